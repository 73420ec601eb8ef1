//! flexkv benchmarks, each beside the baseline it is judged against (same run):
//!
//! * `prefix_match`: longest-prefix match of a 2k-block prompt on a tree holding 100k
//!   blocks (absolute figure; target under 50 us), plus the hashing of that prompt;
//! * `cpu_tier`: storing / loading 64 blocks (32 MiB, NHD) through the cache vs memcpy of
//!   the same bytes;
//! * `transpose`: the HND<->NHD adapter copy vs memcpy of the same bytes;
//! * `ssd_tier`: writing / reading 64 block records vs plain sequential file I/O.
//!
//! Run: `cargo bench -p kvconnect-flexkv --bench flexkv -- --warm-up-time 1 --measurement-time 3`

#![allow(unsafe_code)] // The benchmark vouches for its own KV buffers as regions (KvRegion::new).

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvconnect_api::geometry::BlockShape;
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{
    AttentionKind, BlockId, Dtype, EffectiveLayout, KvGroup, KvLayout, KvRegion, KvRegionSpec, LayerId,
    MemoryKind, ModelSpec, TransferMode,
};
use kvconnect_flexkv::adapter::BlockAdapter;
use kvconnect_flexkv::cache::BlockCache;
use kvconnect_flexkv::hash::block_hashes;
use kvconnect_flexkv::ssd_tier::SsdTier;
use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

const LAYERS: u32 = 8;
const PAIRS: usize = 31;

/// Runs `base` and `cand` alternately (order swapped every pair) and prints the median of
/// the per-pair ratios base time / candidate time, i.e. the candidate's throughput relative
/// to the baseline's. Pairing cancels the slow swings of a shared, loaded machine that make
/// two separately measured criterion figures drift apart.
fn paired_ratio(name: &str, target: f64, base: &mut dyn FnMut(), cand: &mut dyn FnMut()) {
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    let mut r: Vec<f64> = (0..PAIRS)
        .map(|i| {
            if i % 2 == 0 {
                let b = time(base);
                b / time(cand)
            } else {
                let c = time(cand);
                time(base) / c
            }
        })
        .collect();
    r.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    println!(
        "RATIO {name}: {:.2}x the baseline's throughput (median of {PAIRS} interleaved pairs, quartiles {:.2}-{:.2}; target >= {target})",
        r[PAIRS / 2],
        r[PAIRS / 4],
        r[3 * PAIRS / 4]
    );
}
const BLOCKS: u32 = 64;

fn model() -> ModelSpec {
    ModelSpec {
        name: "bench".into(),
        num_layers: LAYERS,
        num_kv_heads: 8,
        head_dim: 128,
        dtype: Some(Dtype::Bf16),
        layers: vec![AttentionKind::Full; LAYERS as usize],
        state: None,
    }
}

fn eff(layout: KvLayout) -> EffectiveLayout {
    EffectiveLayout {
        layout,
        hma: false,
        block_size: 16,
        cache_dtype: Dtype::Bf16,
        memory: MemoryKind::Host,
        transfer_mode: TransferMode::None,
        groups: vec![KvGroup { kind: AttentionKind::Full, layers: (0..LAYERS).map(LayerId).collect() }],
        state_groups: vec![],
        opaque_blocks: false,
    }
}

/// Per-layer host regions filled with a pattern, and the KvMemory over them.
struct Regions {
    bufs: Vec<Vec<u8>>,
    mem: KvMemory,
}

