//! The server processes `kvconnect up` starts and keeps running: the same binary's `worker`
//! subcommand, one process each, all owned by one supervisor thread that lives exactly as
//! long as `up`.
//!
//! - Every server is forked from the supervisor thread, so the death signal it asks for
//!   (PR_SET_PDEATHSIG, which Linux ties to the *thread* that forked the child) fires when
//!   `up` dies and for no other reason.
//! - A server that exits, or whose `/health` says it is unhealthy (a poisoned connector) or
//!   stops answering, is restarted with backoff, logged with the reason. While it is down the
//!   proxy routes around it ([`Backends`]).
//! - A server that keeps failing right after it starts (a bad deployment, a port taken) makes
//!   `up` give up after [`RestartPolicy::max_quick_failures`] attempts in a row, with the
//!   server's error, instead of looping.
//! - Stopping sends SIGTERM to every server and waits (SIGKILL after a grace period); a server
//!   that had to be killed has its shared-memory segments (`/dev/shm/kvc-<pid>-*`) removed
//!   for it.

#![allow(unsafe_code)] // Signals server processes and sets their parent-death signal (libc).

use anyhow::{anyhow, bail, Context, Result};
use kvconnect_api::Role;
use kvconnect_openai::gate;
use kvconnect_proxy::backends::Backends;
use kvconnect_proxy::client;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How to start one server (kept to start it again).
#[derive(Debug, Clone)]
pub struct Launch {
    /// The deployment file.
    pub deployment: PathBuf,
    /// The server's `--role`.
    pub role: Role,
    /// Label in reports and addresses (`monolithic` for the comparison server).
    pub label: String,
    /// Negotiate jointly with the peer role's config.
    pub joint: bool,
    /// Engine id (the same across restarts).
    pub engine_id: String,
    /// KV blocks per cache group.
    pub num_blocks: u32,
    /// HTTP bind address.
    pub host: std::net::IpAddr,
    /// Whether the proxy routes to it (the comparison server is addressed directly).
    pub behind_proxy: bool,
    /// The API key it requires, handed over in its environment (never on its command line).
    pub api_key: Option<String>,
    /// The deployment's data-plane secret, handed over in its environment.
    pub secret: kvconnect_dataplane::auth::Secret,
    /// Decode: the producers it may load from (`--kv-producers`).
    pub kv_producers: Option<String>,
    /// Where it publishes its KV events, and its replay endpoint (`--kv-events-endpoint`,
    /// `--kv-events-replay-endpoint`; the same across restarts, so the proxy's subscriber
    /// finds the restarted worker where it was).
    pub kv_events: Option<(String, String)>,
}

/// When to restart and when to give up.
#[derive(Debug, Clone)]
pub struct RestartPolicy {
    /// How long a server may take to print its address line.
    pub ready_within: Duration,
    /// First wait before a restart; doubles per quick failure up to `max_backoff`.
    pub backoff: Duration,
    /// Longest wait before a restart.
    pub max_backoff: Duration,
    /// A server that fails within this long of being started failed quickly.
    pub quick: Duration,
    /// Quick failures in a row after which `up` gives up.
    pub max_quick_failures: u32,
    /// How often `/health` is asked.
    pub health_every: Duration,
    /// Unanswered `/health` probes in a row after which a server counts as hung.
    pub health_misses: u32,
    /// SIGTERM to SIGKILL.
    pub grace: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            ready_within: Duration::from_secs(60),
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(10),
            quick: Duration::from_secs(10),
            max_quick_failures: 5,
            health_every: Duration::from_secs(1),
            health_misses: 5,
            grace: Duration::from_secs(10),
        }
    }
}

/// A started server, as reported to `up`.
#[derive(Debug, Clone)]
pub struct Started {
    /// Its label.
    pub label: String,
    /// Its engine id.
    pub engine_id: String,
    /// `host:port` of its HTTP API.
    pub http: String,
    /// Its process id.
    pub pid: u32,
}

enum Control {
    Stop,
}

