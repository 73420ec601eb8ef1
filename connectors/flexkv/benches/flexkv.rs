//! flexkv benchmarks, each subject beside the baseline it is judged against, measured in the
//! same run as interleaved pairs (`kvconnect_support::stats::interleaved`: the order alternates
//! within a pair) and reported as the median ratio baseline time / subject time with its
//! quartiles, with the machine's cores and load average before and after:
//!
//! * `cpu_tier`: storing 64 blocks (32 MiB, NHD) into the cache (copy and checksum in one
//!   pass) and loading them back into other blocks, each vs a memcpy of the same bytes from
//!   the same source (the KV regions for a store, the tier's slots for a load);
//! * `transpose`: the HND -> NHD and NHD -> HND adapter copies vs a memcpy of the same bytes
//!   from the same source (the regions, the stored blocks);
//! * `ssd_tier`: writing 64 block records in the batches a demotion writes, each batch made
//!   durable with one `fdatasync`, vs a sequential write of the same bytes with the same
//!   syncs; and the verified read of the records vs a sequential read of the plain file;
//! * `prefix_match`: the longest-prefix match of a 2k-block prompt on a tree of 100k blocks
//!   (absolute; goal under 10 us), and the hashing of that prompt.
//!
//! Every copy's bytes are checked after its pairs. All copies here run on one thread, and
//! so do their baselines.
//!
//! Run: `cargo bench -p kvconnect-flexkv --bench flexkv` (`FLEXKV_BENCH_DIR` puts the SSD
//! files elsewhere than the temp dir; `FLEXKV_BENCH_PAIRS` sets the pairs, 21 by default).
//! Without `--bench` (as `cargo test` runs it) every part runs once at a tiny size, checking
//! its bytes.

#![allow(unsafe_code)] // The benchmark vouches for its own KV buffers as regions (KvRegion::new).

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
use kvconnect_support::host_buffer::HostBuffer;
use kvconnect_support::stats::{
    interleaved_against_fastest, interleaved_timed, memcpy_of_pieces, per_call, verdict, Machine, Paired,
    Quartiles, PIECE_COPIERS,
};
use std::cell::RefCell;
use std::io::{Read, Seek, SeekFrom, Write};

/// The sizes of one run: the benchmark's, or the tiny one of a test run.
struct Size {
    test: bool,
    pairs: usize,
    layers: u32,
    heads: u32,
    head_dim: u32,
    blocks: u32,
    /// Prompts of `prompt_blocks` blocks in the prefix-match tree.
    prompts: u32,
    prompt_blocks: usize,
}

impl Size {
    fn from_args() -> Size {
        let Some(pairs) = kvconnect_support::stats::bench_pairs("FLEXKV_BENCH_PAIRS", 21) else {
            return Size {
                test: true,
                pairs: 1,
                layers: 2,
                heads: 2,
                head_dim: 64,
                blocks: 4,
                prompts: 2,
                prompt_blocks: 8,
            };
        };
        Size {
            test: false,
            pairs,
            layers: 8,
            heads: 8,
            head_dim: 128,
            blocks: 64,
            prompts: 50,
            prompt_blocks: 2048,
        }
    }

    fn model(&self) -> ModelSpec {
        ModelSpec {
            name: "bench".into(),
            num_layers: self.layers,
            num_kv_heads: self.heads,
            head_dim: self.head_dim,
            dtype: Some(Dtype::Bf16),
            layers: vec![AttentionKind::Full; self.layers as usize],
            state: None,
        }
    }

    fn eff(&self, layout: KvLayout) -> EffectiveLayout {
        EffectiveLayout {
            layout,
            hma: false,
            block_size: 16,
            cache_dtype: Dtype::Bf16,
            memory: MemoryKind::Host,
            transfer_mode: TransferMode::None,
            groups: vec![KvGroup {
                kind: AttentionKind::Full,
                layers: (0..self.layers).map(LayerId).collect(),
            }],
            state_groups: vec![],
            opaque_blocks: false,
        }
    }

