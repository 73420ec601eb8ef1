//! A worker's HTTP API against clients that send too much or too slowly, as a raw TCP client
//! would: a body over the limit (declared, or chunked without a length) gets 413 with an
//! OpenAI-style error, a body that does not arrive in time gets 408, a request head dripped a
//! byte at a time is cut off at its deadline; past `--max-concurrent-requests` a request gets
//! 503, past `--request-timeout` a request gets 504 or its stream ends with an error event (and
//! is cancelled), past `--max-connections` a connection gets 503 and is closed; each is counted
//! in /metrics, and the worker then serves a normal request.

use kvconnect_tests::{closed_by_peer, metrics, reference_model, Worker};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn worker() -> Worker {
    let model = reference_model();
    let config = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"backend":"shm"}}"#;
    Worker::start(&[
        "--kv-transfer-config",
        config,
        "--model",
        model.to_str().unwrap(),
        "--max-request-body-bytes",
        "4096",
        "--request-header-timeout",
        "2",
        "--request-body-timeout",
        "2",
    ])
}

/// Sends `head` (and `body`) on a fresh connection; the status and JSON of the answer.
fn raw(addr: &str, head: &str, body: &[u8]) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer and close before taking the whole body.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (h, b) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = h.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, serde_json::from_str(b).unwrap_or(Value::String(b.to_owned())))
}

fn refused(w: &Worker, reason: &str) -> f64 {
    let label = format!("reason=\"{reason}\"");
    metrics(&w.http)
        .iter()
        .find(|(k, _)| k.starts_with("kvconnect_http_refused") && k.contains(&label))
        .map(|(_, v)| *v)
        .unwrap_or(0.0)
}