/// `up`'s end of the supervisor thread.
pub struct Supervisor {
    control: mpsc::Sender<Control>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Why the supervisor thread ended on its own.
pub type GaveUp = tokio::sync::oneshot::Receiver<String>;

impl Supervisor {
    /// Starts the supervisor thread, which starts every server in order. Returns once all
    /// are ready (or the first cannot start: then the others are stopped and its error is
    /// returned). `rt` runs the health probes. The returned receiver yields a message if
    /// the supervisor gives up on a server later.
    pub async fn start(
        launches: Vec<Launch>,
        backends: Arc<Backends>,
        policy: RestartPolicy,
        rt: tokio::runtime::Handle,
    ) -> Result<(Supervisor, Vec<Started>, GaveUp)> {
        let (control, control_rx) = mpsc::channel();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let (gave_up_tx, gave_up_rx) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("kvconnect-supervisor".into())
            .spawn(move || {
                let mut fleet =
                    Fleet { slots: Vec::new(), backends, policy, rt, control: control_rx, stopping: false };
                match fleet.start_all(launches) {
                    Ok(started) => {
                        let _ = ready_tx.send(Ok(started));
                        if let Some(why) = fleet.watch() {
                            let _ = gave_up_tx.send(why);
                        }
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
                fleet.stop_all();
            })
            .context("cannot start the supervisor thread")?;
        let sup = Supervisor { control, thread: Some(thread) };
        match ready_rx.await {
            Ok(Ok(started)) => Ok((sup, started, gave_up_rx)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(anyhow!("the supervisor thread ended while starting the workers")),
        }
    }

    /// Stops every server and waits for them (blocking).
    pub fn stop(&mut self) {
        let _ = self.control.send(Control::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One server slot: its launch, its current process, its restart bookkeeping.
struct Slot {
    launch: Launch,
    proc: Option<Proc>,
    quick_failures: u32,
    restart_at: Option<Instant>,
    health_misses: u32,
    last_health: Instant,
}

struct Proc {
    child: Child,
    http: String,
    started: Instant,
}

struct Fleet {
    slots: Vec<Slot>,
    backends: Arc<Backends>,
    policy: RestartPolicy,
    rt: tokio::runtime::Handle,
    control: mpsc::Receiver<Control>,
    stopping: bool,
}

/// What happened to a server the supervisor watches.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Exited(String),
    Unhealthy(String),
    Hung(u32),
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::Exited(status) => write!(f, "exited: {status}"),
            Event::Unhealthy(why) => write!(f, "reports itself unhealthy: {why}"),
            Event::Hung(n) => write!(f, "did not answer {n} health checks in a row"),
        }
    }
}

/// `exit status: 1` or `signal 9 (SIGKILL)`, for logs.
fn describe_exit(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(sig)) => format!("killed by signal {sig} ({})", signal_name(sig)),
        _ => s.to_string(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGINT => "SIGINT",
        _ => "another signal",
    }
}

/// The wait before restart number `failures` (1 = first quick failure; 0 = after a server
/// that had run for a while).
fn backoff(p: &RestartPolicy, failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    p.backoff.saturating_mul(1 << doublings).min(p.max_backoff)
}

impl Fleet {
    /// True once `up` asked to stop (remembered: the message is read once).
    fn stop_requested(&mut self) -> bool {
        if !self.stopping {
            self.stopping =
                matches!(self.control.try_recv(), Ok(Control::Stop) | Err(mpsc::TryRecvError::Disconnected));
        }
        self.stopping
    }

    fn start_all(&mut self, launches: Vec<Launch>) -> Result<Vec<Started>> {
        let mut started = Vec::new();
        for l in launches {
            let p = self.spawn(&l)?;
            if l.behind_proxy {
                self.backends.extend([(l.role, l.engine_id.clone(), p.http.clone())]);
            }
            started.push(Started {
                label: l.label.clone(),
                engine_id: l.engine_id.clone(),
                http: p.http.clone(),
                pid: p.child.id(),
            });
            self.slots.push(Slot {
                launch: l,
                proc: Some(p),
                quick_failures: 0,
                restart_at: None,
                health_misses: 0,
                last_health: Instant::now(),
            });
        }
        Ok(started)
    }

    /// Starts one server and waits for its address line.
    fn spawn(&mut self, l: &Launch) -> Result<Proc> {
        let exe =
            std::env::current_exe().context("cannot find this program's own path to start the workers")?;
        let mut cmd = Command::new(&exe);
        cmd.arg("worker")
            .arg("--deployment")
            .arg(&l.deployment)
            .args(["--role", l.role.name(), "--engine-id", &l.engine_id])
            .args(["--num-blocks", &l.num_blocks.to_string()])
            .args(["--host", &l.host.to_string(), "--port", "0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if l.joint {
            cmd.arg("--joint");
        }
        if let Some(k) = &l.api_key {
            cmd.env(gate::API_KEY_ENV[0], k);
        }
        cmd.env(kvconnect_dataplane::auth::SECRET_ENV, l.secret.to_text());
        if let Some(p) = &l.kv_producers {
            cmd.args(["--kv-producers", p]);
        }
        if let Some((endpoint, replay)) = &l.kv_events {
            cmd.args(["--kv-events-endpoint", endpoint, "--kv-events-replay-endpoint", replay]);
        }
        die_with_this_thread(&mut cmd);
        let mut child =
            cmd.spawn().with_context(|| format!("cannot start the {} worker {}", l.label, exe.display()))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("worker stdout was not captured"))?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            for line in lines.by_ref() {
                let Ok(line) = line else { break };
                if line.trim_start().starts_with('{') {
                    let _ = tx.send(line);
                    break;
                }
            }
            // Keep draining so the server never blocks on a full pipe.
            for _ in lines {}
        });
        let t0 = Instant::now();
        let line = loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => break line,
                Err(mpsc::RecvTimeoutError::Timeout) if t0.elapsed() < self.policy.ready_within => {
                    if self.stop_requested() {
                        stop_child(&mut child, &l.engine_id, Duration::from_secs(2));
                        bail!("stopped while the {} worker was starting", l.label);
                    }
                }
                Err(_) => {
                    let status = child.try_wait().ok().flatten();
                    stop_child(&mut child, &l.engine_id, Duration::from_secs(2));
                    match status {
                        Some(s) => bail!(
                            "the {} worker exited ({}) before it was ready; its error is above",
                            l.label,
                            describe_exit(s)
                        ),
                        None => bail!(
                            "the {} worker printed no address within {:?}",
                            l.label,
                            self.policy.ready_within
                        ),
                    }
                }
            }
        };
        let v: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("the {} worker's address line is not JSON: {line}", l.label))?;
        let http = v["http"]
            .as_str()
            .ok_or_else(|| anyhow!("the {} worker's address line has no http: {line}", l.label))?
            .to_owned();
        Ok(Proc { child, http, started: Instant::now() })
    }

    /// Watches until asked to stop (`None`) or until it gives up on a server (`Some(why)`).
    fn watch(&mut self) -> Option<String> {
        loop {
            std::thread::sleep(Duration::from_millis(100));
            if self.stop_requested() {
                return None;
            }
            for i in 0..self.slots.len() {
                if let Some(event) = self.check(i) {
                    self.take_down(i, &event);
                }
                if self.stop_requested() {
                    return None;
                }
                if let Err(why) = self.restart_if_due(i) {
                    return Some(why);
                }
            }
        }
    }

    /// Exit status, then (at most every `health_every`) the health probe.
    fn check(&mut self, i: usize) -> Option<Event> {
        let policy = self.policy.clone();
        let slot = &mut self.slots[i];
        let p = slot.proc.as_mut()?;
        if let Ok(Some(s)) = p.child.try_wait() {
            return Some(Event::Exited(describe_exit(s)));
        }
        if slot.last_health.elapsed() < policy.health_every {
            return None;
        }
        slot.last_health = Instant::now();
        let http = p.http.clone();
        let probe = self.rt.block_on(client::request(&http, "GET", "/health", None, Duration::from_secs(2)));
        let slot = &mut self.slots[i];
        match probe {
            Ok(r) if r.status == 200 => {
                slot.health_misses = 0;
                None
            }
            Ok(r) if r.status == 503 && r.json()["status"] == "unhealthy" => {
                let v = r.json();
                Some(Event::Unhealthy(v["reason"].as_str().unwrap_or("no reason given").to_owned()))
            }
            _ => {
                slot.health_misses += 1;
                (slot.health_misses >= policy.health_misses).then_some(Event::Hung(slot.health_misses))
            }
        }
    }

    /// Marks the server down, stops what is left of it and schedules its restart.
    fn take_down(&mut self, i: usize, event: &Event) {
        let policy = self.policy.clone();
        let slot = &mut self.slots[i];
        let Some(mut p) = slot.proc.take() else { return };
        let quick = p.started.elapsed() < policy.quick;
        slot.quick_failures = if quick { slot.quick_failures + 1 } else { 0 };
        let wait = backoff(&policy, slot.quick_failures);
        let l = &slot.launch;
        tracing::warn!(
            engine = %l.engine_id,
            "{} worker {} (pid {}) {event}; restarting it in {wait:?}",
            l.label,
            l.engine_id,
            p.child.id()
        );
        if l.behind_proxy {
            self.backends.set_down(&l.engine_id, &format!("{event}; restarting"));
        }
        stop_child(&mut p.child, &l.engine_id, policy.grace);
        slot.restart_at = Some(Instant::now() + wait);
        slot.health_misses = 0;
    }

    /// Restarts the server if its backoff is over; `Err` when it gives up on it.
    fn restart_if_due(&mut self, i: usize) -> Result<(), String> {
        let slot = &self.slots[i];
        if slot.restart_at.is_none_or(|t| Instant::now() < t) {
            return Ok(());
        }
        let l = slot.launch.clone();
        match self.spawn(&l) {
            Ok(p) => {
                tracing::warn!(
                    engine = %l.engine_id,
                    "{} worker {} restarted (pid {}, http {})",
                    l.label,
                    l.engine_id,
                    p.child.id(),
                    p.http
                );
                if l.behind_proxy {
                    self.backends.set_up(&l.engine_id, &p.http);
                }
                let slot = &mut self.slots[i];
                slot.proc = Some(p);
                slot.restart_at = None;
                slot.last_health = Instant::now();
                Ok(())
            }
            Err(e) => {
                let policy = self.policy.clone();
                let slot = &mut self.slots[i];
                slot.quick_failures += 1;
                if slot.quick_failures >= policy.max_quick_failures {
                    return Err(format!(
                        "the {} worker {} failed {} times in a row right after starting; giving up (last: \
                            {e:#})",
                        l.label, l.engine_id, slot.quick_failures
                    ));
                }
                let wait = backoff(&policy, slot.quick_failures);
                tracing::warn!(engine = %l.engine_id, "restarting the {} worker {} failed: {e:#}; trying \
                    again in {wait:?}", l.label, l.engine_id);
                slot.restart_at = Some(Instant::now() + wait);
                Ok(())
            }
        }
    }

    /// SIGTERM to every server at once, then waits for each (SIGKILL after the grace).
    fn stop_all(&mut self) {
        for s in &self.slots {
            if let Some(p) = &s.proc {
                signal(&p.child, libc::SIGTERM);
            }
        }
        for s in &mut self.slots {
            if let Some(mut p) = s.proc.take() {
                stop_child(&mut p.child, &s.launch.engine_id, self.policy.grace);
            }
        }
    }
}

