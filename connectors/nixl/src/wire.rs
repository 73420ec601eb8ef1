//! The producer's control/data protocol: frames of a u32 big-endian length and a JSON body,
//! capped in size; block bytes follow a `Data` answer unframed, exactly as many as it says
//! (ARCHITECTURE.md §7).
//!
//! Consumer → producer: [`ClientMsg`]. Producer → consumer: [`ServerMsg`].

use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// Default cap on one control frame (as the host side channel's).
pub const DEFAULT_MAX_FRAME: usize = 16 << 20;

/// A byte run of one producer region: (region index, offset, length).
pub type WireRun = (u32, u64, u64);

/// What a consumer asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ClientMsg {
    /// Heartbeat: keep the request's blocks (renews its lease); fails when they are gone.
    Hold {
        /// The request.
        request: String,
    },
    /// Heartbeat that also checks that these runs lie inside the request's blocks (shm
    /// consumers, which copy without the producer seeing the reads).
    Check {
        /// The request.
        request: String,
        /// Runs the consumer is about to copy.
        runs: Vec<WireRun>,
    },
    /// "read request R blocks [...]": stream these runs of the request's blocks.
    Read {
        /// The request.
        request: String,
        /// Runs, each inside the request's blocks.
        runs: Vec<WireRun>,
    },
    /// The consumer has the blocks; the producer may free them.
    Done {
        /// The request.
        request: String,
    },
}

/// What a producer answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ServerMsg {
    /// Done / held.
    Ok,
    /// `bytes` bytes of block data follow, the runs in the order asked.
    Data {
        /// Bytes that follow.
        bytes: u64,
    },
    /// Refused, with the reason.
    Error {
        /// Why.
        reason: String,
    },
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The length prefix is over the cap.
    #[error("frame of {len} bytes exceeds the cap of {cap} bytes")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// The cap.
        cap: usize,
    },
    /// The body is not a valid message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The peer closed the connection between frames.
    #[error("connection closed")]
    Closed,
    /// A socket error (timeouts included).
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Writes one frame.
pub fn write_frame<W: Write>(w: &mut W, msg: &impl Serialize) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(|_| io::Error::other("frame over 4 GiB"))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)?;
    w.flush()
}

/// Reads one frame's body, refusing one over `cap` before reading it.
pub fn read_frame_bytes<R: Read>(r: &mut R, cap: usize) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(FrameError::Io(e)),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > cap {
        return Err(FrameError::TooLarge { len, cap });
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// Reads and decodes one frame.
pub fn read_frame<R: Read, T: for<'de> Deserialize<'de>>(r: &mut R, cap: usize) -> Result<T, FrameError> {
    let body = read_frame_bytes(r, cap)?;
    serde_json::from_slice(&body).map_err(|e| {
        let head = String::from_utf8_lossy(&body[..body.len().min(64)]).into_owned();
        FrameError::Malformed(format!("{e} (frame starts {head:?})"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_cap() {
        let mut buf = Vec::new();
        let m = ClientMsg::Read { request: "r1".into(), runs: vec![(0, 16, 32)] };
        write_frame(&mut buf, &m).unwrap();
        let back: ClientMsg = read_frame(&mut &buf[..], 1024).unwrap();
        assert_eq!(back, m);
        assert!(matches!(read_frame::<_, ClientMsg>(&mut &buf[..], 8), Err(FrameError::TooLarge { .. })));
        let mut junk = 5u32.to_be_bytes().to_vec();
        junk.extend_from_slice(b"hello");
        assert!(matches!(read_frame::<_, ClientMsg>(&mut &junk[..], 1024), Err(FrameError::Malformed(_))));
        assert!(matches!(read_frame::<_, ClientMsg>(&mut &[][..], 1024), Err(FrameError::Closed)));
    }
}
