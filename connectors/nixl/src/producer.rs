//! The producer (prefill) side: keeps finished requests' blocks under a lease and serves them
//! over a small TCP control/data listener.
//!
//! One thread accepts, one thread per connection serves, up to `max_connections`. Every
//! connection first proves the deployment's secret (ARCHITECTURE.md §10) and every request
//! names its transfer capability. A request's lease is renewed by every heartbeat (`hold`)
//! and read, never past `lease_max` from when it was first held: past it every `hold`,
//! `pin` and `read` is refused (counted as `lease_cap`), and each read in flight has a
//! whole deadline bounded by the request's bytes, so no consumer keeps blocks past the cap
//! plus one read. A request ends with the consumer's `done` (once no read of it is in
//! flight) or, when the consumer never comes (killed decode, lost client), at expiry. Both
//! end in `finished_sending`, after which the host frees the blocks. A peer that fails the
//! challenge, names a wrong capability, sends an oversized, malformed or dripping frame, or
//! comes past the connection cap is refused, counted by reason ([`Producer::refusals`], and
//! the worker's `metrics` for the host's `/metrics`) and logged; others keep being served.

use crate::wire::{
    read_frame_within, write_frame, ClientMsg, DeadlineWriter, FrameError, ServerMsg, WireRun, CHANNEL,
};
use kvconnect_api::geometry::{GeometryError, Span};
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{BlockId, BlocksPerGroup, ConnectorMetric, LayerId, RequestId, KV_HOLDS_ENDED};
use kvconnect_dataplane::auth::{self, Secret, Side};
use std::collections::{HashMap, VecDeque};
use std::io::{self, BufReader, IoSlice, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
    /// The deployment's secret; `None` only on loopback.
    pub secret: Option<Secret>,
    /// The longest a request is held from its first hold, renewals included.
    pub lease_max: Duration,
    /// Connections served at once.
    pub max_connections: usize,
    /// Whether `read` is served (backend tcp); other backends copy without it.
    pub serve_reads: bool,
    /// Send and receive buffer of each connection, bytes (0: the kernel's autotuning).
    pub socket_buffer: usize,
}

/// Why the listener refused a peer, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No proof of the secret, or a wrong one.
    Unauthenticated,
    /// A request named with a capability that is not its own.
    BadCapability,
    /// A frame that is not a message of the protocol.
    Malformed,
    /// A frame over the cap.
    Oversized,
    /// A frame that did not arrive whole within its deadline (a challenge never answered, a
    /// frame stalled half-way), or an answer (a Read's blocks included) its peer did not take
    /// whole within its deadline. A connection idle between frames past `idle_timeout` is
    /// closed without a refusal.
    Timeout,
    /// A connection closed in the middle of a frame.
    Truncated,
    /// A connection past the cap.
    TooManyConnections,
    /// A `read` to a producer whose backend does not serve reads.
    ReadNotServed,
    /// A `hold`, `pin` or `read` of a request held for `lease_max` already.
    LeaseCap,
}

impl Refusal {
    /// Every reason, in the order counted.
    pub const ALL: [Refusal; 9] = [
        Refusal::Unauthenticated,
        Refusal::BadCapability,
        Refusal::Malformed,
        Refusal::Oversized,
        Refusal::Timeout,
        Refusal::Truncated,
        Refusal::TooManyConnections,
        Refusal::ReadNotServed,
        Refusal::LeaseCap,
    ];

    /// The reason's name in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Refusal::Unauthenticated => "unauthenticated",
            Refusal::BadCapability => "bad_capability",
            Refusal::Malformed => "malformed",
            Refusal::Oversized => "oversized",
            Refusal::Timeout => "timeout",
            Refusal::Truncated => "truncated",
            Refusal::TooManyConnections => "too_many_connections",
            Refusal::ReadNotServed => "read_not_served",
            Refusal::LeaseCap => "lease_cap",
        }
    }
}

/// Refusals of one producer, by reason.
#[derive(Debug, Default)]
pub struct Refusals([AtomicU64; 9]);

impl Refusals {
    fn count(&self, r: Refusal) {
        if let Some(i) = Refusal::ALL.iter().position(|x| *x == r) {
            self.0[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// (reason, count) for every reason.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        Refusal::ALL.iter().zip(&self.0).map(|(r, n)| (r.name(), n.load(Ordering::Relaxed))).collect()
    }
}

/// Why a request's blocks are no longer held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gone {
    Done,
    Expired,
}

impl Gone {
    const ALL: [Gone; 2] = [Gone::Done, Gone::Expired];

    /// The `how` label of `kvconnect_kv_holds_ended`.
    fn name(self) -> &'static str {
        match self {
            Gone::Done => "done",
            Gone::Expired => "expired",
        }
    }
}

struct Held {
    deadline: Instant,
    /// No renewal moves `deadline` past this.
    cap: Instant,
    capability: String,
    /// Per region: merged byte intervals [start, end) of the request's blocks.
    allowed: Vec<Vec<(u64, u64)>>,
    /// Bytes of those intervals: what one read of the whole request sends.
    bytes: u64,
    /// The request's blocks per KV cache group, sorted (what a `Check` names).
    blocks: Vec<Vec<BlockId>>,
    /// Reads in flight.
    active: u32,
    /// Consumer ranks that read the request (`DoneBy`), once one said how many.
    readers: Option<u32>,
    /// Those that said they have their share.
    done_by: Vec<u32>,
}

