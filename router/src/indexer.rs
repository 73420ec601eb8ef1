//! The indexer: every worker's event stream applied to one [`BlockIndex`], in order, with
//! what was dropped counted by reason. Stored blocks are re-hashed from their token ids into
//! the router's own chain (`chain`, pieces of `unit` tokens), so that blocks of any size
//! from any publisher (the engine's blocks, lmcache's chunks) index the same tokens under
//! the same hashes; per worker, each publisher hash is remembered with the router hashes it
//! stands for, for its removal and for the blocks that name it as parent. A store that names
//! a block by its hash alone (no tokens) is indexed only when the hash is already known. A gap
//! marks the worker stale and asks for a replay; a restart (a new stream, or `AllBlocksCleared`)
//! forgets the worker's blocks, which the new stream and its replay bring back; a dead worker is
//! forgotten and never scored.

use crate::chain;
use crate::event::{medium_bit, BlockHash, KvEvent, KvEventBatch};
use crate::flat::{FlatMap, Packed};
use crate::index::{BlockIndex, IdBuild, Overlap, TierMask, WorkerId};
use crate::stream::{Admit, Dropped, Stream, StreamState};
use kvconnect_api::kv_events::{BlockRemoved, BlockStored};
use std::collections::HashMap;

/// Too many workers for one index.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0} prefill workers is more than the KV index takes ({max}); route with --routing round-robin",
    max = usize::from(WorkerId::MAX)
)]
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
    /// Stored blocks that could not be indexed: named by their hash alone and not known, or
    /// chained on a parent not known, or shorter than the router's unit.
    pub unindexed_blocks: u64,
}

/// Every worker's blocks, from their events.
#[derive(Debug, Clone)]
pub struct Indexer {
    index: BlockIndex,
    streams: Vec<Stream>,
    counts: Counts,
    /// Tokens per router hash.
    unit: usize,
    /// Per worker: publisher hash → the router hash of the block's last piece (which its
    /// children chain on), with the media the worker's events say it holds the block in
    /// (`Known`).
    ext: Vec<FlatMap<Known>>,
    /// Per worker: publisher hash → the router hashes of the block's other pieces, in order,
    /// for the blocks of more than one piece (none where the blocks are the unit).
    more: Vec<HashMap<BlockHash, Vec<u64>, IdBuild>>,
    /// Publisher hashes the batch being applied removed from their last medium: forgotten at
    /// the batch's end unless a later event of the batch stored them again (a move between
    /// media whose store names the block by its hash alone).
    unheld: Vec<BlockHash>,
    /// The index operations of the batch being applied, in order (reused).
    ops: Vec<Op>,
}

/// A publisher hash's entry in a worker's map, in one word: the router hash of its last
/// piece (`chain::KEY_BITS` bits) and, above it, the media the worker's events say it holds
/// the block in (`event::medium_bit`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Known(u64);

impl Known {
    fn new(key: u64, tiers: TierMask) -> Known {
        Known(key | u64::from(tiers) << chain::KEY_BITS)
    }
    fn key(self) -> u64 {
        self.0 & chain::KEY_MASK
    }
    fn tiers(self) -> TierMask {
        (self.0 >> chain::KEY_BITS) as TierMask
    }
    /// The same block, held in `tiers` now.
    fn with_tiers(self, tiers: TierMask) -> Known {
        Known::new(self.key(), tiers)
    }
}

impl Packed for Known {
    fn pack(self) -> u64 {
        self.0
    }
    fn unpack(word: u64) -> Known {
        Known(word)
    }
}

/// One index operation of a batch: a router hash stored in, or removed from, one medium.
#[derive(Debug, Clone, Copy)]
struct Op {
    key: u64,
    /// The medium's tier bit.
    bit: TierMask,
    store: bool,
}

/// Operations between the prefetch of an index slot and its use (`Indexer::run_ops`): enough
/// for the misses of about one event's blocks to be in flight together.
const SLOT_AHEAD: usize = 16;

