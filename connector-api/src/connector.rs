//! The safe connector traits, modelled on vLLM's v1 KV connector: a factory, a scheduler
//! half and a worker half. Built-in connectors implement them directly; plugins implement
//! them and export them through `export_connector!`; the host sees both the same way.

use crate::caps::Capabilities;
use crate::config::{KvRole, KvTransferConfig};
use crate::connector_metrics::ConnectorMetric;
use crate::error::ConnectorError;
use crate::ids::{BlockId, LayerId, RequestId};
use crate::layout::EffectiveLayout;
use crate::model::ModelSpec;
use crate::region::KvRegion;
use serde::{Deserialize, Serialize};

/// Result of every connector method.
pub type ConnectorResult<T> = Result<T, ConnectorError>;

/// Name and version of a connector.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ConnectorInfo {
    /// The connector's name (`nixl`, `lmcache`, ...).
    pub name: String,
    /// Its version.
    pub version: String,
    /// One line on what it does.
    pub description: String,
}

/// Everything a connector instance is created with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ConnectorContext {
    /// This connector's own config (for a composite's child: the child's entry).
    pub config: KvTransferConfig,
    /// The model.
    pub model: ModelSpec,
    /// The negotiated layout.
    pub effective: EffectiveLayout,
    /// This engine's role.
    pub role: KvRole,
    /// This engine's id.
    pub engine_id: String,
    /// Tensor-parallel rank.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
}

/// A request as the scheduler sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Its id.
    pub id: RequestId,
    /// The prompt's token ids.
    pub prompt_tokens: Vec<u32>,
    /// `kv_transfer_params` from the client or the proxy (JSON object, may be empty).
    #[serde(default)]
    pub kv_transfer_params: serde_json::Map<String, serde_json::Value>,
}

/// Blocks allocated to a request, one list per KV cache group.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlocksPerGroup(pub Vec<Vec<BlockId>>);

/// Answer of `get_num_new_matched_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MatchResult {
    /// The connector cannot tell yet; ask again next step.
    Pending,
    /// This many tokens past `num_computed` can be loaded externally.
    Matched {
        /// Tokens the connector can provide.
        tokens: usize,
        /// True when the load completes asynchronously (reported by `get_finished`).
        async_load: bool,
    },
}

/// Answer of `request_finished`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestFinished {
    /// Keep the request's blocks until `get_finished` reports it as finished sending.
    pub delay_free: bool,
    /// Parameters the peer needs to pull the KV (vLLM's `kv_transfer_params`).
    pub transfer_params: Option<serde_json::Map<String, serde_json::Value>>,
}

/// One scheduler step, as far as connectors care.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepInfo {
    /// Step number.
    pub step: u64,
    /// Requests scheduled in this step.
    pub scheduled: Vec<RequestId>,
    /// Requests finished since the last step.
    pub finished: Vec<RequestId>,
}

pub use crate::kv_events::KvEvent;

/// Answer of `get_finished`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinishedTransfers {
    /// Requests whose blocks the producer may now free.
    pub finished_sending: Vec<RequestId>,
    /// Requests whose load completed: an async one the engine now resumes; a synchronous one
    /// (matched with `async_load: false`) it already computed with, so nothing to resume.
    pub finished_recving: Vec<RequestId>,
    /// Requests whose load failed: for an async one the engine applies
    /// `kv_load_failure_policy`; a synchronous one's blocks are also in
    /// `block_ids_with_load_errors`, which the engine acts on.
    pub failed_recving: Vec<RequestId>,
    /// What the connector's cache tiers supplied to requests: the tokens each tier served to
    /// a load, reported once, in the answer of the step in which the load completed (an
    /// async load's with its `finished_recving` entry, a synchronous one's in the step that
    /// loaded it). The host adds them up per request and reports them when the request ends;
    /// a plugin's go the same way as a built-in connector's. Absent from the JSON when
    /// empty, so a connector that reports none need not write it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub load_sources: Vec<LoadSource>,
}

impl FinishedTransfers {
    /// Adds `tokens` that `connector`'s `tier` supplied to `request` (nothing for 0), to the
    /// row of the same request, connector and tier when there is one.
    pub fn add_load(&mut self, request: &RequestId, connector: &str, tier: &str, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let row = self
            .load_sources
            .iter_mut()
            .find(|s| s.request == *request && s.source.connector == connector && s.source.tier == tier);
        match row {
            Some(s) => s.source.tokens += tokens,
            None => self.load_sources.push(LoadSource::new(request, connector, tier, tokens)),
        }
    }
}

