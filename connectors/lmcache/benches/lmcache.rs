//! lmcache benchmarks, each against a baseline measured in the same run:
//! * `cpu_tier`: save a prompt's chunks through the worker half and load them back into other
//!   blocks, vs a plain memcpy of the same bytes out of and back into the regions;
//! * `disk_tier`: write and read a chunk through the disk tier (header, checksum, rename,
//!   index, LRU budget), vs a plain sequential file write and read of the same bytes;
//! * `lookup`: `get_num_new_matched_tokens` on a fully stored 32k-token prompt (target < 50 µs).
//!
//! Ratios (baseline time / lmcache time; 1.0 = as fast as the baseline) are printed at the
//! end, each the median of 30 alternating subject/baseline pairs, so both see the same load
//! on a shared machine. Run: `cargo bench -p kvconnect-lmcache --bench lmcache -- --warm-up-time 1 --measurement-time 3`

#![allow(unsafe_code)] // The benchmark vouches for its own KV buffers as regions (KvRegion::new).

use criterion::{criterion_group, Criterion, Throughput};
use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{
    AttentionKind, BlockId, BlocksPerGroup, ConnectorContext, ConnectorFactory, Dtype, EffectiveLayout,
    KvGroup, KvLayout, KvRegion, KvRegionSpec, KvRole, KvTransferConfig, LayerId, MatchResult, MemoryKind,
    ModelSpec, Request, RequestId, SchedulerConnector, StepInfo, TransferMode, WorkerConnector,
};
use kvconnect_lmcache::disk_tier::DiskTier;
use kvconnect_lmcache::key::ChunkKey;
use kvconnect_lmcache::LmcacheFactory;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Per-iteration times of every timed batch, per benchmark, for the ratios.
/// Samples per benchmark (criterion's sample size, the same for every benchmark here).
const SAMPLES: usize = 10;

static TIMES: Mutex<BTreeMap<&'static str, Vec<f64>>> = Mutex::new(BTreeMap::new());

fn record(name: &'static str, d: Duration, iters: u64) -> Duration {
    let mut t = TIMES.lock().unwrap();
    t.entry(name).or_default().push(d.as_secs_f64() / iters.max(1) as f64);
    d
}

