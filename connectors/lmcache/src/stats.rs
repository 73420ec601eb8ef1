//! Counters of one store, kept as atomics on the hot path and read as a serde snapshot
//! (`kvconnect_lmcache::stats(engine_id)`) for metrics and reports.

use kvconnect_api::ConnectorMetric;
use kvconnect_support::cache_metrics;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};

/// Figures of one tier.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierStats {
    /// Chunks served from this tier.
    pub hits: u64,
    /// Bytes written into this tier.
    pub bytes_stored: u64,
    /// Bytes read out of this tier into KV caches.
    pub bytes_loaded: u64,
    /// Chunks evicted from this tier (to the next tier, or dropped).
    pub evictions: u64,
    /// Chunks held now.
    pub chunks: u64,
    /// Bytes held now.
    pub bytes_used: u64,
    /// Budget in bytes.
    pub budget_bytes: u64,
}

/// A snapshot of one engine's lmcache store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LmcacheStats {
    /// Chunks a load found (any tier: cpu + disk + remote).
    pub hits: u64,
    /// Chunks a load expected but did not find or found corrupt.
    pub misses: u64,
    /// Tokens the scheduler half promised to load (sum of `num_external_tokens`).
    pub hit_tokens: u64,
    /// Chunks saved (new to the store).
    pub chunks_saved: u64,
    /// The CPU tier.
    pub cpu: TierStats,
    /// The disk tier (zeros when there is none).
    pub disk: TierStats,
    /// The remote tier (`remote_url`; zeros when there is none): hits, bytes written to and
    /// read from it.
    #[serde(default)]
    pub remote: TierStats,
    /// Remote reads that found nothing, including those the remote could not answer.
    #[serde(default)]
    pub remote_misses: u64,
    /// Remote operations (lookups and reads) that failed: connection refused, timeout, an
    /// error reply.
    #[serde(default)]
    pub remote_errors: u64,
    /// Remote lookups and reads not tried because the remote failed recently (back-off).
    #[serde(default)]
    pub remote_skipped: u64,
    /// Remote values that failed their header, length or checksum check (never loaded).
    #[serde(default)]
    pub remote_corrupt: u64,
    /// Chunks written to the remote.
    #[serde(default)]
    pub remote_writes: u64,
    /// Remote writes that failed.
    #[serde(default)]
    pub remote_write_errors: u64,
    /// Chunks not written to the remote: its writer queue was full or the remote in back-off.
    #[serde(default)]
    pub remote_write_drops: u64,
    /// Disk writes that failed (I/O errors, a full disk, a chunk larger than the budget).
    pub disk_write_errors: u64,
    /// Disk chunks dropped because their checksum, header or length was wrong.
    pub disk_corrupt_chunks: u64,
    /// Chunks evicted from the CPU tier that were dropped instead of written because the
    /// disk writer was too far behind.
    pub disk_queue_drops: u64,
    /// Chunks that fit no tier (larger than every budget) and were not stored.
    pub rejected_chunks: u64,
    /// KV blocks reported through `block_ids_with_load_errors`.
    pub load_error_blocks: u64,
    /// Saves that could not copy out of the KV cache.
    pub save_errors: u64,
    /// Chunks device saves gathered straight into the pinned CPU tier's slots.
    #[serde(default)]
    pub pinned_chunks_saved: u64,
    /// Chunks device saves built on the heap instead: the pinned slab had no free slot, or
    /// the chunk is partial (fewer tokens than a chunk, so it does not fit a slot's grid).
    #[serde(default)]
    pub pinned_fallback_chunks: u64,
}

#[derive(Default)]
pub(crate) struct TierCounters {
    pub hits: AtomicU64,
    pub bytes_stored: AtomicU64,
    pub bytes_loaded: AtomicU64,
    pub evictions: AtomicU64,
}

