//! The cost of the plugin boundary: a per-layer worker call (`save_kv_layer` with 16 block
//! ids) on the example connector loaded as a plugin (cdylib, through the C ABI) against the
//! same connector linked in-process (its rlib, a direct `dyn WorkerConnector` call), in the
//! same run; plus the time to open and check a plugin.
//!
//! The example's `save_kv_layer` with no save scheduled does a small fixed amount of real
//! work: it bounds-checks each of the 16 block ids against the registered regions. A no-op
//! call (`wait_for_layer_load`) shows the bare boundary cost.
//!
//! Run: `cargo bench -p kvconnect-host --bench plugin_call -- --warm-up-time 1 --measurement-time 3`

#![allow(unsafe_code)] // A benchmark harness over KV buffers it owns.

use criterion::{criterion_group, criterion_main, Criterion};
use kvconnect_api::{
    AttentionKind, BlockId, ConnectorContext, ConnectorFactory, Dtype, EffectiveLayout, KvGroup, KvLayout,
    KvRegion, KvRegionSpec, KvRole, KvTransferConfig, LayerId, MemoryKind, ModelSpec, TransferMode,
    WorkerConnector,
};
use kvconnect_host::loader::{load_plugin, LoaderOptions};
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const LAYERS: u32 = 4;
const NUM_BLOCKS: u32 = 64;

/// Builds the example plugin in release mode into this bench's scratch directory.
fn build_example() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR")).join("plugin-bench");
    let ws = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf();
    let status = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "--offline", "-p", "kvconnect-plugin-example", "--lib", "--target-dir"])
        .arg(&tmp)
        .current_dir(&ws)
        .env_remove("CARGO_TARGET_DIR")
        .status()
        .expect("run cargo");
    assert!(status.success(), "building the example plugin failed");
    tmp.join("release").join(format!(
        "{}kvconnect_plugin_example{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ))
}

fn ctx(dir: &Path) -> ConnectorContext {
    let mut config = KvTransferConfig::named("example");
    config.kv_connector_extra_config.insert("dir".into(), dir.to_string_lossy().into_owned().into());
    ConnectorContext {
        config,
        model: ModelSpec {
            name: "bench".into(),
            num_layers: LAYERS,
            num_kv_heads: 8,
            head_dim: 128,
            dtype: Some(Dtype::Bf16),
            layers: vec![AttentionKind::Full; LAYERS as usize],
            state: None,
        },
        effective: EffectiveLayout {
            layout: KvLayout::HND,
            hma: false,
            block_size: 16,
            cache_dtype: Dtype::Bf16,
            memory: MemoryKind::Host,
            transfer_mode: TransferMode::None,
            groups: vec![KvGroup { kind: AttentionKind::Full, layers: (0..LAYERS).map(LayerId).collect() }],
            state_groups: vec![],
            opaque_blocks: false,
        },
        role: KvRole::Both,
        engine_id: "bench".into(),
        tp_rank: 0,
        tp_size: 1,
    }
}

/// A worker of `f` with `bufs` registered as its per-layer regions.
///
/// # Safety
/// `bufs` must outlive the returned worker and not be touched while it may use them.
unsafe fn worker(f: &dyn ConnectorFactory, dir: &Path, bufs: &mut [Vec<u8>]) -> Box<dyn WorkerConnector> {
    let mut w = f.create_worker(&ctx(dir)).expect("create worker");
    let regions: Vec<KvRegion> = KvRegionSpec::per_layer(bufs, NUM_BLOCKS)
        .into_iter()
        // SAFETY: the caller's contract (`# Safety` above).
        .map(|spec| unsafe { KvRegion::new(spec) })
        .collect();
    w.register_kv_caches(&regions).expect("register");
    w.bind_connector_meta(b"").expect("bind");
    w
}

fn bench(c: &mut Criterion) {
    let lib = build_example();
    let dir = tempfile::tempdir().expect("tempdir");
    let region_len = NUM_BLOCKS as usize * 2 * 8 * 16 * 128 * 2;
    let mut bufs_a: Vec<Vec<u8>> = (0..LAYERS).map(|_| vec![0u8; region_len]).collect();
    let mut bufs_b = bufs_a.clone();

    let native = kvconnect_plugin_example::ExampleFactory::new();
    let plugin = load_plugin(&lib, &LoaderOptions::default()).expect("load the example plugin");
    // SAFETY: the buffers are declared before the workers, so they outlive them, and the
    // benchmark touches them only through the workers.
    let mut w_native = unsafe { worker(&native, dir.path(), &mut bufs_a) };
    // SAFETY: as above.
    let mut w_plugin = unsafe { worker(plugin.factory.as_ref(), dir.path(), &mut bufs_b) };
    let ids: Vec<BlockId> = (0..16).map(|i| BlockId(i * 3 + 1)).collect();

    let mut g = c.benchmark_group("save_kv_layer_16_blocks");
    g.bench_function("in_process", |b| {
        b.iter(|| w_native.save_kv_layer(black_box(LayerId(2)), black_box(&ids)).unwrap())
    });
    g.bench_function("plugin", |b| {
        b.iter(|| w_plugin.save_kv_layer(black_box(LayerId(2)), black_box(&ids)).unwrap())
    });
    g.finish();

    let mut g = c.benchmark_group("wait_for_layer_load_noop");
    g.bench_function("in_process", |b| {
        b.iter(|| w_native.wait_for_layer_load(black_box(LayerId(2))).unwrap())
    });
    g.bench_function("plugin", |b| b.iter(|| w_plugin.wait_for_layer_load(black_box(LayerId(2))).unwrap()));
    g.finish();

    // Open + check + init + factory + capability validation of a library already mapped
    // (dlopen only bumps its count): the loader's own cost.
    let mut g = c.benchmark_group("plugin_open_check");
    g.bench_function("already_mapped", |b| {
        b.iter(|| black_box(load_plugin(&lib, &LoaderOptions::default()).expect("load")));
    });
    g.finish();

    // A library the process has never mapped: dlopen maps and relocates it. Criterion would
    // map thousands of copies, so this is a fixed sample of fresh copies, timed one by one.
    let copies = tempfile::tempdir().expect("tempdir");
    let mut times: Vec<Duration> = (0..30)
        .map(|i| {
            let p = copies.path().join(format!("libexample_{i}.so"));
            std::fs::copy(&lib, &p).expect("copy");
            let t = Instant::now();
            black_box(load_plugin(&p, &LoaderOptions::default()).expect("load"));
            t.elapsed()
        })
        .collect();
    times.sort();
    println!(
        "plugin_open_check/first_open: median {:.1} us, max {:.1} us over {} fresh copies",
        times[times.len() / 2].as_secs_f64() * 1e6,
        times[times.len() - 1].as_secs_f64() * 1e6,
        times.len()
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
