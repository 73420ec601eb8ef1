//! The tiered block cache: the radix index plus the CPU and SSD mempools and their storage.
//!
//! One lock guards the metadata (index, free lists, events); block bytes are copied outside
//! it, under a reference that keeps the block's slots from being reused. A save inserts its
//! block as pending (never matched), fills a CPU slot, then publishes it. When the CPU tier
//! is full, the least recently used unreferenced block gives up its slot: it moves to the
//! SSD tier (written by the saving transfer thread, not the step loop), or, without an SSD
//! tier or when the SSD write fails, it is dropped if it is a leaf. A block read from SSD is
//! checked before it is handed out ([`BlockCache::load`]), or, on the worker's load path, by
//! the checksum its copy into the KV blocks takes in the same pass
//! ([`BlockCache::load_summed`]; a block that then disagrees is wiped and fails its load); a
//! corrupt record is dropped and reported as a miss.

use crate::cpu_tier::CpuTier;
use crate::hash::checksum;
use crate::mempool::SlotPool;
use crate::radix::{Insert, NodeView, RadixIndex, State, Tier};
use crate::ssd_tier::{SsdReadError, SsdTier};
use kvconnect_api::KvEvent;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

const MAX_EVENTS: usize = 65536;

/// Bytes of CPU blocks one demotion writes to SSD before its one sync (see
/// [`BlockCache::demote_batch_blocks`]): a sync costs about as much as writing several MiB,
/// so blocks are demoted in batches rather than one by one.
pub const DEMOTE_BATCH_BYTES: usize = 32 << 20;

/// Blocks of `slot_bytes` one demotion moves, for a CPU tier of `cpu_slots` slots.
fn demote_batch_blocks(slot_bytes: usize, cpu_slots: usize) -> usize {
    (DEMOTE_BATCH_BYTES / slot_bytes.max(1)).min(cpu_slots / 4).max(1)
}

/// Counters of what the cache did, for logs, metrics and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Blocks loaded from the CPU tier.
    pub cpu_hits: u64,
    /// Blocks loaded from the SSD tier.
    pub ssd_hits: u64,
    /// Blocks stored.
    pub stored: u64,
    /// Saves skipped because the block was already cached.
    pub already_cached: u64,
    /// Saves dropped because no slot could be freed (every block referenced).
    pub no_space: u64,
    /// Blocks moved from CPU to SSD.
    pub demoted: u64,
    /// Blocks dropped from the cache by eviction.
    pub evicted: u64,
    /// Blocks the CPU tier let go of to make room (demoted to SSD, dropped, or their CPU copy
    /// freed while SSD keeps one).
    pub cpu_evictions: u64,
    /// Blocks the SSD tier let go of to make room.
    pub ssd_evictions: u64,
    /// SSD writes that failed (full disk, I/O error); the block was not kept on SSD.
    pub ssd_write_errors: u64,
    /// SSD records found corrupt or unreadable when loading; dropped, reported as misses.
    pub ssd_corrupt: u64,
    /// Blocks copied back from SSD into the CPU tier on a hit.
    pub promoted: u64,
    /// Events dropped because nobody took them.
    pub events_dropped: u64,
}

#[derive(Default)]
struct Counters {
    cpu_hits: AtomicU64,
    ssd_hits: AtomicU64,
    stored: AtomicU64,
    already_cached: AtomicU64,
    no_space: AtomicU64,
    demoted: AtomicU64,
    evicted: AtomicU64,
    cpu_evictions: AtomicU64,
    ssd_evictions: AtomicU64,
    ssd_write_errors: AtomicU64,
    ssd_corrupt: AtomicU64,
    promoted: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// What a save did with one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    /// Stored in the CPU tier.
    Stored,
    /// Already cached (or being saved by someone else).
    Present,
    /// Its parent is not cached: the rest of the chain cannot be kept.
    NoParent,
    /// No slot could be freed.
    NoSpace,
}

/// Why a block could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The block is not (or no longer) cached.
    #[error("block {0:016x} is not cached")]
    Missing(u64),
    /// Its SSD record failed verification and was dropped.
    #[error("block {hash:016x}: {source}")]
    Ssd {
        /// The block.
        hash: u64,
        /// What the SSD tier said.
        source: SsdReadError,
    },
    /// The destination refused the bytes.
    #[error("block {hash:016x}: copying into the KV cache failed: {message}")]
    Sink {
        /// The block.
        hash: u64,
        /// Why.
        message: String,
    },
}

struct Inner {
    index: RadixIndex,
    cpu_pool: SlotPool,
    ssd_pool: Option<SlotPool>,
    events: VecDeque<KvEvent>,
    events_dropped: u64,
}

impl Inner {
    fn event(&mut self, e: KvEvent) {
        if self.events.len() >= MAX_EVENTS {
            self.events.pop_front();
            self.events_dropped += 1;
        }
        self.events.push_back(e);
    }

