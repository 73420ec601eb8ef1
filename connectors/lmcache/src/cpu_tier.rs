//! The host-memory tier: chunks under a byte budget, least recently used evicted first.

use crate::chunk_buf::ChunkBuf;
use crate::key::ChunkKey;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// Chunk bytes shared between the tier and readers (a reader keeps an evicted chunk alive).
pub type ChunkData = Arc<ChunkBuf>;

/// Keys are already uniform hashes, so the map uses their first word as is.
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ *b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
    fn write_usize(&mut self, n: usize) {
        self.0 ^= n as u64;
    }
}

/// A map keyed by chunk keys.
pub type KeyMap<V> = HashMap<ChunkKey, V, BuildHasherDefault<KeyHasher>>;

/// The CPU tier.
pub struct CpuTier {
    budget: u64,
    used: u64,
    tick: u64,
    map: KeyMap<(ChunkData, u64)>,
    lru: BTreeMap<u64, ChunkKey>,
}

impl CpuTier {
    /// An empty tier holding at most `budget` bytes.
    pub fn new(budget: u64) -> CpuTier {
        CpuTier { budget, used: 0, tick: 0, map: KeyMap::default(), lru: BTreeMap::new() }
    }

    /// True when the chunk is here (does not count as a use).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.map.contains_key(key)
    }

    /// Every chunk here (no use counted).
    pub fn keys(&self) -> Vec<ChunkKey> {
        self.map.keys().copied().collect()
    }

    /// The chunk, marked most recently used.
    pub fn get(&mut self, key: &ChunkKey) -> Option<ChunkData> {
        self.tick += 1;
        let tick = self.tick;
        let (data, t) = self.map.get_mut(key)?;
        self.lru.remove(t);
        *t = tick;
        self.lru.insert(tick, *key);
        Some(data.clone())
    }

    /// Stores a chunk, evicting least recently used ones until it fits. Returns the evicted
    /// chunks, or gives the chunk back when it is larger than the whole budget.
    pub fn put(&mut self, key: ChunkKey, data: ChunkData) -> Result<Vec<(ChunkKey, ChunkData)>, ChunkData> {
        let len = data.len() as u64;
        if len > self.budget {
            return Err(data);
        }
        if let Some((old, t)) = self.map.remove(&key) {
            self.lru.remove(&t);
            self.used -= old.len() as u64;
        }
        let evicted = self.evict_for(len);
        self.tick += 1;
        self.lru.insert(self.tick, key);
        self.map.insert(key, (data, self.tick));
        self.used += len;
        Ok(evicted)
    }

    /// Removes every chunk; returns their keys.
    pub fn clear(&mut self) -> Vec<ChunkKey> {
        self.used = 0;
        self.lru.clear();
        self.map.drain().map(|(k, _)| k).collect()
    }

    /// Evicts least recently used chunks until `len` more bytes fit (or the tier is empty)
    /// and returns them.
    pub fn evict_for(&mut self, len: u64) -> Vec<(ChunkKey, ChunkData)> {
        let mut evicted = Vec::new();
        while self.used + len > self.budget {
            let Some((_, k)) = self.lru.pop_first() else { break };
            if let Some((d, _)) = self.map.remove(&k) {
                self.used -= d.len() as u64;
                evicted.push((k, d));
            }
        }
        evicted
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes held.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u64) -> ChunkKey {
        ChunkKey([i, i])
    }

    fn d(v: Vec<u8>) -> ChunkData {
        Arc::new(ChunkBuf::Heap(v))
    }

    #[test]
    fn evicts_least_recently_used_within_budget() {
        let mut t = CpuTier::new(300);
        for i in 0..3 {
            assert!(t.put(k(i), d(vec![i as u8; 100])).unwrap().is_empty());
        }
        assert!(t.get(&k(0)).is_some()); // 1 is now the oldest
        let ev = t.put(k(3), d(vec![3; 100])).unwrap();
        assert_eq!(ev.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![k(1)]);
        assert_eq!(t.used(), 300);
        assert!(t.contains(&k(0)) && !t.contains(&k(1)));
        let ev = t.put(k(4), d(vec![4; 250])).unwrap();
        assert_eq!(ev.len(), 3, "needs room for 250 bytes");
        assert_eq!((t.len(), t.used()), (1, 250));
        assert!(t.put(k(5), d(vec![0; 301])).is_err(), "larger than the budget");
        // Making room ahead of a save evicts the oldest first, and only what is needed.
        t.put(k(6), d(vec![6; 40])).unwrap();
        let ev = t.evict_for(10);
        assert!(ev.is_empty(), "290 + 10 fits");
        let ev = t.evict_for(100);
        assert_eq!(ev.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![k(4)]);
        assert_eq!(t.used(), 40);
    }
}
