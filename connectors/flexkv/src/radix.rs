//! The block index: a radix tree over chained block hashes, with per-tier LRU lists and
//! reference counts. Metadata only: it never touches block bytes, files or threads.
//!
//! Every node is one block (block granularity). Because a block's hash is chained from its
//! parent's, the hash alone names the whole prefix, so the nodes sit in one hash table and a
//! node's edge to its parent is a stored index; the tree shape (parent links, child counts)
//! is what keeps the cache prefix-closed: a node is removed only when it is a leaf, so every
//! cached block stays reachable from the root. Matching walks the prompt's hashes and stops
//! at the first block that is missing, not ready, or whose parent link disagrees. While no
//! block that is not ready has children (the usual case: pending blocks are leaves until
//! they are ready), "block i matches" holds for a prefix of the prompt and fails after it,
//! since a ready block's ancestors are all in the tree and ready and, the hashes being
//! chained, are the prompt's earlier blocks; the matched length is then found by bisection
//! (about log2(n) probes, each checking the block and its parent link) instead of a walk.
//!
//! Each tier (CPU, SSD) has an intrusive doubly linked LRU list of the nodes holding a copy
//! there (O(1) touch). Touching a matched path moves it to the front deepest-first and a new
//! copy goes right behind its parent, so ancestors tend to be more recent than their
//! descendants and the LRU end holds leaves; eviction that would drop a block from the tree
//! still checks for children and skips inner nodes.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

/// Index of a node in the arena.
pub type NodeIdx = u32;
const NIL: u32 = u32::MAX;

/// A storage tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Host memory.
    Cpu = 0,
    /// The SSD file.
    Ssd = 1,
}

impl Tier {
    /// The name used in events and stats.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Cpu => "cpu",
            Tier::Ssd => "ssd",
        }
    }

    /// The medium KV events name: `cpu_tier` for host memory, `disk` for the SSD file.
    pub fn medium(self) -> kvconnect_api::Medium {
        match self {
            Tier::Cpu => kvconnect_api::Medium::CpuTier,
            Tier::Ssd => kvconnect_api::Medium::Disk,
        }
    }
}

/// Block hashes are already well mixed, so the table uses them as they are.
pub use kvconnect_support::stable_hash::PassThrough;

/// The life of a node's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// A save is writing it; not matchable.
    Pending,
    /// Holds valid data in at least one tier.
    Ready,
    /// Lost its data (a corrupted SSD record); kept only while it is referenced or has
    /// children, never matched.
    Dead,
}

#[derive(Debug, Clone)]
struct Node {
    hash: u64,
    parent: NodeIdx,
    children: u32,
    refs: u32,
    state: State,
    slot: [Option<u32>; 2],
    prev: [NodeIdx; 2],
    next: [NodeIdx; 2],
}

#[derive(Debug, Clone, Copy)]
struct List {
    head: NodeIdx,
    tail: NodeIdx,
    len: u32,
}

impl Default for List {
    fn default() -> Self {
        List { head: NIL, tail: NIL, len: 0 }
    }
}

/// What `insert_pending` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Insert {
    /// A new (or revived dead) node, pending and referenced once by the caller.
    Created,
    /// The block is already cached or being saved.
    Present,
    /// Its parent is not cached and ready: saving it would leave it unreachable.
    NoParent,
}

/// A snapshot of one node for the cache layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeView {
    /// Its state.
    pub state: State,
    /// Slot in each tier.
    pub cpu: Option<u32>,
    /// Slot in the SSD tier.
    pub ssd: Option<u32>,
    /// References.
    pub refs: u32,
    /// Children.
    pub children: u32,
}

/// The radix tree.
#[derive(Default)]
pub struct RadixIndex {
    nodes: Vec<Node>,
    free: Vec<NodeIdx>,
    map: HashMap<u64, NodeIdx, BuildHasherDefault<PassThrough>>,
    lists: [List; 2],
    /// Blocks that are not ready but have children: while there are none, matching bisects.
    blocking: usize,
}

/// Whether a node keeps a ready descendant behind a block that does not match.
fn blocks(n: &Node) -> bool {
    n.state != State::Ready && n.children > 0
}

impl RadixIndex {
    /// An empty tree.
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks in the tree (any state).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when the tree holds no block.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Blocks holding a copy in `tier`.
    pub fn tier_len(&self, tier: Tier) -> usize {
        self.lists[tier as usize].len as usize
    }

