//! Producer and consumer connector instances in one process, driven through the connector
//! API as a host would: register regions, prefill finishes a request, decode matches,
//! allocates, loads, and both report what finished.

use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorFactory, EffectiveLayout, FinishedTransfers, KvLayout, KvRole,
    MatchResult, ModelSpec, Request, RequestId, SchedulerConnector, StepInfo, WorkerConnector,
};
use kvconnect_bench::harness::{context, effective, model, Regions};
use kvconnect_dataplane::auth::{self, Secret, Side};
use kvconnect_nixl::wire::{authenticate_client, read_frame, write_frame, ClientMsg, ServerMsg, CHANNEL};
use kvconnect_nixl::NixlFactory;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

const BLOCKS: u32 = 16;

struct Engine {
    sched: Box<dyn SchedulerConnector>,
    worker: Box<dyn WorkerConnector>,
    mem: Regions,
    model: ModelSpec,
    eff: EffectiveLayout,
}

fn shm_prefix(tag: &str) -> String {
    format!("/kvc-nixl-t{}-{tag}", std::process::id())
}

fn engine(
    role: KvRole,
    id: &str,
    layout: KvLayout,
    block_size: u32,
    extra: Value,
    shm: Option<&str>,
) -> Engine {
    let m = model(3, 2, 8);
    let eff = effective(&m, layout, block_size);
    let ctx = context(&m, &eff, role, id, extra);
    let mut sched = NixlFactory.create_scheduler(&ctx).unwrap();
    let mut worker = NixlFactory.create_worker(&ctx).unwrap();
    let mut mem = Regions::allocate(&m, &eff, BLOCKS, shm).unwrap();
    // Distinct, position-dependent bytes so a misplaced copy cannot pass.
    for i in 0..mem.regions().len() {
        let salt = (id.len() * 31 + i * 7) as u32;
        for (j, b) in mem.bytes_mut(i).iter_mut().enumerate() {
            *b = ((j as u32).wrapping_mul(2654435761).wrapping_add(salt) >> 13) as u8;
        }
    }
    worker.register_kv_caches(mem.regions()).unwrap();
    let _ = &mut sched;
    Engine { sched, worker, mem, model: m, eff }
}

fn producer(backend: &str, layout: KvLayout, bs: u32, lease: f64, tag: &str) -> Engine {
    let extra = json!({"backend": backend, "kv_lease_duration": lease, "io_timeout": 2,
        "side_channel_host": "127.0.0.1", "side_channel_port": 5600});
    let shm = shm_prefix(tag);
    engine(KvRole::Producer, "prefill-0", layout, bs, extra, (backend == "shm").then_some(shm.as_str()))
}

fn consumer(backend: &str, layout: KvLayout, bs: u32) -> Engine {
    consumer_with(backend, layout, bs, json!({}))
}

/// A consumer with extra settings merged into the usual ones. It loads asynchronously (`load:
/// "async"`) unless `more` says otherwise: the flow most tests here drive (match, start, and
/// the load reported by `get_finished` later).
fn consumer_with(backend: &str, layout: KvLayout, bs: u32, more: Value) -> Engine {
    let mut extra = json!({"backend": backend, "io_timeout": 1, "connect_timeout": 1, "load": "async"});
    if let (Some(e), Some(m)) = (extra.as_object_mut(), more.as_object()) {
        e.extend(m.clone());
    }
    engine(KvRole::Consumer, "decode-0", layout, bs, extra, None)
}

/// A connection to a producer that has read the challenge and answered nothing yet.
fn raw(addr: &str) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let m: ServerMsg = read_frame(&mut c, 1 << 20).unwrap();
    assert!(matches!(m, ServerMsg::Challenge { .. }), "{m:?}");
    c
}

/// A connection to a producer that proved `secret`.
fn authed(addr: &str, secret: Option<&Secret>) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    authenticate_client(&mut c, secret, 1 << 20).unwrap();
    c
}

fn ask(c: &mut TcpStream, m: &ClientMsg) -> ServerMsg {
    write_frame(c, m).unwrap();
    read_frame(c, 1 << 20).unwrap()
}

fn listen_addr(p: &mut Engine) -> String {
    p.worker.handshake_metadata().unwrap().unwrap()["listen"].as_str().unwrap().to_owned()
}

fn blocks(ids: &[u32]) -> BlocksPerGroup {
    BlocksPerGroup(vec![ids.iter().map(|b| BlockId(*b)).collect()])
}

fn step(n: u64) -> StepInfo {
    StepInfo { step: n, scheduled: vec![], finished: vec![] }
}

/// Prefill finishes `req` holding `pblocks`; returns the transfer params.
fn prefill_finish(
    p: &mut Engine,
    req: &str,
    prompt_len: usize,
    pblocks: &[u32],
) -> serde_json::Map<String, Value> {
    let mut params = serde_json::Map::new();
    params.insert("do_remote_decode".into(), json!(true));
    let r = Request { id: req.into(), prompt_tokens: vec![7; prompt_len], kv_transfer_params: params };
    let fin = p.sched.request_finished(&r, &blocks(pblocks)).unwrap();
    assert!(fin.delay_free);
    let meta = p.sched.build_connector_meta(&step(1)).unwrap();
    p.worker.bind_connector_meta(&meta).unwrap();
    fin.transfer_params.unwrap()
}

fn handshake(p: &mut Engine, d: &mut Engine) {
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta})).unwrap();
}

/// Decode matches, allocates `dblocks` and starts the load; returns the matched tokens.
fn decode_start(
    d: &mut Engine,
    req: &str,
    prompt_len: usize,
    params: serde_json::Map<String, Value>,
    dblocks: &[u32],
) -> usize {
    decode_begin(d, req, prompt_len, params, dblocks, true)
}

/// As `decode_start`, checking that the match is asynchronous (`want_async`) or not.
fn decode_begin(
    d: &mut Engine,
    req: &str,
    prompt_len: usize,
    params: serde_json::Map<String, Value>,
    dblocks: &[u32],
    want_async: bool,
) -> usize {
    let r = Request { id: req.into(), prompt_tokens: vec![7; prompt_len], kv_transfer_params: params };
    let MatchResult::Matched { tokens, async_load } = d.sched.get_num_new_matched_tokens(&r, 0).unwrap()
    else {
        panic!("expected a match")
    };
    assert_eq!(async_load, want_async);
    d.sched.update_state_after_alloc(&r, &blocks(dblocks), tokens).unwrap();
    let meta = d.sched.build_connector_meta(&step(1)).unwrap();
    d.worker.bind_connector_meta(&meta).unwrap();
    d.worker.start_load_kv().unwrap();
    tokens
}

