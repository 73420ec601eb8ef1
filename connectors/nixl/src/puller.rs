//! The consumer (decode) side of a pull: plan the copy, send the control messages around it
//! that the backend's steps name ([`crate::transport::PullSteps`]: `hold`, `pin` or nothing
//! before, `done` or `hold` after), let the backend move the bytes ([`crate::transport`]), and keep the
//! authenticated connections to each producer that carry the control messages (and, for tcp,
//! the blocks, through [`Streams`]). Every socket operation has a timeout, so a dead producer
//! ends in an error, never a hang. This is also the entry point benchmarks use to time one
//! transfer.

use crate::copy_plan::CopyPlan;
use crate::error::TransferError;
use crate::idle_link::NoAnswer;
use crate::metadata::{LoadSpec, PeerInfo, PeerKey};
use crate::transport::{Confirm, Pin, Transport, WhileCopying};
use crate::wire::{authenticate_client, read_frame, ClientAuthError, ClientMsg, FrameError, ServerMsg};
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::LayerId;
use std::collections::HashMap;
use std::io;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Connection settings of a consumer.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// Timeout of every socket read and write.
    pub io_timeout: Duration,
    /// Timeout of connecting.
    pub connect_timeout: Duration,
    /// Control frame cap.
    pub max_frame: usize,
    /// Send and receive buffer of each connection, bytes (0: the kernel's autotuning); for
    /// backends whose blocks travel over them (tcp).
    pub socket_buffer: usize,
    /// The deployment's data-plane secret (`None`: the producer runs without one, on
    /// loopback).
    pub secret: Option<kvconnect_dataplane::auth::Secret>,
}

/// What one pull moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullStats {
    /// Bytes copied out of the producer.
    pub bytes: u64,
    /// Contiguous runs (memcpys, socket reads or descriptors) after coalescing.
    pub runs: usize,
    /// True when the layout or block size was adapted on receive.
    pub adapted: bool,
}

impl PullStats {
    /// What moving all of `plan` moves.
    pub fn of(plan: &CopyPlan) -> PullStats {
        let runs = match plan {
            CopyPlan::Direct(r) => r.len(),
            CopyPlan::Adapt(b) => b.len(),
        };
        PullStats { bytes: plan.total_bytes(), runs, adapted: matches!(plan, CopyPlan::Adapt(_)) }
    }
}

/// The connections to producers, per producer ([`PeerKey`]: engine and address, so two
/// producers claiming one engine id never share or evict each other's), each with the
/// handshake (`PeerInfo::generation`) it was opened for: a new handshake, which may be with a
/// producer that restarted at the same address, opens new ones.
struct Connections {
    cfg: PullConfig,
    open: HashMap<PeerKey, Open>,
}

/// The kept connections to one producer.
struct Open {
    /// The handshake they were opened for.
    generation: u64,
    /// The address they were opened to.
    addr: std::net::SocketAddr,
    /// The first is the control connection.
    streams: Vec<TcpStream>,
    /// Answers the control connection still owes to `done`s sent without waiting
    /// ([`crate::transport::Confirm::Release`]); read before it carries anything else.
    owed: usize,
}

/// Pulls blocks from producers through one backend.
pub struct Puller {
    conns: Connections,
    transport: Arc<dyn Transport>,
}

impl std::fmt::Debug for Puller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Puller").field("backend", &self.transport.backend().name()).finish()
    }
}

fn timeout_aware(e: io::Error, after: Duration) -> io::Error {
    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no answer within {:.1}s (producer dead or stalled)", after.as_secs_f64()),
        )
    } else {
        e
    }
}

impl Puller {
    /// A puller through `transport`, with no connections yet.
    pub fn new(cfg: PullConfig, transport: Arc<dyn Transport>) -> Puller {
        Puller { conns: Connections { cfg, open: HashMap::new() }, transport }
    }

    /// Forgets what is kept for producer `key` (connections, and the backend's mappings,
    /// opened handles or loaded agent): after a transfer error the next pull starts again
    /// from its handshake.
    pub fn forget(&mut self, key: &PeerKey) {
        self.conns.open.remove(key);
        self.transport.forget(key);
    }

