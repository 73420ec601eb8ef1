//! `kvconnect worker --kv-events-endpoint`: a subscriber on the worker's PUB socket sees the
//! prefix cache's blocks (medium `CPU`) and lmcache's chunks (`cpu_tier`) stored, with their
//! tokens, as msgpack `KVEventBatch`es numbered from 0; the replay socket sends them again.

use kvconnect_api::{KvEvent, Medium};
use kvconnect_events::decode_batch;
use kvconnect_tests::{reference_model, Worker};
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const CHUNK: usize = 16;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A worker with lmcache (chunks of [`CHUNK`] tokens, a CPU tier of `budget_gib`) publishing
/// its cache events on `tcp://*:port`.
fn lmcache_worker(budget_gib: f64, engine_id: &str, port: u16, more: &[&str]) -> Worker {
    let cfg = format!(
        r#"{{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_producer","kv_connector_extra_config":{{"chunk_size":{CHUNK},"max_local_cpu_size":{budget_gib}}}}}"#
    );
    let model = reference_model();
    let publish = format!("tcp://*:{port}");
    let mut args =
        vec!["--kv-transfer-config", &cfg, "--model", model.to_str().unwrap(), "--engine-id", engine_id];
    args.extend(["--kv-events-endpoint", &publish]);
    args.extend(more);
    Worker::start(&args)
}

fn seq_of(frame: &[u8]) -> i64 {
    i64::from_be_bytes(frame.try_into().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_publishes_its_cache_events_and_replays_them() {
    let (port, replay_port) = (free_port(), free_port());
    let (pub_ep, replay_ep) = (format!("tcp://127.0.0.1:{port}"), format!("tcp://127.0.0.1:{replay_port}"));
    let w = lmcache_worker(
        0.05,
        "events-worker",
        port,
        &["--enable-prefix-caching", "--kv-events-replay-endpoint", &replay_ep, "--kv-events-topic", "kv"],
    );
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&pub_ep).await.unwrap();
    sub.subscribe("kv").await.unwrap();
    // The subscription must reach the worker before its first batch: a PUB drops what no one
    // is subscribed to yet.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let prompt: Vec<u32> = (0..3 * CHUNK as u32 + 5).map(|i| (i * 31 + 7) % 256).collect();
    let (st, r) = w.post("/v1/completions", &serde_json::json!({"prompt": prompt, "max_tokens": 2}));
    assert_eq!(st, 200, "{r}\n{}", w.log());

    let mut seen: Vec<(i64, KvEvent)> = Vec::new();
    let want_chunks = 3;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while seen.iter().filter(|(_, e)| e.medium() == Some(&Medium::CpuTier)).count() < want_chunks {
        let m = tokio::time::timeout_at(deadline, sub.recv())
            .await
            .unwrap_or_else(|_| panic!("events seen: {seen:?}\n{}", w.log()))
            .unwrap()
            .into_vec();
        assert_eq!(&m[0][..], b"kv");
        let seq = seq_of(&m[1]);
        let batch = decode_batch(&m[2]).unwrap();
        seen.extend(batch.events.into_iter().map(|e| (seq, e)));
    }
    let chunks = stored(&seen, Medium::CpuTier);
    assert_eq!(chunks.len(), want_chunks, "{seen:?}");
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.token_ids, prompt[i * CHUNK..(i + 1) * CHUNK], "chunk {i}'s tokens");
        assert_eq!(
            c.parent_block_hash,
            i.checked_sub(1).map(|p| chunks[p].block_hashes[0]),
            "chunk {i}'s parent"
        );
    }
    // The prefix cache publishes too once its blocks are cached (the request has finished).
    let (st, r) = w.post("/v1/completions", &serde_json::json!({"prompt": [1, 2, 3], "max_tokens": 1}));
    assert_eq!(st, 200, "{r}");
    while stored(&seen, Medium::Cpu).is_empty() {
        let m = tokio::time::timeout_at(deadline, sub.recv())
            .await
            .unwrap_or_else(|_| panic!("no CPU prefix-cache event; seen: {seen:?}\n{}", w.log()))
            .unwrap()
            .into_vec();
        seen.extend(decode_batch(&m[2]).unwrap().events.into_iter().map(|e| (seq_of(&m[1]), e)));
    }
    let engine_blocks = stored(&seen, Medium::Cpu);
    assert!(engine_blocks.iter().all(|b| b.token_ids.len() == b.block_size as usize * b.block_hashes.len()));
    assert!(seen.first().is_some_and(|(s, _)| *s == 0), "the first batch is seq 0");

    // A subscriber that missed them asks the replay socket from seq 0.
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&replay_ep).await.unwrap();
    let mut ask = ZmqMessage::from(Vec::<u8>::new());
    ask.push_back(0u64.to_be_bytes().to_vec().into());
    dealer.send(ask).await.unwrap();
    let mut replayed = Vec::new();
    loop {
        let m = dealer.recv().await.unwrap().into_vec();
        if m[2][..] == kvconnect_events::END_SEQ {
            break;
        }
        replayed.extend(decode_batch(&m[3]).unwrap().events.into_iter().map(|e| (seq_of(&m[2]), e)));
    }
    assert!(
        replayed.len() >= seen.len() && replayed[..seen.len()] == seen[..],
        "the replay is the live stream"
    );
}

