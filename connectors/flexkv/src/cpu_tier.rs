//! The CPU tier's storage: one byte buffer per mempool slot, allocated on first use so a
//! large budget costs nothing until it fills.
//!
//! Each slot has its own lock. The cache's reference counts already keep two writers (or a
//! writer and a reader) off one slot; the lock makes that a checked fact instead of an
//! `unsafe` promise, and it is never contended.

use std::sync::{Mutex, OnceLock};

const CHUNK: usize = 4096;

/// One slot: the block's bytes and their checksum (taken while the bytes were hot, so that
/// moving the block to SSD later needs no second pass over them).
#[derive(Default)]
struct Slot {
    /// The block's bytes start at the first cache line of this buffer (`LINE - 1` bytes
    /// longer than a block), so streaming stores write its rows as whole lines.
    data: Vec<u8>,
    sum: u64,
}

/// The cache line slots are aligned to.
const LINE: usize = 64;

/// A chunk of slots, created on first use.
type Chunk = OnceLock<Box<[Mutex<Slot>]>>;

/// Slot storage of the CPU tier.
pub struct CpuTier {
    slot_bytes: usize,
    num_slots: u32,
    chunks: Vec<Chunk>,
}

impl CpuTier {
    /// Storage for `num_slots` slots of `slot_bytes` each.
    pub fn new(num_slots: u32, slot_bytes: usize) -> CpuTier {
        let n = (num_slots as usize).div_ceil(CHUNK);
        CpuTier { slot_bytes, num_slots, chunks: (0..n).map(|_| OnceLock::new()).collect() }
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Runs `f` on slot `slot`'s bytes (exactly `slot_bytes` long). None for a slot past the
    /// end.
    pub fn with_slot<R>(&self, slot: u32, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        self.with_slot_sum(slot, |data, _| f(data))
    }

    /// As `with_slot`, with the slot's stored checksum.
    pub fn with_slot_sum<R>(&self, slot: u32, f: impl FnOnce(&mut [u8], &mut u64) -> R) -> Option<R> {
        if slot >= self.num_slots {
            return None;
        }
        let chunk = self.chunks.get(slot as usize / CHUNK)?;
        let chunk = chunk.get_or_init(|| (0..CHUNK).map(|_| Mutex::new(Slot::default())).collect());
        let mut s = chunk[slot as usize % CHUNK].lock().unwrap_or_else(|e| e.into_inner());
        if s.data.len() != self.slot_bytes + LINE - 1 {
            s.data.resize(self.slot_bytes + LINE - 1, 0);
        }
        let Slot { data, sum } = &mut *s;
        // The buffer is never resized after this, so its start, and the aligned offset, stay.
        let at = data.as_ptr().align_offset(LINE).min(LINE - 1);
        Some(f(&mut data[at..at + self.slot_bytes], sum))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_starts_at_a_cache_line() {
        let t = CpuTier::new(8, 1000);
        for slot in 0..8 {
            let (addr, len) = t.with_slot(slot, |b| (b.as_ptr() as usize, b.len())).unwrap();
            assert_eq!((addr % LINE, len), (0, 1000), "slot {slot}");
        }
    }

    #[test]
    fn slots_are_separate_and_bounded() {
        let t = CpuTier::new(5000, 8);
        t.with_slot(4999, |b| b.copy_from_slice(&[9; 8])).unwrap();
        t.with_slot(1, |b| b.copy_from_slice(&[1; 8])).unwrap();
        assert_eq!(t.with_slot(4999, |b| b.to_vec()).unwrap(), vec![9; 8]);
        assert_eq!(t.with_slot(1, |b| b[0]).unwrap(), 1);
        assert!(t.with_slot(5000, |_| ()).is_none());
    }
}
