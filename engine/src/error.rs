//! What can go wrong in the reference engine.

use kvconnect_api::kv_memory::RegionError;
use kvconnect_api::ConnectorError;

/// An error of the reference engine: pool, shared memory, model config, requests, connector.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The reference model's config.json cannot be used.
    #[error("reference model config: {0}")]
    ModelConfig(String),
    /// The effective layout cannot be served by this engine.
    #[error("effective layout not usable by the worker: {0}")]
    Layout(String),
    /// A tensor-parallel size the model's KV heads cannot be split across.
    #[error(
        "tp_size {tp_size} does not divide the model's {kv_heads} KV heads: each rank holds an equal \
        share of them; use a tp_size that divides {kv_heads}"
    )]
    TpSize {
        /// The tensor-parallel size asked for.
        tp_size: u32,
        /// The model's KV heads.
        kv_heads: u32,
    },
    /// The pool's regions failed the layout check (a bug in the pool if it ever happens).
    #[error("KV pool regions do not match the effective layout: {0}")]
    Regions(#[from] RegionError),
    /// A shared-memory call failed.
    #[error(
        "shared memory segment '{name}': {op} failed: {source}; check /dev/shm space and that no stale \
        segment of that name exists"
    )]
    Shm {
        /// Segment name.
        name: String,
        /// The call (`shm_open`, `ftruncate`, `mmap`).
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// Host memory for a region could not be allocated.
    #[error("cannot allocate {bytes} bytes of host memory for KV region '{name}': lower num_blocks")]
    Alloc {
        /// Region name.
        name: String,
        /// Bytes asked for.
        bytes: usize,
    },
    /// A request that can never be served or is malformed.
    #[error("request '{id}': {reason}")]
    BadRequest {
        /// The request.
        id: String,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A request id that is already in the engine (running, or its blocks held for a
    /// remote decode).
    #[error(
        "request '{id}': a request with this id is still in the engine (running, or its KV held for a \
        remote decode); send a unique X-Request-Id or request_id"
    )]
    DuplicateId {
        /// The id.
        id: String,
    },
    /// A connector call failed in a way that stops the step.
    #[error("connector call {method} failed: {source}")]
    Connector {
        /// The method.
        method: &'static str,
        /// The connector's error.
        source: ConnectorError,
    },
    /// Requests stayed unfinished for too many steps (a connector never answered).
    #[error(
        "{steps} steps passed and requests {waiting:?} are still unfinished: a connector reports a load \
        as neither finished nor failed"
    )]
    Stalled {
        /// Steps run.
        steps: u64,
        /// The requests still waiting.
        waiting: Vec<String>,
    },
    /// Reading or writing a block of the pool failed (block id out of range: a bug).
    #[error("GPU KV regions (kv_buffer_device=\"cuda\"): {0}")]
    Device(String),
    /// Reading or writing the pool failed.
    #[error("KV pool access failed: {0}")]
    Access(String),
}

impl EngineError {
    /// The connector's error, when a connector call failed.
    pub fn connector_error(&self) -> Option<&ConnectorError> {
        match self {
            EngineError::Connector { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<kvconnect_dataplane::shm::ShmError> for EngineError {
    fn from(e: kvconnect_dataplane::shm::ShmError) -> Self {
        use kvconnect_dataplane::shm::ShmError;
        match e {
            ShmError::Os { name, op, source } => EngineError::Shm { name, op, source },
            ShmError::BadName(ref name)
            | ShmError::SizeMismatch { ref name, .. }
            | ShmError::NotPrivate { ref name, .. } => EngineError::Shm {
                name: name.clone(),
                op: "shm_open",
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()),
            },
        }
    }
}
