//! The indexer: every worker's event stream applied to one [`BlockIndex`], in order, with
//! what was dropped counted by reason. A gap marks the worker stale and asks for a replay; a
//! restart (a new stream, or `AllBlocksCleared`) forgets the worker's blocks, which the new
//! stream and its replay bring back; a dead worker is forgotten and never scored.

use crate::event::{KvEvent, KvEventBatch};
use crate::index::{BlockIndex, Overlap, WorkerId};
use crate::stream::{Admit, Dropped, Stream, StreamState};

/// Too many workers for one index.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0} prefill workers is more than the KV index takes ({max}); route with --routing round-robin", max = usize::from(WorkerId::MAX))]
pub struct TooManyWorkers(pub usize);

/// What became of one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Applied.
    Applied,
    /// Dropped, for this reason (counted).
    Dropped(Dropped),
    /// Dropped: the worker missed batches; ask its replay socket for those from `from`.
    Replay { from: u64 },
}

/// Counters over the indexer's life.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Batches applied.
    pub batches: u64,
    /// Events applied.
    pub events: u64,
    /// Batches dropped, by [`Dropped::ALL`]'s order.
    pub dropped: [u64; 5],
    /// Batches the workers' publishers could no longer replay.
    pub lost: u64,
    /// Replays asked for.
    pub replays: u64,
}

/// Every worker's blocks, from their events.
#[derive(Debug, Clone)]
pub struct Indexer {
    index: BlockIndex,
    streams: Vec<Stream>,
    counts: Counts,
}

impl Indexer {
    /// An indexer of `workers` workers, numbered from 0, all fresh.
    pub fn new(workers: usize) -> Result<Indexer, TooManyWorkers> {
        if workers > usize::from(WorkerId::MAX) {
            return Err(TooManyWorkers(workers));
        }
        Ok(Indexer {
            index: BlockIndex::new(workers),
            streams: vec![Stream::default(); workers],
            counts: Counts::default(),
        })
    }

    /// The block index.
    pub fn index(&self) -> &BlockIndex {
        &self.index
    }

    /// The counters.
    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    /// Where `worker`'s stream stands (a worker it does not know: dead).
    pub fn state(&self, worker: WorkerId) -> StreamState {
        self.streams.get(usize::from(worker)).map_or(StreamState::Dead, Stream::state)
    }

    /// Whether any worker's stream is live: without one, the index knows nothing to route by.
    pub fn any_live(&self) -> bool {
        self.streams.iter().any(|s| s.state() == StreamState::Live)
    }

    fn drop(&mut self, why: Dropped) -> Outcome {
        self.counts.dropped[why as usize] += 1;
        Outcome::Dropped(why)
    }

    /// Applies `worker`'s batch numbered `seq`; `replay`: it came from the worker's replay
    /// socket.
    pub fn apply(&mut self, worker: WorkerId, seq: u64, batch: &KvEventBatch, replay: bool) -> Outcome {
        let Some(stream) = self.streams.get_mut(usize::from(worker)) else {
            return self.drop(Dropped::UnknownWorker);
        };
        let malformed =
            batch.events.iter().any(|e| e.block_hashes().is_empty() && *e != KvEvent::AllBlocksCleared);
        if malformed && stream.state() != StreamState::Dead {
            stream.skip(seq);
            return self.drop(Dropped::Malformed);
        }
        match stream.admit(seq, replay) {
            Admit::Drop(why) => self.drop(why),
            Admit::Replay { from } => {
                self.counts.replays += 1;
                Outcome::Replay { from }
            }
            Admit::Apply { lost } => {
                self.counts.lost += lost;
                self.counts.batches += 1;
                self.counts.events += batch.events.len() as u64;
                for e in &batch.events {
                    match e {
                        KvEvent::BlockStored(s) => {
                            s.block_hashes.iter().for_each(|h| self.index.store(worker, *h, &s.medium))
                        }
                        KvEvent::BlockRemoved(r) => {
                            r.block_hashes.iter().for_each(|h| self.index.remove(worker, *h, &r.medium))
                        }
                        KvEvent::AllBlocksCleared => self.index.clear(worker),
                    }
                }
                Outcome::Applied
            }
        }
    }

    /// A batch from `worker` that could not be decoded (counted; nothing applied).
    pub fn reject(&mut self, worker: WorkerId) -> Outcome {
        if usize::from(worker) >= self.streams.len() {
            return self.drop(Dropped::UnknownWorker);
        }
        self.drop(Dropped::Malformed)
    }

    /// `worker` restarted, or its stream started over: its blocks are forgotten until the
    /// new stream (and its replay) brings them.
    pub fn restart(&mut self, worker: WorkerId) {
        if let Some(s) = self.streams.get_mut(usize::from(worker)) {
            s.reset();
            self.index.clear(worker);
        }
    }

    /// `worker` is dead: forgotten, never scored, its batches dropped until [`Indexer::restart`].
    pub fn kill(&mut self, worker: WorkerId) {
        if let Some(s) = self.streams.get_mut(usize::from(worker)) {
            s.kill();
            self.index.clear(worker);
        }
    }

