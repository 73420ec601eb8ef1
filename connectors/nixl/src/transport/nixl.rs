//! Backend `nixl`: NVIDIA's NIXL library over UCX (feature `nixl`; the library is found at
//! run time, [`crate::nixl_lib`]), any two hosts. Each worker has one agent with every KV
//! region registered, as DRAM, or as VRAM of their GPU when they are device memory (feature
//! `cuda`). A producer publishes its agent's metadata and region addresses; a consumer loads
//! them at the handshake. Per request the puller holds the blocks (`hold`), the backend READs
//! the plan's coalesced runs from the producer's registered regions (direct plans straight
//! into place; adapting plans, host memory only, into a registered staging buffer, then
//! scattered), the puller holds again (still held means held throughout), and the backend
//! tells the producer with a NIXL notification (`kvc-done <request> <capability>`) instead of
//! `done` ([`Transport::confirmed`]).
//!
//! Descriptor lists are prepared once per producer and region set, not per request: one
//! entry per span (one layer's K or V of one block) of every region, this worker's own at
//! start and each producer's at the first pull from it (again when its agent or regions
//! change, or after a transfer from it failed). A direct plan's READ then names the entries
//! of its runs by index (`makeXferReq`, which merges entries contiguous on both sides back
//! into the coalesced runs). Adapting plans, which read into a staging buffer of their own,
//! and regions too large to list build their descriptors per request.

// NIXL registration of the KV regions and of staging buffers (the NIXL bindings' unsafe contract).
#![allow(unsafe_code)]

use super::{
    planned, Backend, BackendInfo, Completion, Confirm, Pin, PullSteps, Setup, Started, Streams, Transport,
};
use crate::config::NAME;
use crate::copy_plan::CopyRun;
use crate::copy_plan::{CopyPlan, LocalRegions};
use crate::error::TransferError;
use crate::metadata::{LoadSpec, NixlAgentMetadata, PeerInfo, PeerKey, ProducerMetadata};
use crate::nixl_agent::{NixlAgent, NixlMem, Prepared, ReadPair, Registration, Transfer};
use crate::puller::PullStats;
use kvconnect_api::geometry::Geometry;
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{ConnectorError, ConnectorResult, KvRegion, LayerId, MemoryKind, RequestId};
use kvconnect_dataplane::hex::{from_hex, to_hex};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Its entry in [`super::BACKENDS`].
pub static BACKEND: BackendInfo = BackendInfo {
    name: "nixl",
    aliases: &["ucx"],
    offer: "\"nixl\"",
    across_tp: false,
    carries_state: false,
    // Device memory registered as VRAM, in builds with the `cuda` feature.
    memory_kinds: if cfg!(feature = "cuda") {
        &[MemoryKind::Host, MemoryKind::Device]
    } else {
        &[MemoryKind::Host]
    },
    serves_reads: false,
    shm_regions: false,
    available,
    start,
};

/// Prefix of the NIXL notification a consumer sends when it has a request's blocks.
pub const NIXL_DONE: &str = "kvc-done ";

fn available() -> Result<(), ConnectorError> {
    crate::nixl_lib::load().map(|_| ()).map_err(|e| {
        ConnectorError::config(
            NAME,
            format!(
                "backend 'nixl' (selected by backend=\"nixl\" or backends=[\"UCX\"]) cannot run here: \
                {e}; or use backend \"shm\" (same host) or \"tcp\" (any two hosts)"
            ),
        )
    })
}

/// Why backend nixl cannot pull between these memory kinds: it reads VRAM from VRAM and
/// DRAM from DRAM. `own_vram`: this engine's KV is in GPU memory.
pub(crate) fn mixed_memory(engine: &str, own_vram: bool) -> String {
    let (own, peer) = if own_vram {
        ("GPU memory (VRAM)", "host memory (DRAM)")
    } else {
        ("host memory (DRAM)", "GPU memory (VRAM)")
    };
    format!(
        "producer engine '{engine}' registered its KV with NIXL as {peer} but this engine's KV is in {own}: \
            backend nixl reads VRAM from VRAM and DRAM from DRAM only; put both sides' KV in GPU memory \
            (kv_buffer_device=\"cuda\") or both in host memory"
    )
}

/// Why backend nixl cannot pull a plan that adapts the layout when the KV is in GPU memory:
/// `what` names the mismatch.
pub(crate) fn vram_adapt_refusal(engine: &str, what: &str) -> String {
    format!(
        "backend nixl reads GPU memory as it lies (VRAM to VRAM, no host copy), so it cannot adapt the KV \
            layout on receive, which loading from producer engine '{engine}' needs ({what}): use backend \
            cuda_ipc (same host), which fuses the permute into its GPU copy, or the same layout and block \
            size on both sides"
    )
}

