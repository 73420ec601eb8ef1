//! Backend `cuda_ipc`, the consumer's plan of its gathers from one producer (feature `cuda`):
//! what every load from that producer has in common, worked out at its first load after a
//! handshake and kept for the later ones. It holds the checks of the two geometries (block
//! sizes, layouts, the permute between them) and, per KV cache group, the base address of
//! each (layer, K/V part) on both sides. A load then only checks and copies its block ids.
//! Looking up 56 (layer, part) units in each geometry took most of the 15-17 µs a load spent
//! planning on the step's thread (BENCHMARKS.md).

use crate::error::TransferError;
use crate::metadata::PeerInfo;
use kvconnect_api::geometry::Geometry;
use kvconnect_api::{BlockId, Dim, LayerId};
use kvconnect_cuda::Permute;

fn plan(msg: String) -> TransferError {
    TransferError::Plan(msg)
}

/// What a gather of one KV cache group copies, whatever the load: the base address of each
/// unit (a layer's K or V part, or a whole cross-layer region) on both sides, the bytes of
/// one block of a unit, and the fewest blocks of the regions each side's block ids index.
#[derive(Debug)]
pub struct GroupPlan {
    pub src_bases: Vec<u64>,
    pub dst_bases: Vec<u64>,
    pub block_bytes: u64,
    pub src_blocks: u32,
    pub dst_blocks: u32,
}

/// The plan of every gather from one producer's handshake ([`LaunchPlan::fits`]).
#[derive(Debug)]
pub struct LaunchPlan {
    /// The handshake it was made for (`PeerInfo::generation`, never 0).
    generation: u64,
    groups: Vec<Vec<LayerId>>,
    /// Tokens per block, equal on both sides.
    pub block_tokens: usize,
    pub permute: Permute,
    /// One per KV cache group, in order.
    pub per_group: Vec<GroupPlan>,
}

impl LaunchPlan {
    /// The plan of gathers from `peer` (its regions at `src_all`) into this worker's regions
    /// (geometry `own`, at `own_bases`), for KV cache groups `groups`. Errs, naming what
    /// differs, where the two geometries cannot be copied between.
    pub fn new(
        own: &Geometry,
        own_bases: &[u64],
        groups: &[Vec<LayerId>],
        peer: &PeerInfo,
        src_all: &[u64],
    ) -> Result<LaunchPlan, TransferError> {
        let pg = &peer.geometry;
        let e = &peer.meta.engine_id;
        let (bp, bd) = (pg.shape().tokens as usize, own.shape().tokens as usize);
        if bp != bd {
            return Err(plan(format!(
                "backend cuda_ipc needs equal block sizes; producer engine '{e}' has {bp} tokens per block, \
                    this engine {bd}"
            )));
        }
        if bp == 0 {
            return Err(plan("a block size of 0 tokens".into()));
        }
        let perm = permute(pg, own)?;
        let cross = match (per_layer(pg), per_layer(own)) {
            (true, true) => false,
            (false, false) if perm == Permute::None && pg.layout() == own.layout() => true,
            _ => {
                return Err(plan(format!(
                    "backend cuda_ipc copies per-layer layouts (with an NHD/HND permute) or equal \
                        cross-layer layouts; producer engine '{e}' uses {} and this engine {}",
                    pg.layout(),
                    own.layout()
                )))
            }
        };
        let shape = own.shape();
        let (span_bytes, parts) = (shape.bytes() as u64, shape.kv_parts);
        let mut per_group = Vec::with_capacity(groups.len());
        for (g, layers) in groups.iter().enumerate() {
            let (mut src_bases, mut dst_bases) = (Vec::new(), Vec::new());
            // (peer region, own region) of the units, to bound-check block indices.
            let mut pairs = Vec::new();
            let mut block_bytes = span_bytes;
            if cross {
                // A group without layers copies nothing (no units).
                if let Some(&first) = layers.first() {
                    let (s, d) = (unit(pg, first, 0)?, unit(own, first, 0)?);
                    let (sr, dr) = (&pg.regions()[s.region], &own.regions()[d.region]);
                    block_bytes = (sr.layers.len() as u64) * parts as u64 * span_bytes;
                    if dr.layers != sr.layers {
                        return Err(plan(format!(
                            "producer engine '{e}' region of group {g} holds layers {:?}, this engine's {:?}",
                            sr.layers, dr.layers
                        )));
                    }
                    src_bases.push(base(src_all, s.region, 0, "producer")?);
                    dst_bases.push(base(own_bases, d.region, 0, "this engine's")?);
                    pairs.push((s.region, d.region));
                }
            } else {
                for &layer in layers {
                    for part in 0..parts {
                        let (s, d) = (unit(pg, layer, part)?, unit(own, layer, part)?);
                        src_bases.push(base(src_all, s.region, s.offset, "producer")?);
                        dst_bases.push(base(own_bases, d.region, d.offset, "this engine's")?);
                        pairs.push((s.region, d.region));
                    }
                }
            }
            per_group.push(GroupPlan {
                src_bases,
                dst_bases,
                block_bytes,
                src_blocks: fewest_blocks(pg, pairs.iter().map(|p| p.0)),
                dst_blocks: fewest_blocks(own, pairs.iter().map(|p| p.1)),
            });
        }
        Ok(LaunchPlan {
            generation: peer.generation,
            groups: groups.to_vec(),
            block_tokens: bp,
            permute: perm,
            per_group,
        })
    }