/// Operations between the prefetch of a slot's list of further holders (which reads the
/// slot, prefetched `SLOT_AHEAD - LIST_AHEAD` operations before) and its use.
const LIST_AHEAD: usize = 8;

impl Indexer {
    /// An indexer of `workers` workers, numbered from 0, all fresh, hashing tokens in pieces
    /// of `unit` (the smallest block size of the workers' caches: the engine's block size).
    pub fn new(workers: usize, unit: u32) -> Result<Indexer, TooManyWorkers> {
        if workers > usize::from(WorkerId::MAX) {
            return Err(TooManyWorkers(workers));
        }
        Ok(Indexer {
            index: BlockIndex::new(workers),
            streams: vec![Stream::default(); workers],
            counts: Counts::default(),
            unit: (unit as usize).max(1),
            ext: (0..workers).map(|_| FlatMap::new()).collect(),
            more: (0..workers).map(|_| HashMap::default()).collect(),
            unheld: Vec::new(),
            ops: Vec::new(),
        })
    }

    /// Tokens per router hash.
    pub fn unit(&self) -> usize {
        self.unit
    }

    fn forget(&mut self, worker: WorkerId) {
        self.index.clear(worker);
        self.ext[usize::from(worker)] = FlatMap::new();
        self.more[usize::from(worker)] = HashMap::default();
        self.unheld.clear();
    }

    /// Plans the operation (`store`, or a removal) in the medium of tier bit `bit` on each
    /// router hash that publisher hash `h` of worker `w`, known as `k`, stands for, in order.
    #[inline(always)]
    fn plan_pieces(&mut self, w: usize, h: BlockHash, k: Known, bit: TierMask, store: bool) {
        if !self.more[w].is_empty() {
            if let Some(m) = self.more[w].get(&h) {
                self.ops.extend(m.iter().map(|key| Op { key: *key, bit, store }));
            }
        }
        self.ops.push(Op { key: k.key(), bit, store });
    }

    /// Prefetches the first slots, in worker `w`'s map, of the block hashes event `e` looks up
    /// (`FlatMap::prefetch`); `apply` does it one event ahead, so that these misses overlap
    /// the work of the event before.
    fn prefetch_ext(&self, w: usize, e: &KvEvent) {
        let (parent, hashes) = match e {
            KvEvent::BlockStored(s) => (s.parent_block_hash, &s.block_hashes[..]),
            KvEvent::BlockRemoved(r) => (None, &r.block_hashes[..]),
            KvEvent::AllBlocksCleared => return,
        };
        let map = &self.ext[w];
        if let Some(p) = parent {
            map.prefetch(p);
        }
        for h in hashes {
            map.prefetch(*h);
        }
    }

    // A batch is applied in two passes. The first plans: it turns each event's blocks into
    // router hashes (the worker's map, or the tokens' chain) and operations on the index, in
    // order, and keeps the worker's map up to date as it goes. The map holds, with each
    // publisher hash, the media the worker's events say it holds the block in, so a removal
    // from its last medium is seen here: the hash is forgotten at the batch's end
    // (`forget_unheld`) unless a later event stored it again. The second pass runs the
    // operations in the same order, each index slot prefetched `SLOT_AHEAD` operations before
    // its use, so that the cache misses of many blocks overlap instead of following one
    // another. The result is that of applying the events one by one: the first pass reads
    // nothing of the index, and the second nothing of the worker's map.

