//! Copy units of KV regions: the base addresses and the block size one gather launch needs
//! to move whole blocks of every layer, and the geometry of a small host copy ("stage")
//! whose blocks are `0..n`.
//!
//! The rule: in a layout every dimension before the block dimension `B` selects a unit (one
//! base address), and everything after `B` is one contiguous block of `block_bytes`. K/V
//! sits directly inside `L`, so a per-layer layout `[L][K|V][B]..` has one unit per (layer,
//! part) with blocks of one part of one layer, and a layout that starts with `B` has one unit
//! per region with blocks of every layer. A layout with `H`, `N` or `C` before `B` would split
//! a block into many units; `Geometry::span` does not describe such a layout that way, so it
//! is refused. Pure: no GPU needed, so CI checks it against `Geometry::span`.

#![allow(unsafe_code)] // CUDA bindings: driver calls and device memory.

use kvconnect_api::geometry::{Geometry, RegionShape};
use kvconnect_api::layout::Dim;
use kvconnect_api::{BlockId, KvLayout, KvRegion, KvRegionSpec, LayerId, MemoryKind};

/// Why regions cannot be split into copy units.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitsError {
    /// A layout with a head, token or channel dimension outside the block dimension.
    #[error(
        "KV layout {layout} puts {dims} outside the block dimension B, so a block is not one contiguous \
        run per layer; device KV staging supports layouts that start with B or with L then B (NHD, HND, \
        BLNHC, BLHNC, ...)"
    )]
    Layout {
        /// The layout.
        layout: String,
        /// The dims before B other than L.
        dims: String,
    },
    /// Cross-layer regions holding different numbers of layers (blocks of different sizes).
    #[error(
        "cross-layer region {region} holds {layers} layers but region 0 holds {first}: one gather needs \
        blocks of one size; register cross-layer regions with equal layer counts"
    )]
    UnequalRegions {
        /// The region index.
        region: usize,
        /// Its layer count.
        layers: usize,
        /// Region 0's.
        first: usize,
    },
    /// A block size the gather kernel cannot copy.
    #[error(
        "a KV block of one unit is {0} bytes; the gather copies 16-byte words, so it must be a positive \
        multiple of 16 (heads x block_size x head_dim x dtype size)"
    )]
    BlockBytes(u64),
    /// `Geometry::span` disagrees with the unit rule (a bug in one of them).
    #[error(
        "layer {layer} part {part} block {block}: Geometry::span puts it at region {region} offset \
        {offset}, outside its copy unit"
    )]
    Mismatch {
        /// Layer.
        layer: LayerId,
        /// K/V part.
        part: u32,
        /// Block.
        block: BlockId,
        /// Region of the span.
        region: usize,
        /// Offset of the span.
        offset: usize,
    },
    /// A layer no region holds (the geometry refused it).
    #[error("addressing layer {0} failed: {1}")]
    Geometry(LayerId, String),
}

/// One base address of a gather: a region and the offset of block 0 of this unit in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit {
    /// Region index.
    pub region: usize,
    /// Byte offset of block 0 from the region's start.
    pub offset: u64,
}

/// The units of one geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvUnits {
    /// Units in (region, layer, part) order; the same order for any block count, so a
    /// device geometry's units and its stage's units pair up by index.
    pub units: Vec<Unit>,
    /// Bytes one unit's block occupies.
    pub block_bytes: u64,
}

/// Refuses a layout the unit rule does not cover.
pub fn check_layout(layout: KvLayout) -> Result<(), UnitsError> {
    let before: Vec<Dim> =
        layout.order().into_iter().take(layout.position(Dim::B)).filter(|d| *d != Dim::L).collect();
    if before.is_empty() {
        return Ok(());
    }
    Err(UnitsError::Layout {
        layout: layout.display_name(),
        dims: before.iter().map(|d| format!("{d:?}")).collect::<Vec<_>>().join(", "),
    })
}