    /// Heartbeat: renews the producer's lease on `load`'s request; fails when its blocks are
    /// gone.
    pub fn hold(&mut self, peer: &PeerInfo, load: &LoadSpec) -> Result<(), TransferError> {
        let r = self.conns.link(peer).hold(load);
        if r.as_ref().is_err_and(TransferError::is_transport) {
            self.conns.open.remove(&peer.key());
        }
        r
    }

    /// Tells the producer it may free `request`'s blocks without anything being pulled (the
    /// consumer computes the prompt itself, e.g. a 1-token prompt).
    pub fn release(&mut self, peer: &PeerInfo, load: &LoadSpec) -> Result<PullStats, TransferError> {
        let r = self.conns.link(peer).done(load);
        if r.as_ref().is_err_and(TransferError::is_transport) {
            self.conns.open.remove(&peer.key());
        }
        r.map(|()| PullStats { bytes: 0, runs: 0, adapted: false })
    }

    /// Copies `load` from `peer` into `local` through the backend, with the control messages
    /// its steps name ([`Transport::steps`]) around the copy, then tells the producer it is
    /// done. On `Ok` the bytes are in place and the producer confirmed it held them
    /// throughout.
    pub fn pull(
        &mut self,
        local: &KvMemory,
        groups: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
    ) -> Result<PullStats, TransferError> {
        self.pull_reporting(local, groups, peer, load, &mut |_| {})
    }

    /// [`Puller::pull`], calling `whole` as soon as the load is known whole, before the
    /// messages after it that cannot change that (a `done` whose answer is read later): the
    /// caller reports the load without waiting for them. Not called for a load that fails.
    pub fn pull_reporting(
        &mut self,
        local: &KvMemory,
        groups: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
        whole: &mut dyn FnMut(PullStats),
    ) -> Result<PullStats, TransferError> {
        let r = pull_steps(&*self.transport, &mut self.conns.link(peer), local, groups, peer, load, whole);
        if r.as_ref().is_err_and(TransferError::is_transport) {
            // A stream may be mid-message, a mapping or NIXL's endpoints stale: start again
            // from the handshake.
            self.forget(&peer.key());
        }
        r
    }
}

/// One pull from `link`'s producer, step by step as `transport` declares them
/// ([`Transport::steps`]): plan, pin, copy, confirm, then the backend's own word to the producer.
fn pull_steps(
    transport: &dyn Transport,
    link: &mut Link<'_>,
    local: &KvMemory,
    groups: &[Vec<LayerId>],
    peer: &PeerInfo,
    load: &LoadSpec,
    whole: &mut dyn FnMut(PullStats),
) -> Result<PullStats, TransferError> {
    let steps = transport.steps();
    if steps.before == Pin::Overlapped && transport.backend().serves_reads {
        return Err(TransferError::Plan(format!(
            "backend {}: its blocks travel over the control connection, which an overlapped pin's answer \
                needs while the copy runs",
            transport.backend().name()
        )));
    }
    // Planned before any message: a load this engine cannot take fails without one.
    let planning = Instant::now();
    let plan = match steps.plan {
        true => Some(CopyPlan::build(&peer.geometry, local.geometry(), groups, load)?),
        false => None,
    };
    let t0 = Instant::now();
    let plan_us = (t0 - planning).as_micros() as u64;
    // nixl holds the request first (its READ may take long); shm and cuda_ipc send `pin`
    // naming the blocks they read as the copy starts, and copy while it travels; tcp's
    // producer checks each read itself.
    if steps.before == Pin::Hold {
        link.hold(load)?;
    }
    let mut pin = PinWhileCopying {
        link,
        load,
        groups,
        t0,
        sent_at: Duration::ZERO,
        answered_at: Duration::ZERO,
        sent: None,
        held: None,
    };
    let copy = match (steps.before, transport.backend().serves_reads) {
        (Pin::Overlapped, _) => transport.copy_overlapped(local, groups, peer, load, plan.as_ref(), &mut pin),
        (_, true) => transport.copy(Some(&mut pin.link.0), local, groups, peer, load, plan.as_ref()),
        (_, false) => transport.copy(None, local, groups, peer, load, plan.as_ref()),
    };
    let copy_end = Instant::now();
    let copied = t0.elapsed();
    // The pin's answer is read whatever the copy did (now, unless the backend had it read
    // while it copied), so the connection stays in step. A refused pin (the request gone,
    // blocks not its own) fails the load; nothing it copied is used.
    pin.answer();
    let PinWhileCopying { link, sent_at, answered_at, held, .. } = pin;
    let held = held.transpose();
    let stats = copy?;
    let held = held?;
    if steps.before == Pin::Overlapped && held.is_none_or(|until| copy_end > until) {
        // The copy outlasted the hold the pin promised (or the backend never started the
        // pin): pinned now, still held means held throughout (a request is never held again
        // under the same capability).
        let sent = link.send_pin(load, groups)?;
        link.pinned(sent)?;
    }
    // After the copy: `done` lets the producer free the blocks, and its `Ok` (still held)
    // means the bytes were the request's throughout; after a pin that covered the copy the
    // answer proves nothing more, so it is read later. After a `hold` the backend tells the
    // producer its own way (NIXL's notification).
    match steps.after {
        Confirm::Done => {
            link.done(load)?;
            transport.confirmed(peer, load)?;
        }
        Confirm::Release => {
            // Nothing after this can fail the load: it is reported before `done` goes out.
            transport.confirmed(peer, load)?;
            whole(stats);
            link.release(load);
        }
        Confirm::Hold => {
            link.hold(load)?;
            transport.confirmed(peer, load)?;
        }
    }
    // Where a pull's time goes, for benchmarks (KVCONNECT_LOG=kvconnect_nixl=debug).
    tracing::debug!(
        request = %load.request,
        plan_us,
        pin_sent_at_us = sent_at.as_micros() as u64,
        pin_answered_at_us = answered_at.as_micros() as u64,
        copied_at_us = copied.as_micros() as u64,
        confirm_us = (t0.elapsed() - copied).as_micros() as u64,
        "{}: pull phases",
        transport.backend().name()
    );
    Ok(stats)
}

