//! What the lmcache connector declares.

use kvconnect_api::caps::KvRoleCap;
use kvconnect_api::{
    Capabilities, ConnectorError, ConnectorResult, KvLayout, KvTransferConfig, LayoutConstraint, MemoryKind,
    ModelSpec, TransferMode,
};

/// No HMA; NHD or HND; the block size must divide `chunk_size`; a local cache (no transfer).
pub fn capabilities(config: &KvTransferConfig, _model: Option<&ModelSpec>) -> ConnectorResult<Capabilities> {
    let chunk_size = match config.kv_connector_extra_config.get("chunk_size") {
        None => 256,
        Some(v) => v.as_u64().filter(|n| *n > 0 && *n <= u32::MAX as u64).ok_or_else(|| {
            ConnectorError::config("lmcache", format!("chunk_size must be a positive integer, got {v}"))
        })? as u32,
    };
    let layerwise =
        config.kv_connector_extra_config.get("use_layerwise").and_then(|v| v.as_bool()).unwrap_or(false);
    Ok(Capabilities {
        hma: false,
        layout: LayoutConstraint {
            required: vec![KvLayout::NHD, KvLayout::HND],
            rejected: vec![],
            preferred: vec![KvLayout::NHD, KvLayout::HND],
        },
        adapt: None,
        block_size_multiple: 1,
        block_size_divides: Some(chunk_size),
        cache_dtypes: vec![],
        memory_kinds: vec![MemoryKind::Host, MemoryKind::Disk],
        transfer_mode: TransferMode::None,
        roles: vec![KvRoleCap::Producer, KvRoleCap::Consumer, KvRoleCap::Both],
        layerwise,
        heterogeneous_tp: false,
        mla: true,
        async_load: false,
    })
}