    /// Each worker's overlap with `chain`, into `out`; a worker whose stream is not live (it
    /// missed batches, or is dead) overlaps nothing, since its part of the index may be
    /// wrong.
    pub fn overlaps(&self, chain: &[u64], out: &mut Vec<Overlap>) {
        self.index.overlaps(chain, out);
        for (o, s) in out.iter_mut().zip(&self.streams) {
            if s.state() != StreamState::Live {
                *o = Overlap::default();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Medium;

    fn batch(events: Vec<KvEvent>) -> KvEventBatch {
        KvEventBatch { ts: 0.0, events, data_parallel_rank: None }
    }

    fn stored(hashes: &[u64]) -> KvEventBatch {
        let tokens = vec![0; hashes.len() * 4];
        batch(vec![KvEvent::stored(hashes.to_vec(), None, tokens, 4, Medium::Gpu)])
    }

    fn blocks(ix: &Indexer, worker: WorkerId, chain: &[u64]) -> u32 {
        let mut out = Vec::new();
        ix.overlaps(chain, &mut out);
        out[usize::from(worker)].blocks
    }

    #[test]
    fn a_gap_makes_the_worker_stale_until_the_replay_fills_it() {
        let mut ix = Indexer::new(2).unwrap();
        assert_eq!(ix.apply(0, 0, &stored(&[1]), false), Outcome::Applied);
        assert_eq!(ix.apply(0, 2, &stored(&[3]), false), Outcome::Replay { from: 1 });
        assert_eq!(ix.state(0), StreamState::Stale { from: 1 });
        assert_eq!(blocks(&ix, 0, &[1, 2, 3]), 0, "a stale worker is not scored");
        assert_eq!(ix.apply(0, 1, &stored(&[2]), true), Outcome::Applied);
        assert_eq!(ix.apply(0, 2, &stored(&[3]), true), Outcome::Applied);
        assert_eq!(ix.state(0), StreamState::Live);
        assert_eq!(blocks(&ix, 0, &[1, 2, 3]), 3);
        assert_eq!(ix.apply(0, 1, &stored(&[2]), true), Outcome::Dropped(Dropped::Replayed));
        assert_eq!(ix.counts().dropped[Dropped::Replayed as usize], 1);
        assert_eq!(ix.counts().replays, 1);
    }

    #[test]
    fn malformed_batches_are_dropped_counted_and_the_stream_goes_on() {
        let mut ix = Indexer::new(1).unwrap();
        ix.apply(0, 0, &stored(&[1]), false);
        let bad = batch(vec![KvEvent::removed(vec![], Medium::Gpu)]);
        assert_eq!(ix.apply(0, 1, &bad, false), Outcome::Dropped(Dropped::Malformed));
        assert_eq!(ix.reject(0), Outcome::Dropped(Dropped::Malformed));
        assert_eq!(ix.reject(9), Outcome::Dropped(Dropped::UnknownWorker));
        assert_eq!(ix.apply(9, 0, &stored(&[1]), false), Outcome::Dropped(Dropped::UnknownWorker));
        assert_eq!(ix.apply(0, 2, &stored(&[2]), false), Outcome::Applied, "no gap after a malformed batch");
        assert_eq!(ix.counts().dropped, [0, 0, 0, 2, 2]);
        assert_eq!(blocks(&ix, 0, &[1, 2]), 2);
    }

    #[test]
    fn a_restart_forgets_the_worker_and_its_new_stream_rebuilds_it() {
        let mut ix = Indexer::new(2).unwrap();
        ix.apply(0, 0, &stored(&[1, 2]), false);
        ix.apply(1, 0, &stored(&[1]), false);
        ix.apply(0, 1, &batch(vec![KvEvent::AllBlocksCleared]), false);
        assert_eq!(blocks(&ix, 0, &[1, 2]), 0);
        assert_eq!(blocks(&ix, 1, &[1, 2]), 1, "another worker's blocks stay");
        ix.apply(0, 2, &stored(&[1]), false);
        ix.restart(0);
        assert_eq!(ix.state(0), StreamState::Fresh);
        assert_eq!(ix.index().held(0), 0);
        // The restarted worker's publisher numbers from 0 again.
        assert_eq!(ix.apply(0, 0, &stored(&[1, 2]), false), Outcome::Applied);
        assert_eq!(blocks(&ix, 0, &[1, 2]), 2);
    }

    #[test]
    fn a_dead_worker_is_forgotten_and_its_batches_dropped() {
        let mut ix = Indexer::new(2).unwrap();
        ix.apply(0, 0, &stored(&[1]), false);
        ix.kill(0);
        assert_eq!(ix.apply(0, 1, &stored(&[2]), false), Outcome::Dropped(Dropped::Dead));
        assert_eq!((ix.index().held(0), blocks(&ix, 0, &[1])), (0, 0));
        assert!(!ix.any_live());
        assert!(Indexer::new(70_000).unwrap_err().to_string().contains("--routing round-robin"));
    }
}
