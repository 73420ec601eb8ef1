//! The worker half as vLLM's worker process calls it: vLLM's KV cache tensors become
//! kvconnect regions, the step metadata is unwrapped (handshaking first with every prefill
//! engine it loads from), and the per-layer and per-step calls go to the connector. A
//! producer also serves the side channel decode engines handshake with.

use crate::error::AdapterError;
use crate::meta::{self, Peer};
use crate::peer_gate::PeerGate;
use crate::regions;
use crate::sched_link::server::{SchedulerCounters, SchedulerServer};
use crate::setup::Setup;
use crate::shm_kv;
use kvconnect_api::engine_tensor::{Placement, TensorDesc};
use kvconnect_api::TierTokens;
use kvconnect_api::{BlockId, ConnectorError, LayerId, LayoutField, RequestId, WorkerConnector};
use kvconnect_server::connector_setup;
use kvconnect_server::peers::{peer_envelope, PeerFailure};
use kvconnect_server::sidechannel::{LocalIdentity, SideChannelConfig, SideChannelServer};
use pyo3::prelude::*;
use serde_json::json;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// The counters each rank reports for itself; the rest are per request, from rank 0.
const PER_RANK: &[&str] = &["handshakes", "handshakes_refused", "loads_failed"];

#[derive(Default)]
struct Counters {
    loads_done: u64,
    loads_failed: u64,
    /// Requests whose blocks a consumer finished reading.
    sends_done: u64,
    /// Requests whose blocks were held for a consumer until their lease ended (none finished
    /// reading them): freed too, but no send.
    sends_expired: u64,
    /// The connector's count of holds that ended by their lease (`holds_expired`), as last
    /// read.
    expired_seen: u64,
    handshakes: u64,
    handshakes_refused: u64,
    /// Tokens each cache tier supplied (`<connector>_<tier>`), from the connectors' load
    /// reports, taken as vLLM finishes each request.
    cache_tokens: BTreeMap<String, u64>,
    /// Requests each source supplied KV to: `peer` (a prefill engine) or a cache tier
    /// (`<connector>_<tier>`); a request two sources served counts once under each.
    loads_by_source: BTreeMap<String, u64>,
}

impl Counters {
    /// Every counter by its stats name, with what this rank's scheduler half decided.
    fn named(&self, sc: &SchedulerCounters) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::from([
            ("loads_done".to_owned(), self.loads_done),
            ("loads_failed".to_owned(), self.loads_failed),
            ("sends_done".to_owned(), self.sends_done),
            ("sends_expired".to_owned(), self.sends_expired),
            ("handshakes".to_owned(), self.handshakes),
            ("handshakes_refused".to_owned(), self.handshakes_refused),
        ]);
        m.insert("external_requests".into(), sc.external_requests.load(Ordering::Relaxed));
        m.insert("external_tokens".into(), sc.external_tokens.load(Ordering::Relaxed));
        for (k, v) in &self.cache_tokens {
            m.insert(format!("cache_tokens_{k}"), *v);
        }
        for (k, v) in &self.loads_by_source {
            m.insert(format!("loads_by_source_{k}"), *v);
        }
        m
    }

    /// A step's finished loads: each asynchronous one (`finished_recving`) is a load done as
    /// it finishes; `async_loaded` keeps it until vLLM finishes the request.
    fn count_async_loads(
        &mut self,
        recving: &[RequestId],
        from_peer: &HashMap<String, Vec<Peer>>,
        async_loaded: &mut HashSet<String>,
    ) {
        for r in recving {
            self.loads_done += 1;
            if from_peer.contains_key(&r.0) {
                *self.loads_by_source.entry("peer".to_owned()).or_default() += 1;
            }
            async_loaded.insert(r.0.clone());
        }
    }

    /// `freed` requests whose blocks the connector no longer holds for a consumer, when its
    /// holds that ended by their lease number `expired` in all: those not counted before are
    /// expired sends (no more than `freed`; the rest wait for the next call), the others done.
    fn count_sends(&mut self, freed: u64, expired: u64) {
        let new = expired.saturating_sub(self.expired_seen).min(freed);
        self.expired_seen += new;
        self.sends_expired += new;
        self.sends_done += freed - new;
    }

    /// A request vLLM finished, with what each cache tier supplied to it: a cache load that
    /// was not asynchronous (lmcache loads within the step) never shows in
    /// `finished_recving`, so it is a load done here.
    fn count_finished(&mut self, tiers: Vec<TierTokens>, counted_async: bool) {
        if !tiers.is_empty() && !counted_async {
            self.loads_done += 1;
        }
        for t in tiers {
            let source = format!("{}_{}", t.connector, t.tier);
            *self.loads_by_source.entry(source.clone()).or_default() += 1;
            *self.cache_tokens.entry(source).or_default() += t.tokens;
        }
    }
}

