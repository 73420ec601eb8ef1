//! Which bytes go where: the runs of a pull, from the producer's regions (peer geometry) to
//! this engine's (own geometry), coalesced into contiguous runs.
//!
//! Two shapes of plan. **Direct**: both sides store a block's bytes identically (same H/N/C
//! order and block size), so a block span is copied whole and neighbouring blocks merge into
//! one memcpy or one socket read. **Adapt**: the layouts order H and N differently (NHD vs
//! HND) or the block sizes differ; each source block is scattered row by row (one head's
//! channels of one token) to where this engine's layout puts that row. This is the
//! receive-side application of the adaptation plan's layout permutation and block-size ratio.

use crate::error::TransferError;
use crate::meta::LoadSpec;
use crate::wire::WireRun;
use kvconnect_api::geometry::Geometry;
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{BlockId, Dim, LayerId};

/// One contiguous copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRun {
    /// Producer region index.
    pub src_region: u32,
    /// Offset in it.
    pub src_off: u64,
    /// Own region index.
    pub dst_region: u32,
    /// Offset in it.
    pub dst_off: u64,
    /// Bytes.
    pub len: u64,
}

/// One source block of an adapting plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrcBlock {
    /// Producer region index.
    pub src_region: u32,
    /// Offset in it.
    pub src_off: u64,
    /// Bytes (one block of one layer and K/V part).
    pub len: u64,
    layer: LayerId,
    part: u32,
    group: usize,
    pos: usize,
}

/// The copies of one pull.
#[derive(Debug, Clone)]
pub enum CopyPlan {
    /// Identical block bytes on both sides: contiguous runs, sorted by source.
    Direct(Vec<CopyRun>),
    /// Different H/N order or block size: whole source blocks, sorted by source, scattered.
    Adapt(Vec<SrcBlock>),
}

/// The order of H, N and C inside a block, as the bytes are: with one KV head the head axis
/// may sit anywhere, so it is placed where `KvLayout::normalized` puts it.
fn inner_order(g: &Geometry) -> Vec<Dim> {
    let layout = g.layout().normalized(g.shape().heads);
    layout.order().into_iter().filter(|d| matches!(d, Dim::H | Dim::N | Dim::C)).collect()
}

/// Whether every plan between these geometries must adapt on receive (H/N/C order as the
/// bytes are, or block shape, differ), whatever the request. A plan can also adapt for one request only: one whose
/// first token to load is not on a block boundary.
pub fn layouts_adapt(peer: &Geometry, own: &Geometry) -> bool {
    inner_order(peer) != inner_order(own) || peer.shape() != own.shape()
}

fn plan_err(msg: String) -> TransferError {
    TransferError::Plan(msg)
}

/// Positions in a block list covering tokens `[first, end)` with `bs` tokens per block.
fn positions(first: usize, end: usize, bs: usize) -> std::ops::Range<usize> {
    if end <= first {
        return 0..0;
    }
    first / bs..end.div_ceil(bs)
}

