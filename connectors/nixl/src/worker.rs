//! The worker half: registers the KV regions, runs the producer listener (prefill) and the
//! background pull thread (decode), and reports finished and failed transfers.
//!
//! Nothing here blocks the step loop: `start_load_kv` only posts the step's loads to the
//! pull thread; `get_finished` only collects what finished since the last call.

#![allow(unsafe_code)] // NIXL registration of the KV regions (the NIXL bindings' unsafe contract).

use crate::config::Backend;
use crate::config::{NixlConfig, NAME};
use crate::error::TransferError;
use crate::metadata::NixlAgentMetadata;
use crate::metadata::{LoadSpec, NixlMeta};
use crate::metadata::{PeerInfo, ProducerMetadata, RegionInfo, PROTOCOL_VERSION};
use crate::nixl_agent::NixlMem;
use crate::nixl_agent::{from_hex, to_hex, NixlAgent, Registration};
use crate::producer::{Producer, ProducerConfig};
use crate::puller::{
    mixed_memory, vram_adapt_refusal, PullConfig, PullStats, Puller, VramRegions, NIXL_DONE,
};
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{
    BlockId, ConnectorContext, ConnectorError, ConnectorResult, FinishedTransfers, KvRegion, KvRole, LayerId,
    MemoryKind, RequestId, WorkerConnector,
};
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Handshaken peers by (engine id, side-channel address the host handshook at; empty when
/// the envelope named none).
type Peers = Arc<Mutex<HashMap<(String, String), Arc<PeerInfo>>>>;

/// The peer a load names: the one handshaken at the load's side-channel address, else one
/// whose envelope named no address.
fn find_peer(peers: &Peers, load: &LoadSpec) -> Result<Arc<PeerInfo>, TransferError> {
    let peers = lock(peers);
    let engine = load.remote_engine_id.clone();
    peers
        .get(&(engine.clone(), load.remote_side_channel.clone()))
        .or_else(|| peers.get(&(engine.clone(), String::new())))
        .cloned()
        .ok_or(TransferError::UnknownPeer(engine))
}
type Outcomes = Arc<Mutex<Vec<(LoadSpec, Result<PullStats, TransferError>)>>>;

/// The nixl worker half.
pub struct NixlWorker {
    ctx: ConnectorContext,
    cfg: NixlConfig,
    groups: Vec<Vec<LayerId>>,
    regions: Vec<KvRegion>,
    mem: Option<Arc<KvMemory>>,
    producer: Option<Producer>,
    peers: Peers,
    bound: NixlMeta,
    jobs: Option<Sender<LoadSpec>>,
    puller: Option<JoinHandle<()>>,
    outcomes: Outcomes,
    error_blocks: Vec<BlockId>,
    /// Backend nixl: this worker's agent and its region registrations (dropped first).
    nixl_regs: Vec<Registration>,
    nixl: Option<Arc<NixlAgent>>,
    /// Backend nixl with device KV regions: their GPU and addresses (registered as VRAM).
    nixl_vram: Option<VramRegions>,
    /// Backend cuda_ipc: the GPU of this worker's device regions.
    #[cfg(feature = "cuda")]
    gpu: Option<Arc<kvconnect_cuda::Gpu>>,
}

impl std::fmt::Debug for NixlWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlWorker")
            .field("engine_id", &self.ctx.engine_id)
            .field("producer", &self.producer)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl NixlWorker {
    /// A worker half for `ctx`.
    pub fn new(ctx: &ConnectorContext, cfg: NixlConfig) -> NixlWorker {
        // The KV cache groups, then the state groups: the order of a request's block lists.
        let groups = ctx.effective.groups.iter().map(|g| g.layers.clone());
        let groups = groups.chain(ctx.effective.state_groups.iter().map(|g| g.layers.clone())).collect();
        NixlWorker {
            ctx: ctx.clone(),
            cfg,
            groups,
            regions: Vec::new(),
            mem: None,
            producer: None,
            peers: Arc::default(),
            bound: NixlMeta::default(),
            jobs: None,
            puller: None,
            outcomes: Arc::default(),
            error_blocks: Vec::new(),
            nixl_regs: Vec::new(),
            nixl: None,
            nixl_vram: None,
            #[cfg(feature = "cuda")]
            gpu: None,
        }
    }

    fn is_producer(&self) -> bool {
        matches!(self.ctx.role, KvRole::Producer | KvRole::Both)
    }

    fn is_consumer(&self) -> bool {
        matches!(self.ctx.role, KvRole::Consumer | KvRole::Both)
    }

    /// The producer listener's address, once regions are registered (producer roles).
    pub fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        self.producer.as_ref().map(Producer::addr)
    }

    fn memory(&self) -> ConnectorResult<&Arc<KvMemory>> {
        self.mem
            .as_ref()
            .ok_or_else(|| ConnectorError::invalid(NAME, "register_kv_caches has not been called"))
    }

    fn start_puller(&mut self, mem: Arc<KvMemory>) -> ConnectorResult<()> {
        let (tx, rx) = mpsc::channel();
        let mut puller = Puller::new(PullConfig {
            backend: self.cfg.backend,
            io_timeout: self.cfg.io_timeout,
            connect_timeout: self.cfg.connect_timeout,
            max_frame: self.cfg.max_frame_bytes,
            copy_threads: self.cfg.copy_threads,
            streams: self.cfg.tcp_streams,
            stream_min_bytes: self.cfg.tcp_stream_min_bytes,
            socket_buffer: self.cfg.tcp_socket_buffer,
            secret: self.cfg.secret.clone(),
        });
        if let Some(a) = &self.nixl {
            puller.set_nixl(a.clone());
        }
        if let Some(v) = &self.nixl_vram {
            puller.set_nixl_vram(v.clone());
        }
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            let pull = crate::cuda_ipc::CudaIpcPull::new(gpu.clone(), &self.regions, self.cfg.cuda_ipc_path)
                .map_err(|e| ConnectorError::invalid(NAME, format!("backend cuda_ipc cannot start: {e}")))?;
            puller.set_cuda(pull);
        }
        let ctx = PullLoop {
            puller,
            mem,
            groups: self.groups.clone(),
            peers: self.peers.clone(),
            outcomes: self.outcomes.clone(),
            heartbeat: self.cfg.lease / 3,
        };
        let h = std::thread::Builder::new()
            .name("nixl-pull".into())
            .spawn(move || ctx.run(rx))
            .map_err(|e| ConnectorError::io(NAME, format!("cannot start the pull thread: {e}")))?;
        self.jobs = Some(tx);
        self.puller = Some(h);
        Ok(())
    }

    /// Backend nixl: one agent per worker, named after the engine and process, with every
    /// KV region registered as DRAM, or as VRAM of their GPU when they are device memory.
    fn start_nixl(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        let name = format!("{}-{}", self.ctx.engine_id, std::process::id());
        // UCX's CUDA support looks at the calling thread's context when the backend starts
        // and when memory is registered: make the regions' GPU current first.
        #[cfg(feature = "cuda")]
        if let Some(v) = &self.nixl_vram {
            v.gpu.bind().map_err(|e| ConnectorError::io(NAME, format!("backend nixl with GPU KV: {e}")))?;
        }
        let agent = NixlAgent::new(&name).map_err(|e| ConnectorError::io(NAME, e.to_string()))?;
        let mem = match &self.nixl_vram {
            Some(v) => {
                let m = NixlMem::Vram(v.device);
                if !agent.supports(m) {
                    return Err(ConnectorError::io(
                        NAME,
                        format!(
                            "UCX in this NIXL build offers no transport for VRAM (its UCX backend lists only: {}): use backend cuda_ipc for KV in GPU memory on one host, or a NIXL build with CUDA support",
                            agent.memory_types()
                        ),
                    ));
                }
                m
            }
            None => NixlMem::Dram,
        };
        let mut regs = Vec::with_capacity(regions.len());
        for r in regions {
            // SAFETY: the host keeps every registered region valid memory of its kind (host
            // memory, or cuMemAlloc memory of this GPU for device regions) until shutdown, and
            // shutdown drops these registrations (and the agent) before the memory goes.
            let reg = unsafe { agent.register(r.addr() as usize, r.len() as usize, mem) }.map_err(|e| {
                let hint = match mem {
                    NixlMem::Dram => String::new(),
                    NixlMem::Vram(_) => "; UCX in this NIXL build may offer no transport for VRAM (its CUDA module libuct_cuda needs libcuda.so.1 and libnvidia-ml.so.1 from the NVIDIA driver, its CUDA memory hooks libcudart.so.12, which the nixl-cu12 wheel does not ship): `kvconnect bench nixl-vram` checks this machine, and backend cuda_ipc moves GPU KV on one host without NIXL".into(),
                };
                ConnectorError::io(NAME, format!("region '{}': {e}{hint}", r.name()))
            })?;
            regs.push(reg);
        }
        self.nixl_regs = regs;
        self.nixl = Some(Arc::new(agent));
        Ok(())
    }

    /// Backend nixl: when the regions are device memory, checks they are all on one GPU and
    /// opens it (`nixl_vram`); host regions leave it unset.
    fn start_nixl_vram(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        let Some(first) = regions.iter().find(|r| r.memory() == MemoryKind::Device) else {
            return Ok(());
        };
        for r in regions {
            if r.memory() != MemoryKind::Device {
                return Err(ConnectorError::invalid(
                    NAME,
                    format!(
                        "backend nixl: region '{}' is {:?} memory but region '{}' is in GPU memory: all KV regions of a worker must be in one kind of memory",
                        r.name(), r.memory(), first.name()
                    ),
                ));
            }
            if r.device() < 0 {
                return Err(ConnectorError::invalid(
                    NAME,
                    format!(
                        "backend nixl: region '{}' is in GPU memory but names no GPU (device {}): the host must give device regions their CUDA device ordinal",
                        r.name(), r.device()
                    ),
                ));
            }
            if r.device() != first.device() {
                return Err(ConnectorError::invalid(
                    NAME,
                    format!(
                        "backend nixl: region '{}' is on GPU {} but region '{}' on GPU {}: all KV regions of a worker must be on one GPU",
                        r.name(), r.device(), first.name(), first.device()
                    ),
                ));
            }
        }
        #[cfg(feature = "cuda")]
        {
            let gpu = kvconnect_cuda::Gpu::open(first.device() as usize)
                .map_err(|e| ConnectorError::invalid(NAME, format!("backend nixl with GPU KV: {e}")))?;
            self.nixl_vram = Some(VramRegions {
                device: first.device() as u64,
                regions: regions.iter().map(|r| (r.addr(), r.len())).collect(),
                gpu: Arc::new(gpu),
            });
            Ok(())
        }
        #[cfg(not(feature = "cuda"))]
        Err(ConnectorError::config(
            NAME,
            "backend 'nixl' with KV regions in GPU memory needs a build with `--features cuda` (it registers them with NIXL as VRAM)",
        ))
    }

    /// Backend cuda_ipc: checks the regions are device memory on one GPU and opens it.
    fn start_cuda(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        #[cfg(feature = "cuda")]
        {
            let gpu = crate::cuda_ipc::open_gpu(regions)
                .map_err(|e| ConnectorError::invalid(NAME, e.to_string()))?;
            self.gpu = Some(gpu);
            Ok(())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = regions;
            Err(ConnectorError::config(NAME, "backend 'cuda_ipc' needs a build with `--features cuda`"))
        }
    }

    /// Backend cuda_ipc: the IPC handles of this worker's regions, for the handshake.
    fn cuda_metadata(&self) -> ConnectorResult<Option<crate::metadata::CudaIpcMetadata>> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            return crate::cuda_ipc::export(gpu, &self.regions)
                .map(Some)
                .map_err(|e| ConnectorError::io(NAME, e.to_string()));
        }
        Ok(None)
    }

    fn nixl_metadata(&self) -> ConnectorResult<Option<NixlAgentMetadata>> {
        let Some(a) = &self.nixl else { return Ok(None) };
        let md = a.local_md().map_err(|e| ConnectorError::io(NAME, e.to_string()))?;
        Ok(Some(NixlAgentMetadata {
            agent: a.name().to_owned(),
            md: to_hex(&md),
            region_addrs: self.regions.iter().map(|r| r.addr()).collect(),
            vram_device: self.nixl_vram.as_ref().map(|v| v.device),
        }))
    }

    /// Backend nixl: loads a producer's agent metadata (again only when it changed). With KV
    /// in GPU memory, refuses a producer whose KV is in host memory (or the reverse) and one
    /// whose layout or block size would need adapting on receive.
    fn load_peer_agent(&self, info: &PeerInfo) -> ConnectorResult<()> {
        let Some(a) = &self.nixl else { return Ok(()) };
        let e = &info.meta.engine_id;
        let Some(m) = &info.meta.nixl else {
            return Err(ConnectorError::invalid(
                NAME,
                format!("peer engine '{e}' published no NIXL agent (it does not run backend nixl): use the same backend on both sides"),
            ));
        };
        match (&self.nixl_vram, m.vram_device) {
            (Some(_), None) => return Err(ConnectorError::invalid(NAME, mixed_memory(e, true))),
            (None, Some(_)) => return Err(ConnectorError::invalid(NAME, mixed_memory(e, false))),
            (Some(_), Some(_)) => {
                let own = self.memory()?.geometry();
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
        let known = lock(&self.peers)
            .iter()
            .find(|((engine, _), _)| engine == e)
            .and_then(|(_, p)| p.meta.nixl.clone());
        if known.as_ref().is_some_and(|k| k.md == m.md) {
            return Ok(());
        }
        if let Some(k) = known {
            a.invalidate_remote(&k.agent);
        }
        let md = from_hex(&m.md).ok_or_else(|| {
            ConnectorError::invalid(NAME, format!("peer engine '{e}' NIXL metadata is not hex"))
        })?;
        let name = a
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
}

struct PullLoop {
    puller: Puller,
    mem: Arc<KvMemory>,
    groups: Vec<Vec<LayerId>>,
    peers: Peers,
    outcomes: Outcomes,
    heartbeat: Duration,
}

impl PullLoop {
    fn peer(&self, load: &LoadSpec) -> Result<Arc<PeerInfo>, TransferError> {
        find_peer(&self.peers, load)
    }

    fn finish(&self, load: LoadSpec, r: Result<PullStats, TransferError>) {
        lock(&self.outcomes).push((load, r));
    }

    /// Heartbeats a queued load; a refusal or a dead peer fails it at once.
    fn hold(&mut self, load: &LoadSpec) -> Result<(), TransferError> {
        let peer = self.peer(load)?;
        self.puller.hold(&peer, load)
    }

    fn run(mut self, rx: Receiver<LoadSpec>) {
        // Each queued load with the time of its last heartbeat (None: never sent).
        let mut queue: VecDeque<(LoadSpec, Option<Instant>)> = VecDeque::new();
        loop {
            if queue.is_empty() {
                match rx.recv() {
                    Ok(l) => queue.push_back((l, None)),
                    Err(_) => return,
                }
            }
            loop {
                match rx.recv_timeout(Duration::ZERO) {
                    Ok(l) => queue.push_back((l, None)),
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) if queue.is_empty() => return,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            // Keep the leases of loads still waiting their turn, so a long queue does not
            // let the producer free blocks we are about to pull.
            let mut waiting = VecDeque::with_capacity(queue.len());
            let head = queue.pop_front();
            for (load, last) in queue.drain(..) {
                if last.is_some_and(|t| t.elapsed() < self.heartbeat) {
                    waiting.push_back((load, last));
                    continue;
                }
                match self.hold(&load) {
                    Ok(()) => waiting.push_back((load, Some(Instant::now()))),
                    Err(e) => self.finish(load, Err(e)),
                }
            }
            queue = waiting;
            if let Some((load, _)) = head {
                let r = self.peer(&load).and_then(|peer| {
                    if load.is_release() {
                        self.puller.release(&peer, &load)
                    } else {
                        self.puller.pull(&self.mem, &self.groups, &peer, &load)
                    }
                });
                self.finish(load, r);
            }
        }
    }
}

impl WorkerConnector for NixlWorker {
    fn register_kv_caches(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        if self.mem.is_some() {
            return Err(ConnectorError::invalid(NAME, "register_kv_caches called twice"));
        }
        let ranks = KvMemory::tp_ranks_in(regions);
        if ranks > 1 && !matches!(self.cfg.backend, Backend::Shm | Backend::Tcp) {
            return Err(ConnectorError::not_implemented(
                NAME,
                &format!(
                    "KV regions of {ranks} tensor-parallel ranks on backend '{}' (backends shm and tcp move KV across ranks)",
                    self.cfg.backend.name()
                ),
            ));
        }
        if self.cfg.backend == Backend::Nixl {
            self.start_nixl_vram(regions)?;
        }
        let mem = if self.cfg.backend == Backend::CudaIpc || self.nixl_vram.is_some() {
            // Device regions: this crate never dereferences them on the host; the GPU copies
            // (cuda_ipc) or NIXL moves them VRAM to VRAM.
            if self.cfg.backend == Backend::CudaIpc {
                self.start_cuda(regions)?;
            }
            KvMemory::geometry_only(regions, &self.ctx.model, &self.ctx.effective)
        } else {
            // Host regions, valid until this worker is dropped (`KvRegion::new`); shutdown stops
            // the listener and joins the pull thread, the other users of `mem`, before that.
            // With several ranks' regions (the engine's TP ranks), each rank holds its share
            // of the KV heads in its own regions.
            KvMemory::with_tp_ranks(regions, &self.ctx.model, &self.ctx.effective, ranks)
        }
        .map_err(|e| ConnectorError::invalid(NAME, format!("cannot register KV regions: {e}")))?;
        let mem = Arc::new(mem);
        self.regions = regions.to_vec();
        if self.cfg.backend == Backend::Nixl {
            self.start_nixl(regions)?;
        }
        if self.is_producer() {
            let p = Producer::start(
                mem.clone(),
                ProducerConfig {
                    engine_id: self.ctx.engine_id.clone(),
                    host: self.cfg.host.clone(),
                    port: self.cfg.port,
                    lease: self.cfg.lease,
                    io_timeout: self.cfg.io_timeout,
                    idle_timeout: Duration::from_secs(300).max(self.cfg.lease * 2),
                    max_frame: self.cfg.max_frame_bytes,
                    unknown_grace: (self.cfg.io_timeout / 2).min(Duration::from_secs(3)),
                    secret: self.cfg.secret.clone(),
                    lease_max: self.cfg.lease_max,
                    max_connections: self.cfg.max_connections,
                    serve_reads: self.cfg.backend == Backend::Tcp,
                    socket_buffer: self.cfg.tcp_socket_buffer,
                },
            )
            .map_err(|e| {
                ConnectorError::io(
                    NAME,
                    format!(
                        "cannot listen on {}:{}: {e}; set kv_connector_extra_config.host/port",
                        self.cfg.host, self.cfg.port
                    ),
                )
            })?;
            self.producer = Some(p);
        }
        if self.is_consumer() {
            self.start_puller(mem.clone())?;
        }
        self.mem = Some(mem);
        Ok(())
    }

    fn bind_connector_meta(&mut self, meta: &[u8]) -> ConnectorResult<()> {
        let m: NixlMeta = serde_json::from_slice(meta).map_err(|e| {
            ConnectorError::invalid(
                NAME,
                format!("step metadata from the scheduler half cannot be read: {e}"),
            )
        })?;
        if !m.sends.is_empty() {
            let p = self.producer.as_ref().ok_or_else(|| {
                ConnectorError::invalid(NAME, "requests to keep for remote decode arrived, but this worker is not a producer (kv_role) or has no registered regions")
            })?;
            for s in &m.sends {
                p.hold(s.request.clone(), s.capability.clone(), &s.blocks, &self.groups).map_err(|e| {
                    ConnectorError::invalid(
                        NAME,
                        format!("request {}: its blocks cannot be held: {e}", s.request),
                    )
                })?;
            }
        }
        self.bound.loads.extend(m.loads);
        Ok(())
    }

    fn start_load_kv(&mut self) -> ConnectorResult<()> {
        let loads = std::mem::take(&mut self.bound.loads);
        if loads.is_empty() {
            return Ok(());
        }
        let Some(tx) = self.jobs.as_ref() else {
            return Err(ConnectorError::invalid(NAME, "loads were scheduled, but this worker is not a consumer (kv_role) or has no registered regions"));
        };
        for l in loads {
            if let Err(mpsc::SendError(l)) = tx.send(l) {
                lock(&self.outcomes)
                    .push((l, Err(TransferError::Plan("the pull thread has stopped".into()))));
            }
        }
        Ok(())
    }

    fn save_kv_layer(&mut self, _layer: LayerId, _block_ids: &[BlockId]) -> ConnectorResult<()> {
        // Pull mode: the producer keeps its blocks in place; nothing is saved.
        Ok(())
    }

    fn get_finished(&mut self, _finished_reqs: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        let mut out = FinishedTransfers::default();
        if let Some(p) = &self.producer {
            if let Some(a) = &self.nixl {
                // Consumers tell a NIXL producer they have a request's blocks by notification.
                let notes = a.take_notifications().map_err(|e| ConnectorError::io(NAME, e.to_string()))?;
                for (from, msg) in notes {
                    // `kvc-done <request> <capability>`: an agent that does not know the
                    // capability cannot end another request's hold.
                    match msg.strip_prefix(NIXL_DONE).map(|rest| rest.rsplit_once(' ').unwrap_or((rest, "")))
                    {
                        Some((id, capability)) => {
                            if let Err(why) = p.complete(&RequestId::from(id), capability) {
                                tracing::warn!(agent = %from, "nixl: done notification from '{from}': {why}");
                            }
                        }
                        None => {
                            tracing::warn!(agent = %from, "nixl: ignoring unknown notification '{msg}' from '{from}'")
                        }
                    }
                }
            }
            out.finished_sending = p.take_finished();
        }
        let done = std::mem::take(&mut *lock(&self.outcomes));
        for (load, r) in done {
            if load.is_release() {
                // Nothing was loaded, so nothing is reported; the producer frees its blocks
                // now rather than at lease expiry, or at expiry if this failed.
                if let Err(e) = r {
                    tracing::debug!(request = %load.request, "nixl: releasing the producer's blocks of request {} failed: {e}", load.request);
                }
                continue;
            }
            match r {
                Ok(stats) => {
                    tracing::debug!(request = %load.request, bytes = stats.bytes, runs = stats.runs, "nixl: pulled");
                    out.finished_recving.push(load.request);
                }
                Err(e) => {
                    tracing::warn!(request = %load.request, engine = %load.remote_engine_id, "nixl: loading request {} failed: {e}", load.request);
                    self.error_blocks.extend(load.local_blocks.0.iter().flatten().copied());
                    out.failed_recving.push(load.request);
                }
            }
        }
        Ok(out)
    }

    fn block_ids_with_load_errors(&mut self) -> ConnectorResult<Vec<BlockId>> {
        Ok(std::mem::take(&mut self.error_blocks))
    }

    fn handshake_metadata(&mut self) -> ConnectorResult<Option<serde_json::Value>> {
        let Some(p) = &self.producer else { return Ok(None) };
        let mem = self.memory()?;
        let g = mem.geometry();
        let meta = ProducerMetadata {
            version: PROTOCOL_VERSION,
            engine_id: self.ctx.engine_id.clone(),
            listen: p.addr().to_string(),
            shape: g.shape(),
            tp_size: g.tp_ranks(),
            layout: g.layout(),
            opaque_blocks: g.opaque_blocks(),
            region_shapes: g.regions().to_vec(),
            regions: self
                .regions
                .iter()
                .map(|r| RegionInfo {
                    name: r.name().to_owned(),
                    len: r.len(),
                    group: r.group(),
                    shm_name: r.shm_name().map(str::to_owned),
                })
                .collect(),
            groups: self.groups.clone(),
            state: g.state().clone(),
            pid: std::process::id(),
            nixl: self.nixl_metadata()?,
            cuda_ipc: self.cuda_metadata()?,
        };
        serde_json::to_value(meta)
            .map(Some)
            .map_err(|e| ConnectorError::io(NAME, format!("cannot encode handshake metadata: {e}")))
    }

    fn set_peer_handshake_metadata(&mut self, peer: &serde_json::Value) -> ConnectorResult<()> {
        let mem = self.memory()?;
        let info = PeerInfo::from_envelope(peer, mem.geometry(), &self.groups)?;
        self.load_peer_agent(&info)?;
        tracing::debug!(engine = %info.meta.engine_id, addr = %info.addr, "nixl: peer registered");
        let side_channel = peer.get("side_channel").and_then(serde_json::Value::as_str).unwrap_or_default();
        lock(&self.peers).insert((info.meta.engine_id.clone(), side_channel.to_owned()), Arc::new(info));
        Ok(())
    }

    fn shutdown(&mut self) -> ConnectorResult<()> {
        self.jobs = None;
        if let Some(h) = self.puller.take() {
            let _ = h.join();
        }
        if let Some(mut p) = self.producer.take() {
            p.shutdown();
        }
        self.nixl_regs.clear();
        self.nixl = None;
        self.nixl_vram = None;
        #[cfg(feature = "cuda")]
        {
            self.gpu = None;
        }
        self.mem = None;
        Ok(())
    }
}

impl Drop for NixlWorker {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::{KvLayout, KvRegionSpec};
    use kvconnect_bench::harness::{context, effective, model, Regions};

    /// Backend nixl over `regions` of a 2-layer model (HND, 4-token blocks, 8 blocks).
    fn register(edit: impl Fn(usize, &mut KvRegionSpec)) -> ConnectorResult<()> {
        let m = model(2, 2, 8);
        let eff = effective(&m, KvLayout::HND, 4);
        let ctx = context(&m, &eff, KvRole::Consumer, "decode-0", serde_json::json!({"backend": "nixl"}));
        let cfg = NixlConfig::from_config(&ctx.config).unwrap();
        let host = Regions::allocate(&m, &eff, 8, None).unwrap();
        let regions: Vec<KvRegion> = host
            .regions()
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let mut spec = r.spec().clone();
                edit(i, &mut spec);
                // SAFETY: the memory is `host`'s, alive for the whole test; a region relabelled
                // as device memory is refused before anything touches it.
                unsafe { KvRegion::new(spec) }
            })
            .collect();
        NixlWorker::new(&ctx, cfg).register_kv_caches(&regions)
    }

    #[test]
    fn device_and_host_regions_mixed_are_refused() {
        let e = register(|i, r| {
            if i == 1 {
                r.memory = MemoryKind::Device;
                r.device = 0;
            }
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("all KV regions of a worker must be in one kind of memory"), "{e}");
    }

    #[test]
    fn device_region_without_a_gpu_ordinal_is_refused() {
        let e = register(|_, r| {
            r.memory = MemoryKind::Device;
            r.device = -1;
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("names no GPU (device -1)"), "{e}");
    }

    #[test]
    fn device_regions_on_two_gpus_are_refused() {
        let e = register(|i, r| {
            r.memory = MemoryKind::Device;
            r.device = i as i32;
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("must be on one GPU"), "{e}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn device_regions_without_the_cuda_feature_say_how_to_build() {
        let e = register(|_, r| {
            r.memory = MemoryKind::Device;
            r.device = 0;
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("--features cuda") && e.contains("VRAM"), "{e}");
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
