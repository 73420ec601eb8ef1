//! The memcpy baseline of a copy that may use streaming stores (the shm pull's): the fastest
//! of glibc's copy (`copy_from_slice`) and the streaming-store copy the pull uses
//! (`kvconnect_support::stream_copy::copy_run`), each on one thread and on as many threads as
//! the pull copies the same bytes with. Each pair of a benchmark times every way once; the
//! way with the lowest median over the pairs is the baseline
//! (`kvconnect_support::stats::interleaved_fastest`).

use kvconnect_nixl::copy_plan::copy_threads_for;
use kvconnect_support::stream_copy::copy_run;
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

/// One way of the memcpy baseline: a copier on some threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Way {
    /// The copy.
    pub copier: Copier,
    /// The threads it runs on.
    pub threads: usize,
}

impl std::fmt::Display for Way {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let copier = match self.copier {
            Copier::Glibc => "glibc memcpy",
            Copier::Streaming => "streaming copy",
        };
        write!(f, "{copier} on {} thread{}", self.threads, if self.threads == 1 { "" } else { "s" })
    }
}

/// The ways of the memcpy baseline of `bytes` copied by a pull allowed `threads` copy
/// threads: glibc's copy and the streaming copy, each on one thread and on the threads such a
/// pull uses (`copy_threads_for`), in a fixed order.
pub fn memcpy_ways(bytes: usize, threads: usize) -> Vec<Way> {
    let many = copy_threads_for(bytes, threads);
    let counts = if many > 1 { vec![1, many] } else { vec![1] };
    [Copier::Glibc, Copier::Streaming]
        .into_iter()
        .flat_map(|copier| counts.iter().map(move |&threads| Way { copier, threads }))
        .collect()
}

/// One pair's baseline times: `src` copied into `dst` once by each of [`memcpy_ways`], in
/// its order, each way with its time (for `kvconnect_support::stats::interleaved_fastest`, which
/// takes the way with the lowest median as the baseline). Every way copies all the bytes, so
/// `dst` holds `src` afterwards.
pub fn time_memcpy_ways(dst: &mut [u8], src: &[u8], threads: usize) -> Vec<(Way, Duration)> {
    memcpy_ways(src.len(), threads)
        .into_iter()
        .map(|w| (w, timed_copy(dst, src, w.copier, w.threads)))
        .collect()
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
        let timed = time_memcpy_ways(&mut dst, &src, 2);
        assert_eq!(timed.iter().map(|(w, _)| *w).collect::<Vec<_>>(), memcpy_ways(src.len(), 2));
        assert!(timed.iter().all(|(_, t)| *t > Duration::ZERO));
        assert!(dst == src);
        let names: Vec<String> = timed.iter().map(|(w, _)| w.to_string()).collect();
        assert_eq!(
            names,
            [
                "glibc memcpy on 1 thread",
                "glibc memcpy on 2 threads",
                "streaming copy on 1 thread",
                "streaming copy on 2 threads"
            ]
        );
        assert_eq!(memcpy_ways(16, 8).len(), 2, "a copy too small to split runs on one thread only");
    }
}