/// KV regions in GPU memory: their GPU and device addresses, which READs write into.
#[derive(Clone)]
pub struct VramRegions {
    /// CUDA device ordinal of every region.
    pub device: u64,
    /// (device address, bytes) of each region, in registration order.
    pub regions: Vec<(u64, u64)>,
    /// The GPU, made current on the pull thread before each READ (UCX's CUDA transports
    /// work in the calling thread's context).
    #[cfg(feature = "cuda")]
    pub gpu: Arc<kvconnect_cuda::Gpu>,
}

impl std::fmt::Debug for VramRegions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VramRegions").field("device", &self.device).field("regions", &self.regions).finish()
    }
}

/// When the regions are device memory, checks they are all on one GPU and opens it; host
/// regions give `None`.
fn vram_regions(regions: &[KvRegion]) -> ConnectorResult<Option<VramRegions>> {
    let Some(first) = regions.iter().find(|r| r.memory() == MemoryKind::Device) else {
        return Ok(None);
    };
    for r in regions {
        if r.memory() != MemoryKind::Device {
            return Err(ConnectorError::invalid(
                NAME,
                format!(
                    "backend nixl: region '{}' is {:?} memory but region '{}' is in GPU memory: all KV \
                        regions of a worker must be in one kind of memory",
                    r.name(),
                    r.memory(),
                    first.name()
                ),
            ));
        }
        if r.device() < 0 {
            return Err(ConnectorError::invalid(
                NAME,
                format!(
                    "backend nixl: region '{}' is in GPU memory but names no GPU (device {}): the host must \
                        give device regions their CUDA device ordinal",
                    r.name(),
                    r.device()
                ),
            ));
        }
        if r.device() != first.device() {
            return Err(ConnectorError::invalid(
                NAME,
                format!(
                    "backend nixl: region '{}' is on GPU {} but region '{}' on GPU {}: all KV regions of a \
                        worker must be on one GPU",
                    r.name(),
                    r.device(),
                    first.name(),
                    first.device()
                ),
            ));
        }
    }
    #[cfg(feature = "cuda")]
    {
        let gpu = kvconnect_cuda::Gpu::open(first.device() as usize)
            .map_err(|e| ConnectorError::invalid(NAME, format!("backend nixl with GPU KV: {e}")))?;
        Ok(Some(VramRegions {
            device: first.device() as u64,
            regions: regions.iter().map(|r| (r.addr(), r.len())).collect(),
            gpu: Arc::new(gpu),
        }))
    }
    #[cfg(not(feature = "cuda"))]
    Err(ConnectorError::config(
        NAME,
        "backend 'nixl' with KV regions in GPU memory needs a build with `--features cuda` (it registers \
            them with NIXL as VRAM)",
    ))
}