/// The child gets SIGTERM when the thread that forks it exits, and refuses to start if this
/// process is already gone.
fn die_with_this_thread(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id();
        // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid only change or read this (forked, not
        // yet exec'd) process's own state; both are async-signal-safe and touch no memory.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect.
                if libc::getppid() as u32 != parent {
                    return Err(std::io::Error::other("kvconnect up exited while starting this worker"));
                }
                Ok(())
            });
        }
    }
}

fn signal(child: &Child, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) on a child this process spawned and has not reaped yet (reaping
        // happens only in stop_child, after which the child is dropped); no memory involved.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

fn stop_child(child: &mut Child, engine_id: &str, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        remove_segments(child.id());
        return;
    }
    signal(child, libc::SIGTERM);
    let t0 = Instant::now();
    while t0.elapsed() < grace {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    tracing::warn!(engine = %engine_id, "worker did not stop within {grace:?} of SIGTERM; killing it");
    let _ = child.kill();
    let _ = child.wait();
    remove_segments(child.id());
}

/// A server that was killed (or crashed) cannot unlink its segments.
fn remove_segments(pid: u32) {
    kvconnect_engine::shm::remove_segments_of(pid);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_the_first_quick_failure_up_to_the_cap() {
        let p = RestartPolicy::default();
        assert_eq!(backoff(&p, 0), Duration::from_millis(500));
        assert_eq!(backoff(&p, 1), Duration::from_millis(500));
        assert_eq!(backoff(&p, 2), Duration::from_secs(1));
        assert_eq!(backoff(&p, 4), Duration::from_secs(4));
        assert_eq!(backoff(&p, 6), Duration::from_secs(10));
        assert_eq!(backoff(&p, 1000), Duration::from_secs(10));
    }

    #[test]
    fn events_read_as_log_lines() {
        use std::os::unix::process::ExitStatusExt;
        let killed = std::process::ExitStatus::from_raw(libc::SIGKILL);
        assert_eq!(Event::Exited(describe_exit(killed)).to_string(), "exited: killed by signal 9 (SIGKILL)");
        let failed = std::process::ExitStatus::from_raw(2 << 8);
        assert_eq!(describe_exit(failed), "exit status 2");
        assert_eq!(
            Event::Unhealthy("connector 'x' is poisoned".into()).to_string(),
            "reports itself unhealthy: connector 'x' is poisoned"
        );
        assert_eq!(Event::Hung(5).to_string(), "did not answer 5 health checks in a row");
    }
}
