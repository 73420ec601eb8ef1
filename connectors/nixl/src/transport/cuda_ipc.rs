//! Backend `cuda_ipc`: device KV regions on one host.
//!
//! The producer exports a CUDA IPC handle of each registered device region and publishes
//! them in its handshake metadata. The consumer opens a peer's handles once (lazy peer
//! access, so it also works across GPUs of one host) and, per request, launches ONE gather
//! kernel per KV cache group over every layer and K/V part with source and destination
//! block-index arrays (with HMA off there is one group, so one launch per request); when the
//! two layouts order heads and tokens differently (NHD vs HND) the permute is fused into that
//! copy. When the pull thread is idle and the peer's regions are open, `start_load_kv`
//! launches that gather itself (about 40 µs on the step's thread on an H100, no wait), so the
//! copy starts without waiting for the pull thread to wake; what every load from a producer's
//! handshake shares is planned once (`launch_plan.rs`). The pull thread sends the puller's
//! `pin` as the copy starts and reads its answer while the GPU copies, then waits for a CUDA
//! event recorded after the launches (the step loop never waits on it); then the puller
//! sends `done` ([`super::Pin::Overlapped`]). The
//! kernel is compiled when the worker starts (once per process and GPU architecture, then
//! cached), not at the first request.
//!
//! Two GPUs of one host: the producer names its GPU by PCI bus id, which the consumer looks
//! up among the GPUs it sees. When its own GPU can access the producer's (peer access over
//! NVLink or PCIe), the kernel reads the peer's memory directly; when it cannot, the copy
//! goes through pinned host memory (`kvconnect_cuda::StagedCopy`: the producer's GPU gathers
//! into it, this GPU gathers out of it). `cuda_ipc_path` forces either; the choice and its
//! reason are logged once per producer.
//!
//! Per-layer layouts (`[L][KV][B]..`): the K part of layer l starts at its region's address,
//! the V part `num_blocks * block_bytes` later, and blocks are contiguous, so each (layer,
//! part) is one base address of the gather. Cross-layer layouts (`[B][L][KV]..`) are copied
//! as whole cross-layer blocks, one base per region, and need equal layouts on both sides.

pub mod exports;
#[cfg(feature = "cuda")]
pub mod gather;
#[cfg(feature = "cuda")]
pub mod launch_plan;

use super::BackendInfo;
use crate::config::NAME;
use kvconnect_api::{ConnectorError, MemoryKind};

/// Its entry in [`super::BACKENDS`].
pub static BACKEND: BackendInfo = BackendInfo {
    name: "cuda_ipc",
    aliases: &["cuda-ipc"],
    offer: "\"cuda_ipc\" (same host, GPU KV)",
    across_tp: false,
    carries_state: false,
    // It opens and copies GPU regions (creating it needs the `cuda` feature).
    memory_kinds: &[MemoryKind::Device],
    serves_reads: false,
    shm_regions: false,
    available,
    start,
};

fn available() -> Result<(), ConnectorError> {
    if cfg!(feature = "cuda") {
        return Ok(());
    }
    Err(ConnectorError::config(
        NAME,
        "backend 'cuda_ipc' needs GPU support, which this build lacks: rebuild with `--features cuda` \
            (kvconnect-host/cuda), or use backend \"shm\" or \"tcp\" with kv_buffer_device=\"cpu\"",
    ))
}

#[cfg(not(feature = "cuda"))]
fn start(_: &super::Setup<'_>) -> kvconnect_api::ConnectorResult<super::Started> {
    Err(ConnectorError::config(NAME, "backend 'cuda_ipc' needs a build with `--features cuda`"))
}

#[cfg(feature = "cuda")]
pub use gpu::CudaIpc;

#[cfg(feature = "cuda")]
use gpu::start;

#[cfg(feature = "cuda")]
mod gpu {
    use super::super::{
        Backend, Confirm, NoPin, Pin, PullSteps, Setup, Started, Streams, Transport, WhileCopying,
    };
    use super::exports::Exports;
    use super::gather::{export, open_gpu, CudaIpcPull};
    use super::BACKEND;
    use crate::config::NAME;
    use crate::copy_plan::CopyPlan;
    use crate::error::TransferError;
    use crate::metadata::{CudaIpcMetadata, LoadSpec, PeerInfo, PeerKey, ProducerMetadata};
    use crate::puller::PullStats;
    use kvconnect_api::kv_memory::KvMemory;
    use kvconnect_api::{ConnectorError, ConnectorResult, LayerId};
    use std::sync::{Arc, Mutex};

