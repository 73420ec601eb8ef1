//! The block index: for every block hash some worker holds, which workers hold it and in
//! which media. One hash map over all workers, keyed by the block's chained hash, so a
//! request's lookup walks its chain once, however many workers there are; and a worker's
//! prefix is the run of leading blocks it holds (a block held without its parent does not
//! count, as the engines cannot use it).
//!
//! What it costs: one 16-byte slot per distinct block in a flat table kept at most 3/4 full
//! (`flat`: its hash, the first holder inline, the index of a list of more holders), 4 bytes
//! per further worker holding it. A lookup costs one map probe per leading block of the
//! request plus one step per holder of each; a removal or a store one probe per block;
//! clearing a worker one pass over the whole map.

use crate::event::{fastest_rank, medium_bit, BlockHash, Medium, RANKS};
use crate::flat::{prefetch_line, FlatMap, Packed};
use kvconnect_support::stable_hash::PassThrough;
use std::hash::BuildHasherDefault;

/// A worker's number in the index (its position in the router's list).
pub type WorkerId = u16;

/// The media a worker holds a block in, one bit each (`event::medium_bit`).
pub type TierMask = u8;

/// Maps keyed by hashes that are already uniform: a hash is its own hash.
pub type IdBuild = BuildHasherDefault<PassThrough>;

/// One worker's hold on a block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Holder {
    worker: WorkerId,
    tiers: TierMask,
}

/// The workers holding one block: the first inline (no allocation for a block one worker
/// holds), the others in the index's `rest[more - 1]` (`more` 0: none, and a list there is
/// never empty). `first.tiers == 0`: nobody (and then no others). 8 bytes, so an index slot
/// is 16.
#[derive(Debug, Clone, Copy, Default)]
struct Holders {
    first: Holder,
    more: u32,
}

impl Packed for Holders {
    fn pack(self) -> u64 {
        u64::from(self.first.worker) | u64::from(self.first.tiers) << 16 | u64::from(self.more) << 32
    }
    fn unpack(word: u64) -> Holders {
        let first = Holder { worker: word as u16, tiers: (word >> 16) as u8 };
        Holders { first, more: (word >> 32) as u32 }
    }
}

/// The lists of further holders, shared by all entries, with the free ones to reuse.
#[derive(Debug, Clone, Default)]
struct Rest {
    lists: Vec<Vec<Holder>>,
    free: Vec<u32>,
}

impl Rest {
    fn of(&self, h: &Holders) -> &[Holder] {
        match h.more {
            0 => &[],
            m => &self.lists[m as usize - 1],
        }
    }

    fn iter<'a>(&'a self, h: &'a Holders) -> impl Iterator<Item = &'a Holder> {
        std::iter::once(&h.first).filter(|h| h.tiers != 0).chain(self.of(h).iter())
    }

    fn release(&mut self, h: &mut Holders) {
        if h.more != 0 {
            self.lists[h.more as usize - 1].clear();
            self.free.push(h.more);
            h.more = 0;
        }
    }

    fn push(&mut self, h: &mut Holders, holder: Holder) {
        if h.more == 0 {
            h.more = match self.free.pop() {
                Some(m) => m,
                None => {
                    // Never more lists than index entries at once (freed ones are reused),
                    // and 2^32 entries would be a table of over 64 GiB: the number fits.
                    self.lists.push(Vec::new());
                    self.lists.len() as u32
                }
            };
        }
        self.lists[h.more as usize - 1].push(holder);
    }

    /// Updates `worker`'s mask in `h` with `f`; returns (was held, is held). A block with
    /// one holder at most (most of them) is done here, inline; one with a list, in
    /// `update_listed`.
    #[inline]
    fn update(
        &mut self,
        h: &mut Holders,
        worker: WorkerId,
        f: impl FnOnce(TierMask) -> TierMask,
    ) -> (bool, bool) {
        if h.more != 0 {
            return self.update_listed(h, worker, f);
        }
        if h.first.tiers != 0 && h.first.worker == worker {
            h.first.tiers = f(h.first.tiers);
            return (true, h.first.tiers != 0);
        }
        self.hold(h, worker, f(0))
    }

    /// `worker`, not among `h`'s holders, now holds the block in the media of `t` (none where
    /// `t` is 0); returns (was held, is held).
    #[inline]
    fn hold(&mut self, h: &mut Holders, worker: WorkerId, t: TierMask) -> (bool, bool) {
        if t == 0 {
            return (false, false);
        }
        if h.first.tiers == 0 {
            h.first = Holder { worker, tiers: t };
        } else {
            self.push(h, Holder { worker, tiers: t });
        }
        (false, true)
    }

