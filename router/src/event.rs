//! The events the indexer applies are kvconnect-api's, in vLLM's model
//! (`kvconnect_api::kv_events`: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`), numbered
//! by the worker's publisher (the seq frame of each ZeroMQ message, `kvconnect-events`).
//! Here: which bit of a tier mask each medium takes.

pub use kvconnect_api::kv_events::{BlockHash, KvEvent, KvEventBatch, Medium};

/// Media a tier mask tells apart: the five kvconnect publishes, and any other word.
pub const MEDIA: usize = 6;

/// The bit of `m` in a tier mask. Each medium has its own, so that a removal from one
/// (a block leaving the GPU) leaves the others (its copy in the CPU tier) as they are.
pub fn medium_bit(m: &Medium) -> u8 {
    1 << match m {
        Medium::Gpu => 0,
        Medium::Cpu => 1,
        Medium::CpuTier => 2,
        Medium::Disk => 3,
        Medium::Remote => 4,
        Medium::Other(_) => 5,
    }
}

/// The rank (`Medium::rank`: 0 the engine's own cache, then host memory, disk, remote) of the
/// fastest medium in `mask`.
pub fn fastest_rank(mask: u8) -> usize {
    // Bits in medium_bit's order: GPU and CPU rank 0, cpu_tier 1, disk 2, remote and others 3.
    const RANK: [usize; MEDIA] = [0, 0, 1, 2, 3, 3];
    RANK[(mask.trailing_zeros() as usize).min(MEDIA - 1)]
}

/// Ranks a block's fastest medium can have.
pub const RANKS: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_medium_has_its_bit_and_the_fastest_rank_agrees_with_medium_rank() {
        let all = [
            Medium::Gpu,
            Medium::Cpu,
            Medium::CpuTier,
            Medium::Disk,
            Medium::Remote,
            Medium::Other("STORAGE".into()),
        ];
        let mut seen = 0u8;
        for m in &all {
            let b = medium_bit(m);
            assert_eq!(seen & b, 0, "{m} shares a bit");
            seen |= b;
            assert_eq!(fastest_rank(b), usize::from(m.rank()), "{m}");
        }
        assert_eq!(fastest_rank(medium_bit(&Medium::Disk) | medium_bit(&Medium::CpuTier)), 1);
    }
}
