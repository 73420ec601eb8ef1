//! KV caches in GPU memory.
//!
//! This crate owns everything that talks to the CUDA driver: finding the driver and NVRTC
//! before the first call (cudarc's dynamic loading panics when a library is missing, so the
//! check comes first and its absence is an ordinary error), device regions allocated with
//! plain `cuMemAlloc` so they can be exported over CUDA IPC, the one gather kernel that
//! copies a request's blocks of every layer and region in a single launch (with an
//! NHD↔HND permute fused into the copy), and pinned host buffers for staging.
//!
//! It must not know about connectors, requests or sockets: callers pass base addresses and
//! block-index arrays. It is compiled in CI (no GPU needed to build it); its GPU tests are
//! behind the `cuda` feature and run on a machine with a GPU. Its benchmark
//! (`kvconnect bench transfer --backend cuda_ipc`) lives in `kvconnect-bench`.

pub mod device;
pub mod error;
pub mod ipc;
pub mod kernel;
pub mod kv_stage;
pub mod kv_units;
pub mod staged;
pub mod testing;

/// A CUDA event (what `Gpu::event` and `Gpu::completion_event` return).
pub use cudarc::driver::CudaEvent;
pub use device::{DeviceBuffer, Gpu, PinnedBuffer};
pub use error::CudaError;
pub use ipc::{ImportedRegion, IpcHandle};
pub use kernel::{GatherKernel, GatherSpec, Permute};
pub use kv_stage::{HostCopy, KvStage, StageError};
pub use staged::{StagedConfig, StagedCopy};
