//! Backend cuda_ipc with device KV regions, driven through the connector API as a host would.
//! Needs a GPU: every test skips, saying so, where none can be opened.
//!
//! - same process (CUDA refuses to open a process's own IPC handles: the consumer finds the
//!   regions by handle among those this process exported), with and without an NHD->HND
//!   permute;
//! - two processes: this test binary re-runs itself as the producer, the consumer opens its
//!   IPC handles (the real IPC path); then the producer dies and a load fails;
//! - a handle that cannot be opened is a failed receive, never a crash;
//! - loads after the first from a producer are launched by `start_load_kv` itself, whole, and
//!   one the producer refuses after its launch fails;
//! - the host-staged path (`cuda_ipc_path = "staged"`, what a GPU without peer access to the
//!   producer's gets automatically), in one process and across two, with a permute.
//!
//! `KVC_TEST_DECODE_GPU=1` on a two-GPU host puts every consumer on the second GPU.
#![cfg(feature = "cuda")]

mod device;

use device::{assert_loaded, decode_start, device_engine, prefill_finish, wait_recv, Engine};
use kvconnect_api::{KvLayout, KvRole, RequestId, KV_LOADS_STARTED};
use kvconnect_cuda::Gpu;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

const CHILD_ENV: &str = "KVC_CUDA_IPC_CHILD";

fn gpu() -> Option<Gpu> {
    kvconnect_cuda::testing::gpu_or_skip(0)
}

/// The consumers' GPU: `KVC_TEST_DECODE_GPU` (default 0, the producers' GPU).
fn decode_gpu() -> Gpu {
    let ordinal = std::env::var("KVC_TEST_DECODE_GPU").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    Gpu::open(ordinal).unwrap()
}

fn engine(g: &Gpu, role: KvRole, id: &str, layout: KvLayout) -> Engine {
    engine_on_path(g, role, id, layout, "auto")
}

fn engine_on_path(g: &Gpu, role: KvRole, id: &str, layout: KvLayout, path: &str) -> Engine {
    let extra = json!({"backend": "cuda_ipc", "io_timeout": 2, "connect_timeout": 1, "cuda_ipc_path": path});
    device_engine(g, role, id, layout, extra)
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

/// Loads of `d` started by `start_load_kv` itself and by the pull thread.
fn started(d: &mut Engine) -> (u64, u64) {
    let m = d.worker.metrics().unwrap();
    let on = |on: &str| {
        let s = m.iter().find(|s| s.name == KV_LOADS_STARTED && s.labels == [("on".into(), on.into())]);
        s.map_or(0, |s| s.value)
    };
    (on("step"), on("pull_thread"))
}

/// Overwrites every byte of `e`'s device regions with `byte`.
fn poison(g: &Gpu, e: &Engine, byte: u8) {
    for b in &e.dev {
        g.memset_async(b.ptr(), byte, b.len()).unwrap();
    }
    g.synchronize().unwrap();
}

/// The first load from a producer opens its memory on the pull thread; the next one's gather
/// is launched by `start_load_kv` itself, and its bytes are whole. A load launched that way
/// that the producer then refuses (a capability not the request's) fails, with its blocks
/// reported, and a later load is whole again.
#[test]
fn later_loads_start_on_the_steps_thread_and_a_refused_one_fails() {
    let Some(g) = gpu() else { return };
    let mut p = engine(&g, KvRole::Producer, "prefill-0", KvLayout::HND);
    let mut d = engine(&g, KvRole::Consumer, "decode-0", KvLayout::HND);
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta})).unwrap();
    let load = |p: &mut Engine, d: &mut Engine, req: &str| {
        let params = prefill_finish(p, req);
        decode_start(d, req, params);
        let f = wait_recv(d.worker.as_mut());
        assert_eq!(f.finished_recving, vec![RequestId::from(req)], "{f:?}");
    };
    load(&mut p, &mut d, "req-1");
    assert_eq!(started(&mut d), (0, 1), "the first load opens the producer's memory on the pull thread");
    poison(&g, &d, 0xA5);
    load(&mut p, &mut d, "req-2");
    assert_eq!(started(&mut d), (1, 1), "the second load's gather is launched by start_load_kv");
    assert_loaded(&g, &mut p, &mut d);

    let mut params = prefill_finish(&mut p, "req-3");
    let cap = params["remote_capability"].as_str().unwrap().chars().rev().collect::<String>();
    params.insert("remote_capability".into(), json!(cap));
    decode_start(&mut d, "req-3", params);
    let f = wait_recv(d.worker.as_mut());
    assert_eq!(f.failed_recving, vec![RequestId::from("req-3")], "{f:?}");
    assert_eq!(started(&mut d), (2, 1), "the refused load was launched by start_load_kv");
    assert!(!d.worker.block_ids_with_load_errors().unwrap().is_empty());

    poison(&g, &d, 0x5A);
    load(&mut p, &mut d, "req-4");
    assert_loaded(&g, &mut p, &mut d);
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
