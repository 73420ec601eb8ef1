//! Where a full chunk's blocks sit in a slab of chunk slots, as the gather kernel addresses
//! them: unit `u` = (layer index, K|V part), grid block index `k`, byte
//! `unit_offset(u) + k * block_bytes` from the slab's start.
//!
//! A full chunk stores, for each KV layer, for K then V, its `chunk_tokens / block_size`
//! whole blocks one after another ([`crate::chunk_layout`]), so block `j` of unit
//! `(li, p)` of the chunk in slot `s` is at
//! `s * slot_bytes + (li * parts + p) * chunk_tokens * token_bytes + j * block_bytes`.
//! A slot is `layers * parts * (chunk_tokens / block_size)` blocks long, so every slot
//! starts at a whole number of blocks and the address is `unit_offset(li, p) +
//! (s * blocks_per_slot + j) * block_bytes` with `unit_offset(li, p) = (li * parts + p) *
//! chunk_tokens * token_bytes`: ONE set of unit bases serves every slot, and one launch
//! writes every full chunk of a request. (A partial chunk has a shorter per-unit stride and
//! its last block may be partial, so it does not fit this grid.) Pure: tested without a GPU
//! against `ChunkLayout::save_layer` and `load_layer`.

use crate::chunk_layout::ChunkLayout;
use kvconnect_api::LayerId;

/// The slot grid of one engine's full chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkGrid {
    /// (layer, part, byte offset of block 0) per unit, in chunk order.
    units: Vec<(LayerId, u32, u64)>,
    block_bytes: usize,
    chunk_tokens: usize,
    blocks_per_chunk: usize,
    slot_bytes: usize,
}

impl ChunkGrid {
    /// The grid for full chunks of `chunk_tokens` tokens (a multiple of the block size, as
    /// `ChunkLayout::new` checks for the chunk size).
    pub fn new(layout: &ChunkLayout, chunk_tokens: usize) -> ChunkGrid {
        let bs = layout.block_size().max(1);
        let block_bytes = layout.block_bytes();
        let segment = chunk_tokens * layout.token_bytes();
        let parts = layout.parts();
        let mut units = Vec::new();
        for (li, l) in layout.kv_layers().iter().enumerate() {
            for p in 0..parts {
                units.push((*l, p, ((li * parts as usize + p as usize) * segment) as u64));
            }
        }
        ChunkGrid {
            units,
            block_bytes,
            chunk_tokens,
            blocks_per_chunk: chunk_tokens / bs,
            slot_bytes: layout.chunk_bytes(chunk_tokens),
        }
    }

    /// (layer, part, byte offset of grid block 0), one per unit.
    pub fn units(&self) -> &[(LayerId, u32, u64)] {
        &self.units
    }

    /// Bytes of one slot: one full chunk.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Tokens of a full chunk.
    pub fn chunk_tokens(&self) -> usize {
        self.chunk_tokens
    }

    /// Blocks of one unit in a full chunk.
    pub fn blocks_per_chunk(&self) -> usize {
        self.blocks_per_chunk
    }

    /// Bytes of one block of one unit.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The grid index of block `j` of the chunk in `slot`, or `None` when it does not fit
    /// the kernel's 32-bit block index (or `j` is past the chunk).
    pub fn index(&self, slot: u32, j: usize) -> Option<u32> {
        if j >= self.blocks_per_chunk || self.block_bytes == 0 {
            return None;
        }
        let per_slot = self.slot_bytes / self.block_bytes;
        u32::try_from(slot as usize * per_slot + j).ok()
    }

    /// The blocks `j` of the chunk starting at absolute token `chunk_start` that lie wholly
    /// inside tokens `[from, to)` (the others, at most the first and the last, need the
    /// careful per-token copy).
    pub fn whole_blocks(&self, chunk_start: usize, from: usize, to: usize) -> std::ops::Range<usize> {
        let bs = self.chunk_tokens / self.blocks_per_chunk.max(1);
        if bs == 0 {
            return 0..0;
        }
        let lo = from.saturating_sub(chunk_start).div_ceil(bs);
        let hi = (to.saturating_sub(chunk_start) / bs).min(self.blocks_per_chunk);
        lo.min(hi)..hi
    }
}