    /// Length of the longest cached, ready prefix of `hashes`.
    pub fn match_len(&self, hashes: &[u64]) -> usize {
        if self.blocking == 0 {
            return self.bisect(hashes);
        }
        self.walk(hashes)
    }

    /// Whether block `i` of `hashes` is in the tree, ready, and a child of block `i - 1`
    /// (a first block of none).
    fn links(&self, hashes: &[u64], i: usize) -> bool {
        let Some(&idx) = self.map.get(&hashes[i]) else { return false };
        let n = &self.nodes[idx as usize];
        let parent = match i.checked_sub(1) {
            None => NIL,
            Some(p) => match self.map.get(&hashes[p]) {
                Some(&p) => p,
                None => return false,
            },
        };
        n.state == State::Ready && n.parent == parent
    }

    /// The matched length when no block that is not ready has children (module docs).
    fn bisect(&self, hashes: &[u64]) -> usize {
        let (mut lo, mut hi) = (0, hashes.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.links(hashes, mid) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// The matched length, block by block.
    fn walk(&self, hashes: &[u64]) -> usize {
        let mut parent = NIL;
        for (i, h) in hashes.iter().enumerate() {
            match self.map.get(h) {
                Some(&idx) => {
                    let n = &self.nodes[idx as usize];
                    if n.parent != parent || n.state != State::Ready {
                        return i;
                    }
                    parent = idx;
                }
                None => return i,
            }
        }
        hashes.len()
    }

    /// Matches the longest ready prefix of at most `max` blocks, marks it most recently used
    /// and takes one reference on each matched block. Returns how many.
    pub fn match_and_pin(&mut self, hashes: &[u64], max: usize) -> usize {
        let n = self.match_len(&hashes[..max.min(hashes.len())]);
        // Deepest first, so ancestors end up more recent than descendants; the matched
        // blocks are the deepest one and its ancestors.
        let mut idx = match n.checked_sub(1) {
            Some(last) => self.map.get(&hashes[last]).copied().unwrap_or(NIL),
            None => NIL,
        };
        for _ in 0..n {
            if idx == NIL {
                break;
            }
            self.nodes[idx as usize].refs += 1;
            self.touch_idx(idx);
            idx = self.nodes[idx as usize].parent;
        }
        n
    }

    /// Changes node `idx` through `f`, keeping the count of blocking nodes.
    fn update(&mut self, idx: NodeIdx, f: impl FnOnce(&mut Node)) {
        let n = &mut self.nodes[idx as usize];
        let before = blocks(n);
        f(n);
        let after = blocks(n);
        match (before, after) {
            (false, true) => self.blocking += 1,
            (true, false) => self.blocking -= 1,
            _ => {}
        }
    }

    /// Marks the path ending at `hash` most recently used (deepest first).
    pub fn touch_path(&mut self, hash: u64) {
        let mut idx = self.map.get(&hash).copied().unwrap_or(NIL);
        while idx != NIL {
            self.touch_idx(idx);
            idx = self.nodes[idx as usize].parent;
        }
    }

    fn touch_idx(&mut self, idx: NodeIdx) {
        for t in [Tier::Cpu, Tier::Ssd] {
            if self.nodes[idx as usize].slot[t as usize].is_some() {
                self.unlink(t, idx);
                self.push_front(t, idx);
            }
        }
    }

    /// Takes one more reference on a block. False when it is not in the tree.
    pub fn pin(&mut self, hash: u64) -> bool {
        match self.map.get(&hash) {
            Some(&idx) => {
                self.nodes[idx as usize].refs += 1;
                true
            }
            None => false,
        }
    }

    /// Drops one reference. A dead leaf whose last reference goes is removed (dead nodes
    /// hold no slots, so nothing is leaked).
    pub fn unpin(&mut self, hash: u64) {
        let Some(&idx) = self.map.get(&hash) else { return };
        let n = &mut self.nodes[idx as usize];
        n.refs = n.refs.saturating_sub(1);
        if n.refs == 0 && n.state == State::Dead && n.children == 0 && n.slot == [None, None] {
            self.remove_idx(idx);
        }
    }

    /// Every block's hash, in no particular order.
    pub fn hashes(&self) -> Vec<u64> {
        self.map.keys().copied().collect()
    }

    /// The hash of the block before `hash` in its prefix; `None` for a first block or a block
    /// not here.
    pub fn parent_of(&self, hash: u64) -> Option<u64> {
        let &idx = self.map.get(&hash)?;
        let p = self.nodes[idx as usize].parent;
        (p != NIL).then(|| self.nodes[p as usize].hash)
    }

    /// A snapshot of a block's node.
    pub fn get(&self, hash: u64) -> Option<NodeView> {
        self.map.get(&hash).map(|&idx| {
            let n = &self.nodes[idx as usize];
            NodeView { state: n.state, cpu: n.slot[0], ssd: n.slot[1], refs: n.refs, children: n.children }
        })
    }

    /// Adds `hash` under `parent` (None: a first block) as pending, referenced once.
    pub fn insert_pending(&mut self, hash: u64, parent: Option<u64>) -> Insert {
        let pidx = match parent {
            None => NIL,
            Some(p) => match self.map.get(&p) {
                Some(&i) if self.nodes[i as usize].state == State::Ready => i,
                _ => return Insert::NoParent,
            },
        };
        if let Some(&idx) = self.map.get(&hash) {
            let n = &self.nodes[idx as usize];
            if n.state == State::Dead && n.parent == pidx {
                self.update(idx, |n| {
                    n.state = State::Pending;
                    n.refs += 1;
                });
                return Insert::Created;
            }
            return Insert::Present;
        }
        let node = Node {
            hash,
            parent: pidx,
            children: 0,
            refs: 1,
            state: State::Pending,
            slot: [None, None],
            prev: [NIL; 2],
            next: [NIL; 2],
        };
        let idx = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeIdx
            }
        };
        self.map.insert(hash, idx);
        if pidx != NIL {
            self.update(pidx, |p| p.children += 1);
        }
        Insert::Created
    }

