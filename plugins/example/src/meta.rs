//! What the scheduler half tells the worker half each step.

use kvconnect_api::serde::{Deserialize, Serialize};
use kvconnect_api::BlockId;

/// One request's blocks to fill from the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(crate = "kvconnect_api::serde")]
pub struct LoadJob {
    /// The store key.
    pub key: String,
    /// Index of the first stored block to load (blocks before it are already computed).
    pub first: usize,
    /// Destination blocks, one per stored block from `first` on.
    pub blocks: Vec<BlockId>,
}

/// One request's blocks to store after this step's forward pass.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(crate = "kvconnect_api::serde")]
pub struct SaveJob {
    /// The store key.
    pub key: String,
    /// The tokens the blocks hold (kept with the data, checked on lookup).
    pub tokens: Vec<u32>,
    /// Source blocks, in token order.
    pub blocks: Vec<BlockId>,
}

/// This step's work.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(crate = "kvconnect_api::serde")]
pub struct StepMeta {
    /// Loads to do before the forward pass.
    pub loads: Vec<LoadJob>,
    /// Saves to do as layers are computed.
    pub saves: Vec<SaveJob>,
}
