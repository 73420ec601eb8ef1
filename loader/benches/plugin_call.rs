//! The cost of the plugin boundary: a per-layer worker call (`save_kv_layer` with 16 block
//! ids) on the example connector loaded as a plugin (its cdylib, opened by this crate's
//! loader and called through the C ABI) against the same connector linked in-process (its
//! rlib, a direct `dyn WorkerConnector` call), measured in the same run as interleaved pairs
//! (`kvconnect_support::stats::interleaved`: the order alternates within a pair), each run a
//! fixed number of calls; plus the bare boundary call (`wait_for_layer_load`, no work) and
//! the time to open and check a plugin.
//!
//! The example's `save_kv_layer` with no save scheduled does a small fixed amount of real
//! work: it bounds-checks each of the 16 block ids against the registered regions (4 layers,
//! 64 blocks, HND, bf16).
//!
//! Run: `cargo bench -p kvconnect-loader --bench plugin_call` (`PLUGIN_BENCH_PAIRS` sets the
//! pairs, 21 by default; `KVCONNECT_BENCH_PLUGIN` names a prebuilt example plugin, for a
//! machine without cargo). Without `--bench` (as `cargo test` runs it) every part runs once
//! with a few calls, against a debug build of the plugin.

#![allow(unsafe_code)] // A benchmark harness over KV buffers it owns.

use kvconnect_api::{
    AttentionKind, BlockId, ConnectorContext, ConnectorFactory, Dtype, EffectiveLayout, KvGroup, KvLayout,
    KvRegion, KvRegionSpec, KvRole, KvTransferConfig, LayerId, MemoryKind, ModelSpec, TransferMode,
    WorkerConnector,
};
use kvconnect_loader::{load_plugin, LoaderOptions};
use kvconnect_support::stats::{interleaved_timed, per_call, Machine, Quartiles};
use serde_json::json;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Instant;

const LAYERS: u32 = 4;
const NUM_BLOCKS: u32 = 64;

/// The sizes of one run: the benchmark's, or the tiny one of a test run.
struct Size {
    test: bool,
    pairs: usize,
    /// Calls per timed run.
    calls: usize,
    /// Fresh copies of the library opened one by one.
    fresh_opens: usize,
}

impl Size {
    fn from_args() -> Size {
        let args: Vec<String> = std::env::args().collect();
        // `cargo bench` passes --bench; `cargo test` does not (and `-- --test` asks for a test).
        let test = !args.iter().any(|a| a == "--bench") || args.iter().any(|a| a == "--test");
        if test {
            return Size { test, pairs: 1, calls: 100, fresh_opens: 2 };
        }
        let pairs = std::env::var("PLUGIN_BENCH_PAIRS").ok().and_then(|v| v.parse().ok()).unwrap_or(21);
        Size { test, pairs, calls: 200_000, fresh_opens: 30 }
    }
}

