//! `kvconnect bench transfer --backend cuda_ipc`: a real two-process transfer of a prompt's
//! KV between GPU regions over CUDA IPC, measured against its baselines in the same run.
//!
//! The producer (prefill) process allocates per-layer K and V regions with plain
//! `cuMemAlloc`, fills every block with a value derived from (region, block), exports IPC
//! handles and starts the consumer (decode) process. The consumer opens the handles once,
//! then times, with CUDA events, best of `iters`:
//! - the gather kernel over every region and block of the request (one launch);
//! - the same gather with an NHD→HND permute fused in;
//! - one `cuMemcpyDtoDAsync` per block (what the kernel saves);
//! - a contiguous device-to-device copy of the same bytes (the baseline);
//! - 1-, 8- and 32-block requests (latency);
//! - an lmcache-style save: gather into mapped pinned host memory vs one contiguous
//!   device-to-host copy of the same bytes.
//!
//! On the host's clock it also times the launch call and an event record (`host_us`), and the
//! host-staged path (on its own streams and on one stream per GPU) against one contiguous
//! D2H, one H2D, and the two at once (`staged`).
//!
//! Every gather is checked against the producer's fill pattern before it is timed.

#![allow(unsafe_code)] // CUDA bindings: driver calls and device memory.

use kvconnect_cuda::device::{DeviceBuffer, Gpu};
use kvconnect_cuda::error::CudaError;
use kvconnect_cuda::ipc::{ImportedRegion, IpcHandle};
use kvconnect_cuda::kernel::{GatherKernel, GatherSpec, Permute};
use kvconnect_cuda::staged::{StagedConfig, StagedCopy, DEFAULT_BUFFERS, DEFAULT_CHUNK_BYTES};
use kvconnect_support::stats::Quartiles;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The KV geometry of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Geometry {
    /// KV layers.
    pub layers: u32,
    /// 2 (K and V) or 1 (MLA).
    pub kv_parts: u32,
    /// KV heads.
    pub heads: u32,
    /// Head dim.
    pub head_dim: u32,
    /// Bytes per element.
    pub elem_size: u32,
    /// Tokens per block.
    pub block_tokens: u32,
}

impl Geometry {
    /// Bytes of one block of one region.
    pub fn block_bytes(&self) -> u64 {
        self.heads as u64 * self.head_dim as u64 * self.elem_size as u64 * self.block_tokens as u64
    }

    /// Regions (layers × parts).
    pub fn regions(&self) -> usize {
        (self.layers * self.kv_parts) as usize
    }
}

/// What the producer hands the consumer process (as JSON on its stdin).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerSpec {
    /// Geometry.
    pub geometry: Geometry,
    /// Blocks per producer region.
    pub producer_blocks: u32,
    /// Blocks the request moves.
    pub request_blocks: u32,
    /// Producer GPU ordinal.
    pub producer_device: usize,
    /// GPU the consumer runs on.
    pub consumer_device: usize,
    /// The producer's regions.
    pub regions: Vec<IpcHandle>,
    /// A contiguous producer buffer of the request's size (for the baseline).
    pub flat: IpcHandle,
    /// Timed repetitions (best of).
    pub iters: u32,
}

/// Fill value of block `k` of region `r`: every byte of the block.
fn fill_value(r: usize, k: u32) -> u8 {
    ((r as u64 * 131 + k as u64 * 7 + 1) % 251) as u8
}

/// The request's source blocks: spread over the producer's pool, not contiguous.
fn source_blocks(request: u32, pool: u32) -> Vec<u32> {
    // A fixed odd stride visits every block once when `pool` is a power of two.
    (0..request).map(|i| ((i as u64 * 2654435761u64) % pool as u64) as u32).collect()
}

