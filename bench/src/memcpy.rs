//! The memcpy baseline of a copy that may use streaming stores (the shm pull's): the fastest
//! of glibc's copy (`copy_from_slice`) and the streaming-store copy the pull uses
//! (`kvconnect_nixl::stream_copy::copy_run`), each on one thread and on as many threads as
//! the pull copies the same bytes with.

use kvconnect_nixl::copy_plan::copy_threads_for;
use kvconnect_nixl::stream_copy::copy_run;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Which copy a baseline run used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copier {
    /// `copy_from_slice` (glibc's memcpy).
    Glibc,
    /// `copy_run`: streaming stores for runs of at least `STREAM_THRESHOLD` bytes.
    Streaming,
}

/// The time of one copy of `src` into `dst` (same length) with `copier`, cut into `threads`
/// consecutive equal shares copied at once, one thread each (one: no thread started).
pub fn timed_copy(dst: &mut [u8], src: &[u8], copier: Copier, threads: usize) -> Duration {
    assert_eq!(dst.len(), src.len(), "timed_copy: the destination and the source differ in length");
    let copy = move |d: &mut [u8], s: &[u8]| match copier {
        Copier::Glibc => d.copy_from_slice(black_box(s)),
        Copier::Streaming => copy_run(d, black_box(s)),
    };
    let share = src.len().div_ceil(threads.max(1)).max(1);
    let t = Instant::now();
    if threads <= 1 {
        copy(dst, src);
    } else {
        std::thread::scope(|scope| {
            for (d, s) in dst.chunks_mut(share).zip(src.chunks(share)) {
                scope.spawn(move || copy(d, s));
            }
        });
    }
    let took = t.elapsed();
    black_box(dst);
    took
}

/// The best memcpy of `src` into `dst`: the fastest of glibc's copy and the streaming copy,
/// each on one thread and on the threads a pull allowed `threads` copies these bytes with
/// (`copy_threads_for`). Every run copies all the bytes, so `dst` holds `src` afterwards.
pub fn best_memcpy(dst: &mut [u8], src: &[u8], threads: usize) -> Duration {
    let many = copy_threads_for(src.len(), threads);
    let mut best = Duration::MAX;
    for copier in [Copier::Glibc, Copier::Streaming] {
        for t in if many > 1 { vec![1, many] } else { vec![1] } {
            best = best.min(timed_copy(dst, src, copier, t));
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_copier_and_thread_count_copies_every_byte() {
        let src: Vec<u8> = (0..(kvconnect_nixl::copy_plan::PARALLEL_MIN_BYTES * 2 + 77))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        for copier in [Copier::Glibc, Copier::Streaming] {
            for threads in [1, 2, 3] {
                let mut dst = vec![0u8; src.len()];
                timed_copy(&mut dst, &src, copier, threads);
                assert!(dst == src, "{copier:?} on {threads} threads");
            }
        }
        let mut dst = vec![0u8; src.len()];
        assert!(best_memcpy(&mut dst, &src, 2) > Duration::ZERO);
        assert!(dst == src);
    }
}
