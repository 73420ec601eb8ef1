//! The data plane's write deadlines against peers that take what they asked for too slowly,
//! or never: a live prefill worker's producer listener cuts an authenticated Read whose reader
//! drains it slowly at the Read's whole deadline (its io_timeout plus the bytes at 100 MB/s,
//! though every single write progresses), and one whose reader never reads at the same
//! deadline; its side channel cuts a peer that sends hellos and never reads the answers at
//! `--side-channel-timeout`. Each is counted (`timeout`), nothing of the request is freed,
//! and decode then loads the request whole.

use kvconnect_api::BlockId;
use kvconnect_dataplane::auth::Secret;
use kvconnect_nixl::wire::{authenticate_client, write_frame, ClientMsg};
use kvconnect_nixl::{PeerInfo, ProducerMetadata};
use kvconnect_server::sidechannel::Message;
use kvconnect_tests::{fixture_model, metrics, side_channel, wait_until, Worker};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

const SECRET: &str = "deadline-suite-deployment-secret-0123456789";
/// The producer's io_timeout: the Read deadline is this plus the bytes at 100 MB/s.
const IO_TIMEOUT_S: u64 = 2;
/// Prompt tokens: 2048 of Qwen3-0.6B's KV is 234,881,024 bytes, so a Read of it all has a
/// 4.35 s deadline, far less than a slow reader needs to drain it.
const TOKENS: usize = 2048;

fn config(role: &str, extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","kv_connector_extra_config":{{"backend":"tcp","io_timeout":{IO_TIMEOUT_S},"kv_lease_duration":120{extra}}}}}"#
    )
}

fn worker(config: &str, id: &str, more: &[&str]) -> Worker {
    let model = fixture_model("Qwen--Qwen3-0.6B");
    let blocks = (TOKENS / 16 + 8).to_string();
    let mut args = vec![
        "--kv-transfer-config",
        config,
        "--model",
        model.to_str().unwrap(),
        "--engine-id",
        id,
        "--synthetic-kv",
        "--num-blocks",
        &blocks,
    ];
    args.extend_from_slice(more);
    Worker::start_with_env(&args, &[("KVCONNECT_SIDE_CHANNEL_TOKEN", SECRET)])
}

fn secret() -> Secret {
    Secret::from_text(SECRET, "test").unwrap()
}

fn timeouts(w: &Worker, listener: &str) -> f64 {
    let key = format!("kvconnect_data_plane_refused_total{{listener=\"{listener}\",reason=\"timeout\"}}");
    metrics(&w.http).get(&key).copied().unwrap_or(0.0)
}

/// The producer's handshake metadata, from a handshake proving the secret.
fn producer_metadata(side_channel: &str, consumer_config: &str) -> PeerInfo {
    let compat = side_channel::descriptor(consumer_config, &fixture_model("Qwen--Qwen3-0.6B"));
    let answer = side_channel::handshake(side_channel, &compat, Some(&secret()));
    let Some(Message::Welcome { metadata: Some(meta), .. }) = answer else { panic!("{answer:?}") };
    let meta: ProducerMetadata = serde_json::from_value(meta).expect("nixl's producer metadata");
    PeerInfo::from_metadata(meta).expect("valid metadata")
}

/// Every byte of the request's blocks, as (region, offset, len) runs, adjacent ones joined.
fn runs_of(peer: &PeerInfo, params: &Value) -> Vec<(u32, u64, u64)> {
    let mut runs: Vec<(u32, u64, u64)> = Vec::new();
    let groups = params["remote_block_ids"].as_array().expect("remote_block_ids");
    for (gi, ids) in groups.iter().enumerate() {
        for &layer in &peer.meta.groups[gi] {
            for part in 0..peer.geometry.shape().kv_parts {
                for b in ids.as_array().unwrap() {
                    let block = BlockId(b.as_u64().unwrap() as u32);
                    let s = peer.geometry.span(layer, part, block).expect("span");
                    let (region, off, len) = (s.region as u32, s.offset as u64, s.len as u64);
                    match runs.last_mut() {
                        Some(last) if last.0 == region && last.1 + last.2 == off => last.2 += len,
                        _ => runs.push((region, off, len)),
                    }
                }
            }
        }
    }
    runs
}

/// An authenticated connection to the producer that has asked for the whole request.
fn reading(producer: &str, p: &Value, runs: &[(u32, u64, u64)]) -> TcpStream {
    let mut c = TcpStream::connect(producer).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    authenticate_client(&mut c, Some(&secret()), 1 << 20).unwrap();
    let params = &p["kv_transfer_params"];
    let read = ClientMsg::Read {
        request: params["remote_request_id"].as_str().or(p["id"].as_str()).unwrap().to_owned(),
        capability: params["remote_capability"].as_str().unwrap().to_owned(),
        runs: runs.to_vec(),
    };
    write_frame(&mut c, &read).unwrap();
    c
}

