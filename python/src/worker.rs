//! The worker half as vLLM's worker process calls it: vLLM's KV cache tensors become
//! kvconnect regions, the step metadata is unwrapped (handshaking first with every prefill
//! engine it loads from), and the per-layer and per-step calls go to the connector. A
//! producer also serves the side channel decode engines handshake with.

use crate::error::AdapterError;
use crate::meta::{self, Peer};
use crate::regions::{self, TensorDesc};
use crate::sched_link::server::{SchedulerCounters, SchedulerServer};
use crate::setup::Setup;
use kvconnect_api::{BlockId, ConnectorError, LayerId, RequestId, WorkerConnector};
use kvconnect_host::server::connector_setup;
use kvconnect_host::server::peers::peer_envelope;
use kvconnect_host::sidechannel::{LocalIdentity, SideChannelConfig, SideChannelServer};
use pyo3::prelude::*;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

#[derive(Default)]
struct Counters {
    loads_done: u64,
    loads_failed: u64,
    sends_done: u64,
    handshakes: u64,
    handshakes_refused: u64,
    /// Tokens each cache tier supplied (`<connector>_<tier>`), from the connectors' load
    /// reports, taken as vLLM finishes each request.
    cache_tokens: BTreeMap<String, u64>,
}

impl Counters {
    /// Every counter by its stats name, with the scheduler half's when this worker serves it.
    fn named(&self, sched: Option<&SchedulerCounters>) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::from([
            ("loads_done".to_owned(), self.loads_done),
            ("loads_failed".to_owned(), self.loads_failed),
            ("sends_done".to_owned(), self.sends_done),
            ("handshakes".to_owned(), self.handshakes),
            ("handshakes_refused".to_owned(), self.handshakes_refused),
        ]);
        if let Some(sc) = sched {
            m.insert("external_requests".into(), sc.external_requests.load(Ordering::Relaxed));
            m.insert("external_tokens".into(), sc.external_tokens.load(Ordering::Relaxed));
        }
        for (k, v) in &self.cache_tokens {
            m.insert(format!("cache_tokens_{k}"), *v);
        }
        m
    }
}

struct State {
    conn: Box<dyn WorkerConnector>,
    regions: Vec<kvconnect_api::KvRegion>,
    server: Option<SideChannelServer>,
    /// Peers handshaken with: Ok, or why nothing may be loaded from them.
    peers: HashMap<Peer, Result<(), String>>,
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
    /// TP rank 0 serves the connector's scheduler half to vLLM's scheduler process.
    scheduler: Option<SchedulerServer>,
}

