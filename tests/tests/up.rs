//! `kvconnect up` end to end: the command starts its own prefill and decode worker processes
//! and the P/D proxy; requests go through the proxy with a plain HTTP/1.1 client. Checked:
//! the OpenAI routes (models, completions, chat, streaming), that distinct prefill and decode
//! processes served them (their own /metrics), that outputs equal the monolithic engine's,
//! bad input answered with OpenAI error bodies while the workers keep serving, the DYN-3545
//! mismatch under `fail` and `recompute`, `--workload`, and that SIGTERM to `up` leaves no
//! process and no shared-memory segment behind.

#![allow(unsafe_code)] // Asks whether worker processes are alive (kill(2) with signal 0).

use kvconnect_api::KvLayout;
use kvconnect_engine::{detokenize, tokenize};
use kvconnect_openai::chat_template::chat_prompt;
use kvconnect_openai::stream::{collect_text, collect_token_ids};
use kvconnect_tests::{http_request, kvconnect_bin, monolithic, reference_model, token_ids, varied_prompts};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `kvconnect up` (SIGKILLed on drop if a test failed before stopping it; its
/// workers then die with it through their parent-death signal).
struct Up {
    child: Child,
    proxy: String,
    line: Value,
}

impl Up {
    fn start(args: &[&str]) -> Up {
        let (child, line) = kvconnect_tests::spawn_up(args);
        let proxy = line["proxy"].as_str().unwrap().trim_start_matches("http://").to_owned();
        Up { child, proxy, line }
    }

    fn pids(&self) -> Vec<i32> {
        self.line["worker_pids"].as_array().unwrap().iter().map(|p| p.as_i64().unwrap() as i32).collect()
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        http_request(&self.proxy, "POST", path, Some(body))
    }

    /// SIGTERM; waits for `up` to exit and checks nothing of it is left.
    fn terminate_and_check_clean(mut self) {
        let pids = self.pids();
        let status = kvconnect_tests::terminate(&mut self.child, Duration::from_secs(30));
        let status = status.expect("kvconnect up did not exit within 30 s of SIGTERM");
        assert!(status.success(), "up exited with {status:?}");
        for pid in pids {
            // SAFETY: signal 0 only asks whether the pid exists.
            let alive = unsafe { libc::kill(pid, 0) } == 0;
            assert!(!alive, "worker {pid} outlived kvconnect up");
            let prefix = format!("kvc-{pid}-");
            let left: Vec<String> = std::fs::read_dir("/dev/shm")
                .map(|d| {
                    d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect()
                })
                .unwrap_or_default();
            assert!(
                !left.iter().any(|n| n.starts_with(&prefix)),
                "worker {pid} left shared memory behind: {left:?}"
            );
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn metric(addr: &str, name: &str) -> u64 {
    let (_, body) = http_request(addr, "GET", "/metrics", None);
    let text = body.as_str().unwrap_or_default().to_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("{name} missing from {addr}/metrics:\n{text}"))
}

fn assert_openai_error(status: u16, body: &Value, want: u16, says: &str) {
    assert_eq!(status, want, "{body}");
    let e = &body["error"];
    for k in ["message", "type", "param", "code"] {
        assert!(e.get(k).is_some(), "error body lacks '{k}': {body}");
    }
    let m = e["message"].as_str().unwrap_or_default();
    assert!(m.contains(says), "error message should say '{says}': {m}");
}

const MAX: usize = 4;

#[test]
fn up_serves_openai_routes_through_distinct_prefill_and_decode_processes_and_exits_clean() {
    let up = Up::start(&["--prefill", "2", "--decode", "2", "--num-blocks", "128"]);
    let (prefill, decode) = (up.line["prefill"].clone(), up.line["decode"].clone());
    assert_eq!((prefill.as_array().unwrap().len(), decode.as_array().unwrap().len()), (2, 2), "{}", up.line);
    let mut pids = up.pids();
    pids.push(up.child.id() as i32);
    pids.sort();
    pids.dedup();
    assert_eq!(pids.len(), 5, "four worker processes besides up itself: {}", up.line);

    let (st, models) = http_request(&up.proxy, "GET", "/v1/models", None);
    assert_eq!(st, 200, "{models}");
    let model = models["data"][0]["id"].as_str().unwrap().to_owned();

    // Completions, token prompts, against the monolithic engine.
    let prompts = varied_prompts(8);
    let mono = monolithic(&prompts, MAX, KvLayout::HND);
    for (i, p) in prompts.iter().enumerate() {
        let (st, d) = up.post("/v1/completions", &json!({"model": model, "prompt": p, "max_tokens": MAX}));
        assert_eq!(st, 200, "prompt {i}: {d}");
        let got: Vec<u32> = token_ids(&d).into_iter().map(|t| t as u32).collect();
        assert_eq!(got, mono[i], "prompt {i}: through the proxy != monolithic");
        assert_eq!(
            d["kvconnect"]["num_external_tokens"].as_u64(),
            Some(p.len() as u64 - 1),
            "decode loaded the KV: {d}"
        );
        assert_ne!(d["kvconnect"]["proxy"]["prefill_worker"], d["kvconnect"]["proxy"]["decode_worker"]);
    }

    // Streaming completion and chat (plain and streaming) with a text prompt.
    let text = "The quick brown fox jumps over the lazy dog, again and again.";
    let want_ids = monolithic(&[tokenize(text)], MAX, KvLayout::HND).remove(0);
    let (st, s) = up.post("/v1/completions", &json!({"prompt": text, "max_tokens": MAX, "stream": true}));
    assert_eq!(st, 200, "{s}");
    let s = s.as_str().unwrap();
    assert!(s.starts_with("data: {") && s.ends_with("data: [DONE]\n\n"), "{s}");
    assert_eq!(collect_token_ids(s), Some(want_ids));
    assert!(collect_text(s).is_some());
    let messages =
        json!([{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}]);
    let chat_ids = monolithic(&[tokenize(&chat_prompt(&messages).unwrap())], MAX, KvLayout::HND).remove(0);
    let chat_want = detokenize(&chat_ids);
    let (st, c) =
        up.post("/v1/chat/completions", &json!({"model": model, "messages": messages, "max_tokens": MAX}));
    assert_eq!(st, 200, "{c}");
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    assert_eq!(c["choices"][0]["message"]["content"].as_str(), Some(chat_want.as_str()));
    let (st, cs) =
        up.post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": MAX, "stream": true}));
    assert_eq!(st, 200, "{cs}");
    assert!(cs.as_str().unwrap().contains("chat.completion.chunk"), "{cs}");
    assert_eq!(collect_token_ids(cs.as_str().unwrap()), Some(chat_ids));

    // Both prefill and both decode processes served (round-robin), as their own counters say.
    for w in prefill.as_array().unwrap().iter().chain(decode.as_array().unwrap()) {
        let n = metric(w.as_str().unwrap(), "kvconnect_requests_completed_total");
        assert!(n >= 3, "worker {w} served {n} requests; round-robin should spread 11 over two");
        assert!(metric(w.as_str().unwrap(), "kvconnect_ttft_seconds_count") >= 3, "TTFT histogram on {w}");
    }

    // Bad input: an OpenAI error body, a fitting status, and the workers keep serving.
    let raw = |body: &str| {
        let mut s = TcpStream::connect(&up.proxy).unwrap();
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        (
            head.split_whitespace().nth(1).unwrap().parse::<u16>().unwrap(),
            serde_json::from_str::<Value>(body).unwrap(),
        )
    };
    let (st, e) = raw("{\"prompt\": \"hi\", ");
    assert_openai_error(st, &e, 400, "not valid JSON");
    let (st, e) = up.post("/v1/completions", &json!({"model": "gpt-4", "prompt": "hi"}));
    assert_openai_error(st, &e, 404, "'gpt-4' does not exist");
    assert_eq!(e["error"]["param"], "model");
    let (st, e) = up.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 0}));
    assert_openai_error(st, &e, 400, "positive integer");
    let (st, e) = up.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 1_000_000}));
    assert_openai_error(st, &e, 422, "exceeds the model's context");
    // 128 blocks of 16 tokens hold 2048 tokens; the context (4096) would allow this prompt.
    let long: Vec<u32> = (0..3000u32).map(|i| i % 251).collect();
    let (st, e) = up.post("/v1/completions", &json!({"prompt": long, "max_tokens": 4}));
    assert_openai_error(st, &e, 413, "but the pool has");
    let (st, e) = up.post("/v1/chat/completions", &json!({"messages": [], "max_tokens": 4}));
    assert_openai_error(st, &e, 400, "'messages' is empty");
    // A client that sends a streaming request and hangs up before the answer.
    for _ in 0..3 {
        let mut s = TcpStream::connect(&up.proxy).unwrap();
        let body = json!({"prompt": "disconnect me", "max_tokens": 64, "stream": true}).to_string();
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).unwrap();
        drop(s);
    }
    std::thread::sleep(Duration::from_millis(300));
    let (st, d) = up.post("/v1/completions", &json!({"prompt": prompts[3], "max_tokens": MAX}));
    assert_eq!(st, 200, "after bad input and hang-ups the workers still serve: {d}");
    assert_eq!(token_ids(&d).into_iter().map(|t| t as u32).collect::<Vec<_>>(), mono[3]);
    let (st, h) = http_request(&up.proxy, "GET", "/health", None);
    assert_eq!(st, 200, "{h}");

    up.terminate_and_check_clean();
}

