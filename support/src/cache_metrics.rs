//! The metric families every cache connector reports the same way (its scheduler half's
//! `metrics`), so that lmcache's, flexkv's and a plugin's tiers share one family each on the
//! host's `/metrics`, and the host adds up what two connectors count into one.

use kvconnect_api::ConnectorMetric;

const HITS: &str = "Chunks (lmcache) or blocks (flexkv) a KV load found in a cache tier.";
const LOADED: &str = "Bytes read out of a cache tier into the KV cache.";
const MISSES: &str = "Chunks a KV load expected but did not find.";
const OFFLOAD: &str = "Bytes moved between the KV cache and the host-memory cache tiers: GPU_to_CPU saved \
    into a tier, CPU_to_GPU loaded from one (the KV cache may itself be in host memory).";

/// `kvconnect_cache_hits{connector, tier}`.
pub fn hits(connector: &str, tier: &str, v: u64) -> ConnectorMetric {
    ConnectorMetric::counter("kvconnect_cache_hits", HITS, v)
        .label("connector", connector)
        .label("tier", tier)
}

/// `kvconnect_cache_loaded_bytes{connector, tier}`.
pub fn loaded_bytes(connector: &str, tier: &str, v: u64) -> ConnectorMetric {
    ConnectorMetric::counter("kvconnect_cache_loaded_bytes", LOADED, v)
        .label("connector", connector)
        .label("tier", tier)
}

/// `kvconnect_cache_misses{connector}`.
pub fn misses(connector: &str, v: u64) -> ConnectorMetric {
    ConnectorMetric::counter("kvconnect_cache_misses", MISSES, v).label("connector", connector)
}

/// vLLM's `vllm:kv_offload_total_bytes{transfer_type}`: `saved` into the tiers (GPU_to_CPU)
/// and `restored` out of them (CPU_to_GPU).
pub fn offload(saved: u64, restored: u64) -> [ConnectorMetric; 2] {
    let one = |direction: &str, v| {
        ConnectorMetric::counter("vllm:kv_offload_total_bytes", OFFLOAD, v).label("transfer_type", direction)
    };
    [one("GPU_to_CPU", saved), one("CPU_to_GPU", restored)]
}

const EVICTIONS: &str =
    "Chunks (lmcache) or blocks (flexkv) a cache tier let go of to make room: moved to the \
    next tier, or dropped.";
const USED: &str = "Bytes a cache tier holds now.";
const CAPACITY: &str = "Bytes a cache tier may hold (its configured budget).";

/// `kvconnect_cache_evictions{connector, tier}`.
pub fn evictions(connector: &str, tier: &str, v: u64) -> ConnectorMetric {
    ConnectorMetric::counter("kvconnect_cache_evictions", EVICTIONS, v)
        .label("connector", connector)
        .label("tier", tier)
}

/// `kvconnect_cache_used_bytes{connector, tier}` and `kvconnect_cache_capacity_bytes{connector,
/// tier}`: how full a tier is, which says whether its hit rate is bounded by its size.
pub fn occupancy(connector: &str, tier: &str, used: u64, capacity: u64) -> [ConnectorMetric; 2] {
    [
        ConnectorMetric::gauge("kvconnect_cache_used_bytes", USED, used)
            .label("connector", connector)
            .label("tier", tier),
        ConnectorMetric::gauge("kvconnect_cache_capacity_bytes", CAPACITY, capacity)
            .label("connector", connector)
            .label("tier", tier),
    ]
}
