//! The consumer (decode) side of a pull: plan the copy, move the bytes (shm: straight out of
//! the producer's mapped segments; tcp: streamed into place), then tell the producer it is
//! done. Every socket operation has a timeout, so a dead producer ends in an error, never a
//! hang. This is also the entry point benchmarks use to time one transfer.

#![allow(unsafe_code)] // NIXL registration of the staging buffer (the NIXL bindings' unsafe contract).

use crate::config::Backend;
use crate::copy_plan::{CopyPlan, LocalRegions};
use crate::error::TransferError;
use crate::metadata::LoadSpec;
use crate::metadata::{NixlAgentMetadata, PeerInfo, PeerKey};
use crate::nixl_agent::{NixlAgent, NixlMem, ReadPair};
use crate::shm::ShmMapping;
use crate::wire::{
    authenticate_client, read_frame, write_frame, ClientAuthError, ClientMsg, FrameError, ServerMsg,
};
use kvconnect_api::geometry::Geometry;
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::LayerId;
use std::collections::{HashMap, HashSet};
use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Prefix of the NIXL notification a consumer sends when it has a request's blocks.
pub const NIXL_DONE: &str = "kvc-done ";

fn no_agent() -> TransferError {
    TransferError::Plan(
        "backend 'nixl' selected but this worker has no NIXL agent (regions not registered)".into(),
    )
}

fn peer_agent(peer: &PeerInfo) -> Result<&NixlAgentMetadata, TransferError> {
    peer.meta.nixl.as_ref().ok_or_else(|| {
        TransferError::Plan(format!(
            "producer engine '{}' published no NIXL agent: it does not run backend nixl; use the same backend on both sides",
            peer.meta.engine_id
        ))
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
        "producer engine '{engine}' registered its KV with NIXL as {peer} but this engine's KV is in {own}: backend nixl reads VRAM from VRAM and DRAM from DRAM only; put both sides' KV in GPU memory (kv_buffer_device=\"cuda\") or both in host memory"
    )
}

/// Why backend nixl cannot pull a plan that adapts the layout when the KV is in GPU memory:
/// `what` names the mismatch.
pub(crate) fn vram_adapt_refusal(engine: &str, what: &str) -> String {
    format!(
        "backend nixl reads GPU memory as it lies (VRAM to VRAM, no host copy), so it cannot adapt the KV layout on receive, which loading from producer engine '{engine}' needs ({what}): use backend cuda_ipc (same host), which fuses the permute into its GPU copy, or the same layout and block size on both sides"
    )
}

/// Backend nixl with KV regions in GPU memory: this worker's GPU and its regions' device
/// addresses, which READs write into.
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

/// The address of `len` bytes at `off` in producer region `region`, from its NIXL metadata.
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
                "producer region '{}' at address {base:#x} cannot hold {len} bytes at {off}: the peer's NIXL metadata is corrupt",
                r.name
            ))
        })
}

fn hold(load: &LoadSpec) -> ClientMsg {
    ClientMsg::Hold {
        request: load.producer_request().to_owned(),
        capability: load.remote_capability.clone(),
    }
}

fn done(load: &LoadSpec) -> ClientMsg {
    ClientMsg::Done {
        request: load.producer_request().to_owned(),
        capability: load.remote_capability.clone(),
    }
}

fn check(load: &LoadSpec, plan: &CopyPlan) -> ClientMsg {
    ClientMsg::Check {
        request: load.producer_request().to_owned(),
        capability: load.remote_capability.clone(),
        runs: plan.src_runs(),
    }
}

/// Consumer settings.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// Data path.
    pub backend: Backend,
    /// Timeout of every socket read and write.
    pub io_timeout: Duration,
    /// Timeout of connecting.
    pub connect_timeout: Duration,
    /// Control frame cap.
    pub max_frame: usize,
    /// Threads that copy one large shm pull.
    pub copy_threads: usize,
    /// Parallel streams of one large tcp pull (`crate::tcp_data::streams_for`).
    pub streams: usize,
    /// The least one of those streams carries.
    pub stream_min_bytes: u64,
    /// Send and receive buffer of each tcp connection, bytes (0: the kernel's autotuning).
    pub socket_buffer: usize,
    /// The deployment's data-plane secret (`None`: the producer runs without one, on
    /// loopback).
    pub secret: Option<crate::auth::Secret>,
}

