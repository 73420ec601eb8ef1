//! NIXL with GPU memory (feature `cuda`): the probe behind `kvconnect bench nixl-vram`.
//!
//! Two NIXL agents with the UCX backend in one process, two device buffers on one GPU
//! (`cuMemAlloc`, through kvconnect-cuda) registered as VRAM with their device id, metadata
//! exchanged, then one READ of `blocks` descriptors whose blocks are spread over the source
//! buffer in a shuffled order (so nothing coalesces into one copy), polled until done, a
//! notification sent and received, and the destination downloaded and compared with the
//! source. Timed against one contiguous `cuMemcpyDtoD` of the same bytes on the same
//! buffers, alternating in the same run.
//!
//! Whether this works depends on the NIXL build: its UCX must carry the CUDA transports
//! (`libuct_cuda`, which needs `libcuda.so.1` and `libnvidia-ml.so.1` from the driver), and
//! UCX's CUDA memory hooks (`libucm_cuda`) need `libcudart.so.12`, which the nixl-cu12 wheel
//! does not ship: without it UCX takes GPU memory for host memory and refuses to register it.
//! Every way it can fail comes back as a [`VramError`] that says what to do, never an abort:
//! the checks that can be made before NIXL touches device memory are made first.

#![allow(unsafe_code)] // NIXL VRAM registration and dlopen of the CUDA libraries it needs.

use kvconnect_api::math::gcd;
use kvconnect_cuda::{CudaError, Gpu};
use kvconnect_nixl::nixl_agent::{NixlAgent, NixlCallError, NixlMem, ReadPair};
use kvconnect_nixl::nixl_lib::{self, NixlLibError};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// UCX's CUDA transport module (cuda_copy, cuda_ipc), as the NIXL wheel ships it.
pub const UCX_CUDA_MODULE: &str = "libuct_cuda.so";

/// Why the probe could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum VramError {
    /// The NIXL library is not usable here.
    #[error(transparent)]
    Library(#[from] NixlLibError),
    /// No GPU, or a CUDA call failed.
    #[error("GPU: {0}")]
    Cuda(#[from] CudaError),
    /// The NIXL build cannot move GPU memory.
    #[error("UCX in this NIXL build offers no transport for VRAM: {detail}")]
    NoVramTransport {
        /// What was found missing.
        detail: String,
    },
    /// Registering a device buffer failed.
    #[error(
        "registering {bytes} bytes of GPU {device} memory as VRAM with NIXL's UCX backend failed: \
        {source}; UCX in this NIXL build may offer no transport for VRAM (its CUDA module {UCX_CUDA_MODULE} \
        needs libcuda.so.1 and libnvidia-ml.so.1 from the NVIDIA driver; UCX_TLS, if set, must allow \
        cuda_copy or cuda_ipc)"
    )]
    Register {
        /// Bytes.
        bytes: usize,
        /// Device ordinal.
        device: usize,
        /// NIXL's error.
        source: NixlCallError,
    },
    /// Another NIXL call failed (agents, metadata, the transfer, notifications).
    #[error("{0}")]
    Nixl(#[from] NixlCallError),
    /// The READ did not complete in time.
    #[error(
        "NIXL READ of {bytes} bytes of VRAM in {descriptors} descriptors did not finish within \
        {seconds:.1}s (UCX stalled moving GPU memory; try UCX_TLS unset, or check the UCX CUDA transports)"
    )]
    Timeout {
        /// Bytes.
        bytes: u64,
        /// Descriptors.
        descriptors: usize,
        /// The limit.
        seconds: f64,
    },
    /// The reader's notification never reached the owner.
    #[error(
        "the notification '{message}' sent after the READ did not reach the owning agent within \
        {seconds:.1}s"
    )]
    Notification {
        /// The message.
        message: String,
        /// The limit.
        seconds: f64,
    },
    /// Sizes that do not make a probe.
    #[error("invalid probe: {0}")]
    Invalid(String),
}

/// What to probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VramProbe {
    /// GPU ordinal of both buffers.
    pub gpu: usize,
    /// Bytes per buffer (rounded down to a multiple of `blocks`).
    pub bytes: usize,
    /// Descriptors of the READ (blocks of `bytes / blocks`).
    pub blocks: usize,
    /// Measured READs and copies (after one warm-up each); the best is reported.
    pub repeat: usize,
}

