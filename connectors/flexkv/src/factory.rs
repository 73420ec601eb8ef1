//! `FlexkvFactory`, and what both halves need from a context: the resolved config, the
//! layout adapter, the key namespace and the engine's shared cache.

use crate::adapter::BlockAdapter;
use crate::cache::BlockCache;
use crate::config::FlexkvConfig;
use crate::hash::hash_bytes;
use crate::registry::{shared_cache, RegistryError};
use crate::scheduler::FlexkvScheduler;
use crate::ssd_tier::SsdTier;
use crate::worker::FlexkvWorker;
use kvconnect_api::{
    Capabilities, ConnectorContext, ConnectorError, ConnectorFactory, ConnectorInfo, ConnectorResult,
    KvTransferConfig, ModelSpec, SchedulerConnector, WorkerConnector,
};
use std::sync::Arc;

/// The connector's name.
pub const NAME: &str = "flexkv";

impl From<RegistryError> for ConnectorError {
    fn from(e: RegistryError) -> Self {
        ConnectorError::config(NAME, e.to_string())
    }
}

/// Creates flexkv scheduler and worker halves.
#[derive(Debug, Clone, Copy, Default)]
pub struct FlexkvFactory;

impl FlexkvFactory {
    /// The factory.
    pub fn new() -> Self {
        FlexkvFactory
    }
}

impl ConnectorFactory for FlexkvFactory {
    fn info(&self) -> ConnectorInfo {
        ConnectorInfo {
            name: NAME.to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            description: "FlexKV-style radix-tree block cache: CPU and SSD tiers, async transfer threads"
                .to_owned(),
        }
    }

    fn capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Capabilities> {
        crate::caps::capabilities(config, model)
    }

    fn create_scheduler(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
        Ok(Box::new(FlexkvScheduler::new(Engine::open(ctx)?)))
    }

    fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
        Ok(Box::new(FlexkvWorker::new(Engine::open(ctx)?)?))
    }
}

/// One engine's flexkv state, as either half sees it.
pub struct Engine {
    /// The context the half was created with.
    pub ctx: ConnectorContext,
    /// The resolved settings.
    pub config: FlexkvConfig,
    /// Copies blocks between the regions and the stored form.
    pub adapter: Arc<BlockAdapter>,
    /// Seed of the block key chain: model, block size, dtype, TP rank.
    pub seed: u64,
    /// The cache both halves share.
    pub cache: Arc<BlockCache>,
}

impl Engine {
    /// Resolves the config, checks the deployment and finds or creates the engine's cache.
    pub fn open(ctx: &ConnectorContext) -> ConnectorResult<Engine> {
        let config = FlexkvConfig::from_extra_and_process_env(&ctx.config.kv_connector_extra_config)
            .map_err(|e| ConnectorError::config(NAME, e.to_string()))?;
        Self::open_with(ctx, config)
    }

    /// As `open`, with settings already resolved.
    pub fn open_with(ctx: &ConnectorContext, config: FlexkvConfig) -> ConnectorResult<Engine> {
        let eff = &ctx.effective;
        if eff.groups.len() > 1 {
            return Err(ConnectorError::config(
                NAME,
                format!(
                    "the effective layout has {} KV cache groups (hybrid KV cache manager on); flexkv keeps \
                     one block table per request: run with hybrid_kv_cache_manager=off",
                    eff.groups.len()
                ),
            ));
        }
        if eff.block_size == 0 {
            return Err(ConnectorError::config(NAME, "the effective block size is 0"));
        }
        // Opaque blocks are stored whole (the capability stores_opaque_blocks), any other
        // layout in flexkv's token-major form.
        let adapter = match eff.opaque_blocks {
            true => BlockAdapter::whole_blocks(&ctx.model, eff),
            false => BlockAdapter::new(&ctx.model, eff),
        };
        let slot = adapter.slot_bytes();
        if slot == 0 {
            return Err(ConnectorError::config(
                NAME,
                format!(
                    "model '{}' has no layer that stores KV blocks: there is nothing to cache",
                    ctx.model.name
                ),
            ));
        }
        let cpu_slots = (config.cpu_bytes() / slot as u64).min(u32::MAX as u64 - 1) as u32;
        if cpu_slots == 0 {
            return Err(ConnectorError::config(
                NAME,
                format!(
                    "cpu_cache_gb = {} holds no block: one block of every KV layer is {slot} bytes; raise \
                     cpu_cache_gb to at least {:.6}",
                    config.cpu_cache_gb,
                    (slot as f64 / (1u64 << 30) as f64 * 1e6).ceil() / 1e6
                ),
            ));
        }
        let tp = format!("tp{}/{}", ctx.tp_rank, ctx.tp_size);
        // Opaque blocks are the engine's own bytes: keyed by its layout too, so an engine of
        // another layout never reads them.
        let opaque = if eff.opaque_blocks {
            format!("|opaque {}", eff.layout.canonical_name())
        } else {
            String::new()
        };
        let seed = hash_bytes(
            0,
            format!("{}|{}|{:?}|{tp}{opaque}", ctx.model.fingerprint(), eff.block_size, eff.cache_dtype)
                .as_bytes(),
        );
        let engine_id = ctx.config.engine_id.clone().filter(|s| !s.is_empty()).unwrap_or_else(|| {
            if ctx.engine_id.is_empty() {
                "default".into()
            } else {
                ctx.engine_id.clone()
            }
        });
        let identity = format!(
            "cpu_cache_gb={} ssd_cache_gb={} ssd_cache_dir={:?} promotion={} block={slot}B seed={seed:016x}",
            config.cpu_cache_gb, config.ssd_cache_gb, config.ssd_cache_dir, config.enable_ssd_promotion
        );
        let cache = shared_cache::<ConnectorError>(&engine_id, &identity, || {
            let ssd = match (&config.ssd_cache_dir, config.ssd_enabled()) {
                (Some(dir), true) => Some(
                    SsdTier::open(dir, &engine_id, slot, config.ssd_bytes())
                        .map_err(|e| ConnectorError::config(NAME, e.to_string()))?,
                ),
                _ => None,
            };
            Ok(BlockCache::new(cpu_slots, slot, ssd, config.enable_ssd_promotion, identity.clone())
                .with_block_tokens(eff.block_size))
        })?;
        Ok(Engine { ctx: ctx.clone(), config, adapter: Arc::new(adapter), seed, cache })
    }
}
