//! The engine options `kvconnect negotiate` and `kvconnect worker` both take, parsed once.

use anyhow::{anyhow, bail, Result};
use kvconnect_api::negotiate::{EngineOptions, HmaOption};
use kvconnect_api::KvLayout;
use kvconnect_deployment::parse_cache_dtype;

/// Engine options as vLLM names its flags (on `worker`, with `--kv-transfer-config`).
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Hybrid KV cache manager: auto, on or off.
    #[arg(long = "hybrid-kv-cache-manager", value_name = "auto|on|off", default_value = "auto")]
    pub hybrid_kv_cache_manager: String,
    /// Force a KV layout (NHD, HND, BLHNC, ... or any order of L, B, H, N, C).
    #[arg(long = "kv-cache-layout", value_name = "LAYOUT")]
    pub kv_cache_layout: Option<String>,
    /// Tokens per block (default 16).
    #[arg(long = "block-size", value_name = "N")]
    pub block_size: Option<u32>,
    /// Cache dtype: auto (the model's), bf16, fp16, fp32, fp8, fp8_e5m2.
    #[arg(long = "cache-dtype", value_name = "DTYPE")]
    pub cache_dtype: Option<String>,
}

impl EngineArgs {
    /// The options these flags set, at tensor-parallel size `tp_size` (the caller's own
    /// flag, since only some commands take it beside a deployment file).
    pub fn options(&self, tp_size: u32) -> Result<EngineOptions> {
        let mut o = EngineOptions {
            hybrid_kv_cache_manager: self
                .hybrid_kv_cache_manager
                .parse::<HmaOption>()
                .map_err(|e| anyhow!("--hybrid-kv-cache-manager: {e}"))?,
            ..EngineOptions::default()
        };
        if tp_size == 0 {
            bail!("--tp-size must be a positive integer, got 0");
        }
        o.tp_size = tp_size;
        if let Some(l) = &self.kv_cache_layout {
            o.kv_cache_layout = Some(l.parse::<KvLayout>().map_err(|e| anyhow!("--kv-cache-layout: {e}"))?);
        }
        if let Some(b) = self.block_size {
            if b == 0 {
                bail!("--block-size must be a positive integer, got 0");
            }
            o.block_size = Some(b);
        }
        if let Some(d) = &self.cache_dtype {
            o.cache_dtype = parse_cache_dtype(d).map_err(|m| anyhow!("--{}", m.replacen('_', "-", 1)))?;
        }
        Ok(o)
    }
}
