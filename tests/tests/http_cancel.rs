//! A request whose client disconnects, streamed or not, is ended by the engine and its blocks
//! freed then, not when it would have finished: a raw TCP client sends a long generation,
//! waits until it runs, and closes its connection.

use kvconnect_tests::{metrics, reference_model, wait_until, Worker};
use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

fn counter(w: &Worker, name: &str) -> f64 {
    metrics(&w.http).iter().find(|(k, _)| k.starts_with(name)).map(|(_, v)| *v).unwrap_or(0.0)
}

fn pool(w: &Worker) -> serde_json::Value {
    w.get("/health").1["pool"].clone()
}

#[test]
fn a_request_whose_client_disconnects_is_cancelled_and_its_blocks_freed() {
    let model = reference_model();
    let config = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"backend":"shm"}}"#;
    let w = Worker::start(&["--kv-transfer-config", config, "--model", model.to_str().unwrap()]);
    let prompt: Vec<u32> = (0..200u32).map(|i| (i * 7) % 256).collect();
    for stream in [false, true] {
        let cancelled = counter(&w, "kvconnect_requests_cancelled");
        let completed = counter(&w, "kvconnect_requests_completed");
        // Nearly the whole context: far longer than the test waits before leaving.
        let body = json!({"prompt": prompt, "max_tokens": 3800, "stream": stream}).to_string();
        let mut s = TcpStream::connect(&w.http).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        // HTTP/1.1 keep-alive, as clients send it.
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body.as_bytes()).unwrap();
        if stream {
            // Tokens are arriving: the request runs.
            let mut got = Vec::new();
            let mut buf = [0u8; 1024];
            while !String::from_utf8_lossy(&got).contains("data: ") {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "the stream ended: {}", String::from_utf8_lossy(&got));
                got.extend_from_slice(&buf[..n]);
            }
        } else {
            assert!(
                wait_until(Duration::from_secs(60), || pool(&w)["unfinished"] == 1),
                "the request never ran: {}",
                pool(&w)
            );
        }
        let held = pool(&w);
        assert!(held["free_blocks"].as_u64() < held["total_blocks"].as_u64(), "{held}");
        drop(s);
        assert!(
            wait_until(Duration::from_secs(60), || counter(&w, "kvconnect_requests_cancelled")
                == cancelled + 1.0),
            "stream {stream}: the request was not cancelled\n{}",
            w.log()
        );
        let p = pool(&w);
        assert_eq!(p["unfinished"], 0, "{p}");
        assert_eq!(p["free_blocks"], p["total_blocks"], "stream {stream}: its blocks were not freed: {p}");
        assert_eq!(
            counter(&w, "kvconnect_requests_completed"),
            completed,
            "stream {stream}: the request ran to its end"
        );
    }
    // The worker serves on.
    let (st, d) = w.post("/v1/completions", &json!({"prompt": [1, 2, 3], "max_tokens": 2}));
    assert_eq!(st, 200, "{d}");
}
