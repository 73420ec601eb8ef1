//! A scriptable child connector that records every call, and a resolver over such children,
//! for the composite's tests.

use crate::factory::PdFactory;
use kvconnect_api::KvRole;
use kvconnect_api::{
    BlockId, BlocksPerGroup, Capabilities, ConnectorContext, ConnectorError, ConnectorFactory, ConnectorInfo,
    ConnectorResolver, ConnectorResult, FinishedTransfers, KvEvent, KvLayout, KvRegion, KvTransferConfig,
    LayerId, LayoutConstraint, LoadSource, MatchResult, MemoryKind, ModelSpec, Request, RequestFinished,
    RequestId, SchedulerConnector, StepInfo, TransferMode, WorkerConnector,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What a fake child answers, and what it was asked.
#[derive(Debug, Default)]
pub struct Script {
    /// Every call, e.g. `lookup r1 0`, `alloc r1 32`, `save 3 [1, 2]`.
    pub calls: Vec<String>,
    /// Tokens cached per request (a lookup from `n` answers `cached - n`).
    pub cached: HashMap<String, usize>,
    /// Requests the lookup is still pending for.
    pub pending: Vec<String>,
    /// Loads are async.
    pub async_load: bool,
    /// `request_finished` delays freeing.
    pub delay: bool,
    /// `request_finished` transfer params.
    pub params: Option<serde_json::Map<String, serde_json::Value>>,
    /// Reported by the next `get_finished`.
    pub finished_sending: Vec<String>,
    /// Reported by the next `get_finished`.
    pub finished_recving: Vec<String>,
    /// Reported by the next `get_finished`.
    pub failed_recving: Vec<String>,
    /// Reported by the next `get_finished`.
    pub load_sources: Vec<LoadSource>,
    /// Reported by `block_ids_with_load_errors`.
    pub load_errors: Vec<u32>,
    /// Handshake metadata.
    pub handshake: Option<serde_json::Value>,
    /// Metadata bound by the worker half.
    pub bound: Vec<Vec<u8>>,
    /// Handed out (and emptied) by the next `take_events`.
    pub events: Vec<KvEvent>,
    /// Declares `matches_only_remote_prefills` (a transport's answer).
    pub only_remote_prefills: bool,
}

/// Shared script of one fake child.
pub type Shared = Arc<Mutex<Script>>;

/// A fake connector factory.
pub struct FakeFactory {
    pub name: String,
    pub caps: Capabilities,
    pub script: Shared,
}

impl FakeFactory {
    pub fn new(name: &str, caps: Capabilities) -> (Arc<FakeFactory>, Shared) {
        let script: Shared = Arc::new(Mutex::new(Script::default()));
        (Arc::new(FakeFactory { name: name.to_owned(), caps, script: script.clone() }), script)
    }
}

/// Plain capabilities: HMA, any layout, pull.
pub fn caps_any() -> Capabilities {
    Capabilities::builder(TransferMode::Pull, [MemoryKind::Host], [KvRole::Both])
        .hma(true)
        .heterogeneous_tp(true)
        .mla(true)
        .async_load(true)
        .build()
        .expect("valid capabilities")
}

/// A cache: no HMA, NHD or HND, no transfer.
pub fn caps_cache() -> Capabilities {
    Capabilities {
        hma: false,
        layout: LayoutConstraint {
            required: vec![KvLayout::NHD, KvLayout::HND],
            rejected: vec![],
            preferred: vec![KvLayout::NHD],
        },
        memory_kinds: vec![MemoryKind::Host, MemoryKind::Disk],
        transfer_mode: TransferMode::None,
        ..caps_any()
    }
}

struct FakeHalf {
    name: String,
    s: Shared,
}

impl FakeHalf {
    fn log(&self, call: String) {
        self.s.lock().unwrap().calls.push(call);
    }
}

impl ConnectorFactory for FakeFactory {
    fn info(&self) -> ConnectorInfo {
        ConnectorInfo { name: self.name.clone(), version: "9.9".into(), description: "fake".into() }
    }
    fn capabilities(&self, _c: &KvTransferConfig, _m: Option<&ModelSpec>) -> ConnectorResult<Capabilities> {
        Ok(self.caps.clone())
    }
    fn create_scheduler(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
        self.script.lock().unwrap().calls.push(format!("create_scheduler {}", ctx.config.kv_connector));
        Ok(Box::new(FakeHalf { name: self.name.clone(), s: self.script.clone() }))
    }
    fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
        self.script.lock().unwrap().calls.push(format!("create_worker {}", ctx.config.kv_connector));
        Ok(Box::new(FakeHalf { name: self.name.clone(), s: self.script.clone() }))
    }
}

fn ids(v: Vec<String>) -> Vec<RequestId> {
    v.into_iter().map(RequestId).collect()
}

