//! lmcache's KV events against its tiers' real contents: a workload that overflows the CPU
//! tier into the disk tier and the disk tier into eviction; the events, applied in order to
//! an empty index, must give exactly what each tier holds, and each store must carry its
//! chunk's tokens and the chunk before it.

mod common;

use common::*;
use kvconnect_api::{KvEvent, KvLayout, Medium};
use serde_json::json;
use std::collections::{BTreeSet, HashMap};

const CHUNK: usize = 32;

#[test]
fn events_replay_to_the_tiers_contents_through_eviction() {
    let dir = tempfile::tempdir().unwrap();
    let id = "events-tiers";
    // The CPU tier holds 3 chunks, the disk 5: 12 prompts of 2 chunks push chunks from CPU to
    // disk and out of the disk.
    let mut e = Engine::new(
        id,
        KvLayout::NHD,
        16,
        json!({
            "chunk_size": CHUNK,
            "max_local_cpu_size": gb(3 * chunk_bytes(CHUNK) + 100),
            "local_disk": dir.path(),
            "max_local_disk_size": gb(5 * (chunk_bytes(CHUNK) + 200)),
        }),
    );
    let prompts: Vec<Vec<u32>> = (0..12).map(|i| prompt(100 + i, 2 * CHUNK)).collect();
    let mut r = Replay::default();
    for (i, p) in prompts.iter().enumerate() {
        e.run(&format!("r{i}"), p, 0);
        kvconnect_lmcache::flush(id);
        r.apply(e.sched.take_events().unwrap());
    }
    // Some early prompts again: hits from disk, read back into the CPU tier.
    for (i, p) in prompts.iter().enumerate().skip(6).take(3) {
        e.run(&format!("again{i}"), p, 0);
        kvconnect_lmcache::flush(id);
        r.apply(e.sched.take_events().unwrap());
    }
    let (cpu, disk) = kvconnect_lmcache::registry::holdings(id).unwrap();
    let held: BTreeSet<(u64, Medium)> =
        cpu.iter().map(|&h| (h, Medium::CpuTier)).chain(disk.iter().map(|&h| (h, Medium::Disk))).collect();
    assert_eq!(r.index, held, "the events replayed give what the tiers hold");
    assert_eq!(cpu.len(), 3, "the CPU tier is full");
    assert!(disk.len() == 5, "the disk tier is full: {disk:?}");
    assert!(r.removals >= 24 - 8, "chunks left the CPU tier and the disk: {} removals", r.removals);
    assert!(r.moves > 0 && r.stores > 24, "CPU to disk moves are a removal and a store: {} stores", r.stores);

    // Each stored chunk's tokens are its prompt's, and its parent the chunk before it.
    for p in &prompts {
        let first = r.tokens_of.values().find(|(_, t)| t[..] == p[..CHUNK]).expect("first chunk described");
        assert_eq!(first.0, None, "a prompt's first chunk has no parent");
        let second = r.tokens_of.iter().find(|(_, (_, t))| t[..] == p[CHUNK..]).expect("second chunk");
        let parent = second.1 .0.expect("the second chunk names its parent");
        assert_eq!(r.tokens_of[&parent].1[..], p[..CHUNK], "the parent is the prompt's first chunk");
    }

    // A reset empties both tiers: the events say so.
    assert!(e.sched.reset_cache().unwrap());
    r.apply(e.sched.take_events().unwrap());
    assert!(r.index.is_empty(), "after the reset the index is empty: {:?}", r.index);
}

/// The events applied in order to an index of (hash, medium).
#[derive(Default)]
struct Replay {
    index: BTreeSet<(u64, Medium)>,
    tokens_of: HashMap<u64, (Option<u64>, Vec<u32>)>,
    stores: usize,
    removals: usize,
    moves: usize,
}

impl Replay {
    fn apply(&mut self, events: Vec<KvEvent>) {
        for ev in events {
            match ev {
                KvEvent::BlockStored(s) => {
                    assert_eq!(s.block_hashes.len(), 1, "one chunk per store: {s:?}");
                    assert_eq!(s.block_size as usize, CHUNK, "{s:?}");
                    assert_eq!(s.token_ids.len(), CHUNK);
                    let h = s.block_hashes[0];
                    let described = (s.parent_block_hash, s.token_ids.clone());
                    let prev = self.tokens_of.insert(h, described.clone());
                    assert!(prev.is_none_or(|p| p == described), "a chunk is described alike in every tier");
                    assert!(self.index.insert((h, s.medium.clone())), "{h} stored twice on {}", s.medium);
                    if s.medium == Medium::Disk && !self.index.contains(&(h, Medium::CpuTier)) {
                        self.moves += 1;
                    }
                    self.stores += 1;
                }
                KvEvent::BlockRemoved(r) => {
                    for h in r.block_hashes {
                        assert!(
                            self.index.remove(&(h, r.medium.clone())),
                            "{h} removed from {} unheld",
                            r.medium
                        );
                        self.removals += 1;
                    }
                }
                KvEvent::AllBlocksCleared => self.index.clear(),
            }
        }
    }
}