/// The pin of a [`Pin::Overlapped`] pull: sent once the copy is under way, its answer read
/// while the copy runs where the backend allows ([`WhileCopying::answer`]), else after it.
struct PinWhileCopying<'p, 'l> {
    link: &'p mut Link<'l>,
    load: &'p LoadSpec,
    groups: &'p [Vec<LayerId>],
    /// When the pull started; `sent_at` and `answered_at` count from it (for the log).
    t0: Instant,
    sent_at: Duration,
    answered_at: Duration,
    /// The pin sent, its answer not read yet.
    sent: Option<PinSent>,
    /// Its answer: until when the hold lasts.
    held: Option<Result<Instant, TransferError>>,
}

impl WhileCopying for PinWhileCopying<'_, '_> {
    fn started(&mut self) -> Result<(), TransferError> {
        self.sent = Some(self.link.send_pin(self.load, self.groups)?);
        self.sent_at = self.t0.elapsed();
        Ok(())
    }

    fn answer(&mut self) {
        if let Some(sent) = self.sent.take() {
            self.held = Some(self.link.pinned(sent));
            self.answered_at = self.t0.elapsed();
        }
    }
}

impl Connections {
    fn link<'a>(&'a mut self, peer: &'a PeerInfo) -> Link<'a> {
        Link(Streams { conns: self, peer })
    }
}

/// The connections to one producer, for one pull, as a backend whose blocks travel over them
/// (tcp) uses them: streams to ask for reads on, and the errors naming the producer. The
/// control messages around a pull are the puller's ([`Puller::pull`]).
pub struct Streams<'a> {
    conns: &'a mut Connections,
    peer: &'a PeerInfo,
}

