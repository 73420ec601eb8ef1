//! What the flexkv connector declares.

use kvconnect_api::caps::KvRoleCap;
use kvconnect_api::{
    AdaptCost, Capabilities, ConnectorResult, KvLayout, KvTransferConfig, LayoutConstraint, MemoryKind,
    ModelSpec, TransferMode,
};

/// No HMA; token-major blocks only (rejects HND) but adapts by transposing on its own copy
/// path; async loads.
pub fn capabilities(_config: &KvTransferConfig, _model: Option<&ModelSpec>) -> ConnectorResult<Capabilities> {
    Ok(Capabilities {
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
        memory_kinds: vec![MemoryKind::Host, MemoryKind::Disk],
        transfer_mode: TransferMode::None,
        roles: vec![KvRoleCap::Producer, KvRoleCap::Consumer, KvRoleCap::Both],
        layerwise: false,
        heterogeneous_tp: false,
        mla: false,
        async_load: true,
    })
}
