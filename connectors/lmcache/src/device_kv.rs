//! KV regions in GPU memory (feature `cuda`): the CPU tier's chunks live in a pinned slab,
//! and saves and loads copy between the device blocks and the chunk slots directly.
//!
//! **Save.** Every full chunk of a request gets a slot of the pinned slab
//! ([`crate::pinned_slab`]); ONE launch of the gather kernel writes all their blocks, of every
//! layer and K/V part, straight into the slots in chunk layout ([`crate::chunk_grid`]), and
//! the slots become the stored chunks: no host copy. A partial chunk (fewer tokens than a
//! chunk, with `save_unfull_chunk`) and the chunks the slab has no free slot for are built on
//! the heap as before: their blocks are gathered into a pinned host copy with one more launch
//! ([`kvconnect_cuda::KvStage`]) and the chunk code copies out of it. Both counts are in the
//! store's statistics (`pinned_chunks_saved`, `pinned_fallback_chunks`).
//!
//! **Load.** Blocks wholly covered by a full chunk held in a slot are scattered straight from
//! the slot with one launch (the kernel reads the slab through its device mapping). The
//! other blocks (chunks from the heap or the disk tier, and blocks a load writes only partly,
//! where it starts or ends inside a block) go through a host copy: partly written blocks are
//! gathered first so their other tokens stay as they were, the chunk bytes are written in,
//! and those blocks are scattered back with one launch. Everything is done before
//! `start_load_kv` returns.
//!
//! Both are whole-request: with device KV, `use_layerwise` saves everything at
//! `wait_for_save` and loads everything at `start_load_kv` (a per-layer gather would cost a
//! launch and a synchronisation per layer and request, and the engine's layer waits then
//! return at once).

use crate::chunk_buf::ChunkBuf;
use crate::chunk_grid::{staged_runs, ChunkGrid};
use crate::chunk_layout::ChunkLayout;
use crate::meta::{LoadSpec, SaveSpec};
use crate::pinned_slab::{PinnedSlab, PinnedSlot};
use crate::store::{ChunkBytes, ChunkStore};
use kvconnect_api::{BlockId, ConnectorError, EffectiveLayout, KvRegion, ModelSpec};
use kvconnect_cuda::kv_stage::BlockGrid;
use kvconnect_cuda::KvStage;
use std::sync::Arc;

/// The device regions of one worker, the pinned CPU-tier slab and the grid of its slots.
pub struct DeviceKv {
    stage: KvStage,
    slab: Option<Arc<PinnedSlab>>,
    grid: ChunkGrid,
}

impl std::fmt::Debug for DeviceKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKv").field("stage", &self.stage).field("slab", &self.slab).finish()
    }
}

impl DeviceKv {
    /// The pinned slab, if the CPU tier has one.
    pub fn slab(&self) -> Option<&Arc<PinnedSlab>> {
        self.slab.as_ref()
    }

    fn block_grid<'a>(&'a self, slab: &PinnedSlab) -> BlockGrid<'a> {
        BlockGrid { device_ptr: slab.device_ptr(), len: slab.bytes() as u64, units: self.grid.units() }
    }
}

/// How many chunk slots a CPU tier of `budget` bytes gets: as many whole chunks as the
/// budget holds, no more than the kernel's 32-bit block index can address.
pub fn slot_count(budget: u64, grid: &ChunkGrid) -> u32 {
    let slot = grid.slot_bytes() as u64;
    if slot == 0 || grid.block_bytes() == 0 {
        return 0;
    }
    let per_slot = slot / grid.block_bytes() as u64;
    let by_index = (u32::MAX as u64 + 1) / per_slot.max(1);
    (budget / slot).min(by_index).min(u32::MAX as u64) as u32
}

