//! The host-staged path between two GPUs whose kernels cannot read each other's memory
//! (no peer access: no NVLink and no PCIe peer-to-peer between them).
//!
//! A request's gather is cut into chunks of whole blocks. For each chunk the source GPU's
//! gather kernel packs the blocks of every region into a device scratch buffer, a copy
//! engine moves it into pinned host memory, the destination GPU's copy engine moves it into
//! its own scratch, and its gather kernel puts the blocks in place (with the layout permute,
//! if any, fused in). The four steps run on four streams (pack, download, upload, unpack),
//! ordered by events only, over several buffer sets: the pack of the next chunk and the
//! unpack of the previous one run while the copy engines move this one, the download of one
//! chunk overlaps the upload of the one before, and the host never waits in between. So the
//! copy engines do not stand idle behind a kernel (with one stream per GPU they did: 0.83 of
//! the baseline against 0.87-0.88 on one H100), and the path runs at the speed of the slower PCIe
//! direction, or of the link both ways at once where both ends are one GPU.
//! The source regions are addresses in the source GPU's context (a peer's IPC handles opened
//! there), the destination regions addresses in the destination GPU's.

#![allow(unsafe_code)] // CUDA bindings: driver calls and device memory.

use crate::device::{DeviceBuffer, Gpu, PinnedBuffer};
use crate::error::CudaError;
use crate::kernel::{GatherKernel, GatherSpec, Permute};
use cudarc::driver::{sys, CudaEvent, CudaStream};
use std::sync::Arc;

/// Default size of each staging buffer. Measured on two H200s (8192 tokens of Qwen3-0.6B,
/// 896 MiB, one stream per GPU): 4/8/16/32/64/128 MiB gave 0.79/0.87/0.91/0.90/0.85/0.75 of
/// the baseline across GPUs — small chunks lose to per-chunk overhead, large ones to the
/// first download and last upload that overlap nothing.
pub const DEFAULT_CHUNK_BYTES: usize = 16 << 20;

/// Default number of buffer sets in flight. Measured on one H100 (both ends one GPU, copy
/// streams, 16 MiB chunks): 2, 3 and 4 sets gave 0.875, 0.883 and 0.882 of the baseline, so
/// the fewest, as the packs and unpacks are short beside the copies.
pub const DEFAULT_BUFFERS: usize = 2;

/// How a staged path is built; [`StagedConfig::default`] is what backend cuda_ipc uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedConfig {
    /// Bytes of each staging buffer (grown when one block of every region is larger).
    pub chunk_bytes: usize,
    /// Buffer sets in flight (at least 2).
    pub buffers: usize,
    /// Downloads and uploads on streams of their own (the default). Without, each GPU runs
    /// its kernels and its copies on one stream, so a copy engine waits for every pack or
    /// unpack between two chunks (kept to measure what the streams bring).
    pub copy_streams: bool,
}

impl Default for StagedConfig {
    fn default() -> Self {
        StagedConfig { chunk_bytes: DEFAULT_CHUNK_BYTES, buffers: DEFAULT_BUFFERS, copy_streams: true }
    }
}

struct Stage {
    pinned: PinnedBuffer,
    /// Packed chunk on the source GPU and its copy on the destination GPU.
    src_scratch: DeviceBuffer,
    dst_scratch: DeviceBuffer,
    /// Recorded on the source's pack stream when the chunk is packed.
    packed: CudaEvent,
    /// Recorded on the download stream when the chunk is in pinned memory (so the source
    /// scratch is free again).
    filled: CudaEvent,
    /// Recorded on the upload stream when the chunk has left pinned memory.
    drained: CudaEvent,
    /// Recorded on the destination's stream when the chunk is unpacked (so the destination
    /// scratch is free again).
    unpacked: CudaEvent,
    used: bool,
}

/// Copies gathers from one GPU to another through pinned host memory.
pub struct StagedCopy {
    src: Arc<Gpu>,
    src_kernel: GatherKernel,
    /// The source GPU's stream for downloads (its pack stream without `copy_streams`).
    down: Arc<CudaStream>,
    /// The destination GPU's stream for uploads (its own stream without `copy_streams`).
    up: Arc<CudaStream>,
    /// The destination's own stream, where the unpacks run (the caller waits on it).
    unpack: Arc<CudaStream>,
    chunk_bytes: usize,
    buffers: usize,
    stages: Vec<Stage>,
}

