//! flexkv over KV regions in GPU memory (feature `cuda`): random device blocks are saved
//! through the real scheduler/worker flow (the save gathers on the step thread, the pool job
//! stores), the device is poisoned, and the prompt is loaded into other block ids on the
//! pool thread; the downloaded bytes must equal the saved ones exactly and the block past
//! the match keeps the poison. Per-layer and cross-layer layouts. Skips without a GPU.

#![allow(unsafe_code)] // GPU tests vouch for their device buffers as regions (KvRegion::new).
#![cfg(feature = "cuda")]

mod support;

use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorFactory, KvLayout, KvRegion, KvRegionSpec, LayerId, MatchResult,
    MemoryKind, Request, RequestId, SchedulerConnector, StepInfo, WorkerConnector,
};
use kvconnect_cuda::testing::random_bytes;
use kvconnect_cuda::{DeviceBuffer, Gpu};
use kvconnect_flexkv::FlexkvFactory;
use std::time::{Duration, Instant};
use support::{ctx, effective, model, tokens, BS};

const NUM_BLOCKS: u32 = 128;
const POISON: u8 = 0xEE;
const KV_LAYERS: [u32; 2] = [0, 2];

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
        let shape = BlockShape::of(&model(), &effective(layout));
        let regions: Vec<RegionShape> = if layout.is_cross_layer() {
            vec![RegionShape {
                layers: KV_LAYERS.iter().map(|l| LayerId(*l)).collect(),
                num_blocks: NUM_BLOCKS,
            }]
        } else {
            KV_LAYERS
                .iter()
                .map(|l| RegionShape { layers: vec![LayerId(*l)], num_blocks: NUM_BLOCKS })
                .collect()
        };
        let geometry = Geometry::new(shape, layout, regions);
        let mut bufs = Vec::new();
        let mut orig = Vec::new();
        for (i, r) in geometry.regions().iter().enumerate() {
            let bytes = random_bytes(geometry.region_bytes(r), 91 + i as u64);
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
            .zip(self.geometry.regions())
            .enumerate()
            .map(|(i, (b, r))| {
                // SAFETY: the regions are `self.bufs`, device allocations on `self.gpu` that live as
                // long as this Dev, which outlives the workers in each test.
                unsafe {
                    KvRegion::new(KvRegionSpec {
                        name: format!("kv.{i}"),
                        addr: b.ptr(),
                        len: b.len() as u64,
                        memory: MemoryKind::Device,
                        device: self.gpu.ordinal() as i32,
                        layers: r.layers.clone(),
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

    fn block(&self, regions: &[Vec<u8>], block: BlockId) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for l in KV_LAYERS {
            for p in 0..2 {
                let s = self.geometry.span(LayerId(l), p, block).unwrap();
                out.push(regions[s.region][s.offset..s.offset + s.len].to_vec());
            }
        }
        out
    }
}

struct Halves {
    sched: Box<dyn SchedulerConnector>,
    worker: Box<dyn WorkerConnector>,
    step: u64,
}

impl Halves {
    fn meta(&mut self, scheduled: &[RequestId]) {
        self.step += 1;
        let m = self
            .sched
            .build_connector_meta(&StepInfo {
                step: self.step,
                scheduled: scheduled.to_vec(),
                finished: vec![],
            })
            .unwrap();
        self.worker.bind_connector_meta(&m).unwrap();
    }

    fn wait(&mut self, rid: &RequestId, sending: bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut finished = vec![rid.clone()];
        loop {
            let f = self.worker.get_finished(&finished).unwrap();
            finished.clear();
            if sending && f.finished_sending.contains(rid) || !sending && f.finished_recving.contains(rid) {
                return true;
            }
            if f.failed_recving.contains(rid) {
                return false;
            }
            assert!(Instant::now() < deadline, "{rid:?} never finished");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn request(id: &str, prompt: &[u32]) -> Request {
    Request { id: id.into(), prompt_tokens: prompt.to_vec(), kv_transfer_params: Default::default() }
}

fn ids(v: &[u32]) -> Vec<BlockId> {
    v.iter().map(|b| BlockId(*b)).collect()
}

fn round_trip(layout: KvLayout) {
    let Some(gpu) = gpu() else { return };
    let dev = Dev::new(gpu, layout);
    let id = format!("flexkv-device-{}", layout.canonical_name());
    let c = ctx(effective(layout), serde_json::json!({"cpu_cache_gb": 0.01}), &id);
    let caps = FlexkvFactory.capabilities(&c.config, None).unwrap();
    assert!(caps.memory_kinds.contains(&MemoryKind::Device));
    let mut h = Halves {
        sched: FlexkvFactory.create_scheduler(&c).unwrap(),
        worker: FlexkvFactory.create_worker(&c).unwrap(),
        step: 0,
    };
    h.worker.register_kv_caches(&dev.regions()).unwrap();

    // Save: four full blocks and one token more, from scattered block ids.
    let p = tokens(7, 4 * BS + 1);
    let a = ids(&[30, 5, 17, 9, 40]);
    let req = request("a", &p);
    let MatchResult::Matched { tokens: 0, .. } = h.sched.get_num_new_matched_tokens(&req, 0).unwrap() else {
        panic!("cold cache matched")
    };
    h.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![a.clone()]), 0).unwrap();
    h.meta(std::slice::from_ref(&req.id));
    h.worker.start_load_kv().unwrap();
    h.worker.wait_for_save().unwrap();
    // The gather ran in wait_for_save: poisoning now must not reach the cache.
    dev.poison();
    let rf = h.sched.request_finished(&req, &BlocksPerGroup(vec![a.clone()])).unwrap();
    if rf.delay_free {
        h.meta(&[]);
        assert!(h.wait(&req.id, true));
    }

    // Load into other blocks on the pool thread.
    let b = ids(&[60, 61, 2, 44, 50]);
    let req = request("b", &p);
    let MatchResult::Matched { tokens, async_load } = h.sched.get_num_new_matched_tokens(&req, 0).unwrap()
    else {
        panic!("Pending")
    };
    assert_eq!((tokens, async_load), (4 * BS, true), "{layout}");
    h.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![b.clone()]), tokens).unwrap();
    h.meta(&[]);
    h.worker.start_load_kv().unwrap();
    assert!(h.wait(&req.id, false), "{layout}: load failed");
    assert!(h.worker.block_ids_with_load_errors().unwrap().is_empty());
    let now = dev.download();
    for i in 0..4 {
        assert!(dev.block(&now, b[i]) == dev.block(&dev.orig, a[i]), "{layout} block {i} differs");
    }
    assert!(dev.block(&now, b[4]).iter().all(|p| p.iter().all(|x| *x == POISON)), "{layout}");
    h.sched.request_finished(&req, &BlocksPerGroup(vec![b])).unwrap();
    h.worker.shutdown().unwrap();
}

#[test]
fn per_layer_nhd_and_hnd() {
    round_trip(KvLayout::NHD);
    round_trip(KvLayout::HND);
}

#[test]
fn cross_layer_blnhc_and_blhnc() {
    round_trip(KvLayout::BLNHC);
    round_trip(KvLayout::BLHNC);
}

#[test]
fn regions_on_two_gpus_are_refused() {
    let Some(gpu) = gpu() else { return };
    let dev = Dev::new(gpu, KvLayout::NHD);
    let c = ctx(effective(KvLayout::NHD), serde_json::json!({}), "flexkv-device-two-gpus");
    let mut w = FlexkvFactory.create_worker(&c).unwrap();
    let mut regions = dev.regions();
    let mut spec = regions[1].spec().clone();
    spec.device += 1;
    // SAFETY: the worker refuses the regions (two GPUs) before it touches any of them.
    regions[1] = unsafe { KvRegion::new(spec) };
    let e = w.register_kv_caches(&regions).unwrap_err().to_string();
    assert!(e.contains("must be on one GPU"), "{e}");
}