    /// Per-layer host regions filled with a pattern (`seed` 0: all zeros), and the KvMemory
    /// over them.
    fn regions(&self, layout: KvLayout, seed: u32) -> Regions {
        let shape = BlockShape::of(&self.model(), &self.eff(layout));
        let len = self.blocks as usize * shape.layer_block_bytes();
        let mut bufs: Vec<Lines> = (0..self.layers)
            .map(|l| {
                Lines::new((0..len).map(|i| {
                    (if seed == 0 { 0 } else { (i as u32).wrapping_mul(2_654_435_761) >> 24 ^ l ^ seed })
                        as u8
                }))
            })
            .collect();
        let kv: Vec<KvRegion> = bufs
            .iter_mut()
            .enumerate()
            .map(|(l, b)| {
                let spec = KvRegionSpec::host(
                    format!("layer.{l}"),
                    b.bytes_mut(),
                    vec![LayerId(l as u32)],
                    0,
                    self.blocks,
                );
                // SAFETY: `bufs` moves into the returned value beside the KvMemory built from
                // these regions; moving a Vec does not move its heap buffer, and the buffers
                // are not resized while it lives.
                unsafe { KvRegion::new(spec) }
            })
            .collect();
        let mem = KvMemory::new(&kv, &self.model(), &self.eff(layout)).expect("bench regions fit the layout");
        Regions { bufs, mem }
    }
}

/// Bytes allocated as the engine allocates KV regions (line and page aligned, on huge pages
/// where the kernel gives them): the regions, and the baselines' buffers, which must be as
/// well placed. (flexkv's CPU tier slots are placed the same way.)
struct Lines(HostBuffer);

impl Lines {
    fn new(bytes: impl ExactSizeIterator<Item = u8>) -> Lines {
        let mut buf = HostBuffer::zeroed(bytes.len()).expect("allocate a bench buffer");
        for (d, b) in buf.bytes_mut().iter_mut().zip(bytes) {
            *d = b;
        }
        Lines(buf)
    }

    fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }
}

impl PartialEq for Lines {
    fn eq(&self, other: &Lines) -> bool {
        self.bytes() == other.bytes()
    }
}

/// Per-layer host regions and the KvMemory over them.
struct Regions {
    bufs: Vec<Lines>,
    mem: KvMemory,
}

impl Regions {
    fn bytes(&self) -> usize {
        self.bufs.iter().map(|b| b.bytes().len()).sum()
    }

    /// The baseline of the CPU copies: every region copied into `flat`, one copy each, by
    /// glibc's memcpy and by streaming stores (as the subject may stream); each way's time
    /// in seconds.
    fn memcpy_into(&self, flat: &mut [u8]) -> Vec<f64> {
        memcpy_of_pieces(|copy| {
            let mut off = 0;
            for r in &self.bufs {
                let r = r.bytes();
                copy(&mut flat[off..off + r.len()], r);
                off += r.len();
            }
        })
    }

    fn check_flat(&self, flat: &[u8], what: &str) {
        assert!(
            flat == self.bufs.iter().flat_map(|b| b.bytes()).copied().collect::<Vec<u8>>(),
            "{what}: the memcpy baseline's bytes differ"
        );
    }
}

