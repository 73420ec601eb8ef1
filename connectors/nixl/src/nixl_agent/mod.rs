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
