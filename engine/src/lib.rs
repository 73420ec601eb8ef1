//! The reference engine: a KV block pool over host-memory regions laid out as the effective
//! layout says, a per-step driver that calls the connector API in vLLM's order, and a small
//! deterministic reference transformer that reads and writes its KV only through that pool.
//!
//! The reference engine exists so tests can prove that disaggregated serving (prefill on one
//! engine, decode on another with the transferred KV) gives exactly the tokens a single
//! engine gives. It is not a serving engine: no batching tricks, no preemption, no chunked
//! prefill.
//!
//! Public API, in the order a user meets it:
//! * [`ReferenceConfig`] — the reference model's `config.json` (Hugging Face style); its
//!   [`ReferenceConfig::model_spec`] is what negotiation sees.
//! * [`local_effective_layout`] — an effective layout for a single engine without
//!   negotiation (tests, monolithic runs).
//! * [`Engine`] with [`EngineConfig`], [`GenRequest`], [`RequestOutput`], [`FinishReason`],
//!   [`StepStats`] — the engine and its step loop.
//! * [`SamplingParams`] / [`TokenLogprobs`] — how a request's tokens are chosen (greedy by
//!   default, seeded sampling) and the log-probabilities reported for them.
//! * [`KvPool`] — the block pool (regions, block tables); [`shm`] — shared-memory regions.
//! * [`tokenize`] / [`detokenize`] — the byte-level tokenizer.

pub mod device_pool;
pub mod engine;
pub mod error;
pub mod forward;
pub mod kv_codec;
pub mod model;
pub mod pool;
pub mod prefix_cache;
pub mod prng;
pub mod region;
pub mod sampling;
pub mod shm;
pub mod state_layer;
pub mod state_pool;
pub mod tokenizer;
pub mod tp;

pub use engine::{
    Cancel, Completion, Engine, EngineConfig, FinishReason, GenRequest, RequestOutput, StepStats,
};
pub use error::EngineError;
pub use model::{ReferenceConfig, ReferenceModel};
pub use pool::{local_effective_layout, KvPool};
pub use sampling::{SamplingParams, TokenLogprobs};
pub use tokenizer::{detokenize, tokenize};
