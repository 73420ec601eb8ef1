//! Decode side: the prefill engines this worker may handshake with and what it remembers of
//! each, as kvconnect's own decode workers do (`kvconnect_server::peers`): the same
//! allow-list (`Producers`: `kv_producers`, loopback only when unset), failure reasons and
//! refusal memory ([`REFUSAL_MEMORY`]), over one lock per peer
//! ([`kvconnect_support::peer_slots`]). A peer outside the allow-list is refused before anything
//! is contacted; a peer a load failed from is forgotten, so the next request handshakes again.

use crate::meta::Peer;
use kvconnect_server::peers::{PeerFailure, REFUSAL_MEMORY};
use kvconnect_server::producers::Producers;
use kvconnect_support::peer_slots::PeerSlots;

/// The allow-list and every peer's state.
pub struct PeerGate {
    allowed: Producers,
    slots: PeerSlots<Peer, PeerFailure>,
}

impl PeerGate {
    /// A gate over `allowed` (empty: producers on this host only).
    pub fn new(allowed: Producers) -> PeerGate {
        PeerGate { allowed, slots: PeerSlots::new(REFUSAL_MEMORY) }
    }

    /// Makes sure KV may be loaded from `peer`: the allow-list first, then the remembered
    /// answer, else `handshake`. Refusals that say something about the peer are remembered;
    /// an unreachable peer is asked again next time.
    pub fn ensure(
        &self,
        peer: &Peer,
        handshake: impl FnOnce() -> Result<(), PeerFailure>,
    ) -> Result<(), PeerFailure> {
        if let Err(message) = self.allowed.check(&peer.engine_id, &peer.addr) {
            // The host's wording names its flag; inside vLLM the list is the adapter's key.
            let message = message.replace("--kv-producers", "kv_producers");
            return Err(PeerFailure { reason: "producer_not_allowed", message, diff: Vec::new() });
        }
        self.slots.ensure(peer, handshake, |f| {
            matches!(f.reason, "handshake_refused" | "unauthenticated" | "wrong_engine" | "peer_rejected")
        })
    }

    /// Forgets `peer` (a load from it failed).
    pub fn forget(&self, peer: &Peer) {
        self.slots.forget(peer);
    }
}
