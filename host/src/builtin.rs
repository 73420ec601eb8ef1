//! The factories of the connectors linked into the host.
//!
//! Until a connector crate exports its own factory, the host registers its declared
//! capabilities (`caps.rs`) behind a [`DeclaredFactory`]: capability queries and negotiation
//! work, and creating an instance returns `NotImplemented` rather than pretending.

use kvconnect_api::{
    Capabilities, ConnectorContext, ConnectorError, ConnectorFactory, ConnectorInfo, ConnectorResult,
    KvTransferConfig, ModelSpec, SchedulerConnector, WorkerConnector,
};
use std::sync::Arc;

/// The nixl transport.
pub fn nixl() -> Arc<dyn ConnectorFactory> {
    declared("nixl", "pull-mode P/D KV transport (NIXL, shm, tcp)", kvconnect_nixl::caps::capabilities)
}

/// The LMCache-style chunk cache.
pub fn lmcache() -> Arc<dyn ConnectorFactory> {
    declared("lmcache", "chunked prefix cache, CPU and disk tiers", kvconnect_lmcache::caps::capabilities)
}

/// The FlexKV-style block cache.
pub fn flexkv() -> Arc<dyn ConnectorFactory> {
    declared("flexkv", "radix-tree block cache, CPU and SSD tiers", kvconnect_flexkv::caps::capabilities)
}

fn declared(
    name: &str,
    description: &str,
    caps: fn(&KvTransferConfig, Option<&ModelSpec>) -> ConnectorResult<Capabilities>,
) -> Arc<dyn ConnectorFactory> {
    Arc::new(DeclaredFactory {
        info: ConnectorInfo {
            name: name.to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            description: description.to_owned(),
        },
        caps,
    })
}

/// Answers capability queries from a connector's declaration; its data path is not linked.
pub struct DeclaredFactory {
    info: ConnectorInfo,
    caps: fn(&KvTransferConfig, Option<&ModelSpec>) -> ConnectorResult<Capabilities>,
}

impl ConnectorFactory for DeclaredFactory {
    fn info(&self) -> ConnectorInfo {
        self.info.clone()
    }

    fn capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Capabilities> {
        (self.caps)(config, model)
    }

    fn create_scheduler(&self, _ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
        Err(ConnectorError::not_implemented(&self.info.name, "create_scheduler"))
    }

    fn create_worker(&self, _ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
        Err(ConnectorError::not_implemented(&self.info.name, "create_worker"))
    }
}
