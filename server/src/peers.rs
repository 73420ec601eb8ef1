//! Decode side: the handshake with each prefill engine, made once per peer before any KV is
//! loaded from it, and what a request does when the peer is not allowed, refused or
//! unreachable.
//!
//! A peer is only contacted when the allow-list names it ([`Producers`]). Each peer has its
//! own lock, so a slow handshake stalls only requests for that peer. A refusal is remembered
//! for [`REFUSAL_MEMORY`], an acceptance until a transfer from the peer fails ([`Peers::forget`])
//! or a request names another process at the peer's address (its `remote_instance`: the peer
//! restarted), which is handshaken again before anything is loaded from it.

use crate::engine_loop::EngineHandle;
use crate::producers::Producers;
use crate::sidechannel::{handshake, HandshakeOutcome};
use kvconnect_api::compat::{CompatDescriptor, FieldDiff};
use kvconnect_dataplane::auth::Secret;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

/// How long a refused handshake is answered from memory before the peer is asked again.
pub const REFUSAL_MEMORY: Duration = Duration::from_secs(30);

/// Why KV cannot be loaded from a peer.
#[derive(Debug, Clone)]
pub struct PeerFailure {
    /// What kind of failure, for metrics: `producer_not_allowed` (the params name a producer
    /// outside the allow-list; nothing was contacted), `peer_unreachable`, `wrong_engine` (the
    /// address serves another engine than the params name), `peer_rejected` (the connector
    /// refused the peer's metadata), `unauthenticated` (one side lacks the deployment's
    /// secret) or `handshake_refused` (incompatible KV caches).
    pub reason: &'static str,
    /// The whole reason.
    pub message: String,
    /// The field-level diff when the handshake was refused for incompatibility.
    pub diff: Vec<FieldDiff>,
}

#[derive(Debug, Clone)]
enum PeerState {
    /// Handshaken with the process of this id (`None`: a peer that sends none).
    Ready(Option<String>),
    Refused(PeerFailure, Instant),
}

type Slot = Arc<Mutex<Option<PeerState>>>;

/// The peers this server has handshaken with, by engine id and address.
pub struct Peers {
    local: CompatDescriptor,
    engine_id: String,
    secret: Option<Secret>,
    timeout: Duration,
    allowed: Producers,
    known: std::sync::Mutex<HashMap<(String, String), Slot>>,
}

/// The peer a request's `kv_transfer_params` point at, if it asks to load remote KV.
pub fn remote_peer(params: &Map<String, Value>) -> Result<Option<(String, String)>, String> {
    if params.get("do_remote_prefill").and_then(Value::as_bool) != Some(true) {
        return Ok(None);
    }
    let engine = params.get("remote_engine_id").and_then(Value::as_str);
    let host = params.get("remote_host").and_then(Value::as_str);
    let port = params.get("remote_port").and_then(Value::as_u64);
    match (engine, host, port) {
        // A client wrote these params: only an IP literal, so no name from it is resolved.
        (Some(e), Some(h), Some(p)) if p > 0 && p <= u16::MAX as u64 => match h.parse::<IpAddr>() {
            Ok(ip) => Ok(Some((e.to_owned(), SocketAddr::new(ip, p as u16).to_string()))),
            Err(_) => Err(format!(
                "kv_transfer_params remote_host {:?} is not an IP address; prefill returns its side-channel \
                    IP, forward it unchanged",
                h.chars().take(64).collect::<String>()
            )),
        },
        _ => Err("kv_transfer_params has do_remote_prefill but lacks a string remote_engine_id, a string \
            remote_host or a remote_port in 1..65535; forward the params prefill returned unchanged"
            .into()),
    }
}

/// The prefill process a request's params were made by (`remote_instance`), when they say.
pub fn remote_instance(params: &Map<String, Value>) -> Option<&str> {
    params.get("remote_instance").and_then(Value::as_str)
}