    /// Whether it plans gathers from `peer` for `groups`: made for that very handshake (a
    /// peer never numbered by a worker, generation 0, is planned at every load).
    pub fn fits(&self, peer: &PeerInfo, groups: &[Vec<LayerId>]) -> bool {
        self.generation != 0 && self.generation == peer.generation && self.groups == groups
    }
}

/// The device address of unit `offset` bytes into region `region` of `bases`.
fn base(bases: &[u64], region: usize, offset: u64, side: &str) -> Result<u64, TransferError> {
    bases.get(region).map(|b| b + offset).ok_or_else(|| {
        plan(format!("{side} region {region} has no opened base address ({} opened)", bases.len()))
    })
}

/// Base address, block stride (= copied bytes) and region shape index of one copy unit.
struct Unit {
    region: usize,
    offset: u64,
}

pub fn per_layer(g: &Geometry) -> bool {
    g.layout().position(Dim::B) > g.layout().position(Dim::L)
}

fn inner_order(g: &Geometry) -> Vec<Dim> {
    g.layout().order().into_iter().filter(|d| matches!(d, Dim::H | Dim::N | Dim::C)).collect()
}

/// The permute that turns the peer's block bytes into this engine's.
pub fn permute(peer: &Geometry, own: &Geometry) -> Result<Permute, TransferError> {
    let (p, o) = (inner_order(peer), inner_order(own));
    if p == o {
        return Ok(Permute::None);
    }
    let s = own.shape();
    let (heads, tokens) = (s.heads, s.tokens);
    let nhd = [Dim::N, Dim::H, Dim::C];
    let hnd = [Dim::H, Dim::N, Dim::C];
    if p == nhd && o == hnd {
        Ok(Permute::NhdToHnd { heads, tokens })
    } else if p == hnd && o == nhd {
        Ok(Permute::HndToNhd { heads, tokens })
    } else {
        Err(plan(format!(
            "backend cuda_ipc permutes NHD<->HND only; the peer's blocks are {} and this engine's {}",
            peer.layout(),
            own.layout()
        )))
    }
}

fn unit(g: &Geometry, layer: LayerId, part: u32) -> Result<Unit, TransferError> {
    let s = g.span(layer, part, BlockId(0))?;
    Ok(Unit { region: s.region, offset: s.offset as u64 })
}

/// The fewest blocks of `regions` of `g`: every block index of a launch over them must be
/// below it.
fn fewest_blocks(g: &Geometry, regions: impl Iterator<Item = usize>) -> u32 {
    regions.map(|r| g.regions().get(r).map_or(0, |r| r.num_blocks)).min().unwrap_or(0)
}