impl KvUnits {
    /// Splits a geometry's regions into units (needs at least one block per region to ask
    /// `Geometry::span` where block 0 is; a region without blocks has no units).
    pub fn of(g: &Geometry) -> Result<KvUnits, UnitsError> {
        let layout = g.layout();
        check_layout(layout)?;
        let shape = g.shape();
        let parts = shape.kv_parts;
        let cross = layout.position(Dim::B) == 0;
        let mut units = Vec::new();
        let block_bytes = if cross {
            let first = g.regions().first().map_or(0, |r| r.layers.len());
            for (i, r) in g.regions().iter().enumerate() {
                if r.layers.len() != first {
                    return Err(UnitsError::UnequalRegions { region: i, layers: r.layers.len(), first });
                }
                units.push(Unit { region: i, offset: 0 });
            }
            (first * shape.layer_block_bytes()) as u64
        } else {
            for r in g.regions() {
                if r.num_blocks == 0 {
                    continue;
                }
                for l in &r.layers {
                    for part in 0..parts {
                        let s = g
                            .span(*l, part, BlockId(0))
                            .map_err(|e| UnitsError::Geometry(*l, e.to_string()))?;
                        units.push(Unit { region: s.region, offset: s.offset as u64 });
                    }
                }
            }
            shape.bytes() as u64
        };
        if block_bytes == 0 || !block_bytes.is_multiple_of(16) {
            return Err(UnitsError::BlockBytes(block_bytes));
        }
        let out = KvUnits { units, block_bytes };
        // Cheap check of the rule against the geometry at both ends of every region.
        for r in g.regions() {
            if r.num_blocks == 0 {
                continue;
            }
            for b in [0, r.num_blocks - 1] {
                for l in &r.layers {
                    for part in 0..parts {
                        out.check_span(g, *l, part, BlockId(b))?;
                    }
                }
            }
        }
        Ok(out)
    }

    /// Checks that the span `Geometry::span` gives lies inside the block `block` of a unit.
    pub fn check_span(
        &self,
        g: &Geometry,
        layer: LayerId,
        part: u32,
        block: BlockId,
    ) -> Result<(), UnitsError> {
        let s = g.span(layer, part, block).map_err(|e| UnitsError::Geometry(layer, e.to_string()))?;
        let inside = self.units.iter().any(|u| {
            let start = u.offset + block.0 as u64 * self.block_bytes;
            u.region == s.region
                && s.offset as u64 >= start
                && (s.offset + s.len) as u64 <= start + self.block_bytes
        });
        if inside {
            Ok(())
        } else {
            Err(UnitsError::Mismatch { layer, part, block, region: s.region, offset: s.offset })
        }
    }
}

/// The host copy of `n` blocks of a geometry: the same block shape, layout and regions
/// (layers), each region holding blocks `0..n`, placed one after another in one buffer.
#[derive(Debug, Clone)]
pub struct StageLayout {
    /// The host copy's geometry.
    pub geometry: Geometry,
    /// Byte offset of each region in the buffer.
    pub region_offsets: Vec<usize>,
    /// Bytes of the whole copy.
    pub bytes: usize,
    /// Offset of each unit's block 0 in the buffer, in the same order as the device units.
    pub unit_offsets: Vec<u64>,
}

impl StageLayout {
    /// The host copy of `n` blocks of `device`'s regions.
    pub fn new(device: &Geometry, n: u32) -> Result<StageLayout, UnitsError> {
        let regions: Vec<RegionShape> = device
            .regions()
            .iter()
            .map(|r| RegionShape { layers: r.layers.clone(), num_blocks: n })
            .collect();
        let geometry = Geometry::new(device.shape(), device.layout(), regions);
        let mut region_offsets = Vec::with_capacity(geometry.regions().len());
        let mut bytes = 0usize;
        for r in geometry.regions() {
            region_offsets.push(bytes);
            bytes += geometry.region_bytes(r);
        }
        let unit_offsets = if n == 0 {
            Vec::new()
        } else {
            KvUnits::of(&geometry)?.units.iter().map(|u| region_offsets[u.region] as u64 + u.offset).collect()
        };
        Ok(StageLayout { geometry, region_offsets, bytes, unit_offsets })
    }