/// Producer side: allocate, fill, export, run `consumer` (which starts the other process
/// and returns its JSON), keep everything alive until it returns.
pub fn run_producer(
    device: usize,
    consumer_device: usize,
    geometry: Geometry,
    tokens: u32,
    iters: u32,
    consumer: impl FnOnce(&PeerSpec) -> Result<Value, String>,
) -> Result<Value, CudaError> {
    let gpu = Gpu::open(device)?;
    let request_blocks = tokens.div_ceil(geometry.block_tokens).max(1);
    let producer_blocks = (request_blocks * 2).next_power_of_two();
    let bb = geometry.block_bytes() as usize;
    let mut regions = Vec::with_capacity(geometry.regions());
    for r in 0..geometry.regions() {
        let buf = gpu.alloc(producer_blocks as usize * bb)?;
        for k in 0..producer_blocks {
            gpu.memset_async(buf.ptr() + k as u64 * bb as u64, fill_value(r, k), bb)?;
        }
        regions.push(buf);
    }
    let flat = gpu.alloc(request_blocks as usize * bb * geometry.regions())?;
    gpu.memset_async(flat.ptr(), 0x5a, flat.len())?;
    gpu.synchronize()?;
    let spec = PeerSpec {
        geometry,
        producer_blocks,
        request_blocks,
        producer_device: device,
        consumer_device,
        regions: regions.iter().map(|b| IpcHandle::export(&gpu, b)).collect::<Result<_, _>>()?,
        flat: IpcHandle::export(&gpu, &flat)?,
        iters,
    };
    let mut out = consumer(&spec).map_err(|e| CudaError::Invalid(format!("consumer process: {e}")))?;
    if let Value::Object(m) = &mut out {
        m.insert("device".into(), json!(gpu.name()));
        m.insert("producer_device".into(), json!(device));
    }
    drop(regions);
    Ok(out)
}

fn best_ms(gpu: &Gpu, iters: u32, mut f: impl FnMut() -> Result<(), CudaError>) -> Result<f64, CudaError> {
    f()?; // warm-up
    gpu.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..iters.max(1) {
        let ms = gpu.time(&mut f)?;
        best = best.min(ms);
    }
    Ok(best)
}

/// Interleaved pairs of a baseline and a subject (the order alternating within a pair), after
/// one warm-up of each: the per-pair ratio baseline/subject and each side's times.
struct Paired {
    ratio: Quartiles,
    baseline_ms: Quartiles,
    subject_ms: Quartiles,
}

fn paired(
    gpu: &Gpu,
    pairs: u32,
    mut baseline: impl FnMut() -> Result<(), CudaError>,
    mut subject: impl FnMut() -> Result<(), CudaError>,
) -> Result<Paired, CudaError> {
    baseline()?;
    subject()?;
    gpu.synchronize()?;
    let (mut ratios, mut base, mut subj) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..pairs.max(1) {
        let (b, s) = if i % 2 == 0 {
            let b = gpu.time(&mut baseline)?;
            (b, gpu.time(&mut subject)?)
        } else {
            let s = gpu.time(&mut subject)?;
            (gpu.time(&mut baseline)?, s)
        };
        ratios.push(b / s);
        base.push(b);
        subj.push(s);
    }
    Ok(Paired {
        ratio: Quartiles::of(ratios),
        baseline_ms: Quartiles::of(base),
        subject_ms: Quartiles::of(subj),
    })
}

fn gbps(bytes: u64, ms: f64) -> f64 {
    bytes as f64 / (ms / 1e3) / 1e9
}