    fn free(&mut self, slots: [Option<u32>; 2]) {
        if let Some(c) = slots[0] {
            self.cpu_pool.release(c);
        }
        if let (Some(s), Some(p)) = (slots[1], self.ssd_pool.as_mut()) {
            p.release(s);
        }
    }
}

/// A block stored in `tier`, under the parent the index links it to. The cache keeps no
/// tokens: its events carry the hashes, the parent and the block size, and the scheduler
/// half fills in the token ids (`crate::token_book`).
fn stored(index: &RadixIndex, hash: u64, tier: Tier, block_size: u32) -> KvEvent {
    KvEvent::stored(vec![hash], index.parent_of(hash), Vec::new(), block_size, tier.medium())
}

fn removed(hash: u64, tier: Tier) -> KvEvent {
    KvEvent::removed(vec![hash], tier.medium())
}

/// The cache of one engine.
pub struct BlockCache {
    inner: Mutex<Inner>,
    cpu: CpuTier,
    ssd: Option<SsdTier>,
    promote: bool,
    counters: Counters,
    identity: String,
    /// Tokens per block, as KV events state it (0 until set).
    block_tokens: u32,
}

impl BlockCache {
    /// A cache of `cpu_slots` CPU slots of `slot_bytes`, with an optional SSD tier.
    /// `identity` describes what the cache was built for (compared by the registry).
    pub fn new(
        cpu_slots: u32,
        slot_bytes: usize,
        ssd: Option<SsdTier>,
        promote: bool,
        identity: String,
    ) -> BlockCache {
        let ssd_pool = ssd.as_ref().map(|s| SlotPool::new(s.num_slots()));
        BlockCache {
            inner: Mutex::new(Inner {
                index: RadixIndex::new(),
                cpu_pool: SlotPool::new(cpu_slots),
                ssd_pool,
                events: VecDeque::new(),
                events_dropped: 0,
            }),
            cpu: CpuTier::new(cpu_slots, slot_bytes),
            ssd,
            promote,
            counters: Counters::default(),
            identity,
            block_tokens: 0,
        }
    }

    /// The cache, its KV events stating `tokens` tokens per block.
    pub fn with_block_tokens(mut self, tokens: u32) -> BlockCache {
        self.block_tokens = tokens;
        self
    }