struct State {
    conn: Box<dyn WorkerConnector>,
    regions: Vec<kvconnect_api::KvRegion>,
    server: Option<SideChannelServer>,
    /// The prefill engine ranks each loading request reads from, until vLLM finishes it.
    load_peer: HashMap<String, Vec<Peer>>,
    /// Why a request's load cannot succeed (its peer was refused), for its failure report.
    failed_why: HashMap<String, String>,
    /// Requests whose asynchronous load finished and was counted, until vLLM finishes them.
    async_loaded: HashSet<String>,
    /// What the connector's tiers supplied to each request (`get_finished`'s
    /// `load_sources`), until vLLM finishes it.
    load_sources: HashMap<String, Vec<TierTokens>>,
    counters: Counters,
    /// The counters as last reported to vLLM (`take_stats_json`).
    reported: BTreeMap<String, u64>,
}

/// The worker half of a kvconnect connector inside vLLM.
#[pyclass(module = "kvconnect._kvconnect")]
pub struct Worker {
    name: String,
    setup: Setup,
    rt: tokio::runtime::Runtime,
    state: Mutex<State>,
    /// Which prefill engines may be handshaken with, and what each answered.
    gate: PeerGate,
    /// This rank's scheduler half, served to vLLM's scheduler process.
    scheduler: SchedulerServer,
}

impl Worker {
    /// This rank's counters by stats name. Every rank sees each request, so the per-request
    /// counts come from rank 0 alone (vLLM sums its workers' stats); each rank counts its own
    /// handshakes and failed loads, which are its own.
    fn counters(&self, st: &State) -> BTreeMap<String, u64> {
        let mut all = st.counters.named(self.scheduler.counters());
        if self.setup.ctx.tp_rank != 0 {
            all.retain(|k, _| PER_RANK.contains(&k.as_str()));
        }
        all
    }

    fn with<T>(
        &self,
        call: &'static str,
        f: impl FnOnce(&mut State) -> Result<T, ConnectorError>,
    ) -> Result<T, AdapterError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut st).map_err(|source| AdapterError::Connector { connector: self.name.clone(), call, source })
    }

    /// Handshakes with `peer` and hands its metadata to the connector; the gate runs this at
    /// most once per peer until it is forgotten or its refusal has aged out.
    fn handshake(&self, peer: &Peer) -> Result<(), PeerFailure> {
        let s = &self.setup;
        let outcome = self.rt.block_on(peer_envelope(
            &peer.addr,
            &peer.engine_id,
            &s.compat,
            &s.ctx.engine_id,
            s.secret.as_ref(),
            s.handshake_timeout,
        ));
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.counters.handshakes += 1;
        let envelope = outcome.map_err(|mut f| {
            if matches!(f.reason, "handshake_refused" | "wrong_engine" | "unauthenticated") {
                st.counters.handshakes_refused += 1;
            }
            if f.diff.iter().any(|d| d.field == LayoutField::Hma) {
                f.message.push_str(
                    "\n  inside vLLM: decode's hybrid KV cache manager is on when its \
                    connector class is KvconnectHmaConnector and the model has several KV cache groups; name \
                    KvconnectConnector on decode (vLLM then turns it off), or give both servers the same \
                    'deployment' file so they negotiate it jointly",
                );
            }
            f
        })?;
        st.conn.set_peer_handshake_metadata(&envelope).map_err(|e| PeerFailure {
            reason: "peer_rejected",
            message: format!(
                "the connector rejected prefill engine '{}''s handshake metadata: {e}",
                peer.engine_id
            ),
            diff: Vec::new(),
        })?;
        tracing::info!(peer = %peer.engine_id, addr = %peer.addr, "kvconnect: handshake accepted; KV may be \
            loaded from this prefill engine");
        Ok(())
    }
}