/// One agent per worker, named after the engine and process (and unique in the process:
/// NIXL tells agents apart by name only), with every KV region registered as DRAM, or as
/// VRAM of their GPU when they are device memory.
fn start(s: &Setup<'_>) -> ConnectorResult<Started> {
    let vram = vram_regions(s.regions)?;
    let mem = match &vram {
        // Device regions: this crate never dereferences them on the host; NIXL moves them
        // VRAM to VRAM.
        Some(_) => KvMemory::geometry_only(s.regions, &s.ctx.model, &s.ctx.effective),
        None => KvMemory::with_tp_ranks(s.regions, &s.ctx.model, &s.ctx.effective, s.tp_ranks),
    }
    .map_err(|e| ConnectorError::invalid(NAME, format!("cannot register KV regions: {e}")))?;
    static AGENTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = AGENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("{}-{}-{n}", s.ctx.engine_id, std::process::id());
    // UCX's CUDA support looks at the calling thread's context when the backend starts and
    // when memory is registered: make the regions' GPU current first.
    #[cfg(feature = "cuda")]
    if let Some(v) = &vram {
        v.gpu.bind().map_err(|e| ConnectorError::io(NAME, format!("backend nixl with GPU KV: {e}")))?;
    }
    let agent = NixlAgent::new(&name).map_err(|e| ConnectorError::io(NAME, e.to_string()))?;
    let kind = match &vram {
        Some(v) => {
            let m = NixlMem::Vram(v.device);
            if !agent.supports(m) {
                return Err(ConnectorError::io(
                    NAME,
                    format!(
                        "UCX in this NIXL build offers no transport for VRAM (its UCX backend lists only: \
                            {}): use backend cuda_ipc for KV in GPU memory on one host, or a NIXL build with \
                            CUDA support",
                        agent.memory_types()
                    ),
                ));
            }
            m
        }
        None => NixlMem::Dram,
    };
    let mut regs = Vec::with_capacity(s.regions.len());
    for r in s.regions {
        // SAFETY: the host keeps every registered region valid memory of its kind (host
        // memory, or cuMemAlloc memory of this GPU for device regions) until the worker is
        // shut down, and shutdown drops this backend (these registrations, then the agent)
        // before the memory goes.
        let reg = unsafe { agent.register(r.addr() as usize, r.len() as usize, kind) }.map_err(|e| {
            let hint = match kind {
                NixlMem::Dram => String::new(),
                NixlMem::Vram(_) => "; UCX in this NIXL build may offer no transport for VRAM (its CUDA \
                    module libuct_cuda needs libcuda.so.1 and libnvidia-ml.so.1 from the NVIDIA driver, its \
                    CUDA memory hooks libcudart.so.12, which the nixl-cu12 wheel does not ship): `kvconnect \
                    bench nixl-vram` checks this machine, and backend cuda_ipc moves GPU KV on one host \
                    without NIXL"
                    .into(),
            };
            ConnectorError::io(NAME, format!("region '{}': {e}{hint}", r.name()))
        })?;
        regs.push(reg);
    }
    let unit = mem.geometry().shape().bytes() as u64;
    let own_regions: Vec<(u64, u64)> = s.regions.iter().map(|r| (r.addr(), r.len())).collect();
    let own = match (s.consumer, span_ranges(&own_regions, unit)) {
        (true, Some((ranges, index))) => {
            let list =
                agent.prepare(None, &ranges, kind).map_err(|e| ConnectorError::io(NAME, e.to_string()))?;
            Some(Spans { list, list_mem: kind, index })
        }
        _ => None,
    };
    let transport = Nixl {
        prepared: Mutex::default(),
        own,
        regs,
        agent,
        region_addrs: s.regions.iter().map(|r| r.addr()).collect(),
        vram,
        stale: Mutex::default(),
        io_timeout: s.cfg.io_timeout,
    };
    Ok(Started { mem, transport: Arc::new(transport) })
}

/// The started backend.
pub struct Nixl {
    // Field order is drop order: the prepared lists and registrations before the agent.
    /// Each producer's regions, prepared at the first pull from it.
    prepared: Mutex<HashMap<PeerKey, PeerSpans>>,
    /// This worker's regions, prepared at start (`None`: not a consumer, or too many spans
    /// to list).
    own: Option<Spans>,
    regs: Vec<Registration>,
    agent: NixlAgent,
    /// Base address of each registered region, for the handshake.
    region_addrs: Vec<u64>,
    /// KV regions in GPU memory: READs go VRAM to VRAM into them.
    vram: Option<VramRegions>,
    /// Producers whose agent metadata is loaded again before the next READ (a transfer
    /// from them failed).
    stale: Mutex<HashSet<PeerKey>>,
    /// How long a READ may take (the worker's `io_timeout`, as for its connections).
    io_timeout: Duration,
}

/// READs this process posted by the indices of prepared lists (the rest built their
/// descriptors per request): what tests and benchmarks check the fast path by.
static PREPARED_READS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// READs this process posted through prepared descriptor lists so far.
pub fn prepared_reads() -> u64 {
    PREPARED_READS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The most entries a prepared list may have: beyond it a worker builds its descriptors per
/// request (the list would cost NIXL more memory than it saves time).
const MAX_PREPARED_ENTRIES: usize = 1 << 22;

/// Regions prepared as one list of entries ([`SpanIndex`]).
#[derive(Debug)]
struct Spans {
    list: Prepared,
    /// The memory kind they were prepared as.
    list_mem: NixlMem,
    index: SpanIndex,
}

/// Regions cut into `unit`-byte entries: region `r`'s entry `i` is `[base_r + i * unit,
/// + unit)`, at index `first[r] + i` of one list.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SpanIndex {
    unit: u64,
    first: Vec<usize>,
    /// Entries of each region.
    count: Vec<usize>,
}

impl SpanIndex {
    /// The entries of `len` bytes at `off` in region `region`, if they are whole entries.
    fn entries(&self, region: u32, off: u64, len: u64) -> Option<std::ops::Range<usize>> {
        let r = region as usize;
        if !off.is_multiple_of(self.unit) || !len.is_multiple_of(self.unit) {
            return None;
        }
        let (start, n) = ((off / self.unit) as usize, (len / self.unit) as usize);
        let (first, count) = (*self.first.get(r)?, *self.count.get(r)?);
        let end = start.checked_add(n).filter(|e| *e <= count)?;
        Some(first + start..first + end)
    }
}

