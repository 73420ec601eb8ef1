//! Helpers for GPU tests (here and in the connectors): open a GPU or say why the test skips,
//! and reproducible random bytes to fill regions with.

use crate::device::Gpu;

/// GPU `ordinal`, or `None` after printing why the calling test skips (no driver, no GPU).
pub fn gpu_or_skip(ordinal: usize) -> Option<Gpu> {
    match Gpu::open(ordinal) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("skipping: no usable GPU ({e})");
            None
        }
    }
}

/// `n` bytes of xorshift noise from `seed`: the same bytes on every run.
pub fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}
