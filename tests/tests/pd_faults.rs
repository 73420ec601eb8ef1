//! Faults between a prefill and a decode process: a decode that dies or never comes (prefill
//! frees the blocks when the lease expires), a prefill that dies (decode applies
//! kv_load_failure_policy), a peer that sends garbage or an oversized frame on the side
//! channel (its connection is closed with a logged reason; the worker keeps serving), and
//! SIGTERM (clean exit, shared-memory segments unlinked).

use kvconnect_api::KvLayout;
use kvconnect_tests::{
    closed_by_peer, disaggregated, monolithic, reference_model, token_ids, varied_prompts, wait_until, Worker,
};
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn nixl(role: &str, extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","kv_connector_extra_config":{{"backend":"shm"{extra}}}}}"#
    )
}

fn worker(config: &str, id: &str) -> Worker {
    let model = reference_model();
    Worker::start(&["--kv-transfer-config", config, "--model", model.to_str().unwrap(), "--engine-id", id])
}

fn pool(w: &Worker) -> serde_json::Value {
    let (st, h) = w.get("/health");
    assert_eq!(st, 200, "{h}");
    h["pool"].clone()
}

fn full(w: &Worker) -> bool {
    let p = pool(w);
    p["free_blocks"] == p["total_blocks"] && p["pending_frees"] == 0
}

