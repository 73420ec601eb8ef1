//! The adapter's step metadata, from the scheduler half to the worker half (separate
//! processes in vLLM): the prefill engines whose KV this step loads, so the worker can
//! handshake with each before its connector touches their blocks, then the kvconnect
//! connector's own metadata bytes, untouched.
//!
//! `KVVA`, a little-endian `u32` header length, the header as JSON (`version`, `peers`, and
//! `loads`: each loading request with the index of its peer), then the connector's bytes.

use serde::{Deserialize, Serialize};

const MAGIC: &[u8; 4] = b"KVVA";
const VERSION: u32 = 2;

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
struct Header {
    version: u32,
    #[serde(flatten)]
    step: StepPeers,
}

/// The envelope around one step's connector metadata.
pub fn encode(step: &StepPeers, inner: &[u8]) -> Result<Vec<u8>, String> {
    let header = serde_json::to_vec(&Header { version: VERSION, step: step.clone() })
        .map_err(|e| format!("cannot encode the step's peers: {e}"))?;
    let len = u32::try_from(header.len()).map_err(|_| "the step's peer list is over 4 GiB".to_owned())?;
    let mut out = Vec::with_capacity(8 + header.len() + inner.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(inner);
    Ok(out)
}

/// The peers and the connector's bytes of an envelope, or why it is not one.
pub fn decode(bytes: &[u8]) -> Result<(StepPeers, &[u8]), String> {
    let rest = bytes.strip_prefix(MAGIC.as_slice()).ok_or(
        "it does not start with KVVA: the scheduler and the worker run different kvconnect versions",
    )?;
    let (len, rest) = rest.split_at_checked(4).ok_or("it ends inside its header length")?;
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    let (header, inner) =
        rest.split_at_checked(len).ok_or("its header is longer than the bytes that follow")?;
    let header: Header =
        serde_json::from_slice(header).map_err(|e| format!("its header cannot be read: {e}"))?;
    if header.version != VERSION {
        return Err(format!(
            "envelope version {} (this worker reads {VERSION}): run the same kvconnect in the scheduler and the workers",
            header.version
        ));
    }
    if let Some((r, i)) = header.step.loads.iter().find(|(_, i)| *i >= header.step.peers.len()) {
        return Err(format!("request {r} loads from peer {i} of {}", header.step.peers.len()));
    }
    Ok((header.step, inner))
}