/// Regions of `(base, bytes)` cut into `unit`-byte entries: the entries' ranges and their
/// index. `None` when the unit is 0, there would be more than [`MAX_PREPARED_ENTRIES`], or an
/// address does not fit this machine's.
fn span_ranges(regions: &[(u64, u64)], unit: u64) -> Option<(Vec<(usize, usize)>, SpanIndex)> {
    if unit == 0 {
        return None;
    }
    let total: u64 = regions.iter().map(|(_, len)| len / unit).sum();
    if total > MAX_PREPARED_ENTRIES as u64 {
        return None;
    }
    let mut ranges = Vec::with_capacity(total as usize);
    let mut index = SpanIndex { unit, first: Vec::new(), count: Vec::new() };
    for &(base, len) in regions {
        index.first.push(ranges.len());
        let n = (len / unit) as usize;
        index.count.push(n);
        for i in 0..n as u64 {
            let at = usize::try_from(base.checked_add(i * unit)?).ok()?;
            ranges.push((at, usize::try_from(unit).ok()?));
        }
    }
    Some((ranges, index))
}

/// A producer's prepared regions, and what they were prepared for.
#[derive(Debug)]
struct PeerSpans {
    agent: String,
    region_addrs: Vec<u64>,
    region_lens: Vec<u64>,
    /// `None`: they cannot be listed (too many spans, or a unit other than this worker's).
    spans: Option<Spans>,
}

impl std::fmt::Debug for Nixl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nixl").field("agent", &self.agent).field("regions", &self.regs.len()).finish()
    }
}

fn peer_agent(peer: &PeerInfo) -> Result<&NixlAgentMetadata, TransferError> {
    peer.meta.nixl.as_ref().ok_or_else(|| {
        TransferError::Plan(format!(
            "producer engine '{}' published no NIXL agent: it does not run backend nixl; use the same \
                backend on both sides",
            peer.meta.engine_id
        ))
    })
}

/// The address of `len` bytes at `off` in producer region `region`, from its NIXL metadata.
/// NIXL checks every remote range against the producer agent's registrations.
fn producer_addr(
    peer: &PeerInfo,
    remote: &NixlAgentMetadata,
    region: u32,
    off: u64,
    len: u64,
) -> Result<usize, TransferError> {
    let (r, base) = peer
        .meta
        .regions
        .get(region as usize)
        .zip(remote.region_addrs.get(region as usize))
        .ok_or_else(|| TransferError::Plan(format!("no producer region {region}")))?;
    if off.checked_add(len).is_none_or(|e| e > r.len) {
        return Err(TransferError::Plan(format!(
            "{len} bytes at {off} do not fit producer region '{}' of {} bytes",
            r.name, r.len
        )));
    }
    // The base comes from the peer: an end past the address space is its error, not a wrap.
    base.checked_add(off)
        .filter(|a| a.checked_add(len).is_some())
        .and_then(|a| usize::try_from(a).ok())
        .ok_or_else(|| {
            TransferError::Plan(format!(
                "producer region '{}' at address {base:#x} cannot hold {len} bytes at {off}: the peer's NIXL \
                    metadata is corrupt",
                r.name
            ))
        })
}