/// What the probe measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VramReport {
    /// GPU name.
    pub device: String,
    /// GPU ordinal.
    pub gpu: usize,
    /// Bytes moved by each READ (and each baseline copy).
    pub bytes: u64,
    /// Descriptors per READ.
    pub blocks: usize,
    /// Bytes per descriptor.
    pub block_bytes: u64,
    /// Measured repetitions.
    pub repeat: usize,
    /// The first READ (connection set-up included), milliseconds.
    pub first_read_ms: f64,
    /// Best READ: create, post, poll until done, milliseconds.
    pub nixl_read_ms: f64,
    /// Its rate, GB/s (1e9 bytes).
    pub nixl_gbps: f64,
    /// Best contiguous `cuMemcpyDtoD` of the same bytes (enqueue and synchronise), ms.
    pub dtod_ms: f64,
    /// Its rate, GB/s.
    pub dtod_gbps: f64,
    /// NIXL's rate as a fraction of the copy's (`dtod_ms / nixl_read_ms`).
    pub ratio: f64,
    /// Every byte of the last READ's destination equals its source block.
    pub verified: bool,
    /// The first destination offset that differed, when one did.
    pub first_mismatch: Option<u64>,
    /// Notifications sent after each READ, all received by the owning agent.
    pub notifications: usize,
    /// Memory types the UCX backend lists.
    pub backend_memory_types: String,
    /// The UCX CUDA module found next to the NIXL library, if the layout is the wheel's.
    pub ucx_cuda_module: Option<String>,
    /// `UCX_TLS` as set in the environment.
    pub ucx_tls: Option<String>,
    /// Where the NIXL library was loaded from.
    pub nixl_lib_dir: String,
}

/// The READ's descriptors: destination block `i` is read from source block `src_of[i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockPlan {
    /// Bytes per block.
    pub block: usize,
    /// Source block of each destination block (a permutation of `0..blocks`).
    pub src_of: Vec<usize>,
}

impl BlockPlan {
    /// `blocks` blocks of `bytes / blocks` bytes; the source blocks are visited with a stride
    /// coprime with `blocks` (about half of it), so neighbouring descriptors read far-apart
    /// source blocks and no two of them merge into one contiguous copy.
    pub fn new(bytes: usize, blocks: usize) -> Result<BlockPlan, VramError> {
        if blocks == 0 {
            return Err(VramError::Invalid("--blocks must be at least 1".into()));
        }
        let block = bytes / blocks;
        if block == 0 {
            return Err(VramError::Invalid(format!(
                "{bytes} bytes cannot be split into {blocks} blocks: use at least one byte per block"
            )));
        }
        // Any stride in 2..blocks coprime with it visits every block once and never steps
        // to the next block (that needs a stride of 1); blocks - 1 always qualifies.
        let mut stride = blocks / 2 + 1;
        while gcd(stride, blocks) != 1 {
            stride += 1;
        }
        let src_of = (0..blocks).map(|i| (i * stride + 1) % blocks).collect();
        Ok(BlockPlan { block, src_of })
    }

    /// Bytes one READ moves.
    pub fn total(&self) -> usize {
        self.block * self.src_of.len()
    }

    /// Descriptor pairs between two buffers' base addresses.
    pub fn pairs(&self, dst: u64, src: u64) -> Vec<ReadPair> {
        self.src_of
            .iter()
            .enumerate()
            .map(|(i, &s)| ReadPair {
                local: (dst as usize) + i * self.block,
                remote: (src as usize) + s * self.block,
                len: self.block,
            })
            .collect()
    }

    /// The first offset of `dst` that does not hold its source block's bytes.
    pub fn first_mismatch(&self, src: &[u8], dst: &[u8]) -> Option<u64> {
        let b = self.block;
        for (i, &s) in self.src_of.iter().enumerate() {
            let (Some(want), Some(got)) = (src.get(s * b..(s + 1) * b), dst.get(i * b..(i + 1) * b)) else {
                return Some((i * b) as u64);
            };
            if let Some(k) = want.iter().zip(got).position(|(a, c)| a != c) {
                return Some((i * b + k) as u64);
            }
        }
        None
    }
}

