//! Why a transfer failed. A failed pull is reported in `failed_recving`; the message is
//! logged with the request id.

use kvconnect_api::geometry::GeometryError;
use kvconnect_dataplane::shm::ShmError;
use std::io;

/// A transfer that did not complete.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The blocks asked for do not fit either side's geometry or block lists.
    #[error("cannot plan the copy: {0}")]
    Plan(String),
    /// A transfer this data path does not build.
    #[error("not implemented: {0}")]
    NotImplemented(String),
    /// A block address outside the registered regions.
    #[error("block address: {0}")]
    Geometry(#[from] GeometryError),
    /// The producer refused (blocks freed, lease expired, unknown request, bad run).
    #[error("producer engine '{engine}' refused: {reason}")]
    Refused {
        /// The producer.
        engine: String,
        /// Its reason.
        reason: String,
    },
    /// No handshake with that engine yet.
    #[error(
        "no handshake metadata for engine '{0}': the host must complete the side-channel handshake \
        before loading from it"
    )]
    UnknownPeer(String),
    /// A socket error or timeout.
    #[error("{op} with producer engine '{engine}' at {addr} failed: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The producer.
        engine: String,
        /// Its address.
        addr: String,
        /// The error.
        source: io::Error,
    },
    /// The producer broke the protocol.
    #[error("producer engine '{engine}' broke the protocol: {message}")]
    Protocol {
        /// The producer.
        engine: String,
        /// What it did.
        message: String,
    },
    /// A CUDA call of backend cuda_ipc failed (a peer's handle that cannot be opened, a
    /// kernel launch, a stream error).
    #[error("cuda_ipc: {0}")]
    Cuda(String),
    /// A shared-memory segment could not be used.
    #[error("shm: {0}")]
    Shm(#[from] ShmError),
    /// A NIXL call failed (the message carries NIXL's status name).
    #[error("{0}")]
    Nixl(#[from] crate::nixl_agent::NixlCallError),
    /// A NIXL transfer did not finish in time.
    #[error(
        "NIXL READ of {bytes} bytes from producer engine '{engine}' did not finish within {seconds:.1}s \
        (producer dead or stalled)"
    )]
    NixlTimeout {
        /// The producer.
        engine: String,
        /// Bytes asked for.
        bytes: u64,
        /// The limit.
        seconds: f64,
    },
}

impl TransferError {
    /// Whether the data path to the producer failed (a socket, a mapping, NIXL, CUDA), as
    /// opposed to a refusal or a plan that cannot be made: what the consumer kept for that
    /// producer may be stale.
    pub fn is_transport(&self) -> bool {
        matches!(
            self,
            TransferError::Io { .. }
                | TransferError::Protocol { .. }
                | TransferError::Cuda(_)
                | TransferError::Shm(_)
                | TransferError::Nixl(_)
                | TransferError::NixlTimeout { .. }
        )
    }
}
