//! The indexer and the router at the size of a deployment past one host, without the
//! workers: 256 prefill workers holding 10 million cached blocks in total, from generated
//! event traces.
//!
//! The trace: every worker caches prompts of 64 blocks of 16 tokens, each the 16-block
//! prefix of one of 1,000 shared documents (system prompts, few-shot examples) followed by
//! 48 blocks of its own, stored with their tokens in `BlockStored` events of 16 blocks (vLLM
//! publishes one per request and step, with the blocks that step filled), until the workers
//! hold 10 million blocks between them. Then a steady state: each batch stores a new prompt
//! on one worker, evicts an old one there, and moves another from the GPU to the CPU tier (a
//! removal, and a store naming the blocks by hash alone), so the index stays at its size.
//! Tokens are random words; the workers' own block hashes random 64-bit words (the indexer
//! re-hashes the tokens).
//!
//! Each figure is timed twice: on the wall clock, and on this thread's CPU clock
//! (`CLOCK_THREAD_CPUTIME_ID`), which counts only the time the thread ran on a core, so that
//! a figure "on one core" stays meaningful on a machine shared with other work (the wall
//! clock there includes the time the thread waited for a core).
//!
//! Figures, each over `ROUTER_BENCH_SAMPLES` samples (5 by default; median and quartiles):
//! - build: the 10 million stores applied to an empty indexer, in events per second and
//!   block operations per second, on one core;
//! - steady: the steady-state batches (stores, evictions, moves), the same units;
//! - steady, as published: the same work on other prompts, in events grouped as the
//!   publishers group them (a prompt's blocks in one `BlockStored`, as vLLM's block pool
//!   publishes a request's newly cached blocks; one `BlockRemoved` per evicted block, as vLLM
//!   publishes them; one event per block a tier stores by hash, as kvconnect's tiers do);
//! - floor: the memory traffic alone of the steady state, as a baseline in the same samples:
//!   per block operation one random 16-byte slot read and written in each of two tables of
//!   the index's size (the worker's hash map and the index each cost one slot per block), an
//!   event's 32 slots prefetched one event ahead as the indexer does, and nothing else: the
//!   steady state's rate over this one says how far the work besides the cache misses keeps
//!   it from what the memory allows;
//! - the resident memory the index took, per cached block and per distinct block;
//! - route: one routing decision (the request's hashes from its 1,280 prompt tokens, then
//!   `choose` over all 256 workers, with random loads) for requests that start with a cached
//!   prompt, each timed alone: p50 and p99.
//!
//! What the goal of 1 million events per second on one core counts: events as vLLM defines
//! them (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), each as its publisher emits it. A
//! store of a request's newly cached blocks is one event, however many blocks it carries, and
//! each evicted block is a `BlockRemoved` of its own (`tests/vllm/event_mix.py` counts vLLM's
//! own stream). So the figure that answers it is the steady state as published. Every phase is
//! also given in block operations (each block stored or removed once), and in events of 16
//! blocks, a stricter yardstick than the goal: such an event costs 16 block operations.
//!
//! Run: `cargo bench -p kvconnect-router --bench router`. Without `--bench` (as `cargo test`
//! runs it) it runs once at a tiny size and checks what the index answers.

// clock_gettime of the thread's CPU clock (libc), for figures on one core of a shared machine.
#![allow(unsafe_code)]

use kvconnect_router::chain::prefix_hashes;
use kvconnect_router::flat::prefetch_line;
use kvconnect_router::{
    choose, Candidate, Indexer, KvEvent, KvEventBatch, Medium, Outcome, Weights, WorkerId,
};
use kvconnect_support::stats::{bench_pairs, nearest_rank, Machine, Quartiles};
use std::hint::black_box;
use std::time::Instant;

/// A trace's shape.
struct Size {
    workers: usize,
    total_blocks: usize,
    documents: usize,
    samples: usize,
    decisions: usize,
    steady_batches: usize,
    /// One prompt in this many keeps its tokens for the routing sample.
    sample: usize,
}

const PREFIX: usize = 16;
const OWN: usize = 48;
const PER_EVENT: usize = 16;

