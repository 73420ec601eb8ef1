//! lmcache benchmarks, each subject beside the baseline it is judged against, measured in the
//! same run as interleaved pairs (`kvconnect_support::stats::interleaved`: the order alternates
//! within a pair) and reported as the median ratio baseline time / subject time with its
//! quartiles, with the machine's cores and load average before and after:
//!
//! * `cpu_tier`: a prompt's chunks (2 x 8 MiB) saved through the worker half and loaded back
//!   into other blocks, vs a memcpy of the same bytes block by block out of the regions and
//!   back into other blocks (the faster of glibc's and streaming stores, as the tier streams);
//! * `disk_tier`: an 8 MiB chunk written through the disk tier (header, checksum taken in the
//!   same pass as the write, fsync, rename, directory fsync, index, LRU budget) and read back
//!   (checked in the same pass as the read), vs a plain file of the same bytes created,
//!   written, fsync'd with its directory (the same durability) and read back;
//! * `lookup`: `get_num_new_matched_tokens` on a fully stored 32k-token prompt (absolute;
//!   goal under 10 us), and the key chain alone.
//!
//! Every copy's bytes are checked. The copies run on one thread, and so do their baselines.
//!
//! Run: `cargo bench -p kvconnect-lmcache --bench lmcache [-- PART...]` (parts `cpu_tier`,
//! `disk_tier`, `lookup`; all by default; `LMCACHE_BENCH_PAIRS` sets the pairs, 21 by
//! default). Without `--bench` (as `cargo test` runs it) every part runs once at a tiny size,
//! checking its bytes.

#![allow(unsafe_code)] // The benchmark vouches for its own KV buffers as regions (KvRegion::new).

use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{
    AttentionKind, BlockId, BlocksPerGroup, ConnectorContext, ConnectorFactory, Dtype, EffectiveLayout,
    KvGroup, KvLayout, KvRegion, KvRegionSpec, KvRole, KvTransferConfig, LayerId, MatchResult, MemoryKind,
    ModelSpec, Request, RequestId, SchedulerConnector, StepInfo, TransferMode, WorkerConnector,
};
use kvconnect_lmcache::disk_tier::DiskTier;
use kvconnect_lmcache::key::ChunkKey;
use kvconnect_lmcache::LmcacheFactory;
use kvconnect_support::stats::{
    bench_part, interleaved_against_fastest, interleaved_timed, memcpy_of_pieces, per_call, verdict, Machine,
    Paired, Quartiles, PIECE_COPIERS,
};
use serde_json::json;
use std::io::{Read, Write};

/// The sizes of one run: the benchmark's, or the tiny one of a test run.
struct Size {
    test: bool,
    pairs: usize,
    /// Model of the CPU-tier comparison: layers, KV heads, head dim.
    model: (u32, u32, u32),
    chunk: usize,
    chunks: usize,
    disk_bytes: usize,
    lookup_tokens: usize,
}

impl Size {
    fn from_args() -> Size {
        let Some(pairs) = kvconnect_support::stats::bench_pairs("LMCACHE_BENCH_PAIRS", 21) else {
            return Size {
                test: true,
                pairs: 1,
                model: (2, 2, 16),
                chunk: 32,
                chunks: 2,
                disk_bytes: 4096,
                lookup_tokens: 1024,
            };
        };
        // 8 layers x 8 KV heads x 128 dims x bf16: 32 KiB per token, 8 MiB per 256-token chunk.
        Size {
            test: false,
            pairs,
            model: (8, 8, 128),
            chunk: 256,
            chunks: 2,
            disk_bytes: 8 << 20,
            lookup_tokens: 32 * 1024,
        }
    }

    fn warmup(&self, n: usize) -> usize {
        if self.test {
            0
        } else {
            n
        }
    }
}