fn assert_openai_error(st: u16, e: &Value, status: u16, code: &str, says: &str) {
    assert_eq!(st, status, "{e}");
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    assert_eq!(e["error"]["code"], code, "{e}");
    let msg = e["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains(says), "{msg}");
}

#[test]
fn oversized_slow_and_dripping_requests_are_refused_counted_and_the_worker_serves_on() {
    let w = worker();
    let post = |extra: &str| {
        format!("POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n{extra}Connection: close\r\n\r\n")
    };

    // A body declared over the limit: refused before it is read.
    let big = vec![b' '; 10_000];
    let (st, e) = raw(&w.http, &post("Content-Length: 10000\r\n"), &big);
    assert_openai_error(st, &e, 413, "request_too_large", "at most 4096 bytes");
    // Chunked, with no length: refused once past the limit.
    let mut chunked = format!("{:x}\r\n", big.len()).into_bytes();
    chunked.extend_from_slice(&big);
    chunked.extend_from_slice(b"\r\n0\r\n\r\n");
    let (st, e) = raw(&w.http, &post("Transfer-Encoding: chunked\r\n"), &chunked);
    assert_openai_error(st, &e, 413, "request_too_large", "larger than the limit");
    assert_eq!(refused(&w, "body_too_large"), 2.0);

    // A body that stops coming: 408 at the body deadline.
    let (st, e) = raw(&w.http, &post("Content-Length: 100\r\n"), br#"{"prompt": [1, 2"#);
    assert_openai_error(st, &e, 408, "request_timeout", "did not arrive whole within 2 s");
    assert_eq!(refused(&w, "body_timeout"), 1.0);

    // A request head dripped a byte every 300 ms: the connection is closed at its deadline.
    let mut s = TcpStream::connect(&w.http).unwrap();
    let head = post("Content-Length: 2\r\nX-Padding: 0123456789012345678901234567890123456789\r\n");
    let t0 = Instant::now();
    let mut cut = false;
    for b in head.as_bytes() {
        if s.write_all(&[*b]).is_err() {
            cut = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(300));
        if t0.elapsed() > Duration::from_secs(40) {
            break;
        }
    }
    assert!(cut || closed_by_peer(&mut s), "a dripping request head was not cut off");
    assert!(t0.elapsed() < Duration::from_secs(40), "the head deadline never fired");
    let counted = {
        let t = Instant::now();
        loop {
            let n = refused(&w, "header_timeout");
            if n >= 1.0 || t.elapsed() > Duration::from_secs(20) {
                break n;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    assert_eq!(counted, 1.0);

    // A normal request within the limits is served.
    let (st, d) = w.post("/v1/completions", &json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 2}));
    assert_eq!(st, 200, "{d}");
}

/// A listener that takes connections and never answers: a prefill peer whose handshake stalls,
/// which keeps a decode request in flight for as long as the test needs.
fn stalled_peer() -> (std::net::TcpListener, u16) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    (l, port)
}

#[test]
fn past_its_request_connection_and_time_limits_a_worker_answers_503_504_or_ends_the_stream_and_serves_on() {
    let (stall, stall_port) = stalled_peer();
    let model = reference_model();
    let config = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"fail","kv_connector_extra_config":{"backend":"tcp"}}"#;
    let producers = format!("stalled@127.0.0.1:{stall_port}");
    let w = Worker::start(&[
        "--kv-transfer-config",
        config,
        "--model",
        model.to_str().unwrap(),
        "--kv-producers",
        &producers,
        "--handshake-timeout",
        "60",
        "--max-concurrent-requests",
        "1",
        "--request-timeout",
        "3",
        "--max-connections",
        "3",
    ]);
    let stalled = |stream: bool| {
        json!({"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 2, "stream": stream, "kv_transfer_params": {
            "do_remote_prefill": true, "remote_engine_id": "stalled", "remote_host": "127.0.0.1",
            "remote_port": stall_port, "remote_block_ids": [[0]], "remote_num_tokens": 8,
            "remote_capability": "00000000000000000000000000000000"}})
    };
    let normal = json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 2});

    // One request in flight (its load waits on the stalled peer): the next gets 503 at once.
    std::thread::scope(|s| {
        let t0 = Instant::now();
        let held = s.spawn(|| w.post("/v1/completions", &stalled(false)));
        let (_peer_conn, _) = stall.accept().unwrap();
        let (st, e) = w.post("/v1/completions", &normal);
        assert_eq!(st, 503, "{e}");
        assert_eq!(e["error"]["type"], "service_unavailable", "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains("--max-concurrent-requests"), "{e}");
        assert_eq!(refused(&w, "too_many_requests"), 1.0);
        // The held request runs past --request-timeout: 504, and it is dropped.
        let (st, e) = held.join().unwrap();
        assert_eq!(st, 504, "{e}");
        assert_eq!(e["error"]["code"], "request_run_timeout", "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains("ran past 3 s"), "{e}");
        let took = t0.elapsed();
        assert!(took >= Duration::from_secs(3) && took < Duration::from_secs(20), "{took:?}");
    });
    assert_eq!(refused(&w, "run_timeout"), 1.0);
    // Its place was given back.
    let (st, d) = w.post("/v1/completions", &normal);
    assert_eq!(st, 200, "{d}");

    // A stalled stream has sent nothing yet: it is answered whole, 504.
    let (st, e) = w.post("/v1/completions", &stalled(true));
    assert_eq!(st, 504, "{e}");
    assert_eq!(refused(&w, "run_timeout"), 2.0);
    // A long generation streamed past its deadline: its tokens so far, then an OpenAI error
    // event, and the request is cancelled, its blocks freed.
    let t0 = Instant::now();
    let long = json!({"prompt": [1, 2, 3], "max_tokens": 4000, "stream": true});
    let (st, body) = w.post("/v1/completions", &long);
    let text = body.as_str().unwrap_or_default().to_owned();
    assert_eq!(st, 200, "{text}");
    let took = t0.elapsed();
    assert!(took >= Duration::from_secs(3) && took < Duration::from_secs(20), "{took:?}");
    let error = text.lines().rev().find(|l| l.starts_with("data: ")).unwrap_or_default();
    assert!(error.starts_with("data: {\"error\"") && error.contains("request_run_timeout"), "{text}");
    assert!(text.contains("\"text\""), "no token was streamed before the cut: {text}");
    assert_eq!(refused(&w, "run_timeout"), 3.0);
    let freed = kvconnect_tests::wait_until(Duration::from_secs(10), || {
        let p = w.get("/health").1["pool"].clone();
        p["free_blocks"] == p["total_blocks"]
    });
    assert!(freed, "the cut request kept its blocks: {}", w.get("/health").1);
    assert_eq!(metrics(&w.http).get("kvconnect_requests_cancelled_total").copied(), Some(1.0));

    // Connections open and idle up to the cap of 3: the next is answered 503 and closed. A
    // connection of the steps above may hold its slot a moment after its client closed it,
    // so idle connections are opened one by one until one is refused: an accepted one says
    // nothing (its read times out), a refused one gets the 503 at once.
    let mut idle: Vec<TcpStream> = Vec::new();
    let answer = loop {
        let mut s = TcpStream::connect(&w.http).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(1500))).unwrap();
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        if !got.is_empty() {
            break String::from_utf8_lossy(&got).into_owned();
        }
        idle.push(s);
        assert!(idle.len() <= 3, "{} idle connections were accepted past the cap of 3", idle.len());
    };
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    assert!(head.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(body.contains("--max-connections"), "{answer}");
    drop(idle);
    std::thread::sleep(Duration::from_millis(300));
    let served =
        kvconnect_tests::wait_until(Duration::from_secs(10), || w.post("/v1/completions", &normal).0 == 200);
    assert!(served, "the worker did not serve after the idle connections closed");
    assert_eq!(refused(&w, "too_many_connections"), 1.0);
}