/// Reads `c` to its end, `chunk` bytes every `gap`; the bytes read.
fn drain(c: &mut TcpStream, chunk: usize, gap: Duration) -> u64 {
    let mut buf = vec![0u8; chunk];
    let mut got = 0u64;
    loop {
        match c.read(&mut buf) {
            Ok(0) | Err(_) => return got,
            Ok(n) => got += n as u64,
        }
        std::thread::sleep(gap);
    }
}

#[test]
fn reads_taken_slowly_or_never_are_cut_at_their_deadline_and_counted() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let prefill = worker(
        &config("kv_producer", &format!(r#","port":{port}"#)),
        "prefill-deadline",
        &["--side-channel-timeout", "2"],
    );
    let decode = worker(
        &config("kv_consumer", ""),
        "decode-deadline",
        &["--kv-producers", "prefill-deadline@127.0.0.1"],
    );
    let producer = format!("127.0.0.1:{port}");
    let sc = prefill.side_channel.clone().expect("side channel");
    let prompt = json!(vec![0u32; TOKENS]);
    let (st, p) = prefill.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    );
    assert_eq!(st, 200, "{p}");
    let peer = producer_metadata(&sc, &config("kv_consumer", ""));
    let runs = runs_of(&peer, &p["kv_transfer_params"]);
    let total: u64 = runs.iter().map(|r| r.2).sum();
    assert!(total > 200_000_000, "{total} bytes: too few to outlast the deadline");
    let deadline = Duration::from_secs(IO_TIMEOUT_S) + Duration::from_secs_f64(total as f64 / 100e6);

    // A reader that drains 64 KiB every 50 ms (1.3 MB/s): no write waits long, the Read does.
    // It reads on after the cut what the socket buffers still hold, so the cut is timed by
    // the producer's count.
    let mut c = reading(&producer, &p, &runs);
    let t0 = Instant::now();
    let slow = std::thread::spawn(move || drain(&mut c, 64 << 10, Duration::from_millis(50)));
    assert!(wait_until(deadline + Duration::from_secs(10), || timeouts(&prefill, "producer") == 1.0));
    let took = t0.elapsed();
    assert!(
        took > Duration::from_secs(IO_TIMEOUT_S),
        "cut at {took:?}, before the Read's deadline {deadline:?}"
    );
    assert!(took < deadline + Duration::from_secs(3), "cut at {took:?}; the Read's deadline is {deadline:?}");
    let got = slow.join().unwrap();
    assert!(got < total / 4, "the slow reader got {got} of {total} bytes");

    // A reader that never reads: cut at the same deadline.
    let mut c = reading(&producer, &p, &runs);
    let t0 = Instant::now();
    assert!(wait_until(deadline + Duration::from_secs(10), || timeouts(&prefill, "producer") == 2.0));
    let took = t0.elapsed();
    assert!(took + Duration::from_millis(500) >= deadline, "cut at {took:?}, before {deadline:?}");
    let got = drain(&mut c, 1 << 20, Duration::ZERO);
    assert!(got < total / 4, "the idle reader got {got} of {total} bytes");
    assert!(prefill.log().contains("could not be sent whole in time"), "{}", prefill.log());

    // The side channel: hellos proving the secret, sent without ever reading the welcomes;
    // once the answers fill the socket, the write deadline (2 s) closes the connection.
    let compat = side_channel::descriptor(&config("kv_consumer", ""), &fixture_model("Qwen--Qwen3-0.6B"));
    let (mut c, nonce) = side_channel::challenged(&sc);
    let hello = side_channel::hello(&compat, "never-reads", Some((&nonce, Some(&secret()))));
    c.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    let t0 = Instant::now();
    let mut sent = 0u64;
    while c.write_all(&hello).is_ok() && t0.elapsed() < Duration::from_secs(60) {
        sent += 1;
    }
    assert!(t0.elapsed() < Duration::from_secs(60), "the side channel kept reading {sent} hellos");
    assert!(wait_until(Duration::from_secs(5), || timeouts(&prefill, "side_channel") == 1.0));
    let welcomed = prefill.get("/health").1["side_channel"]["welcomed"].as_u64().unwrap();
    assert!(welcomed > 1 && welcomed < sent, "{welcomed} welcomes of {sent} hellos");

    // Nothing was freed: the request is still held and decode loads all of it.
    assert_eq!(prefill.get("/health").1["pool"]["pending_frees"], 1);
    let (st, d) = decode.post(
        "/v1/completions",
        &json!({"request_id": p["id"], "prompt": prompt, "max_tokens": 1, "kv_transfer_params": p["kv_transfer_params"]}),
    );
    assert_eq!(st, 200, "{d}\n{}", decode.log());
    assert_eq!(d["kv_transfer_params"]["verified"], true, "{d}");
    assert_eq!(d["kvconnect"]["num_external_tokens"].as_u64(), Some(TOKENS as u64 - 1), "{d}");
}