impl Nixl {
    /// READs the plan's runs from the producer's registered regions and waits for the
    /// transfer on this (pull) thread.
    fn read(
        &self,
        io_timeout: Duration,
        dst: &mut LocalRegions,
        peer: &PeerInfo,
        load: &LoadSpec,
        plan: &CopyPlan,
    ) -> Result<(), TransferError> {
        let remote = peer_agent(peer)?;
        let key = peer.key();
        if self.stale.lock().unwrap_or_else(|p| p.into_inner()).remove(&key) {
            // The last transfer from this producer failed: its metadata again, as at the
            // handshake (UCX connects anew), and its lists prepared again.
            let md = from_hex(&remote.md).ok_or_else(|| TransferError::Protocol {
                engine: peer.meta.engine_id.clone(),
                message: "its NIXL metadata is not hex".into(),
            })?;
            self.release_prepared_of(&remote.agent);
            self.agent.invalidate_remote(&remote.agent);
            self.agent.load_remote_md(&md)?;
        }
        if self.vram.is_some() || remote.vram_device.is_some() {
            return self.read_vram(io_timeout, peer, remote, dst.geometry(), load, plan);
        }
        let src = |region: u32, off: u64, len: u64| producer_addr(peer, remote, region, off, len);
        let mut pairs = Vec::new();
        match plan {
            CopyPlan::Direct(rs) => {
                if let Some(t) = self.post_prepared(peer, remote, rs, NixlMem::Dram)? {
                    return self.finish(io_timeout, peer, t);
                }
                for r in rs {
                    let local = dst.dst_mut(r.dst_region, r.dst_off, r.len)?.as_mut_ptr() as usize;
                    pairs.push(ReadPair {
                        local,
                        remote: src(r.src_region, r.src_off, r.len)?,
                        len: r.len as usize,
                    });
                }
                self.wait(io_timeout, peer, &remote.agent, &pairs, NixlMem::Dram, NixlMem::Dram)
            }
            CopyPlan::Adapt(bs) => {
                let mut staging = vec![0u8; plan.total_bytes() as usize];
                let base = staging.as_mut_ptr() as usize;
                let mut at = 0usize;
                for (region, off, len) in plan.src_runs() {
                    pairs.push(ReadPair {
                        local: base + at,
                        remote: src(region, off, len)?,
                        len: len as usize,
                    });
                    at += len as usize;
                }
                let r = {
                    // SAFETY: `staging` outlives the registration (dropped at the end of this
                    // block, after the transfer finished or was released).
                    let _registered = unsafe { self.agent.register_dram(base, staging.len().max(1))? };
                    self.wait(io_timeout, peer, &remote.agent, &pairs, NixlMem::Dram, NixlMem::Dram)
                };
                r?;
                let mut at = 0usize;
                for b in bs {
                    let len = b.len as usize;
                    dst.scatter(&peer.geometry, load, b, &staging[at..at + len])?;
                    at += len;
                }
                Ok(())
            }
        }
    }

    /// Device KV regions on both sides: the plan's coalesced runs READ straight from the
    /// producer's VRAM into this GPU's, one descriptor per run. A plan that adapts the
    /// layout (NHD vs HND, other block sizes, a first token inside a block) is refused:
    /// there is no host copy to scatter from.
    fn read_vram(
        &self,
        io_timeout: Duration,
        peer: &PeerInfo,
        remote: &NixlAgentMetadata,
        own_geometry: &Geometry,
        load: &LoadSpec,
        plan: &CopyPlan,
    ) -> Result<(), TransferError> {
        let e = &peer.meta.engine_id;
        let (own, far_device) = match (&self.vram, remote.vram_device) {
            (Some(own), Some(d)) => (own, d),
            (Some(_), None) => return Err(TransferError::Plan(mixed_memory(e, true))),
            _ => return Err(TransferError::Plan(mixed_memory(e, false))),
        };
        let runs = match plan {
            CopyPlan::Direct(runs) => runs,
            CopyPlan::Adapt(_) => {
                let (p, o) = (&peer.geometry, own_geometry);
                let what = format!(
                    "request {}: producer layout {} with {}-token blocks, this engine's {} with {}-token \
                        blocks, first token {}",
                    load.request,
                    p.layout().display_name(),
                    p.shape().tokens,
                    o.layout().display_name(),
                    o.shape().tokens,
                    load.first_token
                );
                return Err(TransferError::Plan(vram_adapt_refusal(e, &what)));
            }
        };
        #[cfg(feature = "cuda")]
        own.gpu.bind().map_err(|err| TransferError::Cuda(err.to_string()))?;
        if let Some(t) = self.post_prepared(peer, remote, runs, NixlMem::Vram(far_device))? {
            return self.finish(io_timeout, peer, t);
        }
        let mut pairs = Vec::with_capacity(runs.len());
        for r in runs {
            let (base, len) = own
                .regions
                .get(r.dst_region as usize)
                .copied()
                .ok_or_else(|| TransferError::Plan(format!("no local region {}", r.dst_region)))?;
            if r.dst_off.checked_add(r.len).is_none_or(|end| end > len) {
                return Err(TransferError::Plan(format!(
                    "{} bytes at {} do not fit local region {} of {len} bytes",
                    r.len, r.dst_off, r.dst_region
                )));
            }
            pairs.push(ReadPair {
                local: (base + r.dst_off) as usize,
                remote: producer_addr(peer, remote, r.src_region, r.src_off, r.len)?,
                len: r.len as usize,
            });
        }
        self.wait(
            io_timeout,
            peer,
            &remote.agent,
            &pairs,
            NixlMem::Vram(own.device),
            NixlMem::Vram(far_device),
        )
    }

    /// Releases the lists prepared for every producer whose agent is `agent` (before its
    /// metadata is invalidated: NIXL's prepared lists point into it).
    fn release_prepared_of(&self, agent: &str) {
        let mut table = self.prepared.lock().unwrap_or_else(|p| p.into_inner());
        let keys: Vec<PeerKey> =
            table.iter().filter(|(_, p)| p.agent == agent).map(|(k, _)| k.clone()).collect();
        for k in keys {
            if let Some(spans) = table.remove(&k).and_then(|p| p.spans) {
                self.agent.release_prepared(spans.list);
            }
        }
    }