#[test]
fn prefill_frees_blocks_at_lease_expiry_when_decode_dies_or_never_comes() {
    let prefill = worker(&nixl("kv_producer", r#","kv_lease_duration":2"#), "prefill-lease");
    let prompt: Vec<u32> = (0..150).map(|i| (i * 7 % 256) as u32).collect();

    // No decode ever comes: the blocks stay held, then the lease frees them.
    let t0 = Instant::now();
    let (st, p) = prefill.post(
        "/v1/completions",
        &serde_json::json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    );
    assert_eq!(st, 200, "{p}");
    let held = pool(&prefill);
    assert_eq!(held["pending_frees"], 1, "{held}");
    assert!(held["free_blocks"].as_u64() < held["total_blocks"].as_u64(), "{held}");
    if t0.elapsed() < Duration::from_millis(1500) {
        assert!(!full(&prefill), "blocks were freed before the lease expired");
    }
    assert!(
        wait_until(Duration::from_secs(15), || full(&prefill)),
        "lease never expired: {}",
        pool(&prefill)
    );
    // /metrics tells a hold that ended by its lease from one a consumer finished.
    let ended = |how: &str| {
        let key = format!("kvconnect_kv_holds_ended_total{{how=\"{how}\"}}");
        kvconnect_tests::metrics(&prefill.http).get(&key).copied().unwrap_or(-1.0)
    };
    assert_eq!((ended("expired"), ended("done")), (1.0, 0.0), "holds ended, by how");

    // A decode killed while it loads: the pool comes back to full either way.
    let mut decode = worker(&nixl("kv_consumer", ""), "decode-killed");
    let (st, p) = prefill.post(
        "/v1/completions",
        &serde_json::json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    );
    assert_eq!(st, 200, "{p}");
    let addr = decode.http.clone();
    let body = serde_json::json!({"request_id": p["id"], "prompt": prompt, "max_tokens": 64, "kv_transfer_params": p["kv_transfer_params"]});
    let t = std::thread::spawn(move || {
        let _ = std::panic::catch_unwind(|| {
            kvconnect_tests::http_request(&addr, "POST", "/v1/completions", Some(&body))
        });
    });
    std::thread::sleep(Duration::from_millis(30));
    decode.kill();
    let _ = t.join();
    assert!(wait_until(Duration::from_secs(15), || full(&prefill)), "blocks leaked: {}", pool(&prefill));

    // And prefill still serves a new decode.
    let decode2 = worker(&nixl("kv_consumer", ""), "decode-2");
    let (st, d) = disaggregated(&prefill, &decode2, &prompt, 2);
    assert_eq!(st, 200, "{d}");
    assert_eq!(d["kvconnect"]["num_external_tokens"], 149, "{d}");
    // Three holds: the first expired; the killed decode's ended either way (it may have
    // finished its pull before the kill); the last by decode2's done.
    let all = || ended("done") + ended("expired");
    assert!(wait_until(Duration::from_secs(10), || all() == 3.0), "holds ended: {}", all());
    assert!(
        ended("done") >= 1.0 && ended("expired") >= 1.0,
        "{} done, {} expired",
        ended("done"),
        ended("expired")
    );
}

#[test]
fn decode_applies_the_policy_when_prefill_dies() {
    let mut prefill = worker(&nixl("kv_producer", ""), "prefill-dies");
    let recompute = worker(
        &nixl("kv_consumer", "").replacen('{', r#"{"kv_load_failure_policy":"recompute","#, 1),
        "decode-r",
    );
    let fail =
        worker(&nixl("kv_consumer", "").replacen('{', r#"{"kv_load_failure_policy":"fail","#, 1), "decode-f");
    let prompts = varied_prompts(30);
    let p = &prompts[26]; // 31 tokens
    let mono = monolithic(std::slice::from_ref(p), 4, KvLayout::HND);

    // Both decodes handshake and load once while prefill is alive.
    for d in [&recompute, &fail] {
        let (st, r) = disaggregated(&prefill, d, p, 4);
        assert_eq!(st, 200, "{r}");
        assert_eq!(token_ids(&r).into_iter().map(|t| t as u32).collect::<Vec<_>>(), mono[0]);
    }
    // Prefill computes two more prompts, then dies before decode pulls them.
    let mut params = Vec::new();
    for _ in 0..2 {
        let (st, r) = prefill.post(
            "/v1/completions",
            &serde_json::json!({"prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
        );
        assert_eq!(st, 200, "{r}");
        params.push(r);
    }
    prefill.kill();

    let req = |r: &serde_json::Value| serde_json::json!({"request_id": r["id"], "prompt": p, "max_tokens": 4, "kv_transfer_params": r["kv_transfer_params"]});
    let (st, r) = recompute.post("/v1/completions", &req(&params[0]));
    assert_eq!(st, 200, "recompute must still answer: {r}\n{}", recompute.log());
    assert_eq!(token_ids(&r).into_iter().map(|t| t as u32).collect::<Vec<_>>(), mono[0], "recomputed output");
    assert_eq!(r["kvconnect"]["num_external_tokens"], 0, "{r}");

    let (st, r) = fail.post("/v1/completions", &req(&params[1]));
    assert_eq!(st, 502, "{r}");
    let msg = r["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("failed") && msg.contains("kv_load_failure_policy is 'fail'"), "{msg}");
    let (_, h) = fail.get("/health");
    assert_eq!(h["pool"]["failed"], 1, "{h}");
    assert!(full(&fail), "decode freed the failed request's blocks: {}", pool(&fail));
}

#[test]
fn side_channel_garbage_and_oversized_frames_close_only_that_connection() {
    let prefill = worker(&nixl("kv_producer", ""), "prefill-garbage");
    let decode = worker(&nixl("kv_consumer", ""), "decode-garbage");
    let sc = prefill.side_channel.clone().expect("side channel address");

    let mut g = TcpStream::connect(&sc).unwrap();
    g.write_all(&12u32.to_be_bytes()).unwrap();
    g.write_all(b"not json !!").unwrap();
    g.write_all(b"?").unwrap();
    assert!(closed_by_peer(&mut g), "garbage connection left open");

    let mut o = TcpStream::connect(&sc).unwrap();
    o.write_all(&(64u32 << 20).to_be_bytes()).unwrap();
    assert!(closed_by_peer(&mut o), "oversized connection left open");

    let prompts = varied_prompts(20);
    let mono = monolithic(&prompts[18..20], 3, KvLayout::HND);
    for (i, p) in prompts[18..20].iter().enumerate() {
        let (st, d) = disaggregated(&prefill, &decode, p, 3);
        assert_eq!(st, 200, "{d}");
        assert_eq!(token_ids(&d).into_iter().map(|t| t as u32).collect::<Vec<_>>(), mono[i]);
        assert_eq!(d["kvconnect"]["num_external_tokens"].as_u64(), Some(p.len() as u64 - 1), "{d}");
    }
    let (_, h) = prefill.get("/health");
    assert_eq!(h["side_channel"]["dropped"], 2, "{h}");
    assert_eq!(h["side_channel"]["welcomed"], 1, "{h}");
    let log = prefill.log();
    assert!(log.contains("not a kvconnect handshake message"), "{log}");
    assert!(log.contains("above the 16777216-byte cap"), "{log}");
}

#[test]
fn sigterm_shuts_down_cleanly_and_unlinks_shared_memory() {
    let mut w = worker(&nixl("kv_producer", ""), "prefill-term");
    let prefix = format!("kvc-{}-", w.child.id());
    let segments = || -> Vec<String> {
        let names: Vec<String> = match std::fs::read_dir("/dev/shm") {
            Ok(d) => d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect(),
            Err(_) => Vec::new(),
        };
        names.into_iter().filter(|n| n.starts_with(&prefix)).collect()
    };
    assert!(
        !segments().is_empty(),
        "the shm backend puts the pool in shared memory ({prefix}*): {:?}",
        std::fs::read_dir("/dev/shm")
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect::<Vec<_>>())
    );
    let status = w.terminate(Duration::from_secs(20)).expect("worker did not exit on SIGTERM");
    assert!(status.success(), "{status:?}\n{}", w.log());
    assert!(segments().is_empty(), "segments left: {:?}", segments());
}
