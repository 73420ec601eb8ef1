//! FlexKV-style radix-tree block cache with CPU and SSD tiers.
//!
//! The connector `flexkv` keeps KV blocks of past prompts and gives them back to later
//! requests that share a prefix:
//!
//! * **index** (`radix`): a radix tree over chained block hashes at block granularity,
//!   matching the longest cached prefix; per-tier LRU lists evict unreferenced leaves;
//!   reference counts keep blocks being loaded or saved in place;
//! * **tiers** (`mempool`, `cpu_tier`, `ssd_tier`, `cache`): fixed-size slots in host memory
//!   within `cpu_cache_gb`, and records in a file under `ssd_cache_dir` within
//!   `ssd_cache_gb`; blocks evicted from CPU move to SSD, SSD hits are verified and
//!   optionally promoted back;
//! * **transfer engine** (`transfer`): a pool of threads that does every copy, so loads are
//!   asynchronous and saves never block the step loop;
//! * **layout adapter** (`adapter`): blocks are stored token-major (NHD); in a head-major
//!   deployment the copy path transposes;
//! * **halves** (`scheduler`, `worker`): separate objects that talk through
//!   `build_connector_meta` -> `bind_connector_meta` and share the engine's cache through a
//!   process-global registry keyed by engine id (`registry`).
//!
//! KV regions in GPU memory (feature `cuda`, `device_kv`): saves gather a request's blocks
//! into a pinned host copy with one kernel launch when they are submitted; loads fill a host
//! copy on the pool thread and scatter it back with one launch. Without the feature, device
//! regions are refused at `register_kv_caches`.
//!
//! Settings (`config`): `cpu_cache_gb`, `ssd_cache_gb`, `ssd_cache_dir`,
//! `num_transfer_threads`, `enable_ssd_promotion` from `kv_connector_extra_config`, then
//! `FLEXKV_*` environment variables, then the file named by `FLEXKV_CONFIG_PATH`.
//!
//! This crate moves KV only between an engine and its own tiers: it opens no sockets and
//! has no peer (transfer mode `none`).

pub mod adapter;
pub mod cache;
pub mod caps;
pub mod config;
pub mod cpu_tier;
#[cfg(feature = "cuda")]
pub mod device_kv;
pub mod factory;
pub mod hash;
pub mod mempool;
pub mod meta;
pub mod radix;
pub mod registry;
pub mod scheduler;
pub mod ssd_tier;
pub mod token_book;
pub mod transfer;
pub mod worker;

pub use factory::FlexkvFactory;
