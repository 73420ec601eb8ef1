//! kvconnect workers in vLLM's P/D tooling. A proxy written here speaks vLLM's P/D proxy
//! protocol and nothing of kvconnect's: a fresh X-Request-Id per request for both hops, an
//! Authorization header, prefill asked for one token with vLLM's `kv_transfer_params`,
//! decode given the client's body with prefill's params verbatim. In front of kvconnect
//! workers it gives the monolithic engine's tokens, decode loads the KV (no silent
//! recompute), and decode's metrics count prompt tokens by source as vLLM does. The same
//! suite then runs through `kvconnect up`'s own proxy, and bad transfer params are answered
//! correctly and counted.

use kvconnect_api::KvLayout;
use kvconnect_tests::{
    http_request, http_request_with, metrics, monolithic, reference_model, token_ids, workspace_root, Worker,
};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

const MAX: usize = 4;
const BLOCK: usize = 16;

/// A fresh request id, as vLLM's proxy makes one (its own ids, nothing from the workers).
fn uuid_like() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        t as u32,
        n & 0xffff,
        std::process::id() & 0xfff,
        n & 0xfff,
        t >> 32
    )
}

/// One request through vLLM's P/D proxy protocol.
fn vllm_proxy(prefill: &str, decode: &str, path: &str, body: &Value) -> (u16, Value) {
    let rid = uuid_like();
    let headers = [("X-Request-Id", rid.as_str()), ("Authorization", "Bearer sk-test")];
    let mut pre = body.clone();
    pre["max_tokens"] = json!(1);
    if pre.get("max_completion_tokens").is_some() {
        pre["max_completion_tokens"] = json!(1);
    }
    pre["stream"] = json!(false);
    if let Some(o) = pre.as_object_mut() {
        o.remove("stream_options");
        o.remove("min_tokens");
    }
    pre["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let (st, p) = http_request_with(prefill, "POST", path, &headers, Some(&pre));
    if st != 200 {
        return (st, p);
    }
    let mut dec = body.clone();
    dec["kv_transfer_params"] = p["kv_transfer_params"].clone();
    http_request_with(decode, "POST", path, &headers, Some(&dec))
}

/// The deltas of decode's prompt-token and transfer counters over one action.
#[derive(Debug, Default, PartialEq)]
struct Sources {
    local_compute: f64,
    local_cache_hit: f64,
    external_kv_transfer: f64,
    transfers: f64,
}

fn sources(m: &BTreeMap<String, f64>) -> Sources {
    let by = |s: &str| {
        m.get(&format!("vllm:prompt_tokens_by_source_total{{source=\"{s}\"}}")).copied().unwrap_or(0.0)
    };
    Sources {
        local_compute: by("local_compute"),
        local_cache_hit: by("local_cache_hit"),
        external_kv_transfer: by("external_kv_transfer"),
        transfers: m.get("vllm:nixl_bytes_transferred_count").copied().unwrap_or(0.0),
    }
}

fn delta(decode: &str, action: impl FnOnce()) -> Sources {
    let a = sources(&metrics(decode));
    action();
    let b = sources(&metrics(decode));
    Sources {
        local_compute: b.local_compute - a.local_compute,
        local_cache_hit: b.local_cache_hit - a.local_cache_hit,
        external_kv_transfer: b.external_kv_transfer - a.external_kv_transfer,
        transfers: b.transfers - a.transfers,
    }
}

/// A prompt of `len` tokens, different for every `salt`.
fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|j| ((salt * 131 + j * 29 + j * j * 7 + 3) % 251) as u32).collect()
}

fn tokens_of(v: &Value) -> Vec<u32> {
    token_ids(v).into_iter().map(|t| t as u32).collect()
}