/// The median per-iteration time over the last `SAMPLES` batches (criterion's samples; the
/// warm-up batches before them are left out).
fn median(name: &str) -> f64 {
    let t = TIMES.lock().unwrap();
    let Some(v) = t.get(name) else { return f64::NAN };
    let mut v = v[v.len().saturating_sub(SAMPLES)..].to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Engine {
    sched: Box<dyn SchedulerConnector>,
    worker: Box<dyn WorkerConnector>,
    geometry: Geometry,
    buffers: Vec<Vec<u8>>,
    block_size: usize,
    num_blocks: u32,
    step: u64,
}

impl Engine {
    fn new(
        id: &str,
        layers: u32,
        heads: u32,
        head_dim: u32,
        block_size: u32,
        num_blocks: u32,
        extra: serde_json::Value,
    ) -> Engine {
        let model = ModelSpec {
            name: "bench".into(),
            num_layers: layers,
            num_kv_heads: heads,
            head_dim,
            dtype: Some(Dtype::Bf16),
            layers: vec![AttentionKind::Full; layers as usize],
            state: None,
        };
        let effective = EffectiveLayout {
            layout: KvLayout::NHD,
            hma: false,
            block_size,
            cache_dtype: Dtype::Bf16,
            memory: MemoryKind::Host,
            transfer_mode: TransferMode::None,
            groups: vec![KvGroup { kind: AttentionKind::Full, layers: (0..layers).map(LayerId).collect() }],
            state_groups: vec![],
            opaque_blocks: false,
        };
        let mut config = KvTransferConfig::named("LMCacheConnectorV1");
        config.kv_connector_extra_config = extra.as_object().cloned().unwrap();
        let ctx = ConnectorContext {
            config,
            model: model.clone(),
            effective: effective.clone(),
            role: KvRole::Both,
            engine_id: id.to_owned(),
            tp_rank: 0,
            tp_size: 1,
        };
        let sched = LmcacheFactory.create_scheduler(&ctx).unwrap();
        let mut worker = LmcacheFactory.create_worker(&ctx).unwrap();
        let shape = BlockShape::of(&model, &effective);
        let regions: Vec<RegionShape> =
            (0..layers).map(|l| RegionShape { layers: vec![LayerId(l)], num_blocks }).collect();
        let geometry = Geometry::new(shape, KvLayout::NHD, regions.clone());
        let mut buffers: Vec<Vec<u8>> =
            regions.iter().enumerate().map(|(i, r)| vec![i as u8 + 1; geometry.region_bytes(r)]).collect();
        let kv: Vec<KvRegion> = KvRegionSpec::per_layer(&mut buffers, num_blocks)
            .into_iter()
            // SAFETY: the buffers move into the returned Engine after its worker, so they are
            // dropped after it; moving a Vec does not move its heap buffer.
            .map(|spec| unsafe { KvRegion::new(spec) })
            .collect();
        worker.register_kv_caches(&kv).unwrap();
        Engine { sched, worker, geometry, buffers, block_size: block_size as usize, num_blocks, step: 0 }
    }

    /// One request: lookup, allocation at `first_block`, meta, load, save. Returns matched.
    fn request(&mut self, id: &str, tokens: &[u32], first_block: u32) -> usize {
        let req = Request {
            id: RequestId(id.to_owned()),
            prompt_tokens: tokens.to_vec(),
            kv_transfer_params: Default::default(),
        };
        let m = match self.sched.get_num_new_matched_tokens(&req, 0).unwrap() {
            MatchResult::Matched { tokens, .. } => tokens,
            MatchResult::Pending => 0,
        };
        let n = tokens.len().div_ceil(self.block_size) as u32;
        let blocks: Vec<BlockId> =
            (first_block..first_block + n).map(|b| BlockId(b % self.num_blocks)).collect();
        self.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![blocks]), m).unwrap();
        self.step += 1;
        let meta =
            self.sched.build_connector_meta(&StepInfo { step: self.step, ..StepInfo::default() }).unwrap();
        self.worker.bind_connector_meta(&meta).unwrap();
        self.worker.start_load_kv().unwrap();
        self.worker.wait_for_save().unwrap();
        self.sched.request_finished(&req, &BlocksPerGroup::default()).unwrap();
        m
    }
}

/// The CPU-tier comparison: a prompt of two 256-token chunks saved through the worker half
/// and loaded back into other blocks, vs the same bytes copied block by block out of the
/// regions into a buffer and back into other blocks.
struct CpuBench {
    e: Engine,
    staging: Vec<u8>,
    seed: u32,
}

const CPU_CHUNKS: usize = 2;
/// 8 layers x 8 KV heads x 128 dims x bf16: 32 KiB per token, 8 MiB per 256-token chunk.
const CPU_BYTES: usize = CPU_CHUNKS * 256 * 8 * 2 * 8 * 128 * 2;

impl CpuBench {
    fn new(id: &str) -> CpuBench {
        let e = Engine::new(id, 8, 8, 128, 16, 128, json!({"chunk_size": 256, "max_local_cpu_size": 0.125}));
        CpuBench { e, staging: vec![0u8; CPU_BYTES], seed: 0 }
    }

    fn lmcache(&mut self) {
        self.seed += 1;
        let seed = self.seed;
        let p: Vec<u32> = (0..(CPU_CHUNKS * 256 + 1) as u32).map(|i| i ^ seed << 16).collect();
        assert_eq!(self.e.request("save", &p, 0), 0);
        assert_eq!(self.e.request("load", &p, 40), CPU_CHUNKS * 256);
    }

