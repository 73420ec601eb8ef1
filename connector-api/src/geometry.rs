//! Where a block's bytes are: the arithmetic from (layer, K|V, block) to a byte range of a
//! registered region, for any layout. Pure; connectors and the worker runtime share it so
//! that both sides of a transfer address blocks the same way.

use crate::ids::{BlockId, LayerId};
use crate::layout::{Dim, EffectiveLayout, KvLayout};
use crate::model::{AttentionKind, ModelSpec};
use serde::{Deserialize, Serialize};

/// The shape of one block for one layer and one of K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockShape {
    /// KV heads (H).
    pub heads: u32,
    /// Tokens per block (N).
    pub tokens: u32,
    /// Channels per head (C).
    pub head_dim: u32,
    /// Bytes per element.
    pub elem_size: u32,
    /// 2 when K and V are stored separately, 1 for MLA's single latent.
    pub kv_parts: u32,
}

impl BlockShape {
    /// The shape the effective layout gives this model.
    pub fn of(model: &ModelSpec, eff: &EffectiveLayout) -> BlockShape {
        let mla = model.layers.iter().any(|k| matches!(k, AttentionKind::Mla { .. }));
        BlockShape {
            heads: model.num_kv_heads,
            tokens: eff.block_size,
            head_dim: model.head_dim,
            elem_size: eff.cache_dtype.size() as u32,
            kv_parts: if mla { 1 } else { 2 },
        }
    }

    /// Bytes of one block of one layer and one of K/V.
    pub fn bytes(&self) -> usize {
        self.heads as usize * self.tokens as usize * self.head_dim as usize * self.elem_size as usize
    }

    /// Bytes of one block of one layer, K and V together.
    pub fn layer_block_bytes(&self) -> usize {
        self.bytes() * self.kv_parts as usize
    }

    /// [`BlockShape::layer_block_bytes`] for a shape a peer declared: `None` when it does not
    /// fit 64 bits.
    pub fn checked_layer_block_bytes(&self) -> Option<u64> {
        [self.tokens, self.head_dim, self.elem_size, self.kv_parts]
            .into_iter()
            .try_fold(self.heads as u64, |acc, d| acc.checked_mul(d as u64))
    }
}

/// A region's arrangement: which layers it holds, in what order, and how many blocks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionShape {
    /// Layers held, in storage order (one for a per-layer layout).
    pub layers: Vec<LayerId>,
    /// Number of blocks.
    pub num_blocks: u32,
}

/// A byte range inside one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Index into the region list.
    pub region: usize,
    /// Offset in bytes from the region's start.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// The block spans of one layer and K/V part ([`Geometry::layer_spans`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpans {
    region: usize,
    layer: LayerId,
    base: usize,
    stride: usize,
    len: usize,
    num_blocks: u32,
}

impl LayerSpans {
    /// The span of `block`.
    #[inline]
    pub fn span(&self, block: BlockId) -> Result<Span, GeometryError> {
        if block.0 >= self.num_blocks {
            return Err(GeometryError::BlockOutOfRange {
                block,
                layer: self.layer,
                num_blocks: self.num_blocks,
            });
        }
        Ok(Span { region: self.region, offset: self.base + block.0 as usize * self.stride, len: self.len })
    }
}

/// A slice of heads in every block of one layer ([`Geometry::head_slice`]): per K/V part,
/// where the part's blocks lie and the slice's pieces `(offset, len)` inside one block.
#[derive(Debug, Clone)]
pub struct HeadSlice {
    parts: Vec<(LayerSpans, Vec<(usize, usize)>)>,
}

impl HeadSlice {
    /// Appends the slice's runs in `block` to `out`, in block order.
    pub fn spans(&self, block: BlockId, out: &mut Vec<Span>) -> Result<(), GeometryError> {
        for (spans, pieces) in &self.parts {
            let b = spans.span(block)?;
            out.extend(pieces.iter().map(|&(off, len)| Span {
                region: b.region,
                offset: b.offset + off,
                len,
            }));
        }
        Ok(())
    }

    /// The slice's pieces in the order [`HeadSlice::spans`] appends them: each with where its
    /// part's blocks lie, its offset inside a block, and its length. A plan over many blocks
    /// takes each piece through every block in turn, so consecutive runs follow each other
    /// in memory where the blocks do.
    pub fn pieces(&self) -> impl Iterator<Item = (LayerSpans, usize, usize)> + '_ {
        self.parts.iter().flat_map(|(spans, pieces)| pieces.iter().map(|&(off, len)| (*spans, off, len)))
    }
}

