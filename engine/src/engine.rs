//! The reference engine and its step loop: the scheduler half (lookup, allocate,
//! `update_state_after_alloc`, `build_connector_meta`, `request_finished`) and the worker
//! half (`bind_connector_meta`, `start_load_kv`, per layer `wait_for_layer_load` → compute →
//! `save_kv_layer`, `wait_for_save`, `get_finished`, `block_ids_with_load_errors`) called in
//! vLLM's order every step.
//!
//! Blocks are freed only when the connector allows it: a `delay_free` answer from
//! `request_finished` keeps them until `get_finished` reports the request in
//! `finished_sending`. Async loads keep the request out of compute until `get_finished`
//! reports it received (or failed: then `kv_load_failure_policy` decides).

use crate::device_pool::DeviceMirror;
use crate::error::EngineError;
use crate::forward::Scratch;
use crate::kv_codec;
use crate::model::{ReferenceConfig, ReferenceModel};
use crate::pool::KvPool;
use crate::prefix_cache::block_hashes;
use crate::prng::SplitMix64;
use crate::sampling::{SamplingParams, TokenLogprobs};
use crate::state_layer;
use kvconnect_api::connector_metrics;
use kvconnect_api::{
    AttentionKind, BlockId, BlocksPerGroup, ConnectorMetric, EffectiveLayout, FailurePolicy, KvEvent,
    KvRegion, MatchResult, MemoryKind, ModelSpec, Request, RequestId, SchedulerConnector, TierTokens,
    WorkerConnector,
};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

mod step;

/// How to build an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The reference model's config (`ReferenceConfig::builtin()` for the checked-in one).
    pub model: ReferenceConfig,
    /// The negotiated layout (or `local_effective_layout` for a lone engine).
    pub effective: EffectiveLayout,
    /// Blocks per KV cache group.
    pub num_blocks: u32,
    /// Weight seed: engines that must agree use the same one.
    pub seed: u64,
    /// `Some(engine_id)`: regions in POSIX shared memory named `/kvc-<pid>-<engine_id>-<i>`
    /// (for the nixl `shm` backend); `None`: private host memory.
    pub shm: Option<String>,
    /// Tensor-parallel size: the KV heads are split across this many ranks, each with its
    /// own regions (`KvPool::with_tp_ranks`); 1 without TP.
    pub tp_size: u32,
}

/// A generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    /// Unique among the engine's unfinished requests.
    pub id: String,
    /// Prompt token ids (bytes: 0..=255), at least one.
    pub prompt: Vec<u32>,
    /// Tokens to generate, at least one; generation stops there (the byte model has no EOS)
    /// or earlier at a stop sequence.
    pub max_tokens: usize,
    /// vLLM's `kv_transfer_params` (`{"do_remote_decode": true}` on prefill, the prefill's
    /// returned params on decode).
    pub kv_transfer_params: Map<String, Value>,
    /// How tokens are chosen and what is reported about them (greedy by default).
    pub sampling: SamplingParams,
}

impl GenRequest {
    /// A greedy request without transfer params.
    pub fn new(id: impl Into<String>, prompt: Vec<u32>, max_tokens: usize) -> GenRequest {
        GenRequest {
            id: id.into(),
            prompt,
            max_tokens,
            kv_transfer_params: Map::new(),
            sampling: SamplingParams::default(),
        }
    }
}

/// Why a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` were generated.
    Length,
    /// The output ended with one of the request's stop sequences; its last `matched_tokens`
    /// tokens are that sequence.
    Stop {
        /// Length of the stop sequence that matched.
        matched_tokens: usize,
    },
    /// The request failed; the message says why (e.g. a KV load failed under policy `fail`).
    Error(String),
}

/// What one step produced for one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestOutput {
    /// The request.
    pub id: String,
    /// Tokens generated in this step (0 or 1).
    pub new_tokens: Vec<u32>,
    /// Their log-probabilities, one per new token, when the request asked for them (empty
    /// otherwise).
    pub logprobs: Vec<TokenLogprobs>,
    /// Set when the request ended in this step.
    pub finished: Option<FinishReason>,
    /// What `request_finished` returned (only on the finishing output).
    pub kv_transfer_params: Option<Map<String, Value>>,
    /// Time from `add_request` to this token, on the output carrying the first token (TTFT).
    pub first_token_latency: Option<Duration>,
    /// Prompt tokens whose KV came through the connector (on the first-token output).
    pub num_external_tokens: usize,
    /// Prompt tokens found in this engine's prefix cache (on the first-token output).
    pub num_cached_tokens: usize,
    /// Why the external KV load failed, when the prompt was recomputed instead (on the
    /// first-token output).
    pub kv_load_failure: Option<String>,
    /// Which connector tiers supplied the request's external tokens, as the connector
    /// reported them in `get_finished`'s `load_sources`, added up per connector and tier
    /// (on the finishing output).
    pub load_sources: Vec<TierTokens>,
}

/// A finished request, as `run_to_completion` returns it.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The request.
    pub id: String,
    /// Every generated token.
    pub tokens: Vec<u32>,
    /// Their log-probabilities, when the request asked for them.
    pub logprobs: Vec<TokenLogprobs>,
    /// Why it ended.
    pub finish: FinishReason,
    /// What `request_finished` returned.
    pub kv_transfer_params: Option<Map<String, Value>>,
    /// Time to first token (None when it failed before one).
    pub first_token_latency: Option<Duration>,
    /// Prompt tokens whose KV came through the connector.
    pub num_external_tokens: usize,
    /// Prompt tokens found in the prefix cache.
    pub num_cached_tokens: usize,
}

