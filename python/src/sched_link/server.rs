//! The worker side: serves the connector's scheduler half on a Unix socket in a private
//! directory (mode 0700, removed when the server drops), one thread per connection. The
//! socket is reachable only by this user; vLLM's scheduler process is the one client.

use super::{read_frame, write_frame, Call, Reply};
use crate::error::AdapterError;
use kvconnect_api::error::Poison;
use kvconnect_api::{ConnectorError, MatchResult, SchedulerConnector};
use kvconnect_cache_dir::CacheDir;
use std::collections::{HashMap, HashSet};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What the served half decided, for the worker's stats.
#[derive(Debug, Default)]
pub struct SchedulerCounters {
    /// Requests allocated with tokens to load from outside (`num_external_tokens > 0`).
    pub external_requests: AtomicU64,
    /// Tokens those requests load instead of computing.
    pub external_tokens: AtomicU64,
    /// Requests allocated to load synchronously (matched with `async_load: false`): vLLM
    /// computes with their KV in the step that loads it and never waits for them, so the
    /// worker half keeps them out of what it reports finished or failed receiving. Taken
    /// out by the worker half as it reports each.
    pub sync_loads: Mutex<HashSet<String>>,
}

/// A scheduler half served to the scheduler process.
pub struct SchedulerServer {
    path: PathBuf,
    counters: Arc<SchedulerCounters>,
    /// The half's `matches_only_remote_prefills`.
    matches_only_remote_prefills: bool,
    // Kept for its lock; the directory and socket are removed on drop.
    dir: CacheDir,
}

impl SchedulerServer {
    /// Starts serving `conn` (named `name` in errors).
    pub fn start(name: &str, conn: Box<dyn SchedulerConnector>) -> Result<SchedulerServer, AdapterError> {
        let err = |m: String| {
            AdapterError::SideChannel(format!(
                "cannot serve the scheduler half to vLLM's scheduler process: {m}"
            ))
        };
        let dir = CacheDir::create_unique(&std::env::temp_dir(), "kvconnect-vllm-scheduler", "TMPDIR")
            .map_err(|e| err(e.to_string()))?;
        let path = dir.path().join("scheduler.sock");
        let listener = UnixListener::bind(&path).map_err(|e| err(format!("{}: {e}", path.display())))?;
        let matches_only_remote_prefills = conn.matches_only_remote_prefills();
        let conn = Arc::new(Mutex::new(Half { conn, poison: Poison::default() }));
        let counters = Arc::new(SchedulerCounters::default());
        let served = counters.clone();
        let name = name.to_owned();
        std::thread::Builder::new()
            .name("kvconnect-scheduler-half".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    let conn = conn.clone();
                    let name = name.clone();
                    let counters = served.clone();
                    let _ = std::thread::Builder::new()
                        .name("kvconnect-scheduler-conn".into())
                        .spawn(move || serve(&name, stream, &conn, &counters));
                }
            })
            .map_err(|e| err(e.to_string()))?;
        Ok(SchedulerServer { path, counters, matches_only_remote_prefills, dir })
    }

    /// Whether the half matches only decodes' requests (`SchedulerConnector::
    /// matches_only_remote_prefills`): the scheduler process then answers the others itself.
    pub fn matches_only_remote_prefills(&self) -> bool {
        self.matches_only_remote_prefills
    }

    /// What the half decided so far.
    pub fn counters(&self) -> &SchedulerCounters {
        &self.counters
    }

    /// The socket's path, for the scheduler process.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl Drop for SchedulerServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_dir_all(self.dir.path());
    }
}

/// The connector's scheduler half, and why it refuses every call from now on: a call of it
/// panicked (as a plugin's connector is poisoned behind the ABI). The panic's answer names
/// it; each later call answers `Poisoned` with the same message, and the link stays up.
struct Half {
    conn: Box<dyn SchedulerConnector>,
    poison: Poison,
}

fn serve(name: &str, mut stream: UnixStream, conn: &Mutex<Half>, counters: &SchedulerCounters) {
    // Each request's last match: whether its load would be synchronous.
    let mut matched_sync: HashMap<String, bool> = HashMap::new();
    loop {
        let frame = match read_frame(&mut stream) {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("kvconnect: the scheduler process's connection failed: {e}");
                return;
            }
        };
        let call: Call = match serde_json::from_slice(&frame) {
            Ok(c) => c,
            Err(e) => {
                let reply = Reply::Error(ConnectorError::invalid(
                    name,
                    format!(
                        "a scheduler call that cannot be read ({e}): run the same kvconnect in vLLM's \
                        scheduler and workers"
                    ),
                ));
                let _ = send(&mut stream, &reply, None);
                return;
            }
        };
        let method = call.method();
        let mut half = conn.lock().unwrap_or_else(|p| p.into_inner());
        let Half { conn: c, poison } = &mut *half;
        let r = poison.guard(name, method, || dispatch(c.as_mut(), call, &mut matched_sync, counters));
        drop(half);
        let (reply, extra) = match r {
            Ok(answer) => answer,
            Err(e) => {
                if let ConnectorError::Panicked { message, .. } = &e {
                    tracing::error!(
                        "kvconnect: connector '{name}' panicked in {method} (scheduler half): {message}"
                    );
                }
                (Reply::Error(e), None)
            }
        };
        if let Err(e) = send(&mut stream, &reply, extra.as_deref()) {
            tracing::warn!("kvconnect: cannot answer the scheduler process: {e}");
            return;
        }
    }
}

/// One call served by the connector's scheduler half: its answer, and a `Meta` answer's bytes.
fn dispatch(
    c: &mut dyn SchedulerConnector,
    call: Call,
    matched_sync: &mut HashMap<String, bool>,
    counters: &SchedulerCounters,
) -> Result<(Reply, Option<Vec<u8>>), ConnectorError> {
    match call {
        Call::Match { request, num_computed } => {
            let m = c.get_num_new_matched_tokens(&request, num_computed);
            if let Ok(MatchResult::Matched { tokens, async_load }) = &m {
                matched_sync.insert(request.id.0.clone(), *tokens > 0 && !async_load);
            }
            Ok((Reply::Matched(m?), None))
        }
        Call::Alloc { request, blocks, num_external } => {
            let r = c.update_state_after_alloc(&request, &blocks, num_external);
            let sync = matched_sync.remove(&request.id.0).unwrap_or(false);
            if r.is_ok() && num_external > 0 {
                counters.external_requests.fetch_add(1, Ordering::Relaxed);
                counters.external_tokens.fetch_add(num_external as u64, Ordering::Relaxed);
                if sync {
                    counters
                        .sync_loads
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(request.id.0.clone());
                }
            }
            r?;
            Ok((Reply::Done, None))
        }
        Call::Meta { step } => Ok((Reply::Meta, Some(c.build_connector_meta(&step)?))),
        Call::Finished { request, blocks } => {
            matched_sync.remove(&request.id.0);
            Ok((Reply::Finished(c.request_finished(&request, &blocks)?), None))
        }
        Call::Events => Ok((Reply::Events(c.take_events()?), None)),
        Call::Reset => Ok((Reply::Reset(c.reset_cache()?), None)),
    }
}

fn send(stream: &mut UnixStream, reply: &Reply, extra: Option<&[u8]>) -> std::io::Result<()> {
    let json = serde_json::to_vec(reply).map_err(std::io::Error::other)?;
    write_frame(stream, &json)?;
    if let Some(bytes) = extra {
        write_frame(stream, bytes)?;
    }
    Ok(())
}
