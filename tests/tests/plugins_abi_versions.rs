//! ABI minors across real builds: a plugin of one minor loaded by a host of another.
//!
//! Two copies of the ABI definitions come from one source: kvconnect-api as it is (1.1, whose
//! factory vtable ends with `child_capabilities`) and kvconnect-api with its test-only
//! `abi_1_0` feature (1.0: `ABI_MINOR` 0, that entry dropped). The tests build:
//!
//! * the example plugin against each copy, and load the 1.0 build into this 1.1 host, in
//!   process and through `kvconnect plugins inspect --json`: it loads, and the entry it lacks
//!   is absent with its fallback (no children);
//! * `tests/fixtures/abi-host`, a minimal host, against the 1.0 copy, and load the 1.1 build
//!   into it: it loads and answers through the 1.0 entries only. Building the real `kvconnect`
//!   binary against the 1.0 copy would rebuild every connector and the host; the minimal host
//!   applies the real loader's version checks through the same kvconnect-api functions
//!   (`LAYOUT_FINGERPRINT`, the `MIN_*` sizes, `read_declared`), compiled at 1.0;
//! * a plugin built for major 2, which the host refuses with one line.

use kvconnect_api::{ConnectorFactory, KvTransferConfig};
use kvconnect_host::loader::{load_plugin, LoaderOptions};
use kvconnect_tests::plugin_fixtures::{
    self, abi_host, broken_plugin, copy_with_mode, example_plugin_abi_1_0,
};
use kvconnect_tests::{run_kvconnect, text};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn tmp() -> &'static Path {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
}

/// The example plugin built at 1.0 and at 1.1, copied out together (each build of it
/// overwrites the last): (their directory, 1.0, 1.1).
fn examples() -> &'static (tempfile::TempDir, PathBuf, PathBuf) {
    static E: OnceLock<(tempfile::TempDir, PathBuf, PathBuf)> = OnceLock::new();
    E.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let new = copy_with_mode(
            &plugin_fixtures::example_plugin(tmp()),
            dir.path(),
            "libexample_abi_1_1.so",
            0o755,
        );
        let old = example_plugin_abi_1_0(tmp(), dir.path());
        (dir, old, new)
    })
}

#[test]
fn a_1_0_plugin_loads_into_a_1_1_host_with_the_newer_entry_absent() {
    let old = &examples().1;

    let p = load_plugin(old, &LoaderOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.library.abi_version(), "1.0");
    let config = KvTransferConfig::named("example");
    assert!(p.factory.capabilities(&config, None).is_ok());
    // `child_capabilities` is a 1.1 entry: absent, so the fallback: no children.
    assert_eq!(p.factory.child_capabilities(&config, None).unwrap(), None);

    let out = run_kvconnect(&["plugins", "inspect", &old.to_string_lossy(), "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["name"], "example");
    assert_eq!(v["abi"], "1.0");
    assert!(v["children"].is_null(), "{v}");
    assert_eq!(v["capabilities"]["transfer_mode"], "none");
}

#[test]
fn a_1_1_plugin_loads_into_a_1_0_host_which_calls_only_1_0_entries() {
    let new = &examples().2;
    let host = abi_host(tmp(), &["--features", "abi_1_0"]);
    let out = Command::new(&host).arg(new).output().unwrap();
    assert!(out.status.success(), "the 1.0 host refused the 1.1 plugin: {}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["host_abi"], "1.0");
    assert_eq!(v["plugin_abi"], "1.1");
    // The plugin's factory vtable has an entry this host does not know, and never reads.
    let (plugin_size, host_size) =
        (v["plugin_factory_vtable_size"].as_u64().unwrap(), v["host_factory_vtable_size"].as_u64().unwrap());
    assert_eq!(plugin_size, host_size + std::mem::size_of::<usize>() as u64, "{v}");
    assert_eq!(v["info"]["name"], "example");
    assert_eq!(v["capabilities"]["transfer_mode"], "none");

    // The same host built at 1.1 sees the whole vtable: the 1.0 one saw less, not other.
    let host = abi_host(tmp(), &[]);
    let out = Command::new(&host).arg(new).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["host_abi"], "1.1");
    assert_eq!(v["host_factory_vtable_size"].as_u64().unwrap(), plugin_size);
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
