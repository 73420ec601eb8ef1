//! The worker processes `kvconnect up` starts: the same binary's `worker` subcommand, one
//! process each. Every child dies with its parent (PR_SET_PDEATHSIG on Linux), is stopped
//! with SIGTERM and waited for (SIGKILL after a grace period), and a child that had to be
//! killed has its shared-memory segments (`/dev/shm/kvc-<pid>-*`) removed for it.

use anyhow::{anyhow, bail, Context, Result};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A worker process and the addresses it printed.
pub struct WorkerProc {
    /// prefill, decode, or monolithic.
    pub role: String,
    /// Its engine id.
    pub engine_id: String,
    /// `host:port` of its HTTP API.
    pub http: String,
    child: Child,
}

impl WorkerProc {
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// The children of one `kvconnect up`.
#[derive(Default)]
pub struct Supervisor {
    /// Started workers, in start order.
    pub workers: Vec<WorkerProc>,
}

/// How to start one worker.
pub struct Launch<'a> {
    /// The deployment file.
    pub deployment: &'a Path,
    /// `prefill` or `decode` (the worker's `--role`).
    pub role: &'a str,
    /// Label in reports (`monolithic` for the comparison worker).
    pub label: &'a str,
    /// Negotiate jointly with the peer role's config.
    pub joint: bool,
    /// Engine id.
    pub engine_id: String,
    /// KV blocks per cache group.
    pub num_blocks: u32,
    /// HTTP bind address.
    pub host: std::net::IpAddr,
}

impl Supervisor {
    /// Starts `kvconnect worker` and waits (up to `within`) for its address line.
    pub fn start(&mut self, l: &Launch<'_>, within: Duration) -> Result<&WorkerProc> {
        let exe =
            std::env::current_exe().context("cannot find this program's own path to start the workers")?;
        let mut cmd = Command::new(&exe);
        cmd.arg("worker")
            .arg("--deployment")
            .arg(l.deployment)
            .args(["--role", l.role, "--engine-id", &l.engine_id])
            .args(["--num-blocks", &l.num_blocks.to_string()])
            .args(["--host", &l.host.to_string(), "--port", "0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if l.joint {
            cmd.arg("--joint");
        }
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl(PR_SET_PDEATHSIG) only changes this (forked, not yet exec'd)
            // process's own death signal; it is async-signal-safe and touches no memory.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child =
            cmd.spawn().with_context(|| format!("cannot start {} worker {}", l.role, exe.display()))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("worker stdout was not captured"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            for line in lines.by_ref() {
                let Ok(line) = line else { break };
                if line.trim_start().starts_with('{') {
                    let _ = tx.send(line);
                    break;
                }
            }
            // Keep draining so the worker never blocks on a full pipe.
            for _ in lines {}
        });
        let mut proc = WorkerProc {
            role: l.label.to_owned(),
            engine_id: l.engine_id.clone(),
            http: String::new(),
            child,
        };
        let line = match rx.recv_timeout(within) {
            Ok(line) => line,
            Err(_) => {
                let status = proc.child.try_wait().ok().flatten();
                stop_one(&mut proc, Duration::from_secs(2));
                match status {
                    Some(s) => {
                        bail!("the {} worker exited ({s}) before it was ready; its error is above", l.label)
                    }
                    None => bail!("the {} worker printed no address within {within:?}", l.label),
                }
            }
        };
        let v: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("the {} worker's address line is not JSON: {line}", l.label))?;
        proc.http = v["http"]
            .as_str()
            .ok_or_else(|| anyhow!("the {} worker's address line has no http: {line}", l.label))?
            .to_owned();
        self.workers.push(proc);
        self.workers.last().ok_or_else(|| anyhow!("worker list is empty right after a push"))
    }

    /// HTTP addresses of the workers with this label.
    pub fn addresses(&self, label: &str) -> Vec<String> {
        self.workers.iter().filter(|w| w.role == label).map(|w| w.http.clone()).collect()
    }

    /// True when a child has exited.
    pub fn any_exited(&mut self) -> Option<String> {
        self.workers.iter_mut().find_map(|w| {
            matches!(w.child.try_wait(), Ok(Some(_))).then(|| format!("{} ({})", w.engine_id, w.role))
        })
    }

    /// SIGTERM to every child at once, then waits for each (SIGKILL after `grace`).
    pub fn stop(&mut self, grace: Duration) {
        for w in &self.workers {
            signal(w, libc::SIGTERM);
        }
        for w in &mut self.workers {
            stop_one(w, grace);
        }
        self.workers.clear();
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}

fn signal(w: &WorkerProc, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(w.child.id()) {
        // SAFETY: kill(2) on a child this process spawned and has not reaped yet (reaping
        // happens only in stop_one, after which the worker is dropped); no memory involved.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

fn stop_one(w: &mut WorkerProc, grace: Duration) {
    if let Ok(Some(_)) = w.child.try_wait() {
        return;
    }
    signal(w, libc::SIGTERM);
    let t0 = Instant::now();
    while t0.elapsed() < grace {
        if let Ok(Some(_)) = w.child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    tracing::warn!(engine = %w.engine_id, "worker did not stop within {grace:?} of SIGTERM; killing it");
    let _ = w.child.kill();
    let _ = w.child.wait();
    // A killed worker cannot unlink its segments.
    let prefix = format!("kvc-{}-", w.child.id());
    if let Ok(d) = std::fs::read_dir("/dev/shm") {
        for e in d.filter_map(|e| e.ok()) {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}