    /// What the cache was built for.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Bytes of one block.
    pub fn slot_bytes(&self) -> usize {
        self.cpu.slot_bytes()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Metadata updates never leave the index half-changed across a panic point, so a
        // poisoned lock still guards consistent data.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Length of the longest cached prefix of `hashes`.
    pub fn match_len(&self, hashes: &[u64]) -> usize {
        self.lock().index.match_len(hashes)
    }

    /// Matches at most `max` blocks of `hashes`, marks them used and references them so they
    /// cannot be evicted until `unpin`. Returns how many.
    pub fn pin_prefix(&self, hashes: &[u64], max: usize) -> usize {
        self.lock().index.match_and_pin(hashes, max)
    }

    /// Drops one reference on each block.
    pub fn unpin(&self, hashes: &[u64]) {
        let mut g = self.lock();
        for h in hashes {
            g.index.unpin(*h);
        }
    }

    /// Blocks in the tree, on CPU, on SSD.
    pub fn sizes(&self) -> (usize, usize, usize) {
        let g = self.lock();
        (g.index.len(), g.index.tier_len(Tier::Cpu), g.index.tier_len(Tier::Ssd))
    }

    /// Slots of the CPU tier and of the SSD tier (0 when it is off).
    pub fn capacities(&self) -> (u32, u32) {
        let g = self.lock();
        (g.cpu_pool.capacity(), g.ssd_pool.as_ref().map_or(0, |p| p.capacity()))
    }

    /// Where a block is: (on CPU, on SSD, references). None when not in the tree.
    pub fn locate(&self, hash: u64) -> Option<(bool, bool, u32)> {
        self.lock().index.get(hash).map(|v| (v.cpu.is_some(), v.ssd.is_some(), v.refs))
    }

    /// The SSD tier, if on.
    pub fn ssd(&self) -> Option<&SsdTier> {
        self.ssd.as_ref()
    }

    /// A copy of the counters.
    pub fn stats(&self) -> CacheStats {
        let c = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheStats {
            cpu_hits: r(&c.cpu_hits),
            ssd_hits: r(&c.ssd_hits),
            stored: r(&c.stored),
            already_cached: r(&c.already_cached),
            no_space: r(&c.no_space),
            demoted: r(&c.demoted),
            evicted: r(&c.evicted),
            cpu_evictions: r(&c.cpu_evictions),
            ssd_evictions: r(&c.ssd_evictions),
            ssd_write_errors: r(&c.ssd_write_errors),
            ssd_corrupt: r(&c.ssd_corrupt),
            promoted: r(&c.promoted),
            events_dropped: self.lock().events_dropped,
        }
    }

    /// Empties the cache (vLLM's `/reset_prefix_cache?reset_external=true`): every block
    /// leaves the tree and its slots are freed, each tier's as one `Removed` event. Returns
    /// `None`, changing nothing, while a load or save holds a block or a block is still being
    /// written (the caller may retry), else how many blocks were removed.
    pub fn clear(&self) -> Option<usize> {
        let mut g = self.lock();
        let views: Vec<(u64, NodeView)> =
            g.index.hashes().into_iter().filter_map(|h| g.index.get(h).map(|v| (h, v))).collect();
        if views.iter().any(|(_, v)| v.refs > 0 || v.state == State::Pending) {
            return None;
        }
        g.index = RadixIndex::new();
        let (mut on_cpu, mut on_ssd) = (Vec::new(), Vec::new());
        for (h, v) in &views {
            g.free([v.cpu, v.ssd]);
            if v.cpu.is_some() {
                on_cpu.push(*h);
            }
            if v.ssd.is_some() {
                on_ssd.push(*h);
            }
        }
        for (hashes, tier) in [(on_cpu, Tier::Cpu), (on_ssd, Tier::Ssd)] {
            if !hashes.is_empty() {
                g.event(KvEvent::removed(hashes, tier.medium()));
            }
        }
        Some(views.len())
    }

    /// Events since the last call.
    pub fn take_events(&self) -> Vec<KvEvent> {
        self.lock().events.drain(..).collect()
    }

    /// Stores block `hash` (child of `parent`, None for a first block); `fill` writes its
    /// bytes into the slot. Errors from `fill` drop the block and are returned. The block's
    /// checksum is taken after `fill`, a second pass over the slot: a copy that can sum as it
    /// goes uses [`BlockCache::store_summed`].
    pub fn store<E>(
        &self,
        hash: u64,
        parent: Option<u64>,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<StoreOutcome, E> {
        self.store_summed(hash, parent, |buf| {
            fill(buf)?;
            Ok(checksum(buf))
        })
    }

    /// As [`BlockCache::store`], where `fill` also returns the [`checksum`] of what it wrote,
    /// taken in the same pass as its copy. A wrong sum is caught when the block is read back
    /// from SSD (a miss, never loaded).
    pub fn store_summed<E>(
        &self,
        hash: u64,
        parent: Option<u64>,
        fill: impl FnOnce(&mut [u8]) -> Result<u64, E>,
    ) -> Result<StoreOutcome, E> {
        let mut g = self.lock();
        match g.index.insert_pending(hash, parent) {
            Insert::Present => {
                bump(&self.counters.already_cached);
                return Ok(StoreOutcome::Present);
            }
            Insert::NoParent => return Ok(StoreOutcome::NoParent),
            Insert::Created => {}
        }
        let (mut g, slot) = self.alloc_cpu(g);
        let Some(slot) = slot else {
            let slots = g.index.abandon(hash);
            g.free(slots);
            bump(&self.counters.no_space);
            return Ok(StoreOutcome::NoSpace);
        };
        g.index.set_slot(hash, Tier::Cpu, slot);
        drop(g);
        // The checksum is taken now, while the bytes are hot, for a later move to SSD.
        let r = self.cpu.with_slot_sum(slot, |buf, sum| {
            fill(buf).map(|s| {
                *sum = s;
            })
        });
        let mut g = self.lock();
        match r {
            Some(Ok(())) => {
                g.index.mark_ready(hash);
                g.index.unpin(hash);
                let e = stored(&g.index, hash, Tier::Cpu, self.block_tokens);
                g.event(e);
                bump(&self.counters.stored);
                Ok(StoreOutcome::Stored)
            }
            Some(Err(e)) => {
                let slots = g.index.abandon(hash);
                g.free(slots);
                Err(e)
            }
            None => {
                // The pool never hands out a slot past the tier's end.
                let slots = g.index.abandon(hash);
                g.free(slots);
                Ok(StoreOutcome::NoSpace)
            }
        }
    }

    /// Loads block `hash` (which the caller references) into `sink`. `scratch` is reused for
    /// SSD reads. A block from the SSD tier is verified before `sink` sees it.
    pub fn load(
        &self,
        hash: u64,
        scratch: &mut Vec<u8>,
        sink: impl FnOnce(&[u8]) -> Result<(), String>,
    ) -> Result<Tier, LoadError> {
        self.load_inner(hash, scratch, true, |b, _| sink(b).map(|()| 0))
    }

    /// [`BlockCache::load`] with a sink that verifies as it copies: `sink(bytes, sum)` copies
    /// the block where it goes and, where `sum` is true (a block from the SSD tier), returns
    /// the [`crate::hash::checksum`] of the bytes, taken in the same pass
    /// ([`crate::adapter::BlockAdapter::scatter_summed`]); otherwise its value is unused.
    /// An SSD block is then read from memory once instead of twice; the price is that a
    /// corrupt one has been copied before the checksum disagrees, so on
    /// [`LoadError::Ssd`] what the sink wrote must be treated as not loaded (the worker
    /// reports the block as failed, and the engine recomputes it).
    pub fn load_summed(
        &self,
        hash: u64,
        scratch: &mut Vec<u8>,
        sink: impl FnOnce(&[u8], bool) -> Result<u64, String>,
    ) -> Result<Tier, LoadError> {
        self.load_inner(hash, scratch, false, sink)
    }

    fn load_inner(
        &self,
        hash: u64,
        scratch: &mut Vec<u8>,
        verify_first: bool,
        sink: impl FnOnce(&[u8], bool) -> Result<u64, String>,
    ) -> Result<Tier, LoadError> {
        let view = self.lock().index.get(hash).ok_or(LoadError::Missing(hash))?;
        if view.state != State::Ready {
            return Err(LoadError::Missing(hash));
        }
        if let Some(c) = view.cpu {
            let r = self.cpu.with_slot(c, |buf| sink(buf, false)).ok_or(LoadError::Missing(hash))?;
            r.map_err(|message| LoadError::Sink { hash, message })?;
            bump(&self.counters.cpu_hits);
            return Ok(Tier::Cpu);
        }
        let (Some(s), Some(ssd)) = (view.ssd, self.ssd.as_ref()) else {
            return Err(LoadError::Missing(hash));
        };
        let read = if verify_first {
            ssd.read(s, hash, scratch).map(|payload| sink(payload, false).map(|_| payload))
        } else {
            ssd.read_into(s, hash, scratch, |payload| sink(payload, true))
        };
        let payload = match read {
            Ok(Ok(p)) => p,
            Ok(Err(message)) => return Err(LoadError::Sink { hash, message }),
            Err(source) => {
                let mut g = self.lock();
                let slots = g.index.mark_dead(hash);
                g.free(slots);
                g.event(removed(hash, Tier::Ssd));
                bump(&self.counters.ssd_corrupt);
                tracing::warn!(block = format!("{hash:016x}"), "flexkv: dropped an SSD block: {source}");
                return Err(LoadError::Ssd { hash, source });
            }
        };
        bump(&self.counters.ssd_hits);
        if self.promote {
            self.promote_block(hash, payload);
        }
        Ok(Tier::Ssd)
    }

    fn promote_block(&self, hash: u64, payload: &[u8]) {
        let g = self.lock();
        if !matches!(g.index.get(hash), Some(v) if v.state == State::Ready && v.cpu.is_none()) {
            return;
        }
        let (g, slot) = self.alloc_cpu(g);
        let Some(slot) = slot else { return };
        drop(g);
        let filled = self
            .cpu
            .with_slot_sum(slot, |buf, sum| {
                buf.copy_from_slice(payload);
                *sum = checksum(buf);
            })
            .is_some();
        let mut g = self.lock();
        match g.index.get(hash) {
            Some(v) if filled && v.state == State::Ready && v.cpu.is_none() => {
                g.index.set_slot(hash, Tier::Cpu, slot);
                let e = stored(&g.index, hash, Tier::Cpu, self.block_tokens);
                g.event(e);
                bump(&self.counters.promoted);
            }
            _ => g.cpu_pool.release(slot),
        }
    }

    /// A free CPU slot, making one by demoting or evicting the LRU block when needed. The
    /// lock is released while demoted blocks are written to SSD.
    fn alloc_cpu<'a>(&'a self, mut g: MutexGuard<'a, Inner>) -> (MutexGuard<'a, Inner>, Option<u32>) {
        let mut demote_ok = self.ssd.is_some();
        loop {
            if let Some(s) = g.cpu_pool.alloc() {
                return (g, Some(s));
            }
            // Dropping a block's last copy must not orphan its children.
            let can_demote = demote_ok;
            let victim = g.index.lru_victim(Tier::Cpu, |v| v.ssd.is_none() && !can_demote);
            let Some(v) = victim else { return (g, None) };
            let Some(view) = g.index.get(v) else { return (g, None) };
            if view.ssd.is_some() {
                let c = g.index.clear_slot(v, Tier::Cpu);
                g.free([c, None]);
                g.event(removed(v, Tier::Cpu));
                bump(&self.counters.cpu_evictions);
                continue;
            }
            if !demote_ok {
                if let Some(slots) = g.index.remove(v) {
                    g.free(slots);
                    g.event(removed(v, Tier::Cpu));
                    bump(&self.counters.evicted);
                    bump(&self.counters.cpu_evictions);
                    continue;
                }
                return (g, None);
            }
            let (batch, guard) = self.demote_batch(g);
            g = guard;
            if batch == 0 {
                demote_ok = false;
            }
        }
    }

    /// Most blocks one demotion moves to SSD: [`DEMOTE_BATCH_BYTES`] of them, at most a
    /// quarter of the CPU tier, at least one.
    pub fn demote_batch_blocks(&self) -> usize {
        let slots = self.lock().cpu_pool.capacity() as usize;
        demote_batch_blocks(self.cpu.slot_bytes(), slots)
    }

    /// Moves a batch of the least recently used CPU blocks that have no SSD copy to SSD:
    /// writes their records with the lock released, makes them durable with one sync, and only
    /// then enters them in the index and frees their CPU slots. Returns how many were
    /// demoted (0: no SSD slot, or the writes failed; the caller then evicts instead).
    fn demote_batch<'a>(&'a self, mut g: MutexGuard<'a, Inner>) -> (usize, MutexGuard<'a, Inner>) {
        let Some(ssd) = self.ssd.as_ref() else { return (0, g) };
        let max = demote_batch_blocks(self.cpu.slot_bytes(), g.cpu_pool.capacity() as usize);
        // (block, CPU slot, SSD slot); each is pinned while its record is written.
        let mut batch: Vec<(u64, u32, u32)> = Vec::new();
        while batch.len() < max {
            let Some(v) = g.index.lru_victim(Tier::Cpu, |_| false) else { break };
            let Some(view) = g.index.get(v) else { break };
            let Some(c) = view.cpu else { break };
            if view.ssd.is_some() {
                break;
            }
            let Some(s) = self.alloc_ssd(&mut g) else { break };
            g.index.pin(v);
            batch.push((v, c, s));
        }
        if batch.is_empty() {
            return (0, g);
        }
        drop(g);
        let mut written: Vec<std::io::Result<()>> = batch
            .iter()
            .map(|&(v, c, s)| {
                self.cpu
                    .with_slot_sum(c, |buf, sum| ssd.write_summed(s, v, buf, *sum))
                    .unwrap_or_else(|| Err(std::io::Error::other("CPU slot out of range")))
            })
            .collect();
        // Nothing enters the index before it is durable: one sync for the whole batch.
        if written.iter().any(|r| r.is_ok()) {
            if let Err(e) = ssd.sync() {
                let why = e.to_string();
                for r in written.iter_mut().filter(|r| r.is_ok()) {
                    *r = Err(std::io::Error::other(format!("syncing the SSD tier failed: {why}")));
                }
            }
        }
        let mut g = self.lock();
        let mut demoted = 0;
        for (&(v, _, s), r) in batch.iter().zip(written) {
            g.index.unpin(v);
            match r {
                Ok(()) => {
                    g.index.set_slot(v, Tier::Ssd, s);
                    let e = stored(&g.index, v, Tier::Ssd, self.block_tokens);
                    g.event(e);
                    bump(&self.counters.demoted);
                    demoted += 1;
                    // A load may have referenced the block (and be reading its CPU slot)
                    // while the lock was released: then it keeps both copies for now.
                    if g.index.get(v).is_some_and(|x| x.refs == 0) {
                        let c = g.index.clear_slot(v, Tier::Cpu);
                        g.free([c, None]);
                        g.event(removed(v, Tier::Cpu));
                        bump(&self.counters.cpu_evictions);
                    }
                }
                Err(e) => {
                    g.free([None, Some(s)]);
                    bump(&self.counters.ssd_write_errors);
                    tracing::warn!(
                        "flexkv: writing a block to the SSD tier failed ({e}); evicting from CPU without \
                         keeping an SSD copy"
                    );
                }
            }
        }
        (demoted, g)
    }

