//! lmcache over KV regions in GPU memory (feature `cuda`): random device blocks are saved
//! through the real scheduler/worker flow, the device is poisoned, and the prompt is loaded
//! into other block ids; the downloaded bytes must equal the saved ones exactly, and bytes
//! the load must not write (past the match) keep the poison. Full chunks go straight into
//! the pinned CPU tier's slots and load straight out of them (the statistics say which path
//! each chunk took); partial chunks and chunks from the disk tier go through the host copy.
//! Skips, saying so, without a GPU.

#![allow(unsafe_code)] // GPU tests vouch for their device buffers as regions (KvRegion::new).
#![cfg(feature = "cuda")]

mod common;

use common::*;
use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorFactory, KvLayout, KvRegion, KvRegionSpec, LayerId, MatchResult,
    MemoryKind, StepInfo,
};
use kvconnect_cuda::testing::random_bytes;
use kvconnect_cuda::{DeviceBuffer, Gpu};
use kvconnect_lmcache::LmcacheFactory;
use serde_json::json;

const CHUNK: usize = 32;
const BS: u32 = 16;
const POISON: u8 = 0xEE;

fn gpu() -> Option<Gpu> {
    kvconnect_cuda::testing::gpu_or_skip(0)
}

struct Dev {
    gpu: Gpu,
    bufs: Vec<DeviceBuffer>,
    orig: Vec<Vec<u8>>,
    geometry: Geometry,
}

impl Dev {
    fn new(gpu: Gpu, layout: KvLayout) -> Dev {
        let c = ctx("x", layout, BS, json!({}));
        let shape = BlockShape::of(&c.model, &c.effective);
        let regions: Vec<RegionShape> =
            (0..LAYERS).map(|l| RegionShape { layers: vec![LayerId(l)], num_blocks: NUM_BLOCKS }).collect();
        let geometry = Geometry::new(shape, layout, regions);
        let mut bufs = Vec::new();
        let mut orig = Vec::new();
        for (i, r) in geometry.regions().iter().enumerate() {
            let bytes = random_bytes(geometry.region_bytes(r), 77 + i as u64);
            let b = gpu.alloc(bytes.len()).unwrap();
            gpu.upload(b.ptr(), &bytes).unwrap();
            bufs.push(b);
            orig.push(bytes);
        }
        Dev { gpu, bufs, orig, geometry }
    }

    fn regions(&self) -> Vec<KvRegion> {
        self.bufs
            .iter()
            .enumerate()
            .map(|(i, b)| {
                // SAFETY: the regions are `self.bufs`, device allocations on `self.gpu` that live as
                // long as this Dev, which outlives the workers in each test.
                unsafe {
                    KvRegion::new(KvRegionSpec {
                        name: format!("layer.{i}"),
                        addr: b.ptr(),
                        len: b.len() as u64,
                        memory: MemoryKind::Device,
                        device: self.gpu.ordinal() as i32,
                        layers: vec![LayerId(i as u32)],
                        group: 0,
                        num_blocks: NUM_BLOCKS,
                        shm_name: None,
                    })
                }
            })
            .collect()
    }

    fn poison(&self) {
        for b in &self.bufs {
            self.gpu.memset_async(b.ptr(), POISON, b.len()).unwrap();
        }
        self.gpu.synchronize().unwrap();
    }

    fn download(&self) -> Vec<Vec<u8>> {
        self.bufs
            .iter()
            .map(|b| {
                let mut v = vec![0u8; b.len()];
                self.gpu.download(&mut v, b.ptr()).unwrap();
                v
            })
            .collect()
    }

    /// The bytes of `block` of every layer and part in `regions`.
    fn block(&self, regions: &[Vec<u8>], block: BlockId) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for l in 0..LAYERS {
            for p in 0..self.geometry.shape().kv_parts {
                let s = self.geometry.span(LayerId(l), p, block).unwrap();
                out.push(regions[s.region][s.offset..s.offset + s.len].to_vec());
            }
        }
        out
    }

    /// `orig_block` with tokens `[from, BS)` of every head set to the poison.
    fn with_poisoned_tail(&self, parts: Vec<Vec<u8>>, from: u32) -> Vec<Vec<u8>> {
        self.with_poisoned(parts, from..BS)
    }

    /// `orig_block` with `tokens` of every head set to the poison.
    fn with_poisoned(&self, mut parts: Vec<Vec<u8>>, tokens: std::ops::Range<u32>) -> Vec<Vec<u8>> {
        let row = (self.geometry.shape().head_dim * self.geometry.shape().elem_size) as usize;
        for p in &mut parts {
            for t in tokens.clone() {
                for h in 0..self.geometry.shape().heads {
                    let o = self.geometry.inner_offset(h, t, 0);
                    p[o..o + row].fill(POISON);
                }
            }
        }
        parts
    }
}

