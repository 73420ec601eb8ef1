//! The worker half as vLLM's worker process calls it: vLLM's KV cache tensors become
//! kvconnect regions, the step metadata is unwrapped (handshaking first with every prefill
//! engine it loads from), and the per-layer and per-step calls go to the connector. A
//! producer also serves the side channel decode engines handshake with.

use crate::error::AdapterError;
use crate::meta::{self, Peer};
use crate::regions::{self, TensorDesc};
use crate::setup::Setup;
use kvconnect_api::{BlockId, ConnectorError, LayerId, RequestId, WorkerConnector};
use kvconnect_host::server::peers::peer_envelope;
use kvconnect_host::sidechannel::{LocalIdentity, SideChannelConfig, SideChannelServer};
use pyo3::prelude::*;
use serde_json::json;
use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Default)]
struct Counters {
    loads_done: u64,
    loads_failed: u64,
    sends_done: u64,
    handshakes: u64,
    handshakes_refused: u64,
}

struct State {
    conn: Box<dyn WorkerConnector>,
    regions: Vec<kvconnect_api::KvRegion>,
    server: Option<SideChannelServer>,
    /// Peers handshaken with: Ok, or why nothing may be loaded from them.
    peers: HashMap<Peer, Result<(), String>>,
    counters: Counters,
}

/// The worker half of a kvconnect connector inside vLLM.
#[pyclass(module = "kvconnect._kvconnect")]
pub struct Worker {
    name: String,
    setup: Setup,
    rt: tokio::runtime::Runtime,
    state: Mutex<State>,
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
        let conn = kvconnect_host::server::connector_setup::create_worker(&setup.registry, &setup.ctx)
            .map_err(AdapterError::Negotiation)?;
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
        };
        Ok(Worker { name, setup, rt, state: Mutex::new(state) })
    }

    /// Connector, role, effective layout and compat hash, in one line.
    fn summary(&self) -> String {
        self.setup.summary()
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
        let f = self.with("get_finished", |s| {
            let f = s.conn.get_finished(&ids)?;
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

    /// Counters since start, as JSON: loads finished and failed, sends finished, handshakes.
    fn stats_json(&self) -> String {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let c = &st.counters;
        json!({
            "loads_done": c.loads_done,
            "loads_failed": c.loads_failed,
            "sends_done": c.sends_done,
            "handshakes": c.handshakes,
            "handshakes_refused": c.handshakes_refused,
        })
        .to_string()
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