/// Opens the regions' GPU, prepares the stage and pins the CPU tier's slab (sized from its
/// budget: `max_local_cpu_size`). A stage failure (no driver, no GPU, regions on two GPUs, a
/// layout one gather cannot copy) is a config error naming the cause; a slab that cannot be
/// pinned is logged and saves then build heap chunks.
pub fn open(
    regions: &[KvRegion],
    model: &ModelSpec,
    eff: &EffectiveLayout,
    layout: &ChunkLayout,
    chunk_tokens: usize,
    store: &ChunkStore,
) -> Result<DeviceKv, ConnectorError> {
    let stage = KvStage::open(regions, model, eff)
        .map_err(|e| ConnectorError::config("lmcache", format!("device KV regions cannot be staged: {e}")))?;
    let grid = ChunkGrid::new(layout, chunk_tokens);
    let slots = slot_count(store.cpu_budget(), &grid);
    let slab = if slots == 0 {
        tracing::info!(
            budget = store.cpu_budget(),
            chunk_bytes = grid.slot_bytes(),
            "lmcache: the CPU tier holds no whole chunk; device saves build heap chunks"
        );
        None
    } else {
        match PinnedSlab::new(stage.gpu(), grid.slot_bytes(), slots) {
            Ok(s) => {
                tracing::info!(slots, bytes = s.bytes(), "lmcache: pinned CPU tier allocated");
                Some(s)
            }
            Err(e) => {
                tracing::warn!("lmcache: {e}; device saves build heap chunks instead");
                None
            }
        }
    };
    Ok(DeviceKv { stage, slab, grid })
}

/// Saves every chunk of `spec`: full chunks straight into pinned slots with one launch, the
/// rest on the heap. Returns the chunks' buffers in `spec.chunks` order.
pub fn save(
    dkv: &DeviceKv,
    store: &ChunkStore,
    layout: &ChunkLayout,
    spec: &SaveSpec,
) -> Result<Vec<ChunkBuf>, String> {
    let n = spec.chunks.len();
    let mut slotted: Vec<Option<PinnedSlot>> = (0..n).map(|_| None).collect();
    if let Some(slab) = &dkv.slab {
        let full: Vec<usize> = (0..n).filter(|i| spec.chunks[*i].tokens == dkv.grid.chunk_tokens()).collect();
        if slab.free_slots() < full.len() {
            // What `put` would evict for this save anyway, evicted first so its slots are
            // free for the gather.
            let bytes: usize = spec.chunks.iter().map(|c| layout.chunk_bytes(c.tokens)).sum();
            store.make_room(bytes as u64);
        }
        let slots = slab.take(full.len(), dkv.grid.slot_bytes());
        let mut placed = Vec::with_capacity(slots.len());
        for (ci, slot) in full.into_iter().zip(slots) {
            placed.push((spec.chunks[ci].start, slot.index()));
            slotted[ci] = Some(slot);
        }
        let pairs = dkv.grid.save_pairs(&spec.blocks, &placed)?;
        if !pairs.is_empty() {
            dkv.stage.gather_to_grid(&dkv.block_grid(slab), &pairs).map_err(|e| e.to_string())?;
        }
    }
    let rest: Vec<usize> = (0..n).filter(|i| slotted[*i].is_none()).collect();
    let mut heap = save_heap(&dkv.stage, store, layout, spec, &rest)?.into_iter();
    store.count_pinned(n - rest.len(), rest.len());
    let mut out = Vec::with_capacity(n);
    for s in slotted {
        match s {
            Some(slot) => out.push(ChunkBuf::Pinned(slot)),
            None => out.push(ChunkBuf::Heap(heap.next().ok_or("a heap chunk went missing")?)),
        }
    }
    Ok(out)
}

/// Bytes of chunk copies one thread takes on, at least (smaller saves stay on the caller's
/// thread: spawning costs more than it saves).
const BYTES_PER_THREAD: usize = 8 << 20;
/// At most this many copy threads per save.
const MAX_THREADS: usize = 8;

