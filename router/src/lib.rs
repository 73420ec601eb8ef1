//! The KV-aware router's pure logic: the indexer, which applies every prefill worker's KV
//! cache events (kvconnect-api's `kv_events`: vLLM's `BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`, in batches numbered by the worker's publisher)
//! to one index of which worker holds which prefix blocks in which medium, and the choice of
//! the worker for a request by its cached prefix against its load (`choose`, whose doc
//! states the formula). No sockets, threads or clocks: the proxy (`kvconnect-proxy`) feeds it
//! events and asks it for choices.

pub mod chain;
pub mod choose;
pub mod event;
pub mod flat;
pub mod index;
pub mod indexer;
pub mod stream;

pub use choose::{choose, Candidate, Choice, Fallback, Weights, TIER_WEIGHTS};
pub use event::{BlockHash, KvEvent, KvEventBatch, Medium};
pub use index::{BlockIndex, Overlap, WorkerId};
pub use indexer::{Counts, Indexer, Outcome, TooManyWorkers};
pub use stream::{Dropped, StreamState};
