//! The block index: for every block hash some worker holds, which workers hold it and in
//! which media. One hash map over all workers, keyed by the block's chained hash, so a
//! request's lookup walks its chain once, however many workers there are; and a worker's
//! prefix is the run of leading blocks it holds (a block held without its parent does not
//! count, as the engines cannot use it).
//!
//! What it costs: one map entry per distinct block (its hash, the first holder inline, more
//! holders in a vector), 4 bytes per further worker holding it. A lookup costs one map probe
//! per leading block of the request plus one step per holder of each; a removal or a store
//! one probe per block; clearing a worker one pass over the whole map.

use crate::event::{fastest_rank, medium_bit, BlockHash, Medium, RANKS};
use kvconnect_support::stable_hash::PassThrough;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

/// A worker's number in the index (its position in the router's list).
pub type WorkerId = u16;

/// The media a worker holds a block in, one bit each (`event::medium_bit`).
pub type TierMask = u8;

/// Maps keyed by hashes that are already uniform: a hash is its own hash.
pub type IdBuild = BuildHasherDefault<PassThrough>;

/// One worker's hold on a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    worker: WorkerId,
    tiers: TierMask,
}

/// The workers holding one block: the first inline (no allocation for a block one worker
/// holds), the others in `rest`. `first.tiers == 0`: nobody.
#[derive(Debug, Clone)]
struct Holders {
    first: Holder,
    rest: Vec<Holder>,
}

impl Holders {
    fn iter(&self) -> impl Iterator<Item = &Holder> {
        std::iter::once(&self.first).filter(|h| h.tiers != 0).chain(self.rest.iter())
    }

    fn is_empty(&self) -> bool {
        self.first.tiers == 0 && self.rest.is_empty()
    }

    /// Updates `worker`'s mask with `f`; returns (was held, is held).
    fn update(&mut self, worker: WorkerId, f: impl FnOnce(TierMask) -> TierMask) -> (bool, bool) {
        if self.first.tiers != 0 && self.first.worker == worker {
            let before = self.first.tiers;
            self.first.tiers = f(before);
            if self.first.tiers == 0 {
                if let Some(h) = self.rest.pop() {
                    self.first = h;
                }
            }
            return (true, self.first.worker == worker && self.first.tiers != 0);
        }
        if let Some(i) = self.rest.iter().position(|h| h.worker == worker) {
            let t = f(self.rest[i].tiers);
            if t == 0 {
                self.rest.swap_remove(i);
            } else {
                self.rest[i].tiers = t;
            }
            return (true, t != 0);
        }
        let t = f(0);
        if t == 0 {
            return (false, false);
        }
        if self.first.tiers == 0 {
            self.first = Holder { worker, tiers: t };
        } else {
            self.rest.push(Holder { worker, tiers: t });
        }
        (false, true)
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
    map: HashMap<BlockHash, Holders, IdBuild>,
    /// Per worker: blocks held in at least one medium.
    held: Vec<u64>,
}

impl BlockIndex {
    /// An empty index of `workers` workers.
    pub fn new(workers: usize) -> BlockIndex {
        BlockIndex { map: HashMap::default(), held: vec![0; workers] }
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

    /// The media `worker` holds `hash` in.
    pub fn tiers(&self, worker: WorkerId, hash: BlockHash) -> TierMask {
        self.map.get(&hash).and_then(|h| h.iter().find(|h| h.worker == worker)).map_or(0, |h| h.tiers)
    }

    /// `worker` now holds `hash` in `medium` too.
    pub fn store(&mut self, worker: WorkerId, hash: BlockHash, medium: &Medium) {
        let bit = medium_bit(medium);
        let holders = self
            .map
            .entry(hash)
            .or_insert_with(|| Holders { first: Holder { worker, tiers: 0 }, rest: Vec::new() });
        let (was, is) = holders.update(worker, |t| t | bit);
        if !was && is {
            self.held[usize::from(worker)] += 1;
        }
    }

    /// `worker` no longer holds `hash` in `medium` (a block it did not hold there: nothing).
    pub fn remove(&mut self, worker: WorkerId, hash: BlockHash, medium: &Medium) {
        let bit = medium_bit(medium);
        let Some(holders) = self.map.get_mut(&hash) else { return };
        let (was, is) = holders.update(worker, |t| t & !bit);
        if was && !is {
            self.held[usize::from(worker)] -= 1;
        }
        if holders.is_empty() {
            self.map.remove(&hash);
        }
    }

    /// Forgets every block of `worker` (one pass over the whole map).
    pub fn clear(&mut self, worker: WorkerId) {
        if self.held[usize::from(worker)] == 0 {
            return;
        }
        self.map.retain(|_, h| {
            h.update(worker, |_| 0);
            !h.is_empty()
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
            let Some(holders) = self.map.get(hash) else { break };
            let mut extended = false;
            for h in holders.iter() {
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
        ix.remove(0, 7, &Medium::Gpu); // not held there: nothing changes
        assert_eq!(ix.held(0), 1);
        ix.clear(1);
        assert_eq!((ix.held(1), ix.tiers(1, 7), ix.distinct_blocks()), (0, 0, 1));
        ix.remove(0, 7, &Medium::Disk);
        assert_eq!((ix.held(0), ix.distinct_blocks()), (0, 0));
    }
}
