//! What can go wrong between vLLM and a kvconnect connector, one variant per cause, each
//! saying what to change. Python sees every one as `kvconnect.KvconnectError` with the
//! message as its only line.

use kvconnect_api::ConnectorError;

/// An error of the vLLM adapter.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// vLLM's side of the setup (what the Python half read from vLLM's config) is malformed.
    #[error(
        "kvconnect: the adapter's setup from vLLM cannot be read: {0}; this is a bug in kvconnect.vllm, \
        report it with the vLLM version"
    )]
    Setup(String),
    /// `kv_connector_extra_config` is not what the adapter takes.
    #[error("kvconnect: request {request}: {message}")]
    Request {
        /// vLLM's request id.
        request: String,
        /// What is wrong with it and what to do.
        message: String,
    },
    #[error("kvconnect: kv_connector_extra_config: {0}")]
    ExtraConfig(String),
    /// The model's config.json (vLLM's hf_config) gives no KV geometry.
    #[error("kvconnect: the model's config cannot be read as a KV cache geometry: {0}")]
    Model(String),
    /// Negotiation failed, or the named connector does not exist.
    #[error("kvconnect: {0}")]
    Negotiation(String),
    /// A KV cache tensor vLLM registered does not fit the negotiated layout.
    #[error("kvconnect: KV cache tensor '{layer}': {message}")]
    Region {
        /// vLLM's layer name.
        layer: String,
        /// What is wrong.
        message: String,
    },
    /// The connector itself failed.
    #[error("kvconnect: connector '{connector}' failed in {call}: {source}")]
    Connector {
        /// The connector's name.
        connector: String,
        /// The call.
        call: &'static str,
        /// Its error.
        source: ConnectorError,
    },
    /// The side channel (prefill) could not start.
    #[error("kvconnect: {0}")]
    SideChannel(String),
    /// A combination the adapter does not implement.
    #[error("kvconnect: not implemented: {0}")]
    NotImplemented(String),
    /// vLLM called the scheduler before it handed over the worker's scheduler socket.
    #[error(
        "kvconnect: vLLM called {call} before set_xfer_handshake_metadata handed the scheduler the \
        worker's scheduler socket; this vLLM does not pass connector handshake metadata, which \
        kvconnect.vllm needs"
    )]
    NotAttached {
        /// The call.
        call: &'static str,
    },
    /// Step metadata from the scheduler half cannot be read.
    #[error("kvconnect: step metadata from the scheduler: {0}")]
    Meta(String),
}

pyo3::create_exception!(
    _kvconnect,
    KvconnectError,
    pyo3::exceptions::PyException,
    "A kvconnect error: one line saying what happened and what to do."
);

impl From<AdapterError> for pyo3::PyErr {
    fn from(e: AdapterError) -> pyo3::PyErr {
        KvconnectError::new_err(e.to_string())
    }
}