fn stored(seen: &[(i64, KvEvent)], medium: Medium) -> Vec<kvconnect_api::BlockStored> {
    seen.iter()
        .filter_map(|(_, e)| match e {
            KvEvent::BlockStored(s) if s.medium == medium => Some(s.clone()),
            _ => None,
        })
        .collect()
}

/// A CPU tier too small for the workload: `/metrics` shows it full (bytes held against its
/// budget) and counts each chunk it let go of, as many as the removals the worker published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_cpu_tier_shows_in_metrics_as_its_events_say() {
    // The reference model's KV is 512 bytes a token: a chunk of 16 tokens is 8 KiB, and the
    // budget holds 3 of them.
    let chunk_bytes = 512 * CHUNK as u64;
    let budget_gib = (3 * chunk_bytes) as f64 / (1u64 << 30) as f64;
    let port = free_port();
    let w = lmcache_worker(budget_gib, "events-full-tier", port, &[]);
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
    sub.subscribe("").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Three prompts of three chunks each: nine chunks through a tier of three.
    for p in 0..3u32 {
        let prompt: Vec<u32> = (0..3 * CHUNK as u32 + 1).map(|i| (i * 29 + p * 101 + 3) % 256).collect();
        let (st, r) = w.post("/v1/completions", &serde_json::json!({"prompt": prompt, "max_tokens": 1}));
        assert_eq!(st, 200, "{r}\n{}", w.log());
    }
    let (mut stored_n, mut removed_n) = (0u64, 0u64);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while stored_n < 9 || removed_n < 6 {
        let m = tokio::time::timeout_at(deadline, sub.recv())
            .await
            .unwrap_or_else(|_| panic!("{stored_n} chunks stored, {removed_n} removed\n{}", w.log()))
            .unwrap()
            .into_vec();
        for e in decode_batch(&m[2]).unwrap().events {
            match e {
                KvEvent::BlockStored(s) if s.medium == Medium::CpuTier => {
                    stored_n += s.block_hashes.len() as u64
                }
                KvEvent::BlockRemoved(r) if r.medium == Medium::CpuTier => {
                    removed_n += r.block_hashes.len() as u64
                }
                _ => {}
            }
        }
    }
    let m = kvconnect_tests::metrics(&w.http);
    let get = |k: &str| m.get(&format!(r#"{k}{{connector="lmcache",tier="cpu"}}"#)).copied();
    assert_eq!((stored_n, removed_n), (9, 6), "{m:?}");
    assert_eq!(get("kvconnect_cache_evictions_total"), Some(removed_n as f64), "{m:?}");
    assert_eq!(get("kvconnect_cache_capacity_bytes"), Some((3 * chunk_bytes) as f64), "{m:?}");
    assert_eq!(
        get("kvconnect_cache_used_bytes"),
        Some(((stored_n - removed_n) * chunk_bytes) as f64),
        "{m:?}"
    );
    // No disk tier configured: none shown.
    assert!(
        !m.keys().any(|k| k.contains(r#"tier="disk""#) && k.starts_with("kvconnect_cache_used")),
        "{m:?}"
    );
}