/// Why a block cannot be addressed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    /// No region holds the layer.
    #[error("no registered region holds layer {0}")]
    NoRegionForLayer(LayerId),
    /// A block id past the region's end.
    #[error("block {block} is out of range: the region holding layer {layer} has {num_blocks} blocks")]
    BlockOutOfRange {
        /// The block.
        block: BlockId,
        /// The layer.
        layer: LayerId,
        /// Blocks in that region.
        num_blocks: u32,
    },
    /// A byte range that does not fit the region, or a buffer of the wrong length.
    #[error(
        "span of {len} bytes at offset {offset} does not fit region {region} (or the buffer length \
        differs from the block's)"
    )]
    SpanOutOfRegion {
        /// Region index.
        region: usize,
        /// Offset.
        offset: usize,
        /// Length asked for.
        len: usize,
    },
    /// K/V index 1 on an MLA cache.
    #[error("K/V part {0} does not exist in this cache (it has {1} parts)")]
    NoSuchPart(u32, u32),
    /// A tensor-parallel rank past the last.
    #[error("tensor-parallel rank {rank} does not exist: the regions belong to {ranks} rank(s)")]
    NoSuchRank {
        /// The rank asked for.
        rank: u32,
        /// Ranks the regions belong to.
        ranks: u32,
    },
    /// Heads past the ones a rank holds.
    #[error("KV heads {first}..{first}+{n} do not exist: a rank here holds {heads}")]
    NoSuchHeads {
        /// The first head asked for.
        first: u32,
        /// How many.
        n: u32,
        /// Heads one rank holds.
        heads: u32,
    },
    /// A slice of KV heads that is not one run per block part or per token.
    #[error(
        "not implemented: layout {layout} keeps a KV head's bytes apart inside a block in a way \
        kvconnect does not slice; a head slice is planned for layouts with heads outermost in a block (HND, \
        or opaque blocks whose heads are outermost) or right inside the tokens (NHD)"
    )]
    HeadsNotSliceable {
        /// The layout's name.
        layout: String,
    },
}

/// Addresses blocks in a set of regions laid out per one effective layout.
///
/// Under tensor parallelism the regions belong to `tp_ranks` ranks, registered rank by
/// rank, each rank with the same arrangement over its share of the KV heads: `shape.heads`
/// is the heads of one rank, and rank `r` holds global heads `r * heads .. (r + 1) * heads`.
/// The regions may be all of an engine's ranks (kvconnect's own workers), or one rank of
/// several (vLLM's workers, [`Geometry::as_rank_of`]): ranks are then named by their index
/// in the whole engine, and only the held ones have spans.
#[derive(Debug, Clone)]
pub struct Geometry {
    shape: BlockShape,
    layout: KvLayout,
    regions: Vec<RegionShape>,
    opaque: bool,
    /// Opaque blocks whose bytes are the heads one after another (vLLM's CPU backend's
    /// `[B, H, N, 2C]`): one head's K and V together are one run.
    opaque_heads_outer: bool,
    tp_ranks: u32,
    /// The first held rank's index in the whole engine.
    first_rank: u32,
    /// The whole engine's TP size.
    tp_size: u32,
    state: crate::state_slots::StateSlots,
}

impl Geometry {
    /// A geometry over `regions`, in registration order (one tensor-parallel rank).
    pub fn new(shape: BlockShape, layout: KvLayout, regions: Vec<RegionShape>) -> Geometry {
        Geometry {
            shape,
            layout,
            regions,
            opaque: false,
            opaque_heads_outer: false,
            tp_ranks: 1,
            first_rank: 0,
            tp_size: 1,
            state: Default::default(),
        }
    }

    /// The same geometry over the regions of `ranks` tensor-parallel ranks (registered rank
    /// by rank, the same number each); `None` when the regions do not split evenly.
    pub fn with_tp_ranks(mut self, ranks: u32) -> Option<Geometry> {
        if ranks == 0 || !self.regions.len().is_multiple_of(ranks as usize) {
            return None;
        }
        self.tp_ranks = ranks;
        self.first_rank = 0;
        self.tp_size = ranks;
        Some(self)
    }