fn wait_finished(
    w: &mut dyn WorkerConnector,
    pred: impl Fn(&FinishedTransfers) -> bool,
) -> FinishedTransfers {
    let t0 = Instant::now();
    let mut acc = FinishedTransfers::default();
    while t0.elapsed() < Duration::from_secs(15) {
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
        .mem
        .regions()
        .iter()
        .map(|r| RegionShape { layers: r.layers().to_vec(), num_blocks: r.num_blocks() })
        .collect();
    Geometry::new(shape, e.eff.layout, regions)
}

/// Every element of tokens [0, n) equal on both sides, addressed through each side's layout.
fn assert_same_kv(p: &mut Engine, pblocks: &[u32], d: &mut Engine, dblocks: &[u32], n: usize) {
    let (gp, gd) = (geometry(p), geometry(d));
    let (sp, sd) = (gp.shape(), gd.shape());
    let mut checked = 0;
    for layer in p.model.kv_layers() {
        for part in 0..2 {
            for t in 0..n {
                let (pb, db) = (pblocks[t / sp.tokens as usize], dblocks[t / sd.tokens as usize]);
                let ps = gp.span(layer, part, BlockId(pb)).unwrap();
                let ds = gd.span(layer, part, BlockId(db)).unwrap();
                for h in 0..sp.heads {
                    for c in 0..sp.head_dim {
                        let po = ps.offset + gp.inner_offset(h, (t % sp.tokens as usize) as u32, c);
                        let dof = ds.offset + gd.inner_offset(h, (t % sd.tokens as usize) as u32, c);
                        let a = &p.mem.bytes_mut(ps.region)[po..po + 2].to_vec();
                        let b = &d.mem.bytes_mut(ds.region)[dof..dof + 2];
                        assert_eq!(a, b, "layer {layer} part {part} token {t} head {h} channel {c}");
                        checked += 1;
                    }
                }
            }
        }
    }
    assert_eq!(checked, 3 * 2 * n * 2 * 8);
}

fn full_flow(backend: &str, play: KvLayout, dlay: KvLayout, pbs: u32, dbs: u32, tag: &str) {
    full_flow_with(backend, play, dlay, pbs, dbs, tag, json!({}))
}

fn full_flow_with(
    backend: &str,
    play: KvLayout,
    dlay: KvLayout,
    pbs: u32,
    dbs: u32,
    tag: &str,
    consumer_extra: Value,
) {
    let mut p = producer(backend, play, pbs, 30.0, tag);
    let mut d = consumer_with(backend, dlay, dbs, consumer_extra);
    handshake(&mut p, &mut d);
    let prompt = 21;
    let pblocks: Vec<u32> = (0..(prompt as u32).div_ceil(pbs)).map(|i| 3 + i).collect();
    let dblocks: Vec<u32> = (0..(prompt as u32).div_ceil(dbs)).map(|i| 2 + 2 * i).collect();
    let params = prefill_finish(&mut p, "req-1", prompt, &pblocks);
    assert_eq!(params["remote_engine_id"], json!("prefill-0"));
    assert_eq!(params["remote_port"], json!(5600));
    assert_eq!(params["remote_num_tokens"], json!(prompt));
    let tokens = decode_start(&mut d, "req-1", prompt, params, &dblocks);
    assert_eq!(tokens, prompt - 1);
    let f =
        wait_finished(d.worker.as_mut(), |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("req-1")], "{f:?}");
    assert!(f.failed_recving.is_empty());
    assert_same_kv(&mut p, &pblocks, &mut d, &dblocks, tokens);
    let f = wait_finished(p.worker.as_mut(), |f| !f.finished_sending.is_empty());
    assert_eq!(f.finished_sending, vec![RequestId::from("req-1")]);
}

#[test]
fn tcp_pull_full_worker_flow() {
    full_flow("tcp", KvLayout::HND, KvLayout::HND, 4, 4, "a");
}

#[test]
fn tcp_pull_on_parallel_streams_lands_every_byte() {
    // 3840 bytes cut into three streams of at least 1 KiB, each its own connection.
    let more = json!({"tcp_streams": 3, "tcp_stream_min_bytes": 1024, "tcp_socket_buffer": 65536});
    full_flow_with("tcp", KvLayout::HND, KvLayout::HND, 4, 4, "w", more);
}

#[test]
fn shm_pull_full_worker_flow() {
    full_flow("shm", KvLayout::HND, KvLayout::HND, 4, 4, "b");
}

#[test]
fn nhd_to_hnd_is_permuted_on_receive_exactly() {
    full_flow("tcp", KvLayout::NHD, KvLayout::HND, 4, 4, "c");
    full_flow("shm", KvLayout::NHD, KvLayout::HND, 4, 4, "d");
}

#[test]
fn cross_layer_and_block_size_ratio_are_adapted() {
    full_flow("tcp", KvLayout::HND, KvLayout::HND, 8, 4, "e");
    full_flow("shm", KvLayout::BLHNC, KvLayout::BLHNC, 4, 4, "f");
    full_flow("shm", KvLayout::NHD, KvLayout::HND, 4, 8, "g");
}

#[test]
fn lease_expiry_frees_blocks_and_a_late_decode_fails() {
    let mut p = producer("tcp", KvLayout::HND, 4, 0.3, "h");
    let mut d = consumer("tcp", KvLayout::HND, 4);
    handshake(&mut p, &mut d);
    let params = prefill_finish(&mut p, "late", 9, &[1, 2, 3]);
    assert!(p.worker.get_finished(&[]).unwrap().finished_sending.is_empty(), "held within the lease");
    std::thread::sleep(Duration::from_millis(400));
    let f = p.worker.get_finished(&[]).unwrap();
    assert_eq!(f.finished_sending, vec![RequestId::from("late")], "freed at lease expiry");
    decode_start(&mut d, "late", 9, params, &[4, 5, 6]);
    let f =
        wait_finished(d.worker.as_mut(), |f| !f.failed_recving.is_empty() || !f.finished_recving.is_empty());
    assert_eq!(f.failed_recving, vec![RequestId::from("late")]);
    // The load was to fill tokens 0..8 (decode computes the prompt's last token itself):
    // blocks 4 and 5. Block 6 holds only that last token, which no load writes, so vLLM's
    // "recompute" policy must not be told it failed.
    let bad = d.worker.block_ids_with_load_errors().unwrap();
    assert_eq!(bad, vec![BlockId(4), BlockId(5)]);
}

#[test]
fn unknown_request_is_a_failed_receive_on_both_backends() {
    for (backend, tag) in [("tcp", "i"), ("shm", "j")] {
        let mut p = producer(backend, KvLayout::HND, 4, 30.0, tag);
        let mut d = consumer(backend, KvLayout::HND, 4);
        handshake(&mut p, &mut d);
        let params = json!({"do_remote_prefill": true, "remote_engine_id": "prefill-0", "remote_host": "127.0.0.1",
            "remote_port": 1, "remote_block_ids": [[1, 2]], "remote_num_tokens": 8});
        decode_start(&mut d, "never-prefilled", 8, params.as_object().cloned().unwrap(), &[1, 2]);
        let f = wait_finished(d.worker.as_mut(), |f| {
            !f.failed_recving.is_empty() || !f.finished_recving.is_empty()
        });
        assert_eq!(f.failed_recving, vec![RequestId::from("never-prefilled")], "{backend}");
    }
}

#[test]
fn garbage_and_oversized_frames_close_that_connection_only() {
    let mut p = producer("tcp", KvLayout::HND, 4, 30.0, "k");
    let addr = listen_addr(&mut p);
    // Oversized: a 1 GiB length prefix, before and after authenticating.
    let mut buf = [0u8; 16];
    for mut big in [raw(&addr), authed(&addr, None)] {
        big.write_all(&(1u32 << 30).to_be_bytes()).unwrap();
        assert_eq!(big.read(&mut buf).unwrap_or(0), 0, "closed without an answer");
    }
    // Garbage: a well-sized frame that is not a message.
    for mut junk in [raw(&addr), authed(&addr, None)] {
        junk.write_all(&7u32.to_be_bytes()).unwrap();
        junk.write_all(b"\x00garbag").unwrap();
        assert_eq!(junk.read(&mut buf).unwrap_or(0), 0);
    }
    // A run outside the request's blocks is refused, and that connection stays usable.
    let params = prefill_finish(&mut p, "ok", 9, &[1, 2, 3]);
    let capability = params["remote_capability"].as_str().unwrap().to_owned();
    let mut c = authed(&addr, None);
    let m = ask(&mut c, &ClientMsg::Read { request: "ok".into(), capability, runs: vec![(0, 0, 1 << 20)] });
    assert!(
        matches!(m, ServerMsg::Error { ref reason } if reason.contains("not inside the blocks")),
        "{m:?}"
    );
    // Others are still served, end to end.
    let mut d = consumer("tcp", KvLayout::HND, 4);
    handshake(&mut p, &mut d);
    let params = prefill_finish(&mut p, "after", 9, &[5, 6, 7]);
    decode_start(&mut d, "after", 9, params, &[1, 2, 3]);
    let f =
        wait_finished(d.worker.as_mut(), |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("after")]);
}

