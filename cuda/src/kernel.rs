//! The one gather kernel: copies a request's blocks of every region in a single launch,
//! optionally permuting NHD↔HND inside each block on the way.
//!
//! One thread block of 512 threads copies one (block, region) pair with 16-byte loads, two in
//! flight per thread. Regions are passed as base addresses (a per-layer K or V region, or a whole
//! cross-layer region), blocks as two index arrays, so one launch covers every layer: per
//! block copies are bound by the host (about 5 µs a call), one launch is not. Up to 128
//! regions and 3,584 blocks the arrays travel in the launch's own parameters (one 30 KiB
//! parameter, sm_70 and later); larger gathers upload them to device memory first.

#![allow(unsafe_code)] // CUDA bindings: driver calls and device memory.

use crate::device::{DeviceBuffer, Gpu, PinnedBuffer};
use crate::error::CudaError;
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use std::ffi::CString;

const SOURCE: &str = r#"
#define KVC_MAX_REGIONS 128
#define KVC_MAX_BLOCKS 3584

// Index arrays passed in the launch itself (a kernel parameter of up to 32 KiB, sm_70+):
// nothing to upload before the kernel runs.
struct kvc_inline_args {
    unsigned long long block_bytes;
    unsigned int n_blocks;
    unsigned int mode;
    unsigned int heads;
    unsigned int tokens;
    unsigned long long src_bases[KVC_MAX_REGIONS];
    unsigned long long dst_bases[KVC_MAX_REGIONS];
    unsigned int src_blocks[KVC_MAX_BLOCKS];
    unsigned int dst_blocks[KVC_MAX_BLOCKS];
};

__device__ __forceinline__ void kvc_copy_block(
    const uint4* __restrict__ src,
    uint4* __restrict__ dst,
    unsigned long long block_bytes,
    unsigned int mode,
    unsigned int heads,
    unsigned int tokens)
{
    const unsigned int n16 = (unsigned int)(block_bytes >> 4);
    const unsigned int step = blockDim.x;
    if (mode == 0) {
        unsigned int i = threadIdx.x;
        for (; i + step < n16; i += 2 * step) {
            uint4 a0 = src[i];
            uint4 a1 = src[i + step];
            dst[i] = a0;
            dst[i + step] = a1;
        }
        for (; i < n16; i += step) dst[i] = src[i];
    } else {
        const unsigned int row16 = n16 / (heads * tokens);
        for (unsigned int i = threadIdx.x; i < n16; i += step) {
            const unsigned int d = i / row16;
            const unsigned int c = i - d * row16;
            unsigned int s;
            if (mode == 1) {
                // source token-major (row n*H+h), destination head-major (row h*N+n)
                const unsigned int h = d / tokens;
                const unsigned int n = d - h * tokens;
                s = n * heads + h;
            } else {
                // source head-major, destination token-major (row n*H+h)
                const unsigned int n = d / heads;
                const unsigned int h = d - n * heads;
                s = h * tokens + n;
            }
            dst[i] = src[s * row16 + c];
        }
    }
}

extern "C" __global__ void kvc_gather(
    const unsigned long long* __restrict__ src_bases,
    const unsigned long long* __restrict__ dst_bases,
    const unsigned int* __restrict__ src_blocks,
    const unsigned int* __restrict__ dst_blocks,
    unsigned int n_blocks,
    unsigned long long block_bytes,
    unsigned int mode,
    unsigned int heads,
    unsigned int tokens)
{
    const unsigned int b = blockIdx.x % n_blocks;
    const unsigned int r = blockIdx.x / n_blocks;
    const uint4* src = (const uint4*)(src_bases[r] + (unsigned long long)src_blocks[b] * block_bytes);
    uint4* dst = (uint4*)(dst_bases[r] + (unsigned long long)dst_blocks[b] * block_bytes);
    kvc_copy_block(src, dst, block_bytes, mode, heads, tokens);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
extern "C" __global__ void kvc_gather_inline(const __grid_constant__ kvc_inline_args a)
{
    const unsigned int b = blockIdx.x % a.n_blocks;
    const unsigned int r = blockIdx.x / a.n_blocks;
    const uint4* src = (const uint4*)(a.src_bases[r] + (unsigned long long)a.src_blocks[b] * a.block_bytes);
    uint4* dst = (uint4*)(a.dst_bases[r] + (unsigned long long)a.dst_blocks[b] * a.block_bytes);
    kvc_copy_block(src, dst, a.block_bytes, a.mode, a.heads, a.tokens);
}
#endif

"#;

/// Threads per thread block. With 512 threads holding two 16-byte loads each, a 32 KiB block
/// is two passes, and more thread blocks are resident per SM than with 256 threads holding
/// four: measured on an H200, scattered 32 KiB blocks, 0.953x a contiguous device copy
/// against 0.926x (BENCHMARKS.md, "GPU transfers").
const THREADS: u32 = 512;

/// A permute fused into the copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permute {
    /// Plain copy.
    None,
    /// Source blocks token-major (NHD), destination head-major (HND).
    NhdToHnd {
        /// KV heads per block.
        heads: u32,
        /// Tokens per block.
        tokens: u32,
    },
    /// Source head-major, destination token-major.
    HndToNhd {
        /// KV heads per block.
        heads: u32,
        /// Tokens per block.
        tokens: u32,
    },
}