    /// The same geometry over the regions of one rank, `rank` of an engine of `tp_size`
    /// ranks (each of vLLM's workers registers its own rank's KV); `None` when the regions
    /// are several ranks' or `rank` is not below `tp_size`.
    pub fn as_rank_of(mut self, rank: u32, tp_size: u32) -> Option<Geometry> {
        if self.tp_ranks != 1 || rank >= tp_size {
            return None;
        }
        self.first_rank = rank;
        self.tp_size = tp_size;
        Some(self)
    }

    /// Tensor-parallel ranks the regions belong to (1 without TP, and for one rank of
    /// several).
    pub fn tp_ranks(&self) -> u32 {
        self.tp_ranks
    }

    /// The whole engine's tensor-parallel size (held ranks or not).
    pub fn tp_size(&self) -> u32 {
        self.tp_size
    }

    /// The engine's ranks whose regions these are.
    pub fn held_ranks(&self) -> std::ops::Range<u32> {
        self.first_rank..self.first_rank + self.tp_ranks
    }

    /// KV heads over all of the engine's ranks.
    pub fn total_heads(&self) -> u32 {
        self.shape.heads * self.tp_size
    }

    /// Indices of rank `rank`'s regions (`rank` counted in the whole engine).
    pub fn rank_regions(&self, rank: u32) -> Result<std::ops::Range<usize>, GeometryError> {
        if !self.held_ranks().contains(&rank) {
            return Err(GeometryError::NoSuchRank { rank, ranks: self.tp_ranks });
        }
        let per = self.regions.len() / self.tp_ranks as usize;
        let i = (rank - self.first_rank) as usize;
        Ok(i * per..(i + 1) * per)
    }

    /// The same geometry over opaque blocks whose heads are outermost inside a block, when
    /// `yes` (the engine's tensors say so: vLLM's CPU backend's `[B, H, N, 2C]`).
    pub fn with_opaque_heads_outer(mut self, yes: bool) -> Geometry {
        self.opaque_heads_outer = yes;
        self
    }

    /// True for opaque blocks whose heads are outermost inside a block.
    pub fn opaque_heads_outer(&self) -> bool {
        self.opaque && self.opaque_heads_outer
    }

    /// The byte runs holding local heads `first .. first + n` of `block` for `layer` in rank
    /// `rank`'s regions, every K/V part included, in block order: one run per part when heads
    /// are outermost (HND), one run for the whole block's share when the blocks are opaque
    /// with heads outermost, one run per part and token when heads sit right inside the
    /// tokens (NHD); other orders are not sliced.
    pub fn head_runs(
        &self,
        rank: u32,
        layer: LayerId,
        block: BlockId,
        first: u32,
        n: u32,
    ) -> Result<Vec<Span>, GeometryError> {
        let mut out = Vec::new();
        self.head_slice(rank, layer, first, n)?.spans(block, &mut out)?;
        Ok(out)
    }

    /// Where local heads `first .. first + n` lie in every block of `layer` in rank `rank`'s
    /// regions ([`Geometry::head_runs`] of any block): worked out once, so a plan over
    /// thousands of blocks pays a multiply and an add per run.
    pub fn head_slice(
        &self,
        rank: u32,
        layer: LayerId,
        first: u32,
        n: u32,
    ) -> Result<HeadSlice, GeometryError> {
        let s = self.shape;
        if first.checked_add(n).is_none_or(|end| end > s.heads) {
            return Err(GeometryError::NoSuchHeads { first, n, heads: s.heads });
        }
        let per_head = s.bytes() / s.heads.max(1) as usize;
        if self.opaque {
            if !self.opaque_heads_outer {
                return Err(GeometryError::HeadsNotSliceable { layout: "opaque".into() });
            }
            // [H][..] over the whole block, K and V together.
            let head = per_head * s.kv_parts as usize;
            let pieces = vec![(first as usize * head, n as usize * head)];
            return Ok(HeadSlice { parts: vec![(self.layer_spans(rank, layer, 0)?, pieces)] });
        }
        let inner: Vec<Dim> =
            self.layout.order().into_iter().filter(|d| matches!(d, Dim::H | Dim::N | Dim::C)).collect();
        let pieces: Vec<(usize, usize)> = match inner.as_slice() {
            [Dim::H, ..] => vec![(self.inner_offset(first, 0, 0), n as usize * per_head)],
            [Dim::N, Dim::H, Dim::C] => {
                let row = n as usize * s.head_dim as usize * s.elem_size as usize;
                (0..s.tokens).map(|t| (self.inner_offset(first, t, 0), row)).collect()
            }
            _ => return Err(GeometryError::HeadsNotSliceable { layout: self.layout.display_name() }),
        };
        let parts = (0..s.kv_parts)
            .map(|part| Ok((self.layer_spans(rank, layer, part)?, pieces.clone())))
            .collect::<Result<_, GeometryError>>()?;
        Ok(HeadSlice { parts })
    }