/// Prints one comparison.
fn report(name: &str, goal: f64, p: Paired, bytes: usize, machine: Machine) {
    println!("RATIO {name}: {}; goal >= {goal}: {}; {machine}", p.summary(Some(bytes)), p.verdict(goal));
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

fn pairs(size: &Size, base: impl FnMut(), subject: impl FnMut()) -> Paired {
    interleaved_timed(size.pairs, if size.test { 0 } else { 2 }, base, subject)
}

/// [`pairs`] against the fastest way of a memcpy baseline that times its ways itself
/// ([`memcpy_of_pieces`]: glibc's and streaming stores): the way with the lowest median over
/// the pairs, named on a line of its own.
fn pairs_against(size: &Size, base: impl FnMut() -> Vec<f64>, subject: impl FnMut()) -> Paired {
    let (p, way) = interleaved_against_fastest(size.pairs, if size.test { 0 } else { 2 }, base, subject);
    println!("  (baseline below: {})", PIECE_COPIERS[way]);
    p
}

fn prefix_match(size: &Size) {
    let bs = 16usize;
    let cache = BlockCache::new(size.prompts * size.prompt_blocks as u32 + 64, 1, None, false, String::new());
    let mut prompts = Vec::new();
    for p in 0..size.prompts {
        let toks: Vec<u32> =
            (0..(size.prompt_blocks * bs) as u32).map(|i| i.wrapping_mul(31) ^ (p << 24)).collect();
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
    assert_eq!(cache.sizes().0, size.prompts as usize * size.prompt_blocks);
    let (toks, hashes) = &prompts[size.prompts as usize / 3];
    assert_eq!(cache.match_len(hashes), hashes.len());
    let (samples, iters) = if size.test { (1, 1) } else { (31, 2000) };
    let m = Machine::start();
    let q = per_call(samples, iters, || {
        std::hint::black_box(cache.match_len(std::hint::black_box(hashes)));
    });
    let name = format!("prefix_match {}-block prompt in a {}-block tree", hashes.len(), cache.sizes().0);
    absolute(&name, &q, samples, Some(10.0));
    let q = per_call(samples, iters / 10, || {
        let n = cache.pin_prefix(std::hint::black_box(hashes), hashes.len());
        cache.unpin(&hashes[..n]);
    });
    absolute("prefix_match match+pin+unpin", &q, samples, None);
    let q = per_call(samples, iters / 10, || {
        std::hint::black_box(block_hashes(7, std::hint::black_box(toks), bs));
    });
    absolute(&format!("hash of the {}-token prompt", toks.len()), &q, samples, None);
    println!("  ({})", m.finish());
}

fn cpu_tier(size: &Size) {
    let src = size.regions(KvLayout::NHD, 1);
    let dst = size.regions(KvLayout::NHD, 0);
    let adapter = BlockAdapter::new(&size.model(), &size.eff(KvLayout::NHD));
    let bytes = src.bytes();
    let slot = adapter.slot_bytes();
    let n = size.blocks as usize;
    assert_eq!(slot * n, bytes);
    // Room for 2 x n blocks: the fixed chain that is loaded, and the store iterations, each
    // of which evicts the previous one's n blocks.
    let cache = BlockCache::new(2 * size.blocks, slot, None, false, String::new());
    let hashes = block_hashes(99, &vec![5u32; n], 1);
    let mut parent = None;
    for (i, h) in hashes.iter().enumerate() {
        cache
            .store_summed(*h, parent, |s| adapter.gather_summed(&src.mem, BlockId(i as u32), s))
            .expect("gather");
        parent = Some(*h);
    }
    assert_eq!(cache.pin_prefix(&hashes, hashes.len()), n);
    let mut flat = Lines::new(std::iter::repeat_n(0u8, bytes));
    let seq = std::cell::Cell::new(0u32);
    let last = RefCell::new(Vec::new());
    let store = || {
        seq.set(seq.get() + 1);
        let chain = block_hashes(1, &vec![seq.get(); n], 1);
        let mut parent = None;
        for (i, h) in chain.iter().enumerate() {
            cache
                .store_summed(*h, parent, |s| adapter.gather_summed(&src.mem, BlockId(i as u32), s))
                .expect("gather");
            parent = Some(*h);
        }
        *last.borrow_mut() = chain;
    };
    let (mut scratch, mut tbuf) = (Vec::new(), Vec::new());
    let m = Machine::start();
    let flat_cell = RefCell::new(flat.bytes_mut());
    let p = pairs_against(size, || src.memcpy_into(&mut flat_cell.borrow_mut()), store);
    report("cpu_tier store (KV -> CPU tier, checksum in the same pass) vs memcpy", 0.9, p, bytes, m.finish());
    // The last stored chain holds the source's blocks: loaded into `dst`, they equal them.
    let chain = last.borrow().clone();
    assert_eq!(cache.pin_prefix(&chain, n), n, "the stored chain is cached");
    for (i, h) in chain.iter().enumerate() {
        cache
            .load(*h, &mut scratch, |s| {
                adapter.scatter(&dst.mem, BlockId(i as u32), s, &mut tbuf).map_err(|e| e.to_string())
            })
            .expect("load the stored chain");
    }
    cache.unpin(&chain);
    assert!(dst.bufs == src.bufs, "the stored blocks differ from the source's");
    flat_cell.borrow_mut().fill(0);
    let mut load = || {
        for (i, h) in hashes.iter().enumerate() {
            cache
                .load(*h, &mut scratch, |s| {
                    adapter.scatter(&dst.mem, BlockId(i as u32), s, &mut tbuf).map_err(|e| e.to_string())
                })
                .expect("load");
        }
    };
    // The baseline reads the same bytes from the same place (the tier's slots, in whatever
    // cache state the last copy left them), so only the destination differs.
    let slots_memcpy = || {
        memcpy_of_pieces(|copy| {
            let mut flat = flat_cell.borrow_mut();
            for (h, out) in hashes.iter().zip(flat.chunks_exact_mut(slot)) {
                cache
                    .load(*h, &mut Vec::new(), |s| {
                        copy(out, s);
                        Ok(())
                    })
                    .expect("copy a slot");
            }
        })
    };
    let m = Machine::start();
    let p = pairs_against(size, slots_memcpy, &mut load);
    report("cpu_tier load (CPU tier -> KV) vs memcpy out of the same slots", 0.9, p, bytes, m.finish());
    assert!(dst.bufs == src.bufs, "the loaded blocks differ from the stored ones");
    let stored_form = flat_cell.borrow().to_vec();
    let m = Machine::start();
    let p = pairs_against(size, || src.memcpy_into(&mut flat_cell.borrow_mut()), &mut load);
    report(
        "cpu_tier load vs memcpy out of the KV regions (reference, no goal: the baseline's \
         source is in another cache state)",
        0.0,
        p,
        bytes,
        m.finish(),
    );
    src.check_flat(&flat_cell.borrow(), "cpu_tier");
    assert!(dst.bufs == src.bufs, "the loaded blocks differ from the stored ones");
    // The slots' memcpy copied the stored form: the blocks, layer by layer, in order.
    for (i, block) in stored_form.chunks_exact(slot).enumerate() {
        let mut want = Vec::new();
        for l in 0..size.layers {
            for part in 0..2 {
                let span = src.mem.span(LayerId(l), part, BlockId(i as u32)).expect("span");
                want.extend_from_slice(src.mem.slice(span).expect("slice"));
            }
        }
        assert!(block == want.as_slice(), "block {i}: the slots' memcpy copied other bytes");
    }
}

fn transpose(size: &Size) {
    let hnd = size.regions(KvLayout::HND, 3);
    let back = size.regions(KvLayout::HND, 0);
    let adapter = BlockAdapter::new(&size.model(), &size.eff(KvLayout::HND));
    assert!(adapter.transposes());
    let bytes = hnd.bytes();
    let slot = adapter.slot_bytes();
    // Slots back to back in one buffer, line aligned and on huge pages, as the CPU tier's are.
    let mut stored_buf = Lines::new(std::iter::repeat_n(0u8, bytes));
    let mut flat = Lines::new(std::iter::repeat_n(0u8, bytes));
    let flat_cell = RefCell::new(flat.bytes_mut());
    let m = Machine::start();
    let p = pairs_against(
        size,
        || hnd.memcpy_into(&mut flat_cell.borrow_mut()),
        || {
            for (i, s) in stored_buf.bytes_mut().chunks_exact_mut(slot).enumerate() {
                adapter.gather(&hnd.mem, BlockId(i as u32), s).expect("gather");
            }
        },
    );
    report("transpose HND -> NHD vs memcpy", 0.9, p, bytes, m.finish());
    hnd.check_flat(&flat_cell.borrow(), "transpose");
    let stored: Vec<&[u8]> = stored_buf.bytes().chunks_exact(slot).collect();
    let mut tbuf = Vec::new();
    // As the load's: the baseline reads the same stored blocks the subject reads.
    let stored_memcpy = || {
        memcpy_of_pieces(|copy| {
            let mut flat = flat_cell.borrow_mut();
            for (s, out) in stored.iter().zip(flat.chunks_exact_mut(slot)) {
                copy(out, s);
            }
        })
    };
    let m = Machine::start();
    let p = pairs_against(size, stored_memcpy, || {
        for (i, s) in stored.iter().enumerate() {
            adapter.scatter(&back.mem, BlockId(i as u32), s, &mut tbuf).expect("scatter");
        }
    });
    report("transpose NHD -> HND vs memcpy out of the same stored blocks", 0.9, p, bytes, m.finish());
    assert!(
        flat_cell.borrow().chunks_exact(slot).zip(&stored).all(|(f, s)| f == *s),
        "transpose: the stored blocks' memcpy copied other bytes"
    );
    // NHD -> HND undoes HND -> NHD, and the stored form is not the region's bytes.
    assert!(back.bufs == hnd.bufs, "the transposes do not round-trip");
    let mut raw = Vec::new();
    for l in 0..size.layers {
        for part in 0..2 {
            let span = hnd.mem.span(LayerId(l), part, BlockId(0)).expect("span");
            raw.extend_from_slice(hnd.mem.slice(span).expect("slice"));
        }
    }
    assert!(stored[0] != raw.as_slice(), "the stored form is the region's bytes: nothing was transposed");
}

fn ssd_tier(size: &Size) {
    // Records of the bench model's blocks (512 KiB at full size), so they load into its regions.
    let kv = size.regions(KvLayout::NHD, 0);
    let adapter = BlockAdapter::new(&size.model(), &size.eff(KvLayout::NHD));
    let slot = adapter.slot_bytes();
    let n = size.blocks as usize;
    // The records one demotion writes before its sync, for a CPU tier of 4 x n blocks.
    let cache = BlockCache::new(4 * size.blocks, slot, None, false, String::new());
    let batch = cache.demote_batch_blocks();
    let dir = tempfile::tempdir_in(
        std::env::var_os("FLEXKV_BENCH_DIR").unwrap_or_else(|| std::env::temp_dir().into()),
    )
    .expect("bench temp dir");
    let tier = SsdTier::open(&dir.path().join("tier"), "bench", slot, SsdTier::record_bytes(slot) * n as u64)
        .expect("open tier");
    let payloads: Vec<Vec<u8>> =
        (0..n).map(|i| (0..slot).map(|j| (i * 7 + j * 13 + (j >> 12)) as u8).collect()).collect();
    let plain_path = dir.path().join("plain.bin");
    let plain = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&plain_path)
        .expect("plain file");
    let plain = RefCell::new(plain);
    // Same durability on both sides: a sync after every `batch` blocks.
    let plain_write = || {
        let mut f = plain.borrow_mut();
        f.seek(SeekFrom::Start(0)).expect("seek");
        for group in payloads.chunks(batch) {
            for p in group {
                f.write_all(p).expect("write");
            }
            f.sync_data().expect("sync the plain file");
        }
    };
    // The demotion path: the checksum was taken when the block entered the CPU tier.
    let sums: Vec<u64> = payloads.iter().map(|p| kvconnect_flexkv::hash::checksum(p)).collect();
    let tier_write = || {
        for (g, group) in payloads.chunks(batch).enumerate() {
            for (j, p) in group.iter().enumerate() {
                let i = g * batch + j;
                tier.write_summed(i as u32, i as u64, p, sums[i]).expect("tier write");
            }
            tier.sync().expect("sync the tier");
        }
    };
    let m = Machine::start();
    let p = pairs(size, plain_write, tier_write);
    report(
        &format!(
            "ssd_tier write (records in batches of {batch}, each fdatasync'd) vs sequential write, same syncs"
        ),
        0.9,
        p,
        slot * n,
        m.finish(),
    );
    let mut buf = vec![0u8; slot];
    let plain_read = || {
        let mut f = plain.borrow_mut();
        f.seek(SeekFrom::Start(0)).expect("seek");
        for _ in 0..n {
            f.read_exact(&mut buf).expect("read");
        }
    };
    let mut rbuf = Vec::new();
    let mut tier_read = || {
        for i in 0..n {
            std::hint::black_box(tier.read(i as u32, i as u64, &mut rbuf).expect("tier read"));
        }
    };
    // The load path: each record read and scattered into its KV block, verified by the
    // checksum the scatter takes in the same pass, against the same bytes read from the plain
    // file and copied into the same blocks by the faster of glibc's memcpy and streaming stores.
    let (mut lbuf, mut tbuf) = (Vec::new(), Vec::new());
    let mut tier_load = || {
        for i in 0..n {
            tier.read_into(i as u32, i as u64, &mut lbuf, |p| {
                adapter.scatter_summed(&kv.mem, BlockId(i as u32), p, &mut tbuf)
            })
            .expect("tier read")
            .expect("scatter");
        }
    };
    let sub = slot / (size.layers as usize * 2);
    let mut pbuf = vec![0u8; slot];
    let mut plain_load = || {
        memcpy_of_pieces(|copy| {
            let mut f = plain.borrow_mut();
            f.seek(SeekFrom::Start(0)).expect("seek");
            for i in 0..n {
                f.read_exact(&mut pbuf).expect("read");
                for (j, piece) in pbuf.chunks_exact(sub).enumerate() {
                    let span =
                        kv.mem.span(LayerId(j as u32 / 2), j as u32 % 2, BlockId(i as u32)).expect("span");
                    kv.mem.write_with(span, piece.len(), |d| copy(d, piece)).expect("write");
                }
            }
        })
    };
    let m = Machine::start();
    let p = pairs_against(size, &mut plain_load, &mut tier_load);
    report(
        "ssd_tier load into KV (records read, scattered, verified in the same pass) vs sequential \
         read + memcpy into the same blocks",
        0.9,
        p,
        slot * n,
        m.finish(),
    );
    let mut out = vec![0u8; slot];
    for (i, want) in payloads.iter().enumerate() {
        adapter.gather(&kv.mem, BlockId(i as u32), &mut out).expect("gather");
        assert!(out == *want, "block {i}: the KV block does not hold its record");
    }
    // Each side on its own writes every block: wiped first, checked after.
    for (what, run) in [
        ("tier load", &mut tier_load as &mut dyn FnMut()),
        ("baseline", &mut || {
            plain_load();
        }),
    ] {
        adapter.clear(&kv.mem, BlockId(0)).expect("wipe");
        run();
        adapter.gather(&kv.mem, BlockId(0), &mut out).expect("gather");
        assert!(out == payloads[0], "block 0: the {what} did not write its record");
    }
    let m = Machine::start();
    let p = pairs(size, plain_read, &mut tier_read);
    report(
        "ssd_tier read alone (records, verified) vs sequential read (reference, no goal)",
        0.0,
        p,
        slot * n,
        m.finish(),
    );
    // Reference: the same records read raw (one pread each, no checks), to tell the cost of
    // verification from the cost of the file itself.
    let raw = std::fs::File::open(tier.path()).expect("open tier file");
    let mut rawbuf = vec![0u8; SsdTier::record_bytes(slot) as usize];
    let raw_read = || {
        use std::os::unix::fs::FileExt;
        for i in 0..n {
            raw.read_exact_at(&mut rawbuf, i as u64 * tier.record()).expect("raw read");
        }
    };
    let m = Machine::start();
    let p = pairs(size, raw_read, &mut tier_read);
    report(
        "ssd_tier read (records, verified) vs raw pread of the same records (reference, no goal)",
        0.0,
        p,
        slot * n,
        m.finish(),
    );
    for (i, want) in payloads.iter().enumerate() {
        assert_eq!(tier.read(i as u32, i as u64, &mut rbuf).expect("tier read"), &want[..], "record {i}");
    }
    let mut f = plain.borrow_mut();
    f.seek(SeekFrom::Start(0)).expect("seek");
    for (i, want) in payloads.iter().enumerate() {
        f.read_exact(&mut buf).expect("read");
        assert!(buf == *want, "plain block {i}");
    }
}

fn main() {
    let size = Size::from_args();
    let all = Machine::start();
    println!(
        "flexkv bench ({}; {} pairs per ratio): {all}",
        if size.test { "test run, tiny sizes" } else { "full sizes" },
        size.pairs
    );
    cpu_tier(&size);
    transpose(&size);
    ssd_tier(&size);
    prefix_match(&size);
    println!("flexkv bench done: {}", all.finish());
}