/// A producer that answers a read with half the bytes it promised, then `close`s or stalls.
fn fake_producer(close: bool) -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let server_nonce = auth::nonce().unwrap();
        write_frame(&mut s, &ServerMsg::Challenge { nonce: server_nonce.clone() }).unwrap();
        let Ok(ClientMsg::Auth { nonce, .. }) = read_frame(&mut s, 1 << 20) else { return };
        let proof = auth::proof(None, CHANNEL, Side::Server, &server_nonce, &nonce);
        write_frame(&mut s, &ServerMsg::Authenticated { proof }).unwrap();
        loop {
            let m: ClientMsg = match read_frame(&mut s, 1 << 24) {
                Ok(m) => m,
                Err(_) => return,
            };
            match m {
                ClientMsg::Hold { .. } => write_frame(&mut s, &ServerMsg::Ok).unwrap(),
                ClientMsg::Pin { .. } => write_frame(&mut s, &ServerMsg::Held { ms: 30_000 }).unwrap(),
                ClientMsg::Read { runs, .. } => {
                    let total: u64 = runs.iter().map(|r| r.2).sum();
                    write_frame(&mut s, &ServerMsg::Data { bytes: total }).unwrap();
                    s.write_all(&vec![1u8; total as usize / 2]).unwrap();
                    if close {
                        return;
                    }
                    std::thread::sleep(Duration::from_secs(3));
                    return;
                }
                ClientMsg::Done { .. } | ClientMsg::DoneBy { .. } => {
                    write_frame(&mut s, &ServerMsg::Ok).unwrap()
                }
                ClientMsg::Auth { .. } => return,
            }
        }
    });
    (addr, h)
}

/// A producer's listener that answers each `pin` with the next of `pins` (then `held` for 30
/// s) and every `done` with `ok`, and records the ops it was sent. The pin numbered
/// `close_at` (from 0) it does not answer: it closes that connection and serves the next.
fn scripted_pins(
    mut pins: Vec<ServerMsg>,
    close_at: Option<usize>,
) -> (String, std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let ops = std::sync::Arc::new(std::sync::Mutex::new(Vec::<&'static str>::new()));
    let seen = ops.clone();
    pins.reverse();
    std::thread::spawn(move || loop {
        let Ok((mut s, _)) = l.accept() else { return };
        let server_nonce = auth::nonce().unwrap();
        write_frame(&mut s, &ServerMsg::Challenge { nonce: server_nonce.clone() }).unwrap();
        let Ok(ClientMsg::Auth { nonce, .. }) = read_frame(&mut s, 1 << 20) else { return };
        let proof = auth::proof(None, CHANNEL, Side::Server, &server_nonce, &nonce);
        write_frame(&mut s, &ServerMsg::Authenticated { proof }).unwrap();
        while let Ok(m) = read_frame::<_, ClientMsg>(&mut s, 1 << 24) {
            let answer = match m {
                ClientMsg::Pin { .. } => {
                    let mut seen = seen.lock().unwrap();
                    if close_at == Some(seen.iter().filter(|o| o.starts_with("pin")).count()) {
                        seen.push("pin, closed unanswered");
                        break;
                    }
                    seen.push("pin");
                    pins.pop().unwrap_or(ServerMsg::Held { ms: 30_000 })
                }
                ClientMsg::Done { .. } | ClientMsg::DoneBy { .. } => {
                    seen.lock().unwrap().push("done");
                    ServerMsg::Ok
                }
                _ => {
                    seen.lock().unwrap().push("other");
                    ServerMsg::Error { reason: "not expected here".into() }
                }
            };
            if write_frame(&mut s, &answer).is_err() {
                break;
            }
        }
    });
    (addr, ops)
}

/// Waits (up to 5 s) until `ops` holds `n` entries, then a moment more for any beyond.
fn ops_after(ops: &std::sync::Mutex<Vec<&'static str>>, n: usize) -> Vec<&'static str> {
    let t0 = Instant::now();
    while ops.lock().unwrap().len() < n && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(50));
    ops.lock().unwrap().clone()
}

#[test]
fn a_pin_whose_kept_connection_closes_unanswered_is_asked_again_on_a_new_one() {
    let mut p = producer("shm", KvLayout::HND, 4, 30.0, "pinclose");
    let mut d = consumer("shm", KvLayout::HND, 4);
    let mut meta = p.worker.handshake_metadata().unwrap().unwrap();
    // The second load's pin goes out on the connection the first load kept, which closes
    // without answering it (a producer closing an idle link just then).
    let (fake, ops) = scripted_pins(vec![], Some(1));
    meta["listen"] = json!(fake);
    d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta})).unwrap();
    for (req, src, dst) in [("pc1", [1, 2, 3], [4, 5, 6]), ("pc2", [7, 1, 2], [3, 5, 4])] {
        let params = prefill_finish(&mut p, req, 9, &src);
        decode_start(&mut d, req, 9, params, &dst);
        let f = wait_finished(d.worker.as_mut(), |f| {
            !f.failed_recving.is_empty() || !f.finished_recving.is_empty()
        });
        assert_eq!(f.finished_recving, vec![RequestId::from(req)], "{f:?}");
        assert_same_kv(&mut p, &src, &mut d, &dst, 8);
    }
    let want = ["pin", "done", "pin, closed unanswered", "pin", "done"];
    assert_eq!(ops_after(&ops, want.len()), want);
}

#[test]
fn a_copy_that_outlasts_its_pins_hold_is_pinned_again_after_it() {
    // The pin promises no time at all, so every copy outlasts it: a second pin after the copy
    // decides the load, and only then is `done` sent.
    let cases = [
        (ServerMsg::Held { ms: 30_000 }, true, vec!["pin", "pin", "done"]),
        (ServerMsg::Error { reason: "request outlast is not held".into() }, false, vec!["pin", "pin"]),
    ];
    for (i, (second, whole, want)) in cases.into_iter().enumerate() {
        let mut p = producer("shm", KvLayout::HND, 4, 30.0, &format!("outlast{i}"));
        let mut d = consumer("shm", KvLayout::HND, 4);
        let mut meta = p.worker.handshake_metadata().unwrap().unwrap();
        let (fake, ops) = scripted_pins(vec![ServerMsg::Held { ms: 0 }, second], None);
        meta["listen"] = json!(fake);
        d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta})).unwrap();
        let params = prefill_finish(&mut p, "outlast", 9, &[1, 2, 3]);
        decode_start(&mut d, "outlast", 9, params, &[4, 5, 6]);
        let f = wait_finished(d.worker.as_mut(), |f| {
            !f.failed_recving.is_empty() || !f.finished_recving.is_empty()
        });
        let id = vec![RequestId::from("outlast")];
        if whole {
            assert_eq!(f.finished_recving, id);
            assert_same_kv(&mut p, &[1, 2, 3], &mut d, &[4, 5, 6], 8);
        } else {
            assert_eq!(f.failed_recving, id, "the second pin was refused");
        }
        // `done` goes out after the load is reported, its answer read later.
        assert_eq!(ops_after(&ops, want.len()), want, "case {i}");
    }
}

#[test]
fn producer_killed_mid_transfer_is_a_failed_receive_within_the_timeout() {
    for close in [true, false] {
        let mut p = producer("tcp", KvLayout::HND, 4, 30.0, if close { "l" } else { "m" });
        let mut d = consumer("tcp", KvLayout::HND, 4);
        let mut meta = p.worker.handshake_metadata().unwrap().unwrap();
        let (fake, h) = fake_producer(close);
        meta["listen"] = json!(fake);
        d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta})).unwrap();
        let params = prefill_finish(&mut p, "cut", 9, &[1, 2, 3]);
        let t0 = Instant::now();
        decode_start(&mut d, "cut", 9, params, &[1, 2, 3]);
        let f = wait_finished(d.worker.as_mut(), |f| {
            !f.failed_recving.is_empty() || !f.finished_recving.is_empty()
        });
        assert_eq!(f.failed_recving, vec![RequestId::from("cut")], "close={close}");
        assert!(t0.elapsed() < Duration::from_secs(5), "io_timeout is 1 s: {:?}", t0.elapsed());
        h.join().unwrap();
    }
}

#[test]
fn producer_shut_down_is_a_failed_receive() {
    let mut p = producer("shm", KvLayout::HND, 4, 30.0, "n");
    let mut d = consumer("shm", KvLayout::HND, 4);
    handshake(&mut p, &mut d);
    let params = prefill_finish(&mut p, "gone", 9, &[1, 2, 3]);
    p.worker.shutdown().unwrap();
    decode_start(&mut d, "gone", 9, params, &[1, 2, 3]);
    let f =
        wait_finished(d.worker.as_mut(), |f| !f.failed_recving.is_empty() || !f.finished_recving.is_empty());
    assert_eq!(f.failed_recving, vec![RequestId::from("gone")]);
}

