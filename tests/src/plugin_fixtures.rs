//! Builds the plugin libraries the plugin tests load through the real dynamic path: the
//! example plugin (a workspace member), the deliberately broken plugins of
//! `tests/fixtures/broken-plugins`, one library per defect, and plugin crates a test writes
//! outside the workspace (docs/plugins.md's guide).
//!
//! They are built with cargo into a directory under the test's `CARGO_TARGET_TMPDIR`, not the
//! outer target directory, whose lock the running `cargo test` holds. Dependencies are
//! compiled once and shared by every build there.

use crate::cargo_cmd;
use crate::workspace_root;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Every defect the broken-plugin fixture can be built with. The first two load (a method
/// panics later; a newer minor is accepted); the host refuses the others.
pub const DEFECTS: &[&str] = &[
    "method_panics",
    "newer_minor",
    "wrong_magic",
    "abi_major",
    "short_vtable",
    "minor_without_entry",
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

fn target_dir(tmp: &Path) -> PathBuf {
    tmp.join("plugin-fixtures")
}

/// Builds the example plugin's cdylib; returns its path.
pub fn example_plugin(tmp: &Path) -> PathBuf {
    let _g = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    build_example(tmp, &[])
}

/// Builds the example plugin against kvconnect-api's ABI as 1.0 defined it (the test-only
/// `abi_1_0` feature) and returns a copy of it in `out_dir`, named `libexample_abi_1_0.so`.
pub fn example_plugin_abi_1_0(tmp: &Path, out_dir: &Path) -> PathBuf {
    let _g = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let built = build_example(tmp, &["--features", "kvconnect-api/abi_1_0"]);
    let dst = out_dir.join("libexample_abi_1_0.so");
    std::fs::copy(&built, &dst).expect("copy the 1.0 example plugin");
    set_mode(&dst, 0o755);
    dst
}

/// Builds `tests/fixtures/abi-host`, a host that loads one plugin through the real loader,
/// built against the kvconnect-api of its features (`args`: `--features abi_1_0` for a 1.0
/// host); returns the executable.
pub fn abi_host(tmp: &Path, args: &[&str]) -> PathBuf {
    let _g = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let src = fixture_source(tmp, "abi-host", &["src/main.rs"]);
    build_locked(tmp, &src, &format!("kvconnect-abi-host{}", std::env::consts::EXE_SUFFIX), args).0
}

/// Runs `cargo build` on `tests/fixtures/region-forger` (`args`: e.g. `--features host`),
/// without asserting success: its tests look at whether kvconnect-api let it build.
pub fn build_region_forger(tmp: &Path, args: &[&str]) -> std::process::Output {
    let _g = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let src = fixture_source(tmp, "region-forger", &["src/lib.rs"]);
    let lock = std::fs::read(workspace_root().join("Cargo.lock")).expect("read Cargo.lock");
    write_if_changed(&src.join("Cargo.lock"), &lock);
    let target = target_dir(tmp);
    let target_arg = target.to_string_lossy();
    let mut all = vec!["build", "--offline", "--target-dir", &target_arg];
    all.extend_from_slice(args);
    cargo_cmd::command(&all, &src).output().expect("run cargo")
}

/// The caller holds `BUILD`. The library is overwritten by the next build with other
/// features; callers that need it to stay copy it.
fn build_example(tmp: &Path, features: &[&str]) -> PathBuf {
    let target = target_dir(tmp);
    let target_arg = target.to_string_lossy();
    let mut args =
        vec!["build", "--offline", "-p", "kvconnect-plugin-example", "--lib", "--target-dir", &target_arg];
    args.extend_from_slice(features);
    cargo_cmd::run(&args, &workspace_root());
    let lib = target.join("debug").join(lib_file("kvconnect_plugin_example"));
    assert!(lib.exists(), "{} was not built", lib.display());
    lib
}

/// Builds the broken plugin with one defect; returns a copy named `libbroken_<defect>.so` in
/// `out_dir`.
pub fn broken_plugin(tmp: &Path, defect: &str, out_dir: &Path) -> PathBuf {
    let _g = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let src = fixture_source(tmp, "broken-plugins", &["src/lib.rs"]);
    let (built, _) = build_locked(tmp, &src, &lib_file("kvconnect_broken_plugin"), &["--features", defect]);
    let dst = out_dir.join(format!("libbroken_{defect}.so"));
    std::fs::copy(&built, &dst).expect("copy the built fixture");
    set_mode(&dst, 0o755);
    dst
}

/// Builds the plugin crate at `src`, a crate outside the workspace that depends on this
/// checkout's kvconnect-api by path, into the fixtures' target directory. Returns its library
/// (`lib_name` is the crate's library name) and what cargo printed on stderr.
pub fn external_plugin(tmp: &Path, src: &Path, lib_name: &str) -> (PathBuf, String) {
    let _g = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    build_locked(tmp, src, &lib_file(lib_name), &[])
}

/// Locks the crate at `src` to the workspace's `Cargo.lock`, so it builds offline with exactly
/// the crates the workspace build fetched, and builds it with `args`; returns the file
/// `artifact` of the build. The caller holds `BUILD`.
fn build_locked(tmp: &Path, src: &Path, artifact: &str, args: &[&str]) -> (PathBuf, String) {
    let target = target_dir(tmp);
    let lock = std::fs::read(workspace_root().join("Cargo.lock")).expect("read Cargo.lock");
    write_if_changed(&src.join("Cargo.lock"), &lock);
    let target_arg = target.to_string_lossy();
    let mut all = vec!["build", "--offline", "--target-dir", &target_arg];
    all.extend_from_slice(args);
    let out = cargo_cmd::run(&all, src);
    let built = target.join("debug").join(artifact);
    assert!(built.exists(), "{} was not built", built.display());
    (built, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A copy of `tests/fixtures/<name>` (its manifest and `files`) under `tmp`, depending on
/// this checkout's kvconnect-api by absolute path, so nothing is written into the source tree.
fn fixture_source(tmp: &Path, name: &str, files: &[&str]) -> PathBuf {
    let ws = workspace_root();
    let from = ws.join("tests/fixtures").join(name);
    let to = tmp.join(format!("{name}-src"));
    let mut manifest = std::fs::read_to_string(from.join("Cargo.toml")).expect("read the fixture manifest");
    for dep in ["connector-api", "loader"] {
        let at = ws.join(dep);
        manifest = manifest
            .replace(&format!("path = \"../../../{dep}\""), &format!("path = {:?}", at.to_string_lossy()));
    }
    write_if_changed(&to.join("Cargo.toml"), manifest.as_bytes());
    for f in files {
        write_if_changed(&to.join(f), &std::fs::read(from.join(f)).expect("read the fixture source"));
    }
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

/// Builds `plugins/c-example`, the plugin written in C against `kvconnect.h` alone, with the
/// system C compiler (`$CC`, else `cc`) as its source file says, plus `defines` (`-DNAME=VALUE`
/// flags); returns the library, `libc_example<suffix>.so` in `out_dir`.
pub fn c_example_plugin(out_dir: &Path, suffix: &str, defines: &[&str]) -> PathBuf {
    let ws = workspace_root();
    let src = ws.join("plugins/c-example/src");
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&src)
        .expect("read plugins/c-example/src")
        .map(|e| e.expect("list plugins/c-example/src").path())
        .filter(|p| p.extension().is_some_and(|e| e == "c"))
        .collect();
    sources.sort();
    let lib = out_dir.join(format!("libc_example{suffix}{}", std::env::consts::DLL_SUFFIX));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = std::process::Command::new(&cc)
        .args([
            "-std=c99",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-O2",
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-I",
        ])
        .arg(ws.join("connector-api/include"))
        .args(defines)
        .args(&sources)
        .arg("-o")
        .arg(&lib)
        .arg("-lpthread")
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler '{cc}' ({e}); install gcc or set CC"));
    assert!(
        out.status.success(),
        "plugins/c-example does not compile:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    lib
}
