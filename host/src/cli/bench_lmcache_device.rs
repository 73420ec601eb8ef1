//! `kvconnect bench lmcache-device`: the lmcache save of one request whose KV is in GPU
//! memory, against a contiguous device-to-pinned-host copy of the same bytes, in one run.
//!
//! Three figures on the same GPU and request: (a) one `cuMemcpyDtoH` of the request's bytes
//! from one contiguous device buffer into pinned memory (the baseline), (b) the gather of the
//! request's blocks (every layer, K and V, scattered block ids) into the pinned host copy
//! with one kernel launch, (c) the whole lmcache save through the worker half
//! (`save_kv_layer` for every layer, then `wait_for_save`: the gather straight into the
//! pinned CPU tier's chunk slots, pinned at `register_kv_caches` before anything is timed,
//! and the chunks stored). Each is the best of `--repeat`; both ratios are baseline time
//! over measured time. Afterwards the last saved prompt is loaded into other blocks (timed:
//! `start_load_kv`, straight out of the slots) and compared byte for byte, so a fast but
//! wrong save shows. The report says how many chunks went into pinned slots and how many
//! fell back to the heap. Built only with `cuda`.

#![allow(unsafe_code)] // A benchmark harness that vouches for the KV regions it allocates.

use anyhow::Result;
use std::path::PathBuf;

