//! The worker half: starts the backend over the KV regions ([`crate::transport`]), runs the
//! producer listener (prefill) and the background pull thread (decode), and reports finished
//! and failed transfers.
//!
//! Nothing here blocks the step loop for an asynchronous load: `start_load_kv` posts the step's
//! loads to the pull thread (where the backend can, it first starts a copy itself, without
//! waiting: a GPU gather, [`Transport::launch`]); `get_finished` only collects what finished
//! since the last call. A synchronous one (`load: "sync"`) is waited for in
//! `wait_for_layer_load`, before the step computes with its blocks.

use crate::config::{NixlConfig, NAME};
use crate::error::TransferError;
use crate::metadata::{LoadSpec, NixlMeta};
use crate::metadata::{PeerInfo, PeerKey, ProducerMetadata, RegionInfo, PROTOCOL_VERSION};
use crate::producer::{Producer, ProducerConfig};
use crate::puller::{PullConfig, PullStats, Puller};
use crate::transport::{Backend, Setup, Transport};
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{
    BlockId, ConnectorContext, ConnectorError, ConnectorMetric, ConnectorResult, FinishedTransfers, KvRegion,
    KvRole, LayerId, RequestId, WorkerConnector, KV_LOADS_STARTED,
};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Handshaken peers by (engine id, side-channel address the host handshook at; empty when
/// the envelope named none).
type Peers = Arc<Mutex<HashMap<PeerKey, Arc<PeerInfo>>>>;

/// The peer a load names: the one handshaken at the load's side-channel address, else one
/// whose envelope named no address.
fn find_peer(peers: &Peers, load: &LoadSpec) -> Result<Arc<PeerInfo>, TransferError> {
    let peers = lock(peers);
    let engine = load.remote_engine_id.clone();
    let at = |side_channel: String| PeerKey { engine: engine.clone(), side_channel };
    peers
        .get(&at(load.remote_side_channel.clone()))
        .or_else(|| peers.get(&at(String::new())))
        .cloned()
        .ok_or(TransferError::UnknownPeer(engine))
}
/// A load for the pull thread, and whether its copy was started already
/// ([`Transport::launch`], on the step's thread).
struct Job {
    load: LoadSpec,
    launched: bool,
}

/// Loads the pull thread ended, and the signal that one more did.
#[derive(Default)]
struct Outcomes {
    ended: Mutex<Vec<(LoadSpec, Result<PullStats, TransferError>)>>,
    arrived: Condvar,
}

impl Outcomes {
    fn push(&self, load: LoadSpec, r: Result<PullStats, TransferError>) {
        lock(&self.ended).push((load, r));
        self.arrived.notify_all();
    }
}

/// The nixl worker half.
pub struct NixlWorker {
    ctx: ConnectorContext,
    cfg: NixlConfig,
    groups: Vec<Vec<LayerId>>,
    regions: Vec<KvRegion>,
    mem: Option<Arc<KvMemory>>,
    producer: Option<Producer>,
    peers: Peers,
    /// Handshakes taken so far: each peer's `generation`.
    handshakes: u64,
    bound: NixlMeta,
    jobs: Option<Sender<Job>>,
    /// Jobs sent to the pull thread and not ended yet: a copy is started on the step's
    /// thread only when there are none (it is then the pull thread's next).
    in_pull: Arc<AtomicUsize>,
    /// Loads whose copy started on the step's thread, and those the pull thread started.
    started: (u64, u64),
    puller: Option<JoinHandle<()>>,
    outcomes: Arc<Outcomes>,
    /// This step's synchronous loads, until each has ended (`wait_sync`).
    sync_pending: Vec<LoadSpec>,
    error_blocks: Vec<BlockId>,
    /// Requests loading from several producer ranks: how many of their loads ended, and
    /// whether one failed; reported once all have ended, so no load still writes into
    /// blocks the engine was told to recompute.
    parts: HashMap<RequestId, (u32, bool)>,
    /// The started backend (after `register_kv_caches`); dropped at shutdown, after the pull
    /// thread and the listener, before the regions go.
    transport: Option<Arc<dyn Transport>>,
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
            handshakes: 0,
            bound: NixlMeta::default(),
            jobs: None,
            in_pull: Arc::default(),
            started: (0, 0),
            puller: None,
            outcomes: Arc::default(),
            sync_pending: Vec::new(),
            error_blocks: Vec::new(),
            parts: HashMap::new(),
            transport: None,
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

    fn transport(&self) -> ConnectorResult<&Arc<dyn Transport>> {
        self.transport
            .as_ref()
            .ok_or_else(|| ConnectorError::invalid(NAME, "register_kv_caches has not been called"))
    }

    fn start_puller(&mut self, mem: Arc<KvMemory>, transport: Arc<dyn Transport>) -> ConnectorResult<()> {
        let (tx, rx) = mpsc::channel();
        let backend = transport.backend();
        let transport_for_loop = transport.clone();
        let puller = Puller::new(
            PullConfig {
                io_timeout: self.cfg.io_timeout,
                connect_timeout: self.cfg.connect_timeout,
                max_frame: self.cfg.max_frame_bytes,
                // Only where the blocks travel over these connections.
                socket_buffer: if backend.serves_reads { self.cfg.tcp_socket_buffer } else { 0 },
                secret: self.cfg.secret.clone(),
            },
            transport,
        );
        let ctx = PullLoop {
            puller,
            transport: transport_for_loop,
            mem,
            groups: self.groups.clone(),
            peers: self.peers.clone(),
            outcomes: self.outcomes.clone(),
            in_pull: self.in_pull.clone(),
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
}

/// Reports a job's outcome, once no copy it started still runs (`transport`'s).
fn report(
    transport: &dyn Transport,
    in_pull: &AtomicUsize,
    outcomes: &Outcomes,
    job: Job,
    r: Result<PullStats, TransferError>,
) {
    if job.launched {
        transport.settle_launched();
    }
    // Counted out first: whoever sees the outcome finds the pull thread free.
    in_pull.fetch_sub(1, Ordering::AcqRel);
    outcomes.push(job.load, r);
}

struct PullLoop {
    puller: Puller,
    /// The puller's backend, to settle a launched copy with while the puller is busy.
    transport: Arc<dyn Transport>,
    mem: Arc<KvMemory>,
    groups: Vec<Vec<LayerId>>,
    peers: Peers,
    outcomes: Arc<Outcomes>,
    in_pull: Arc<AtomicUsize>,
    heartbeat: Duration,
}

impl PullLoop {
    fn peer(&self, load: &LoadSpec) -> Result<Arc<PeerInfo>, TransferError> {
        find_peer(&self.peers, load)
    }

    /// Reports a job's outcome, once no copy it started still runs.
    fn finish(&self, job: Job, r: Result<PullStats, TransferError>) {
        report(&*self.transport, &self.in_pull, &self.outcomes, job, r);
    }

    /// Heartbeats a queued load; a refusal or a dead peer fails it at once.
    fn hold(&mut self, load: &LoadSpec) -> Result<(), TransferError> {
        let peer = self.peer(load)?;
        self.puller.hold(&peer, load)
    }

    fn run(mut self, rx: Receiver<Job>) {
        // Each queued load with the time of its last heartbeat (None: never sent).
        let mut queue: VecDeque<(Job, Option<Instant>)> = VecDeque::new();
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
            for (job, last) in queue.drain(..) {
                if last.is_some_and(|t| t.elapsed() < self.heartbeat) {
                    waiting.push_back((job, last));
                    continue;
                }
                match self.hold(&job.load) {
                    Ok(()) => waiting.push_back((job, Some(Instant::now()))),
                    Err(e) => self.finish(job, Err(e)),
                }
            }
            queue = waiting;
            if let Some((job, _)) = head {
                let load = &job.load;
                let t0 = Instant::now();
                // A load known whole is reported at once, before the `done` that follows it.
                let mut early = None;
                let r = self.peer(load).and_then(|peer| {
                    if load.is_release() {
                        return self.puller.release(&peer, load);
                    }
                    let (transport, in_pull, outcomes) = (&*self.transport, &*self.in_pull, &*self.outcomes);
                    let whole = &mut |s: PullStats| {
                        let job = Job { load: load.clone(), launched: job.launched };
                        report(transport, in_pull, outcomes, job, Ok(s));
                        early = Some(t0.elapsed());
                    };
                    self.puller.pull_reporting(&self.mem, &self.groups, &peer, load, whole)
                });
                if let (Ok(s), false) = (&r, load.is_release()) {
                    // The transfer alone (pin, copy or stream, done), for benchmarks.
                    let micros = t0.elapsed().as_micros() as u64;
                    let reported_us = early.map(|e| e.as_micros() as u64);
                    tracing::debug!(request = %load.request, bytes = s.bytes, micros, reported_us = ?reported_us,
                        "nixl: pull took");
                }
                if early.is_none() {
                    self.finish(job, r);
                }
            }
        }
    }
}

impl NixlWorker {
    /// Waits until every synchronous load of this step has ended, successfully or not (their
    /// outcomes stay for `get_finished`). It cannot hang: each pull ends within the
    /// connector's connect and I/O timeouts, and should the pull thread stop, what it never
    /// ended fails here.
    fn wait_sync(&mut self) {
        if self.sync_pending.is_empty() {
            return;
        }
        let mut ended = lock(&self.outcomes.ended);
        loop {
            // A request loading from several producer ranks has one load per rank.
            let count = |r: &RequestId, of: &mut dyn Iterator<Item = &LoadSpec>| {
                of.filter(|l| l.sync && l.request == *r).count()
            };
            let done = self.sync_pending.iter().all(|p| {
                count(&p.request, &mut ended.iter().map(|(l, _)| l))
                    >= count(&p.request, &mut self.sync_pending.iter())
            });
            if done {
                self.sync_pending.clear();
                return;
            }
            if self.puller.as_ref().is_none_or(JoinHandle::is_finished) {
                // Fail what never ended: per request, the loads past those that did.
                let mut seen: HashMap<RequestId, usize> = HashMap::new();
                for (l, _) in ended.iter().filter(|(l, _)| l.sync) {
                    *seen.entry(l.request.clone()).or_default() += 1;
                }
                for l in std::mem::take(&mut self.sync_pending) {
                    match seen.get_mut(&l.request) {
                        Some(n) if *n > 0 => *n -= 1,
                        _ => ended.push((l, Err(TransferError::Plan("the pull thread has stopped".into())))),
                    }
                }
                return;
            }
            ended = match self.outcomes.arrived.wait_timeout(ended, Duration::from_millis(100)) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

impl NixlWorker {
    /// Starts `load`'s copy here, on the step's thread, where the backend can without waiting
    /// ([`Transport::launch`]) and the pull thread has nothing else to do first. Anything that
    /// stops it (a peer not handshaken, a load the backend refuses) leaves the load to the
    /// pull thread, which reports it.
    fn launch(&self, load: &LoadSpec) -> bool {
        if load.is_release() || load.sources > 1 || self.in_pull.load(Ordering::Acquire) > 0 {
            return false;
        }
        let (Some(mem), Some(t)) = (&self.mem, &self.transport) else { return false };
        let Ok(peer) = find_peer(&self.peers, load) else { return false };
        match t.launch(mem, &self.groups, &peer, load) {
            Ok(launched) => launched,
            Err(e) => {
                tracing::debug!(request = %load.request, "nixl: not started on the step's thread ({e}); the \
                    pull thread takes it");
                false
            }
        }
    }
}

impl WorkerConnector for NixlWorker {
    fn register_kv_caches(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        if self.mem.is_some() {
            return Err(ConnectorError::invalid(NAME, "register_kv_caches called twice"));
        }
        let backend = self.cfg.backend;
        let ranks = KvMemory::tp_ranks_in(regions);
        if ranks > 1 && !backend.across_tp {
            return Err(ConnectorError::not_implemented(
                NAME,
                &format!(
                    "KV regions of {ranks} tensor-parallel ranks on backend '{}' (backends {} move KV across \
                        ranks)",
                    backend.name(),
                    Backend::names_where(|b| b.across_tp)
                ),
            ));
        }
        let started = (backend.start)(&Setup {
            regions,
            ctx: &self.ctx,
            cfg: &self.cfg,
            tp_ranks: ranks,
            producer: self.is_producer(),
            consumer: self.is_consumer(),
        })?;
        let mem = Arc::new(started.mem);
        self.regions = regions.to_vec();
        if self.is_producer() {
            let p = Producer::start(
                mem.clone(),
                ProducerConfig {
                    engine_id: self.ctx.engine_id.clone(),
                    host: self.cfg.host.clone(),
                    port: self.cfg.port,
                    lease: self.cfg.lease,
                    io_timeout: self.cfg.io_timeout,
                    idle_timeout: self.cfg.idle_timeout,
                    max_frame: self.cfg.max_frame_bytes,
                    unknown_grace: (self.cfg.io_timeout / 2).min(Duration::from_secs(3)),
                    secret: self.cfg.secret.clone(),
                    lease_max: self.cfg.lease_max,
                    max_connections: self.cfg.max_connections,
                    serve_reads: backend.serves_reads,
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
            self.start_puller(mem.clone(), started.transport.clone())?;
        }
        self.transport = Some(started.transport);
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
                ConnectorError::invalid(
                    NAME,
                    "requests to keep for remote decode arrived, but this worker \
                    is not a producer (kv_role) or has no registered regions",
                )
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
            return Err(ConnectorError::invalid(
                NAME,
                "loads were scheduled, but this worker is not a \
                consumer (kv_role) or has no registered regions",
            ));
        };
        for l in loads {
            if l.sync {
                self.sync_pending.push(l.clone());
            }
            let launched = self.launch(&l);
            if !l.is_release() {
                match launched {
                    true => self.started.0 += 1,
                    false => self.started.1 += 1,
                }
            }
            self.in_pull.fetch_add(1, Ordering::AcqRel);
            if let Err(mpsc::SendError(job)) = tx.send(Job { load: l, launched }) {
                if job.launched {
                    if let Some(t) = &self.transport {
                        t.settle_launched();
                    }
                }
                self.in_pull.fetch_sub(1, Ordering::AcqRel);
                self.outcomes.push(job.load, Err(TransferError::Plan("the pull thread has stopped".into())));
            }
        }
        Ok(())
    }

    fn wait_for_layer_load(&mut self, _layer: LayerId) -> ConnectorResult<()> {
        // A synchronous load is whole before the first layer computes: later layers find
        // nothing pending.
        self.wait_sync();
        Ok(())
    }

    fn save_kv_layer(&mut self, _layer: LayerId, _block_ids: &[BlockId]) -> ConnectorResult<()> {
        // Pull mode: the producer keeps its blocks in place; nothing is saved.
        Ok(())
    }

    fn get_finished(&mut self, _finished_reqs: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        let mut out = FinishedTransfers::default();
        if let (Some(p), Some(t)) = (&self.producer, &self.transport) {
            // Completions that reached this producer outside its listener (NIXL
            // notifications): the capability they name decides, as for `done`.
            for c in t.completions()? {
                if let Err(why) = p.complete(&c.request, &c.capability) {
                    tracing::warn!(agent = %c.from, "nixl: done notification from '{}': {why}", c.from);
                }
            }
            out.finished_sending = p.take_finished();
        }
        // A step with no forward (or a caller that skips the per-layer calls) still reports
        // its synchronous loads in this step.
        self.wait_sync();
        let done = std::mem::take(&mut *lock(&self.outcomes.ended));
        for (load, r) in done {
            if load.is_release() {
                // Nothing was loaded, so nothing is reported; the producer frees its blocks
                // now rather than at lease expiry, or at expiry if this failed.
                if let Err(e) = r {
                    tracing::debug!(request = %load.request, "nixl: releasing the producer's blocks of \
                        request {} failed: {e}", load.request);
                }
                continue;
            }
            let failed = match r {
                Ok(stats) => {
                    tracing::debug!(request = %load.request, bytes = stats.bytes, runs = stats.runs, "nixl: \
                        pulled");
                    false
                }
                Err(e) => {
                    tracing::warn!(
                        request = %load.request, engine = %load.remote_engine_id,
                        side_channel = %load.remote_side_channel,
                        "nixl: loading request {} failed: {e}", load.request
                    );
                    true
                }
            };
            let failed = if load.sources > 1 {
                let part = self.parts.entry(load.request.clone()).or_default();
                part.0 += 1;
                part.1 |= failed;
                if part.0 < load.sources {
                    continue;
                }
                self.parts.remove(&load.request).is_some_and(|(_, f)| f)
            } else {
                failed
            };
            if failed {
                let (groups, bs) = (self.ctx.effective.groups.len(), self.ctx.effective.block_size);
                self.error_blocks.extend(load.written_blocks(groups, bs as usize));
                out.failed_recving.push(load.request);
            } else {
                out.finished_recving.push(load.request);
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
        let mut meta = ProducerMetadata {
            version: PROTOCOL_VERSION,
            engine_id: self.ctx.engine_id.clone(),
            listen: p.addr().to_string(),
            shape: g.shape(),
            tp_size: g.tp_size(),
            tp_rank: (g.tp_ranks() == 1 && g.tp_size() > 1).then_some(g.held_ranks().start),
            layout: g.layout(),
            opaque_blocks: g.opaque_blocks(),
            opaque_heads_outer: g.opaque_heads_outer(),
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
            nixl: None,
            cuda_ipc: None,
        };
        self.transport()?.publish(&mut meta)?;
        serde_json::to_value(meta)
            .map(Some)
            .map_err(|e| ConnectorError::io(NAME, format!("cannot encode handshake metadata: {e}")))
    }

    fn set_peer_handshake_metadata(&mut self, peer: &serde_json::Value) -> ConnectorResult<()> {
        let mem = self.memory()?;
        let mut info = PeerInfo::from_envelope(peer, mem.geometry(), &self.groups)?;
        self.transport()?.admit(&info, mem.geometry(), &lock(&self.peers))?;
        tracing::debug!(
            engine = %info.meta.engine_id, side_channel = %info.side_channel, addr = %info.addr,
            "nixl: peer registered"
        );
        self.handshakes += 1;
        info.generation = self.handshakes;
        lock(&self.peers).insert(info.key(), Arc::new(info));
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
        self.transport = None;
        self.mem = None;
        Ok(())
    }

    fn metrics(&mut self) -> ConnectorResult<Vec<ConnectorMetric>> {
        let mut out = self.producer.as_ref().map(Producer::metrics).unwrap_or_default();
        if self.jobs.is_some() {
            const HELP: &str = "Loads from a prefill engine by where their copy started: step (by \
                start_load_kv itself, a GPU gather launched without waiting) or pull_thread.";
            for (on, v) in [("step", self.started.0), ("pull_thread", self.started.1)] {
                out.push(ConnectorMetric::counter(KV_LOADS_STARTED, HELP, v).label("on", on));
            }
        }
        Ok(out)
    }
}

impl Drop for NixlWorker {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

#[allow(unsafe_code)] // The tests vouch for regions over buffers they own (`KvRegion::new`).
#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::{KvLayout, KvRegionSpec, MemoryKind};
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
}
