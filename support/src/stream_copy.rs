//! Copying KV bytes with non-temporal (streaming) stores.
//!
//! A pulled run is tens of MiB, and a cache tier's block hundreds of KiB copied in rows,
//! more than the caches keep: ordinary stores first read every destination line into the
//! cache (read-for-ownership) only to evict it again, a third pass over memory. Streaming
//! stores write around the cache. glibc's memcpy switches to them only for single copies
//! above a threshold scaled to the cache size, which per-region runs (one layer's K or V
//! blocks) and a transpose's rows fall under; so the callers decide by what they move:
//! [`copy_run`] for one large run, [`Batch`] for many pieces of one large copy (the rows of
//! a transposed block), fenced once at its end.

#![allow(unsafe_code)] // SIMD copies: AVX2 non-temporal stores behind a runtime feature check.

use kvconnect_api::geometry::{GeometryError, Span};
use kvconnect_api::kv_memory::KvMemory;

/// Pieces shorter than this are copied with ordinary stores inside a [`Batch`]: a streaming
/// store that fills less than a cache line costs more than it saves.
pub const STREAM_MIN_PIECE: usize = 64;

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
    fence();
}

/// Orders the streaming stores before anything after them (another thread's reads of the
/// destination included).
#[cfg(target_arch = "x86_64")]
fn fence() {
    // SAFETY: SFENCE has no operands and no preconditions (SSE is part of the x86_64 baseline).
    unsafe { std::arch::x86_64::_mm_sfence() }
}

/// Many copies that together are one large copy (the rows of a transposed block, a cache
/// tier's blocks): each piece of at least [`STREAM_MIN_PIECE`] bytes is written with
/// streaming stores, and the batch fences once when it is dropped, so the destination is
/// complete for every reader after the batch ends.
#[derive(Debug)]
pub struct Batch {
    /// AVX2 is available (checked once per batch).
    avx2: bool,
    /// Some piece was streamed, so the drop fences.
    streamed: bool,
}

impl Default for Batch {
    fn default() -> Self {
        Self::new()
    }
}

impl Batch {
    /// A batch that has copied nothing yet.
    pub fn new() -> Batch {
        #[cfg(target_arch = "x86_64")]
        let avx2 = std::arch::is_x86_feature_detected!("avx2");
        #[cfg(not(target_arch = "x86_64"))]
        let avx2 = false;
        Batch { avx2, streamed: false }
    }

    /// Records that the caller wrote into the batch's destination with streaming stores of
    /// its own (a copy fused with a checksum), so the batch fences them when it ends.
    pub fn note_streamed(&mut self) {
        self.streamed = true;
    }

    /// Copies `src` into `dst` (same length).
    pub fn copy(&mut self, dst: &mut [u8], src: &[u8]) {
        assert_eq!(dst.len(), src.len(), "Batch::copy: length mismatch");
        #[cfg(target_arch = "x86_64")]
        if dst.len() >= STREAM_MIN_PIECE {
            self.streamed = true;
            if self.avx2 {
                // SAFETY: AVX2 is present (checked in `new`).
                unsafe { stream_avx2(dst, src) }
            } else {
                stream_sse2(dst, src)
            }
            return;
        }
        dst.copy_from_slice(src);
    }

    /// Appends `src` to `out` as [`Batch::copy`] copies: the new bytes are written once, into
    /// the vector's spare capacity, never zeroed first.
    pub fn extend(&mut self, out: &mut Vec<u8>, src: &[u8]) {
        #[cfg(target_arch = "x86_64")]
        if src.len() >= STREAM_MIN_PIECE {
            out.reserve(src.len());
            let at = out.len();
            self.streamed = true;
            // SAFETY: `reserve` made the `src.len()` bytes after `at` part of the allocation,
            // valid for writes and disjoint from `src` (which `out`'s exclusive borrow cannot
            // alias); the copy writes every one of them before `set_len` takes them in.
            unsafe {
                let dst = out.as_mut_ptr().add(at);
                if self.avx2 {
                    stream_avx2_to(dst, src)
                } else {
                    stream_sse2_to(dst, src)
                }
                out.set_len(at + src.len());
            }
            return;
        }
        out.extend_from_slice(src);
    }
}