/// How a load of tokens `[from, to)` splits: blocks scattered straight from slots, and
/// blocks that go through the host copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadSplit {
    /// (block-table index, grid index) of every block wholly covered by a chunk in a slot.
    pub direct: Vec<(usize, u32)>,
    /// Per block-table index below `to`'s block: true when the block goes through the host
    /// copy (the rest of the range, including blocks the load writes only partly).
    pub staged: Vec<bool>,
}

impl ChunkGrid {
    /// The gather pairs (device block, grid index) that write full chunks into slots:
    /// `chunks` holds (first token, slot) of each full chunk, `blocks` the request's table.
    pub fn save_pairs(
        &self,
        blocks: &[kvconnect_api::BlockId],
        chunks: &[(usize, u32)],
    ) -> Result<Vec<(kvconnect_api::BlockId, u32)>, String> {
        let bs = self.chunk_tokens / self.blocks_per_chunk.max(1);
        let mut pairs = Vec::with_capacity(chunks.len() * self.blocks_per_chunk);
        for (start, slot) in chunks {
            let first = start / bs.max(1);
            for j in 0..self.blocks_per_chunk {
                let block = *blocks.get(first + j).ok_or_else(|| {
                    format!(
                        "token {} needs block index {} but the request has {} blocks",
                        start + j * bs,
                        first + j,
                        blocks.len()
                    )
                })?;
                let k = self.index(*slot, j).ok_or_else(|| {
                    format!("slot {slot} block {j} is past the kernel's 32-bit block index")
                })?;
                pairs.push((block, k));
            }
        }
        Ok(pairs)
    }

    /// Splits a load of tokens `[from, to)`: `chunks` holds (first token, tokens, slot if
    /// the chunk is a full chunk in a slot) of each fetched chunk.
    pub fn split_load(&self, chunks: &[(usize, usize, Option<u32>)], from: usize, to: usize) -> LoadSplit {
        let bs = self.chunk_tokens / self.blocks_per_chunk.max(1);
        if to <= from || bs == 0 {
            return LoadSplit { direct: Vec::new(), staged: Vec::new() };
        }
        let (lo, hi) = (from / bs, to.div_ceil(bs));
        let mut staged = vec![false; hi];
        staged[lo..hi].iter_mut().for_each(|s| *s = true);
        let mut direct = Vec::new();
        for (start, tokens, slot) in chunks {
            let Some(slot) = slot else { continue };
            if *tokens != self.chunk_tokens {
                continue;
            }
            for j in self.whole_blocks(*start, from, to) {
                let Some(k) = self.index(*slot, j) else { continue };
                let i = start / bs + j;
                staged[i] = false;
                direct.push((i, k));
            }
        }
        LoadSplit { direct, staged }
    }
}

/// The chunk-relative token ranges of the chunk at `chunk_start` (`tokens` long) that a load
/// of `[from, to)` writes through the host copy: maximal runs of staged blocks.
pub fn staged_runs(
    staged: &[bool],
    block_size: usize,
    chunk_start: usize,
    tokens: usize,
    from: usize,
    to: usize,
) -> Vec<(usize, usize)> {
    let bs = block_size.max(1);
    let hi_t = to.min(chunk_start + tokens);
    let mut t = from.max(chunk_start);
    let mut runs = Vec::new();
    while t < hi_t {
        let b = t / bs;
        let mut e = b;
        while e < staged.len() && staged[e] && e * bs < hi_t {
            e += 1;
        }
        if e == b {
            t = ((b + 1) * bs).min(hi_t);
            continue;
        }
        let t_end = (e * bs).min(hi_t);
        runs.push((t - chunk_start, t_end - chunk_start));
        t = t_end;
    }
    runs
}

