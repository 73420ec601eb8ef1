//! Which bytes go where: the runs of a pull, from the producer's regions (peer geometry) to
//! this engine's (own geometry), coalesced into contiguous runs.
//!
//! Two shapes of plan. **Direct**: both sides store a block's bytes identically (same H/N/C
//! order and block size), so a block span is copied whole and neighbouring blocks merge into
//! one memcpy or one socket read. **Adapt**: the layouts order H and N differently (NHD vs
//! HND) or the block sizes differ; each source block is scattered row by row (one head's
//! channels of one token) to where this engine's layout puts that row. This is the
//! receive-side application of the adaptation plan's layout permutation and block-size ratio.

#![allow(unsafe_code)] // Slices of the registered KV regions the host vouched for.

use crate::error::TransferError;
use crate::metadata::LoadSpec;
use crate::wire::WireRun;
use kvconnect_api::geometry::{BlockShape, Geometry, Span};
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

impl CopyRun {
    /// The copy of source span `s` to destination span `d` (of the same length).
    fn between(s: Span, d: Span) -> CopyRun {
        CopyRun {
            src_region: s.region as u32,
            src_off: s.offset as u64,
            dst_region: d.region as u32,
            dst_off: d.offset as u64,
            len: s.len as u64,
        }
    }
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
    let layout = g.layout().normalized(g.total_heads());
    layout.order().into_iter().filter(|d| matches!(d, Dim::H | Dim::N | Dim::C)).collect()
}

