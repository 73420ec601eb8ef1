//! KV regions in GPU memory (`kv_buffer_device = "cuda"`, effective memory = device).
//!
//! The reference engine computes on the CPU, so it keeps its working copy of the KV in the
//! host pool; this mirror holds the regions the connectors see, allocated on GPU 0 (or
//! `KVCONNECT_GPU`) with plain `cuMemAlloc` (exportable over CUDA IPC) and registered as
//! `MemoryKind::Device`. Around each step the touched blocks move: every block the engine
//! writes goes up right after its layer is computed (before `save_kv_layer`), and when a
//! connector reports loads finished the regions come down before the next step reads them.
//! That is correctness, not speed: this path is the ground truth for device-KV transports.
//!
//! Why whole regions come down safely: the device copy always holds everything the engine
//! wrote (uploads follow every write), so a download only adds what connectors wrote; bytes
//! of a load still in flight may arrive half-written, but the engine reads those blocks only
//! after that load is reported finished, which triggers another download. Uploads are limited
//! to the blocks the engine wrote, so they never overwrite a block a connector is loading.
//!
//! Built without the `cuda` feature, asking for device KV is an error saying how to rebuild.

#![allow(unsafe_code)] // Vouches for device-mirrored KV regions and stages them through host memory.

use crate::error::EngineError;
use crate::pool::KvPool;
use kvconnect_api::{BlockId, KvRegion, LayerId};