#[pymethods]
impl Worker {
    /// Negotiates from vLLM's settings (JSON, see `kvconnect.vllm`) and creates the half.
    #[new]
    fn new(setup_json: &str) -> PyResult<Worker> {
        crate::init_logging();
        let setup = Setup::from_vllm(setup_json)?;
        let name = setup.ctx.config.kv_connector.clone();
        // Both halves in this process, scheduler half first, as kvconnect's own workers make
        // them: a connector's halves may share state (lmcache's and flexkv's stores). Every
        // TP rank serves its own half: each rank's store and transfers are its own.
        let half = connector_setup::create_scheduler(&setup.registry, &setup.ctx)
            .map_err(AdapterError::Negotiation)?;
        let scheduler = SchedulerServer::start(&name, half)?;
        let conn =
            connector_setup::create_worker(&setup.registry, &setup.ctx).map_err(AdapterError::Negotiation)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvconnect-sidechannel")
            .enable_all()
            .build()
            .map_err(|e| {
                AdapterError::SideChannel(format!("cannot start the side channel's runtime: {e}"))
            })?;
        let state = State {
            conn,
            regions: Vec::new(),
            server: None,
            load_peer: HashMap::new(),
            failed_why: HashMap::new(),
            async_loaded: HashSet::new(),
            load_sources: HashMap::new(),
            counters: Counters::default(),
            reported: BTreeMap::new(),
        };
        let gate = PeerGate::new(setup.producers.clone());
        Ok(Worker { name, setup, rt, state: Mutex::new(state), gate, scheduler })
    }

    /// Connector, role, effective layout and compat hash, in one line.
    fn summary(&self) -> String {
        self.setup.summary()
    }

    /// Where this worker serves its rank's scheduler half, for vLLM's scheduler process
    /// (`Scheduler.attach`).
    fn scheduler_socket(&self) -> String {
        self.scheduler.path().display().to_string()
    }

    /// Whether this rank's scheduler half matches only decodes' requests (those whose params
    /// ask for a remote prefill), for `Scheduler.attach`.
    fn scheduler_matches_only_remote_prefills(&self) -> bool {
        self.scheduler.matches_only_remote_prefills()
    }

    /// This worker's tensor-parallel rank.
    fn tp_rank(&self) -> u32 {
        self.setup.ctx.tp_rank
    }

    /// The longest an idle step waits, in seconds (the adapter key `idle_step_wait_ms`,
    /// checked at setup, or its default): `kvconnect.vllm` paces vLLM's idle steps with it.
    fn idle_step_wait_s(&self) -> f64 {
        self.setup.idle_step_wait_ms / 1000.0
    }

    /// Whether vLLM's KV cache must be in shared memory (a producer over the nixl `shm`
    /// backend): `kvconnect.vllm` then allocates it through [`Worker::allocate_shared_kv`].
    fn kv_in_shared_memory(&self) -> bool {
        self.setup.shm_kv
    }

    /// The `size`-byte buffer vLLM allocates its whole KV cache as, each layer's blocks a
    /// shared-memory segment: `placements` are vLLM's `KVCacheTensor`s as `(offset,
    /// layer_stride, block_stride, layers, blocks)`. Returns its address, which lives for the
    /// process, and the segments' names.
    fn allocate_shared_kv(
        &self,
        size: u64,
        placements: Vec<(u64, u64, u64, u64, u64)>,
    ) -> PyResult<(u64, Vec<String>)> {
        let p: Vec<Placement> = placements
            .into_iter()
            .map(|(offset, layer_stride, block_stride, num_layers, num_blocks)| Placement {
                offset,
                layer_stride,
                block_stride,
                num_layers,
                num_blocks,
            })
            .collect();
        Ok(shm_kv::allocate(&self.setup.ctx.engine_id, size, &p)?)
    }