impl Size {
    fn from_args() -> Size {
        match bench_pairs("ROUTER_BENCH_SAMPLES", 5) {
            None => Size {
                workers: 8,
                total_blocks: 8 * 64 * 20,
                documents: 10,
                samples: 1,
                decisions: 200,
                steady_batches: 16,
                sample: 4,
            },
            Some(samples) => Size {
                workers: 256,
                total_blocks: 10_000_000,
                documents: 1000,
                samples,
                decisions: 100_000,
                steady_batches: 20_000,
                sample: 64,
            },
        }
    }
}

/// splitmix64: the trace's random words.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Tokens per block: the engine's block size, and the router's unit.
const BS: usize = 16;

/// One cached prompt: its worker, its blocks' hashes as the worker names them, and its
/// tokens (kept for the routing sample only).
struct Prompt {
    worker: WorkerId,
    ext: Vec<u64>,
    tokens: Vec<u32>,
}

fn prompt(rng: &mut Rng, documents: &[Vec<u32>], worker: WorkerId) -> Prompt {
    let mut tokens = documents[rng.below(documents.len())].clone();
    tokens.extend((0..OWN * BS).map(|_| rng.next() as u32));
    Prompt { worker, ext: (0..PREFIX + OWN).map(|_| rng.next()).collect(), tokens }
}

/// How a trace groups blocks into events.
#[derive(Clone, Copy)]
enum Shape {
    /// Every event `PER_EVENT` blocks.
    Sixteen,
    /// As the publishers group them: a prompt's blocks stored in one `BlockStored` (vLLM's
    /// block pool publishes a request's newly cached blocks together), each removal its own
    /// `BlockRemoved` (vLLM publishes one per evicted block), and each block a tier stores
    /// by its hash alone its own event (kvconnect's tiers publish per block or chunk).
    Published,
}

impl Shape {
    /// Blocks per event of a store with tokens, and of the others.
    fn per_event(self, with_tokens: bool) -> usize {
        match (self, with_tokens) {
            (Shape::Sixteen, _) => PER_EVENT,
            (Shape::Published, true) => PREFIX + OWN,
            (Shape::Published, false) => 1,
        }
    }
}

/// A prompt's blocks as `BlockStored` events with their tokens.
fn stores(p: &Prompt, medium: Medium, shape: Shape) -> Vec<KvEvent> {
    let per = shape.per_event(true);
    (0..p.ext.len())
        .step_by(per)
        .map(|b| {
            let parent = b.checked_sub(1).map(|j| p.ext[j]);
            let tokens = p.tokens[b * BS..(b + per) * BS].to_vec();
            KvEvent::stored(p.ext[b..b + per].to_vec(), parent, tokens, BS as u32, medium.clone())
        })
        .collect()
}

/// A move's store: the blocks named by their hashes alone.
fn stores_by_hash(p: &Prompt, medium: Medium, shape: Shape) -> Vec<KvEvent> {
    p.ext
        .chunks(shape.per_event(false))
        .map(|c| KvEvent::stored(c.to_vec(), None, Vec::new(), 0, medium.clone()))
        .collect()
}

fn removals(p: &Prompt, medium: Medium, shape: Shape) -> Vec<KvEvent> {
    p.ext.chunks(shape.per_event(false)).map(|c| KvEvent::removed(c.to_vec(), medium.clone())).collect()
}

/// A worker's batch with its sequence number.
type Numbered = (WorkerId, u64, KvEventBatch);

fn batch(events: Vec<KvEvent>) -> KvEventBatch {
    KvEventBatch { ts: 0.0, events, data_parallel_rank: None }
}

/// The trace: the build's batches per worker, and the steady state's, twice: in events of 16
/// blocks, then (on other prompts) the same work in events as the publishers group them; the
/// prompts (tokens kept for one in `Size::sample`, drawn at random, for the routing sample).
struct Trace {
    prompts: Vec<Prompt>,
    build: Vec<Numbered>,
    steady: Vec<Numbered>,
    published: Vec<Numbered>,
    build_blocks: usize,
    steady_blocks: usize,
    published_blocks: usize,
}

