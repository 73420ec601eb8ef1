//! The router's own block hashes: a chain over pieces of `unit` tokens, each hash the
//! previous one's mixed with the piece's tokens (`kvconnect_support::stable_hash::hash_bytes`,
//! the same in every process). Workers name their blocks with hashes of their own (the
//! engine's prefix cache its block hashes, lmcache its chunk keys rooted in a namespace the
//! proxy cannot know, at a chunk size other than the engine's block size), so the indexer
//! re-hashes every stored block from the token ids its event carries, and the proxy hashes a
//! request's prompt the same way: a predicted hit is then a run of the same tokens, whoever
//! stored it and at whatever block size.
//!
//! A router hash has 56 bits (`KEY_BITS`): the indexer keeps a worker's media of a block in
//! the top 8 bits of the same word as its router hash (`indexer`), so that a removal learns
//! in one map probe both the hash to remove and whether the worker still holds the block.
//! 56 bits leave a collision between two of 10 million blocks at odds of about 1 in 1,400.

use kvconnect_support::stable_hash::{mix, P0, P1, P2, P3};

/// The hash before a prompt's first piece.
pub const ROOT: u64 = 0;

/// Bits of a router hash.
pub const KEY_BITS: u32 = 56;

/// The bits a router hash may have.
pub const KEY_MASK: u64 = (1 << KEY_BITS) - 1;

/// The hash of the piece `tokens` after the piece hashed `parent`: `hash_bytes(parent, b)`
/// of the tokens' little-endian bytes `b`, 64 tokens at a time (pieces longer than 64 tokens,
/// a large unit, go on in steps of 64), computed from the tokens in place (each 8-byte word
/// of `b` is two tokens), its low `KEY_BITS` bits.
pub fn next(parent: u64, tokens: &[u32]) -> u64 {
    let n = tokens.len().min(64);
    let (head, rest) = tokens.split_at(n);
    let mut h = parent ^ P0;
    let mut pairs = head.chunks_exact(2);
    for p in &mut pairs {
        h = mix(h ^ (u64::from(p[0]) | u64::from(p[1]) << 32) ^ P1, P2);
    }
    let tail = pairs.remainder().first().map_or(0, |t| u64::from(*t));
    h = mix(h ^ tail ^ P1, P2);
    h = mix(h ^ (4 * n) as u64, P3);
    h &= KEY_MASK;
    for more in rest.chunks(64) {
        h = next(h, more);
    }
    h
}

/// The hashes of `tokens`' full pieces of `unit` tokens, from the start of a prompt.
pub fn prefix_hashes(tokens: &[u32], unit: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / unit.max(1));
    let mut h = ROOT;
    for piece in tokens.chunks_exact(unit.max(1)) {
        h = next(h, piece);
        out.push(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_depends_on_every_earlier_token_and_extends_piece_by_piece() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[3] = 999;
        let (ha, hb) = (prefix_hashes(&a, 16), prefix_hashes(&b, 16));
        assert_eq!(ha.len(), 4);
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y), "a change in block 0 changes every later hash");
        assert_eq!(prefix_hashes(&a[..40], 16), ha[..2], "a longer prompt extends the chain");
        assert_eq!(next(ha[1], &a[32..48]), ha[2]);
        let long: Vec<u32> = (0..300).collect();
        assert_ne!(prefix_hashes(&long, 150)[0], prefix_hashes(&long, 100)[0]);
    }

    /// The definition `next` computes in place: the bytes, hashed 64 tokens at a time.
    fn by_bytes(parent: u64, tokens: &[u32]) -> u64 {
        let n = tokens.len().min(64);
        let bytes: Vec<u8> = tokens[..n].iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut h = kvconnect_support::stable_hash::hash_bytes(parent, &bytes) & KEY_MASK;
        for rest in tokens[n..].chunks(64) {
            h = by_bytes(h, rest);
        }
        h
    }

    #[test]
    fn next_is_the_hash_of_the_tokens_bytes() {
        let t: Vec<u32> = (0..300u32).map(|i| i.wrapping_mul(2_654_435_761) ^ (i << 7)).collect();
        for len in (0..=140).chain([150, 199, 200, 255, 256, 300]) {
            for parent in [ROOT, 1, u64::MAX, 0x0123_4567_89ab_cdef] {
                assert_eq!(next(parent, &t[..len]), by_bytes(parent, &t[..len]), "{len} tokens");
            }
        }
    }
}