fn mismatched(dir: &std::path::Path, policy: &str) -> std::path::PathBuf {
    let text = format!(
        r#"model = "{}"

[prefill]
kv_transfer_config = '{{"kv_connector":"PdConnector","kv_role":"kv_producer","kv_connector_extra_config":{{"connectors":[{{"kv_connector":"LMCacheConnectorV1"}},{{"kv_connector":"NixlConnector","kv_connector_extra_config":{{"backend":"shm"}}}}]}}}}'

[decode]
kv_transfer_config = '{{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"{policy}","kv_connector_extra_config":{{"backend":"shm"}}}}'
hybrid_kv_cache_manager = "auto"
"#,
        reference_model().display()
    );
    let p = dir.join(format!("dyn3545-{policy}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn mismatched_decode_fails_naming_hma_under_fail_and_recomputes_under_recompute() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = varied_prompts(6)[5].clone();
    let mono = monolithic(std::slice::from_ref(&prompt), MAX, KvLayout::HND);

    let fail = mismatched(dir.path(), "fail");
    let up = Up::start(&[fail.to_str().unwrap(), "--independent"]);
    let (st, e) = up.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": MAX}));
    assert_eq!(st, 502, "{e}");
    let m = e["error"]["message"].as_str().unwrap_or_default();
    assert!(m.contains("hma: prefill=off") && m.contains("decode=on"), "{m}");
    assert!(e["error"]["diff"].as_array().is_some_and(|d| d.iter().any(|f| f["field"] == "hma")), "{e}");
    let dec = up.line["decode"][0].as_str().unwrap().to_owned();
    assert_eq!(
        metric(&dec, "kvconnect_handshake_refusals_total{field=\"hma\"}"),
        1,
        "decode counts the refusal by field"
    );
    up.terminate_and_check_clean();

    let recompute = mismatched(dir.path(), "recompute");
    let up = Up::start(&[recompute.to_str().unwrap(), "--independent"]);
    let (st, d) = up.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": MAX}));
    assert_eq!(st, 200, "{d}");
    assert_eq!(token_ids(&d).into_iter().map(|t| t as u32).collect::<Vec<_>>(), mono[0]);
    assert_eq!(d["kvconnect"]["kv_load"]["recomputed"], true, "{d}");
    assert_eq!(d["kvconnect"]["num_external_tokens"], 0, "{d}");
    up.terminate_and_check_clean();
}

#[test]
fn an_api_key_guards_the_proxy_and_the_workers_as_vllms_does() {
    let up = Up::start(&["--api-key", "k3y-for-the-test"]);
    let body = json!({"prompt": "Hello, key", "max_tokens": MAX});
    let (st, e) = up.post("/v1/completions", &body);
    assert_openai_error(st, &e, 401, "API key");
    let auth = [("Authorization", "Bearer k3y-for-the-test")];
    let (st, d) =
        kvconnect_tests::http_request_with(&up.proxy, "POST", "/v1/completions", &auth, Some(&body));
    assert_eq!(st, 200, "{d}");
    assert!(d["kvconnect"]["num_external_tokens"].as_u64().unwrap() > 0, "decode loaded the KV: {d}");
    let (st, m) = kvconnect_tests::http_request_with(&up.proxy, "GET", "/v1/models", &auth, None);
    assert_eq!(st, 200, "{m}");
    // The workers require it too; /health stays open, as vLLM's.
    for w in [&up.line["prefill"][0], &up.line["decode"][0]] {
        let w = w.as_str().unwrap();
        let (st, e) = http_request(w, "POST", "/v1/completions", Some(&body));
        assert_eq!(st, 401, "{e}");
        assert_eq!(http_request(w, "GET", "/health", None).0, 200);
    }
    // Handed to the workers through their environment, never on a command line.
    for pid in up.pids() {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        assert!(
            !String::from_utf8_lossy(&cmdline).contains("k3y"),
            "the key is on worker {pid}'s command line"
        );
    }
    up.terminate_and_check_clean();
}

#[test]
fn up_hands_its_workers_one_secret_by_environment_and_decode_its_producers() {
    let up = Up::start(&[]);
    let body = json!({"prompt": "Hello, secret", "max_tokens": MAX});
    let (st, d) = up.post("/v1/completions", &body);
    assert_eq!(st, 200, "{d}");
    assert!(d["kvconnect"]["num_external_tokens"].as_u64().unwrap() > 0, "decode loaded the KV: {d}");
    let mut secrets = Vec::new();
    for pid in up.pids() {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let secret = environ
            .split(|b| *b == 0)
            .find_map(|v| v.strip_prefix(b"KVCONNECT_SIDE_CHANNEL_TOKEN="))
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_else(|| panic!("worker {pid} got no secret in its environment"));
        assert!(secret.len() >= 32, "{secret}");
        let cmdline =
            String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/cmdline")).unwrap()).into_owned();
        assert!(!cmdline.contains(&secret), "the secret is on worker {pid}'s command line");
        if cmdline.contains("\0decode\0") {
            assert!(
                cmdline.contains("--kv-producers") && cmdline.contains("-prefill-0@127.0.0.1"),
                "{cmdline}"
            );
        }
        secrets.push(secret);
    }
    secrets.dedup();
    assert_eq!(secrets.len(), 1, "one secret for the deployment");
    up.terminate_and_check_clean();
}

#[test]
fn hybrid_model_workload_moves_kv_and_state_and_equals_monolithic() {
    // The hybrid reference model (sliding, state and full layers) over nixl shm with HMA on:
    // every decode loads its prompt's KV and state from prefill, none recomputes, and every
    // output equals the monolithic engine's.
    let deployment = kvconnect_tests::workspace_root().join("examples/deployments/hybrid-up.toml");
    let out = Command::new(kvconnect_bin())
        .arg("up")
        .arg(&deployment)
        .args(["--workload", "8", "--json"])
        .stdin(Stdio::null())
        .output()
        .expect("run kvconnect up --workload");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_str(stdout.split_once('\n').unwrap().1).unwrap();
    assert_eq!(report["requests"], 8, "{report}");
    assert_eq!(report["failed"], 0, "{report}");
    assert_eq!(report["mismatches"], 0, "{report}");
    assert_eq!(report["loaded_requests"], 8, "every decode loaded from prefill: {report}");
    assert_eq!(report["recomputed_requests"], 0, "no decode recomputed its prompt: {report}");
}

#[test]
fn workload_report_checks_every_output_and_exits_zero() {
    // One request at a time: a prompt sharing a prefix with one still in flight would find
    // nothing stored yet, so the hit rate would depend on timing. One prefix: the shared
    // prompts among the 8 (a fixed draw) repeat it.
    let report = kvconnect_tests::up_workload_report(&[
        "--workload",
        "8",
        "--prefixes",
        "1",
        "--concurrency",
        "1",
        "--json",
        "--compare-monolithic",
    ]);
    assert_eq!(report["requests"], 8, "{report}");
    assert_eq!(report["failed"], 0, "{report}");
    assert_eq!(report["mismatches"], 0, "{report}");
    assert!(report["kv_bytes"].as_u64().unwrap() > 0, "decode loaded KV from prefill: {report}");
    assert!(
        report["prefill_cache_hit_rate"].as_f64().unwrap() > 0.0,
        "shared prefixes hit the cache: {report}"
    );
    let hits = report["prefill_cache_hits"].as_array().unwrap();
    assert!(
        hits.iter().all(|h| h["connector"] == "lmcache" && h["tier"] == "cpu"),
        "the default deployment's prefill caches with lmcache's CPU tier: {report}"
    );
    assert!(report["ttft_ms"]["p50"].as_f64().unwrap() > 0.0, "{report}");
    // Decode's own part of the TTFT: there, and no more than the whole (p99 to p99).
    let part = |k: &str, p: &str| report[k][p].as_f64().unwrap();
    assert!(0.0 < part("decode_ttft_ms", "p50"), "{report}");
    assert!(part("decode_ttft_ms", "p99") <= part("ttft_ms", "p99"), "{report}");
    assert_eq!(report["compare_monolithic"]["monolithic_mismatches"], 0, "{report}");
    assert!(report["compare_monolithic"]["ttft_p50_ratio"].as_f64().unwrap() > 0.0, "{report}");
    // Every prompt ran on both, in interleaved rounds: eight pairs, ordered quartiles.
    let c = &report["compare_monolithic"];
    assert_eq!(c["pairs"], 8, "{report}");
    let q = |k: &str| c["ttft_pair_ratio"][k].as_f64().unwrap();
    assert!(0.0 < q("q1") && q("q1") <= q("median") && q("median") <= q("q3"), "{report}");
}

#[test]
fn up_refuses_a_missing_deployment_before_starting_anything() {
    let out = Command::new(kvconnect_bin()).args(["up", "/nonexistent/deploy.toml"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no such file"), "{err}");
    assert!(out.stdout.is_empty(), "no address line for a deployment that cannot start");
}

#[test]
fn the_proxy_and_its_workers_refuse_a_body_over_the_limit_with_413() {
    let up = Up::start(&[]);
    let too_big = kvconnect_openai::gate::DEFAULT_MAX_BODY_BYTES + 1;
    for addr in [up.proxy.as_str(), up.line["decode"][0].as_str().unwrap()] {
        // Declared over the limit: answered without the body being sent at all.
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(60))).unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: up\r\nContent-Type: application/json\r\nContent-Length: {too_big}\r\nConnection: close\r\n\r\n"
        );
        s.write_all(head.as_bytes()).unwrap();
        let mut raw = String::new();
        let _ = s.read_to_string(&mut raw);
        let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
        let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let e: Value = serde_json::from_str(body).unwrap_or(Value::String(body.to_owned()));
        assert_openai_error(status, &e, 413, "--max-request-body-bytes");
        assert_eq!(e["error"]["code"], "request_too_large", "{addr}: {e}");
    }
    let (st, d) = up.post("/v1/completions", &json!({"prompt": "Hello, limit", "max_tokens": MAX}));
    assert_eq!(st, 200, "{d}");
    up.terminate_and_check_clean();
}