    /// Marks a pending block ready (its data is written).
    pub fn mark_ready(&mut self, hash: u64) {
        if let Some(&idx) = self.map.get(&hash) {
            self.update(idx, |n| n.state = State::Ready);
        }
    }

    /// Marks a block dead: its data is gone. Returns the slots it held, now detached.
    pub fn mark_dead(&mut self, hash: u64) -> [Option<u32>; 2] {
        let Some(&idx) = self.map.get(&hash) else { return [None, None] };
        let slots = [self.take_slot(idx, Tier::Cpu), self.take_slot(idx, Tier::Ssd)];
        self.update(idx, |n| n.state = State::Dead);
        let n = &self.nodes[idx as usize];
        if n.refs == 0 && n.children == 0 {
            self.remove_idx(idx);
        }
        slots
    }

    /// Records that `hash` has a copy in `slot` of `tier` (most recently used there).
    pub fn set_slot(&mut self, hash: u64, tier: Tier, slot: u32) {
        let Some(&idx) = self.map.get(&hash) else { return };
        if self.nodes[idx as usize].slot[tier as usize].is_some() {
            self.unlink(tier, idx);
        }
        self.nodes[idx as usize].slot[tier as usize] = Some(slot);
        // Right behind its parent when the parent is in this tier, so the parent stays the
        // more recent of the two and the LRU end keeps holding leaves.
        let parent = self.nodes[idx as usize].parent;
        if parent != NIL && self.nodes[parent as usize].slot[tier as usize].is_some() {
            self.insert_after(tier, parent, idx);
        } else {
            self.push_front(tier, idx);
        }
    }

    /// Forgets `hash`'s copy in `tier`; returns its slot.
    pub fn clear_slot(&mut self, hash: u64, tier: Tier) -> Option<u32> {
        let idx = *self.map.get(&hash)?;
        self.take_slot(idx, tier)
    }

    fn take_slot(&mut self, idx: NodeIdx, tier: Tier) -> Option<u32> {
        let s = self.nodes[idx as usize].slot[tier as usize].take();
        if s.is_some() {
            self.unlink(tier, idx);
        }
        s
    }

    /// Removes a leaf block with no references; returns its slots. None when it is not in
    /// the tree, referenced, or has children.
    pub fn remove(&mut self, hash: u64) -> Option<[Option<u32>; 2]> {
        let idx = *self.map.get(&hash)?;
        let n = &self.nodes[idx as usize];
        if n.refs > 0 || n.children > 0 {
            return None;
        }
        let slots = [self.take_slot(idx, Tier::Cpu), self.take_slot(idx, Tier::Ssd)];
        self.remove_idx(idx);
        Some(slots)
    }