    /// Posts the READ of a direct plan's `runs` by the indices of prepared entries: the
    /// producer's regions (of memory kind `far_mem`) prepared at the first pull from it, or
    /// again when its agent or regions changed. `None` when the runs cannot be named so
    /// (this worker's or the producer's regions too large to list, other units on the two
    /// sides, a run that is not whole entries, nothing to read): the caller builds them.
    fn post_prepared(
        &self,
        peer: &PeerInfo,
        remote: &NixlAgentMetadata,
        runs: &[CopyRun],
        far_mem: NixlMem,
    ) -> Result<Option<Transfer>, TransferError> {
        let Some(own) = &self.own else { return Ok(None) };
        if runs.is_empty() {
            return Ok(None);
        }
        let key = peer.key();
        let lens: Vec<u64> = peer.meta.regions.iter().map(|r| r.len).collect();
        let mut table = self.prepared.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = table.get(&key).is_some_and(|p| {
            p.agent == remote.agent
                && p.region_addrs == remote.region_addrs
                && p.region_lens == lens
                && p.spans.as_ref().is_none_or(|s| s.list_mem == far_mem)
        });
        if !fresh {
            if let Some(spans) = table.remove(&key).and_then(|p| p.spans) {
                self.agent.release_prepared(spans.list);
            }
            let unit = peer.geometry.shape().bytes() as u64;
            let regions: Vec<(u64, u64)> =
                remote.region_addrs.iter().copied().zip(lens.iter().copied()).collect();
            let spans = match span_ranges(&regions, unit).filter(|_| unit == own.index.unit) {
                Some((ranges, index)) => {
                    let list = self.agent.prepare(Some(&remote.agent), &ranges, far_mem)?;
                    Some(Spans { list, list_mem: far_mem, index })
                }
                None => None,
            };
            let prepared = PeerSpans {
                agent: remote.agent.clone(),
                region_addrs: remote.region_addrs.clone(),
                region_lens: lens,
                spans,
            };
            table.insert(key.clone(), prepared);
        }
        let Some(far) = table.get(&key).and_then(|p| p.spans.as_ref()) else { return Ok(None) };
        let (mut local_idx, mut far_idx, mut bytes) = (Vec::new(), Vec::new(), 0u64);
        for r in runs {
            let entries = (
                own.index.entries(r.dst_region, r.dst_off, r.len),
                far.index.entries(r.src_region, r.src_off, r.len),
            );
            let (Some(l), Some(f)) = entries else { return Ok(None) };
            // Entries are fewer than MAX_PREPARED_ENTRIES, so their indices fit an i32.
            local_idx.extend(l.map(|i| i as i32));
            far_idx.extend(f.map(|i| i as i32));
            bytes += r.len;
        }
        let t = self.agent.post_read_prepared(&own.list, &local_idx, &far.list, &far_idx, bytes)?;
        PREPARED_READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Some(t))
    }

    /// Posts one READ of `pairs` and polls it until done.
    fn wait(
        &self,
        io_timeout: Duration,
        peer: &PeerInfo,
        remote: &str,
        pairs: &[ReadPair],
        local_mem: NixlMem,
        far_mem: NixlMem,
    ) -> Result<(), TransferError> {
        if pairs.is_empty() {
            return Ok(());
        }
        let t = self.agent.post_read_mem(remote, pairs, local_mem, far_mem)?;
        self.finish(io_timeout, peer, t)
    }

    /// Polls a posted READ until done, within the io timeout plus its bytes at a pessimistic
    /// 100 MB/s, on this (pull) thread.
    fn finish(&self, io_timeout: Duration, peer: &PeerInfo, t: Transfer) -> Result<(), TransferError> {
        let limit = io_timeout + Duration::from_secs_f64(t.bytes() as f64 / 100e6);
        let start = Instant::now();
        let mut spins = 0u32;
        while !self.agent.poll(&t)? {
            if start.elapsed() > limit {
                return Err(TransferError::NixlTimeout {
                    engine: peer.meta.engine_id.clone(),
                    bytes: t.bytes(),
                    seconds: limit.as_secs_f64(),
                });
            }
            spins += 1;
            if spins > 1000 {
                std::thread::yield_now();
            }
        }
        Ok(())
    }
}

impl Transport for Nixl {
    fn backend(&self) -> Backend {
        Backend::of(&BACKEND)
    }