impl SchedulerConnector for FakeHalf {
    fn matches_only_remote_prefills(&self) -> bool {
        self.s.lock().unwrap().only_remote_prefills
    }
    fn get_num_new_matched_tokens(&mut self, req: &Request, n: usize) -> ConnectorResult<MatchResult> {
        self.log(format!("lookup {} {n}", req.id));
        let s = self.s.lock().unwrap();
        if s.pending.contains(&req.id.0) {
            return Ok(MatchResult::Pending);
        }
        let cached = s.cached.get(&req.id.0).copied().unwrap_or(0);
        Ok(MatchResult::Matched { tokens: cached.saturating_sub(n), async_load: s.async_load })
    }
    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        b: &BlocksPerGroup,
        n: usize,
    ) -> ConnectorResult<()> {
        self.log(format!("alloc {} {n} blocks={}", req.id, b.0.iter().map(Vec::len).sum::<usize>()));
        Ok(())
    }
    fn build_connector_meta(&mut self, step: &StepInfo) -> ConnectorResult<Vec<u8>> {
        self.log(format!("build_meta {}", step.step));
        Ok(format!("{}@{}", self.name, step.step).into_bytes())
    }
    fn request_finished(&mut self, req: &Request, _b: &BlocksPerGroup) -> ConnectorResult<RequestFinished> {
        self.log(format!("request_finished {}", req.id));
        let s = self.s.lock().unwrap();
        Ok(RequestFinished { delay_free: s.delay, transfer_params: s.params.clone() })
    }
    fn take_events(&mut self) -> ConnectorResult<Vec<KvEvent>> {
        Ok(std::mem::take(&mut self.s.lock().unwrap().events))
    }
}

impl WorkerConnector for FakeHalf {
    fn register_kv_caches(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        self.log(format!("register {}", regions.len()));
        Ok(())
    }
    fn bind_connector_meta(&mut self, meta: &[u8]) -> ConnectorResult<()> {
        self.log(format!("bind {}", String::from_utf8_lossy(meta)));
        self.s.lock().unwrap().bound.push(meta.to_vec());
        Ok(())
    }
    fn start_load_kv(&mut self) -> ConnectorResult<()> {
        self.log("start_load".into());
        Ok(())
    }
    fn wait_for_layer_load(&mut self, layer: LayerId) -> ConnectorResult<()> {
        self.log(format!("wait_layer {layer}"));
        Ok(())
    }
    fn save_kv_layer(&mut self, layer: LayerId, blocks: &[BlockId]) -> ConnectorResult<()> {
        self.log(format!("save {layer} {:?}", blocks.iter().map(|b| b.0).collect::<Vec<_>>()));
        Ok(())
    }
    fn wait_for_save(&mut self) -> ConnectorResult<()> {
        self.log("wait_save".into());
        Ok(())
    }
    fn get_finished(&mut self, _f: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        let mut s = self.s.lock().unwrap();
        Ok(FinishedTransfers {
            finished_sending: ids(std::mem::take(&mut s.finished_sending)),
            finished_recving: ids(std::mem::take(&mut s.finished_recving)),
            failed_recving: ids(std::mem::take(&mut s.failed_recving)),
            load_sources: std::mem::take(&mut s.load_sources),
        })
    }
    fn block_ids_with_load_errors(&mut self) -> ConnectorResult<Vec<BlockId>> {
        Ok(self.s.lock().unwrap().load_errors.iter().map(|b| BlockId(*b)).collect())
    }
    fn handshake_metadata(&mut self) -> ConnectorResult<Option<serde_json::Value>> {
        Ok(self.s.lock().unwrap().handshake.clone())
    }
    fn set_peer_handshake_metadata(&mut self, peer: &serde_json::Value) -> ConnectorResult<()> {
        self.log(format!("peer {peer}"));
        Ok(())
    }
    fn shutdown(&mut self) -> ConnectorResult<()> {
        self.log("shutdown".into());
        Ok(())
    }
}

/// A resolver over fake factories; `PdConnector` resolves to a composite over the same
/// resolver, and a preset name resolves to a fixed config of another connector (which is how
/// a composite can come to contain itself).
#[derive(Clone, Default)]
pub struct FakeResolver {
    pub factories: HashMap<String, Arc<dyn ConnectorFactory>>,
    pub presets: HashMap<String, KvTransferConfig>,
}

impl FakeResolver {
    pub fn with(mut self, f: Arc<FakeFactory>) -> Self {
        self.factories.insert(f.name.clone(), f);
        self
    }
}

/// A connector name that stands for a fixed config.
struct Preset {
    config: KvTransferConfig,
    inner: Arc<dyn ConnectorFactory>,
}

impl ConnectorFactory for Preset {
    fn info(&self) -> ConnectorInfo {
        self.inner.info()
    }
    fn capabilities(&self, _c: &KvTransferConfig, m: Option<&ModelSpec>) -> ConnectorResult<Capabilities> {
        self.inner.capabilities(&self.config, m)
    }
    fn child_capabilities(
        &self,
        _c: &KvTransferConfig,
        m: Option<&ModelSpec>,
    ) -> ConnectorResult<Option<Vec<kvconnect_api::negotiate::ChildCaps>>> {
        self.inner.child_capabilities(&self.config, m)
    }
    fn create_scheduler(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
        self.inner.create_scheduler(&ConnectorContext { config: self.config.clone(), ..ctx.clone() })
    }
    fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
        self.inner.create_worker(&ConnectorContext { config: self.config.clone(), ..ctx.clone() })
    }
}

impl ConnectorResolver for FakeResolver {
    fn resolve(&self, config: &KvTransferConfig) -> ConnectorResult<Arc<dyn ConnectorFactory>> {
        let name = config.kv_connector.as_str();
        if name == "PdConnector" {
            return Ok(Arc::new(PdFactory::new(Arc::new(self.clone()))));
        }
        if let Some(p) = self.presets.get(name) {
            let inner = self.resolve(p)?;
            return Ok(Arc::new(Preset { config: p.clone(), inner }));
        }
        self.factories
            .get(name)
            .cloned()
            .ok_or_else(|| ConnectorError::config(name, format!("no connector named '{name}'")))
    }

    fn known_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.factories.keys().cloned().collect();
        v.push("PdConnector".into());
        v.extend(self.presets.keys().cloned());
        v.sort();
        v
    }
}