    /// The same geometry with the state regions that follow the KV regions.
    pub fn with_state(mut self, state: crate::state_slots::StateSlots) -> Geometry {
        self.state = state;
        self
    }

    /// The state regions (empty for a model without state layers).
    pub fn state(&self) -> &crate::state_slots::StateSlots {
        &self.state
    }

    /// The same geometry over opaque blocks (`EffectiveLayout::opaque_blocks`): each layer's
    /// blocks lie one after another in its region, a block's K part then its V part, so a
    /// block's parts together are one contiguous run. Their inner order is not known:
    /// [`Geometry::inner_offset`] means nothing here, and blocks may only be copied whole.
    pub fn with_opaque_blocks(mut self, opaque: bool) -> Geometry {
        self.opaque = opaque;
        self
    }

    /// True for a geometry over opaque blocks.
    pub fn opaque_blocks(&self) -> bool {
        self.opaque
    }

    /// The block shape.
    pub fn shape(&self) -> BlockShape {
        self.shape
    }

    /// The layout.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The regions.
    pub fn regions(&self) -> &[RegionShape] {
        &self.regions
    }

    /// Bytes a region of this shape occupies.
    pub fn region_bytes(&self, r: &RegionShape) -> usize {
        r.layers.len() * r.num_blocks as usize * self.shape.layer_block_bytes()
    }

    /// [`Geometry::region_bytes`] for a region a peer declared: `None` when it does not fit
    /// 64 bits (a peer's sizes are multiplied checked, never trusted to be sane).
    pub fn checked_region_bytes(&self, r: &RegionShape) -> Option<u64> {
        (r.layers.len() as u64)
            .checked_mul(r.num_blocks as u64)?
            .checked_mul(self.shape.checked_layer_block_bytes()?)
    }

    /// The bytes of `block` for `layer` and K/V `part` (0 = K, 1 = V) in the first held
    /// rank's regions (the only rank without TP). Within the span the three inner dims are in
    /// the layout's order of H, N, C.
    pub fn span(&self, layer: LayerId, part: u32, block: BlockId) -> Result<Span, GeometryError> {
        self.rank_span(self.first_rank, layer, part, block)
    }

    /// [`Geometry::span`] in tensor-parallel rank `rank`'s regions.
    pub fn rank_span(
        &self,
        rank: u32,
        layer: LayerId,
        part: u32,
        block: BlockId,
    ) -> Result<Span, GeometryError> {
        self.layer_spans(rank, layer, part)?.span(block)
    }

    /// The spans of every block of one layer and K/V part in rank `rank`'s regions: the
    /// region found once, each block's span then a multiply and an add (a plan over
    /// thousands of blocks asks for each).
    pub fn layer_spans(&self, rank: u32, layer: LayerId, part: u32) -> Result<LayerSpans, GeometryError> {
        if part >= self.shape.kv_parts {
            return Err(GeometryError::NoSuchPart(part, self.shape.kv_parts));
        }
        let range = self.rank_regions(rank)?;
        let (ri, r, li) = self.regions[range.clone()]
            .iter()
            .zip(range)
            .find_map(|(r, i)| r.layers.iter().position(|l| *l == layer).map(|li| (i, r, li)))
            .ok_or(GeometryError::NoRegionForLayer(layer))?;
        let blk = self.shape.bytes();
        let parts = self.shape.kv_parts as usize;
        let nl = r.layers.len();
        let nb = r.num_blocks as usize;
        let part = part as usize;
        // Offset of block b: base + b * stride.
        let (base, stride) = if self.opaque {
            // [L][B][KV][..]: whole blocks per layer.
            ((li * nb * parts + part) * blk, parts * blk)
        } else if self.layout.position(Dim::B) < self.layout.position(Dim::L) {
            // [B][L][KV][..]
            ((li * parts + part) * blk, nl * parts * blk)
        } else {
            // [L][KV][B][..]
            ((li * parts + part) * nb * blk, blk)
        };
        Ok(LayerSpans { region: ri, layer, base, stride, len: blk, num_blocks: r.num_blocks })
    }