impl CopyPlan {
    /// Plans `load` from a producer with geometry `peer` into `own`, over the KV cache
    /// `groups` (layers per group; both sides have the same groups).
    pub fn build(
        peer: &Geometry,
        own: &Geometry,
        groups: &[Vec<LayerId>],
        load: &LoadSpec,
    ) -> Result<CopyPlan, TransferError> {
        let (bp, bd) = (peer.shape().tokens as usize, own.shape().tokens as usize);
        if bp == 0 || bd == 0 {
            return Err(plan_err("a block size of 0 tokens".into()));
        }
        if load.remote_blocks.0.len() != groups.len() || load.local_blocks.0.len() != groups.len() {
            return Err(plan_err(format!(
                "request {}: {} remote and {} local block lists for {} KV cache groups",
                load.request,
                load.remote_blocks.0.len(),
                load.local_blocks.0.len(),
                groups.len()
            )));
        }
        let (first, end) = (load.first_token, load.num_tokens);
        for (g, (r, l)) in load.remote_blocks.0.iter().zip(&load.local_blocks.0).enumerate() {
            let need_r = positions(first, end, bp).end;
            let need_l = positions(first, end, bd).end;
            if first < end && (r.len() < need_r || l.len() < need_l) {
                return Err(plan_err(format!(
                    "request {}: tokens {first}..{end} of group {g} need {need_r} producer blocks and {need_l} local blocks, got {} and {}",
                    load.request,
                    r.len(),
                    l.len()
                )));
            }
        }
        let parts = peer.shape().kv_parts;
        let direct = bp == bd && first % bp == 0 && !layouts_adapt(peer, own);
        if direct {
            let mut runs = Vec::new();
            for (g, layers) in groups.iter().enumerate() {
                let (r, l) = (&load.remote_blocks.0[g], &load.local_blocks.0[g]);
                for &layer in layers {
                    for part in 0..parts {
                        for pos in positions(first, end, bp) {
                            let s = peer.span(layer, part, r[pos])?;
                            let d = own.span(layer, part, l[pos])?;
                            runs.push(CopyRun {
                                src_region: s.region as u32,
                                src_off: s.offset as u64,
                                dst_region: d.region as u32,
                                dst_off: d.offset as u64,
                                len: s.len as u64,
                            });
                        }
                    }
                }
            }
            runs.sort_by_key(|r| (r.src_region, r.src_off));
            Ok(CopyPlan::Direct(coalesce(runs)))
        } else {
            let mut blocks = Vec::new();
            for (g, layers) in groups.iter().enumerate() {
                let r = &load.remote_blocks.0[g];
                for &layer in layers {
                    for part in 0..parts {
                        for pos in positions(first, end, bp) {
                            let s = peer.span(layer, part, r[pos])?;
                            blocks.push(SrcBlock {
                                src_region: s.region as u32,
                                src_off: s.offset as u64,
                                len: s.len as u64,
                                layer,
                                part,
                                group: g,
                                pos,
                            });
                        }
                    }
                }
            }
            blocks.sort_by_key(|b| (b.src_region, b.src_off));
            Ok(CopyPlan::Adapt(blocks))
        }
    }

    /// The source runs in stream order (what a tcp read asks for), coalesced.
    pub fn src_runs(&self) -> Vec<WireRun> {
        let mut out: Vec<WireRun> = Vec::new();
        let mut push = |region: u32, off: u64, len: u64| match out.last_mut() {
            Some(last) if last.0 == region && last.1 + last.2 == off => last.2 += len,
            _ => out.push((region, off, len)),
        };
        match self {
            CopyPlan::Direct(runs) => runs.iter().for_each(|r| push(r.src_region, r.src_off, r.len)),
            CopyPlan::Adapt(blocks) => blocks.iter().for_each(|b| push(b.src_region, b.src_off, b.len)),
        }
        out
    }

    /// Bytes read from the producer.
    pub fn total_bytes(&self) -> u64 {
        match self {
            CopyPlan::Direct(runs) => runs.iter().map(|r| r.len).sum(),
            CopyPlan::Adapt(blocks) => blocks.iter().map(|b| b.len).sum(),
        }
    }
}

fn coalesce(runs: Vec<CopyRun>) -> Vec<CopyRun> {
    let mut out: Vec<CopyRun> = Vec::with_capacity(runs.len());
    for r in runs {
        match out.last_mut() {
            Some(p)
                if p.src_region == r.src_region
                    && p.dst_region == r.dst_region
                    && p.src_off + p.len == r.src_off
                    && p.dst_off + p.len == r.dst_off =>
            {
                p.len += r.len
            }
            _ => out.push(r),
        }
    }
    out
}

/// Write access to this engine's registered regions for the receive path.
pub struct LocalRegions<'a> {
    mem: &'a KvMemory,
}

impl<'a> LocalRegions<'a> {
    /// Wraps registered memory.
    pub fn new(mem: &'a KvMemory) -> Self {
        LocalRegions { mem }
    }

    /// The geometry of the regions.
    pub fn geometry(&self) -> &Geometry {
        self.mem.geometry()
    }

