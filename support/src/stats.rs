//! The summary every benchmark reports: quartiles of a series, such as the per-pair ratios of
//! interleaved baseline/subject runs ([`interleaved`]), and the machine it ran on
//! ([`Machine`]: cores, load average before and after).

use serde::Serialize;
use std::time::Instant;

/// The quartiles of a series (nearest rank).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Quartiles {
    /// 25th percentile.
    pub q1: f64,
    /// Median.
    pub median: f64,
    /// 75th percentile.
    pub q3: f64,
}

impl Quartiles {
    /// Nearest-rank quartiles; zeros for an empty series.
    pub fn of(v: Vec<f64>) -> Quartiles {
        let [q1, median, q3] = nearest_rank(v, [0.25, 0.50, 0.75]);
        Quartiles { q1, median, q3 }
    }
}

/// The nearest-rank quantiles `qs` of `v`; zeros for an empty series.
pub fn nearest_rank<const N: usize>(mut v: Vec<f64>, qs: [f64; N]) -> [f64; N] {
    if v.is_empty() {
        return [0.0; N];
    }
    v.sort_by(f64::total_cmp);
    qs.map(|q| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1])
}

/// What `pairs` interleaved runs of a baseline and a subject gave: the per-pair ratio
/// baseline time / subject time (above 1: the subject is faster) and each side's times in
/// seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Paired {
    /// Pairs measured (warm-ups not counted).
    pub pairs: usize,
    /// Baseline time / subject time, per pair.
    pub ratio: Quartiles,
    /// The baseline's times (seconds).
    pub baseline_s: Quartiles,
    /// The subject's times (seconds).
    pub subject_s: Quartiles,
}

/// Runs `warmup` unmeasured rounds of both, then `pairs` pairs of a baseline and a subject,
/// alternating which runs first within a pair (baseline first in even pairs), so neither always
/// meets a warmer or a quieter machine. Each closure returns how long its run took (seconds),
/// so a caller can time only the part that matters, or time on a device's clock; the first
/// error ends the run.
pub fn interleaved<E>(
    pairs: usize,
    warmup: usize,
    mut baseline: impl FnMut() -> Result<f64, E>,
    subject: impl FnMut() -> Result<f64, E>,
) -> Result<Paired, E> {
    Ok(interleaved_fastest(pairs, warmup, || Ok(vec![baseline()?]), subject)?.0)
}

/// [`interleaved`] against the fastest of several baselines (ways of doing the same work,
/// such as glibc's memcpy and a streaming copy, on one thread and on several): in each pair
/// the baseline closure runs every way once and returns their times, in a fixed order. The
/// figure's baseline is the way with the lowest median time over the pairs, returned with
/// the pairs by its index; each pair's ratio is that way's time in the pair over the
/// subject's. (The fastest way of each pair instead would set the minimum of several noisy
/// draws against the subject's single draw, and on a noisy machine rate a subject exactly as
/// fast as the best way below 1.) A baseline that returns no time, or a different number of
/// times than the first pair, is a bug in the benchmark and panics.
pub fn interleaved_fastest<E>(
    pairs: usize,
    warmup: usize,
    mut baseline: impl FnMut() -> Result<Vec<f64>, E>,
    mut subject: impl FnMut() -> Result<f64, E>,
) -> Result<(Paired, usize), E> {
    for _ in 0..warmup {
        baseline()?;
        subject()?;
    }
    let (mut base, mut subj): (Vec<Vec<f64>>, Vec<f64>) = (Vec::new(), Vec::new());
    for i in 0..pairs.max(1) {
        let (b, s) = if i % 2 == 0 {
            let b = baseline()?;
            (b, subject()?)
        } else {
            let s = subject()?;
            (baseline()?, s)
        };
        base.push(b);
        subj.push(s);
    }
    Ok(paired_fastest(&base, &subj))
}