/// The example plugin: `KVCONNECT_BENCH_PLUGIN`, or built here (release for the benchmark,
/// debug for a test run) into this bench's scratch directory.
fn example_plugin(release: bool) -> PathBuf {
    if let Some(p) = std::env::var_os("KVCONNECT_BENCH_PLUGIN") {
        return PathBuf::from(p);
    }
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR")).join("plugin-bench");
    let ws = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf();
    let mut cmd = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(["build", "--offline", "-p", "kvconnect-plugin-example", "--lib", "--target-dir"]).arg(&tmp);
    if release {
        cmd.arg("--release");
    }
    let status = cmd.current_dir(&ws).env_remove("CARGO_TARGET_DIR").status().expect("run cargo");
    assert!(status.success(), "building the example plugin failed");
    tmp.join(if release { "release" } else { "debug" }).join(format!(
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

fn ns(q: &Quartiles) -> serde_json::Value {
    json!({"q1": q.q1 * 1e9, "median": q.median * 1e9, "q3": q.q3 * 1e9})
}

fn main() {
    let size = Size::from_args();
    let lib = example_plugin(!size.test);
    let machine = Machine::start();
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
    // Both halves answer the same, so the plugin's calls did the same work.
    assert_eq!(
        w_native.save_kv_layer(LayerId(2), &ids).is_ok(),
        w_plugin.save_kv_layer(LayerId(2), &ids).is_ok()
    );
    assert!(
        w_plugin.save_kv_layer(LayerId(2), &[BlockId(NUM_BLOCKS)]).is_err(),
        "an id past the regions is refused"
    );

    let calls = size.calls;
    let save = interleaved_timed(
        size.pairs,
        1,
        || (0..calls).for_each(|_| w_native.save_kv_layer(black_box(LayerId(2)), black_box(&ids)).unwrap()),
        || (0..calls).for_each(|_| w_plugin.save_kv_layer(black_box(LayerId(2)), black_box(&ids)).unwrap()),
    );
    let bare = interleaved_timed(
        size.pairs,
        1,
        || (0..calls).for_each(|_| w_native.wait_for_layer_load(black_box(LayerId(2))).unwrap()),
        || (0..calls).for_each(|_| w_plugin.wait_for_layer_load(black_box(LayerId(2))).unwrap()),
    );
    // Plugin time over in-process time, per pair: the inverse of the pairs' throughput ratio.
    let cost = |q: &Quartiles| Quartiles { q1: 1.0 / q.q3, median: 1.0 / q.median, q3: 1.0 / q.q1 };
    let per = |q: &Quartiles| Quartiles {
        q1: q.q1 / calls as f64,
        median: q.median / calls as f64,
        q3: q.q3 / calls as f64,
    };

    // Open + check + init + factory + capability validation of a library already mapped
    // (dlopen only bumps its count): the loader's own cost.
    let mapped = per_call(size.pairs, if size.test { 2 } else { 200 }, || {
        black_box(load_plugin(&lib, &LoaderOptions::default()).expect("load"));
    });
    // A library the process has never mapped: dlopen maps and relocates it, one fresh copy each.
    let copies = tempfile::tempdir().expect("tempdir");
    let first: Vec<f64> = (0..size.fresh_opens)
        .map(|i| {
            let p = copies.path().join(format!("libexample_{i}.so"));
            std::fs::copy(&lib, &p).expect("copy");
            let t = Instant::now();
            black_box(load_plugin(&p, &LoaderOptions::default()).expect("load"));
            t.elapsed().as_secs_f64()
        })
        .collect();
    let first = Quartiles::of(first);
    let bare_plugin_ns = per(&bare.subject_s).median * 1e9;
    let out = json!({
        "bench": "plugin_call",
        "pairs": save.pairs,
        "calls_per_run": calls,
        "save_kv_layer_16_blocks": {
            "plugin_over_in_process": cost(&save.ratio),
            "in_process_ns": ns(&per(&save.baseline_s)),
            "plugin_ns": ns(&per(&save.subject_s)),
            "goal": "plugin <= 1.5x in-process",
            "verdict": kvconnect_support::stats::verdict(save.pairs, cost(&save.ratio).median <= 1.5),
        },
        "wait_for_layer_load_noop": {
            "plugin_over_in_process": cost(&bare.ratio),
            "in_process_ns": ns(&per(&bare.baseline_s)),
            "plugin_ns": ns(&per(&bare.subject_s)),
            "goal": "plugin call < 40 ns",
            "verdict": kvconnect_support::stats::verdict(bare.pairs, bare_plugin_ns < 40.0),
        },
        "open_check_already_mapped_us": {
            "q1": mapped.q1 * 1e6, "median": mapped.median * 1e6, "q3": mapped.q3 * 1e6,
        },
        "open_check_first_open_us": {
            "q1": first.q1 * 1e6, "median": first.median * 1e6, "q3": first.q3 * 1e6,
            "copies": size.fresh_opens,
        },
        "machine": machine.finish(),
    });
    println!("{}", serde_json::to_string_pretty(&out).expect("JSON"));
}