    fn memcpy(&mut self) {
        let e = &mut self.e;
        let per_block = e.geometry.shape().bytes();
        let nblocks = CPU_CHUNKS * 256 / e.block_size;
        let mut off = 0;
        for buf in e.buffers.iter() {
            for part in 0..2 {
                for blk in 0..nblocks {
                    let s = e.geometry.span(LayerId(0), part, BlockId(blk as u32)).unwrap();
                    self.staging[off..off + per_block].copy_from_slice(&buf[s.offset..s.offset + per_block]);
                    off += per_block;
                }
            }
        }
        let mut off = 0;
        for buf in e.buffers.iter_mut() {
            for part in 0..2 {
                for blk in 0..nblocks {
                    let s = e.geometry.span(LayerId(0), part, BlockId(40 + blk as u32)).unwrap();
                    buf[s.offset..s.offset + per_block].copy_from_slice(&self.staging[off..off + per_block]);
                    off += per_block;
                }
            }
        }
        std::hint::black_box(&mut e.buffers);
    }
}

/// The disk-tier comparison: an 8 MiB chunk written and read back through the disk tier
/// (header, checksum, rename, index, LRU budget of four chunks) vs `std::fs::write` and
/// `std::fs::read` of the same bytes (deleting the file four writes back).
struct DiskBench {
    _dir: tempfile::TempDir,
    tier: DiskTier,
    plain: std::path::PathBuf,
    data: Vec<u8>,
    i: u64,
    j: u64,
}

const DISK_BYTES: usize = 8 << 20;

impl DiskBench {
    fn new() -> DiskBench {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..DISK_BYTES).map(|i| (i * 31 % 251) as u8).collect();
        let budget = 4 * (DISK_BYTES + kvconnect_lmcache::disk_tier::FILE_OVERHEAD) as u64;
        let (tier, _) = DiskTier::open(&dir.path().join("tier"), budget).unwrap();
        let plain = dir.path().join("plain");
        std::fs::create_dir_all(&plain).unwrap();
        DiskBench { _dir: dir, tier, plain, data, i: 0, j: 0 }
    }

    fn lmcache(&mut self) {
        self.i += 1;
        let k = ChunkKey([self.i, 7]);
        self.tier.write(k, &self.data).unwrap();
        let back = self.tier.read(&k).unwrap().unwrap();
        assert_eq!(back.data().len(), DISK_BYTES);
    }

    fn plain(&mut self) {
        self.j += 1;
        let p = self.plain.join(format!("{}.bin", self.j));
        std::fs::write(&p, &self.data).unwrap();
        let back = std::fs::read(&p).unwrap();
        assert_eq!(back.len(), DISK_BYTES);
        if self.j > 4 {
            let _ = std::fs::remove_file(self.plain.join(format!("{}.bin", self.j - 4)));
        }
    }
}

fn timed(iters: u64, mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed()
}

fn cpu_tier(c: &mut Criterion) {
    let mut b = CpuBench::new("bench-cpu");
    let mut g = c.benchmark_group("cpu_tier");
    g.throughput(Throughput::Bytes(2 * CPU_BYTES as u64)).sample_size(SAMPLES);
    g.bench_function("lmcache_save_then_load", |x| x.iter_custom(|n| timed(n, || b.lmcache())));
    g.bench_function("memcpy_baseline", |x| x.iter_custom(|n| timed(n, || b.memcpy())));
    g.finish();
}

fn disk_tier(c: &mut Criterion) {
    let mut b = DiskBench::new();
    let mut g = c.benchmark_group("disk_tier");
    g.throughput(Throughput::Bytes(2 * DISK_BYTES as u64)).sample_size(SAMPLES);
    g.bench_function("lmcache_write_then_read", |x| x.iter_custom(|n| timed(n, || b.lmcache())));
    g.bench_function("plain_file_baseline", |x| x.iter_custom(|n| timed(n, || b.plain())));
    g.finish();
}

