//! `LmcacheFactory`: the connector's entry point for hosts and the plugin wrapper.

use crate::caps;
use crate::chunk_layout::ChunkLayout;
use crate::config::LmcacheConfig;
use crate::key::Namespace;
use crate::registry;
use crate::scheduler::LmcacheScheduler;
use crate::worker::LmcacheWorker;
use kvconnect_api::{
    Capabilities, ConnectorContext, ConnectorFactory, ConnectorInfo, ConnectorResult, KvTransferConfig,
    ModelSpec, SchedulerConnector, WorkerConnector,
};

/// Creates lmcache scheduler and worker halves. Both halves of one engine (same
/// `engine_id` and config) share one chunk store in this process.
#[derive(Debug, Default, Clone, Copy)]
pub struct LmcacheFactory;

impl ConnectorFactory for LmcacheFactory {
    fn info(&self) -> ConnectorInfo {
        ConnectorInfo {
            name: "lmcache".to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            description: "LMCache-style chunked prefix cache with CPU, disk and remote (Redis) tiers"
                .to_owned(),
        }
    }

    fn capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Capabilities> {
        caps::capabilities(config, model)
    }

    fn create_scheduler(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
        let cfg = LmcacheConfig::from_kv_config(&ctx.config)?;
        // Refuses an unsupported layout or block size before anything is opened.
        ChunkLayout::new(&ctx.model, &ctx.effective, cfg.chunk_size)?;
        let store = registry::store_for(&ctx.engine_id, &cfg)?;
        let ns = Namespace::of(ctx, cfg.chunk_size);
        Ok(Box::new(LmcacheScheduler::new(store, ns, cfg, ctx.effective.block_size)))
    }

    fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
        let cfg = LmcacheConfig::from_kv_config(&ctx.config)?;
        let layout = ChunkLayout::new(&ctx.model, &ctx.effective, cfg.chunk_size)?;
        let store = registry::store_for(&ctx.engine_id, &cfg)?;
        Ok(Box::new(LmcacheWorker::new(
            store,
            layout,
            ctx.model.clone(),
            ctx.effective.clone(),
            cfg.use_layerwise,
        )))
    }
}
