//! The layout adapter: moves one block between the engine's KV regions and flexkv's stored
//! form, transposing when the deployment's layout is not token-major.
//!
//! flexkv stores a block as every KV layer's K then V (V absent for MLA), each in NHD order
//! `[N][H][C]`. When negotiation puts it in a head-major deployment (HND next to nixl, or
//! the cross-layer `BLHNC`) the copy path transposes rows of `C` channels between `[H][N]`
//! and `[N][H]`; the row positions of both sides come from
//! `Geometry::inner_offset`, so any layout where `C` is innermost is a row copy and any
//! other falls back to element moves. Regions are reached only through `KvMemory`.

use crate::hash::Checksum;
use kvconnect_api::geometry::{BlockShape, Geometry, GeometryError};
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::layout::Dim;
use kvconnect_api::{BlockId, EffectiveLayout, KvLayout, LayerId, ModelSpec};
use kvconnect_support::stream_copy::{self, Batch, STREAM_MIN_PIECE};

/// How one block is gathered from and scattered into the KV regions.
#[derive(Debug, Clone)]
pub struct BlockAdapter {
    layers: Vec<LayerId>,
    parts: u32,
    sub_bytes: usize,
    layout: KvLayout,
    /// (offset in the region's block, offset in the stored NHD block) of every moved unit;
    /// `None` when both orders are the same and a block is one plain copy.
    moves: Option<Vec<(u32, u32)>>,
    unit: usize,
}

impl BlockAdapter {
    /// The adapter for a model in a deployment's effective layout.
    pub fn new(model: &ModelSpec, eff: &EffectiveLayout) -> BlockAdapter {
        let shape = BlockShape::of(model, eff);
        Self::with_shape(model.kv_layers(), shape, eff.layout)
    }

    /// The adapter over an engine's opaque blocks (`EffectiveLayout::opaque_blocks`): every
    /// K and V span is copied as it is, never transposed, so the stored form is the engine's
    /// own bytes, which only an engine of the same layout reads back (the key seed says so).
    pub fn whole_blocks(model: &ModelSpec, eff: &EffectiveLayout) -> BlockAdapter {
        let shape = BlockShape::of(model, eff);
        let mut a = Self::with_shape(model.kv_layers(), shape, eff.layout);
        a.moves = None;
        a.unit = shape.bytes();
        a
    }

    /// The adapter for explicit layers, block shape and layout.
    pub fn with_shape(layers: Vec<LayerId>, shape: BlockShape, layout: KvLayout) -> BlockAdapter {
        let deploy = Geometry::new(shape, layout, vec![]);
        let stored = Geometry::new(shape, KvLayout::NHD, vec![]);
        let inner = |l: KvLayout| {
            l.order().into_iter().filter(|d| matches!(d, Dim::H | Dim::N | Dim::C)).collect::<Vec<_>>()
        };
        // With one KV head, where the head axis sits does not change the bytes.
        let (moves, unit) = if inner(layout.normalized(shape.heads))
            == inner(KvLayout::NHD.normalized(shape.heads))
        {
            (None, shape.bytes())
        } else if layout.position(Dim::C) > layout.position(Dim::H)
            && layout.position(Dim::C) > layout.position(Dim::N)
        {
            let mut m = Vec::with_capacity((shape.heads * shape.tokens) as usize);
            for n in 0..shape.tokens {
                for h in 0..shape.heads {
                    m.push((deploy.inner_offset(h, n, 0) as u32, stored.inner_offset(h, n, 0) as u32));
                }
            }
            (Some(m), shape.head_dim as usize * shape.elem_size as usize)
        } else {
            let mut m = Vec::with_capacity(shape.bytes() / shape.elem_size.max(1) as usize);
            for n in 0..shape.tokens {
                for h in 0..shape.heads {
                    for c in 0..shape.head_dim {
                        m.push((deploy.inner_offset(h, n, c) as u32, stored.inner_offset(h, n, c) as u32));
                    }
                }
            }
            (Some(m), shape.elem_size as usize)
        };
        BlockAdapter { layers, parts: shape.kv_parts, sub_bytes: shape.bytes(), layout, moves, unit }
    }

