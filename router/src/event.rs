//! The KV cache events the index applies, as one worker publishes them: vLLM's `BlockStored`,
//! `BlockRemoved` and `AllBlocksCleared` (`vllm/distributed/kv_events.py`), in batches
//! numbered by the worker's publisher. Only what the index keeps is here: block hashes, the
//! parent and the medium; the token ids and block size of `BlockStored` stay with the codec.

/// A block's chained hash: the engine's prefix-cache hash of the block and every block
/// before it (`kvconnect_engine::prefix_cache::block_hashes`).
pub type BlockHash = u64;

/// Where a worker keeps a block, fastest first: the engine's own prefix cache on the GPU or
/// in CPU memory (vLLM's `GPU`, `CPU`), then the cache connectors' tiers (lmcache's and
/// flexkv's CPU tier, disk, remote store).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    /// The engine's KV blocks in GPU memory.
    Gpu,
    /// The engine's KV blocks in CPU memory (a CPU engine, or vLLM's CPU offload).
    Cpu,
    /// A cache connector's CPU tier.
    CpuTier,
    /// A cache connector's disk tier.
    Disk,
    /// A cache connector's remote store.
    Remote,
}

impl Medium {
    /// Every medium, fastest first; `index()` is the position here.
    pub const ALL: [Medium; 5] = [Medium::Gpu, Medium::Cpu, Medium::CpuTier, Medium::Disk, Medium::Remote];

    /// The event's word for it.
    pub fn name(self) -> &'static str {
        match self {
            Medium::Gpu => "gpu",
            Medium::Cpu => "cpu",
            Medium::CpuTier => "cpu_tier",
            Medium::Disk => "disk",
            Medium::Remote => "remote",
        }
    }

    /// The medium an event names (vLLM writes `GPU` and `CPU` in capitals); None for a word
    /// it does not know.
    pub fn parse(s: &str) -> Option<Medium> {
        Medium::ALL.into_iter().find(|m| m.name().eq_ignore_ascii_case(s))
    }

    /// Its position in [`Medium::ALL`] (its bit in a tier mask).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// One event of a worker's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks stored, in prefix order: each block's parent is the one before it, the first
    /// one's is `parent` (None: the first block of a prompt).
    Stored { hashes: Vec<BlockHash>, parent: Option<BlockHash>, medium: Medium },
    /// Blocks removed from one medium (a block moving from a CPU tier to disk is a removal
    /// from `cpu_tier` and a store on `disk`).
    Removed { hashes: Vec<BlockHash>, medium: Medium },
    /// Every block of the worker, in every medium, is gone.
    AllCleared,
}

/// A worker's numbered batch of events (vLLM's `KVEventBatch`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventBatch {
    /// The publisher's sequence number: one more than the batch before.
    pub seq: u64,
    /// The events, applied in order.
    pub events: Vec<KvEvent>,
}