    /// A writable view of `len` bytes at `off` in region `region`, bounds-checked.
    pub fn dst_mut(&mut self, region: u32, off: u64, len: u64) -> Result<&mut [u8], TransferError> {
        let (base, rlen) = self
            .mem
            .region_base(region as usize)
            .ok_or_else(|| plan_err(format!("no local region {region}")))?;
        let end = off.checked_add(len).filter(|e| *e <= rlen as u64);
        if end.is_none() {
            return Err(plan_err(format!(
                "{len} bytes at {off} do not fit local region {region} of {rlen} bytes"
            )));
        }
        // SAFETY: [base+off, base+off+len) lies inside a region the host registered as valid
        // for reads and writes while the connector lives (KvMemory's contract); the blocks are
        // allocated to a request being loaded, which the engine does not touch until the
        // load is reported finished; `&mut self` keeps at most one view alive.
        Ok(unsafe { std::slice::from_raw_parts_mut((base + off as usize) as *mut u8, len as usize) })
    }

    /// Copies a direct run's bytes into place.
    pub fn write_run(&mut self, run: &CopyRun, src: &[u8]) -> Result<(), TransferError> {
        let dst = self.dst_mut(run.dst_region, run.dst_off, run.len)?;
        if dst.len() != src.len() {
            return Err(plan_err(format!("run of {} bytes for a destination of {}", src.len(), dst.len())));
        }
        crate::stream_copy::copy_run(dst, src);
        Ok(())
    }

