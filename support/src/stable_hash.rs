//! Stable 64-bit hashes of bytes, the same in every process, build and run (std's hashers are
//! randomly seeded): [`hash_bytes`] for small keys, and [`Checksum`], a payload checksum
//! fast enough to take in the same pass as the copy it guards (fused with streaming stores,
//! [`Checksum::copy_update`]). The cache connectors key and guard their stored blocks with
//! them. The mixing step is a 64x64->128 multiply folded to 64 bits (as in wyhash).

// SIMD: the checksum's lanes in AVX2 registers (fused with streaming stores), behind a runtime feature check.
#![allow(unsafe_code)]

use crate::stream_copy::Batch;

/// Mixing constants (wyhash's).
pub const P0: u64 = 0xa076_1d64_78bd_642f;
pub const P1: u64 = 0xe703_7ed1_a0b4_28db;
pub const P2: u64 = 0x8ebc_6af0_9c88_c6e3;
pub const P3: u64 = 0x5899_65cc_7537_4cc3;

/// The mixing step: a 64x64->128 multiply folded to 64 bits.
#[inline(always)]
pub fn mix(a: u64, b: u64) -> u64 {
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

/// A hasher for keys that are already uniform hashes (block hashes, chained prefix hashes):
/// a `u64` key is its own hash, other bytes are folded in. For hash maps keyed by such
/// hashes (`HashMap<u64, V, BuildHasherDefault<PassThrough>>`).
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThrough(u64);

impl std::hash::Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// A checksum of a payload: a Fletcher-style pair of sums (the words, and the running sums
/// of the words) in eight 64-bit lanes, so a change in any word, a zeroed sector, a bit flip
/// or two words swapped changes it. Additions only, so it vectorises and runs faster than
/// the copy it guards. It is for torn writes and bad sectors, not for an adversary.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut c = Checksum::new();
    c.update(bytes);
    c.finish()
}

const CK: [u64; 8] = [
    0x9e37_79b9_7f4a_7c15,
    0xbf58_476d_1ce4_e5b9,
    0x94d0_49bb_1331_11eb,
    0xff51_afd7_ed55_8ccd,
    0xc4ce_b9fe_1a85_ec53,
    0x87c3_7b91_1142_53d5,
    0x4cf5_ad43_2745_937f,
    0xe703_7ed1_a0b4_28db,
];

/// [`checksum`] computed piece by piece (so a reader can verify each piece while it is
/// still in cache). Every piece but the last must be a multiple of 1 KiB long.
#[derive(Debug, Clone)]
pub struct Checksum {
    acc: [u64; 8],
    sums: [u64; 8],
    len: u64,
    tail: Vec<u8>,
}

impl Default for Checksum {
    fn default() -> Self {
        Self::new()
    }
}

impl Checksum {
    /// An empty checksum.
    pub fn new() -> Self {
        Checksum { acc: CK, sums: [0; 8], len: 0, tail: Vec::new() }
    }

    /// Adds a piece. A piece after one whose length was not a multiple of 1 KiB is appended
    /// to that remainder (correct, but slower).
    pub fn update(&mut self, bytes: &[u8]) {
        self.len += bytes.len() as u64;
        if !self.tail.is_empty() {
            self.tail.extend_from_slice(bytes);
            let t = std::mem::take(&mut self.tail);
            let whole = t.len() / 1024 * 1024;
            self.blocks(&t[..whole]);
            self.tail = t[whole..].to_vec();
            return;
        }
        let whole = bytes.len() / 1024 * 1024;
        self.blocks(&bytes[..whole]);
        self.tail.extend_from_slice(&bytes[whole..]);
    }

