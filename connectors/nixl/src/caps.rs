//! What the nixl connector declares.

use crate::config::NixlConfig;
use kvconnect_api::caps::KvRoleCap;
use kvconnect_api::{
    AttentionKind, Capabilities, ConnectorResult, KvLayout, KvTransferConfig, LayoutConstraint, MemoryKind,
    ModelSpec, TransferMode,
};

/// HMA yes; HND required for non-MLA models (like vLLM's NixlConnector); pull mode. What
/// else it declares depends on the backend, each claim being what that backend's data path
/// does (`tests/tests/capabilities_audit.rs` names the test of each):
///
/// * **shm, tcp**: host memory (their copies read and write host memory only); heterogeneous
///   TP (a decode whose TP size divides, or is divided by, prefill's reads each rank's head
///   slices from the prefill ranks holding them, `copy_plan`); per-request state of
///   state-space / linear-attention layers (direct copies of the state slots beside the KV).
/// * **nixl**: host memory, and device memory (registered as VRAM) in builds with the `cuda`
///   feature; equal TP sizes only; no state.
/// * **cuda_ipc**: device memory only (it opens and copies GPU regions; creating it needs the
///   `cuda` feature); equal TP sizes only; no state.
///
/// No backend combines adaptations: across tensor-parallel ranks blocks are copied as they
/// are (same block size and layout on both sides), state moves only at TP 1 and only beside
/// blocks copied as they are, so `state_with_tp`, `adapts_with_tp` and `adapts_with_state` are
/// false and negotiation and the compat check refuse those pairs before launch. A config that
/// does not parse declares the most modest set (creating the connector then says what is
/// wrong).
pub fn capabilities(config: &KvTransferConfig, model: Option<&ModelSpec>) -> ConnectorResult<Capabilities> {
    let backend = NixlConfig::from_config(config).ok().map(|c| c.backend);
    let mla = model.is_some_and(|m| m.layers.iter().any(|k| matches!(k, AttentionKind::Mla { .. })));
    let layout = if mla {
        LayoutConstraint::default()
    } else {
        LayoutConstraint { required: vec![KvLayout::HND], rejected: vec![], preferred: vec![KvLayout::HND] }
    };
    let memory_kinds = backend.map_or(vec![MemoryKind::Host], |b| b.memory_kinds.to_vec());
    Ok(Capabilities {
        hma: true,
        layout,
        adapt: None,
        block_size_multiple: 1,
        block_size_divides: None,
        cache_dtypes: vec![],
        memory_kinds,
        transfer_mode: TransferMode::Pull,
        roles: vec![KvRoleCap::Producer, KvRoleCap::Consumer, KvRoleCap::Both],
        layerwise: false,
        heterogeneous_tp: backend.is_some_and(|b| b.across_tp),
        mla: true,
        async_load: true,
        carries_state: backend.is_some_and(|b| b.carries_state),
        state_with_tp: false,
        adapts_with_tp: false,
        adapts_with_state: false,
        stores_opaque_blocks: false,
        ranks_in_one_worker: backend.is_some_and(|b| b.across_tp),
        // Every backend's producer puts the side channel's address into the transfer params
        // and authenticates its peers with the deployment's secret.
        needs_side_channel: true,
        needs_data_plane_secret: true,
        // Backend shm's consumers map the producer's regions.
        needs_shared_memory_kv: backend.is_some_and(|b| b.shm_regions),
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

    #[test]
    fn memory_kinds_are_what_each_backend_copies() {
        let caps = |backend: &str| {
            let json = format!(
                r#"{{"kv_connector":"NixlConnector","kv_connector_extra_config":{{"backend":"{backend}"}}}}"#
            );
            capabilities(&KvTransferConfig::from_json(&json).unwrap(), None).unwrap()
        };
        // shm and tcp read and write host memory only, so they never claim device memory,
        // and with it the state they carry never meets device KV.
        for backend in ["shm", "tcp"] {
            let c = caps(backend);
            assert_eq!(c.memory_kinds, [MemoryKind::Host], "{backend}");
            assert!(c.carries_state && !c.state_with_tp && !c.adapts_with_tp && !c.adapts_with_state);
        }
        assert_eq!(caps("cuda_ipc").memory_kinds, [MemoryKind::Device]);
        let nixl = caps("nixl").memory_kinds;
        assert_eq!(nixl.contains(&MemoryKind::Device), cfg!(feature = "cuda"), "{nixl:?}");
        assert!(!caps("cuda_ipc").carries_state && !caps("nixl").carries_state);
    }
}
