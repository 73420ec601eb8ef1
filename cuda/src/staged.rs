//! The host-staged path between two GPUs whose kernels cannot read each other's memory
//! (no peer access: no NVLink and no PCIe peer-to-peer between them).
//!
//! A request's gather is cut into chunks of whole blocks. For each chunk the source GPU's
//! gather kernel packs the blocks of every region into a device scratch buffer, a copy
//! engine moves it into pinned host memory, the destination GPU's copy engine moves it into
//! its own scratch, and its gather kernel puts the blocks in place (with the layout permute,
//! if any, fused in). Two sets of buffers alternate and the two GPUs are ordered by events
//! only, so the download of one chunk overlaps the upload of the previous one and the host
//! never waits in between: the path runs at the speed of the slower PCIe direction. The
//! source regions are addresses in the source GPU's context (a peer's IPC handles opened
//! there), the destination regions addresses in the destination GPU's.

#![allow(unsafe_code)] // CUDA bindings: driver calls and device memory.

use crate::device::{DeviceBuffer, Gpu, PinnedBuffer};
use crate::error::CudaError;
use crate::kernel::{GatherKernel, GatherSpec, Permute};
use cudarc::driver::{sys, CudaEvent};
use std::sync::Arc;

/// Default size of each staging buffer. Measured on two H200s (8192 tokens of Qwen3-0.6B,
/// 896 MiB): 4/8/16/32/64/128 MiB gave 0.79/0.87/0.91/0.90/0.85/0.75 of the baseline across
/// GPUs — small chunks lose to per-chunk overhead, large ones to the first download and last
/// upload that overlap nothing. More than two buffer sets changed nothing.
pub const DEFAULT_CHUNK_BYTES: usize = 16 << 20;

/// Default number of buffer sets in flight.
pub const DEFAULT_BUFFERS: usize = 2;

struct Stage {
    pinned: PinnedBuffer,
    /// Packed chunk on the source GPU and its copy on the destination GPU.
    src_scratch: DeviceBuffer,
    dst_scratch: DeviceBuffer,
    /// Recorded on the source stream when the chunk is in pinned memory.
    filled: CudaEvent,
    /// Recorded on the destination stream when the chunk has left pinned memory.
    drained: CudaEvent,
    used: bool,
}

/// Copies gathers from one GPU to another through pinned host memory.
pub struct StagedCopy {
    src: Arc<Gpu>,
    src_kernel: GatherKernel,
    dst_ordinal: usize,
    chunk_bytes: usize,
    buffers: usize,
    stages: Vec<Stage>,
}

impl StagedCopy {
    /// A staged path from `src` (the GPU that holds the source regions) to `dst`, with two
    /// sets of `chunk_bytes` buffers (grown when one block of every region is larger).
    /// Compiles the gather kernel for the source GPU.
    pub fn new(src: Arc<Gpu>, dst: &Gpu, chunk_bytes: usize) -> Result<StagedCopy, CudaError> {
        Self::with_buffers(src, dst, chunk_bytes, DEFAULT_BUFFERS)
    }

    /// The same with `buffers` (at least 2) buffer sets in flight.
    pub fn with_buffers(
        src: Arc<Gpu>,
        dst: &Gpu,
        chunk_bytes: usize,
        buffers: usize,
    ) -> Result<StagedCopy, CudaError> {
        let src_kernel = GatherKernel::new(&src)?;
        let mut s = StagedCopy {
            src,
            src_kernel,
            dst_ordinal: dst.ordinal(),
            chunk_bytes: 0,
            buffers: buffers.max(2),
            stages: Vec::new(),
        };
        s.grow(dst, chunk_bytes.max(16))?;
        Ok(s)
    }

    /// The source GPU.
    pub fn source(&self) -> &Arc<Gpu> {
        &self.src
    }

    fn grow(&mut self, dst: &Gpu, bytes: usize) -> Result<(), CudaError> {
        // Buffers still in use by an earlier copy must be drained before they are freed.
        dst.synchronize()?;
        self.src.synchronize()?;
        self.stages.clear();
        for _ in 0..self.buffers {
            self.stages.push(Stage {
                pinned: self.src.alloc_pinned(bytes)?,
                src_scratch: self.src.alloc(bytes)?,
                dst_scratch: dst.alloc(bytes)?,
                filled: self.src.event()?,
                drained: dst.event()?,
                used: false,
            });
        }
        self.chunk_bytes = bytes;
        Ok(())
    }

    /// Enqueues `spec` (sources on the source GPU, destinations on `dst`) chunk by chunk;
    /// returns when the last chunk is enqueued. Synchronise `dst` to wait for the whole copy.
    /// On an error nothing is left queued (both GPUs are waited for).
    pub fn copy(
        &mut self,
        dst: &Gpu,
        dst_kernel: &mut GatherKernel,
        spec: &GatherSpec<'_>,
    ) -> Result<(), CudaError> {
        let r = self.enqueue(dst, dst_kernel, spec);
        if r.is_err() {
            let _ = dst.synchronize();
            let _ = self.src.synchronize();
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
        if dst.ordinal() != self.dst_ordinal {
            return Err(CudaError::Invalid(format!(
                "this staged path was built for GPU {}, not GPU {}",
                self.dst_ordinal,
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
        for (i, &(a, b)) in chunks.iter().enumerate() {
            // The packed bytes of this chunk: the last unit ends after its (b - a) blocks.
            let bytes = ((units as u64 - 1) * k as u64 + (b - a) as u64) * bb;
            let nstages = self.stages.len();
            let s = &mut self.stages[i % nstages];
            self.src_kernel.launch_prepared(&self.src, &pack, i)?;
            if s.used {
                // The destination must have taken this pinned buffer's previous chunk.
                self.src.stream().wait(&s.drained).map_err(|e| CudaError::driver("cuStreamWaitEvent", e))?;
            }
            self.src.bind()?;
            // SAFETY: the pinned buffer and the scratch hold chunk_bytes >= `bytes`; both live
            // in `self` until the copy is synchronised (grow and drop synchronise first).
            let r = unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    s.pinned.host_ptr() as *mut std::ffi::c_void,
                    s.src_scratch.ptr(),
                    bytes as usize,
                    self.src.stream().cu_stream(),
                )
            };
            check(r, "cuMemcpyDtoHAsync")?;
            s.filled.record(self.src.stream()).map_err(|e| CudaError::driver("cuEventRecord", e))?;
            dst.stream().wait(&s.filled).map_err(|e| CudaError::driver("cuStreamWaitEvent", e))?;
            dst.bind()?;
            // SAFETY: as above, on the destination GPU.
            let r = unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    s.dst_scratch.ptr(),
                    s.pinned.host_ptr() as *const std::ffi::c_void,
                    bytes as usize,
                    dst.stream().cu_stream(),
                )
            };
            check(r, "cuMemcpyHtoDAsync")?;
            s.drained.record(dst.stream()).map_err(|e| CudaError::driver("cuEventRecord", e))?;
            s.used = true;
            dst_kernel.launch_prepared(dst, &unpack, i)?;
        }
        Ok(())
    }
}

impl Drop for StagedCopy {
    fn drop(&mut self) {
        // Work still queued may use the buffers freed with `stages`.
        let _ = self.src.synchronize();
    }
}

fn check(r: sys::CUresult, call: &'static str) -> Result<(), CudaError> {
    if r == sys::cudaError_enum::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::driver(call, cudarc::driver::DriverError(r)))
    }
}