/// Whether every plan between these geometries must adapt on receive (H/N/C order as the
/// bytes are, or block shape, differ), whatever the request. A plan can also adapt for one request
/// only: one whose first token to load is not on a block boundary.
pub fn layouts_adapt(peer: &Geometry, own: &Geometry) -> bool {
    // Compared over all tensor-parallel ranks: how the heads are split is not adapting.
    let whole = |g: &Geometry| BlockShape { heads: g.total_heads(), ..g.shape() };
    inner_order(peer) != inner_order(own)
        || whole(peer) != whole(own)
        || peer.opaque_blocks() != own.opaque_blocks()
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

/// The producer blocks a load reads, one list per KV cache group (a state group's one state
/// slot): what a consumer that copies without the producer seeing the reads asks it to
/// confirm are the request's (`pin`). Block ids, not byte runs: a load of
/// scattered blocks is one run per block, layer and part, many times its block count.
pub fn read_blocks(peer: &Geometry, groups: &[Vec<LayerId>], load: &LoadSpec) -> Vec<Vec<BlockId>> {
    let bs = (peer.shape().tokens as usize).max(1);
    let (first, end) = (load.first_token, load.num_tokens);
    load.remote_blocks
        .0
        .iter()
        .enumerate()
        .map(|(g, ids)| {
            let wanted = if end <= first {
                0..0
            } else if groups.get(g).is_some_and(|layers| is_state_group(peer, layers)) {
                0..1
            } else {
                positions(first, end, bs)
            };
            ids.get(wanted.start..wanted.end.min(ids.len())).unwrap_or_default().to_vec()
        })
        .collect()
}

/// True for a state group (its layers keep per-request state in state slots, not KV blocks).
fn is_state_group(own: &Geometry, layers: &[LayerId]) -> bool {
    layers.first().is_some_and(|l| own.state().holds(*l))
}

/// The copies of a load's per-request state: for every state group, the request's one slot
/// in each of its layers, from the producer's slot to this engine's. None when the load
/// moves no tokens.
fn state_runs(
    peer: &Geometry,
    own: &Geometry,
    groups: &[Vec<LayerId>],
    load: &LoadSpec,
) -> Result<Vec<CopyRun>, TransferError> {
    let mut runs = Vec::new();
    if load.num_tokens <= load.first_token {
        return Ok(runs);
    }
    for (g, layers) in groups.iter().enumerate() {
        if !is_state_group(own, layers) {
            continue;
        }
        let (Some(&r), Some(&l)) = (load.remote_blocks.0[g].first(), load.local_blocks.0[g].first()) else {
            return Err(plan_err(format!(
                "request {}: state group {g} needs one producer and one local state slot, got {} and {}",
                load.request,
                load.remote_blocks.0[g].len(),
                load.local_blocks.0[g].len()
            )));
        };
        for &layer in layers {
            let (s, d) = (peer.state().span(layer, r)?, own.state().span(layer, l)?);
            if s.len != d.len {
                return Err(plan_err(format!(
                    "request {}: layer {layer} keeps {} bytes of state on the producer and {} here",
                    load.request, s.len, d.len
                )));
            }
            runs.push(CopyRun::between(s, d));
        }
    }
    Ok(runs)
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
        let across = across_ranks_needed(peer, own);
        if across && (!peer.state().is_empty() || !own.state().is_empty()) {
            return Err(TransferError::NotImplemented(format!(
                "request {}: moving per-request state across tensor-parallel ranks (producer {} rank(s), \
                    this engine {}) is not built; run a model with state layers at TP 1 on both sides",
                load.request,
                peer.tp_ranks(),
                own.tp_ranks()
            )));
        }
        let state = state_runs(peer, own, groups, load)?;
        for (g, (r, l)) in load.remote_blocks.0.iter().zip(&load.local_blocks.0).enumerate() {
            if is_state_group(own, &groups[g]) {
                continue;
            }
            let need_r = positions(first, end, bp).end;
            let need_l = positions(first, end, bd).end;
            if first < end && (r.len() < need_r || l.len() < need_l) {
                return Err(plan_err(format!(
                    "request {}: tokens {first}..{end} of group {g} need {need_r} producer blocks and \
                        {need_l} local blocks, got {} and {}",
                    load.request,
                    r.len(),
                    l.len()
                )));
            }
        }
        let parts = peer.shape().kv_parts;
        let direct = bp == bd && first % bp == 0 && !layouts_adapt(peer, own);
        // One rank on each side, the same one of the same TP size: its blocks as they are.
        let (pr, or) = (peer.held_ranks().start, own.held_ranks().start);
        if across {
            if !direct {
                return Err(TransferError::NotImplemented(format!(
                    "request {}: loading tokens {first}..{end} across tensor-parallel ranks (producer {} \
                        rank(s), this engine {}) while adapting blocks (producer {} blocks of {bp} tokens, \
                        this engine {} of {bd}, or a load not starting on a block boundary); across ranks \
                        use the same layout and block size on both sides",
                    load.request,
                    peer.tp_ranks(),
                    own.tp_ranks(),
                    peer.layout().display_name(),
                    own.layout().display_name(),
                )));
            }
            return Ok(CopyPlan::Direct(coalesce(across_ranks(peer, own, groups, load)?)));
        }
        if !direct && (peer.opaque_blocks() || own.opaque_blocks()) {
            return Err(plan_err(format!(
                "request {}: loading tokens {first}..{end} would adapt blocks (producer {} blocks of {bp} \
                    tokens, this engine {} of {bd}), but opaque blocks move whole only: same block size and \
                    engine backend on both sides, loads starting on a block boundary",
                load.request,
                if peer.opaque_blocks() { "opaque" } else { "known-layout" },
                if own.opaque_blocks() { "opaque" } else { "known-layout" },
            )));
        }
        if !direct && !state.is_empty() {
            return Err(TransferError::NotImplemented(format!(
                "request {}: loading tokens {first}..{end} adapts blocks (producer blocks of {bp} tokens, \
                    this engine's of {bd}, or another H/N order), and moving per-request state beside \
                    adapted blocks is not built; use the same layout and block size on both sides of a model \
                    with state layers",
                load.request
            )));
        }
        if direct {
            let mut runs = state;
            for (g, layers) in groups.iter().enumerate() {
                if is_state_group(own, layers) {
                    continue;
                }
                let (r, l) = (&load.remote_blocks.0[g], &load.local_blocks.0[g]);
                for &layer in layers {
                    for part in 0..parts {
                        let (ps, os) =
                            (peer.layer_spans(pr, layer, part)?, own.layer_spans(or, layer, part)?);
                        for pos in positions(first, end, bp) {
                            let run = CopyRun::between(ps.span(r[pos])?, os.span(l[pos])?);
                            // Merged with the last where it continues it on both sides (the
                            // result after sorting and coalescing is the same, on fewer runs).
                            match runs.last_mut() {
                                Some(p) if continues(p, &run) => p.len += run.len,
                                _ => runs.push(run),
                            }
                        }
                    }
                }
            }
            sort_by_source(&mut runs);
            Ok(CopyPlan::Direct(coalesce(runs)))
        } else {
            let mut blocks = Vec::new();
            for (g, layers) in groups.iter().enumerate() {
                if is_state_group(own, layers) {
                    continue;
                }
                let r = &load.remote_blocks.0[g];
                for &layer in layers {
                    for part in 0..parts {
                        let ps = peer.layer_spans(pr, layer, part)?;
                        for pos in positions(first, end, bp) {
                            let s = ps.span(r[pos])?;
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
            blocks.sort_unstable_by_key(|b| (b.src_region, b.src_off));
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

/// Whether a load between these geometries moves head slices between ranks: either side
/// holds several ranks, the TP sizes differ, or the two hold different ranks. A load
/// between one rank of each side, the same rank of the same TP size (vLLM's workers at
/// equal TP sizes), copies its blocks as they are.
fn across_ranks_needed(peer: &Geometry, own: &Geometry) -> bool {
    peer.tp_ranks() != 1
        || own.tp_ranks() != 1
        || peer.tp_size() != own.tp_size()
        || peer.held_ranks() != own.held_ranks()
}

/// The runs of a load between engines whose KV heads are split across tensor-parallel
/// ranks, the same layout and block size on both sides. Global head `h` lives in rank
/// `h / heads` of each side; every slice of `min(producer heads, own heads)` heads lies in
/// one rank on each side, so each of this engine's ranks reads its heads from the producer
/// ranks holding them. Only the ranks each side holds are planned: an engine holding one
/// rank of several (vLLM's workers) reads its slice from a producer rank, and a producer
/// geometry of one rank of several yields just the slices that rank holds. A head slice is
/// one run per block part with heads outermost (HND), one run per block for opaque blocks
/// whose heads are outermost (vLLM's CPU backend), one run per token and part for NHD.
fn across_ranks(
    peer: &Geometry,
    own: &Geometry,
    groups: &[Vec<LayerId>],
    load: &LoadSpec,
) -> Result<Vec<CopyRun>, TransferError> {
    let (hp, ho) = (peer.shape().heads, own.shape().heads);
    if peer.total_heads() != own.total_heads() || hp == 0 || ho == 0 {
        return Err(plan_err(format!(
            "request {}: the producer holds {} KV heads over {} rank(s), this engine {} over {}: both must \
                hold the same model's heads",
            load.request,
            peer.total_heads(),
            peer.tp_ranks(),
            own.total_heads(),
            own.tp_ranks()
        )));
    }
    let slice = hp.min(ho);
    let sliced = |e: kvconnect_api::geometry::GeometryError| match e {
        kvconnect_api::geometry::GeometryError::HeadsNotSliceable { .. } => {
            TransferError::NotImplemented(format!(
            "request {}: moving KV between tensor-parallel ranks (producer rank(s) {:?} of {}, this engine's \
                {:?} of {}): {e}",
            load.request,
            peer.held_ranks(),
            peer.tp_size(),
            own.held_ranks(),
            own.tp_size()
        ))
        }
        other => TransferError::from(other),
    };
    let bs = peer.shape().tokens as usize;
    let mut runs = Vec::new();
    // Each group's positions in the order of their producer blocks, so that a piece taken
    // through them reads ascending addresses (a request's blocks come in any order).
    let by_block: Vec<Vec<usize>> = load
        .remote_blocks
        .0
        .iter()
        .map(|r| {
            let mut p: Vec<usize> = positions(load.first_token, load.num_tokens, bs).collect();
            p.sort_by_key(|&pos| r[pos]);
            p
        })
        .collect();
    // Head slice (so producer rank) outermost, then layer, then piece, then block: where a
    // rank's regions hold its layers in order (one region per layer, or the layers one after
    // another) the runs come out sorted by source and the sort below is one pass.
    for first_head in (0..peer.total_heads()).step_by(slice as usize) {
        let (pr, ph) = (first_head / hp, first_head % hp);
        let (or, oh) = (first_head / ho, first_head % ho);
        if !peer.held_ranks().contains(&pr) || !own.held_ranks().contains(&or) {
            continue;
        }
        for (g, layers) in groups.iter().enumerate() {
            let (r, l) = (&load.remote_blocks.0[g], &load.local_blocks.0[g]);
            for &layer in layers {
                // Where the slice lies in any block, once per layer; per block, arithmetic.
                let src: Vec<_> = peer.head_slice(pr, layer, ph, slice).map_err(sliced)?.pieces().collect();
                let dst: Vec<_> = own.head_slice(or, layer, oh, slice).map_err(sliced)?.pieces().collect();
                if src.len() != dst.len() || src.iter().zip(&dst).any(|(a, b)| a.2 != b.2) {
                    return Err(plan_err(format!(
                        "request {}: a slice of {slice} KV heads is {} run(s) on the producer and {} \
                            here: both sides must use the same layout",
                        load.request,
                        src.len(),
                        dst.len()
                    )));
                }
                for (&(sb, so, len), &(db, dof, _)) in src.iter().zip(&dst) {
                    for &pos in &by_block[g] {
                        let (s, d) = (sb.span(r[pos]).map_err(sliced)?, db.span(l[pos]).map_err(sliced)?);
                        runs.push(CopyRun::between(
                            Span { region: s.region, offset: s.offset + so, len },
                            Span { region: d.region, offset: d.offset + dof, len },
                        ));
                    }
                }
            }
        }
    }
    if runs.is_empty() && load.num_tokens > load.first_token {
        return Err(plan_err(format!(
            "request {}: the producer holds rank(s) {:?} of {} and this engine rank(s) {:?} of {}: none of \
                this engine's KV heads are the producer's, so the load names the wrong producer rank",
            load.request,
            peer.held_ranks(),
            peer.tp_size(),
            own.held_ranks(),
            own.tp_size()
        )));
    }
    sort_by_source(&mut runs);
    Ok(runs)
}

/// Sorts runs by where they read: nothing to do for runs built in that order, one pass to
/// see it; otherwise a stable sort, which merges the stretches already in order rather than
/// sorting tens of thousands of runs from scratch.
fn sort_by_source(runs: &mut [CopyRun]) {
    let key = |r: &CopyRun| (r.src_region, r.src_off);
    if !runs.is_sorted_by_key(key) {
        runs.sort_by_key(key);
    }
}

fn coalesce(runs: Vec<CopyRun>) -> Vec<CopyRun> {
    let mut out: Vec<CopyRun> = Vec::with_capacity(runs.len());
    for r in runs {
        match out.last_mut() {
            Some(p) if continues(p, &r) => p.len += r.len,
            _ => out.push(r),
        }
    }
    out
}

/// Whether run `r` starts where `p` ends, in the same regions on both sides.
fn continues(p: &CopyRun, r: &CopyRun) -> bool {
    p.src_region == r.src_region
        && p.dst_region == r.dst_region
        && p.src_off + p.len == r.src_off
        && p.dst_off + p.len == r.dst_off
}

/// Below this many bytes a pull is copied by one thread: starting threads costs more than it
/// saves.
pub const PARALLEL_MIN_BYTES: usize = 8 << 20;

/// The copy threads a pull uses unless `copy_threads` says otherwise: the cores this process
/// may run on, at most 8 (memory bandwidth, not cores, bounds a copy beyond that).
pub fn default_copy_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(8)
}

/// The threads a copy of `bytes` bytes runs on when it may use `threads`: one per
/// [`PARALLEL_MIN_BYTES`] at the most, at least one.
pub fn copy_threads_for(bytes: usize, threads: usize) -> usize {
    threads.clamp(1, (bytes / PARALLEL_MIN_BYTES).max(1))
}

/// Cuts `pieces` into consecutive shares of about `share` bytes each (`len` of a piece),
/// cutting a piece where a share ends (`cut(piece, n)`: its first `n` bytes and the rest).
fn split_shares<T>(
    pieces: impl IntoIterator<Item = T>,
    share: usize,
    len: impl Fn(&T) -> usize,
    cut: impl Fn(T, usize) -> (T, T),
) -> Vec<Vec<T>> {
    let share = share.max(1);
    let mut out: Vec<Vec<T>> = vec![Vec::new()];
    let mut room = share;
    for mut piece in pieces {
        while len(&piece) > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = share;
            }
            let n = len(&piece).min(room);
            let (now, later) = cut(piece, n);
            if let Some(last) = out.last_mut() {
                last.push(now);
            }
            piece = later;
            room -= n;
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

/// Where each share of about `share` bytes of `runs` starts: the run, and the byte in it. A
/// share runs to where the next starts (the last to the end), so the shares are consecutive
/// and cover every byte once; `runs` itself is not copied.
fn share_starts(runs: &[CopyRun], share: u64) -> Vec<(usize, u64)> {
    let share = share.max(1);
    let mut starts = vec![(0, 0)];
    let mut room = share;
    for (i, r) in runs.iter().enumerate() {
        let mut at = 0;
        while r.len - at > room {
            at += room;
            starts.push((i, at));
            room = share;
        }
        room -= r.len - at;
        if room == 0 && i + 1 < runs.len() {
            starts.push((i + 1, 0));
            room = share;
        }
    }
    starts
}

/// Cuts direct runs into at most `parts` consecutive shares of about equal bytes (the
/// streams of one tcp pull), splitting a run where a share ends; the shares, concatenated,
/// are `runs` in order.
pub fn split_runs(runs: &[CopyRun], parts: usize) -> Vec<Vec<CopyRun>> {
    let total: u64 = runs.iter().map(|r| r.len).sum();
    let share = total.div_ceil(parts.max(1) as u64).max(1);
    split_shares(
        runs.iter().copied(),
        usize::try_from(share).unwrap_or(usize::MAX),
        |r| r.len as usize,
        |r, n| {
            let n = n as u64;
            let now = CopyRun { len: n, ..r };
            let later = CopyRun { src_off: r.src_off + n, dst_off: r.dst_off + n, len: r.len - n, ..r };
            (now, later)
        },
    )
}

/// Write access to this engine's registered regions for the receive path. `KvMemory`'s safe
/// API copies in and out (`write` is one plain memcpy per call) and hands out no writable
/// view; the receive path needs views that sockets receive straight into and runs copied
/// with streaming stores on several threads, so it makes them here, each bounds-checked
/// against the registered region by [`LocalRegions::dst_mut`] and kept exclusive by
/// `&mut self`.
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

    /// Refuses runs whose destinations share a byte ([`crate::overlap`]). Their bounds are
    /// checked already.
    fn refuse_overlap<'r>(
        &self,
        runs: impl Iterator<Item = &'r CopyRun> + Clone,
    ) -> Result<(), TransferError> {
        crate::overlap::refuse_overlap(runs.map(|r| (r.dst_region, r.dst_off, r.len)), |i| {
            self.mem.region_base(i)
        })
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

    /// Copies direct runs into place, reading each run's bytes from `src`, and splitting the
    /// bytes evenly over up to `threads` threads when there are at least
    /// [`PARALLEL_MIN_BYTES`] of them. Before any byte is written, every run is checked: its
    /// source is as long as it, its destination lies inside a registered region, and no two
    /// destinations share a byte (a plan never writes a byte twice; one that would is refused).
    /// A pull across TP sizes is tens of thousands of runs: the checks are one pass each, and
    /// nothing per run is allocated.
    pub fn write_runs<'s>(
        &mut self,
        runs: &[CopyRun],
        src: impl Fn(&CopyRun) -> Result<&'s [u8], TransferError> + Sync,
        threads: usize,
    ) -> Result<(), TransferError> {
        let t0 = std::time::Instant::now();
        let mut total = 0usize;
        for run in runs {
            let s = src(run)?;
            if s.len() as u64 != run.len {
                return Err(plan_err(format!("run of {} bytes for a destination of {}", s.len(), run.len)));
            }
            self.dst_mut(run.dst_region, run.dst_off, run.len)?;
            total += s.len();
        }
        self.refuse_overlap(runs.iter())?;
        let threads = copy_threads_for(total, threads);
        let starts = share_starts(runs, total.div_ceil(threads) as u64);
        // A large pull is one large copy however many runs it has (a load across TP sizes is
        // a half-block per run): streaming stores for all of its pieces, each thread's fenced
        // once when its share ends (before the join), not only for runs that are large alone.
        let stream = total >= kvconnect_support::stream_copy::STREAM_THRESHOLD;
        let mem = self.mem;
        let copy = |share: usize| -> Result<(), TransferError> {
            let (first, from) = starts[share];
            let (last, to) = starts.get(share + 1).copied().unwrap_or((runs.len(), 0));
            let mut batch = kvconnect_support::stream_copy::Batch::new();
            for (i, run) in runs.iter().enumerate().take(last + 1).skip(first) {
                let lo = if i == first { from } else { 0 };
                let hi = if i == last { to } else { run.len };
                if hi <= lo {
                    continue;
                }
                // The source was as long as the run when checked; a function that answers
                // otherwise now fails the copy rather than the process.
                let bytes = src(run)?.get(lo as usize..hi as usize).ok_or_else(|| {
                    plan_err(format!(
                        "the source of a run of {} bytes changed length during the copy",
                        run.len
                    ))
                })?;
                let (base, _) = mem
                    .region_base(run.dst_region as usize)
                    .ok_or_else(|| plan_err(format!("no local region {}", run.dst_region)))?;
                let at = base + (run.dst_off + lo) as usize;
                // SAFETY: each destination lies inside a registered region (checked by
                // `dst_mut` above), no two overlap (checked above; the shares cut runs into
                // disjoint parts), and `&mut self` is held until every thread has joined, so
                // these are the only views of those bytes.
                let dst = unsafe { std::slice::from_raw_parts_mut(at as *mut u8, bytes.len()) };
                if stream {
                    batch.copy(dst, bytes);
                } else {
                    dst.copy_from_slice(bytes);
                }
            }
            Ok(())
        };
        let prepared = t0.elapsed();
        let copied = match starts.len() {
            _ if total == 0 => Ok(()),
            1 => copy(0),
            n => std::thread::scope(|s| {
                let others: Vec<_> = (1..n).map(|k| s.spawn(move || copy(k))).collect();
                let mut r = copy(0);
                for t in others {
                    let done = t.join().unwrap_or_else(|_| Err(plan_err("a copy thread panicked".into())));
                    r = r.and(done);
                }
                r
            }),
        };
        // Where a large copy's time goes (KVCONNECT_LOG=kvconnect_nixl=debug).
        tracing::debug!(
            runs = runs.len(),
            bytes = total,
            threads = starts.len(),
            prepare_us = prepared.as_micros() as u64,
            copy_us = (t0.elapsed() - prepared).as_micros() as u64,
            "copy: runs written"
        );
        copied
    }

    /// Writable views of the destinations of `shares` (direct runs, each share one stream's),
    /// bounds-checked, all at once: runs whose destinations overlap are refused before any
    /// view is handed out, so each share can be received on its own thread.
    pub fn views(&mut self, shares: &[Vec<CopyRun>]) -> Result<Vec<Vec<&mut [u8]>>, TransferError> {
        let mut addrs = Vec::with_capacity(shares.len());
        for share in shares {
            let mut v = Vec::with_capacity(share.len());
            for r in share {
                let dst = self.dst_mut(r.dst_region, r.dst_off, r.len)?;
                v.push((dst.as_mut_ptr() as usize, dst.len()));
            }
            addrs.push(v);
        }
        self.refuse_overlap(shares.iter().flatten())?;
        let views = addrs
            .into_iter()
            .map(|share| {
                share
                    .into_iter()
                    .map(|(a, n)| {
                        // SAFETY: each destination lies inside a registered region (checked by
                        // `dst_mut` above), no two overlap (checked above), and the views
                        // borrow `self` mutably for their whole life, so no other view of
                        // these bytes can be made while they live.
                        unsafe { std::slice::from_raw_parts_mut(a as *mut u8, n) }
                    })
                    .collect()
            })
            .collect();
        Ok(views)
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
    use kvconnect_api::geometry::RegionShape;
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
            reader: None,
            sources: 1,
            sync: false,
        }
    }

    /// Two layers over `ranks` ranks holding 4 KV heads between them, HND.
    fn ranked(ranks: u32, layout: KvLayout) -> Geometry {
        let shape = BlockShape { heads: 4 / ranks, tokens: 4, head_dim: 2, elem_size: 2, kv_parts: 2 };
        let per_rank = [0, 1].map(|l| RegionShape { layers: vec![LayerId(l)], num_blocks: 8 });
        let regions = (0..ranks).flat_map(|_| per_rank.clone()).collect();
        Geometry::new(shape, layout, regions).with_tp_ranks(ranks).unwrap()
    }

    /// An element of a block: (layer, part, block position, global head, token, channel).
    type Element = (u32, u32, usize, u32, u32, u32);

    /// Every element of the blocks `blocks` in `g`'s regions, named by what it is: (layer,
    /// part, block position, global head, token, channel) -> (region, byte offset).
    fn elements(g: &Geometry, blocks: &[u32]) -> Vec<(Element, (usize, usize))> {
        let s = g.shape();
        let mut out = Vec::new();
        for layer in 0..2 {
            for part in 0..2 {
                for (pos, b) in blocks.iter().enumerate() {
                    for head in 0..g.total_heads() {
                        let span = g.rank_span(head / s.heads, LayerId(layer), part, BlockId(*b)).unwrap();
                        for t in 0..s.tokens {
                            for c in 0..s.head_dim {
                                let at = span.offset + g.inner_offset(head % s.heads, t, c);
                                out.push(((layer, part, pos, head, t, c), (span.region, at)));
                            }
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn each_rank_reads_its_heads_from_the_producer_ranks_that_hold_them() {
        // The blocks in either order on each side: the runs come out sorted by source anyway.
        let orders = [(vec![3, 5], vec![6, 1]), (vec![5, 3], vec![1, 6]), (vec![7, 0], vec![2, 4])];
        for ((p, d), (remote, local)) in [(2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (1, 4)]
            .into_iter()
            .flat_map(|pd| orders.iter().cloned().map(move |o| (pd, o)))
        {
            let (peer, own) = (ranked(p, KvLayout::HND), ranked(d, KvLayout::HND));
            let plan = CopyPlan::build(
                &peer,
                &own,
                &[vec![LayerId(0), LayerId(1)]],
                &load(remote.clone(), local.clone(), 0, 8),
            )
            .unwrap();
            let CopyPlan::Direct(runs) = &plan else { panic!("{p}->{d}: {plan:?}") };
            assert!(runs.is_sorted_by_key(|r| (r.src_region, r.src_off)), "{p}->{d}: {runs:?}");
            // Producer regions filled with each element's own name; copy the runs as a pull would.
            let region_len = peer.region_bytes(&peer.regions()[0]);
            let mut src = vec![vec![0u8; region_len]; peer.regions().len()];
            for (i, (_, (r, at))) in elements(&peer, &remote).into_iter().enumerate() {
                src[r][at..at + 2].copy_from_slice(&(i as u16 + 1).to_le_bytes());
            }
            let mut dst = vec![vec![0u8; own.region_bytes(&own.regions()[0])]; own.regions().len()];
            for r in runs {
                let (so, dof, n) = (r.src_off as usize, r.dst_off as usize, r.len as usize);
                dst[r.dst_region as usize][dof..dof + n]
                    .copy_from_slice(&src[r.src_region as usize][so..so + n]);
            }
            let want = elements(&peer, &remote);
            for ((name, (r, at)), (wname, _)) in elements(&own, &local).into_iter().zip(&want) {
                assert_eq!(name, *wname);
                let i = want.iter().position(|(n, _)| *n == name).unwrap();
                assert_eq!(&dst[r][at..at + 2], &(i as u16 + 1).to_le_bytes(), "{p}->{d}: {name:?}");
            }
            assert_eq!(plan.total_bytes() as usize, 2 * 2 * 2 * peer.total_heads() as usize * 4 * 2 * 2);
        }
    }

    #[test]
    fn across_ranks_an_adapting_or_head_interleaved_plan_is_not_built() {
        let refusal = |peer: &Geometry, own: &Geometry| {
            let groups = [vec![LayerId(0), LayerId(1)]];
            CopyPlan::build(peer, own, &groups, &load(vec![0], vec![0], 0, 4)).unwrap_err().to_string()
        };
        let e = refusal(&ranked(2, KvLayout::HND), &ranked(1, KvLayout::NHD));
        assert!(
            e.starts_with(
                "not implemented: request r: loading tokens 0..4 across tensor-parallel ranks \
                 (producer 2 rank(s), this engine 1)"
            ),
            "{e}"
        );
        // Opaque blocks whose inner order is unknown are never sliced.
        let opaque = |g: Geometry| g.with_opaque_blocks(true);
        let e = refusal(&opaque(ranked(2, KvLayout::HND)), &opaque(ranked(1, KvLayout::HND)));
        assert!(e.contains("not implemented") && e.contains("opaque"), "{e}");
        let one = ranked(1, KvLayout::HND);
        let other =
            Geometry::new(BlockShape { heads: 2, ..one.shape() }, KvLayout::HND, one.regions().to_vec());
        // Another model's heads are never copied (the handshake refuses such a peer first).
        assert!(refusal(&ranked(2, KvLayout::HND), &other).contains("(producer 2 rank(s), this engine 1)"));
    }

    /// One rank, `rank` of `ranks`, of two layers holding 4 KV heads over all ranks
    /// (vLLM's workers: each registers its own rank's KV).
    fn one_rank(rank: u32, ranks: u32, layout: KvLayout, opaque: bool) -> Geometry {
        let shape = BlockShape { heads: 4 / ranks, tokens: 4, head_dim: 2, elem_size: 2, kv_parts: 2 };
        let regions = [0, 1].map(|l| RegionShape { layers: vec![LayerId(l)], num_blocks: 8 }).to_vec();
        Geometry::new(shape, layout, regions)
            .with_opaque_blocks(opaque)
            .with_opaque_heads_outer(opaque)
            .as_rank_of(rank, ranks)
            .unwrap()
    }

    /// Where each element of a held rank's blocks lies, named (layer, part, block position,
    /// global head, token, channel), worked out from the layout alone: HND/NHD by
    /// `inner_offset`, opaque heads-outermost blocks as vLLM's CPU backend lays them out
    /// (`[H][N][K|V][C]`: each head's K and V rows one after another).
    fn held_elements(g: &Geometry, blocks: &[u32]) -> Vec<(Element, (usize, usize))> {
        let s = g.shape();
        let rank = g.held_ranks().start;
        let mut out = Vec::new();
        for layer in 0..2 {
            for part in 0..2 {
                for (pos, b) in blocks.iter().enumerate() {
                    for h in 0..s.heads {
                        let head = rank * s.heads + h;
                        for t in 0..s.tokens {
                            for c in 0..s.head_dim {
                                let at = if g.opaque_blocks() {
                                    let block = g.rank_span(rank, LayerId(layer), 0, BlockId(*b)).unwrap();
                                    let row = (((h * s.tokens + t) * 2 + part) * s.head_dim + c) as usize;
                                    (block.region, block.offset + row * s.elem_size as usize)
                                } else {
                                    let span = g.rank_span(rank, LayerId(layer), part, BlockId(*b)).unwrap();
                                    (span.region, span.offset + g.inner_offset(h, t, c))
                                };
                                out.push(((layer, part, pos, head, t, c), at));
                            }
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn one_rank_of_several_reads_its_heads_from_each_producer_rank_holding_them() {
        let groups = [vec![LayerId(0), LayerId(1)]];
        for (layout, opaque) in [(KvLayout::HND, false), (KvLayout::NHD, false), (KvLayout::HND, true)] {
            for (p, d) in [(2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (1, 4), (4, 1)] {
                let (remote, local) = (vec![3, 5], vec![6, 1]);
                let peers: Vec<Geometry> = (0..p).map(|r| one_rank(r, p, layout, opaque)).collect();
                // Every producer element, named, as a u16 at its place in that rank's regions.
                let names: Vec<_> =
                    peers.iter().flat_map(|g| held_elements(g, &remote)).map(|(n, _)| n).collect();
                let label = |n: &(u32, u32, usize, u32, u32, u32)| {
                    names.iter().position(|m| m == n).unwrap() as u16 + 1
                };
                for c in 0..d {
                    let own = one_rank(c, d, layout, opaque);
                    let mut dst = vec![vec![0u8; own.region_bytes(&own.regions()[0])]; 2];
                    let mut read_from = 0;
                    for peer in &peers {
                        let mut src = vec![vec![0u8; peer.region_bytes(&peer.regions()[0])]; 2];
                        for (n, (r, at)) in held_elements(peer, &remote) {
                            src[r][at..at + 2].copy_from_slice(&label(&n).to_le_bytes());
                        }
                        let plan =
                            CopyPlan::build(peer, &own, &groups, &load(remote.clone(), local.clone(), 0, 8));
                        let runs = match plan {
                            Ok(CopyPlan::Direct(runs)) => runs,
                            Ok(other) => panic!("{p}->{d}: {other:?}"),
                            Err(e) => {
                                // A producer rank holding none of this rank's heads is named as such.
                                assert!(
                                    e.to_string().contains("none of this engine's KV heads"),
                                    "{p}->{d}: {e}"
                                );
                                continue;
                            }
                        };
                        read_from += 1;
                        for r in runs {
                            let (so, dof, n) = (r.src_off as usize, r.dst_off as usize, r.len as usize);
                            dst[r.dst_region as usize][dof..dof + n]
                                .copy_from_slice(&src[r.src_region as usize][so..so + n]);
                        }
                    }
                    assert_eq!(read_from, (p / d).max(1), "{layout:?} opaque {opaque}: {p}->{d} rank {c}");
                    for (n, (r, at)) in held_elements(&own, &local) {
                        assert_eq!(
                            &dst[r][at..at + 2],
                            &label(&n).to_le_bytes(),
                            "{layout:?} opaque {opaque}: {p}->{d} rank {c}: {n:?}"
                        );
                    }
                }
            }
        }
    }

    /// `geo` plus one state layer (2) of 8 slots of 96 bytes after the two KV regions.
    fn geo_state(layout: KvLayout, tokens: u32) -> Geometry {
        use kvconnect_api::state_slots::{StateRegion, StateSlots};
        geo(layout, tokens).with_state(StateSlots {
            slot_bytes: 96,
            first_region: 2,
            regions: vec![StateRegion { layers: vec![LayerId(2)], num_slots: 8 }],
        })
    }

    /// A load of the KV group's blocks and the state group's slot.
    fn load_state(remote: (Vec<u32>, u32), local: (Vec<u32>, u32), first: usize, n: usize) -> LoadSpec {
        let ids = |v: Vec<u32>| v.into_iter().map(BlockId).collect::<Vec<_>>();
        LoadSpec {
            remote_blocks: BlocksPerGroup(vec![ids(remote.0), vec![BlockId(remote.1)]]),
            local_blocks: BlocksPerGroup(vec![ids(local.0), vec![BlockId(local.1)]]),
            ..load(vec![], vec![], first, n)
        }
    }

    #[test]
    fn a_check_names_the_blocks_a_load_reads_and_a_state_group_its_slot() {
        let ids =
            |g: Vec<Vec<BlockId>>| g.into_iter().map(|v| v.into_iter().map(|b| b.0).collect()).collect();
        let one = vec![vec![LayerId(0), LayerId(1)]];
        let g = geo(KvLayout::HND, 4);
        // Tokens 4..10 of 4-token blocks are positions 1 and 2.
        let got: Vec<Vec<u32>> = ids(read_blocks(&g, &one, &load(vec![10, 11, 12, 13], vec![], 4, 10)));
        assert_eq!(got, vec![vec![11, 12]]);
        assert_eq!(ids(read_blocks(&g, &one, &load(vec![10, 11], vec![], 0, 8))), vec![vec![10, 11]]);
        // Nothing to load names nothing; params with fewer blocks than tokens name those there are.
        assert_eq!(ids(read_blocks(&g, &one, &load(vec![10, 11], vec![], 5, 5))), vec![Vec::<u32>::new()]);
        assert_eq!(ids(read_blocks(&g, &one, &load(vec![10], vec![], 0, 8))), vec![vec![10]]);
        let groups = vec![vec![LayerId(0), LayerId(1)], vec![LayerId(2)]];
        let got = ids(read_blocks(
            &geo_state(KvLayout::HND, 4),
            &groups,
            &load_state((vec![1, 2], 5), (vec![3, 4], 6), 0, 7),
        ));
        assert_eq!(got, vec![vec![1, 2], vec![5]]);
    }

    #[test]
    fn a_load_moves_the_state_slot_beside_the_kv_blocks() {
        let groups = vec![vec![LayerId(0), LayerId(1)], vec![LayerId(2)]];
        let (peer, own) = (geo_state(KvLayout::HND, 4), geo_state(KvLayout::HND, 4));
        let plan = CopyPlan::build(&peer, &own, &groups, &load_state((vec![1, 2], 5), (vec![3, 4], 6), 0, 7))
            .unwrap();
        let CopyPlan::Direct(runs) = &plan else { panic!("equal layouts copy directly") };
        let state: Vec<&CopyRun> = runs.iter().filter(|r| r.src_region == 2).collect();
        assert_eq!(
            state,
            [&CopyRun { src_region: 2, src_off: 5 * 96, dst_region: 2, dst_off: 6 * 96, len: 96 }]
        );
        let kv = 2 * 2 * 2 * peer.shape().bytes() as u64;
        assert_eq!(plan.total_bytes(), kv + 96);
        // Nothing to load: no state either.
        let none =
            CopyPlan::build(&peer, &own, &groups, &load_state((vec![1], 5), (vec![3], 6), 3, 3)).unwrap();
        assert_eq!(none.total_bytes(), 0);
        // A state group without a slot is a planning error naming it.
        let mut bad = load_state((vec![1, 2], 5), (vec![3, 4], 6), 0, 7);
        bad.local_blocks.0[1].clear();
        let e = CopyPlan::build(&peer, &own, &groups, &bad).unwrap_err().to_string();
        assert!(e.contains("state group 1 needs one producer and one local state slot"), "{e}");
        // State beside blocks that must be adapted is not built.
        let nhd = geo_state(KvLayout::NHD, 4);
        let e = CopyPlan::build(&nhd, &own, &groups, &load_state((vec![1, 2], 5), (vec![3, 4], 6), 0, 7))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("not implemented:") && e.contains("per-request state"), "{e}");
    }

    #[test]
    fn shares_start_where_the_bytes_divide_evenly() {
        let run = |len| CopyRun { src_region: 0, src_off: 0, dst_region: 0, dst_off: 0, len };
        let runs = [run(30), run(70)];
        assert_eq!(share_starts(&runs, 40), vec![(0, 0), (1, 10), (1, 50)]);
        // A share ending where a run ends starts the next at that run's start, never at its end.
        assert_eq!(share_starts(&runs, 30), vec![(0, 0), (1, 0), (1, 30), (1, 60)]);
        assert_eq!(share_starts(&[run(40), run(40)], 40), vec![(0, 0), (1, 0)]);
        assert_eq!(share_starts(&runs, 1000), vec![(0, 0)]);
        assert_eq!(share_starts(&runs, 0).len(), 100, "a share of 0 bytes is taken as 1");
        assert_eq!(share_starts(&[], 10), vec![(0, 0)]);
        // Zero-length runs are passed over.
        assert_eq!(share_starts(&[run(0), run(20), run(0), run(20)], 20), vec![(0, 0), (2, 0)]);
    }

    #[test]
    fn runs_split_into_streams_cover_every_byte_once_in_order() {
        let run = |s, d, len| CopyRun { src_region: 1, src_off: s, dst_region: 2, dst_off: d, len };
        let runs = vec![run(0, 100, 30), run(50, 500, 70)];
        let shares = split_runs(&runs, 3);
        assert_eq!(
            shares,
            vec![vec![run(0, 100, 30), run(50, 500, 4)], vec![run(54, 504, 34)], vec![run(88, 538, 32)]]
        );
        assert_eq!(split_runs(&runs, 1), vec![runs.clone()]);
        assert_eq!(split_runs(&runs, 0), vec![runs.clone()]);
        assert_eq!(split_runs(&runs, 1000).len(), 100, "never a share of zero bytes");
        assert!(split_runs(&[], 4).is_empty());
    }

    #[test]
    fn views_of_overlapping_or_outside_runs_are_refused() {
        let (regions, mem) = big_memory();
        let run = |off, len| CopyRun { src_region: 0, src_off: 0, dst_region: 0, dst_off: off, len };
        let mut local = LocalRegions::new(&mem);
        let v = local.views(&[vec![run(0, 64)], vec![run(64, 64), run(4096, 8)]]).unwrap();
        assert_eq!(
            v.iter().map(|s| s.iter().map(|b| b.len()).collect::<Vec<_>>()).collect::<Vec<_>>(),
            vec![vec![64], vec![64, 8]]
        );
        let e = local.views(&[vec![run(0, 64)], vec![run(32, 64)]]).unwrap_err();
        assert!(e.to_string().contains("write the same destination bytes"), "{e}");
        let far = regions.regions()[0].len();
        let e = local.views(&[vec![run(far - 8, 64)]]).unwrap_err();
        assert!(e.to_string().contains("do not fit local region 0"), "{e}");
    }

    /// 2 layers x 8 heads x 128 channels, 16-token blocks, 64 blocks: 32 MiB of host KV.
    fn big_memory() -> (kvconnect_bench::harness::Regions, KvMemory) {
        let m = kvconnect_bench::harness::model(2, 8, 128);
        let eff = kvconnect_bench::harness::effective(&m, KvLayout::HND, 16);
        let regions = kvconnect_bench::harness::Regions::allocate(&m, &eff, 64, None).unwrap();
        let mem = KvMemory::new(regions.regions(), &m, &eff).unwrap();
        (regions, mem)
    }

    #[test]
    fn runs_copied_by_several_threads_land_exactly() {
        let (mut regions, mem) = big_memory();
        let len = regions.regions()[0].len();
        let src: Vec<u8> = (0..2 * len).map(|i| (i * 7 % 251) as u8).collect();
        let runs: Vec<CopyRun> = (0..2u32)
            .map(|r| CopyRun { src_region: r, src_off: 0, dst_region: r, dst_off: 0, len })
            .collect();
        let from = |r: &CopyRun| Ok(&src[(r.src_region as u64 * len) as usize..][..r.len as usize]);
        LocalRegions::new(&mem).write_runs(&runs, from, 4).unwrap();
        drop(mem);
        assert!(regions.bytes_mut(0) == &src[..len as usize]);
        assert!(regions.bytes_mut(1) == &src[len as usize..]);
    }

    #[test]
    fn many_small_runs_cut_between_threads_land_exactly() {
        // Runs of 5,000 and 11,000 bytes alternating between two regions, read from a source
        // in reverse order: the four threads' shares start mid-run.
        let (mut regions, mem) = big_memory();
        let len = regions.regions()[0].len();
        let src: Vec<u8> = (0..2 * len).map(|i| (i * 13 % 251) as u8).collect();
        let mut runs = Vec::new();
        let (mut at, mut read) = ([0u64; 2], 2 * len);
        for k in 0.. {
            let n = if k % 4 < 2 { 5000 } else { 11000 };
            let r = (k % 2) as usize;
            if at[r] + n > len {
                break;
            }
            read -= n;
            runs.push(CopyRun { src_region: 0, src_off: read, dst_region: r as u32, dst_off: at[r], len: n });
            at[r] += n;
        }
        let total: u64 = runs.iter().map(|r| r.len).sum();
        assert!(
            share_starts(&runs, total.div_ceil(4)).iter().any(|&(_, at)| at > 0),
            "a share starts mid-run"
        );
        let from = |r: &CopyRun| Ok(&src[r.src_off as usize..][..r.len as usize]);
        LocalRegions::new(&mem).write_runs(&runs, from, 4).unwrap();
        drop(mem);
        for r in 0..2u32 {
            let got = regions.bytes_mut(r as usize).to_vec();
            for run in runs.iter().filter(|x| x.dst_region == r) {
                let (d, s) = (run.dst_off as usize, run.src_off as usize);
                assert!(got[d..d + run.len as usize] == src[s..s + run.len as usize], "{run:?}");
            }
            assert!(got[at[r as usize] as usize..].iter().all(|b| *b == 0), "nothing past the runs");
        }
    }

    #[test]
    fn runs_that_overlap_or_leave_their_region_are_refused_before_any_copy() {
        let (mut regions, mem) = big_memory();
        let src = vec![9u8; 4096];
        let run = |off| CopyRun { src_region: 0, src_off: 0, dst_region: 0, dst_off: off, len: 4096 };
        let e = LocalRegions::new(&mem).write_runs(&[run(0), run(2048)], |_| Ok(&src[..]), 2).unwrap_err();
        assert!(e.to_string().contains("write the same destination bytes"), "{e}");
        let far = regions.regions()[0].len();
        let e = LocalRegions::new(&mem).write_runs(&[run(0), run(far)], |_| Ok(&src[..]), 2).unwrap_err();
        assert!(e.to_string().contains("do not fit local region 0"), "{e}");
        // A source that answers shorter once checked fails the copy, not the process.
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let shrinking = |_: &CopyRun| {
            let n = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(if n == 0 { &src[..] } else { &src[..100] })
        };
        let e = LocalRegions::new(&mem).write_runs(&[run(8192)], shrinking, 2).unwrap_err();
        assert!(e.to_string().contains("changed length during the copy"), "{e}");
        drop(mem);
        assert!(regions.bytes_mut(0).iter().all(|b| *b == 0), "nothing was copied");
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
    fn opaque_blocks_copy_whole_or_not_at_all() {
        let opaque = |tokens| geo(KvLayout::HND, tokens).with_opaque_blocks(true);
        let groups = vec![vec![LayerId(0), LayerId(1)]];
        // Equal opaque geometries: each block (K part then V part) is one run per layer.
        let p =
            CopyPlan::build(&opaque(4), &opaque(4), &groups, &load(vec![2, 3], vec![5, 6], 0, 8)).unwrap();
        let CopyPlan::Direct(runs) = &p else { panic!("expected direct: {p:?}") };
        assert_eq!(runs.len(), 2, "{runs:?}");
        assert!(runs.iter().all(|r| r.len == 2 * 2 * 64 && r.src_off == 2 * 128 && r.dst_off == 5 * 128));
        // Anything that would look inside a block is refused, naming why.
        for (peer, own, first) in
            [(opaque(4), opaque(8), 0), (opaque(4), geo(KvLayout::HND, 4), 0), (opaque(4), opaque(4), 2)]
        {
            let e =
                CopyPlan::build(&peer, &own, &groups, &load(vec![2, 3], vec![5, 6], first, 8)).unwrap_err();
            assert!(e.to_string().contains("opaque blocks move whole only"), "{e}");
        }
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
