//! LMCache-style chunked prefix cache with CPU, disk and remote (Redis) tiers.
//!
//! A prompt is split into chunks of `chunk_size` tokens (default 256). Each chunk's key
//! chains the previous chunk's key with this chunk's tokens, rooted in a namespace that
//! digests the model fingerprint, the effective layout (layout, block size, cache dtype,
//! HMA), the TP rank and size and the chunk size, so a cache written under one layout is
//! never read as another. Keys are the same in every process and on every machine (fixed
//! seeds; see [`hash`]).
//!
//! **Tiers.** A CPU tier with a byte budget and LRU eviction; an optional local-disk tier
//! that takes what the CPU tier evicts (written by a background thread, never on the step
//! loop) and serves hits back. The disk index is rebuilt from the files at start, so it
//! survives a restart; every chunk read from disk is checked (header and checksum), and a
//! corrupt or truncated chunk is a miss and is deleted, never loaded. Chunks still in the CPU
//! tier when the store closes are not written to disk. Buffers of chunks that left every tier
//! are kept for reuse by later saves (up to an eighth of the CPU budget, at least 64 MiB and
//! never more than the budget), on top of the budget. Chunk bytes are stored in the effective
//! layout's own order ([`chunk_layout`]). With `remote_url: redis://host:port` a remote tier
//! that workers share sits behind both ([`remote_tier`]): new chunks are written to it in the
//! background, lookups and loads fall back to it, every value is checksummed, and a remote
//! that is down is a counted miss, never a failed or stalled request. Which tier served each
//! request's tokens goes to the host in `get_finished`'s `load_sources`.
//!
//! **Scheduler half** ([`LmcacheScheduler`]). `get_num_new_matched_tokens` returns the end of
//! the longest run of stored chunks (chunk-aligned; a final partial chunk counts only with
//! `save_unfull_chunk`), capped at `prompt_len - 1` so the engine always computes at least
//! one token (LMCache's rule: a fully stored 512-token prompt matches 511), minus what the
//! engine already has. It has no side effects (LRU order and statistics are unchanged), so
//! it may be called repeatedly. `update_state_after_alloc` records what to load;
//! `build_connector_meta` passes loads and saves to the worker half as JSON. The block table
//! passed to `update_state_after_alloc` is the request's whole table (block `i` holds tokens
//! `[i*block_size, (i+1)*block_size)`), and a request's prompt is computed in the step after
//! its allocation (whole prefill; chunked prefill is not followed).
//!
//! **Worker half** ([`LmcacheWorker`]). `start_load_kv` (and, with `use_layerwise`,
//! `wait_for_layer_load`) copies stored bytes into the request's blocks through the
//! registered regions ([`kvconnect_api::kv_memory::KvMemory`]); `save_kv_layer` (layer-wise)
//! or `wait_for_save` copies every new full chunk (partial ones with `save_unfull_chunk`)
//! out of the KV cache. A load that cannot complete is reported through
//! `block_ids_with_load_errors` (from the first failed chunk to the end of the load).
//!
//! **Device KV** (feature `cuda`). With regions in GPU memory the CPU tier keeps its chunks
//! in a pinned slab of chunk-sized slots (sized from `max_local_cpu_size`, pinned at
//! `register_kv_caches`, like LMCache's pinned CPU backend). A save gathers every full chunk
//! of a request straight into slots with one kernel launch, already in chunk layout; a load
//! scatters whole blocks straight out of the slots. Partial chunks, chunks the slab has no
//! free slot for, chunks read from disk and blocks a load writes only partly go through a
//! pinned host copy of the request's blocks and the host chunk code (one more launch).
//! Layer-wise saving and loading degrade to whole-request then. Without the feature, device
//! regions are refused at `register_kv_caches`.
//!
//! **Sharing the store.** In vLLM the two halves live in different processes; here the
//! scheduler and worker of one engine run in one process, so they share one store through a
//! process-global table keyed by (engine id, resolved config) ([`registry`]). It closes when
//! the last half is dropped. [`stats()`] reads its counters.
//!
//! **Config**, highest precedence first: `kv_connector_extra_config` (LMCache's keys, plain or
//! `lmcache.`-prefixed), `LMCACHE_<KEY>` environment variables (upper-case key), the YAML
//! file named by `LMCACHE_CONFIG_FILE`. Every key of LMCache's is honoured, mapped (logged at
//! info) or refused with the kvconnect way ([`keys`], [`config`]); LMCache's P/D settings are
//! a request for the nixl connector beside lmcache in a `PdConnector` ([`pd`]).
//!
//! This crate must not depend on the host or other connectors; it owns no threads but its
//! disk writer.

pub mod caps;
pub mod chunk_buf;
pub mod chunk_grid;
pub mod chunk_layout;
pub mod config;
pub mod cpu_tier;
#[cfg(feature = "cuda")]
pub mod device_kv;
pub mod disk_tier;
pub mod factory;
pub mod hash;
pub mod key;
pub mod keys;
pub mod meta;
pub mod pd;
#[cfg(feature = "cuda")]
pub mod pinned_slab;
pub mod registry;
pub mod remote_tier;
pub mod remote_watch;
pub mod scheduler;
pub mod slot_alloc;
pub mod stats;
pub mod store;
pub mod worker;

pub use config::LmcacheConfig;
pub use factory::LmcacheFactory;
pub use registry::flush;
pub use scheduler::LmcacheScheduler;
pub use stats::{LmcacheStats, TierStats};
pub use worker::LmcacheWorker;

/// The statistics of `engine_id`'s lmcache store (hits, misses, bytes per tier, evictions,
/// disk errors), while a half of that engine is alive.
pub fn stats(engine_id: &str) -> Option<LmcacheStats> {
    registry::stats(engine_id)
}
