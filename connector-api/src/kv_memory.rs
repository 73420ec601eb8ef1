//! Bounds-checked access to the KV regions a host registered with a connector.
//!
//! `register_kv_caches` hands a connector regions the host vouched for ([`KvRegion::new`]).
//! This module is where a connector turns them, once, into a value whose every read and
//! write is checked against the effective layout: a block id past a region's end, a region
//! of the wrong size or a layer no region holds is an error, never a stray write into
//! someone else's memory. None of it takes `unsafe` from the connector: the promise about
//! the memory was made where the regions were.

#![allow(unsafe_code)] // Reads and writes the host's KV memory at vouched-for addresses, after bounds checks.

use crate::caps::MemoryKind;
use crate::geometry::{BlockShape, Geometry, GeometryError, RegionShape, Span};
use crate::ids::{BlockId, LayerId};
use crate::layout::EffectiveLayout;
use crate::model::ModelSpec;
use crate::region::KvRegion;
use crate::state_slots::{StateRegion, StateSlots};

/// Registered regions that do not match the effective layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    /// A region is not in host memory.
    #[error("region '{name}' is in {memory:?} memory; this data path reads host memory only")]
    NotHost {
        /// The region.
        name: String,
        /// Its memory kind.
        memory: MemoryKind,
    },
    /// A region's length disagrees with the layout.
    #[error(
        "region '{name}' is {len} bytes, but {layers} layer(s) x {num_blocks} blocks of {block_bytes} \
        bytes (K and V) in the effective layout need {expected}: register regions laid out as the negotiated \
        layout says"
    )]
    WrongSize {
        /// The region.
        name: String,
        /// Its length.
        len: u64,
        /// Layers it holds.
        layers: usize,
        /// Blocks it holds.
        num_blocks: u32,
        /// Bytes per block per layer (K and V).
        block_bytes: usize,
        /// The expected length.
        expected: u64,
    },
    /// A KV layer of the model is in no region.
    #[error("layer {0} holds KV but no registered region covers it")]
    MissingLayer(LayerId),
    /// A layer is in two regions.
    #[error("layer {0} is covered by more than one registered region")]
    DuplicateLayer(LayerId),
    /// A null address.
    #[error("region '{0}' has a null address")]
    Null(String),
    /// A state region that does not fit the effective layout's state groups.
    #[error("state region '{name}': {reason}")]
    State {
        /// The region.
        name: String,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A cross-layer layout with a region holding one layer, or the reverse.
    #[error("region '{name}' holds {layers} layer(s) but the effective layout {layout} is {kind}")]
    LayoutMismatch {
        /// The region.
        name: String,
        /// Layers it holds.
        layers: usize,
        /// The layout.
        layout: String,
        /// "per-layer" or "cross-layer".
        kind: &'static str,
    },
    /// Tensor-parallel ranks that do not split the KV heads, or the regions, evenly.
    #[error(
        "{regions} region(s) for a model with {heads} KV heads cannot be split across {ranks} \
        tensor-parallel rank(s): the ranks must divide the KV heads and register the same regions each"
    )]
    TpSplit {
        /// Ranks asked for.
        ranks: u32,
        /// The model's KV heads.
        heads: u32,
        /// Regions registered.
        regions: usize,
    },
}

/// A set of registered host regions, addressed through the effective layout.
#[derive(Debug)]
pub struct KvMemory {
    geometry: Geometry,
    bases: Vec<(usize, usize)>,
}

impl KvMemory {
    /// Checks `regions` against the model and effective layout and keeps their addresses.
    /// Every region must be host memory; [`KvRegion::new`]'s contract keeps it valid for as
    /// long as the returned value is used. Connectors write a block only when the step
    /// protocol gives it to them (a load's target before the forward pass, a save's source
    /// after it), so the engine never reads a block they are writing.
    pub fn new(
        regions: &[KvRegion],
        model: &ModelSpec,
        eff: &EffectiveLayout,
    ) -> Result<KvMemory, RegionError> {
        Self::build(regions, model, eff, true, 1)
    }

    /// [`KvMemory::new`] over the regions of `tp_ranks` tensor-parallel ranks, registered
    /// rank by rank: each rank holds `num_kv_heads / tp_ranks` heads of every KV layer in
    /// its own regions (`Geometry::with_tp_ranks`).
    pub fn with_tp_ranks(
        regions: &[KvRegion],
        model: &ModelSpec,
        eff: &EffectiveLayout,
        tp_ranks: u32,
    ) -> Result<KvMemory, RegionError> {
        Self::build(regions, model, eff, true, tp_ranks)
    }