    fn publish(&self, meta: &mut ProducerMetadata) -> ConnectorResult<()> {
        let md = self.agent.local_md().map_err(|e| ConnectorError::io(NAME, e.to_string()))?;
        meta.nixl = Some(NixlAgentMetadata {
            agent: self.agent.name().to_owned(),
            md: to_hex(&md),
            region_addrs: self.region_addrs.clone(),
            vram_device: self.vram.as_ref().map(|v| v.device),
        });
        Ok(())
    }

    /// Loads a producer's agent metadata (again only when it changed). With KV in GPU
    /// memory, refuses a producer whose KV is in host memory (or the reverse) and one whose
    /// layout or block size would need adapting on receive. NIXL knows remote agents by name
    /// alone, so what is loaded is kept per peer (engine and address): a producer that claims
    /// another's engine id neither replaces nor invalidates its agent, and one that names an
    /// agent another producer uses with other metadata is refused.
    fn admit(
        &self,
        info: &PeerInfo,
        own: &Geometry,
        known: &HashMap<PeerKey, Arc<PeerInfo>>,
    ) -> ConnectorResult<()> {
        let e = &info.meta.engine_id;
        let Some(m) = &info.meta.nixl else {
            return Err(ConnectorError::invalid(
                NAME,
                format!(
                    "peer engine '{e}' published no NIXL agent (it does not run backend nixl): use the \
                    same backend on both sides"
                ),
            ));
        };
        match (&self.vram, m.vram_device) {
            (Some(_), None) => return Err(ConnectorError::invalid(NAME, mixed_memory(e, true))),
            (None, Some(_)) => return Err(ConnectorError::invalid(NAME, mixed_memory(e, false))),
            (Some(_), Some(_)) => {
                if crate::copy_plan::layouts_adapt(&info.geometry, own) {
                    let what = format!(
                        "its layout {} with {}-token blocks, this engine's {} with {}-token blocks",
                        info.geometry.layout().display_name(),
                        info.geometry.shape().tokens,
                        own.layout().display_name(),
                        own.shape().tokens
                    );
                    return Err(ConnectorError::invalid(NAME, vram_adapt_refusal(e, &what)));
                }
            }
            (None, None) => {}
        }
        if m.region_addrs.len() != info.meta.regions.len() {
            return Err(ConnectorError::invalid(
                NAME,
                format!(
                    "peer engine '{e}' NIXL metadata lists {} region addresses for {} regions",
                    m.region_addrs.len(),
                    info.meta.regions.len()
                ),
            ));
        }
        let key = info.key();
        let others: Vec<&NixlAgentMetadata> =
            known.iter().filter(|(k, _)| **k != key).filter_map(|(_, p)| p.meta.nixl.as_ref()).collect();
        if let Some(other) = others.iter().find(|o| o.agent == m.agent && o.md != m.md) {
            return Err(ConnectorError::invalid(
                NAME,
                format!(
                    "peer engine {key} names its NIXL agent '{}', which another producer this engine already \
                        loaded uses with other metadata ({} bytes against {}): NIXL tells agents apart by \
                        name only, so this peer is refused; give each producer its own agent",
                    m.agent,
                    m.md.len() / 2,
                    other.md.len() / 2
                ),
            ));
        }
        let before = known.get(&key).and_then(|p| p.meta.nixl.clone());
        if before.as_ref().is_some_and(|k| k.md == m.md) {
            return Ok(());
        }
        // The agent this peer had before (a producer that restarted), unless another peer
        // still uses it.
        if let Some(k) = before.filter(|k| !others.iter().any(|o| o.agent == k.agent)) {
            self.release_prepared_of(&k.agent);
            self.agent.invalidate_remote(&k.agent);
        }
        let md = from_hex(&m.md).ok_or_else(|| {
            ConnectorError::invalid(NAME, format!("peer engine '{e}' NIXL metadata is not hex"))
        })?;
        let name = self
            .agent
            .load_remote_md(&md)
            .map_err(|err| ConnectorError::invalid(NAME, format!("peer engine '{e}': {err}")))?;
        if name != m.agent {
            return Err(ConnectorError::invalid(
                NAME,
                format!(
                    "peer engine '{e}' says its NIXL agent is '{}' but its metadata is agent '{name}'",
                    m.agent
                ),
            ));
        }
        Ok(())
    }

