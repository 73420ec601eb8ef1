//! Running cargo from a test: the cargo that runs the tests, without the outer build's
//! target-directory settings, which would send the inner build into the directory the
//! running `cargo test` holds locked.

use std::path::Path;
use std::process::{Command, Output};

/// `cargo ARGS` in `cwd`, ready to run.
pub fn command(args: &[&str], cwd: &Path) -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    c.args(args).current_dir(cwd).env_remove("CARGO_TARGET_DIR").env_remove("CARGO_BUILD_TARGET_DIR");
    c
}

/// Runs `cargo ARGS` in `cwd`; a failure panics with cargo's stderr.
pub fn run(args: &[&str], cwd: &Path) -> Output {
    let out = command(args, cwd).output().expect("run cargo");
    assert!(
        out.status.success(),
        "cargo {args:?} in {} failed:\n{}",
        cwd.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