    /// Device regions on one GPU: a producer exports their handles now, a consumer compiles
    /// its gather kernel now (so the first request does not wait for it, and a GPU that
    /// cannot run it fails registration).
    pub(super) fn start(s: &Setup<'_>) -> ConnectorResult<Started> {
        let gpu = open_gpu(s.regions).map_err(|e| ConnectorError::invalid(NAME, e.to_string()))?;
        // This crate never dereferences device regions on the host; the GPU copies them.
        let mem = KvMemory::geometry_only(s.regions, &s.ctx.model, &s.ctx.effective)
            .map_err(|e| ConnectorError::invalid(NAME, format!("cannot register KV regions: {e}")))?;
        let exported = match s.producer {
            true => Some(export(&gpu, s.regions).map_err(|e| ConnectorError::io(NAME, e.to_string()))?),
            false => None,
        };
        let pull = match s.consumer {
            true => Some(Mutex::new(CudaIpcPull::new(gpu.clone(), s.regions, s.cfg.cuda_ipc_path).map_err(
                |e| ConnectorError::invalid(NAME, format!("backend cuda_ipc cannot start: {e}")),
            )?)),
            false => None,
        };
        Ok(Started { mem, transport: Arc::new(CudaIpc { pull, exported, _gpu: gpu }) })
    }

    /// The started backend.
    pub struct CudaIpc {
        /// Consumer: the opened peers and the kernel (used by the pull thread alone).
        pull: Option<Mutex<CudaIpcPull>>,
        /// Producer: the handles published, and their record for consumers in this process
        /// (dropped with this backend, before the regions go).
        exported: Option<(CudaIpcMetadata, Exports)>,
        _gpu: Arc<kvconnect_cuda::Gpu>,
    }

    impl Transport for CudaIpc {
        fn backend(&self) -> Backend {
            Backend::of(&BACKEND)
        }

        fn publish(&self, meta: &mut ProducerMetadata) -> ConnectorResult<()> {
            meta.cuda_ipc = self.exported.as_ref().map(|(m, _)| m.clone());
            Ok(())
        }

        /// The puller pins the blocks as the copy starts (as for shm); the gather checks the
        /// load itself, so the puller plans nothing.
        fn steps(&self) -> PullSteps {
            PullSteps { plan: false, before: Pin::Overlapped, after: Confirm::Release }
        }

        /// Copies the blocks with one gather launch per KV cache group.
        fn copy(
            &self,
            _: Option<&mut Streams<'_>>,
            local: &KvMemory,
            groups: &[Vec<LayerId>],
            peer: &PeerInfo,
            load: &LoadSpec,
            _: Option<&CopyPlan>,
        ) -> Result<PullStats, TransferError> {
            self.copy_overlapped(local, groups, peer, load, None, &mut NoPin)
        }

        /// Sends the pin once the gather is launched and reads its answer while the GPU
        /// copies; then waits for the copy.
        fn copy_overlapped(
            &self,
            local: &KvMemory,
            groups: &[Vec<LayerId>],
            peer: &PeerInfo,
            load: &LoadSpec,
            _: Option<&CopyPlan>,
            pin: &mut dyn WhileCopying,
        ) -> Result<PullStats, TransferError> {
            let pull = self.pull.as_ref().ok_or_else(|| {
                TransferError::Plan(
                    "backend cuda_ipc: this worker is not a consumer (kv_role), so it has no GPU side to \
                        copy with"
                        .into(),
                )
            })?;
            let mut pull = pull.lock().unwrap_or_else(|p| p.into_inner());
            let (bytes, adapted) = pull.pull(local.geometry(), groups, peer, load, pin)?;
            Ok(PullStats { bytes, runs: groups.len(), adapted })
        }

        /// Launches the gather on the calling thread when the consumer's GPU side is free (the
        /// pull thread is not copying) and the peer's regions are open.
        fn launch(
            &self,
            local: &KvMemory,
            groups: &[Vec<LayerId>],
            peer: &PeerInfo,
            load: &LoadSpec,
        ) -> Result<bool, TransferError> {
            let Some(pull) = &self.pull else { return Ok(false) };
            // Never waits: a pull thread that is copying holds the lock.
            let Ok(mut pull) = pull.try_lock() else { return Ok(false) };
            pull.launch(local.geometry(), groups, peer, load)
        }

        fn settle_launched(&self) {
            if let Some(p) = &self.pull {
                p.lock().unwrap_or_else(|p| p.into_inner()).settle();
            }
        }

        fn forget(&self, key: &PeerKey) {
            if let Some(p) = &self.pull {
                p.lock().unwrap_or_else(|p| p.into_inner()).forget(key);
            }
        }
    }
}