    /// Byte offset of element (head, token, channel) inside one block span, per the layout's
    /// order of H, N and C.
    pub fn inner_offset(&self, head: u32, token: u32, channel: u32) -> usize {
        let s = self.shape;
        let mut idx = 0usize;
        for d in self.layout.order() {
            let (size, i) = match d {
                Dim::H => (s.heads, head),
                Dim::N => (s.tokens, token),
                Dim::C => (s.head_dim, channel),
                Dim::L | Dim::B => continue,
            };
            idx = idx * size as usize + i as usize;
        }
        idx * s.elem_size as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> BlockShape {
        BlockShape { heads: 2, tokens: 4, head_dim: 8, elem_size: 2, kv_parts: 2 }
    }

    #[test]
    fn checked_sizes_refuse_overflow() {
        let g = Geometry::new(
            shape(),
            KvLayout::NHD,
            vec![RegionShape { layers: vec![LayerId(0); 3], num_blocks: 10 }],
        );
        assert_eq!(g.checked_region_bytes(&g.regions()[0]), Some(g.region_bytes(&g.regions()[0]) as u64));
        let huge =
            BlockShape { heads: u32::MAX, tokens: u32::MAX, head_dim: u32::MAX, elem_size: 2, kv_parts: 2 };
        assert_eq!(huge.checked_layer_block_bytes(), None);
        let g = Geometry::new(shape(), KvLayout::NHD, vec![]);
        let many = RegionShape { layers: vec![LayerId(0); 4], num_blocks: u32::MAX };
        let wide =
            Geometry::new(BlockShape { heads: 1 << 16, tokens: 1 << 16, ..shape() }, KvLayout::NHD, vec![]);
        assert!(g.checked_region_bytes(&many).is_some());
        assert_eq!(wide.checked_region_bytes(&many), None);
    }

    #[test]
    fn per_layer_offsets() {
        let g = Geometry::new(
            shape(),
            KvLayout::NHD,
            vec![
                RegionShape { layers: vec![LayerId(0)], num_blocks: 10 },
                RegionShape { layers: vec![LayerId(1)], num_blocks: 10 },
            ],
        );
        let blk = shape().bytes();
        assert_eq!(g.span(LayerId(1), 0, BlockId(3)).unwrap(), Span { region: 1, offset: 3 * blk, len: blk });
        assert_eq!(g.span(LayerId(0), 1, BlockId(0)).unwrap().offset, 10 * blk);
        assert!(g.span(LayerId(0), 0, BlockId(10)).is_err());
        assert!(g.span(LayerId(2), 0, BlockId(0)).is_err());
    }

    #[test]
    fn cross_layer_offsets() {
        let g = Geometry::new(
            shape(),
            KvLayout::BLHNC,
            vec![RegionShape { layers: vec![LayerId(0), LayerId(1)], num_blocks: 5 }],
        );
        let blk = shape().bytes();
        assert_eq!(g.span(LayerId(1), 1, BlockId(2)).unwrap().offset, ((2 * 2 + 1) * 2 + 1) * blk);
    }

    #[test]
    fn opaque_blocks_are_whole_per_layer() {
        let g = Geometry::new(
            shape(),
            KvLayout::HND,
            vec![
                RegionShape { layers: vec![LayerId(0)], num_blocks: 10 },
                RegionShape { layers: vec![LayerId(1)], num_blocks: 10 },
            ],
        )
        .with_opaque_blocks(true);
        let blk = shape().bytes();
        let k = g.span(LayerId(1), 0, BlockId(3)).unwrap();
        let v = g.span(LayerId(1), 1, BlockId(3)).unwrap();
        assert_eq!(k, Span { region: 1, offset: 6 * blk, len: blk });
        // V follows K inside the same block: the block is one run of 2 * blk bytes.
        assert_eq!(v.offset, k.offset + blk);
        assert_eq!(g.region_bytes(&g.regions()[0]), 10 * 2 * blk);
        assert!(g.span(LayerId(0), 0, BlockId(10)).is_err());
    }

    #[test]
    fn ranks_have_their_own_regions_and_head_slices() {
        let per_layer = |l| RegionShape { layers: vec![LayerId(l)], num_blocks: 10 };
        let regions = vec![per_layer(0), per_layer(1), per_layer(0), per_layer(1)];
        let g = Geometry::new(shape(), KvLayout::HND, regions.clone()).with_tp_ranks(2).unwrap();
        assert_eq!((g.tp_ranks(), g.total_heads()), (2, 4));
        let blk = shape().bytes();
        assert_eq!(
            g.rank_span(1, LayerId(1), 1, BlockId(2)).unwrap(),
            Span { region: 3, offset: 12 * blk, len: blk }
        );
        assert_eq!(g.rank_span(0, LayerId(1), 1, BlockId(2)).unwrap().region, 1);
        assert_eq!(
            g.rank_span(2, LayerId(0), 0, BlockId(0)),
            Err(GeometryError::NoSuchRank { rank: 2, ranks: 2 })
        );
        let head_runs = |g: &Geometry, first, n| g.head_runs(1, LayerId(0), BlockId(2), first, n);
        let k = g.rank_span(1, LayerId(0), 0, BlockId(2)).unwrap();
        let v = g.rank_span(1, LayerId(0), 1, BlockId(2)).unwrap();
        let half = Span { len: blk / 2, ..k };
        assert_eq!(
            head_runs(&g, 1, 1).unwrap(),
            [Span { offset: k.offset + blk / 2, ..half }, Span { offset: v.offset + blk / 2, ..half }]
        );
        assert_eq!(head_runs(&g, 1, 2), Err(GeometryError::NoSuchHeads { first: 1, n: 2, heads: 2 }));
        assert!(Geometry::new(shape(), KvLayout::HND, regions[..3].to_vec()).with_tp_ranks(2).is_none());
    }

    #[test]
    fn one_rank_of_several_is_named_by_its_index_in_the_engine() {
        let per_layer = |l| RegionShape { layers: vec![LayerId(l)], num_blocks: 10 };
        let g =
            Geometry::new(shape(), KvLayout::NHD, vec![per_layer(0), per_layer(1)]).as_rank_of(1, 2).unwrap();
        assert_eq!((g.tp_ranks(), g.tp_size(), g.held_ranks(), g.total_heads()), (1, 2, 1..2, 4));
        let blk = shape().bytes();
        assert_eq!(
            g.rank_span(1, LayerId(1), 0, BlockId(3)).unwrap(),
            Span { region: 1, offset: 3 * blk, len: blk }
        );
        assert_eq!(g.span(LayerId(1), 0, BlockId(3)), g.rank_span(1, LayerId(1), 0, BlockId(3)));
        assert!(matches!(
            g.rank_span(0, LayerId(1), 0, BlockId(3)),
            Err(GeometryError::NoSuchRank { rank: 0, .. })
        ));
        // NHD: one run per token of each part, the rank's head slice inside each token row.
        let runs = g.head_runs(1, LayerId(0), BlockId(0), 1, 1).unwrap();
        assert_eq!(runs.len(), 2 * 4);
        assert_eq!(runs[1], Span { region: 0, offset: g.inner_offset(1, 1, 0), len: 8 * 2 });
        let opaque = g.clone().with_opaque_blocks(true);
        assert!(matches!(
            opaque.head_runs(1, LayerId(0), BlockId(0), 0, 1),
            Err(GeometryError::HeadsNotSliceable { .. })
        ));
        // Opaque blocks with heads outermost: one run over the head's K and V together.
        let outer = opaque.with_opaque_heads_outer(true);
        let b = outer.rank_span(1, LayerId(0), 0, BlockId(4)).unwrap();
        assert_eq!(
            outer.head_runs(1, LayerId(0), BlockId(4), 1, 1).unwrap(),
            [Span { offset: b.offset + blk, len: blk, ..b }]
        );
        assert!(Geometry::new(shape(), KvLayout::NHD, vec![]).as_rank_of(2, 2).is_none());
    }

    #[test]
    fn inner_offset_follows_layout() {
        let nhd = Geometry::new(shape(), KvLayout::NHD, vec![]);
        let hnd = Geometry::new(shape(), KvLayout::HND, vec![]);
        // NHD: [N][H][C]; HND: [H][N][C]
        assert_eq!(nhd.inner_offset(1, 2, 3), ((2 * 2 + 1) * 8 + 3) * 2);
        assert_eq!(hnd.inner_offset(1, 2, 3), ((4 + 2) * 8 + 3) * 2);
    }
}
