//! Builds the plugin libraries the plugin tests load through the real dynamic path: the
//! example plugin (a workspace member) and the deliberately broken plugins of
//! `tests/fixtures/broken-plugins`, one library per defect.
//!
//! They are built with cargo into a directory under the test's `CARGO_TARGET_TMPDIR`, not the
//! outer target directory, whose lock the running `cargo test` holds. Dependencies are
//! compiled once and shared by every build there.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Every defect the broken-plugin fixture can be built with. The first two load (a method
/// panics later; a newer minor is accepted); the host refuses the others.
pub const DEFECTS: &[&str] = &[
    "method_panics",
    "newer_minor",
    "wrong_magic",
    "abi_major",
    "short_vtable",
    "bad_fingerprint",
    "factory_panics",
    "invalid_caps",
    "no_entry",
];

/// Defects that take down the process loading the plugin, in the capability query the host
/// makes at load: `std::process::abort()`, and a sleep that never ends. Only `kvconnect
/// plugins`, which loads each plugin in a query process of its own, survives them.
pub const CRASHING_DEFECTS: &[&str] = &["caps_aborts", "caps_hangs"];

// One build at a time within a test binary; cargo's own lock orders the binaries.
static BUILD: Mutex<()> = Mutex::new(());

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

fn run_cargo(args: &[&str], cwd: &Path) {
    let out = Command::new(cargo())
        .args(args)
        .current_dir(cwd)
        // The outer cargo's settings for the test binary must not leak into this build.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET_DIR")
        .output()
        .expect("run cargo");
    assert!(
        out.status.success(),
        "cargo {args:?} in {} failed:\n{}",
        cwd.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

fn target_dir(tmp: &Path) -> PathBuf {
    tmp.join("plugin-fixtures")
}

/// Builds the example plugin's cdylib; returns its path.
pub fn example_plugin(tmp: &Path) -> PathBuf {
    let _g = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let target = target_dir(tmp);
    let ws = workspace_root();
    run_cargo(
        &[
            "build",
            "--offline",
            "-p",
            "kvconnect-plugin-example",
            "--lib",
            "--target-dir",
            &target.to_string_lossy(),
        ],
        &ws,
    );
    let lib = target.join("debug").join(lib_file("kvconnect_plugin_example"));
    assert!(lib.exists(), "{} was not built", lib.display());
    lib
}

/// Builds the broken plugin with one defect; returns a copy named `libbroken_<defect>.so` in
/// `out_dir`.
pub fn broken_plugin(tmp: &Path, defect: &str, out_dir: &Path) -> PathBuf {
    let _g = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let target = target_dir(tmp);
    let src = fixture_source(tmp);
    run_cargo(&["build", "--offline", "--features", defect, "--target-dir", &target.to_string_lossy()], &src);
    let built = target.join("debug").join(lib_file("kvconnect_broken_plugin"));
    let dst = out_dir.join(format!("libbroken_{defect}.so"));
    std::fs::copy(&built, &dst).expect("copy the built fixture");
    set_mode(&dst, 0o755);
    dst
}

/// A copy of `tests/fixtures/broken-plugins` under `tmp`, depending on this checkout's
/// kvconnect-api by absolute path and locked to the workspace's `Cargo.lock`, so it builds
/// offline with exactly the crates the workspace build fetched, and nothing is written into
/// the source tree.
fn fixture_source(tmp: &Path) -> PathBuf {
    let ws = workspace_root();
    let from = ws.join("tests/fixtures/broken-plugins");
    let to = tmp.join("broken-plugin-src");
    let api = ws.join("connector-api");
    let manifest = std::fs::read_to_string(from.join("Cargo.toml"))
        .expect("read the fixture manifest")
        .replace("path = \"../../../connector-api\"", &format!("path = {:?}", api.to_string_lossy()));
    write_if_changed(&to.join("Cargo.toml"), manifest.as_bytes());
    write_if_changed(
        &to.join("src/lib.rs"),
        &std::fs::read(from.join("src/lib.rs")).expect("read the fixture source"),
    );
    write_if_changed(&to.join("Cargo.lock"), &std::fs::read(ws.join("Cargo.lock")).expect("read Cargo.lock"));
    to
}

// Rewriting an unchanged file would make cargo rebuild it for every defect.
fn write_if_changed(p: &Path, bytes: &[u8]) {
    if std::fs::read(p).ok().as_deref() != Some(bytes) {
        std::fs::create_dir_all(p.parent().expect("a parent directory")).expect("create fixture directory");
        std::fs::write(p, bytes).expect("write fixture file");
    }
}

/// Copies a file into `dir` under `name` with permission bits `mode`.
pub fn copy_with_mode(src: &Path, dir: &Path, name: &str, mode: u32) -> PathBuf {
    let dst = dir.join(name);
    std::fs::copy(src, &dst).expect("copy plugin");
    set_mode(&dst, mode);
    dst
}

fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

fn lib_file(crate_name: &str) -> String {
    format!("{}{crate_name}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX)
}
