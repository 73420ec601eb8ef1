//! The KV block pool: host-memory regions laid out as the effective layout says, and one
//! block table (id space, free list) per KV cache group.
//!
//! Per-layer layouts (`LB...`) get one region per KV layer; cross-layer layouts (`BL...`)
//! one region per KV cache group holding that group's layers. Offsets come from
//! `kvconnect_api::geometry` only, through a bounds-checked `KvMemory` over the pool's own
//! regions, so the engine and every connector address a block the same way.

#![allow(unsafe_code)] // Vouches for the block pool's KV regions (`KvRegion::new`) and reads them.

use crate::error::EngineError;
use crate::prefix_cache::PrefixCache;
use crate::region::RegionMemory;
use crate::shm;
use crate::state_pool::StatePool;
use kvconnect_api::geometry::BlockShape;
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::layout::Dim;
use kvconnect_api::{
    BlockId, BlocksPerGroup, Dtype, EffectiveLayout, KvEvent, KvLayout, KvRegion, KvRegionSpec, LayerId,
    MemoryKind, ModelSpec, TransferMode,
};

/// An effective layout for one engine on its own, without negotiation: the KV cache groups
/// `negotiate` would give (HMA on: one per attention kind; off: one of every KV layer) and
/// the model's state groups, host memory, no transfer.
pub fn local_effective_layout(
    model: &ModelSpec,
    layout: KvLayout,
    hma: bool,
    block_size: u32,
    cache_dtype: Dtype,
) -> EffectiveLayout {
    let groups = kvconnect_api::negotiate::kv_groups(model, hma);
    EffectiveLayout {
        layout,
        hma,
        block_size,
        cache_dtype,
        memory: MemoryKind::Host,
        transfer_mode: TransferMode::None,
        groups,
        state_groups: kvconnect_api::negotiate::state_groups(model),
        opaque_blocks: false,
    }
}

/// One host region the pool allocates: name, bytes, layers, group and blocks (or slots).
pub(crate) struct HostRegion {
    pub name: String,
    pub len: usize,
    pub layers: Vec<LayerId>,
    pub group: usize,
    pub num_blocks: u32,
}

/// Allocates `r` (a shared-memory segment named for `shm_engine_id` and its index, or private
/// memory) and appends it, vouched for, to `regions`, and its memory to `memories`.
pub(crate) fn push_host_region(
    r: HostRegion,
    shm_engine_id: Option<&str>,
    regions: &mut Vec<KvRegion>,
    memories: &mut Vec<RegionMemory>,
) -> Result<(), EngineError> {
    let memory = match shm_engine_id {
        Some(id) => RegionMemory::shm(&shm::segment_name(id, regions.len())?, r.len)?,
        None => RegionMemory::heap(&r.name, r.len)?,
    };
    let spec = KvRegionSpec {
        name: r.name,
        addr: memory.ptr() as u64,
        len: r.len as u64,
        memory: MemoryKind::Host,
        device: -1,
        layers: r.layers,
        group: r.group as u32,
        num_blocks: r.num_blocks,
        shm_name: memory.shm_name().map(str::to_owned),
    };
    // SAFETY: the region is `memory`, valid for reads and writes of `len` bytes, which the
    // pool keeps (never moving its contents) until it is dropped; the pool drops its own `mem`
    // first, and the engine shuts down and drops its connector, the only other holder of the
    // regions, before the pool.
    regions.push(unsafe { KvRegion::new(spec) });
    memories.push(memory);
    Ok(())
}

/// Element strides (in elements) of H, N and C inside one block span, per the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InnerStrides {
    /// Stride of a KV head.
    pub head: usize,
    /// Stride of a token slot.
    pub token: usize,
    /// Stride of a channel.
    pub channel: usize,
}

/// The block pool. Owns the region memory; frees it (and unlinks shared-memory segments)
/// on drop.
#[derive(Debug)]
pub struct KvPool {
    effective: EffectiveLayout,
    shape: BlockShape,
    strides: InnerStrides,
    // `mem` holds raw addresses into `memories`; it is declared first so it drops first.
    mem: KvMemory,
    regions: Vec<KvRegion>,
    memories: Vec<RegionMemory>,
    layer_group: Vec<Option<usize>>,
    free: Vec<Vec<u32>>,
    /// Per group and block: how many requests use it (0: free, or idle in `cache`).
    refs: Vec<Vec<u32>>,
    /// Per state group: its free state slots, and which slots are in use.
    state: StatePool,
    /// Full prompt blocks known by their tokens' hash (empty unless prefix caching is on).
    cache: PrefixCache,
    num_blocks: u32,
    /// Tensor-parallel ranks: each holds `num_kv_heads / tp_ranks` heads in its own regions.
    tp_ranks: u32,
    /// With several ranks: one rank's block shape and strides (the pool's own are those of
    /// a whole block, all heads, which `read_block` gathers and `write_block` scatters).
    rank_shape: BlockShape,
    rank_strides: InnerStrides,
}

