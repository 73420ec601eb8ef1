//! What the scheduler half tells the worker half each step (`build_connector_meta` ->
//! `bind_connector_meta`), as JSON.

use kvconnect_api::{BlockId, RequestId};
use serde::{Deserialize, Serialize};

/// Copy cached blocks into the KV cache. The scheduler referenced every block in `hashes`
/// when it matched them; the worker drops those references when the load is over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadOp {
    /// The request.
    pub req: RequestId,
    /// Block keys, in prompt order.
    pub hashes: Vec<u64>,
    /// Destination block ids, one per key.
    pub blocks: Vec<BlockId>,
}

/// Save a request's full prompt blocks, computed in this step, into the cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaveOp {
    /// The request.
    pub req: RequestId,
    /// Block keys of the prompt's full blocks from the first one, in order.
    pub hashes: Vec<u64>,
    /// Source block ids, one per key.
    pub blocks: Vec<BlockId>,
}

/// One step's worth of work for the worker half.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlexkvMeta {
    /// Loads to start.
    #[serde(default)]
    pub loads: Vec<LoadOp>,
    /// Saves to run after this step's forward pass.
    #[serde(default)]
    pub saves: Vec<SaveOp>,
    /// Requests that finished with their blocks held for a save.
    #[serde(default)]
    pub finished: Vec<RequestId>,
}
