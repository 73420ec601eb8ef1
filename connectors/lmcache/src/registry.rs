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
use kvconnect_api::ConnectorError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

type Table = HashMap<(String, String), Weak<ChunkStore>>;

fn table() -> std::sync::MutexGuard<'static, Table> {
    static T: OnceLock<Mutex<Table>> = OnceLock::new();
    match T.get_or_init(|| Mutex::new(HashMap::new())).lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The store of `engine_id` with `cfg`, opened on first use.
pub fn store_for(engine_id: &str, cfg: &LmcacheConfig) -> Result<Arc<ChunkStore>, ConnectorError> {
    let key = (engine_id.to_owned(), serde_json::to_string(cfg).unwrap_or_default());
    let mut t = table();
    if let Some(s) = t.get(&key).and_then(Weak::upgrade) {
        return Ok(s);
    }
    t.retain(|_, w| w.strong_count() > 0);
    let s = Arc::new(ChunkStore::open(cfg)?);
    t.insert(key, Arc::downgrade(&s));
    Ok(s)
}

/// The statistics of `engine_id`'s store, while either half of that engine is alive.
pub fn stats(engine_id: &str) -> Option<LmcacheStats> {
    let stores: Vec<Arc<ChunkStore>> =
        table().iter().filter(|((e, _), _)| e == engine_id).filter_map(|(_, w)| w.upgrade()).collect();
    stores.first().map(|s| s.stats())
}

/// Waits until `engine_id`'s queued disk writes are done (tests, benchmarks, shutdown).
pub fn flush(engine_id: &str) {
    let stores: Vec<Arc<ChunkStore>> =
        table().iter().filter(|((e, _), _)| e == engine_id).filter_map(|(_, w)| w.upgrade()).collect();
    for s in stores {
        s.flush();
    }
}