impl Batch {
    /// Copies `unit`-byte rows of `src` into `dst`: for each `(from, to)` of `rows`,
    /// `src[from..from + unit]` into `dst[to..to + unit]` (a transpose's rows). When every
    /// destination row is whole cache lines (`dst` line aligned, `unit` and each `to` a
    /// multiple of the line) they are streamed in one loop with no call per row; otherwise
    /// each row is copied as [`Batch::copy`] copies it. Panics, as slicing does, on a row out
    /// of bounds.
    pub fn copy_rows(
        &mut self,
        dst: &mut [u8],
        src: &[u8],
        rows: impl Iterator<Item = (usize, usize)> + Clone,
        unit: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        if self.avx2
            && unit >= LINE
            && unit.is_multiple_of(LINE)
            && (dst.as_ptr() as usize).is_multiple_of(LINE)
            && rows.clone().all(|(_, to)| to.is_multiple_of(LINE))
        {
            self.streamed = true;
            // SAFETY: AVX2 is present (checked in `new`).
            unsafe { rows_avx2(dst, src, rows, unit) };
            return;
        }
        for (from, to) in rows {
            self.copy(&mut dst[to..to + unit], &src[from..from + unit]);
        }
    }
}

/// The rows of [`Batch::copy_rows`], whole lines each, streamed with 32-byte stores; the
/// caller fences.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_avx2(dst: &mut [u8], src: &[u8], rows: impl Iterator<Item = (usize, usize)>, unit: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    for (from, to) in rows {
        let (d, s) = (&mut dst[to..to + unit], &src[from..from + unit]);
        // SAFETY: both slices are `unit` bytes (bounds checked by the slicing above), a
        // multiple of the line; `d` starts at a line (`dst` and `to` line aligned, checked by
        // the caller), so every store is 32-byte aligned.
        unsafe {
            let (mut sp, mut dp) = (s.as_ptr() as *const __m256i, d.as_mut_ptr() as *mut __m256i);
            for _ in 0..unit / LINE {
                let a = _mm256_loadu_si256(sp);
                let b = _mm256_loadu_si256(sp.add(1));
                _mm256_stream_si256(dp, a);
                _mm256_stream_si256(dp.add(1), b);
                sp = sp.add(2);
                dp = dp.add(2);
            }
        }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if self.streamed {
            fence();
        }
    }
}

/// [`KvMemory::write`] as one piece of `batch`: the bytes are in place once the batch ends.
pub fn write_in(mem: &KvMemory, batch: &mut Batch, span: Span, src: &[u8]) -> Result<(), GeometryError> {
    mem.write_with(span, src.len(), |dst| batch.copy(dst, src))
}

/// [`Batch::copy_rows`] into a span of `mem`'s regions: `unit`-byte rows of `src`, each
/// `(from, to)` of `rows` from `src[from..]` to `to` bytes into the span.
pub fn write_rows_in(
    mem: &KvMemory,
    batch: &mut Batch,
    span: Span,
    src: &[u8],
    rows: impl Iterator<Item = (usize, usize)> + Clone,
    unit: usize,
) -> Result<(), GeometryError> {
    mem.write_with(span, span.len, |dst| batch.copy_rows(dst, src, rows, unit))
}

/// The cache line: streaming stores write whole lines only, so a line that the copy covers
/// in part (at an unaligned start or end) is written with ordinary stores, never as a
/// partial write-combining flush, which costs a read of the line at the memory controller.
const LINE: usize = 64;

/// Streams `src` into `dst` one cache line per step with 32-byte non-temporal stores; the
/// caller fences.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "stream_avx2: length mismatch");
    // SAFETY: `dst` is valid for writes of `src.len()` bytes (asserted), and a `&mut` cannot
    // overlap `src`; AVX2 is the caller's promise.
    unsafe { stream_avx2_to(dst.as_mut_ptr(), src) }
}

/// [`stream_avx2`] into raw memory (which may be uninitialised: it is only written).
///
/// # Safety
/// AVX2 must be present, and `dst` valid for writes of `src.len()` bytes that do not overlap
/// `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2_to(dst: *mut u8, src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    let n = src.len();
    let head = dst.align_offset(LINE).min(n);
    let body = (n - head) / LINE * LINE;
    // SAFETY: every write stays inside [dst, dst + n) (body <= n - head), the caller's range;
    // loads read the same offsets of `src`; stores are 32-byte aligned because `dst + head`
    // is line aligned; the ranges do not overlap (the caller's promise).
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
        let mut s = src.as_ptr().add(head) as *const __m256i;
        let mut d = dst.add(head) as *mut __m256i;
        for _ in 0..body / LINE {
            let a = _mm256_loadu_si256(s);
            let b = _mm256_loadu_si256(s.add(1));
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
            s = s.add(2);
            d = d.add(2);
        }
        std::ptr::copy_nonoverlapping(src.as_ptr().add(head + body), dst.add(head + body), n - head - body);
    }
}

