//! The KV router's subscriber: one task per prefill server following its KV event
//! publisher as vLLM's subscribers do (`kvconnect-events`' `ZmqEventPublisher`, or vLLM's
//! own `--kv-events-config` publisher): a SUB socket on the server's endpoint taking
//! `(topic, seq, payload)` messages, and, where the server has a replay endpoint, a DEALER
//! socket asking it for the batches from a seq (`["", seq as 8 bytes big-endian]`) and
//! reading `("", topic, seq, payload)` answers up to the end marker. Each batch is decoded
//! (`kvconnect_events::decode_batch`) and handed to the router, which says when to ask for a
//! replay; a message that cannot be read is dropped and counted as malformed.

use super::routing::KvRouter;
use kvconnect_events::{decode_batch, END_SEQ};
use kvconnect_router::Outcome;
use std::sync::Arc;
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Where one prefill server publishes its KV events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSource {
    /// The server's name in the router (its engine id).
    pub name: String,
    /// Its PUB endpoint, `tcp://HOST:PORT`.
    pub endpoint: String,
    /// Its replay endpoint, if it has one.
    pub replay: Option<String>,
}

/// A replay answer read whole, or why it stopped.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// Follows `source` until the task is dropped: connects (and reconnects, every second, while
/// the server is unreachable) and applies every batch to `router`.
pub async fn follow(router: Arc<KvRouter>, source: EventSource) {
    let mut sub = zeromq::SubSocket::new();
    loop {
        match sub.connect(&source.endpoint).await {
            Ok(()) => break,
            Err(e) => {
                tracing::debug!(
                    worker = %source.name,
                    "KV events: cannot connect to {}: {e}; retrying", source.endpoint
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    if let Err(e) = sub.subscribe("").await {
        tracing::warn!(worker = %source.name, "KV events: cannot subscribe to {}: {e}", source.endpoint);
        return;
    }
    let mut dealer: Option<zeromq::DealerSocket> = None;
    loop {
        let msg = match sub.recv().await {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::debug!(worker = %source.name, "KV events: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some((seq, payload)) = numbered(&msg, 1) else {
            router.reject(&source.name);
            continue;
        };
        let Some(from) = apply(&router, &source.name, seq, payload, false) else { continue };
        let Some(replay) = &source.replay else {
            tracing::warn!(worker = %source.name, "KV events: batches from {from} missed and the server has \
                no replay endpoint");
            continue;
        };
        if dealer.is_none() {
            let mut d = zeromq::DealerSocket::new();
            match d.connect(replay).await {
                Ok(()) => dealer = Some(d),
                Err(e) => {
                    tracing::warn!(worker = %source.name, "KV events: cannot reach the replay endpoint \
                        {replay}: {e}");
                    continue;
                }
            }
        }
        if let Some(d) = dealer.as_mut() {
            if let Err(e) = replay_from(&router, &source.name, d, from).await {
                tracing::warn!(worker = %source.name, "KV events: the replay from {from} failed: {e}");
                dealer = None;
            }
        }
    }
}

/// The seq and payload of a message whose seq frame is at `at`, payload right after it.
fn numbered(msg: &[axum::body::Bytes], at: usize) -> Option<(i64, &[u8])> {
    let seq = i64::from_be_bytes(msg.get(at)?.as_ref().try_into().ok()?);
    Some((seq, msg.get(at + 1)?.as_ref()))
}

/// Decodes and applies one batch; returns the seq to replay from when the router asks.
fn apply(router: &KvRouter, name: &str, seq: i64, payload: &[u8], replay: bool) -> Option<u64> {
    let (Ok(seq), Ok(batch)) = (u64::try_from(seq), decode_batch(payload)) else {
        router.reject(name);
        return None;
    };
    match router.apply(name, seq, &batch, replay) {
        Outcome::Replay { from } => Some(from),
        _ => None,
    }
}

/// Asks for the batches from `from` and applies each up to the end marker.
async fn replay_from(
    router: &KvRouter,
    name: &str,
    d: &mut zeromq::DealerSocket,
    from: u64,
) -> Result<(), String> {
    let mut ask = ZmqMessage::from(Vec::<u8>::new());
    ask.push_back(from.to_be_bytes().to_vec().into());
    d.send(ask).await.map_err(|e| e.to_string())?;
    loop {
        let m = tokio::time::timeout(REPLAY_TIMEOUT, d.recv())
            .await
            .map_err(|_| format!("no answer in {}s", REPLAY_TIMEOUT.as_secs()))?
            .map_err(|e| e.to_string())?
            .into_vec();
        if m.get(2).is_some_and(|s| s.as_ref() == END_SEQ) {
            return Ok(());
        }
        // ("", topic, seq, payload)
        match numbered(&m, 2) {
            Some((seq, payload)) => {
                apply(router, name, seq, payload, true);
            }
            None => router.reject(name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::Backends;
    use crate::metrics::ProxyMetrics;
    use kvconnect_api::{KvEvent, KvEventBatch, Medium, Role};
    use kvconnect_engine::prefix_cache::block_hashes;
    use kvconnect_events::{PublisherConfig, ZmqEventPublisher};

    const BS: u32 = 4;

    fn stored(prompt: &[u32]) -> KvEventBatch {
        let hashes = block_hashes(prompt, BS as usize);
        let tokens = prompt[..hashes.len() * BS as usize].to_vec();
        KvEventBatch {
            ts: 0.0,
            events: vec![KvEvent::stored(hashes, None, tokens, BS, Medium::Gpu)],
            data_parallel_rank: None,
        }
    }

    fn prompt(i: u32) -> Vec<u32> {
        (0..9).map(|t| i * 100 + t).collect()
    }

    /// A server's publisher over real sockets: the batches it published before the router
    /// subscribed come from its replay socket, so the index holds every prompt, and the
    /// router sends each prompt to that server.
    #[tokio::test]
    async fn a_late_subscriber_rebuilds_the_index_from_the_replay_and_routes_by_it() {
        let mut cfg = PublisherConfig::new("tcp://127.0.0.1:0");
        cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
        let publisher = ZmqEventPublisher::start(&cfg).unwrap();
        // Published before anyone subscribed: only the replay has them.
        for i in 0..3 {
            publisher.publish(&stored(&prompt(i))).unwrap();
        }
        let backends = Backends::new([
            (Role::Prefill, "p0".into(), "127.0.0.1:1".into()),
            (Role::Prefill, "p1".into(), "127.0.0.1:2".into()),
        ]);
        let metrics = ProxyMetrics::default();
        let kv = Arc::new(KvRouter::new(vec!["p0".into(), "p1".into()], BS, metrics.router.clone()).unwrap());
        let source = EventSource {
            name: "p1".into(),
            endpoint: publisher.endpoint().replace("0.0.0.0", "127.0.0.1"),
            replay: publisher.replay_endpoint().map(|e| e.replace("0.0.0.0", "127.0.0.1")),
        };
        let task = tokio::spawn(follow(kv.clone(), source));
        // A PUB drops what it sends before the subscription lands: publish until the router
        // has every prompt, the first three included.
        let mut i = 3;
        let t0 = std::time::Instant::now();
        loop {
            publisher.publish(&stored(&prompt(i))).unwrap();
            i += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
            let held = (0..i).all(|j| {
                kv.pick(&backends, Some(&prompt(j)), &[]).unwrap().prediction.is_some_and(|p| p.tokens == 8)
            });
            if held {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "the index never held every prompt");
        }
        for j in 0..i {
            assert_eq!(kv.pick(&backends, Some(&prompt(j)), &[]).unwrap().http, "127.0.0.1:2", "prompt {j}");
        }
        let t = metrics.render();
        assert!(t.contains("kvconnect_router_replays_requested_total 1\n"), "{t}");
        task.abort();
    }
}