#[test]
fn shm_backend_refuses_a_peer_without_shared_memory_regions() {
    let mut p = producer("tcp", KvLayout::HND, 4, 30.0, "o"); // heap regions
    let mut d = consumer("shm", KvLayout::HND, 4);
    handshake(&mut p, &mut d);
    let params = prefill_finish(&mut p, "noshm", 9, &[1, 2, 3]);
    decode_start(&mut d, "noshm", 9, params, &[1, 2, 3]);
    let f =
        wait_finished(d.worker.as_mut(), |f| !f.failed_recving.is_empty() || !f.finished_recving.is_empty());
    assert_eq!(f.failed_recving, vec![RequestId::from("noshm")]);
}

#[test]
fn missing_side_channel_is_a_clear_error() {
    // Backend nixl's own tests (library present or missing) are in tests/nixl_backend.rs.
    let m = model(3, 2, 8);
    let eff = effective(&m, KvLayout::HND, 4);
    let ctx = context(&m, &eff, KvRole::Producer, "p", json!({}));
    let mut s = NixlFactory.create_scheduler(&ctx).unwrap();
    let mut params = serde_json::Map::new();
    params.insert("do_remote_decode".into(), json!(true));
    let r = Request { id: "r".into(), prompt_tokens: vec![1; 4], kv_transfer_params: params };
    let e = s.request_finished(&r, &blocks(&[1])).unwrap_err().to_string();
    assert!(e.contains("side_channel_host"), "{e}");
}

#[test]
fn incompatible_peer_and_mismatched_plan_are_refused_at_handshake() {
    let mut p = producer("tcp", KvLayout::NHD, 4, 30.0, "p");
    let mut d = consumer("tcp", KvLayout::HND, 4);
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    let plan = json!({"layout": {"from": "LBHNC", "to": "LBHNC", "perm": [0, 1, 2, 3, 4]}, "block_size_ratio": null, "tp_ratio": null});
    let e = d
        .worker
        .set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta, "plan": plan}))
        .unwrap_err();
    assert!(e.to_string().contains("the handshake and the regions disagree"), "{e}");
    let good = json!({"layout": {"from": "LBNHC", "to": "LBHNC", "perm": [0, 1, 3, 2, 4]}, "block_size_ratio": null, "tp_ratio": null});
    d.worker
        .set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta, "plan": good}))
        .unwrap();
    let mut other = meta.clone();
    other["shape"]["heads"] = json!(4);
    for r in other["regions"].as_array_mut().unwrap() {
        r["len"] = json!(r["len"].as_u64().unwrap() * 2);
    }
    let e =
        d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": other})).unwrap_err();
    assert!(e.to_string().contains("4 kv heads per block, this engine 2"), "{e}");
    let e = d
        .worker
        .set_peer_handshake_metadata(&json!({"engine_id": "someone-else", "peer": meta}))
        .unwrap_err();
    assert!(e.to_string().contains("someone-else"), "{e}");
}

#[test]
fn nothing_to_load_releases_the_producer_blocks_at_once() {
    let mut p = producer("tcp", KvLayout::HND, 4, 30.0, "q");
    let mut d = consumer("tcp", KvLayout::HND, 4);
    handshake(&mut p, &mut d);
    // A 1-token prompt: decode computes it itself (at least one token is always computed).
    let params = prefill_finish(&mut p, "tiny", 1, &[1]);
    let r = Request { id: "tiny".into(), prompt_tokens: vec![7], kv_transfer_params: params };
    let m = d.sched.get_num_new_matched_tokens(&r, 0).unwrap();
    assert_eq!(m, MatchResult::Matched { tokens: 0, async_load: false });
    d.sched.update_state_after_alloc(&r, &blocks(&[2]), 0).unwrap();
    let meta = d.sched.build_connector_meta(&step(1)).unwrap();
    d.worker.bind_connector_meta(&meta).unwrap();
    d.worker.start_load_kv().unwrap();
    let f = wait_finished(p.worker.as_mut(), |f| !f.finished_sending.is_empty());
    assert_eq!(f.finished_sending, vec![RequestId::from("tiny")], "freed long before the 30 s lease");
    let f = d.worker.get_finished(&[]).unwrap();
    assert!(f.finished_recving.is_empty() && f.failed_recving.is_empty(), "nothing was loaded: {f:?}");
}

#[test]
fn params_naming_another_requests_blocks_are_a_failed_receive() {
    for (backend, tag) in [("shm", "r"), ("tcp", "s")] {
        let mut p = producer(backend, KvLayout::HND, 4, 30.0, tag);
        let mut d = consumer(backend, KvLayout::HND, 4);
        handshake(&mut p, &mut d);
        let _other = prefill_finish(&mut p, "other", 9, &[8, 9, 10]);
        let mut params = prefill_finish(&mut p, "mine", 9, &[1, 2, 3]);
        // A client that rewrites the params to point at "other"'s blocks.
        params.insert("remote_block_ids".into(), json!([[8, 9, 10]]));
        decode_start(&mut d, "mine", 9, params, &[4, 5, 6]);
        let f = wait_finished(d.worker.as_mut(), |f| {
            !f.failed_recving.is_empty() || !f.finished_recving.is_empty()
        });
        assert_eq!(f.failed_recving, vec![RequestId::from("mine")], "{backend}");
        // Refused, so neither request's blocks were freed under it.
        let sent = p.worker.get_finished(&[]).unwrap().finished_sending;
        assert!(sent.is_empty(), "{backend}: {sent:?}");
    }
}

#[test]
fn a_restarted_producer_is_reached_at_its_new_address_after_a_new_handshake() {
    let mut d = consumer("tcp", KvLayout::HND, 4);
    {
        let mut p = producer("tcp", KvLayout::HND, 4, 30.0, "t");
        handshake(&mut p, &mut d);
        let params = prefill_finish(&mut p, "before", 9, &[1, 2, 3]);
        decode_start(&mut d, "before", 9, params, &[1, 2, 3]);
        let f = wait_finished(d.worker.as_mut(), |f| {
            !f.finished_recving.is_empty() || !f.failed_recving.is_empty()
        });
        assert_eq!(f.finished_recving, vec![RequestId::from("before")]);
    } // the producer goes away; the consumer's connection to it is dead
    let mut p = producer("tcp", KvLayout::HND, 4, 30.0, "u");
    handshake(&mut p, &mut d);
    let params = prefill_finish(&mut p, "after", 9, &[4, 5, 6]);
    decode_start(&mut d, "after", 9, params, &[4, 5, 6]);
    let f =
        wait_finished(d.worker.as_mut(), |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("after")], "{f:?}");
    assert_same_kv(&mut p, &[4, 5, 6], &mut d, &[4, 5, 6], 8);
}

#[test]
fn decode_killed_mid_transfer_leaves_blocks_to_lease_expiry() {
    let mut p = producer("tcp", KvLayout::HND, 4, 0.5, "v");
    let addr = listen_addr(&mut p);
    let params = prefill_finish(&mut p, "orphan", 9, &[1, 2, 3]);
    let capability = params["remote_capability"].as_str().unwrap().to_owned();
    // A decode that asks for the blocks, reads the answer's header and dies.
    let mut c = authed(&addr, None);
    let runs = vec![(0u32, 128, 3 * 128)]; // K of blocks 1..4 in region 0 (HND, 2x4x8 bf16 = 128 B/block)
    let m = ask(&mut c, &ClientMsg::Read { request: "orphan".into(), capability, runs });
    assert_eq!(m, ServerMsg::Data { bytes: 384 });
    drop(c);
    assert!(p.worker.get_finished(&[]).unwrap().finished_sending.is_empty(), "still within the lease");
    let f = wait_finished(p.worker.as_mut(), |f| !f.finished_sending.is_empty());
    assert_eq!(f.finished_sending, vec![RequestId::from("orphan")], "freed at lease expiry");
}

const SECRET: &str = "a-test-secret-of-enough-bytes";

