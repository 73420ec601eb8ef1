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
use crate::event::{BlockHash, KvEvent, KvEventBatch, Medium};
use crate::flat::FlatMap;
use crate::index::{BlockIndex, IdBuild, Overlap, WorkerId};
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
    /// children chain on).
    ext: Vec<FlatMap<u64>>,
    /// Per worker: publisher hash → the router hashes of the block's other pieces, in order,
    /// for the blocks of more than one piece (none where the blocks are the unit).
    more: Vec<HashMap<BlockHash, Vec<u64>, IdBuild>>,
    /// Publisher hashes the batch being applied removed from their last medium, each with
    /// the number of the event that did, in the batch.
    unheld: Vec<(BlockHash, u32)>,
    /// While `unheld` has any: publisher hashes the batch stored again (indexed), each with
    /// the number of the event that did. A hash unheld with no store after its removal is
    /// forgotten at the batch's end, without looking it up in the index again.
    restored: Vec<(BlockHash, u32)>,
    /// The number of the event being applied, in its batch.
    event: u32,
    /// The router hashes of the event being applied (reused).
    keys: Vec<u64>,
}

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
            restored: Vec::new(),
            event: 0,
            keys: Vec::new(),
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
    }

    /// Appends the router hashes publisher hash `h` of worker `w` stands for, in order, to
    /// `keys`; false where it is not known.
    fn pieces_of(&self, w: usize, h: BlockHash, keys: &mut Vec<u64>) -> bool {
        let Some(last) = self.ext[w].get(h) else { return false };
        let last = &last;
        if !self.more[w].is_empty() {
            if let Some(m) = self.more[w].get(&h) {
                keys.extend_from_slice(m);
            }
        }
        keys.push(*last);
        true
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

    /// Stores `keys` in the index for `worker`, having started all their cache misses.
    fn store_keys(&mut self, worker: WorkerId, keys: &[u64], medium: &Medium) {
        self.index.prefetch(keys);
        for k in keys {
            self.index.store(worker, *k, medium);
        }
    }

    // An event's work is in phases: every lookup's first slot is prefetched before the first
    // is used (the worker's map for its block hashes one event ahead in `apply`; then the
    // index for the router hashes, each as soon as it is known), so the cache misses of its
    // blocks overlap instead of following one another. Prefetches only fetch; the result is
    // that of applying the blocks one by one: within an event, stores and removals touch each
    // key once, and the lookups read nothing the event changes.
    fn store(&mut self, worker: WorkerId, s: &BlockStored) {
        let w = usize::from(worker);
        let bs = s.block_size as usize;
        let mut keys = std::mem::take(&mut self.keys);
        keys.clear();
        if bs == 0 || s.token_ids.is_empty() {
            // Named by hash alone: only a block already known (a move between media).
            for h in &s.block_hashes {
                if !self.pieces_of(w, *h, &mut keys) {
                    self.counts.unindexed_blocks += 1;
                } else if !self.unheld.is_empty() {
                    self.restored.push((*h, self.event));
                }
            }
            self.store_keys(worker, &keys, &s.medium);
            self.keys = keys;
            return;
        }
        let parent = match s.parent_block_hash {
            None => Some(chain::ROOT),
            Some(p) => self.ext[w].get(p),
        };
        let Some(mut c) = parent else {
            self.counts.unindexed_blocks += s.block_hashes.len() as u64;
            self.keys = keys;
            return;
        };
        if bs < self.unit {
            self.counts.unindexed_blocks += 1;
            self.keys = keys;
            return;
        }
        // A block that ends mid-piece cannot be chained on: only the first is indexed.
        let n = if bs.is_multiple_of(self.unit) { s.block_hashes.len() } else { 1 };
        let hashes = &s.block_hashes[..n];
        // Each key's index slot is prefetched as soon as the key is known, while the next ones
        // are hashed.
        for block in s.token_ids[..n * bs].chunks_exact(bs) {
            for piece in block.chunks_exact(self.unit) {
                c = chain::next(c, piece);
                self.index.prefetch_slot(c);
                keys.push(c);
            }
        }
        self.index.prefetch_lists(&keys);
        for k in &keys {
            self.index.store(worker, *k, &s.medium);
        }
        let per = bs / self.unit;
        for (h, pieces) in hashes.iter().zip(keys.chunks_exact(per)) {
            let (last, more) = match pieces.split_last() {
                Some((last, more)) => (*last, more),
                None => continue,
            };
            self.ext[w].insert(*h, last);
            if !self.unheld.is_empty() {
                self.restored.push((*h, self.event));
            }
            if !more.is_empty() {
                self.more[w].insert(*h, more.to_vec());
            } else if !self.more[w].is_empty() {
                self.more[w].remove(h);
            }
        }
        self.counts.unindexed_blocks += (s.block_hashes.len() - n) as u64;
        self.keys = keys;
    }

    fn remove(&mut self, worker: WorkerId, r: &BlockRemoved) {
        let w = usize::from(worker);
        let mut keys = std::mem::take(&mut self.keys);
        keys.clear();
        for h in &r.block_hashes {
            self.pieces_of(w, *h, &mut keys);
        }
        self.index.prefetch(&keys);
        self.keys = keys;
        for h in &r.block_hashes {
            let Some(last) = self.ext[w].get(*h) else { continue };
            if let Some(more) = self.more[w].get(h) {
                for u in more {
                    self.index.remove(worker, *u, &r.medium);
                }
            }
            if !self.index.remove(worker, last, &r.medium) {
                // Forgotten at the end of the batch, unless stored again in it (a move
                // between media whose store names the block by its hash alone).
                self.unheld.push((*h, self.event));
            }
        }
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
                if let Some(e) = batch.events.first() {
                    self.prefetch_ext(w, e);
                }
                for (i, e) in batch.events.iter().enumerate() {
                    if let Some(next) = batch.events.get(i + 1) {
                        self.prefetch_ext(w, next);
                    }
                    self.event = i as u32;
                    match e {
                        KvEvent::BlockStored(s) => self.store(worker, s),
                        KvEvent::BlockRemoved(r) => self.remove(worker, r),
                        KvEvent::AllBlocksCleared => self.forget(worker),
                    }
                }
                self.forget_unheld(w);
                Outcome::Applied
            }
        }
    }

    /// At a batch's end: forgets worker `w`'s publisher hashes that the batch removed from
    /// their last medium and did not store again after (stores and removals of one hash in a
    /// batch apply in order, so the last one says whether the worker holds it).
    fn forget_unheld(&mut self, w: usize) {
        if self.unheld.is_empty() {
            return;
        }
        let mut unheld = std::mem::take(&mut self.unheld);
        let mut restored = std::mem::take(&mut self.restored);
        restored.sort_unstable();
        for &(h, removed) in &unheld {
            // The last store of `h` in the batch: the end of its run in the sorted list.
            let end = restored.partition_point(|&(r, _)| r <= h);
            let stored_after = end > 0 && restored[end - 1].0 == h && restored[end - 1].1 > removed;
            if !stored_after && self.ext[w].remove(h).is_some() && !self.more[w].is_empty() {
                self.more[w].remove(&h);
            }
        }
        unheld.clear();
        restored.clear();
        (self.unheld, self.restored) = (unheld, restored);
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