/// Consumer side: open the peer's regions and measure. Returns the report.
pub fn run_consumer(spec: &PeerSpec) -> Result<Value, CudaError> {
    let gpu = Gpu::open(spec.consumer_device)?;
    let mut kernel = GatherKernel::new(&gpu)?;
    let g = spec.geometry;
    let bb = g.block_bytes();
    let nreg = g.regions();
    let t_open = std::time::Instant::now();
    let peer: Vec<ImportedRegion> =
        spec.regions.iter().map(|h| ImportedRegion::open(&gpu, h)).collect::<Result<_, _>>()?;
    let peer_flat = ImportedRegion::open(&gpu, &spec.flat)?;
    let open_ms = t_open.elapsed().as_secs_f64() * 1e3;
    let local_blocks = spec.request_blocks * 2;
    let local: Vec<DeviceBuffer> =
        (0..nreg).map(|_| gpu.alloc(local_blocks as usize * bb as usize)).collect::<Result<_, _>>()?;
    let local_flat = gpu.alloc(peer_flat.len())?;
    let src_bases: Vec<u64> = peer.iter().map(|p| p.ptr()).collect();
    let dst_bases: Vec<u64> = local.iter().map(|l| l.ptr()).collect();
    let src_blocks = source_blocks(spec.request_blocks, spec.producer_blocks);
    // Destination blocks in reverse order: neither side is one contiguous run.
    let dst_blocks: Vec<u32> = (0..spec.request_blocks).rev().map(|i| i + spec.request_blocks / 2).collect();
    let bytes = spec.request_blocks as u64 * nreg as u64 * bb;

    // Correctness first: poison, gather, check the blocks.
    let plain = GatherSpec {
        src_bases: &src_bases,
        dst_bases: &dst_bases,
        src_blocks: &src_blocks,
        dst_blocks: &dst_blocks,
        block_bytes: bb,
        permute: Permute::None,
    };
    poison(&gpu, &local)?;
    kernel.launch(&gpu, &plain)?;
    gpu.synchronize()?;
    let checked = check_blocks(&gpu, &local, &src_blocks, &dst_blocks, bb, "gather")?;

    let iters = spec.iters;
    let contiguous = || gpu.copy_dtod_async(local_flat.ptr(), peer_flat.ptr(), bytes as usize);
    let gather = paired(&gpu, iters, contiguous, || kernel.launch(&gpu, &plain))?;
    let permuted =
        GatherSpec { permute: Permute::NhdToHnd { heads: g.heads, tokens: g.block_tokens }, ..plain.clone() };
    let permute = paired(&gpu, iters, contiguous, || kernel.launch(&gpu, &permuted))?;
    let (gather_ms, contiguous_ms) = (gather.subject_ms.median, gather.baseline_ms.median);
    let per_block_ms = best_ms(&gpu, iters.min(3), || {
        for r in 0..nreg {
            for (&s, &d) in src_blocks.iter().zip(&dst_blocks) {
                gpu.copy_dtod_async(dst_bases[r] + d as u64 * bb, src_bases[r] + s as u64 * bb, bb as usize)?;
            }
        }
        Ok(())
    })?;
    let mut small = serde_json::Map::new();
    for n in [1usize, 8, 32] {
        let n = n.min(src_blocks.len());
        let s = GatherSpec { src_blocks: &src_blocks[..n], dst_blocks: &dst_blocks[..n], ..plain.clone() };
        let ms = best_ms(&gpu, iters, || kernel.launch(&gpu, &s))?;
        small.insert(format!("{n}_blocks_us"), json!(ms * 1e3));
    }

    // What starting a gather costs the host, the GPU idle before each: the launch call for the
    // whole request and for one block, and recording an event after a launch. Each closure
    // returns the microseconds of the call it times.
    let host_us = |f: &mut dyn FnMut() -> Result<f64, CudaError>| -> Result<Quartiles, CudaError> {
        let mut us = Vec::new();
        for _ in 0..iters.max(1) {
            gpu.synchronize()?;
            us.push(f()?);
        }
        gpu.synchronize()?;
        Ok(Quartiles::of(us))
    };
    let timed = |f: &mut dyn FnMut() -> Result<(), CudaError>| -> Result<f64, CudaError> {
        let t = std::time::Instant::now();
        f()?;
        Ok(t.elapsed().as_secs_f64() * 1e6)
    };
    let one = GatherSpec { src_blocks: &src_blocks[..1], dst_blocks: &dst_blocks[..1], ..plain.clone() };
    let launch_request_us = host_us(&mut || timed(&mut || kernel.launch(&gpu, &plain)))?;
    let launch_one_block_us = host_us(&mut || timed(&mut || kernel.launch(&gpu, &one)))?;
    let done = gpu.completion_event()?;
    let record_us = host_us(&mut || {
        kernel.launch(&gpu, &plain)?;
        timed(&mut || done.record(gpu.stream()).map_err(|e| CudaError::driver("cuEventRecord", e)))
    })?;

    // lmcache-style save: the request's blocks of every region into pinned host memory.
    let mut pinned = gpu.alloc_pinned(bytes as usize)?;
    let per_region = spec.request_blocks as u64 * bb;
    let pinned_bases: Vec<u64> = (0..nreg as u64).map(|r| pinned.device_ptr() + r * per_region).collect();
    let seq: Vec<u32> = (0..spec.request_blocks).collect();
    let save = GatherSpec {
        src_bases: &dst_bases,
        dst_bases: &pinned_bases,
        src_blocks: &dst_blocks,
        dst_blocks: &seq,
        block_bytes: bb,
        permute: Permute::None,
    };
    kernel.launch(&gpu, &save)?;
    gpu.synchronize()?;
    let host = pinned.as_mut_slice();
    for r in [0usize, nreg - 1] {
        let off = r * per_region as usize;
        let want = fill_value(r, src_blocks[0]);
        if host[off] != want || host[off + bb as usize - 1] != want {
            return Err(CudaError::Invalid(format!("save-to-host check failed in region {r}")));
        }
    }
    let save_ms = best_ms(&gpu, iters, || kernel.launch(&gpu, &save))?;
    let d2h_ms = best_ms(&gpu, iters, || {
        // SAFETY: `pinned` holds `bytes` bytes and `local_flat` at least as many.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut pinned.as_mut_slice()[..bytes as usize],
                local_flat.ptr(),
                gpu.stream().cu_stream(),
            )
        }
        .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync", e))
    })?;

    // The host-staged path backend cuda_ipc takes without peer access, on the same request:
    // the direct mapping is closed and the handles opened again on the producer's GPU.
    drop(peer);
    let staged = staged_path(spec, &gpu, &mut kernel, &local, &dst_bases, &src_blocks, &dst_blocks, iters)?;

    let cross = if spec.consumer_device != spec.producer_device {
        cross_device(&gpu, spec.producer_device, bytes as usize, iters, gather_ms)?
    } else {
        Value::Null
    };

    Ok(json!({
        "backend": "cuda_ipc",
        "cross_device": cross,
        "staged": staged,
        "bytes": bytes,
        "regions": nreg,
        "blocks": spec.request_blocks,
        "block_bytes": bb,
        "consumer_device": spec.consumer_device,
        "ipc_open_ms": open_ms,
        "blocks_checked": checked,
        "pairs": iters.max(1),
        "gbps": gbps(bytes * 2, gather_ms),
        "baseline": "contiguous cuMemcpyDtoDAsync of the same bytes, interleaved with the subject",
        "baseline_gbps": gbps(bytes * 2, contiguous_ms),
        "ratio": gather.ratio.median,
        "ratio_quartiles": gather.ratio,
        "permute_gbps": gbps(bytes * 2, permute.subject_ms.median),
        "permute_ratio": permute.ratio.median,
        "permute_ratio_quartiles": permute.ratio,
        "per_block_memcpy_gbps": gbps(bytes * 2, per_block_ms),
        "per_block_memcpy_ratio": contiguous_ms / per_block_ms,
        "small_requests": small,
        "host_us": {
            "launch_request": launch_request_us,
            "launch_one_block": launch_one_block_us,
            "record_after_launch": record_us,
        },
        "save_to_pinned_gbps": gbps(bytes, save_ms),
        "contiguous_d2h_gbps": gbps(bytes, d2h_ms),
        "save_ratio": d2h_ms / save_ms,
        "note": "GB/s count bytes read + written for device copies, bytes moved for host saves"
    }))
}