/// A tcp producer `id` with extra settings merged into the usual ones.
fn producer_with(id: &str, more: Value) -> Engine {
    let mut extra = json!({"backend": "tcp", "kv_lease_duration": 30, "io_timeout": 2,
        "side_channel_host": "127.0.0.1", "side_channel_port": 5600});
    for (k, v) in more.as_object().unwrap() {
        extra[k] = v.clone();
    }
    engine(KvRole::Producer, id, KvLayout::HND, 4, extra, None)
}

/// What the producer's worker reports for the host's /metrics as refused for `reason`.
fn refused(p: &mut Engine, reason: &str) -> u64 {
    let all = p.worker.metrics().unwrap();
    let of = |m: &&kvconnect_api::ConnectorMetric| {
        m.name == "kvconnect_data_plane_refused"
            && m.labels.contains(&("listener".to_owned(), "producer".to_owned()))
            && m.labels.contains(&("reason".to_owned(), reason.to_owned()))
    };
    all.iter().find(of).map(|m| m.value).unwrap()
}

fn is_error(m: &ServerMsg, needle: &str) -> bool {
    matches!(m, ServerMsg::Error { reason } if reason.contains(needle))
}

#[test]
fn peers_without_the_secret_are_refused_counted_and_read_nothing() {
    let mut p = producer_with("prefill-auth", json!({"data_plane_secret": SECRET}));
    let addr = listen_addr(&mut p);
    let params = prefill_finish(&mut p, "r", 9, &[1, 2, 3]);
    let capability = params["remote_capability"].as_str().unwrap().to_owned();
    let runs = vec![(0u32, 128, 3 * 128)];
    // A request without the challenge-response: refused, connection closed.
    let mut c = raw(&addr);
    let read = ClientMsg::Read { request: "r".into(), capability: capability.clone(), runs: runs.clone() };
    let m = ask(&mut c, &read);
    assert!(is_error(&m, "prove the deployment's data-plane secret"), "{m:?}");
    let mut buf = [0u8; 4];
    assert_eq!(c.read(&mut buf).unwrap_or(0), 0, "closed after the refusal");
    // A wrong secret, and none at all.
    for wrong in [Some(Secret::from_text("another-secret-of-enough-bytes", "test").unwrap()), None] {
        let mut c = TcpStream::connect(&addr).unwrap();
        let e = authenticate_client(&mut c, wrong.as_ref(), 1 << 20).unwrap_err().to_string();
        assert!(e.contains("proof of the data-plane secret is wrong"), "{e}");
    }
    assert_eq!(refused(&mut p, "unauthenticated"), 3);
    // The request is still held: the right secret and capability read it.
    let good = Secret::from_text(SECRET, "test").unwrap();
    let mut c = authed(&addr, Some(&good));
    assert_eq!(ask(&mut c, &read), ServerMsg::Data { bytes: 384 });
    // A consumer configured with another secret fails its receive; one with the same succeeds.
    for (secret, ok) in [("another-secret-of-enough-bytes", false), (SECRET, true)] {
        let mut d = engine(
            KvRole::Consumer,
            "decode-auth",
            KvLayout::HND,
            4,
            json!({"backend": "tcp", "io_timeout": 1, "connect_timeout": 1, "data_plane_secret": secret}),
            None,
        );
        handshake_as(&mut p, &mut d, "prefill-auth");
        let req = if ok { "good" } else { "bad" };
        let params = prefill_finish(&mut p, req, 9, &[4, 5, 6]);
        decode_start(&mut d, req, 9, params, &[1, 2, 3]);
        let f = wait_finished(d.worker.as_mut(), |f| {
            !f.failed_recving.is_empty() || !f.finished_recving.is_empty()
        });
        let want = vec![RequestId::from(req)];
        assert_eq!(if ok { f.finished_recving } else { f.failed_recving }, want, "{secret}");
    }
}

fn handshake_as(p: &mut Engine, d: &mut Engine, engine_id: &str) {
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    d.worker.set_peer_handshake_metadata(&json!({"engine_id": engine_id, "peer": meta})).unwrap();
}

#[test]
fn a_wrong_or_replayed_capability_neither_reads_nor_frees() {
    let mut p = producer_with("prefill-cap", json!({}));
    let addr = listen_addr(&mut p);
    let victim = prefill_finish(&mut p, "victim", 9, &[1, 2, 3]);
    let mine = prefill_finish(&mut p, "mine", 9, &[5, 6, 7]);
    let (victim_cap, my_cap) =
        (victim["remote_capability"].as_str().unwrap(), mine["remote_capability"].as_str().unwrap());
    assert_eq!(victim_cap.len(), 32, "128 bits, hex");
    assert_ne!(victim_cap, my_cap);
    let runs = vec![(0u32, 128, 3 * 128)];
    let mut c = authed(&addr, None);
    // A guessed capability and one replayed from another request, on every operation.
    for cap in ["0123456789abcdef0123456789abcdef", my_cap, ""] {
        let capability = cap.to_owned();
        let r = "victim".to_owned();
        for m in [
            ClientMsg::Hold { request: r.clone(), capability: capability.clone() },
            ClientMsg::Pin {
                request: r.clone(),
                capability: capability.clone(),
                blocks: vec![vec![BlockId(1)]],
            },
            ClientMsg::Read { request: r.clone(), capability: capability.clone(), runs: runs.clone() },
            ClientMsg::Done { request: r.clone(), capability: capability.clone() },
        ] {
            let a = ask(&mut c, &m);
            assert!(is_error(&a, "transfer capability does not match"), "{m:?}: {a:?}");
        }
    }
    assert_eq!(refused(&mut p, "bad_capability"), 12);
    assert!(p.worker.get_finished(&[]).unwrap().finished_sending.is_empty(), "nothing freed");
    // The victim's own consumer still gets its blocks.
    let mut d = consumer("tcp", KvLayout::HND, 4);
    handshake_as(&mut p, &mut d, "prefill-cap");
    decode_start(&mut d, "victim", 9, victim, &[1, 2, 3]);
    let f =
        wait_finished(d.worker.as_mut(), |f| !f.failed_recving.is_empty() || !f.finished_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("victim")]);
    assert_same_kv(&mut p, &[1, 2, 3], &mut d, &[1, 2, 3], 8);
}

#[test]
fn only_backend_tcp_serves_reads() {
    let mut p = engine(
        KvRole::Producer,
        "prefill-noread",
        KvLayout::HND,
        4,
        json!({"backend": "shm", "side_channel_host": "127.0.0.1", "side_channel_port": 5600}),
        Some(&shm_prefix("noread")),
    );
    let addr = listen_addr(&mut p);
    let params = prefill_finish(&mut p, "r", 9, &[1, 2, 3]);
    let capability = params["remote_capability"].as_str().unwrap().to_owned();
    let mut c = authed(&addr, None);
    let m = ask(
        &mut c,
        &ClientMsg::Read { request: "r".into(), capability: capability.clone(), runs: vec![(0, 128, 128)] },
    );
    assert!(is_error(&m, "does not serve reads"), "{m:?}");
    let pin = |c: &mut TcpStream, blocks: Vec<Vec<u32>>| {
        let blocks = blocks.into_iter().map(|g| g.into_iter().map(BlockId).collect()).collect();
        ask(c, &ClientMsg::Pin { request: "r".into(), capability: capability.clone(), blocks })
    };
    // The blocks a copy reads, by id: any of the request's, in any order, are confirmed, with
    // the lease left (30 s by default, just renewed).
    for blocks in [vec![vec![3, 1, 2]], vec![vec![2]]] {
        let m = pin(&mut c, blocks);
        assert!(matches!(m, ServerMsg::Held { ms } if (29_000..=30_000).contains(&ms)), "{m:?}");
    }
    // One that is not the request's, or a KV cache group it has no blocks in, is refused,
    // and the connection stays usable.
    let m = pin(&mut c, vec![vec![1, 4]]);
    assert!(is_error(&m, "block 4 of KV cache group 0 is not one of request r's blocks"), "{m:?}");
    let m = pin(&mut c, vec![vec![1], vec![2]]);
    assert!(is_error(&m, "holds blocks in 1 KV cache group(s), but the consumer names 2"), "{m:?}");
    assert!(matches!(pin(&mut c, vec![vec![1, 2, 3]]), ServerMsg::Held { .. }));
    assert!(p.worker.get_finished(&[]).unwrap().finished_sending.is_empty(), "a pin frees nothing");
    assert_eq!(refused(&mut p, "read_not_served"), 1);
}

