//! Backend nixl through the real NIXL library (UCX, DRAM): a producer and a consumer
//! connector instance in one process, driven as a host would. Built with feature `nixl` only
//! (`.ci/run` runs it so); skips with a message when the library is not on this machine (CI
//! fetches it with scripts/fetch-nixl.sh).
//!
//! NIXL agents created concurrently may deadlock (nixl-sys runs its own tests one at a
//! time), so every test here holds `SERIAL`.
#![cfg(feature = "nixl")]

use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{
    AttentionKind, BlockId, BlocksPerGroup, ConnectorFactory, EffectiveLayout, FinishedTransfers, KvGroup,
    KvLayout, KvRole, LayerId, MatchResult, ModelSpec, Request, RequestId, SchedulerConnector, StepInfo,
    WorkerConnector,
};
use kvconnect_bench::harness::{context, effective, model, Regions};
use kvconnect_nixl::NixlFactory;
use serde_json::{json, Value};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

/// Holds the lock when the library is present; `None` (after saying so) when it is not.
fn nixl_or_skip() -> Option<MutexGuard<'static, ()>> {
    if let Err(e) = kvconnect_nixl::nixl_lib::load() {
        eprintln!("skipping: NIXL library not found (run scripts/fetch-nixl.sh): {e}");
        return None;
    }
    Some(SERIAL.lock().unwrap_or_else(|p| p.into_inner()))
}

const BLOCKS: u32 = 16;

struct Engine {
    sched: Box<dyn SchedulerConnector>,
    worker: Box<dyn WorkerConnector>,
    mem: Regions,
    model: ModelSpec,
    eff: EffectiveLayout,
}

/// 4 layers; HMA on: two KV cache groups (layers 0,2 full; 1,3 sliding), off: one.
fn layout(layout: KvLayout, hma: bool) -> (ModelSpec, EffectiveLayout) {
    let mut m = model(4, 2, 8);
    let mut eff = effective(&m, layout, 4);
    if hma {
        m.layers = vec![
            AttentionKind::Full,
            AttentionKind::SlidingWindow { window: 8 },
            AttentionKind::Full,
            AttentionKind::SlidingWindow { window: 8 },
        ];
        eff.hma = true;
        eff.groups = vec![
            KvGroup { kind: AttentionKind::Full, layers: vec![LayerId(0), LayerId(2)] },
            KvGroup {
                kind: AttentionKind::SlidingWindow { window: 8 },
                layers: vec![LayerId(1), LayerId(3)],
            },
        ];
    }
    (m, eff)
}

fn engine(role: KvRole, id: &str, lay: KvLayout, hma: bool, extra: Value) -> Engine {
    let (m, eff) = layout(lay, hma);
    let ctx = context(&m, &eff, role, id, extra);
    let sched = NixlFactory.create_scheduler(&ctx).unwrap();
    let mut worker = NixlFactory.create_worker(&ctx).unwrap();
    let mut mem = Regions::allocate(&m, &eff, BLOCKS, None).unwrap();
    for i in 0..mem.regions().len() {
        let salt = (id.len() * 31 + i * 7) as u32;
        for (j, b) in mem.bytes_mut(i).iter_mut().enumerate() {
            *b = ((j as u32).wrapping_mul(2654435761).wrapping_add(salt) >> 13) as u8;
        }
    }
    worker.register_kv_caches(mem.regions()).unwrap();
    Engine { sched, worker, mem, model: m, eff }
}

fn pair(play: KvLayout, dlay: KvLayout, hma: bool, lease: f64) -> (Engine, Engine) {
    let p = engine(
        KvRole::Producer,
        "prefill-0",
        play,
        hma,
        json!({"backends": ["UCX"], "kv_lease_duration": lease, "io_timeout": 5,
               "side_channel_host": "127.0.0.1", "side_channel_port": 5600}),
    );
    let d = engine(KvRole::Consumer, "decode-0", dlay, hma, json!({"backend": "nixl", "io_timeout": 5}));
    (p, d)
}

