//! The producer's control/data protocol: frames of a u32 big-endian length and a JSON body,
//! capped in size; block bytes follow a `Data` answer unframed, exactly as many as it says
//! (ARCHITECTURE.md §7).
//!
//! Consumer → producer: [`ClientMsg`]. Producer → consumer: [`ServerMsg`].

use kvconnect_api::BlockId;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// Default cap on one control frame (the host side channel's too).
pub use kvconnect_support::frame::DEFAULT_MAX_FRAME;

/// A byte run of one producer region: (region index, offset, length).
pub type WireRun = (u32, u64, u64);

/// What a consumer asks. Every connection opens with [`ClientMsg::Auth`] answering the
/// producer's [`ServerMsg::Challenge`]; every request names its transfer capability.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ClientMsg {
    /// The answer to the challenge: the consumer's own nonce and its proof of the secret
    /// (`kvconnect_dataplane::auth::proof`, channel [`CHANNEL`]).
    Auth {
        /// The consumer's nonce (hex).
        nonce: String,
        /// HMAC over both nonces (hex).
        proof: String,
    },
    /// Heartbeat: keep the request's blocks (renews its lease); fails when they are gone.
    Hold {
        /// The request.
        request: String,
        /// Its transfer capability, as prefill put it into `kv_transfer_params`.
        #[serde(default)]
        capability: String,
    },
    /// Sent by a consumer that copies without the producer seeing the reads (shm, cuda_ipc)
    /// as it starts the copy: renew the request's lease and check that these blocks are the
    /// request's. Answered `held`, with how long the hold lasts at least, or refused.
    Pin {
        /// The request.
        request: String,
        /// Its transfer capability.
        #[serde(default)]
        capability: String,
        /// The producer blocks the consumer copies, one list per KV cache group (a state
        /// group's state slot): block ids, so the message stays small however scattered the
        /// blocks are.
        blocks: Vec<Vec<BlockId>>,
    },
    /// "read request R blocks [...]": stream these runs of the request's blocks (backend tcp
    /// only).
    Read {
        /// The request.
        request: String,
        /// Its transfer capability.
        #[serde(default)]
        capability: String,
        /// Runs, each inside the request's blocks.
        runs: Vec<WireRun>,
    },
    /// The consumer has the blocks; the producer may free them.
    Done {
        /// The request.
        request: String,
        /// Its transfer capability.
        #[serde(default)]
        capability: String,
    },
    /// One of several consumer ranks that read the request's blocks (a consumer at a larger
    /// TP size: each rank reads its heads' share) has its share; the producer frees them
    /// once every one of the `readers` has said so.
    DoneBy {
        /// The request.
        request: String,
        /// Its transfer capability.
        capability: String,
        /// This reader's index, below `readers`.
        reader: u32,
        /// How many consumer ranks read the request.
        readers: u32,
    },
}

/// The most consumer ranks that may read one request's blocks (`ClientMsg::DoneBy`).
pub const MAX_READERS: u32 = 64;

/// The channel name both sides put into their proofs on the producer listener.
pub const CHANNEL: &str = "kvconnect-nixl-producer";

