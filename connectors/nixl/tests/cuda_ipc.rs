//! Backend cuda_ipc with device KV regions, driven through the connector API as a host would.
//! Needs a GPU: every test skips, saying so, where none can be opened.
//!
//! - same process (the consumer uses the producer's device addresses; CUDA refuses to open a
//!   process's own IPC handles), with and without an NHD->HND permute;
//! - two processes: this test binary re-runs itself as the producer, the consumer opens its
//!   IPC handles (the real IPC path); then the producer dies and a load fails;
//! - a handle that cannot be opened is a failed receive, never a crash;
//! - the host-staged path (`cuda_ipc_path = "staged"`, what a GPU without peer access to the
//!   producer's gets automatically), in one process and across two, with a permute.
//!
//! `KVC_TEST_DECODE_GPU=1` on a two-GPU host puts every consumer on the second GPU.
#![cfg(feature = "cuda")]

use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorFactory, EffectiveLayout, FinishedTransfers, KvLayout, KvRegion,
    KvRole, MatchResult, MemoryKind, ModelSpec, Request, RequestId, SchedulerConnector, StepInfo,
    WorkerConnector,
};
use kvconnect_cuda::{DeviceBuffer, Gpu};
use kvconnect_nixl::harness::{context, effective, model, Regions};
use kvconnect_nixl::NixlFactory;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BLOCKS: u32 = 16;
const PROMPT: usize = 21;
const BS: u32 = 4;
const CHILD_ENV: &str = "KVC_CUDA_IPC_CHILD";

fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("skipping: no GPU ({e})");
            None
        }
    }
}

/// The consumers' GPU: `KVC_TEST_DECODE_GPU` (default 0, the producers' GPU).
fn decode_gpu() -> Gpu {
    let ordinal = std::env::var("KVC_TEST_DECODE_GPU").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    Gpu::open(ordinal).unwrap()
}

struct Engine {
    sched: Box<dyn SchedulerConnector>,
    worker: Box<dyn WorkerConnector>,
    host: Regions,
    dev: Vec<DeviceBuffer>,
    regions: Vec<KvRegion>,
    model: ModelSpec,
    eff: EffectiveLayout,
}

/// Device regions filled with distinct, position-dependent bytes (salted by engine id).
fn engine(g: &Gpu, role: KvRole, id: &str, layout: KvLayout) -> Engine {
    engine_on_path(g, role, id, layout, "auto")
}