impl KvPool {
    /// Allocates `num_blocks` blocks per KV cache group. With `shm_engine_id`, every region
    /// is a shared-memory segment named by [`shm::segment_name`]; otherwise private memory.
    pub fn new(
        model: &ModelSpec,
        eff: &EffectiveLayout,
        num_blocks: u32,
        shm_engine_id: Option<&str>,
    ) -> Result<KvPool, EngineError> {
        Self::with_tp_ranks(model, eff, num_blocks, shm_engine_id, 1)
    }

    /// [`KvPool::new`] for `tp_ranks` tensor-parallel ranks: every rank gets its own regions
    /// (registered rank by rank) holding its `num_kv_heads / tp_ranks` KV heads of every
    /// layer, and all ranks share one block table, as vLLM's TP workers do.
    pub fn with_tp_ranks(
        model: &ModelSpec,
        eff: &EffectiveLayout,
        num_blocks: u32,
        shm_engine_id: Option<&str>,
        tp_ranks: u32,
    ) -> Result<KvPool, EngineError> {
        let lay = |m: String| EngineError::Layout(m);
        if tp_ranks == 0 || !model.num_kv_heads.is_multiple_of(tp_ranks) {
            return Err(EngineError::TpSize { tp_size: tp_ranks, kv_heads: model.num_kv_heads });
        }
        // Device KV: this pool is the engine's host working copy, `device_pool` the regions
        // the connectors see.
        if !matches!(eff.memory, MemoryKind::Host | MemoryKind::Device) {
            return Err(lay(format!(
                "memory kind is {:?}; the worker keeps KV in host or device memory (kv_buffer_device \"cpu\" \
                    or \"cuda\")",
                eff.memory
            )));
        }
        if eff.block_size == 0 {
            return Err(lay("block_size is 0; use a positive block size such as 16".into()));
        }
        if num_blocks == 0 {
            return Err(lay("num_blocks is 0; the pool needs at least one block per KV cache group".into()));
        }
        if eff.groups.is_empty() {
            return Err(lay(
                "no KV cache groups: the effective layout must list the model's KV layers".into()
            ));
        }
        if !eff.hma && eff.groups.len() != 1 {
            return Err(lay(format!(
                "hybrid KV cache manager is off but the layout has {} KV cache groups; with HMA off all KV \
                    layers form one group",
                eff.groups.len()
            )));
        }
        let n = model.layers.len();
        let mut layer_group = vec![None; n];
        for (gi, g) in eff.groups.iter().enumerate() {
            if g.layers.is_empty() {
                return Err(lay(format!("KV cache group {gi} holds no layers")));
            }
            for l in &g.layers {
                let i = l.0 as usize;
                if i >= n {
                    return Err(lay(format!("group {gi} names layer {l}, but the model has {n} layers")));
                }
                if !model.layers[i].has_kv_blocks() {
                    return Err(lay(format!("group {gi} names layer {l}, which stores no KV blocks")));
                }
                if layer_group[i].replace(gi).is_some() {
                    return Err(lay(format!("layer {l} is in more than one KV cache group")));
                }
            }
        }
        if let Some(i) = (0..n).find(|i| model.layers[*i].has_kv_blocks() && layer_group[*i].is_none()) {
            return Err(lay(format!("layer {i} stores KV but is in no KV cache group")));
        }
        let shape = BlockShape::of(model, eff);
        let rank_shape = BlockShape { heads: shape.heads / tp_ranks, ..shape };
        // (name, layers, group) of every region of one rank, in registration order.
        let rank_plan: Vec<(String, Vec<LayerId>, usize)> = if eff.layout.is_cross_layer() {
            eff.groups
                .iter()
                .enumerate()
                .map(|(gi, g)| (format!("group{gi}"), g.layers.clone(), gi))
                .collect()
        } else {
            (0..n)
                .filter_map(|i| layer_group[i].map(|g| (format!("layer.{i}"), vec![LayerId(i as u32)], g)))
                .collect()
        };
        let plan: Vec<(String, Vec<LayerId>, usize)> = if tp_ranks == 1 {
            rank_plan
        } else {
            (0..tp_ranks)
                .flat_map(|r| rank_plan.iter().map(move |(n, l, g)| (format!("rank{r}.{n}"), l.clone(), *g)))
                .collect()
        };
        let mut memories = Vec::with_capacity(plan.len());
        let mut regions = Vec::with_capacity(plan.len());
        for (name, layers, group) in plan {
            let len = layers
                .len()
                .checked_mul(num_blocks as usize)
                .and_then(|x| x.checked_mul(rank_shape.layer_block_bytes()))
                .ok_or_else(|| EngineError::Alloc { name: name.clone(), bytes: usize::MAX })?;
            let spec = HostRegion { name, len, layers, group, num_blocks };
            push_host_region(spec, shm_engine_id, &mut regions, &mut memories)?;
        }
        if tp_ranks > 1 && !eff.state_groups.is_empty() {
            return Err(lay(format!(
                "not implemented: state layers (per-request state slots) across {tp_ranks} tensor-parallel \
                    ranks; run a model with state layers at tp_size 1"
            )));
        }
        let state = StatePool::allocate(eff, num_blocks, shm_engine_id, &mut regions, &mut memories)?;
        let mem = KvMemory::with_tp_ranks(&regions, model, eff, tp_ranks)?;
        let strides = inner_strides(eff.layout, &shape);
        let rank_strides = inner_strides(eff.layout, &rank_shape);
        let free = eff.groups.iter().map(|_| (0..num_blocks).rev().collect()).collect();
        let refs = eff.groups.iter().map(|_| vec![0; num_blocks as usize]).collect();
        Ok(KvPool {
            effective: eff.clone(),
            shape,
            strides,
            mem,
            regions,
            memories,
            layer_group,
            free,
            refs,
            state,
            cache: PrefixCache::new(eff.groups.len()),
            num_blocks,
            tp_ranks,
            rank_shape,
            rank_strides,
        })
    }

