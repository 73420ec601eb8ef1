//! The engine's own prefix cache (vLLM's automatic prefix caching): full prompt blocks are
//! known by a hash chained over their tokens and every earlier block, so a later prompt that
//! starts with the same tokens reuses their KV instead of computing it.
//!
//! This is bookkeeping only; the block pool owns the blocks and their reference counts. Per
//! KV cache group it keeps which block holds which hash, and which of those no request uses
//! now (idle: reusable on a hit, taken back oldest first when the pool runs out of free
//! blocks).

use kvconnect_api::{KvEvent, Medium};
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// The chained hashes of a prompt's full blocks of `block_size` tokens.
pub fn block_hashes(prompt: &[u32], block_size: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(prompt.len() / block_size.max(1));
    let mut parent = 0u64;
    for block in prompt.chunks_exact(block_size.max(1)) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        parent.hash(&mut h);
        block.hash(&mut h);
        parent = h.finish();
        out.push(parent);
    }
    out
}

#[derive(Debug, Default)]
struct Group {
    by_hash: HashMap<u64, u32>,
    hash_of: HashMap<u32, u64>,
    /// Idle cached blocks by the tick they went idle.
    idle: BTreeMap<u64, u32>,
    idle_since: HashMap<u32, u64>,
}

/// The prefix cache of a pool with `groups` KV cache groups.
#[derive(Debug, Default)]
pub struct PrefixCache {
    groups: Vec<Group>,
    tick: u64,
    /// KV events of group 0 (the blocks every group caches alike) since they were last
    /// taken; `None` while no one takes them.
    events: Option<Vec<KvEvent>>,
}

impl PrefixCache {
    /// An empty cache.
    pub fn new(groups: usize) -> PrefixCache {
        PrefixCache { groups: (0..groups).map(|_| Group::default()).collect(), tick: 0, events: None }
    }

    /// Keeps KV events from now on (`take_events` must then be called regularly).
    pub fn enable_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events since the last call: blocks registered (stored) and evicted (removed), in
    /// the engine's host memory (`CPU`, as vLLM names a CPU build's prefix cache).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Publishes the store of a block group 0 registered: its hash, its parent's, its tokens.
    pub fn stored_event(&mut self, hash: u64, parent: Option<u64>, tokens: &[u32]) {
        if let Some(ev) = &mut self.events {
            ev.push(KvEvent::stored(vec![hash], parent, tokens.to_vec(), tokens.len() as u32, Medium::Cpu));
        }
    }

    /// Records that `block` of `group` holds the full block with `hash`; false (nothing
    /// recorded) when another block already holds it or this block holds another hash.
    pub fn register(&mut self, group: usize, block: u32, hash: u64) -> bool {
        let Some(g) = self.groups.get_mut(group) else { return false };
        if g.by_hash.contains_key(&hash) || g.hash_of.contains_key(&block) {
            return false;
        }
        g.by_hash.insert(hash, block);
        g.hash_of.insert(block, hash);
        true
    }

    /// True when `block` of `group` holds a cached hash.
    pub fn is_cached(&self, group: usize, block: u32) -> bool {
        self.groups.get(group).is_some_and(|g| g.hash_of.contains_key(&block))
    }

    /// The blocks holding the longest run of `hashes` from the start that every group has,
    /// one list per group.
    pub fn lookup(&self, hashes: &[u64]) -> Vec<Vec<u32>> {
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); self.groups.len()];
        'blocks: for h in hashes {
            let mut found = Vec::with_capacity(self.groups.len());
            for g in &self.groups {
                match g.by_hash.get(h) {
                    Some(b) => found.push(*b),
                    None => break 'blocks,
                }
            }
            for (list, b) in out.iter_mut().zip(found) {
                list.push(b);
            }
        }
        out
    }

    /// A cached block no request uses any more: reusable, and evictable.
    pub fn set_idle(&mut self, group: usize, block: u32) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(g) = self.groups.get_mut(group) {
            if let Some(old) = g.idle_since.insert(block, tick) {
                g.idle.remove(&old);
            }
            g.idle.insert(tick, block);
        }
    }

    /// A request uses the cached `block` again.
    pub fn set_busy(&mut self, group: usize, block: u32) {
        if let Some(g) = self.groups.get_mut(group) {
            if let Some(t) = g.idle_since.remove(&block) {
                g.idle.remove(&t);
            }
        }
    }

    /// Idle blocks of `group`.
    pub fn idle(&self, group: usize) -> usize {
        self.groups.get(group).map_or(0, |g| g.idle.len())
    }

    /// Takes the longest-idle block of `group` out of the cache (its hash forgotten).
    pub fn evict(&mut self, group: usize) -> Option<u32> {
        let g = self.groups.get_mut(group)?;
        let (_, block) = g.idle.pop_first()?;
        g.idle_since.remove(&block);
        if let Some(h) = g.hash_of.remove(&block) {
            g.by_hash.remove(&h);
            if let (0, Some(ev)) = (group, &mut self.events) {
                ev.push(KvEvent::removed(vec![h], Medium::Cpu));
            }
        }
        Some(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_over_earlier_blocks_and_ignore_a_partial_tail() {
        let a: Vec<u32> = (0..40).collect();
        let ha = block_hashes(&a, 16);
        assert_eq!(ha.len(), 2);
        let mut b = a.clone();
        b[3] = 99; // only the first block differs
        let hb = block_hashes(&b, 16);
        assert_ne!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1], "the second block's hash covers the first");
        assert_eq!(block_hashes(&a[..32], 16), ha);
    }

    #[test]
    fn lookup_takes_the_run_every_group_has() {
        let mut c = PrefixCache::new(2);
        for (i, h) in [10u64, 11, 12].iter().enumerate() {
            assert!(c.register(0, i as u32, *h));
        }
        c.register(1, 7, 10);
        c.register(1, 8, 11);
        assert_eq!(c.lookup(&[10, 11, 12]), vec![vec![0, 1], vec![7, 8]]);
        assert_eq!(c.lookup(&[12]), vec![Vec::<u32>::new(), vec![]], "group 1 lacks it");
        assert!(!c.register(0, 5, 10), "a hash is held by one block");
        assert!(!c.register(0, 0, 99), "a block holds one hash");
    }

    #[test]
    fn idle_blocks_are_evicted_oldest_first_and_reuse_makes_them_busy() {
        let mut c = PrefixCache::new(1);
        for b in 0..3u32 {
            c.register(0, b, 100 + b as u64);
            c.set_idle(0, b);
        }
        c.set_busy(0, 0);
        assert_eq!(c.idle(0), 2);
        assert_eq!(c.evict(0), Some(1));
        assert!(!c.is_cached(0, 1));
        assert_eq!(c.lookup(&[101]), vec![Vec::<u32>::new()]);
        c.set_idle(0, 0);
        assert_eq!(c.evict(0), Some(2));
        assert_eq!(c.evict(0), Some(0));
        assert_eq!(c.evict(0), None);
    }
}