fn engine_on_path(g: &Gpu, role: KvRole, id: &str, layout: KvLayout, path: &str) -> Engine {
    let m = model(3, 2, 8);
    let eff = effective(&m, layout, BS);
    let ctx = context(
        &m,
        &eff,
        role,
        id,
        json!({"backend": "cuda_ipc", "io_timeout": 2, "connect_timeout": 1, "cuda_ipc_path": path,
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
    worker.register_kv_caches(&regions).unwrap();
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

fn wait_recv(w: &mut dyn WorkerConnector) -> FinishedTransfers {
    let t0 = Instant::now();
    let mut acc = FinishedTransfers::default();
    while t0.elapsed() < Duration::from_secs(20) {
        let f = w.get_finished(&[]).unwrap();
        acc.finished_recving.extend(f.finished_recving);
        acc.failed_recving.extend(f.failed_recving);
        if !acc.finished_recving.is_empty() || !acc.failed_recving.is_empty() {
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

fn in_process(play: KvLayout, dlay: KvLayout, path: &str) {
    let Some(g) = gpu() else { return };
    let dg = decode_gpu();
    let mut p = engine(&g, KvRole::Producer, "prefill-0", play);
    let mut d = engine_on_path(&dg, KvRole::Consumer, "decode-0", dlay, path);
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    assert_eq!(meta["cuda_ipc"]["handles"].as_array().unwrap().len(), p.regions.len());
    d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta})).unwrap();
    let params = prefill_finish(&mut p, "req-1");
    decode_start(&mut d, "req-1", params);
    let f = wait_recv(d.worker.as_mut());
    assert_eq!(f.finished_recving, vec![RequestId::from("req-1")], "{f:?}");
    assert_loaded(&dg, &mut p, &mut d);
}

#[test]
fn same_process_equal_layouts() {
    in_process(KvLayout::HND, KvLayout::HND, "auto");
}

#[test]
fn same_process_fused_nhd_to_hnd_permute() {
    in_process(KvLayout::NHD, KvLayout::HND, "auto");
}

#[test]
fn same_process_host_staged_with_permute() {
    in_process(KvLayout::NHD, KvLayout::HND, "staged");
}

#[test]
fn unopenable_handle_is_a_failed_receive() {
    let Some(g) = gpu() else { return };
    let mut p = engine(&g, KvRole::Producer, "prefill-0", KvLayout::HND);
    let mut d = engine(&g, KvRole::Consumer, "decode-0", KvLayout::HND);
    let mut meta = p.worker.handshake_metadata().unwrap().unwrap();
    // Another pid makes the consumer open the handles; a handle of zeros names no allocation.
    meta["pid"] = json!(std::process::id() + 1);
    let n = meta["cuda_ipc"]["handles"].as_array().unwrap().len();
    meta["cuda_ipc"]["handles"] = json!(vec!["00".repeat(64); n]);
    d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta})).unwrap();
    let params = prefill_finish(&mut p, "req-1");
    decode_start(&mut d, "req-1", params);
    let f = wait_recv(d.worker.as_mut());
    assert_eq!(f.failed_recving, vec![RequestId::from("req-1")], "{f:?}");
    assert!(!d.worker.block_ids_with_load_errors().unwrap().is_empty());
}

/// The producer process of `two_processes`: prints its handshake metadata and the transfer
/// params on one line, then serves until its stdin closes.
#[test]
fn child_producer() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let Some(g) = gpu() else { return };
    let mut p = engine(&g, KvRole::Producer, "prefill-0", KvLayout::NHD);
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    let params = prefill_finish(&mut p, "req-1");
    println!("\nKVC-CHILD {}", json!({"meta": meta, "params": params}));
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    let _ = p.worker.get_finished(&[]);
}

#[test]
fn two_processes_ipc_then_dead_peer() {
    two_processes("auto");
}

#[test]
fn two_processes_host_staged_then_dead_peer() {
    two_processes("staged");
}

fn two_processes(path: &str) {
    let Some(g) = gpu() else { return };
    let dg = decode_gpu();
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["--exact", "child_producer", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut line = String::new();
    let mut r = BufReader::new(out);
    loop {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "producer process ended without its metadata");
        // The test harness may print "test child_producer ... " on the same line first.
        if let Some((_, rest)) = line.split_once("KVC-CHILD ") {
            line = rest.to_owned();
            break;
        }
    }
    let v: Value = serde_json::from_str(&line).unwrap();
    let params = v["params"].as_object().unwrap().clone();
    // The consumer in HND: the permute is fused into the copy across processes.
    let mut d = engine_on_path(&dg, KvRole::Consumer, "decode-0", KvLayout::HND, path);
    d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": v["meta"]})).unwrap();
    decode_start(&mut d, "req-1", params.clone());
    let f = wait_recv(d.worker.as_mut());
    assert_eq!(f.finished_recving, vec![RequestId::from("req-1")], "{f:?}");
    // The producer's bytes are deterministic: rebuild them here (same id, layout, salt).
    let mut p_ref = engine(&g, KvRole::Both, "prefill-0", KvLayout::NHD);
    assert_loaded(&dg, &mut p_ref, &mut d);
    drop(p_ref);

    // The producer dies: a later load from it fails (policy applies), nothing hangs.
    drop(child.stdin.take());
    let _ = child.kill();
    let _ = child.wait();
    let mut d2 = engine_on_path(&dg, KvRole::Consumer, "decode-1", KvLayout::HND, path);
    d2.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": v["meta"]})).unwrap();
    decode_start(&mut d2, "req-1", params);
    let f = wait_recv(d2.worker.as_mut());
    assert_eq!(f.failed_recving, vec![RequestId::from("req-1")], "{f:?}");
}