    /// A free SSD slot, evicting the LRU SSD block when needed (metadata only).
    fn alloc_ssd(&self, g: &mut MutexGuard<'_, Inner>) -> Option<u32> {
        loop {
            if let Some(s) = g.ssd_pool.as_mut()?.alloc() {
                return Some(s);
            }
            let v = g.index.lru_victim(Tier::Ssd, |v| v.cpu.is_none())?;
            let view = g.index.get(v)?;
            if view.cpu.is_some() {
                let s = g.index.clear_slot(v, Tier::Ssd);
                g.free([None, s]);
            } else {
                let slots = g.index.remove(v)?;
                g.free(slots);
                bump(&self.counters.evicted);
            }
            g.event(removed(v, Tier::Ssd));
            bump(&self.counters.ssd_evictions);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::block_hashes;

    fn fill(tag: u8) -> impl FnOnce(&mut [u8]) -> Result<(), String> {
        move |b: &mut [u8]| {
            b.iter_mut().enumerate().for_each(|(i, x)| *x = tag.wrapping_add(i as u8));
            Ok(())
        }
    }

    fn store_chain(c: &BlockCache, hashes: &[u64], tag: u8) -> Vec<StoreOutcome> {
        let mut parent = None;
        hashes
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let o = c.store(*h, parent, fill(tag.wrapping_add(i as u8))).unwrap();
                parent = Some(*h);
                o
            })
            .collect()
    }