    /// [`Rest::update`] of a block with a list of further holders (`h.more` not 0).
    #[inline(never)]
    fn update_listed(
        &mut self,
        h: &mut Holders,
        worker: WorkerId,
        f: impl FnOnce(TierMask) -> TierMask,
    ) -> (bool, bool) {
        if h.first.tiers != 0 && h.first.worker == worker {
            h.first.tiers = f(h.first.tiers);
            if h.first.tiers == 0 && h.more != 0 {
                let list = &mut self.lists[h.more as usize - 1];
                if let Some(next) = list.pop() {
                    h.first = next;
                }
                if list.is_empty() {
                    self.release(h);
                }
            }
            return (true, h.first.worker == worker && h.first.tiers != 0);
        }
        let list = &mut self.lists[h.more as usize - 1];
        if let Some(i) = list.iter().position(|x| x.worker == worker) {
            let t = f(list[i].tiers);
            if t == 0 {
                list.swap_remove(i);
                if list.is_empty() {
                    self.release(h);
                }
            } else {
                list[i].tiers = t;
            }
            return (true, t != 0);
        }
        self.hold(h, worker, f(0))
    }
}

/// What one worker holds of a request's leading blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Overlap {
    /// Leading blocks held, in any medium.
    pub blocks: u32,
    /// Of those, how many have their fastest medium at each rank (`Medium::rank`: 0 the
    /// engine's own cache, 1 host memory, 2 disk, 3 remote).
    pub by_rank: [u32; RANKS],
}

/// The block index of a fixed set of workers.
#[derive(Debug, Clone)]
pub struct BlockIndex {
    map: FlatMap<Holders>,
    rest: Rest,
    /// Per worker: blocks held in at least one medium.
    held: Vec<u64>,
}

impl BlockIndex {
    /// An empty index of `workers` workers.
    pub fn new(workers: usize) -> BlockIndex {
        BlockIndex { map: FlatMap::new(), rest: Rest::default(), held: vec![0; workers] }
    }

    /// How many workers it indexes.
    pub fn workers(&self) -> usize {
        self.held.len()
    }

    /// Blocks `worker` holds in at least one medium.
    pub fn held(&self, worker: WorkerId) -> u64 {
        self.held.get(usize::from(worker)).copied().unwrap_or(0)
    }

    /// Distinct blocks held by any worker.
    pub fn distinct_blocks(&self) -> usize {
        self.map.len()
    }

    /// Prefetches `hash`'s first index slot (see `FlatMap::prefetch`), so that the cache misses
    /// of many hashes overlap before they are stored or removed one by one.
    #[inline]
    pub fn prefetch_slot(&self, hash: BlockHash) {
        self.map.prefetch(hash);
    }

    /// Prefetches `hash`'s list of further holders (a prefix many workers hold), each line of
    /// it (16 holders of 4 bytes to a line), which a store or removal scans for its worker.
    /// It reads the slot (best prefetched first), and only the first (most entries are there:
    /// a hint need not find every one).
    #[inline]
    pub fn prefetch_list(&self, hash: BlockHash) {
        if let Some(x) = self.map.get_at_home(hash).filter(|x| x.more != 0) {
            self.rest.lists[x.more as usize - 1].iter().step_by(16).for_each(prefetch_line);
        }
    }

    /// The media `worker` holds `hash` in.
    pub fn tiers(&self, worker: WorkerId, hash: BlockHash) -> TierMask {
        self.map
            .get(hash)
            .map_or(0, |h| self.rest.iter(&h).find(|h| h.worker == worker).map_or(0, |h| h.tiers))
    }

    /// `worker` now holds `hash` in `medium` too.
    pub fn store(&mut self, worker: WorkerId, hash: BlockHash, medium: &Medium) {
        self.store_in(worker, hash, medium_bit(medium));
    }

    /// [`BlockIndex::store`] in the medium of tier bit `bit` (`event::medium_bit`).
    pub fn store_in(&mut self, worker: WorkerId, hash: BlockHash, bit: TierMask) {
        let rest = &mut self.rest;
        let (was, is) = self.map.upsert(hash, |h| rest.update(h, worker, |t| t | bit));
        if !was && is {
            self.held[usize::from(worker)] += 1;
        }
    }

    /// `worker` no longer holds `hash` in `medium` (a block it did not hold there: nothing).
    /// Returns whether `worker` still holds it in another medium.
    pub fn remove(&mut self, worker: WorkerId, hash: BlockHash, medium: &Medium) -> bool {
        self.remove_from(worker, hash, medium_bit(medium))
    }

    /// [`BlockIndex::remove`] from the medium of tier bit `bit`.
    pub fn remove_from(&mut self, worker: WorkerId, hash: BlockHash, bit: TierMask) -> bool {
        let rest = &mut self.rest;
        let Some(((was, is), _)) = self.map.change(hash, |h| {
            let (was, is) = rest.update(h, worker, |t| t & !bit);
            // The entry goes with its last holder.
            ((was, is), h.first.tiers != 0)
        }) else {
            return false;
        };
        if was && !is {
            self.held[usize::from(worker)] -= 1;
        }
        is
    }