/// Two GPUs of one host: the gather reading the peer GPU vs a contiguous
/// `cuMemcpyPeerAsync` of the same bytes, in the same run.
/// GB/s here count the bytes that cross between the GPUs once.
fn cross_device(
    gpu: &Gpu,
    producer_device: usize,
    bytes: usize,
    iters: u32,
    gather_ms: f64,
) -> Result<Value, CudaError> {
    let producer = Gpu::open(producer_device)?;
    let peer_access = gpu.enable_peer_access(&producer)?;
    let src = producer.alloc(bytes)?;
    producer.memset_async(src.ptr(), 0x3c, bytes)?;
    producer.synchronize()?;
    let dst = gpu.alloc(bytes)?;
    let peer_ms = best_ms(gpu, iters, || {
        // SAFETY: both buffers hold `bytes` bytes in their own live contexts.
        unsafe {
            cudarc::driver::result::memcpy_peer_async(
                gpu.context().cu_ctx(),
                dst.ptr(),
                producer.context().cu_ctx(),
                src.ptr(),
                bytes,
                gpu.stream().cu_stream(),
            )
        }
        .map_err(|e| CudaError::driver("cuMemcpyPeerAsync", e))
    })?;
    Ok(json!({
        "peer_access": peer_access,
        "path": if peer_access { "gather kernel reading the peer GPU over NVLink" } else { "host-staged (no \
            peer access)" },
        "gather_gbps": gbps(bytes as u64, gather_ms),
        "peer_copy_gbps": gbps(bytes as u64, peer_ms),
        "ratio_vs_peer_copy": peer_ms / gather_ms,
        "note": "GB/s count the bytes that cross between the GPUs once"
    }))
}