impl Streams<'_> {
    /// The connection settings.
    pub fn config(&self) -> &PullConfig {
        &self.conns.cfg
    }

    /// A socket error with `op` and the producer in its message.
    pub fn io(&self, op: &'static str, e: io::Error) -> TransferError {
        TransferError::Io {
            op,
            engine: self.peer.meta.engine_id.clone(),
            addr: self.peer.addr.to_string(),
            source: timeout_aware(e, self.conns.cfg.io_timeout),
        }
    }

    /// A frame that could not be read or written.
    pub fn frame_err(&self, op: &'static str, e: FrameError) -> TransferError {
        match e {
            FrameError::Io(e) => self.io(op, e),
            FrameError::Closed => {
                self.io(op, io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed by the producer"))
            }
            other => TransferError::Protocol {
                engine: self.peer.meta.engine_id.clone(),
                message: other.to_string(),
            },
        }
    }

    /// The producer's refusal.
    pub fn refused(&self, reason: String) -> TransferError {
        TransferError::Refused { engine: self.peer.meta.engine_id.clone(), reason }
    }

    /// The producer broke the protocol.
    pub fn protocol(&self, message: String) -> TransferError {
        TransferError::Protocol { engine: self.peer.meta.engine_id.clone(), message }
    }

    /// The control connection, as it is (in the middle of an answer, the rest of it is read
    /// here); opened when there is none.
    pub fn control(&mut self) -> Result<&mut TcpStream, TransferError> {
        let (peer, key) = (self.peer, self.peer.key());
        let open = self
            .conns
            .open
            .get(&key)
            .is_some_and(|o| o.generation == peer.generation && !o.streams.is_empty() && o.owed == 0);
        if !open {
            self.streams(1)?;
        }
        let first = self.conns.open.get_mut(&key).and_then(|o| o.streams.first_mut());
        first.ok_or(TransferError::UnknownPeer(key.engine))
    }

    /// `n` authenticated connections (the first is the control connection) to start requests
    /// on, opened as needed and kept, with how many of them were kept from before. Kept ones
    /// the producer closed while they sat idle are dropped first ([`crate::idle_link`]).
    pub fn streams(&mut self, n: usize) -> Result<(usize, &mut [TcpStream]), TransferError> {
        let (peer, key) = (self.peer, self.peer.key());
        if self.conns.open.get(&key).is_some_and(|o| o.generation != peer.generation || o.addr != peer.addr) {
            self.conns.open.remove(&key);
        }
        self.settle();
        if let Some(Open { streams: v, .. }) = self.conns.open.get_mut(&key) {
            let before = v.len();
            v.retain(crate::idle_link::still_open);
            if v.len() < before {
                tracing::debug!(engine = %key.engine, addr = %peer.addr, "nixl: producer engine '{}' closed \
                    {} idle connection(s); opening new ones", key.engine, before - v.len());
            }
        }
        let have = self.conns.open.get(&key).map_or(0, |o| o.streams.len());
        for _ in have..n.max(1) {
            let cfg = &self.conns.cfg;
            let mut s = crate::tcp_data::connect(peer.addr, cfg.connect_timeout, cfg.socket_buffer)
                .map_err(|e| self.io("connecting", e))?;
            let setup = s
                .set_read_timeout(Some(cfg.io_timeout))
                .and_then(|_| s.set_write_timeout(Some(cfg.io_timeout)));
            setup.map_err(|e| self.io("configuring the socket", e))?;
            self.authenticate(&mut s)?;
            let o = self.conns.open.entry(key.clone());
            let new = || Open { generation: peer.generation, addr: peer.addr, streams: Vec::new(), owed: 0 };
            o.or_insert_with(new).streams.push(s);
        }
        match self.conns.open.get_mut(&key) {
            Some(o) => Ok((have.min(n.max(1)), &mut o.streams[..n.max(1)])),
            None => Err(TransferError::UnknownPeer(key.engine)),
        }
    }

    /// Closes every connection to this producer (one stopped mid-answer).
    pub fn close(&mut self) {
        self.conns.open.remove(&self.peer.key());
    }

    /// Reads the answers the control connection owes to `done`s sent without waiting. A
    /// refusal there changes no load (each was whole before its `done` went out) and is
    /// logged; a connection that cannot answer is closed, and the producer frees the blocks
    /// at its lease's end instead.
    fn settle(&mut self) {
        let (key, cap) = (self.peer.key(), self.conns.cfg.max_frame);
        let Some(o) = self.conns.open.get_mut(&key) else { return };
        while o.owed > 0 {
            let Some(s) = o.streams.first_mut() else { break };
            match read_frame::<_, ServerMsg>(s, cap) {
                Ok(ServerMsg::Ok) => {}
                Ok(other) => {
                    tracing::warn!(engine = %key.engine, "nixl: producer engine '{}' answered a done \
                    with {other:?}; the load it ended was already whole", key.engine)
                }
                Err(e) => {
                    tracing::debug!(engine = %key.engine, "nixl: producer engine '{}' did not answer a done ({e}); \
                        opening a new connection", key.engine);
                    self.conns.open.remove(&key);
                    return;
                }
            }
            o.owed -= 1;
        }
    }

    /// Sends `msg` on the control connection without waiting for its answer. Returns whether
    /// the connection was kept from before (the producer may have closed it as idle just
    /// then: [`Streams::answer`] tells).
    fn send(&mut self, msg: &ClientMsg) -> Result<bool, TransferError> {
        let kept = self.streams(1)?.0 > 0;
        let s = self.control()?;
        match crate::wire::write_frame(s, msg) {
            Ok(()) => Ok(kept),
            Err(e) if kept && crate::idle_link::is_closed(&e) => {
                self.close();
                let s = self.control()?;
                crate::wire::write_frame(s, msg).map_err(|e| self.io("asking", e))?;
                Ok(false)
            }
            Err(e) => Err(self.io("asking", e)),
        }
    }

    /// Reads the answer to what [`Streams::send`] sent; the inner `Err` when the producer
    /// closed the connection before any byte of it arrived.
    fn answer(&mut self) -> Result<Result<ServerMsg, io::Error>, TransferError> {
        let cap = self.conns.cfg.max_frame;
        let s = self.control()?;
        match crate::idle_link::await_answer(s) {
            Ok(()) => read_frame::<_, ServerMsg>(s, cap).map(Ok).map_err(|e| self.frame_err("asking", e)),
            Err(NoAnswer::Closed(e)) => Ok(Err(e)),
            Err(NoAnswer::Io(e)) => Err(self.io("asking", e)),
        }
    }

    /// Sends `msg` without waiting for its answer, which the control connection then owes
    /// (read by [`Streams::settle`] before its next use). A send that fails closes the
    /// connections; nothing else fails.
    fn send_owed(&mut self, msg: &ClientMsg) {
        match self.send(msg) {
            Ok(_) => {
                if let Some(o) = self.conns.open.get_mut(&self.peer.key()) {
                    o.owed += 1;
                }
            }
            Err(e) => {
                tracing::debug!(engine = %self.peer.meta.engine_id, "nixl: sending a done failed ({e}); the \
                    producer frees the blocks at its lease's end");
                self.close();
            }
        }
    }

    /// Answers the producer's challenge and checks its proof in turn: a listener that does
    /// not know the deployment's secret is never read from.
    fn authenticate(&self, s: &mut TcpStream) -> Result<(), TransferError> {
        let engine = || self.peer.meta.engine_id.clone();
        let cfg = &self.conns.cfg;
        authenticate_client(s, cfg.secret.as_ref(), cfg.max_frame).map_err(|e| match e {
            ClientAuthError::Frame(f) => self.frame_err("authenticating", f),
            ClientAuthError::Refused(reason) => TransferError::Refused { engine: engine(), reason },
            e @ ClientAuthError::WrongServer => {
                TransferError::Refused { engine: engine(), reason: e.to_string() }
            }
            ClientAuthError::Protocol(message) => TransferError::Protocol { engine: engine(), message },
            ClientAuthError::Rng(e) => TransferError::Plan(e.to_string()),
        })
    }

    /// Sends one control message and reads its answer. When a kept connection turns out
    /// closed by the producer before any byte of the answer arrived (it closed it as idle just
    /// as the message went out), the message is sent once more on a new connection; every
    /// message may be ([`crate::idle_link`] says why).
    pub fn call(&mut self, msg: &ClientMsg) -> Result<ServerMsg, TransferError> {
        let at = Instant::now();
        let kept = self.send(msg)?;
        Ok(self.answer_to(msg, kept, at)?.0)
    }

    /// The answer to `msg`, sent at `at` by [`Streams::send`] (`kept`: on a connection kept
    /// from before), with when the message it answers was sent: a kept connection the
    /// producer closed as idle before answering is asked again on a new one.
    fn answer_to(
        &mut self,
        msg: &ClientMsg,
        kept: bool,
        at: Instant,
    ) -> Result<(ServerMsg, Instant), TransferError> {
        match self.answer()? {
            Ok(m) => Ok((m, at)),
            Err(closed) if kept => {
                tracing::debug!(engine = %self.peer.meta.engine_id, "nixl: producer engine '{}' closed a \
                    kept connection before answering ({closed}); asking again on a new one",
                    self.peer.meta.engine_id);
                self.close();
                let at = Instant::now();
                self.send(msg)?;
                let answer = self.answer()?.map_err(|closed| self.io("asking", closed))?;
                Ok((answer, at))
            }
            Err(closed) => Err(self.io("asking", closed)),
        }
    }
}