    /// Bytes of one stored block (every KV layer, K and V).
    pub fn slot_bytes(&self) -> usize {
        self.layers.len() * self.parts as usize * self.sub_bytes
    }

    /// True when the copy path transposes.
    pub fn transposes(&self) -> bool {
        self.moves.is_some()
    }

    /// The deployment layout it adapts from.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Copies block `block` of every KV layer out of the regions into `dst` (stored form),
    /// with streaming stores (the stored block is not read again soon).
    pub fn gather(&self, mem: &KvMemory, block: BlockId, dst: &mut [u8]) -> Result<(), GeometryError> {
        self.check_len(dst.len())?;
        let mut batch = Batch::new();
        let mut scratch = Vec::new();
        for (i, out) in dst.chunks_exact_mut(self.sub_bytes).enumerate() {
            let (layer, part) = self.sub(i);
            let src = mem.slice(mem.span(layer, part, block)?)?;
            match &self.moves {
                None => batch.copy(out, src),
                Some(m) if self.streams_rows(out.as_ptr() as usize) => {
                    batch.copy_rows(out, src, m.iter().map(|&(r, s)| (r as usize, s as usize)), self.unit)
                }
                // Rows that do not fill whole cache lines: transposed in cache, then streamed.
                Some(m) => {
                    scratch.resize(self.sub_bytes, 0);
                    permute(src, &mut scratch, m, self.unit, false);
                    batch.copy(out, &scratch);
                }
            }
        }
        Ok(())
    }

    /// Whether a sub-block at `addr` is written row by row with streaming stores: its rows
    /// are whole cache lines ([`STREAM_MIN_PIECE`]), which needs the sub-block line aligned.
    fn streams_rows(&self, addr: usize) -> bool {
        self.unit.is_multiple_of(STREAM_MIN_PIECE) && addr.is_multiple_of(STREAM_MIN_PIECE)
    }

    /// [`BlockAdapter::gather`], returning the stored block's [`crate::hash::checksum`]
    /// taken in the same pass: each piece is summed while it is in cache (the source piece
    /// right after it is streamed out; when transposing, the sub-block transposed in a
    /// cache-sized scratch, summed, then streamed out).
    pub fn gather_summed(
        &self,
        mem: &KvMemory,
        block: BlockId,
        dst: &mut [u8],
    ) -> Result<u64, GeometryError> {
        self.check_len(dst.len())?;
        let mut sum = Checksum::new();
        let mut batch = Batch::new();
        let mut scratch = Vec::new();
        for (i, out) in dst.chunks_exact_mut(self.sub_bytes).enumerate() {
            let (layer, part) = self.sub(i);
            let src = mem.slice(mem.span(layer, part, block)?)?;
            match &self.moves {
                None => sum.copy_update(&mut batch, out, src),
                Some(m) => {
                    scratch.resize(self.sub_bytes, 0);
                    permute(src, &mut scratch, m, self.unit, false);
                    sum.copy_update(&mut batch, out, &scratch);
                }
            }
        }
        Ok(sum.finish())
    }

    /// Copies a stored block `src` into block `block` of every KV layer, with streaming
    /// stores. `scratch` holds one transposed sub-block on its way in when the layout moves
    /// single elements.
    pub fn scatter(
        &self,
        mem: &KvMemory,
        block: BlockId,
        src: &[u8],
        scratch: &mut Vec<u8>,
    ) -> Result<(), GeometryError> {
        self.scatter_inner(mem, block, src, scratch, None)
    }

    /// [`BlockAdapter::scatter`], returning the stored block's [`crate::hash::checksum`]
    /// taken in the same pass (each sub-block summed as it is streamed in, or, when
    /// transposing, summed just before it is moved, while it is in cache), so a reader can
    /// verify what it loaded without reading it again.
    pub fn scatter_summed(
        &self,
        mem: &KvMemory,
        block: BlockId,
        src: &[u8],
        scratch: &mut Vec<u8>,
    ) -> Result<u64, GeometryError> {
        let mut sum = Checksum::new();
        self.scatter_inner(mem, block, src, scratch, Some(&mut sum))?;
        Ok(sum.finish())
    }