impl Worker {
    fn with<T>(
        &self,
        call: &'static str,
        f: impl FnOnce(&mut State) -> Result<T, ConnectorError>,
    ) -> Result<T, AdapterError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut st).map_err(|source| AdapterError::Connector { connector: self.name.clone(), call, source })
    }

    /// Handshakes with `peer` once; a refusal is remembered (a running prefill's descriptor
    /// does not change), an unreachable peer is tried again next time.
    fn ensure_peer(&self, st: &mut State, peer: &Peer) {
        if st.peers.contains_key(peer) {
            return;
        }
        let s = &self.setup;
        let outcome = self.rt.block_on(peer_envelope(
            &peer.addr,
            &peer.engine_id,
            &s.compat,
            &s.ctx.engine_id,
            s.secret.as_ref(),
            s.handshake_timeout,
        ));
        st.counters.handshakes += 1;
        match outcome {
            Ok(envelope) => match st.conn.set_peer_handshake_metadata(&envelope) {
                Ok(()) => {
                    tracing::info!(peer = %peer.engine_id, addr = %peer.addr, "kvconnect: handshake accepted; KV may be loaded from this prefill engine");
                    st.peers.insert(peer.clone(), Ok(()));
                }
                Err(e) => {
                    let why = format!(
                        "the connector rejected prefill engine '{}''s handshake metadata: {e}",
                        peer.engine_id
                    );
                    tracing::error!("kvconnect: {why}");
                    st.peers.insert(peer.clone(), Err(why));
                }
            },
            Err(f) => {
                tracing::error!(reason = f.reason, "kvconnect: {}", f.message);
                if f.reason == "handshake_refused" || f.reason == "wrong_engine" {
                    st.counters.handshakes_refused += 1;
                    st.peers.insert(peer.clone(), Err(f.message));
                }
            }
        }
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
        // them: a connector's halves may share state (lmcache's and flexkv's stores).
        let scheduler = if setup.ctx.tp_rank == 0 {
            let half = connector_setup::create_scheduler(&setup.registry, &setup.ctx)
                .map_err(AdapterError::Negotiation)?;
            Some(SchedulerServer::start(&name, half)?)
        } else {
            None
        };
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
            peers: HashMap::new(),
            counters: Counters::default(),
            reported: BTreeMap::new(),
        };
        Ok(Worker { name, setup, rt, state: Mutex::new(state), scheduler })
    }

    /// Connector, role, effective layout and compat hash, in one line.
    fn summary(&self) -> String {
        self.setup.summary()
    }

    /// Where this worker serves the connector's scheduler half (TP rank 0 only), for vLLM's
    /// scheduler process (`Scheduler.attach`).
    fn scheduler_socket(&self) -> Option<String> {
        self.scheduler.as_ref().map(|s| s.path().display().to_string())
    }

    /// vLLM's KV cache tensors, one per attention layer: `(layer name, layer index, data
    /// pointer, bytes, blocks)`. The caller keeps the tensors alive while this worker lives.
    /// Returns the side channel's address on a producer.
    fn register_kv_caches(&self, tensors: Vec<(String, u32, u64, u64, u32)>) -> PyResult<Option<String>> {
        let descs: Vec<TensorDesc> = tensors
            .into_iter()
            .map(|(name, layer, addr, len, num_blocks)| TensorDesc {
                name,
                layer: LayerId(layer),
                addr,
                len,
                num_blocks,
            })
            .collect();
        let regions = regions::to_regions(&descs, &self.setup.ctx.model, &self.setup.negotiated.effective)?;
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
        tracing::info!(side_channel = %addr, engine = %self.setup.ctx.engine_id, "kvconnect: side channel listening");
        self.state.lock().unwrap_or_else(|p| p.into_inner()).server = Some(server);
        Ok(Some(addr))
    }

    /// This step's metadata from the scheduler half.
    fn bind_connector_meta(&self, meta_bytes: &[u8]) -> PyResult<()> {
        let (peers, inner) = meta::decode(meta_bytes).map_err(AdapterError::Meta)?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        for p in &peers {
            self.ensure_peer(&mut st, p);
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

    /// `(finished sending, finished receiving, failed receiving)` request ids.
    fn get_finished(&self, finished: Vec<String>) -> PyResult<(Vec<String>, Vec<String>, Vec<String>)> {
        let ids: Vec<RequestId> = finished.into_iter().map(RequestId).collect();
        let engine = self.setup.ctx.engine_id.as_str();
        let f = self.with("get_finished", |s| {
            let f = s.conn.get_finished(&ids)?;
            for r in &ids {
                for t in kvconnect_api::load_report::take(engine, &r.0) {
                    *s.counters.cache_tokens.entry(format!("{}_{}", t.connector, t.tier)).or_default() +=
                        t.tokens;
                }
            }
            s.counters.sends_done += f.finished_sending.len() as u64;
            s.counters.loads_done += f.finished_recving.len() as u64;
            s.counters.loads_failed += f.failed_recving.len() as u64;
            Ok(f)
        })?;
        let strs = |v: Vec<RequestId>| v.into_iter().map(|r| r.0).collect();
        Ok((strs(f.finished_sending), strs(f.finished_recving), strs(f.failed_recving)))
    }

    fn block_ids_with_load_errors(&self) -> PyResult<Vec<u32>> {
        let b = self.with("block_ids_with_load_errors", |s| s.conn.block_ids_with_load_errors())?;
        Ok(b.into_iter().map(|b| b.0).collect())
    }

    /// Counters since start, as a JSON object of numbers: loads finished and failed, sends
    /// finished, handshakes, tokens each cache tier supplied and, on the worker that serves
    /// the scheduler half, requests and tokens scheduled to load from outside.
    fn stats_json(&self) -> String {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        json!(st.counters.named(self.scheduler.as_ref().map(|s| s.counters()))).to_string()
    }

    /// What the counters grew by since the last call (only those that grew), for vLLM's
    /// per-interval connector stats.
    fn take_stats_json(&self) -> String {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = st.counters.named(self.scheduler.as_ref().map(|s| s.counters()));
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
