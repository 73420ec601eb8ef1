//! Copying large runs with non-temporal stores.
//!
//! A pulled run is tens of MiB, far larger than the last-level cache: ordinary stores
//! first read every destination line into the cache (read-for-ownership) only to evict it
//! again. Streaming stores write around the cache. glibc's memcpy switches to them only for
//! copies above a threshold scaled to the cache size, which per-region runs (one layer's
//! K or V blocks) can fall under; so the shm backend decides by the run's size itself.

#![allow(unsafe_code)] // SIMD copies: AVX2 non-temporal stores behind a runtime feature check.

/// Runs at least this long are copied with streaming stores.
pub const STREAM_THRESHOLD: usize = 2 << 20;

/// Copies `src` into `dst` (same length), with streaming stores when the run is large.
pub fn copy_run(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_run: length mismatch");
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= STREAM_THRESHOLD {
        stream_x86_64(dst, src);
        return;
    }
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
fn stream_x86_64(dst: &mut [u8], src: &[u8]) {
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked just above).
        unsafe { stream_avx2(dst, src) }
    } else {
        stream_sse2(dst, src)
    }
}

/// Streams `src` into `dst` 128 bytes per step with 32-byte non-temporal stores.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    let n = dst.len();
    let head = dst.as_ptr().align_offset(32).min(n);
    dst[..head].copy_from_slice(&src[..head]);
    let body = (n - head) / 128 * 128;
    // SAFETY: loads read [head, head+body) of `src`, stores write the same range of `dst`,
    // both in bounds (body <= n - head, equal lengths asserted by the caller); stores are
    // 32-byte aligned because `dst + head` is; the fence orders the streaming stores before
    // anything after the copy.
    unsafe {
        let mut s = src.as_ptr().add(head) as *const __m256i;
        let mut d = dst.as_mut_ptr().add(head) as *mut __m256i;
        for _ in 0..body / 128 {
            let a = _mm256_loadu_si256(s);
            let b = _mm256_loadu_si256(s.add(1));
            let c = _mm256_loadu_si256(s.add(2));
            let e = _mm256_loadu_si256(s.add(3));
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
            _mm256_stream_si256(d.add(2), c);
            _mm256_stream_si256(d.add(3), e);
            s = s.add(4);
            d = d.add(4);
        }
        _mm_sfence();
    }
    dst[head + body..].copy_from_slice(&src[head + body..]);
}

/// The same with 16-byte stores, for x86_64 CPUs without AVX2 (SSE2 is baseline).
#[cfg(target_arch = "x86_64")]
fn stream_sse2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let n = dst.len();
    let head = dst.as_ptr().align_offset(16).min(n);
    dst[..head].copy_from_slice(&src[..head]);
    let body = (n - head) / 64 * 64;
    // SAFETY: as in `stream_avx2`, with 16-byte alignment; SSE2 is part of the x86_64
    // baseline.
    unsafe {
        let mut s = src.as_ptr().add(head) as *const __m128i;
        let mut d = dst.as_mut_ptr().add(head) as *mut __m128i;
        for _ in 0..body / 64 {
            let a = _mm_loadu_si128(s);
            let b = _mm_loadu_si128(s.add(1));
            let c = _mm_loadu_si128(s.add(2));
            let e = _mm_loadu_si128(s.add(3));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            s = s.add(4);
            d = d.add(4);
        }
        _mm_sfence();
    }
    dst[head + body..].copy_from_slice(&src[head + body..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_exactly_at_every_alignment_and_size() {
        let src: Vec<u8> = (0..STREAM_THRESHOLD + 200).map(|i| (i * 7 + 3) as u8).collect();
        for off in [0usize, 1, 5, 15] {
            for len in [0usize, 1, 63, 100, STREAM_THRESHOLD, STREAM_THRESHOLD + 77] {
                let mut dst = vec![0u8; len + 40];
                copy_run(&mut dst[off..off + len], &src[3..3 + len]);
                assert_eq!(&dst[off..off + len], &src[3..3 + len], "off {off} len {len}");
                assert!(dst[..off].iter().all(|b| *b == 0) && dst[off + len..].iter().all(|b| *b == 0));
                #[cfg(target_arch = "x86_64")]
                {
                    let mut d2 = vec![0u8; len + 40];
                    stream_sse2(&mut d2[off..off + len], &src[3..3 + len]);
                    assert_eq!(&d2[off..off + len], &src[3..3 + len], "sse2 off {off} len {len}");
                }
            }
        }
    }
}