/// What one pull moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullStats {
    /// Bytes copied out of the producer.
    pub bytes: u64,
    /// Contiguous runs (memcpys or socket reads) after coalescing.
    pub runs: usize,
    /// True when the layout or block size was adapted on receive.
    pub adapted: bool,
}

struct Mapped {
    names: Vec<Option<String>>,
    maps: Vec<ShmMapping>,
}

/// Pulls blocks from producers; keeps its connections (the first carries control messages;
/// tcp opens more for parallel streams) and, for shm, the mapped segments, per producer
/// ([`PeerKey`]: engine and address), so two producers claiming one engine id never share
/// or evict each other's. After a transfer error from a producer all of it is dropped and
/// made again from its handshake; connections are also made again for a new handshake.
pub struct Puller {
    cfg: PullConfig,
    /// Per producer: the handshake (`PeerInfo::generation`) they were opened for, and the
    /// connections.
    conns: HashMap<PeerKey, (u64, Vec<TcpStream>)>,
    mapped: HashMap<PeerKey, Mapped>,
    /// Backend nixl: producers whose agent metadata is loaded again before the next READ
    /// (a transfer from them failed).
    nixl_stale: HashSet<PeerKey>,
    nixl: Option<Arc<NixlAgent>>,
    nixl_vram: Option<VramRegions>,
    #[cfg(feature = "cuda")]
    cuda: Option<crate::cuda_ipc::CudaIpcPull>,
}

impl std::fmt::Debug for Puller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Puller").field("backend", &self.cfg.backend).finish()
    }
}

fn timeout_aware(e: io::Error, after: Duration) -> io::Error {
    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no answer within {:.1}s (producer dead or stalled)", after.as_secs_f64()),
        )
    } else {
        e
    }
}

impl Puller {
    /// A puller with no connections yet.
    pub fn new(cfg: PullConfig) -> Puller {
        Puller {
            cfg,
            conns: HashMap::new(),
            mapped: HashMap::new(),
            nixl_stale: HashSet::new(),
            nixl: None,
            nixl_vram: None,
            #[cfg(feature = "cuda")]
            cuda: None,
        }
    }

    /// The device side that backend `cuda_ipc` copies with (this worker's GPU and regions).
    #[cfg(feature = "cuda")]
    pub fn set_cuda(&mut self, cuda: crate::cuda_ipc::CudaIpcPull) {
        self.cuda = Some(cuda);
    }

    /// The NIXL agent that backend `nixl` reads with (this worker's, with its regions
    /// registered, and every peer's metadata loaded).
    pub fn set_nixl(&mut self, agent: Arc<NixlAgent>) {
        self.nixl = Some(agent);
    }

    /// Backend nixl with device KV regions: READs go VRAM to VRAM into these regions.
    pub fn set_nixl_vram(&mut self, regions: VramRegions) {
        self.nixl_vram = Some(regions);
    }

    /// Forgets what is kept for producer `key` (connections, mappings, opened handles) and,
    /// for backend nixl, loads its agent metadata again before the next READ: after a
    /// transfer error the next pull starts from its handshake.
    pub fn forget(&mut self, key: &PeerKey) {
        self.conns.remove(key);
        self.mapped.remove(key);
        #[cfg(feature = "cuda")]
        if let Some(c) = self.cuda.as_mut() {
            c.forget(key);
        }
        if self.nixl.is_some() {
            self.nixl_stale.insert(key.clone());
        }
    }

    fn io(&self, op: &'static str, peer: &PeerInfo, e: io::Error) -> TransferError {
        TransferError::Io {
            op,
            engine: peer.meta.engine_id.clone(),
            addr: peer.addr.to_string(),
            source: timeout_aware(e, self.cfg.io_timeout),
        }
    }

