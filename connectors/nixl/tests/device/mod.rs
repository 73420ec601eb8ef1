//! Shared by the device-KV connector tests (cuda_ipc, nixl_vram): engines whose KV regions
//! are device memory filled with distinct, position-dependent bytes, the scheduler steps of
//! one disaggregated request, and an element-by-element check of what a consumer loaded.

#![allow(unsafe_code)] // GPU tests vouch for their device buffers as regions (KvRegion::new).
#![allow(dead_code)]

use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorFactory, EffectiveLayout, FinishedTransfers, KvLayout, KvRegion,
    KvRole, MatchResult, MemoryKind, ModelSpec, Request, SchedulerConnector, StepInfo, WorkerConnector,
};
use kvconnect_bench::harness::{context, effective, model, Regions};
use kvconnect_cuda::{DeviceBuffer, Gpu};
use kvconnect_nixl::NixlFactory;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

pub const BLOCKS: u32 = 16;
pub const PROMPT: usize = 21;
pub const BS: u32 = 4;

pub struct Engine {
    pub sched: Box<dyn SchedulerConnector>,
    pub worker: Box<dyn WorkerConnector>,
    pub host: Regions,
    pub dev: Vec<DeviceBuffer>,
    pub regions: Vec<KvRegion>,
    pub model: ModelSpec,
    pub eff: EffectiveLayout,
}

/// An engine whose KV regions are device memory of `g`, filled with distinct,
/// position-dependent bytes (salted by engine id); `extra` is its connector settings.
pub fn device_engine(g: &Gpu, role: KvRole, id: &str, layout: KvLayout, extra: Value) -> Engine {
    let m = model(3, 2, 8);
    let eff = effective(&m, layout, BS);
    let mut settings = json!({"side_channel_host": "127.0.0.1", "side_channel_port": 5600});
    if let (Some(s), Value::Object(e)) = (settings.as_object_mut(), extra) {
        s.extend(e);
    }
    let ctx = context(&m, &eff, role, id, settings);
    let sched = NixlFactory.create_scheduler(&ctx).unwrap();
    let mut worker = NixlFactory.create_worker(&ctx).unwrap();
    let mut host = Regions::allocate(&m, &eff, BLOCKS, None).unwrap();
    let mut dev = Vec::new();
    let mut regions = Vec::new();
    for i in 0..host.regions().len() {
        let salt = (id.len() * 31 + i * 7) as u32;
        for (j, b) in host.bytes_mut(i).iter_mut().enumerate() {
            *b = ((j as u32).wrapping_mul(2654435761).wrapping_add(salt) >> 13) as u8;
        }
        let buf = g.alloc(host.regions()[i].len() as usize).unwrap();
        g.upload(buf.ptr(), host.bytes_mut(i)).unwrap();
        let mut spec = host.regions()[i].spec().clone();
        spec.addr = buf.ptr();
        spec.memory = MemoryKind::Device;
        spec.device = g.ordinal() as i32;
        // SAFETY: the region is `buf`, an allocation of the host region's length on `g`, which
        // the Engine keeps in `dev` and drops after its worker.
        regions.push(unsafe { KvRegion::new(spec) });
        dev.push(buf);
    }
    if let Err(e) = worker.register_kv_caches(&regions) {
        panic!("registering device KV regions failed: {e}");
    }
    Engine { sched, worker, host, dev, regions, model: m, eff }
}

pub fn blocks(ids: &[u32]) -> BlocksPerGroup {
    BlocksPerGroup(vec![ids.iter().map(|b| BlockId(*b)).collect()])
}

pub fn step(n: u64) -> StepInfo {
    StepInfo { step: n, scheduled: vec![], finished: vec![] }
}

pub fn pblocks() -> Vec<u32> {
    (0..(PROMPT as u32).div_ceil(BS)).map(|i| 3 + i).collect()
}

/// Not contiguous, so a pull is several runs, not one.
pub fn dblocks() -> Vec<u32> {
    (0..(PROMPT as u32).div_ceil(BS)).map(|i| 2 + 2 * i).collect()
}

