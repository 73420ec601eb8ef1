//! The process-global table of stores, keyed by (engine id, resolved config).
//!
//! In vLLM the scheduler and worker halves of an engine run in different processes and
//! LMCache connects them through its own server. Here both halves of one engine run in one
//! process, so they share one store through this table: the first half created opens it, the
//! second finds it, and it closes (flushing the disk writer) when the last half drops it.
//! Two engines in one process get separate stores; two engines must not share a
//! `local_disk` directory.

use crate::config::LmcacheConfig;
use crate::stats::LmcacheStats;
use crate::store::ChunkStore;
use kvconnect_api::per_engine::PerEngine;
use kvconnect_api::ConnectorError;
use std::sync::Arc;

static STORES: PerEngine<ChunkStore> = PerEngine::new();

/// The store of `engine_id` with `cfg`, opened on first use.
pub fn store_for(engine_id: &str, cfg: &LmcacheConfig) -> Result<Arc<ChunkStore>, ConnectorError> {
    let identity = serde_json::to_string(cfg).unwrap_or_default();
    // Stores of other configs under the same engine id coexist.
    STORES.get_or_create(engine_id, &identity, |_| None, || ChunkStore::open(cfg))
}

/// The statistics of `engine_id`'s store, while either half of that engine is alive.
pub fn stats(engine_id: &str) -> Option<LmcacheStats> {
    STORES.live(engine_id).first().map(|s| s.stats())
}

/// The chunk hashes `engine_id`'s local tiers hold, `(cpu_tier, disk)` (see
/// [`ChunkStore::holdings`]).
pub fn holdings(engine_id: &str) -> Option<(Vec<u64>, Vec<u64>)> {
    STORES.live(engine_id).first().map(|s| s.holdings())
}

/// Waits until `engine_id`'s queued disk writes are done (tests, benchmarks, shutdown).
pub fn flush(engine_id: &str) {
    for s in STORES.live(engine_id) {
        s.flush();
    }
}