fn trace(size: &Size) -> Trace {
    let mut rng = Rng(7);
    let documents: Vec<Vec<u32>> =
        (0..size.documents).map(|_| (0..PREFIX * BS).map(|_| rng.next() as u32).collect()).collect();
    let per_worker = size.total_blocks / size.workers / (PREFIX + OWN);
    let mut seq = vec![0u64; size.workers];
    let mut prompts = Vec::new();
    let mut build = Vec::new();
    for _ in 0..per_worker {
        for w in 0..size.workers as WorkerId {
            let mut p = prompt(&mut rng, &documents, w);
            build.push((w, seq[usize::from(w)], batch(stores(&p, Medium::Gpu, Shape::Sixteen))));
            seq[usize::from(w)] += 1;
            if rng.below(size.sample) != 0 {
                p.tokens = Vec::new();
            }
            prompts.push(p);
        }
    }
    let build_blocks = prompts.len() * (PREFIX + OWN);
    let mut next = vec![0usize; size.workers];
    let mut run = |shape| steady_state(size, &prompts, &documents, (&mut rng, &mut next, &mut seq), shape);
    let (steady, steady_blocks) = run(Shape::Sixteen);
    let (published, published_blocks) = run(Shape::Published);
    Trace { prompts, build, steady, published, build_blocks, steady_blocks, published_blocks }
}

/// Steady state: on one worker, store a new prompt, evict its oldest, move one from the
/// GPU to the CPU tier (a removal, and a store by hash alone). Evicted and moved prompts
/// are the build's, in order (from where `next` says, per worker), none sampled for routing,
/// so each is touched once. Returns the batches and their block operations.
fn steady_state(
    size: &Size,
    prompts: &[Prompt],
    documents: &[Vec<u32>],
    (rng, next, seq): (&mut Rng, &mut [usize], &mut [u64]),
    shape: Shape,
) -> (Vec<Numbered>, usize) {
    let mut steady = Vec::new();
    let mut blocks = 0;
    let at = |k: usize, w: WorkerId| k * size.workers + usize::from(w);
    for i in 0..size.steady_batches {
        let w = (i % size.workers) as WorkerId;
        let mut pick = || loop {
            let k = next[usize::from(w)];
            next[usize::from(w)] += 1;
            match prompts.get(at(k, w)) {
                Some(p) if !p.tokens.is_empty() => continue,
                other => break other,
            }
        };
        let (Some(evicted), Some(moved)) = (pick(), pick()) else { continue };
        let p = prompt(rng, documents, w);
        let mut events = stores(&p, Medium::Gpu, shape);
        events.extend(removals(evicted, Medium::Gpu, shape));
        events.extend(removals(moved, Medium::Gpu, shape));
        events.extend(stores_by_hash(moved, Medium::CpuTier, shape));
        blocks += 4 * (PREFIX + OWN);
        steady.push((w, seq[usize::from(w)], batch(events)));
        seq[usize::from(w)] += 1;
    }
    (steady, blocks)
}

fn apply_all(ix: &mut Indexer, batches: &[Numbered]) {
    for (w, seq, b) in batches {
        let o = ix.apply(*w, *seq, b, false);
        debug_assert_eq!(o, Outcome::Applied);
        black_box(o);
    }
}

fn events(batches: &[Numbered]) -> usize {
    batches.iter().map(|(_, _, b)| b.events.len()).sum()
}

/// Seconds on this thread's CPU clock (NaN where it cannot be read).
fn cpu_now() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into `ts`, which is valid and owned here.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if r != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Wall and CPU seconds of `f`.
fn timed(f: impl FnOnce()) -> (f64, f64) {
    let (t0, c0) = (Instant::now(), cpu_now());
    f();
    (t0.elapsed().as_secs_f64(), cpu_now() - c0)
}

/// Resident memory of this process, in bytes (None where /proc is missing).
fn rss() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn rate(n: usize, secs: &[f64]) -> Quartiles {
    Quartiles::of(secs.iter().map(|s| n as f64 / s).collect())
}