    /// The geometry and bounds of regions this process cannot dereference (device memory):
    /// the same checks as [`KvMemory::new`] except the memory kind, and no access —
    /// `read`, `write` and `slice` fail with `SpanOutOfRegion`, `region_base` is `None`.
    /// Connectors that move device bytes with their own kernels use it for planning.
    pub fn geometry_only(
        regions: &[KvRegion],
        model: &ModelSpec,
        eff: &EffectiveLayout,
    ) -> Result<KvMemory, RegionError> {
        Self::build(regions, model, eff, false, 1)
    }

    fn build(
        regions: &[KvRegion],
        model: &ModelSpec,
        eff: &EffectiveLayout,
        host: bool,
        tp_ranks: u32,
    ) -> Result<KvMemory, RegionError> {
        let split =
            RegionError::TpSplit { ranks: tp_ranks, heads: model.num_kv_heads, regions: regions.len() };
        if tp_ranks == 0
            || !model.num_kv_heads.is_multiple_of(tp_ranks)
            || !regions.len().is_multiple_of(tp_ranks as usize)
        {
            return Err(split);
        }
        let mut shape = BlockShape::of(model, eff);
        shape.heads /= tp_ranks;
        let mut shapes = Vec::with_capacity(regions.len());
        let mut bases = Vec::with_capacity(regions.len());
        let cross = eff.layout.is_cross_layer();
        let state_layers: std::collections::BTreeSet<LayerId> =
            eff.state_groups.iter().flat_map(|g| g.layers.iter().copied()).collect();
        let mut state = StateSlots::default();
        for r in regions {
            if !r.layers().is_empty() && r.layers().iter().all(|l| state_layers.contains(l)) {
                if host && r.memory() != MemoryKind::Host {
                    return Err(RegionError::NotHost { name: r.name().to_owned(), memory: r.memory() });
                }
                state_region(r, eff, shapes.len(), &mut state)?;
                if host {
                    bases.push((r.addr() as usize, r.len() as usize));
                }
                continue;
            }
            if !state.is_empty() {
                return Err(RegionError::State {
                    name: r.name().to_owned(),
                    reason: "a KV region follows a state region; register every KV region first".into(),
                });
            }
            if host && r.memory() != MemoryKind::Host {
                return Err(RegionError::NotHost { name: r.name().to_owned(), memory: r.memory() });
            }
            if r.addr() == 0 {
                return Err(RegionError::Null(r.name().to_owned()));
            }
            if !cross && r.layers().len() != 1 {
                return Err(RegionError::LayoutMismatch {
                    name: r.name().to_owned(),
                    layers: r.layers().len(),
                    layout: eff.layout.display_name(),
                    kind: "per-layer",
                });
            }
            let expected = (r.layers().len() * r.num_blocks() as usize * shape.layer_block_bytes()) as u64;
            if r.len() != expected {
                return Err(RegionError::WrongSize {
                    name: r.name().to_owned(),
                    len: r.len(),
                    layers: r.layers().len(),
                    num_blocks: r.num_blocks(),
                    block_bytes: shape.layer_block_bytes(),
                    expected,
                });
            }
            shapes.push(RegionShape { layers: r.layers().to_vec(), num_blocks: r.num_blocks() });
            if host {
                bases.push((r.addr() as usize, r.len() as usize));
            }
        }
        if tp_ranks > 1 && !state.is_empty() {
            return Err(RegionError::State {
                name: regions.last().map(|r| r.name().to_owned()).unwrap_or_default(),
                reason: format!(
                    "not implemented: state layers across {tp_ranks} tensor-parallel ranks (state regions \
                        are registered for TP 1 only)"
                ),
            });
        }
        // Every rank covers every KV layer once, in its own regions (state regions, TP 1
        // only, count towards that one rank).
        let per = shapes.len() / tp_ranks as usize;
        for r in 0..tp_ranks as usize {
            let rank = &shapes[r * per..(r + 1) * per];
            let mut seen = std::collections::BTreeSet::new();
            for s in rank.iter().map(|s| &s.layers).chain(state.regions.iter().map(|r| &r.layers)) {
                for l in s {
                    if !seen.insert(*l) {
                        return Err(RegionError::DuplicateLayer(*l));
                    }
                }
            }
            for (i, k) in model.layers.iter().enumerate() {
                let l = LayerId(i as u32);
                if k.has_kv_blocks() && !seen.contains(&l) {
                    return Err(RegionError::MissingLayer(l));
                }
            }
        }
        let geometry = Geometry::new(shape, eff.layout, shapes)
            .with_opaque_blocks(eff.opaque_blocks)
            .with_tp_ranks(tp_ranks)
            .ok_or(split)?
            .with_state(state);
        Ok(KvMemory { geometry, bases })
    }