/// Arguments of `bench lmcache-device`.
#[derive(Debug, Clone, clap::Args)]
pub struct LmcacheDeviceArgs {
    /// The model's config.json (the KV contents are synthetic).
    #[arg(long, value_name = "CONFIG.json", default_value = "fixtures/models/Qwen--Qwen3-0.6B/config.json")]
    pub model: PathBuf,
    /// Prompt length in tokens.
    #[arg(long, value_name = "N", default_value_t = 8192)]
    pub tokens: usize,
    /// Measured runs of each figure (after one warm-up); the best is reported.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub repeat: usize,
    /// Tokens per KV block.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub block_size: u32,
    /// lmcache chunk size in tokens.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub chunk_size: u32,
    /// KV layout: NHD or HND.
    #[arg(long, value_name = "NHD|HND", default_value = "NHD")]
    pub layout: String,
    /// GPU ordinal.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub gpu: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[cfg(not(feature = "cuda"))]
pub fn run(_a: &LmcacheDeviceArgs) -> Result<()> {
    anyhow::bail!(
        "this kvconnect was built without GPU support: rebuild it with `cargo build --release -p \
            kvconnect-host --features cuda` to run bench lmcache-device"
    )
}

#[cfg(feature = "cuda")]
pub fn run(a: &LmcacheDeviceArgs) -> Result<()> {
    let report = imp::measure(a)?;
    if a.json {
        println!("{report}");
    } else {
        let f = |k: &str| report.get(k).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
        println!(
            "lmcache save of {} tokens ({} bytes) from GPU {} on {}",
            a.tokens, report["bytes"], a.gpu, report["device"]
        );
        println!("  contiguous D2H to pinned   {:8.1} GB/s  {:8.3} ms", f("baseline_gbps"), f("baseline_ms"));
        println!(
            "  gather into pinned copy    {:8.1} GB/s  {:8.3} ms  {:.2}x baseline",
            f("gather_gbps"),
            f("gather_ms"),
            f("gather_ratio")
        );
        println!(
            "  lmcache save (CPU tier)    {:8.1} GB/s  {:8.3} ms  {:.2}x baseline (target >= 0.8)",
            f("save_gbps"),
            f("save_ms"),
            f("save_ratio")
        );
        println!("  lmcache load (from slots)  {:8.1} GB/s  {:8.3} ms", f("load_gbps"), f("load_ms"));
        println!(
            "  chunks saved into pinned slots: {}, on the heap: {}",
            report["pinned_chunks"], report["heap_chunks"]
        );
        println!("  reloaded into other blocks and compared: {}", report["verified"]);
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod imp {
    use super::LmcacheDeviceArgs;
    use anyhow::{anyhow, bail, Context, Result};
    use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
    use kvconnect_api::{
        BlockId, BlocksPerGroup, ConnectorContext, ConnectorFactory, Dtype, KvLayout, KvRegion, KvRegionSpec,
        KvRole, KvTransferConfig, LayerId, MatchResult, MemoryKind, ModelSpec, Request, RequestId,
        SchedulerConnector, StepInfo, WorkerConnector,
    };
    use kvconnect_cuda::{DeviceBuffer, Gpu, KvStage};
    use kvconnect_engine::local_effective_layout;
    use kvconnect_lmcache::LmcacheFactory;
    use serde_json::{json, Value};
    use std::sync::Arc;
    use std::time::Instant;

    fn gbps(bytes: usize, ms: f64) -> f64 {
        bytes as f64 / (ms * 1e-3) / 1e9
    }

    fn best(repeat: usize, mut f: impl FnMut(usize) -> Result<f64>) -> Result<f64> {
        f(0)?;
        let mut best = f64::INFINITY;
        for i in 1..=repeat.max(1) {
            best = best.min(f(i)?);
        }
        Ok(best)
    }

    /// One request through the scheduler and worker; returns the milliseconds of the save
    /// (`save_kv_layer` for every layer and `wait_for_save`), of the load (`start_load_kv`)
    /// and the matched tokens.
    #[allow(clippy::too_many_arguments)]
    fn request(
        sched: &mut dyn SchedulerConnector,
        worker: &mut dyn WorkerConnector,
        step: u64,
        id: &str,
        tokens: &[u32],
        blocks: &[BlockId],
        layers: &[LayerId],
    ) -> Result<(f64, f64, usize)> {
        let req = Request {
            id: RequestId(id.to_owned()),
            prompt_tokens: tokens.to_vec(),
            kv_transfer_params: Default::default(),
        };
        let matched = match sched.get_num_new_matched_tokens(&req, 0)? {
            MatchResult::Matched { tokens, .. } => tokens,
            MatchResult::Pending => bail!("lmcache answered Pending"),
        };
        let table = BlocksPerGroup(vec![blocks.to_vec()]);
        sched.update_state_after_alloc(&req, &table, matched)?;
        let meta = sched.build_connector_meta(&StepInfo {
            step,
            scheduled: vec![req.id.clone()],
            finished: vec![],
        })?;
        worker.bind_connector_meta(&meta)?;
        let t = Instant::now();
        worker.start_load_kv()?;
        let load_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        for l in layers {
            worker.save_kv_layer(*l, blocks)?;
        }
        worker.wait_for_save()?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        worker.get_finished(std::slice::from_ref(&req.id))?;
        sched.request_finished(&req, &table)?;
        Ok((ms, load_ms, matched))
    }

    pub fn measure(a: &LmcacheDeviceArgs) -> Result<Value> {
        let text =
            std::fs::read_to_string(&a.model).with_context(|| format!("model {}", a.model.display()))?;
        let model =
            ModelSpec::from_hf_config_json(&text).with_context(|| format!("model {}", a.model.display()))?;
        let layout: KvLayout = a.layout.parse().map_err(|e| anyhow!("--layout: {e}"))?;
        if a.tokens == 0 || a.block_size == 0 {
            bail!("--tokens and --block-size must be positive");
        }
        let mut eff =
            local_effective_layout(&model, layout, false, a.block_size, model.dtype.unwrap_or(Dtype::Bf16));
        eff.memory = MemoryKind::Device;
        let shape = BlockShape::of(&model, &eff);
        let layers = model.kv_layers();
        let n = a.tokens.div_ceil(a.block_size as usize);
        // Twice the request's blocks: saves read every other block (scattered ids), the
        // check loads into the rest.
        let num_blocks = u32::try_from(2 * n + 1).context("--tokens is too large")?;
        let regions_shape: Vec<RegionShape> =
            layers.iter().map(|l| RegionShape { layers: vec![*l], num_blocks }).collect();
        let geometry = Geometry::new(shape, layout, regions_shape);

        let gpu = Arc::new(Gpu::open(a.gpu).map_err(|e| anyhow!("{e}"))?);
        let mut bufs: Vec<DeviceBuffer> = Vec::new();
        let mut regions = Vec::new();
        for (i, r) in geometry.regions().iter().enumerate() {
            let b = gpu.alloc(geometry.region_bytes(r)).map_err(|e| anyhow!("{e}"))?;
            // Distinct bytes per region and block position: a misplaced block shows.
            let mut fill = vec![0u8; b.len()];
            for (j, x) in fill.iter_mut().enumerate() {
                *x = ((j / 4096) as u8).wrapping_mul(31) ^ (i as u8).wrapping_mul(7) ^ (j as u8);
            }
            gpu.upload(b.ptr(), &fill).map_err(|e| anyhow!("{e}"))?;
            let spec = KvRegionSpec {
                name: format!("layer.{}", r.layers[0].0),
                addr: b.ptr(),
                len: b.len() as u64,
                memory: MemoryKind::Device,
                device: a.gpu as i32,
                layers: r.layers.clone(),
                group: 0,
                num_blocks,
                shm_name: None,
            };
            // SAFETY: the region is `b`, a live allocation on GPU `a.gpu` that `bufs` keeps
            // until the end of this function, after the stage and connectors using it are gone.
            regions.push(unsafe { KvRegion::new(spec) });
            bufs.push(b);
        }
        let save_ids: Vec<BlockId> = (0..n as u32).map(|i| BlockId(2 * (n as u32 - 1 - i))).collect();
        let bytes = n * layers.len() * shape.layer_block_bytes();

        // (a) one contiguous device-to-pinned copy of the same bytes.
        let src = gpu.alloc(bytes).map_err(|e| anyhow!("{e}"))?;
        let mut pinned = gpu.alloc_pinned(bytes).map_err(|e| anyhow!("{e}"))?;
        // Wall clock, like (b) and (c): enqueue, copy, synchronise.
        let baseline_ms = best(a.repeat, |_| {
            let t = Instant::now();
            gpu.download(pinned.as_mut_slice(), src.ptr()).map_err(|e| anyhow!("{e}"))?;
            Ok(t.elapsed().as_secs_f64() * 1e3)
        })?;
        drop(pinned);
        drop(src);

        // (b) the gather of the request's blocks into the pinned host copy.
        let stage = KvStage::new(gpu.clone(), &regions, &model, &eff).map_err(|e| anyhow!("{e}"))?;
        let gather_ms = best(a.repeat, |_| {
            let t = Instant::now();
            let copy = stage.gather(&save_ids).map_err(|e| anyhow!("{e}"))?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            drop(copy);
            Ok(ms)
        })?;
        drop(stage);

        // (c) the whole lmcache save, a new prompt each time (a stored one is not saved again).
        let per_request_gb = bytes as f64 / (1u64 << 30) as f64;
        let mut config = KvTransferConfig::named("LMCacheConnectorV1");
        config.kv_connector_extra_config = json!({
            "chunk_size": a.chunk_size,
            "max_local_cpu_size": per_request_gb * (a.repeat as f64 + 3.0),
        })
        .as_object()
        .cloned()
        .unwrap_or_default();
        let ctx = ConnectorContext {
            config,
            model: model.clone(),
            effective: eff.clone(),
            role: KvRole::Both,
            engine_id: format!("bench-lmcache-device-{}", std::process::id()),
            tp_rank: 0,
            tp_size: 1,
        };
        let mut sched = LmcacheFactory.create_scheduler(&ctx)?;
        let mut worker = LmcacheFactory.create_worker(&ctx)?;
        worker.register_kv_caches(&regions)?;
        let prompt = |seed: usize| -> Vec<u32> {
            (0..a.tokens as u32)
                .map(|i| (seed as u32).wrapping_mul(7919).wrapping_add(i * 13 + 1) % 100_000)
                .collect()
        };
        let mut last = 0;
        let save_ms = best(a.repeat, |i| {
            last = i;
            let (ms, _, matched) = request(
                &mut *sched,
                &mut *worker,
                1 + i as u64,
                &format!("save-{i}"),
                &prompt(i),
                &save_ids,
                &layers,
            )?;
            if matched != 0 {
                bail!("prompt {i} matched {matched} tokens: the timed save would not store anything");
            }
            Ok(ms)
        })?;

        // Check: the last prompt loads into the other blocks with the saved bytes.
        let load_ids: Vec<BlockId> = (0..n as u32).map(|i| BlockId(2 * i + 1)).collect();
        let (_, load_ms, matched) =
            request(&mut *sched, &mut *worker, 1000, "check", &prompt(last), &load_ids, &layers)?;
        let stats = kvconnect_lmcache::stats(&ctx.engine_id)
            .ok_or_else(|| anyhow!("the lmcache store of the bench closed early"))?;
        let bs = a.block_size as usize;
        let full = matched / bs;
        let mut verified = matched > 0;
        let blk = shape.bytes();
        let mut got = vec![0u8; blk];
        let mut want = vec![0u8; blk];
        for (li, l) in layers.iter().enumerate() {
            for part in 0..shape.kv_parts {
                for i in (0..full).step_by(7.max(full / 64).max(1)) {
                    let s = geometry.span(*l, part, save_ids[i])?;
                    let d = geometry.span(*l, part, load_ids[i])?;
                    gpu.download(&mut want, bufs[li].ptr() + s.offset as u64).map_err(|e| anyhow!("{e}"))?;
                    gpu.download(&mut got, bufs[li].ptr() + d.offset as u64).map_err(|e| anyhow!("{e}"))?;
                    verified &= got == want;
                }
            }
        }
        worker.shutdown()?;
        if !verified {
            bail!(
                "the reloaded blocks differ from the saved ones (matched {matched} tokens): the save is \
                wrong"
            );
        }
        Ok(json!({
            "device": gpu.name(),
            "model": model.name,
            "tokens": a.tokens,
            "layout": layout.display_name(),
            "block_size": a.block_size,
            "chunk_size": a.chunk_size,
            "bytes": bytes,
            "blocks": n,
            "layers": layers.len(),
            "baseline": "one contiguous cuMemcpyDtoH of the request's bytes into pinned memory",
            "baseline_ms": baseline_ms,
            "baseline_gbps": gbps(bytes, baseline_ms),
            "gather_ms": gather_ms,
            "gather_gbps": gbps(bytes, gather_ms),
            "gather_ratio": baseline_ms / gather_ms,
            "save_ms": save_ms,
            "save_gbps": gbps(bytes, save_ms),
            "save_ratio": baseline_ms / save_ms,
            "save_target_ratio": 0.8,
            "load_ms": load_ms,
            "load_gbps": gbps(matched / bs * blk * layers.len() * shape.kv_parts as usize, load_ms),
            "pinned_chunks": stats.pinned_chunks_saved,
            "heap_chunks": stats.pinned_fallback_chunks,
            "verified": verified,
            "verified_tokens": full * bs,
        }))
    }
}
