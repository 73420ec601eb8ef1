//! The CPU tier's storage: mempool slots carved out of chunks of host memory, each chunk
//! mapped on first use (so a large budget costs nothing until it fills) and placed on
//! transparent huge pages where the kernel gives them, as the engine's KV regions are: the
//! copies between the two then take no more TLB misses than a memcpy between regions.
//!
//! Each slot has its own lock. The cache's reference counts already keep two writers (or a
//! writer and a reader) off one slot; the lock makes that a checked fact, and it is never
//! contended.

#![allow(unsafe_code)] // Slots are disjoint byte ranges of one mapping, each reached under its own lock.

use kvconnect_support::host_buffer::HostBuffer;
use std::sync::{Mutex, OnceLock};

/// The cache line every slot starts at, so streaming stores write its rows as whole lines.
const LINE: usize = 64;

/// A chunk is mapped at about this size (whole huge pages when slots are large), and holds at
/// most [`CHUNK_SLOTS`] slots (so tiny slots do not make a chunk's locks outweigh its bytes).
const CHUNK_BYTES: usize = 64 << 20;
const CHUNK_SLOTS: usize = 4096;

/// One chunk: its memory, and the lock and checksum of each of its slots.
struct Chunk {
    mem: HostBuffer,
    sums: Box<[Mutex<u64>]>,
}

/// Slot storage of the CPU tier.
pub struct CpuTier {
    slot_bytes: usize,
    /// Bytes from one slot's start to the next's: `slot_bytes` rounded up to a line.
    stride: usize,
    per_chunk: usize,
    num_slots: u32,
    chunks: Vec<OnceLock<Chunk>>,
}

impl CpuTier {
    /// Storage for `num_slots` slots of `slot_bytes` each.
    pub fn new(num_slots: u32, slot_bytes: usize) -> CpuTier {
        let stride = slot_bytes.max(1).next_multiple_of(LINE);
        let per_chunk = (CHUNK_BYTES / stride).clamp(1, CHUNK_SLOTS).min(num_slots.max(1) as usize);
        let n = (num_slots as usize).div_ceil(per_chunk);
        CpuTier {
            slot_bytes,
            stride,
            per_chunk,
            num_slots,
            chunks: (0..n).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Runs `f` on slot `slot`'s bytes (exactly `slot_bytes` long). None for a slot past the
    /// end, or when the host memory for its chunk cannot be mapped (logged; the caller then
    /// treats the tier as full).
    pub fn with_slot<R>(&self, slot: u32, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        self.with_slot_sum(slot, |data, _| f(data))
    }

    /// As `with_slot`, with the slot's stored checksum.
    pub fn with_slot_sum<R>(&self, slot: u32, f: impl FnOnce(&mut [u8], &mut u64) -> R) -> Option<R> {
        if slot >= self.num_slots {
            return None;
        }
        let chunk = self.chunk(slot as usize / self.per_chunk)?;
        let i = slot as usize % self.per_chunk;
        let mut sum = chunk.sums[i].lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: slot `i` is the `slot_bytes` bytes at `i * stride` of the chunk's mapping
        // (`per_chunk * stride` bytes long, so inside it), disjoint from every other slot's;
        // it is reached only here, under its own lock, held for as long as the view lives.
        // The mapping lives as long as `self`, which this borrow outlives.
        let data = unsafe {
            std::slice::from_raw_parts_mut(chunk.mem.as_ptr().add(i * self.stride), self.slot_bytes)
        };
        Some(f(data, &mut sum))
    }

    /// Chunk `c`, mapped on first use. A mapping that fails is tried again on a later call.
    fn chunk(&self, c: usize) -> Option<&Chunk> {
        let cell = self.chunks.get(c)?;
        if let Some(chunk) = cell.get() {
            return Some(chunk);
        }
        let slots = self.per_chunk.min(self.num_slots as usize - c * self.per_chunk);
        match HostBuffer::zeroed(slots * self.stride) {
            // Two threads may map the same chunk at once: one mapping wins, the other is
            // unmapped unused.
            Ok(mem) => {
                Some(cell.get_or_init(|| Chunk { mem, sums: (0..slots).map(|_| Mutex::new(0)).collect() }))
            }
            Err(e) => {
                tracing::warn!("flexkv: the CPU tier cannot grow (blocks are not cached until it can): {e}");
                None
            }
        }
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
        t.with_slot(4096, |b| b.copy_from_slice(&[4; 8])).unwrap();
        t.with_slot_sum(4095, |b, s| {
            b.fill(3);
            *s = 33;
        })
        .unwrap();
        assert_eq!(t.with_slot(4999, |b| b.to_vec()).unwrap(), vec![9; 8]);
        assert_eq!(t.with_slot(1, |b| b[0]).unwrap(), 1);
        assert_eq!(t.with_slot_sum(4095, |b, s| (b.to_vec(), *s)).unwrap(), (vec![3; 8], 33));
        assert_eq!(t.with_slot(4096, |b| b.to_vec()).unwrap(), vec![4; 8]);
        assert_eq!(t.with_slot(0, |b| b.to_vec()).unwrap(), vec![0; 8], "a fresh slot is zeroed");
        assert!(t.with_slot(5000, |_| ()).is_none());
    }

    #[test]
    fn large_slots_sit_in_huge_page_aligned_chunks() {
        let slot = 512 * 1024;
        let t = CpuTier::new(300, slot);
        assert_eq!(t.per_chunk, 128);
        let addr = |s| t.with_slot(s, |b| b.as_ptr() as usize).unwrap();
        assert_eq!(addr(0) % kvconnect_support::host_buffer::HUGE_PAGE, 0);
        assert_eq!(addr(127) - addr(0), 127 * slot);
        // The last chunk holds only the slots that are left.
        assert_eq!(addr(299) - addr(256), 43 * slot);
    }

    #[test]
    fn a_budget_larger_than_memory_costs_nothing_until_it_fills() {
        // 4096 slots of 64 MiB (256 GiB, more than the machine has): only the chunk of the
        // slot used is mapped.
        let t = CpuTier::new(4096, 64 << 20);
        t.with_slot(4095, |b| b[..4].copy_from_slice(&[1, 2, 3, 4])).unwrap();
        assert_eq!(t.with_slot(4095, |b| b[..4].to_vec()).unwrap(), vec![1, 2, 3, 4]);
    }
}
