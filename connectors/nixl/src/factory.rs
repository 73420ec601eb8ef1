//! `NixlFactory`: the connector's entry point for hosts and composites.

use crate::caps;
use crate::config::{Backend, NixlConfig, NAME};
use crate::scheduler::NixlScheduler;
use crate::worker::NixlWorker;
use kvconnect_api::{
    Capabilities, ConnectorContext, ConnectorFactory, ConnectorInfo, ConnectorResult, KvTransferConfig,
    ModelSpec, SchedulerConnector, WorkerConnector,
};

/// Creates nixl connector instances.
#[derive(Debug, Clone, Copy, Default)]
pub struct NixlFactory;

impl ConnectorFactory for NixlFactory {
    fn info(&self) -> ConnectorInfo {
        ConnectorInfo {
            name: NAME.to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            description: format!(
                "pull-mode P/D KV transport (backends: {}; nixl = the NIXL library over UCX)",
                Backend::all().map(Backend::name).collect::<Vec<_>>().join(", ")
            ),
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
        let cfg = NixlConfig::from_config(&ctx.config)?;
        cfg.require_available()?;
        Ok(Box::new(NixlScheduler::new(ctx, cfg)))
    }

    fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
        let cfg = NixlConfig::from_config(&ctx.config)?;
        cfg.require_available()?;
        Ok(Box::new(NixlWorker::new(ctx, cfg)))
    }
}