/// The environment variable that picks the GPU (ordinal, default 0).
pub const GPU_ENV: &str = "KVCONNECT_GPU";

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use kvconnect_api::{KvRegionSpec, MemoryKind};
    use kvconnect_cuda::{DeviceBuffer, Gpu};

    fn dev_err(what: &str, e: impl std::fmt::Display) -> EngineError {
        EngineError::Device(format!("{what}: {e}"))
    }

    /// The device copy of a pool's regions.
    pub struct DeviceMirror {
        gpu: Gpu,
        bufs: Vec<DeviceBuffer>,
        regions: Vec<KvRegion>,
    }

    impl std::fmt::Debug for DeviceMirror {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("DeviceMirror")
                .field("gpu", &self.gpu.ordinal())
                .field("regions", &self.bufs.len())
                .finish()
        }
    }

    impl DeviceMirror {
        /// Allocates one device region per pool region, zeroed like the pool.
        pub fn new(pool: &KvPool) -> Result<DeviceMirror, EngineError> {
            let ordinal = match std::env::var(GPU_ENV) {
                Ok(s) => s.trim().parse::<usize>().map_err(|_| {
                    EngineError::Device(format!("{GPU_ENV}='{s}' is not a GPU ordinal (0, 1, ...)"))
                })?,
                Err(_) => 0,
            };
            let gpu = Gpu::open(ordinal)
                .map_err(|e| dev_err("opening the GPU for kv_buffer_device=\"cuda\"", e))?;
            let mut bufs = Vec::with_capacity(pool.regions().len());
            let mut regions = Vec::with_capacity(pool.regions().len());
            for r in pool.regions() {
                let buf =
                    gpu.alloc(r.len() as usize).map_err(|e| dev_err(&format!("region '{}'", r.name()), e))?;
                gpu.memset_async(buf.ptr(), 0, buf.len()).map_err(|e| dev_err("zeroing", e))?;
                let spec = KvRegionSpec {
                    addr: buf.ptr(),
                    memory: MemoryKind::Device,
                    device: ordinal as i32,
                    shm_name: None,
                    ..r.spec().clone()
                };
                // SAFETY: the region is `buf`, a live allocation of `r.len()` bytes on GPU
                // `ordinal`, which the mirror keeps until it is dropped; the engine drops its
                // connector, the only other holder of the regions, before the mirror.
                regions.push(unsafe { KvRegion::new(spec) });
                bufs.push(buf);
            }
            gpu.synchronize().map_err(|e| dev_err("zeroing", e))?;
            Ok(DeviceMirror { gpu, bufs, regions })
        }

        /// The device regions (what `register_kv_caches` receives).
        pub fn regions(&self) -> &[KvRegion] {
            &self.regions
        }

        /// Copies the engine's bytes of `blocks` of `layer` (every K/V part) up.
        pub fn upload_blocks(
            &self,
            pool: &KvPool,
            layer: LayerId,
            blocks: &[BlockId],
        ) -> Result<(), EngineError> {
            let mem = pool.memory();
            for &b in blocks {
                for part in 0..pool.shape().kv_parts {
                    let span = mem.span(layer, part, b).map_err(|e| EngineError::Access(e.to_string()))?;
                    let bytes = mem.slice(span).map_err(|e| EngineError::Access(e.to_string()))?;
                    let buf = self
                        .bufs
                        .get(span.region)
                        .ok_or_else(|| EngineError::Access(format!("no device region {}", span.region)))?;
                    self.gpu
                        .upload(buf.ptr() + span.offset as u64, bytes)
                        .map_err(|e| dev_err("upload", e))?;
                }
            }
            Ok(())
        }

        /// Copies every region down into the engine's working copy.
        pub fn download_all(&self, pool: &KvPool) -> Result<(), EngineError> {
            for (i, buf) in self.bufs.iter().enumerate() {
                let (base, len) = pool
                    .memory()
                    .region_base(i)
                    .ok_or_else(|| EngineError::Access(format!("no host region {i}")))?;
                let len = len.min(buf.len());
                // SAFETY: `base..base+len` is the pool's own host region, alive as long as the
                // pool; no connector sees it (they see the device regions) and the engine is
                // between steps, so nothing else reads or writes it during the copy.
                let host = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, len) };
                self.gpu.download(host, buf.ptr()).map_err(|e| dev_err("download", e))?;
            }
            Ok(())
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    /// The device copy of a pool's regions; this build has no GPU support, so none exists.
    #[derive(Debug)]
    pub enum DeviceMirror {}

    impl DeviceMirror {
        /// Always an error: this build has no GPU support.
        pub fn new(_pool: &KvPool) -> Result<DeviceMirror, EngineError> {
            Err(EngineError::Device(
                "kv_buffer_device=\"cuda\" asks for KV regions in GPU memory, but this kvconnect was built \
                    without GPU support: rebuild with `cargo build --release -p kvconnect-host --features \
                    cuda`, or use kv_buffer_device=\"cpu\""
                    .into(),
            ))
        }

        /// Never called (no value exists).
        pub fn regions(&self) -> &[KvRegion] {
            match *self {}
        }

        /// Never called (no value exists).
        pub fn upload_blocks(&self, _: &KvPool, _: LayerId, _: &[BlockId]) -> Result<(), EngineError> {
            match *self {}
        }

        /// Never called (no value exists).
        pub fn download_all(&self, _: &KvPool) -> Result<(), EngineError> {
            match *self {}
        }
    }
}

pub use imp::DeviceMirror;

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use crate::{local_effective_layout, Engine, EngineConfig, ReferenceConfig};
    use kvconnect_api::{Dtype, FailurePolicy, KvLayout, MemoryKind};

    #[test]
    fn device_kv_without_cuda_says_how_to_rebuild() {
        let model = ReferenceConfig::builtin().unwrap();
        let spec = model.model_spec().unwrap();
        let mut effective = local_effective_layout(&spec, KvLayout::HND, true, 16, Dtype::Bf16);
        effective.memory = MemoryKind::Device;
        let cfg = EngineConfig { effective, model, num_blocks: 8, seed: 1, shm: None, tp_size: 1 };
        let e = Engine::new(cfg, None, FailurePolicy::Fail).unwrap_err().to_string();
        assert!(e.contains("--features cuda") && e.contains("kv_buffer_device"), "{e}");
    }
}
