//! NIXL with GPU memory. Needs a GPU and the NIXL library: every test skips, saying so,
//! where either is missing (`NIXL_LIB_DIR` names the library's directory;
//! scripts/fetch-nixl.sh fetches it).
//!
//! - the raw VRAM probe: two agents, UCX, two device buffers registered as VRAM, one READ of
//!   shuffled blocks, a notification, every byte compared;
//! - backend nixl over device KV regions, driven through the connector API as a host would:
//!   a producer and a consumer engine in this process, a request loaded VRAM to VRAM and
//!   compared element by element, the producer told through NIXL's notification;
//! - a layout the consumer would have to permute on receive is refused at the handshake,
//!   naming backend cuda_ipc.
//!
//! NIXL agents created concurrently may deadlock (nixl-sys runs its own tests one at a
//! time), so every test holds `SERIAL`.
#![cfg(feature = "cuda")]

use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorFactory, EffectiveLayout, FinishedTransfers, KvLayout, KvRegion,
    KvRole, MatchResult, MemoryKind, ModelSpec, Request, RequestId, SchedulerConnector, StepInfo,
    WorkerConnector,
};
use kvconnect_cuda::{DeviceBuffer, Gpu};
use kvconnect_nixl::harness::{context, effective, model, Regions};
use kvconnect_nixl::nixl_vram::{probe, VramProbe};
use kvconnect_nixl::NixlFactory;
use serde_json::{json, Value};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

/// GPU 0 and the serialising lock when there is a GPU and the NIXL library; `None` (after
/// saying which is missing) otherwise.
fn gpu_and_nixl_or_skip() -> Option<(Gpu, MutexGuard<'static, ()>)> {
    let g = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("skipping: no GPU ({e})");
            return None;
        }
    };
    if let Err(e) = kvconnect_nixl::nixl_lib::load() {
        eprintln!("skipping: NIXL library not found (set NIXL_LIB_DIR or run scripts/fetch-nixl.sh): {e}");
        return None;
    }
    Some((g, SERIAL.lock().unwrap_or_else(|p| p.into_inner())))
}

#[test]
fn vram_read_of_shuffled_blocks_delivers_every_byte() {
    let Some((_g, _serial)) = gpu_and_nixl_or_skip() else { return };
    // 4 MiB in 257 blocks: a prime count, so the block size is not a power of two either.
    let r = match probe(VramProbe { gpu: 0, bytes: 4 << 20, blocks: 257, repeat: 2 }) {
        Ok(r) => r,
        Err(e) => panic!("NIXL VRAM probe failed: {e}"),
    };
    eprintln!("{}", serde_json::to_string(&r).unwrap());
    assert_eq!(r.blocks, 257);
    assert_eq!(r.bytes, r.block_bytes * 257);
    assert!(r.verified, "destination differs from its source blocks at offset {:?}", r.first_mismatch);
    assert_eq!(r.notifications, 3, "one notification per READ (warm-up + 2)");
    assert!(r.nixl_read_ms > 0.0 && r.dtod_ms > 0.0);
}

const BLOCKS: u32 = 16;
const PROMPT: usize = 21;
const BS: u32 = 4;

struct Engine {
    sched: Box<dyn SchedulerConnector>,
    worker: Box<dyn WorkerConnector>,
    host: Regions,
    dev: Vec<DeviceBuffer>,
    regions: Vec<KvRegion>,
    model: ModelSpec,
    eff: EffectiveLayout,
}

/// An engine on backend nixl whose KV regions are device memory of `g`, filled with
/// distinct, position-dependent bytes (salted by engine id).
fn engine(g: &Gpu, role: KvRole, id: &str, layout: KvLayout) -> Engine {
    let m = model(3, 2, 8);
    let eff = effective(&m, layout, BS);
    let ctx = context(
        &m,
        &eff,
        role,
        id,
        json!({"backend": "nixl", "io_timeout": 5, "connect_timeout": 2,
            "side_channel_host": "127.0.0.1", "side_channel_port": 5600}),
    );
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
        let buf = g.alloc(host.regions()[i].len as usize).unwrap();
        g.upload(buf.ptr(), host.bytes_mut(i)).unwrap();
        let mut r = host.regions()[i].clone();
        r.addr = buf.ptr();
        r.memory = MemoryKind::Device;
        r.device = g.ordinal() as i32;
        regions.push(r);
        dev.push(buf);
    }
    if let Err(e) = worker.register_kv_caches(&regions) {
        panic!("registering device KV regions with backend nixl failed: {e}");
    }
    Engine { sched, worker, host, dev, regions, model: m, eff }
}

fn blocks(ids: &[u32]) -> BlocksPerGroup {
    BlocksPerGroup(vec![ids.iter().map(|b| BlockId(*b)).collect()])
}