fn regions(layout: KvLayout) -> Regions {
    let shape = BlockShape::of(&model(), &eff(layout));
    let len = BLOCKS as usize * shape.layer_block_bytes();
    let mut bufs: Vec<Vec<u8>> =
        (0..LAYERS).map(|l| (0..len).map(|i| (i as u32 ^ l) as u8).collect()).collect();
    let kv: Vec<KvRegion> = KvRegionSpec::per_layer(&mut bufs, BLOCKS)
        .into_iter()
        // SAFETY: `bufs` moves into the returned value beside the KvMemory built from these
        // regions; moving a Vec does not move its heap buffer, and the buffers are not
        // resized while it lives.
        .map(|spec| unsafe { KvRegion::new(spec) })
        .collect();
    let mem = KvMemory::new(&kv, &model(), &eff(layout)).expect("bench regions fit the layout");
    Regions { bufs, mem }
}

fn total_bytes(r: &Regions) -> usize {
    r.bufs.iter().map(|b| b.len()).sum()
}

fn prefix_match(c: &mut Criterion) {
    let bs = 16usize;
    let prompt_blocks = 2048usize;
    // 50 prompts of 2k blocks = 100k blocks, all distinct (different first tokens).
    let cache = BlockCache::new(110_000, 1, None, false, String::new());
    let mut prompts = Vec::new();
    for p in 0..50u32 {
        let toks: Vec<u32> =
            (0..(prompt_blocks * bs) as u32).map(|i| i.wrapping_mul(31) ^ (p << 24)).collect();
        let hashes = block_hashes(7, &toks, bs);
        let mut parent = None;
        for h in &hashes {
            cache
                .store(*h, parent, |b| {
                    b[0] = 1;
                    Ok::<(), ()>(())
                })
                .expect("infallible fill");
            parent = Some(*h);
        }
        prompts.push((toks, hashes));
    }
    assert!(cache.sizes().0 >= 100_000);
    let (toks, hashes) = &prompts[17];
    let mut g = c.benchmark_group("prefix_match");
    g.bench_function("match_2k_blocks_in_100k_tree", |b| {
        b.iter(|| black_box(cache.match_len(black_box(hashes))))
    });
    g.bench_function("match_pin_unpin_2k_blocks_in_100k_tree", |b| {
        b.iter(|| {
            let n = cache.pin_prefix(black_box(hashes), hashes.len());
            cache.unpin(&hashes[..n]);
            n
        })
    });
    g.bench_function("hash_2k_block_prompt", |b| b.iter(|| block_hashes(7, black_box(toks), bs)));
    g.finish();
}

fn cpu_tier(c: &mut Criterion) {
    let src = regions(KvLayout::NHD);
    let dst = regions(KvLayout::NHD);
    let adapter = BlockAdapter::new(&model(), &eff(KvLayout::NHD));
    let bytes = total_bytes(&src);
    let slot = adapter.slot_bytes();
    assert_eq!(slot * BLOCKS as usize, bytes);
    // Room for 2 x 64 blocks: the fixed chain that is loaded, and the store iterations, each
    // of which evicts the previous one's 64 blocks.
    let cache = BlockCache::new(2 * BLOCKS, slot, None, false, String::new());
    let hashes = block_hashes(99, &vec![5u32; BLOCKS as usize], 1);
    let mut parent = None;
    for (i, h) in hashes.iter().enumerate() {
        cache.store(*h, parent, |s| adapter.gather(&src.mem, BlockId(i as u32), s)).expect("gather");
        parent = Some(*h);
    }
    assert_eq!(cache.pin_prefix(&hashes, hashes.len()), BLOCKS as usize);
    let seq = AtomicU64::new(0);
    let mut flat = vec![0u8; bytes];
    let mut memcpy = || {
        let mut off = 0;
        for r in &src.bufs {
            flat[off..off + r.len()].copy_from_slice(r);
            off += r.len();
        }
    };
    let mut store = || {
        let toks: Vec<u32> = vec![seq.fetch_add(1, Ordering::Relaxed) as u32; BLOCKS as usize];
        let chain = block_hashes(1, &toks, 1);
        let mut parent = None;
        for (i, h) in chain.iter().enumerate() {
            cache.store(*h, parent, |s| adapter.gather(&src.mem, BlockId(i as u32), s)).expect("gather");
            parent = Some(*h);
        }
    };
    let (mut scratch, mut tbuf) = (Vec::new(), Vec::new());
    let mut load = || {
        for (i, h) in hashes.iter().enumerate() {
            cache
                .load(*h, &mut scratch, |s| {
                    adapter.scatter(&dst.mem, BlockId(i as u32), s, &mut tbuf).map_err(|e| e.to_string())
                })
                .expect("load");
        }
    };
    let mut g = c.benchmark_group("cpu_tier");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function("memcpy_baseline", |b| b.iter(&mut memcpy));
    g.bench_function("store_64_blocks", |b| b.iter(&mut store));
    g.bench_function("load_64_blocks", |b| b.iter(&mut load));
    g.finish();
    paired_ratio("cpu_tier store (KV -> CPU tier) vs memcpy", 0.7, &mut memcpy, &mut store);
    paired_ratio("cpu_tier load (CPU tier -> KV) vs memcpy", 0.7, &mut memcpy, &mut load);
}

