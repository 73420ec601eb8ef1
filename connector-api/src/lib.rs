//! The kvconnect contract, shared by every host, connector and plugin.
//!
//! This crate owns the plain data every side agrees on (model specs, KV layouts,
//! capabilities, the negotiated effective layout and its compatibility descriptor), the pure
//! functions over that data (negotiation, hashing, diffing), the safe connector traits, and
//! the versioned C ABI that carries those traits across a shared-library boundary.
//!
//! It must not open sockets, spawn threads, touch files or load libraries: effects live in
//! the host's crates and the connectors, and what they share beyond the contract (benchmark
//! statistics, host buffers, stable hashes, frames, peer slots) in `kvconnect-support`. A
//! third-party plugin depends on this crate alone: it re-exports `serde`, `serde_json` and
//! `tracing` for that.

// The negotiation tests' children, shared with the integration tests and the benchmark; the
// file names this crate by its name, in its own unit tests too.
#[cfg(test)]
extern crate self as kvconnect_api;
#[cfg(test)]
#[path = "../tests/support/children.rs"]
mod children;

pub mod ffi;
/// The plugin ABI under its earlier name: everything in [`ffi`].
pub mod abi {
    pub use crate::ffi::*;
}
pub mod caps;
pub mod compat;
pub mod config;
pub mod connector;
pub mod connector_metrics;
pub mod engine_tensor;
pub mod error;
pub mod geometry;
pub mod ids;
pub mod kv_events;
pub mod kv_events_merge;
pub mod kv_memory;
pub mod layout;
pub mod math;
pub mod model;
pub mod negotiate;
pub mod per_engine;
pub mod protocol;
pub mod region;
pub mod role;
pub mod sdk;
pub mod state_slots;
pub mod tp_ranks;

// The crates whose types and macros this crate's API uses, so that a plugin depends on
// `kvconnect-api` alone and gets the very versions the API was built with: `serde_json`
// (`Value` and `Map` in the trait signatures), `tracing` (the events the SDK forwards to the
// host's log) and `serde` (implemented by every public type; derive with
// `#[serde(crate = "kvconnect_api::serde")]`).
pub use serde;
pub use serde_json;
pub use tracing;

pub use caps::{AdaptCost, Capabilities, CapabilitiesBuilder, LayoutConstraint, MemoryKind, TransferMode};
pub use compat::{AdaptationPlan, CompatDescriptor, FieldClass, FieldDiff, Incompatible, LayoutPermutation};
pub use config::{FailurePolicy, KvTransferConfig};
pub use connector::{
    BlocksPerGroup, ConnectorContext, ConnectorFactory, ConnectorInfo, ConnectorResolver, ConnectorResult,
    FinishedTransfers, KvEvent, LoadSource, MatchResult, Request, RequestFinished, SchedulerConnector,
    StepInfo, TierTokens, WorkerConnector,
};
pub use connector_metrics::{
    holds_expired, ConnectorMetric, MetricError, MetricKind, KV_HOLDS_ENDED, KV_LOADS_STARTED,
};
pub use error::ConnectorError;
pub use ids::{BlockId, LayerId, RequestId};
pub use kv_events::{BlockHash, BlockRemoved, BlockStored, KvEventBatch, Medium};
pub use layout::{Dim, EffectiveLayout, KvGroup, KvLayout, StateGroup};
pub use model::{AttentionKind, Dtype, LayerState, ModelError, ModelSpec, StateKind};
pub use negotiate::{
    negotiate, negotiate_deployment, ChildCaps, Conflict, DecidedBy, EngineOptions, FieldProvenance,
    HmaOption, LayoutAdapter, LayoutField, Negotiated,
};
pub use region::{KvRegion, KvRegionSpec};
pub use role::{KvRole, Role, UnknownRole};