    fn frame_err(&self, op: &'static str, peer: &PeerInfo, e: FrameError) -> TransferError {
        match e {
            FrameError::Io(e) => self.io(op, peer, e),
            FrameError::Closed => self.io(
                op,
                peer,
                io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed by the producer"),
            ),
            other => {
                TransferError::Protocol { engine: peer.meta.engine_id.clone(), message: other.to_string() }
            }
        }
    }

    /// The control connection to `peer`.
    fn conn(&mut self, peer: &PeerInfo) -> Result<&mut TcpStream, TransferError> {
        let engine = peer.meta.engine_id.clone();
        self.streams(peer, 1)?.first_mut().ok_or(TransferError::UnknownPeer(engine))
    }

    /// `n` authenticated connections to `peer` (the first is the control connection), opened
    /// as needed and kept.
    fn streams(&mut self, peer: &PeerInfo, n: usize) -> Result<&mut [TcpStream], TransferError> {
        let key = peer.key();
        // A new handshake may be with a producer that restarted (at the same address or
        // another): never reuse the old streams.
        if self.conns.get(&key).is_some_and(|(generation, v)| {
            *generation != peer.generation || v.iter().any(|s| s.peer_addr().ok() != Some(peer.addr))
        }) {
            self.conns.remove(&key);
        }
        let have = self.conns.get(&key).map_or(0, |(_, v)| v.len());
        for _ in have..n.max(1) {
            let buffer = if self.cfg.backend == Backend::Tcp { self.cfg.socket_buffer } else { 0 };
            let mut s = crate::tcp_data::connect(peer.addr, self.cfg.connect_timeout, buffer)
                .map_err(|e| self.io("connecting", peer, e))?;
            let setup = s
                .set_read_timeout(Some(self.cfg.io_timeout))
                .and_then(|_| s.set_write_timeout(Some(self.cfg.io_timeout)));
            setup.map_err(|e| self.io("configuring the socket", peer, e))?;
            self.authenticate(&mut s, peer)?;
            self.conns.entry(key.clone()).or_insert_with(|| (peer.generation, Vec::new())).1.push(s);
        }
        match self.conns.get_mut(&key) {
            Some((_, v)) => Ok(&mut v[..n.max(1)]),
            None => Err(TransferError::UnknownPeer(key.engine)),
        }
    }

    /// Answers the producer's challenge and checks its proof in turn: a listener that does
    /// not know the deployment's secret is never read from.
    fn authenticate(&self, s: &mut TcpStream, peer: &PeerInfo) -> Result<(), TransferError> {
        let engine = || peer.meta.engine_id.clone();
        authenticate_client(s, self.cfg.secret.as_ref(), self.cfg.max_frame).map_err(|e| match e {
            ClientAuthError::Frame(f) => self.frame_err("authenticating", peer, f),
            ClientAuthError::Refused(reason) => TransferError::Refused { engine: engine(), reason },
            e @ ClientAuthError::WrongServer => {
                TransferError::Refused { engine: engine(), reason: e.to_string() }
            }
            ClientAuthError::Protocol(message) => TransferError::Protocol { engine: engine(), message },
            ClientAuthError::Rng(e) => TransferError::Plan(e.to_string()),
        })
    }

    /// Sends one control message and reads its answer.
    fn call(&mut self, peer: &PeerInfo, msg: &ClientMsg) -> Result<ServerMsg, TransferError> {
        let cap = self.cfg.max_frame;
        let s = self.conn(peer)?;
        let sent = write_frame(s, msg);
        let answer = sent.map_err(FrameError::Io).and_then(|_| read_frame::<_, ServerMsg>(s, cap));
        answer.map_err(|e| self.frame_err("asking", peer, e))
    }