fn transpose(c: &mut Criterion) {
    let hnd = regions(KvLayout::HND);
    let adapter = BlockAdapter::new(&model(), &eff(KvLayout::HND));
    assert!(adapter.transposes());
    let bytes = total_bytes(&hnd);
    let slot = adapter.slot_bytes();
    let mut stored: Vec<Vec<u8>> = (0..BLOCKS).map(|_| vec![0u8; slot]).collect();
    let mut flat = vec![0u8; bytes];
    let mut memcpy = || {
        let mut off = 0;
        for r in &hnd.bufs {
            flat[off..off + r.len()].copy_from_slice(r);
            off += r.len();
        }
    };
    let mut to_nhd = || {
        for (i, s) in stored.iter_mut().enumerate() {
            adapter.gather(&hnd.mem, BlockId(i as u32), s).expect("gather");
        }
    };
    let mut to_hnd_src: Vec<Vec<u8>> = (0..BLOCKS).map(|i| vec![i as u8; slot]).collect();
    let mut tbuf = Vec::new();
    let mut to_hnd = || {
        for (i, s) in to_hnd_src.iter_mut().enumerate() {
            adapter.scatter(&hnd.mem, BlockId(i as u32), s, &mut tbuf).expect("scatter");
        }
    };
    let mut g = c.benchmark_group("transpose");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function("memcpy_baseline", |b| b.iter(&mut memcpy));
    g.bench_function("hnd_to_nhd_64_blocks", |b| b.iter(&mut to_nhd));
    g.bench_function("nhd_to_hnd_64_blocks", |b| b.iter(&mut to_hnd));
    g.finish();
    paired_ratio("transpose HND -> NHD vs memcpy", 0.5, &mut memcpy, &mut to_nhd);
    paired_ratio("transpose NHD -> HND vs memcpy", 0.5, &mut memcpy, &mut to_hnd);
}