/// The pause after an idle step of [`Engine::run_to_completion`] and
/// [`Engine::wait_for_pending_frees`]: 10,000 idle steps wait at least a second for a
/// connector's transfer threads, however busy the machine.
pub const IDLE_STEP_PAUSE: std::time::Duration = std::time::Duration::from_micros(100);

/// Timings and counts of the last step (for benchmarks: TTFT splits, load waits).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepStats {
    /// Step number (1-based).
    pub step: u64,
    /// Requests computed.
    pub scheduled: usize,
    /// Prompt tokens computed.
    pub prefill_tokens: usize,
    /// Decode tokens computed.
    pub decode_tokens: usize,
    /// Requests still waiting for an async load after the step.
    pub waiting_for_remote_kv: usize,
    /// Whole step.
    pub elapsed: Duration,
    /// Inside the model's math and the pool's reads/writes.
    pub compute: Duration,
    /// Inside connector calls.
    pub connector: Duration,
}

/// What [`Engine::cancel`] did with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancel {
    /// Ended, its blocks freed.
    Ended,
    /// Not now (its KV is being loaded); ask again after a step.
    Later,
    /// No such unfinished request (it ended already).
    Unknown,
    /// This engine runs every request to its end.
    NotSupported,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    WaitingForRemoteKv,
    Running,
}

#[derive(Debug)]
struct Seq {
    req: Request,
    max_tokens: usize,
    state: State,
    blocks: Option<BlocksPerGroup>,
    num_computed: usize,
    external: usize,
    loaded_this_step: bool,
    load_error: Option<String>,
    /// Why an external load failed and the prompt was recomputed.
    kv_load_failure: Option<String>,
    /// What the connector's tiers supplied to the request's loads, until it ends.
    load_sources: Vec<TierTokens>,
    /// Prompt tokens found in the prefix cache at admission.
    cached: usize,
    /// Per KV cache group: how many leading blocks were already given back because every
    /// future token's sliding window starts past them.
    freed_prefix: Vec<usize>,
    output: Vec<u32>,
    added: Instant,
    sampling: SamplingParams,
    /// The request's generator, seeded with `sampling.seed`: one draw per sampled token.
    rng: SplitMix64,
}

impl Seq {
    fn seq_len(&self) -> usize {
        self.req.prompt_tokens.len() + self.output.len()
    }

    fn token(&self, pos: usize) -> u32 {
        let p = self.req.prompt_tokens.len();
        if pos < p {
            self.req.prompt_tokens[pos]
        } else {
            self.output[pos - p]
        }
    }
}

type Connector = (Box<dyn SchedulerConnector>, Box<dyn WorkerConnector>);

/// The reference engine: model, block pool, optional connector, requests.
pub struct Engine {
    model: ReferenceModel,
    spec: ModelSpec,
    // Declared before `pool` so the connector is dropped (and shut down) before the memory
    // it registered goes away.
    connector: Option<Connector>,
    // Device KV: the regions the connector sees (dropped after it, before the pool).
    device: Option<DeviceMirror>,
    pool: KvPool,
    policy: FailurePolicy,
    seqs: BTreeMap<u64, Seq>,
    by_id: BTreeMap<String, u64>,
    next_seq: u64,
    pending_free: BTreeMap<String, BlocksPerGroup>,
    sent_early: BTreeSet<String>,
    finished_since_last: Vec<RequestId>,
    step_no: u64,
    stats: Option<StepStats>,
    scratch: Scratch,
    state_buf: Vec<u8>,
    shut_down: bool,
    /// Reuse the KV of full prompt blocks an earlier request computed (off by default).
    prefix_caching: bool,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.spec.name)
            .field("effective", self.pool.effective())
            .field("connector", &self.connector.is_some())
            .field("unfinished", &self.seqs.len())
            .finish()
    }
}

fn conn_err(method: &'static str) -> impl FnOnce(kvconnect_api::ConnectorError) -> EngineError {
    move |source| EngineError::Connector { method, source }
}

impl Engine {
    /// Builds the model from `cfg.model` and `cfg.seed`, allocates the pool and registers its
    /// regions with the connector's worker half.
    pub fn new(
        cfg: EngineConfig,
        connector: Option<Connector>,
        policy: FailurePolicy,
    ) -> Result<Engine, EngineError> {
        let model = ReferenceModel::new(&cfg.model, cfg.seed)?;
        let spec = cfg.model.model_spec()?;
        if !kv_codec::supported(cfg.effective.cache_dtype) {
            return Err(EngineError::Layout(format!(
                "cache dtype {:?} is not supported by the reference engine; use bf16 or f32",
                cfg.effective.cache_dtype
            )));
        }
        if spec.layers.iter().any(|k| matches!(k, AttentionKind::Mla { .. } | AttentionKind::FeedForward)) {
            return Err(EngineError::ModelConfig(
                "the reference engine runs full and sliding-window attention and state layers only".into(),
            ));
        }
        if spec.has_state_layers() && cfg.effective.memory == MemoryKind::Device {
            return Err(EngineError::Layout(
                "not implemented: state layers with KV in device memory; use kv_buffer_device \"cpu\"".into(),
            ));
        }
        let pool = crate::tp::pool(&spec, &cfg)?;
        let device = match cfg.effective.memory {
            MemoryKind::Device => Some(DeviceMirror::new(&pool)?),
            _ => None,
        };
        let mut connector = connector;
        if let Some((_, w)) = connector.as_mut() {
            let regions = device.as_ref().map_or(pool.regions(), DeviceMirror::regions);
            w.register_kv_caches(regions).map_err(conn_err("register_kv_caches"))?;
        }
        Ok(Engine {
            model,
            spec,
            connector,
            device,
            pool,
            policy,
            seqs: BTreeMap::new(),
            by_id: BTreeMap::new(),
            next_seq: 0,
            pending_free: BTreeMap::new(),
            sent_early: BTreeSet::new(),
            finished_since_last: Vec::new(),
            step_no: 0,
            stats: None,
            scratch: Scratch::default(),
            state_buf: Vec::new(),
            shut_down: false,
            prefix_caching: false,
        })
    }