/// Builds heap buffers for chunks `which` of `spec` (in that order): gathers the blocks they
/// span into a pinned host copy with one launch and copies every layer of every chunk out of
/// it. Long saves are split across a few threads by chunk.
fn save_heap(
    stage: &KvStage,
    store: &ChunkStore,
    layout: &ChunkLayout,
    spec: &SaveSpec,
    which: &[usize],
) -> Result<Vec<Vec<u8>>, String> {
    if which.is_empty() {
        return Ok(Vec::new());
    }
    let bs = layout.block_size().max(1);
    let chunks: Vec<crate::key::ChunkRef> = which.iter().map(|i| spec.chunks[*i]).collect();
    let lo = chunks.iter().map(|c| c.start / bs).min().unwrap_or(0);
    let hi = chunks.iter().map(|c| layout.block_indices(c.start, c.start + c.tokens).end).max().unwrap_or(0);
    if hi > spec.blocks.len() {
        return Err(format!("tokens of the save need {hi} blocks but the request has {}", spec.blocks.len()));
    }
    let copy = stage.gather(&spec.blocks[lo..hi]).map_err(|e| e.to_string())?;
    // Block-table index i is the copy's block i - lo (indices below lo are never read).
    let ids: Vec<BlockId> = (0..hi).map(|i| BlockId(i.saturating_sub(lo) as u32)).collect();
    let mem = copy.memory();
    let mut bufs: Vec<Vec<u8>> =
        chunks.iter().map(|c| store.take_buffer(layout.chunk_bytes(c.tokens))).collect();
    let one = |chunks: &[crate::key::ChunkRef], bufs: &mut [Vec<u8>]| -> Result<(), String> {
        for (c, buf) in chunks.iter().zip(bufs.iter_mut()) {
            for layer in layout.kv_layers() {
                layout.save_layer(mem, *layer, &ids, c.start, c.tokens, buf).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    };
    let n = chunks.len();
    let bytes: usize = chunks.iter().map(|c| layout.chunk_bytes(c.tokens)).sum();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (bytes / BYTES_PER_THREAD).min(cores).min(MAX_THREADS).min(n).max(1);
    if threads == 1 {
        one(&chunks, &mut bufs)?;
        return Ok(bufs);
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> =
            chunks.chunks(per).zip(bufs.chunks_mut(per)).map(|(c, b)| s.spawn(move || one(c, b))).collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|_| Err("a chunk copy thread panicked".into())))
    })?;
    Ok(bufs)
}

/// The slot of a fetched chunk in this worker's slab (its whole blocks scatter straight into
/// the device when it is a full chunk).
fn direct_slot<'a>(dkv: &DeviceKv, bytes: &'a ChunkBytes) -> Option<&'a PinnedSlot> {
    let slab = dkv.slab.as_ref()?;
    let ChunkBytes::Mem(d) = bytes else { return None };
    let slot = d.pinned()?;
    Arc::ptr_eq(slot.slab(), slab).then_some(slot)
}

/// Writes a load's fetched chunks into the device blocks. Returns the first token that did
/// not load (`spec.end` when everything did) and the reason.
pub fn load(
    dkv: &DeviceKv,
    layout: &ChunkLayout,
    spec: &LoadSpec,
    chunks: &[(usize, ChunkBytes)],
) -> (usize, Option<String>) {
    // Chunks were fetched in order and stop at the first missing one.
    let mut hi = chunks
        .last()
        .and_then(|(ci, _)| spec.chunks.get(*ci))
        .map_or(spec.start, |c| (c.start + c.tokens).min(spec.end));
    if hi <= spec.start {
        return (spec.start, None);
    }
    let idx = layout.block_indices(spec.start, hi);
    if idx.end > spec.blocks.len() {
        return (
            spec.start,
            Some(format!(
                "tokens up to {hi} need {} blocks but the request has {}",
                idx.end,
                spec.blocks.len()
            )),
        );
    }
    // Full chunks in slots scatter their whole blocks straight into the device.
    let placed: Vec<(usize, usize, Option<u32>)> = chunks
        .iter()
        .map(|(ci, bytes)| {
            let c = spec.chunks[*ci];
            (c.start, c.tokens, direct_slot(dkv, bytes).map(PinnedSlot::index))
        })
        .collect();
    let split = dkv.grid.split_load(&placed, spec.start, hi);
    let mut why = None;
    if split.staged.iter().any(|s| *s) {
        match load_staged(&dkv.stage, layout, spec, chunks, &split.staged, hi) {
            Ok(()) => {}
            Err((to, e)) => {
                hi = to;
                why = Some(e);
            }
        }
    }
    let end = layout.block_indices(spec.start, hi).end;
    let pairs: Vec<(u32, BlockId)> =
        split.direct.iter().filter(|(i, _)| *i < end).map(|(i, k)| (*k, spec.blocks[*i])).collect();
    if let (Some(slab), false) = (&dkv.slab, pairs.is_empty()) {
        if let Err(e) = dkv.stage.scatter_from_grid(&dkv.block_grid(slab), &pairs) {
            return (spec.start, Some(e.to_string()));
        }
    }
    (hi, why)
}

