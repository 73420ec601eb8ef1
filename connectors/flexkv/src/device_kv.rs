//! KV regions in GPU memory (feature `cuda`): blocks move through pinned host copies
//! ([`kvconnect_cuda::KvStage`]).
//!
//! A save gathers the request's blocks of every layer with one kernel launch, synchronously
//! when the save is submitted (the forward pass is over then, and the next step may
//! overwrite the blocks), and hands the host copy to the pool job, which stores it block by
//! block as for host KV. A load's pool job reads the cached blocks into a host copy, then
//! scatters the blocks it read with one launch; the stage binds the GPU on the pool thread.

use crate::factory::NAME;
use kvconnect_api::{BlockId, ConnectorError, EffectiveLayout, KvRegion, ModelSpec};
use kvconnect_cuda::{HostCopy, KvStage};

/// Opens the regions' GPU and prepares the stage; any failure (no driver, no GPU, regions on
/// two GPUs, a layout one gather cannot copy) is a config error naming the cause.
pub fn open(
    regions: &[KvRegion],
    model: &ModelSpec,
    eff: &EffectiveLayout,
) -> Result<KvStage, ConnectorError> {
    KvStage::open(regions, model, eff).map_err(|e| {
        ConnectorError::config(NAME, format!("register_kv_caches: device KV regions cannot be staged: {e}"))
    })
}

/// Gathers a save's blocks (on the calling thread, before it returns).
pub fn gather(stage: &KvStage, blocks: &[BlockId]) -> Result<HostCopy, String> {
    stage.gather(blocks).map_err(|e| e.to_string())
}

/// A host copy for a load of `n` blocks.
pub fn host_copy(stage: &KvStage, n: usize) -> Result<HostCopy, String> {
    stage.host_copy(n).map_err(|e| e.to_string())
}

/// Scatters the first `loaded` blocks of a load's host copy into the device `blocks`.
pub fn scatter(stage: &KvStage, copy: &HostCopy, blocks: &[BlockId], loaded: usize) -> Result<(), String> {
    let pairs: Vec<(u32, BlockId)> =
        blocks.iter().take(loaded).enumerate().map(|(i, b)| (i as u32, *b)).collect();
    stage.scatter(copy, &pairs).map_err(|e| e.to_string())
}