    fn load(c: &BlockCache, h: u64) -> Result<(Tier, Vec<u8>), LoadError> {
        let mut out = Vec::new();
        let mut scratch = Vec::new();
        c.load(h, &mut scratch, |b| {
            out = b.to_vec();
            Ok(())
        })
        .map(|t| (t, out))
    }

    fn expected(tag: u8, n: usize) -> Vec<u8> {
        (0..n).map(|i| tag.wrapping_add(i as u8)).collect()
    }

    #[test]
    fn blocks_are_demoted_in_batches_each_synced_before_it_is_indexed() {
        let dir = tempfile::tempdir().unwrap();
        let ssd = SsdTier::open(dir.path(), "t", 100, 20 * 8192).unwrap();
        let c = BlockCache::new(8, 100, Some(ssd), false, String::new());
        assert_eq!(c.demote_batch_blocks(), 2, "a quarter of 8 CPU slots");
        let a = block_hashes(1, &(0..9).collect::<Vec<_>>(), 1);
        store_chain(&c, &a, 0);
        // The ninth block needed one slot; the two least recently used blocks moved together.
        assert_eq!(c.stats().demoted, 2);
        assert_eq!(c.sizes(), (9, 7, 2));
        c.pin_prefix(&a, 9);
        let mut from_ssd = 0;
        for (i, h) in a.iter().enumerate() {
            let (tier, bytes) = load(&c, *h).unwrap();
            assert_eq!(bytes, expected(i as u8, 100), "block {i}");
            from_ssd += usize::from(tier == Tier::Ssd);
        }
        assert_eq!(from_ssd, 2);
        c.unpin(&a);
        // Large blocks: 32 MiB of them at a time, whatever the CPU tier's size.
        assert_eq!(demote_batch_blocks(512 << 10, 100_000), 64);
        assert_eq!(demote_batch_blocks(512 << 10, 3), 1);
    }

