//! Several threads save, match, load and (through tiny tiers) evict the same blocks at
//! once. A referenced block must always load, and every load must return exactly the bytes
//! saved under its key: no block lost, none corrupted, no slot shared by two blocks.

use kvconnect_flexkv::cache::{BlockCache, LoadError, StoreOutcome};
use kvconnect_flexkv::hash::block_hashes;
use kvconnect_flexkv::ssd_tier::SsdTier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const SLOT: usize = 1000;

fn content(hash: u64, buf: &mut [u8]) {
    let mut x = hash;
    for chunk in buf.chunks_mut(8) {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn prompts() -> Vec<Vec<u64>> {
    // 40 prompts over 5 shared roots: branching trees of 1..=8 blocks.
    (0..40u32)
        .map(|i| {
            let root = i % 5;
            let len = 1 + (i as usize * 7) % 8;
            let mut toks: Vec<u32> = vec![root; 4];
            for b in 1..len {
                toks.extend([root, b as u32, i % (b as u32 + 1), 9]);
            }
            block_hashes(42, &toks, 4)
        })
        .collect()
}

fn run(cache: Arc<BlockCache>, threads: u64, iters: usize) {
    let prompts = Arc::new(prompts());
    let loads = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (cache, prompts, loads) = (cache.clone(), prompts.clone(), loads.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x1234_5678 + t * 7919);
                let mut scratch = Vec::new();
                let mut expect = vec![0u8; SLOT];
                for _ in 0..iters {
                    let p = &prompts[(rng.next() % prompts.len() as u64) as usize];
                    let n = cache.pin_prefix(p, p.len());
                    for h in &p[..n] {
                        content(*h, &mut expect);
                        let mut got_right = false;
                        let r = cache.load(*h, &mut scratch, |b| {
                            got_right = b == &expect[..];
                            Ok(())
                        });
                        match r {
                            Ok(_) => assert!(got_right, "block {h:016x} loaded with wrong bytes"),
                            Err(LoadError::Missing(_)) => panic!("referenced block {h:016x} was lost"),
                            Err(e) => panic!("unexpected load error: {e}"),
                        }
                        loads.fetch_add(1, Ordering::Relaxed);
                    }
                    cache.unpin(&p[..n]);
                    let mut parent = None;
                    for h in p.iter() {
                        let o = cache
                            .store(*h, parent, |slot| {
                                content(*h, slot);
                                Ok::<(), ()>(())
                            })
                            .unwrap();
                        match o {
                            StoreOutcome::Stored | StoreOutcome::Present => parent = Some(*h),
                            StoreOutcome::NoParent | StoreOutcome::NoSpace => break,
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a stress thread failed");
    }
    assert!(loads.load(Ordering::Relaxed) > 100, "the stress test loaded too little to mean anything");
    // Quiescent: nothing referenced, every cached block loads exactly.
    let mut scratch = Vec::new();
    let mut expect = vec![0u8; SLOT];
    for p in prompts.iter() {
        for h in &p[..cache.match_len(p)] {
            assert_eq!(cache.locate(*h).map(|l| l.2), Some(0), "a reference leaked");
        }
    }
    for p in prompts.iter() {
        // Pinned, because loading with promotion evicts blocks (maybe this prompt's leaves).
        let n = cache.pin_prefix(p, p.len());
        for h in &p[..n] {
            content(*h, &mut expect);
            cache
                .load(*h, &mut scratch, |b| if b == &expect[..] { Ok(()) } else { Err("wrong".into()) })
                .unwrap();
        }
        cache.unpin(&p[..n]);
    }
}

#[test]
fn concurrent_save_load_evict_cpu_only() {
    let cache = Arc::new(BlockCache::new(12, SLOT, None, false, String::new()));
    run(cache.clone(), 6, 600);
    let st = cache.stats();
    assert!(st.evicted > 0 && st.stored > 0, "{st:?}");
}

#[test]
fn concurrent_save_load_evict_with_ssd_and_promotion() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = SsdTier::open(dir.path(), "stress", SLOT, 24 * 8192).unwrap();
    let cache = Arc::new(BlockCache::new(8, SLOT, Some(ssd), true, String::new()));
    run(cache.clone(), 6, 600);
    let st = cache.stats();
    assert!(st.demoted > 0 && st.ssd_hits > 0 && st.promoted > 0 && st.evicted > 0, "{st:?}");
    assert_eq!(st.ssd_corrupt, 0, "{st:?}");
}
