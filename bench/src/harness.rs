//! Building blocks for driving the connector without a host: KV regions allocated here (heap
//! or shared memory), contexts, and a synthetic model. Used by this crate's tests and
//! benchmarks and by `kvconnect bench transfer`; a real host allocates regions in its pool.

#![allow(unsafe_code)] // The test harness's engine memory (heap or shm) vouched for as regions.

use kvconnect_api::geometry::BlockShape;
use kvconnect_api::{
    AttentionKind, ConnectorContext, Dtype, EffectiveLayout, KvGroup, KvLayout, KvRegion, KvRegionSpec,
    KvRole, KvTransferConfig, LayerId, MemoryKind, ModelSpec, TransferMode,
};
use kvconnect_dataplane::shm::{ShmError, ShmSegment};

/// A full-attention model with `layers` layers.
pub fn model(layers: u32, kv_heads: u32, head_dim: u32) -> ModelSpec {
    ModelSpec {
        name: format!("synthetic-{layers}x{kv_heads}x{head_dim}"),
        num_layers: layers,
        num_kv_heads: kv_heads,
        head_dim,
        dtype: Some(Dtype::Bf16),
        layers: vec![AttentionKind::Full; layers as usize],
        state: None,
    }
}

/// A bf16 host layout with one KV cache group holding every layer.
pub fn effective(model: &ModelSpec, layout: KvLayout, block_size: u32) -> EffectiveLayout {
    EffectiveLayout {
        layout,
        hma: false,
        block_size,
        cache_dtype: Dtype::Bf16,
        memory: MemoryKind::Host,
        transfer_mode: TransferMode::Pull,
        groups: vec![KvGroup { kind: AttentionKind::Full, layers: model.kv_layers() }],
        state_groups: vec![],
        opaque_blocks: false,
    }
}

/// A context for one engine; `extra` becomes `kv_connector_extra_config`.
pub fn context(
    model: &ModelSpec,
    eff: &EffectiveLayout,
    role: KvRole,
    engine_id: &str,
    extra: serde_json::Value,
) -> ConnectorContext {
    let mut config = KvTransferConfig::named("NixlConnector");
    config.kv_role = Some(role);
    config.engine_id = Some(engine_id.to_owned());
    config.kv_connector_extra_config = extra.as_object().cloned().unwrap_or_default();
    ConnectorContext {
        config,
        model: model.clone(),
        effective: eff.clone(),
        role,
        engine_id: engine_id.to_owned(),
        tp_rank: 0,
        tp_size: 1,
    }
}

enum Backing {
    Heap(Vec<u8>),
    Shm(ShmSegment),
}

/// KV regions laid out as an effective layout says: one per KV layer (per-layer layouts)
/// or one per group (cross-layer layouts).
pub struct Regions {
    backing: Vec<Backing>,
    regions: Vec<KvRegion>,
}

impl Regions {
    /// Allocates zeroed regions of `num_blocks` blocks; in shared memory named
    /// `{shm_prefix}-{i}` when a prefix is given (it must start with '/').
    pub fn allocate(
        model: &ModelSpec,
        eff: &EffectiveLayout,
        num_blocks: u32,
        shm_prefix: Option<&str>,
    ) -> Result<Regions, ShmError> {
        let shape = BlockShape::of(model, eff);
        let sets: Vec<(u32, Vec<LayerId>)> = if eff.layout.is_cross_layer() {
            eff.groups.iter().enumerate().map(|(g, grp)| (g as u32, grp.layers.clone())).collect()
        } else {
            eff.groups
                .iter()
                .enumerate()
                .flat_map(|(g, grp)| grp.layers.iter().map(move |l| (g as u32, vec![*l])))
                .collect()
        };
        let mut backing = Vec::new();
        let mut regions = Vec::new();
        for (i, (group, layers)) in sets.into_iter().enumerate() {
            let len = layers.len() * num_blocks as usize * shape.layer_block_bytes();
            let (b, addr, shm_name) = match shm_prefix {
                Some(p) => {
                    let seg = ShmSegment::create(&format!("{p}-{i}"), len)?;
                    let addr = seg.ptr() as u64;
                    let name = seg.name().to_owned();
                    (Backing::Shm(seg), addr, Some(name))
                }
                None => {
                    let mut v = vec![0u8; len.max(1)];
                    let addr = v.as_mut_ptr() as u64;
                    (Backing::Heap(v), addr, None)
                }
            };
            backing.push(b);
            let spec = KvRegionSpec {
                name: format!("region.{i}"),
                addr,
                len: len as u64,
                memory: MemoryKind::Host,
                device: -1,
                layers,
                group,
                num_blocks,
                shm_name,
            };
            // SAFETY: the region is the heap buffer or segment just pushed to `backing`, which
            // `Regions` keeps (never moving the bytes) until it is dropped; tests drop the
            // workers they register the regions with first.
            regions.push(unsafe { KvRegion::new(spec) });
        }
        Ok(Regions { backing, regions })
    }

    /// The regions to register. Their memory goes with `self`: drop the workers they were
    /// registered with first.
    pub fn regions(&self) -> &[KvRegion] {
        &self.regions
    }

    /// Region `i`'s bytes, for filling and checking (not while a transfer into it runs).
    pub fn bytes_mut(&mut self, i: usize) -> &mut [u8] {
        let len = self.regions[i].len() as usize;
        match &mut self.backing[i] {
            Backing::Heap(v) => &mut v[..len],
            // SAFETY: the segment maps `len` bytes read-write for as long as `self` lives, and
            // `&mut self` makes this the only view handed out.
            Backing::Shm(s) => unsafe { std::slice::from_raw_parts_mut(s.ptr(), len) },
        }
    }
}