    #[test]
    fn cpu_only_evicts_lru_leaves() {
        let c = BlockCache::new(4, 64, None, false, String::new());
        let a = block_hashes(1, &(0..48).collect::<Vec<_>>(), 16);
        let b = block_hashes(1, &(100..132).collect::<Vec<_>>(), 16);
        assert_eq!(store_chain(&c, &a, 0), vec![StoreOutcome::Stored; 3]);
        assert_eq!(c.pin_prefix(&a, 3), 3);
        c.unpin(&a);
        // b needs 2 slots: one free, then the LRU leaf of a goes.
        assert_eq!(store_chain(&c, &b, 50), vec![StoreOutcome::Stored; 2]);
        assert_eq!(c.match_len(&a), 2);
        assert_eq!(c.match_len(&b), 2);
        assert_eq!(c.stats().evicted, 1);
        assert_eq!(load(&c, a[1]).unwrap(), (Tier::Cpu, expected(1, 64)));
    }

    #[test]
    fn clear_empties_the_cache_unless_a_block_is_held() {
        let c = BlockCache::new(4, 8, None, false, String::new());
        let a = block_hashes(1, &[1, 2, 3], 1);
        store_chain(&c, &a, 0);
        c.take_events();
        assert_eq!(c.pin_prefix(&a, 2), 2);
        assert_eq!(c.clear(), None, "a pinned block keeps the cache as it is");
        assert_eq!(c.match_len(&a), 3);
        c.unpin(&a[..2]);
        assert_eq!(c.clear(), Some(3));
        assert_eq!((c.match_len(&a), c.sizes()), (0, (0, 0, 0)));
        let removed: Vec<u64> = c
            .take_events()
            .into_iter()
            .flat_map(|e| match e {
                KvEvent::BlockRemoved(r) => r.block_hashes,
                other => panic!("{other:?} on clear"),
            })
            .collect();
        assert_eq!(removed.len(), 3);
        // The freed slots take new blocks.
        let b = block_hashes(9, &[4, 5, 6, 7], 1);
        assert_eq!(store_chain(&c, &b, 0), vec![StoreOutcome::Stored; 4]);
    }

    #[test]
    fn pinned_blocks_are_never_evicted() {
        let c = BlockCache::new(2, 8, None, false, String::new());
        let a = block_hashes(1, &[1, 2], 1);
        store_chain(&c, &a, 0);
        assert_eq!(c.pin_prefix(&a, 2), 2);
        let b = block_hashes(9, &[3], 1);
        assert_eq!(store_chain(&c, &b, 0), vec![StoreOutcome::NoSpace]);
        assert_eq!(c.match_len(&a), 2);
        assert_eq!(c.stats().no_space, 1);
        c.unpin(&a);
        assert_eq!(store_chain(&c, &b, 0), vec![StoreOutcome::Stored]);
    }