impl TierCounters {
    fn snapshot(&self) -> TierStats {
        TierStats {
            hits: get(&self.hits),
            bytes_stored: get(&self.bytes_stored),
            bytes_loaded: get(&self.bytes_loaded),
            evictions: get(&self.evictions),
            ..TierStats::default()
        }
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub misses: AtomicU64,
    pub hit_tokens: AtomicU64,
    pub chunks_saved: AtomicU64,
    pub cpu: TierCounters,
    pub disk: TierCounters,
    pub remote: TierCounters,
    pub remote_misses: AtomicU64,
    pub remote_errors: AtomicU64,
    pub remote_skipped: AtomicU64,
    pub remote_corrupt: AtomicU64,
    pub remote_writes: AtomicU64,
    pub remote_write_errors: AtomicU64,
    pub remote_write_drops: AtomicU64,
    pub disk_write_errors: AtomicU64,
    pub disk_corrupt_chunks: AtomicU64,
    pub disk_queue_drops: AtomicU64,
    pub rejected_chunks: AtomicU64,
    pub load_error_blocks: AtomicU64,
    pub save_errors: AtomicU64,
    pub pinned_chunks_saved: AtomicU64,
    pub pinned_fallback_chunks: AtomicU64,
}

pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

impl Counters {
    /// The counters as a snapshot; the caller fills the tiers' occupancy.
    pub fn snapshot(&self) -> LmcacheStats {
        let cpu = self.cpu.snapshot();
        let disk = self.disk.snapshot();
        let remote = self.remote.snapshot();
        LmcacheStats {
            hits: cpu.hits + disk.hits + remote.hits,
            misses: get(&self.misses),
            hit_tokens: get(&self.hit_tokens),
            chunks_saved: get(&self.chunks_saved),
            cpu,
            disk,
            remote,
            remote_misses: get(&self.remote_misses),
            remote_errors: get(&self.remote_errors),
            remote_skipped: get(&self.remote_skipped),
            remote_corrupt: get(&self.remote_corrupt),
            remote_writes: get(&self.remote_writes),
            remote_write_errors: get(&self.remote_write_errors),
            remote_write_drops: get(&self.remote_write_drops),
            disk_write_errors: get(&self.disk_write_errors),
            disk_corrupt_chunks: get(&self.disk_corrupt_chunks),
            disk_queue_drops: get(&self.disk_queue_drops),
            rejected_chunks: get(&self.rejected_chunks),
            load_error_blocks: get(&self.load_error_blocks),
            save_errors: get(&self.save_errors),
            pinned_chunks_saved: get(&self.pinned_chunks_saved),
            pinned_fallback_chunks: get(&self.pinned_fallback_chunks),
        }
    }
}

/// What the store counts as the host's `/metrics` shows it: hits, bytes loaded per tier,
/// misses, the remote tier's other outcomes, the bytes offloaded and restored, and each local
/// tier's evictions, bytes held and budget.
pub fn metrics(s: &LmcacheStats) -> Vec<ConnectorMetric> {
    const REMOTE: &str =
        "lmcache remote tier (remote_url) outcomes other than hits: miss (not there, or the \
        remote could not answer), error (a failed lookup or read), skipped (not tried during the back-off \
        after a failure), corrupt (failed its checksum; never loaded), write_error, write_dropped.";
    let tiers = [("cpu", &s.cpu), ("disk", &s.disk), ("remote", &s.remote)];
    let mut out: Vec<ConnectorMetric> =
        tiers.iter().map(|(tier, t)| cache_metrics::hits("lmcache", tier, t.hits)).collect();
    out.push(cache_metrics::misses("lmcache", s.misses));
    for (outcome, v) in [
        ("miss", s.remote_misses),
        ("error", s.remote_errors),
        ("skipped", s.remote_skipped),
        ("corrupt", s.remote_corrupt),
        ("write_error", s.remote_write_errors),
        ("write_dropped", s.remote_write_drops),
    ] {
        out.push(
            ConnectorMetric::counter("kvconnect_cache_remote_outcomes", REMOTE, v)
                .label("connector", "lmcache")
                .label("outcome", outcome),
        );
    }
    out.extend(tiers.iter().map(|(tier, t)| cache_metrics::loaded_bytes("lmcache", tier, t.bytes_loaded)));
    // The local tiers that are on (a budget): how full, and how much they let go of. The
    // remote tier's size is the remote server's to say.
    for (tier, t) in tiers.iter().filter(|(tier, t)| *tier != "remote" && t.budget_bytes > 0) {
        out.push(cache_metrics::evictions("lmcache", tier, t.evictions));
        out.extend(cache_metrics::occupancy("lmcache", tier, t.bytes_used, t.budget_bytes));
    }
    let restored = tiers.iter().map(|(_, t)| t.bytes_loaded).sum();
    out.extend(cache_metrics::offload(s.cpu.bytes_stored, restored));
    out
}