/// The connections to one producer, for one pull, with the control messages the puller sends
/// around a backend's copy.
struct Link<'a>(Streams<'a>);

impl Link<'_> {
    fn expect_ok(&mut self, msg: &ClientMsg) -> Result<(), TransferError> {
        let engine = || self.0.peer.meta.engine_id.clone();
        match self.0.call(msg)? {
            ServerMsg::Ok => Ok(()),
            ServerMsg::Error { reason } => Err(TransferError::Refused { engine: engine(), reason }),
            other => Err(TransferError::Protocol {
                engine: engine(),
                message: format!("answered {other:?} to {msg:?}"),
            }),
        }
    }

    /// `hold`: renews the lease; fails when the producer no longer holds the request.
    fn hold(&mut self, load: &LoadSpec) -> Result<(), TransferError> {
        self.expect_ok(&ClientMsg::Hold {
            request: load.producer_request().to_owned(),
            capability: load.remote_capability.clone(),
        })
    }

    /// `done`: the consumer has the blocks; the producer frees them once no read is in
    /// flight. `Ok` means it still held them, so they were the request's throughout.
    fn done(&mut self, load: &LoadSpec) -> Result<(), TransferError> {
        self.expect_ok(&done_msg(load))
    }

    /// `done` without waiting for its answer (read before the connection's next use): for a
    /// load a `pin` already proved whole.
    fn release(&mut self, load: &LoadSpec) {
        self.0.send_owed(&done_msg(load));
    }

    /// Sends `pin` for the blocks `load` reads, as the copy starts; its answer is read by
    /// [`Link::pinned`] while the copy runs (GPU copies) or once it is done.
    fn send_pin(&mut self, load: &LoadSpec, groups: &[Vec<LayerId>]) -> Result<PinSent, TransferError> {
        let msg = ClientMsg::Pin {
            request: load.producer_request().to_owned(),
            capability: load.remote_capability.clone(),
            blocks: crate::copy_plan::read_blocks(&self.0.peer.geometry, groups, load),
        };
        let at = Instant::now();
        let kept = self.0.send(&msg)?;
        Ok(PinSent { msg, at, kept })
    }

    /// The answer to a `pin`: until when the hold lasts at least. A kept connection the
    /// producer closed as idle before answering is asked again on a new one: held then means
    /// held since before the copy (a request is never held again under the same capability),
    /// and the hold lasts at least the answer's `ms` from the second asking, which the copy's
    /// end is checked against.
    fn pinned(&mut self, sent: PinSent) -> Result<Instant, TransferError> {
        let (answer, at) = self.0.answer_to(&sent.msg, sent.kept, sent.at)?;
        match answer {
            ServerMsg::Held { ms } => Ok(at + Duration::from_millis(ms)),
            ServerMsg::Error { reason } => Err(self.0.refused(reason)),
            other => Err(self.0.protocol(format!("answered {other:?} to {:?}", sent.msg))),
        }
    }
}

/// A `pin` sent, its answer not read yet.
struct PinSent {
    msg: ClientMsg,
    /// When it was sent: the hold it answers lasts at least its `ms` from then.
    at: Instant,
    /// It went out on a connection kept from before.
    kept: bool,
}

/// `done`, or `done_by` for one of several readers.
fn done_msg(load: &LoadSpec) -> ClientMsg {
    let (request, capability) = (load.producer_request().to_owned(), load.remote_capability.clone());
    match load.reader {
        Some((reader, readers)) if readers > 1 => ClientMsg::DoneBy { request, capability, reader, readers },
        _ => ClientMsg::Done { request, capability },
    }
}