impl StagedCopy {
    /// A staged path from `src` (the GPU that holds the source regions) to `dst`, with
    /// `chunk_bytes` buffers and the other settings' defaults. Compiles the gather kernel for
    /// the source GPU.
    pub fn new(src: Arc<Gpu>, dst: &Gpu, chunk_bytes: usize) -> Result<StagedCopy, CudaError> {
        Self::configured(src, dst, StagedConfig { chunk_bytes, ..StagedConfig::default() })
    }

    /// The same with every setting given.
    pub fn configured(src: Arc<Gpu>, dst: &Gpu, config: StagedConfig) -> Result<StagedCopy, CudaError> {
        let src_kernel = GatherKernel::new(&src)?;
        let (down, up) = if config.copy_streams {
            let stream =
                |gpu: &Gpu| gpu.context().new_stream().map_err(|e| CudaError::driver("cuStreamCreate", e));
            (stream(&src)?, stream(dst)?)
        } else {
            (src.stream().clone(), dst.stream().clone())
        };
        let mut s = StagedCopy {
            src,
            src_kernel,
            down,
            up,
            unpack: dst.stream().clone(),
            chunk_bytes: 0,
            buffers: config.buffers.max(2),
            stages: Vec::new(),
        };
        s.grow(dst, config.chunk_bytes.max(16))?;
        Ok(s)
    }

    /// The source GPU.
    pub fn source(&self) -> &Arc<Gpu> {
        &self.src
    }

    /// Waits for everything this path queued, on every stream.
    fn drain(&self) -> Result<(), CudaError> {
        let sync = |s: &CudaStream| s.synchronize().map_err(|e| CudaError::driver("cuStreamSynchronize", e));
        sync(&self.unpack)?;
        sync(&self.up)?;
        sync(&self.down)?;
        self.src.synchronize()
    }

    fn grow(&mut self, dst: &Gpu, bytes: usize) -> Result<(), CudaError> {
        // Buffers still in use by an earlier copy must be drained before they are freed.
        self.drain()?;
        self.stages.clear();
        for _ in 0..self.buffers {
            self.stages.push(Stage {
                pinned: self.src.alloc_pinned(bytes)?,
                src_scratch: self.src.alloc(bytes)?,
                dst_scratch: dst.alloc(bytes)?,
                packed: self.src.event()?,
                filled: self.src.event()?,
                drained: dst.event()?,
                unpacked: dst.event()?,
                used: false,
            });
        }
        self.chunk_bytes = bytes;
        Ok(())
    }

    /// Enqueues `spec` (sources on the source GPU, destinations on `dst`) chunk by chunk;
    /// returns when the last chunk is enqueued. Synchronise `dst` to wait for the whole copy
    /// (its last unpack comes after every other step). On an error nothing is left queued
    /// (every stream is waited for).
    pub fn copy(
        &mut self,
        dst: &Gpu,
        dst_kernel: &mut GatherKernel,
        spec: &GatherSpec<'_>,
    ) -> Result<(), CudaError> {
        let r = self.enqueue(dst, dst_kernel, spec);
        if r.is_err() {
            let _ = self.drain();
        }
        r
    }