/// Tokens of one request one tier of one connector supplied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierTokens {
    /// The connector (`lmcache`, `flexkv`, a plugin's name).
    pub connector: String,
    /// Its tier (`cpu`, `disk`, `remote`, `ssd`).
    pub tier: String,
    /// Tokens loaded from it.
    pub tokens: u64,
}

impl TierTokens {
    /// Adds `t` to `rows`: to the row of the same connector and tier when there is one
    /// (nothing for 0 tokens).
    pub fn add_to(rows: &mut Vec<TierTokens>, t: TierTokens) {
        if t.tokens == 0 {
            return;
        }
        match rows.iter_mut().find(|r| r.connector == t.connector && r.tier == t.tier) {
            Some(r) => r.tokens += t.tokens,
            None => rows.push(t),
        }
    }
}

/// What one tier of one connector supplied to one request (`get_finished`'s
/// `load_sources`). In JSON, one flat object: `{"request", "connector", "tier", "tokens"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSource {
    /// The request loaded for.
    pub request: RequestId,
    /// The connector, its tier and the tokens.
    #[serde(flatten)]
    pub source: TierTokens,
}

impl LoadSource {
    /// `tokens` of `request` that `connector`'s `tier` supplied.
    pub fn new(request: &RequestId, connector: &str, tier: &str, tokens: u64) -> Self {
        LoadSource {
            request: request.clone(),
            source: TierTokens { connector: connector.to_owned(), tier: tier.to_owned(), tokens },
        }
    }
}

/// Creates connector instances and answers capability queries.
pub trait ConnectorFactory: Send + Sync {
    /// Name and version.
    fn info(&self) -> ConnectorInfo;

    /// What the connector can do with this config and (when known) model. Needs no instance:
    /// the CLI and negotiation call it before anything starts.
    fn capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Capabilities>;

    /// For a composite: every leaf connector it combines, in order, each with its own
    /// declaration, so negotiation names the child that decides each field and attaches an
    /// adapter to the child that needs it. `None` (the default) for a plain connector.
    fn child_capabilities(
        &self,
        _config: &KvTransferConfig,
        _model: Option<&ModelSpec>,
    ) -> ConnectorResult<Option<Vec<crate::negotiate::ChildCaps>>> {
        Ok(None)
    }

    /// Creates the scheduler half.
    fn create_scheduler(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>>;

    /// Creates the worker half.
    fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>>;
}

/// The scheduler half (vLLM's `KVConnectorBase_V1` scheduler-side methods).
pub trait SchedulerConnector: Send {
    /// How many tokens past `num_computed` the connector can provide.
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed: usize,
    ) -> ConnectorResult<MatchResult>;

    /// Whether [`get_num_new_matched_tokens`](Self::get_num_new_matched_tokens) answers every
    /// request whose `kv_transfer_params` do not ask for a remote prefill (no
    /// `do_remote_prefill: true`) with 0 tokens, synchronous, changing nothing: a host may
    /// then answer those requests itself, without the call (inside vLLM, a round trip to the
    /// worker process). False by default: a connector with a cache matches any request.
    fn matches_only_remote_prefills(&self) -> bool {
        false
    }

    /// Blocks were allocated for `req`; `num_external_tokens` of them will be loaded.
    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
        num_external_tokens: usize,
    ) -> ConnectorResult<()>;

    /// Metadata for the workers for this step.
    fn build_connector_meta(&mut self, step: &StepInfo) -> ConnectorResult<Vec<u8>>;

    /// The request finished; say whether to delay freeing its blocks.
    fn request_finished(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
    ) -> ConnectorResult<RequestFinished>;

    /// Events since the last call. None by default: a connector without a cache index
    /// publishes nothing.
    fn take_events(&mut self) -> ConnectorResult<Vec<KvEvent>> {
        Ok(Vec::new())
    }

    /// Empties the connector's store (vLLM's `/reset_prefix_cache?reset_external=true`), so
    /// that no later request loads what was stored before. `Ok(false)` when it cannot be
    /// emptied now (a transfer holds stored blocks; the caller may retry), changing nothing.
    /// `Ok(true)` by default: a connector without a store has nothing to reset. A plugin's
    /// scheduler half answers with this default: the plugin ABI has no entry for it yet.
    fn reset_cache(&mut self) -> ConnectorResult<bool> {
        Ok(true)
    }

    /// What this half counts for the host's `/metrics`, read at scrape time: the state one
    /// engine holds once (a cache's hits per tier, say); the host adds it up with the worker
    /// halves' ([`ConnectorMetric::merge`]). None by default.
    fn metrics(&mut self) -> ConnectorResult<Vec<ConnectorMetric>> {
        Ok(Vec::new())
    }
}