/// One launch's worth of copying.
#[derive(Debug, Clone)]
pub struct GatherSpec<'a> {
    /// Base address of each source region (device, IPC-mapped or mapped pinned memory).
    pub src_bases: &'a [u64],
    /// Base address of each destination region, same count.
    pub dst_bases: &'a [u64],
    /// Source block index of each copied block.
    pub src_blocks: &'a [u32],
    /// Destination block index, same count.
    pub dst_blocks: &'a [u32],
    /// Bytes of one block in one region (a multiple of 16).
    pub block_bytes: u64,
    /// Permute to fuse.
    pub permute: Permute,
}

impl GatherSpec<'_> {
    pub(crate) fn check(&self) -> Result<(u32, u32, u32), CudaError> {
        if self.src_bases.len() != self.dst_bases.len() {
            return Err(CudaError::Invalid(format!(
                "{} source regions but {} destination regions",
                self.src_bases.len(),
                self.dst_bases.len()
            )));
        }
        if self.src_blocks.len() != self.dst_blocks.len() {
            return Err(CudaError::Invalid(format!(
                "{} source blocks but {} destination blocks",
                self.src_blocks.len(),
                self.dst_blocks.len()
            )));
        }
        if self.block_bytes == 0
            || !self.block_bytes.is_multiple_of(16)
            || self.block_bytes >> 4 > u32::MAX as u64
        {
            return Err(CudaError::Invalid(format!(
                "block size {} bytes is not a positive multiple of 16",
                self.block_bytes
            )));
        }
        let (mode, heads, tokens) = match self.permute {
            Permute::None => (0, 1, 1),
            Permute::NhdToHnd { heads, tokens } => (1, heads, tokens),
            Permute::HndToNhd { heads, tokens } => (2, heads, tokens),
        };
        if mode != 0 {
            let rows = heads as u64 * tokens as u64;
            if rows == 0 || !self.block_bytes.is_multiple_of(rows * 16) {
                return Err(CudaError::Invalid(format!(
                    "a permuted block of {} bytes must hold {heads} heads x {tokens} tokens of rows that are \
                        multiples of 16 bytes",
                    self.block_bytes
                )));
            }
        }
        let grid = self.src_blocks.len() as u64 * self.src_bases.len() as u64;
        if grid > i32::MAX as u64 {
            return Err(CudaError::Invalid(format!("{grid} (block, region) pairs exceed one launch")));
        }
        Ok((mode, heads, tokens))
    }
}

/// Regions and blocks a launch can carry in its parameters (`KVC_MAX_REGIONS`,
/// `KVC_MAX_BLOCKS` in the kernel's source); larger gathers upload their index arrays first.
pub const INLINE_MAX_REGIONS: usize = 128;
/// See [`INLINE_MAX_REGIONS`].
pub const INLINE_MAX_BLOCKS: usize = 3584;

/// `kvc_inline_args` of the kernel's source, field for field (30,744 bytes, within the 32 KiB
/// a kernel parameter may have on sm_70 and later).
#[repr(C)]
struct InlineArgs {
    block_bytes: u64,
    n_blocks: u32,
    mode: u32,
    heads: u32,
    tokens: u32,
    src_bases: [u64; INLINE_MAX_REGIONS],
    dst_bases: [u64; INLINE_MAX_REGIONS],
    src_blocks: [u32; INLINE_MAX_BLOCKS],
    dst_blocks: [u32; INLINE_MAX_BLOCKS],
}