fn handshake(p: &mut Engine, d: &mut Engine) {
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    assert!(meta["nixl"]["md"].as_str().is_some_and(|m| !m.is_empty()), "{meta}");
    d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta})).unwrap();
}

fn blocks(groups: &[Vec<u32>]) -> BlocksPerGroup {
    BlocksPerGroup(groups.iter().map(|g| g.iter().map(|b| BlockId(*b)).collect()).collect())
}

fn step(n: u64) -> StepInfo {
    StepInfo { step: n, scheduled: vec![], finished: vec![] }
}

fn prefill_finish(p: &mut Engine, req: &str, n: usize, pb: &[Vec<u32>]) -> serde_json::Map<String, Value> {
    let mut params = serde_json::Map::new();
    params.insert("do_remote_decode".into(), json!(true));
    let r = Request { id: req.into(), prompt_tokens: vec![7; n], kv_transfer_params: params };
    let fin = p.sched.request_finished(&r, &blocks(pb)).unwrap();
    assert!(fin.delay_free);
    let meta = p.sched.build_connector_meta(&step(1)).unwrap();
    p.worker.bind_connector_meta(&meta).unwrap();
    fin.transfer_params.unwrap()
}

fn decode_start(
    d: &mut Engine,
    req: &str,
    n: usize,
    params: serde_json::Map<String, Value>,
    db: &[Vec<u32>],
) {
    let r = Request { id: req.into(), prompt_tokens: vec![7; n], kv_transfer_params: params };
    let MatchResult::Matched { tokens, async_load } = d.sched.get_num_new_matched_tokens(&r, 0).unwrap()
    else {
        panic!("expected a match")
    };
    assert!(async_load);
    d.sched.update_state_after_alloc(&r, &blocks(db), tokens).unwrap();
    let meta = d.sched.build_connector_meta(&step(1)).unwrap();
    d.worker.bind_connector_meta(&meta).unwrap();
    d.worker.start_load_kv().unwrap();
}

