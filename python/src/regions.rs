//! vLLM's KV cache tensors as kvconnect regions: one region per attention layer, described
//! from the tensor's own shape, strides, dtype and device (`kvconnect_api::engine_tensor`)
//! and checked against the negotiated layout before the connector sees it. Over the nixl
//! `shm` backend each region is also the shared-memory segment vLLM's KV cache was put in
//! (`shm_kv`).

#![allow(unsafe_code)] // Vouches for vLLM's KV cache tensors as regions (KvRegion::new).

use crate::error::AdapterError;
use crate::shm_kv;
use kvconnect_api::engine_tensor::{describe, Expected, TensorDesc};
use kvconnect_api::geometry::BlockShape;
use kvconnect_api::{EffectiveLayout, KvRegion, KvRegionSpec, ModelSpec};

/// The regions for `tensors`, each checked: a KV layer of a group, described as the
/// negotiated layout (`num_blocks`: the blocks vLLM allocated, when known) and, with
/// `in_shared_memory`, one of the segments vLLM's KV cache was allocated in.
pub fn to_regions(
    tensors: &[TensorDesc],
    model: &ModelSpec,
    eff: &EffectiveLayout,
    num_blocks: Option<u64>,
    in_shared_memory: bool,
) -> Result<Vec<KvRegion>, AdapterError> {
    if let Some(g) = eff.state_groups.first() {
        return Err(AdapterError::NotImplemented(format!(
            "a model with state layers (layers {:?}: Mamba or linear attention) inside vLLM: kvconnect does \
                not describe vLLM's state tensors as regions yet; serve it P/D with kvconnect's own workers \
                (kvconnect up)",
            g.layers.iter().map(|l| l.0).collect::<Vec<_>>()
        )));
    }
    let shape = BlockShape::of(model, eff);
    let expected = Expected {
        num_blocks,
        block_size: u64::from(eff.block_size),
        heads: u64::from(shape.heads),
        head_dim: u64::from(shape.head_dim),
        kv_parts: u64::from(shape.kv_parts),
        dtype: eff.cache_dtype,
        memory: eff.memory,
        opaque: eff.opaque_blocks,
        layout: eff.layout,
    };
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        let err = |message: String| AdapterError::Region { layer: t.name.clone(), message };
        let group = eff.groups.iter().position(|g| g.layers.contains(&t.layer)).ok_or_else(|| {
            err(format!(
                "layer index {} is in no KV cache group of the negotiated layout ({} \
                groups); the model's config.json and the engine's layers disagree",
                t.layer.0,
                eff.groups.len()
            ))
        })?;
        let d = describe(t, &expected).map_err(|e| err(e.to_string()))?;
        // Opaque blocks are vLLM's CPU backend's, `[B, H, N, 2C]`: heads outermost in a block,
        // which moving KV between TP sizes relies on.
        let heads_outer = [shape.heads, eff.block_size, shape.kv_parts * shape.head_dim].map(u64::from);
        if eff.opaque_blocks && t.shape.get(1..) != Some(heads_outer.as_slice()) {
            return Err(err(format!(
                "not implemented: vLLM's CPU KV cache tensor has shape {:?}; kvconnect reads it as \
                    [num_blocks, heads, block_size, 2 * head_dim] = [_, {}, {}, {}] (heads outermost in a \
                    block)",
                t.shape, heads_outer[0], heads_outer[1], heads_outer[2]
            )));
        }
        let shm_name = if in_shared_memory {
            Some(shm_kv::segment_at(t.addr, d.len).ok_or_else(|| {
                err("it is not in the shared memory kvconnect gave vLLM for its KV cache (vLLM did not \
                    allocate it inside the connector's get_mem_pool_context), so the nixl backend 'shm' \
                    cannot serve it; use backend 'tcp'"
                    .into())
            })?)
        } else {
            None
        };
        let spec = KvRegionSpec {
            name: t.name.clone(),
            addr: t.addr,
            len: d.len,
            memory: eff.memory,
            device: d.device,
            layers: vec![t.layer],
            group: group as u32,
            num_blocks: d.num_blocks,
            shm_name,
        };
        // SAFETY: the memory is vLLM's KV cache tensor for this layer, of the kind the
        // negotiation named (checked against the tensor's device), dense over `len` bytes
        // from `addr` as its shape and strides say. kvconnect.vllm keeps a reference to every
        // tensor in the connector object, which owns this worker, so the memory outlives the
        // connector; vLLM keeps its KV cache for the engine's life.
        out.push(unsafe { KvRegion::new(spec) });
    }
    Ok(out)
}