/// The figure of measured pairs: `base[i]` holds pair `i`'s baseline time by each way (the
/// same ways in every pair), `subject[i]` its subject's time (seconds). The baseline is the
/// way with the lowest median time, returned by its index (see [`interleaved_fastest`]).
/// Pairs with no baseline time are bugs in the benchmark and panic.
pub fn paired_fastest(base: &[Vec<f64>], subject: &[f64]) -> (Paired, usize) {
    assert!(
        base.len() == subject.len() && base.iter().all(|b| !b.is_empty() && b.len() == base[0].len()),
        "paired_fastest: every pair's baseline must time the same ways, at least one"
    );
    let way_median = |w: usize| Quartiles::of(base.iter().map(|b| b[w]).collect()).median;
    let ways = base.first().map_or(1, Vec::len);
    let fastest = (0..ways).min_by(|a, b| way_median(*a).total_cmp(&way_median(*b))).unwrap_or(0);
    let chosen: Vec<f64> = base.iter().map(|b| b[fastest]).collect();
    let ratios = chosen.iter().zip(subject).map(|(b, s)| b / s.max(f64::MIN_POSITIVE)).collect();
    let paired = Paired {
        pairs: subject.len(),
        ratio: Quartiles::of(ratios),
        baseline_s: Quartiles::of(chosen),
        subject_s: Quartiles::of(subject.to_vec()),
    };
    (paired, fastest)
}

/// [`interleaved`] against a baseline that times itself, the subject timed whole on the wall
/// clock; neither can fail.
pub fn interleaved_against(
    pairs: usize,
    warmup: usize,
    mut baseline: impl FnMut() -> f64,
    subject: impl FnMut(),
) -> Paired {
    interleaved_against_fastest(pairs, warmup, || vec![baseline()], subject).0
}

/// [`interleaved_fastest`] for a baseline that times its ways itself (such as
/// [`memcpy_of_pieces`]) and a subject timed whole on the wall clock; neither can fail.
pub fn interleaved_against_fastest(
    pairs: usize,
    warmup: usize,
    mut baseline: impl FnMut() -> Vec<f64>,
    mut subject: impl FnMut(),
) -> (Paired, usize) {
    let r = interleaved_fastest::<std::convert::Infallible>(
        pairs,
        warmup,
        || Ok(baseline()),
        || Ok(seconds(&mut subject)),
    );
    match r {
        Ok(p) => p,
        Err(never) => match never {},
    }
}

/// [`interleaved`] for closures that cannot fail, each timed whole on the wall clock.
pub fn interleaved_timed(
    pairs: usize,
    warmup: usize,
    mut baseline: impl FnMut(),
    subject: impl FnMut(),
) -> Paired {
    interleaved_against(pairs, warmup, || seconds(&mut baseline), subject)
}

impl Paired {
    /// One line for a report: the median ratio with its quartiles and pairs, and each
    /// side's median time (and rate, given the bytes each run moved).
    pub fn summary(&self, bytes: Option<usize>) -> String {
        let side = |q: &Quartiles| match bytes {
            Some(b) => format!("{:.3} ms = {:.2} GB/s", q.median * 1e3, b as f64 / q.median.max(1e-12) / 1e9),
            None => format!("{:.3} ms", q.median * 1e3),
        };
        format!(
            "{:.3}x the baseline's throughput (median of {} interleaved pairs, quartiles {:.3} .. {:.3}; \
                subject {}, baseline {})",
            self.ratio.median,
            self.pairs,
            self.ratio.q1,
            self.ratio.q3,
            side(&self.subject_s),
            side(&self.baseline_s)
        )
    }

    /// [`Paired::summary`] for runs of `n` repetitions each (calls, steps: `what`, singular):
    /// each side's median time per repetition in microseconds.
    pub fn summary_per(&self, n: usize, what: &str) -> String {
        let us = |q: &Quartiles| q.median / n.max(1) as f64 * 1e6;
        format!(
            "{:.3}x the baseline's throughput (median of {} interleaved pairs of {n} {what}s, quartiles \
                {:.3} .. {:.3}; subject {:.3} us, baseline {:.3} us per {what})",
            self.ratio.median,
            self.pairs,
            self.ratio.q1,
            self.ratio.q3,
            us(&self.subject_s),
            us(&self.baseline_s)
        )
    }

    /// Whether the median ratio reaches `goal`: `met`, `missed`, or, from a single pair (a
    /// run that only checks the code works), no verdict.
    pub fn verdict(&self, goal: f64) -> &'static str {
        verdict(self.pairs, self.ratio.median >= goal)
    }
}

/// `met` or `missed`, or no verdict from a single sample or pair.
pub fn verdict(samples: usize, met: bool) -> &'static str {
    match (samples, met) {
        (0 | 1, _) => "one sample, a test run: no verdict",
        (_, true) => "met",
        (_, false) => "missed",
    }
}

