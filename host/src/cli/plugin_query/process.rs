//! Runs one plugin query in a child process of this binary (`kvconnect plugins probe`),
//! with a time limit. A plugin that aborts, segfaults or hangs takes only that process
//! down; the caller gets its one line as a [`LoadError`].
//!
//! The child inherits stderr, so the plugin's log lines (forwarded to the host log in the
//! child) and the child's own messages reach the user as they would from this process.
//! Its stdout is read in the background, so a plugin that prints a lot cannot block it.

#![allow(unsafe_code)] // Sets the query process's parent-death signal before exec (libc).

use super::answer::{Answer, Loaded};
use super::failure::NoAnswer;
use crate::loader::{LoadError, LoaderOptions};
use anyhow::Context;
use kvconnect_api::{KvTransferConfig, ModelSpec};
use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;
use wait_timeout::ChildExt;

/// The most of a query process's stdout that is kept; the answer is far smaller.
const MAX_STDOUT: u64 = 16 << 20;

/// How long to wait for the rest of stdout once the process has exited (a process the plugin
/// started may still hold the pipe open).
const STDOUT_GRACE: Duration = Duration::from_secs(1);

/// Runs plugin queries in child processes of this binary.
#[derive(Debug, Clone)]
pub struct QueryProcess {
    exe: PathBuf,
    limit: Duration,
}

impl QueryProcess {
    /// Queries run this binary, and are killed after `limit`.
    pub fn new(limit: Duration) -> anyhow::Result<QueryProcess> {
        let exe = std::env::current_exe().context(
            "cannot find this program's own file, which plugin queries run in a process of its own",
        )?;
        Ok(QueryProcess { exe, limit })
    }

    /// Loads the plugin file `path` in a query process and asks it for its capabilities for
    /// `config` (default: the plain config naming it) and `model`.
    pub fn ask(
        &self,
        path: &Path,
        options: &LoaderOptions,
        config: Option<&KvTransferConfig>,
        model: Option<&ModelSpec>,
    ) -> Result<Loaded, LoadError> {
        let shown = path.display().to_string();
        let fail = |why: NoAnswer| LoadError::QueryProcess { path: shown.clone(), message: why.line(&shown) };
        let args = probe_args(path, options, config, model).map_err(|e| fail(NoAnswer::CannotRun(e)))?;
        let mut cmd = Command::new(&self.exe);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        die_with_this_process(&mut cmd);
        let mut child = cmd.spawn().map_err(|e| fail(NoAnswer::CannotRun(e.to_string())))?;
        let stdout = read_in_background(child.stdout.take());
        let status = match child.wait_timeout(self.limit) {
            Ok(Some(status)) => status,
            Ok(None) => {
                kill(&mut child);
                return Err(fail(NoAnswer::TimedOut(self.limit)));
            }
            Err(e) => {
                kill(&mut child);
                return Err(fail(NoAnswer::CannotRun(e.to_string())));
            }
        };
        // An answer counts even if the process then failed on its way out: it was given.
        match Answer::parse(&stdout.recv_timeout(STDOUT_GRACE).unwrap_or_default()) {
            Some(Answer::Loaded(l)) => Ok(*l),
            Some(Answer::Refused(message)) => Err(LoadError::QueryProcess { path: shown, message }),
            None => Err(fail(NoAnswer::from_status(status))),
        }
    }
}

/// The query process's command line after the program: `plugins probe [options] -- PATH`.
fn probe_args(
    path: &Path,
    options: &LoaderOptions,
    config: Option<&KvTransferConfig>,
    model: Option<&ModelSpec>,
) -> Result<Vec<OsString>, String> {
    let mut args: Vec<OsString> = vec!["plugins".into(), "probe".into()];
    if options.allow_insecure {
        args.push("--allow-insecure-plugins".into());
    }
    if let Some(c) = config {
        args.extend(["--config-json".into(), json("kv-transfer-config", c)?.into()]);
    }
    if let Some(m) = model {
        args.extend(["--model-json".into(), json("model", m)?.into()]);
    }
    args.extend(["--".into(), path.as_os_str().to_owned()]);
    Ok(args)
}

fn json<T: serde::Serialize>(what: &str, v: &T) -> Result<String, String> {
    serde_json::to_string(v).map_err(|e| format!("cannot encode the {what} for it: {e}"))
}

/// Everything the child prints on stdout, delivered once it closes the pipe.
fn read_in_background(stdout: Option<ChildStdout>) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    if let Some(out) = stdout {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let mut out = out;
            let _ = (&mut out).take(MAX_STDOUT).read_to_end(&mut buf);
            // Drain the rest, so the child never blocks on a full pipe.
            let _ = std::io::copy(&mut out, &mut std::io::sink());
            let _ = tx.send(buf);
        });
    }
    rx
}

/// Kills a query process with SIGKILL (a hung plugin may ignore anything gentler) and reaps it.
fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Has the query process killed (SIGKILL) when this process dies, so that a hung plugin's
/// process cannot outlive an interrupted `kvconnect plugins` either. Linux ties this to the
/// thread that started the child: queries are started from the command's main thread.
#[cfg(target_os = "linux")]
fn die_with_this_process(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec; it calls only prctl and
    // getppid, which are async-signal-safe, and builds its errors without allocating.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // This process may have died before prctl; then no signal would ever come.
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_this_process(_cmd: &mut Command) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_comes_last_after_the_options() {
        let config = KvTransferConfig::named("mine");
        let args = probe_args(
            Path::new("-odd/libx.so"),
            &LoaderOptions { allow_insecure: true },
            Some(&config),
            None,
        )
        .unwrap();
        let args: Vec<String> = args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(args[..3], ["plugins", "probe", "--allow-insecure-plugins"]);
        assert_eq!(args[3], "--config-json");
        assert_eq!(KvTransferConfig::from_json(&args[4]).unwrap(), config);
        assert_eq!(args[5..], ["--", "-odd/libx.so"]);
        let plain = probe_args(Path::new("libx.so"), &LoaderOptions::default(), None, None).unwrap();
        assert_eq!(plain, ["plugins", "probe", "--", "libx.so"].map(OsString::from));
    }
}