fn step(n: u64) -> StepInfo {
    StepInfo { step: n, scheduled: vec![], finished: vec![] }
}

fn pblocks() -> Vec<u32> {
    (0..(PROMPT as u32).div_ceil(BS)).map(|i| 3 + i).collect()
}

/// Not contiguous, so the pull is several descriptors, not one.
fn dblocks() -> Vec<u32> {
    (0..(PROMPT as u32).div_ceil(BS)).map(|i| 2 + 2 * i).collect()
}

fn prefill_finish(p: &mut Engine, req: &str) -> serde_json::Map<String, Value> {
    let mut params = serde_json::Map::new();
    params.insert("do_remote_decode".into(), json!(true));
    let r = Request { id: req.into(), prompt_tokens: vec![7; PROMPT], kv_transfer_params: params };
    let fin = p.sched.request_finished(&r, &blocks(&pblocks())).unwrap();
    assert!(fin.delay_free);
    let meta = p.sched.build_connector_meta(&step(1)).unwrap();
    p.worker.bind_connector_meta(&meta).unwrap();
    fin.transfer_params.unwrap()
}

fn decode_start(d: &mut Engine, req: &str, params: serde_json::Map<String, Value>) {
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

fn wait(w: &mut dyn WorkerConnector, pred: impl Fn(&FinishedTransfers) -> bool) -> FinishedTransfers {
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

fn geometry(e: &Engine) -> Geometry {
    let shape = BlockShape::of(&e.model, &e.eff);
    let regions = e
        .regions
        .iter()
        .map(|r| RegionShape { layers: r.layers.clone(), num_blocks: r.num_blocks })
        .collect();
    Geometry::new(shape, e.eff.layout, regions)
}

/// Downloads the consumer's device regions and compares every element of tokens
/// [0, PROMPT - 1) with the producer's (host copies of what it uploaded).
fn assert_loaded(g: &Gpu, p: &mut Engine, d: &mut Engine) {
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

#[test]
fn connector_loads_a_request_vram_to_vram() {
    let Some((g, _serial)) = gpu_and_nixl_or_skip() else { return };
    let mut p = engine(&g, KvRole::Producer, "prefill-0", KvLayout::HND);
    let mut d = engine(&g, KvRole::Consumer, "decode-0", KvLayout::HND);
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    assert_eq!(meta["nixl"]["vram_device"], json!(0), "{meta}");
    d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta})).unwrap();
    let params = prefill_finish(&mut p, "req-1");
    decode_start(&mut d, "req-1", params);
    let f = wait(d.worker.as_mut(), |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("req-1")], "{f:?}");
    assert_loaded(&g, &mut p, &mut d);
    // The consumer's NIXL notification reaches the producer, which then frees the blocks.
    let f = wait(p.worker.as_mut(), |f| !f.finished_sending.is_empty());
    assert_eq!(f.finished_sending, vec![RequestId::from("req-1")]);
}

#[test]
fn layout_needing_a_permute_is_refused_naming_cuda_ipc() {
    let Some((g, _serial)) = gpu_and_nixl_or_skip() else { return };
    let mut p = engine(&g, KvRole::Producer, "prefill-0", KvLayout::NHD);
    let mut d = engine(&g, KvRole::Consumer, "decode-0", KvLayout::HND);
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    let e = d
        .worker
        .set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cuda_ipc") && e.contains("NHD") && e.contains("HND"), "{e}");
}

#[test]
fn host_kv_producer_is_refused_by_a_gpu_kv_consumer() {
    let Some((g, _serial)) = gpu_and_nixl_or_skip() else { return };
    let mut d = engine(&g, KvRole::Consumer, "decode-0", KvLayout::HND);
    // A producer whose KV is in host memory (same geometry, backend nixl, DRAM).
    let m = model(3, 2, 8);
    let eff = effective(&m, KvLayout::HND, BS);
    let ctx = context(
        &m,
        &eff,
        KvRole::Producer,
        "prefill-host",
        json!({"backend": "nixl", "side_channel_host": "127.0.0.1", "side_channel_port": 5600}),
    );
    // Declared before the worker, so that it outlives the worker's NIXL registrations.
    let mem = Regions::allocate(&m, &eff, BLOCKS, None).unwrap();
    let mut pw = NixlFactory.create_worker(&ctx).unwrap();
    pw.register_kv_caches(mem.regions()).unwrap();
    let meta = pw.handshake_metadata().unwrap().unwrap();
    assert!(meta["nixl"].get("vram_device").is_none(), "{meta}");
    let e = d
        .worker
        .set_peer_handshake_metadata(&json!({"engine_id": "prefill-host", "peer": meta}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("host memory (DRAM)") && e.contains("GPU memory (VRAM)"), "{e}");
}
