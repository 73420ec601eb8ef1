//! The scheduler half as vLLM's scheduler process calls it: requests and block tables in,
//! match answers, step metadata and transfer params out. Every tensor-parallel rank runs its
//! own connector, scheduler half included (`kvconnect_api::tp_ranks`): each call goes to every
//! rank's half at once (`sched_link::client::call_each`) and their answers are combined, and
//! each rank's step metadata is its own half's.
//! It remembers which prefill engines each rank loads from this step, so that rank's worker
//! can handshake with them first.
//!
//! The calls to the worker processes run without the GIL: while one waits for its answer, the
//! scheduler process's other threads (vLLM's engine core receives requests and sends outputs
//! from threads of its own) go on.

use crate::error::AdapterError;
use crate::meta::{self, Peer, StepPeers};
use crate::sched_link::client::{self, Answer, RemoteScheduler};
use crate::sched_link::Call;
use crate::setup::Setup;
use kvconnect_api::tp_ranks::{self, params_for_rank};
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorResult, KvEvent, MatchResult, Request, RequestId, SchedulerConnector,
    StepInfo,
};
use kvconnect_dataplane::params::asks_remote_prefill;
use kvconnect_server::peers::remote_peer;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde_json::{Map, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// One tensor-parallel rank's scheduler half and what it loads this step.
struct Rank {
    /// The half in that rank's worker process.
    conn: RemoteScheduler,
    /// This step's loads and the prefill engines they come from.
    peers: StepPeers,
}

struct State {
    /// Every rank's half, in rank order, once vLLM handed over their sockets.
    ranks: Vec<Rank>,
    /// Every rank's half matches only decodes' requests: the others are answered here.
    matches_only_remote_prefills: bool,
}

/// The scheduler half of a kvconnect connector inside vLLM.
#[pyclass(module = "kvconnect._kvconnect")]
pub struct Scheduler {
    name: String,
    summary: String,
    state: Mutex<State>,
    /// Requests computed here because their producer ran at a TP size that does not divide
    /// this engine's, since the last `take_refused_loads`.
    refused_loads: AtomicU64,
    /// Matches answered here without a call to the workers (`matches_only_remote_prefills`),
    /// since the last `take_matches_answered_here`.
    matches_answered_here: AtomicU64,
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
    fn err(&self, call: &'static str) -> impl Fn(kvconnect_api::ConnectorError) -> AdapterError + '_ {
        move |source| AdapterError::Connector { connector: self.name.clone(), call, source }
    }

    /// `f` of every rank, in rank order, once vLLM attached them.
    fn ranks_do<T>(
        &self,
        call: &'static str,
        f: impl FnOnce(&mut [Rank]) -> Result<T, AdapterError>,
    ) -> Result<T, AdapterError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.ranks.is_empty() {
            return Err(AdapterError::NotAttached { call });
        }
        f(&mut st.ranks)
    }

    /// Runs `f` on every rank's half, one after the other, in rank order.
    fn each<T>(
        &self,
        call: &'static str,
        mut f: impl FnMut(usize, &mut Rank) -> Result<T, kvconnect_api::ConnectorError>,
    ) -> Result<Vec<T>, AdapterError> {
        self.ranks_do(call, |ranks| {
            ranks.iter_mut().enumerate().map(|(i, r)| f(i, r).map_err(self.err(call))).collect()
        })
    }

    /// `call(rank)` to every rank's half at once (`client::call_each`), each answer read by
    /// `read`; the answers in rank order, or the first rank's error.
    fn call_each<T>(
        &self,
        method: &'static str,
        call: impl Fn(usize) -> Call,
        read: impl Fn(&RemoteScheduler, Answer) -> ConnectorResult<T>,
    ) -> Result<Vec<T>, AdapterError> {
        self.ranks_do(method, |ranks| {
            let each = client::call_each(ranks.iter_mut().map(|r| &mut r.conn), call, read);
            each.into_iter().map(|r| r.map_err(self.err(method))).collect()
        })
    }

    fn ranks(&self) -> usize {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).ranks.len()
    }

    /// The request as rank `rank` of `ranks` sees it: with the params of the producer rank it
    /// loads from.
    fn rank_request(req: &Request, rank: usize, ranks: usize) -> Result<Request, AdapterError> {
        let kv_transfer_params = params_for_rank(&req.kv_transfer_params, rank, ranks)
            .map_err(|e| AdapterError::Request { request: req.id.0.clone(), message: e.to_string() })?;
        Ok(Request { kv_transfer_params, ..req.clone() })
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
            state: Mutex::new(State { ranks: Vec::new(), matches_only_remote_prefills: false }),
            refused_loads: AtomicU64::new(0),
            matches_answered_here: AtomicU64::new(0),
        })
    }

    /// The sockets at which the worker processes serve their ranks' scheduler halves
    /// (`Worker.scheduler_socket`), in TP rank order, as vLLM's handshake metadata carried them;
    /// whether every one of those halves matches only decodes' requests
    /// (`Worker.scheduler_matches_only_remote_prefills`).
    fn attach(&self, sockets: Vec<String>, matches_only_remote_prefills: bool) {
        let ranks = sockets
            .iter()
            .map(|s| Rank {
                conn: RemoteScheduler::new(&self.name, PathBuf::from(s)),
                peers: StepPeers::default(),
            })
            .collect();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.ranks = ranks;
        st.matches_only_remote_prefills = matches_only_remote_prefills;
    }

    /// Connector, role, effective layout and compat hash, in one line.
    fn summary(&self) -> String {
        self.summary.clone()
    }

    /// How many requests were computed here since the last call because their producer ran
    /// at another TP size (for vLLM's per-interval stats).
    fn take_refused_loads(&self) -> u64 {
        self.refused_loads.swap(0, Ordering::Relaxed)
    }

    /// How many matches were answered here since the last call, 0 tokens without a call to
    /// the worker processes, because every rank's half matches only decodes' requests (for
    /// vLLM's per-interval stats: an operator sees the saved round trips, a test that they
    /// happen).
    fn take_matches_answered_here(&self) -> u64 {
        self.matches_answered_here.swap(0, Ordering::Relaxed)
    }

    /// `(tokens, async)`; `tokens` is None while the connector cannot tell yet: what every
    /// rank can load. A request whose producer ran at a TP size that does not divide this
    /// engine's (nor it the other) loads nothing: its prompt is computed here, and the log
    /// says why at ERROR. A request that is not a decode's (no `do_remote_prefill`) is
    /// answered here, 0 tokens, where every rank's half matches only decodes' requests.
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        request_id: &str,
        prompt_tokens: Vec<u32>,
        params_json: Option<&str>,
        num_computed: usize,
    ) -> PyResult<(Option<usize>, bool)> {
        let req = request(request_id, prompt_tokens, params_json)?;
        let local = self.state.lock().unwrap_or_else(|p| p.into_inner()).matches_only_remote_prefills;
        if local && !asks_remote_prefill(&req) {
            self.matches_answered_here.fetch_add(1, Ordering::Relaxed);
            return Ok((Some(0), false));
        }
        let n = self.ranks();
        let reqs = match (0..n).map(|r| Self::rank_request(&req, r, n)).collect::<Result<Vec<_>, _>>() {
            Ok(reqs) => reqs,
            Err(e) => {
                tracing::error!("{e}; this server computes the request's prompt itself");
                self.refused_loads.fetch_add(1, Ordering::Relaxed);
                return Ok((Some(0), false));
            }
        };
        let each = py.detach(|| {
            self.call_each(
                "get_num_new_matched_tokens",
                |r| Call::Match { request: reqs[r].clone(), num_computed },
                RemoteScheduler::read_match,
            )
        })?;
        Ok(match tp_ranks::combine_matches(&each) {
            MatchResult::Pending => (None, false),
            MatchResult::Matched { tokens, async_load } => (Some(tokens), async_load),
        })
    }

    /// Blocks were allocated; `num_external` tokens will be loaded into them.
    fn update_state_after_alloc(
        &self,
        py: Python<'_>,
        request_id: &str,
        prompt_tokens: Vec<u32>,
        params_json: Option<&str>,
        block_ids: Vec<Vec<u32>>,
        num_external: usize,
    ) -> PyResult<()> {
        let req = request(request_id, prompt_tokens, params_json)?;
        let n = self.ranks();
        let b = blocks(block_ids);
        let mut reqs = Vec::with_capacity(n);
        for r in 0..n {
            let rr = match Self::rank_request(&req, r, n) {
                Ok(rr) => rr,
                // Refused at the match (nothing loads): no rank's half hears of the producer.
                Err(_) if num_external == 0 => {
                    Request { kv_transfer_params: Default::default(), ..req.clone() }
                }
                Err(e) => return Err(e.into()),
            };
            // Every producer rank this rank reads (several when prefill ran at a larger TP size).
            let peers = tp_ranks::sources(&rr.kv_transfer_params)
                .iter()
                .map(remote_peer)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| AdapterError::Setup(format!("request {request_id}: {e}")))?;
            reqs.push((rr, peers));
        }
        py.detach(|| {
            self.each("update_state_after_alloc", |r, rank| {
                let (rr, peers) = &reqs[r];
                rank.conn.update_state_after_alloc(rr, &b, num_external)?;
                for (engine_id, addr) in peers.iter().flatten() {
                    rank.peers.add(request_id, Peer { engine_id: engine_id.clone(), addr: addr.clone() });
                }
                Ok(())
            })
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
        let each = py.detach(|| {
            self.ranks_do("build_connector_meta", |ranks| {
                let call = |_| Call::Meta { step: info.clone() };
                let inner = client::call_each(
                    ranks.iter_mut().map(|r| &mut r.conn),
                    call,
                    RemoteScheduler::read_meta,
                );
                ranks
                    .iter_mut()
                    .zip(inner)
                    .map(|(rank, inner)| {
                        Ok((
                            std::mem::take(&mut rank.peers),
                            inner.map_err(self.err("build_connector_meta"))?,
                        ))
                    })
                    .collect::<Result<Vec<_>, AdapterError>>()
            })
        })?;
        let bytes = meta::encode(&each).map_err(AdapterError::Meta)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Empties every rank's store (vLLM's `/reset_prefix_cache?reset_external=true`): true
    /// when every rank's half emptied its own, false when one could not now (vLLM's caller
    /// may retry). Every rank is asked, whatever the others answered.
    fn reset_cache(&self, py: Python<'_>) -> PyResult<bool> {
        let each =
            py.detach(|| self.call_each("reset_cache", |_| Call::Reset, RemoteScheduler::read_reset))?;
        Ok(each.into_iter().all(|ok| ok))
    }

    /// The connector's KV events since the last call, as `(kind, block_hashes,
    /// parent_block_hash, token_ids, block_size, medium)` with kind `stored`, `removed`
    /// (parent None, no tokens, block size 0) or `cleared` (no hashes, medium empty): rank 0's,
    /// since every rank stores its share of the same blocks under the same hashes (the
    /// other ranks' queues are bounded and drop their oldest).
    #[allow(clippy::type_complexity)]
    fn take_events(
        &self,
        py: Python<'_>,
    ) -> PyResult<Vec<(&'static str, Vec<u64>, Option<u64>, Vec<u32>, u32, String)>> {
        let events = py.detach(|| {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let Some(rank) = st.ranks.first_mut() else {
                return Err(AdapterError::NotAttached { call: "take_events" });
            };
            rank.conn.take_events().map_err(self.err("take_events"))
        })?;
        Ok(events
            .into_iter()
            .map(|e| match e {
                KvEvent::BlockStored(s) => (
                    "stored",
                    s.block_hashes,
                    s.parent_block_hash,
                    s.token_ids,
                    s.block_size,
                    s.medium.to_string(),
                ),
                KvEvent::BlockRemoved(r) => {
                    ("removed", r.block_hashes, None, Vec::new(), 0, r.medium.to_string())
                }
                KvEvent::AllBlocksCleared => ("cleared", Vec::new(), None, Vec::new(), 0, String::new()),
            })
            .collect())
    }

    /// `(delay_free, kv_transfer_params as JSON or None)`: blocks kept while any rank keeps
    /// them; at several ranks the params list every rank's own (`kvconnect_api::tp_ranks`).
    fn request_finished(
        &self,
        py: Python<'_>,
        request_id: &str,
        prompt_tokens: Vec<u32>,
        params_json: Option<&str>,
        block_ids: Vec<Vec<u32>>,
    ) -> PyResult<(bool, Option<String>)> {
        let req = request(request_id, prompt_tokens, params_json)?;
        let b = blocks(block_ids);
        let each = py.detach(|| {
            self.call_each(
                "request_finished",
                |_| Call::Finished { request: req.clone(), blocks: b.clone() },
                RemoteScheduler::read_finished,
            )
        })?;
        let r = tp_ranks::combine_finished(each);
        let params = r.transfer_params.map(|m| Value::Object(m).to_string());
        Ok((r.delay_free, params))
    }
}
