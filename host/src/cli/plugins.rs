//! `kvconnect plugins list | inspect`: capability queries, answered without creating any
//! connector instance. The `--json` output is a stable interface (documented in docs/plugins.md):
//! fields are only ever added.

use super::config_arg::read_config;
use super::plugin_query::probe::{self, ProbeArgs};
use super::plugin_query::time_limit::{self, QUERY_TIMEOUT_ENV};
use super::{plugin_query, GlobalArgs};
use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use kvconnect_api::{Capabilities, KvTransferConfig, ModelSpec};
use kvconnect_registry::{Entry, Registry};
use serde_json::{json, Value};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

/// `kvconnect plugins ...`.
#[derive(Debug, Subcommand)]
pub enum PluginsCommand {
    /// Every connector this host can see: built-ins and plugins, with a capability summary;
    /// then one line per plugin that was refused.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        limit: QueryLimit,
    },
    /// The full capabilities of one connector, for a config and a model.
    Inspect {
        /// A connector name (`nixl`, `NixlConnector`, a plugin's name) or a plugin file.
        target: String,
        /// vLLM's --kv-transfer-config JSON (or a file holding it); capabilities may depend on it.
        #[arg(long, visible_alias = "config", value_name = "JSON")]
        kv_transfer_config: Option<String>,
        /// A Hugging Face config.json; capabilities may depend on the model.
        #[arg(long, value_name = "CONFIG.json")]
        model: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        limit: QueryLimit,
    },
    /// Loads one plugin file and prints its answer to a capability query as JSON: what
    /// `list` and `inspect` run in a process of its own for each plugin.
    #[command(hide = true)]
    Probe(ProbeArgs),
}

/// How long each plugin's query process may take.
#[derive(Debug, Clone, Args)]
pub struct QueryLimit {
    /// Seconds to wait for each plugin, loaded and queried in a process of its own, before
    /// killing that process and refusing the plugin [default: 10, or
    /// KVCONNECT_PLUGIN_QUERY_TIMEOUT]
    #[arg(long, value_name = "SECS", value_parser = time_limit::parse_secs)]
    query_timeout: Option<Duration>,
}

impl QueryLimit {
    fn registry(&self, global: &GlobalArgs) -> anyhow::Result<Registry> {
        let env = std::env::var(QUERY_TIMEOUT_ENV).ok();
        plugin_query::registry(global, time_limit::query_timeout(self.query_timeout, env.as_deref())?)
    }
}

/// Runs a `plugins` subcommand.
pub fn run(global: &GlobalArgs, cmd: PluginsCommand) -> anyhow::Result<()> {
    match cmd {
        PluginsCommand::List { json, limit } => list(&limit.registry(global)?, json),
        PluginsCommand::Inspect { target, kv_transfer_config, model, json, limit } => {
            let registry = limit.registry(global)?;
            registry.warn_load_errors();
            inspect(&registry, &target, kv_transfer_config.as_deref(), model.as_deref(), json)
        }
        PluginsCommand::Probe(args) => probe::run(global, &args),
    }
}

fn list(registry: &Registry, as_json: bool) -> anyhow::Result<()> {
    let entries = registry.entries();
    let rows: Vec<(Entry, Result<Capabilities, String>)> = entries
        .into_iter()
        .map(|e| {
            let caps = default_capabilities(&e);
            (e, caps)
        })
        .collect();
    if as_json {
        let connectors: Vec<Value> = rows
            .iter()
            .map(|(e, caps)| {
                let mut v = entry_json(e);
                v["summary"] = caps.as_ref().map(|c| json!(c.summary())).unwrap_or(Value::Null);
                v["capabilities_error"] = caps.as_ref().err().map(|m| json!(m)).unwrap_or(Value::Null);
                v
            })
            .collect();
        let errors: Vec<Value> = registry
            .load_errors()
            .iter()
            .map(|e| json!({"path": e.path(), "message": e.to_string()}))
            .collect();
        let shadowed = registry.shadowed();
        writeln!(
            std::io::stdout(),
            "{}",
            serde_json::to_string_pretty(
                &json!({"connectors": connectors, "errors": errors, "shadowed": shadowed})
            )?
        )?;
    } else {
        let mut table =
            vec![["NAME", "VERSION", "ORIGIN", "ABI", "PATH", "CAPABILITIES"].map(str::to_owned).to_vec()];
        for (e, caps) in &rows {
            let info = e.factory.info();
            table.push(vec![
                e.name.clone(),
                info.version,
                e.origin.to_string(),
                e.abi.clone().unwrap_or_else(|| "-".into()),
                e.path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "-".into()),
                match caps {
                    Ok(c) => c.summary(),
                    Err(m) => format!("(needs a config: {m})"),
                },
            ]);
        }
        write!(std::io::stdout(), "{}", aligned(&table))?;
        for e in registry.load_errors() {
            eprintln!("{e}");
        }
        for note in registry.shadowed() {
            eprintln!("{note}");
        }
    }
    Ok(())
}