    /// Copies `src` into `dst` (same length) as part of `batch` (streaming stores) and adds
    /// it, in one pass: each 16 KiB piece of the source is summed right after it is copied,
    /// while it is in the L1 cache, so the bytes are read from memory once (a piece of 1 KiB
    /// measured slower: the copy's start-up cost). The same rule on piece lengths as
    /// [`Checksum::update`].
    pub fn copy_update(&mut self, batch: &mut Batch, dst: &mut [u8], src: &[u8]) {
        if dst.len() != src.len() || !self.tail.is_empty() {
            // Not one of the fused cases: the plain copy, then the sum.
            let n = dst.len().min(src.len());
            batch.copy(&mut dst[..n], &src[..n]);
            self.update(&src[..n]);
            return;
        }
        self.len += src.len() as u64;
        let whole = src.len() / 1024 * 1024;
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && (dst.as_ptr() as usize).is_multiple_of(64) {
            // SAFETY: AVX2 is present (checked just above); `dst` is line aligned.
            unsafe { lanes_avx2::<true>(&mut self.acc, &mut self.sums, &src[..whole], &mut dst[..whole]) };
            batch.note_streamed();
            batch.copy(&mut dst[whole..], &src[whole..]);
            self.tail.extend_from_slice(&src[whole..]);
            return;
        }
        for (d, s) in dst[..whole].chunks_mut(16 << 10).zip(src[..whole].chunks(16 << 10)) {
            batch.copy(d, s);
            self.blocks(s);
        }
        batch.copy(&mut dst[whole..], &src[whole..]);
        self.tail.extend_from_slice(&src[whole..]);
    }

    /// Adds whole 1 KiB blocks (`bytes` is a multiple of 1 KiB long), in AVX2 where the CPU
    /// has it (checked once per call).
    fn blocks(&mut self, bytes: &[u8]) {
        debug_assert!(bytes.len().is_multiple_of(1024), "Checksum::blocks: not whole blocks");
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked just above).
            unsafe { lanes_avx2::<false>(&mut self.acc, &mut self.sums, bytes, &mut []) };
            return;
        }
        let (mut a, mut b) = (self.acc, self.sums);
        for stripe in bytes.chunks_exact(64) {
            for i in 0..8 {
                let mut w = [0u8; 8];
                w.copy_from_slice(&stripe[i * 8..i * 8 + 8]);
                a[i] = a[i].wrapping_add(u64::from_le_bytes(w));
                b[i] = b[i].wrapping_add(a[i]);
            }
        }
        (self.acc, self.sums) = (a, b);
    }

    /// The checksum.
    pub fn finish(&self) -> u64 {
        let mut h = P3;
        for (a, b) in self.acc.iter().zip(&self.sums) {
            h = mix(h ^ a, P1 ^ b);
        }
        h = hash_bytes(h, &self.tail);
        mix(h ^ self.len, P2)
    }
}