    #[test]
    fn cpu_to_ssd_and_back_with_promotion() {
        let dir = tempfile::tempdir().unwrap();
        let ssd = SsdTier::open(dir.path(), "t", 100, 10 * 8192).unwrap();
        let c = BlockCache::new(2, 100, Some(ssd), true, String::new());
        let a = block_hashes(1, &(0..5).collect::<Vec<_>>(), 1);
        assert_eq!(store_chain(&c, &a, 10), vec![StoreOutcome::Stored; 5]);
        assert_eq!(c.stats().demoted, 3);
        assert_eq!(c.match_len(&a), 5);
        assert_eq!(c.sizes(), (5, 2, 3));
        let (on_cpu, on_ssd, _) = c.locate(a[0]).unwrap();
        assert!(!on_cpu && on_ssd);
        c.pin_prefix(&a, 1);
        assert_eq!(load(&c, a[0]).unwrap(), (Tier::Ssd, expected(10, 100)));
        c.unpin(&a[..1]);
        assert_eq!(c.stats().ssd_hits, 1);
        // Promotion gave it a CPU copy (by demoting another block).
        assert_eq!(c.stats().promoted, 1);
        assert_eq!(load(&c, a[0]).unwrap(), (Tier::Cpu, expected(10, 100)));
        for (i, h) in a.iter().enumerate() {
            assert_eq!(load(&c, *h).unwrap().1, expected(10 + i as u8, 100), "block {i}");
        }
    }

    /// The events of a workload through both tiers (demotions, a promotion, SSD evictions),
    /// applied in order, give exactly what each tier holds; each store names its parent.
    #[test]
    fn events_replay_to_the_tiers_contents() {
        use kvconnect_api::Medium;
        use std::collections::BTreeSet;
        let dir = tempfile::tempdir().unwrap();
        // Room for 4 blocks on SSD: the chains below overflow it.
        let ssd = SsdTier::open(dir.path(), "t", 100, 4 * 8192).unwrap();
        let c = BlockCache::new(2, 100, Some(ssd), true, String::new()).with_block_tokens(16);
        let a = block_hashes(1, &(0..5).collect::<Vec<_>>(), 1);
        let b = block_hashes(2, &(0..4).collect::<Vec<_>>(), 1);
        store_chain(&c, &a, 10);
        c.pin_prefix(&a, 1);
        load(&c, a[0]).unwrap();
        c.unpin(&a[..1]);
        store_chain(&c, &b, 20);
        let mut index = BTreeSet::new();
        let mut removals = std::collections::BTreeMap::new();
        for e in c.take_events() {
            match e {
                KvEvent::BlockStored(s) => {
                    let h = s.block_hashes[0];
                    assert_eq!(s.block_size, 16);
                    let chain = if a.contains(&h) { &a } else { &b };
                    let i = chain.iter().position(|x| *x == h).unwrap();
                    assert_eq!(s.parent_block_hash, i.checked_sub(1).map(|p| chain[p]), "parent of {h}");
                    assert!(index.insert((h, s.medium)), "stored twice");
                }
                KvEvent::BlockRemoved(r) => {
                    *removals.entry(r.medium.clone()).or_insert(0u64) += r.block_hashes.len() as u64;
                    for h in r.block_hashes {
                        assert!(index.remove(&(h, r.medium.clone())), "{h} removed from {} unheld", r.medium);
                    }
                }
                KvEvent::AllBlocksCleared => index.clear(),
            }
        }
        let mut held = BTreeSet::new();
        for h in a.iter().chain(&b) {
            if let Some((cpu, ssd, _)) = c.locate(*h) {
                if cpu {
                    held.insert((*h, Medium::CpuTier));
                }
                if ssd {
                    held.insert((*h, Medium::Disk));
                }
            }
        }
        assert_eq!(index, held);
        let st = c.stats();
        assert!(st.demoted > 4, "blocks went to SSD and some were evicted there");
        // Every removal here made room (nothing was reset), so each tier's evictions are its
        // removals.
        assert_eq!(st.cpu_evictions, removals[&Medium::CpuTier]);
        assert_eq!(st.ssd_evictions, removals[&Medium::Disk]);
        assert!(st.ssd_evictions > 0);
        let (_, on_cpu, on_ssd) = c.sizes();
        assert_eq!(c.capacities(), (2, 4));
        assert!(on_cpu <= 2 && on_ssd <= 4, "{on_cpu} on CPU, {on_ssd} on SSD");
    }