/// Seconds `f` took to run.
pub fn seconds(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// The ways of the baseline of a single-threaded copy of many pieces that may stream (a
/// cache tier's blocks), for [`interleaved_against_fastest`]: the seconds of glibc's memcpy
/// and of streaming stores ([`crate::stream_copy::Batch`]) over the same pieces, in
/// the order of [`PIECE_COPIERS`]. `copy_all` calls the copier it is given once for each
/// (destination, source) piece. (A whole transfer's baseline, on threads, is
/// `kvconnect_bench::memcpy::memcpy_ways`.)
pub fn memcpy_of_pieces(mut copy_all: impl FnMut(&mut dyn FnMut(&mut [u8], &[u8]))) -> Vec<f64> {
    let glibc = seconds(|| copy_all(&mut |d, s| d.copy_from_slice(s)));
    let streamed = seconds(|| {
        let mut batch = crate::stream_copy::Batch::new();
        copy_all(&mut |d, s| batch.copy(d, s));
    });
    vec![glibc, streamed]
}

/// The names of [`memcpy_of_pieces`]'s ways, by index.
pub const PIECE_COPIERS: [&str; 2] = ["glibc memcpy", "streaming stores"];

/// The quartiles of the time of one call of `f` (seconds), over `samples` samples of
/// `iters` calls each, after one unmeasured call.
pub fn per_call(samples: usize, iters: usize, mut f: impl FnMut()) -> Quartiles {
    f();
    let iters = iters.max(1);
    Quartiles::of(
        (0..samples.max(1)).map(|_| seconds(|| (0..iters).for_each(|_| f())) / iters as f64).collect(),
    )
}

/// A measurement's pairs, or None for a test run: `cargo bench` starts a benchmark binary
/// with `--bench` among its arguments, `cargo test` without it (and `-- --test` asks for a
/// test run), which runs every part once at a tiny size, checking its results. The pairs are
/// the variable `pairs_var`'s value, `default` (21 in most benchmarks) where it is unset or
/// not a number.
pub fn bench_pairs(pairs_var: &str, default: usize) -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--bench") || args.iter().any(|a| a == "--test") {
        return None;
    }
    Some(std::env::var(pairs_var).ok().and_then(|p| p.parse().ok()).unwrap_or(default))
}

/// Whether a bench runs its part `part`: every part when the command line names none
/// (`cargo bench --bench B`), else only the parts named (`cargo bench --bench B -- lookup`).
/// Flags (`--bench`, `--test`, ...) are not part names.
pub fn bench_part(part: &str) -> bool {
    part_named(std::env::args().skip(1), part)
}

/// [`bench_part`] over given arguments (the program's name left out).
fn part_named(args: impl IntoIterator<Item = String>, part: &str) -> bool {
    let named: Vec<String> = args.into_iter().filter(|a| !a.starts_with('-')).collect();
    named.is_empty() || named.iter().any(|a| a == part)
}

/// What a figure was measured on: the cores this process may use and the 1-minute load
/// average when the measurement began and when it ended (None where /proc/loadavg is
/// missing).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Machine {
    /// Cores available to this process.
    pub cores: usize,
    /// Load average when the measurement began.
    pub load_average_before: Option<f64>,
    /// Load average when it ended (None until [`Machine::finish`]).
    pub load_average_after: Option<f64>,
}

impl Machine {
    /// The machine now, before a measurement.
    pub fn start() -> Machine {
        Machine {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            load_average_before: load_average(),
            load_average_after: None,
        }
    }

    /// Records the load average after the measurement.
    pub fn finish(mut self) -> Machine {
        self.load_average_after = load_average();
        self
    }
}

impl std::fmt::Display for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let load = |l: Option<f64>| l.map_or_else(|| "unknown".to_owned(), |l| format!("{l:.2}"));
        write!(f, "{} cores, load average {}", self.cores, load(self.load_average_before))?;
        match self.load_average_after {
            Some(after) => write!(f, " before, {after:.2} after"),
            None => Ok(()),
        }
    }
}