    fn expect_ok(&mut self, peer: &PeerInfo, msg: &ClientMsg) -> Result<(), TransferError> {
        match self.call(peer, msg)? {
            ServerMsg::Ok => Ok(()),
            ServerMsg::Error { reason } => {
                Err(TransferError::Refused { engine: peer.meta.engine_id.clone(), reason })
            }
            other => Err(TransferError::Protocol {
                engine: peer.meta.engine_id.clone(),
                message: format!("answered {other:?} to {msg:?}"),
            }),
        }
    }

    /// Heartbeat: renews the producer's lease on `load`'s request; fails when its blocks are
    /// gone.
    pub fn hold(&mut self, peer: &PeerInfo, load: &LoadSpec) -> Result<(), TransferError> {
        let r = self.expect_ok(peer, &hold(load));
        if matches!(r, Err(TransferError::Io { .. } | TransferError::Protocol { .. })) {
            self.conns.remove(&peer.key());
        }
        r
    }

    /// Tells the producer it may free `request`'s blocks without anything being pulled (the
    /// consumer computes the prompt itself, e.g. a 1-token prompt).
    pub fn release(&mut self, peer: &PeerInfo, load: &LoadSpec) -> Result<PullStats, TransferError> {
        let r = self.expect_ok(peer, &done(load));
        if matches!(r, Err(TransferError::Io { .. } | TransferError::Protocol { .. })) {
            self.conns.remove(&peer.key());
        }
        r.map(|()| PullStats { bytes: 0, runs: 0, adapted: false })
    }

    /// Copies `load` from `peer` into `local`, then tells the producer it is done. On `Ok`
    /// the bytes are in place and the producer confirmed it held them throughout.
    pub fn pull(
        &mut self,
        local: &KvMemory,
        groups: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
    ) -> Result<PullStats, TransferError> {
        let plan = CopyPlan::build(&peer.geometry, local.geometry(), groups, load)?;
        let r = if self.cfg.backend == Backend::CudaIpc {
            self.pull_cuda(local, groups, peer, load, &plan)
        } else {
            self.pull_plan(local, peer, load, &plan)
        };
        if r.as_ref().is_err_and(TransferError::is_transport) {
            // A stream may be mid-message, a mapping or NIXL's endpoints stale: start again
            // from the handshake.
            self.forget(&peer.key());
        }
        r
    }

    /// Backend cuda_ipc: pin the request's blocks at the producer (as for shm), copy them with
    /// one gather launch per KV cache group, then tell the producer.
    fn pull_cuda(
        &mut self,
        local: &KvMemory,
        groups: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
        plan: &CopyPlan,
    ) -> Result<PullStats, TransferError> {
        self.expect_ok(peer, &check(load, plan))?;
        #[cfg(feature = "cuda")]
        {
            let c = self.cuda.as_mut().ok_or_else(|| {
                TransferError::Plan(
                    "backend cuda_ipc selected but this worker has no GPU side (regions not registered)"
                        .into(),
                )
            })?;
            let (bytes, adapted) = c.pull(local.geometry(), groups, peer, load)?;
            self.expect_ok(peer, &done(load))?;
            Ok(PullStats { bytes, runs: groups.len(), adapted })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (local, groups);
            Err(TransferError::Plan("backend cuda_ipc needs a build with `--features cuda`".into()))
        }
    }