    /// KV events since the last call: the prefix cache's (medium `CPU`; from the first call
    /// on) and then the connector's (its tiers', merged by a composite), for a KV-aware router.
    pub fn take_kv_events(&mut self) -> Result<Vec<KvEvent>, EngineError> {
        let mut out = self.pool.take_cache_events();
        if let Some(c) = self.scheduler_connector() {
            out.extend(
                c.take_events().map_err(|source| EngineError::Connector { method: "take_events", source })?,
            );
        }
        Ok(out)
    }

    /// What the connector counts for `/metrics`: its scheduler half's samples and its worker
    /// half's, merged; none without a connector.
    pub fn connector_metrics(&mut self) -> Result<Vec<ConnectorMetric>, EngineError> {
        let Some((s, w)) = self.connector.as_mut() else {
            return Ok(Vec::new());
        };
        connector_metrics::of_connector(s.as_mut(), w.as_mut()).map_err(conn_err("metrics"))
    }

    /// Turns the prefix cache on (vLLM's `--enable-prefix-caching`): full prompt blocks of
    /// finished requests stay cached until their blocks are needed, and a prompt starting
    /// with the same tokens reuses them instead of computing or loading them.
    ///
    /// Refused for models with state layers: a cached prefix holds KV, not the state after it.
    pub fn enable_prefix_caching(&mut self) -> Result<(), EngineError> {
        if self.pool.has_state() {
            return Err(EngineError::ModelConfig(format!(
                "not implemented: prefix caching for model '{}', whose state layers keep a per-request state \
                    that cached KV blocks do not restore; serve it without --enable-prefix-caching",
                self.spec.name
            )));
        }
        self.prefix_caching = true;
        Ok(())
    }

    /// Queues a request. Refused: an empty prompt, a token past 255, `max_tokens == 0`, an id
    /// already in use, or a request that needs more blocks than the pool has.
    pub fn add_request(&mut self, r: GenRequest) -> Result<(), EngineError> {
        let bad = |reason: String| Err(EngineError::BadRequest { id: r.id.clone(), reason });
        if r.prompt.is_empty() {
            return bad("the prompt is empty; send at least one token".into());
        }
        if let Some(t) = r.prompt.iter().find(|t| **t >= crate::tokenizer::VOCAB_SIZE) {
            return bad(format!("token id {t} is outside the byte vocabulary (0..=255)"));
        }
        if r.max_tokens == 0 {
            return bad("max_tokens is 0; ask for at least one token".into());
        }
        if let Err(why) = r.sampling.check() {
            return bad(why);
        }
        if self.by_id.contains_key(&r.id) || self.pending_free.contains_key(&r.id) {
            return Err(EngineError::DuplicateId { id: r.id.clone() });
        }
        let need = self.blocks_needed(r.prompt.len(), r.max_tokens);
        if need > self.pool.blocks_per_group() as usize {
            return bad(format!(
                "needs {need} blocks per KV cache group ({} prompt + {} generated tokens at {} tokens a \
                    block) but the pool has {}; raise num_blocks or shorten the request",
                r.prompt.len(),
                r.max_tokens,
                self.pool.effective().block_size,
                self.pool.blocks_per_group()
            ));
        }
        let mut seq = Seq {
            req: Request {
                id: RequestId(r.id.clone()),
                prompt_tokens: r.prompt,
                kv_transfer_params: r.kv_transfer_params,
            },
            max_tokens: r.max_tokens,
            state: State::Waiting,
            blocks: None,
            num_computed: 0,
            external: 0,
            loaded_this_step: false,
            load_error: None,
            kv_load_failure: None,
            load_sources: Vec::new(),
            cached: 0,
            freed_prefix: Vec::new(),
            output: Vec::new(),
            added: Instant::now(),
            rng: SplitMix64::new(r.sampling.seed),
            sampling: r.sampling,
        };
        if self.spec.has_state_layers() {
            state_layer::prefill_backoff(&mut seq.req, &mut seq.max_tokens);
        }
        self.by_id.insert(r.id, self.next_seq);
        self.seqs.insert(self.next_seq, seq);
        self.next_seq += 1;
        Ok(())
    }

    fn blocks_needed(&self, prompt: usize, max_tokens: usize) -> usize {
        // Every position that is ever computed: the prompt and all generated tokens but the
        // last (which is returned, never fed back).
        (prompt + max_tokens - 1).div_ceil(self.pool.effective().block_size as usize)
    }

    /// True while any request is waiting, loading or running.
    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Requests waiting, loading or running.
    pub fn num_unfinished(&self) -> usize {
        self.seqs.len()
    }

