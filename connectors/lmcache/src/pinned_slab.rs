//! The pinned CPU tier (feature `cuda`): one page-locked, GPU-mapped slab cut into
//! chunk-sized slots, like LMCache's pinned local CPU backend.
//!
//! Device saves gather a request's blocks straight into slots and device loads scatter
//! straight out of them, so no chunk byte is copied by the host. A slot is handed out as a
//! [`PinnedSlot`] that returns itself to the free list when the last holder (the CPU tier,
//! the disk writer's queue or a load) drops it; slots keep the slab alive. When no slot is
//! free, saves fall back to heap chunks (counted in the store's statistics).

#![allow(unsafe_code)] // Pinned host memory the CUDA copy engine shares: raw slices of it.

use crate::slot_alloc::SlotAllocator;
use kvconnect_cuda::{Gpu, PinnedBuffer};
use std::sync::{Arc, Mutex};

/// One pinned slab of equal slots.
pub struct PinnedSlab {
    buf: PinnedBuffer,
    /// Host address of the slab, taken once at allocation so slot views never form a
    /// reference to bytes the GPU may be writing in another slot.
    host: *const u8,
    dev: u64,
    slot_bytes: usize,
    slots: Mutex<SlotAllocator>,
}

// SAFETY: the slab's memory is written only by GPU kernels into slots taken from `slots`
// (exclusively owned by one save until its launch is synchronised) and read by the host only
// through `PinnedSlot::as_slice` of slots that were filled and synchronised before being
// shared; the free list is behind a mutex. `host` is a plain address into `buf`, which lives
// as long as the slab.
unsafe impl Sync for PinnedSlab {}
// SAFETY: as above; PinnedBuffer is Send and the raw pointer is only an address into it.
unsafe impl Send for PinnedSlab {}

impl std::fmt::Debug for PinnedSlab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedSlab")
            .field("slot_bytes", &self.slot_bytes)
            .field("slots", &self.slots())
            .finish()
    }
}

impl PinnedSlab {
    /// Pins `slots * slot_bytes` bytes on `gpu`'s context.
    pub fn new(gpu: &Gpu, slot_bytes: usize, slots: u32) -> Result<Arc<PinnedSlab>, String> {
        let bytes = slot_bytes
            .checked_mul(slots as usize)
            .ok_or_else(|| format!("{slots} slots of {slot_bytes} bytes overflow"))?;
        let buf = gpu
            .alloc_pinned(bytes)
            .map_err(|e| format!("pinning {bytes} bytes for {slots} chunk slots failed: {e}"))?;
        let host = buf.as_slice().as_ptr();
        let dev = buf.device_ptr();
        Ok(Arc::new(PinnedSlab { buf, host, dev, slot_bytes, slots: Mutex::new(SlotAllocator::new(slots)) }))
    }

    fn alloc(&self) -> std::sync::MutexGuard<'_, SlotAllocator> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes up to `n` slots, each `len` bytes long (at most the slot size).
    pub fn take(self: &Arc<Self>, n: usize, len: usize) -> Vec<PinnedSlot> {
        if len > self.slot_bytes {
            return Vec::new();
        }
        self.alloc().take(n).into_iter().map(|index| PinnedSlot { slab: self.clone(), index, len }).collect()
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slots in all.
    pub fn slots(&self) -> u32 {
        self.alloc().slots()
    }

    /// Slots free now.
    pub fn free_slots(&self) -> usize {
        self.alloc().free()
    }

    /// The slab's device address (slot `i` at `+ i * slot_bytes`).
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// Bytes of the slab.
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }
}

/// One slot of a slab, holding a chunk of `len` bytes at its start.
pub struct PinnedSlot {
    slab: Arc<PinnedSlab>,
    index: u32,
    len: usize,
}

impl PinnedSlot {
    /// The slot's index in its slab.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Bytes of the chunk.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slab.
    pub fn slab(&self) -> &Arc<PinnedSlab> {
        &self.slab
    }

    /// The chunk's bytes. Read them only after the launch that filled the slot was
    /// synchronised (saves do that before the chunk is stored).
    pub fn as_slice(&self) -> &[u8] {
        let off = self.index as usize * self.slab.slot_bytes;
        // SAFETY: `index < slots` and `len <= slot_bytes` (checked in `take`), so the range
        // lies inside the slab, which `self.slab` keeps alive; no kernel writes this slot
        // once it is filled (see the Sync impl).
        unsafe { std::slice::from_raw_parts(self.slab.host.add(off), self.len) }
    }
}

impl Drop for PinnedSlot {
    fn drop(&mut self) {
        if let Err(e) = self.slab.alloc().give(self.index) {
            tracing::error!("lmcache: pinned chunk slot bookkeeping is wrong: {e}");
        }
    }
}