    /// How many tensor-parallel ranks' regions `regions` are, read from the regions
    /// themselves: each rank's regions cover every KV layer once, so the count of regions
    /// holding the first region's first layer (1 for an engine without TP, or for one rank
    /// of an engine whose ranks each register their own).
    pub fn tp_ranks_in(regions: &[KvRegion]) -> u32 {
        let Some(first) = regions.first().and_then(|r| r.layers().first()) else { return 1 };
        regions.iter().filter(|r| r.layers().contains(first)).count().max(1) as u32
    }

    /// The same memory as rank `rank` of an engine of `tp_size` ranks, when it holds one
    /// rank's regions ([`Geometry::as_rank_of`]); `None` otherwise.
    pub fn as_rank_of(self, rank: u32, tp_size: u32) -> Option<KvMemory> {
        let geometry = self.geometry.as_rank_of(rank, tp_size)?;
        Some(KvMemory { geometry, ..self })
    }

    /// The same memory with opaque blocks whose heads are outermost, when `yes`
    /// ([`Geometry::with_opaque_heads_outer`]).
    pub fn with_opaque_heads_outer(self, yes: bool) -> KvMemory {
        KvMemory { geometry: self.geometry.with_opaque_heads_outer(yes), ..self }
    }

    /// The geometry the regions follow.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// The span of one block of one layer and K/V part.
    pub fn span(&self, layer: LayerId, part: u32, block: BlockId) -> Result<Span, GeometryError> {
        self.geometry.span(layer, part, block)
    }

    /// The span of one request's state `slot` in state layer `layer`.
    pub fn state_span(&self, layer: LayerId, slot: BlockId) -> Result<Span, GeometryError> {
        self.geometry.state().span(layer, slot)
    }

