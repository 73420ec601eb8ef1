//! lmcache over KV regions in GPU memory (feature `cuda`): random device blocks are saved
//! through the real scheduler/worker flow, the device is poisoned, and the prompt is loaded
//! into other block ids; the downloaded bytes must equal the saved ones exactly, and bytes
//! the load must not write (past the match) keep the poison. Skips, saying so, without a GPU.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorFactory, KvLayout, KvRegion, LayerId, MatchResult, MemoryKind, StepInfo,
};
use kvconnect_cuda::{DeviceBuffer, Gpu};
use kvconnect_lmcache::LmcacheFactory;
use serde_json::json;

const CHUNK: usize = 32;
const BS: u32 = 16;
const POISON: u8 = 0xEE;

fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("skipping: no usable GPU ({e})");
            None
        }
    }
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
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
            .map(|(i, b)| KvRegion {
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
    fn with_poisoned_tail(&self, mut parts: Vec<Vec<u8>>, from: u32) -> Vec<Vec<u8>> {
        let row = (self.geometry.shape().head_dim * self.geometry.shape().elem_size) as usize;
        for p in &mut parts {
            for t in from..BS {
                for h in 0..self.geometry.shape().heads {
                    let o = self.geometry.inner_offset(h, t, 0);
                    p[o..o + row].fill(POISON);
                }
            }
        }
        parts
    }
}

/// One request through the vLLM call order; returns (matched tokens, load errors).
fn step(
    e: &mut (Box<dyn kvconnect_api::SchedulerConnector>, Box<dyn kvconnect_api::WorkerConnector>),
    n: u64,
    id: &str,
    tokens: &[u32],
    blocks: &[BlockId],
) -> (usize, Vec<BlockId>) {
    let (sched, worker) = e;
    let req = request(id, tokens);
    let matched = match sched.get_num_new_matched_tokens(&req, 0).unwrap() {
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
    let c = ctx(&id, layout, BS, json!({"chunk_size": CHUNK, "use_layerwise": layerwise}));
    let caps = LmcacheFactory.capabilities(&c.config, None).unwrap();
    assert!(caps.memory_kinds.contains(&MemoryKind::Device));
    let mut e = (LmcacheFactory.create_scheduler(&c).unwrap(), LmcacheFactory.create_worker(&c).unwrap());
    e.1.register_kv_caches(&dev.regions()).unwrap();

    // Save: two full chunks and 9 tokens more, from scattered block ids.
    let p = prompt(5, 2 * CHUNK + 9);
    let a = ids(&[100, 7, 55, 3, 200]);
    assert_eq!(step(&mut e, 1, "a", &p, &a), (0, vec![]));
    assert_eq!(kvconnect_lmcache::stats(&id).unwrap().chunks_saved, 2);

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

#[test]
fn regions_on_two_gpus_are_refused() {
    let Some(gpu) = gpu() else { return };
    let dev = Dev::new(gpu, KvLayout::NHD);
    let c = ctx("lmcache-device-two-gpus", KvLayout::NHD, BS, json!({"chunk_size": CHUNK}));
    let mut w = LmcacheFactory.create_worker(&c).unwrap();
    let mut regions = dev.regions();
    regions[1].device += 1;
    let e = w.register_kv_caches(&regions).unwrap_err().to_string();
    assert!(e.contains("must be on one GPU"), "{e}");
}