    /// The regions, in registration order (what `register_kv_caches` receives).
    pub fn regions(&self) -> &[KvRegion] {
        &self.regions
    }

    /// Bounds-checked access to the regions.
    pub fn memory(&self) -> &KvMemory {
        &self.mem
    }

    /// The effective layout the pool follows.
    pub fn effective(&self) -> &EffectiveLayout {
        &self.effective
    }

    /// One block's shape.
    pub fn shape(&self) -> BlockShape {
        self.shape
    }

    /// Strides of H, N, C inside a block span.
    pub fn strides(&self) -> InnerStrides {
        self.strides
    }

    /// Number of KV cache groups (block tables).
    pub fn num_groups(&self) -> usize {
        self.free.len()
    }

    /// The KV cache group of a layer (None for a layer without KV blocks).
    pub fn group_of(&self, layer: LayerId) -> Option<usize> {
        self.layer_group.get(layer.0 as usize).copied().flatten()
    }

    /// Blocks per group.
    pub fn blocks_per_group(&self) -> u32 {
        self.num_blocks
    }

    /// Blocks in all groups together.
    pub fn total_blocks(&self) -> usize {
        self.num_blocks as usize * self.free.len()
    }

    /// Free blocks in all groups together.
    pub fn free_blocks(&self) -> usize {
        (0..self.free.len()).map(|g| self.free[g].len() + self.cache.idle(g)).sum()
    }

    /// Takes `n` blocks from every group, or none at all when some group has fewer free.
    /// Free blocks go first; then idle cached blocks, longest idle first (their cached
    /// prefix is forgotten).
    pub fn allocate(&mut self, n: usize) -> Option<BlocksPerGroup> {
        if (0..self.free.len()).any(|g| self.free[g].len() + self.cache.idle(g) < n) {
            return None;
        }
        let mut lists = Vec::with_capacity(self.free.len());
        for g in 0..self.free.len() {
            let mut list = Vec::with_capacity(n);
            for _ in 0..n {
                if let Some(b) = self.free[g].pop().or_else(|| self.cache.evict(g)) {
                    self.refs[g][b as usize] = 1;
                    list.push(BlockId(b));
                }
            }
            lists.push(list);
        }
        Some(BlocksPerGroup(lists))
    }