    /// Consumers tell a NIXL producer they have a request's blocks by notification:
    /// `kvc-done <request> <capability>` (an agent that does not know the capability cannot
    /// end another request's hold; the producer checks it).
    fn completions(&self) -> ConnectorResult<Vec<Completion>> {
        let notes = self.agent.take_notifications().map_err(|e| ConnectorError::io(NAME, e.to_string()))?;
        let mut out = Vec::with_capacity(notes.len());
        for (from, msg) in notes {
            match msg.strip_prefix(NIXL_DONE).map(|rest| rest.rsplit_once(' ').unwrap_or((rest, ""))) {
                Some((id, capability)) => out.push(Completion {
                    from,
                    request: RequestId::from(id),
                    capability: capability.to_owned(),
                }),
                None => {
                    tracing::warn!(agent = %from, "nixl: ignoring unknown notification '{msg}' from '{from}'")
                }
            }
        }
        Ok(out)
    }

    fn steps(&self) -> PullSteps {
        PullSteps { plan: true, before: Pin::Hold, after: Confirm::Hold }
    }

    fn copy(
        &self,
        _: Option<&mut Streams<'_>>,
        local: &KvMemory,
        _: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
        plan: Option<&CopyPlan>,
    ) -> Result<PullStats, TransferError> {
        let plan = planned(plan)?;
        let mut dst = LocalRegions::new(local);
        self.read(self.io_timeout, &mut dst, peer, load, plan)?;
        Ok(PullStats::of(plan))
    }

    /// After the puller's second `hold`: NIXL tells the producer.
    fn confirmed(&self, peer: &PeerInfo, load: &LoadSpec) -> Result<(), TransferError> {
        let remote = peer_agent(peer)?;
        let note = format!("{NIXL_DONE}{} {}", load.producer_request(), load.remote_capability);
        self.agent.notify(&remote.agent, note.as_bytes())?;
        Ok(())
    }

    fn forget(&self, key: &PeerKey) {
        self.stale.lock().unwrap_or_else(|p| p.into_inner()).insert(key.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::sample_metadata;

    #[test]
    fn a_peer_region_address_near_the_top_is_an_error_not_a_wrap() {
        let peer = PeerInfo::from_metadata(sample_metadata()).unwrap();
        let len = peer.meta.regions[0].len;
        let agent = |base: u64| NixlAgentMetadata {
            agent: "a".into(),
            md: String::new(),
            region_addrs: vec![base],
            vram_device: None,
        };
        assert_eq!(producer_addr(&peer, &agent(0x1000), 0, 16, 32).unwrap(), 0x1010);
        let e = producer_addr(&peer, &agent(u64::MAX - 8), 0, 16, 32).unwrap_err().to_string();
        assert!(e.contains("corrupt"), "{e}");
        assert!(producer_addr(&peer, &agent(0x1000), 0, len, 1).is_err());
        assert!(producer_addr(&peer, &agent(0x1000), 0, u64::MAX, 2).is_err());
        assert!(producer_addr(&peer, &agent(0x1000), 3, 0, 1).is_err());
    }

    #[test]
    fn regions_are_listed_span_by_span_and_runs_named_by_their_entries() {
        let (ranges, index) = span_ranges(&[(0x1000, 4 * 64), (0x9000, 2 * 64 + 10)], 64).unwrap();
        assert_eq!(ranges.len(), 6, "whole spans only");
        assert_eq!((ranges[0], ranges[3], ranges[4]), ((0x1000, 64), (0x10c0, 64), (0x9000, 64)));
        assert_eq!(index.entries(0, 64, 128), Some(1..3));
        assert_eq!(index.entries(1, 64, 64), Some(5..6));
        // Not whole entries, past a region, or no such region: built per request instead.
        assert_eq!(index.entries(0, 32, 64), None);
        assert_eq!(index.entries(0, 64, 100), None);
        assert_eq!(index.entries(0, 192, 128), None);
        assert_eq!(index.entries(2, 0, 64), None);
        assert_eq!(index.entries(0, u64::MAX - 63, 64), None);
        // Too many spans, a unit of 0, an address past this machine's: no list.
        assert!(span_ranges(&[(0, (MAX_PREPARED_ENTRIES as u64 + 1) * 8)], 8).is_none());
        assert!(span_ranges(&[(0, 64)], 0).is_none());
        assert!(span_ranges(&[(u64::MAX - 8, 64)], 32).is_none());
    }

    #[test]
    fn refusals_name_the_remedy() {
        let e = vram_adapt_refusal("prefill-0", "its layout NHD");
        assert!(
            e.contains("backend cuda_ipc") && e.contains("fuses the permute") && e.contains("prefill-0"),
            "{e}"
        );
        let e = mixed_memory("prefill-0", true);
        assert!(e.contains("registered its KV with NIXL as host memory (DRAM)"), "{e}");
        assert!(e.contains("this engine's KV is in GPU memory (VRAM)"), "{e}");
        assert!(
            mixed_memory("p", false).contains("as GPU memory (VRAM) but this engine's KV is in host memory")
        );
    }
}