/// The suite: `send` runs one request the P/D way; `decode` is the decode worker's address.
fn suite(send: &dyn Fn(&Value) -> (u16, Value), decode: &str, salt: usize) {
    for (k, len) in [5usize, BLOCK, BLOCK + 2, 4 * BLOCK].into_iter().enumerate() {
        let cold = prompt(len, salt + 10 * k);
        let same = prompt(len, salt + 10 * k + 1);
        let prefixed = prompt(len, salt + 10 * k + 2);
        let want = monolithic(&[cold.clone(), same.clone(), prefixed.clone()], MAX, KvLayout::HND);

        // A cold decode loads every prompt token (the last is recomputed for its logits, and
        // counts as external, as vLLM counts it).
        let mut answer = (0, Value::Null);
        let d = delta(decode, || answer = send(&json!({"prompt": cold, "max_tokens": MAX})));
        assert_eq!(answer.0, 200, "{len} tokens: {}", answer.1);
        assert_eq!(tokens_of(&answer.1), want[0], "{len} tokens, cold: P/D != monolithic");
        assert_eq!(answer.1["kvconnect"]["num_external_tokens"], len - 1, "{}", answer.1);
        assert_eq!(
            d,
            Sources {
                local_compute: 0.0,
                local_cache_hit: 0.0,
                external_kv_transfer: len as f64,
                transfers: 1.0
            },
            "{len} tokens, cold"
        );

        // A direct request to decode computes everything and moves nothing.
        let d = delta(decode, || {
            let (st, v) = http_request(
                decode,
                "POST",
                "/v1/completions",
                Some(&json!({"prompt": same, "max_tokens": MAX})),
            );
            assert_eq!(st, 200, "{v}");
            assert_eq!(tokens_of(&v), want[1], "{len} tokens, direct");
        });
        assert_eq!(
            d,
            Sources {
                local_compute: len as f64,
                local_cache_hit: 0.0,
                external_kv_transfer: 0.0,
                transfers: 0.0
            },
            "{len} tokens, direct to decode"
        );
        // The same prompt again, P/D: decode's cache has its whole blocks, the rest comes
        // from prefill.
        let cached = (len - 1) / BLOCK * BLOCK;
        let d = delta(decode, || answer = send(&json!({"prompt": same, "max_tokens": MAX})));
        assert_eq!(answer.0, 200, "{}", answer.1);
        assert_eq!(tokens_of(&answer.1), want[1], "{len} tokens, primed: P/D != monolithic");
        assert_eq!(answer.1["kvconnect"]["num_cached_tokens"], cached, "{}", answer.1);
        assert_eq!(
            d,
            Sources {
                local_compute: 0.0,
                local_cache_hit: cached as f64,
                external_kv_transfer: (len - cached) as f64,
                transfers: f64::from(len - cached > 1),
            },
            "{len} tokens, decode primed with the same prompt"
        );

        // Primed with a prefix (its first block): a partial hit, the rest transferred.
        if len > BLOCK {
            let (st, v) = http_request(
                decode,
                "POST",
                "/v1/completions",
                Some(&json!({"prompt": prefixed[..BLOCK], "max_tokens": 1})),
            );
            assert_eq!(st, 200, "{v}");
            let d = delta(decode, || answer = send(&json!({"prompt": prefixed, "max_tokens": MAX})));
            assert_eq!(tokens_of(&answer.1), want[2], "{len} tokens, prefix primed: P/D != monolithic");
            assert_eq!(
                d,
                Sources {
                    local_compute: 0.0,
                    local_cache_hit: BLOCK as f64,
                    external_kv_transfer: (len - BLOCK) as f64,
                    transfers: 1.0,
                },
                "{len} tokens, decode primed with the first block"
            );
        }
    }
}

