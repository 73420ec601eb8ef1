//! Pull-mode P/D KV transport: the real NIXL library, plus built-in shm and tcp backends.
//!
//! Prefill (producer) keeps a finished request's blocks (delay-free) and returns transfer
//! params; decode (consumer) pulls those blocks into its own and tells prefill, which then
//! reports the request in `finished_sending` so the host frees them. Blocks whose consumer
//! never comes are freed when their lease (`kv_lease_duration`, renewed by heartbeats and
//! reads) expires.
//!
//! Backends (`transport`: one file each, one registration table, one trait): `shm` (same host;
//! decode maps prefill's shared-memory regions read-only and copies coalesced runs), `tcp` (any two
//! hosts; blocks streamed over prefill's listener). `nixl` (NVIDIA's NIXL library over UCX through
//! `nixl-sys`; any two hosts; decode READs the producer's registered regions and notifies it
//! through NIXL; the library is found at run time, see `nixl_lib`; with feature `cuda`, device KV
//! regions are registered as VRAM and read VRAM to VRAM when both sides' KV is in GPU memory; the
//! probe that checks a NIXL build can is `kvconnect-bench`'s). `cuda_ipc` (feature `cuda`; same
//! host, device KV regions): decode opens prefill's CUDA IPC handles once and copies each request
//! with one gather kernel.
//!
//! The host side: it sets `side_channel_host`/`side_channel_port` and the data-plane secret
//! in `kv_connector_extra_config`, as the capabilities ask (`needs_side_channel`,
//! `needs_data_plane_secret`; the address goes into the transfer params as `remote_host` /
//! `remote_port`), keeps stepping a producer while requests await `finished_sending`, and
//! hands the decode worker its handshake envelope (ARCHITECTURE.md §6) before loading from a
//! peer.
//!
//! This crate must not decide compatibility (the host's handshake does, with
//! `kvconnect_api`); it only refuses a peer whose blocks it cannot address. Every plugin that
//! exports it links it, so benchmarks, probes and test harnesses live in `kvconnect-bench`.

pub mod caps;
pub mod config;
pub mod copy_plan;
pub mod error;
pub mod factory;
pub mod idle_link;
pub mod metadata;
pub mod nixl_agent;
pub mod nixl_lib;
pub mod overlap;
pub mod producer;
pub mod puller;
pub mod scheduler;
pub mod tcp_data;
pub mod transport;
pub mod wire;
pub mod worker;

pub use config::{Backend, NixlConfig};
pub use error::TransferError;
pub use factory::NixlFactory;
pub use metadata::{PeerInfo, ProducerMetadata};
pub use puller::{PullConfig, PullStats, Puller};
pub use scheduler::NixlScheduler;
pub use worker::NixlWorker;
