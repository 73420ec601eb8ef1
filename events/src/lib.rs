//! KV cache events on vLLM's wire.
//!
//! [`codec`] writes and reads vLLM's msgpack `KVEventBatch` (the event model is
//! `kvconnect_api::kv_events`); [`publisher`] sends batches on a ZeroMQ PUB socket as
//! `(topic, seq, payload)` and answers replay requests on a ROUTER socket, as vLLM's
//! `ZmqEventPublisher` does, so that a subscriber written for vLLM reads kvconnect's workers
//! unchanged.

pub mod codec;
pub mod publisher;

pub use codec::{decode_batch, encode_batch, DecodeError, EncodeError};
pub use publisher::{PublishError, PublisherConfig, PublisherCounters, ZmqEventPublisher, END_SEQ};