/// The same with 16-byte stores, for x86_64 CPUs without AVX2 (SSE2 is baseline).
#[cfg(target_arch = "x86_64")]
fn stream_sse2(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "stream_sse2: length mismatch");
    // SAFETY: as in `stream_avx2`; SSE2 is part of the x86_64 baseline.
    unsafe { stream_sse2_to(dst.as_mut_ptr(), src) }
}

/// [`stream_sse2`] into raw memory (which may be uninitialised: it is only written).
///
/// # Safety
/// `dst` valid for writes of `src.len()` bytes that do not overlap `src`.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_sse2_to(dst: *mut u8, src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let n = src.len();
    let head = dst.align_offset(LINE).min(n);
    let body = (n - head) / LINE * LINE;
    // SAFETY: as in `stream_avx2_to`, with 16-byte stores into line-aligned lines; SSE2 is
    // part of the x86_64 baseline.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
        let mut s = src.as_ptr().add(head) as *const __m128i;
        let mut d = dst.add(head) as *mut __m128i;
        for _ in 0..body / LINE {
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
        std::ptr::copy_nonoverlapping(src.as_ptr().add(head + body), dst.add(head + body), n - head - body);
    }
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
                    fence();
                    assert_eq!(&d2[off..off + len], &src[3..3 + len], "sse2 off {off} len {len}");
                }
            }
        }
    }

    #[test]
    fn extend_appends_exactly_at_every_alignment_and_size() {
        let src: Vec<u8> = (0..5000).map(|i| (i * 11 + 5) as u8).collect();
        for start in [0usize, 1, 63, 64, 100] {
            for len in [0usize, 1, 63, 64, 65, 1000, 4999] {
                let mut out: Vec<u8> = (0..start).map(|i| i as u8).collect();
                let mut batch = Batch::new();
                batch.extend(&mut out, &src[1..1 + len]);
                batch.extend(&mut out, &src[..3]);
                drop(batch);
                let mut want: Vec<u8> = (0..start).map(|i| i as u8).collect();
                want.extend_from_slice(&src[1..1 + len]);
                want.extend_from_slice(&src[..3]);
                assert_eq!(out, want, "start {start} len {len}");
            }
        }
    }

    #[test]
    fn rows_land_where_they_are_sent_streamed_or_not() {
        let src: Vec<u8> = (0..8192).map(|i| (i * 29 + 1) as u8).collect();
        let mut buf = vec![0u8; 8192 + 128];
        let base = buf.as_ptr().align_offset(64);
        // Reversed rows of 128 bytes; into a line-aligned destination (streamed), one 16
        // bytes past a line, and rows of 96 bytes (not whole lines).
        for (shift, unit) in [(0usize, 128usize), (16, 128), (0, 96)] {
            buf.fill(0);
            let n = 8192 / unit;
            let rows = (0..n).map(|i| (i * unit, (n - 1 - i) * unit));
            let dst = &mut buf[base + shift..base + shift + n * unit];
            Batch::new().copy_rows(dst, &src, rows, unit);
            for i in 0..n {
                assert_eq!(
                    &dst[(n - 1 - i) * unit..][..unit],
                    &src[i * unit..][..unit],
                    "shift {shift} unit {unit} row {i}"
                );
            }
        }
    }

    #[test]
    fn a_batch_copies_every_piece_exactly_short_or_long_at_any_alignment() {
        let src: Vec<u8> = (0..70_000).map(|i| (i * 13 + 5) as u8).collect();
        let mut dst = vec![0u8; src.len() + 64];
        let mut at = 0usize;
        {
            let mut batch = Batch::new();
            // Pieces below, at and above the streaming minimum, at odd destination offsets.
            for (i, len) in [1usize, 63, 64, 65, 200, 256, 4096, 33].iter().cycle().take(64).enumerate() {
                let gap = i % 3;
                batch.copy(&mut dst[at + gap..at + gap + len], &src[at..at + len]);
                at += len + gap;
            }
            assert_eq!(batch.streamed, cfg!(target_arch = "x86_64"));
        }
        let mut at = 0usize;
        for (i, len) in [1usize, 63, 64, 65, 200, 256, 4096, 33].iter().cycle().take(64).enumerate() {
            let gap = i % 3;
            assert_eq!(&dst[at + gap..at + gap + len], &src[at..at + len], "piece {i}");
            at += len + gap;
        }
    }
}