    /// Host regions over a buffer at `base` laid out as this stage (for `KvMemory::new`),
    /// named after the device regions.
    ///
    /// # Safety
    /// `base` must start `self.bytes` bytes of host memory that stay readable and writable by
    /// this process, and are otherwise untouched, for as long as the regions or anything built
    /// from them is used.
    pub unsafe fn host_regions(&self, base: u64, device: &[KvRegion]) -> Vec<KvRegion> {
        self.geometry
            .regions()
            .iter()
            .zip(&self.region_offsets)
            .zip(device)
            .map(|((r, off), d)| {
                let spec = KvRegionSpec {
                    name: format!("{} (host copy)", d.name()),
                    addr: base + *off as u64,
                    len: self.geometry.region_bytes(r) as u64,
                    memory: MemoryKind::Host,
                    device: -1,
                    layers: r.layers.clone(),
                    group: d.group(),
                    num_blocks: r.num_blocks,
                    shm_name: None,
                };
                // SAFETY: the region is `region_bytes` at `off` into the stage, which ends at
                // `self.bytes`: inside the buffer the caller vouches for.
                unsafe { KvRegion::new(spec) }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::geometry::BlockShape;

    fn shape(kv_parts: u32) -> BlockShape {
        BlockShape { heads: 2, tokens: 4, head_dim: 8, elem_size: 2, kv_parts }
    }

    fn regions(layout: KvLayout, layers: u32, blocks: u32) -> Vec<RegionShape> {
        if layout.is_cross_layer() {
            vec![RegionShape { layers: (0..layers).map(LayerId).collect(), num_blocks: blocks }]
        } else {
            (0..layers).map(|l| RegionShape { layers: vec![LayerId(l)], num_blocks: blocks }).collect()
        }
    }

    /// Every layout: either refused (exactly those with H, N or C before B), or every
    /// (layer, part, block) span lies in its unit's block, units do not overlap, and the
    /// units cover the regions exactly.
    #[test]
    fn units_agree_with_geometry_span_for_every_layout() {
        let mut accepted = 0;
        for layout in KvLayout::all() {
            for parts in [1, 2] {
                let g = Geometry::new(shape(parts), layout, regions(layout, 3, 5));
                let inner_before_b = layout.order()[..layout.position(Dim::B)].iter().any(|d| *d != Dim::L);
                let r = KvUnits::of(&g);
                if inner_before_b {
                    let e = r.unwrap_err().to_string();
                    assert!(e.contains(&layout.display_name()) && e.contains("outside the block"), "{e}");
                    continue;
                }
                accepted += 1;
                let u = r.unwrap();
                for reg in g.regions() {
                    for l in &reg.layers {
                        for p in 0..parts {
                            for b in 0..reg.num_blocks {
                                u.check_span(&g, *l, p, BlockId(b)).unwrap();
                            }
                        }
                    }
                }
                // Units tile every region exactly: no overlap, no gap.
                let total: u64 = g.regions().iter().map(|r| g.region_bytes(r) as u64).sum();
                assert_eq!(u.units.len() as u64 * 5 * u.block_bytes, total, "{layout}");
                let mut starts: Vec<(usize, u64)> = u.units.iter().map(|x| (x.region, x.offset)).collect();
                starts.sort();
                for w in starts.windows(2) {
                    if w[0].0 == w[1].0 {
                        assert!(w[1].1 >= w[0].1 + 5 * u.block_bytes, "{layout}: units overlap");
                    }
                }
            }
        }
        // L B x x x (6 orders) and B x x x x (24 orders), each with 1 and 2 parts.
        assert_eq!(accepted, 2 * 30);
    }

    #[test]
    fn per_layer_and_cross_layer_units() {
        let s = shape(2);
        let blk = s.bytes() as u64;
        let g = Geometry::new(s, KvLayout::NHD, regions(KvLayout::NHD, 2, 10));
        let u = KvUnits::of(&g).unwrap();
        assert_eq!(u.block_bytes, blk);
        assert_eq!(
            u.units,
            vec![
                Unit { region: 0, offset: 0 },
                Unit { region: 0, offset: 10 * blk },
                Unit { region: 1, offset: 0 },
                Unit { region: 1, offset: 10 * blk },
            ]
        );
        let g = Geometry::new(s, KvLayout::BLHNC, regions(KvLayout::BLHNC, 3, 10));
        let u = KvUnits::of(&g).unwrap();
        assert_eq!(u.block_bytes, 3 * 2 * blk);
        assert_eq!(u.units, vec![Unit { region: 0, offset: 0 }]);
    }

    #[test]
    fn stage_of_n_blocks_mirrors_the_device_units() {
        let s = shape(2);
        let blk = s.bytes() as u64;
        let g = Geometry::new(s, KvLayout::HND, regions(KvLayout::HND, 2, 100));
        let st = StageLayout::new(&g, 3).unwrap();
        assert_eq!(st.bytes, 2 * 2 * 3 * blk as usize);
        assert_eq!(st.region_offsets, vec![0, 2 * 3 * blk as usize]);
        assert_eq!(st.unit_offsets, vec![0, 3 * blk, 6 * blk, 9 * blk]);
        // Block i of layer 1 part 1 of the stage is where the stage geometry says.
        let span = st.geometry.span(LayerId(1), 1, BlockId(2)).unwrap();
        assert_eq!(st.region_offsets[span.region] as u64 + span.offset as u64, 9 * blk + 2 * blk);
        let dev = KvRegionSpec {
            name: "layer.0".into(),
            addr: 1,
            len: 0,
            memory: MemoryKind::Device,
            device: 0,
            layers: vec![LayerId(0)],
            group: 0,
            num_blocks: 100,
            shm_name: None,
        };
        // SAFETY: neither region is ever dereferenced; the test only reads their descriptions.
        let host = unsafe { st.host_regions(4096, &[KvRegion::new(dev)]) };
        assert_eq!(host.len(), 1, "zip stops at the shorter list");
        assert_eq!((host[0].addr(), host[0].num_blocks(), host[0].memory()), (4096, 3, MemoryKind::Host));
    }

    /// The gather done on the CPU with the kernel's arithmetic (unit base + block x
    /// block_bytes on both sides): a host copy read through `KvMemory` over `host_regions`
    /// holds device block `blocks[i]` as its block `i`, for every layer and part, in
    /// per-layer and cross-layer layouts.
    #[test]
    fn emulated_gather_gives_a_host_copy_the_geometry_reads_back() {
        use kvconnect_api::kv_memory::KvMemory;
        use kvconnect_api::{AttentionKind, Dtype, EffectiveLayout, KvGroup, ModelSpec, TransferMode};
        let model = ModelSpec {
            name: "t".into(),
            num_layers: 3,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: Some(Dtype::F16),
            layers: vec![AttentionKind::Full; 3],
            state: None,
        };
        for layout in [KvLayout::NHD, KvLayout::HND, KvLayout::BLNHC, KvLayout::BLHNC] {
            let eff = EffectiveLayout {
                layout,
                hma: false,
                block_size: 4,
                cache_dtype: Dtype::F16,
                memory: MemoryKind::Device,
                transfer_mode: TransferMode::None,
                groups: vec![KvGroup { kind: AttentionKind::Full, layers: (0..3).map(LayerId).collect() }],
                state_groups: vec![],
                opaque_blocks: false,
            };
            let shape = BlockShape::of(&model, &eff);
            let g = Geometry::new(shape, layout, regions(layout, 3, 9));
            let mut dev: Vec<Vec<u8>> = g
                .regions()
                .iter()
                .enumerate()
                .map(|(r, s)| (0..g.region_bytes(s)).map(|i| (i * 7 + r * 131 + i / 97) as u8).collect())
                .collect();
            let dev_regions: Vec<KvRegion> = dev
                .iter_mut()
                .zip(g.regions())
                .enumerate()
                .map(|(i, (b, s))| {
                    let spec = KvRegionSpec::host(format!("r{i}"), b, s.layers.clone(), 0, 9);
                    // SAFETY: `dev` outlives the regions within this iteration and is only read.
                    unsafe { KvRegion::new(spec) }
                })
                .collect();
            let blocks = [7u32, 0, 8, 3];
            let units = KvUnits::of(&g).unwrap();
            let st = StageLayout::new(&g, blocks.len() as u32).unwrap();
            assert_eq!(st.unit_offsets.len(), units.units.len());
            let mut stage = vec![0u8; st.bytes];
            let bb = units.block_bytes as usize;
            for (u, dst) in units.units.iter().zip(&st.unit_offsets) {
                for (i, b) in blocks.iter().enumerate() {
                    let s = u.offset as usize + *b as usize * bb;
                    let d = *dst as usize + i * bb;
                    stage[d..d + bb].copy_from_slice(&dev[u.region][s..s + bb]);
                }
            }
            // SAFETY: `stage` holds `st.bytes` bytes, alive to the end of this iteration and
            // only read through the regions.
            let host = unsafe { st.host_regions(stage.as_mut_ptr() as u64, &dev_regions) };
            let copy = KvMemory::new(&host, &model, &eff).unwrap();
            let orig = KvMemory::new(&dev_regions, &model, &eff).unwrap();
            for l in 0..3 {
                for p in 0..2 {
                    for (i, b) in blocks.iter().enumerate() {
                        let a = copy.slice(copy.span(LayerId(l), p, BlockId(i as u32)).unwrap()).unwrap();
                        let o = orig.slice(orig.span(LayerId(l), p, BlockId(*b)).unwrap()).unwrap();
                        assert_eq!(a, o, "{layout} layer {l} part {p} copy block {i} = device block {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn refuses_what_one_gather_cannot_copy() {
        let g = Geometry::new(
            shape(2),
            KvLayout::BLNHC,
            vec![
                RegionShape { layers: vec![LayerId(0), LayerId(1)], num_blocks: 4 },
                RegionShape { layers: vec![LayerId(2)], num_blocks: 4 },
            ],
        );
        let e = KvUnits::of(&g).unwrap_err().to_string();
        assert!(e.contains("region 1 holds 1 layers but region 0 holds 2"), "{e}");
        let odd = BlockShape { heads: 1, tokens: 1, head_dim: 3, elem_size: 2, kv_parts: 2 };
        let g = Geometry::new(odd, KvLayout::NHD, regions(KvLayout::NHD, 1, 4));
        let e = KvUnits::of(&g).unwrap_err().to_string();
        assert!(e.contains("6 bytes") && e.contains("multiple of 16"), "{e}");
        let hlbnc = KvLayout::from_order([Dim::H, Dim::L, Dim::B, Dim::N, Dim::C]).unwrap();
        let e = check_layout(hlbnc).unwrap_err().to_string();
        assert!(e.contains("HLBNC") && e.contains("puts H outside"), "{e}");
    }
}