    /// Finished requests whose blocks wait for the connector's `finished_sending`.
    pub fn pending_frees(&self) -> Vec<String> {
        self.pending_free.keys().cloned().collect()
    }

    /// Free blocks over all KV cache groups.
    pub fn free_blocks(&self) -> usize {
        self.pool.free_blocks()
    }

    /// All blocks over all KV cache groups.
    pub fn total_blocks(&self) -> usize {
        self.pool.total_blocks()
    }

    /// The regions registered with the connector.
    pub fn regions(&self) -> &[KvRegion] {
        self.device.as_ref().map_or(self.pool.regions(), DeviceMirror::regions)
    }

    /// The block pool.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// The model as negotiation sees it.
    pub fn model_spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The effective layout.
    pub fn effective(&self) -> &EffectiveLayout {
        self.pool.effective()
    }

    /// The connector's worker half (handshake metadata in and out).
    pub fn worker_connector(&mut self) -> Option<&mut (dyn WorkerConnector + 'static)> {
        self.connector.as_mut().map(|(_, w)| w.as_mut())
    }

    /// The connector's scheduler half.
    pub fn scheduler_connector(&mut self) -> Option<&mut (dyn SchedulerConnector + 'static)> {
        self.connector.as_mut().map(|(s, _)| s.as_mut())
    }

    /// Timings of the last step.
    pub fn last_step_stats(&self) -> Option<&StepStats> {
        self.stats.as_ref()
    }

    /// Shuts the connector's worker half down (also done on drop; only the first call
    /// reaches the connector).
    pub fn shutdown(&mut self) -> Result<(), EngineError> {
        if std::mem::replace(&mut self.shut_down, true) {
            return Ok(());
        }
        if let Some((_, w)) = self.connector.as_mut() {
            w.shutdown().map_err(conn_err("shutdown"))?;
        }
        Ok(())
    }

    /// Runs steps until every request has finished; returns them in the order they were
    /// added. Fails with `Stalled` after `max_steps` steps. A step that computed nothing
    /// (every request waiting for its KV or for blocks) is followed by a pause of
    /// [`IDLE_STEP_PAUSE`], so that the connector's threads get the cores a busy loop would
    /// take from them, and `max_steps` idle steps wait at least that long times as many.
    pub fn run_to_completion(&mut self, max_steps: u64) -> Result<Vec<Completion>, EngineError> {
        let order: BTreeMap<String, u64> = self.by_id.clone();
        let mut done: BTreeMap<u64, Completion> = BTreeMap::new();
        let mut partial: BTreeMap<String, Completion> = BTreeMap::new();
        let mut steps = 0;
        while self.has_unfinished() {
            if steps == max_steps {
                return Err(EngineError::Stalled { steps, waiting: self.by_id.keys().cloned().collect() });
            }
            steps += 1;
            let outputs = self.step()?;
            if self.last_step_stats().is_none_or(|s| s.scheduled == 0) {
                std::thread::sleep(IDLE_STEP_PAUSE);
            }
            for o in outputs {
                let c = partial.entry(o.id.clone()).or_insert_with(|| Completion {
                    id: o.id.clone(),
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    finish: FinishReason::Length,
                    kv_transfer_params: None,
                    first_token_latency: None,
                    num_external_tokens: 0,
                    num_cached_tokens: 0,
                });
                c.tokens.extend(&o.new_tokens);
                c.logprobs.extend(o.logprobs);
                if o.first_token_latency.is_some() {
                    c.first_token_latency = o.first_token_latency;
                    c.num_external_tokens = o.num_external_tokens;
                    c.num_cached_tokens = o.num_cached_tokens;
                }
                if let Some(f) = o.finished {
                    let Some(mut c) = partial.remove(&o.id) else { continue };
                    c.finish = f;
                    c.kv_transfer_params = o.kv_transfer_params;
                    let key = order.get(&o.id).copied().unwrap_or(u64::MAX - done.len() as u64);
                    done.insert(key, c);
                }
            }
        }
        Ok(done.into_values().collect())
    }

    /// Runs (idle) steps until the connector has released every delayed block, pausing
    /// [`IDLE_STEP_PAUSE`] after each (as [`Engine::run_to_completion`] does after a step
    /// that computed nothing); fails with `Stalled` after `max_steps`.
    pub fn wait_for_pending_frees(&mut self, max_steps: u64) -> Result<(), EngineError> {
        let mut steps = 0;
        while !self.pending_free.is_empty() {
            if steps == max_steps {
                return Err(EngineError::Stalled { steps, waiting: self.pending_frees() });
            }
            steps += 1;
            self.step()?;
            std::thread::sleep(IDLE_STEP_PAUSE);
        }
        Ok(())
    }

    /// Runs state layer `layer` (of state group `sg`) for every scheduled request; returns
    /// the state slots written.
    fn forward_state(
        &mut self,
        layer: usize,
        sg: usize,
        hs: &mut [(u64, usize, Vec<f32>)],
    ) -> Result<Vec<BlockId>, EngineError> {
        let list = self.pool.num_groups() + sg;
        let mut written = Vec::new();
        for (k, start, h) in hs.iter_mut() {
            let Some(blocks) = self.seqs.get(k).and_then(|s| s.blocks.as_ref()) else { continue };
            let slot = blocks.0.get(list).and_then(|l| l.first()).copied().ok_or_else(|| {
                EngineError::Layout(format!("a request has no state slot for state layer {layer}"))
            })?;
            state_layer::forward_state_layer(
                &self.model,
                &self.pool,
                layer,
                slot,
                *start,
                h,
                &mut self.state_buf,
            )?;
            written.push(slot);
        }
        written.sort_unstable();
        Ok(written)
    }

