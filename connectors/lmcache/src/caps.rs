//! What the lmcache connector declares.

use crate::config::{LmcacheConfig, NAME};
use kvconnect_api::KvRole;
use kvconnect_api::{
    Capabilities, ConnectorError, ConnectorResult, KvLayout, KvTransferConfig, LayoutConstraint, MemoryKind,
    ModelSpec, TransferMode,
};

/// No HMA; NHD or HND; the block size must divide `chunk_size`; layer-wise when
/// `use_layerwise` is set; a local cache (no transfer). Reads the full config (extra config,
/// `LMCACHE_*` environment, `LMCACHE_CONFIG_FILE`), so a bad value is refused here already.
pub fn capabilities(config: &KvTransferConfig, _model: Option<&ModelSpec>) -> ConnectorResult<Capabilities> {
    let cfg = LmcacheConfig::from_kv_config(config)?;
    let mut memory_kinds = vec![MemoryKind::Host];
    // Device KV regions are staged through pinned host memory, compiled with `cuda` only.
    if cfg!(feature = "cuda") {
        memory_kinds.push(MemoryKind::Device);
    }
    if cfg.local_disk.is_some() {
        memory_kinds.push(MemoryKind::Disk);
    }
    Capabilities::builder(
        TransferMode::None,
        memory_kinds,
        [KvRole::Producer, KvRole::Consumer, KvRole::Both],
    )
    .layout(LayoutConstraint {
        required: vec![KvLayout::NHD, KvLayout::HND],
        rejected: vec![],
        preferred: vec![KvLayout::NHD, KvLayout::HND],
    })
    .block_size_divides(Some(cfg.chunk_size))
    .layerwise(cfg.use_layerwise)
    .mla(true)
    .build()
    .map_err(|e| ConnectorError::invalid(NAME, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(extra: serde_json::Value) -> KvTransferConfig {
        let mut c = KvTransferConfig::named("LMCacheConnectorV1");
        c.kv_connector_extra_config = extra.as_object().cloned().unwrap();
        c
    }

    #[test]
    fn reads_chunk_size_layerwise_and_disk() {
        let c = capabilities(&cfg(json!({"chunk_size": 64, "use_layerwise": true})), None).unwrap();
        assert_eq!(c.block_size_divides, Some(64));
        assert!(c.layerwise && !c.hma);
        assert_eq!(c.memory_kinds.contains(&MemoryKind::Device), cfg!(feature = "cuda"));
        assert!(!c.memory_kinds.contains(&MemoryKind::Disk));
        c.validate().unwrap();
        let c = capabilities(&cfg(json!({"local_disk": "file:///tmp/x", "max_local_disk_size": 1.0})), None)
            .unwrap();
        assert!(c.memory_kinds.contains(&MemoryKind::Host) && c.memory_kinds.contains(&MemoryKind::Disk));
        assert_eq!(c.block_size_divides, Some(256));
    }

    #[test]
    fn bad_config_is_refused() {
        let e = capabilities(&cfg(json!({"chunk_size": 0})), None).unwrap_err().to_string();
        assert!(e.contains("chunk_size"), "{e}");
    }
}