fn wait(w: &mut dyn WorkerConnector, pred: impl Fn(&FinishedTransfers) -> bool) -> FinishedTransfers {
    let t0 = Instant::now();
    let mut acc = FinishedTransfers::default();
    while t0.elapsed() < Duration::from_secs(20) {
        let f = w.get_finished(&[]).unwrap();
        acc.finished_sending.extend(f.finished_sending);
        acc.finished_recving.extend(f.finished_recving);
        acc.failed_recving.extend(f.failed_recving);
        if pred(&acc) {
            return acc;
        }
        std::thread::sleep(Duration::from_millis(2));
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

/// Every element of tokens [0, n) of every group equal on both sides, through each layout.
fn assert_same_kv(p: &mut Engine, pb: &[Vec<u32>], d: &mut Engine, db: &[Vec<u32>], n: usize) {
    let (gp, gd) = (geometry(p), geometry(d));
    let s = gp.shape();
    let bs = s.tokens as usize;
    let mut checked = 0;
    for (g, grp) in p.eff.groups.clone().iter().enumerate() {
        for &layer in &grp.layers {
            for part in 0..2 {
                for t in 0..n {
                    let ps = gp.span(layer, part, BlockId(pb[g][t / bs])).unwrap();
                    let ds = gd.span(layer, part, BlockId(db[g][t / bs])).unwrap();
                    for h in 0..s.heads {
                        for c in 0..s.head_dim {
                            let po = ps.offset + gp.inner_offset(h, (t % bs) as u32, c);
                            let dof = ds.offset + gd.inner_offset(h, (t % bs) as u32, c);
                            let a = p.mem.bytes_mut(ps.region)[po..po + 2].to_vec();
                            let b = &d.mem.bytes_mut(ds.region)[dof..dof + 2];
                            assert_eq!(
                                &a[..],
                                b,
                                "group {g} layer {layer} part {part} token {t} head {h} ch {c}"
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert_eq!(checked, 4 * 2 * n * 2 * 8);
}

fn pull_and_compare(play: KvLayout, dlay: KvLayout, hma: bool) {
    let (mut p, mut d) = pair(play, dlay, hma, 30.0);
    handshake(&mut p, &mut d);
    let prepared_before = kvconnect_nixl::transport::nixl::prepared_reads();
    let n = 21;
    let groups = if hma { 2 } else { 1 };
    // Contiguous producer blocks (merged into one descriptor per layer and K/V) against
    // scattered decode blocks.
    let pb: Vec<Vec<u32>> = (0..groups).map(|g| (0..6).map(|i| 3 + i + g * 6).collect()).collect();
    let db: Vec<Vec<u32>> = (0..groups).map(|g| (0..6).map(|i| 1 + 2 * i + g).collect()).collect();
    let params = prefill_finish(&mut p, "req-1", n, &pb);
    decode_start(&mut d, "req-1", n, params, &db);
    let f = wait(d.worker.as_mut(), |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("req-1")], "{f:?}");
    // Prefill frees the blocks when decode's NIXL notification arrives.
    let fp = wait(p.worker.as_mut(), |f| !f.finished_sending.is_empty());
    assert_eq!(fp.finished_sending, vec![RequestId::from("req-1")]);
    assert_same_kv(&mut p, &pb, &mut d, &db, n - 1);
    // Equal layouts READ by the indices of the lists prepared for the producer; a plan that
    // adapts the layout reads into a staging buffer with descriptors of its own.
    let prepared = kvconnect_nixl::transport::nixl::prepared_reads() - prepared_before;
    assert_eq!(prepared, u64::from(play == dlay), "{play:?} -> {dlay:?}");
    d.worker.shutdown().unwrap();
    p.worker.shutdown().unwrap();
}

#[test]
fn pull_hnd_hma_off() {
    let Some(_g) = nixl_or_skip() else { return };
    pull_and_compare(KvLayout::HND, KvLayout::HND, false);
}

#[test]
fn pull_hnd_hma_on() {
    let Some(_g) = nixl_or_skip() else { return };
    pull_and_compare(KvLayout::HND, KvLayout::HND, true);
}

#[test]
fn pull_nhd_hma_on() {
    let Some(_g) = nixl_or_skip() else { return };
    pull_and_compare(KvLayout::NHD, KvLayout::NHD, true);
}

#[test]
fn pull_nhd_to_hnd_adapts_on_receive() {
    let Some(_g) = nixl_or_skip() else { return };
    pull_and_compare(KvLayout::NHD, KvLayout::HND, false);
}

#[test]
fn a_done_notification_without_the_requests_capability_frees_nothing() {
    let Some(_g) = nixl_or_skip() else { return };
    let (mut p, mut d) = pair(KvLayout::HND, KvLayout::HND, false, 30.0);
    handshake(&mut p, &mut d);
    let (pb, db) = (vec![vec![3, 4, 5]], vec![vec![1, 2, 3]]);
    let params = prefill_finish(&mut p, "guarded", 9, &pb);
    // A NIXL agent that has the producer's agent metadata and the request id, but not the
    // capability: no capability, then one of its own.
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    let md = kvconnect_dataplane::hex::from_hex(meta["nixl"]["md"].as_str().unwrap()).unwrap();
    let rogue = kvconnect_nixl::nixl_agent::NixlAgent::new("rogue-agent").unwrap();
    let remote = rogue.load_remote_md(&md).unwrap();
    for note in ["kvc-done guarded".to_owned(), format!("kvc-done guarded {}", "0".repeat(32))] {
        rogue.notify(&remote, note.as_bytes()).unwrap();
    }
    let bad_capability = |p: &mut Engine| {
        p.worker
            .metrics()
            .unwrap()
            .into_iter()
            .find(|m| m.labels.contains(&("reason".to_owned(), "bad_capability".to_owned())))
            .map_or(0, |m| m.value)
    };
    let t0 = Instant::now();
    while bad_capability(&mut p) < 2 {
        let f = p.worker.get_finished(&[]).unwrap();
        assert!(
            f.finished_sending.is_empty(),
            "a notification without the capability freed the blocks: {f:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(60), "the rogue notifications never arrived");
        std::thread::sleep(Duration::from_millis(20));
    }
    let f = p.worker.get_finished(&[]).unwrap();
    assert!(f.finished_sending.is_empty(), "{f:?}");
    // The real consumer, which has the capability, loads the blocks and its notification
    // frees them.
    decode_start(&mut d, "guarded", 9, params, &db);
    let f = wait(d.worker.as_mut(), |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("guarded")], "{f:?}");
    let fp = wait(p.worker.as_mut(), |f| !f.finished_sending.is_empty());
    assert_eq!(fp.finished_sending, vec![RequestId::from("guarded")]);
    assert_same_kv(&mut p, &pb, &mut d, &db, 8);
    drop(rogue);
    d.worker.shutdown().unwrap();
    p.worker.shutdown().unwrap();
}

#[test]
fn freed_blocks_are_a_failed_receive_not_garbage() {
    let Some(_g) = nixl_or_skip() else { return };
    let (mut p, mut d) = pair(KvLayout::HND, KvLayout::HND, false, 0.2);
    handshake(&mut p, &mut d);
    let (pb, db) = (vec![vec![3, 4, 5]], vec![vec![1, 2, 3]]);
    let params = prefill_finish(&mut p, "late", 9, &pb);
    // No consumer within the lease: prefill frees the blocks.
    std::thread::sleep(Duration::from_millis(300));
    let fp = wait(p.worker.as_mut(), |f| !f.finished_sending.is_empty());
    assert_eq!(fp.finished_sending, vec![RequestId::from("late")]);
    let before: Vec<u8> = d.mem.bytes_mut(0).to_vec();
    decode_start(&mut d, "late", 9, params, &db);
    let f = wait(d.worker.as_mut(), |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty());
    assert_eq!(f.failed_recving, vec![RequestId::from("late")], "{f:?}");
    assert!(f.finished_recving.is_empty());
    // The load was to fill tokens 0..8 (decode computes the prompt's last token itself):
    // blocks 1 and 2, not block 3, which holds only that last token.
    let bad = d.worker.block_ids_with_load_errors().unwrap();
    assert_eq!(bad, vec![BlockId(1), BlockId(2)]);
    assert_eq!(d.mem.bytes_mut(0), &before[..], "nothing was written into decode's blocks");
}

#[test]
fn garbage_agent_metadata_is_an_error_with_nixls_status_name() {
    let Some(_g) = nixl_or_skip() else { return };
    let (mut p, mut d) = pair(KvLayout::HND, KvLayout::HND, false, 30.0);
    let mut meta = p.worker.handshake_metadata().unwrap().unwrap();
    meta["nixl"]["md"] = json!("00112233445566778899aabbccddeeff");
    let e = d
        .worker
        .set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("NIXL_ERR_"), "{e}");
    assert!(e.contains("loadRemoteMD") && e.contains("prefill-0"), "{e}");
    println!("garbage metadata: {e}");
    meta["nixl"]["md"] = json!("not hex");
    let e = d
        .worker
        .set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not hex"), "{e}");
}

#[test]
fn a_peer_without_nixl_is_refused_at_the_handshake() {
    let Some(_g) = nixl_or_skip() else { return };
    let mut p = engine(
        KvRole::Producer,
        "prefill-0",
        KvLayout::HND,
        false,
        json!({"backend": "tcp", "side_channel_host": "127.0.0.1", "side_channel_port": 5600}),
    );
    let mut d = engine(KvRole::Consumer, "decode-0", KvLayout::HND, false, json!({"backend": "nixl"}));
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    let e = d
        .worker
        .set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("published no NIXL agent"), "{e}");
}

#[test]
fn missing_library_is_an_error_not_an_abort() {
    // In a child process (the library, once loaded, stays loaded), with NIXL_LIB_DIR naming
    // a directory without it: selecting backend nixl must fail with a message, not abort.
    if std::env::var_os("KVC_NIXL_MISSING_CHILD").is_some() {
        let (m, eff) = layout(KvLayout::HND, false);
        let ctx = context(&m, &eff, KvRole::Consumer, "d", json!({"backends": ["UCX"]}));
        let e = NixlFactory
            .create_worker(&ctx)
            .err()
            .expect("backend nixl without the library must fail")
            .to_string();
        println!("CHILD-ERROR: {e}");
        return;
    }
    let empty = std::env::temp_dir().join(format!("kvc-no-nixl-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["missing_library_is_an_error_not_an_abort", "--exact", "--nocapture", "--test-threads=1"])
        .env("KVC_NIXL_MISSING_CHILD", "1")
        .env("NIXL_LIB_DIR", &empty)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("CHILD-ERROR: ").map(|(_, e)| e))
        .unwrap_or_else(|| panic!("child printed no error: {stdout}"));
    assert!(line.contains("backend 'nixl'") && line.contains("has no libnixl_capi.so"), "{line}");
    assert!(line.contains("scripts/fetch-nixl.sh"), "{line}");
    std::fs::remove_dir_all(&empty).unwrap();
}

/// A NIXL producer `id` whose params name side channel 127.0.0.1:`port`.
fn producer_at(id: &str, port: u16) -> Engine {
    engine(
        KvRole::Producer,
        id,
        KvLayout::HND,
        false,
        json!({"backend": "nixl", "io_timeout": 5, "side_channel_host": "127.0.0.1", "side_channel_port": port}),
    )
}

/// The host's handshake of `d` with `p`, reached at side channel 127.0.0.1:`port`.
fn handshake_at(p: &mut Engine, d: &mut Engine, id: &str, port: u16) -> Result<(), String> {
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    let env = json!({"engine_id": id, "side_channel": format!("127.0.0.1:{port}"), "peer": meta});
    d.worker.set_peer_handshake_metadata(&env).map_err(|e| e.to_string())
}

/// One load of `req` from `p` into `d`, checked byte for byte; `Err` when it failed.
fn load_checked(p: &mut Engine, d: &mut Engine, req: &str) -> Result<(), FinishedTransfers> {
    let (pb, db) = (vec![vec![3, 4, 5]], vec![vec![1, 2, 3]]);
    let params = prefill_finish(p, req, 9, &pb);
    decode_start(d, req, 9, params, &db);
    let f = wait(d.worker.as_mut(), |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty());
    if f.finished_recving != vec![RequestId::from(req)] {
        return Err(f);
    }
    assert_same_kv(p, &pb, d, &db, 8);
    Ok(())
}

#[test]
fn two_producers_claiming_one_engine_id_neither_replace_nor_invalidate_each_others_agent() {
    let Some(_g) = nixl_or_skip() else { return };
    let mut first = producer_at("prefill-twin", 5621);
    let mut second = producer_at("prefill-twin", 5622);
    let mut d = engine(
        KvRole::Consumer,
        "decode-0",
        KvLayout::HND,
        false,
        json!({"backend": "nixl", "io_timeout": 5}),
    );
    handshake_at(&mut first, &mut d, "prefill-twin", 5621).unwrap();
    handshake_at(&mut second, &mut d, "prefill-twin", 5622).unwrap();
    // Loads alternate; each reads its own producer's agent, and the second handshake (or a
    // repeated one) did not invalidate the first's.
    load_checked(&mut first, &mut d, "a").unwrap();
    load_checked(&mut second, &mut d, "b").unwrap();
    handshake_at(&mut second, &mut d, "prefill-twin", 5622).unwrap();
    load_checked(&mut first, &mut d, "c").unwrap();
    load_checked(&mut second, &mut d, "d").unwrap();
    // A third peer that names the first's agent with metadata of its own is refused: NIXL
    // could not tell the two apart.
    let mut meta = first.worker.handshake_metadata().unwrap().unwrap();
    let mine = second.worker.handshake_metadata().unwrap().unwrap();
    meta["nixl"]["md"] = mine["nixl"]["md"].clone();
    let env = json!({"engine_id": "prefill-twin", "side_channel": "127.0.0.1:5623", "peer": meta});
    let e = d.worker.set_peer_handshake_metadata(&env).unwrap_err().to_string();
    assert!(e.contains("another producer this engine already loaded uses with other metadata"), "{e}");
    load_checked(&mut first, &mut d, "e").unwrap();
    for w in [&mut d.worker, &mut first.worker, &mut second.worker] {
        w.shutdown().unwrap();
    }
}

#[test]
fn a_restarted_producer_is_loaded_from_after_a_failed_load_and_a_new_handshake() {
    let Some(_g) = nixl_or_skip() else { return };
    let mut d = engine(
        KvRole::Consumer,
        "decode-0",
        KvLayout::HND,
        false,
        json!({"backend": "nixl", "io_timeout": 2}),
    );
    let mut old = producer_at("prefill-restart", 5631);
    handshake_at(&mut old, &mut d, "prefill-restart", 5631).unwrap();
    load_checked(&mut old, &mut d, "before").unwrap();
    // The producer goes away: a load from it fails.
    let params = prefill_finish(&mut old, "lost", 9, &[vec![6, 7, 8]]);
    old.worker.shutdown().unwrap();
    decode_start(&mut d, "lost", 9, params, &[vec![4, 5, 6]]);
    let f = wait(d.worker.as_mut(), |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty());
    assert_eq!(f.failed_recving, vec![RequestId::from("lost")], "{f:?}");
    // Its successor (another agent, the same engine id and side channel) after the host's
    // new handshake: loaded from at once.
    let mut new = producer_at("prefill-restart", 5631);
    handshake_at(&mut new, &mut d, "prefill-restart", 5631).unwrap();
    load_checked(&mut new, &mut d, "after").unwrap();
    d.worker.shutdown().unwrap();
    new.worker.shutdown().unwrap();
}

#[allow(unsafe_code)] // Registers buffers this test owns with NIXL.
#[test]
fn prepared_lists_read_by_index_and_refuse_bad_indices() {
    use kvconnect_nixl::nixl_agent::{NixlAgent, NixlMem};
    let Some(_g) = nixl_or_skip() else { return };
    let (owner, reader) = (NixlAgent::new("prep-owner").unwrap(), NixlAgent::new("prep-reader").unwrap());
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut dst = vec![0u8; 4096];
    // SAFETY: both buffers outlive the registrations, dropped at the end of this test.
    let regs = unsafe {
        (
            owner.register_dram(src.as_ptr() as usize, src.len()).unwrap(),
            reader.register_dram(dst.as_mut_ptr() as usize, dst.len()).unwrap(),
        )
    };
    let remote = reader.load_remote_md(&owner.local_md().unwrap()).unwrap();
    let spans = |base: usize| (0..4).map(|i| (base + i * 1024, 1024)).collect::<Vec<_>>();
    let local = reader.prepare(None, &spans(dst.as_ptr() as usize), NixlMem::Dram).unwrap();
    let far = reader.prepare(Some(&remote), &spans(src.as_ptr() as usize), NixlMem::Dram).unwrap();
    assert_eq!(far.entries(), 4);
    // Source spans 2, 3 into destination spans 0, 1 (contiguous on both sides: merged).
    let t = reader.post_read_prepared(&local, &[0, 1], &far, &[2, 3], 2048).unwrap();
    let t0 = Instant::now();
    while !reader.poll(&t).unwrap() {
        assert!(t0.elapsed() < Duration::from_secs(20), "the READ never finished");
    }
    drop(t);
    assert_eq!(&dst[..2048], &src[2048..]);
    assert!(dst[2048..].iter().all(|&b| b == 0), "nothing else written");
    for (li, fi, why) in [
        (&[0, 1][..], &[2][..], "as many entries of each"),
        (&[4][..], &[0][..], "an index past the end"),
        (&[0][..], &[-1][..], "an index past the end"),
    ] {
        let e = reader.post_read_prepared(&local, li, &far, fi, 1024).unwrap_err().to_string();
        assert!(e.contains("makeXferReq") && e.contains(why), "{e}");
    }
    // A peer's list where this agent's belongs.
    let e = reader.post_read_prepared(&far, &[0], &far, &[0], 1024).unwrap_err().to_string();
    assert!(e.contains("a local list, a peer's list"), "{e}");
    reader.release_prepared(local);
    drop(regs);
}
