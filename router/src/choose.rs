//! The choice of a prefill worker: the one with the lowest estimated cost, where
//!
//! ```text
//! cost(w) = (B - H(w)) + LOAD * in_flight(w)
//! H(w)    = sum over the request's leading blocks w holds of weight(fastest medium w holds it in)
//! ```
//!
//! `B` is the request's full blocks, `in_flight(w)` the requests the proxy has sent `w` that
//! have not returned, and `LOAD` ([`Weights::load_blocks`]) how many blocks of computing one
//! request in flight is worth. A block on the GPU saves its whole computation (weight 1); one
//! further away saves less, since it has to be brought back first ([`TIER_WEIGHTS`], by
//! `Medium::rank`). Ties go
//! to the first worker in a rotating order, so requests nobody holds spread round-robin.
//!
//! Without events to go by (no worker's stream is live: no events yet, or the subscriber
//! cannot reach them) the choice falls back to round-robin and says why.

use crate::event::RANKS;
use crate::index::{Overlap, WorkerId};
use crate::indexer::Indexer;

/// Weight of a block by the rank of the fastest medium holding it (`Medium::rank`): the
/// engine's own cache (`GPU`, `CPU`) 1, a cache connector's CPU tier 0.75, disk 0.5, remote
/// (and any medium kvconnect does not name) 0.25.
pub const TIER_WEIGHTS: [f64; RANKS] = [1.0, 0.75, 0.5, 0.25];

/// Blocks of computation one request in flight is worth, by default.
pub const LOAD_BLOCKS: f64 = 4.0;

/// The formula's weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    /// Per rank of medium, what a block held there is worth (1: its whole computation).
    pub tier: [f64; RANKS],
    /// Blocks one request in flight is worth.
    pub load_blocks: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights { tier: TIER_WEIGHTS, load_blocks: LOAD_BLOCKS }
    }
}

impl Weights {
    /// `H(w)`: what a worker's overlap saves, in blocks.
    pub fn saved(&self, o: &Overlap) -> f64 {
        o.by_rank.iter().zip(self.tier).map(|(n, w)| f64::from(*n) * w).sum()
    }
}

/// A worker the request may go to (one that is up), with its requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The worker.
    pub worker: WorkerId,
    /// Requests the proxy sent it that have not returned.
    pub in_flight: u32,
}

/// Why a choice was round-robin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// No worker's event stream is live.
    NoEvents,
}

impl Fallback {
    /// The metric label and log word.
    pub fn label(self) -> &'static str {
        match self {
            Fallback::NoEvents => "no_events",
        }
    }
}

/// The worker chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// The worker.
    pub worker: WorkerId,
    /// Leading blocks the index says it holds (0 for a round-robin choice).
    pub predicted_blocks: u32,
    /// Its cost (`B - H + LOAD * in_flight`); None for a round-robin choice.
    pub cost: Option<f64>,
    /// Why the choice was round-robin; None for a choice by the index.
    pub fallback: Option<Fallback>,
}

