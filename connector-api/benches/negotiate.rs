//! Cost of negotiation and of the compat descriptor, for a 3-child composite (lmcache-,
//! flexkv- and nixl-like capabilities) on an 80-layer hybrid model, each against a baseline
//! measured in the same run: serialising the finished descriptor to JSON. Interleaved pairs
//! (`kvconnect_support::stats::interleaved`: the order alternates within a pair), each run a
//! fixed number of calls on one thread on both sides; the figure is the median ratio
//! baseline time / subject time with its quartiles, with the machine's cores and load
//! average before and after. Every call's result is checked.
//!
//! Run: `cargo bench -p kvconnect-api --bench negotiate` (`NEGOTIATE_BENCH_PAIRS` sets the
//! pairs, 21 by default). Without `--bench` (as `cargo test` runs it) every figure runs one
//! pair of a few calls.

#[path = "../tests/support/children.rs"]
mod children;

use kvconnect_api::{
    negotiate, negotiate_deployment, AttentionKind, ChildCaps, CompatDescriptor, Dtype, EngineOptions,
    ModelSpec,
};
use kvconnect_support::stats::{bench_pairs, interleaved_timed, verdict, Machine};
use std::hint::black_box;

/// The sizes of one run: the benchmark's, or the tiny one of a test run.
struct Size {
    pairs: usize,
    warmup: usize,
    /// Calls per timed run, on either side.
    calls: usize,
}

impl Size {
    fn from_args() -> Size {
        match bench_pairs("NEGOTIATE_BENCH_PAIRS", 21) {
            None => Size { pairs: 1, warmup: 0, calls: 2 },
            Some(pairs) => Size { pairs, warmup: 2, calls: 1000 },
        }
    }
}

fn children() -> Vec<ChildCaps> {
    let mut lmcache = children::lmcache(256);
    lmcache.caps.mla = false;
    vec![lmcache, children::flexkv(), children::nixl()]
}

/// 80 layers: three sliding-window (4096) layers, then one full-attention layer.
fn model() -> ModelSpec {
    let layers = (0..80)
        .map(|i| if i % 4 == 3 { AttentionKind::Full } else { AttentionKind::SlidingWindow { window: 4096 } })
        .collect();
    ModelSpec {
        name: "hybrid-80".into(),
        num_layers: 80,
        num_kv_heads: 8,
        head_dim: 128,
        dtype: Some(Dtype::Bf16),
        layers,
        state: None,
    }
}

fn negotiate_and_hash(m: &ModelSpec, o: &EngineOptions, c: &[ChildCaps]) -> String {
    let n = negotiate(m, o, c).expect("the benchmark's children negotiate a layout");
    CompatDescriptor::new(m, &n, o).compat_hash()
}

/// One figure: `subject` against the JSON baseline, per call, in interleaved pairs; with a
/// goal on the subject's time per call where one is given.
fn figure(
    size: &Size,
    name: &str,
    goal_us: Option<f64>,
    baseline: &mut dyn FnMut(),
    subject: &mut dyn FnMut(),
) {
    let calls = size.calls;
    let m = Machine::start();
    let p = interleaved_timed(
        size.pairs,
        size.warmup,
        || (0..calls).for_each(|_| baseline()),
        || (0..calls).for_each(|_| subject()),
    );
    let goal = goal_us.map_or(String::new(), |g| {
        let us = p.subject_s.median / calls as f64 * 1e6;
        format!("; goal < {g} us per call: {}", verdict(p.pairs, us < g))
    });
    println!("RATIO {name}: {}{goal}; {}", p.summary_per(calls, "call"), m.finish());
}

fn main() {
    let size = Size::from_args();
    let all = Machine::start();
    println!("negotiate bench ({} pairs per ratio, {} calls per run): {all}", size.pairs, size.calls);
    let m = model();
    let o = EngineOptions::default();
    let ch = children();
    let decode = vec![ch[2].clone()];
    let n = negotiate(&m, &o, &ch).expect("the benchmark's children negotiate a layout");
    let d = CompatDescriptor::new(&m, &n, &o);
    let json_len = serde_json::to_string(&d).expect("descriptor to JSON").len();
    let hash = d.compat_hash();
    assert_eq!(hash.len(), 64, "a compat hash is 64 hex digits: {hash}");
    let mut to_json = || {
        let s = serde_json::to_string(black_box(&d)).expect("descriptor to JSON");
        assert_eq!(s.len(), json_len, "the descriptor's JSON changed between calls");
    };
    let goal = Some(1000.0);
    figure(
        &size,
        "negotiate + descriptor + compat hash vs descriptor to JSON",
        goal,
        &mut to_json,
        &mut || assert_eq!(negotiate_and_hash(black_box(&m), black_box(&o), black_box(&ch)), hash),
    );
    figure(&size, "negotiate vs descriptor to JSON", goal, &mut to_json, &mut || {
        let got = negotiate(black_box(&m), black_box(&o), black_box(&ch)).expect("negotiate");
        assert!(got == n, "negotiate gave another result than its first call");
    });
    figure(&size, "compat hash only vs descriptor to JSON", None, &mut to_json, &mut || {
        assert_eq!(black_box(&d).compat_hash(), hash)
    });
    figure(
        &size,
        "negotiate_deployment (prefill 3 children, decode nixl) vs descriptor to JSON",
        goal,
        &mut to_json,
        &mut || {
            let r = negotiate_deployment(black_box(&m), (&o, &ch), (&o, &decode));
            assert!(r.is_ok(), "negotiate_deployment refused the benchmark's deployment: {r:?}");
        },
    );
    println!("negotiate bench done: {}", all.finish());
}
