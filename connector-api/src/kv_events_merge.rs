//! One event stream out of several children's (the composite's): a block is reported stored
//! in a medium when the first child stores it there, and removed when the last child that
//! held it there lets it go. A second child storing the same block, or a child storing it
//! again, is a duplicate and dropped; so is a removal of a block no child was known to hold.
//! A child's `AllBlocksCleared` becomes the removals of what only that child held.

use crate::kv_events::{BlockHash, BlockStored, KvEvent, Medium};
use std::collections::HashMap;

/// The merge state: which children hold each `(hash, medium)`.
#[derive(Debug, Default)]
pub struct EventMerger {
    held: HashMap<(BlockHash, Medium), u64>,
}

impl EventMerger {
    /// A merger for up to 64 children.
    pub fn new() -> EventMerger {
        EventMerger::default()
    }

    /// How many `(block, medium)` pairs some child holds.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether no child holds anything.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Child `child`'s (0..64) events, in order; what the merged stream reports is appended to
    /// `out`.
    pub fn push(&mut self, child: usize, events: Vec<KvEvent>, out: &mut Vec<KvEvent>) {
        let bit = 1u64 << (child % 64);
        for e in events {
            match e {
                KvEvent::BlockStored(s) => self.stored(bit, s, out),
                KvEvent::BlockRemoved(r) => {
                    let gone = self.release(bit, r.block_hashes.iter().map(|h| (*h, &r.medium)));
                    if !gone.is_empty() {
                        out.push(KvEvent::removed(gone, r.medium));
                    }
                }
                KvEvent::AllBlocksCleared => {
                    let mut by_medium: HashMap<Medium, Vec<BlockHash>> = HashMap::new();
                    self.held.retain(|(h, m), holders| {
                        if *holders & bit == 0 {
                            return true;
                        }
                        *holders &= !bit;
                        if *holders == 0 {
                            by_medium.entry(m.clone()).or_default().push(*h);
                        }
                        *holders != 0
                    });
                    let mut media: Vec<_> = by_medium.into_iter().collect();
                    media.sort();
                    for (m, mut hashes) in media {
                        hashes.sort_unstable();
                        out.push(KvEvent::removed(hashes, m));
                    }
                }
            }
        }
    }

    /// The blocks no child held in this medium yet, as stores of consecutive runs (each run's
    /// parent the block before it, its tokens its own blocks').
    fn stored(&mut self, bit: u64, s: BlockStored, out: &mut Vec<KvEvent>) {
        let bs = s.block_size as usize;
        let tokens_per_block = s.token_ids.len() == s.block_hashes.len() * bs;
        let mut run: Option<BlockStored> = None;
        let mut parent = s.parent_block_hash;
        for (i, &h) in s.block_hashes.iter().enumerate() {
            let holders = self.held.entry((h, s.medium.clone())).or_insert(0);
            let new = *holders == 0;
            *holders |= bit;
            if new {
                let r = run.get_or_insert_with(|| BlockStored {
                    block_hashes: Vec::new(),
                    parent_block_hash: parent,
                    token_ids: Vec::new(),
                    block_size: s.block_size,
                    lora_id: s.lora_id,
                    medium: s.medium.clone(),
                });
                r.block_hashes.push(h);
                if tokens_per_block {
                    r.token_ids.extend_from_slice(&s.token_ids[i * bs..(i + 1) * bs]);
                }
            } else if let Some(r) = run.take() {
                out.push(KvEvent::BlockStored(r));
            }
            parent = Some(h);
        }
        if let Some(mut r) = run {
            // Tokens that do not split by block stay with a store that kept every block.
            if !tokens_per_block && r.block_hashes.len() == s.block_hashes.len() {
                r.token_ids = s.token_ids;
            }
            out.push(KvEvent::BlockStored(r));
        }
    }

    fn release<'a>(
        &mut self,
        bit: u64,
        blocks: impl Iterator<Item = (BlockHash, &'a Medium)>,
    ) -> Vec<BlockHash> {
        let mut gone = Vec::new();
        for (h, m) in blocks {
            let key = (h, m.clone());
            if let Some(holders) = self.held.get_mut(&key) {
                if *holders & bit != 0 {
                    *holders &= !bit;
                    if *holders == 0 {
                        self.held.remove(&key);
                        gone.push(h);
                    }
                }
            }
        }
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(h: &[u64], parent: Option<u64>, m: Medium) -> KvEvent {
        let tokens = h.iter().flat_map(|&x| [x as u32, x as u32 + 1]).collect();
        KvEvent::stored(h.to_vec(), parent, tokens, 2, m)
    }

    #[test]
    fn duplicates_across_children_are_dropped_and_the_last_holder_removes() {
        let mut m = EventMerger::new();
        let mut out = Vec::new();
        m.push(0, vec![st(&[1, 2, 3], None, Medium::CpuTier)], &mut out);
        // Child 1 stores 2, 3 (held) and 4 (new): only 4, its parent 3, its own tokens.
        m.push(1, vec![st(&[2, 3, 4], Some(1), Medium::CpuTier)], &mut out);
        // The same blocks on another medium are news.
        m.push(1, vec![st(&[2], Some(1), Medium::Disk)], &mut out);
        // Child 0 repeats itself: nothing.
        m.push(0, vec![st(&[1], None, Medium::CpuTier)], &mut out);
        assert_eq!(
            out,
            vec![
                st(&[1, 2, 3], None, Medium::CpuTier),
                st(&[4], Some(3), Medium::CpuTier),
                st(&[2], Some(1), Medium::Disk),
            ]
        );
        out.clear();
        // 2 leaves child 0's CPU tier: child 1 still holds it. 1 leaves: gone.
        m.push(0, vec![KvEvent::removed(vec![1, 2], Medium::CpuTier)], &mut out);
        assert_eq!(out, vec![KvEvent::removed(vec![1], Medium::CpuTier)]);
        out.clear();
        // A removal of what the child never held is dropped.
        m.push(0, vec![KvEvent::removed(vec![4, 99], Medium::CpuTier)], &mut out);
        assert!(out.is_empty(), "{out:?}");
        // Child 1 clears: what only it held goes, per medium.
        m.push(1, vec![KvEvent::AllBlocksCleared], &mut out);
        assert_eq!(
            out,
            vec![KvEvent::removed(vec![2, 4], Medium::CpuTier), KvEvent::removed(vec![2], Medium::Disk)]
        );
        out.clear();
        m.push(0, vec![KvEvent::removed(vec![3], Medium::CpuTier)], &mut out);
        assert_eq!(out, vec![KvEvent::removed(vec![3], Medium::CpuTier)]);
        assert!(m.is_empty());
    }

    #[test]
    fn a_store_with_a_held_block_in_the_middle_splits_into_runs() {
        let mut m = EventMerger::new();
        let mut out = Vec::new();
        m.push(0, vec![st(&[2], Some(1), Medium::Gpu)], &mut out);
        out.clear();
        m.push(1, vec![st(&[1, 2, 3], None, Medium::Gpu)], &mut out);
        assert_eq!(out, vec![st(&[1], None, Medium::Gpu), st(&[3], Some(2), Medium::Gpu)]);
    }
}
