//! The process-global registry that lets the scheduler half and the worker half of one
//! engine share one cache.
//!
//! vLLM-style hosts create the two halves separately. Both look their cache up here by the
//! engine's `engine_id` (`kv_transfer_config.engine_id`, else the context's); the first
//! creates it, the second gets the same `Arc`. The registry keeps only weak references: the
//! cache (its CPU memory and its SSD file) goes away when the last half is dropped. The two
//! halves must live in one process; a worker in another process gets a cache of its own, so
//! its scheduler would never see what it saved. Two engines in one process need distinct
//! engine ids; a second cache asked for under an id that is taken with a different
//! configuration is refused rather than silently shared.

use crate::cache::BlockCache;
use kvconnect_api::per_engine::PerEngine;
use std::sync::Arc;

static CACHES: PerEngine<BlockCache> = PerEngine::new();

/// The id is taken by a cache built for something else.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "engine_id '{engine_id}' already has a flexkv cache in this process built for {existing}, but this \
    half asks for {wanted}; give each engine its own engine_id and create both halves of one engine with the \
    same config"
)]
pub struct RegistryError {
    /// The engine.
    pub engine_id: String,
    /// What the existing cache was built for.
    pub existing: String,
    /// What was asked for.
    pub wanted: String,
}

/// The cache of `engine_id`, created by `make` when none is alive. `identity` must equal
/// the existing cache's.
pub fn shared_cache<E: From<RegistryError>>(
    engine_id: &str,
    identity: &str,
    make: impl FnOnce() -> Result<BlockCache, E>,
) -> Result<Arc<BlockCache>, E> {
    // One cache per engine: any other identity is refused.
    let taken = |existing: &str| {
        Some(E::from(RegistryError {
            engine_id: engine_id.to_owned(),
            existing: existing.to_owned(),
            wanted: identity.to_owned(),
        }))
    };
    CACHES.get_or_create(engine_id, identity, taken, make)
}

/// The counters of `engine_id`'s cache and its block size in bytes, while either half of
/// that engine is alive.
pub fn stats(engine_id: &str) -> Option<(crate::cache::CacheStats, usize)> {
    CACHES.live(engine_id).first().map(|c| (c.stats(), c.slot_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_cache_per_engine_while_alive() {
        let mk = || Ok::<_, RegistryError>(BlockCache::new(1, 8, None, false, "x".into()));
        let a = shared_cache("reg-test-1", "x", mk).unwrap();
        let b = shared_cache("reg-test-1", "x", mk).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let other = shared_cache("reg-test-2", "x", mk).unwrap();
        assert!(!Arc::ptr_eq(&a, &other));
        let e = shared_cache("reg-test-1", "y", || {
            Ok::<_, RegistryError>(BlockCache::new(1, 8, None, false, "y".into()))
        })
        .err()
        .unwrap();
        assert!(e.to_string().contains("give each engine its own engine_id"), "{e}");
        drop((a, b));
        let c = shared_cache("reg-test-1", "y", || {
            Ok::<_, RegistryError>(BlockCache::new(1, 8, None, false, "y".into()))
        })
        .unwrap();
        assert_eq!(c.identity(), "y");
    }
}