    /// Zeroes block `block` of every KV layer: a block whose load failed after its bytes were
    /// copied in (an SSD record whose checksum disagreed) holds no byte of it afterwards.
    pub fn clear(&self, mem: &KvMemory, block: BlockId) -> Result<(), GeometryError> {
        for i in 0..self.layers.len() * self.parts as usize {
            let (layer, part) = self.sub(i);
            let span = mem.span(layer, part, block)?;
            mem.write_with(span, span.len, |d| d.fill(0))?;
        }
        Ok(())
    }

    fn scatter_inner(
        &self,
        mem: &KvMemory,
        block: BlockId,
        src: &[u8],
        scratch: &mut Vec<u8>,
        mut sum: Option<&mut Checksum>,
    ) -> Result<(), GeometryError> {
        self.check_len(src.len())?;
        let mut batch = Batch::new();
        for (i, inp) in src.chunks_exact(self.sub_bytes).enumerate() {
            let (layer, part) = self.sub(i);
            let span = mem.span(layer, part, block)?;
            match (&self.moves, sum.as_deref_mut()) {
                (None, None) => stream_copy::write_in(mem, &mut batch, span, inp)?,
                (None, Some(sum)) => {
                    mem.write_with(span, inp.len(), |d| sum.copy_update(&mut batch, d, inp))?
                }
                (Some(m), sum) => {
                    if let Some(sum) = sum {
                        sum.update(inp);
                    }
                    if self.streams_rows(mem.slice(span)?.as_ptr() as usize) {
                        // Rows of whole cache lines: streamed straight into the region, row by row.
                        stream_copy::write_rows_in(
                            mem,
                            &mut batch,
                            span,
                            inp,
                            m.iter().map(|&(r, s)| (s as usize, r as usize)),
                            self.unit,
                        )?
                    } else {
                        // Other rows, or single elements: transposed in `scratch`, then streamed.
                        scratch.resize(self.sub_bytes, 0);
                        permute(inp, scratch, m, self.unit, true);
                        stream_copy::write_in(mem, &mut batch, span, scratch)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn sub(&self, i: usize) -> (LayerId, u32) {
        (self.layers[i / self.parts as usize], (i % self.parts as usize) as u32)
    }

    fn check_len(&self, len: usize) -> Result<(), GeometryError> {
        if len != self.slot_bytes() {
            return Err(GeometryError::SpanOutOfRegion { region: usize::MAX, offset: 0, len });
        }
        Ok(())
    }
}

/// Moves `unit`-byte pieces between a deployment-ordered block and a stored one, into a
/// destination that stays in cache (a scratch sub-block). `to_region` false: region ->
/// stored (`src` is the region side); true: stored -> region.
#[inline]
fn permute(src: &[u8], dst: &mut [u8], moves: &[(u32, u32)], unit: usize, to_region: bool) {
    for &(r, s) in moves {
        let (from, to) = if to_region { (s as usize, r as usize) } else { (r as usize, s as usize) };
        dst[to..to + unit].copy_from_slice(&src[from..from + unit]);
    }
}

#[allow(unsafe_code)] // Tests vouch for their own KV buffers as regions (KvRegion::new).
#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> BlockShape {
        BlockShape { heads: 3, tokens: 4, head_dim: 5, elem_size: 2, kv_parts: 2 }
    }

    #[test]
    fn nhd_is_a_plain_copy_and_hnd_is_a_transpose() {
        assert!(!BlockAdapter::with_shape(vec![LayerId(0)], shape(), KvLayout::NHD).transposes());
        assert!(!BlockAdapter::with_shape(vec![LayerId(0)], shape(), KvLayout::BLNHC).transposes());
        let a = BlockAdapter::with_shape(vec![LayerId(0)], shape(), KvLayout::HND);
        assert!(a.transposes());
        assert_eq!(a.unit, 10);
        // HND row (h=2, n=1) lands at NHD row (n=1, h=2).
        let m = a.moves.as_ref().unwrap();
        assert!(m.contains(&(((2 * 4 + 1) * 10) as u32, ((3 + 2) * 10) as u32)));
    }

    #[test]
    fn odd_layout_moves_elements_exactly() {
        // C outside N: element moves.
        let l: KvLayout = "LBCHN".parse().unwrap();
        let a = BlockAdapter::with_shape(vec![LayerId(0)], shape(), l);
        assert_eq!(a.unit, 2);
        let s = shape();
        let src: Vec<u8> = (0..s.bytes()).map(|i| (i * 31 % 251) as u8).collect();
        let mut stored = vec![0; s.bytes()];
        permute(&src, &mut stored, a.moves.as_ref().unwrap(), a.unit, false);
        let dg = Geometry::new(s, l, vec![]);
        let sg = Geometry::new(s, KvLayout::NHD, vec![]);
        for h in 0..3 {
            for n in 0..4 {
                for c in 0..5 {
                    let (x, y) = (dg.inner_offset(h, n, c), sg.inner_offset(h, n, c));
                    assert_eq!(src[x..x + 2], stored[y..y + 2]);
                }
            }
        }
        let mut back = vec![0; s.bytes()];
        permute(&stored, &mut back, a.moves.as_ref().unwrap(), a.unit, true);
        assert_eq!(back, src);
    }

    #[test]
    fn one_kv_head_needs_no_transpose() {
        let shape = |heads| BlockShape { heads, tokens: 8, head_dim: 16, elem_size: 2, kv_parts: 2 };
        assert!(!BlockAdapter::with_shape(vec![LayerId(0)], shape(1), KvLayout::HND).transposes());
        assert!(!BlockAdapter::with_shape(vec![LayerId(0)], shape(1), KvLayout::BLHNC).transposes());
        assert!(BlockAdapter::with_shape(vec![LayerId(0)], shape(2), KvLayout::HND).transposes());
    }

    /// `shift` bytes past a cache line of `buf`, `len` long.
    fn at_shift(buf: &mut [u8], shift: usize, len: usize) -> &mut [u8] {
        let at = buf.as_ptr().align_offset(64) + shift;
        &mut buf[at..at + len]
    }

    /// Gathers block 1 of `layout` regions (HND: 128-byte rows) into a stored block and
    /// scatters it into block 2 of other regions, summed in the same pass, and into block 1
    /// plainly; the stored block and the regions start `stored_shift`
    /// and `region_shift` bytes past a cache line (0: rows streamed whole; else transposed in
    /// cache first).
    fn wide_rows_round_trip(layout: KvLayout, stored_shift: usize, region_shift: usize) {
        use kvconnect_api::{
            AttentionKind, Dtype, KvGroup, KvRegion, KvRegionSpec, MemoryKind, TransferMode,
        };
        let model = ModelSpec {
            name: "t".into(),
            num_layers: 2,
            num_kv_heads: 4,
            head_dim: 64,
            dtype: Some(Dtype::Bf16),
            layers: vec![AttentionKind::Full; 2],
            state: None,
        };
        let eff = |layout| EffectiveLayout {
            layout,
            hma: false,
            block_size: 8,
            cache_dtype: Dtype::Bf16,
            memory: MemoryKind::Host,
            transfer_mode: TransferMode::None,
            groups: vec![KvGroup { kind: AttentionKind::Full, layers: vec![LayerId(0), LayerId(1)] }],
            state_groups: vec![],
            opaque_blocks: false,
        };
        let shape = BlockShape::of(&model, &eff(layout));
        let len = 3 * shape.layer_block_bytes();
        let mut src: Vec<Vec<u8>> =
            (0..2).map(|l| (0..len + 128).map(|i| ((i * 131 + l * 7) % 253) as u8).collect()).collect();
        let mut dst: Vec<Vec<u8>> = vec![vec![0u8; len + 128]; 2];
        let regions = |bufs: &mut Vec<Vec<u8>>| -> Vec<KvRegion> {
            bufs.iter_mut()
                .enumerate()
                .map(|(i, b)| {
                    let spec = KvRegionSpec::host(
                        format!("layer.{i}"),
                        at_shift(b, region_shift, len),
                        vec![LayerId(i as u32)],
                        0,
                        3,
                    );
                    // SAFETY: `src` and `dst` outlive both KvMemory values and are read back
                    // only after the copies.
                    unsafe { KvRegion::new(spec) }
                })
                .collect()
        };
        let src_mem = KvMemory::new(&regions(&mut src), &model, &eff(layout)).unwrap();
        let dst_mem = KvMemory::new(&regions(&mut dst), &model, &eff(layout)).unwrap();
        let a = BlockAdapter::new(&model, &eff(layout));
        assert_eq!(a.transposes(), layout == KvLayout::HND);
        let mut stored_buf = vec![0u8; a.slot_bytes() + 128];
        let stored = at_shift(&mut stored_buf, stored_shift, a.slot_bytes());
        if a.transposes() {
            assert_eq!(a.unit, 128);
            assert_eq!(a.streams_rows(stored.as_ptr() as usize), stored_shift == 0);
        }
        let sum = a.gather_summed(&src_mem, BlockId(1), stored).unwrap();
        assert_eq!(sum, crate::hash::checksum(stored), "summed in the same pass as the copy");
        let mut plain_buf = vec![0u8; a.slot_bytes() + 128];
        let plain = at_shift(&mut plain_buf, stored_shift, a.slot_bytes());
        a.gather(&src_mem, BlockId(1), plain).unwrap();
        assert_eq!(plain, stored);
        // Scattered with its checksum taken in the same pass into block 2, plainly into 1.
        let sum_in = a.scatter_summed(&dst_mem, BlockId(2), stored, &mut Vec::new()).unwrap();
        assert_eq!(sum_in, sum, "the scatter sums the stored block it copies");
        a.scatter(&dst_mem, BlockId(1), stored, &mut Vec::new()).unwrap();
        let stored = stored.to_vec();
        let hnd = Geometry::new(shape, layout, vec![]);
        let nhd = Geometry::new(shape, KvLayout::NHD, vec![]);
        let view = |b: &Vec<u8>| b[b.as_ptr().align_offset(64) + region_shift..][..len].to_vec();
        let (src, dst): (Vec<Vec<u8>>, Vec<Vec<u8>>) =
            (src.iter().map(view).collect(), dst.iter().map(view).collect());
        for l in 0..2u32 {
            for part in 0..2u32 {
                let s = src_mem.span(LayerId(l), part, BlockId(1)).unwrap();
                let d = dst_mem.span(LayerId(l), part, BlockId(2)).unwrap();
                let d1 = dst_mem.span(LayerId(l), part, BlockId(1)).unwrap();
                let dl = &dst[l as usize];
                assert_eq!(
                    dl[d1.offset..d1.offset + d1.len],
                    dl[d.offset..d.offset + d.len],
                    "scatter and scatter_summed"
                );
                let base = (l * 2 + part) as usize * shape.bytes();
                for h in 0..4 {
                    for n in 0..8 {
                        for c in 0..64 {
                            let (x, y) = (hnd.inner_offset(h, n, c), nhd.inner_offset(h, n, c));
                            let want = &src[l as usize][s.offset + x..s.offset + x + 2];
                            assert_eq!(
                                &stored[base + y..base + y + 2],
                                want,
                                "stored ({l},{part},{h},{n},{c})"
                            );
                            assert_eq!(&dst[l as usize][d.offset + x..d.offset + x + 2], want);
                        }
                    }
                }
            }
        }
        // Nothing outside the destination block was written.
        let d0 = dst_mem.span(LayerId(0), 0, BlockId(0)).unwrap();
        assert!(dst[0][d0.offset..d0.offset + d0.len].iter().all(|b| *b == 0));
    }

    #[test]
    fn wide_rows_round_trip_through_hnd_and_nhd_regions_exactly_aligned_or_not() {
        for layout in [KvLayout::HND, KvLayout::NHD] {
            wide_rows_round_trip(layout, 0, 0);
            wide_rows_round_trip(layout, 16, 0);
            wide_rows_round_trip(layout, 0, 16);
            wide_rows_round_trip(layout, 16, 48);
        }
    }
}