/// `b` as a block index of a region of `n` blocks, or an error naming `side`.
pub fn check_block(n: u32, b: BlockId, side: &str) -> Result<u32, TransferError> {
    if b.0 >= n {
        return Err(plan(format!("{side} block {} is outside its region of {n} blocks", b.0)));
    }
    Ok(b.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::handshake::sample_metadata;
    use crate::metadata::RegionInfo;
    use kvconnect_api::geometry::{BlockShape, RegionShape};
    use kvconnect_api::KvLayout;

    const SHAPE: BlockShape = BlockShape { heads: 2, tokens: 4, head_dim: 8, elem_size: 2, kv_parts: 2 };

    fn per_layer_regions(blocks: [u32; 2]) -> Vec<RegionShape> {
        vec![
            RegionShape { layers: vec![LayerId(0)], num_blocks: blocks[0] },
            RegionShape { layers: vec![LayerId(1)], num_blocks: blocks[1] },
        ]
    }

    /// A producer with one NHD region of 10 blocks per layer, from handshake `generation`.
    fn peer(generation: u64, tokens: u32) -> PeerInfo {
        let mut m = sample_metadata();
        m.shape = BlockShape { tokens, ..SHAPE };
        m.region_shapes = per_layer_regions([10, 10]);
        let g = Geometry::new(m.shape, KvLayout::NHD, vec![]);
        m.regions = m
            .region_shapes
            .iter()
            .enumerate()
            .map(|(i, r)| RegionInfo {
                name: format!("layer.{i}"),
                len: g.region_bytes(r) as u64,
                group: 0,
                shm_name: None,
            })
            .collect();
        let mut p = PeerInfo::from_metadata(m).unwrap();
        p.generation = generation;
        p
    }

    fn groups() -> Vec<Vec<LayerId>> {
        vec![vec![LayerId(0), LayerId(1)]]
    }

    #[test]
    fn each_layer_and_part_starts_at_its_region_base_and_blocks_are_bounded_by_the_smaller_region() {
        // This engine: HND, 10 and 12 blocks; a block of a part is 2 * 4 * 8 * 2 = 128 bytes,
        // so each V part starts 128 bytes times its region's blocks after the K part.
        let own = Geometry::new(SHAPE, KvLayout::HND, per_layer_regions([10, 12]));
        let p =
            LaunchPlan::new(&own, &[5_000_000, 6_000_000], &groups(), &peer(3, 4), &[1_000_000, 2_000_000])
                .unwrap();
        assert_eq!(p.block_tokens, 4);
        assert_eq!(p.permute, Permute::NhdToHnd { heads: 2, tokens: 4 });
        let [g] = &p.per_group[..] else { panic!("one group planned: {:?}", p.per_group) };
        assert_eq!(g.src_bases, [1_000_000, 1_001_280, 2_000_000, 2_001_280]);
        assert_eq!(g.dst_bases, [5_000_000, 5_001_280, 6_000_000, 6_001_536]);
        assert_eq!((g.block_bytes, g.src_blocks, g.dst_blocks), (128, 10, 10));
    }

    #[test]
    fn a_plan_is_kept_for_its_own_handshake_and_groups_only() {
        let own = Geometry::new(SHAPE, KvLayout::NHD, per_layer_regions([10, 10]));
        let p = LaunchPlan::new(&own, &[1, 2], &groups(), &peer(3, 4), &[3, 4]).unwrap();
        assert!(p.fits(&peer(3, 4), &groups()));
        assert!(!p.fits(&peer(4, 4), &groups()), "a later handshake is planned again");
        assert!(!p.fits(&peer(3, 4), &[vec![LayerId(0)], vec![LayerId(1)]]));
        let unnumbered = LaunchPlan::new(&own, &[1, 2], &groups(), &peer(0, 4), &[3, 4]).unwrap();
        assert!(
            !unnumbered.fits(&peer(0, 4), &groups()),
            "a peer no worker numbered is planned at every load"
        );
    }

    #[test]
    fn geometries_that_cannot_be_copied_between_are_refused_naming_the_difference() {
        let own = Geometry::new(SHAPE, KvLayout::NHD, per_layer_regions([10, 10]));
        let e = LaunchPlan::new(&own, &[1, 2], &groups(), &peer(3, 8), &[3, 4]).unwrap_err().to_string();
        assert!(
            e.contains(
                "needs equal block sizes; producer engine 'prefill-0' has 8 tokens per block, this engine 4"
            ),
            "{e}"
        );
        let e = LaunchPlan::new(&own, &[1], &groups(), &peer(3, 4), &[3, 4]).unwrap_err().to_string();
        assert!(e.contains("this engine's region 1 has no opened base address (1 opened)"), "{e}");
    }
}
