//! The token ids of the blocks the cache holds, for its KV events. The cache itself keeps only
//! hashes; the scheduler half sees each prompt, so it notes a block's tokens when it asks the
//! worker to save the block, and fills them into the `BlockStored` events it hands out.
//!
//! A block's tokens are kept while some tier holds it, as the events themselves say (a store
//! adds a tier, a removal takes one away), so a block moving from the CPU tier to the SSD,
//! which is one removal and one store, keeps them. They are forgotten when the last tier lets
//! the block go. At most [`MAX_BLOCKS`] are kept (the oldest noted go first), so notes for
//! blocks that were never stored cannot grow without bound.

use kvconnect_api::KvEvent;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// Blocks whose tokens are kept at most.
pub const MAX_BLOCKS: usize = 1 << 20;

#[derive(Default)]
struct Entry {
    tokens: Arc<[u32]>,
    /// Tiers that hold the block, as the events so far say.
    tiers: u32,
}

/// Block hash → its tokens, for the events.
#[derive(Default)]
pub struct TokenBook {
    blocks: HashMap<u64, Entry>,
    /// Oldest noted first; may name blocks forgotten since (skipped when met).
    order: VecDeque<u64>,
}

impl TokenBook {
    /// Notes the tokens of block `hash`.
    pub fn note(&mut self, hash: u64, tokens: &[u32]) {
        // A hash names its tokens: a block noted before keeps what it has.
        if self.blocks.contains_key(&hash) {
            return;
        }
        self.blocks.insert(hash, Entry { tokens: tokens.into(), tiers: 0 });
        self.order.push_back(hash);
        while self.blocks.len() > MAX_BLOCKS {
            let Some(old) = self.order.pop_front() else { break };
            self.blocks.remove(&old);
        }
        if self.order.len() > 2 * self.blocks.len() + 1024 {
            let blocks = &self.blocks;
            self.order.retain(|h| blocks.contains_key(h));
        }
    }

    /// Fills in the tokens of each stored block of `events`, then counts the tiers each
    /// block is in and forgets the blocks that no tier holds any more.
    pub fn fill(&mut self, events: &mut [KvEvent]) {
        let mut emptied = HashSet::new();
        for ev in events.iter_mut() {
            match ev {
                KvEvent::BlockStored(s) => {
                    if s.token_ids.is_empty() {
                        let tokens: Option<Vec<u32>> = s
                            .block_hashes
                            .iter()
                            .map(|h| self.blocks.get(h).map(|e| e.tokens.to_vec()))
                            .collect::<Option<Vec<_>>>()
                            .map(|v| v.concat());
                        if let Some(t) =
                            tokens.filter(|t| t.len() == s.block_size as usize * s.block_hashes.len())
                        {
                            s.token_ids = t;
                        }
                    }
                    for h in &s.block_hashes {
                        if let Some(e) = self.blocks.get_mut(h) {
                            e.tiers += 1;
                            emptied.remove(h);
                        }
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    for h in &r.block_hashes {
                        if let Some(e) = self.blocks.get_mut(h) {
                            e.tiers = e.tiers.saturating_sub(1);
                            if e.tiers == 0 {
                                emptied.insert(*h);
                            }
                        }
                    }
                }
                KvEvent::AllBlocksCleared => {
                    for (h, e) in self.blocks.iter_mut() {
                        if e.tiers > 0 {
                            e.tiers = 0;
                            emptied.insert(*h);
                        }
                    }
                }
            }
        }
        for h in emptied {
            self.blocks.remove(&h);
        }
    }

    /// Blocks whose tokens are kept.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when no block's tokens are kept.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::Medium;

    fn stored(h: u64, medium: Medium) -> KvEvent {
        KvEvent::stored(vec![h], None, Vec::new(), 2, medium)
    }

    fn tokens(ev: &KvEvent) -> Vec<u32> {
        match ev {
            KvEvent::BlockStored(s) => s.token_ids.clone(),
            _ => panic!("{ev:?}"),
        }
    }

    #[test]
    fn a_move_between_tiers_keeps_the_tokens_and_the_last_removal_forgets_them() {
        let mut b = TokenBook::default();
        b.note(7, &[1, 2]);
        let mut evs = vec![stored(7, Medium::CpuTier)];
        b.fill(&mut evs);
        assert_eq!(tokens(&evs[0]), vec![1, 2]);
        // CPU to SSD: a removal then a store, in one batch.
        let mut evs = vec![KvEvent::removed(vec![7], Medium::CpuTier), stored(7, Medium::Disk)];
        b.fill(&mut evs);
        assert_eq!(tokens(&evs[1]), vec![1, 2], "the store after the move carries the tokens");
        assert_eq!(b.len(), 1);
        b.fill(&mut [KvEvent::removed(vec![7], Medium::Disk)]);
        assert!(b.is_empty(), "no tier holds it: forgotten");
        // A block nobody noted keeps its empty tokens.
        let mut evs = vec![stored(8, Medium::CpuTier)];
        b.fill(&mut evs);
        assert!(tokens(&evs[0]).is_empty());
    }

    #[test]
    fn a_clear_forgets_every_stored_block_but_not_one_still_to_be_stored() {
        let mut b = TokenBook::default();
        b.note(1, &[1, 1]);
        b.note(2, &[2, 2]);
        b.fill(&mut [stored(1, Medium::CpuTier)]);
        b.fill(&mut [KvEvent::AllBlocksCleared]);
        assert_eq!(b.len(), 1, "block 2 was noted for a save not stored yet");
        let mut evs = vec![stored(2, Medium::CpuTier)];
        b.fill(&mut evs);
        assert_eq!(tokens(&evs[0]), vec![2, 2]);
    }

    #[test]
    fn tokens_of_the_wrong_length_are_not_filled_in() {
        let mut b = TokenBook::default();
        b.note(3, &[1, 2, 3]);
        let mut evs = vec![stored(3, Medium::CpuTier)];
        b.fill(&mut evs);
        assert!(tokens(&evs[0]).is_empty(), "block size 2, three tokens noted");
    }
}