    /// Looks a waiting request up and allocates its blocks. Ok(false): no room now.
    fn admit(&mut self, key: u64, outputs: &mut Vec<RequestOutput>) -> Result<bool, EngineError> {
        let Some(s) = self.seqs.get(&key) else { return Ok(true) };
        let prompt_len = s.req.prompt_tokens.len();
        let need = self.blocks_needed(prompt_len, s.max_tokens);
        let bs = self.pool.effective().block_size as usize;
        // The prefix cache first: whole blocks, leaving at least the last prompt token to
        // compute (it yields the first output token).
        let hashes = if self.prefix_caching {
            let mut h = block_hashes(&s.req.prompt_tokens, bs);
            h.truncate((prompt_len - 1) / bs);
            h
        } else {
            Vec::new()
        };
        let mut lookup_error = None;
        let (mut ext, mut async_load) = (0, false);
        let mut hit = self.pool.take_cached(&hashes);
        let mut cached = hit.0.first().map_or(0, Vec::len) * bs;
        if let Some((sched, _)) = self.connector.as_mut() {
            match sched.get_num_new_matched_tokens(&s.req, cached) {
                Ok(MatchResult::Pending) => {
                    self.pool.release(&hit);
                    return Ok(true);
                }
                // At least one prompt token is always computed here: it yields the first
                // output token (vLLM does the same).
                Ok(MatchResult::Matched { tokens, async_load: a }) => {
                    (ext, async_load) = (tokens.min(prompt_len - 1 - cached), a)
                }
                Err(e) => lookup_error = Some(format!("get_num_new_matched_tokens failed: {e}")),
            }
        }
        if let (Some(why), FailurePolicy::Fail) = (&lookup_error, self.policy) {
            self.pool.release(&hit);
            let why = format!("KV lookup failed ({why}) and kv_load_failure_policy is 'fail'");
            self.end(key, FinishReason::Error(why), outputs, true);
            return Ok(true);
        }
        let fresh = need - cached / bs;
        if !self.pool.extend(&mut hit, fresh) || !self.pool.take_state_slots(&mut hit) {
            self.pool.release(&hit);
            return Ok(false);
        }
        let blocks = hit;
        if let Some((sched, _)) = self.connector.as_mut() {
            let Some(s) = self.seqs.get(&key) else {
                self.pool.release(&blocks);
                return Ok(true);
            };
            if let Err(e) = sched.update_state_after_alloc(&s.req, &blocks, ext) {
                if ext > 0 && self.policy == FailurePolicy::Fail {
                    let why =
                        format!("update_state_after_alloc failed ({e}) and kv_load_failure_policy is 'fail'");
                    if let Some(s) = self.seqs.get_mut(&key) {
                        s.blocks = Some(blocks);
                    }
                    self.end(key, FinishReason::Error(why), outputs, true);
                    return Ok(true);
                }
                tracing::warn!(request = %s.req.id, error = %e, "update_state_after_alloc failed; computing \
                    the prompt locally");
                (ext, async_load) = (0, false);
            }
        }
        if blocks.0.is_empty() {
            cached = 0;
        }
        if let Some(s) = self.seqs.get_mut(&key) {
            s.blocks = Some(blocks);
            s.external = ext;
            s.cached = cached;
            s.num_computed = cached;
            if async_load && ext > 0 {
                s.state = State::WaitingForRemoteKv;
            } else {
                s.state = State::Running;
                s.num_computed = cached + ext;
                s.loaded_this_step = ext > 0;
            }
        }
        Ok(true)
    }

    /// With HMA on and no connector, gives back sliding-window blocks no future token can
    /// attend to (vLLM's sliding-window manager does the same). With a connector every block
    /// stays until the request ends: `request_finished` hands the whole table to it, and a
    /// transfer may still read it. With the prefix cache on they stay too, so that every
    /// group holds the prompt's blocks when they are cached.
    fn free_out_of_window_blocks(&mut self) {
        if self.connector.is_some() || !self.pool.effective().hma || self.prefix_caching {
            return;
        }
        let bs = self.pool.effective().block_size as usize;
        let windows: Vec<Option<usize>> = self
            .pool
            .effective()
            .groups
            .iter()
            .map(|g| match g.kind {
                AttentionKind::SlidingWindow { window } => Some(window as usize),
                _ => None,
            })
            .collect();
        for s in self.seqs.values_mut() {
            let Some(blocks) = s.blocks.as_ref() else { continue };
            if s.state != State::Running {
                continue;
            }
            s.freed_prefix.resize(blocks.0.len(), 0);
            // The next token computed sits at `num_computed` and sees positions from
            // `num_computed + 1 - window` on; later tokens see even less of the past.
            for (g, w) in windows.iter().enumerate() {
                let (Some(w), Some(list)) = (w, blocks.0.get(g)) else { continue };
                let first_needed = (s.num_computed + 1).saturating_sub(*w);
                let upto = (first_needed / bs).min(list.len());
                if upto > s.freed_prefix[g] {
                    let mut give = vec![Vec::new(); blocks.0.len()];
                    give[g] = list[s.freed_prefix[g]..upto].to_vec();
                    self.pool.release(&BlocksPerGroup(give));
                    s.freed_prefix[g] = upto;
                }
            }
        }
    }