/// Capabilities for the plain config naming the connector, no model, validated.
fn default_capabilities(e: &Entry) -> Result<Capabilities, String> {
    let caps =
        e.factory.capabilities(&KvTransferConfig::named(&e.name), None).map_err(|err| err.to_string())?;
    caps.validate().map_err(|err| format!("invalid capabilities: {err}"))?;
    Ok(caps)
}

fn entry_json(e: &Entry) -> Value {
    let info = e.factory.info();
    json!({
        "name": e.name,
        "version": info.version,
        "description": info.description,
        "origin": e.origin,
        "aliases": e.aliases,
        "path": e.path.as_ref().map(|p| p.display().to_string()),
        "abi": e.abi,
        "sdk_version": e.sdk_version,
    })
}

fn inspect(
    registry: &Registry,
    target: &str,
    config: Option<&str>,
    model: Option<&std::path::Path>,
    as_json: bool,
) -> anyhow::Result<()> {
    let config = match config {
        Some(c) => Some(read_config(c)?),
        None => None,
    };
    let entry = registry.find(target)?;
    let config = config.unwrap_or_else(|| KvTransferConfig::named(&entry.name));
    let model = match model {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read model config {}", p.display()))?;
            Some(
                ModelSpec::from_hf_config_json(&text)
                    .with_context(|| format!("model config {}", p.display()))?,
            )
        }
        None => None,
    };
    let caps = entry.factory.capabilities(&config, model.as_ref()).with_context(|| {
        format!("connector '{}' cannot answer a capability query for this config", entry.name)
    })?;
    if let Err(e) = caps.validate() {
        bail!(
            "connector '{}' declares invalid capabilities: {e} — the host refuses it; fix its capabilities()",
            entry.name
        );
    }
    let children = entry
        .factory
        .child_capabilities(&config, model.as_ref())
        .with_context(|| format!("connector '{}' cannot list its children's capabilities", entry.name))?;
    if as_json {
        let mut v = entry_json(&entry);
        v["model"] = model.as_ref().map(|m| json!(m.name)).unwrap_or(Value::Null);
        v["summary"] = json!(caps.summary());
        v["capabilities"] = serde_json::to_value(&caps)?;
        if let Some((backends, note)) = machine_notes(&entry.name) {
            v["available_backends"] = json!(backends);
            v["notes"] = json!([note]);
        }
        v["children"] = match &children {
            Some(cs) => Value::Array(
                cs.iter()
                    .map(|c| {
                        json!({
                            "name": c.name,
                            "version": c.version,
                            "summary": c.caps.summary(),
                            "capabilities": c.caps,
                        })
                    })
                    .collect(),
            ),
            None => Value::Null,
        };
        writeln!(std::io::stdout(), "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    let info = entry.factory.info();
    let mut head = vec![
        vec!["name".to_owned(), entry.name.clone()],
        vec!["version".to_owned(), info.version.clone()],
        vec!["origin".to_owned(), entry.origin.to_string()],
    ];
    if let Some(p) = &entry.path {
        head.push(vec!["path".to_owned(), p.display().to_string()]);
    }
    if let Some(a) = &entry.abi {
        head.push(vec![
            "abi".to_owned(),
            format!("{a} (kvconnect-api {})", entry.sdk_version.clone().unwrap_or_default()),
        ]);
    }
    if !entry.aliases.is_empty() {
        head.push(vec!["aliases".to_owned(), entry.aliases.join(", ")]);
    }
    head.push(vec!["description".to_owned(), info.description.clone()]);
    if let Some(m) = &model {
        head.push(vec!["model".to_owned(), m.name.clone()]);
    }
    if let Some((backends, note)) = machine_notes(&entry.name) {
        head.push(vec!["available_backends".to_owned(), backends.join(", ")]);
        head.push(vec!["notes".to_owned(), note]);
    }
    write!(std::io::stdout(), "{}", aligned(&head))?;
    writeln!(std::io::stdout(), "capabilities:")?;
    write!(std::io::stdout(), "{}", indent(&aligned(&caps_rows(&caps)), "  "))?;
    if let Some(cs) = children {
        writeln!(std::io::stdout(), "children:")?;
        for c in cs {
            writeln!(std::io::stdout(), "  {} {}: {}", c.name, c.version, c.caps.summary())?;
        }
    }
    Ok(())
}

/// What this machine can run of a connector, where that depends on the machine: the nixl
/// connector's backends (`nixl` needs the NIXL library; looked up, not loaded).
fn machine_notes(name: &str) -> Option<(Vec<String>, String)> {
    (name == kvconnect_nixl::config::NAME).then(kvconnect_nixl::nixl_lib::availability)
}

fn caps_rows(c: &Capabilities) -> Vec<Vec<String>> {
    let yes = |b: bool| if b { "yes" } else { "no" }.to_owned();
    let list = |v: Vec<String>, empty: &str| if v.is_empty() { empty.to_owned() } else { v.join(", ") };
    vec![
        vec!["hma".into(), yes(c.hma)],
        vec!["layout".into(), c.layout.describe()],
        vec!["adapt".into(), c.adapt.map(|a| a.to_string()).unwrap_or_else(|| "no".into())],
        vec!["block_size_multiple".into(), c.block_size_multiple.to_string()],
        vec![
            "block_size_divides".into(),
            c.block_size_divides.map(|d| d.to_string()).unwrap_or_else(|| "-".into()),
        ],
        vec![
            "cache_dtypes".into(),
            list(c.cache_dtypes.iter().map(|d| format!("{d:?}").to_lowercase()).collect(), "any"),
        ],
        vec!["memory_kinds".into(), list(c.memory_kinds.iter().map(|m| m.to_string()).collect(), "-")],
        vec!["transfer_mode".into(), c.transfer_mode.to_string()],
        vec!["roles".into(), list(c.roles.iter().map(|r| r.to_string()).collect(), "-")],
        vec!["layerwise".into(), yes(c.layerwise)],
        vec!["heterogeneous_tp".into(), yes(c.heterogeneous_tp)],
        vec!["mla".into(), yes(c.mla)],
        vec!["async_load".into(), yes(c.async_load)],
        vec!["carries_state".into(), yes(c.carries_state)],
        vec!["state_with_tp".into(), yes(c.state_with_tp)],
        vec!["adapts_with_tp".into(), yes(c.adapts_with_tp)],
        vec!["adapts_with_state".into(), yes(c.adapts_with_state)],
        vec!["stores_opaque_blocks".into(), yes(c.stores_opaque_blocks)],
        vec!["ranks_in_one_worker".into(), yes(c.ranks_in_one_worker)],
        vec!["needs_side_channel".into(), yes(c.needs_side_channel)],
        vec!["needs_data_plane_secret".into(), yes(c.needs_data_plane_secret)],
        vec!["needs_shared_memory_kv".into(), yes(c.needs_shared_memory_kv)],
    ]
}

/// Left-aligned columns separated by two spaces; the last column is not padded.
fn aligned(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|i| rows.iter().filter_map(|r| r.get(i)).map(|c| c.chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (i, cell) in r.iter().enumerate() {
            if i + 1 < r.len() {
                line.push_str(&format!("{cell:<w$}  ", w = widths[i]));
            } else {
                line.push_str(cell);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn indent(s: &str, by: &str) -> String {
    s.lines().map(|l| format!("{by}{l}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_pads_all_but_the_last_column() {
        let t = aligned(&[
            vec!["a".into(), "bb".into(), "c".into()],
            vec!["ddd".into(), "e".into(), "ffff".into()],
        ]);
        assert_eq!(t, "a    bb  c\nddd  e   ffff\n");
    }
}
