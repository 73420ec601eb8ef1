//! ABI minors across real builds: a plugin of one minor loaded by a host of another.
//!
//! Two copies of the ABI definitions come from one source: kvconnect-api as it is (1.3, whose
//! factory vtable ends with 1.1's `child_capabilities`, and whose scheduler vtable has 1.2's
//! `take_kv_events` and, like the worker's, 1.3's `metrics`) and kvconnect-api with its test-only `abi_1_0` feature (1.0: `ABI_MINOR`
//! 0, those entries dropped). The tests build:
//!
//! * the example plugin against each copy, and load the 1.0 build into this 1.3 host, in
//!   process and through `kvconnect plugins inspect --json`: it loads, and the entries it
//!   lacks are absent with their fallbacks (no children; events through `take_events`; no
//!   metrics);
//! * `tests/fixtures/abi-host`, a host made of the real loader (`kvconnect-loader`), against
//!   each copy, and load 1.3 builds into it: the 1.0 host loads them and answers through the
//!   1.0 entries only (a composite's children, a 1.1 entry, are not asked for; its KV events
//!   come through `take_events`, in the shape before media), the 1.3 host built the same way
//!   sees the children and the events with their media, parents and tokens;
//! * a plugin built for major 2, which the host refuses with one line.

use kvconnect_api::{ConnectorFactory, KvEvent, KvTransferConfig, Medium};
use kvconnect_registry::loader::{load_plugin, LoaderOptions};
use kvconnect_tests::plugin_fixtures::{
    self, abi_host, broken_plugin, copy_with_mode, example_plugin_abi_1_0,
};
use kvconnect_tests::{round_trip, run_kvconnect, text};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn tmp() -> &'static Path {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
}

/// The example plugin built at 1.0 and at 1.3, copied out together (each build of it
/// overwrites the last): (their directory, 1.0, 1.3).
fn examples() -> &'static (tempfile::TempDir, PathBuf, PathBuf) {
    static E: OnceLock<(tempfile::TempDir, PathBuf, PathBuf)> = OnceLock::new();
    E.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let new = copy_with_mode(
            &plugin_fixtures::example_plugin(tmp()),
            dir.path(),
            "libexample_abi_1_3.so",
            0o755,
        );
        let old = example_plugin_abi_1_0(tmp(), dir.path());
        (dir, old, new)
    })
}

#[test]
fn a_1_0_plugin_loads_into_a_1_3_host_with_the_newer_entries_absent() {
    let old = &examples().1;

    let p = load_plugin(old, &LoaderOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.library.abi_version(), "1.0");
    let config = KvTransferConfig::named("example");
    assert!(p.factory.capabilities(&config, None).is_ok());
    // `child_capabilities` is a 1.1 entry: absent, so the fallback: no children.
    assert_eq!(p.factory.child_capabilities(&config, None).unwrap(), None);
    // `take_kv_events` is a 1.2 entry: absent, so the host takes the events through
    // `take_events` (the example publishes none).
    let store = tempfile::tempdir().unwrap();
    let mut scheduler = p.factory.create_scheduler(&round_trip::ctx(store.path())).unwrap();
    assert_eq!(scheduler.take_events().unwrap(), vec![]);
    // `metrics` is a 1.3 entry of both halves: absent, so the fallback: nothing counted.
    assert_eq!(scheduler.metrics().unwrap(), vec![]);
    let mut worker = p.factory.create_worker(&round_trip::ctx(store.path())).unwrap();
    assert_eq!(worker.metrics().unwrap(), vec![]);

    let out = run_kvconnect(&["plugins", "inspect", &old.to_string_lossy(), "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["name"], "example");
    assert_eq!(v["abi"], "1.0");
    assert!(v["children"].is_null(), "{v}");
    assert_eq!(v["capabilities"]["transfer_mode"], "none");
}

#[test]
fn a_1_3_plugin_loads_into_a_1_0_host_which_calls_only_1_0_entries() {
    let dir = tempfile::tempdir().unwrap();
    let composite = broken_plugin(tmp(), "composite", dir.path());
    // Each build of the host overwrites the last: keep a copy of the 1.0 one.
    let old_host =
        copy_with_mode(&abi_host(tmp(), &["--features", "abi_1_0"]), dir.path(), "abi-host-1.0", 0o755);
    let new_host = abi_host(tmp(), &[]);
    let run = |host: &Path, plugin: &Path| {
        let out = Command::new(host).arg(plugin).output().unwrap();
        assert!(
            out.status.success(),
            "{} refused {}: {}",
            host.display(),
            plugin.display(),
            text(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };

    let v = run(&old_host, &examples().2);
    assert_eq!(v["host_abi"], "1.0", "{v}");
    assert_eq!(v["plugin_abi"], "1.3", "{v}");
    assert_eq!(v["info"]["name"], "example", "{v}");
    assert_eq!(v["capabilities"]["ok"]["transfer_mode"], "none", "{v}");

    // A composite's `child_capabilities` is a 1.1 entry: the 1.0 host does not know it, so
    // it has the 1.0 answer (no children), though the plugin exports the entry.
    let v = run(&old_host, &composite);
    assert_eq!((&v["host_abi"], &v["plugin_abi"]), (&"1.0".into(), &"1.3".into()), "{v}");
    assert!(v["children"]["ok"].is_null(), "{v}");
    // Its KV events: the 1.0 host calls `take_events`, which answers in the shape before
    // media: hashes and tier only, no clear.
    let before = [
        KvEvent::stored(vec![11, 12], None, vec![], 0, Medium::CpuTier),
        KvEvent::removed(vec![11], Medium::Disk),
    ];
    assert_eq!(events(&v), before, "{v}");
    let v = run(&new_host, &composite);
    assert_eq!(v["host_abi"], "1.3", "{v}");
    // The 1.3 host calls `take_kv_events`: the events as the plugin made them.
    let now = [
        KvEvent::stored(vec![11, 12], Some(10), (1..=8).collect(), 4, Medium::CpuTier),
        KvEvent::removed(vec![11], Medium::Disk),
        KvEvent::AllBlocksCleared,
    ];
    assert_eq!(events(&v), now, "{v}");
    let names: Vec<_> = v["children"]["ok"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["cache", "net"], "{v}");
}

/// The KV events an abi-host line reports.
fn events(v: &serde_json::Value) -> Vec<KvEvent> {
    serde_json::from_value(v["events"]["ok"].clone()).unwrap_or_else(|e| panic!("{e}: {v}"))
}

#[test]
fn a_2_0_plugin_is_refused_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = broken_plugin(tmp(), "abi_major", dir.path());
    let out = run_kvconnect(&["plugins", "inspect", &p.to_string_lossy()]);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    assert!(e.contains("built for kvconnect ABI 2.x") && e.contains("this host speaks 1.x"), "{e}");
    assert!(e.contains(&p.to_string_lossy().into_owned()), "{e}");
}
