//! Decode side: the handshake with each prefill engine, made once per peer before any KV is
//! loaded from it, and what a request does when the peer is refused or unreachable.

use crate::server::engine_loop::EngineHandle;
use crate::sidechannel::{handshake, HandshakeOutcome};
use kvconnect_api::compat::{CompatDescriptor, FieldDiff};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::sync::Mutex;

/// Why KV cannot be loaded from a peer.
#[derive(Debug, Clone)]
pub struct PeerFailure {
    /// What kind of failure, for metrics: `peer_unreachable`, `wrong_engine` (the address
    /// serves another engine than the params name), `peer_rejected` (the connector refused
    /// the peer's metadata) or `handshake_refused` (incompatible KV caches).
    pub reason: &'static str,
    /// The whole reason.
    pub message: String,
    /// The field-level diff when the handshake was refused for incompatibility.
    pub diff: Vec<FieldDiff>,
}

#[derive(Debug, Clone)]
enum PeerState {
    Ready,
    Refused(PeerFailure),
}

/// The peers this worker has handshaken with, by engine id and address.
pub struct Peers {
    local: CompatDescriptor,
    engine_id: String,
    token: Option<String>,
    timeout: Duration,
    known: Mutex<HashMap<(String, String), PeerState>>,
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
                "kv_transfer_params remote_host {:?} is not an IP address; prefill returns its side-channel IP, forward it unchanged",
                h.chars().take(64).collect::<String>()
            )),
        },
        _ => Err("kv_transfer_params has do_remote_prefill but lacks a string remote_engine_id, a string remote_host or a remote_port in 1..65535; forward the params prefill returned unchanged".into()),
    }
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
    /// Peers of a worker with this descriptor and engine id.
    pub fn new(
        local: CompatDescriptor,
        engine_id: String,
        token: Option<String>,
        timeout: Duration,
    ) -> Peers {
        Peers { local, engine_id, token, timeout, known: Mutex::new(HashMap::new()) }
    }

    /// Makes sure KV may be loaded from `engine` at `addr`: handshakes on first use and
    /// hands the peer's metadata to the connector. A refusal is remembered (the peer's
    /// descriptor does not change while it runs); an unreachable peer is retried next time.
    pub async fn ensure(&self, engine: &str, addr: &str, handle: &EngineHandle) -> Result<(), PeerFailure> {
        let key = (engine.to_owned(), addr.to_owned());
        // Held across the handshake so concurrent requests to a new peer handshake once.
        let mut known = self.known.lock().await;
        match known.get(&key) {
            Some(PeerState::Ready) => return Ok(()),
            Some(PeerState::Refused(f)) => return Err(f.clone()),
            None => {}
        }
        let envelope = match peer_envelope(
            addr,
            engine,
            &self.local,
            &self.engine_id,
            self.token.as_deref(),
            self.timeout,
        )
        .await
        {
            Ok(envelope) => envelope,
            Err(f) => {
                if f.reason == "handshake_refused" {
                    tracing::warn!(peer = %engine, %addr, "handshake refused: {}", f.message);
                    known.insert(key, PeerState::Refused(f.clone()));
                }
                return Err(f);
            }
        };
        handle.set_peer(envelope).await.map_err(|e| PeerFailure {
            reason: "peer_rejected",
            message: format!("the connector rejected prefill engine '{engine}''s handshake metadata: {e}"),
            diff: Vec::new(),
        })?;
        tracing::info!(peer = %engine, %addr, "handshake accepted; KV may be loaded from this peer");
        known.insert(key, PeerState::Ready);
        Ok(())
    }
}

/// Handshakes with prefill engine `engine` at `addr` as a worker with descriptor `local` and
/// id `engine_id`, and returns the envelope its connector gets through
/// `set_peer_handshake_metadata` (ARCHITECTURE.md §6): `{"engine_id", "peer", "plan",
/// "peer_effective"}`. Any engine that loads KV from a kvconnect prefill does this once per
/// peer before loading: this worker and the vLLM adapter.
pub async fn peer_envelope(
    addr: &str,
    engine: &str,
    local: &CompatDescriptor,
    engine_id: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Result<Value, PeerFailure> {
    let outcome = handshake(addr, local, engine_id, token, timeout).await.map_err(|e| PeerFailure {
        reason: "peer_unreachable",
        message: format!("cannot handshake with prefill engine '{engine}' at {addr}: {e}"),
        diff: Vec::new(),
    })?;
    match outcome {
        HandshakeOutcome::Welcome { compat, engine_id, metadata, plan } => {
            if engine_id != engine {
                return Err(PeerFailure {
                    reason: "wrong_engine",
                    message: format!(
                        "the side channel at {addr} belongs to engine '{engine_id}', not '{engine}' named in kv_transfer_params; no KV was loaded"
                    ),
                    diff: Vec::new(),
                });
            }
            Ok(json!({
                "engine_id": engine,
                "peer": metadata.unwrap_or(Value::Null),
                "plan": plan,
                "peer_effective": compat.effective,
            }))
        }
        HandshakeOutcome::Refused { diff, message } => {
            Err(PeerFailure { reason: "handshake_refused", message, diff })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_peer_reads_prefill_params() {
        let p: Map<String, Value> = serde_json::from_value(json!({
            "do_remote_prefill": true, "remote_engine_id": "p0", "remote_host": "127.0.0.1", "remote_port": 5000,
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
