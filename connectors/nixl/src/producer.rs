//! The producer (prefill) side: keeps finished requests' blocks under a lease and serves them
//! over a small TCP control/data listener.
//!
//! One thread accepts, one thread per connection serves. A request's lease is renewed by
//! every heartbeat (`hold`) and read; it ends with the consumer's `done` or, when the
//! consumer never comes (killed decode, lost client), at expiry. Both end in
//! `finished_sending`, after which the host frees the blocks. A peer that sends an oversized
//! or malformed frame has its connection closed with a logged reason; others keep being
//! served.

use crate::wire::{read_frame, write_frame, ClientMsg, FrameError, ServerMsg, WireRun};
use kvconnect_api::geometry::{GeometryError, Span};
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{BlocksPerGroup, LayerId, RequestId};
use std::collections::{HashMap, VecDeque};
use std::io::{self, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How many freed request ids are remembered, to answer "freed" rather than "unknown".
const GONE_MEMORY: usize = 4096;

/// Producer settings.
#[derive(Debug, Clone)]
pub struct ProducerConfig {
    /// This engine's id (for messages).
    pub engine_id: String,
    /// Listener bind host.
    pub host: String,
    /// Listener port (0 = any).
    pub port: u16,
    /// Lease of a held request.
    pub lease: Duration,
    /// Timeout of each socket write and of reading a frame.
    pub io_timeout: Duration,
    /// How long a connection may sit idle between frames.
    pub idle_timeout: Duration,
    /// Control frame cap.
    pub max_frame: usize,
    /// How long a read for a request not (yet) held waits for it to appear: the consumer may
    /// come before this engine's next step hands it the finished request.
    pub unknown_grace: Duration,
}

/// Why a request's blocks are no longer held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gone {
    Done,
    Expired,
}

struct Held {
    deadline: Instant,
    /// Per region: merged byte intervals [start, end) of the request's blocks.
    allowed: Vec<Vec<(u64, u64)>>,
    active: u32,
}

#[derive(Default)]
struct State {
    held: HashMap<RequestId, Held>,
    finished: Vec<RequestId>,
    gone: HashMap<RequestId, Gone>,
    gone_order: VecDeque<RequestId>,
}

impl State {
    fn forget(&mut self, id: RequestId, why: Gone) {
        if self.gone.insert(id.clone(), why).is_none() {
            self.gone_order.push_back(id);
        }
        while self.gone_order.len() > GONE_MEMORY {
            if let Some(old) = self.gone_order.pop_front() {
                self.gone.remove(&old);
            }
        }
    }
}

struct Shared {
    mem: Arc<KvMemory>,
    cfg: ProducerConfig,
    state: Mutex<State>,
    cv: Condvar,
    stop: AtomicBool,
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A serving thread that panicked cannot leave State half-updated in a way that
        // matters more than losing the connector; keep serving.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn reason(&self, st: &State, id: &RequestId) -> String {
        match st.gone.get(id) {
            Some(Gone::Expired) => format!(
                "the blocks of request {id} were freed: its lease of {:.1}s expired before the consumer finished",
                self.cfg.lease.as_secs_f64()
            ),
            Some(Gone::Done) => format!("request {id} was already completed by a consumer and its blocks freed"),
            None => format!("request {id} is not held by engine '{}' (unknown request, or its blocks were freed)", self.cfg.engine_id),
        }
    }

    /// Waits (up to the grace period) for `id` to be held and marks a read in progress.
    fn acquire(&self, id: &RequestId) -> Result<(), String> {
        let give_up = Instant::now() + self.cfg.unknown_grace;
        let mut st = self.lock();
        loop {
            if let Some(h) = st.held.get_mut(id) {
                h.active += 1;
                h.deadline = Instant::now() + self.cfg.lease;
                return Ok(());
            }
            let now = Instant::now();
            if st.gone.contains_key(id) || now >= give_up || self.stop.load(Ordering::Relaxed) {
                return Err(self.reason(&st, id));
            }
            st = self.cv.wait_timeout(st, give_up - now).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
    }

    fn release(&self, id: &RequestId) {
        let mut st = self.lock();
        if let Some(h) = st.held.get_mut(id) {
            h.active = h.active.saturating_sub(1);
            h.deadline = Instant::now() + self.cfg.lease;
        }
    }

    fn check_runs(&self, id: &RequestId, runs: &[WireRun]) -> Result<u64, String> {
        let st = self.lock();
        let h = st.held.get(id).ok_or_else(|| self.reason(&st, id))?;
        let mut total = 0u64;
        for &(region, off, len) in runs {
            let end =
                off.checked_add(len).ok_or_else(|| format!("run ({region}, {off}, {len}) overflows"))?;
            let ok = h.allowed.get(region as usize).is_some_and(|iv| {
                let i = iv.partition_point(|&(_, e)| e <= off);
                iv.get(i).is_some_and(|&(s, e)| s <= off && end <= e)
            });
            if !ok || len == 0 {
                return Err(format!("run ({region}, {off}, {len}) is not inside the blocks of request {id}"));
            }
            total += len;
        }
        Ok(total)
    }
}