fn main() {
    let size = Size::from_args();
    let bench = size.samples > 1 || size.workers > 8;
    let t = trace(&size);
    let m = Machine::start();
    let (mut build_s, mut steady_s, mut floor_s, mut floor_cpu) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut floor = Floor::new(t.build_blocks, t.steady_blocks);
    let (mut build_cpu, mut steady_cpu, mut decide, mut decide_cpu) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut published_s, mut published_cpu) = (Vec::new(), Vec::new());
    let mut memory = None;
    assert!(!t.steady.is_empty() && !t.published.is_empty(), "the build has prompts left for both");
    for sample in 0..size.samples {
        let before = rss();
        let mut ix = Indexer::new(size.workers, BS as u32).expect("256 workers fit the index");
        let (wall, cpu) = timed(|| apply_all(&mut ix, &t.build));
        build_s.push(wall);
        build_cpu.push(cpu);
        let held: u64 = (0..size.workers as WorkerId).map(|w| ix.index().held(w)).sum();
        if sample == 0 {
            memory =
                before.zip(rss()).map(|(b, a)| (a.saturating_sub(b), held, ix.index().distinct_blocks()));
        }
        // Every worker holds exactly its prompts' blocks (a document's prefix counts once per
        // worker, however many of its prompts start with it).
        assert!(held as usize <= t.build_blocks && held as usize >= t.build_blocks * 3 / 4, "{held}");
        check_routes(&ix, &t, &size, (&mut decide, &mut decide_cpu), sample == 0);
        let (wall, cpu) = timed(|| apply_all(&mut ix, &t.steady));
        steady_s.push(wall);
        steady_cpu.push(cpu);
        let (wall, cpu) = timed(|| apply_all(&mut ix, &t.published));
        published_s.push(wall);
        published_cpu.push(cpu);
        assert_eq!(ix.counts().dropped, [0; 5]);
        assert_eq!(ix.counts().unindexed_blocks, 0);
        drop(ix);
        let (wall, cpu) = timed(|| floor.run());
        floor_s.push(wall);
        floor_cpu.push(cpu);
    }
    let m = m.finish();
    let (be, se, pe) = (events(&t.build), events(&t.steady), events(&t.published));
    let [p50, p99] = nearest_rank(decide.clone(), [0.50, 0.99]);
    let [c50, c99] = nearest_rank(decide_cpu.clone(), [0.50, 0.99]);
    let q =
        |x: Quartiles, unit: f64| format!("{:.2} [{:.2}, {:.2}]", x.median / unit, x.q1 / unit, x.q3 / unit);
    println!(
        "router: {} workers, {} blocks stored in {} events ({} batches); {} samples; {m}",
        size.workers,
        t.build_blocks,
        be,
        t.build.len(),
        size.samples
    );
    let per = |n: usize, cpu: &[f64], wall: &[f64]| {
        format!("{} M per CPU second (wall clock {} M/s)", q(rate(n, cpu), 1e6), q(rate(n, wall), 1e6))
    };
    println!(
        "  build:  events {}; block ops {} (median [q1, q3])",
        per(be, &build_cpu, &build_s),
        per(t.build_blocks, &build_cpu, &build_s)
    );
    println!(
        "  steady: events {}; block ops {} ({} batches of stores, evictions and moves)",
        per(se, &steady_cpu, &steady_s),
        per(t.steady_blocks, &steady_cpu, &steady_s),
        t.steady.len()
    );
    println!(
        "  steady, as published: events {}; block ops {} ({} batches: the same work in events as \
         the publishers group them, {:.1} blocks per event)",
        per(pe, &published_cpu, &published_s),
        per(t.published_blocks, &published_cpu, &published_s),
        t.published.len(),
        t.published_blocks as f64 / pe as f64
    );
    let ratios: Vec<f64> = steady_cpu.iter().zip(&floor_cpu).map(|(s, f)| f / s).collect();
    println!(
        "  floor:  block ops {} (memory traffic alone); steady over floor {} per sample",
        per(t.steady_blocks, &floor_cpu, &floor_s),
        q(Quartiles::of(ratios), 1.0)
    );
    if let Some((bytes, held, distinct)) = memory {
        println!(
            "  memory: {:.0} MiB resident for {held} cached blocks ({distinct} distinct): {:.1} bytes per \
             cached block, {:.1} per distinct block",
            bytes as f64 / (1 << 20) as f64,
            bytes as f64 / held as f64,
            bytes as f64 / distinct as f64
        );
    }
    println!(
        "  route:  CPU clock p50 {:.1} µs, p99 {:.1} µs; wall clock p50 {:.1} µs, p99 \
         {:.1} µs; {} decisions ({} per sample)",
        c50 * 1e6,
        c99 * 1e6,
        p50 * 1e6,
        p99 * 1e6,
        decide.len(),
        size.decisions
    );
    if bench {
        let met = |ok: bool| if ok { "met" } else { "NOT met" };
        let median = |n: usize, cpu: &[f64]| rate(n, cpu).median;
        let published = median(pe, &published_cpu);
        let blocks = median(t.build_blocks, &build_cpu).min(median(t.steady_blocks, &steady_cpu));
        println!(
            "  goals (one core, CPU clock): >= 1 M events/s as the publishers emit them, steady state: {} \
             ({:.2} M); >= 1 M block operations/s, building and steady: {} ({:.2} M at the slower); route \
             p99 < 100 µs: {} (wall clock: {}); not a goal, events of {PER_EVENT} blocks: {:.2} M building, \
             {:.2} M steady",
            met(published >= 1e6),
            published / 1e6,
            met(blocks >= 1e6),
            blocks / 1e6,
            met(c99 < 100e-6),
            met(p99 < 100e-6),
            median(be, &build_cpu) / 1e6,
            median(se, &steady_cpu) / 1e6
        );
    }
}

