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

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
    use kvconnect_api::kv_memory::KvMemory;
    use kvconnect_api::{
        AttentionKind, BlockId, Dtype, EffectiveLayout, KvGroup, KvLayout, KvRegion, MemoryKind, ModelSpec,
        TransferMode,
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
        let regions = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| KvRegion {
                name: format!("layer.{i}"),
                addr: b.as_mut_ptr() as u64,
                len: b.len() as u64,
                memory: MemoryKind::Host,
                device: -1,
                layers: vec![LayerId(i as u32)],
                group: 0,
                num_blocks: BLOCKS,
                shm_name: None,
            })
            .collect();
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
            // SAFETY: the regions are the Vecs in `kv`, alive and unchanged for the test.
            let mem = unsafe { KvMemory::new(&regions, &model(), &eff(layout)) }.unwrap();
            let cl = ChunkLayout::new(&model(), &eff(layout), CHUNK as u32).unwrap();
            let grid = ChunkGrid::new(&cl, CHUNK);
            assert_eq!(grid.blocks_per_chunk(), CHUNK / BS as usize);
            assert_eq!(grid.units().len(), 2 * LAYERS as usize);
            assert_eq!(grid.slot_bytes() % grid.block_bytes(), 0);
            // A request of 3 full chunks over scattered blocks, stored in slots 4, 0, 2.
            let table: Vec<BlockId> = [17, 2, 9, 0, 11, 5, 19, 3, 8].iter().map(|b| BlockId(*b)).collect();
            let slots = [4u32, 0, 2];
            let mut slab = vec![0u8; 5 * grid.slot_bytes()];
            let mut pairs = Vec::new();
            for (c, slot) in slots.iter().enumerate() {
                for j in 0..grid.blocks_per_chunk() {
                    pairs.push((table[c * grid.blocks_per_chunk() + j], grid.index(*slot, j).unwrap()));
                }
            }
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
            let regions_a: Vec<KvRegion> = a
                .iter_mut()
                .enumerate()
                .map(|(i, b)| KvRegion {
                    name: format!("layer.{i}"),
                    addr: b.as_mut_ptr() as u64,
                    len: b.len() as u64,
                    memory: MemoryKind::Host,
                    device: -1,
                    layers: vec![LayerId(i as u32)],
                    group: 0,
                    num_blocks: BLOCKS,
                    shm_name: None,
                })
                .collect();
            // SAFETY: the regions are the Vecs in `a`, alive for the test, written only here.
            let mem = unsafe { KvMemory::new(&regions_a, &model(), &eff(layout)) }.unwrap();
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
