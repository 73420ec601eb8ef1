//! What the flexkv connector declares.

use crate::config::FlexkvConfig;
use kvconnect_api::KvRole;
use kvconnect_api::{
    AdaptCost, Capabilities, ConnectorError, ConnectorResult, KvLayout, KvTransferConfig, LayoutConstraint,
    MemoryKind, ModelSpec, TransferMode,
};

/// No HMA; token-major blocks only (rejects HND) but adapts by transposing on its own copy
/// path, except over opaque blocks, which it stores whole in the engine's layout; async loads.
/// Reads the config (extra config, `FLEXKV_*`, `FLEXKV_CONFIG_PATH`): a config that does not
/// resolve is an error here already, and the disk memory kind is declared only when the SSD
/// tier is on.
pub fn capabilities(config: &KvTransferConfig, _model: Option<&ModelSpec>) -> ConnectorResult<Capabilities> {
    let cfg = FlexkvConfig::from_extra_and_process_env(&config.kv_connector_extra_config)
        .map_err(|e| ConnectorError::config("flexkv", e.to_string()))?;
    Ok(capabilities_for(&cfg))
}

/// The capabilities of a resolved config.
pub fn capabilities_for(cfg: &FlexkvConfig) -> Capabilities {
    let mut memory_kinds = vec![MemoryKind::Host];
    // Device KV regions are staged through pinned host memory, compiled with `cuda` only.
    if cfg!(feature = "cuda") {
        memory_kinds.push(MemoryKind::Device);
    }
    if cfg.ssd_enabled() {
        memory_kinds.push(MemoryKind::Disk);
    }
    Capabilities {
        hma: false,
        layout: LayoutConstraint {
            required: vec![],
            rejected: vec![KvLayout::HND],
            preferred: vec![KvLayout::NHD],
        },
        adapt: Some(AdaptCost::Medium),
        block_size_multiple: 1,
        block_size_divides: None,
        cache_dtypes: vec![],
        memory_kinds,
        transfer_mode: TransferMode::None,
        roles: vec![KvRole::Producer, KvRole::Consumer, KvRole::Both],
        layerwise: false,
        heterogeneous_tp: false,
        mla: false,
        async_load: true,
        carries_state: false,
        state_with_tp: false,
        adapts_with_tp: false,
        adapts_with_state: false,
        // Over opaque blocks (vLLM's CPU backend) it stores each block's bytes as they are
        // and loads them back into the same engine's layout, never transposing.
        stores_opaque_blocks: true,
        ranks_in_one_worker: false,
        needs_side_channel: false,
        needs_data_plane_secret: false,
        needs_shared_memory_kv: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declares_what_the_issue_says_and_reads_the_config() {
        let mut cfg = KvTransferConfig::named("FlexKVConnectorV1");
        let c = capabilities(&cfg, None).unwrap();
        assert!(!c.hma && c.async_load && c.adapt.is_some());
        assert!(!c.layout.accepts(KvLayout::HND) && c.layout.accepts(KvLayout::NHD));
        c.validate().unwrap();
        assert_eq!(c.memory_kinds.contains(&MemoryKind::Device), cfg!(feature = "cuda"));
        cfg.kv_connector_extra_config =
            serde_json::json!({"ssd_cache_gb": 1, "ssd_cache_dir": "/tmp/x"}).as_object().cloned().unwrap();
        assert!(capabilities(&cfg, None).unwrap().memory_kinds.contains(&MemoryKind::Disk));
        cfg.kv_connector_extra_config =
            serde_json::json!({"cpu_cache_gb": "many"}).as_object().cloned().unwrap();
        let e = capabilities(&cfg, None).unwrap_err().to_string();
        assert!(e.contains("cpu_cache_gb"), "{e}");
    }
}
