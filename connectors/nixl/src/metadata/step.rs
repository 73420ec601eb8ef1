//! What the scheduler half tells the worker half each step (serialized as JSON).

use kvconnect_api::{BlocksPerGroup, RequestId};
use serde::{Deserialize, Serialize};

/// A pull to start: copy tokens `[first_token, num_tokens)` of `request` from the remote
/// engine's blocks into the local ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSpec {
    /// The request, as this engine knows it.
    pub request: RequestId,
    /// The id the producer holds the request's blocks under, when it differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request: Option<RequestId>,
    /// The engine holding the KV.
    pub remote_engine_id: String,
    /// The transfer capability the producer issued for the request (`remote_capability` in
    /// `kv_transfer_params`); every message about it names it.
    #[serde(default)]
    pub remote_capability: String,
    /// The side-channel address the params name (`remote_host:remote_port`): the load uses
    /// the peer the host handshook with there, so two producers claiming one engine id are
    /// never mixed up.
    #[serde(default)]
    pub remote_side_channel: String,
    /// Its blocks, one list per KV cache group, from the first token on.
    pub remote_blocks: BlocksPerGroup,
    /// This engine's blocks for the request, one list per group, from the first token on.
    pub local_blocks: BlocksPerGroup,
    /// First token to load (tokens before it are already computed locally).
    pub first_token: usize,
    /// One past the last token to load.
    pub num_tokens: usize,
}

impl LoadSpec {
    /// A request that matched nothing to load (its tokens are all computed locally), whose
    /// producer blocks should be freed now rather than at lease expiry.
    pub fn release(request: RequestId, remote_engine_id: String, remote_capability: String) -> LoadSpec {
        LoadSpec {
            request,
            remote_request: None,
            remote_engine_id,
            remote_capability,
            remote_side_channel: String::new(),
            remote_blocks: BlocksPerGroup::default(),
            local_blocks: BlocksPerGroup::default(),
            first_token: 0,
            num_tokens: 0,
        }
    }

    /// The id to address the producer with: the one it holds the blocks under.
    pub fn producer_request(&self) -> &str {
        self.remote_request.as_ref().unwrap_or(&self.request).0.as_str()
    }

    /// True for [`LoadSpec::release`]: nothing to copy, only the producer to notify.
    pub fn is_release(&self) -> bool {
        self.remote_blocks.0.is_empty()
            && self.local_blocks.0.is_empty()
            && self.num_tokens == self.first_token
    }
}

/// A finished request whose blocks this (producer) engine keeps for a consumer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendSpec {
    /// The request.
    pub request: RequestId,
    /// The capability a consumer must name to read them.
    pub capability: String,
    /// Its blocks, one list per group.
    pub blocks: BlocksPerGroup,
}

/// One step's metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlMeta {
    /// Loads to start this step (consumer).
    pub loads: Vec<LoadSpec>,
    /// Requests that finished with delayed free (producer).
    pub sends: Vec<SendSpec>,
}
