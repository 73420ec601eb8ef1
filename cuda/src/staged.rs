//! The host-staged path between two GPUs whose kernels cannot read each other's memory
//! (no peer access: no NVLink and no PCIe peer-to-peer between them).
//!
//! A request's gather is cut into chunks of whole blocks. For each chunk the source GPU's
//! gather kernel copies the blocks of every region into a pinned, mapped host buffer, and
//! the destination GPU's kernel copies them from there into their places (with the layout
//! permute, if any, fused into that second copy). Two buffers alternate, ordered by events
//! only (no host waits between the GPUs), so one chunk's download overlaps the previous
//! chunk's upload. The source regions must be addresses in the source GPU's context (a peer's
//! IPC handles opened there), the destination regions addresses in the destination GPU's.

use crate::device::{Gpu, PinnedBuffer};
use crate::error::CudaError;
use crate::kernel::{GatherKernel, GatherSpec, Permute};
use cudarc::driver::CudaEvent;
use std::sync::Arc;

/// Default size of each of the two pinned buffers.
pub const DEFAULT_CHUNK_BYTES: usize = 64 << 20;

struct Stage {
    /// Kept alive while kernels use it through the two addresses below.
    _buf: PinnedBuffer,
    /// The buffer's address for kernels on the source and on the destination GPU.
    src_ptr: u64,
    dst_ptr: u64,
    /// Recorded on the source stream when the chunk is in the buffer.
    filled: CudaEvent,
    /// Recorded on the destination stream when the chunk has left the buffer.
    drained: CudaEvent,
    used: bool,
}

/// Copies gathers from one GPU to another through pinned host memory.
pub struct StagedCopy {
    src: Arc<Gpu>,
    src_kernel: GatherKernel,
    dst_ordinal: usize,
    chunk_bytes: usize,
    stages: Vec<Stage>,
}

impl StagedCopy {
    /// A staged path from `src` (the GPU that holds the source regions) to `dst`, with two
    /// pinned buffers of `chunk_bytes` each (grown when one block of every region is larger).
    /// Compiles the gather kernel for the source GPU.
    pub fn new(src: Arc<Gpu>, dst: &Gpu, chunk_bytes: usize) -> Result<StagedCopy, CudaError> {
        let src_kernel = GatherKernel::new(&src)?;
        let mut s =
            StagedCopy { src, src_kernel, dst_ordinal: dst.ordinal(), chunk_bytes: 0, stages: Vec::new() };
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
        for _ in 0..2 {
            let buf = self.src.alloc_pinned(bytes)?;
            let src_ptr = buf.device_ptr_in(&self.src)?;
            let dst_ptr = buf.device_ptr_in(dst)?;
            self.stages.push(Stage {
                _buf: buf,
                src_ptr,
                dst_ptr,
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
    pub fn copy(
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
        let (mut src_stage, mut dst_stage) = (vec![0u64; units], vec![0u64; units]);
        for (i, start) in (0..n).step_by(k).enumerate() {
            let end = (start + k).min(n);
            let m = end - start;
            let s = &mut self.stages[i % 2];
            for u in 0..units {
                let off = u as u64 * k as u64 * bb;
                src_stage[u] = s.src_ptr + off;
                dst_stage[u] = s.dst_ptr + off;
            }
            if s.used {
                // The destination must have read this buffer's previous chunk.
                self.src.stream().wait(&s.drained).map_err(|e| CudaError::driver("cuStreamWaitEvent", e))?;
            }
            let down = GatherSpec {
                src_bases: spec.src_bases,
                dst_bases: &src_stage,
                src_blocks: &spec.src_blocks[start..end],
                dst_blocks: &seq[..m],
                block_bytes: bb,
                permute: Permute::None,
            };
            self.src_kernel.launch(&self.src, &down)?;
            s.filled.record(self.src.stream()).map_err(|e| CudaError::driver("cuEventRecord", e))?;
            dst.stream().wait(&s.filled).map_err(|e| CudaError::driver("cuStreamWaitEvent", e))?;
            let up = GatherSpec {
                src_bases: &dst_stage,
                dst_bases: spec.dst_bases,
                src_blocks: &seq[..m],
                dst_blocks: &spec.dst_blocks[start..end],
                block_bytes: bb,
                permute: spec.permute,
            };
            dst_kernel.launch(dst, &up)?;
            s.drained.record(dst.stream()).map_err(|e| CudaError::driver("cuEventRecord", e))?;
            s.used = true;
        }
        Ok(())
    }
}
