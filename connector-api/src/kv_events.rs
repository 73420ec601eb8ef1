//! KV cache events: what a connector or the engine's prefix cache stored, removed or
//! cleared, in vLLM's event model (`vllm/distributed/kv_events.py`: `BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`, batched in a `KVEventBatch`). A KV-aware router reads
//! them to learn which worker holds which prefix, and in which tier.
//!
//! Plain data only; the msgpack codec and the ZeroMQ publisher live in `kvconnect-events`.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A block's hash as events carry it: vLLM's integer form of its block hash
/// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, the low 64 bits), or a connector's own chunk hash.
pub type BlockHash = u64;

/// Where a block is kept. vLLM's own words for its prefix cache (`GPU`, and `CPU` for its CPU
/// offloading), and kvconnect's for the tiers of its cache connectors (lmcache, flexkv).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    /// The engine's own prefix cache in GPU memory (vLLM's `MEDIUM_GPU`, `"GPU"`).
    Gpu,
    /// The engine's own prefix cache in host memory (vLLM's `MEDIUM_CPU`, `"CPU"`: a CPU
    /// build's KV cache, or vLLM's CPU offloading).
    Cpu,
    /// A cache connector's host-memory tier (lmcache's `local_cpu`, flexkv's `cpu`):
    /// `"cpu_tier"`.
    CpuTier,
    /// A cache connector's local disk tier (lmcache's `local_disk`, flexkv's `ssd`): `"disk"`.
    Disk,
    /// A cache connector's remote tier (lmcache's `remote_url`, flexkv's remote store):
    /// `"remote"`.
    Remote,
    /// Any other medium a publisher names (vLLM's `"STORAGE"`, another system's words):
    /// kept as written so that a decoded batch re-encodes unchanged.
    Other(String),
}

impl Medium {
    /// The medium as events write it.
    pub fn as_str(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::CpuTier => "cpu_tier",
            Medium::Disk => "disk",
            Medium::Remote => "remote",
            Medium::Other(s) => s,
        }
    }

    /// The medium an event names; a word not listed above is kept as [`Medium::Other`].
    pub fn parse(s: &str) -> Medium {
        match s {
            "GPU" => Medium::Gpu,
            "CPU" => Medium::Cpu,
            "cpu_tier" => Medium::CpuTier,
            "disk" => Medium::Disk,
            "remote" => Medium::Remote,
            other => Medium::Other(other.to_owned()),
        }
    }

    /// How fast a block is reached from this medium, for a router weighing tiers: 0 for the
    /// engine's own cache, then host memory, disk and remote; `Other` counts as remote.
    pub fn rank(&self) -> u8 {
        match self {
            Medium::Gpu | Medium::Cpu => 0,
            Medium::CpuTier => 1,
            Medium::Disk => 2,
            Medium::Remote | Medium::Other(_) => 3,
        }
    }
}

impl fmt::Display for Medium {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Medium {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Medium {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Medium::parse(&String::deserialize(d)?))
    }
}

/// Blocks were stored (vLLM's `BlockStored`): consecutive blocks of one prefix, each hash
/// chained on the one before it, the first on `parent_block_hash`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockStored {
    /// The blocks' hashes, in prefix order.
    pub block_hashes: Vec<BlockHash>,
    /// The hash of the block before the first one; `None` when the first block starts the
    /// prompt.
    pub parent_block_hash: Option<BlockHash>,
    /// The tokens of the blocks, `block_size` per block, in order.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter the blocks were computed with (vLLM's deprecated `lora_id`); `None`
    /// for the base model.
    pub lora_id: Option<i64>,
    /// Where the blocks are now.
    pub medium: Medium,
}

/// Blocks were removed from one medium (vLLM's `BlockRemoved`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockRemoved {
    /// The removed blocks' hashes.
    pub block_hashes: Vec<BlockHash>,
    /// The medium they left.
    pub medium: Medium,
}

/// One KV cache event (vLLM's `KVCacheEvent`s).
///
/// Read from JSON (the plugin ABI's `take_kv_events`) in this shape, or (its `take_events`)
/// in the shape plugins built before it wrote (`{"Stored": {"hashes": [..], "tier": ".."}}`,
/// `Removed` alike), read as a store or removal of those hashes in the medium the tier names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "AnyKvEvent")]
pub enum KvEvent {
    /// Blocks were stored.
    BlockStored(BlockStored),
    /// Blocks were removed.
    BlockRemoved(BlockRemoved),
    /// Every block this publisher held is gone, in every medium (vLLM's `AllBlocksCleared`,
    /// which names none).
    AllBlocksCleared,
}

impl KvEvent {
    /// A store of consecutive blocks.
    pub fn stored(
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        medium: Medium,
    ) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium,
        })
    }

    /// A removal of blocks from one medium.
    pub fn removed(block_hashes: Vec<BlockHash>, medium: Medium) -> KvEvent {
        KvEvent::BlockRemoved(BlockRemoved { block_hashes, medium })
    }

    /// The medium the event names; `None` for [`KvEvent::AllBlocksCleared`].
    pub fn medium(&self) -> Option<&Medium> {
        match self {
            KvEvent::BlockStored(s) => Some(&s.medium),
            KvEvent::BlockRemoved(r) => Some(&r.medium),
            KvEvent::AllBlocksCleared => None,
        }
    }

    /// The hashes the event names (none for a clear).
    pub fn block_hashes(&self) -> &[BlockHash] {
        match self {
            KvEvent::BlockStored(s) => &s.block_hashes,
            KvEvent::BlockRemoved(r) => &r.block_hashes,
            KvEvent::AllBlocksCleared => &[],
        }
    }
}