    /// Takes `n` more blocks for every group and appends them to `blocks`; false (nothing
    /// taken) when some group has fewer free.
    pub fn extend(&mut self, blocks: &mut BlocksPerGroup, n: usize) -> bool {
        match self.allocate(n) {
            Some(more) => {
                for (have, add) in blocks.0.iter_mut().zip(more.0) {
                    have.extend(add);
                }
                true
            }
            None => false,
        }
    }

    /// Gives up one use of each block. A block nobody uses any more returns to its group's
    /// free list, or, when it holds a cached prefix, stays cached as idle. Ids out of range
    /// or not in use are ignored with a warning (they would corrupt the free list).
    pub fn release(&mut self, blocks: &BlocksPerGroup) {
        for (g, list) in blocks.0.iter().enumerate() {
            if let Some(sg) = g.checked_sub(self.free.len()).filter(|sg| *sg < self.state.groups()) {
                self.state.release(sg, list);
                continue;
            }
            if g >= self.free.len() {
                tracing::warn!(group = g, "release of blocks of an unknown KV cache group ignored");
                continue;
            }
            for b in list {
                let Some(r) = self.refs[g].get_mut(b.0 as usize).filter(|r| **r > 0) else {
                    tracing::warn!(
                        group = g,
                        block = b.0,
                        "release of an invalid or already free block ignored"
                    );
                    continue;
                };
                *r -= 1;
                if *r > 0 {
                    continue;
                }
                if self.cache.is_cached(g, b.0) {
                    self.cache.set_idle(g, b.0);
                } else {
                    self.free[g].push(b.0);
                }
            }
        }
    }

    /// Appends one state slot per state group to `blocks` (after its KV cache groups' lists);
    /// false (nothing taken) when some state group has no free slot. Models without state
    /// layers take nothing.
    pub fn take_state_slots(&mut self, blocks: &mut BlocksPerGroup) -> bool {
        match self.state.take() {
            Some(slots) => {
                blocks.0.extend(slots.into_iter().map(|s| vec![BlockId(s)]));
                true
            }
            None => false,
        }
    }

    /// The state group of a state layer (None for a layer without state).
    pub fn state_group_of(&self, layer: LayerId) -> Option<usize> {
        self.effective.state_groups.iter().position(|g| g.layers.contains(&layer))
    }

    /// True when the model has state layers (and so the pool state slots).
    pub fn has_state(&self) -> bool {
        self.state.groups() > 0
    }

    /// Copies one request's state (`slot`) of state layer `layer` into `buf` (resized to fit).
    pub fn read_state(&self, layer: LayerId, slot: BlockId, buf: &mut Vec<u8>) -> Result<(), EngineError> {
        let span = self.mem.state_span(layer, slot).map_err(|e| EngineError::Access(e.to_string()))?;
        buf.resize(span.len, 0);
        self.mem.read(span, buf).map_err(|e| EngineError::Access(e.to_string()))
    }

    /// Writes `buf` as one request's state (`slot`) of state layer `layer`.
    pub fn write_state(&self, layer: LayerId, slot: BlockId, buf: &[u8]) -> Result<(), EngineError> {
        let span = self.mem.state_span(layer, slot).map_err(|e| EngineError::Access(e.to_string()))?;
        self.mem.write(span, buf).map_err(|e| EngineError::Access(e.to_string()))
    }

    /// Remembers that `blocks` (one per group, in use) hold the full prompt block `hash`,
    /// whose tokens are `tokens` and whose prefix ends in block `parent`.
    pub fn cache_block(&mut self, blocks: &[BlockId], hash: u64, parent: Option<u64>, tokens: &[u32]) {
        for (g, b) in blocks.iter().enumerate() {
            if self.refs.get(g).and_then(|r| r.get(b.0 as usize)).is_some_and(|r| *r > 0)
                && self.cache.register(g, b.0, hash)
                && g == 0
            {
                self.cache.stored_event(hash, parent, tokens);
            }
        }
    }

    /// The prefix cache's KV events (see [`PrefixCache::take_events`]); turns them on at the
    /// first call.
    pub fn take_cache_events(&mut self) -> Vec<KvEvent> {
        self.cache.enable_events();
        self.cache.take_events()
    }