/// Position-dependent bytes (no block repeats another), so a misplaced block shows.
pub fn pattern(len: usize) -> Vec<u8> {
    (0..len as u64).map(|j| (j.wrapping_mul(2654435761).wrapping_add(j >> 20) >> 13) as u8).collect()
}

/// Where UCX looks for its transport modules for this NIXL library directory:
/// `UCX_MODULE_DIR` when set, else the wheel's layout (`../nixl_cu12.libs/ucx` beside the
/// library, next to the bundled `libucs`). `None` when neither exists (another layout).
pub fn ucx_module_dir(nixl_dir: &Path) -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("UCX_MODULE_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d));
    }
    let wheel = nixl_dir.parent()?.join("nixl_cu12.libs").join("ucx");
    wheel.is_dir().then_some(wheel)
}

/// UCX's CUDA module in `dir` (`libuct_cuda.so`, with or without a version suffix).
pub fn find_ucx_cuda_module(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(UCX_CUDA_MODULE)))
        .collect();
    found.sort();
    found.into_iter().next()
}

/// The checks that can be made before NIXL touches device memory: UCX's CUDA module is
/// shipped beside the library (when the layout is known) and the driver library it needs
/// besides libcuda (NVML) loads. Returns the module found, if the layout was known.
pub fn check_vram_transport(nixl_dir: &Path) -> Result<Option<PathBuf>, VramError> {
    let Some(dir) = ucx_module_dir(nixl_dir) else { return Ok(None) };
    let module = find_ucx_cuda_module(&dir).ok_or_else(|| VramError::NoVramTransport {
        detail: format!(
            "no {UCX_CUDA_MODULE}* (UCX's cuda_copy/cuda_ipc transports) in its module directory {}; copy it \
                there from the nixl-cu12 wheel's nixl_cu12.libs/ucx/",
            dir.display()
        ),
    })?;
    // SAFETY: NVML's loader runs no initialiser with preconditions; the handle is closed
    // again at once (UCX loads its own reference when it loads the CUDA module).
    if let Err(e) = unsafe { libloading::Library::new("libnvidia-ml.so.1") } {
        return Err(VramError::NoVramTransport {
            detail: format!(
                "UCX's CUDA module {} needs libnvidia-ml.so.1 from the NVIDIA driver, which cannot be loaded \
                    here ({e}); install the driver's NVML library or add its directory to LD_LIBRARY_PATH",
                module.display()
            ),
        });
    }
    let beside = dir.parent().map(|d| d.join(CUDART)).filter(|p| p.exists());
    // SAFETY: as for NVML: loaded to see that it can be, then closed.
    if beside.is_none() && unsafe { libloading::Library::new(CUDART) }.is_err() {
        return Err(VramError::NoVramTransport {
            detail: format!(
                "UCX's CUDA memory hooks (libucm_cuda) need {CUDART}, which the nixl-cu12 wheel does not \
                    ship and this machine lacks, so UCX would take GPU memory for host memory; install the \
                    CUDA 12 runtime (the pip package nvidia-cuda-runtime-cu12 has it) and put {CUDART} on \
                    LD_LIBRARY_PATH or into {}",
                dir.parent().unwrap_or(&dir).display()
            ),
        });
    }
    Ok(Some(module))
}

/// The CUDA runtime UCX's CUDA memory hooks link against.
const CUDART: &str = "libcudart.so.12";

/// Polls `t` until done, spinning then yielding, within `limit`.
fn wait(
    agent: &NixlAgent,
    t: &kvconnect_nixl::nixl_agent::Transfer,
    limit: Duration,
) -> Result<(), VramError> {
    let start = Instant::now();
    let mut spins = 0u32;
    while !agent.poll(t)? {
        if start.elapsed() > limit {
            return Err(VramError::Timeout {
                bytes: t.bytes(),
                descriptors: t.descriptors(),
                seconds: limit.as_secs_f64(),
            });
        }
        spins += 1;
        if spins > 1000 {
            std::thread::yield_now();
        }
    }
    Ok(())
}