    /// Plans a store (see above).
    fn plan_store(&mut self, worker: WorkerId, s: &BlockStored) {
        let w = usize::from(worker);
        let bs = s.block_size as usize;
        let bit = medium_bit(&s.medium);
        if bs == 0 || s.token_ids.is_empty() {
            // Named by hash alone: only a block already known (a move between media).
            for h in &s.block_hashes {
                let held = |k: &mut Known| {
                    *k = k.with_tiers(k.tiers() | bit);
                    *k
                };
                match self.ext[w].update(*h, held) {
                    Some(k) => self.plan_pieces(w, *h, k, bit, true),
                    None => self.counts.unindexed_blocks += 1,
                }
            }
            return;
        }
        let parent = match s.parent_block_hash {
            None => Some(chain::ROOT),
            Some(p) => self.ext[w].get(p).map(Known::key),
        };
        let Some(mut c) = parent else {
            self.counts.unindexed_blocks += s.block_hashes.len() as u64;
            return;
        };
        if bs < self.unit {
            self.counts.unindexed_blocks += 1;
            return;
        }
        // A block that ends mid-piece cannot be chained on: only the first is indexed.
        let n = if bs.is_multiple_of(self.unit) { s.block_hashes.len() } else { 1 };
        let per = bs / self.unit;
        for (h, block) in s.block_hashes[..n].iter().zip(s.token_ids[..n * bs].chunks_exact(bs)) {
            let first = self.ops.len();
            for piece in block.chunks_exact(self.unit) {
                c = chain::next(c, piece);
                self.ops.push(Op { key: c, bit, store: true });
            }
            // Its media: any it was stored in before (under whatever tokens), and this one.
            self.ext[w].upsert(*h, |k| *k = Known::new(c, k.tiers() | bit));
            if per > 1 {
                let more = self.ops[first..self.ops.len() - 1].iter().map(|o| o.key).collect();
                self.more[w].insert(*h, more);
            } else if !self.more[w].is_empty() {
                self.more[w].remove(h);
            }
        }
        self.counts.unindexed_blocks += (s.block_hashes.len() - n) as u64;
    }

    /// Plans a removal (see above).
    fn plan_remove(&mut self, worker: WorkerId, r: &BlockRemoved) {
        let w = usize::from(worker);
        let bit = medium_bit(&r.medium);
        for h in &r.block_hashes {
            let unheld = |k: &mut Known| {
                *k = k.with_tiers(k.tiers() & !bit);
                *k
            };
            if let Some(k) = self.ext[w].update(*h, unheld) {
                self.plan_pieces(w, *h, k, bit, false);
                if k.tiers() == 0 {
                    self.unheld.push(*h);
                }
            }
        }
    }