/// Chooses among `candidates` (none: None) for a request whose block hashes are `chain`.
/// `turn` is a counter the caller advances on every call: where round-robin and ties start.
/// `scratch` is reused between calls (one entry per indexed worker).
pub fn choose(
    indexer: &Indexer,
    weights: &Weights,
    chain: &[u64],
    candidates: &[Candidate],
    turn: usize,
    scratch: &mut Vec<Overlap>,
) -> Option<Choice> {
    if candidates.is_empty() {
        return None;
    }
    let start = turn % candidates.len();
    let rotated = candidates[start..].iter().chain(&candidates[..start]);
    if !indexer.any_live() {
        let worker = candidates[start].worker;
        return Some(Choice { worker, predicted_blocks: 0, cost: None, fallback: Some(Fallback::NoEvents) });
    }
    indexer.overlaps(chain, scratch);
    let blocks = chain.len() as f64;
    let mut best: Option<Choice> = None;
    for c in rotated {
        let o = scratch.get(usize::from(c.worker)).copied().unwrap_or_default();
        let cost = blocks - weights.saved(&o) + weights.load_blocks * f64::from(c.in_flight);
        if best.is_none_or(|b| b.cost.is_some_and(|bc| cost < bc)) {
            best = Some(Choice {
                worker: c.worker,
                predicted_blocks: o.blocks,
                cost: Some(cost),
                fallback: None,
            });
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{KvEvent, KvEventBatch, Medium};

    /// The request's tokens: 4 blocks of 4.
    const PROMPT: [u32; 16] = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20];

    /// The store of PROMPT's first `n` blocks (each named by a hash of the worker's own).
    fn store(ix: &mut Indexer, worker: WorkerId, seq: u64, n: usize, medium: Medium) {
        let hashes = (0..n as u64).map(|i| 100 * u64::from(worker) + i).collect();
        let events = vec![KvEvent::stored(hashes, None, PROMPT[..4 * n].to_vec(), 4, medium)];
        let b = KvEventBatch { ts: 0.0, events, data_parallel_rank: None };
        assert_eq!(ix.apply(worker, seq, &b, false), crate::indexer::Outcome::Applied);
    }

    fn idle(workers: &[WorkerId]) -> Vec<Candidate> {
        workers.iter().map(|&worker| Candidate { worker, in_flight: 0 }).collect()
    }

    /// A scripted sequence: which worker each request goes to as the caches and loads change.
    #[test]
    fn a_scripted_sequence_goes_where_the_prefix_is_unless_that_worker_is_busy() {
        let w = Weights::default();
        let mut ix = Indexer::new(3, 4).unwrap();
        let mut s = Vec::new();
        let req = crate::chain::prefix_hashes(&PROMPT, 4);
        let other = crate::chain::prefix_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let all = idle(&[0, 1, 2]);
        // 1. No events yet: round-robin, said so.
        let c = choose(&ix, &w, &req, &all, 0, &mut s).unwrap();
        assert_eq!((c.worker, c.fallback), (0, Some(Fallback::NoEvents)));
        assert_eq!(choose(&ix, &w, &req, &all, 1, &mut s).unwrap().worker, 1);
        // 2. Worker 1 stored the prompt's first 3 blocks on the GPU: it gets the request
        //    whatever the turn.
        store(&mut ix, 1, 0, 3, Medium::Gpu);
        for turn in 0..3 {
            let c = choose(&ix, &w, &req, &all, turn, &mut s).unwrap();
            assert_eq!((c.worker, c.predicted_blocks, c.fallback), (1, 3, None), "turn {turn}");
            assert_eq!(c.cost, Some(1.0));
        }
        // 3. Worker 2 holds the whole prompt, but on disk: 4 - 4 * 0.5 = 2 > worker 1's 1.
        store(&mut ix, 2, 0, 4, Medium::Disk);
        assert_eq!(choose(&ix, &w, &req, &all, 0, &mut s).unwrap().worker, 1);
        // 4. Worker 1 has a request in flight: 1 + 4 = 5 > worker 2's 2.
        let busy = vec![
            Candidate { worker: 0, in_flight: 0 },
            Candidate { worker: 1, in_flight: 1 },
            Candidate { worker: 2, in_flight: 0 },
        ];
        assert_eq!(choose(&ix, &w, &req, &busy, 0, &mut s).unwrap().worker, 2);
        // 5. A prompt nobody holds: ties, so the turn decides (round-robin among equals).
        let picks: Vec<WorkerId> =
            (0..3).map(|t| choose(&ix, &w, &other, &all, t, &mut s).unwrap().worker).collect();
        assert_eq!(picks, [0, 1, 2]);
        // 6. Worker 1 is down (not a candidate) and then dead in the index: never chosen.
        assert_eq!(choose(&ix, &w, &req, &idle(&[0, 2]), 0, &mut s).unwrap().worker, 2);
        ix.kill(2);
        let c = choose(&ix, &w, &req, &idle(&[0, 2]), 0, &mut s).unwrap();
        assert_eq!((c.worker, c.predicted_blocks), (0, 0), "a dead worker's blocks do not count");
        // 7. No candidate at all: no choice.
        assert_eq!(choose(&ix, &w, &req, &[], 0, &mut s), None);
    }
}