    /// The blocks holding the longest cached run of `hashes`, taken for one more use (one
    /// list per group, all of the same length).
    pub fn take_cached(&mut self, hashes: &[u64]) -> BlocksPerGroup {
        let found = self.cache.lookup(hashes);
        let mut out = Vec::with_capacity(found.len());
        for (g, list) in found.into_iter().enumerate() {
            for b in &list {
                if self.refs[g][*b as usize] == 0 {
                    self.cache.set_busy(g, *b);
                }
                self.refs[g][*b as usize] += 1;
            }
            out.push(list.into_iter().map(BlockId).collect());
        }
        BlocksPerGroup(out)
    }

    /// Tensor-parallel ranks of the pool (1 without TP).
    pub fn tp_ranks(&self) -> u32 {
        self.tp_ranks
    }

    /// Copies the bytes of (`layer`, K|V `part`, `block`) into `buf` (resized to fit), every
    /// KV head: with several ranks, each rank's heads are gathered from its own regions.
    pub fn read_block(
        &self,
        layer: LayerId,
        part: u32,
        block: BlockId,
        buf: &mut Vec<u8>,
    ) -> Result<(), EngineError> {
        let access = |e: kvconnect_api::geometry::GeometryError| EngineError::Access(e.to_string());
        if self.tp_ranks == 1 {
            let span = self.mem.span(layer, part, block).map_err(access)?;
            buf.resize(span.len, 0);
            return self.mem.read(span, buf).map_err(access);
        }
        buf.resize(self.shape.bytes(), 0);
        for rank in 0..self.tp_ranks {
            let span = self.mem.geometry().rank_span(rank, layer, part, block).map_err(access)?;
            let src = self.mem.slice(span).map_err(access)?;
            self.for_each_row(rank, |whole, part| buf[whole.clone()].copy_from_slice(&src[part]));
        }
        Ok(())
    }

    /// Writes `buf` as the bytes of (`layer`, K|V `part`, `block`), every KV head: with
    /// several ranks, each rank's heads are scattered into its own regions.
    pub fn write_block(
        &self,
        layer: LayerId,
        part: u32,
        block: BlockId,
        buf: &[u8],
    ) -> Result<(), EngineError> {
        let access = |e: kvconnect_api::geometry::GeometryError| EngineError::Access(e.to_string());
        if self.tp_ranks == 1 {
            let span = self.mem.span(layer, part, block).map_err(access)?;
            return self.mem.write(span, buf).map_err(access);
        }
        if buf.len() != self.shape.bytes() {
            return Err(EngineError::Access(format!(
                "a block of {} bytes written where blocks are {} bytes",
                buf.len(),
                self.shape.bytes()
            )));
        }
        let mut rank_block = vec![0u8; self.rank_shape.bytes()];
        for rank in 0..self.tp_ranks {
            let span = self.mem.geometry().rank_span(rank, layer, part, block).map_err(access)?;
            self.for_each_row(rank, |whole, part| rank_block[part].copy_from_slice(&buf[whole.clone()]));
            self.mem.write(span, &rank_block).map_err(access)?;
        }
        Ok(())
    }

    /// Pairs the byte range of every element of `rank`'s heads in a whole block (all heads)
    /// with its range in the rank's own block.
    fn for_each_row(&self, rank: u32, mut f: impl FnMut(std::ops::Range<usize>, std::ops::Range<usize>)) {
        let (whole, own) = (self.strides, self.rank_strides);
        let s = self.rank_shape;
        let es = s.elem_size as usize;
        // Channels side by side (C innermost): one range per head and token.
        let (run, runs) = match whole.channel == 1 && own.channel == 1 {
            true => (s.head_dim as usize, 1),
            false => (1, s.head_dim as usize),
        };
        for h in 0..s.heads as usize {
            let global = rank as usize * s.heads as usize + h;
            for n in 0..s.tokens as usize {
                for c in 0..runs {
                    let w = (global * whole.head + n * whole.token + c * whole.channel) * es;
                    let o = (h * own.head + n * own.token + c * own.channel) * es;
                    f(w..w + run * es, o..o + run * es);
                }
            }
        }
    }

    /// Names of the shared-memory segments behind the regions (empty when private).
    pub fn shm_names(&self) -> Vec<String> {
        self.memories.iter().filter_map(|m| m.shm_name().map(str::to_owned)).collect()
    }
}