// SAFETY: plain old data laid out as the kernel's `kvc_inline_args` (`repr(C)`, the same field
// types in the same order), passed by value.
unsafe impl cudarc::driver::DeviceRepr for InlineArgs {}

/// The compiled kernel plus reusable index buffers.
pub struct GatherKernel {
    func: CudaFunction,
    /// The kernel whose index arrays travel in its launch (sm_70 and later).
    inline: Option<CudaFunction>,
    /// Its parameter block, reused (the driver copies it at each launch).
    args: Box<InlineArgs>,
    arch: String,
    scratch: Option<(DeviceBuffer, PinnedBuffer)>,
    /// Bumped by every `prepare`: a `Prepared` of an older generation is refused.
    generation: u64,
}

impl GatherKernel {
    /// Compiles the kernel with NVRTC to a cubin for this GPU's architecture (no driver JIT
    /// at load; once per architecture and process, then taken from a cache) and loads it.
    pub fn new(gpu: &Gpu) -> Result<GatherKernel, CudaError> {
        let arch = gpu.arch()?;
        let cubin = cubin_for(&arch)?;
        gpu.bind()?;
        let module = gpu
            .context()
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(|e| CudaError::driver("cuModuleLoadData", e))?;
        let func =
            module.load_function("kvc_gather").map_err(|e| CudaError::driver("cuModuleGetFunction", e))?;
        let inline = match sm_major(&arch) >= 7 {
            true => Some(
                module
                    .load_function("kvc_gather_inline")
                    .map_err(|e| CudaError::driver("cuModuleGetFunction", e))?,
            ),
            false => None,
        };
        let args = Box::new(InlineArgs {
            block_bytes: 0,
            n_blocks: 0,
            mode: 0,
            heads: 0,
            tokens: 0,
            src_bases: [0; INLINE_MAX_REGIONS],
            dst_bases: [0; INLINE_MAX_REGIONS],
            src_blocks: [0; INLINE_MAX_BLOCKS],
            dst_blocks: [0; INLINE_MAX_BLOCKS],
        });
        Ok(GatherKernel { func, inline, args, arch, scratch: None, generation: 0 })
    }

    /// The architecture it was compiled for.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Enqueues the gather on the GPU's stream (returns at once; synchronise or time it).
    /// Up to [`INLINE_MAX_REGIONS`] regions and [`INLINE_MAX_BLOCKS`] blocks its index arrays
    /// travel in the launch's parameters, so nothing is uploaded or waited for first (about
    /// 20 µs of a 0.5 ms gather on an H200, BENCHMARKS.md); larger gathers upload them.
    pub fn launch(&mut self, gpu: &Gpu, spec: &GatherSpec<'_>) -> Result<(), CudaError> {
        let (regions, blocks) = (spec.src_bases.len(), spec.src_blocks.len());
        if let Some(func) =
            self.inline.as_ref().filter(|_| regions <= INLINE_MAX_REGIONS && blocks <= INLINE_MAX_BLOCKS)
        {
            let (mode, heads, tokens) = spec.check()?;
            if regions == 0 || blocks == 0 {
                return Ok(());
            }
            let a = &mut *self.args;
            a.block_bytes = spec.block_bytes;
            a.n_blocks = blocks as u32;
            (a.mode, a.heads, a.tokens) = (mode, heads, tokens);
            a.src_bases[..regions].copy_from_slice(spec.src_bases);
            a.dst_bases[..regions].copy_from_slice(spec.dst_bases);
            a.src_blocks[..blocks].copy_from_slice(spec.src_blocks);
            a.dst_blocks[..blocks].copy_from_slice(spec.dst_blocks);
            gpu.bind()?;
            let grid = (regions * blocks) as u32;
            let cfg =
                LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
            let mut args = gpu.stream().launch_builder(func);
            args.arg(&*self.args);
            // SAFETY: the one argument is the kernel's `kvc_inline_args`, by value (the driver
            // copies it at the launch); `check` bounded the grid and the block size; the caller
            // guarantees every base address plus (max block index + 1) * block_bytes lies in
            // live memory.
            unsafe { args.launch(cfg) }.map_err(|e| CudaError::driver("cuLaunchKernel", e))?;
            return Ok(());
        }
        let prepared = self.prepare(gpu, std::slice::from_ref(spec))?;
        self.launch_prepared(gpu, &prepared, 0)
    }

