//! The adapter's step metadata, from the scheduler half to the worker half (separate
//! processes in vLLM). vLLM hands every tensor-parallel rank the same metadata, and each rank
//! runs its own connector, so the metadata holds one entry per rank: the prefill engines whose
//! KV that rank loads this step, so the worker can handshake with each before its connector
//! touches their blocks, then that rank's connector's own metadata bytes, untouched.
//!
//! `KVVA`, a little-endian `u32` header length, the header as JSON (`version`, and `ranks`:
//! for each rank its `peers`, its `loads` (each loading request with the index of its peer)
//! and the length of its connector's bytes), then every rank's connector bytes in rank order.

use serde::{Deserialize, Serialize};

const MAGIC: &[u8; 4] = b"KVVA";
const VERSION: u32 = 3;

/// A prefill engine to handshake with: its id and side-channel `host:port`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Peer {
    /// `remote_engine_id` of the request's kv_transfer_params.
    pub engine_id: String,
    /// Its side channel.
    pub addr: String,
}

/// One step's peers and which request loads from which.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepPeers {
    /// Prefill engines this step loads from.
    pub peers: Vec<Peer>,
    /// `(request id, index into peers)` for each request that loads.
    pub loads: Vec<(String, usize)>,
}

impl StepPeers {
    /// Records that `request` loads from `peer`.
    pub fn add(&mut self, request: &str, peer: Peer) {
        let i = match self.peers.iter().position(|p| *p == peer) {
            Some(i) => i,
            None => {
                self.peers.push(peer);
                self.peers.len() - 1
            }
        };
        self.loads.push((request.to_owned(), i));
    }
}

#[derive(Serialize, Deserialize)]
struct RankHeader {
    #[serde(flatten)]
    step: StepPeers,
    /// Length of this rank's connector bytes.
    bytes: usize,
}

#[derive(Serialize, Deserialize)]
struct Header {
    version: u32,
    ranks: Vec<RankHeader>,
}

/// The envelope around one step's connector metadata: each rank's peers and bytes, in rank
/// order.
pub fn encode(ranks: &[(StepPeers, Vec<u8>)]) -> Result<Vec<u8>, String> {
    let header = Header {
        version: VERSION,
        ranks: ranks.iter().map(|(step, b)| RankHeader { step: step.clone(), bytes: b.len() }).collect(),
    };
    let header = serde_json::to_vec(&header).map_err(|e| format!("cannot encode the step's peers: {e}"))?;
    let len = u32::try_from(header.len()).map_err(|_| "the step's peer list is over 4 GiB".to_owned())?;
    let inner: usize = ranks.iter().map(|(_, b)| b.len()).sum();
    let mut out = Vec::with_capacity(8 + header.len() + inner);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&header);
    for (_, b) in ranks {
        out.extend_from_slice(b);
    }
    Ok(out)
}

/// Rank `rank`'s peers and connector bytes of an envelope, or why it is not one.
pub fn decode(bytes: &[u8], rank: usize) -> Result<(StepPeers, &[u8]), String> {
    let rest = bytes.strip_prefix(MAGIC.as_slice()).ok_or(
        "it does not start with KVVA: the scheduler and the worker run different kvconnect versions",
    )?;
    let (len, rest) = rest.split_at_checked(4).ok_or("it ends inside its header length")?;
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    let (header, mut inner) =
        rest.split_at_checked(len).ok_or("its header is longer than the bytes that follow")?;
    let header: Header =
        serde_json::from_slice(header).map_err(|e| format!("its header cannot be read: {e}"))?;
    if header.version != VERSION {
        return Err(format!(
            "envelope version {} (this worker reads {VERSION}): run the same kvconnect in the scheduler and \
                the workers",
            header.version
        ));
    }
    let ranks = header.ranks.len();
    for (r, h) in header.ranks.into_iter().enumerate() {
        let (mine, rest) = inner
            .split_at_checked(h.bytes)
            .ok_or_else(|| format!("rank {r}'s {} connector bytes run past the envelope's end", h.bytes))?;
        inner = rest;
        if r != rank {
            continue;
        }
        if let Some((req, i)) = h.step.loads.iter().find(|(_, i)| *i >= h.step.peers.len()) {
            return Err(format!("request {req} loads from peer {i} of {}", h.step.peers.len()));
        }
        return Ok((h.step, mine));
    }
    Err(format!(
        "it holds {ranks} tensor-parallel rank(s) and this worker is rank {rank}: the scheduler attached to \
            fewer workers than run"
    ))
}