#[allow(unsafe_code)] // Tests vouch for their own KV buffers as regions (KvRegion::new).
#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
    use kvconnect_api::kv_memory::KvMemory;
    use kvconnect_api::{
        AttentionKind, BlockId, Dtype, EffectiveLayout, KvGroup, KvLayout, KvRegion, KvRegionSpec,
        MemoryKind, ModelSpec, TransferMode,
    };

    const LAYERS: u32 = 3;
    const BS: u32 = 4;
    const CHUNK: usize = 12;
    const BLOCKS: u32 = 20;

    fn model() -> ModelSpec {
        ModelSpec {
            name: "grid".into(),
            num_layers: LAYERS,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: Some(Dtype::F16),
            layers: vec![AttentionKind::Full; LAYERS as usize],
            state: None,
        }
    }

    fn eff(layout: KvLayout) -> EffectiveLayout {
        EffectiveLayout {
            layout,
            hma: false,
            block_size: BS,
            cache_dtype: Dtype::F16,
            memory: MemoryKind::Host,
            transfer_mode: TransferMode::None,
            groups: vec![KvGroup { kind: AttentionKind::Full, layers: (0..LAYERS).map(LayerId).collect() }],
            state_groups: vec![],
            opaque_blocks: false,
        }
    }

    /// Host KV regions (one per layer) filled with distinct bytes.
    fn host_kv(layout: KvLayout) -> (Vec<Vec<u8>>, Vec<KvRegion>, Geometry) {
        let m = model();
        let e = eff(layout);
        let shape = BlockShape::of(&m, &e);
        let g = Geometry::new(
            shape,
            layout,
            (0..LAYERS).map(|l| RegionShape { layers: vec![LayerId(l)], num_blocks: BLOCKS }).collect(),
        );
        let mut bufs: Vec<Vec<u8>> = g
            .regions()
            .iter()
            .enumerate()
            .map(|(i, r)| (0..g.region_bytes(r)).map(|j| (j * 7 + i * 131 + j / 251) as u8).collect())
            .collect();
        // SAFETY: the buffers go back to the caller with the regions, and every test keeps them
        // together to its end (moving a Vec does not move its heap buffer).
        let regions = unsafe { regions_over(&mut bufs) };
        (bufs, regions, g)
    }

    /// The gather kernel on the host: block `src_blocks[b]` of unit `u` of the KV regions to
    /// grid index `dst[b]` of unit `u` of the slab.
    fn emulate_gather(
        g: &Geometry,
        kv: &[Vec<u8>],
        grid: &ChunkGrid,
        pairs: &[(BlockId, u32)],
        slab: &mut [u8],
    ) {
        let bb = grid.block_bytes();
        for (l, p, off) in grid.units() {
            for (b, k) in pairs {
                let s = g.span(*l, *p, *b).unwrap();
                assert_eq!(s.len, bb, "one (layer, part) block is one unit block");
                let d = *off as usize + *k as usize * bb;
                slab[d..d + bb].copy_from_slice(&kv[s.region][s.offset..s.offset + bb]);
            }
        }
    }

    /// Every full chunk of a request gathered by the grid arithmetic into slots (in a
    /// shuffled slot order) equals, byte for byte, the chunk `save_layer` builds.
    #[test]
    fn grid_gather_equals_save_layer_for_nhd_and_hnd() {
        for layout in [KvLayout::NHD, KvLayout::HND] {
            let (kv, regions, g) = host_kv(layout);
            let mem = KvMemory::new(&regions, &model(), &eff(layout)).unwrap();
            let cl = ChunkLayout::new(&model(), &eff(layout), CHUNK as u32).unwrap();
            let grid = ChunkGrid::new(&cl, CHUNK);
            assert_eq!(grid.blocks_per_chunk(), CHUNK / BS as usize);
            assert_eq!(grid.units().len(), 2 * LAYERS as usize);
            assert_eq!(grid.slot_bytes() % grid.block_bytes(), 0);
            // A request of 3 full chunks over scattered blocks, stored in slots 4, 0, 2.
            let table: Vec<BlockId> = [17, 2, 9, 0, 11, 5, 19, 3, 8].iter().map(|b| BlockId(*b)).collect();
            let slots = [4u32, 0, 2];
            let mut slab = vec![0u8; 5 * grid.slot_bytes()];
            let placed: Vec<(usize, u32)> = slots.iter().enumerate().map(|(c, s)| (c * CHUNK, *s)).collect();
            let pairs = grid.save_pairs(&table, &placed).unwrap();
            assert_eq!(pairs.len(), 9);
            let e = grid.save_pairs(&table[..8], &placed).unwrap_err();
            assert!(e.contains("needs block index 8 but the request has 8 blocks"), "{e}");
            emulate_gather(&g, &kv, &grid, &pairs, &mut slab);
            for (c, slot) in slots.iter().enumerate() {
                let mut want = Vec::new();
                for l in cl.kv_layers() {
                    cl.save_layer(&mem, *l, &table, c * CHUNK, CHUNK, &mut want).unwrap();
                }
                let s = *slot as usize * grid.slot_bytes();
                assert!(slab[s..s + grid.slot_bytes()] == want[..], "{layout} chunk {c} in slot {slot}");
            }
        }
    }

    /// The reverse: scattering whole blocks out of a slot by the grid arithmetic writes the
    /// same bytes as `load_layer` does from the chunk.
    #[test]
    fn grid_scatter_equals_load_layer() {
        for layout in [KvLayout::NHD, KvLayout::HND] {
            let (kv, _regions, g) = host_kv(layout);
            let cl = ChunkLayout::new(&model(), &eff(layout), CHUNK as u32).unwrap();
            let grid = ChunkGrid::new(&cl, CHUNK);
            let chunk: Vec<u8> = (0..grid.slot_bytes()).map(|i| (i * 13 + 5) as u8).collect();
            let table: Vec<BlockId> = [6, 14, 1].iter().map(|b| BlockId(*b)).collect();
            // load_layer into a copy of the regions.
            let mut a = kv.clone();
            // SAFETY: `a` lives to the end of this iteration and is read only after the writes.
            let regions_a = unsafe { regions_over(&mut a) };
            let mem = KvMemory::new(&regions_a, &model(), &eff(layout)).unwrap();
            for li in 0..LAYERS as usize {
                cl.load_layer(&mem, li, &table, 0, CHUNK, 0, CHUNK, &chunk).unwrap();
            }
            // The grid arithmetic, emulating the scatter kernel from slot 1 of a slab.
            let mut b = kv.clone();
            let mut slab = vec![0u8; 2 * grid.slot_bytes()];
            slab[grid.slot_bytes()..].copy_from_slice(&chunk);
            let bb = grid.block_bytes();
            for (l, p, off) in grid.units() {
                for (j, blk) in table.iter().enumerate() {
                    let s = g.span(*l, *p, *blk).unwrap();
                    let src = *off as usize + grid.index(1, j).unwrap() as usize * bb;
                    b[s.region][s.offset..s.offset + bb].copy_from_slice(&slab[src..src + bb]);
                }
            }
            assert!(a == b, "{layout}: scatter from the slot differs from load_layer");
        }
    }

    /// One host region per buffer.
    ///
    /// # Safety
    /// The buffers must outlive every use of the regions and not be touched meanwhile.
    unsafe fn regions_over(bufs: &mut [Vec<u8>]) -> Vec<KvRegion> {
        KvRegionSpec::per_layer(bufs, BLOCKS)
            .into_iter()
            // SAFETY: the caller's contract (`# Safety` above).
            .map(|spec| unsafe { KvRegion::new(spec) })
            .collect()
    }

    /// A device load as `device_kv::load` splits it — whole blocks of full chunks in slots
    /// scattered by the grid arithmetic, every other token written by `load_layer` in the
    /// runs `staged_runs` gives — writes exactly what `load_layer` over every chunk writes,
    /// for loads that start and end inside blocks and chunks, over slotted, heap and partial
    /// chunks.
    #[test]
    fn split_load_writes_what_load_layer_writes() {
        for layout in [KvLayout::NHD, KvLayout::HND] {
            let (kv, _r, g) = host_kv(layout);
            let cl = ChunkLayout::new(&model(), &eff(layout), CHUNK as u32).unwrap();
            let grid = ChunkGrid::new(&cl, CHUNK);
            let bs = BS as usize;
            // Chunks [0,12) in slot 3, [12,24) on the heap, [24,36) in slot 1, [36,41)
            // partial (never scattered from a slot, even if it claims one).
            let chunks: Vec<(usize, usize, Option<u32>)> =
                vec![(0, CHUNK, Some(3)), (12, CHUNK, None), (24, CHUNK, Some(1)), (36, 5, Some(2))];
            let bytes: Vec<Vec<u8>> = chunks
                .iter()
                .enumerate()
                .map(|(c, (_, t, _))| (0..cl.chunk_bytes(*t)).map(|i| (i * 29 + c * 101 + 3) as u8).collect())
                .collect();
            let mut slab = vec![0u8; 4 * grid.slot_bytes()];
            for ((_, _, slot), b) in chunks.iter().zip(&bytes) {
                if let (Some(s), true) = (slot, b.len() == grid.slot_bytes()) {
                    let o = *s as usize * grid.slot_bytes();
                    slab[o..o + b.len()].copy_from_slice(b);
                }
            }
            let table: Vec<BlockId> = (0..11).map(|i| BlockId(18 - i)).collect();
            for (from, to) in [(0, 41), (0, 40), (2, 35), (13, 23), (4, 24), (25, 26), (0, 12), (7, 7)] {
                // Reference: load_layer over every chunk's part of [from, to).
                let mut a = kv.clone();
                // SAFETY: `a` lives to the end of this iteration and is read only after the writes.
                let ra = unsafe { regions_over(&mut a) };
                let ma = KvMemory::new(&ra, &model(), &eff(layout)).unwrap();
                for ((start, t, _), b) in chunks.iter().zip(&bytes) {
                    let (t0, t1) = (from.max(*start), to.min(start + t));
                    if t0 < t1 {
                        for li in 0..LAYERS as usize {
                            cl.load_layer(&ma, li, &table, *start, *t, t0 - start, t1 - start, b).unwrap();
                        }
                    }
                }
                // The split.
                let mut b2 = kv.clone();
                // SAFETY: as above, for `b2`.
                let rb = unsafe { regions_over(&mut b2) };
                let mb = KvMemory::new(&rb, &model(), &eff(layout)).unwrap();
                let split = grid.split_load(&chunks, from, to);
                let direct_blocks: Vec<usize> = split.direct.iter().map(|(i, _)| *i).collect();
                for i in &direct_blocks {
                    assert!(!split.staged[*i], "block {i} is both direct and staged");
                    assert!(
                        *i * bs >= from && (*i + 1) * bs <= to,
                        "direct block {i} is not inside [{from}, {to})"
                    );
                }
                for ((start, t, _), b) in chunks.iter().zip(&bytes) {
                    for (t0, t1) in staged_runs(&split.staged, bs, *start, *t, from, to) {
                        for li in 0..LAYERS as usize {
                            cl.load_layer(&mb, li, &table, *start, *t, t0, t1, b).unwrap();
                        }
                    }
                }
                drop(mb);
                let bb = grid.block_bytes();
                for (l, p, off) in grid.units() {
                    for (i, k) in &split.direct {
                        let sp = g.span(*l, *p, table[*i]).unwrap();
                        let src = *off as usize + *k as usize * bb;
                        b2[sp.region][sp.offset..sp.offset + bb].copy_from_slice(&slab[src..src + bb]);
                    }
                }
                drop(ma);
                assert!(a == b2, "{layout} load [{from}, {to}) differs from load_layer");
                if (from, to) == (0, 41) {
                    // Blocks 0-2 (slot 3) and 6-8 (slot 1) come straight from slots.
                    let mut d = direct_blocks.clone();
                    d.sort();
                    assert_eq!(d, vec![0, 1, 2, 6, 7, 8]);
                }
            }
        }
    }

    #[test]
    fn whole_blocks_inside_a_token_range() {
        let cl = ChunkLayout::new(&model(), &eff(KvLayout::NHD), CHUNK as u32).unwrap();
        let grid = ChunkGrid::new(&cl, CHUNK);
        // Chunk [12, 24) of blocks [12,16) [16,20) [20,24).
        assert_eq!(grid.whole_blocks(12, 0, 100), 0..3);
        assert_eq!(grid.whole_blocks(12, 13, 100), 1..3, "block 0 starts before the range");
        assert_eq!(grid.whole_blocks(12, 16, 23), 1..2, "block 2 ends after it");
        assert!(grid.whole_blocks(12, 13, 15).is_empty(), "inside one block: none whole");
        assert_eq!(grid.whole_blocks(12, 30, 40), 3..3);
        assert_eq!(grid.index(0, 3), None, "past the chunk");
        assert_eq!(grid.index(2, 1), Some(2 * 2 * LAYERS * 3 + 1));
    }
}