    /// Uploads the index arrays of several gathers at once (one host wait, one copy), so that
    /// [`GatherKernel::launch_prepared`] can then enqueue them, interleaved with other work,
    /// without waiting on the host. A later `prepare` or `launch` invalidates the result.
    pub fn prepare(&mut self, gpu: &Gpu, specs: &[GatherSpec<'_>]) -> Result<Prepared, CudaError> {
        let mut need = 0usize;
        let mut checked = Vec::with_capacity(specs.len());
        for spec in specs {
            checked.push(spec.check()?);
            need += 16 * spec.src_bases.len() + 8 * spec.src_blocks.len();
        }
        let grow = self.scratch.as_ref().is_none_or(|(d, _)| d.len() < need);
        // The previous launches may still read the scratch: wait before rewriting or
        // replacing it (the pinned staging half is reused too).
        gpu.synchronize()?;
        if grow {
            let cap = need.next_power_of_two().max(4096);
            self.scratch = Some((gpu.alloc(cap)?, gpu.alloc_pinned(cap)?));
        }
        self.generation += 1;
        let Some((dev, pinned)) = self.scratch.as_mut() else {
            return Err(CudaError::Invalid("gather scratch missing".into()));
        };
        let host = pinned.as_mut_slice();
        let base = dev.ptr();
        let mut off = 0usize;
        let mut launches = Vec::with_capacity(specs.len());
        for (spec, (mode, heads, tokens)) in specs.iter().zip(checked) {
            let (r, b) = (spec.src_bases.len(), spec.src_blocks.len());
            let at = off;
            for v in spec.src_bases.iter().chain(spec.dst_bases) {
                host[off..off + 8].copy_from_slice(&v.to_ne_bytes());
                off += 8;
            }
            for v in spec.src_blocks.iter().chain(spec.dst_blocks) {
                host[off..off + 4].copy_from_slice(&v.to_ne_bytes());
                off += 4;
            }
            let src_bases = base + at as u64;
            let src_blocks = src_bases + 16 * r as u64;
            launches.push(Launch {
                src_bases,
                dst_bases: src_bases + 8 * r as u64,
                src_blocks,
                dst_blocks: src_blocks + 4 * b as u64,
                n_blocks: b as u32,
                regions: r as u32,
                block_bytes: spec.block_bytes,
                mode,
                heads,
                tokens,
            });
        }
        if off > 0 {
            gpu.bind()?;
            // SAFETY: `dev` holds at least `need` >= off bytes; the pinned source stays alive
            // and is not rewritten before the stream is synchronised (at the next prepare).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dev.ptr(),
                    &pinned.as_slice()[..off],
                    gpu.stream().cu_stream(),
                )
                .map_err(|e| CudaError::driver("cuMemcpyHtoDAsync", e))?;
            }
        }
        Ok(Prepared { generation: self.generation, launches })
    }

    /// Enqueues gather `i` of a [`Prepared`] batch on the GPU's stream, without a host wait.
    pub fn launch_prepared(&self, gpu: &Gpu, prepared: &Prepared, i: usize) -> Result<(), CudaError> {
        if prepared.generation != self.generation {
            return Err(CudaError::Invalid(
                "a prepared gather was used after its index arrays were replaced".into(),
            ));
        }
        let l =
            prepared.launches.get(i).ok_or_else(|| CudaError::Invalid(format!("no prepared gather {i}")))?;
        if l.n_blocks == 0 || l.regions == 0 {
            return Ok(());
        }
        gpu.bind()?;
        let grid = l.regions * l.n_blocks;
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut args = gpu.stream().launch_builder(&self.func);
        args.arg(&l.src_bases)
            .arg(&l.dst_bases)
            .arg(&l.src_blocks)
            .arg(&l.dst_blocks)
            .arg(&l.n_blocks)
            .arg(&l.block_bytes)
            .arg(&l.mode)
            .arg(&l.heads)
            .arg(&l.tokens);
        // SAFETY: the argument list matches the kernel's signature (pointers passed as
        // 64-bit device addresses, uploaded by `prepare` of this generation, which is still
        // current); `check` bounded the grid; the caller guarantees every base address plus
        // (max block index + 1) * block_bytes lies in live memory.
        unsafe { args.launch(cfg) }.map_err(|e| CudaError::driver("cuLaunchKernel", e))?;
        Ok(())
    }
}

