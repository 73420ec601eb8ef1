//! `kvconnect negotiate`: one server's effective KV layout, its compat hash and, with
//! `--explain`, who decided every field and why.

use anyhow::{Context, Result};
use kvconnect_api::compat::CompatDescriptor;
use kvconnect_api::negotiate::{EngineOptions, Negotiated};
use kvconnect_api::{ConnectorResolver, ModelSpec};
use kvconnect_deployment::{negotiate_alone, DeploymentError, Negotiating};
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `kvconnect negotiate`.
#[derive(Debug, Clone, clap::Args)]
pub struct NegotiateArgs {
    /// The worker's vLLM --kv-transfer-config JSON, or a file holding it.
    #[arg(long = "kv-transfer-config", value_name = "JSON|FILE")]
    pub kv_transfer_config: String,
    /// The model's Hugging Face config.json.
    #[arg(long, value_name = "CONFIG.json")]
    pub model: PathBuf,
    #[command(flatten)]
    pub engine: super::engine_args::EngineArgs,
    /// Tensor-parallel size.
    #[arg(long = "tp-size", value_name = "N", default_value_t = 1)]
    pub tp_size: u32,
    /// Forbid children from adapting their own data path to another layout.
    #[arg(long = "no-adapters")]
    pub no_adapters: bool,
    /// Print the provenance of every field.
    #[arg(long)]
    pub explain: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub use super::config_arg::read_config;

/// Reads a model config.json.
pub fn read_model(path: &std::path::Path) -> Result<ModelSpec> {
    let text = kvconnect_config_file::read_text(path)
        .with_context(|| format!("model {}: cannot read it", path.display()))?;
    ModelSpec::from_hf_config_json(&text).with_context(|| format!("model {}", path.display()))
}

fn options(args: &NegotiateArgs) -> Result<EngineOptions> {
    let mut o = args.engine.options(args.tp_size)?;
    o.allow_adapters = !args.no_adapters;
    Ok(o)
}

/// One line per negotiated field, values only.
pub fn render_fields(n: &Negotiated) -> String {
    let w = n.provenance.iter().map(|p| p.field.as_str().len()).max().unwrap_or(0);
    n.provenance.iter().map(|p| format!("  {:<w$}  {}\n", p.field, p.value)).collect()
}

/// The adapters, one line each.
pub fn render_adapters(n: &Negotiated) -> String {
    n.adapters
        .iter()
        .map(|a| {
            format!(
                "  adapter: child '{}' works in {} natively and adapts its own copy path to {} (transpose, \
                    cost {})\n",
                a.child,
                a.native.display_name(),
                a.effective.display_name(),
                a.cost
            )
        })
        .collect()
}

/// Runs `kvconnect negotiate`. Returns the exit code: 0 negotiated, 1 conflict; bad input
/// is an error (exit 2).
pub fn run(args: &NegotiateArgs, resolver: &dyn ConnectorResolver, out: &mut dyn Write) -> Result<u8> {
    let config = read_config(&args.kv_transfer_config)?;
    let (config, notes) =
        kvconnect_deployment::lmcache_pd(config).map_err(|e| anyhow::anyhow!("--kv-transfer-config: {e}"))?;
    let model = read_model(&args.model)?;
    let opts = options(args)?;
    let (n, d) = match negotiate_alone(resolver, &config, &model, &opts, Negotiating::Engine("worker")) {
        Ok(r) => r,
        Err(DeploymentError::Conflict { conflict, .. }) => {
            if args.json {
                writeln!(out, "{}", serde_json::json!({ "ok": false, "conflict": conflict.to_string() }))?;
            } else {
                writeln!(out, "conflict: {conflict}")?;
            }
            return Ok(1);
        }
        Err(e) => return Err(e.into()),
    };
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&json(&n, &d))?)?;
        return Ok(0);
    }
    let names: Vec<String> = n.children.iter().map(|c| format!("{} {}", c.name, c.version)).collect();
    writeln!(out, "model: {} ({})", model.name, args.model.display())?;
    writeln!(out, "connector: {} [{}]", config.kv_connector, names.join(", "))?;
    for note in &notes {
        writeln!(out, "note: {note}")?;
    }
    writeln!(out, "effective layout:")?;
    if args.explain {
        for line in n.explain().lines() {
            writeln!(out, "  {line}")?;
        }
    } else {
        write!(out, "{}", render_fields(&n))?;
    }
    write!(out, "{}", render_adapters(&n))?;
    writeln!(out, "compat hash: {}", d.compat_hash())?;
    Ok(0)
}

/// The JSON form of one server's negotiation.
pub fn json(n: &Negotiated, d: &CompatDescriptor) -> serde_json::Value {
    serde_json::json!({
        "ok": true,
        "effective": n.effective,
        "compat_hash": d.compat_hash(),
        "provenance": n.provenance,
        "adapters": n.adapters,
        "children": n
            .children
            .iter()
            .map(|c| serde_json::json!({"name": c.name, "version": c.version}))
            .collect::<Vec<_>>(),
        "descriptor": d,
    })
}