/// A running producer listener.
pub struct Producer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer").field("addr", &self.addr).finish()
    }
}

impl Producer {
    /// Binds the listener and starts serving reads of `mem`.
    pub fn start(mem: Arc<KvMemory>, cfg: ProducerConfig) -> io::Result<Producer> {
        let listener = TcpListener::bind((cfg.host.as_str(), cfg.port))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            mem,
            cfg,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
        });
        let s = shared.clone();
        let accept =
            std::thread::Builder::new().name("nixl-accept".into()).spawn(move || accept_loop(listener, s))?;
        tracing::debug!(%addr, "nixl producer listening");
        Ok(Producer { addr, shared, accept: Some(accept) })
    }

    /// The listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Keeps `blocks` of `request` for a consumer, under a fresh lease.
    pub fn hold(
        &self,
        request: RequestId,
        blocks: &BlocksPerGroup,
        groups: &[Vec<LayerId>],
    ) -> Result<(), GeometryError> {
        let g = self.shared.mem.geometry();
        let mut allowed: Vec<Vec<(u64, u64)>> = vec![Vec::new(); g.regions().len()];
        for (gi, ids) in blocks.0.iter().enumerate() {
            for &layer in groups.get(gi).map(Vec::as_slice).unwrap_or(&[]) {
                for part in 0..g.shape().kv_parts {
                    for &b in ids {
                        let Span { region, offset, len } = g.span(layer, part, b)?;
                        allowed[region].push((offset as u64, (offset + len) as u64));
                    }
                }
            }
        }
        for iv in &mut allowed {
            iv.sort_unstable();
            let mut merged: Vec<(u64, u64)> = Vec::with_capacity(iv.len());
            for &(s, e) in iv.iter() {
                match merged.last_mut() {
                    Some(last) if s <= last.1 => last.1 = last.1.max(e),
                    _ => merged.push((s, e)),
                }
            }
            *iv = merged;
        }
        let mut st = self.shared.lock();
        st.gone.remove(&request);
        st.held
            .insert(request, Held { deadline: Instant::now() + self.shared.cfg.lease, allowed, active: 0 });
        drop(st);
        self.shared.cv.notify_all();
        Ok(())
    }

    /// Requests whose blocks may now be freed: a consumer said done, or the lease expired.
    pub fn take_finished(&self) -> Vec<RequestId> {
        let now = Instant::now();
        let mut st = self.shared.lock();
        let expired: Vec<RequestId> = st
            .held
            .iter()
            .filter(|(_, h)| h.deadline <= now && h.active == 0)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            st.held.remove(&id);
            tracing::warn!(
                request = %id,
                lease_s = self.shared.cfg.lease.as_secs_f64(),
                "nixl: no consumer finished pulling request {id} within its lease; freeing its blocks"
            );
            st.forget(id.clone(), Gone::Expired);
            st.finished.push(id);
        }
        std::mem::take(&mut st.finished)
    }

    /// A consumer has the blocks of `request` (backend nixl: its NIXL notification arrived):
    /// ends the hold, so the request is reported finished. `Err` says why it was not held.
    pub fn complete(&self, request: &RequestId) -> Result<(), String> {
        let mut st = self.shared.lock();
        if st.held.remove(request).is_some() {
            st.forget(request.clone(), Gone::Done);
            st.finished.push(request.clone());
            Ok(())
        } else {
            Err(self.shared.reason(&st, request))
        }
    }

    /// Requests currently held.
    pub fn held(&self) -> usize {
        self.shared.lock().held.len()
    }

    /// Stops accepting, closes every connection.
    pub fn shutdown(&mut self) {
        if self.shared.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        self.shared.cv.notify_all();
        // Wake the accept loop; it checks `stop` after every accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(500));
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        let conns = std::mem::take(&mut *self.shared.conns.lock().unwrap_or_else(|p| p.into_inner()));
        for (_, c) in conns {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("nixl producer: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone() {
            shared.conns.lock().unwrap_or_else(|p| p.into_inner()).insert(id, clone);
        }
        let s = shared.clone();
        let spawned = std::thread::Builder::new().name("nixl-serve".into()).spawn(move || {
            let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
            if let Err(reason) = serve(stream, &s) {
                tracing::warn!(peer = %peer, "nixl producer: closing connection from {peer}: {reason}");
            }
            s.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        });
        if let Err(e) = spawned {
            tracing::warn!("nixl producer: cannot start a serving thread: {e}");
        }
    }
}