/// The default deployment with decode's prefix cache on, in a temp dir.
fn deployment(dir: &std::path::Path) -> std::path::PathBuf {
    let src = std::fs::read_to_string(workspace_root().join("examples/deployments/default-up.toml")).unwrap();
    let model = reference_model().to_string_lossy().into_owned();
    let text = src.replace("../../fixtures/models/kvconnect--reference/config.json", &model)
        + "enable_prefix_caching = true\n";
    assert!(text.trim_end().ends_with("enable_prefix_caching = true"), "[decode] is the file's last section");
    let path = dir.join("vllm-proxy.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_proxy_speaking_only_vllms_protocol_moves_kv_and_counts_prompt_tokens_as_vllm_does() {
    let dir = tempfile::tempdir().unwrap();
    let d = deployment(dir.path());
    let d = d.to_str().unwrap();
    let prefill = Worker::start(&["--deployment", d, "--role", "prefill", "--joint"]);
    let decode = Worker::start(&["--deployment", d, "--role", "decode", "--joint"]);
    let send = |b: &Value| vllm_proxy(&prefill.http, &decode.http, "/v1/completions", b);
    suite(&send, &decode.http, 0);

    // Chat as clients send it, through the same protocol.
    let chat = json!({"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": MAX});
    let (st, v) = vllm_proxy(&prefill.http, &decode.http, "/v1/chat/completions", &chat);
    assert_eq!(st, 200, "{v}");
    assert!(v["kvconnect"]["num_external_tokens"].as_u64().unwrap() > 0, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");

    // Bad transfer params under recompute: a correct answer, the failure counted by reason.
    let p = prompt(40, 900);
    let want = monolithic(std::slice::from_ref(&p), MAX, KvLayout::HND).remove(0);
    let rid = uuid_like();
    let h = [("X-Request-Id", rid.as_str())];
    let pre = json!({"prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    let (_, pv) = http_request_with(&prefill.http, "POST", "/v1/completions", &h, Some(&pre));
    let params = pv["kv_transfer_params"].clone();
    let failures = |m: &BTreeMap<String, f64>, reason: &str| {
        m.get(&format!("kvconnect_kv_load_failures_total{{reason=\"{reason}\"}}")).copied().unwrap_or(0.0)
    };
    let recomputed =
        |m: &BTreeMap<String, f64>| m.get("kvconnect_kv_recomputed_requests_total").copied().unwrap_or(0.0);
    let mut cases: Vec<(&str, Value, &str)> = Vec::new();
    let mut unknown_request = params.clone();
    unknown_request["remote_request_id"] = json!("cmpl-no-such-request");
    cases.push(("a request prefill does not hold", unknown_request, "load_failed"));
    let mut unknown_engine = params.clone();
    unknown_engine["remote_engine_id"] = json!("no-such-engine");
    cases.push(("an engine that does not exist", unknown_engine, "wrong_engine"));
    cases.push(("params used once already", params.clone(), "load_failed"));
    // The genuine load first, so the last case replays consumed params.
    let (st, v) = http_request_with(
        &decode.http,
        "POST",
        "/v1/completions",
        &h,
        Some(&json!({"prompt": p, "max_tokens": MAX, "kv_transfer_params": params})),
    );
    assert_eq!((st, tokens_of(&v)), (200, want.clone()), "{v}");
    for (what, bad, reason) in cases {
        let before = metrics(&decode.http);
        let (st, v) = http_request(
            &decode.http,
            "POST",
            "/v1/completions",
            Some(&json!({"prompt": p, "max_tokens": MAX, "kv_transfer_params": bad})),
        );
        assert_eq!(st, 200, "{what}: {v}");
        assert_eq!(tokens_of(&v), want, "{what}: recomputed correctly");
        assert_eq!(v["kvconnect"]["kv_load"]["recomputed"], true, "{what}: says so: {v}");
        let after = metrics(&decode.http);
        assert_eq!(failures(&after, reason) - failures(&before, reason), 1.0, "{what}: counted as {reason}");
        assert_eq!(recomputed(&after) - recomputed(&before), 1.0, "{what}");
    }
}

#[test]
fn kvconnect_ups_proxy_behaves_as_vllms() {
    let dir = tempfile::tempdir().unwrap();
    let d = deployment(dir.path());
    let (mut up, line) = kvconnect_tests::spawn_up(&[d.to_str().unwrap()]);
    let proxy = line["proxy"].as_str().unwrap().trim_start_matches("http://").to_owned();
    let decode = line["decode"][0].as_str().unwrap().to_owned();
    let send = |b: &Value| http_request(&proxy, "POST", "/v1/completions", Some(b));
    suite(&send, &decode, 1000);
    let (st, m) = http_request(&proxy, "GET", "/v1/models", None);
    assert_eq!(st, 200);
    assert_eq!(m["data"][0]["id"], "kvconnect--reference", "a served model name without spaces: {m}");
    let status = kvconnect_tests::terminate(&mut up, std::time::Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
}