/// Waits until `owner` has received `message` from any agent.
fn await_notification(owner: &NixlAgent, message: &str, limit: Duration) -> Result<(), VramError> {
    let start = Instant::now();
    loop {
        if owner.take_notifications()?.iter().any(|(_, m)| m == message) {
            return Ok(());
        }
        if start.elapsed() > limit {
            return Err(VramError::Notification {
                message: message.to_owned(),
                seconds: limit.as_secs_f64(),
            });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Runs the probe (see the module documentation).
pub fn probe(p: VramProbe) -> Result<VramReport, VramError> {
    let plan = BlockPlan::new(p.bytes, p.blocks)?;
    let total = plan.total();
    let lib_dir = nixl_lib::load()?.to_path_buf();
    let gpu = Gpu::open(p.gpu)?;
    let module = check_vram_transport(&lib_dir)?;
    let device = p.gpu as u64;

    // Declared before the agents so that they are dropped after them (and after the
    // registrations, declared last): NIXL must let go of the memory before it is freed.
    let src = gpu.alloc(total)?;
    let dst = gpu.alloc(total)?;
    let host_src = pattern(total);
    gpu.upload(src.ptr(), &host_src)?;

    let pid = std::process::id();
    let owner = NixlAgent::new(&format!("vram-owner-{pid}"))?;
    let reader = NixlAgent::new(&format!("vram-reader-{pid}"))?;
    if !reader.supports(NixlMem::Vram(device)) {
        return Err(VramError::NoVramTransport {
            detail: format!("its UCX backend lists only these memory types: {}", reader.memory_types()),
        });
    }
    // UCX's CUDA transports use the context current on the calling thread.
    gpu.bind()?;
    let register = |agent: &NixlAgent, addr: u64| {
        // SAFETY: both buffers are cuMemAlloc memory of this GPU of `total` bytes and outlive
        // the agents (declared before them, so dropped after).
        unsafe { agent.register(addr as usize, total, NixlMem::Vram(device)) }
            .map_err(|source| VramError::Register { bytes: total, device: p.gpu, source })
    };
    let _src_reg = register(&owner, src.ptr())?;
    let _dst_reg = register(&reader, dst.ptr())?;
    let remote = reader.load_remote_md(&owner.local_md()?)?;

    let pairs = plan.pairs(dst.ptr(), src.ptr());
    let limit = Duration::from_secs(20) + Duration::from_secs_f64(total as f64 / 100e6);
    let mut notifications = 0usize;
    let mut read = |round: usize| -> Result<Duration, VramError> {
        gpu.memset_async(dst.ptr(), 0, total)?;
        gpu.synchronize()?;
        let t0 = Instant::now();
        let t = reader.post_read_mem(&remote, &pairs, NixlMem::Vram(device), NixlMem::Vram(device))?;
        wait(&reader, &t, limit)?;
        let took = t0.elapsed();
        let message = format!("kvc-vram-done {round}");
        reader.notify(owner.name(), message.as_bytes())?;
        await_notification(&owner, &message, Duration::from_secs(10))?;
        notifications += 1;
        Ok(took)
    };
    let copy = || -> Result<Duration, VramError> {
        let t0 = Instant::now();
        gpu.copy_dtod_async(dst.ptr(), src.ptr(), total)?;
        gpu.synchronize()?;
        Ok(t0.elapsed())
    };

    let first = read(0)?;
    copy()?;
    let (mut best_read, mut best_copy) = (Duration::MAX, Duration::MAX);
    let repeat = p.repeat.max(1);
    for round in 1..=repeat {
        best_copy = best_copy.min(copy()?);
        // The READ goes last, so the destination checked below is what NIXL wrote.
        best_read = best_read.min(read(round)?);
    }
    let mut host_dst = vec![0u8; total];
    gpu.download(&mut host_dst, dst.ptr())?;
    let first_mismatch = plan.first_mismatch(&host_src, &host_dst);

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let gbps = |d: Duration| total as f64 / d.as_secs_f64().max(1e-12) / 1e9;
    Ok(VramReport {
        device: gpu.name(),
        gpu: p.gpu,
        bytes: total as u64,
        blocks: plan.src_of.len(),
        block_bytes: plan.block as u64,
        repeat,
        first_read_ms: ms(first),
        nixl_read_ms: ms(best_read),
        nixl_gbps: gbps(best_read),
        dtod_ms: ms(best_copy),
        dtod_gbps: gbps(best_copy),
        ratio: best_copy.as_secs_f64() / best_read.as_secs_f64().max(1e-12),
        verified: first_mismatch.is_none(),
        first_mismatch,
        notifications,
        backend_memory_types: reader.memory_types(),
        ucx_cuda_module: module.map(|m| m.display().to_string()),
        ucx_tls: std::env::var("UCX_TLS").ok(),
        nixl_lib_dir: lib_dir.display().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_is_a_permutation_without_contiguous_neighbours() {
        for blocks in [2usize, 3, 8, 64, 100, 1024] {
            let p = BlockPlan::new(blocks * 512 + blocks - 1, blocks).unwrap();
            assert_eq!(p.block, 512);
            let mut seen = p.src_of.clone();
            seen.sort();
            assert_eq!(seen, (0..blocks).collect::<Vec<_>>(), "{blocks}");
            if blocks > 2 {
                // No descriptor's source follows the previous one's: nothing coalesces.
                assert!(p.src_of.windows(2).all(|w| w[1] != w[0] + 1), "{blocks}: {:?}", p.src_of);
            }
        }
        assert_eq!(BlockPlan::new(10, 1).unwrap().src_of, vec![0]);
    }

    #[test]
    fn bad_sizes_are_errors() {
        assert!(BlockPlan::new(100, 0).unwrap_err().to_string().contains("--blocks"));
        assert!(BlockPlan::new(3, 4).unwrap_err().to_string().contains("cannot be split"));
    }

    #[test]
    fn pairs_and_mismatch_follow_the_plan() {
        let p = BlockPlan::new(64, 4).unwrap();
        let pairs = p.pairs(1000, 5000);
        assert_eq!(pairs.len(), 4);
        for (i, pr) in pairs.iter().enumerate() {
            assert_eq!(pr.local, 1000 + i * 16);
            assert_eq!(pr.remote, 5000 + p.src_of[i] * 16);
            assert_eq!(pr.len, 16);
        }
        let src = pattern(64);
        let mut dst = vec![0u8; 64];
        for (i, &s) in p.src_of.iter().enumerate() {
            dst[i * 16..(i + 1) * 16].copy_from_slice(&src[s * 16..(s + 1) * 16]);
        }
        assert_eq!(p.first_mismatch(&src, &dst), None);
        dst[37] ^= 1;
        assert_eq!(p.first_mismatch(&src, &dst), Some(37));
        // An identity copy is wrong for a shuffled plan.
        assert!(p.first_mismatch(&src, &src).is_some());
    }

    #[test]
    fn pattern_blocks_differ() {
        let v = pattern(1 << 16);
        assert_ne!(v[..512], v[512..1024]);
        assert_ne!(v[..4096], v[4096..8192]);
    }

    #[test]
    fn missing_ucx_cuda_module_is_a_clear_error() {
        let root = std::env::temp_dir().join(format!("kvc-vram-ucx-{}", std::process::id()));
        let lib = root.join(".nixl_cu12.mesonpy.libs");
        let ucx = root.join("nixl_cu12.libs/ucx");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::create_dir_all(&ucx).unwrap();
        std::fs::write(ucx.join("libuct_cma.so.0.0.0"), b"").unwrap();
        if std::env::var_os("UCX_MODULE_DIR").is_none() {
            assert_eq!(ucx_module_dir(&lib), Some(ucx.clone()));
            let e = check_vram_transport(&lib).unwrap_err().to_string();
            assert!(e.starts_with("UCX in this NIXL build offers no transport for VRAM"), "{e}");
            assert!(e.contains("libuct_cuda.so") && e.contains(&ucx.display().to_string()), "{e}");
        }
        std::fs::write(ucx.join("libuct_cuda.so.0.0.0"), b"").unwrap();
        assert_eq!(find_ucx_cuda_module(&ucx), Some(ucx.join("libuct_cuda.so.0.0.0")));
        // Another layout: nothing to check before NIXL runs.
        assert_eq!(find_ucx_cuda_module(&root), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