#[derive(Default)]
struct State {
    held: HashMap<RequestId, Held>,
    finished: Vec<RequestId>,
    gone: HashMap<RequestId, Gone>,
    gone_order: VecDeque<RequestId>,
    /// Holds ended since the producer started, by [`Gone::ALL`]'s order.
    ended: [u64; 2],
}

impl State {
    /// `id`'s hold ended, for `why`: remembered for a while, so that a late consumer is told
    /// why, and counted.
    fn forget(&mut self, id: RequestId, why: Gone) {
        self.ended[why as usize] += 1;
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
    open: AtomicUsize,
    refusals: Arc<Refusals>,
}

/// A request's answer, and the reason it counts as a refusal, if it does.
type Refused = (String, Option<Refusal>);

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A serving thread that panicked cannot leave State half-updated in a way that
        // matters more than losing the connector; keep serving.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn reason(&self, st: &State, id: &RequestId) -> String {
        match st.gone.get(id) {
            Some(Gone::Expired) => format!(
                "the blocks of request {id} were freed: its lease of {:.1}s expired before the consumer \
                    finished",
                self.cfg.lease.as_secs_f64()
            ),
            Some(Gone::Done) => format!(
                "request {id} was already completed by a consumer and its blocks \
                freed"
            ),
            None => format!(
                "request {id} is not held by engine '{}' (unknown request, or its blocks were \
                freed)",
                self.cfg.engine_id
            ),
        }
    }

    fn wrong_capability(&self, id: &RequestId) -> Refused {
        (
            format!(
                "request {id}: the transfer capability does not match the one engine '{}' issued for it; \
                forward kv_transfer_params as prefill returned them",
                self.cfg.engine_id
            ),
            Some(Refusal::BadCapability),
        )
    }

    fn past_cap(&self, id: &RequestId) -> Refused {
        (
            format!(
                "request {id}: engine '{}' has held its blocks for kv_lease_max = {:.1}s since it first held \
                    them; it serves no more reads or renewals of them and frees them once the reads in \
                    flight end; pull sooner, or raise kv_lease_max on the producer",
                self.cfg.engine_id,
                self.cfg.lease_max.as_secs_f64()
            ),
            Some(Refusal::LeaseCap),
        )
    }

    /// Waits (up to the grace period) for `id` to be held, checks `capability`, and marks a
    /// read in progress; past the lease cap it refuses. Returns the request's bytes (what a
    /// read of all of it sends).
    fn acquire(&self, id: &RequestId, capability: &str) -> Result<u64, Refused> {
        let give_up = Instant::now() + self.cfg.unknown_grace;
        let mut st = self.lock();
        loop {
            if let Some(h) = st.held.get_mut(id) {
                if !auth::same_secret(&h.capability, capability) {
                    return Err(self.wrong_capability(id));
                }
                let now = Instant::now();
                if now >= h.cap {
                    return Err(self.past_cap(id));
                }
                h.active += 1;
                h.deadline = (now + self.cfg.lease).min(h.cap);
                return Ok(h.bytes);
            }
            let now = Instant::now();
            if st.gone.contains_key(id) || now >= give_up || self.stop.load(Ordering::Relaxed) {
                return Err((self.reason(&st, id), None));
            }
            st = self.cv.wait_timeout(st, give_up - now).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
    }

    fn release(&self, id: &RequestId) {
        let mut st = self.lock();
        if let Some(h) = st.held.get_mut(id) {
            h.active = h.active.saturating_sub(1);
            h.deadline = (Instant::now() + self.cfg.lease).min(h.cap);
        }
        drop(st);
        self.cv.notify_all();
    }

    /// Records that consumer rank `reader` of `readers` has its share of `id`: true once
    /// every reader has (the hold may then end), false while some have not.
    fn reader_done(
        &self,
        id: &RequestId,
        capability: &str,
        reader: u32,
        readers: u32,
    ) -> Result<bool, Refused> {
        let mut st = self.lock();
        let Some(h) = st.held.get_mut(id) else { return Err((self.reason(&st, id), None)) };
        if !auth::same_secret(&h.capability, capability) {
            return Err(self.wrong_capability(id));
        }
        let malformed = |why: String| Err((format!("request {id}: {why}"), Some(Refusal::Malformed)));
        if readers == 0 || readers > crate::wire::MAX_READERS || reader >= readers {
            return malformed(format!(
                "reader {reader} of {readers}: a reader's index must be below the count, at most {}",
                crate::wire::MAX_READERS
            ));
        }
        match h.readers {
            Some(n) if n != readers => {
                return malformed(format!(
                    "one consumer rank said {n} ranks read it, another {readers}: run every decode rank with \
                        the same tp_size"
                ))
            }
            _ => h.readers = Some(readers),
        }
        if !h.done_by.contains(&reader) {
            h.done_by.push(reader);
        }
        Ok(h.done_by.len() as u32 >= readers)
    }

    /// Ends the hold of `id` for a consumer that has its blocks: waits (up to the io timeout)
    /// for reads of it in flight to end, so no block is freed while it is being sent. With
    /// `reader` (`(index, readers)`), only once every reader has said so.
    fn complete(&self, id: &RequestId, capability: &str, reader: Option<(u32, u32)>) -> Result<(), Refused> {
        if let Some((r, n)) = reader {
            if !self.reader_done(id, capability, r, n)? {
                return Ok(());
            }
        }
        let give_up = Instant::now() + self.cfg.io_timeout;
        let mut st = self.lock();
        loop {
            let Some(h) = st.held.get(id) else { return Err((self.reason(&st, id), None)) };
            if !auth::same_secret(&h.capability, capability) {
                return Err(self.wrong_capability(id));
            }
            if h.active == 0 {
                st.held.remove(id);
                st.forget(id.clone(), Gone::Done);
                st.finished.push(id.clone());
                return Ok(());
            }
            let now = Instant::now();
            if now >= give_up || self.stop.load(Ordering::Relaxed) {
                return Err((
                    format!(
                        "request {id}: reads of its blocks are still in flight after {:.1}s; not freeing \
                        them under a read",
                        self.cfg.io_timeout.as_secs_f64()
                    ),
                    None,
                ));
            }
            st = self.cv.wait_timeout(st, give_up - now).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// `pin`, for a consumer that copies without this listener seeing the reads: waits for
    /// the hold as a read does, checks the capability, renews the lease, and checks that
    /// every block of `blocks` (per KV cache group) is one of request `id`'s. Returns how
    /// long the hold lasts at least from now (the lease left: a hold ends before it only by
    /// the consumer's `done`).
    fn pin(&self, id: &RequestId, capability: &str, blocks: &[Vec<BlockId>]) -> Result<Duration, Refused> {
        self.acquire(id, capability)?;
        let checked = self.blocks_of(id, blocks);
        self.release(id);
        checked.map_err(|reason| (reason, None))?;
        let st = self.lock();
        let h = st.held.get(id).ok_or_else(|| (self.reason(&st, id), None))?;
        Ok(h.deadline.saturating_duration_since(Instant::now()))
    }

    fn blocks_of(&self, id: &RequestId, blocks: &[Vec<BlockId>]) -> Result<(), String> {
        let st = self.lock();
        let h = st.held.get(id).ok_or_else(|| self.reason(&st, id))?;
        if blocks.len() > h.blocks.len() {
            return Err(format!(
                "request {id} holds blocks in {} KV cache group(s), but the consumer names {}: both sides \
                    must run the same model",
                h.blocks.len(),
                blocks.len()
            ));
        }
        for (g, ids) in blocks.iter().enumerate() {
            if let Some(b) = ids.iter().find(|b| h.blocks[g].binary_search(b).is_err()) {
                return Err(format!(
                    "block {} of KV cache group {g} is not one of request {id}'s blocks: the load read \
                        another request's blocks and fails",
                    b.0
                ));
            }
        }
        Ok(())
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
    /// Binds the listener and starts serving reads of `mem`. Without a secret it binds
    /// loopback only.
    pub fn start(mem: Arc<KvMemory>, cfg: ProducerConfig) -> io::Result<Producer> {
        let listener = TcpListener::bind((cfg.host.as_str(), cfg.port))?;
        let addr = listener.local_addr()?;
        if cfg.secret.is_none() && !addr.ip().is_loopback() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "the producer listener would accept connections beyond loopback ({addr}) without a \
                    data-plane secret, letting any host read this engine's KV; set \
                    KVCONNECT_SIDE_CHANNEL_TOKEN (at least {} random bytes, the same on every worker of the \
                    deployment) or pass --secret-file, or bind host 127.0.0.1",
                    auth::MIN_SECRET_BYTES
                ),
            ));
        }
        let refusals = Arc::new(Refusals::default());
        let shared = Arc::new(Shared {
            mem,
            cfg,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            open: AtomicUsize::new(0),
            refusals,
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

    /// The listener's refusals by reason.
    pub fn refusals(&self) -> Vec<(&'static str, u64)> {
        self.shared.refusals.snapshot()
    }

    /// Holds ended since the producer started, by how: `("done", n)`, a consumer finished
    /// reading; `("expired", n)`, no consumer finished within the lease (it never pulled, or
    /// its `done` was lost), so the blocks were held until then.
    pub fn holds_ended(&self) -> Vec<(&'static str, u64)> {
        let ended = self.shared.lock().ended;
        Gone::ALL.iter().map(|g| (g.name(), ended[*g as usize])).collect()
    }

    /// The listener's refusals and the holds ended as the host's `/metrics` shows them: one
    /// `kvconnect_data_plane_refused` sample per reason, labelled `listener="producer"`, and
    /// one `kvconnect_kv_holds_ended` sample per way a hold ends (`how`).
    pub fn metrics(&self) -> Vec<ConnectorMetric> {
        const HELP: &str = "Peers the data plane refused, by listener and reason.";
        const ENDED_HELP: &str = "Requests whose blocks this prefill engine held for a consumer, by how \
            the hold ended: done (the consumer finished reading) or expired (no consumer finished within \
            the lease; the blocks were held until then).";
        let refused = self.refusals().into_iter().map(|(reason, v)| {
            ConnectorMetric::counter("kvconnect_data_plane_refused", HELP, v)
                .label("listener", "producer")
                .label("reason", reason)
        });
        let ended = self
            .holds_ended()
            .into_iter()
            .map(|(how, v)| ConnectorMetric::counter(KV_HOLDS_ENDED, ENDED_HELP, v).label("how", how));
        refused.chain(ended).collect()
    }

    /// Keeps `blocks` of `request` for a consumer that names `capability`, under a fresh lease.
    pub fn hold(
        &self,
        request: RequestId,
        capability: String,
        blocks: &BlocksPerGroup,
        groups: &[Vec<LayerId>],
    ) -> Result<(), GeometryError> {
        let g = self.shared.mem.geometry();
        let mut allowed: Vec<Vec<(u64, u64)>> = vec![Vec::new(); g.regions().len() + g.state().regions.len()];
        for (gi, ids) in blocks.0.iter().enumerate() {
            for &layer in groups.get(gi).map(Vec::as_slice).unwrap_or(&[]) {
                if g.state().holds(layer) {
                    for &slot in ids {
                        let Span { region, offset, len } = g.state().span(layer, slot)?;
                        allowed[region].push((offset as u64, (offset + len) as u64));
                    }
                    continue;
                }
                for (rank, part) in g.held_ranks().flat_map(|r| (0..g.shape().kv_parts).map(move |p| (r, p)))
                {
                    for &b in ids {
                        let Span { region, offset, len } = g.rank_span(rank, layer, part, b)?;
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
        let bytes = allowed.iter().flatten().map(|(s, e)| e - s).sum();
        let mut st = self.shared.lock();
        st.gone.remove(&request);
        let now = Instant::now();
        let cap = now + self.shared.cfg.lease_max;
        let deadline = (now + self.shared.cfg.lease).min(cap);
        let blocks = blocks
            .0
            .iter()
            .map(|ids| {
                let mut ids = ids.clone();
                ids.sort_unstable();
                ids
            })
            .collect();
        let held = Held {
            deadline,
            cap,
            capability,
            allowed,
            bytes,
            blocks,
            active: 0,
            readers: None,
            done_by: Vec::new(),
        };
        st.held.insert(request, held);
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

    /// A consumer naming `capability` has the blocks of `request` (backend nixl: its NIXL
    /// notification arrived): ends the hold once no read of it is in flight, so the request
    /// is reported finished. `Err` says why it was not ended.
    pub fn complete(&self, request: &RequestId, capability: &str) -> Result<(), String> {
        self.shared.complete(request, capability, None).map_err(|(reason, refusal)| {
            if let Some(r) = refusal {
                self.shared.refusals.count(r);
            }
            reason
        })
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
        if shared.open.fetch_add(1, Ordering::SeqCst) >= shared.cfg.max_connections {
            shared.open.fetch_sub(1, Ordering::SeqCst);
            shared.refusals.count(Refusal::TooManyConnections);
            tracing::warn!(
                "nixl producer: refusing a connection from {}: {} connections are open, the cap",
                stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into()),
                shared.cfg.max_connections
            );
            let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
            let mut w = stream;
            let reason = format!(
                "engine '{}' serves at most {} connections at once; try again later",
                shared.cfg.engine_id, shared.cfg.max_connections
            );
            let _ = write_frame(&mut w, &ServerMsg::Error { reason });
            continue;
        }
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
            s.open.fetch_sub(1, Ordering::SeqCst);
        });
        if let Err(e) = spawned {
            shared.open.fetch_sub(1, Ordering::SeqCst);
            shared.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            tracing::warn!("nixl producer: cannot start a serving thread: {e}");
        }
    }
}

fn frame_refusal(e: FrameError, stopping: bool) -> Refused {
    match e {
        FrameError::TooLarge { .. } => (e.to_string(), Some(Refusal::Oversized)),
        FrameError::Malformed(_) => (e.to_string(), Some(Refusal::Malformed)),
        FrameError::Closed => ("closed".into(), None),
        // Where a frame is due (the answer to the challenge): a peer that sends nothing.
        FrameError::Idle(_) => (format!("the peer sent nothing: {e}"), Some(Refusal::Timeout)),
        FrameError::Io(e) if stopping => (format!("shutting down ({e})"), None),
        FrameError::Io(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
            (format!("reading a request: {e}"), Some(Refusal::Timeout))
        }
        FrameError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            (format!("the connection closed in the middle of a frame ({e})"), Some(Refusal::Truncated))
        }
        FrameError::Io(e) => (format!("reading a request: {e}"), None),
    }
}

/// A write that failed at its deadline (the peer reads too slowly, or not at all) is a
/// `timeout`; other failures (the peer went away) are no refusal.
fn write_refusal(e: &io::Error) -> Option<Refusal> {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut).then_some(Refusal::Timeout)
}

/// The challenge-response that opens every connection; `Err` closes it.
fn authenticate(reader: &mut BufReader<TcpStream>, w: &mut TcpStream, s: &Shared) -> Result<(), Refused> {
    let cfg = &s.cfg;
    let server_nonce = auth::nonce().map_err(|e| (e.to_string(), None))?;
    let within = Instant::now() + cfg.io_timeout;
    write_frame(
        &mut DeadlineWriter { stream: w, deadline: within },
        &ServerMsg::Challenge { nonce: server_nonce.clone() },
    )
    .map_err(|e| (format!("sending the challenge: {e}"), None))?;
    let first: ClientMsg = read_frame_within(reader, cfg.max_frame, cfg.io_timeout, cfg.io_timeout)
        .map_err(|e| frame_refusal(e, s.stop.load(Ordering::Relaxed)))?;
    let refuse = |w: &mut TcpStream, why: String| {
        s.refusals.count(Refusal::Unauthenticated);
        let _ = write_frame(
            &mut DeadlineWriter { stream: w, deadline: within },
            &ServerMsg::Error { reason: why.clone() },
        );
        Err((why, None))
    };
    let ClientMsg::Auth { nonce, proof } = first else {
        return refuse(
            w,
            format!(
                "engine '{}' answers only peers that prove the deployment's data-plane \
            secret first; this peer sent a request without it",
                cfg.engine_id
            ),
        );
    };
    if !auth::verify(cfg.secret.as_ref(), CHANNEL, Side::Client, &server_nonce, &nonce, &proof) {
        return refuse(
            w,
            format!(
                "engine '{}': the proof of the data-plane secret is wrong; give every \
            worker of the deployment the same KVCONNECT_SIDE_CHANNEL_TOKEN or --secret-file",
                cfg.engine_id
            ),
        );
    }
    let mine = auth::proof(cfg.secret.as_ref(), CHANNEL, Side::Server, &server_nonce, &nonce);
    write_frame(
        &mut DeadlineWriter { stream: w, deadline: within },
        &ServerMsg::Authenticated { proof: mine },
    )
    .map_err(|e| (format!("answering the challenge: {e}"), None))
}

/// Serves one connection until it closes; `Err` carries the reason it was closed early, which
/// is counted while the connection is still open (a peer that sees it close sees the count).
fn serve(stream: TcpStream, s: &Shared) -> Result<(), String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    if s.cfg.serve_reads {
        crate::tcp_data::set_buffers(&stream, s.cfg.socket_buffer).map_err(|e| e.to_string())?;
    }
    stream.set_write_timeout(Some(s.cfg.io_timeout)).map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let mut w = stream;
    let r = authenticate(&mut reader, &mut w, s).and_then(|()| serve_requests(&mut reader, &mut w, s));
    r.map_err(|(reason, refusal)| {
        if let Some(r) = refusal {
            s.refusals.count(r);
        }
        reason
    })
}

/// Answers requests on an authenticated connection.
fn serve_requests(reader: &mut BufReader<TcpStream>, w: &mut TcpStream, s: &Shared) -> Result<(), Refused> {
    let cfg = &s.cfg;
    loop {
        let msg: ClientMsg = match read_frame_within(reader, cfg.max_frame, cfg.idle_timeout, cfg.io_timeout)
        {
            Ok(m) => m,
            Err(FrameError::Closed) => return Ok(()),
            // A consumer keeps its connection between requests; one unused for this long is
            // closed, and the consumer opens a new one when it needs it. Nothing was refused.
            Err(e @ FrameError::Idle(_)) => {
                tracing::debug!("nixl producer: closing an idle connection ({e})");
                return Ok(());
            }
            Err(e) => return Err(frame_refusal(e, s.stop.load(Ordering::Relaxed))),
        };
        let send = |w: &mut TcpStream, m: ServerMsg| {
            let deadline = Instant::now() + cfg.io_timeout;
            write_frame(&mut DeadlineWriter { stream: w, deadline }, &m)
                .map_err(|e| (format!("writing an answer: {e}"), write_refusal(&e)))
        };
        // A refusal is answered and counted; the connection stays open.
        let answer = |r: Result<(), Refused>| match r {
            Ok(()) => ServerMsg::Ok,
            Err((reason, refusal)) => {
                if let Some(r) = refusal {
                    s.refusals.count(r);
                }
                ServerMsg::Error { reason }
            }
        };
        match msg {
            ClientMsg::Auth { .. } => {
                let r =
                    Err(("already authenticated on this connection".to_owned(), Some(Refusal::Malformed)));
                send(w, answer(r))?;
            }
            ClientMsg::Hold { request, capability } => {
                let id = RequestId(request);
                let r = s.acquire(&id, &capability).map(|_| s.release(&id));
                send(w, answer(r))?;
            }
            ClientMsg::Pin { request, capability, blocks } => {
                let m = match s.pin(&RequestId(request), &capability, &blocks) {
                    Ok(left) => ServerMsg::Held { ms: left.as_millis() as u64 },
                    Err(refused) => answer(Err(refused)),
                };
                send(w, m)?;
            }
            ClientMsg::Done { request, capability } => {
                let r = s.complete(&RequestId(request), &capability, None);
                send(w, answer(r))?;
            }
            ClientMsg::DoneBy { request, capability, reader, readers } => {
                let r = s.complete(&RequestId(request), &capability, Some((reader, readers)));
                send(w, answer(r))?;
            }
            ClientMsg::Read { request, capability, runs } => {
                let id = RequestId(request);
                if !cfg.serve_reads {
                    let r = Err((
                        format!(
                            "engine '{}' does not serve reads over its listener: its backend copies \
                            without them; use the same backend on both sides",
                            cfg.engine_id
                        ),
                        Some(Refusal::ReadNotServed),
                    ));
                    send(w, answer(r))?;
                    continue;
                }
                let held_bytes = match s.acquire(&id, &capability) {
                    Ok(b) => b,
                    Err(refused) => {
                        send(w, answer(Err(refused)))?;
                        continue;
                    }
                };
                let result = stream_runs(w, s, &id, &runs, held_bytes);
                s.release(&id);
                match result {
                    Ok(()) => {}
                    Err(StreamError::Refused(reason)) => send(w, ServerMsg::Error { reason })?,
                    Err(StreamError::Io(e)) => {
                        let refusal = write_refusal(&e);
                        return Err((format!("sending blocks of request {id}: {e}"), refusal));
                    }
                }
            }
        }
    }
}

/// How long one read may take to send, whole: the io timeout plus its bytes at a
/// pessimistic 100 MB/s, the bytes counted at most once per byte the request holds (a read
/// that names its runs over and over is no slower to cut off), so a consumer that reads
/// slowly cannot keep the blocks pinned.
fn read_deadline(io_timeout: Duration, total: u64, held_bytes: u64) -> Duration {
    io_timeout + Duration::from_secs_f64(total.min(held_bytes) as f64 / 100e6)
}

enum StreamError {
    Refused(String),
    Io(io::Error),
}

/// Sends `runs` of request `id` (which holds `held_bytes`) straight out of the regions.
fn stream_runs(
    w: &mut TcpStream,
    s: &Shared,
    id: &RequestId,
    runs: &[WireRun],
    held_bytes: u64,
) -> Result<(), StreamError> {
    let total = s.check_runs(id, runs).map_err(StreamError::Refused)?;
    let mut slices = Vec::with_capacity(runs.len());
    for &(region, off, len) in runs {
        let span = Span { region: region as usize, offset: off as usize, len: len as usize };
        let bytes = s.mem.slice(span).map_err(|e| StreamError::Refused(e.to_string()))?;
        slices.push(IoSlice::new(bytes));
    }
    let deadline = Instant::now() + read_deadline(s.cfg.io_timeout, total, held_bytes);
    let mut w = DeadlineWriter { stream: w, deadline };
    write_frame(&mut w, &ServerMsg::Data { bytes: total }).map_err(StreamError::Io)?;
    // Straight out of the regions, as many runs per system call as the socket takes.
    crate::tcp_data::write_all_vectored(&mut w, &mut slices).map_err(StreamError::Io)?;
    w.flush().map_err(StreamError::Io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::{BlockId, KvLayout};
    use kvconnect_bench::harness::{effective, model, Regions};

    fn producer(io_timeout: Duration) -> (Producer, Regions) {
        leased_producer(io_timeout, Duration::from_secs(30), Duration::from_secs(120))
    }

    fn leased_producer(io_timeout: Duration, lease: Duration, lease_max: Duration) -> (Producer, Regions) {
        configured_producer(io_timeout, lease, lease_max, Duration::from_secs(30))
    }

    fn configured_producer(
        io_timeout: Duration,
        lease: Duration,
        lease_max: Duration,
        idle_timeout: Duration,
    ) -> (Producer, Regions) {
        let m = model(2, 2, 8);
        let eff = effective(&m, KvLayout::HND, 4);
        let regions = Regions::allocate(&m, &eff, 8, None).unwrap();
        let mem = Arc::new(KvMemory::new(regions.regions(), &m, &eff).unwrap());
        let cfg = ProducerConfig {
            engine_id: "prefill-unit".into(),
            host: "127.0.0.1".into(),
            port: 0,
            lease,
            io_timeout,
            idle_timeout,
            max_frame: 1 << 20,
            unknown_grace: Duration::ZERO,
            secret: None,
            lease_max,
            max_connections: 4,
            serve_reads: true,
            socket_buffer: 1 << 20,
        };
        let p = Producer::start(mem, cfg).unwrap();
        let groups = vec![m.kv_layers()];
        p.hold(RequestId::from("r"), "cap".into(), &BlocksPerGroup(vec![vec![BlockId(1)]]), &groups).unwrap();
        (p, regions)
    }

    #[test]
    fn done_waits_for_a_read_in_flight_and_never_frees_under_it() {
        let (p, _regions) = producer(Duration::from_secs(5));
        let id = RequestId::from("r");
        // A read of the request is in flight.
        p.shared.acquire(&id, "cap").unwrap();
        let shared = p.shared.clone();
        let done = std::thread::spawn(move || {
            let t0 = Instant::now();
            let r = shared.complete(&RequestId::from("r"), "cap", None);
            (r.map_err(|e| e.0), t0.elapsed())
        });
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(p.held(), 1, "not freed while the read is in flight");
        assert!(p.take_finished().is_empty());
        p.shared.release(&id);
        let (r, waited) = done.join().unwrap();
        assert_eq!(r, Ok(()));
        assert!(waited >= Duration::from_millis(250), "{waited:?}");
        assert_eq!(p.take_finished(), vec![id]);
    }

    #[test]
    fn blocks_read_by_several_consumer_ranks_are_freed_after_the_last_says_done() {
        let (p, _regions) = producer(Duration::from_secs(5));
        let id = RequestId::from("r");
        // Two decode ranks (a decode at twice prefill's TP size) read the one block set.
        assert_eq!(p.shared.complete(&id, "cap", Some((1, 2))).map_err(|e| e.0), Ok(()));
        // The same reader again (a retried done) counts once.
        assert_eq!(p.shared.complete(&id, "cap", Some((1, 2))).map_err(|e| e.0), Ok(()));
        assert_eq!((p.held(), p.take_finished()), (1, vec![]));
        // A reader naming another count, or an index past it, is refused and frees nothing.
        let e = p.shared.complete(&id, "cap", Some((0, 3))).unwrap_err();
        assert_eq!(e.1, Some(Refusal::Malformed));
        assert!(e.0.contains("same tp_size"), "{}", e.0);
        assert_eq!(p.shared.complete(&id, "cap", Some((2, 2))).unwrap_err().1, Some(Refusal::Malformed));
        assert_eq!(
            p.shared.complete(&id, "guess", Some((0, 2))).unwrap_err().1,
            Some(Refusal::BadCapability)
        );
        assert_eq!(p.held(), 1);
        assert_eq!(p.shared.complete(&id, "cap", Some((0, 2))).map_err(|e| e.0), Ok(()));
        assert_eq!((p.held(), p.take_finished()), (0, vec![id]));
    }

    #[test]
    fn pin_renews_the_lease_and_confirms_only_the_requests_own_blocks() {
        let (p, _regions) = producer(Duration::from_secs(5));
        let id = RequestId::from("r");
        let other = [vec![vec![BlockId(1), BlockId(2)]], vec![vec![BlockId(1)], vec![BlockId(1)]]];
        let e = p.shared.pin(&id, "cap", &other[0]).unwrap_err();
        assert!(e.0.contains("block 2 of KV cache group 0 is not one of request r's blocks"), "{}", e.0);
        let e = p.shared.pin(&id, "cap", &other[1]).unwrap_err();
        assert!(e.0.contains("same model"), "{}", e.0);
        // Checked after the capability, which is refused and counted as ever.
        let e = p.shared.pin(&id, "guess", &other[0]).unwrap_err();
        assert_eq!(e.1, Some(Refusal::BadCapability));
        // The request's own blocks: held, for the lease just renewed (30 s here).
        let left = p.shared.pin(&id, "cap", &[vec![BlockId(1)]]).unwrap();
        assert!(left > Duration::from_secs(29) && left <= Duration::from_secs(30), "{left:?}");
        assert_eq!((p.held(), p.take_finished()), (1, vec![]), "a pin frees nothing");
        p.shared.complete(&id, "cap", None).unwrap();
        let e = p.shared.pin(&id, "cap", &[vec![BlockId(1)]]).unwrap_err();
        assert!(e.0.contains("request r"), "a request that is gone is never pinned: {}", e.0);
    }

    #[test]
    fn holds_are_counted_by_how_they_ended_and_shown_as_metrics() {
        let (p, _regions) =
            leased_producer(Duration::from_secs(5), Duration::from_millis(200), Duration::from_secs(5));
        let groups = vec![model(2, 2, 8).kv_layers()];
        let blocks = BlocksPerGroup(vec![vec![BlockId(2)]]);
        p.hold(RequestId::from("read"), "cap2".into(), &blocks, &groups).unwrap();
        assert_eq!(p.holds_ended(), vec![("done", 0), ("expired", 0)]);
        p.shared.complete(&RequestId::from("read"), "cap2", None).unwrap();
        // "r" (held by the helper) is never read: its lease ends.
        std::thread::sleep(Duration::from_millis(300));
        let mut freed = p.take_finished();
        freed.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(freed, vec![RequestId::from("r"), RequestId::from("read")]);
        assert_eq!(p.holds_ended(), vec![("done", 1), ("expired", 1)]);
        let m = p.metrics();
        assert_eq!(kvconnect_api::holds_expired(&m), 1);
        let done = m.iter().find(|s| s.name == KV_HOLDS_ENDED && s.labels == [("how".into(), "done".into())]);
        assert_eq!(done.map(|s| s.value), Some(1));
        assert!(m.iter().all(|s| s.check().is_ok()));
    }

    #[test]
    fn a_pin_never_promises_past_the_lease_cap() {
        let (p, _regions) =
            leased_producer(Duration::from_secs(5), Duration::from_secs(30), Duration::from_millis(800));
        let left = p.shared.pin(&RequestId::from("r"), "cap", &[vec![BlockId(1)]]).unwrap();
        assert!(left <= Duration::from_millis(800), "{left:?}");
    }

    #[test]
    fn done_under_a_read_that_never_ends_is_refused_after_the_io_timeout() {
        let (p, _regions) = producer(Duration::from_millis(300));
        let id = RequestId::from("r");
        p.shared.acquire(&id, "cap").unwrap();
        let e = p.complete(&id, "cap").unwrap_err();
        assert!(e.contains("still in flight"), "{e}");
        assert_eq!(p.held(), 1);
        // A wrong capability is refused at once, read or not, and counted.
        let e = p.complete(&id, "guess").unwrap_err();
        assert!(e.contains("capability does not match"), "{e}");
        assert!(p.refusals().contains(&("bad_capability", 1)));
    }

    #[test]
    fn overlapping_reads_are_refused_past_the_lease_cap_and_the_blocks_freed_after_the_last() {
        let cap = Duration::from_millis(400);
        let (p, _regions) = leased_producer(Duration::from_secs(5), Duration::from_millis(100), cap);
        let id = RequestId::from("r");
        let t0 = Instant::now();
        // A consumer that always starts its next read before the last one ends: one read is
        // in flight at every moment.
        p.shared.acquire(&id, "cap").unwrap();
        let refused = loop {
            assert!(t0.elapsed() < Duration::from_secs(5), "reads were never refused");
            match p.shared.acquire(&id, "cap") {
                Ok(bytes) => {
                    assert_eq!(bytes, 2 * 2 * 128, "one block of 2 layers, K and V, 128 bytes each");
                    p.shared.release(&id);
                }
                Err(refused) => break refused,
            }
            assert!(p.take_finished().is_empty(), "freed while a read is in flight");
            std::thread::sleep(Duration::from_millis(20));
        };
        let at = t0.elapsed();
        assert!(at >= cap - Duration::from_millis(50), "refused before the cap: {at:?}");
        assert_eq!(refused.1, Some(Refusal::LeaseCap));
        assert!(refused.0.contains("kv_lease_max = 0.4s"), "{}", refused.0);
        // A renewal and a check are refused alike; the read in flight still holds the blocks.
        assert_eq!(p.shared.acquire(&id, "cap").unwrap_err().1, Some(Refusal::LeaseCap));
        assert!(p.take_finished().is_empty(), "freed while a read is in flight");
        assert_eq!(p.held(), 1);
        p.shared.release(&id);
        assert_eq!(p.take_finished(), vec![id.clone()], "freed once the last read ended");
        // A wrong capability past the cap is still a wrong capability.
        let (_, r) = p.shared.acquire(&id, "guess").unwrap_err();
        assert_eq!(r, None, "freed: unknown now");
    }

    #[test]
    fn a_reads_deadline_counts_each_held_byte_once() {
        let io = Duration::from_secs(1);
        assert_eq!(read_deadline(io, 100_000_000, 1 << 40), Duration::from_secs(2));
        // Runs named over and over (a terabyte asked of a 100 MB request) get no longer.
        assert_eq!(read_deadline(io, 1 << 40, 100_000_000), Duration::from_secs(2));
    }

    /// Reads until `c` is closed; how long that took.
    fn until_closed(c: &mut TcpStream) -> Duration {
        let t0 = Instant::now();
        let mut rest = Vec::new();
        let _ = io::Read::read_to_end(c, &mut rest);
        t0.elapsed()
    }

    fn timeouts(p: &Producer) -> u64 {
        p.refusals().iter().find(|(r, _)| *r == "timeout").map_or(0, |(_, n)| *n)
    }

    #[test]
    fn an_idle_connection_is_closed_without_a_refusal_a_stalled_frame_is_one() {
        let (io, idle) = (Duration::from_millis(400), Duration::from_millis(200));
        let (p, _regions) = configured_producer(io, Duration::from_secs(30), Duration::from_secs(120), idle);
        let connect = || {
            let c = TcpStream::connect(p.addr()).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            c
        };
        // Authenticated, then idle between frames: closed after the idle timeout, no refusal.
        let mut c = connect();
        crate::wire::authenticate_client(&mut c, None, 1 << 20).unwrap();
        let took = until_closed(&mut c);
        assert!(took >= idle - Duration::from_millis(50) && took < io * 4, "{took:?}");
        assert_eq!(timeouts(&p), 0, "an idle close is no refusal");
        // A frame stalled half-way: closed after the io timeout, a refusal.
        let mut c = connect();
        crate::wire::authenticate_client(&mut c, None, 1 << 20).unwrap();
        c.write_all(&20u32.to_be_bytes()).unwrap();
        c.write_all(b"{\"op\"").unwrap();
        until_closed(&mut c);
        assert_eq!(timeouts(&p), 1, "a stalled frame is a timeout");
        // A challenge never answered is one too.
        until_closed(&mut connect());
        assert_eq!(timeouts(&p), 2, "a challenge never answered is a timeout");
    }
}