    fn enqueue(
        &mut self,
        dst: &Gpu,
        dst_kernel: &mut GatherKernel,
        spec: &GatherSpec<'_>,
    ) -> Result<(), CudaError> {
        spec.check()?;
        if !Arc::ptr_eq(dst.stream(), &self.unpack) {
            return Err(CudaError::Invalid(format!(
                "this staged path was built for another handle of GPU {}, not this one of GPU {}: pass \
                    the same Gpu on every copy",
                self.unpack.context().ordinal(),
                dst.ordinal()
            )));
        }
        let units = spec.src_bases.len();
        let n = spec.src_blocks.len();
        if units == 0 || n == 0 {
            return Ok(());
        }
        let bb = spec.block_bytes;
        let per_block = units as u64 * bb;
        if per_block > self.chunk_bytes as u64 {
            let want = usize::try_from(per_block).map_err(|_| {
                CudaError::Invalid(format!("{per_block} bytes per block index do not fit in memory"))
            })?;
            self.grow(dst, want)?;
        }
        let k = (self.chunk_bytes as u64 / per_block).max(1) as usize;
        let seq: Vec<u32> = (0..k.min(n) as u32).collect();
        // Unit u of a packed chunk starts at u * k blocks in the scratch buffers.
        let packed =
            |base: u64| -> Vec<u64> { (0..units as u64).map(|u| base + u * k as u64 * bb).collect() };
        let src_packed: Vec<Vec<u64>> = self.stages.iter().map(|s| packed(s.src_scratch.ptr())).collect();
        let dst_packed: Vec<Vec<u64>> = self.stages.iter().map(|s| packed(s.dst_scratch.ptr())).collect();
        let chunks: Vec<(usize, usize)> = (0..n).step_by(k).map(|a| (a, (a + k).min(n))).collect();
        let pack: Vec<GatherSpec<'_>> = chunks
            .iter()
            .enumerate()
            .map(|(i, &(a, b))| GatherSpec {
                src_bases: spec.src_bases,
                dst_bases: &src_packed[i % src_packed.len()],
                src_blocks: &spec.src_blocks[a..b],
                dst_blocks: &seq[..b - a],
                block_bytes: bb,
                permute: Permute::None,
            })
            .collect();
        let unpack: Vec<GatherSpec<'_>> = chunks
            .iter()
            .enumerate()
            .map(|(i, &(a, b))| GatherSpec {
                src_bases: &dst_packed[i % dst_packed.len()],
                dst_bases: spec.dst_bases,
                src_blocks: &seq[..b - a],
                dst_blocks: &spec.dst_blocks[a..b],
                block_bytes: bb,
                permute: spec.permute,
            })
            .collect();
        let pack = self.src_kernel.prepare(&self.src, &pack)?;
        let unpack = dst_kernel.prepare(dst, &unpack)?;
        let wait = |stream: &CudaStream, event: &CudaEvent| {
            stream.wait(event).map_err(|e| CudaError::driver("cuStreamWaitEvent", e))
        };
        let record = |event: &CudaEvent, stream: &Arc<CudaStream>| {
            event.record(stream).map_err(|e| CudaError::driver("cuEventRecord", e))
        };
        for (i, &(a, b)) in chunks.iter().enumerate() {
            // The packed bytes of this chunk: the last unit ends after its (b - a) blocks.
            let bytes = ((units as u64 - 1) * k as u64 + (b - a) as u64) * bb;
            let nstages = self.stages.len();
            let s = &mut self.stages[i % nstages];
            // Pack, once the source scratch's previous chunk is downloaded.
            if s.used {
                wait(self.src.stream(), &s.filled)?;
            }
            self.src_kernel.launch_prepared(&self.src, &pack, i)?;
            record(&s.packed, self.src.stream())?;
            // Download, once packed and once the pinned buffer's previous chunk is uploaded.
            wait(&self.down, &s.packed)?;
            if s.used {
                wait(&self.down, &s.drained)?;
            }
            self.src.bind()?;
            // SAFETY: the pinned buffer and the scratch hold chunk_bytes >= `bytes`; both live
            // in `self` until the copy is synchronised (grow and drop wait for every stream
            // first).
            let r = unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    s.pinned.host_ptr() as *mut std::ffi::c_void,
                    s.src_scratch.ptr(),
                    bytes as usize,
                    self.down.cu_stream(),
                )
            };
            check(r, "cuMemcpyDtoHAsync")?;
            record(&s.filled, &self.down)?;
            // Upload, once downloaded and once the destination scratch's previous chunk is
            // unpacked.
            wait(&self.up, &s.filled)?;
            if s.used {
                wait(&self.up, &s.unpacked)?;
            }
            dst.bind()?;
            // SAFETY: as above, on the destination GPU.
            let r = unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    s.dst_scratch.ptr(),
                    s.pinned.host_ptr() as *const std::ffi::c_void,
                    bytes as usize,
                    self.up.cu_stream(),
                )
            };
            check(r, "cuMemcpyHtoDAsync")?;
            record(&s.drained, &self.up)?;
            // Unpack on the destination's stream, once uploaded.
            wait(dst.stream(), &s.drained)?;
            dst_kernel.launch_prepared(dst, &unpack, i)?;
            record(&s.unpacked, dst.stream())?;
            s.used = true;
        }
        Ok(())
    }
}

impl Drop for StagedCopy {
    fn drop(&mut self) {
        // Work still queued may use the buffers freed with `stages`.
        let _ = self.drain();
    }
}

fn check(r: sys::CUresult, call: &'static str) -> Result<(), CudaError> {
    if r == sys::cudaError_enum::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::driver(call, cudarc::driver::DriverError(r)))
    }
}