    fn pull_plan(
        &mut self,
        local: &KvMemory,
        peer: &PeerInfo,
        load: &LoadSpec,
        plan: &CopyPlan,
    ) -> Result<PullStats, TransferError> {
        let mut dst = LocalRegions::new(local);
        let runs = match plan {
            CopyPlan::Direct(r) => r.len(),
            CopyPlan::Adapt(b) => b.len(),
        };
        match self.cfg.backend {
            Backend::Shm => {
                // Pin the blocks first: a request the producer no longer holds, or runs outside
                // its blocks (params naming another request's blocks), are a failed receive,
                // never a copy of whatever those blocks hold now.
                self.expect_ok(peer, &check(load, plan))?;
                self.map(peer)?;
                let mapped = self
                    .mapped
                    .get(&peer.key())
                    .ok_or_else(|| TransferError::UnknownPeer(peer.meta.engine_id.clone()))?;
                let src = |region: u32, off: u64, len: u64| -> Result<&[u8], TransferError> {
                    let m = mapped
                        .maps
                        .get(region as usize)
                        .ok_or_else(|| TransferError::Plan(format!("no producer region {region}")))?;
                    let s = m.as_slice();
                    let end = off.checked_add(len).filter(|e| *e <= s.len() as u64).ok_or_else(|| {
                        TransferError::Plan(format!(
                            "{len} bytes at {off} do not fit producer segment '{}'",
                            m.name()
                        ))
                    })?;
                    Ok(&s[off as usize..end as usize])
                };
                match plan {
                    CopyPlan::Direct(rs) => {
                        let runs = rs
                            .iter()
                            .map(|r| Ok((*r, src(r.src_region, r.src_off, r.len)?)))
                            .collect::<Result<Vec<_>, TransferError>>()?;
                        dst.write_runs(&runs, self.cfg.copy_threads)?;
                    }
                    CopyPlan::Adapt(bs) => {
                        for b in bs {
                            dst.scatter(&peer.geometry, load, b, src(b.src_region, b.src_off, b.len)?)?;
                        }
                    }
                }
            }
            Backend::Tcp if matches!(plan, CopyPlan::Direct(_)) => {
                self.receive_tcp(&mut dst, peer, load, plan)?
            }
            Backend::Tcp => {
                let total = plan.total_bytes();
                let read = ClientMsg::Read {
                    request: load.producer_request().to_owned(),
                    capability: load.remote_capability.clone(),
                    runs: plan.src_runs(),
                };
                match self.call(peer, &read)? {
                    ServerMsg::Data { bytes } if bytes == total => {}
                    ServerMsg::Error { reason } => {
                        return Err(TransferError::Refused { engine: peer.meta.engine_id.clone(), reason })
                    }
                    other => {
                        return Err(TransferError::Protocol {
                            engine: peer.meta.engine_id.clone(),
                            message: format!("answered {other:?} to a read of {total} bytes"),
                        })
                    }
                }
                let timeout = self.cfg.io_timeout;
                let engine = peer.meta.engine_id.clone();
                let addr = peer.addr.to_string();
                let s = self.conn(peer)?;
                let io = |e: io::Error| TransferError::Io {
                    op: "reading block data",
                    engine: engine.clone(),
                    addr: addr.clone(),
                    source: timeout_aware(e, timeout),
                };
                if let CopyPlan::Adapt(bs) = plan {
                    let mut scratch = Vec::new();
                    for b in bs {
                        scratch.resize(b.len as usize, 0);
                        s.read_exact(&mut scratch).map_err(io)?;
                        dst.scatter(&peer.geometry, load, b, &scratch)?;
                    }
                }
            }
            Backend::CudaIpc => {
                return Err(TransferError::Plan("backend cuda_ipc copies on the GPU (pull_cuda)".into()));
            }
            Backend::Nixl => {
                // Pin first, as for shm: a request the producer no longer holds is a failed
                // receive, never a read of whatever its blocks hold now.
                self.expect_ok(peer, &hold(load))?;
                self.nixl_read(&mut dst, peer, load, plan)?;
                // Still held after the read means held throughout (a freed request is never
                // held again), so the bytes are the request's. Then NIXL tells the producer.
                self.expect_ok(peer, &hold(load))?;
                let agent = self.nixl.as_ref().ok_or_else(no_agent)?;
                let remote = peer_agent(peer)?;
                let note = format!("{NIXL_DONE}{} {}", load.producer_request(), load.remote_capability);
                agent.notify(&remote.agent, note.as_bytes())?;
                return Ok(PullStats {
                    bytes: plan.total_bytes(),
                    runs,
                    adapted: matches!(plan, CopyPlan::Adapt(_)),
                });
            }
        }
        self.expect_ok(peer, &done(load))?;
        Ok(PullStats { bytes: plan.total_bytes(), runs, adapted: matches!(plan, CopyPlan::Adapt(_)) })
    }