fn ssd_tier(c: &mut Criterion) {
    let slot = 512 * 1024;
    let n = BLOCKS as usize;
    let dir = tempfile::tempdir_in(
        std::env::var_os("FLEXKV_BENCH_DIR").unwrap_or_else(|| std::env::temp_dir().into()),
    )
    .expect("bench temp dir");
    let tier = SsdTier::open(&dir.path().join("tier"), "bench", slot, SsdTier::record_bytes(slot) * n as u64)
        .expect("open tier");
    let payloads: Vec<Vec<u8>> = (0..n).map(|i| (0..slot).map(|j| (i * 7 + j) as u8).collect()).collect();
    let plain_path = dir.path().join("plain.bin");
    let plain = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&plain_path)
        .expect("plain file");
    let plain = std::cell::RefCell::new(plain);
    let mut plain_write = || {
        let mut f = plain.borrow_mut();
        f.seek(SeekFrom::Start(0)).expect("seek");
        for p in &payloads {
            f.write_all(p).expect("write");
        }
    };
    // The demotion path: the checksum was taken when the block entered the CPU tier.
    let sums: Vec<u64> = payloads.iter().map(|p| kvconnect_flexkv::hash::checksum(p)).collect();
    let mut tier_write = || {
        for (i, p) in payloads.iter().enumerate() {
            tier.write_summed(i as u32, i as u64, p, sums[i]).expect("tier write");
        }
    };
    let mut tier_write_checksumming = || {
        for (i, p) in payloads.iter().enumerate() {
            tier.write(i as u32, i as u64, p).expect("tier write");
        }
    };
    // The read benchmarks read what these wrote (also when run alone with a filter).
    plain_write();
    tier_write();
    let mut buf = vec![0u8; slot];
    let mut plain_read = || {
        let mut f = plain.borrow_mut();
        f.seek(SeekFrom::Start(0)).expect("seek");
        for _ in 0..n {
            f.read_exact(&mut buf).expect("read");
        }
    };
    let mut rbuf = Vec::new();
    let mut tier_read = || {
        for i in 0..n {
            black_box(tier.read(i as u32, i as u64, &mut rbuf).expect("tier read"));
        }
    };
    // Reference: the same records read raw (one pread each, no checks), to tell the cost of
    // verification from the cost of the file itself.
    let raw = std::fs::File::open(tier.path()).expect("open tier file");
    let mut rawbuf = vec![0u8; SsdTier::record_bytes(slot) as usize];
    let mut raw_read = || {
        use std::os::unix::fs::FileExt;
        for i in 0..n {
            raw.read_exact_at(&mut rawbuf, i as u64 * tier.record()).expect("raw read");
        }
    };
    let hot = vec![7u8; 128 * 1024];
    let mut g = c.benchmark_group("ssd_tier");
    g.throughput(Throughput::Bytes((slot * n) as u64));
    g.bench_function(BenchmarkId::new("write", "plain_sequential"), |b| b.iter(&mut plain_write));
    g.bench_function(BenchmarkId::new("write", "tier_records"), |b| b.iter(&mut tier_write));
    g.bench_function(BenchmarkId::new("write", "tier_records_checksumming"), |b| {
        b.iter(&mut tier_write_checksumming)
    });
    g.bench_function(BenchmarkId::new("read", "plain_sequential"), |b| b.iter(&mut plain_read));
    g.bench_function(BenchmarkId::new("read", "tier_records_verified"), |b| b.iter(&mut tier_read));
    g.bench_function(BenchmarkId::new("read", "tier_records_raw_pread"), |b| b.iter(&mut raw_read));
    g.bench_function("checksum_hot_128k_x256", |b| {
        b.iter(|| {
            (0..256).map(|_| kvconnect_flexkv::hash::checksum(black_box(&hot))).fold(0u64, |a, c| a ^ c)
        })
    });
    g.bench_function("checksum_cold_32MiB", |b| {
        b.iter(|| payloads.iter().map(|p| kvconnect_flexkv::hash::checksum(p)).fold(0u64, |a, c| a ^ c))
    });
    g.finish();
    paired_ratio(
        "ssd_tier write (records, checksum taken at store) vs sequential write",
        0.7,
        &mut plain_write,
        &mut tier_write,
    );
    paired_ratio(
        "ssd_tier write (records, checksummed while writing) vs sequential write",
        0.7,
        &mut plain_write,
        &mut tier_write_checksumming,
    );
    paired_ratio(
        "ssd_tier read (records, verified) vs sequential read",
        0.7,
        &mut plain_read,
        &mut tier_read,
    );
    paired_ratio(
        "ssd_tier read (records, verified) vs raw pread of the same records",
        0.7,
        &mut raw_read,
        &mut tier_read,
    );
}

criterion_group!(benches, prefix_match, cpu_tier, transpose, ssd_tier);
criterion_main!(benches);