fn report(name: &str, goal: f64, p: Paired, bytes: usize, machine: Machine) {
    println!("RATIO {name}: {}; goal >= {goal}: {}; {machine}", p.summary(Some(bytes)), p.verdict(goal));
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
        // A pattern that differs from byte to byte, block to block and region to region, so a
        // block copied to the wrong place is seen.
        let mut buffers: Vec<Vec<u8>> = regions
            .iter()
            .enumerate()
            .map(|(i, r)| {
                (0..geometry.region_bytes(r))
                    .map(|j| ((j as u32).wrapping_mul(2_654_435_761) >> 24) as u8 ^ i as u8)
                    .collect()
            })
            .collect();
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

/// The CPU-tier comparison: a prompt of `chunks` chunks saved through the worker half and
/// loaded back into other blocks, vs the same bytes copied block by block out of the regions
/// into a buffer and back into other blocks.
struct CpuBench {
    e: Engine,
    staging: Vec<u8>,
    chunks: usize,
    chunk: usize,
    seed: u32,
}

/// First block of the loads (the saves use blocks from 0).
const LOAD_AT: u32 = 40;

impl CpuBench {
    fn new(size: &Size, id: &str) -> CpuBench {
        let (layers, heads, dim) = size.model;
        // The CPU tier holds eight saves; its evictions are recycled into later saves.
        let bytes = (size.chunks * size.chunk) as u64 * u64::from(layers * heads * dim) * 2 * 2;
        let budget_gb = (8 * bytes) as f64 / (1u64 << 30) as f64;
        let e = Engine::new(
            id,
            layers,
            heads,
            dim,
            16,
            128,
            json!({"chunk_size": size.chunk, "max_local_cpu_size": budget_gb}),
        );
        CpuBench { e, staging: vec![0u8; bytes as usize], chunks: size.chunks, chunk: size.chunk, seed: 0 }
    }

    fn bytes(&self) -> usize {
        self.staging.len()
    }

    fn lmcache(&mut self) {
        self.seed += 1;
        let seed = self.seed;
        let p: Vec<u32> = (0..(self.chunks * self.chunk + 1) as u32).map(|i| i ^ seed << 16).collect();
        assert_eq!(self.e.request("save", &p, 0), 0);
        assert_eq!(self.e.request("load", &p, LOAD_AT), self.chunks * self.chunk);
    }

    /// The baseline: the same bytes copied block by block out of the regions into one
    /// buffer and back into other blocks, by glibc's memcpy and by streaming
    /// stores (as the subject streams); each way's time in seconds.
    fn memcpy(&mut self) -> Vec<f64> {
        let e = &mut self.e;
        let staging = &mut self.staging;
        let per_block = e.geometry.shape().bytes();
        let nblocks = self.chunks * self.chunk / e.block_size;
        let t = memcpy_of_pieces(|copy| {
            let mut off = 0;
            for buf in e.buffers.iter() {
                for part in 0..2 {
                    for blk in 0..nblocks {
                        let s = e.geometry.span(LayerId(0), part, BlockId(blk as u32)).unwrap();
                        copy(&mut staging[off..off + per_block], &buf[s.offset..s.offset + per_block]);
                        off += per_block;
                    }
                }
            }
            let mut off = 0;
            for buf in e.buffers.iter_mut() {
                for part in 0..2 {
                    for blk in 0..nblocks {
                        let s = e.geometry.span(LayerId(0), part, BlockId(LOAD_AT + blk as u32)).unwrap();
                        copy(&mut buf[s.offset..s.offset + per_block], &staging[off..off + per_block]);
                        off += per_block;
                    }
                }
            }
        });
        std::hint::black_box(&mut self.e.buffers);
        t
    }

    /// Checks that the blocks at `LOAD_AT` hold what the saved blocks hold, then scrambles
    /// them so the next check sees only the next copy's bytes.
    fn check_and_clear(&mut self, what: &str) {
        let e = &mut self.e;
        let per_block = e.geometry.shape().bytes();
        for (r, buf) in e.buffers.iter_mut().enumerate() {
            for part in 0..2 {
                for blk in 0..(self.chunks * self.chunk / e.block_size) as u32 {
                    let a = e.geometry.span(LayerId(0), part, BlockId(blk)).unwrap().offset;
                    let b = e.geometry.span(LayerId(0), part, BlockId(LOAD_AT + blk)).unwrap().offset;
                    assert!(
                        buf[a..a + per_block] == buf[b..b + per_block],
                        "{what}: region {r} part {part} block {blk} was not copied back intact"
                    );
                    buf[b..b + per_block].fill(0xa5);
                }
            }
        }
    }
}

/// The disk-tier comparison: a chunk written and read back through the disk tier (budget of
/// four chunks), vs a plain file of the same bytes created, written, made as durable (fsync
/// of the file and of its directory) and read back (the file four writes back removed).
struct DiskBench {
    _dir: tempfile::TempDir,
    tier: DiskTier,
    plain: std::path::PathBuf,
    plain_dir: std::fs::File,
    data: Vec<u8>,
    i: u64,
    j: u64,
}

impl DiskBench {
    fn new(size: &Size) -> DiskBench {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..size.disk_bytes).map(|i| (i * 31 % 251) as u8).collect();
        let budget = 4 * (size.disk_bytes + kvconnect_lmcache::disk_tier::FILE_OVERHEAD) as u64;
        let (tier, _) = DiskTier::open(&dir.path().join("tier"), budget).unwrap();
        let plain = dir.path().join("plain");
        std::fs::create_dir_all(&plain).unwrap();
        let plain_dir = std::fs::File::open(&plain).unwrap();
        DiskBench { _dir: dir, tier, plain, plain_dir, data, i: 0, j: 0 }
    }

    fn lmcache(&mut self) {
        self.i += 1;
        let k = ChunkKey([self.i, 7]);
        self.tier.write(k, &self.data).unwrap();
        let back = self.tier.read(&k).unwrap().unwrap();
        assert!(back.data() == self.data.as_slice(), "the disk tier gave back other bytes");
    }

    fn plain(&mut self) {
        self.j += 1;
        let p = self.plain.join(format!("{}.bin", self.j));
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(&self.data).unwrap();
        f.sync_all().unwrap();
        self.plain_dir.sync_all().unwrap();
        drop(f);
        let mut back = Vec::new();
        std::fs::File::open(&p).unwrap().read_to_end(&mut back).unwrap();
        assert!(back == self.data, "the plain file gave back other bytes");
        if self.j > 4 {
            let _ = std::fs::remove_file(self.plain.join(format!("{}.bin", self.j - 4)));
        }
    }
}