fn inner_strides(layout: KvLayout, s: &BlockShape) -> InnerStrides {
    let mut st = InnerStrides { head: 0, token: 0, channel: 0 };
    let mut acc = 1usize;
    for d in layout.order().iter().rev() {
        match d {
            Dim::H => {
                st.head = acc;
                acc *= s.heads as usize;
            }
            Dim::N => {
                st.token = acc;
                acc *= s.tokens as usize;
            }
            Dim::C => {
                st.channel = acc;
                acc *= s.head_dim as usize;
            }
            Dim::L | Dim::B => {}
        }
    }
    st
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::geometry::Geometry;
    use kvconnect_api::AttentionKind;

    fn model() -> ModelSpec {
        ModelSpec {
            name: "t".into(),
            num_layers: 4,
            num_kv_heads: 2,
            head_dim: 4,
            dtype: Some(Dtype::Bf16),
            layers: vec![
                AttentionKind::SlidingWindow { window: 8 },
                AttentionKind::Full,
                AttentionKind::SlidingWindow { window: 8 },
                AttentionKind::Full,
            ],
            state: None,
        }
    }

    #[test]
    fn groups_follow_hma() {
        let on = local_effective_layout(&model(), KvLayout::HND, true, 4, Dtype::Bf16);
        assert_eq!(on.groups.len(), 2);
        assert_eq!(on.groups[0].layers, vec![LayerId(0), LayerId(2)]);
        assert_eq!(on.groups[1].layers, vec![LayerId(1), LayerId(3)]);
        let off = local_effective_layout(&model(), KvLayout::HND, false, 4, Dtype::Bf16);
        assert_eq!(off.groups.len(), 1);
        assert_eq!(off.groups[0].layers.len(), 4);
    }

    #[test]
    fn regions_per_layout_and_hma() {
        for (layout, hma, regions, groups) in [
            (KvLayout::NHD, false, 4, 1),
            (KvLayout::HND, true, 4, 2),
            (KvLayout::BLHNC, false, 1, 1),
            (KvLayout::BLNHC, true, 2, 2),
        ] {
            let eff = local_effective_layout(&model(), layout, hma, 4, Dtype::Bf16);
            let pool = KvPool::new(&model(), &eff, 5, None).unwrap();
            assert_eq!(pool.regions().len(), regions, "{layout}");
            assert_eq!(pool.num_groups(), groups);
            assert_eq!(pool.total_blocks(), 5 * groups);
            let bytes: u64 = pool.regions().iter().map(|r| r.len()).sum();
            assert_eq!(bytes as usize, 4 * 5 * 2 * 2 * 4 * 4 * 2, "{layout}");
        }
    }

    #[test]
    fn block_bytes_land_where_geometry_says() {
        let eff = local_effective_layout(&model(), KvLayout::BLHNC, true, 4, Dtype::Bf16);
        let pool = KvPool::new(&model(), &eff, 3, None).unwrap();
        let data: Vec<u8> = (0..pool.shape().bytes()).map(|i| (i % 251) as u8 + 1).collect();
        pool.write_block(LayerId(2), 1, BlockId(2), &data).unwrap();
        let g = Geometry::new(
            pool.shape(),
            KvLayout::BLHNC,
            pool.regions()
                .iter()
                .map(|r| kvconnect_api::geometry::RegionShape {
                    layers: r.layers().to_vec(),
                    num_blocks: r.num_blocks(),
                })
                .collect(),
        );
        let span = g.span(LayerId(2), 1, BlockId(2)).unwrap();
        let r = &pool.regions()[span.region];
        assert_eq!(r.layers(), [LayerId(0), LayerId(2)]);
        // SAFETY: the span lies inside region `r`, which `pool` keeps alive.
        let raw =
            unsafe { std::slice::from_raw_parts((r.addr() as usize + span.offset) as *const u8, span.len) };
        assert_eq!(raw, &data[..]);
        let mut back = Vec::new();
        pool.read_block(LayerId(2), 1, BlockId(2), &mut back).unwrap();
        assert_eq!(back, data);
        assert!(pool.read_block(LayerId(2), 1, BlockId(3), &mut back).is_err());
    }

    #[test]
    fn allocate_is_all_or_nothing_and_release_restores() {
        let eff = local_effective_layout(&model(), KvLayout::HND, true, 4, Dtype::Bf16);
        let mut pool = KvPool::new(&model(), &eff, 4, None).unwrap();
        let a = pool.allocate(3).unwrap();
        assert_eq!(a.0.len(), 2);
        assert_eq!(a.0[0], vec![BlockId(0), BlockId(1), BlockId(2)]);
        assert!(pool.allocate(2).is_none());
        assert_eq!(pool.free_blocks(), 2);
        pool.release(&a);
        pool.release(&a); // double free is ignored
        assert_eq!(pool.free_blocks(), pool.total_blocks());
    }

    #[test]
    fn cached_blocks_are_shared_kept_while_idle_and_evicted_when_needed() {
        use kvconnect_api::Medium;
        let eff = local_effective_layout(&model(), KvLayout::HND, false, 4, Dtype::Bf16);
        let mut pool = KvPool::new(&model(), &eff, 4, None).unwrap();
        assert!(pool.take_cache_events().is_empty(), "events from here on");
        let a = pool.allocate(2).unwrap();
        pool.cache_block(&[a.0[0][0]], 7, None, &[1, 2, 3, 4]);
        assert_eq!(
            pool.take_cache_events(),
            vec![KvEvent::stored(vec![7], None, vec![1, 2, 3, 4], 4, Medium::Cpu)]
        );
        // A second request shares the cached block while the first still runs.
        let shared = pool.take_cached(&[7, 8]);
        assert_eq!(shared.0[0], vec![a.0[0][0]]);
        pool.release(&a);
        assert_eq!(pool.free_blocks(), 3, "the shared block is still in use");
        pool.release(&shared);
        assert_eq!(pool.free_blocks(), 4, "idle cached blocks count as free");
        // Still cached while idle, and taken back when the pool runs out.
        assert_eq!(pool.take_cached(&[7]).0[0].len(), 1);
        let again = pool.take_cached(&[7]);
        pool.release(&again);
        pool.release(&again);
        let all = pool.allocate(4).unwrap();
        assert_eq!(all.0[0].len(), 4);
        assert!(pool.take_cached(&[7]).0[0].is_empty(), "evicted for the allocation");
        assert_eq!(
            pool.take_cache_events(),
            vec![KvEvent::removed(vec![7], Medium::Cpu)],
            "the eviction is published"
        );
        pool.release(&all);
        assert_eq!(pool.free_blocks(), 4);
    }

    #[test]
    fn strides_match_geometry_inner_offset() {
        for layout in [KvLayout::NHD, KvLayout::HND, KvLayout::BLNHC, "LBCNH".parse().unwrap()] {
            let eff = local_effective_layout(&model(), layout, false, 4, Dtype::F32);
            let pool = KvPool::new(&model(), &eff, 1, None).unwrap();
            let g = Geometry::new(pool.shape(), layout, vec![]);
            let s = pool.strides();
            for (h, t, c) in [(0, 0, 0), (1, 2, 3), (1, 3, 0), (0, 1, 2)] {
                assert_eq!(
                    (h * s.head + t * s.token + c * s.channel) * 4,
                    g.inner_offset(h as u32, t as u32, c as u32)
                );
            }
        }
    }

    #[test]
    fn bad_layouts_are_refused_with_reasons() {
        let mut eff = local_effective_layout(&model(), KvLayout::HND, false, 4, Dtype::Bf16);
        eff.groups[0].layers.pop();
        let e = KvPool::new(&model(), &eff, 2, None).unwrap_err().to_string();
        assert!(e.contains("layer 3 stores KV but is in no KV cache group"), "{e}");
        let eff = local_effective_layout(&model(), KvLayout::HND, false, 4, Dtype::Bf16);
        let e = KvPool::new(&model(), &eff, 0, None).unwrap_err().to_string();
        assert!(e.contains("num_blocks is 0"), "{e}");
        let mut eff = local_effective_layout(&model(), KvLayout::HND, true, 4, Dtype::Bf16);
        eff.hma = false;
        let e = KvPool::new(&model(), &eff, 2, None).unwrap_err().to_string();
        assert!(e.contains("HMA off"), "{e}");
    }

    #[test]
    fn shm_regions_carry_their_names() {
        let eff = local_effective_layout(&model(), KvLayout::HND, false, 4, Dtype::Bf16);
        let pool = KvPool::new(&model(), &eff, 2, Some("pool test")).unwrap();
        let names = pool.shm_names();
        assert_eq!(names.len(), 4);
        assert_eq!(pool.regions()[1].shm_name(), Some(names[1].as_str()));
        let live = shm::live_segments();
        assert!(names.iter().all(|n| live.contains(n)));
        drop(pool);
        let live = shm::live_segments();
        assert!(names.iter().all(|n| !live.contains(n)));
    }
}