/// Serves one connection until it closes; `Err` carries the reason it was closed early.
fn serve(stream: TcpStream, s: &Shared) -> Result<(), String> {
    let cfg = &s.cfg;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(cfg.io_timeout)).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(cfg.idle_timeout)).map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let mut w = stream;
    loop {
        let msg: ClientMsg = match read_frame(&mut reader, cfg.max_frame) {
            Ok(m) => m,
            Err(FrameError::Closed) => return Ok(()),
            Err(e @ (FrameError::TooLarge { .. } | FrameError::Malformed(_))) => return Err(e.to_string()),
            Err(FrameError::Io(e)) if s.stop.load(Ordering::Relaxed) => {
                return Err(format!("shutting down ({e})"))
            }
            Err(FrameError::Io(e)) => return Err(format!("reading a request: {e}")),
        };
        let send = |w: &mut TcpStream, m: ServerMsg| {
            write_frame(w, &m).map_err(|e| format!("writing an answer: {e}"))
        };
        match msg {
            ClientMsg::Hold { request } => {
                let id = RequestId(request);
                let answer = match s.acquire(&id) {
                    Ok(()) => {
                        s.release(&id);
                        ServerMsg::Ok
                    }
                    Err(reason) => ServerMsg::Error { reason },
                };
                send(&mut w, answer)?;
            }
            ClientMsg::Check { request, runs } => {
                let id = RequestId(request);
                let answer = match s.acquire(&id) {
                    Ok(()) => {
                        let checked = s.check_runs(&id, &runs);
                        s.release(&id);
                        match checked {
                            Ok(_) => ServerMsg::Ok,
                            Err(reason) => ServerMsg::Error { reason },
                        }
                    }
                    Err(reason) => ServerMsg::Error { reason },
                };
                send(&mut w, answer)?;
            }
            ClientMsg::Done { request } => {
                let id = RequestId(request);
                let mut st = s.lock();
                let answer = if st.held.remove(&id).is_some() {
                    st.forget(id.clone(), Gone::Done);
                    st.finished.push(id);
                    ServerMsg::Ok
                } else {
                    ServerMsg::Error { reason: s.reason(&st, &id) }
                };
                drop(st);
                send(&mut w, answer)?;
            }
            ClientMsg::Read { request, runs } => {
                let id = RequestId(request);
                if let Err(reason) = s.acquire(&id) {
                    send(&mut w, ServerMsg::Error { reason })?;
                    continue;
                }
                let result = stream_runs(&mut w, s, &id, &runs);
                s.release(&id);
                match result {
                    Ok(()) => {}
                    Err(StreamError::Refused(reason)) => send(&mut w, ServerMsg::Error { reason })?,
                    Err(StreamError::Io(e)) => return Err(format!("sending blocks of request {id}: {e}")),
                }
            }
        }
    }
}

enum StreamError {
    Refused(String),
    Io(io::Error),
}

fn stream_runs(w: &mut TcpStream, s: &Shared, id: &RequestId, runs: &[WireRun]) -> Result<(), StreamError> {
    let total = s.check_runs(id, runs).map_err(StreamError::Refused)?;
    let mut slices = Vec::with_capacity(runs.len());
    for &(region, off, len) in runs {
        let span = Span { region: region as usize, offset: off as usize, len: len as usize };
        let bytes = s.mem.slice(span).map_err(|e| StreamError::Refused(e.to_string()))?;
        slices.push(bytes);
    }
    write_frame(w, &ServerMsg::Data { bytes: total }).map_err(StreamError::Io)?;
    for b in slices {
        w.write_all(b).map_err(StreamError::Io)?;
    }
    w.flush().map_err(StreamError::Io)
}