    /// vLLM's KV cache tensors, one per attention layer: `(layer name, layer index, data
    /// pointer, shape, strides in elements, element size, dtype, device ordinal or None for
    /// host memory)`, and the blocks vLLM allocated. The caller keeps the tensors alive
    /// while this worker lives. Returns the side channel's address on a producer.
    #[allow(clippy::type_complexity)]
    fn register_kv_caches(
        &self,
        tensors: Vec<(String, u32, u64, Vec<u64>, Vec<u64>, u64, String, Option<i32>)>,
        num_blocks: Option<u64>,
    ) -> PyResult<Option<String>> {
        let descs: Vec<TensorDesc> = tensors
            .into_iter()
            .map(|(name, layer, addr, shape, strides, elem_size, dtype, device)| TensorDesc {
                name,
                layer: LayerId(layer),
                addr,
                shape,
                strides,
                elem_size,
                dtype,
                device,
            })
            .collect();
        let s = &self.setup;
        let regions =
            regions::to_regions(&descs, &s.ctx.model, &s.negotiated.effective, num_blocks, s.shm_kv)?;
        let metadata = self.with("register_kv_caches", |s| {
            s.conn.register_kv_caches(&regions)?;
            s.regions = regions;
            s.conn.handshake_metadata()
        })?;
        let Some((host, port)) = self.setup.side_channel else { return Ok(None) };
        let cfg = SideChannelConfig {
            host,
            port,
            secret: self.setup.secret.clone(),
            ..SideChannelConfig::default()
        };
        let local = LocalIdentity {
            compat: self.setup.compat.clone(),
            engine_id: self.setup.ctx.engine_id.clone(),
            metadata,
        };
        let server = self
            .rt
            .block_on(SideChannelServer::bind(cfg, local))
            .map_err(|e| AdapterError::SideChannel(format!("{e}; pick another side_channel_port")))?;
        let addr = server.local_addr().to_string();
        tracing::info!(side_channel = %addr, engine = %self.setup.ctx.engine_id, "kvconnect: side channel \
            listening");
        self.state.lock().unwrap_or_else(|p| p.into_inner()).server = Some(server);
        Ok(Some(addr))
    }

    /// This step's metadata from the scheduler half: each prefill engine it loads from is
    /// handshaken with first (outside the state lock, one lock per peer); the requests of a
    /// refused one keep the refusal for their failure report.
    fn bind_connector_meta(&self, meta_bytes: &[u8]) -> PyResult<()> {
        let (step, inner) =
            meta::decode(meta_bytes, self.setup.ctx.tp_rank as usize).map_err(AdapterError::Meta)?;
        let refused: Vec<Option<String>> = step
            .peers
            .iter()
            .map(|p| {
                self.gate.ensure(p, || self.handshake(p)).err().map(|f| {
                    tracing::error!(
                        reason = f.reason, peer = %p.engine_id, addr = %p.addr,
                        "kvconnect: {}", f.message
                    );
                    // One line per request: the refusal's header and each field's diff.
                    format!("{} ({})", f.message.replace(":\n  ", ": ").replace("\n  ", "; "), f.reason)
                })
            })
            .collect();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        for (r, i) in &step.loads {
            st.load_peer.entry(r.clone()).or_default().push(step.peers[*i].clone());
            if let Some(why) = &refused[*i] {
                st.failed_why.insert(r.clone(), why.clone());
            }
        }
        st.conn.bind_connector_meta(inner).map_err(|source| AdapterError::Connector {
            connector: self.name.clone(),
            call: "bind_connector_meta",
            source,
        })?;
        Ok(())
    }

    fn start_load_kv(&self) -> PyResult<()> {
        Ok(self.with("start_load_kv", |s| s.conn.start_load_kv())?)
    }

    fn wait_for_layer_load(&self, layer: u32) -> PyResult<()> {
        Ok(self.with("wait_for_layer_load", |s| s.conn.wait_for_layer_load(LayerId(layer)))?)
    }

    fn save_kv_layer(&self, layer: u32, block_ids: Vec<u32>) -> PyResult<()> {
        let ids: Vec<BlockId> = block_ids.into_iter().map(BlockId).collect();
        Ok(self.with("save_kv_layer", |s| s.conn.save_kv_layer(LayerId(layer), &ids))?)
    }

    fn wait_for_save(&self) -> PyResult<()> {
        Ok(self.with("wait_for_save", |s| s.conn.wait_for_save())?)
    }

