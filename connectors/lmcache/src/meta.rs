//! What the scheduler half tells the worker half each step (`build_connector_meta` ->
//! `bind_connector_meta`), as JSON.

use crate::key::ChunkRef;
use kvconnect_api::{BlockId, ConnectorError, RequestId};
use serde::{Deserialize, Serialize};

/// Tokens of one request to load from the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSpec {
    /// The request.
    pub req: RequestId,
    /// First token to load (the engine's own prefix-cache hit ends here).
    pub start: usize,
    /// One past the last token to load.
    pub end: usize,
    /// The chunks overlapping `[start, end)`, in order.
    pub chunks: Vec<ChunkRef>,
    /// The request's block table (block `i` holds tokens `[i*block_size, (i+1)*block_size)`).
    pub blocks: Vec<BlockId>,
}

/// Chunks of one request to save once this step has computed them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaveSpec {
    /// The request.
    pub req: RequestId,
    /// Chunks not yet stored, in order.
    pub chunks: Vec<ChunkRef>,
    /// The request's block table.
    pub blocks: Vec<BlockId>,
}

/// One step's metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepMeta {
    /// Marks the bytes as this connector's.
    pub connector: String,
    /// Loads, in request order.
    pub loads: Vec<LoadSpec>,
    /// Saves, in request order.
    pub saves: Vec<SaveSpec>,
}

impl StepMeta {
    /// Encodes for `build_connector_meta`.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes what `encode` wrote; anything else is a clear error.
    pub fn decode(bytes: &[u8]) -> Result<StepMeta, ConnectorError> {
        if bytes.is_empty() {
            return Ok(StepMeta::default());
        }
        let m: StepMeta =
            serde_json::from_slice(bytes).map_err(|e| {
                ConnectorError::invalid(
                "lmcache",
                format!("connector metadata of {} bytes is not lmcache's ({e}); pass the bytes this engine's \
                    lmcache scheduler built", bytes.len()),
            )
            })?;
        if m.connector != "lmcache" {
            return Err(ConnectorError::invalid(
                "lmcache",
                format!("connector metadata is from '{}', not lmcache", m.connector),
            ));
        }
        Ok(m)
    }
}
