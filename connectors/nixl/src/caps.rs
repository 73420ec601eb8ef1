//! What the nixl connector declares.

use kvconnect_api::caps::KvRoleCap;
use kvconnect_api::{
    AttentionKind, Capabilities, ConnectorResult, KvLayout, KvTransferConfig, LayoutConstraint, MemoryKind,
    ModelSpec, TransferMode,
};

/// HMA yes; HND required for non-MLA models (like vLLM's NixlConnector); pull mode.
/// Heterogeneous TP on backends `shm` and `tcp`: a decode whose TP size divides, or is
/// divided by, prefill's reads each rank's head slices from the prefill ranks holding them
/// (`copy_plan`). Backends `nixl` and `cuda_ipc` move KV between equal TP sizes only, so
/// negotiation and the handshake refuse a peer with another one before any KV moves.
/// Per-request state (state-space / linear-attention layers) moves with backends `shm` and
/// `tcp` only, the data paths whose state copies are built and tested, and only between TP 1
/// engines (state across TP ranks is not implemented); a config that does not parse declares
/// neither (creating the connector then says what is wrong).
pub fn capabilities(config: &KvTransferConfig, model: Option<&ModelSpec>) -> ConnectorResult<Capabilities> {
    let shm_or_tcp = crate::config::NixlConfig::from_config(config)
        .is_ok_and(|c| matches!(c.backend, crate::config::Backend::Shm | crate::config::Backend::Tcp));
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
        heterogeneous_tp: shm_or_tcp,
        mla: true,
        async_load: true,
        carries_state: shm_or_tcp,
        stores_opaque_blocks: false,
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