/// What `KvEvent` is read from: its own shape, or the one before it.
#[derive(Deserialize)]
#[serde(untagged)]
enum AnyKvEvent {
    Now(KvEventNow),
    Before(KvEventBefore),
}

#[derive(Deserialize)]
enum KvEventNow {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
}

/// An event in the shape before media: what the plugin ABI's `take_events` entry carries
/// both ways (a plugin of ABI 1.2 or later publishes media through `take_kv_events`).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(crate) enum KvEventBefore {
    Stored { hashes: Vec<BlockHash>, tier: String },
    Removed { hashes: Vec<BlockHash>, tier: String },
}

/// The tier names plugins used before media: `cpu` for a CPU tier, `ssd` for a disk one.
fn medium_of_tier(tier: &str) -> Medium {
    match tier {
        "cpu" => Medium::CpuTier,
        "ssd" => Medium::Disk,
        other => Medium::parse(other),
    }
}

/// The tier name a medium had before media, read back as that medium by `medium_of_tier`.
fn tier_of_medium(medium: &Medium) -> String {
    match medium {
        Medium::CpuTier => "cpu".to_owned(),
        other => other.as_str().to_owned(),
    }
}

impl KvEventBefore {
    /// `event` in the shape before media: its hashes and tier, without parent, tokens or
    /// block size, which that shape has no room for. `None` for a clear, which it cannot say.
    pub(crate) fn of(event: &KvEvent) -> Option<KvEventBefore> {
        match event {
            KvEvent::BlockStored(s) => Some(KvEventBefore::Stored {
                hashes: s.block_hashes.clone(),
                tier: tier_of_medium(&s.medium),
            }),
            KvEvent::BlockRemoved(r) => Some(KvEventBefore::Removed {
                hashes: r.block_hashes.clone(),
                tier: tier_of_medium(&r.medium),
            }),
            KvEvent::AllBlocksCleared => None,
        }
    }
}

impl From<AnyKvEvent> for KvEvent {
    fn from(e: AnyKvEvent) -> KvEvent {
        match e {
            AnyKvEvent::Now(KvEventNow::BlockStored(s)) => KvEvent::BlockStored(s),
            AnyKvEvent::Now(KvEventNow::BlockRemoved(r)) => KvEvent::BlockRemoved(r),
            AnyKvEvent::Now(KvEventNow::AllBlocksCleared) => KvEvent::AllBlocksCleared,
            AnyKvEvent::Before(KvEventBefore::Stored { hashes, tier }) => {
                KvEvent::stored(hashes, None, Vec::new(), 0, medium_of_tier(&tier))
            }
            AnyKvEvent::Before(KvEventBefore::Removed { hashes, tier }) => {
                KvEvent::removed(hashes, medium_of_tier(&tier))
            }
        }
    }
}

/// A batch of events as a publisher sends it (vLLM's `KVEventBatch`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvEventBatch {
    /// When the batch was made, in seconds since the Unix epoch.
    pub ts: f64,
    /// The events, in the order they happened.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank of the engine that published them; `None` when unspecified.
    pub data_parallel_rank: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trips_and_reads_the_shape_before_media() {
        let events = vec![
            KvEvent::stored(vec![1, 2], Some(9), vec![5, 6], 1, Medium::CpuTier),
            KvEvent::removed(vec![2], Medium::Other("STORAGE".into())),
            KvEvent::AllBlocksCleared,
        ];
        let json = serde_json::to_string(&events).unwrap();
        assert_eq!(serde_json::from_str::<Vec<KvEvent>>(&json).unwrap(), events);
        let before = r#"[{"Stored":{"hashes":[3],"tier":"cpu"}},{"Removed":{"hashes":[4],"tier":"ssd"}}]"#;
        assert_eq!(
            serde_json::from_str::<Vec<KvEvent>>(before).unwrap(),
            vec![
                KvEvent::stored(vec![3], None, vec![], 0, Medium::CpuTier),
                KvEvent::removed(vec![4], Medium::Disk)
            ]
        );
        let err = serde_json::from_str::<KvEvent>(r#"{"Stored":{"hashes":"x"}}"#).unwrap_err().to_string();
        assert!(err.contains("did not match any variant"), "{err}");
    }

    #[test]
    fn the_shape_before_media_keeps_hashes_and_tier_and_reads_back_as_the_same_medium() {
        let events = [
            KvEvent::stored(vec![1, 2], Some(9), vec![5, 6], 1, Medium::CpuTier),
            KvEvent::removed(vec![2], Medium::Disk),
            KvEvent::AllBlocksCleared,
            KvEvent::stored(vec![3], None, vec![7], 1, Medium::Remote),
        ];
        let before: Vec<_> = events.iter().filter_map(KvEventBefore::of).collect();
        let json = serde_json::to_string(&before).unwrap();
        assert_eq!(
            json,
            concat!(
                r#"[{"Stored":{"hashes":[1,2],"tier":"cpu"}},{"Removed":{"hashes":[2],"tier":"disk"}},"#,
                r#"{"Stored":{"hashes":[3],"tier":"remote"}}]"#
            )
        );
        assert_eq!(
            serde_json::from_str::<Vec<KvEvent>>(&json).unwrap(),
            vec![
                KvEvent::stored(vec![1, 2], None, vec![], 0, Medium::CpuTier),
                KvEvent::removed(vec![2], Medium::Disk),
                KvEvent::stored(vec![3], None, vec![], 0, Medium::Remote),
            ]
        );
    }
}
