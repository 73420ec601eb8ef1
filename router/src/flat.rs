//! A hash map from 64-bit keys to small values, flat: one array of (key, value) slots, open
//! addressing with linear probing, at most 3/4 full (key 0 marks an empty slot; a key 0 is
//! kept aside). The index and the workers' hash maps hold millions of entries, so nearly every
//! probe misses the caches: a slot of 16 bytes (four to a cache line) and a probe that
//! usually ends in its first line keep that to one miss, and [`FlatMap::prefetch`] lets a
//! caller start the misses of a whole event's keys together before it applies them one by one.
//!
//! A key's first slot is the top bits of its mixed value, so doubling the array moves the
//! entry of slot `i` near slot `2i`: growing is one pass over the old array and a nearly
//! sequential one over the new, not a random write per entry.
//!
//! The lookups are `#[inline(always)]`: called from many places, the compiler kept them as
//! calls, and their entries and exits were a sixth of the indexer's instructions.

#![allow(unsafe_code)] // `prefetch_line`: a CPU hint that reads nothing and cannot fault.

use kvconnect_support::stable_hash::{mix, P0};
use std::marker::PhantomData;

/// Asks the CPU to bring the cache line that holds `*p` into its caches, without waiting for
/// it. A load that misses holds up the instructions after it once the core's window of
/// pending work is full; a prefetch retires at once, so the misses of many keys stay in
/// flight while the caller goes on (hashing the next keys, applying the event before).
/// Elsewhere than x86-64 it does nothing.
#[inline(always)]
pub fn prefetch_line<T>(p: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` is a hint: it reads nothing the program sees and never faults,
    // whatever the address; this one is a live reference's besides.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((p as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Slots of the smallest array.
const MIN_SLOTS: usize = 16;

/// A value a slot holds in one 64-bit word; `unpack(0)` is the value of a new entry.
pub trait Packed: Copy {
    /// The word.
    fn pack(self) -> u64;
    /// The value of a word.
    fn unpack(word: u64) -> Self;
}

impl Packed for u64 {
    fn pack(self) -> u64 {
        self
    }
    fn unpack(word: u64) -> u64 {
        word
    }
}

/// The map: slots of two words, the key and the packed value, so that a new array is
/// zeroed memory straight from the allocator (no pass to fill it).
#[derive(Debug, Clone)]
pub struct FlatMap<V> {
    slots: Vec<[u64; 2]>,
    /// 64 - log2(slots.len()), where there are slots.
    shift: u32,
    /// Occupied slots.
    len: usize,
    /// The value of key 0.
    zero: Option<u64>,
    value: PhantomData<V>,
}

impl<V: Packed> Default for FlatMap<V> {
    fn default() -> Self {
        FlatMap { slots: Vec::new(), shift: 64, len: 0, zero: None, value: PhantomData }
    }
}

impl<V: Packed> FlatMap<V> {
    /// An empty map (no allocation).
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries.
    pub fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    /// No entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of its slot array.
    pub fn slot_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<[u64; 2]>()
    }

    #[inline(always)]
    fn home(&self, key: u64) -> usize {
        // Keys need not be uniform (a publisher may number its blocks 1, 2, 3): mixed first.
        (mix(key, P0) >> self.shift) as usize
    }

    /// Where `key` is (`Ok`), or the empty slot where it would go (`Err`). Needs slots.
    #[inline(always)]
    fn find(&self, key: u64) -> Result<usize, usize> {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let k = self.slots[i][0];
            if k == key {
                return Ok(i);
            }
            if k == 0 {
                return Err(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The word of `key`, where present.
    #[inline(always)]
    fn word(&mut self, key: u64) -> Option<&mut u64> {
        if key == 0 {
            return self.zero.as_mut();
        }
        if self.slots.is_empty() {
            return None;
        }
        let i = self.find(key).ok()?;
        Some(&mut self.slots[i][1])
    }

    /// Prefetches `key`'s first slot and the one four slots on (64 bytes: the next cache
    /// line): the lines the lookup will need (a probe, or a removal's shift, goes on past the
    /// first line when the run it meets crosses a line's end), asked for early so that the
    /// misses of several keys overlap. Changes nothing a lookup answers.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        if self.slots.is_empty() {
            return;
        }
        let i = self.home(key);
        prefetch_line(&self.slots[i]);
        prefetch_line(&self.slots[(i + 4) & (self.slots.len() - 1)]);
    }

    /// The value of `key` where its entry is in its first slot (most are), without probing
    /// further: for hints, which may miss an entry but never find a wrong one.
    #[inline]
    pub fn get_at_home(&self, key: u64) -> Option<V> {
        if self.slots.is_empty() || key == 0 {
            return None;
        }
        let s = self.slots[self.home(key)];
        (s[0] == key).then(|| V::unpack(s[1]))
    }

    /// The value of `key`.
    #[inline(always)]
    pub fn get(&self, key: u64) -> Option<V> {
        if key == 0 {
            return self.zero.map(V::unpack);
        }
        if self.slots.is_empty() {
            return None;
        }
        self.find(key).ok().map(|i| V::unpack(self.slots[i][1]))
    }

    /// Changes the value of `key` with `f`, where present; returns what `f` returned.
    #[inline(always)]
    pub fn update<R>(&mut self, key: u64, f: impl FnOnce(&mut V) -> R) -> Option<R> {
        let w = self.word(key)?;
        let mut v = V::unpack(*w);
        let r = f(&mut v);
        *w = v.pack();
        Some(r)
    }

    /// Changes the value of `key` with `f`, inserted as `unpack(0)` where absent; returns
    /// what `f` returned.
    #[inline(always)]
    pub fn upsert<R>(&mut self, key: u64, f: impl FnOnce(&mut V) -> R) -> R {
        let w = if key == 0 {
            self.zero.get_or_insert(0)
        } else {
            if (self.len + 1) * 4 > self.slots.len() * 3 {
                self.grow();
            }
            let i = match self.find(key) {
                Ok(i) => i,
                Err(i) => {
                    self.slots[i] = [key, 0];
                    self.len += 1;
                    i
                }
            };
            &mut self.slots[i][1]
        };
        let mut v = V::unpack(*w);
        let r = f(&mut v);
        *w = v.pack();
        r
    }

    /// Sets `key`'s value.
    pub fn insert(&mut self, key: u64, value: V) {
        self.upsert(key, |v| *v = value);
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: u64) -> Option<V> {
        self.change(key, |_| ((), false)).map(|((), v)| v)
    }

    /// Changes the value of `key` with `f`, where present, and removes the entry where `f`
    /// says so (its second answer false): one probe for both. Returns what `f` returned and
    /// the value it left.
    #[inline(always)]
    pub fn change<R>(&mut self, key: u64, f: impl FnOnce(&mut V) -> (R, bool)) -> Option<(R, V)> {
        if key == 0 {
            let mut v = V::unpack(self.zero?);
            let (r, keep) = f(&mut v);
            self.zero = keep.then(|| v.pack());
            return Some((r, v));
        }
        if self.slots.is_empty() {
            return None;
        }
        let hole = self.find(key).ok()?;
        let mut v = V::unpack(self.slots[hole][1]);
        let (r, keep) = f(&mut v);
        if keep {
            self.slots[hole][1] = v.pack();
        } else {
            self.remove_at(hole);
        }
        Some((r, v))
    }

    /// Empties slot `hole` (occupied).
    fn remove_at(&mut self, mut hole: usize) {
        // Backward shift: each later entry of the run moves into the hole if the hole lies
        // between its first slot and where it is, so no probe meets a gap before its key.
        let mask = self.slots.len() - 1;
        let mut j = (hole + 1) & mask;
        loop {
            let k = self.slots[j][0];
            if k == 0 {
                break;
            }
            let from_home = j.wrapping_sub(self.home(k)) & mask;
            if from_home >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = [0, 0];
        self.len -= 1;
    }

    /// Keeps the entries for which `keep` (which may change the value) says true.
    pub fn retain(&mut self, mut keep: impl FnMut(u64, &mut V) -> bool) {
        if let Some(w) = self.zero {
            let mut v = V::unpack(w);
            self.zero = keep(0, &mut v).then(|| v.pack());
        }
        let mut gone = Vec::new();
        for [k, w] in self.slots.iter_mut() {
            if *k != 0 {
                let mut v = V::unpack(*w);
                if !keep(*k, &mut v) {
                    gone.push(*k);
                }
                *w = v.pack();
            }
        }
        for k in gone {
            self.remove(k);
        }
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        let rest = self.slots.iter().filter(|s| s[0] != 0).map(|s| (s[0], V::unpack(s[1])));
        self.zero.iter().map(|w| (0, V::unpack(*w))).chain(rest)
    }

    fn grow(&mut self) {
        let n = (self.slots.len() * 2).max(MIN_SLOTS);
        let mut slots = vec![[0u64; 2]; n];
        // Before the first write below: probes of a table of hundreds of MiB miss the TLB too.
        kvconnect_support::host_buffer::advise_huge_pages(&mut slots);
        // Zeroed memory fresh from the kernel: the first read of a page would map the shared
        // zero page and the first write then fault again, so each page (4 KiB, 256 slots) is
        // written once first (a value the compiler cannot know is zero, so the write stays).
        for s in slots.iter_mut().step_by(256) {
            *s = std::hint::black_box([0, 0]);
        }
        let old = std::mem::replace(&mut self.slots, slots);
        self.shift = 64 - n.trailing_zeros();
        for s in old {
            if s[0] != 0 {
                if let Err(i) = self.find(s[0]) {
                    self.slots[i] = s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn agrees_with_std_hash_map_through_inserts_removals_and_growth() {
        // Keys from a small range (many collisions of first slots, long runs to shift back),
        // including 0, and uniform ones.
        let mut x = 1u64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for range in [40u64, 5000, u64::MAX] {
            let (mut f, mut s) = (FlatMap::<u64>::new(), HashMap::new());
            for step in 0..60_000u32 {
                let k = if range == u64::MAX { rnd() } else { rnd() % range };
                match rnd() % 5 {
                    0 | 1 => {
                        f.insert(k, u64::from(step));
                        s.insert(k, u64::from(step));
                    }
                    2 => assert_eq!(f.remove(k), s.remove(&k), "{k}"),
                    3 => {
                        // Bumped, and removed where it was odd.
                        let got = f.change(k, |v| {
                            let odd = *v % 2 == 1;
                            *v += 1;
                            (odd, !odd)
                        });
                        let want = s.get_mut(&k).map(|v| {
                            let odd = *v % 2 == 1;
                            *v += 1;
                            (odd, *v)
                        });
                        if want.is_some_and(|(odd, _)| odd) {
                            s.remove(&k);
                        }
                        assert_eq!(got, want, "{k}");
                    }
                    _ => {
                        f.update(k, |v| *v += 1);
                        if let Some(v) = s.get_mut(&k) {
                            *v += 1;
                        }
                    }
                }
                assert_eq!(f.get(k), s.get(&k).copied());
                if let Some(v) = f.get_at_home(k) {
                    assert_eq!(Some(&v), s.get(&k), "a hint finds only the right value");
                }
            }
            assert_eq!(f.len(), s.len());
            let mut all: Vec<(u64, u64)> = f.iter().collect();
            let mut want: Vec<(u64, u64)> = s.iter().map(|(k, v)| (*k, *v)).collect();
            all.sort_unstable();
            want.sort_unstable();
            assert_eq!(all, want);
            for k in want.iter().map(|e| e.0) {
                assert!(f.get(k).is_some());
            }
            f.retain(|k, v| {
                *v += 1;
                k % 3 != 0
            });
            s.retain(|k, v| {
                *v += 1;
                k % 3 != 0
            });
            let mut all: Vec<(u64, u64)> = f.iter().collect();
            let mut want: Vec<(u64, u64)> = s.iter().map(|(k, v)| (*k, *v)).collect();
            all.sort_unstable();
            want.sort_unstable();
            assert_eq!(all, want);
        }
    }

    #[test]
    fn key_zero_and_an_empty_map() {
        let mut f = FlatMap::<u64>::new();
        assert_eq!((f.get_at_home(5), f.get_at_home(0)), (None, None));
        assert_eq!(f.remove(5), None);
        f.prefetch(5);
        assert_eq!((f.get(0), f.get(5), f.len()), (None, None, 0));
        f.upsert(0, |v| *v += 3);
        f.insert(16, 4);
        assert_eq!((f.get(0), f.get(16), f.len()), (Some(3), Some(4), 2));
        assert_eq!(f.remove(0), Some(3));
        assert_eq!((f.get(0), f.len(), f.is_empty()), (None, 1, false));
    }
}