pub fn prefill_finish(p: &mut Engine, req: &str) -> serde_json::Map<String, Value> {
    let mut params = serde_json::Map::new();
    params.insert("do_remote_decode".into(), json!(true));
    let r = Request { id: req.into(), prompt_tokens: vec![7; PROMPT], kv_transfer_params: params };
    let fin = p.sched.request_finished(&r, &blocks(&pblocks())).unwrap();
    assert!(fin.delay_free);
    let meta = p.sched.build_connector_meta(&step(1)).unwrap();
    p.worker.bind_connector_meta(&meta).unwrap();
    fin.transfer_params.unwrap()
}

pub fn decode_start(d: &mut Engine, req: &str, params: serde_json::Map<String, Value>) {
    let r = Request { id: req.into(), prompt_tokens: vec![7; PROMPT], kv_transfer_params: params };
    let MatchResult::Matched { tokens, async_load } = d.sched.get_num_new_matched_tokens(&r, 0).unwrap()
    else {
        panic!("expected a match")
    };
    assert!(async_load);
    d.sched.update_state_after_alloc(&r, &blocks(&dblocks()), tokens).unwrap();
    let meta = d.sched.build_connector_meta(&step(1)).unwrap();
    d.worker.bind_connector_meta(&meta).unwrap();
    d.worker.start_load_kv().unwrap();
}

/// Polls `get_finished` until `pred` holds for what was reported so far (30 s at most).
pub fn wait(w: &mut dyn WorkerConnector, pred: impl Fn(&FinishedTransfers) -> bool) -> FinishedTransfers {
    let t0 = Instant::now();
    let mut acc = FinishedTransfers::default();
    while t0.elapsed() < Duration::from_secs(30) {
        let f = w.get_finished(&[]).unwrap();
        acc.finished_sending.extend(f.finished_sending);
        acc.finished_recving.extend(f.finished_recving);
        acc.failed_recving.extend(f.failed_recving);
        if pred(&acc) {
            return acc;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("timed out waiting; got {acc:?}")
}

/// Waits for a receive to finish or fail.
pub fn wait_recv(w: &mut dyn WorkerConnector) -> FinishedTransfers {
    wait(w, |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty())
}

pub fn geometry(e: &Engine) -> Geometry {
    let shape = BlockShape::of(&e.model, &e.eff);
    let regions = e
        .regions
        .iter()
        .map(|r| RegionShape { layers: r.layers().to_vec(), num_blocks: r.num_blocks() })
        .collect();
    Geometry::new(shape, e.eff.layout, regions)
}

/// Downloads the consumer's device regions (on `g`) and compares every element of tokens
/// [0, PROMPT - 1) with the producer's (host copies of what it uploaded).
pub fn assert_loaded(g: &Gpu, p: &mut Engine, d: &mut Engine) {
    // The consumer's regions start with other bytes (another salt): a block not copied fails.
    for i in 0..d.dev.len() {
        let ptr = d.dev[i].ptr();
        g.download(d.host.bytes_mut(i), ptr).unwrap();
    }
    let (gp, gd) = (geometry(p), geometry(d));
    let s = gp.shape();
    let (pb, db) = (pblocks(), dblocks());
    let mut checked = 0;
    for layer in p.model.kv_layers() {
        for part in 0..2 {
            for t in 0..PROMPT - 1 {
                let bi = t / s.tokens as usize;
                let ps = gp.span(layer, part, BlockId(pb[bi])).unwrap();
                let ds = gd.span(layer, part, BlockId(db[bi])).unwrap();
                let tok = (t % s.tokens as usize) as u32;
                for h in 0..s.heads {
                    for c in 0..s.head_dim {
                        let po = ps.offset + gp.inner_offset(h, tok, c);
                        let dof = ds.offset + gd.inner_offset(h, tok, c);
                        let a = p.host.bytes_mut(ps.region)[po..po + 2].to_vec();
                        let b = &d.host.bytes_mut(ds.region)[dof..dof + 2];
                        assert_eq!(&a[..], b, "layer {layer} part {part} token {t} head {h} channel {c}");
                        checked += 1;
                    }
                }
            }
        }
    }
    assert_eq!(checked, 3 * 2 * (PROMPT - 1) * 2 * 8);
}
