//! Plugins as `kvconnect plugins` sees them: registry entries whose factory is answered by
//! query processes, so the plugin's code never runs in this process.

use super::answer::Loaded;
use super::process::QueryProcess;
use crate::loader::{LoadError, LoaderOptions};
use kvconnect_api::{
    Capabilities, ChildCaps, ConnectorContext, ConnectorError, ConnectorFactory, ConnectorInfo,
    ConnectorResult, KvTransferConfig, ModelSpec, SchedulerConnector, WorkerConnector,
};
use kvconnect_registry::{Entry, OpenPlugin, Origin};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Opens each plugin file with one query (the plain config naming it, no model), the one
/// loading a plugin in this process would make.
pub fn opener(query: QueryProcess) -> OpenPlugin {
    let query = Arc::new(query);
    Arc::new(move |path: &Path, options: &LoaderOptions| open(&query, path, options))
}

fn open(query: &Arc<QueryProcess>, path: &Path, options: &LoaderOptions) -> Result<Entry, LoadError> {
    let loaded = query.ask(path, options, None, None)?;
    let factory = QueriedFactory {
        query: query.clone(),
        path: path.to_path_buf(),
        options: options.clone(),
        asked: KvTransferConfig::named(&loaded.name),
        loaded: loaded.clone(),
        last: Mutex::new(None),
    };
    Ok(Entry {
        name: loaded.name,
        aliases: Vec::new(),
        origin: Origin::Dynamic,
        path: Some(path.to_path_buf()),
        abi: Some(loaded.abi),
        sdk_version: Some(loaded.sdk_version),
        factory: Arc::new(factory),
    })
}

/// A plugin's factory, answered by query processes: its info and its capabilities for the
/// config the opening query asked about come from that query; any other capability query
/// runs another. It creates no connectors: servers load plugins themselves.
struct QueriedFactory {
    query: Arc<QueryProcess>,
    path: PathBuf,
    options: LoaderOptions,
    asked: KvTransferConfig,
    loaded: Loaded,
    /// The last other query and its answer: `inspect` asks for the capabilities and then the
    /// children for the same config and model, which one query process answers.
    last: Mutex<Option<(KvTransferConfig, Option<ModelSpec>, Loaded)>>,
}

impl QueriedFactory {
    fn not_here(&self, method: &str) -> ConnectorError {
        ConnectorError::Other {
            connector: self.loaded.name.clone(),
            message: format!(
                "{method}: `kvconnect plugins` only queries plugins, in a process of their own; a worker \
                    loads them to create connectors"
            ),
        }
    }
}

impl QueriedFactory {
    /// The answer to a query for `config` and `model`: the opening query's when it asked the
    /// same, else a new query process's.
    fn answer(&self, config: &KvTransferConfig, model: Option<&ModelSpec>) -> ConnectorResult<Loaded> {
        if model.is_none() && *config == self.asked {
            return Ok(self.loaded.clone());
        }
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((c, m, loaded)) = last.as_ref() {
            if c == config && m.as_ref() == model {
                return Ok(loaded.clone());
            }
        }
        let loaded = self.query.ask(&self.path, &self.options, Some(config), model).map_err(|e| {
            ConnectorError::Other { connector: self.loaded.name.clone(), message: e.to_string() }
        })?;
        *last = Some((config.clone(), model.cloned(), loaded.clone()));
        Ok(loaded)
    }
}

impl ConnectorFactory for QueriedFactory {
    fn info(&self) -> ConnectorInfo {
        self.loaded.info.clone()
    }

    fn capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Capabilities> {
        self.answer(config, model).and_then(|loaded| loaded.capabilities)
    }

    fn child_capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Option<Vec<ChildCaps>>> {
        self.answer(config, model).and_then(|loaded| loaded.children)
    }

    fn create_scheduler(&self, _ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
        Err(self.not_here("create_scheduler"))
    }

    fn create_worker(&self, _ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
        Err(self.not_here("create_worker"))
    }
}