    /// Ends every unfinished request with `why` after a failed step, freeing its blocks (or
    /// parking them for the connector as `request_finished` asks). With `connector_dead` the
    /// connector is not called again: blocks are freed at once, and blocks parked for it
    /// earlier are freed too, since a dead instance never reports them sent. Returns how
    /// many requests it ended.
    pub fn abort_all(&mut self, why: &str, connector_dead: bool) -> usize {
        let keys: Vec<u64> = self.seqs.keys().copied().collect();
        let mut outputs = Vec::new();
        for k in &keys {
            self.end(*k, FinishReason::Error(why.to_owned()), &mut outputs, !connector_dead);
        }
        if connector_dead {
            for (_, b) in std::mem::take(&mut self.pending_free) {
                self.pool.release(&b);
            }
            self.sent_early.clear();
        }
        keys.len()
    }

    /// Records the request's full prompt blocks in the prefix cache (those every group still
    /// holds: sliding-window blocks given back early may already serve another request).
    fn cache_prompt_blocks(&mut self, s: &Seq, blocks: &BlocksPerGroup) {
        let bs = self.pool.effective().block_size as usize;
        let first_held = s.freed_prefix.iter().copied().max().unwrap_or(0);
        let hashes = block_hashes(&s.req.prompt_tokens, bs);
        for (i, &h) in hashes.iter().enumerate().skip(first_held) {
            let Some(row) = blocks.0.iter().map(|g| g.get(i).copied()).collect::<Option<Vec<BlockId>>>()
            else {
                break;
            };
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            self.pool.cache_block(&row, h, parent, &s.req.prompt_tokens[i * bs..(i + 1) * bs]);
        }
    }

    /// Ends request `id` for a client that is gone: its blocks are freed now, and a prefill
    /// request's are not kept for a remote decode (no one will get its transfer params).
    /// While its KV is being loaded from a peer (a transfer may be writing its blocks) it is
    /// left running: `Later`, ask again.
    pub fn cancel(&mut self, id: &str, why: &str) -> Cancel {
        let Some(&key) = self.by_id.get(id) else { return Cancel::Unknown };
        let Some(s) = self.seqs.get_mut(&key) else { return Cancel::Unknown };
        if s.state == State::WaitingForRemoteKv {
            return Cancel::Later;
        }
        s.req.kv_transfer_params.remove("do_remote_decode");
        let mut outputs = Vec::new();
        self.end(key, FinishReason::Error(why.to_owned()), &mut outputs, true);
        Cancel::Ended
    }