    /// Forgets every block of `worker` (one pass over the whole map).
    pub fn clear(&mut self, worker: WorkerId) {
        if self.held[usize::from(worker)] == 0 {
            return;
        }
        let rest = &mut self.rest;
        self.map.retain(|_, h| {
            rest.update(h, worker, |_| 0);
            h.first.tiers != 0
        });
        self.held[usize::from(worker)] = 0;
    }

    /// Each worker's [`Overlap`] with the chain `chain` (a request's block hashes in order),
    /// written into `out` (resized to one entry per worker). Stops at the first block no
    /// worker holds after a prefix.
    pub fn overlaps(&self, chain: &[BlockHash], out: &mut Vec<Overlap>) {
        out.clear();
        out.resize(self.held.len(), Overlap::default());
        for (i, hash) in chain.iter().enumerate() {
            let Some(holders) = self.map.get(*hash) else { break };
            let mut extended = false;
            for h in self.rest.iter(&holders) {
                let o = &mut out[usize::from(h.worker)];
                if o.blocks as usize == i {
                    o.blocks += 1;
                    o.by_rank[fastest_rank(h.tiers)] += 1;
                    extended = true;
                }
            }
            if !extended {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_counts_leading_blocks_only_at_their_fastest_medium() {
        let mut ix = BlockIndex::new(3);
        for h in [1, 2, 3] {
            ix.store(0, h, &Medium::Gpu);
        }
        ix.store(0, 2, &Medium::Disk);
        ix.store(1, 1, &Medium::Disk);
        ix.store(1, 3, &Medium::Gpu); // no block 2: block 3 is not a prefix of worker 1's
        let mut out = Vec::new();
        ix.overlaps(&[1, 2, 3, 4], &mut out);
        assert_eq!(out[0], Overlap { blocks: 3, by_rank: [3, 0, 0, 0] });
        assert_eq!(out[1], Overlap { blocks: 1, by_rank: [0, 0, 1, 0] });
        assert_eq!(out[2], Overlap::default());
        assert_eq!((ix.held(0), ix.held(1), ix.distinct_blocks()), (3, 2, 3));
    }

    /// Random stores, removals and clears over a few workers and blocks (so most blocks have
    /// several holders, and lists of further holders are taken, emptied and reused), checked
    /// against a plain map of (worker, block) to media after every step.
    #[test]
    fn agrees_with_a_plain_map_of_each_workers_media() {
        use std::collections::HashMap;
        let media = [Medium::Gpu, Medium::CpuTier, Medium::Disk];
        let mut ix = BlockIndex::new(6);
        let mut want: HashMap<(WorkerId, u64), TierMask> = HashMap::new();
        let mut x = 99u64;
        for _ in 0..20_000 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let (w, hash, m, op) =
                ((x >> 20) as u16 % 6, (x >> 30) % 12, &media[(x >> 40) as usize % 3], (x >> 50) % 100);
            let bit = medium_bit(m);
            if op < 55 {
                ix.store(w, hash, m);
                *want.entry((w, hash)).or_default() |= bit;
            } else if op < 99 {
                let still = ix.remove(w, hash, m);
                if let Some(t) = want.get_mut(&(w, hash)) {
                    *t &= !bit;
                }
                assert_eq!(still, want.get(&(w, hash)).is_some_and(|t| *t != 0));
            } else {
                ix.clear(w);
                want.retain(|k, _| k.0 != w);
            }
            want.retain(|_, t| *t != 0);
            for w in 0..6 {
                for hash in 0..12 {
                    assert_eq!(ix.tiers(w, hash), want.get(&(w, hash)).copied().unwrap_or(0));
                }
                assert_eq!(ix.held(w), want.keys().filter(|k| k.0 == w).count() as u64);
            }
            let distinct: std::collections::HashSet<u64> = want.keys().map(|k| k.1).collect();
            assert_eq!(ix.distinct_blocks(), distinct.len());
        }
    }

    #[test]
    fn removals_are_per_medium_and_clear_forgets_one_worker() {
        let mut ix = BlockIndex::new(2);
        ix.store(0, 7, &Medium::CpuTier);
        ix.store(1, 7, &Medium::Gpu);
        // A block moving from the CPU tier to disk: one removal, one store.
        ix.remove(0, 7, &Medium::CpuTier);
        ix.store(0, 7, &Medium::Disk);
        assert_eq!(ix.tiers(0, 7), medium_bit(&Medium::Disk));
        assert_eq!(ix.held(0), 1);
        assert!(ix.remove(0, 7, &Medium::Gpu), "not held on the GPU: nothing changes, still on disk");
        assert_eq!(ix.held(0), 1);
        ix.clear(1);
        assert_eq!((ix.held(1), ix.tiers(1, 7), ix.distinct_blocks()), (0, 0, 1));
        ix.remove(0, 7, &Medium::Disk);
        assert_eq!((ix.held(0), ix.distinct_blocks()), (0, 0));
    }
}