    /// Backend tcp, a direct plan: its runs cut into one share per stream (several for a
    /// large pull), each asked for on its own connection and received straight into its
    /// destination blocks, the streams on threads of their own.
    fn receive_tcp(
        &mut self,
        dst: &mut LocalRegions,
        peer: &PeerInfo,
        load: &LoadSpec,
        plan: &CopyPlan,
    ) -> Result<(), TransferError> {
        let CopyPlan::Direct(runs) = plan else {
            return Err(TransferError::Plan("an adapting plan is received on one stream".into()));
        };
        let n = crate::tcp_data::streams_for(plan.total_bytes(), self.cfg.streams, self.cfg.stream_min_bytes);
        let shares = crate::copy_plan::split_runs(runs, n);
        let views = dst.views(&shares)?;
        let reads: Vec<ClientMsg> = shares
            .iter()
            .map(|share| ClientMsg::Read {
                request: load.producer_request().to_owned(),
                capability: load.remote_capability.clone(),
                runs: share.iter().map(|r| (r.src_region, r.src_off, r.len)).collect(),
            })
            .collect();
        let cap = self.cfg.max_frame;
        let streams = self.streams(peer, shares.len())?;
        let mut jobs = streams.iter_mut().zip(reads.iter()).zip(views);
        let results: Vec<Result<(), crate::tcp_data::ShareError>> = match jobs.next() {
            None => Vec::new(),
            Some(((s, read), v)) => std::thread::scope(|scope| {
                let rest: Vec<_> = jobs
                    .map(|((s, read), v)| {
                        scope.spawn(move || crate::tcp_data::receive_share(s, read, v, cap))
                    })
                    .collect();
                let mut out = vec![crate::tcp_data::receive_share(s, read, v, cap)];
                for h in rest {
                    out.push(h.join().unwrap_or_else(|_| {
                        Err(crate::tcp_data::ShareError::Protocol("a receiving thread panicked".into()))
                    }));
                }
                out
            }),
        };
        if let Some(e) = results.into_iter().find_map(Result::err) {
            // Another stream may have stopped mid-answer: reuse none of them.
            self.conns.remove(&peer.key());
            return Err(self.share_err(peer, e));
        }
        Ok(())
    }

    fn share_err(&self, peer: &PeerInfo, e: crate::tcp_data::ShareError) -> TransferError {
        use crate::tcp_data::ShareError;
        let engine = peer.meta.engine_id.clone();
        match e {
            ShareError::Frame(f) => self.frame_err("asking", peer, f),
            ShareError::Io(e) => self.io("reading block data", peer, e),
            ShareError::Refused(reason) => TransferError::Refused { engine, reason },
            ShareError::Protocol(message) => TransferError::Protocol { engine, message },
        }
    }