    /// Removes a pending block whose save failed (the saver holds its only reference).
    pub fn abandon(&mut self, hash: u64) -> [Option<u32>; 2] {
        let Some(&idx) = self.map.get(&hash) else { return [None, None] };
        let slots = [self.take_slot(idx, Tier::Cpu), self.take_slot(idx, Tier::Ssd)];
        self.update(idx, |n| {
            n.refs = n.refs.saturating_sub(1);
            n.state = State::Dead;
        });
        let n = &self.nodes[idx as usize];
        if n.refs == 0 && n.children == 0 {
            self.remove_idx(idx);
        }
        slots
    }

    fn remove_idx(&mut self, idx: NodeIdx) {
        let (hash, parent) = {
            let n = &self.nodes[idx as usize];
            (n.hash, n.parent)
        };
        self.map.remove(&hash);
        self.free.push(idx);
        if parent != NIL {
            self.update(parent, |p| p.children -= 1);
            let p = &self.nodes[parent as usize];
            // A dead parent that was kept only for this child goes too.
            if p.children == 0 && p.refs == 0 && p.state == State::Dead && p.slot == [None, None] {
                self.remove_idx(parent);
            }
        }
    }

    /// The least recently used block in `tier` that may give up its copy there: ready,
    /// unreferenced and, when `must_be_leaf`, without children. Scans from the LRU end.
    pub fn lru_victim(&self, tier: Tier, must_be_leaf: impl Fn(&NodeView) -> bool) -> Option<u64> {
        let mut idx = self.lists[tier as usize].tail;
        while idx != NIL {
            let n = &self.nodes[idx as usize];
            let view = NodeView {
                state: n.state,
                cpu: n.slot[0],
                ssd: n.slot[1],
                refs: n.refs,
                children: n.children,
            };
            if n.refs == 0 && n.state == State::Ready && !(must_be_leaf(&view) && n.children > 0) {
                return Some(n.hash);
            }
            idx = n.prev[tier as usize];
        }
        None
    }

    fn unlink(&mut self, t: Tier, idx: NodeIdx) {
        let ti = t as usize;
        let (p, nx) = (self.nodes[idx as usize].prev[ti], self.nodes[idx as usize].next[ti]);
        if p != NIL {
            self.nodes[p as usize].next[ti] = nx;
        } else {
            self.lists[ti].head = nx;
        }
        if nx != NIL {
            self.nodes[nx as usize].prev[ti] = p;
        } else {
            self.lists[ti].tail = p;
        }
        self.nodes[idx as usize].prev[ti] = NIL;
        self.nodes[idx as usize].next[ti] = NIL;
        self.lists[ti].len -= 1;
    }

    fn insert_after(&mut self, t: Tier, at: NodeIdx, idx: NodeIdx) {
        let ti = t as usize;
        let nx = self.nodes[at as usize].next[ti];
        self.nodes[idx as usize].prev[ti] = at;
        self.nodes[idx as usize].next[ti] = nx;
        self.nodes[at as usize].next[ti] = idx;
        if nx != NIL {
            self.nodes[nx as usize].prev[ti] = idx;
        } else {
            self.lists[ti].tail = idx;
        }
        self.lists[ti].len += 1;
    }