    /// Runs the planned operations (see above), in order.
    fn run_ops(&mut self, worker: WorkerId) {
        let ops = std::mem::take(&mut self.ops);
        for op in ops.iter().take(SLOT_AHEAD) {
            self.index.prefetch_slot(op.key);
        }
        for op in ops.iter().take(LIST_AHEAD) {
            self.index.prefetch_list(op.key);
        }
        for (i, op) in ops.iter().enumerate() {
            if let Some(o) = ops.get(i + SLOT_AHEAD) {
                self.index.prefetch_slot(o.key);
            }
            if let Some(o) = ops.get(i + LIST_AHEAD) {
                self.index.prefetch_list(o.key);
            }
            if op.store {
                self.index.store_in(worker, op.key, op.bit);
            } else {
                self.index.remove_from(worker, op.key, op.bit);
            }
        }
        self.ops = ops;
        self.ops.clear();
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
        let malformed = batch.events.iter().any(|e| match e {
            KvEvent::BlockStored(s) => {
                s.block_hashes.is_empty()
                    || (!s.token_ids.is_empty()
                        && s.token_ids.len() != s.block_hashes.len() * s.block_size as usize)
            }
            KvEvent::BlockRemoved(r) => r.block_hashes.is_empty(),
            KvEvent::AllBlocksCleared => false,
        });
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
                let w = usize::from(worker);
                let events = &batch.events;
                if let Some(e) = events.first() {
                    self.prefetch_ext(w, e);
                }
                for (i, e) in events.iter().enumerate() {
                    if let Some(next) = events.get(i + 1) {
                        self.prefetch_ext(w, next);
                    }
                    match e {
                        KvEvent::BlockStored(s) => self.plan_store(worker, s),
                        KvEvent::BlockRemoved(r) => self.plan_remove(worker, r),
                        KvEvent::AllBlocksCleared => {
                            // What came before the clear is applied first, then forgotten.
                            self.run_ops(worker);
                            self.forget(worker);
                        }
                    }
                }
                self.run_ops(worker);
                self.forget_unheld(w);
                Outcome::Applied
            }
        }
    }

    /// At a batch's end: forgets worker `w`'s publisher hashes that the batch removed from
    /// their last medium and did not store again after (the map's media of a hash follow its
    /// events in order, so they say whether the worker holds it now).
    fn forget_unheld(&mut self, w: usize) {
        for h in self.unheld.drain(..) {
            let gone = self.ext[w].change(h, |k| ((), k.tiers() != 0));
            if gone.is_some_and(|((), k)| k.tiers() == 0) && !self.more[w].is_empty() {
                self.more[w].remove(&h);
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
            self.forget(worker);
        }
    }

    /// `worker` is dead: forgotten, never scored, its batches dropped until [`Indexer::restart`].
    pub fn kill(&mut self, worker: WorkerId) {
        if let Some(s) = self.streams.get_mut(usize::from(worker)) {
            s.kill();
            self.forget(worker);
        }
    }

    /// Each worker's overlap with `chain` (a request's router hashes: `chain::prefix_hashes`
    /// of its prompt at [`Indexer::unit`]), into `out`; a worker whose stream is not live (it
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

    const UNIT: u32 = 4;

    fn prompt() -> Vec<u32> {
        (100..140).collect()
    }

    fn batch(events: Vec<KvEvent>) -> KvEventBatch {
        KvEventBatch { ts: 0.0, events, data_parallel_rank: None }
    }

    /// The publisher's own hash of block `i` (any numbering of its own).
    fn ext(i: usize) -> u64 {
        7000 + i as u64
    }

    /// The store of the prompt's blocks `from..to` of `UNIT` tokens in `medium`.
    fn blocks_of(from: usize, to: usize, medium: Medium) -> KvEvent {
        let u = UNIT as usize;
        let parent = from.checked_sub(1).map(ext);
        KvEvent::stored(
            (from..to).map(ext).collect(),
            parent,
            prompt()[from * u..to * u].to_vec(),
            UNIT,
            medium,
        )
    }

    fn stored(from: usize, to: usize) -> KvEventBatch {
        batch(vec![blocks_of(from, to, Medium::Gpu)])
    }

    /// Leading blocks of the prompt `worker` holds, as the router sees them.
    fn blocks(ix: &Indexer, worker: WorkerId) -> u32 {
        let mut out = Vec::new();
        ix.overlaps(&chain::prefix_hashes(&prompt(), UNIT as usize), &mut out);
        out[usize::from(worker)].blocks
    }

    #[test]
    fn a_gap_makes_the_worker_stale_until_the_replay_fills_it() {
        let mut ix = Indexer::new(2, UNIT).unwrap();
        assert_eq!(ix.apply(0, 0, &stored(0, 1), false), Outcome::Applied);
        assert_eq!(ix.apply(0, 2, &stored(2, 3), false), Outcome::Replay { from: 1 });
        assert_eq!(ix.state(0), StreamState::Stale { from: 1 });
        assert_eq!(blocks(&ix, 0), 0, "a stale worker is not scored");
        assert_eq!(ix.apply(0, 1, &stored(1, 2), true), Outcome::Applied);
        assert_eq!(ix.apply(0, 2, &stored(2, 3), true), Outcome::Applied);
        assert_eq!(ix.state(0), StreamState::Live);
        assert_eq!(blocks(&ix, 0), 3);
        assert_eq!(ix.apply(0, 1, &stored(1, 2), true), Outcome::Dropped(Dropped::Replayed));
        assert_eq!(ix.counts().dropped[Dropped::Replayed as usize], 1);
        assert_eq!(ix.counts().replays, 1);
    }

    #[test]
    fn malformed_batches_are_dropped_counted_and_the_stream_goes_on() {
        let mut ix = Indexer::new(1, UNIT).unwrap();
        ix.apply(0, 0, &stored(0, 1), false);
        let no_blocks = batch(vec![KvEvent::removed(vec![], Medium::Gpu)]);
        assert_eq!(ix.apply(0, 1, &no_blocks, false), Outcome::Dropped(Dropped::Malformed));
        // Two blocks of 4 tokens named, 5 tokens given.
        let short = batch(vec![KvEvent::stored(vec![1, 2], None, vec![0; 5], UNIT, Medium::Gpu)]);
        assert_eq!(ix.apply(0, 2, &short, false), Outcome::Dropped(Dropped::Malformed));
        assert_eq!(ix.reject(0), Outcome::Dropped(Dropped::Malformed));
        assert_eq!(ix.reject(9), Outcome::Dropped(Dropped::UnknownWorker));
        assert_eq!(ix.apply(9, 0, &stored(0, 1), false), Outcome::Dropped(Dropped::UnknownWorker));
        assert_eq!(ix.apply(0, 3, &stored(1, 2), false), Outcome::Applied, "no gap after a malformed batch");
        assert_eq!(ix.counts().dropped, [0, 0, 0, 3, 2]);
        assert_eq!(blocks(&ix, 0), 2);
    }

    #[test]
    fn a_restart_forgets_the_worker_and_its_new_stream_rebuilds_it() {
        let mut ix = Indexer::new(2, UNIT).unwrap();
        ix.apply(0, 0, &stored(0, 2), false);
        ix.apply(1, 0, &stored(0, 1), false);
        ix.apply(0, 1, &batch(vec![KvEvent::AllBlocksCleared]), false);
        assert_eq!(blocks(&ix, 0), 0);
        assert_eq!(blocks(&ix, 1), 1, "another worker's blocks stay");
        ix.apply(0, 2, &stored(0, 1), false);
        ix.restart(0);
        assert_eq!(ix.state(0), StreamState::Fresh);
        assert_eq!(ix.index().held(0), 0);
        // The restarted worker's publisher numbers from 0 again.
        assert_eq!(ix.apply(0, 0, &stored(0, 2), false), Outcome::Applied);
        assert_eq!(blocks(&ix, 0), 2);
    }

    #[test]
    fn a_dead_worker_is_forgotten_and_its_batches_dropped() {
        let mut ix = Indexer::new(2, UNIT).unwrap();
        ix.apply(0, 0, &stored(0, 1), false);
        ix.kill(0);
        assert_eq!(ix.apply(0, 1, &stored(1, 2), false), Outcome::Dropped(Dropped::Dead));
        assert_eq!((ix.index().held(0), blocks(&ix, 0)), (0, 0));
        assert!(!ix.any_live());
        assert!(Indexer::new(70_000, UNIT).unwrap_err().to_string().contains("--routing round-robin"));
    }

    /// Blocks that end mid-piece: the first block's whole pieces are indexed, and the blocks
    /// after it, which chain on a partial piece, are counted as unindexed; blocks shorter than
    /// a piece index nothing.
    #[test]
    fn blocks_ending_mid_piece_index_only_the_first() {
        let mut ix = Indexer::new(1, UNIT).unwrap();
        let p = prompt();
        let six = KvEvent::stored(vec![1, 2, 3], None, p[..18].to_vec(), 6, Medium::Gpu);
        assert_eq!(ix.apply(0, 0, &batch(vec![six]), false), Outcome::Applied);
        assert_eq!((blocks(&ix, 0), ix.counts().unindexed_blocks), (1, 2));
        // Block 1 is known by its hash: a move stores its one piece again, elsewhere.
        let moved = KvEvent::stored(vec![1, 2], None, Vec::new(), 0, Medium::Disk);
        ix.apply(0, 1, &batch(vec![moved]), false);
        assert_eq!(ix.counts().unindexed_blocks, 3, "block 2 was never indexed");
        let short = KvEvent::stored(vec![4, 5], None, p[..4].to_vec(), 2, Medium::Gpu);
        ix.apply(0, 2, &batch(vec![short]), false);
        assert_eq!((ix.index().held(0), ix.counts().unindexed_blocks), (1, 4));
    }

    /// An lmcache-like publisher: chunks of 3 units under hashes of its own, a move from the
    /// CPU tier to disk with the chunk named by its hash alone; and the engine's own blocks of
    /// one unit for the same tokens: both index the same router hashes.
    #[test]
    fn blocks_of_any_size_index_their_tokens_and_moves_keep_them() {
        let mut ix = Indexer::new(2, UNIT).unwrap();
        let p = prompt();
        let chunk = |i: usize, parent: Option<u64>, medium: Medium| {
            KvEvent::stored(vec![900 + i as u64], parent, p[i * 12..(i + 1) * 12].to_vec(), 12, medium)
        };
        let first = batch(vec![chunk(0, None, Medium::CpuTier), chunk(1, Some(900), Medium::CpuTier)]);
        assert_eq!(ix.apply(0, 0, &first, false), Outcome::Applied);
        assert_eq!(blocks(&ix, 0), 6);
        let mut out = Vec::new();
        ix.overlaps(&chain::prefix_hashes(&p, UNIT as usize), &mut out);
        assert_eq!(out[0].by_rank, [0, 6, 0, 0], "in the CPU tier");
        // Chunk 1 moves to disk: removed from cpu_tier, stored on disk by its hash alone.
        let moved = batch(vec![
            KvEvent::removed(vec![901], Medium::CpuTier),
            KvEvent::stored(vec![901], None, Vec::new(), 0, Medium::Disk),
        ]);
        assert_eq!(ix.apply(0, 1, &moved, false), Outcome::Applied);
        ix.overlaps(&chain::prefix_hashes(&p, UNIT as usize), &mut out);
        assert_eq!((out[0].blocks, out[0].by_rank), (6, [0, 3, 3, 0]));
        // 901 held nowhere after the removal, but stored again in the same batch: still known.
        assert_eq!(ix.counts().unindexed_blocks, 0, "the disk store found 901 still known");
        // Removed from disk too: forgotten, so a later store by hash alone is not indexed.
        let gone = batch(vec![KvEvent::removed(vec![901], Medium::Disk)]);
        ix.apply(0, 2, &gone, false);
        let again = batch(vec![KvEvent::stored(vec![901], None, Vec::new(), 0, Medium::Disk)]);
        ix.apply(0, 3, &again, false);
        assert_eq!((blocks(&ix, 0), ix.counts().unindexed_blocks), (3, 1));
        // A chunk whose parent the router never saw: not indexed, counted.
        let orphan = batch(vec![chunk(2, Some(12345), Medium::Disk)]);
        ix.apply(0, 4, &orphan, false);
        assert_eq!((blocks(&ix, 0), ix.counts().unindexed_blocks), (3, 2));
        // The engine's own blocks of one unit on worker 1: the same router hashes.
        ix.apply(1, 0, &stored(0, 8), false);
        ix.overlaps(&chain::prefix_hashes(&p, UNIT as usize), &mut out);
        assert_eq!((out[1].blocks, out[1].by_rank), (8, [8, 0, 0, 0]));
    }

    /// The indexer's rules as the module states them, applied event by event with plain maps:
    /// what the two passes and the prefetches must agree with.
    #[derive(Default)]
    struct Model {
        /// (worker, publisher hash) -> the router hashes it stands for, and the media the
        /// worker's events say it holds it in.
        ext: HashMap<(WorkerId, BlockHash), (Vec<u64>, u8)>,
        /// (worker, router hash) -> media.
        held: HashMap<(WorkerId, u64), u8>,
        unindexed: u64,
    }

    impl Model {
        fn apply(&mut self, w: WorkerId, events: &[KvEvent]) {
            let unit = UNIT as usize;
            for e in events {
                match e {
                    KvEvent::BlockStored(s) if s.block_size == 0 || s.token_ids.is_empty() => {
                        let bit = medium_bit(&s.medium);
                        for h in &s.block_hashes {
                            match self.ext.get_mut(&(w, *h)) {
                                Some((keys, media)) => {
                                    *media |= bit;
                                    for k in keys {
                                        *self.held.entry((w, *k)).or_default() |= bit;
                                    }
                                }
                                None => self.unindexed += 1,
                            }
                        }
                    }
                    KvEvent::BlockStored(s) => {
                        let bs = s.block_size as usize;
                        let bit = medium_bit(&s.medium);
                        let parent = match s.parent_block_hash {
                            None => Some(chain::ROOT),
                            Some(p) => self.ext.get(&(w, p)).map(|k| *k.0.last().unwrap()),
                        };
                        let Some(mut c) = parent else {
                            self.unindexed += s.block_hashes.len() as u64;
                            continue;
                        };
                        if bs < unit {
                            self.unindexed += 1;
                            continue;
                        }
                        let n = if bs.is_multiple_of(unit) { s.block_hashes.len() } else { 1 };
                        for (b, h) in s.block_hashes[..n].iter().enumerate() {
                            let mut keys = Vec::new();
                            for piece in s.token_ids[b * bs..(b + 1) * bs].chunks_exact(unit) {
                                c = chain::next(c, piece);
                                keys.push(c);
                                *self.held.entry((w, c)).or_default() |= bit;
                            }
                            let media = self.ext.get(&(w, *h)).map_or(0, |k| k.1);
                            self.ext.insert((w, *h), (keys, media | bit));
                        }
                        self.unindexed += (s.block_hashes.len() - n) as u64;
                    }
                    KvEvent::BlockRemoved(r) => {
                        let bit = medium_bit(&r.medium);
                        for h in &r.block_hashes {
                            let Some((keys, media)) = self.ext.get_mut(&(w, *h)) else { continue };
                            *media &= !bit;
                            for k in keys {
                                if let Some(m) = self.held.get_mut(&(w, *k)) {
                                    *m &= !bit;
                                }
                            }
                            self.held.retain(|_, m| *m != 0);
                        }
                    }
                    KvEvent::AllBlocksCleared => {
                        self.held.retain(|k, _| k.0 != w);
                        self.ext.retain(|k, _| k.0 != w);
                    }
                }
            }
            // A hash held in no medium at the batch's end is forgotten.
            self.ext.retain(|k, v| k.0 != w || v.1 != 0);
        }
    }

    /// Random batches over three workers, a few publisher hashes (so blocks are stored,
    /// moved, removed and stored again within a batch), blocks of one and two pieces and
    /// some ending mid-piece, parents known and not, and clears mid-batch: after each batch
    /// the index, the workers' maps and the unindexed count are the model's.
    #[test]
    fn batches_apply_as_their_events_one_by_one() {
        let media = [Medium::Gpu, Medium::CpuTier, Medium::Disk];
        let mut x = 5u64;
        let mut rnd = move |n: u64| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (x >> 33) % n
        };
        let mut ix = Indexer::new(3, UNIT).unwrap();
        let mut model = Model::default();
        let mut seq = [0u64; 3];
        for _ in 0..3000 {
            let w = rnd(3) as WorkerId;
            let events: Vec<KvEvent> = (0..1 + rnd(8))
                .map(|_| {
                    let medium = media[rnd(3) as usize].clone();
                    let hashes: Vec<u64> = (0..1 + rnd(3)).map(|_| 1 + rnd(24)).collect();
                    match rnd(20) {
                        0..=6 => {
                            let bs = [4u32, 8, 4, 6, 2][rnd(5) as usize];
                            let parent = [None, Some(1 + rnd(24))][rnd(2) as usize];
                            // Tokens from a small alphabet: prompts share pieces.
                            let tokens = (0..hashes.len() * bs as usize).map(|_| rnd(3) as u32).collect();
                            KvEvent::stored(hashes, parent, tokens, bs, medium)
                        }
                        7..=11 => KvEvent::stored(hashes, None, Vec::new(), 0, medium),
                        12..=18 => KvEvent::removed(hashes, medium),
                        _ if rnd(10) == 0 => KvEvent::AllBlocksCleared,
                        _ => KvEvent::removed(hashes, medium),
                    }
                })
                .collect();
            let s = &mut seq[usize::from(w)];
            assert_eq!(ix.apply(w, *s, &batch(events.clone()), false), Outcome::Applied);
            *s += 1;
            model.apply(w, &events);
            assert_eq!(ix.counts().unindexed_blocks, model.unindexed);
            for ((mw, key), m) in &model.held {
                assert_eq!(ix.index().tiers(*mw, *key), *m, "worker {mw}, key {key:x}");
            }
            for v in 0..3 {
                let n = model.held.keys().filter(|k| k.0 == v).count() as u64;
                assert_eq!(ix.index().held(v), n, "worker {v}");
                let mut known: Vec<(u64, u64, u8)> =
                    ix.ext[usize::from(v)].iter().map(|(h, k)| (h, k.key(), k.tiers())).collect();
                let mut want: Vec<(u64, u64, u8)> = model
                    .ext
                    .iter()
                    .filter(|(k, _)| k.0 == v)
                    .map(|(k, (keys, media))| (k.1, *keys.last().unwrap(), *media))
                    .collect();
                known.sort_unstable();
                want.sort_unstable();
                assert_eq!(known, want, "worker {v}'s hashes");
            }
        }
    }

    /// Within one batch a hash's stores and removals apply in order: the last says whether
    /// the worker still holds the block, and so whether its hash is remembered.
    #[test]
    fn a_hash_removed_and_stored_again_in_one_batch_follows_its_last_event() {
        let by_hash = |i: usize, m: Medium| KvEvent::stored(vec![ext(i)], None, Vec::new(), 0, m);
        let mut ix = Indexer::new(1, UNIT).unwrap();
        assert_eq!(ix.apply(0, 0, &stored(0, 4), false), Outcome::Applied);
        // Block 3: gpu -> cpu -> gone -> cpu. Block 2: gpu -> cpu -> gone.
        let b = batch(vec![
            KvEvent::removed(vec![ext(3), ext(2)], Medium::Gpu),
            by_hash(3, Medium::CpuTier),
            by_hash(2, Medium::CpuTier),
            KvEvent::removed(vec![ext(3), ext(2)], Medium::CpuTier),
            by_hash(3, Medium::CpuTier),
        ]);
        assert_eq!(ix.apply(0, 1, &b, false), Outcome::Applied);
        assert_eq!((blocks(&ix, 0), ix.counts().unindexed_blocks), (2, 0), "block 3 is held, block 2 is not");
        // 2's hash was forgotten: stored by hash alone, it is not known. 3's still is.
        ix.apply(0, 2, &batch(vec![by_hash(2, Medium::Disk), by_hash(3, Medium::Disk)]), false);
        assert_eq!(ix.counts().unindexed_blocks, 1);
        let mut out = Vec::new();
        ix.overlaps(&chain::prefix_hashes(&prompt(), UNIT as usize), &mut out);
        assert_eq!(out[0].blocks, 2, "block 3 is held but its parent, block 2, is not");
        // Stored again with its tokens after its hash was forgotten: known again.
        ix.apply(0, 3, &batch(vec![blocks_of(2, 3, Medium::Gpu)]), false);
        assert_eq!(blocks(&ix, 0), 4);
    }
}