/// The params with the remote-prefill keys removed: the request is then computed locally.
pub fn strip_remote(params: &Map<String, Value>) -> Map<String, Value> {
    params
        .iter()
        .filter(|(k, _)| !(k.starts_with("remote_") || *k == "do_remote_prefill"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

impl Peers {
    /// Peers of a server with this descriptor and engine id.
    pub fn new(
        local: CompatDescriptor,
        engine_id: String,
        secret: Option<Secret>,
        timeout: Duration,
        allowed: Producers,
    ) -> Peers {
        Peers { local, engine_id, secret, timeout, allowed, known: std::sync::Mutex::new(HashMap::new()) }
    }

    fn slot(&self, key: &(String, String)) -> Slot {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.entry(key.clone()).or_default().clone()
    }

    /// Forgets the handshake with `engine` at `addr` (a transfer from it failed, so it may
    /// have restarted): the next request handshakes again.
    pub async fn forget(&self, engine: &str, addr: &str) {
        let slot = self.slot(&(engine.to_owned(), addr.to_owned()));
        *slot.lock().await = None;
    }

    /// Makes sure KV may be loaded from `engine` at `addr`, the process `instance` when the
    /// request says which: checks the allow-list, handshakes on first use (and again when the
    /// request names another process than the one handshaken) and hands the peer's metadata
    /// to the connector. A refusal is remembered for a while (the peer's descriptor does not
    /// change while it runs); an unreachable peer is retried next time.
    pub async fn ensure(
        &self,
        engine: &str,
        addr: &str,
        instance: Option<&str>,
        handle: &EngineHandle,
    ) -> Result<(), PeerFailure> {
        if let Err(message) = self.allowed.check(engine, addr) {
            return Err(PeerFailure { reason: "producer_not_allowed", message, diff: Vec::new() });
        }
        let key = (engine.to_owned(), addr.to_owned());
        let slot = self.slot(&key);
        // Held across the handshake so concurrent requests to a new peer handshake once;
        // requests for other peers do not wait on it.
        let mut known = slot.lock().await;
        match &*known {
            Some(PeerState::Ready(seen)) if instance.is_none() || seen.as_deref() == instance => {
                return Ok(())
            }
            Some(PeerState::Ready(seen)) => {
                tracing::info!(peer = %engine, %addr, was = ?seen, now = ?instance, "prefill engine \
                    restarted at the same address; handshaking again");
            }
            Some(PeerState::Refused(f, at)) if at.elapsed() < REFUSAL_MEMORY => return Err(f.clone()),
            _ => {}
        }
        let outcome =
            peer_envelope(addr, engine, &self.local, &self.engine_id, self.secret.as_ref(), self.timeout)
                .await;
        let envelope = match outcome {
            Ok(envelope) => envelope,
            Err(f) => {
                if matches!(f.reason, "handshake_refused" | "unauthenticated") {
                    tracing::warn!(peer = %engine, %addr, "handshake refused: {}", f.message);
                    *known = Some(PeerState::Refused(f.clone(), Instant::now()));
                }
                return Err(f);
            }
        };
        let seen = envelope.get("instance").and_then(Value::as_str).map(str::to_owned);
        handle.set_peer(envelope).await.map_err(|e| PeerFailure {
            reason: "peer_rejected",
            message: format!("the connector rejected prefill engine '{engine}''s handshake metadata: {e}"),
            diff: Vec::new(),
        })?;
        tracing::info!(peer = %engine, %addr, "handshake accepted; KV may be loaded from this peer");
        *known = Some(PeerState::Ready(seen));
        Ok(())
    }
}

/// Handshakes with prefill engine `engine` at `addr` as a server with descriptor `local` and
/// id `engine_id`, proving `secret`, and returns the envelope its connector gets through
/// `set_peer_handshake_metadata` (ARCHITECTURE.md §6): `{"engine_id", "side_channel", "peer",
/// "plan", "peer_effective", "instance"}`. Any engine that loads KV from a kvconnect prefill does this once
/// per peer before loading: this server and the vLLM adapter.
pub async fn peer_envelope(
    addr: &str,
    engine: &str,
    local: &CompatDescriptor,
    engine_id: &str,
    secret: Option<&Secret>,
    timeout: Duration,
) -> Result<Value, PeerFailure> {
    let outcome = handshake(addr, local, engine_id, secret, timeout).await.map_err(|e| PeerFailure {
        reason: "peer_unreachable",
        message: format!("cannot handshake with prefill engine '{engine}' at {addr}: {e}"),
        diff: Vec::new(),
    })?;
    match outcome {
        HandshakeOutcome::Welcome { compat, engine_id, metadata, plan, instance } => {
            if engine_id != engine {
                return Err(PeerFailure {
                    reason: "wrong_engine",
                    message: format!(
                        "the side channel at {addr} belongs to engine '{engine_id}', not '{engine}' named in \
                            kv_transfer_params; no KV was loaded"
                    ),
                    diff: Vec::new(),
                });
            }
            Ok(json!({
                "engine_id": engine,
                "side_channel": addr,
                "peer": metadata.unwrap_or(Value::Null),
                "plan": plan,
                "peer_effective": compat.effective,
                "instance": instance,
            }))
        }
        HandshakeOutcome::Refused { diff, message } => {
            let reason = if message.starts_with(crate::sidechannel::UNAUTHENTICATED) {
                "unauthenticated"
            } else {
                "handshake_refused"
            };
            Err(PeerFailure { reason, message, diff })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_peer_reads_prefill_params() {
        let p: Map<String, Value> = serde_json::from_value(json!({
            "do_remote_prefill": true, "remote_engine_id": "p0", "remote_host": "127.0.0.1",
            "remote_port": 5000,
            "remote_block_ids": [[1]], "remote_num_tokens": 3
        }))
        .unwrap();
        assert_eq!(remote_peer(&p).unwrap(), Some(("p0".into(), "127.0.0.1:5000".into())));
        let stripped = strip_remote(&p);
        assert!(stripped.is_empty(), "{stripped:?}");
        assert_eq!(remote_peer(&Map::new()).unwrap(), None);
        let bad: Map<String, Value> =
            serde_json::from_value(json!({"do_remote_prefill": true, "remote_port": 0})).unwrap();
        assert!(remote_peer(&bad).unwrap_err().contains("remote_engine_id"));
    }
    #[test]
    fn remote_peer_takes_ip_literals_only() {
        let with_host = |h: &str| -> Map<String, Value> {
            serde_json::from_value(json!({
                "do_remote_prefill": true, "remote_engine_id": "p0", "remote_host": h, "remote_port": 5000
            }))
            .unwrap()
        };
        assert_eq!(remote_peer(&with_host("::1")).unwrap(), Some(("p0".into(), "[::1]:5000".into())));
        for h in ["localhost", "evil.example", "127.0.0.1:22", "[::1]"] {
            let e = remote_peer(&with_host(h)).unwrap_err();
            assert!(e.contains("not an IP address"), "{h}: {e}");
        }
    }
}
