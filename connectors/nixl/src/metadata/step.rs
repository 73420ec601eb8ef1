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
    /// `(index, count)` when this engine's rank is one of several consumer ranks reading
    /// the producer rank's blocks (a decode at a larger TP size): the producer frees them
    /// once every reader is done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reader: Option<(u32, u32)>,
    /// Producer ranks this request loads from, one load each (a decode at a smaller TP size
    /// reads its heads from several); the request is loaded once all of them are.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub sources: u32,
    /// A synchronous load (`load: "sync"`): the engine computes with its blocks in the step
    /// that starts it, so the worker's `wait_for_layer_load` waits for it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sync: bool,
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
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
            reader: None,
            sources: 1,
            sync: false,
        }
    }

    /// The id to address the producer with: the one it holds the blocks under.
    pub fn producer_request(&self) -> &str {
        self.remote_request.as_ref().unwrap_or(&self.request).0.as_str()
    }

    /// The local blocks the load writes, the ones a failed load leaves unfilled: in each of
    /// the first `kv_groups` groups (attention, `block_size` tokens a block) those holding
    /// tokens `[first_token, num_tokens)`, and every block of the groups after them (state
    /// slots, written whole). Blocks before `first_token` hold KV computed here (a local
    /// prefix hit) and are not among them, so the engine recomputes from the first block
    /// the load was to fill, not from the prompt's start.
    pub fn written_blocks(&self, kv_groups: usize, block_size: usize) -> Vec<kvconnect_api::BlockId> {
        let bs = block_size.max(1);
        let (from, to) = (self.first_token / bs, self.num_tokens.div_ceil(bs));
        let mut out = Vec::new();
        for (g, blocks) in self.local_blocks.0.iter().enumerate() {
            if g < kv_groups {
                out.extend(blocks.iter().take(to).skip(from).copied());
            } else {
                out.extend(blocks.iter().copied());
            }
        }
        out
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::BlockId;

    fn load(groups: Vec<Vec<u32>>, first_token: usize, num_tokens: usize) -> LoadSpec {
        let b = BlocksPerGroup(groups.into_iter().map(|g| g.into_iter().map(BlockId).collect()).collect());
        LoadSpec {
            local_blocks: b.clone(),
            remote_blocks: b,
            first_token,
            num_tokens,
            ..LoadSpec::release(RequestId("r".into()), "p".into(), String::new())
        }
    }

    fn ids(v: Vec<BlockId>) -> Vec<u32> {
        v.into_iter().map(|b| b.0).collect()
    }

    #[test]
    fn a_whole_load_writes_every_block() {
        assert_eq!(ids(load(vec![vec![7, 3, 9]], 0, 96).written_blocks(1, 32)), [7, 3, 9]);
        // A partial last block is written too.
        assert_eq!(ids(load(vec![vec![7, 3, 9]], 0, 70).written_blocks(1, 32)), [7, 3, 9]);
    }

    #[test]
    fn blocks_of_a_local_prefix_hit_are_not_written() {
        // Two blocks computed here, the third and fourth loaded.
        assert_eq!(ids(load(vec![vec![7, 3, 9, 4]], 64, 128).written_blocks(1, 32)), [9, 4]);
        // Blocks past the last loaded token (the part decode computes) neither.
        assert_eq!(ids(load(vec![vec![7, 3, 9, 4, 5]], 32, 96).written_blocks(1, 32)), [3, 9]);
    }

    #[test]
    fn state_groups_are_written_whole() {
        let l = load(vec![vec![7, 3, 9], vec![11]], 32, 96);
        assert_eq!(ids(l.written_blocks(1, 32)), [3, 9, 11]);
    }
}
