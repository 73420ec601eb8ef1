//! A third-party kvconnect plugin, built only against `kvconnect-api`: a KV cache store in a
//! local directory. It is also the template for writing a plugin (docs/plugins.md, "Write a
//! plugin").
//!
//! What it does: when a request's prompt has been prefilled, the worker half copies the KV
//! bytes of the prompt's full blocks out of the engine's registered regions into files under
//! `dir` (one file per layer), keyed by a hash of the token ids and the block geometry. When
//! a later request starts with the same tokens, the scheduler half reports them as matched
//! and the worker half copies the bytes back into the new request's blocks before the
//! forward pass. No network, no peer: transfer mode `none`, like a local LMCache disk tier.
//!
//! Config (`kv_connector_extra_config`): `dir` (required to create instances), the directory
//! it stores in; created if missing.
//!
//! What it must not do: touch memory other than the registered regions (every access goes
//! through `kvconnect_api::kv_memory`, bounds-checked), or block the step loop on anything but
//! its own files.

#![forbid(unsafe_code)]

pub mod meta;
pub mod scheduler;
pub mod store;
pub mod worker;

use kvconnect_api::KvRole;
use kvconnect_api::{
    serde_json, Capabilities, ConnectorContext, ConnectorError, ConnectorFactory, ConnectorInfo,
    ConnectorResult, KvLayout, KvTransferConfig, LayoutConstraint, MemoryKind, ModelSpec, SchedulerConnector,
    TransferMode, WorkerConnector,
};
use std::path::PathBuf;

/// The connector's name.
pub const NAME: &str = "example";

kvconnect_api::export_connector!(NAME, ExampleFactory::new());

/// Creates the store's scheduler and worker halves.
#[derive(Debug, Default)]
pub struct ExampleFactory;

impl ExampleFactory {
    /// The factory.
    pub fn new() -> Self {
        ExampleFactory
    }
}

/// The directory from `kv_connector_extra_config.dir`.
pub fn store_dir(config: &KvTransferConfig) -> ConnectorResult<PathBuf> {
    match config.kv_connector_extra_config.get("dir") {
        Some(serde_json::Value::String(d)) if !d.is_empty() => Ok(PathBuf::from(d)),
        Some(other) => {
            Err(ConnectorError::config(NAME, format!("'dir' must be a directory path string, got {other}")))
        }
        None => Err(ConnectorError::config(
            NAME,
            "no 'dir': set kv_connector_extra_config.dir to the directory to store KV blocks in",
        )),
    }
}

impl ConnectorFactory for ExampleFactory {
    fn info(&self) -> ConnectorInfo {
        ConnectorInfo {
            name: NAME.to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            description: "example plugin: KV blocks stored in a local directory, keyed by token ids"
                .to_owned(),
        }
    }

    fn capabilities(
        &self,
        _config: &KvTransferConfig,
        _model: Option<&ModelSpec>,
    ) -> ConnectorResult<Capabilities> {
        Capabilities::builder(
            TransferMode::None,
            [MemoryKind::Host],
            [KvRole::Producer, KvRole::Consumer, KvRole::Both],
        )
        // One block table per request: with HMA on, sliding-window groups free blocks the
        // store would still address.
        .hma(false)
        // It copies whole spans through the geometry, so any layout works.
        .layout(LayoutConstraint { required: vec![], rejected: vec![], preferred: vec![KvLayout::NHD] })
        .layerwise(true)
        .mla(true)
        .build()
        .map_err(|e| ConnectorError::invalid(NAME, e.to_string()))
    }

    fn create_scheduler(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
        Ok(Box::new(scheduler::ExampleScheduler::new(ctx)?))
    }

    fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
        Ok(Box::new(worker::ExampleWorker::new(ctx)?))
    }
}
