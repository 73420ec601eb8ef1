//! How a decode worker keeps its prefill peers: each peer's handshake has its own lock, so a
//! peer that accepts the connection and then says nothing stalls only the requests for it,
//! never those for another prefill; and a prefill worker restarted on the same address (a new
//! process, new memory) is handshaken again, so decode loads its KV, the output equal to the
//! monolithic one, rather than using what it learnt of the process before.

use kvconnect_api::KvLayout;
use kvconnect_tests::{
    metrics, monolithic, prefill_for_remote_decode, reference_worker_with_secret, token_ids, varied_prompts,
    Worker,
};
use serde_json::{json, Value};
use std::net::TcpListener;
use std::time::{Duration, Instant};

const SECRET: &str = "peers-suite-deployment-secret-0123456789";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn config(backend: &str, role: &str, extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","kv_load_failure_policy":"fail","kv_connector_extra_config":{{"backend":"{backend}"{extra}}}}}"#
    )
}

fn worker(config: &str, id: &str, more: &[&str]) -> Worker {
    reference_worker_with_secret(config, id, more, SECRET)
}

fn decode_one(w: &Worker, prompt: &[u32], params: &Value, id: &Value) -> (u16, Value) {
    w.post(
        "/v1/completions",
        &json!({"request_id": id, "prompt": prompt, "max_tokens": 3, "kv_transfer_params": params}),
    )
}

fn load_failures(w: &Worker, reason: &str) -> f64 {
    let key = format!("kvconnect_kv_load_failures_total{{reason=\"{reason}\"}}");
    metrics(&w.http).get(&key).copied().unwrap_or(0.0)
}

#[test]
fn a_peer_that_stalls_its_handshake_does_not_stall_requests_for_another_peer() {
    let prefill = worker(&config("tcp", "kv_producer", ""), "prefill-quick", &[]);
    // A "prefill" that takes connections and never sends its challenge.
    let stall = TcpListener::bind("127.0.0.1:0").unwrap();
    let stall_port = stall.local_addr().unwrap().port();
    let decode = worker(
        &config("tcp", "kv_consumer", ""),
        "decode-peers",
        &[
            "--kv-producers",
            &format!("prefill-stall@127.0.0.1:{stall_port},prefill-quick@127.0.0.1"),
            "--handshake-timeout",
            "8",
        ],
    );
    let prompts = varied_prompts(30);
    let mono = monolithic(&prompts[20..22], 3, KvLayout::HND);
    let p = prefill_for_remote_decode(&prefill, &prompts[20]);
    let mut stalled = p["kv_transfer_params"].clone();
    stalled["remote_engine_id"] = json!("prefill-stall");
    stalled["remote_port"] = json!(stall_port);

    std::thread::scope(|s| {
        let t0 = Instant::now();
        let waiting = s.spawn(|| decode_one(&decode, &prompts[20], &stalled, &json!("stalled-1")));
        // The stalled peer has the connection (and its handshake lock) before the others run.
        let (conn, _) = stall.accept().expect("decode connects to the stalled peer");
        let accepted = t0.elapsed();
        for (i, prompt) in prompts[20..22].iter().enumerate() {
            let p = if i == 0 { p.clone() } else { prefill_for_remote_decode(&prefill, prompt) };
            let t = Instant::now();
            let (st, d) = decode_one(&decode, prompt, &p["kv_transfer_params"], &p["id"]);
            assert_eq!(st, 200, "{d}\n{}", decode.log());
            assert_eq!(d["kvconnect"]["num_external_tokens"].as_u64(), Some(prompt.len() as u64 - 1), "{d}");
            assert_eq!(token_ids(&d).into_iter().map(|t| t as u32).collect::<Vec<_>>(), mono[i]);
            assert!(
                t.elapsed() < Duration::from_secs(4),
                "a request for another peer waited {:?}",
                t.elapsed()
            );
        }
        assert!(!waiting.is_finished(), "the stalled handshake ended early");
        // The stalled request: refused once the handshake times out, counted.
        let (st, d) = waiting.join().unwrap();
        let took = t0.elapsed();
        assert_eq!(st, 502, "{d}");
        let msg = d["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("prefill-stall"), "{msg}");
        assert!(
            took >= accepted + Duration::from_secs(7),
            "refused after {took:?}, before the 8 s handshake timeout"
        );
        drop(conn);
    });
    assert_eq!(load_failures(&decode, "peer_unreachable"), 1.0);
    assert_eq!(prefill.get("/health").1["side_channel"]["welcomed"], 1);
}

/// P/D of `prompt` through `prefill` and `decode`: decode's output, all but the last prompt
/// token loaded.
fn pd(prefill: &Worker, decode: &Worker, prompt: &[u32]) -> Vec<u32> {
    let p = prefill_for_remote_decode(prefill, prompt);
    let (st, d) = decode_one(decode, prompt, &p["kv_transfer_params"], &p["id"]);
    assert_eq!(st, 200, "{d}\n{}\n{}", decode.log(), prefill.log());
    assert_eq!(d["kvconnect"]["num_external_tokens"].as_u64(), Some(prompt.len() as u64 - 1), "{d}");
    token_ids(&d).into_iter().map(|t| t as u32).collect()
}

fn restarted_prefill_is_handshaken_again(backend: &str) {
    let (sc_port, producer_port) = (free_port(), free_port());
    let prefill_config = config(backend, "kv_producer", &format!(r#","port":{producer_port}"#));
    let sc = sc_port.to_string();
    let start_prefill = || worker(&prefill_config, "prefill-again", &["--side-channel-port", &sc]);
    let decode = worker(
        &config(backend, "kv_consumer", ""),
        &format!("decode-again-{backend}"),
        &["--kv-producers", &format!("prefill-again@127.0.0.1:{sc_port}")],
    );
    let prompts: Vec<Vec<u32>> = varied_prompts(30).into_iter().skip(22).collect();
    let mono = monolithic(&prompts, 3, KvLayout::HND);
    let mut prefill = start_prefill();
    assert_eq!(pd(&prefill, &decode, &prompts[0]), mono[0]);
    // The prefill process dies (kill -9) and a new one comes up on the same addresses, with
    // the same engine id: new memory, new segments.
    prefill.kill();
    let prefill = start_prefill();
    for (prompt, want) in prompts.iter().zip(&mono).skip(1) {
        assert_eq!(
            &pd(&prefill, &decode, prompt),
            want,
            "{backend}: a prompt of {} tokens after the restart",
            prompt.len()
        );
    }
    assert_eq!(prefill.get("/health").1["side_channel"]["welcomed"], 1, "decode handshook the new process");
    let failed: f64 = metrics(&decode.http)
        .iter()
        .filter(|(k, _)| k.starts_with("kvconnect_kv_load_failures_total"))
        .map(|(_, v)| *v)
        .sum();
    assert_eq!(failed, 0.0, "a load failed across the restart");
}

#[test]
fn a_prefill_restarted_on_the_same_address_is_handshaken_again_over_tcp() {
    restarted_prefill_is_handshaken_again("tcp");
}

#[test]
fn a_prefill_restarted_on_the_same_address_is_handshaken_again_over_shm() {
    restarted_prefill_is_handshaken_again("shm");
}
