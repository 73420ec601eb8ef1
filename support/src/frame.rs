//! Length-prefixed JSON frames: a big-endian `u32` length, then that many bytes of JSON. The
//! host's side channel (ARCHITECTURE.md §6) and the nixl transport's producer listener (§7)
//! both speak them. This is the format, once; each side reads and writes the bytes with its
//! own I/O (the side channel asynchronously under deadlines, the producer's threads on
//! blocking sockets).

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Default cap on one frame's body.
pub const DEFAULT_MAX_FRAME: usize = 16 << 20;

/// Bytes of the length prefix.
pub const HEADER_LEN: usize = 4;

/// A message that cannot be put into a frame.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// It does not serialise.
    #[error("the message does not serialise as JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// Its JSON is longer than a `u32` length can say.
    #[error("a {0}-byte message does not fit a frame")]
    TooLong(usize),
}

/// A length prefix announcing more than the reader accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("frame of {len} bytes exceeds the cap of {cap} bytes")]
pub struct TooLarge {
    /// The announced length.
    pub len: usize,
    /// The cap.
    pub cap: usize,
}

/// The frame carrying `msg`, prefix and body in one buffer (one write).
pub fn encode<T: Serialize + ?Sized>(msg: &T) -> Result<Vec<u8>, EncodeError> {
    let body = serde_json::to_vec(msg)?;
    let len = u32::try_from(body.len()).map_err(|_| EncodeError::TooLong(body.len()))?;
    let mut buf = Vec::with_capacity(HEADER_LEN + body.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(&body);
    Ok(buf)
}

/// The body length a prefix announces, refused above `cap` before anything is allocated.
pub fn body_len(prefix: [u8; HEADER_LEN], cap: usize) -> Result<usize, TooLarge> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > cap {
        return Err(TooLarge { len, cap });
    }
    Ok(len)
}

/// A frame's body as a message.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, serde_json::Error> {
    serde_json::from_slice(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_is_the_body_length_big_endian() {
        let f = encode(&serde_json::json!({"a": 1})).unwrap();
        assert_eq!(&f[..HEADER_LEN], &7u32.to_be_bytes());
        assert_eq!(&f[HEADER_LEN..], br#"{"a":1}"#);
        let len = body_len(f[..HEADER_LEN].try_into().unwrap(), 1024).unwrap();
        let back: serde_json::Value = decode(&f[HEADER_LEN..HEADER_LEN + len]).unwrap();
        assert_eq!(back["a"], 1);
    }

    #[test]
    fn a_prefix_over_the_cap_is_refused_naming_both() {
        let e = body_len(u32::MAX.to_be_bytes(), DEFAULT_MAX_FRAME).unwrap_err();
        assert_eq!(e, TooLarge { len: u32::MAX as usize, cap: DEFAULT_MAX_FRAME });
        assert_eq!(
            e.to_string(),
            format!("frame of {} bytes exceeds the cap of {DEFAULT_MAX_FRAME} bytes", u32::MAX)
        );
        assert_eq!(body_len(512u32.to_be_bytes(), 512), Ok(512));
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(decode::<serde_json::Value>(b"{not json").is_err());
    }
}
