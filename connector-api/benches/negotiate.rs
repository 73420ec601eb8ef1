//! Cost of negotiation and of the compat descriptor, for a 3-child composite (lmcache-,
//! flexkv- and nixl-like capabilities) on an 80-layer hybrid model. The baseline, measured
//! in the same run, is serialising the descriptor to JSON alone.
//!
//! `cargo bench -p kvconnect-api --bench negotiate -- --warm-up-time 1 --measurement-time 3`

use criterion::{black_box, criterion_group, Criterion};
#[path = "../tests/support/children.rs"]
mod children;

use kvconnect_api::{
    negotiate, negotiate_deployment, AttentionKind, ChildCaps, CompatDescriptor, Dtype, EngineOptions,
    ModelSpec,
};
use std::time::Instant;

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
    match negotiate(m, o, c) {
        Ok(n) => CompatDescriptor::new(m, &n, o).compat_hash(),
        Err(e) => e.to_string(),
    }
}

fn benches(c: &mut Criterion) {
    let m = model();
    let o = EngineOptions::default();
    let ch = children();
    let n = negotiate(&m, &o, &ch).expect("the benchmark's children are compatible");
    let d = CompatDescriptor::new(&m, &n, &o);
    let mut g = c.benchmark_group("negotiate_80_layers_3_children");
    g.bench_function("baseline_descriptor_to_json", |b| b.iter(|| serde_json::to_string(black_box(&d))));
    g.bench_function("negotiate", |b| {
        b.iter(|| black_box(negotiate(black_box(&m), black_box(&o), black_box(&ch))).is_ok())
    });
    g.bench_function("negotiate_descriptor_hash", |b| {
        b.iter(|| negotiate_and_hash(black_box(&m), black_box(&o), black_box(&ch)))
    });
    g.bench_function("compat_hash_only", |b| b.iter(|| black_box(&d).compat_hash()));
    let decode = vec![ch[2].clone()];
    g.bench_function("negotiate_deployment", |b| {
        b.iter(|| black_box(negotiate_deployment(black_box(&m), (&o, &ch), (&o, &decode))).is_ok())
    });
    g.finish();
}

criterion_group!(group, benches);

/// Mean time per call over `iters` calls, after a short warm-up.
fn per_call<R>(iters: u32, mut f: impl FnMut() -> R) -> f64 {
    for _ in 0..iters / 10 {
        black_box(f());
    }
    let t = Instant::now();
    for _ in 0..iters {
        black_box(f());
    }
    t.elapsed().as_secs_f64() / f64::from(iters)
}

/// The ratio the benchmark is read by, measured here so both sides share one run.
fn ratio_report() {
    let m = model();
    let o = EngineOptions::default();
    let ch = children();
    let Ok(n) = negotiate(&m, &o, &ch) else { return };
    let d = CompatDescriptor::new(&m, &n, &o);
    let base = per_call(20_000, || serde_json::to_string(&d));
    let full = per_call(20_000, || negotiate_and_hash(&m, &o, &ch));
    println!(
        "ratio: negotiate + descriptor + hash = {:.2} us, descriptor to JSON = {:.2} us, ratio {:.1}x",
        full * 1e6,
        base * 1e6,
        full / base
    );
}

fn main() {
    group();
    Criterion::default().configure_from_args().final_summary();
    ratio_report();
}