type Halves = (Box<dyn kvconnect_api::SchedulerConnector>, Box<dyn kvconnect_api::WorkerConnector>);

/// One request through the vLLM call order; returns (matched tokens, load errors).
fn step(e: &mut Halves, n: u64, id: &str, tokens: &[u32], blocks: &[BlockId]) -> (usize, Vec<BlockId>) {
    step_from(e, n, id, tokens, blocks, 0)
}

/// `step` for an engine that already computed `computed` tokens of the prompt.
fn step_from(
    e: &mut Halves,
    n: u64,
    id: &str,
    tokens: &[u32],
    blocks: &[BlockId],
    computed: usize,
) -> (usize, Vec<BlockId>) {
    let (sched, worker) = e;
    let req = request(id, tokens);
    let matched = match sched.get_num_new_matched_tokens(&req, computed).unwrap() {
        MatchResult::Matched { tokens, .. } => tokens,
        MatchResult::Pending => panic!("lmcache never answers Pending"),
    };
    sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![blocks.to_vec()]), matched).unwrap();
    let meta = sched
        .build_connector_meta(&StepInfo { step: n, scheduled: vec![req.id.clone()], finished: vec![] })
        .unwrap();
    worker.bind_connector_meta(&meta).unwrap();
    worker.start_load_kv().unwrap();
    let errors = worker.block_ids_with_load_errors().unwrap();
    for l in 0..LAYERS {
        worker.wait_for_layer_load(LayerId(l)).unwrap();
        worker.save_kv_layer(LayerId(l), blocks).unwrap();
    }
    worker.wait_for_save().unwrap();
    worker.get_finished(std::slice::from_ref(&req.id)).unwrap();
    sched.request_finished(&req, &BlocksPerGroup(vec![blocks.to_vec()])).unwrap();
    (matched, errors)
}

fn ids(v: &[u32]) -> Vec<BlockId> {
    v.iter().map(|b| BlockId(*b)).collect()
}

fn round_trip(layout: KvLayout, layerwise: bool) {
    let Some(gpu) = gpu() else { return };
    let dev = Dev::new(gpu, layout);
    let id = format!("lmcache-device-{}-{layerwise}", layout.canonical_name());
    // A small CPU tier: its pinned slab is what the tier's budget holds.
    let c = ctx(
        &id,
        layout,
        BS,
        json!({"chunk_size": CHUNK, "use_layerwise": layerwise, "max_local_cpu_size": 0.01}),
    );
    let caps = LmcacheFactory.capabilities(&c.config, None).unwrap();
    assert!(caps.memory_kinds.contains(&MemoryKind::Device));
    let mut e = (LmcacheFactory.create_scheduler(&c).unwrap(), LmcacheFactory.create_worker(&c).unwrap());
    e.1.register_kv_caches(&dev.regions()).unwrap();

    // Save: two full chunks and 9 tokens more, from scattered block ids.
    let p = prompt(5, 2 * CHUNK + 9);
    let a = ids(&[100, 7, 55, 3, 200]);
    assert_eq!(step(&mut e, 1, "a", &p, &a), (0, vec![]));
    let st = kvconnect_lmcache::stats(&id).unwrap();
    assert_eq!(st.chunks_saved, 2);
    assert_eq!(
        (st.pinned_chunks_saved, st.pinned_fallback_chunks),
        (2, 0),
        "both chunks went straight into slots"
    );

    // Load into other blocks of a poisoned device: the four blocks of the two chunks equal
    // the saved ones, the fifth (past the match) keeps the poison.
    dev.poison();
    let b = ids(&[300, 9, 401, 12, 250]);
    let (m, errs) = step(&mut e, 2, "b", &p[..2 * CHUNK + 9], &b);
    assert_eq!((m, errs), (2 * CHUNK, vec![]));
    let now = dev.download();
    for i in 0..4 {
        assert!(dev.block(&now, b[i]) == dev.block(&dev.orig, a[i]), "{layout} block {i} differs");
    }
    assert!(dev.block(&now, b[4]).iter().all(|p| p.iter().all(|x| *x == POISON)));
    // The saving request's own blocks were poisoned and not written back.
    assert!(dev.block(&now, a[0]).iter().all(|p| p.iter().all(|x| *x == POISON)));

    // A chunk-aligned prompt matches all but its last token: that token is left to the
    // engine, so the last block's final token keeps the poison and its other tokens load.
    dev.poison();
    let cblocks = ids(&[20, 21, 22, 23]);
    let (m, errs) = step(&mut e, 3, "c", &p[..2 * CHUNK], &cblocks);
    assert_eq!((m, errs), (2 * CHUNK - 1, vec![]));
    let now = dev.download();
    for i in 0..3 {
        assert!(dev.block(&now, cblocks[i]) == dev.block(&dev.orig, a[i]), "{layout} block {i} differs");
    }
    let want = dev.with_poisoned_tail(dev.block(&dev.orig, a[3]), BS - 1);
    assert!(dev.block(&now, cblocks[3]) == want, "{layout}: the partly loaded block");

    // An engine that computed 20 tokens itself loads [20, 63): block 1 from token 4 on (out
    // of chunk 0's slot, through the host copy), block 2 whole straight from chunk 1's slot,
    // block 3 but its last token; block 0 is not touched.
    dev.poison();
    let d = ids(&[70, 71, 72, 73]);
    let (m, errs) = step_from(&mut e, 4, "d", &p[..2 * CHUNK], &d, 20);
    assert_eq!((m, errs), (2 * CHUNK - 1 - 20, vec![]));
    let now = dev.download();
    assert!(dev.block(&now, d[0]).iter().all(|p| p.iter().all(|x| *x == POISON)), "{layout}: block 0");
    assert!(
        dev.block(&now, d[1]) == dev.with_poisoned(dev.block(&dev.orig, a[1]), 0..4),
        "{layout}: block 1"
    );
    assert!(dev.block(&now, d[2]) == dev.block(&dev.orig, a[2]), "{layout}: block 2");
    assert!(
        dev.block(&now, d[3]) == dev.with_poisoned_tail(dev.block(&dev.orig, a[3]), BS - 1),
        "{layout}: block 3"
    );
    e.1.shutdown().unwrap();
}

