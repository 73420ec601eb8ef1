//! What the worker server and the P/D proxy both speak: the OpenAI request parameters and
//! error bodies, request ids, server-sent event streams, the API-key and in-flight gate, the
//! HTTP accept loop and the Prometheus metrics of `/metrics`.

pub mod chat_template;
pub mod error;
pub mod gate;
pub mod metrics;
pub mod params;
pub mod request_id;
pub mod serve;
pub mod stream;
pub mod unsupported;

/// The reference engine's context window (`max_position_embeddings` of its config).
pub const CONTEXT_TOKENS: usize = 4096;