/// Index arrays of several gathers on the device, ready to launch.
#[derive(Debug)]
pub struct Prepared {
    generation: u64,
    launches: Vec<Launch>,
}

impl Prepared {
    /// How many gathers it holds.
    pub fn len(&self) -> usize {
        self.launches.len()
    }

    /// True when it holds none.
    pub fn is_empty(&self) -> bool {
        self.launches.is_empty()
    }
}

#[derive(Debug, Clone, Copy)]
struct Launch {
    src_bases: u64,
    dst_bases: u64,
    src_blocks: u64,
    dst_blocks: u64,
    n_blocks: u32,
    regions: u32,
    block_bytes: u64,
    mode: u32,
    heads: u32,
    tokens: u32,
}

/// The major compute capability of an `sm_XY` architecture name (0 when it is not one).
fn sm_major(arch: &str) -> u32 {
    let digits = arch.trim_start_matches("sm_");
    digits.get(..digits.len().saturating_sub(1)).and_then(|d| d.parse().ok()).unwrap_or(0)
}

/// The cubin for `arch`, compiled at the first call and kept for the process: every
/// connector, staged path and stage of a worker loads the same bytes without NVRTC again.
fn cubin_for(arch: &str) -> Result<Vec<u8>, CudaError> {
    static CACHE: std::sync::Mutex<Vec<(String, Vec<u8>)>> = std::sync::Mutex::new(Vec::new());
    // Holding the lock while compiling makes concurrent first callers wait for one compile.
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, c)) = cache.iter().find(|(a, _)| a == arch) {
        return Ok(c.clone());
    }
    let cubin = compile_cubin(arch)?;
    cache.push((arch.to_owned(), cubin.clone()));
    Ok(cubin)
}

fn compile_cubin(arch: &str) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, sys};
    let compile_err = |log: String| CudaError::Compile { arch: arch.to_owned(), log };
    let src = CString::new(SOURCE).map_err(|e| compile_err(e.to_string()))?;
    let prog = result::create_program(&src, None).map_err(|e| compile_err(format!("{e:?}")))?;
    let opts = [format!("--gpu-architecture={arch}"), "--std=c++17".to_owned()];
    // SAFETY: `prog` was just created and is destroyed once below.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    let out = match compiled {
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled successfully; the buffer is sized by NVRTC's answer.
            unsafe {
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| compile_err(format!("{e:?}")))?;
                let mut buf = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char)
                    .result()
                    .map_err(|e| compile_err(format!("{e:?}")))?;
                Ok(buf)
            }
        }
        Err(e) => {
            // SAFETY: `prog` is valid until destroyed below.
            let log = unsafe { result::get_program_log(prog) }
                .map(|l| l.iter().map(|c| *c as u8 as char).collect::<String>())
                .unwrap_or_default();
            Err(compile_err(format!("{e:?}: {log}")))
        }
    };
    // SAFETY: destroyed once, after its last use.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inline_parameters_match_the_kernels_struct_and_fit_one_launch() {
        // kvc_inline_args: 24 bytes of scalars, then the four arrays; a kernel parameter may
        // hold 32,764 bytes.
        let want = 24 + 16 * INLINE_MAX_REGIONS + 8 * INLINE_MAX_BLOCKS;
        assert_eq!(std::mem::size_of::<InlineArgs>(), want);
        assert!(want <= 32_764, "{want}");
        assert!(SOURCE.contains(&format!("#define KVC_MAX_REGIONS {INLINE_MAX_REGIONS}")));
        assert!(SOURCE.contains(&format!("#define KVC_MAX_BLOCKS {INLINE_MAX_BLOCKS}")));
    }

    #[test]
    fn the_major_compute_capability_is_read_from_the_architecture() {
        assert_eq!(sm_major("sm_90"), 9);
        assert_eq!(sm_major("sm_75"), 7);
        assert_eq!(sm_major("sm_100"), 10);
        assert_eq!(sm_major("sm_61"), 6);
        assert_eq!(sm_major("gfx90a"), 0);
    }
}
