//! One NIXL agent per worker, over the UCX backend: registers KV regions (host memory as DRAM,
//! GPU memory as VRAM with its device id), exchanges agent metadata, posts READ transfers,
//! polls them, and carries "done" notifications.
//!
//! Every NIXL call goes through here, so every NIXL failure becomes a [`NixlCallError`] whose
//! message carries NIXL's status name (`NIXL_ERR_BACKEND`, ...) and the call that failed.

#[cfg(feature = "nixl")]
mod agent;
#[cfg(not(feature = "nixl"))]
mod unbuilt;

#[cfg(feature = "nixl")]
pub use agent::{status_name, NixlAgent, Prepared, Registration, Transfer};
#[cfg(not(feature = "nixl"))]
pub use unbuilt::{NixlAgent, Prepared, Registration, Transfer};

use crate::nixl_lib::NixlLibError;

/// The NIXL transfer backend this connector uses.
pub const UCX: &str = "UCX";

/// A NIXL call that failed.
#[derive(Debug, thiserror::Error)]
pub enum NixlCallError {
    /// The library is not usable on this machine.
    #[error(transparent)]
    Library(#[from] NixlLibError),
    /// NIXL returned an error status.
    #[error("NIXL {op} failed: {status} ({detail})")]
    Status {
        /// The call, with what it was called on.
        op: String,
        /// NIXL's status name.
        status: &'static str,
        /// nixl-sys' description.
        detail: String,
    },
}

/// Where a registered range or a side of a transfer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NixlMem {
    /// Host memory.
    Dram,
    /// GPU memory of this CUDA device ordinal (as this process numbers it).
    Vram(u64),
}

impl NixlMem {
    /// "DRAM" or "VRAM of GPU n", for messages.
    pub fn describe(self) -> String {
        match self {
            NixlMem::Dram => "DRAM".into(),
            NixlMem::Vram(d) => format!("VRAM of GPU {d}"),
        }
    }
}

/// One local range read from one remote range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadPair {
    /// Local destination address.
    pub local: usize,
    /// Remote source address.
    pub remote: usize,
    /// Bytes.
    pub len: usize,
}

/// Hex for metadata bytes inside JSON.
pub fn to_hex(b: &[u8]) -> String {
    const H: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(H[(x >> 4) as usize] as char);
        s.push(H[(x & 15) as usize] as char);
    }
    s
}

/// Inverse of [`to_hex`]; `None` on anything else.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    let s = s.as_bytes();
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let d = |c: u8| (c as char).to_digit(16).map(|v| v as u8);
    s.chunks(2).map(|p| Some(d(p[0])? << 4 | d(p[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let b: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&b)).unwrap(), b);
        assert!(from_hex("abc").is_none());
        assert!(from_hex("zz").is_none());
    }
}
