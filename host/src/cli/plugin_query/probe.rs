//! `kvconnect plugins probe PATH`, hidden: the query process's side. Loads one plugin file
//! in this process, asks it for its capabilities and prints the [`Answer`] as the last line
//! of stdout. A refusal is an answer too (exit 0); the process ends otherwise only if the
//! plugin ends it.

use super::answer::Answer;
use crate::cli::GlobalArgs;
use crate::loader::LoaderOptions;
use anyhow::Context;
use clap::Args;
use kvconnect_api::{KvTransferConfig, ModelSpec};
use std::io::Write;
use std::path::PathBuf;

/// `kvconnect plugins probe`.
#[derive(Debug, Args)]
pub struct ProbeArgs {
    /// The plugin file.
    pub path: PathBuf,
    /// The kv-transfer-config to ask about, as JSON (default: the plain config naming it).
    #[arg(long, value_name = "JSON")]
    pub config_json: Option<String>,
    /// The model to ask about, as kvconnect-api's ModelSpec JSON.
    #[arg(long, value_name = "JSON")]
    pub model_json: Option<String>,
}

/// Answers one query.
pub fn run(global: &GlobalArgs, args: &ProbeArgs) -> anyhow::Result<()> {
    let config = match &args.config_json {
        Some(c) => Some(KvTransferConfig::from_json(c).context("--config-json")?),
        None => None,
    };
    let model: Option<ModelSpec> = match &args.model_json {
        Some(m) => Some(serde_json::from_str(m).context("--model-json")?),
        None => None,
    };
    let options = LoaderOptions { allow_insecure: global.allow_insecure_plugins };
    let answer = Answer::ask(&args.path, &options, config, model.as_ref());
    let mut out = std::io::stdout().lock();
    // On a line of its own, whatever the plugin printed before without a newline.
    writeln!(out, "\n{}", serde_json::to_string(&answer)?)?;
    out.flush()?;
    Ok(())
}