    /// vLLM preempted these requests and frees their blocks after this returns: the
    /// connector finishes or drops its background work on them first.
    fn handle_preemptions(&self, preempted: Vec<String>) -> PyResult<()> {
        let ids: Vec<RequestId> = preempted.into_iter().map(RequestId).collect();
        Ok(self.with("handle_preemptions", |s| s.conn.handle_preemptions(&ids))?)
    }

    /// `(finished sending, finished receiving, failed receiving)`: request ids, a failed one
    /// with why it failed (the refused handshake's field diff and remedy, when that is why).
    /// A peer a load failed from for another reason is forgotten: the next request
    /// handshakes with it again.
    #[allow(clippy::type_complexity)]
    fn get_finished(
        &self,
        finished: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>, Vec<(String, String)>)> {
        let ids: Vec<RequestId> = finished.into_iter().map(RequestId).collect();
        let mut forget = Vec::new();
        let f = self.with("get_finished", |s| {
            let mut f = s.conn.get_finished(&ids)?;
            s.counters.count_async_loads(&f.finished_recving, &s.load_peer, &mut s.async_loaded);
            for l in std::mem::take(&mut f.load_sources) {
                TierTokens::add_to(s.load_sources.entry(l.request.0).or_default(), l.source);
            }
            for r in &ids {
                let counted_async = s.async_loaded.remove(&r.0);
                s.counters.count_finished(s.load_sources.remove(&r.0).unwrap_or_default(), counted_async);
            }
            if !f.finished_sending.is_empty() {
                // A connector whose metrics fail leaves every freed request counted as done.
                let expired = match s.conn.metrics() {
                    Ok(m) => kvconnect_api::holds_expired(&m),
                    Err(e) => {
                        tracing::warn!(
                            "kvconnect: the connector's metrics failed ({e}); sends that ended by \
                            their lease are counted as done"
                        );
                        s.counters.expired_seen
                    }
                };
                s.counters.count_sends(f.finished_sending.len() as u64, expired);
            }
            s.counters.loads_failed += f.failed_recving.len() as u64;
            let failed: Vec<(String, String)> = f
                .failed_recving
                .iter()
                .map(|r| {
                    let peers = s.load_peer.remove(&r.0).unwrap_or_default();
                    let why = s.failed_why.remove(&r.0).unwrap_or_else(|| {
                        forget.extend(peers.iter().cloned());
                        match peers.as_slice() {
                            [] => "the connector's load failed (see its error above)".to_owned(),
                            [p, ..] => format!(
                                "the load from prefill engine '{}' at {} failed (see the connector's error \
                                    above); the next request handshakes with it again",
                                p.engine_id,
                                peers.iter().map(|p| p.addr.as_str()).collect::<Vec<_>>().join(" and ")
                            ),
                        }
                    });
                    (r.0.clone(), why)
                })
                .collect();
            for r in f.finished_recving.iter().chain(&ids) {
                s.load_peer.remove(&r.0);
                s.failed_why.remove(&r.0);
            }
            // A synchronous load was counted above; vLLM computed with it in the step that
            // loaded it and waits for nothing, so it is not reported (a failed one is, by its
            // blocks, in block_ids_with_load_errors).
            let mut recving: Vec<String> = f.finished_recving.iter().map(|r| r.0.clone()).collect();
            let mut failed = failed;
            {
                let mut sync = self.scheduler.counters().sync_loads.lock().unwrap_or_else(|p| p.into_inner());
                if !sync.is_empty() {
                    recving.retain(|r| {
                        let was_sync = sync.remove(r);
                        if was_sync {
                            tracing::info!(
                                request = %r,
                                "kvconnect worker: request {r} loaded its external KV synchronously"
                            );
                        }
                        !was_sync
                    });
                    failed.retain(|(r, why)| {
                        let was_sync = sync.remove(r);
                        if was_sync {
                            tracing::warn!(
                                request = %r,
                                "kvconnect worker: request {r} failed to load its external KV (a \
                                synchronous load; vLLM recomputes from its first failed block): {why}"
                            );
                        }
                        !was_sync
                    });
                    for r in &ids {
                        sync.remove(&r.0);
                    }
                }
            }
            let strs = |v: &[RequestId]| v.iter().map(|r| r.0.clone()).collect::<Vec<_>>();
            Ok((strs(&f.finished_sending), recving, failed))
        })?;
        for p in &forget {
            self.gate.forget(p);
        }
        Ok(f)
    }