    /// Scatters one source block (the producer's bytes of `b`) into this engine's layout.
    pub fn scatter(
        &mut self,
        peer: &Geometry,
        load: &LoadSpec,
        b: &SrcBlock,
        src: &[u8],
    ) -> Result<(), TransferError> {
        let own = self.mem.geometry().clone();
        let (ps, os) = (peer.shape(), own.shape());
        let (bp, bd) = (ps.tokens as usize, os.tokens as usize);
        if src.len() as u64 != b.len {
            return Err(plan_err(format!("source block of {} bytes, expected {}", src.len(), b.len)));
        }
        let local = &load.local_blocks.0[b.group];
        let start = load.first_token.max(b.pos * bp);
        let stop = load.num_tokens.min((b.pos + 1) * bp);
        let elem = ps.elem_size as usize;
        let c_inner = peer.layout().order()[4] == Dim::C && own.layout().order()[4] == Dim::C;
        let row = if c_inner { ps.head_dim as usize * elem } else { elem };
        let channels = if c_inner { 1 } else { ps.head_dim };
        let mut current: Option<(BlockId, kvconnect_api::geometry::Span)> = None;
        for t in start..stop {
            let (sp, sd) = ((t - b.pos * bp) as u32, (t % bd) as u32);
            let lb = *local
                .get(t / bd)
                .ok_or_else(|| plan_err(format!("request {}: no local block for token {t}", load.request)))?;
            let span = match current {
                Some((id, s)) if id == lb => s,
                _ => {
                    let s = own.span(b.layer, b.part, lb)?;
                    current = Some((lb, s));
                    s
                }
            };
            let dst = self.dst_mut(span.region as u32, span.offset as u64, span.len as u64)?;
            for h in 0..ps.heads {
                for c in 0..channels {
                    let so = peer.inner_offset(h, sp, c);
                    let d = own.inner_offset(h, sd, c);
                    let (s_end, d_end) = (so + row, d + row);
                    if s_end > src.len() || d_end > dst.len() {
                        return Err(plan_err("row outside its block (geometry mismatch)".into()));
                    }
                    dst[d..d_end].copy_from_slice(&src[so..s_end]);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::geometry::{BlockShape, RegionShape};
    use kvconnect_api::{BlocksPerGroup, KvLayout};

    fn geo(layout: KvLayout, tokens: u32) -> Geometry {
        geo_heads(layout, tokens, 2)
    }

    fn geo_heads(layout: KvLayout, tokens: u32, heads: u32) -> Geometry {
        let shape = BlockShape { heads, tokens, head_dim: 4, elem_size: 2, kv_parts: 2 };
        Geometry::new(
            shape,
            layout,
            vec![
                RegionShape { layers: vec![LayerId(0)], num_blocks: 8 },
                RegionShape { layers: vec![LayerId(1)], num_blocks: 8 },
            ],
        )
    }

    fn load(remote: Vec<u32>, local: Vec<u32>, first: usize, n: usize) -> LoadSpec {
        LoadSpec {
            request: "r".into(),
            remote_request: None,
            remote_engine_id: "p".into(),
            remote_capability: String::new(),
            remote_side_channel: String::new(),
            remote_blocks: BlocksPerGroup(vec![remote.into_iter().map(BlockId).collect()]),
            local_blocks: BlocksPerGroup(vec![local.into_iter().map(BlockId).collect()]),
            first_token: first,
            num_tokens: n,
        }
    }

    #[test]
    fn contiguous_blocks_coalesce_into_one_run_per_layer_part() {
        let g = geo(KvLayout::HND, 4);
        let groups = vec![vec![LayerId(0), LayerId(1)]];
        let p = CopyPlan::build(&g, &g, &groups, &load(vec![2, 3, 4], vec![5, 6, 7], 0, 10)).unwrap();
        let CopyPlan::Direct(runs) = &p else { panic!("expected direct") };
        // per layer region: K blocks 2..5 and V blocks 2..5 are two runs (V follows K's 8 blocks)
        assert_eq!(runs.len(), 4);
        assert!(runs.iter().all(|r| r.len == 3 * 64));
        assert_eq!(p.total_bytes(), 4 * 3 * 64);
        let p = CopyPlan::build(&g, &g, &groups, &load(vec![2, 4, 3], vec![5, 6, 7], 0, 10)).unwrap();
        let CopyPlan::Direct(runs) = &p else { panic!("expected direct") };
        assert_eq!(runs.len(), 12, "non-contiguous source blocks stay separate");
    }

    #[test]
    fn too_few_blocks_is_a_plan_error() {
        let g = geo(KvLayout::HND, 4);
        let e =
            CopyPlan::build(&g, &g, &[vec![LayerId(0), LayerId(1)]], &load(vec![1], vec![1, 2, 3], 0, 10))
                .unwrap_err();
        assert!(e.to_string().contains("need 3 producer blocks"), "{e}");
    }

    #[test]
    fn layouts_adapt_on_order_or_block_size_only() {
        let hnd4 = geo(KvLayout::HND, 4);
        assert!(!layouts_adapt(&hnd4, &hnd4));
        assert!(layouts_adapt(&geo(KvLayout::NHD, 4), &hnd4));
        assert!(layouts_adapt(&geo(KvLayout::HND, 8), &hnd4));
        // One KV head: NHD and HND blocks are the same bytes, copied as they are.
        let (nhd1, hnd1) = (geo_heads(KvLayout::NHD, 4, 1), geo_heads(KvLayout::HND, 4, 1));
        assert!(!layouts_adapt(&nhd1, &hnd1));
        let groups = vec![vec![LayerId(0), LayerId(1)]];
        let p = CopyPlan::build(&nhd1, &hnd1, &groups, &load(vec![1, 2], vec![3, 4], 0, 8)).unwrap();
        assert!(matches!(p, CopyPlan::Direct(_)), "{p:?}");
    }

    #[test]
    fn different_layout_or_block_size_adapts() {
        let groups = vec![vec![LayerId(0), LayerId(1)]];
        let p = CopyPlan::build(
            &geo(KvLayout::NHD, 4),
            &geo(KvLayout::HND, 4),
            &groups,
            &load(vec![1], vec![1], 0, 4),
        )
        .unwrap();
        assert!(matches!(p, CopyPlan::Adapt(ref b) if b.len() == 4));
        let p = CopyPlan::build(
            &geo(KvLayout::HND, 8),
            &geo(KvLayout::HND, 4),
            &groups,
            &load(vec![1], vec![1, 2], 0, 8),
        )
        .unwrap();
        assert!(matches!(p, CopyPlan::Adapt(_)));
    }
}