#[test]
fn nhd_save_poison_load_into_other_blocks() {
    round_trip(KvLayout::NHD, false);
}

#[test]
fn hnd_layerwise_degrades_to_whole_request_and_is_exact() {
    round_trip(KvLayout::HND, true);
}

/// A prompt of two full chunks and a partial one (`save_unfull_chunk`): the full chunks go
/// into pinned slots, the partial one to the heap; one load takes blocks from both, and the
/// last block only partly (the engine computes the final token).
#[test]
fn partial_chunk_goes_to_the_heap_and_loads_with_the_pinned_ones() {
    let Some(gpu) = gpu() else { return };
    let dev = Dev::new(gpu, KvLayout::NHD);
    let id = "lmcache-device-unfull";
    let c = ctx(
        id,
        KvLayout::NHD,
        BS,
        json!({"chunk_size": CHUNK, "save_unfull_chunk": true, "max_local_cpu_size": 0.01}),
    );
    let mut e = (LmcacheFactory.create_scheduler(&c).unwrap(), LmcacheFactory.create_worker(&c).unwrap());
    e.1.register_kv_caches(&dev.regions()).unwrap();
    let p = prompt(9, 2 * CHUNK + 9);
    let a = ids(&[100, 7, 55, 3, 200]);
    assert_eq!(step(&mut e, 1, "a", &p, &a), (0, vec![]));
    let st = kvconnect_lmcache::stats(id).unwrap();
    assert_eq!(st.chunks_saved, 3);
    assert_eq!((st.pinned_chunks_saved, st.pinned_fallback_chunks), (2, 1));

    dev.poison();
    let b = ids(&[300, 9, 401, 12, 250]);
    let (m, errs) = step(&mut e, 2, "b", &p, &b);
    assert_eq!((m, errs), (2 * CHUNK + 8, vec![]), "all but the last token");
    let now = dev.download();
    for i in 0..4 {
        assert!(dev.block(&now, b[i]) == dev.block(&dev.orig, a[i]), "block {i} (from a slot) differs");
    }
    // Block 4 holds tokens 64..73 of the prompt; 64..72 load from the heap chunk.
    let want = dev.with_poisoned_tail(dev.block(&dev.orig, a[4]), 8);
    assert!(dev.block(&now, b[4]) == want, "the partial chunk's block");
    e.1.shutdown().unwrap();
}