/// The steady state's memory traffic alone (see the module note): two tables of 16-byte slots
/// the size of the index's (a power of two at most 3/4 full, as `flat` keeps it), and the
/// random slots each block operation touches, drawn in advance.
struct Floor {
    tables: [Vec<[u64; 2]>; 2],
    slots: Vec<u32>,
}

impl Floor {
    fn new(blocks: usize, steady_blocks: usize) -> Floor {
        let n = (blocks * 4 / 3).next_power_of_two();
        let table = || {
            let mut t = vec![[0u64; 2]; n];
            kvconnect_support::host_buffer::advise_huge_pages(&mut t);
            for s in t.iter_mut() {
                *s = [1, 0];
            }
            t
        };
        let mut rng = Rng(13);
        let slots = (0..steady_blocks * 2).map(|_| rng.below(n) as u32).collect();
        Floor { tables: [table(), table()], slots }
    }

    /// Every block operation's two slots, an event's prefetched one event ahead.
    fn run(&mut self) {
        let per = 2 * PER_EVENT;
        let mut sum = 0u64;
        for (i, e) in self.slots.chunks(per).enumerate() {
            if let Some(next) = self.slots.get((i + 1) * per..(i + 2) * per) {
                for (k, s) in next.iter().enumerate() {
                    prefetch_line(&self.tables[k & 1][*s as usize]);
                }
            }
            for (k, s) in e.iter().enumerate() {
                let slot = &mut self.tables[k & 1][*s as usize];
                sum = sum.wrapping_add(slot[0]);
                slot[1] += 1;
            }
        }
        black_box(sum);
    }
}

/// Routes requests that start with a cached prompt (and go on past it), each decision timed
/// alone, and checks that the worker holding the prompt is chosen while it is idle.
fn check_routes(ix: &Indexer, t: &Trace, size: &Size, times: (&mut Vec<f64>, &mut Vec<f64>), check: bool) {
    let mut rng = Rng(11);
    let w = Weights::default();
    let mut scratch = Vec::new();
    let mut candidates: Vec<Candidate> =
        (0..size.workers as WorkerId).map(|worker| Candidate { worker, in_flight: 0 }).collect();
    let sampled: Vec<&Prompt> = t.prompts.iter().filter(|p| !p.tokens.is_empty()).collect();
    let mut tokens = Vec::with_capacity((PREFIX + OWN + 16) * BS);
    for turn in 0..size.decisions {
        let p = sampled[rng.below(sampled.len())];
        tokens.clear();
        tokens.extend_from_slice(&p.tokens);
        tokens.extend((0..16 * BS).map(|_| rng.next() as u32));
        for c in candidates.iter_mut() {
            c.in_flight = (rng.next() % 3) as u32;
        }
        candidates[usize::from(p.worker)].in_flight = 0;
        let mut c = None;
        // The whole decision: the prompt's hashes, then the choice.
        let (wall, cpu) = timed(|| {
            let chain = prefix_hashes(&tokens, BS);
            c = choose(ix, &w, &chain, &candidates, turn, &mut scratch);
        });
        times.0.push(wall);
        times.1.push(cpu);
        let c = c.expect("candidates were given");
        if check {
            assert_eq!(c.worker, p.worker, "the idle worker holding the whole prompt is chosen");
            assert_eq!(c.predicted_blocks as usize, p.ext.len());
        }
    }
}