/// What a producer answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ServerMsg {
    /// The first frame on every connection: prove the secret over this nonce.
    Challenge {
        /// The producer's nonce for this connection (hex).
        nonce: String,
    },
    /// The consumer's proof holds; the producer's own proof over both nonces.
    Authenticated {
        /// HMAC over both nonces, server side (hex).
        proof: String,
    },
    /// Done / held.
    Ok,
    /// The answer to `pin`: the request is held, its blocks are its own, and the hold lasts at
    /// least `ms` milliseconds from when this answer was made (unless the consumer says done).
    Held {
        /// Milliseconds the hold lasts at least.
        ms: u64,
    },
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
    /// No frame started within the wait allowed between frames.
    #[error("no frame started within {:.1}s", .0.as_secs_f64())]
    Idle(std::time::Duration),
    /// A socket error (timeouts included).
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Writes one frame.
pub fn write_frame<W: Write>(w: &mut W, msg: &impl Serialize) -> io::Result<()> {
    let buf = kvconnect_support::frame::encode(msg).map_err(io::Error::other)?;
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
    let len = kvconnect_support::frame::body_len(len, cap)
        .map_err(|e| FrameError::TooLarge { len: e.len, cap: e.cap })?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// Why a consumer could not authenticate to a producer.
#[derive(Debug, thiserror::Error)]
pub enum ClientAuthError {
    /// A frame could not be read.
    #[error("{0}")]
    Frame(#[from] FrameError),
    /// The producer refused the proof.
    #[error("{0}")]
    Refused(String),
    /// The producer does not hold this deployment's secret.
    #[error(
        "its proof of the data-plane secret is wrong: it does not hold this deployment's secret; give \
        every worker the same KVCONNECT_SIDE_CHANNEL_TOKEN or --secret-file"
    )]
    WrongServer,
    /// The producer answered out of protocol.
    #[error("{0}")]
    Protocol(String),
    /// No nonce could be made.
    #[error("{0}")]
    Rng(#[from] kvconnect_dataplane::auth::AuthError),
}

/// The consumer's side of the challenge-response that opens a connection to a producer: on
/// `Ok` both sides proved the same secret.
pub fn authenticate_client(
    s: &mut std::net::TcpStream,
    secret: Option<&kvconnect_dataplane::auth::Secret>,
    cap: usize,
) -> Result<(), ClientAuthError> {
    use kvconnect_dataplane::auth::{nonce, proof, verify, Side};
    let server_nonce = match read_frame::<_, ServerMsg>(s, cap)? {
        ServerMsg::Challenge { nonce } => nonce,
        ServerMsg::Error { reason } => return Err(ClientAuthError::Refused(reason)),
        other => {
            return Err(ClientAuthError::Protocol(format!(
                "opened with {other:?} instead of a challenge; run the same kvconnect on both sides"
            )))
        }
    };
    let mine = nonce()?;
    let p = proof(secret, CHANNEL, Side::Client, &server_nonce, &mine);
    write_frame(s, &ClientMsg::Auth { nonce: mine.clone(), proof: p }).map_err(FrameError::Io)?;
    match read_frame::<_, ServerMsg>(s, cap)? {
        ServerMsg::Authenticated { proof }
            if verify(secret, CHANNEL, Side::Server, &server_nonce, &mine, &proof) =>
        {
            Ok(())
        }
        ServerMsg::Authenticated { .. } => Err(ClientAuthError::WrongServer),
        ServerMsg::Error { reason } => Err(ClientAuthError::Refused(reason)),
        other => Err(ClientAuthError::Protocol(format!("answered {other:?} to the proof of the secret"))),
    }
}

/// Reads one frame from `stream` (through `reader`, which buffers it): waits up to `idle`
/// for the frame to start ([`FrameError::Idle`] when none does), then allows the whole rest
/// of it until `within` has passed, so a peer that drips a frame a byte at a time loses its
/// connection, as one that stalls half-way does (a timeout, [`FrameError::Io`]).
pub fn read_frame_within<T: for<'de> Deserialize<'de>>(
    reader: &mut io::BufReader<std::net::TcpStream>,
    cap: usize,
    idle: std::time::Duration,
    within: std::time::Duration,
) -> Result<T, FrameError> {
    use io::BufRead;
    reader.get_ref().set_read_timeout(Some(idle))?;
    match reader.fill_buf() {
        Ok([]) => return Err(FrameError::Closed),
        Ok(_) => {}
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
            return Err(FrameError::Idle(idle))
        }
        Err(e) => return Err(FrameError::Io(e)),
    }
    let deadline = std::time::Instant::now() + within;
    read_frame(&mut Deadline { reader, deadline }, cap)
}

/// A reader that gives every read only what is left until a deadline.
struct Deadline<'a> {
    reader: &'a mut io::BufReader<std::net::TcpStream>,
    deadline: std::time::Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the frame did not arrive whole in time"));
        }
        self.reader.get_ref().set_read_timeout(Some(left))?;
        self.reader.read(buf)
    }
}

/// A writer that gives every write only what is left until a deadline, so a peer that reads
/// slowly cannot hold a serving thread past it.
pub struct DeadlineWriter<'a> {
    /// The stream written to.
    pub stream: &'a mut std::net::TcpStream,
    /// When the whole write must be done.
    pub deadline: std::time::Instant,
}

impl DeadlineWriter<'_> {
    /// Gives the next write what is left until the deadline; an error once it has passed.
    fn arm(&mut self) -> io::Result<()> {
        let left = self.deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the answer could not be sent whole in time",
            ));
        }
        self.stream.set_write_timeout(Some(left))
    }
}

impl Write for DeadlineWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm()?;
        self.stream.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.arm()?;
        self.stream.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// Reads and decodes one frame.
pub fn read_frame<R: Read, T: for<'de> Deserialize<'de>>(r: &mut R, cap: usize) -> Result<T, FrameError> {
    let body = read_frame_bytes(r, cap)?;
    kvconnect_support::frame::decode(&body).map_err(|e| {
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
        let m = ClientMsg::Read { request: "r1".into(), capability: "c".into(), runs: vec![(0, 16, 32)] };
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
