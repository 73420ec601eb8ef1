//! What the nixl connector declares.

use kvconnect_api::caps::KvRoleCap;
use kvconnect_api::{
    AttentionKind, Capabilities, ConnectorResult, KvLayout, KvTransferConfig, LayoutConstraint, MemoryKind,
    ModelSpec, TransferMode,
};

/// HMA yes; HND required for non-MLA models (like vLLM's NixlConnector); pull mode.
/// Heterogeneous TP where the backend says so (`BackendInfo::across_tp`: shm and tcp): a
/// decode whose TP size divides, or is divided by, prefill's reads each rank's head slices
/// from the prefill ranks holding them (`copy_plan`). The others (nixl, cuda_ipc) move KV
/// between equal TP sizes only, so negotiation and the handshake refuse a peer with another
/// one before any KV moves. Per-request state (state-space / linear-attention layers) moves
/// where the backend says so (`carries_state`: shm and tcp, the data paths whose state
/// copies are built and tested), and only between TP 1 engines (state across TP ranks is not
/// implemented); a config that does not parse declares neither (creating the connector then
/// says what is wrong).
pub fn capabilities(config: &KvTransferConfig, model: Option<&ModelSpec>) -> ConnectorResult<Capabilities> {
    let backend = crate::config::NixlConfig::from_config(config).ok().map(|c| c.backend);
    let mla = model.is_some_and(|m| m.layers.iter().any(|k| matches!(k, AttentionKind::Mla { .. })));
    let layout = if mla {
        LayoutConstraint::default()
    } else {
        LayoutConstraint { required: vec![KvLayout::HND], rejected: vec![], preferred: vec![KvLayout::HND] }
    };
    Ok(Capabilities {
        hma: true,
        layout,
        adapt: None,
        block_size_multiple: 1,
        block_size_divides: None,
        cache_dtypes: vec![],
        // Device KV regions need backend cuda_ipc or nixl (registered as VRAM), compiled only
        // with the `cuda` feature; shm and tcp refuse them at registration.
        memory_kinds: if cfg!(feature = "cuda") {
            vec![MemoryKind::Host, MemoryKind::Device]
        } else {
            vec![MemoryKind::Host]
        },
        transfer_mode: TransferMode::Pull,
        roles: vec![KvRoleCap::Producer, KvRoleCap::Consumer, KvRoleCap::Both],
        layerwise: false,
        heterogeneous_tp: backend.is_some_and(|b| b.across_tp),
        mla: true,
        async_load: true,
        carries_state: backend.is_some_and(|b| b.carries_state),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heterogeneous_tp_only_on_the_backends_that_move_head_slices() {
        for (backend, across) in [("shm", true), ("tcp", true), ("nixl", false), ("cuda_ipc", false)] {
            let json = format!(
                r#"{{"kv_connector":"NixlConnector","kv_connector_extra_config":{{"backend":"{backend}"}}}}"#
            );
            let config = KvTransferConfig::from_json(&json).unwrap();
            assert_eq!(capabilities(&config, None).unwrap().heterogeneous_tp, across, "{backend}");
        }
    }
}
