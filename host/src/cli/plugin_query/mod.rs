//! `kvconnect plugins list | inspect` never load a plugin into their own process: each
//! plugin file is loaded and queried in a child process of this binary (the hidden
//! `kvconnect plugins probe PATH`), which is killed (SIGKILL) if it has not answered within
//! a time limit (10 s; `--query-timeout SECS` or `KVCONNECT_PLUGIN_QUERY_TIMEOUT`). A
//! plugin that aborts, segfaults or hangs is refused with one line naming its file and the
//! signal or the time limit; the other connectors are listed as usual.
//!
//! The child runs the same loader servers use and answers with what it gave, so the
//! entries, capabilities and refusals read exactly as if the plugin had been loaded here.
//! Built-ins are queried in this process.

mod answer;
mod factory;
mod failure;
pub mod probe;
mod process;
pub mod time_limit;

use crate::cli::GlobalArgs;
use kvconnect_registry::Registry;
use std::time::Duration;

/// The registry `kvconnect plugins` queries: the built-ins, and every plugin on the plugin
/// path opened in a query process with `limit`.
pub fn registry(global: &GlobalArgs, limit: Duration) -> anyhow::Result<Registry> {
    let query = process::QueryProcess::new(limit)?;
    Ok(Registry::load_with(&global.registry_config(), factory::opener(query)))
}