/// No CPU tier, a disk tier: no pinned slab, every chunk is built on the heap, and the load
/// from disk goes through the host copy, exactly.
#[test]
fn without_a_cpu_tier_chunks_go_through_the_heap_to_disk_and_back() {
    let Some(gpu) = gpu() else { return };
    let dev = Dev::new(gpu, KvLayout::HND);
    let dir = tempfile::tempdir().unwrap();
    let id = "lmcache-device-disk-only";
    let c = ctx(
        id,
        KvLayout::HND,
        BS,
        json!({"chunk_size": CHUNK, "local_cpu": false, "local_disk": format!("file://{}", dir.path().display()), "max_local_disk_size": 0.01}),
    );
    let mut e = (LmcacheFactory.create_scheduler(&c).unwrap(), LmcacheFactory.create_worker(&c).unwrap());
    e.1.register_kv_caches(&dev.regions()).unwrap();
    let p = prompt(11, 2 * CHUNK + 1);
    let a = ids(&[40, 41, 5, 6, 90]);
    assert_eq!(step(&mut e, 1, "a", &p, &a), (0, vec![]));
    kvconnect_lmcache::flush(id);
    let st = kvconnect_lmcache::stats(id).unwrap();
    assert_eq!((st.pinned_chunks_saved, st.pinned_fallback_chunks), (0, 2));
    assert_eq!(st.disk.chunks, 2);

    dev.poison();
    let b = ids(&[60, 61, 62, 63, 64]);
    let (m, errs) = step(&mut e, 2, "b", &p, &b);
    assert_eq!((m, errs), (2 * CHUNK, vec![]));
    let now = dev.download();
    for i in 0..4 {
        assert!(dev.block(&now, b[i]) == dev.block(&dev.orig, a[i]), "block {i} from disk differs");
    }
    assert!(dev.block(&now, b[4]).iter().all(|p| p.iter().all(|x| *x == POISON)));
    assert_eq!(kvconnect_lmcache::stats(id).unwrap().disk.hits, 2);
    e.1.shutdown().unwrap();
}

/// A CPU tier of two chunks: saving a second two-chunk prompt evicts the first prompt's
/// chunks before the gather, so their slots serve the new save (nothing falls back), and the
/// second prompt loads exactly while the first is gone.
#[test]
fn a_full_pinned_tier_evicts_before_the_gather_and_reuses_the_slots() {
    let Some(gpu) = gpu() else { return };
    let dev = Dev::new(gpu, KvLayout::NHD);
    let id = "lmcache-device-full-tier";
    // 2.5 chunks of 3 layers x K,V x 32 tokens x 2 heads x 8 x f16 = 6144 bytes each.
    let gb = 2.5 * 6144.0 / (1u64 << 30) as f64;
    let c = ctx(id, KvLayout::NHD, BS, json!({"chunk_size": CHUNK, "max_local_cpu_size": gb}));
    let mut e = (LmcacheFactory.create_scheduler(&c).unwrap(), LmcacheFactory.create_worker(&c).unwrap());
    e.1.register_kv_caches(&dev.regions()).unwrap();
    let p1 = prompt(21, 2 * CHUNK);
    let p2 = prompt(22, 2 * CHUNK);
    let a1 = ids(&[1, 2, 3, 4]);
    let a2 = ids(&[10, 11, 12, 13]);
    assert_eq!(step(&mut e, 1, "p1", &p1, &a1), (0, vec![]));
    assert_eq!(step(&mut e, 2, "p2", &p2, &a2), (0, vec![]));
    let st = kvconnect_lmcache::stats(id).unwrap();
    assert_eq!((st.pinned_chunks_saved, st.pinned_fallback_chunks), (4, 0));
    assert_eq!((st.cpu.chunks, st.cpu.evictions), (2, 2));

    dev.poison();
    let b = ids(&[30, 31, 32, 33]);
    let (m, errs) = step(&mut e, 3, "p2 again", &p2, &b);
    assert_eq!((m, errs), (2 * CHUNK - 1, vec![]));
    let now = dev.download();
    for i in 0..3 {
        assert!(dev.block(&now, b[i]) == dev.block(&dev.orig, a2[i]), "block {i} differs");
    }
    assert!(dev.block(&now, b[3]) == dev.with_poisoned_tail(dev.block(&dev.orig, a2[3]), BS - 1));
    let (m, _) = step(&mut e, 4, "p1 again", &p1, &ids(&[40, 41, 42, 43]));
    assert_eq!(m, 0, "the first prompt was evicted");
    e.1.shutdown().unwrap();
}

#[test]
fn regions_on_two_gpus_are_refused() {
    let Some(gpu) = gpu() else { return };
    let dev = Dev::new(gpu, KvLayout::NHD);
    let c = ctx("lmcache-device-two-gpus", KvLayout::NHD, BS, json!({"chunk_size": CHUNK}));
    let mut w = LmcacheFactory.create_worker(&c).unwrap();
    let mut regions = dev.regions();
    let mut spec = regions[1].spec().clone();
    spec.device += 1;
    // SAFETY: the worker refuses the regions (two GPUs) before it touches any of them.
    regions[1] = unsafe { KvRegion::new(spec) };
    let e = w.register_kv_caches(&regions).unwrap_err().to_string();
    assert!(e.contains("must be on one GPU"), "{e}");
}