    /// A cache of one CPU slot over an SSD tier, holding a chain of three 100-byte blocks:
    /// a[0] and a[1] on SSD (records 0 and 1), a[2] in the CPU tier.
    fn three_blocks_two_on_ssd() -> (tempfile::TempDir, std::path::PathBuf, BlockCache, Vec<u64>) {
        let dir = tempfile::tempdir().unwrap();
        let ssd = SsdTier::open(dir.path(), "t", 100, 10 * 8192).unwrap();
        let path = ssd.path().to_path_buf();
        let c = BlockCache::new(1, 100, Some(ssd), false, String::new());
        let a = block_hashes(1, &[1, 2, 3], 1);
        store_chain(&c, &a, 0);
        (dir, path, c, a)
    }

    #[test]
    fn corrupted_ssd_block_is_a_miss_and_never_loaded() {
        use std::os::unix::fs::FileExt;
        let (_dir, path, c, a) = three_blocks_two_on_ssd();
        // a[0] and a[1] are on SSD in records 0 and 1; flip a byte of record 0's payload.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[0xee], 4096 + 7).unwrap();
        c.pin_prefix(&a, 3);
        let mut sunk = false;
        let e = c
            .load(a[0], &mut Vec::new(), |_| {
                sunk = true;
                Ok(())
            })
            .unwrap_err();
        assert!(matches!(e, LoadError::Ssd { .. }), "{e}");
        assert!(!sunk, "corrupt bytes were handed out");
        c.unpin(&a);
        assert_eq!(c.match_len(&a), 0);
        assert_eq!(c.stats().ssd_corrupt, 1);
        // The prefix can be cached again.
        assert_eq!(store_chain(&c, &a[..1], 0), vec![StoreOutcome::Stored]);
        assert_eq!(c.match_len(&a), 3);
    }

    #[test]
    fn a_block_loaded_summed_is_verified_by_the_sinks_checksum() {
        use std::os::unix::fs::FileExt;
        let (_dir, path, c, a) = three_blocks_two_on_ssd();
        c.pin_prefix(&a, 3);
        // From the CPU tier no checksum is asked for; from SSD one is, and a right one loads.
        let mut asked = Vec::new();
        let mut sink = |b: &[u8], sum: bool| {
            asked.push(sum);
            Ok(if sum { crate::hash::checksum(b) } else { 0 })
        };
        assert_eq!(c.load_summed(a[2], &mut Vec::new(), &mut sink).unwrap(), Tier::Cpu);
        assert_eq!(c.load_summed(a[1], &mut Vec::new(), &mut sink).unwrap(), Tier::Ssd);
        assert_eq!(asked, [false, true]);
        // A sum that disagrees with the record (here: a sink that sums other bytes) is
        // corruption: the block is dropped.
        let e = c.load_summed(a[1], &mut Vec::new(), |_, _| Ok(12345)).unwrap_err();
        assert!(matches!(e, LoadError::Ssd { .. }) && e.to_string().contains("checksum mismatch"), "{e}");
        assert_eq!(c.stats().ssd_corrupt, 1);
        // A flipped byte on disk: the sink copied it, the load fails, the block is gone.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[0xee], 4096 + 7).unwrap();
        let e = c.load_summed(a[0], &mut Vec::new(), |b, _| Ok(crate::hash::checksum(b))).unwrap_err();
        assert!(matches!(e, LoadError::Ssd { .. }), "{e}");
        assert_eq!(c.stats().ssd_corrupt, 2);
        // A sink's own failure is the sink's error, not corruption.
        let e = c.load_summed(a[2], &mut Vec::new(), |_, _| Err("sink failed".into())).unwrap_err();
        assert!(matches!(e, LoadError::Sink { .. }) && e.to_string().contains("sink failed"), "{e}");
        assert_eq!(c.stats().ssd_corrupt, 2);
        c.unpin(&a);
        assert_eq!(c.match_len(&a), 0);
    }

    #[test]
    fn a_full_disk_degrades_to_cpu_eviction() {
        let full = std::path::Path::new("/dev/full");
        if !full.exists() {
            eprintln!("skipping: /dev/full is not available");
            return;
        }
        let ssd = SsdTier::open(full, "t", 100, 10 * 8192).unwrap();
        let c = BlockCache::new(2, 100, Some(ssd), true, String::new());
        let a = block_hashes(1, &[1, 2, 3, 4], 1);
        let b = block_hashes(2, &[1, 2], 1);
        store_chain(&c, &a, 0);
        // a's leaves give way; nothing is kept on the full disk.
        assert!(c.stats().ssd_write_errors >= 1);
        assert_eq!(c.sizes().2, 0);
        assert_eq!(c.match_len(&a), 2);
        assert_eq!(store_chain(&c, &b, 0), vec![StoreOutcome::Stored; 2]);
        assert_eq!(load(&c, b[1]).unwrap().1, expected(1, 100));
    }
}