/// The 1-minute load average, from /proc/loadavg (None where there is none).
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_parts_are_all_unless_some_are_named() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(part_named(args(&["--bench"]), "lookup"), "none named: every part");
        assert!(part_named(args(&[]), "lookup"));
        assert!(part_named(args(&["lookup", "--bench"]), "lookup"));
        assert!(!part_named(args(&["lookup", "--bench"]), "disk_tier"));
        assert!(part_named(args(&["cpu_tier", "disk_tier", "--bench"]), "disk_tier"));
    }

    #[test]
    fn pairs_alternate_their_order_and_report_the_ratio_of_each() {
        let order = std::cell::RefCell::new(Vec::new());
        let mut b_times = [2.0, 2.0, 4.0].into_iter();
        let mut s_times = [1.0, 4.0, 1.0].into_iter();
        let p = interleaved::<()>(
            3,
            0,
            || {
                order.borrow_mut().push('b');
                Ok(b_times.next().unwrap())
            },
            || {
                order.borrow_mut().push('s');
                Ok(s_times.next().unwrap())
            },
        )
        .unwrap();
        assert_eq!(order.into_inner(), vec!['b', 's', 's', 'b', 'b', 's']);
        assert_eq!(p.pairs, 3);
        assert_eq!(p.ratio, Quartiles { q1: 0.5, median: 2.0, q3: 4.0 });
        assert_eq!(p.baseline_s.median, 2.0);
        let e = interleaved(5, 1, || Ok(1.0), || Err("subject failed"));
        assert_eq!(e, Err("subject failed"));
    }

    #[test]
    fn the_fastest_baseline_is_the_way_with_the_lowest_median_not_each_pairs_minimum() {
        // Way 0 is fastest at the median, though way 1 wins two pairs by noise.
        let mut ways =
            [vec![2.0, 5.0], vec![2.0, 1.0], vec![2.0, 1.0], vec![2.0, 3.0], vec![2.0, 4.0]].into_iter();
        let (p, fastest) = interleaved_fastest::<()>(5, 0, || Ok(ways.next().unwrap()), || Ok(2.0)).unwrap();
        assert_eq!(fastest, 0);
        assert_eq!(p.ratio.median, 1.0, "the per-pair minimum would give 0.5 in two pairs");
        assert_eq!(p.baseline_s.median, 2.0);
        let mut ways = [vec![3.0, 1.0], vec![3.0, 2.0], vec![3.0, 1.0]].into_iter();
        let (p, fastest) = interleaved_fastest::<()>(3, 0, || Ok(ways.next().unwrap()), || Ok(1.0)).unwrap();
        assert_eq!((fastest, p.ratio.median), (1, 1.0));
        let e = interleaved_fastest(3, 0, || Ok(vec![1.0]), || Err("subject failed"));
        assert_eq!(e, Err("subject failed"));
    }

    #[test]
    fn the_machine_names_its_cores_and_load() {
        let m = Machine::start().finish();
        assert!(m.cores >= 1);
        if std::path::Path::new("/proc/loadavg").exists() {
            assert!(m.load_average_before.is_some() && m.load_average_after.is_some());
        }
        assert!(m.to_string().contains(&format!("{} cores", m.cores)));
    }

    #[test]
    fn a_test_binary_is_a_test_run_and_per_call_times_divide_by_the_calls() {
        // The test harness is not started with `--bench`.
        assert_eq!(bench_pairs("KVCONNECT_STATS_TEST_PAIRS", 21), None);
        let p = Paired {
            pairs: 3,
            ratio: Quartiles { q1: 0.5, median: 0.5, q3: 0.5 },
            baseline_s: Quartiles { q1: 1e-3, median: 1e-3, q3: 1e-3 },
            subject_s: Quartiles { q1: 2e-3, median: 2e-3, q3: 2e-3 },
        };
        let s = p.summary_per(1000, "call");
        assert!(
            s.contains("of 1000 calls") && s.contains("subject 2.000 us, baseline 1.000 us per call"),
            "{s}"
        );
    }

    #[test]
    fn nearest_rank_quartiles() {
        let q = Quartiles::of(vec![5.0, 1.0, 4.0, 2.0, 3.0]);
        assert_eq!(q, Quartiles { q1: 2.0, median: 3.0, q3: 4.0 });
        assert_eq!(Quartiles::of(vec![]), Quartiles::default());
        assert_eq!(Quartiles::of(vec![7.0]), Quartiles { q1: 7.0, median: 7.0, q3: 7.0 });
    }
}