/// The worker half (vLLM's worker-side methods).
pub trait WorkerConnector: Send {
    /// The engine's KV memory, once, before any other worker call. The host vouched for every
    /// region when it made it ([`KvRegion::new`]): the memory stays valid until this worker
    /// has been shut down and dropped. Wrap the regions in
    /// [`KvMemory`](crate::kv_memory::KvMemory) to read and write blocks, bounds-checked.
    fn register_kv_caches(&mut self, regions: &[KvRegion]) -> ConnectorResult<()>;

    /// This step's metadata from the scheduler half.
    fn bind_connector_meta(&mut self, meta: &[u8]) -> ConnectorResult<()>;

    /// Starts loading this step's external KV.
    fn start_load_kv(&mut self) -> ConnectorResult<()>;

    /// Blocks until `layer`'s KV is loaded (layer-wise connectors). Returns at once by
    /// default: a connector that loads whole requests has nothing to wait for per layer.
    fn wait_for_layer_load(&mut self, _layer: LayerId) -> ConnectorResult<()> {
        Ok(())
    }

    /// `layer` was computed for these blocks; save what this step must save.
    fn save_kv_layer(&mut self, layer: LayerId, block_ids: &[BlockId]) -> ConnectorResult<()>;

    /// Blocks until this step's saves are safe to proceed past. Returns at once by default:
    /// a connector that saves synchronously (or not at all) is done when `save_kv_layer`
    /// returns.
    fn wait_for_save(&mut self) -> ConnectorResult<()> {
        Ok(())
    }

    /// The engine preempted these requests: their blocks are freed once this returns and this
    /// step's forward may overwrite them. A connector that still reads or writes a preempted
    /// request's blocks in the background (an asynchronous save) finishes or drops that work
    /// before returning. Nothing by default: a connector without background work on a
    /// running request's blocks has nothing to do. A plugin's worker half answers with this
    /// default: the plugin ABI has no entry for it yet.
    fn handle_preemptions(&mut self, _preempted: &[RequestId]) -> ConnectorResult<()> {
        Ok(())
    }

    /// Requests whose sending or receiving finished since the last call.
    fn get_finished(&mut self, finished_reqs: &[RequestId]) -> ConnectorResult<FinishedTransfers>;

    /// Blocks whose load failed. None by default, for connectors that report a failed load
    /// through `get_finished` or load nothing.
    fn block_ids_with_load_errors(&mut self) -> ConnectorResult<Vec<BlockId>> {
        Ok(Vec::new())
    }

    /// Metadata the peer needs (JSON). `None` by default: a connector that moves nothing
    /// between engines has nothing to publish.
    fn handshake_metadata(&mut self) -> ConnectorResult<Option<serde_json::Value>> {
        Ok(None)
    }

    /// The peer's metadata. Ignored by default, for connectors that do not talk to a peer.
    fn set_peer_handshake_metadata(&mut self, _peer: &serde_json::Value) -> ConnectorResult<()> {
        Ok(())
    }

    /// Releases everything. Nothing by default: what the connector holds is released when
    /// it is dropped.
    fn shutdown(&mut self) -> ConnectorResult<()> {
        Ok(())
    }

    /// What this worker half counts for the host's `/metrics`, read at scrape time: what it
    /// holds on its own (a data-plane listener's refusals, say). The host adds up the samples
    /// of equal name and labels of every worker half it runs (kvconnect's worker server runs
    /// one for all of an engine's ranks) and of the scheduler half
    /// ([`ConnectorMetric::merge`]). None by default.
    fn metrics(&mut self) -> ConnectorResult<Vec<ConnectorMetric>> {
        Ok(Vec::new())
    }
}

/// Finds the factory for a config's connector: the host's registry implements this, and the
/// composite uses it to create its children without knowing where they come from.
pub trait ConnectorResolver: Send + Sync {
    /// The factory for `config.kv_connector` (or its `kv_connector_module_path`).
    fn resolve(&self, config: &KvTransferConfig) -> ConnectorResult<std::sync::Arc<dyn ConnectorFactory>>;

    /// Every name that resolves, for error messages.
    fn known_names(&self) -> Vec<String>;
}