#[test]
fn a_producer_beyond_loopback_needs_a_secret() {
    let m = model(3, 2, 8);
    let eff = effective(&m, KvLayout::HND, 4);
    let ctx =
        context(&m, &eff, KvRole::Producer, "prefill-open", json!({"backend": "tcp", "host": "0.0.0.0"}));
    let mut worker = NixlFactory.create_worker(&ctx).unwrap();
    let mem = Regions::allocate(&m, &eff, BLOCKS, None).unwrap();
    let e = worker.register_kv_caches(mem.regions()).unwrap_err().to_string();
    assert!(e.contains("without a data-plane secret") && e.contains("KVCONNECT_SIDE_CHANNEL_TOKEN"), "{e}");
    let ctx = context(
        &m,
        &eff,
        KvRole::Producer,
        "prefill-open",
        json!({"backend": "tcp", "host": "0.0.0.0", "data_plane_secret": SECRET}),
    );
    let mut worker = NixlFactory.create_worker(&ctx).unwrap();
    worker.register_kv_caches(mem.regions()).unwrap();
    // A secret too short to resist guessing is refused with what to do.
    let ctx = context(&m, &eff, KvRole::Producer, "p", json!({"data_plane_secret": "short"}));
    let e = NixlFactory.create_worker(&ctx).err().expect("a short secret is refused").to_string();
    assert!(e.contains("at least 16") && e.contains("openssl rand"), "{e}");
}

