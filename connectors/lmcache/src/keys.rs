//! Every key of LMCache's config (its documented keys, the v0 keys of its older examples and
//! the keys vLLM's LMCache adapter reads from `kv_connector_extra_config`) and how kvconnect
//! handles it: honoured, mapped to what kvconnect does instead (logged at info, naming the
//! mapping), or refused with the kvconnect way to get the same thing. No key of LMCache's is
//! dropped for being unknown; only keys LMCache itself does not have are warned about.

/// A value that asks for nothing beyond what kvconnect does anyway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Default {
    /// `false` (or absent, or null).
    False,
    /// Absent, null, an empty list or mapping, or `false`.
    Unset,
    /// Zero (or null).
    Zero,
}

/// How one key is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Read into the settings (see `config::apply_setting`).
    Setting,
    /// Honoured at its default value; any other value is refused with this remedy.
    DefaultOnly(Default, &'static str),
    /// Mapped to what kvconnect does instead; the text is the info line's explanation.
    Mapped(&'static str),
    /// Part of LMCache's disaggregated-prefill (P/D) settings.
    Pd,
    /// Handled on its own in `config` (value-dependent mappings).
    Special,
}

const NO_SHARED_LOOKUP: &str = "kvconnect's lmcache looks up its own tiers; for a cache shared by workers \
    set remote_url: redis://host:port";
const NO_CONTROLLER: &str = "kvconnect has no LMCache controller: `kvconnect up` supervises the workers and \
    each worker serves GET /metrics and /health; remove enable_controller";
const NO_P2P: &str = "kvconnect's lmcache does not share CPU tiers peer to peer; for a cache shared by \
    workers set remote_url: redis://host:port, and for prefill-to-decode transfer put the nixl \
    connector beside lmcache in a PdConnector";
const NO_BLENDING: &str = "kvconnect's lmcache reuses prompt prefixes only (no CacheBlend of \
    non-prefix chunks); remove enable_blending";
const NO_GDS: &str = "kvconnect has no GPU Direct Storage tier; for chunks on disk set local_disk: \
    file:///path and max_local_disk_size";
const NO_PLUGINS: &str = "kvconnect's lmcache loads no LMCache plugins; a storage backend of your own is a \
    kvconnect connector plugin on KVCONNECT_PLUGIN_PATH (see docs/plugins.md, Write a plugin)";
const SYSTEM_ALLOCATOR: &str = "kvconnect takes the CPU tier's memory from the system allocator as chunks \
    arrive (max_local_cpu_size caps it); no reservation, hugepages, NUMA binding or staged allocation";
const NO_API_SERVER: &str = "kvconnect starts no LMCache API server: the worker's own HTTP port serves \
    GET /metrics (cache hits per tier) and /health";
const NO_DECODE_CACHE: &str =
    "kvconnect's lmcache stores prompt KV only; decode-time KV is not saved; remove save_decode_cache";
const REMOTE_TIMEOUT: &str = "the remote tier's operations time out after remote_timeout_ms \
    (default 200 ms) so a request never waits on a slow remote";
const NO_RETRIEVE_PIPELINE: &str =
    "chunks are read within the step that loads them; there is no separate retrieve pipeline";
const CHUNK_HASH: &str = "chunk keys use kvconnect's fixed-seed chained hash, the same in every \
    kvconnect process (keys are not LMCache's)";
const STORE_LOCATION: &str =
    "saves go to the CPU tier (evictions to disk) and, with remote_url, to the remote tier";
const ONE_DISK_DIR: &str =
    "each worker uses the one local_disk directory it is given; give each worker its own";
const LOOKUP_TIMEOUT: &str =
    "lookups of the local tiers do not wait; remote lookups time out after remote_timeout_ms";
const NO_LOOKUP_SERVER: &str =
    "the scheduler and worker halves share one store in the worker process; there is no lookup server";
const DIRECT_LOOKUP: &str = "the scheduler half looks chunks up in the shared store directly";
const NO_RPC_PORT: &str =
    "the scheduler and worker halves share one store in the worker process; no RPC port is opened";
const LMCACHE_V1: &str = "kvconnect's lmcache follows LMCache v1 (the engine \
    LMCACHE_USE_EXPERIMENTAL selected); v0 keys are mapped";
const KV_EVENTS: &str = "KV events (stored/removed per tier) are always produced for the host's take_events";
const GATHER_KERNEL: &str = "device KV is copied by kvconnect's own gather kernel (feature cuda)";
const REFERENCE_COUNTED: &str = "chunks held by a load are reference counted and released when the load ends";
const BLENDING_ONLY: &str = "read by LMCache only with enable_blending, which kvconnect does not have";
const NO_CXL: &str = "kvconnect has no CXL shared-memory tier; for chunks shared by workers \
    set remote_url: redis://host:port";
const NO_PRIORITY: &str = "kvconnect requests carry no priority (the API refuses `priority`), so every \
    prompt is cached; remove priority_limit";
const NO_MISS_SIMULATION: &str = "kvconnect's lmcache does not simulate misses; remove hit_miss_ratio";
const NO_REMOTE_CONFIG: &str =
    "give the settings in LMCACHE_CONFIG_FILE, LMCACHE_* variables or kv_connector_extra_config";
const NO_HIDDEN_STATES: &str =
    "kvconnect's lmcache caches KV only, no hidden states; remove enable_hidden_state_cache";
const NO_PYTHON: &str = "kvconnect has no Python runtime";
const STATS: &str =
    "chunk statistics are kvconnect_lmcache::stats() and the worker's /metrics (kvconnect_cache_* per tier)";

/// LMCache's keys, with how each is handled. docs/connectors/lmcache.md's table lists the same keys
/// (a test keeps them in step).
pub const KEYS: &[(&str, Kind)] = &[
    // Storage and chunking.
    ("chunk_size", Kind::Setting),
    ("local_cpu", Kind::Setting),
    ("max_local_cpu_size", Kind::Setting),
    ("local_disk", Kind::Setting),
    ("max_local_disk_size", Kind::Setting),
    ("remote_url", Kind::Setting),
    ("save_unfull_chunk", Kind::Setting),
    ("use_layerwise", Kind::Setting),
    ("min_retrieve_tokens", Kind::Setting),
    ("remote_serde", Kind::Special),
    ("local_device", Kind::Special),
    ("max_local_cache_size", Kind::Special),
    ("discard_partial_chunks", Kind::Special),
    ("skip_last_n_tokens", Kind::Special),
    ("extra_config", Kind::Special),
    ("cache_policy", Kind::Special),
    ("save_decode_cache", Kind::DefaultOnly(Default::False, NO_DECODE_CACHE)),
    ("blocking_timeout_secs", Kind::Mapped(REMOTE_TIMEOUT)),
    ("pipelined_backend", Kind::Mapped(NO_RETRIEVE_PIPELINE)),
    ("pre_caching_hash_algorithm", Kind::Mapped(CHUNK_HASH)),
    ("retrieve_locations", Kind::Mapped("loads read the CPU tier, then the disk tier, then the remote tier")),
    ("store_location", Kind::Mapped(STORE_LOCATION)),
    ("local_disk_path_sharding", Kind::Mapped(ONE_DISK_DIR)),
    ("cost_aware_half_life_seconds", Kind::Mapped("eviction is least recently used")),
    ("cost_aware_ewma_alpha", Kind::Mapped("eviction is least recently used")),
    ("enable_async_loading", Kind::Mapped("loads complete within the engine step that needs them")),
    ("lookup_timeout_ms", Kind::Mapped(LOOKUP_TIMEOUT)),
    ("lookup_server_worker_ids", Kind::Mapped(NO_LOOKUP_SERVER)),
    ("enable_scheduler_bypass_lookup", Kind::Mapped(DIRECT_LOOKUP)),
    ("lmcache_rpc_port", Kind::Mapped(NO_RPC_PORT)),
    ("use_native", Kind::Mapped("kvconnect's lmcache is native Rust")),
    ("use_experimental", Kind::Mapped(LMCACHE_V1)),
    ("enable_kv_events", Kind::Mapped(KV_EVENTS)),
    ("use_gpu_connector_v3", Kind::Mapped(GATHER_KERNEL)),
    ("pin_timeout_sec", Kind::Mapped(REFERENCE_COUNTED)),
    ("pin_check_interval_sec", Kind::Mapped(REFERENCE_COUNTED)),
    ("audit_actual_remote_url", Kind::Mapped("no audit backend; remote_url names the one remote")),
    ("app_id", Kind::Mapped("no remote configuration service is asked")),
    ("mp_host", Kind::Mapped("no multi-process server is started; the worker serves its own engine")),
    ("mp_port", Kind::Mapped("no multi-process server is started; the worker serves its own engine")),
    // Memory management.
    ("local_cpu_use_hugepages", Kind::Mapped(SYSTEM_ALLOCATOR)),
    ("reserve_local_cpu_size", Kind::Mapped(SYSTEM_ALLOCATOR)),
    ("numa_mode", Kind::Mapped(SYSTEM_ALLOCATOR)),
    ("enable_lazy_memory_allocator", Kind::Mapped(SYSTEM_ALLOCATOR)),
    ("lazy_memory_initial_ratio", Kind::Mapped(SYSTEM_ALLOCATOR)),
    ("lazy_memory_expand_trigger_ratio", Kind::Mapped(SYSTEM_ALLOCATOR)),
    ("lazy_memory_step_ratio", Kind::Mapped(SYSTEM_ALLOCATOR)),
    ("lazy_memory_safe_size", Kind::Mapped(SYSTEM_ALLOCATOR)),
    ("py_enable_gc", Kind::Mapped(NO_PYTHON)),
    // Statistics and the internal API server.
    ("enable_chunk_statistics", Kind::Mapped(STATS)),
    ("chunk_statistics_auto_start_statistics", Kind::Mapped(STATS)),
    ("chunk_statistics_auto_exit_timeout_hours", Kind::Mapped(STATS)),
    ("chunk_statistics_auto_exit_target_unique_chunks", Kind::Mapped(STATS)),
    ("chunk_statistics_strategy", Kind::Mapped(STATS)),
    ("internal_api_server_enabled", Kind::Mapped(NO_API_SERVER)),
    ("internal_api_server_host", Kind::Mapped(NO_API_SERVER)),
    ("internal_api_server_port_start", Kind::Mapped(NO_API_SERVER)),
    ("internal_api_server_include_index_list", Kind::Mapped(NO_API_SERVER)),
    ("internal_api_server_socket_path_prefix", Kind::Mapped(NO_API_SERVER)),
    ("script_allowed_imports", Kind::Mapped(NO_API_SERVER)),
    // Features kvconnect's lmcache does not have.
    ("enable_blending", Kind::DefaultOnly(Default::False, NO_BLENDING)),
    ("blend_recompute_ratios", Kind::Mapped(BLENDING_ONLY)),
    ("blend_recompute_ratio", Kind::Mapped(BLENDING_ONLY)),
    ("blend_thresholds", Kind::Mapped(BLENDING_ONLY)),
    ("blend_check_layers", Kind::Mapped(BLENDING_ONLY)),
    ("blend_min_tokens", Kind::Mapped(BLENDING_ONLY)),
    ("blend_special_str", Kind::Mapped(BLENDING_ONLY)),
    ("blend_separator", Kind::Mapped(BLENDING_ONLY)),
    ("blend_add_special_in_precomp", Kind::Mapped(BLENDING_ONLY)),
    ("enable_p2p", Kind::DefaultOnly(Default::False, NO_P2P)),
    ("p2p_host", Kind::Mapped("read by LMCache only with enable_p2p")),
    ("p2p_init_ports", Kind::Mapped("read by LMCache only with enable_p2p")),
    ("p2p_lookup_ports", Kind::Mapped("read by LMCache only with enable_p2p")),
    ("peer_init_ports", Kind::Mapped("read by LMCache only with enable_p2p")),
    ("peer_lookup_ports", Kind::Mapped("read by LMCache only with enable_p2p")),
    ("lookup_url", Kind::DefaultOnly(Default::Unset, NO_SHARED_LOOKUP)),
    ("distributed_url", Kind::DefaultOnly(Default::Unset, NO_SHARED_LOOKUP)),
    ("external_lookup_client", Kind::DefaultOnly(Default::Unset, NO_SHARED_LOOKUP)),
    ("enable_controller", Kind::DefaultOnly(Default::False, NO_CONTROLLER)),
    ("controller_url", Kind::Mapped("read by LMCache only with enable_controller")),
    ("controller_pull_url", Kind::Mapped("read by LMCache only with enable_controller")),
    ("controller_reply_url", Kind::Mapped("read by LMCache only with enable_controller")),
    ("lmcache_instance_id", Kind::Mapped("the worker is known by its engine id (--engine-id)")),
    ("lmcache_worker_port", Kind::Mapped("read by LMCache only with enable_controller")),
    ("lmcache_worker_ports", Kind::Mapped("read by LMCache only with enable_controller")),
    ("lmcache_worker_ids", Kind::Mapped("read by LMCache only with enable_controller")),
    ("lmcache_worker_heartbeat_delay_time", Kind::Mapped("read by LMCache only with enable_controller")),
    ("lmcache_worker_heartbeat_time", Kind::Mapped("read by LMCache only with enable_controller")),
    ("gds_path", Kind::DefaultOnly(Default::Unset, NO_GDS)),
    ("gds_path_sharding", Kind::Mapped("read by LMCache only with gds_path")),
    ("gds_buffer_size", Kind::Mapped("read by LMCache only with gds_path")),
    ("cufile_buffer_size", Kind::Mapped("read by LMCache only with gds_path")),
    ("use_gds", Kind::Mapped("read by LMCache only with gds_path")),
    ("gds_backend", Kind::Mapped("read by LMCache only with gds_path")),
    ("maru_path", Kind::DefaultOnly(Default::Unset, NO_CXL)),
    ("maru_pool_size", Kind::Mapped("read by LMCache only with maru_path")),
    ("priority_limit", Kind::DefaultOnly(Default::Unset, NO_PRIORITY)),
    ("hit_miss_ratio", Kind::DefaultOnly(Default::Unset, NO_MISS_SIMULATION)),
    ("remote_config_url", Kind::DefaultOnly(Default::Unset, NO_REMOTE_CONFIG)),
    ("enable_hidden_state_cache", Kind::DefaultOnly(Default::False, NO_HIDDEN_STATES)),
    ("max_hidden_state_cpu_size", Kind::Mapped("read by LMCache only with enable_hidden_state_cache")),
    ("hidden_state_layers", Kind::Mapped("read by LMCache only with enable_hidden_state_cache")),
    ("hidden_states_retrieve_mode", Kind::Mapped("read by LMCache only with enable_hidden_state_cache")),
    ("runtime_plugin_locations", Kind::DefaultOnly(Default::Unset, NO_PLUGINS)),
    ("plugin_locations", Kind::DefaultOnly(Default::Unset, NO_PLUGINS)),
    ("storage_plugins", Kind::DefaultOnly(Default::Unset, NO_PLUGINS)),
    ("external_backends", Kind::DefaultOnly(Default::Unset, NO_PLUGINS)),
    ("remote_storage_plugins", Kind::DefaultOnly(Default::Unset, NO_PLUGINS)),
    // Disaggregated prefill (see `pd`).
    ("enable_pd", Kind::Pd),
    ("enable_xpyd", Kind::Pd),
    ("enable_nixl", Kind::Pd),
    ("transfer_channel", Kind::Pd),
    ("pd_role", Kind::Pd),
    ("pd_buffer_size", Kind::Pd),
    ("pd_buffer_device", Kind::Pd),
    ("pd_peer_host", Kind::Pd),
    ("pd_peer_init_port", Kind::Pd),
    ("pd_peer_alloc_port", Kind::Pd),
    ("pd_peer_query_port", Kind::Pd),
    ("pd_proxy_host", Kind::Pd),
    ("pd_proxy_port", Kind::Pd),
    ("pd_allocation_timeout_sec", Kind::Pd),
    ("pd_shutdown_timeout_sec", Kind::Pd),
    ("pd_condition_poll_interval_sec", Kind::Pd),
    ("pd_max_prefill_len", Kind::Pd),
    ("pd_backend_mode", Kind::Pd),
    ("pd_skip_proxy_notification", Kind::Pd),
    ("pd_bidirectional", Kind::Pd),
    ("pd_retrieve_locations", Kind::Pd),
    ("pd_store_location", Kind::Pd),
    ("pd_pull_mode", Kind::Pd),
    ("pd_delay_pull", Kind::Pd),
    ("nixl_role", Kind::Pd),
    ("nixl_backends", Kind::Pd),
    ("nixl_buffer_size", Kind::Pd),
    ("nixl_buffer_device", Kind::Pd),
    ("nixl_enable_gc", Kind::Pd),
    ("nixl_receiver_host", Kind::Pd),
    ("nixl_receiver_port", Kind::Pd),
    ("nixl_peer_host", Kind::Pd),
    ("nixl_peer_port", Kind::Pd),
    ("nixl_peer_init_port", Kind::Pd),
    ("nixl_peer_alloc_port", Kind::Pd),
    ("nixl_proxy_host", Kind::Pd),
    ("nixl_proxy_port", Kind::Pd),
    // kvconnect's own.
    ("remote_timeout_ms", Kind::Setting),
    ("remote_retry_ms", Kind::Setting),
];

/// How `key` is handled, or `None` for a key LMCache does not have.
pub fn kind_of(key: &str) -> Option<Kind> {
    KEYS.iter().find(|(k, _)| *k == key).map(|(_, kind)| *kind)
}

/// The known key closest to `key` (one or two edits away), for "did you mean".
pub fn closest(key: &str) -> Option<&'static str> {
    KEYS.iter()
        .map(|(k, _)| (*k, distance(key, k)))
        .filter(|(_, d)| *d <= 2)
        .min_by_key(|(_, d)| *d)
        .map(|(k, _)| k)
}

fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_unique_and_typos_find_their_key() {
        let mut names: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a key is listed twice");
        assert_eq!(closest("chunksize"), Some("chunk_size"));
        assert_eq!(closest("local_cpus"), Some("local_cpu"));
        assert_eq!(closest("something_else_entirely"), None);
    }

    #[test]
    fn the_docs_list_every_key_and_no_other() {
        let section = include_str!("../../../docs/connectors/lmcache.md");
        let mut listed = Vec::new();
        for line in section.lines().filter(|l| l.starts_with("| `")) {
            let first = line.split('|').nth(1).unwrap_or("");
            for part in first.split('`').skip(1).step_by(2) {
                listed.push(part.trim().to_owned());
            }
        }
        for (k, _) in KEYS {
            assert!(listed.iter().any(|l| l == k), "docs/connectors/lmcache.md's table does not list `{k}`");
        }
        for l in &listed {
            assert!(
                kind_of(l).is_some(),
                "docs/connectors/lmcache.md's table lists `{l}`, which keys.rs does not have"
            );
        }
    }
}
