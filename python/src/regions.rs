//! vLLM's KV cache tensors as kvconnect regions: one region per attention layer, its blocks
//! whole and back to back (vLLM allocates `[num_blocks, ...]` per layer). The tensors are
//! checked against the negotiated block shape before the connector sees them.

#![allow(unsafe_code)] // Vouches for vLLM's KV cache tensors as regions (KvRegion::new).

use crate::error::AdapterError;
use kvconnect_api::geometry::BlockShape;
use kvconnect_api::{EffectiveLayout, KvRegion, KvRegionSpec, LayerId, MemoryKind, ModelSpec};

/// One layer's KV cache tensor as the Python half describes it.
#[derive(Debug, Clone)]
pub struct TensorDesc {
    /// vLLM's layer name.
    pub name: String,
    /// The layer's index in the model.
    pub layer: LayerId,
    /// `tensor.data_ptr()`.
    pub addr: u64,
    /// `tensor.numel() * tensor.element_size()`.
    pub len: u64,
    /// `tensor.shape[0]`.
    pub num_blocks: u32,
}

/// The regions for `tensors`, each checked: a known KV layer of a group, non-null, and
/// exactly `num_blocks` blocks of the negotiated shape.
pub fn to_regions(
    tensors: &[TensorDesc],
    model: &ModelSpec,
    eff: &EffectiveLayout,
) -> Result<Vec<KvRegion>, AdapterError> {
    let block = BlockShape::of(model, eff).layer_block_bytes() as u64;
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        let err = |message: String| AdapterError::Region { layer: t.name.clone(), message };
        let group = eff
            .groups
            .iter()
            .position(|g| g.layers.contains(&t.layer))
            .ok_or_else(|| err(format!("layer index {} is in no KV cache group of the negotiated layout ({} groups); the model's config.json and the engine's layers disagree", t.layer.0, eff.groups.len())))?;
        if t.addr == 0 {
            return Err(err("its data pointer is null".into()));
        }
        if t.len != block * u64::from(t.num_blocks) {
            return Err(err(format!(
                "{} bytes for {} blocks, but the negotiated layout (block_size {}, cache dtype {:?}, {} KV heads of head dim {}) needs {} bytes per block: vLLM's cache and the negotiation disagree",
                t.len, t.num_blocks, eff.block_size, eff.cache_dtype, model.num_kv_heads, model.head_dim, block
            )));
        }
        let spec = KvRegionSpec {
            name: t.name.clone(),
            addr: t.addr,
            len: t.len,
            memory: eff.memory,
            device: if eff.memory == MemoryKind::Host { -1 } else { 0 },
            layers: vec![t.layer],
            group: group as u32,
            num_blocks: t.num_blocks,
            shm_name: None,
        };
        // SAFETY: the memory is vLLM's KV cache tensor for this layer, of the kind the
        // negotiation named (checked by vLLM's device), `len` bytes from `addr` as the tensor
        // reports them. kvconnect.vllm keeps a reference to every tensor in the connector
        // object, which owns this worker, so the memory outlives the connector; vLLM keeps
        // its KV cache for the engine's life.
        out.push(unsafe { KvRegion::new(spec) });
    }
    Ok(out)
}