    /// READs the plan's runs from the producer's registered regions (direct plans straight
    /// into place, one descriptor per coalesced run; adapting plans into a registered staging
    /// buffer, then scattered) and waits for the transfer on this (pull) thread.
    fn nixl_read(
        &mut self,
        dst: &mut LocalRegions,
        peer: &PeerInfo,
        load: &LoadSpec,
        plan: &CopyPlan,
    ) -> Result<(), TransferError> {
        let agent = self.nixl.as_ref().ok_or_else(no_agent)?;
        let remote = peer_agent(peer)?;
        if self.nixl_stale.remove(&peer.key()) {
            // The last transfer from this producer failed: its metadata again, as at the
            // handshake (UCX connects anew).
            let md = crate::nixl_agent::from_hex(&remote.md).ok_or_else(|| TransferError::Protocol {
                engine: peer.meta.engine_id.clone(),
                message: "its NIXL metadata is not hex".into(),
            })?;
            agent.invalidate_remote(&remote.agent);
            agent.load_remote_md(&md)?;
        }
        if self.nixl_vram.is_some() || remote.vram_device.is_some() {
            return self.nixl_read_vram(agent, peer, remote, dst.geometry(), load, plan);
        }
        let src = |region: u32, off: u64, len: u64| producer_addr(peer, remote, region, off, len);
        let mut pairs = Vec::new();
        match plan {
            CopyPlan::Direct(rs) => {
                for r in rs {
                    let local = dst.dst_mut(r.dst_region, r.dst_off, r.len)?.as_mut_ptr() as usize;
                    pairs.push(ReadPair {
                        local,
                        remote: src(r.src_region, r.src_off, r.len)?,
                        len: r.len as usize,
                    });
                }
                self.nixl_wait(agent, peer, &remote.agent, &pairs, NixlMem::Dram, NixlMem::Dram)
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
                // SAFETY: `staging` outlives the registration (dropped at the end of this block,
                // after the transfer finished or was released).
                let reg = unsafe { agent.register_dram(base, staging.len().max(1))? };
                let r = self.nixl_wait(agent, peer, &remote.agent, &pairs, NixlMem::Dram, NixlMem::Dram);
                drop(reg);
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
    fn nixl_read_vram(
        &self,
        agent: &NixlAgent,
        peer: &PeerInfo,
        remote: &NixlAgentMetadata,
        own_geometry: &Geometry,
        load: &LoadSpec,
        plan: &CopyPlan,
    ) -> Result<(), TransferError> {
        let e = &peer.meta.engine_id;
        let (own, far_device) = match (&self.nixl_vram, remote.vram_device) {
            (Some(own), Some(d)) => (own, d),
            (Some(_), None) => return Err(TransferError::Plan(mixed_memory(e, true))),
            _ => return Err(TransferError::Plan(mixed_memory(e, false))),
        };
        let runs = match plan {
            CopyPlan::Direct(runs) => runs,
            CopyPlan::Adapt(_) => {
                let (p, o) = (&peer.geometry, own_geometry);
                let what = format!(
                    "request {}: producer layout {} with {}-token blocks, this engine's {} with {}-token blocks, first token {}",
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
        #[cfg(feature = "cuda")]
        own.gpu.bind().map_err(|err| TransferError::Cuda(err.to_string()))?;
        self.nixl_wait(
            agent,
            peer,
            &remote.agent,
            &pairs,
            NixlMem::Vram(own.device),
            NixlMem::Vram(far_device),
        )
    }

    fn nixl_wait(
        &self,
        agent: &NixlAgent,
        peer: &PeerInfo,
        remote: &str,
        pairs: &[ReadPair],
        local_mem: NixlMem,
        far_mem: NixlMem,
    ) -> Result<(), TransferError> {
        if pairs.is_empty() {
            return Ok(());
        }
        let t = agent.post_read_mem(remote, pairs, local_mem, far_mem)?;
        // Allow the io timeout plus the transfer at a pessimistic 100 MB/s.
        let limit = self.cfg.io_timeout + Duration::from_secs_f64(t.bytes() as f64 / 100e6);
        let start = Instant::now();
        let mut spins = 0u32;
        while !agent.poll(&t)? {
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

    /// Maps the producer's segments (once per engine), checking their sizes.
    fn map(&mut self, peer: &PeerInfo) -> Result<(), TransferError> {
        let names: Vec<Option<String>> = peer.meta.regions.iter().map(|r| r.shm_name.clone()).collect();
        if self.mapped.get(&peer.key()).is_some_and(|m| m.names == names) {
            return Ok(());
        }
        let mut maps = Vec::with_capacity(names.len());
        for r in &peer.meta.regions {
            let name = r.shm_name.as_deref().ok_or_else(|| {
                TransferError::Plan(format!(
                    "producer engine '{}' region '{}' is not in shared memory, so backend shm cannot read it: use backend tcp, or let the producer's pool allocate shm regions",
                    peer.meta.engine_id, r.name
                ))
            })?;
            maps.push(ShmMapping::open(name, r.len)?);
        }
        self.mapped.insert(peer.key(), Mapped { names, maps });
        Ok(())
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
}