fn poison(gpu: &Gpu, local: &[DeviceBuffer]) -> Result<(), CudaError> {
    for l in local {
        gpu.memset_async(l.ptr(), 0xEE, l.len())?;
    }
    gpu.synchronize()
}

/// Checks every 7th and the last copied block of every region against the fill pattern.
fn check_blocks(
    gpu: &Gpu,
    local: &[DeviceBuffer],
    src_blocks: &[u32],
    dst_blocks: &[u32],
    bb: u64,
    what: &str,
) -> Result<u64, CudaError> {
    let mut checked = 0u64;
    let mut probe = vec![0u8; bb as usize];
    for (r, l) in local.iter().enumerate() {
        for (i, (&s, &d)) in src_blocks.iter().zip(dst_blocks).enumerate() {
            if i % 7 != 0 && i + 1 != src_blocks.len() {
                continue;
            }
            gpu.download(&mut probe, l.ptr() + d as u64 * bb)?;
            let want = fill_value(r, s);
            if probe.iter().any(|b| *b != want) {
                return Err(CudaError::Invalid(format!(
                    "{what} check failed: region {r} block {s}->{d} does not hold {want:#x}"
                )));
            }
            checked += 1;
        }
    }
    Ok(checked)
}

/// The host-staged path (`StagedCopy`, as backend cuda_ipc runs it without peer access) on
/// the request's blocks, checked, then timed (wall clock) in interleaved rounds against its
/// baselines: the slower of one contiguous device-to-host and one host-to-device copy of the
/// same bytes (each alone), and the two running at once on two streams (what the link does
/// both ways together, which bounds the path where both ends are one GPU). The same path with
/// one stream per GPU (kernels and copies in line) runs in the same rounds.
#[allow(clippy::too_many_arguments)]
fn staged_path(
    spec: &PeerSpec,
    gpu: &Gpu,
    kernel: &mut GatherKernel,
    local: &[DeviceBuffer],
    dst_bases: &[u64],
    src_blocks: &[u32],
    dst_blocks: &[u32],
    iters: u32,
) -> Result<Value, CudaError> {
    let producer = std::sync::Arc::new(Gpu::open(spec.producer_device)?);
    let regions: Vec<ImportedRegion> =
        spec.regions.iter().map(|h| ImportedRegion::open(&producer, h)).collect::<Result<_, _>>()?;
    let src_bases: Vec<u64> = regions.iter().map(|r| r.ptr()).collect();
    let bb = spec.geometry.block_bytes();
    let request = GatherSpec {
        src_bases: &src_bases,
        dst_bases,
        src_blocks,
        dst_blocks,
        block_bytes: bb,
        permute: Permute::None,
    };
    // Tuning knobs of this measurement only (the connector uses the defaults).
    let knob = |name: &str, default: usize| {
        std::env::var(name).ok().and_then(|v| v.parse::<usize>().ok()).filter(|v| *v > 0).unwrap_or(default)
    };
    let config = StagedConfig {
        chunk_bytes: knob("KVC_BENCH_STAGED_CHUNK_MIB", DEFAULT_CHUNK_BYTES >> 20) << 20,
        buffers: knob("KVC_BENCH_STAGED_BUFFERS", DEFAULT_BUFFERS),
        copy_streams: true,
    };
    let mut staged = StagedCopy::configured(producer.clone(), gpu, config)?;
    let mut inline =
        StagedCopy::configured(producer.clone(), gpu, StagedConfig { copy_streams: false, ..config })?;
    let mut checked = 0;
    for (path, name) in [(&mut staged, "staged"), (&mut inline, "staged, one stream per GPU")] {
        poison(gpu, local)?;
        path.copy(gpu, kernel, &request)?;
        gpu.synchronize()?;
        checked += check_blocks(gpu, local, src_blocks, dst_blocks, bb, name)?;
    }
    let bytes = src_blocks.len() * src_bases.len() * bb as usize;
    let src = producer.alloc(bytes)?;
    let dst = gpu.alloc(bytes)?;
    let mut down_host = gpu.alloc_pinned(bytes)?;
    let up_host = gpu.alloc_pinned(bytes)?;
    let d2h = |host: &mut [u8]| {
        // SAFETY: `host` and `src` hold `bytes` bytes each; the caller synchronises the
        // producer's stream before `host` is touched again.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(host, src.ptr(), producer.stream().cu_stream()) }
            .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync", e))
    };
    let h2d = |host: &[u8]| {
        // SAFETY: as above, the other way, on the consumer's stream.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst.ptr(), host, gpu.stream().cu_stream()) }
            .map_err(|e| CudaError::driver("cuMemcpyHtoDAsync", e))
    };
    let wall = |f: &mut dyn FnMut() -> Result<(), CudaError>| -> Result<f64, CudaError> {
        let t = std::time::Instant::now();
        f()?;
        producer.synchronize()?;
        gpu.synchronize()?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    // Rounds of five, each subject's place in the round rotating.
    let rounds = iters.clamp(3, 15) as usize;
    let mut ms: [Vec<f64>; 5] = Default::default();
    for r in 0..=rounds {
        for j in 0..5 {
            let which = (j + r) % 5;
            let t = match which {
                0 => wall(&mut || staged.copy(gpu, kernel, &request))?,
                1 => wall(&mut || inline.copy(gpu, kernel, &request))?,
                2 => wall(&mut || d2h(down_host.as_mut_slice()))?,
                3 => wall(&mut || h2d(up_host.as_slice()))?,
                _ => wall(&mut || {
                    d2h(down_host.as_mut_slice())?;
                    h2d(up_host.as_slice())
                })?,
            };
            // Round 0 warms every subject up.
            if r > 0 {
                ms[which].push(t);
            }
        }
    }
    let best = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let [staged_ms, inline_ms, d2h_ms, h2d_ms, both_ms] = [0, 1, 2, 3, 4].map(|i| best(&ms[i]));
    let baseline_ms = d2h_ms.max(h2d_ms);
    // Per round: the baseline of that round over the subject of that round.
    let per_round = |num: &dyn Fn(usize) -> f64, den: usize| {
        Quartiles::of((0..rounds).map(|r| num(r) / ms[den][r]).collect())
    };
    let one_way = |r: usize| ms[2][r].max(ms[3][r]);
    let both_ways = |r: usize| ms[4][r];
    Ok(json!({
        "path": "pack on the producer's GPU, D2H, H2D, unpack on the consumer's, each on its own stream",
        "chunk_mib": config.chunk_bytes >> 20,
        "buffers": config.buffers,
        "rounds": rounds,
        "blocks_checked": checked,
        "gbps": gbps(bytes as u64, staged_ms),
        "baseline": "the slower of one contiguous D2H and one contiguous H2D of the same bytes",
        "baseline_gbps": gbps(bytes as u64, baseline_ms),
        "ratio": baseline_ms / staged_ms,
        "ratio_per_round": per_round(&one_way, 0),
        "both_ways": "one contiguous D2H and one contiguous H2D of the same bytes at once, on two streams",
        "both_ways_gbps_each": gbps(bytes as u64, both_ms),
        "ratio_both_ways": both_ms / staged_ms,
        "ratio_both_ways_per_round": per_round(&both_ways, 0),
        "one_stream_per_gpu": {
            "gbps": gbps(bytes as u64, inline_ms),
            "ratio": baseline_ms / inline_ms,
            "ratio_per_round": per_round(&one_way, 1),
        },
    }))
}