    fn block_ids_with_load_errors(&self) -> PyResult<Vec<u32>> {
        let b = self.with("block_ids_with_load_errors", |s| s.conn.block_ids_with_load_errors())?;
        Ok(b.into_iter().map(|b| b.0).collect())
    }

    /// Counters since start, as a JSON object of numbers: loads finished (from a prefill
    /// engine or a cache tier) and failed, loads by source, sends finished, handshakes, tokens
    /// each cache tier supplied and, on the worker that serves
    /// the scheduler half, requests and tokens scheduled to load from outside.
    fn stats_json(&self) -> String {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        json!(self.counters(&st)).to_string()
    }

    /// What the counters grew by since the last call (only those that grew), for vLLM's
    /// per-interval connector stats.
    fn take_stats_json(&self) -> String {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.counters(&st);
        let delta: BTreeMap<&String, u64> = now
            .iter()
            .filter_map(|(k, v)| {
                let d = v.saturating_sub(st.reported.get(k).copied().unwrap_or(0));
                (d > 0).then_some((k, d))
            })
            .collect();
        let out = json!(delta).to_string();
        st.reported = now;
        out
    }

    fn shutdown(&self) -> PyResult<()> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.server = None;
        st.conn.shutdown().map_err(|source| AdapterError::Connector {
            connector: self.name.clone(),
            call: "shutdown",
            source,
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(connector: &str, tier: &str, tokens: u64) -> TierTokens {
        TierTokens { connector: connector.into(), tier: tier.into(), tokens }
    }

    #[test]
    fn freed_requests_are_sends_done_unless_their_hold_ended_by_its_lease() {
        let mut c = Counters::default();
        c.count_sends(2, 0);
        // One of three freed now ended by its lease (the connector's count went 0 -> 1).
        c.count_sends(3, 1);
        // Nothing new expired.
        c.count_sends(1, 1);
        // A count ahead of what this call freed counts no more than it freed, the rest later.
        c.count_sends(1, 4);
        c.count_sends(3, 4);
        let m = c.named(&SchedulerCounters::default());
        assert_eq!((m["sends_done"], m["sends_expired"]), (6, 4));
    }

    #[test]
    fn every_load_is_done_once_and_counted_by_source() {
        let mut c = Counters::default();
        let mut async_loaded = HashSet::new();
        let peer = Peer { engine_id: "prefill".into(), addr: "127.0.0.1:5600".into() };
        let from_peer = HashMap::from([("p1".to_owned(), vec![peer])]);
        // A load from prefill and an asynchronous cache load (flexkv) finish; the cache
        // load's tiers are reported when vLLM finishes the request.
        c.count_async_loads(&["p1".into(), "f1".into()], &from_peer, &mut async_loaded);
        c.count_finished(Vec::new(), async_loaded.remove("p1"));
        c.count_finished(vec![tier("flexkv", "cpu", 64)], async_loaded.remove("f1"));
        // A synchronous cache load (lmcache) never shows in finished_recving; two tiers served it.
        c.count_finished(
            vec![tier("lmcache", "cpu", 32), tier("lmcache", "disk", 16)],
            async_loaded.remove("l1"),
        );
        // A request nothing was loaded for.
        c.count_finished(Vec::new(), async_loaded.remove("n1"));
        let m = c.named(&SchedulerCounters::default());
        assert_eq!(m["loads_done"], 3);
        assert_eq!(m["loads_by_source_peer"], 1);
        assert_eq!(m["loads_by_source_flexkv_cpu"], 1);
        assert_eq!(m["loads_by_source_lmcache_cpu"], 1);
        assert_eq!(m["loads_by_source_lmcache_disk"], 1);
        assert_eq!(m["cache_tokens_lmcache_cpu"], 32);
        assert_eq!(m["cache_tokens_flexkv_cpu"], 64);
        assert!(async_loaded.is_empty());
    }
}