    fn push_front(&mut self, t: Tier, idx: NodeIdx) {
        let ti = t as usize;
        let old = self.lists[ti].head;
        self.nodes[idx as usize].prev[ti] = NIL;
        self.nodes[idx as usize].next[ti] = old;
        if old != NIL {
            self.nodes[old as usize].prev[ti] = idx;
        } else {
            self.lists[ti].tail = idx;
        }
        self.lists[ti].head = idx;
        self.lists[ti].len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(ix: &mut RadixIndex, hashes: &[u64], tier: Tier) {
        let mut parent = None;
        for (i, h) in hashes.iter().enumerate() {
            assert_eq!(ix.insert_pending(*h, parent), Insert::Created);
            ix.set_slot(*h, tier, i as u32);
            ix.mark_ready(*h);
            ix.unpin(*h);
            parent = Some(*h);
        }
    }

    #[test]
    fn longest_prefix_of_every_length() {
        let mut ix = RadixIndex::new();
        let a: Vec<u64> = (1..=10).collect();
        chain(&mut ix, &a, Tier::Cpu);
        for n in 0..=10 {
            let mut q = a[..n].to_vec();
            q.extend([100, 101]);
            assert_eq!(ix.match_len(&q), n);
        }
        // A diverging branch shares the prefix.
        let mut b = a[..4].to_vec();
        b.extend([50, 51]);
        assert_eq!(ix.insert_pending(50, Some(4)), Insert::Created);
        ix.mark_ready(50);
        ix.unpin(50);
        assert_eq!(ix.match_len(&b), 5);
        assert_eq!(ix.get(4).unwrap().children, 2);
        // A hash present under another parent does not match here.
        assert_eq!(ix.match_len(&[2]), 0);
    }

    #[test]
    fn pending_and_dead_are_not_matched_and_no_parent_is_refused() {
        let mut ix = RadixIndex::new();
        assert_eq!(ix.insert_pending(1, None), Insert::Created);
        assert_eq!(ix.match_len(&[1]), 0);
        assert_eq!(ix.insert_pending(2, Some(1)), Insert::NoParent);
        ix.mark_ready(1);
        assert_eq!(ix.match_len(&[1]), 1);
        assert_eq!(ix.insert_pending(1, None), Insert::Present);
        ix.mark_dead(1);
        assert_eq!(ix.match_len(&[1]), 0);
        ix.unpin(1);
        assert!(ix.is_empty());
    }

    /// A chained block hash, as `hash::block_hashes` makes them: a block's hash names its
    /// whole prefix.
    fn link(parent: u64, token: u64) -> u64 {
        let mut z = parent ^ token.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z ^ (z >> 31)
    }

    #[test]
    fn bisection_matches_the_walk_through_saves_deaths_revivals_and_removals() {
        let mut ix = RadixIndex::new();
        let mut rng = 0x1234_5678u64;
        let mut next = move |n: u64| {
            rng = link(rng, 1);
            rng % n
        };
        // Prompts over a 3-token alphabet, so they share prefixes and branch.
        let prompt = |toks: &[u64]| {
            let mut h = 7;
            toks.iter()
                .map(|t| {
                    h = link(h, *t);
                    h
                })
                .collect::<Vec<u64>>()
        };
        let mut bisected = 0;
        for round in 0..3000 {
            let toks: Vec<u64> = (0..1 + next(12)).map(|_| next(3)).collect();
            let hashes = prompt(&toks);
            let at = next(hashes.len() as u64) as usize;
            let h = hashes[at];
            match next(6) {
                0 | 1 => {
                    if ix.insert_pending(h, at.checked_sub(1).map(|p| hashes[p])) == Insert::Created {
                        if next(4) > 0 {
                            ix.mark_ready(h);
                        }
                        ix.unpin(h);
                    }
                }
                2 => {
                    ix.mark_dead(h);
                }
                3 => {
                    ix.remove(h);
                }
                4 => {
                    ix.mark_ready(h);
                }
                _ => {
                    let n = ix.match_and_pin(&hashes, hashes.len());
                    assert_eq!(n, ix.walk(&hashes));
                    for x in &hashes[..n] {
                        ix.unpin(*x);
                    }
                }
            }
            let blocking = ix.map.values().filter(|&&i| blocks(&ix.nodes[i as usize])).count();
            assert_eq!(ix.blocking, blocking, "round {round}");
            for _ in 0..4 {
                let q: Vec<u64> = (0..1 + next(14)).map(|_| next(3)).collect();
                let q = prompt(&q);
                assert_eq!(ix.match_len(&q), ix.walk(&q), "round {round}");
                bisected += usize::from(ix.blocking == 0);
            }
        }
        assert!(bisected > 1000, "the bisection ran ({bisected} queries)");
        assert!(ix.len() > 10, "the tree grew ({} blocks)", ix.len());
    }

    #[test]
    fn lru_victims_are_unreferenced_leaves_first() {
        let mut ix = RadixIndex::new();
        chain(&mut ix, &[1, 2, 3], Tier::Cpu);
        chain(&mut ix, &[10, 11], Tier::Cpu);
        // Touching the first chain makes the second the LRU one; its leaf goes first.
        ix.touch_path(3);
        assert_eq!(ix.lru_victim(Tier::Cpu, |_| true), Some(11));
        assert_eq!(ix.match_and_pin(&[10, 11], 2), 2);
        assert_eq!(ix.lru_victim(Tier::Cpu, |_| true), Some(3));
        ix.unpin(10);
        ix.unpin(11);
        assert_eq!(ix.remove(11).unwrap(), [Some(1), None]);
        assert_eq!(ix.remove(2), None, "not a leaf");
        assert_eq!(ix.match_len(&[10, 11]), 1);
        assert_eq!(ix.tier_len(Tier::Cpu), 4);
    }
}