#[test]
fn renewals_cannot_hold_blocks_past_the_lease_cap() {
    let mut p = producer_with("prefill-cap-lease", json!({"kv_lease_duration": 0.3, "kv_lease_max": 0.8}));
    let addr = listen_addr(&mut p);
    let params = prefill_finish(&mut p, "r", 9, &[1, 2, 3]);
    let capability = params["remote_capability"].as_str().unwrap().to_owned();
    let mut c = authed(&addr, None);
    let t0 = Instant::now();
    let hold = ClientMsg::Hold { request: "r".into(), capability };
    let mut freed = None;
    while t0.elapsed() < Duration::from_secs(3) {
        // Renewed every 100 ms, well within the 0.3 s lease.
        let _ = ask(&mut c, &hold);
        if !p.worker.get_finished(&[]).unwrap().finished_sending.is_empty() {
            freed = Some(t0.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let at = freed.expect("freed despite the renewals");
    assert!(at >= Duration::from_millis(700), "not before the cap: {at:?}");
    assert!(is_error(&ask(&mut c, &hold), "lease"), "a renewal after the cap fails");
}

#[test]
fn connections_past_the_cap_and_dripped_frames_are_refused() {
    let mut p = producer_with("prefill-flood", json!({"max_connections": 2, "io_timeout": 1}));
    let addr = listen_addr(&mut p);
    let a = authed(&addr, None);
    let b = authed(&addr, None);
    let mut c = TcpStream::connect(&addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let m: ServerMsg = read_frame(&mut c, 1 << 20).unwrap();
    assert!(is_error(&m, "at most 2 connections"), "{m:?}");
    assert_eq!(refused(&mut p, "too_many_connections"), 1);
    drop((a, b));
    std::thread::sleep(Duration::from_millis(200));
    // A frame dripped a byte at a time loses its connection after the 1 s frame deadline,
    // though no single byte waited longer than the idle timeout.
    let mut d = authed(&addr, None);
    let frame = {
        let body = br#"{"op":"hold","request":"x","capability":"y"}"#;
        let mut f = (body.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(body);
        f
    };
    let t0 = Instant::now();
    let mut cut = false;
    for byte in &frame {
        if d.write_all(&[*byte]).is_err() {
            cut = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    let mut buf = [0u8; 4];
    cut = cut || d.read(&mut buf).unwrap_or(0) == 0;
    assert!(cut, "the connection was closed");
    assert!(t0.elapsed() < Duration::from_secs(8));
    assert_eq!(refused(&mut p, "timeout"), 1);
    // And a normal consumer is served afterwards.
    let mut dd = consumer("tcp", KvLayout::HND, 4);
    handshake_as(&mut p, &mut dd, "prefill-flood");
    let params = prefill_finish(&mut p, "after", 9, &[1, 2, 3]);
    decode_start(&mut dd, "after", 9, params, &[1, 2, 3]);
    let f =
        wait_finished(dd.worker.as_mut(), |f| !f.failed_recving.is_empty() || !f.finished_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("after")]);
}

#[test]
fn two_producers_claiming_one_engine_id_are_kept_apart_by_address() {
    let mut first = producer_with("prefill-twin", json!({"side_channel_port": 5601}));
    let mut second = producer_with("prefill-twin", json!({"side_channel_port": 5602}));
    let mut d = consumer("tcp", KvLayout::HND, 4);
    for (p, sc) in [(&mut first, "127.0.0.1:5601"), (&mut second, "127.0.0.1:5602")] {
        let meta = p.worker.handshake_metadata().unwrap().unwrap();
        d.worker
            .set_peer_handshake_metadata(
                &json!({"engine_id": "prefill-twin", "side_channel": sc, "peer": meta}),
            )
            .unwrap();
    }
    // The second handshake did not replace the first: a load from the first is served by it.
    let params = prefill_finish(&mut first, "from-first", 9, &[1, 2, 3]);
    assert_eq!(params["remote_port"], json!(5601));
    decode_start(&mut d, "from-first", 9, params, &[1, 2, 3]);
    let f =
        wait_finished(d.worker.as_mut(), |f| !f.failed_recving.is_empty() || !f.finished_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("from-first")], "{f:?}");
    // Params naming the second's address are pulled from the second, which does not hold it.
    let mut params = prefill_finish(&mut first, "misdirected", 9, &[4, 5, 6]);
    params.insert("remote_port".into(), json!(5602));
    decode_start(&mut d, "misdirected", 9, params, &[4, 5, 6]);
    let f =
        wait_finished(d.worker.as_mut(), |f| !f.failed_recving.is_empty() || !f.finished_recving.is_empty());
    assert_eq!(f.failed_recving, vec![RequestId::from("misdirected")], "{f:?}");
}

#[test]
fn overlapping_reads_cannot_hold_blocks_past_the_lease_cap() {
    // Small producer socket buffers: an answer its reader never takes stalls its read there.
    let io_timeout = Duration::from_millis(600);
    let mut p = producer_with(
        "prefill-overlap",
        json!({"kv_lease_duration": 0.3, "kv_lease_max": 1.0, "io_timeout": 0.6, "tcp_socket_buffer": 4096}),
    );
    let addr = listen_addr(&mut p);
    let params = prefill_finish(&mut p, "r", 9, &[1, 2, 3]);
    let t0 = Instant::now();
    let capability = params["remote_capability"].as_str().unwrap().to_owned();
    // One run of the request named 4096 times: 1.5 MiB that this consumer never reads.
    let read = ClientMsg::Read { request: "r".into(), capability, runs: vec![(0u32, 128, 3 * 128); 4096] };
    let (mut stalled, mut last_read, mut refused_at, mut freed) = (Vec::new(), t0, None, None);
    while t0.elapsed() < Duration::from_secs(8) && freed.is_none() {
        // A new read every 200 ms, each before the last one's deadline: one is always in
        // flight.
        if refused_at.is_none() {
            let mut c = authed(&addr, None);
            match ask(&mut c, &read) {
                ServerMsg::Data { bytes } => {
                    assert_eq!(bytes, 4096 * 384);
                    last_read = Instant::now();
                    stalled.push(c);
                }
                m if is_error(&m, "kv_lease_max = 1.0s") => refused_at = Some(t0.elapsed()),
                m => panic!("{m:?}"),
            }
        }
        if !p.worker.get_finished(&[]).unwrap().finished_sending.is_empty() {
            freed = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let refused_at = refused_at.expect("reads past the lease cap were refused");
    assert!(refused_at >= Duration::from_millis(800), "not before the cap: {refused_at:?}");
    let freed = freed.expect("the blocks were freed although reads kept overlapping");
    assert!(refused(&mut p, "lease_cap") >= 1);
    // Not while the last read was in flight: it ran until its whole deadline cut it.
    assert!(freed >= last_read + io_timeout - Duration::from_millis(100), "freed under a read");
    assert!(freed - t0 < Duration::from_secs(3), "freed {:?} after the first read", freed - t0);
    // Every stalled read was cut off by the producer: its connection ends short of its bytes.
    for mut c in stalled {
        let mut got = 0usize;
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n @ 1..) = c.read(&mut buf) {
            got += n;
        }
        assert!(got < 4096 * 384, "a read ran past its deadline: {got} bytes");
    }
}

/// A load of `req` from `p` into `d` (blocks 1..4 on both sides); returns what decode reported.
fn load_one(p: &mut Engine, d: &mut Engine, req: &str) -> FinishedTransfers {
    let params = prefill_finish(p, req, 9, &[1, 2, 3]);
    decode_load(d, req, params)
}

/// Decode's load of `req` (9 tokens) into its blocks 1..4 with `params`, to its end.
fn decode_load(d: &mut Engine, req: &str, params: serde_json::Map<String, Value>) -> FinishedTransfers {
    decode_start(d, req, 9, params, &[1, 2, 3]);
    wait_finished(d.worker.as_mut(), |f| !f.failed_recving.is_empty() || !f.finished_recving.is_empty())
}

#[test]
fn a_producer_restarted_at_the_same_address_is_loaded_from_at_once_after_its_new_handshake() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut d = consumer("tcp", KvLayout::HND, 4);
    let sc = json!({"engine_id": "prefill-again", "side_channel": "127.0.0.1:5600"});
    let handshake_at = |p: &mut Engine, d: &mut Engine| {
        let mut env = sc.clone();
        env["peer"] = p.worker.handshake_metadata().unwrap().unwrap();
        d.worker.set_peer_handshake_metadata(&env).unwrap();
    };
    {
        let mut p = producer_with("prefill-again", json!({"port": port}));
        handshake_at(&mut p, &mut d);
        assert_eq!(load_one(&mut p, &mut d, "before").finished_recving, vec![RequestId::from("before")]);
    } // it goes away; decode's connections to it are dead, at an address that is live again:
    let mut p = producer_with("prefill-again", json!({"port": port}));
    assert_eq!(listen_addr(&mut p), format!("127.0.0.1:{port}"));
    handshake_at(&mut p, &mut d);
    // The first load after the new handshake already succeeds: nothing of the old producer
    // (its connections) is used for the new one.
    let f = load_one(&mut p, &mut d, "after");
    assert_eq!(f.finished_recving, vec![RequestId::from("after")], "{f:?}");
    assert_same_kv(&mut p, &[1, 2, 3], &mut d, &[1, 2, 3], 8);
}

#[test]
fn two_shm_producers_claiming_one_engine_id_each_serve_their_own_loads() {
    let shm = |tag: &str| shm_prefix(tag);
    let extra = |port: u16| {
        json!({"backend": "shm", "kv_lease_duration": 30, "io_timeout": 2,
               "side_channel_host": "127.0.0.1", "side_channel_port": port})
    };
    let mut first =
        engine(KvRole::Producer, "prefill-twin-shm", KvLayout::HND, 4, extra(5611), Some(&shm("tw1")));
    let mut second =
        engine(KvRole::Producer, "prefill-twin-shm", KvLayout::HND, 4, extra(5612), Some(&shm("tw2")));
    let mut d = consumer("shm", KvLayout::HND, 4);
    for (p, sc) in [(&mut first, "127.0.0.1:5611"), (&mut second, "127.0.0.1:5612")] {
        let meta = p.worker.handshake_metadata().unwrap().unwrap();
        d.worker
            .set_peer_handshake_metadata(
                &json!({"engine_id": "prefill-twin-shm", "side_channel": sc, "peer": meta}),
            )
            .unwrap();
    }
    // Loads alternate between the two; each lands its own producer's bytes.
    for (i, from_first) in [true, false, true, false].into_iter().enumerate() {
        let p = if from_first { &mut first } else { &mut second };
        let req = format!("r{i}");
        let f = load_one(p, &mut d, &req);
        assert_eq!(f.finished_recving, vec![RequestId::from(req.as_str())], "{f:?}");
        assert_same_kv(p, &[1, 2, 3], &mut d, &[1, 2, 3], 8);
    }
}

/// Decode keeps its connections to a producer between loads, and the producer closes those
/// idle past its `idle_timeout`: the next load opens new ones and lands its bytes (decode's
/// blocks are zeroed before each load, so only a real load passes), never failing on a
/// closed connection; the close counts as no refusal.
fn a_load_after_idle_connections_were_closed_is_served(backend: &str, tag: &str, consumer_more: Value) {
    let id = format!("prefill-idle-{tag}");
    let extra = json!({"backend": backend, "kv_lease_duration": 30, "io_timeout": 2, "idle_timeout": 0.3,
        "side_channel_host": "127.0.0.1", "side_channel_port": 5600});
    let shm = shm_prefix(tag);
    let shm = (backend == "shm").then_some(shm.as_str());
    let mut p = engine(KvRole::Producer, &id, KvLayout::HND, 4, extra, shm);
    let mut d = consumer_with(backend, KvLayout::HND, 4, consumer_more);
    handshake_as(&mut p, &mut d, &id);
    for round in 0..3 {
        for i in 0..d.mem.regions().len() {
            d.mem.bytes_mut(i).fill(0);
        }
        let req = format!("idle-{round}");
        let f = load_one(&mut p, &mut d, &req);
        assert_eq!(f.finished_recving, vec![RequestId::from(req.as_str())], "{backend} round {round}: {f:?}");
        assert!(f.failed_recving.is_empty(), "{f:?}");
        assert_same_kv(&mut p, &[1, 2, 3], &mut d, &[1, 2, 3], 8);
        // Well past the idle timeout: the producer has closed decode's connections.
        std::thread::sleep(Duration::from_millis(900));
    }
    assert_eq!(refused(&mut p, "timeout"), 0, "{backend}: an idle connection closed is no refusal");
}

#[test]
fn a_tcp_load_after_the_producer_closed_idle_connections_is_served() {
    a_load_after_idle_connections_were_closed_is_served("tcp", "ia", json!({}));
}

#[test]
fn a_tcp_load_on_parallel_streams_after_they_were_closed_idle_is_served() {
    let more = json!({"tcp_streams": 3, "tcp_stream_min_bytes": 1024});
    a_load_after_idle_connections_were_closed_is_served("tcp", "ib", more);
}

#[test]
fn an_shm_load_after_the_producer_closed_idle_connections_is_served() {
    a_load_after_idle_connections_were_closed_is_served("shm", "ic", json!({}));
}

/// A connection to `l` within `within`, if one comes.
fn accept_within(l: &TcpListener, within: Duration) -> Option<TcpStream> {
    l.set_nonblocking(true).unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if let Ok((s, _)) = l.accept() {
            s.set_nonblocking(false).unwrap();
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

/// A tcp producer that serves connection `i` for `plan[i]` messages, then reads one more and
/// closes without answering it (`usize::MAX`: serves it to the end), as an idle close that
/// lands just as a request goes out does. Returns its address and a handle that joins to the
/// number of connections it accepted (waiting up to 10 s for each planned one), counting any
/// that come in the 500 ms after its plan.
fn closing_producer(plan: Vec<usize>) -> (String, std::thread::JoinHandle<usize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || {
        let mut accepted = 0;
        for answers in plan {
            let Some(mut s) = accept_within(&l, Duration::from_secs(10)) else { return accepted };
            accepted += 1;
            let server_nonce = auth::nonce().unwrap();
            write_frame(&mut s, &ServerMsg::Challenge { nonce: server_nonce.clone() }).unwrap();
            let Ok(ClientMsg::Auth { nonce, .. }) = read_frame(&mut s, 1 << 20) else { break };
            let proof = auth::proof(None, CHANNEL, Side::Server, &server_nonce, &nonce);
            write_frame(&mut s, &ServerMsg::Authenticated { proof }).unwrap();
            for served in 0.. {
                let Ok(m) = read_frame::<_, ClientMsg>(&mut s, 1 << 24) else { break };
                if served == answers {
                    break; // closed without an answer
                }
                match m {
                    ClientMsg::Read { runs, .. } => {
                        let total: u64 = runs.iter().map(|r| r.2).sum();
                        write_frame(&mut s, &ServerMsg::Data { bytes: total }).unwrap();
                        s.write_all(&vec![7u8; total as usize]).unwrap();
                    }
                    _ => write_frame(&mut s, &ServerMsg::Ok).unwrap(),
                }
            }
        }
        accepted + usize::from(accept_within(&l, Duration::from_millis(500)).is_some())
    });
    (addr, h)
}

/// Loads `req` (as `load_one` does); returns what decode reported and how long it took.
fn load_from(p: &mut Engine, d: &mut Engine, req: &str) -> (FinishedTransfers, Duration) {
    let t0 = Instant::now();
    let f = load_one(p, d, req);
    (f, t0.elapsed())
}

/// The handshake of `p`, its listener address replaced by `at`.
fn handshake_at(p: &mut Engine, d: &mut Engine, at: &str) {
    let mut meta = p.worker.handshake_metadata().unwrap().unwrap();
    meta["listen"] = json!(at);
    d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta})).unwrap();
}

#[test]
fn a_kept_connection_closed_as_the_request_goes_out_is_asked_again_once_on_a_new_one() {
    let mut p = producer("tcp", KvLayout::HND, 4, 30.0, "id");
    // The first connection serves the first load (read, done), then closes on the next read
    // without answering it; the second serves everything.
    let (fake, h) = closing_producer(vec![2, usize::MAX]);
    let mut d = consumer("tcp", KvLayout::HND, 4);
    handshake_at(&mut p, &mut d, &fake);
    let (f, _) = load_from(&mut p, &mut d, "first");
    assert_eq!(f.finished_recving, vec![RequestId::from("first")], "{f:?}");
    let (f, _) = load_from(&mut p, &mut d, "second");
    assert_eq!(f.finished_recving, vec![RequestId::from("second")], "{f:?}");
    drop(d);
    assert_eq!(h.join().unwrap(), 2, "one new connection for the request asked again");
}

#[test]
fn a_producer_that_closes_fresh_connections_too_fails_the_load_after_one_retry() {
    let mut p = producer("tcp", KvLayout::HND, 4, 30.0, "ie");
    // The kept connection closes on the second load's read, and so does the new one.
    let (fake, h) = closing_producer(vec![2, 0]);
    let mut d = consumer("tcp", KvLayout::HND, 4);
    handshake_at(&mut p, &mut d, &fake);
    assert_eq!(load_from(&mut p, &mut d, "first").0.finished_recving, vec![RequestId::from("first")]);
    let (f, took) = load_from(&mut p, &mut d, "second");
    assert_eq!(f.failed_recving, vec![RequestId::from("second")], "{f:?}");
    assert!(took < Duration::from_secs(3), "failed fast: {took:?}");
    assert_eq!(h.join().unwrap(), 2, "asked again once, not in a loop");
}

#[test]
fn a_producer_that_is_gone_fails_the_load_at_once() {
    for backend in ["tcp", "shm"] {
        let tag = if backend == "tcp" { "if" } else { "ig" };
        let mut p = producer(backend, KvLayout::HND, 4, 30.0, tag);
        let mut d = consumer(backend, KvLayout::HND, 4);
        handshake(&mut p, &mut d);
        assert_eq!(load_from(&mut p, &mut d, "first").0.finished_recving, vec![RequestId::from("first")]);
        let params = prefill_finish(&mut p, "second", 9, &[1, 2, 3]);
        p.worker.shutdown().unwrap();
        let t0 = Instant::now();
        let f = decode_load(&mut d, "second", params);
        assert_eq!(f.failed_recving, vec![RequestId::from("second")], "{backend}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{backend}: {:?}", t0.elapsed());
    }
}

#[test]
fn a_synchronous_load_is_whole_once_the_first_layer_has_waited() {
    for (backend, tag) in [("shm", "sa"), ("tcp", "sb")] {
        let mut p = producer(backend, KvLayout::HND, 4, 30.0, tag);
        let mut d = consumer_with(backend, KvLayout::HND, 4, json!({"load": "sync"}));
        handshake(&mut p, &mut d);
        let (pblocks, dblocks) = ([3, 4, 5, 6, 7, 8], [2, 4, 6, 8, 10, 12]);
        let params = prefill_finish(&mut p, "sync-1", 21, &pblocks);
        // Matched synchronously; the first layer waits as an engine does before computing.
        let tokens = decode_begin(&mut d, "sync-1", 21, params, &dblocks, false);
        d.worker.wait_for_layer_load(kvconnect_api::LayerId(0)).unwrap();
        assert_eq!(tokens, 20);
        // No get_finished in between: the bytes are there when the step computes.
        assert_same_kv(&mut p, &pblocks, &mut d, &dblocks, tokens);
        let f = d.worker.get_finished(&[]).unwrap();
        assert_eq!(
            f.finished_recving,
            vec![RequestId::from("sync-1")],
            "{backend}: reported in its own step"
        );
        assert!(d.worker.block_ids_with_load_errors().unwrap().is_empty());
        let f = wait_finished(p.worker.as_mut(), |f| !f.finished_sending.is_empty());
        assert_eq!(f.finished_sending, vec![RequestId::from("sync-1")]);
    }
}

#[test]
fn load_auto_is_synchronous_over_shm_within_its_limit_and_asynchronous_otherwise() {
    let (pblocks, dblocks) = ([3, 4, 5, 6, 7, 8], [2, 4, 6, 8, 10, 12]);
    // (backend, extra settings, whether the 20-token load is matched synchronously); `load:
    // null` is the default, `auto`.
    for (backend, more, sync, tag) in [
        ("shm", json!({"load": null}), true, "aa"),
        ("shm", json!({"load": "auto", "sync_max_bytes": 1}), false, "ab"),
        ("tcp", json!({"load": null}), false, "ac"),
    ] {
        let mut p = producer(backend, KvLayout::HND, 4, 30.0, tag);
        let mut d = consumer_with(backend, KvLayout::HND, 4, more.clone());
        handshake(&mut p, &mut d);
        let params = prefill_finish(&mut p, "auto-1", 21, &pblocks);
        let tokens = decode_begin(&mut d, "auto-1", 21, params, &dblocks, !sync);
        assert_eq!(tokens, 20);
        let f = if sync {
            // Whole once the first layer has waited, reported in its own step.
            d.worker.wait_for_layer_load(kvconnect_api::LayerId(0)).unwrap();
            d.worker.get_finished(&[]).unwrap()
        } else {
            wait_finished(d.worker.as_mut(), |f| {
                !f.failed_recving.is_empty() || !f.finished_recving.is_empty()
            })
        };
        assert_eq!(f.finished_recving, vec![RequestId::from("auto-1")], "{backend} {more}: {f:?}");
        assert_same_kv(&mut p, &pblocks, &mut d, &dblocks, tokens);
    }
}

#[test]
fn a_failed_synchronous_load_ends_the_wait_and_names_its_blocks_in_that_step() {
    let mut p = producer("shm", KvLayout::HND, 4, 30.0, "sc");
    let mut d = consumer_with("shm", KvLayout::HND, 4, json!({"load": "sync"}));
    handshake(&mut p, &mut d);
    let params = prefill_finish(&mut p, "gone", 9, &[1, 2, 3]);
    p.worker.shutdown().unwrap();
    let t0 = Instant::now();
    decode_begin(&mut d, "gone", 9, params, &[5, 6, 7], false);
    d.worker.wait_for_layer_load(kvconnect_api::LayerId(0)).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "connect and io timeouts are 1 s: {:?}", t0.elapsed());
    let f = d.worker.get_finished(&[]).unwrap();
    assert_eq!(f.failed_recving, vec![RequestId::from("gone")], "{f:?}");
    let mut bad: Vec<u32> = d.worker.block_ids_with_load_errors().unwrap().into_iter().map(|b| b.0).collect();
    bad.sort();
    assert_eq!(bad, [5, 6], "the blocks the load was to write (8 tokens of 4-token blocks)");
}
