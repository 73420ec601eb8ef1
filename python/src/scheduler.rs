//! The scheduler half as vLLM's scheduler process calls it: requests and block tables in,
//! match answers, step metadata and transfer params out. It remembers which prefill engines
//! this step loads from, so the worker half can handshake with them first.

use crate::error::AdapterError;
use crate::meta::{self, Peer, StepPeers};
use crate::sched_link::client::RemoteScheduler;
use crate::setup::Setup;
use kvconnect_api::{BlockId, BlocksPerGroup, MatchResult, Request, RequestId, SchedulerConnector, StepInfo};
use kvconnect_host::server::peers::remote_peer;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde_json::{Map, Value};
use std::path::PathBuf;
use std::sync::Mutex;

struct State {
    /// The half in the worker process, once vLLM handed over its socket.
    conn: Option<Box<dyn SchedulerConnector>>,
    /// This step's loads and the prefill engines they come from.
    peers: StepPeers,
}

/// The scheduler half of a kvconnect connector inside vLLM.
#[pyclass(module = "kvconnect._kvconnect")]
pub struct Scheduler {
    name: String,
    summary: String,
    state: Mutex<State>,
}

fn request(id: &str, prompt: Vec<u32>, params: Option<&str>) -> Result<Request, AdapterError> {
    let kv_transfer_params = match params {
        None => Map::new(),
        Some(p) => match serde_json::from_str::<Value>(p) {
            Ok(Value::Object(m)) => m,
            Ok(Value::Null) => Map::new(),
            Ok(other) => {
                return Err(AdapterError::Setup(format!(
                    "request {id}: kv_transfer_params must be a JSON object, got {other}"
                )))
            }
            Err(e) => return Err(AdapterError::Setup(format!("request {id}: kv_transfer_params: {e}"))),
        },
    };
    Ok(Request { id: RequestId(id.to_owned()), prompt_tokens: prompt, kv_transfer_params })
}

fn blocks(groups: Vec<Vec<u32>>) -> BlocksPerGroup {
    BlocksPerGroup(groups.into_iter().map(|g| g.into_iter().map(BlockId).collect()).collect())
}

impl Scheduler {
    fn with<T>(
        &self,
        call: &'static str,
        f: impl FnOnce(&mut dyn SchedulerConnector, &mut StepPeers) -> Result<T, kvconnect_api::ConnectorError>,
    ) -> Result<T, AdapterError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let State { conn, peers } = &mut *st;
        let conn = conn.as_mut().ok_or(AdapterError::NotAttached { call })?;
        f(conn.as_mut(), peers).map_err(|source| AdapterError::Connector {
            connector: self.name.clone(),
            call,
            source,
        })
    }
}

#[pymethods]
impl Scheduler {
    /// Negotiates from vLLM's settings (JSON, see `kvconnect.vllm`) and creates the half.
    #[new]
    fn new(setup_json: &str) -> PyResult<Scheduler> {
        crate::init_logging();
        let setup = Setup::from_vllm(setup_json)?;
        let name = setup.ctx.config.kv_connector.clone();
        Ok(Scheduler {
            name,
            summary: setup.summary(),
            state: Mutex::new(State { conn: None, peers: StepPeers::default() }),
        })
    }

    /// The socket at which the worker process (TP rank 0) serves the connector's scheduler
    /// half (`Worker.scheduler_socket`), as vLLM's handshake metadata carried it.
    fn attach(&self, socket: &str) {
        let conn = RemoteScheduler::new(&self.name, PathBuf::from(socket));
        self.state.lock().unwrap_or_else(|p| p.into_inner()).conn = Some(Box::new(conn));
    }

    /// Connector, role, effective layout and compat hash, in one line.
    fn summary(&self) -> String {
        self.summary.clone()
    }

    /// `(tokens, async)`; `tokens` is None while the connector cannot tell yet.
    fn get_num_new_matched_tokens(
        &self,
        request_id: &str,
        prompt_tokens: Vec<u32>,
        params_json: Option<&str>,
        num_computed: usize,
    ) -> PyResult<(Option<usize>, bool)> {
        let req = request(request_id, prompt_tokens, params_json)?;
        let m =
            self.with("get_num_new_matched_tokens", |c, _| c.get_num_new_matched_tokens(&req, num_computed))?;
        Ok(match m {
            MatchResult::Pending => (None, false),
            MatchResult::Matched { tokens, async_load } => (Some(tokens), async_load),
        })
    }

    /// Blocks were allocated; `num_external` tokens will be loaded into them.
    fn update_state_after_alloc(
        &self,
        request_id: &str,
        prompt_tokens: Vec<u32>,
        params_json: Option<&str>,
        block_ids: Vec<Vec<u32>>,
        num_external: usize,
    ) -> PyResult<()> {
        let req = request(request_id, prompt_tokens, params_json)?;
        let peer = remote_peer(&req.kv_transfer_params)
            .map_err(|e| AdapterError::Setup(format!("request {request_id}: {e}")))?;
        let b = blocks(block_ids);
        self.with("update_state_after_alloc", |c, peers| {
            c.update_state_after_alloc(&req, &b, num_external)?;
            if let Some((engine_id, addr)) = peer {
                peers.add(request_id, Peer { engine_id, addr });
            }
            Ok(())
        })?;
        Ok(())
    }

    /// This step's metadata for the workers.
    fn build_connector_meta<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        scheduled: Vec<String>,
        finished: Vec<String>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let info = StepInfo {
            step,
            scheduled: scheduled.into_iter().map(RequestId).collect(),
            finished: finished.into_iter().map(RequestId).collect(),
        };
        let (peers, inner) = self.with("build_connector_meta", |c, peers| {
            let inner = c.build_connector_meta(&info)?;
            Ok((std::mem::take(peers), inner))
        })?;
        let bytes = meta::encode(&peers, &inner).map_err(AdapterError::Meta)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// `(delay_free, kv_transfer_params as JSON or None)`.
    fn request_finished(
        &self,
        request_id: &str,
        prompt_tokens: Vec<u32>,
        params_json: Option<&str>,
        block_ids: Vec<Vec<u32>>,
    ) -> PyResult<(bool, Option<String>)> {
        let req = request(request_id, prompt_tokens, params_json)?;
        let b = blocks(block_ids);
        let r = self.with("request_finished", |c, _| c.request_finished(&req, &b))?;
        let params = r.transfer_params.map(|m| Value::Object(m).to_string());
        Ok((r.delay_free, params))
    }
}
