//! `kvconnect plan DEPLOYMENT.toml`: negotiates the prefill and decode servers of a
//! deployment and says, before anything starts, whether they can exchange KV: identical,
//! adaptable (with the plan the receiver applies), or not (the field-level diff and a
//! remedy).

use crate::cli::negotiate::{render_adapters, render_fields};
use anyhow::Result;
use kvconnect_api::compat::{same_bytes_note, FieldClass, FieldDiff};
use kvconnect_api::ConnectorResolver;
use kvconnect_api::Role;
use kvconnect_deployment::{plan, Deployment, DeploymentError, Plan};
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `kvconnect plan`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// The deployment file (TOML).
    #[arg(value_name = "DEPLOYMENT.toml")]
    pub deployment: PathBuf,
    /// Negotiate both roles together, as workers started from this deployment do.
    #[arg(long)]
    pub joint: bool,
    /// Print who decided each field of each role, and why.
    #[arg(long)]
    pub explain: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

fn connectors_of(dep: &Deployment, role: Role, p: &Plan) -> String {
    let n = match role {
        Role::Prefill => &p.prefill.0,
        Role::Decode => &p.decode.0,
    };
    let names: Vec<&str> = n.children.iter().map(|c| c.name.as_str()).collect();
    format!("{}[{}]", dep.role(role).kv_transfer_config.kv_connector, names.join(", "))
}

/// Runs `kvconnect plan`. Returns the exit code: 0 compatible, 1 not; bad input is an error
/// (exit 2).
pub fn run(args: &PlanArgs, resolver: &dyn ConnectorResolver, out: &mut dyn Write) -> Result<u8> {
    let dep = Deployment::load(&args.deployment)?;
    let how = if args.joint {
        "both roles together (--joint), as workers started from this deployment do"
    } else {
        "each role alone, as independently launched workers do"
    };
    let p = match plan(&dep, args.joint, resolver) {
        Ok(p) => p,
        Err(e @ DeploymentError::Conflict { .. }) => {
            if args.json {
                writeln!(
                    out,
                    "{}",
                    serde_json::json!({"compatible": false, "joint": args.joint, "conflict": e.to_string()})
                )?;
            } else {
                writeln!(out, "deployment: {}", args.deployment.display())?;
                writeln!(out, "negotiated: {how}")?;
                writeln!(out, "NOT COMPATIBLE: {e}")?;
            }
            return Ok(1);
        }
        Err(e) => return Err(e.into()),
    };
    if args.json {
        let side = |r: &(kvconnect_api::negotiate::Negotiated, kvconnect_api::compat::CompatDescriptor)| {
            crate::cli::negotiate::json(&r.0, &r.1)
        };
        let v = serde_json::json!({
            "deployment": args.deployment.display().to_string(),
            "joint": p.joint,
            "compatible": p.outcome.is_ok(),
            "prefill": side(&p.prefill),
            "decode": side(&p.decode),
            "diffs": p.diffs,
            "notes": {"prefill": dep.prefill.notes, "decode": dep.decode.notes},
            "plan": p.outcome.as_ref().ok(),
            "error": p.outcome.as_ref().err().map(|e| e.to_string()),
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(if p.outcome.is_ok() { 0 } else { 1 });
    }

    writeln!(out, "deployment: {}", args.deployment.display())?;
    writeln!(out, "model: {} ({})", dep.model.name, dep.model_path.display())?;
    writeln!(out, "negotiated: {how}")?;
    for (role, (n, d)) in [(Role::Prefill, &p.prefill), (Role::Decode, &p.decode)] {
        writeln!(out)?;
        writeln!(out, "{role}: {}", connectors_of(&dep, role, &p))?;
        for note in &dep.role(role).notes {
            writeln!(out, "  note: {note}")?;
        }
        if args.explain {
            for line in n.explain().lines() {
                writeln!(out, "  {line}")?;
            }
        } else {
            write!(out, "{}", render_fields(n))?;
        }
        write!(out, "{}", render_adapters(n))?;
        writeln!(out, "  compat hash  {}", d.compat_hash())?;
    }
    writeln!(out)?;
    let same_bytes = same_bytes_note(&p.prefill.1, &p.decode.1);
    match &p.outcome {
        Err(inc) => {
            writeln!(out, "NOT COMPATIBLE: {inc}")?;
            // Joint negotiation reconciles what the children decide, not the TP sizes the
            // roles were given.
            if !args.joint && inc.diffs.iter().any(|d| d.field != "tp_size") {
                writeln!(
                    out,
                    "hint: workers started with `kvconnect worker --deployment {0} --role prefill|decode \
                        --joint` negotiate jointly; `kvconnect plan --joint {0}` shows what they agree on",
                    args.deployment.display()
                )?;
            }
            Ok(1)
        }
        Ok(plan) if plan.is_identity() => {
            match &same_bytes {
                Some(note) => writeln!(
                    out,
                    "COMPATIBLE: identical compat hashes; decode reads prefill's blocks as they are\n  {note}"
                )?,
                None => writeln!(
                    out,
                    "COMPATIBLE: identical compat hashes and layouts; decode reads prefill's blocks as they \
                        are"
                )?,
            }
            Ok(0)
        }
        Ok(plan) => {
            writeln!(out, "COMPATIBLE with adaptation (the strict fields and compat hashes are equal):")?;
            if let Some(note) = &same_bytes {
                writeln!(out, "  {note}")?;
            }
            for d in p.diffs.iter().filter(|d| d.class == FieldClass::Adaptable) {
                writeln!(out, "  {}", diff_line(d))?;
            }
            if let Some(l) = &plan.layout {
                writeln!(
                    out,
                    "  decode permutes every block it reads from prefill: {} -> {}, axes {:?} (axis i of \
                        decode's layout is axis perm[i] of prefill's)",
                    l.from.canonical_name(),
                    l.to.canonical_name(),
                    l.perm
                )?;
            }
            if let Some((r, s)) = plan.block_size_ratio {
                // (receiver, sender) block sizes, reduced: (2, 1) means decode's blocks hold
                // twice as many tokens, so one decode block takes two prefill blocks.
                writeln!(out, "  block sizes: {s} decode block(s) per {r} prefill block(s)")?;
            }
            if let Some((r, s)) = plan.tp_ratio {
                writeln!(
                    out,
                    "  TP: decode TP {r} : prefill TP {s}; each decode rank reads its heads' share"
                )?;
            }
            Ok(0)
        }
    }
}

fn diff_line(d: &FieldDiff) -> String {
    d.line("prefill", "decode")
}