fn cpu_tier(size: &Size) {
    let mut b = CpuBench::new(size, "bench-cpu");
    let bytes = 2 * b.bytes();
    // Until the tier is full its saves take fresh memory; the warm-up fills it (eight saves).
    let warmup = size.warmup(9);
    let cell = std::cell::RefCell::new(&mut b);
    let m = Machine::start();
    let (p, way) = interleaved_against_fastest(
        size.pairs,
        warmup,
        || cell.borrow_mut().memcpy(),
        || cell.borrow_mut().lmcache(),
    );
    report(
        &format!("cpu tier save+load vs memcpy out and back ({})", PIECE_COPIERS[way]),
        0.9,
        p,
        bytes,
        m.finish(),
    );
    b.lmcache();
    b.check_and_clear("lmcache");
    b.memcpy();
    b.check_and_clear("memcpy");
}

fn disk_tier(size: &Size) {
    let mut b = DiskBench::new(size);
    let bytes = 2 * b.data.len();
    let cell = std::cell::RefCell::new(&mut b);
    let m = Machine::start();
    let p = interleaved_timed(
        size.pairs,
        size.warmup(2),
        || cell.borrow_mut().plain(),
        || cell.borrow_mut().lmcache(),
    );
    report("disk tier write+read vs plain file write+fsync+read", 0.9, p, bytes, m.finish());
}

fn absolute(name: &str, q: &Quartiles, samples: usize, goal_us: Option<f64>) {
    let goal = goal_us
        .map_or(String::new(), |g| format!("; goal < {g} us: {}", verdict(samples, q.median * 1e6 < g)));
    println!(
        "TIME {name}: {:.2} us (median of {samples} samples, quartiles {:.2} .. {:.2}){goal}",
        q.median * 1e6,
        q.q1 * 1e6,
        q.q3 * 1e6
    );
}

fn lookup(size: &Size) {
    // A small model, so the stored chunks stay small; lookup cost does not depend on it.
    let tokens = size.lookup_tokens;
    let blocks = (tokens / 16) as u32 + 64;
    let mut e = Engine::new("bench-lookup", 1, 1, 8, 16, blocks, json!({"chunk_size": 256}));
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
    let (samples, iters) = if size.test { (1, 1) } else { (31, 500) };
    let m = Machine::start();
    let q = per_call(samples, iters, || {
        std::hint::black_box(e.sched.get_num_new_matched_tokens(std::hint::black_box(&req), 0).unwrap());
    });
    absolute(
        &format!("get_num_new_matched_tokens, {tokens}-token prompt all stored"),
        &q,
        samples,
        Some(10.0),
    );
    let ns = kvconnect_lmcache::key::Namespace([1, 2]);
    let q = per_call(samples, iters, || {
        std::hint::black_box(kvconnect_lmcache::key::chunk_keys(ns, std::hint::black_box(&p), 256, false));
    });
    absolute(&format!("  of which the key chain of the {tokens} tokens"), &q, samples, None);
    println!("  ({})", m.finish());
}

fn main() {
    let size = Size::from_args();
    let all = Machine::start();
    println!(
        "lmcache bench ({}; {} pairs per ratio): {all}",
        if size.test { "test run, tiny sizes" } else { "full sizes" },
        size.pairs
    );
    if bench_part("cpu_tier") {
        cpu_tier(&size);
    }
    if bench_part("disk_tier") {
        disk_tier(&size);
    }
    if bench_part("lookup") {
        lookup(&size);
    }
    println!("lmcache bench done: {}", all.finish());
}