/// [`Checksum`]'s lanes over `src` (whole 64-byte stripes) in four AVX2 registers: lanes 0-3
/// and 4-7 of the word sums and of the running sums, the same wrapping additions in the same
/// order as the portable loop. With `COPY`, each stripe is also streamed into `dst` (line
/// aligned, as long as `src`) in the same loop, loaded once; the caller's batch fences.
/// Without, `dst` is unused.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn lanes_avx2<const COPY: bool>(acc: &mut [u64; 8], sums: &mut [u64; 8], src: &[u8], dst: &mut [u8]) {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi64, _mm256_loadu_si256, _mm256_storeu_si256, _mm256_stream_si256,
    };
    if COPY {
        assert_eq!(dst.len(), src.len(), "lanes_avx2: length mismatch");
    }
    // SAFETY: loads and stores of the two 8-lane arrays (64 bytes each, unaligned forms);
    // loads of whole stripes inside `src` (`chunks_exact`); with `COPY`, stores of whole
    // stripes of `dst`, as long as `src` (asserted) and line aligned (the caller checked), so
    // each is 32-byte aligned.
    unsafe {
        let (pa, pb) = (acc.as_mut_ptr() as *mut __m256i, sums.as_mut_ptr() as *mut __m256i);
        let (mut a0, mut a1) = (_mm256_loadu_si256(pa), _mm256_loadu_si256(pa.add(1)));
        let (mut b0, mut b1) = (_mm256_loadu_si256(pb), _mm256_loadu_si256(pb.add(1)));
        for (i, s) in src.chunks_exact(64).enumerate() {
            let sp = s.as_ptr() as *const __m256i;
            let (x0, x1) = (_mm256_loadu_si256(sp), _mm256_loadu_si256(sp.add(1)));
            if COPY {
                let dp = dst[i * 64..i * 64 + 64].as_mut_ptr() as *mut __m256i;
                _mm256_stream_si256(dp, x0);
                _mm256_stream_si256(dp.add(1), x1);
            }
            a0 = _mm256_add_epi64(a0, x0);
            a1 = _mm256_add_epi64(a1, x1);
            b0 = _mm256_add_epi64(b0, a0);
            b1 = _mm256_add_epi64(b1, a1);
        }
        _mm256_storeu_si256(pa, a0);
        _mm256_storeu_si256(pa.add(1), a1);
        _mm256_storeu_si256(pb, b0);
        _mm256_storeu_si256(pb.add(1), b1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_sees_every_byte() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let c = checksum(&data);
        for i in [0, 31, 32, 500, 999, 1024, 4095, 4999] {
            let mut d = data.clone();
            d[i] ^= 1;
            assert_ne!(checksum(&d), c, "flip at {i}");
        }
        assert_ne!(checksum(&data[..4999]), c);
        // Zeroed sectors and a swapped pair of kilobytes are caught.
        let mut z = data.clone();
        z[512..1024].fill(0);
        assert_ne!(checksum(&z), c);
        let mut sw = data.clone();
        sw[..1024].copy_from_slice(&data[1024..2048]);
        sw[1024..2048].copy_from_slice(&data[..1024]);
        assert_ne!(checksum(&sw), c);
        // Piecewise equals whole, aligned or not.
        let mut p = Checksum::new();
        p.update(&data[..2048]);
        p.update(&data[2048..3000]);
        p.update(&data[3000..]);
        assert_eq!(p.finish(), c);
        // Copying while summing gives the same sum and the same bytes.
        let mut q = Checksum::new();
        let mut out = vec![0u8; data.len()];
        q.copy_update(&mut Batch::new(), &mut out[..3072], &data[..3072]);
        q.copy_update(&mut Batch::new(), &mut out[3072..], &data[3072..]);
        assert_eq!((q.finish(), &out), (c, &data));
    }

    /// The portable lanes over whole stripes, the definition the SIMD forms must match.
    fn lanes(bytes: &[u8]) -> ([u64; 8], [u64; 8]) {
        let (mut a, mut b) = (CK, [0u64; 8]);
        for stripe in bytes.chunks_exact(64) {
            for i in 0..8 {
                a[i] = a[i].wrapping_add(u64::from_le_bytes(stripe[i * 8..i * 8 + 8].try_into().unwrap()));
                b[i] = b[i].wrapping_add(a[i]);
            }
        }
        (a, b)
    }

    #[test]
    fn simd_lanes_and_the_fused_copy_match_the_portable_definition() {
        let data: Vec<u8> = (0..64 * 1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        let want = lanes(&data);
        let mut c = Checksum::new();
        c.update(&data);
        assert_eq!((c.acc, c.sums), want);
        // Copied and summed at once, into a line-aligned destination and an unaligned one.
        let mut buf = vec![0u8; data.len() + 128];
        let base = buf.as_ptr().align_offset(64);
        for shift in [0usize, 8] {
            let dst = &mut buf[base + shift..base + shift + data.len()];
            let mut q = Checksum::new();
            q.copy_update(&mut Batch::new(), dst, &data);
            assert_eq!((q.acc, q.sums), want, "shift {shift}");
            assert_eq!(dst, &data[..], "shift {shift}");
            assert_eq!(q.finish(), checksum(&data));
        }
    }
}