    /// Ends a request: tells the connector (unless `ask_connector` is false), frees or parks
    /// its blocks, emits the output.
    fn end(&mut self, key: u64, why: FinishReason, outputs: &mut Vec<RequestOutput>, ask_connector: bool) {
        let Some(s) = self.seqs.remove(&key) else { return };
        self.by_id.remove(&s.req.id.0);
        let blocks = s.blocks.clone().unwrap_or_default();
        let held = BlocksPerGroup(
            blocks
                .0
                .iter()
                .enumerate()
                .map(|(g, list)| list[s.freed_prefix.get(g).copied().unwrap_or(0).min(list.len())..].to_vec())
                .collect(),
        );
        let computed = !matches!(why, FinishReason::Error(_)) && s.num_computed >= s.req.prompt_tokens.len();
        if self.prefix_caching && computed {
            self.cache_prompt_blocks(&s, &blocks);
        }
        let mut params = None;
        let mut delay = false;
        if let Some((sched, _)) = self.connector.as_mut().filter(|_| ask_connector) {
            match sched.request_finished(&s.req, &blocks) {
                Ok(rf) => {
                    delay = rf.delay_free;
                    params = rf.transfer_params;
                }
                Err(e) => {
                    tracing::warn!(request = %s.req.id, error = %e, "request_finished failed; freeing its \
                        blocks now");
                }
            }
        }
        if delay && !self.sent_early.remove(&s.req.id.0) {
            self.pending_free.insert(s.req.id.0.clone(), held);
        } else {
            self.pool.release(&held);
        }
        self.finished_since_last.push(s.req.id.clone());
        // Merge with this step's token output for the request, if any.
        match outputs.iter_mut().find(|o| o.id == s.req.id.0) {
            Some(o) => {
                o.finished = Some(why);
                o.kv_transfer_params = params;
                o.load_sources = s.load_sources;
            }
            None => outputs.push(RequestOutput {
                id: s.req.id.0.clone(),
                new_tokens: Vec::new(),
                logprobs: Vec::new(),
                finished: Some(why),
                kv_transfer_params: params,
                first_token_latency: None,
                load_sources: s.load_sources,
                ..RequestOutput::default()
            }),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!(error = %e, "connector shutdown failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::local_effective_layout;
    use kvconnect_api::{
        ConnectorResult, Dtype, FinishedTransfers, KvLayout, LayerId, RequestFinished, StepInfo,
    };
    use std::sync::{Arc, Mutex};

    type Log = Arc<Mutex<Vec<String>>>;

    /// Records every call; delays freeing and reports the request sent one step later.
    struct Rec {
        log: Log,
        send_after: Arc<Mutex<Vec<RequestId>>>,
        misbehave: Misbehave,
    }

    #[derive(Clone, Copy, PartialEq)]
    enum Misbehave {
        No,
        /// Lookups never resolve.
        Pending,
        /// build_connector_meta fails.
        MetaError,
    }

    impl SchedulerConnector for Rec {
        fn get_num_new_matched_tokens(&mut self, req: &Request, n: usize) -> ConnectorResult<MatchResult> {
            self.log.lock().unwrap().push(format!("lookup {} {n}", req.id));
            if self.misbehave == Misbehave::Pending {
                return Ok(MatchResult::Pending);
            }
            Ok(MatchResult::Matched { tokens: 0, async_load: false })
        }
        fn update_state_after_alloc(
            &mut self,
            req: &Request,
            b: &BlocksPerGroup,
            ext: usize,
        ) -> ConnectorResult<()> {
            self.log.lock().unwrap().push(format!("alloc {} groups={} ext={ext}", req.id, b.0.len()));
            Ok(())
        }
        fn build_connector_meta(&mut self, s: &StepInfo) -> ConnectorResult<Vec<u8>> {
            self.log.lock().unwrap().push(format!(
                "meta {} sched={} fin={}",
                s.step,
                s.scheduled.len(),
                s.finished.len()
            ));
            if self.misbehave == Misbehave::MetaError {
                return Err(kvconnect_api::ConnectorError::io("rec", "peer went away"));
            }
            Ok(vec![s.step as u8])
        }
        fn request_finished(
            &mut self,
            req: &Request,
            _: &BlocksPerGroup,
        ) -> ConnectorResult<RequestFinished> {
            self.log.lock().unwrap().push(format!("finished {}", req.id));
            self.send_after.lock().unwrap().push(req.id.clone());
            Ok(RequestFinished {
                delay_free: true,
                transfer_params: Some(Map::from_iter([("k".into(), Value::from(1))])),
            })
        }
    }

    impl WorkerConnector for Rec {
        fn register_kv_caches(&mut self, r: &[KvRegion]) -> ConnectorResult<()> {
            self.log.lock().unwrap().push(format!("register {}", r.len()));
            Ok(())
        }
        fn bind_connector_meta(&mut self, m: &[u8]) -> ConnectorResult<()> {
            self.log.lock().unwrap().push(format!("bind {m:?}"));
            Ok(())
        }
        fn start_load_kv(&mut self) -> ConnectorResult<()> {
            self.log.lock().unwrap().push("start_load".into());
            Ok(())
        }
        fn wait_for_layer_load(&mut self, l: LayerId) -> ConnectorResult<()> {
            self.log.lock().unwrap().push(format!("wait_layer {l}"));
            Ok(())
        }
        fn save_kv_layer(&mut self, l: LayerId, b: &[BlockId]) -> ConnectorResult<()> {
            self.log.lock().unwrap().push(format!("save {l} {b:?}"));
            Ok(())
        }
        fn wait_for_save(&mut self) -> ConnectorResult<()> {
            self.log.lock().unwrap().push("wait_save".into());
            Ok(())
        }
        fn get_finished(&mut self, f: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
            self.log.lock().unwrap().push(format!("get_finished {}", f.len()));
            // Report as sent what finished in an earlier step (never in the same one).
            let sent =
                if f.is_empty() { Vec::new() } else { std::mem::take(&mut *self.send_after.lock().unwrap()) };
            Ok(FinishedTransfers { finished_sending: sent, ..Default::default() })
        }
        fn block_ids_with_load_errors(&mut self) -> ConnectorResult<Vec<BlockId>> {
            self.log.lock().unwrap().push("load_errors".into());
            Ok(Vec::new())
        }
        fn shutdown(&mut self) -> ConnectorResult<()> {
            self.log.lock().unwrap().push("shutdown".into());
            Ok(())
        }
    }

    fn engine_with(misbehave: Misbehave, log: &Log) -> Engine {
        let cfg = ReferenceConfig::builtin().unwrap();
        let spec = cfg.model_spec().unwrap();
        let eff = local_effective_layout(&spec, KvLayout::HND, true, 16, Dtype::Bf16);
        let send_after = Arc::new(Mutex::new(Vec::new()));
        let conn: Connector = (
            Box::new(Rec { log: log.clone(), send_after: send_after.clone(), misbehave }),
            Box::new(Rec { log: log.clone(), send_after, misbehave }),
        );
        let ec = EngineConfig { model: cfg, effective: eff, num_blocks: 8, seed: 1, shm: None, tp_size: 1 };
        Engine::new(ec, Some(conn), FailurePolicy::Recompute).unwrap()
    }

    #[test]
    fn a_lookup_that_never_resolves_is_reported_as_stalled() {
        let mut e = engine_with(Misbehave::Pending, &Log::default());
        e.add_request(GenRequest::new("slow", vec![1; 4], 1)).unwrap();
        let err = e.run_to_completion(5).unwrap_err().to_string();
        assert!(err.contains("5 steps passed and requests [\"slow\"] are still unfinished"), "{err}");
        assert_eq!(e.free_blocks(), e.total_blocks());
    }

    #[test]
    fn a_failing_step_call_names_the_method_and_keeps_the_request() {
        let mut e = engine_with(Misbehave::MetaError, &Log::default());
        e.add_request(GenRequest::new("a", vec![1; 4], 1)).unwrap();
        let err = e.step().unwrap_err().to_string();
        assert_eq!(err, "connector call build_connector_meta failed: connector 'rec': peer went away");
        assert!(e.has_unfinished());
    }

    #[test]
    fn connector_calls_come_in_vllm_order_and_blocks_wait_for_finished_sending() {
        let log = Log::default();
        let mut e = engine_with(Misbehave::No, &log);
        e.add_request(GenRequest::new("a", vec![1; 20], 2)).unwrap();
        let o1 = e.step().unwrap();
        assert_eq!(o1.len(), 1);
        assert!(o1[0].first_token_latency.is_some() && o1[0].finished.is_none());
        let o2 = e.step().unwrap();
        assert_eq!(o2[0].finished, Some(FinishReason::Length));
        assert_eq!(o2[0].kv_transfer_params.as_ref().unwrap()["k"], 1);
        // Finished but the connector still holds its blocks.
        assert!(!e.has_unfinished());
        assert_eq!(e.pending_frees(), vec!["a".to_owned()]);
        assert_eq!(e.free_blocks(), e.total_blocks() - 2 * 2);
        e.step().unwrap();
        assert!(e.pending_frees().is_empty());
        assert_eq!(e.free_blocks(), e.total_blocks());
        drop(e);

        let layers = |v: &mut Vec<String>, blocks: &str| {
            for l in 0..4 {
                v.push(format!("wait_layer {l}"));
                v.push(format!("save {l} {blocks}"));
            }
        };
        let mut want = vec!["register 4".to_owned(), "lookup a 0".into(), "alloc a groups=2 ext=0".into()];
        want.extend(["meta 1 sched=1 fin=0".into(), "bind [1]".into(), "start_load".into()]);
        layers(&mut want, "[BlockId(0), BlockId(1)]");
        want.extend(["wait_save".into(), "get_finished 0".into(), "load_errors".into()]);
        want.extend(["meta 2 sched=1 fin=0".into(), "bind [2]".into(), "start_load".into()]);
        layers(&mut want, "[BlockId(1)]");
        want.extend(["wait_save".into(), "get_finished 0".into(), "load_errors".into(), "finished a".into()]);
        want.extend(["meta 3 sched=0 fin=1".into(), "bind [3]".into(), "start_load".into()]);
        layers(&mut want, "[]");
        want.extend(["wait_save".into(), "get_finished 1".into(), "load_errors".into(), "shutdown".into()]);
        assert_eq!(*log.lock().unwrap(), want);
    }

    #[test]
    fn unsupported_cache_dtype_is_refused() {
        let cfg = ReferenceConfig::builtin().unwrap();
        let spec = cfg.model_spec().unwrap();
        let eff = local_effective_layout(&spec, KvLayout::HND, true, 16, Dtype::Fp8E4m3);
        let ec = EngineConfig { model: cfg, effective: eff, num_blocks: 8, seed: 1, shm: None, tp_size: 1 };
        let e = Engine::new(ec, None, FailurePolicy::Recompute).unwrap_err().to_string();
        assert!(
            e.contains("cache dtype Fp8E4m3 is not supported by the reference engine; use bf16 or f32"),
            "{e}"
        );
    }
}

#[cfg(test)]
mod window_tests {
    use super::*;
    use crate::pool::local_effective_layout;
    use kvconnect_api::{Dtype, KvLayout};

    fn engine(hma: bool) -> Engine {
        let cfg = ReferenceConfig::builtin().unwrap();
        let spec = cfg.model_spec().unwrap();
        let eff = local_effective_layout(&spec, KvLayout::HND, hma, 16, Dtype::Bf16);
        let ec = EngineConfig { model: cfg, effective: eff, num_blocks: 16, seed: 3, shm: None, tp_size: 1 };
        Engine::new(ec, None, FailurePolicy::Recompute).unwrap()
    }

    /// Runs a 150-token request, then (after its prefill) a second one that reuses whatever
    /// blocks the pool has free; returns both token lists and the free count after step 1.
    fn run(hma: bool) -> (Vec<u32>, Vec<u32>, usize) {
        let long: Vec<u32> = (0..150u32).map(|i| (i * 7 + 3) % 256).collect();
        let short: Vec<u32> = (0..40u32).map(|i| (i * 13 + 5) % 256).collect();
        let mut e = engine(hma);
        e.add_request(GenRequest::new("long", long, 20)).unwrap();
        let mut toks: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for o in e.step().unwrap() {
            toks.entry(o.id).or_default().extend(o.new_tokens);
        }
        let free_after_prefill = e.free_blocks();
        e.add_request(GenRequest::new("short", short, 20)).unwrap();
        while e.has_unfinished() {
            for o in e.step().unwrap() {
                toks.entry(o.id).or_default().extend(o.new_tokens);
            }
        }
        assert_eq!(e.free_blocks(), e.total_blocks());
        (toks["long"].clone(), toks["short"].clone(), free_after_prefill)
    }

    #[test]
    fn sliding_window_blocks_are_given_back_early_with_hma_and_tokens_do_not_change() {
        let (long_on, short_on, free_on) = run(true);
        let (long_off, short_off, free_off) = run(false);
        // 11 blocks per group for 169 positions; after the prefill the next token (at 150)
        // sees positions 119.. in the sliding layers, so blocks 0..7 of that group are free
        // again; the short request then takes those very blocks while the long one decodes.
        assert_eq!(free_on, 2 * 16 - 2 * 11 + 7);
        assert_eq!(free_off, 16 - 11);
        assert_eq!(long_on.len(), 20);
        assert_eq!(long_on, long_off);
        assert_eq!(short_on, short_off);
    }
}
