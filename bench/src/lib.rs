//! Benchmarks and probes of kvconnect's transports, and the harness that drives a connector
//! without a host.
//!
//! `kvconnect bench` runs what is here: the bare NIXL baseline of a transfer (`nixl_raw`,
//! feature `nixl`), the NIXL VRAM probe (`nixl_vram`, feature `cuda`) and the two-process
//! CUDA IPC transfer (`cuda_ipc`, feature `cuda`). The connectors' own tests and benchmarks
//! use `harness`; transfers are judged against `memcpy` (the best memcpy of the same bytes)
//! and `raw_socket` (the same bytes over raw loopback streams). None of it belongs in a library
//! that every plugin links, which is why it is not in the connectors or in `kvconnect-cuda`;
//! nothing but the host and tests depends on this crate.

#[cfg(feature = "cuda")]
pub mod cuda_ipc;
pub mod harness;
pub mod memcpy;
#[cfg(feature = "nixl")]
pub mod nixl_raw;
#[cfg(feature = "cuda")]
pub mod nixl_vram;
pub mod raw_socket;