    /// Copies a span out of the regions into `dst` (which must be `span.len` bytes).
    pub fn read(&self, span: Span, dst: &mut [u8]) -> Result<(), GeometryError> {
        let src = self.checked(span, dst.len())?;
        // SAFETY: `checked` proved [src, src+len) lies inside a registered host region, which
        // `KvRegion::new`'s contract keeps valid for reads; `dst` is a distinct Rust slice.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into a span of the regions.
    pub fn write(&self, span: Span, src: &[u8]) -> Result<(), GeometryError> {
        let dst = self.checked(span, src.len())?;
        // SAFETY: as in `read`; the region is valid for writes and `src` cannot alias it
        // because it is a shared Rust slice the caller owns.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    /// Hands `write` a writable view of a span of the regions (`len` bytes, which must be the
    /// span's), for a copy that does more than copy, such as summing the bytes it streams in;
    /// returns what `write` returns. The view lives only for the call.
    pub fn write_with<R>(
        &self,
        span: Span,
        len: usize,
        write: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, GeometryError> {
        let dst = self.checked(span, len)?;
        // SAFETY: [dst, dst+len) lies inside a registered host region (checked by `checked`),
        // valid for writes by `KvRegion::new`'s contract; the view is handed to `write` alone
        // and cannot outlive the call (the closure's argument is borrowed for the call only).
        let dst = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
        Ok(write(dst))
    }

    /// A read-only view of a span, for zero-copy senders. The caller must not hold it across
    /// a step in which the engine may write the same block.
    pub fn slice(&self, span: Span) -> Result<&[u8], GeometryError> {
        let p = self.checked(span, span.len)?;
        // SAFETY: bounds checked by `checked`; validity guaranteed by `KvRegion::new`'s
        // contract for as long as `self`, built from those regions, is used.
        Ok(unsafe { std::slice::from_raw_parts(p as *const u8, span.len) })
    }

    /// Start address and length of region `i`.
    pub fn region_base(&self, i: usize) -> Option<(usize, usize)> {
        self.bases.get(i).copied()
    }

    fn checked(&self, span: Span, len: usize) -> Result<usize, GeometryError> {
        let (base, rlen) = self.bases.get(span.region).copied().ok_or(GeometryError::SpanOutOfRegion {
            region: span.region,
            offset: span.offset,
            len,
        })?;
        if len != span.len || span.offset.checked_add(len).is_none_or(|end| end > rlen) {
            return Err(GeometryError::SpanOutOfRegion { region: span.region, offset: span.offset, len });
        }
        Ok(base + span.offset)
    }
}

/// Checks one state region (host memory, one slot per request in each of its layers, after
/// the KV regions) and adds it to `state`.
fn state_region(
    r: &KvRegion,
    eff: &EffectiveLayout,
    first_region: usize,
    state: &mut StateSlots,
) -> Result<(), RegionError> {
    let bad = |reason: String| RegionError::State { name: r.name().to_owned(), reason };
    if r.addr() == 0 {
        return Err(RegionError::Null(r.name().to_owned()));
    }
    let slot_bytes = StateSlots::slot_bytes_of(eff).ok_or_else(|| {
        bad("the effective layout's state groups do not give one state shape (conv and recurrent state dims \
            must be in the model's config)"
            .into())
    })?;
    if state.is_empty() {
        *state = StateSlots { slot_bytes, first_region, regions: Vec::new() };
    }
    let region = StateRegion { layers: r.layers().to_vec(), num_slots: r.num_blocks() };
    let expected = state.region_bytes(&region);
    if expected != Some(r.len()) {
        return Err(bad(format!(
            "{} bytes, but {} layer(s) x {} slots of {slot_bytes} bytes need {}; register state regions \
                sized as the state groups say",
            r.len(),
            region.layers.len(),
            region.num_slots,
            expected.map_or("more than 2^64".to_owned(), |e| e.to_string())
        )));
    }
    state.regions.push(region);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caps::TransferMode;
    use crate::layout::{KvGroup, KvLayout};
    use crate::model::{AttentionKind, Dtype};
    use crate::region::KvRegionSpec;

    fn model() -> ModelSpec {
        ModelSpec {
            name: "t".into(),
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 4,
            dtype: Some(Dtype::Bf16),
            layers: vec![AttentionKind::Full, AttentionKind::Full],
            state: None,
        }
    }

    fn eff() -> EffectiveLayout {
        EffectiveLayout {
            layout: KvLayout::NHD,
            hma: false,
            block_size: 4,
            cache_dtype: Dtype::Bf16,
            memory: MemoryKind::Host,
            transfer_mode: TransferMode::None,
            groups: vec![KvGroup { kind: AttentionKind::Full, layers: vec![LayerId(0), LayerId(1)] }],
            state_groups: vec![],
            opaque_blocks: false,
        }
    }

    /// A region over `buf`; the caller keeps `buf` alive and untouched while it is used.
    fn region(buf: &mut [u8], layer: u32, blocks: u32) -> KvRegion {
        let spec = KvRegionSpec::host(format!("layer.{layer}"), buf, vec![LayerId(layer)], 0, blocks);
        // SAFETY: every test keeps `buf` alive, and reads it only after dropping the KvMemory
        // built from this region.
        unsafe { KvRegion::new(spec) }
    }

    #[test]
    fn state_regions_follow_the_kv_regions_with_one_slot_per_request() {
        use crate::layout::StateGroup;
        use crate::model::{LayerState, StateKind};
        let st = LayerState {
            kind: StateKind::GatedDeltaNet,
            conv_shape: vec![3, 8],
            conv_dtype: Dtype::Bf16,
            ssm_shape: vec![1, 2, 2],
            ssm_dtype: Dtype::F32,
        };
        let mut m = model();
        m.num_layers = 3;
        m.layers.push(AttentionKind::Linear);
        m.state = Some(st.clone());
        let mut e = eff();
        e.state_groups = vec![StateGroup { layers: vec![LayerId(2)], state: Some(st) }];
        let slot = 3 * 8 * 2 + 4 * 4;
        let block = 2 * 2 * 4 * 4 * 2;
        let (mut a, mut b, mut s) = (vec![0u8; block * 3], vec![0u8; block * 3], vec![0u8; slot * 5]);
        let regions = [region(&mut a, 0, 3), region(&mut b, 1, 3), region(&mut s, 2, 5)];
        let mem = KvMemory::new(&regions, &m, &e).unwrap();
        let span = mem.state_span(LayerId(2), BlockId(4)).unwrap();
        assert_eq!(span, Span { region: 2, offset: 4 * slot, len: slot });
        mem.write(span, &vec![7u8; slot]).unwrap();
        assert!(mem.state_span(LayerId(2), BlockId(5)).is_err());
        drop(mem);
        assert!(s[4 * slot..].iter().all(|x| *x == 7));
        // A state region of the wrong size, or before a KV region, is refused saying so.
        let (mut a, mut b, mut s) = (vec![0u8; block * 3], vec![0u8; block * 3], vec![0u8; slot * 5 + 1]);
        let e1 = KvMemory::new(&[region(&mut a, 0, 3), region(&mut b, 1, 3), region(&mut s, 2, 5)], &m, &e)
            .unwrap_err()
            .to_string();
        assert!(e1.contains("state region 'layer.2'") && e1.contains("5 slots of 64 bytes"), "{e1}");
        let (mut a, mut b, mut s) = (vec![0u8; block * 3], vec![0u8; block * 3], vec![0u8; slot * 5]);
        let e2 = KvMemory::new(&[region(&mut s, 2, 5), region(&mut a, 0, 3), region(&mut b, 1, 3)], &m, &e)
            .unwrap_err()
            .to_string();
        assert!(e2.contains("register every KV region first"), "{e2}");
    }

    #[test]
    fn read_write_round_trip_and_bounds() {
        let per_layer = 3 * 2 * 2 * 4 * 4 * 2; // blocks * kv * heads * tokens * dim * 2 bytes
        let mut a = vec![0u8; per_layer];
        let mut b = vec![0u8; per_layer];
        let regions = [region(&mut a, 0, 3), region(&mut b, 1, 3)];
        let mem = KvMemory::new(&regions, &model(), &eff()).unwrap();
        let span = mem.span(LayerId(1), 1, BlockId(2)).unwrap();
        let data: Vec<u8> = (0..span.len as u32).map(|i| i as u8).collect();
        mem.write(span, &data).unwrap();
        let mut back = vec![0u8; span.len];
        mem.read(span, &mut back).unwrap();
        assert_eq!(back, data);
        assert!(mem.span(LayerId(1), 0, BlockId(3)).is_err());
        assert!(mem.read(span, &mut [0u8; 3]).is_err());
        // A view handed to a closure writes the same span, and is refused at another length.
        let other = mem.span(LayerId(1), 0, BlockId(0)).unwrap();
        let n = mem.write_with(other, other.len, |d| {
            d.fill(7);
            d.len()
        });
        assert_eq!(n.unwrap(), other.len);
        assert!(mem.write_with(other, other.len + 1, |_| ()).is_err());
        drop(mem);
        assert_eq!(&b[span.offset..span.offset + span.len], &data[..]);
        assert!(b[other.offset..other.offset + other.len].iter().all(|x| *x == 7));
    }

    #[test]
    fn wrong_regions_are_refused() {
        let mut a = vec![0u8; 100];
        let regions = [region(&mut a, 0, 3)];
        let e = KvMemory::new(&regions, &model(), &eff()).unwrap_err();
        assert!(matches!(e, RegionError::WrongSize { .. }), "{e}");
        let per_layer = 3 * 2 * 2 * 4 * 4 * 2;
        let mut a = vec![0u8; per_layer];
        let regions = [region(&mut a, 0, 3)];
        let e = KvMemory::new(&regions, &model(), &eff()).unwrap_err();
        assert_eq!(e, RegionError::MissingLayer(LayerId(1)));
    }

    #[test]
    fn tensor_parallel_ranks_each_cover_every_layer_with_their_heads() {
        // One head per rank: a rank's layer region is half the TP 1 size.
        let per_rank_layer = 3 * 2 * 4 * 4 * 2;
        let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; per_rank_layer]).collect();
        let [a, b, c, d] = &mut bufs[..] else { unreachable!() };
        let regions = [region(a, 0, 3), region(b, 1, 3), region(c, 0, 3), region(d, 1, 3)];
        assert_eq!(KvMemory::tp_ranks_in(&regions), 2);
        assert_eq!(KvMemory::tp_ranks_in(&regions[..2]), 1);
        let mem = KvMemory::with_tp_ranks(&regions, &model(), &eff(), 2).unwrap();
        assert_eq!((mem.geometry().shape().heads, mem.geometry().tp_ranks()), (1, 2));
        assert_eq!(mem.geometry().rank_span(1, LayerId(0), 0, BlockId(0)).unwrap().region, 2);
        let e = KvMemory::with_tp_ranks(&regions, &model(), &eff(), 4).unwrap_err();
        assert_eq!(e, RegionError::TpSplit { ranks: 4, heads: 2, regions: 4 });
        assert!(e.to_string().contains("cannot be split across 4 tensor-parallel rank(s)"), "{e}");
        let e = KvMemory::with_tp_ranks(&regions[..2], &model(), &eff(), 2).unwrap_err();
        assert_eq!(e, RegionError::MissingLayer(LayerId(1)));
        assert!(KvMemory::with_tp_ranks(&[], &model(), &eff(), 2).is_err());
    }
}