/// Loads the blocks marked in `staged` (block-table indices) through a host copy holding
/// just those blocks, in order. On failure returns the first token not loaded and why;
/// blocks before it are scattered.
fn load_staged(
    stage: &KvStage,
    layout: &ChunkLayout,
    spec: &LoadSpec,
    chunks: &[(usize, ChunkBytes)],
    staged: &[bool],
    hi: usize,
) -> Result<(), (usize, String)> {
    let bs = layout.block_size().max(1);
    // Staged block i is the copy's block rank[i]; other entries are never read (the runs
    // below cover staged blocks only).
    let mut rank = vec![0u32; staged.len()];
    let mut n = 0u32;
    for (r, s) in rank.iter_mut().zip(staged) {
        if *s {
            *r = n;
            n += 1;
        }
    }
    let mut copy = stage.host_copy(n as usize).map_err(|e| (spec.start, e.to_string()))?;
    let at = |i: usize| rank[i];
    // Partly written blocks keep their other tokens: bring them up first.
    let mut edges: Vec<(BlockId, u32)> = Vec::new();
    let first = spec.start / bs;
    let last = (hi - 1) / bs;
    if !spec.start.is_multiple_of(bs) && staged[first] {
        edges.push((spec.blocks[first], at(first)));
    }
    if !hi.is_multiple_of(bs) && staged[last] && (last != first || edges.is_empty()) {
        edges.push((spec.blocks[last], at(last)));
    }
    stage.gather_into(&mut copy, &edges).map_err(|e| (spec.start, e.to_string()))?;
    let ids: Vec<BlockId> = rank.iter().map(|r| BlockId(*r)).collect();
    let mut hi = hi;
    let mut why = None;
    'chunks: for (ci, bytes) in chunks {
        let c = spec.chunks[*ci];
        for (t0, t1) in staged_runs(staged, bs, c.start, c.tokens, spec.start, hi) {
            for li in 0..layout.kv_layers().len() {
                if let Err(err) =
                    layout.load_layer(copy.memory(), li, &ids, c.start, c.tokens, t0, t1, bytes.as_slice())
                {
                    hi = hi.min(c.start.max(spec.start));
                    why = Some(err.to_string());
                    break 'chunks;
                }
            }
        }
    }
    let pairs: Vec<(u32, BlockId)> = layout
        .block_indices(spec.start, hi)
        .filter(|i| staged[*i])
        .map(|i| (at(i), spec.blocks[i]))
        .collect();
    stage.scatter(&copy, &pairs).map_err(|e| (spec.start, e.to_string()))?;
    match why {
        Some(w) => Err((hi, w)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::{AttentionKind, Dtype, KvGroup, KvLayout, LayerId, MemoryKind, TransferMode};

    #[test]
    fn slots_follow_the_budget_and_the_kernel_index() {
        let model = ModelSpec {
            name: "m".into(),
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: Some(Dtype::F16),
            layers: vec![AttentionKind::Full; 2],
            state: None,
        };
        let eff = EffectiveLayout {
            layout: KvLayout::NHD,
            hma: false,
            block_size: 16,
            cache_dtype: Dtype::F16,
            memory: MemoryKind::Device,
            transfer_mode: TransferMode::None,
            groups: vec![KvGroup { kind: AttentionKind::Full, layers: vec![LayerId(0), LayerId(1)] }],
            state_groups: vec![],
            opaque_blocks: false,
        };
        let cl = ChunkLayout::new(&model, &eff, 64).unwrap();
        let grid = ChunkGrid::new(&cl, 64);
        // 2 layers x 2 parts x 64 tokens x 32 bytes.
        assert_eq!(grid.slot_bytes(), 8192);
        assert_eq!(slot_count(8192 * 10 + 100, &grid), 10);
        assert_eq!(slot_count(8191, &grid), 0, "no whole chunk fits");
        // 16 blocks a slot: at most 2^32 / 16 slots are addressable.
        assert_eq!(slot_count(u64::MAX, &grid), (1u64 << 28) as u32);
    }
}