/// The ratio baseline/subject from `rounds` alternating pairs (median of the per-pair
/// ratios), so both sides see the same load on a shared machine.
fn paired(rounds: usize, mut subject: impl FnMut(), mut baseline: impl FnMut()) -> (f64, f64, f64) {
    for _ in 0..3 {
        subject();
        baseline();
    }
    let (mut rs, mut ss, mut bs) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let s = timed(1, &mut subject).as_secs_f64();
        let b = timed(1, &mut baseline).as_secs_f64();
        rs.push(b / s);
        ss.push(s);
        bs.push(b);
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    (med(rs), med(ss), med(bs))
}

fn lookup(c: &mut Criterion) {
    // A small model, so 128 stored chunks stay small; lookup cost does not depend on it.
    let tokens = 32 * 1024;
    let mut e = Engine::new("bench-lookup", 1, 1, 8, 16, 2048 + 64, json!({"chunk_size": 256}));
    let p: Vec<u32> = (0..tokens as u32).map(|i| i.wrapping_mul(2654435761) % 128_000).collect();
    e.request("fill", &p, 0);
    let req = Request {
        id: RequestId("q".into()),
        prompt_tokens: p.clone(),
        kv_transfer_params: Default::default(),
    };
    assert_eq!(
        e.sched.get_num_new_matched_tokens(&req, 0).unwrap(),
        MatchResult::Matched { tokens: tokens - 1, async_load: false }
    );
    let mut g = c.benchmark_group("lookup");
    g.sample_size(SAMPLES);
    // Where the time goes: the key chain alone.
    let ns = kvconnect_lmcache::key::Namespace([1, 2]);
    g.bench_function("chunk_keys_32k", |b| {
        b.iter(|| std::hint::black_box(kvconnect_lmcache::key::chunk_keys(ns, &p, 256, false)))
    });
    g.throughput(Throughput::Bytes(4 * tokens as u64));
    g.bench_function("hash_tokens_32k", |b| {
        b.iter(|| {
            std::hint::black_box(kvconnect_lmcache::hash::hash_tokens([1, 2], std::hint::black_box(&p)))
        })
    });
    g.throughput(Throughput::Elements(1));
    g.bench_function("get_num_new_matched_tokens_32k", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                std::hint::black_box(e.sched.get_num_new_matched_tokens(&req, 0).unwrap());
            }
            record("lookup_32k", start.elapsed(), iters)
        })
    });
    g.finish();
}

criterion_group!(benches, cpu_tier, disk_tier, lookup);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    // Ratios from alternating pairs, after criterion's own figures above.
    let mut cpu = CpuBench::new("bench-cpu-paired");
    let cpu_cell = std::cell::RefCell::new(&mut cpu);
    let (r, s, b) = paired(30, || cpu_cell.borrow_mut().lmcache(), || cpu_cell.borrow_mut().memcpy());
    println!("\nlmcache ratios (baseline time / lmcache time; median of 30 alternating pairs, same run):");
    println!(
        "  cpu tier save+load vs memcpy:        {r:.2}x  ({:.2} ms vs {:.2} ms for 16 MiB each way; target >= 0.7x)",
        s * 1e3,
        b * 1e3
    );
    let mut disk = DiskBench::new();
    let disk_cell = std::cell::RefCell::new(&mut disk);
    let (r, s, b) = paired(30, || disk_cell.borrow_mut().lmcache(), || disk_cell.borrow_mut().plain());
    println!(
        "  disk tier write+read vs plain file:  {r:.2}x  ({:.2} ms vs {:.2} ms for 8 MiB each way; target >= 0.7x)",
        s * 1e3,
        b * 1e3
    );
    println!("  lookup of a 32k-token prompt:        {:.1} us (target < 50 us)", median("lookup_32k") * 1e6);
}
