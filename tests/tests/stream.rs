//! Streaming and the worker's transfer metrics, against a real `kvconnect up` (one prefill and
//! one decode worker process). Checked: a `stream: true` request to a worker gets its first
//! SSE chunk while the response is still open and more chunks follow (the chunks are not all
//! written at the end), and so does one through the proxy; a client that hangs up mid-stream leaves the worker serving with all
//! its blocks free; after a prefix-sharing request pair, prefill's /metrics shows lmcache hits
//! and decode's shows KV bytes moved (external tokens × the model's KV bytes per token) and
//! the admission-to-first-token histogram of requests that loaded external KV.

use kvconnect_openai::stream::collect_token_ids;
use kvconnect_tests::{http_request, wait_until};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Child;
use std::time::Duration;

/// `kvconnect up`, SIGKILLed with its workers on drop.
struct Up {
    child: Child,
    line: Value,
}

impl Up {
    fn start(args: &[&str]) -> Up {
        let (child, line) = kvconnect_tests::spawn_up(args);
        Up { child, line }
    }

    fn worker(&self, role: &str) -> String {
        self.line[role][0].as_str().unwrap().trim_start_matches("http://").to_owned()
    }

    fn proxy(&self) -> String {
        self.line["proxy"].as_str().unwrap().trim_start_matches("http://").to_owned()
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn metrics(addr: &str) -> String {
    let (st, body) = http_request(addr, "GET", "/metrics", None);
    assert_eq!(st, 200, "{body}");
    body.as_str().unwrap_or_default().to_owned()
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
}

/// Sends a streaming request and returns the connection, positioned after the request.
fn open_stream(addr: &str, body: &Value) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    s
}

/// Reads until the bytes so far hold a `data:` event; returns them.
fn read_first_event(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the connection closed before any event: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        if text.contains("data: {") {
            return text;
        }
    }
}

/// Undoes HTTP/1.1 chunked transfer encoding of a body.
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

#[test]
fn worker_streams_tokens_as_produced_and_reports_transfer_metrics() {
    let up = Up::start(&["--prefill", "1", "--decode", "1", "--num-blocks", "128"]);
    let (prefill, decode) = (up.worker("prefill"), up.worker("decode"));

    // Streaming: the first event arrives while the response is still open, and more follow.
    let prompt = "Stream me a long answer, token by token, please.";
    let mut s = open_stream(&decode, &json!({"prompt": prompt, "max_tokens": 256, "stream": true}));
    let first = read_first_event(&mut s);
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(!first.contains("[DONE]"), "the whole stream came at once, not as produced:\n{first}");
    let events_at_first = first.matches("data: {").count();
    assert!(events_at_first < 256, "every token arrived in the first read: {events_at_first}");
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    let whole = first + &String::from_utf8_lossy(&rest);
    let (_, body) = whole.split_once("\r\n\r\n").unwrap();
    let body = dechunk(body);
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    let streamed = collect_token_ids(&body).expect("a complete stream");
    assert_eq!(streamed.len(), 256, "one id per generated token");
    let (st, plain) =
        http_request(&decode, "POST", "/v1/completions", Some(&json!({"prompt": prompt, "max_tokens": 256})));
    assert_eq!(st, 200, "{plain}");
    let plain_ids: Vec<u32> = plain["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(streamed, plain_ids, "streamed tokens equal the non-streaming answer");

    // Through the proxy: decode's stream is passed on as it arrives, the closing chunk carries
    // the proxy's block.
    let mut s = open_stream(&up.proxy(), &json!({"prompt": prompt, "max_tokens": 256, "stream": true}));
    let first = read_first_event(&mut s);
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(!first.contains("[DONE]"), "the proxy buffered the whole stream:\n{first}");
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    let whole = first + &String::from_utf8_lossy(&rest);
    let body = dechunk(whole.split_once("\r\n\r\n").unwrap().1);
    assert_eq!(collect_token_ids(&body).as_ref(), Some(&plain_ids), "proxy stream == worker answer");
    assert!(body.contains("\"decode_worker\""), "the closing chunk names the workers: {body}");

    // A client that hangs up after the first event: the worker keeps serving, blocks come back.
    for _ in 0..2 {
        let mut s =
            open_stream(&decode, &json!({"prompt": "hang up on me", "max_tokens": 256, "stream": true}));
        let _ = read_first_event(&mut s);
        drop(s);
    }
    assert!(
        wait_until(Duration::from_secs(30), || {
            let m = metrics(&decode);
            metric(&m, "kvconnect_requests_unfinished") == 0
                && metric(&m, "kvconnect_pool_free_blocks") == metric(&m, "kvconnect_pool_blocks")
        }),
        "requests whose client left still finish and free their blocks:\n{}",
        metrics(&decode)
    );

    // A prefix-sharing pair through the proxy: prefill hits lmcache, decode loads KV.
    let shared = "A long shared system prompt that both requests start with, so that the second one finds its chunks in the cache. ".repeat(3);
    for q in ["first question?", "second question!"] {
        let (st, d) = http_request(
            &up.proxy(),
            "POST",
            "/v1/completions",
            Some(&json!({"prompt": format!("{shared}{q}"), "max_tokens": 4})),
        );
        assert_eq!(st, 200, "{d}");
    }
    let p = metrics(&prefill);
    assert!(metric(&p, "kvconnect_cache_hits_total{connector=\"lmcache\",tier=\"cpu\"}") > 0, "{p}");
    let d = metrics(&decode);
    let ext = metric(&d, "kvconnect_external_tokens_total");
    let moved = metric(&d, "kvconnect_kv_bytes_moved_total");
    assert!(ext > 0 && moved > 0, "decode loaded KV through the connector:\n{d}");
    assert_eq!(moved % ext, 0, "bytes moved are whole tokens' KV: {moved} / {ext}");
    assert!(metric(&d, "kvconnect_external_kv_first_token_seconds_count") >= 2, "{d}");
}
