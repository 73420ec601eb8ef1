//! The connector's scheduler half lives in the worker process, beside its worker half, as it
//! does in kvconnect's own workers: connectors such as lmcache and flexkv share one store
//! between their halves, and vLLM runs its scheduler in another process. The worker (TP rank
//! 0) serves the half on a Unix socket in a private directory ([`server`]); vLLM hands the
//! socket's path to the scheduler process through its handshake-metadata hooks, and the
//! adapter's scheduler calls it there ([`client`]).
//!
//! Frames: a big-endian `u32` length, then that many bytes. A call is one JSON frame
//! ([`Call`]); its answer is one JSON frame ([`Reply`]), and for `build_connector_meta` one
//! more frame with the metadata's raw bytes.

pub mod client;
pub mod server;

use kvconnect_api::{
    BlocksPerGroup, ConnectorError, KvEvent, MatchResult, Request, RequestFinished, StepInfo,
};
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// Frames above this are refused before their body is read.
const MAX_FRAME: usize = 256 << 20;

/// One scheduler-half call, tagged by the variant's name as its one key (`{"match": {...}}`):
/// read in one pass. A tag among the fields (`{"call": "match", ...}`) would have the reader
/// keep the whole call aside first, and a 410-token prompt then took 11-14 µs to read instead
/// of 4.5.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Call {
    /// `get_num_new_matched_tokens`.
    Match { request: Request, num_computed: usize },
    /// `update_state_after_alloc`.
    Alloc { request: Request, blocks: BlocksPerGroup, num_external: usize },
    /// `build_connector_meta`; the reply is followed by the metadata's bytes.
    Meta { step: StepInfo },
    /// `request_finished`.
    Finished { request: Request, blocks: BlocksPerGroup },
    /// `take_events`.
    Events,
    /// `reset_cache`.
    Reset,
}

impl Call {
    /// The vLLM connector method it stands for.
    pub fn method(&self) -> &'static str {
        match self {
            Call::Match { .. } => "get_num_new_matched_tokens",
            Call::Alloc { .. } => "update_state_after_alloc",
            Call::Meta { .. } => "build_connector_meta",
            Call::Finished { .. } => "request_finished",
            Call::Events => "take_events",
            Call::Reset => "reset_cache",
        }
    }
}

/// The answer to a [`Call`].
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    /// To `Match`.
    Matched(MatchResult),
    /// To `Alloc`.
    Done,
    /// To `Meta`: the bytes follow in the next frame.
    Meta,
    /// To `Finished`.
    Finished(RequestFinished),
    /// To `Events`.
    Events(Vec<KvEvent>),
    /// To `Reset`: whether the store was emptied.
    Reset(bool),
    /// The connector's error, or why the call could not be served.
    Error(ConnectorError),
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    let len = u32::try_from(bytes.len()).ok().filter(|&l| l as usize <= MAX_FRAME).ok_or_else(|| {
        io::Error::other(format!("a frame of {} bytes is over the cap of {MAX_FRAME}", bytes.len()))
    })?;
    w.write_all(&len.to_be_bytes())?;
    w.write_all(bytes)?;
    w.flush()
}

/// Reads one frame; `Ok(None)` when the peer closed the connection between frames. The
/// prefix is kvconnect's one frame format (`kvconnect_support::frame`); the body is bytes, which
/// are JSON except a `Meta` reply's second frame.
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; kvconnect_support::frame::HEADER_LEN];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = kvconnect_support::frame::body_len(len, MAX_FRAME).map_err(io::Error::other)?;
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(Some(buf))
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod bench;
