//! The P/D side channel: the handshake a decode server makes with a prefill server before it
//! loads any KV from it (ARCHITECTURE.md §6 and §9).
//!
//! Frames are a big-endian `u32` length followed by that many bytes of JSON. Every read has a
//! timeout and every frame a size cap, so a peer that stalls, lies about a length or sends
//! garbage costs one connection, never the server. Every connection opens with the prefill
//! side's `challenge`; the `hello` answers it with a proof of the deployment's secret and the
//! `welcome` proves it back (ARCHITECTURE.md §10), so the secret never crosses the wire. Without
//! a secret the listener binds loopback only.
//!
//! The decode side sends `hello` with its [`CompatDescriptor`]; the prefill side checks it
//! with [`kvconnect_api::compat::check`] and answers `welcome` (its own descriptor and its
//! connector's handshake metadata) or `refused` with the field-level diff, worded by role.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvconnect_api::compat::{check_roles, AdaptationPlan, CompatDescriptor, FieldDiff};
use kvconnect_api::protocol::VersionMismatch;
use kvconnect_dataplane::auth::{self, Secret, Side};
use kvconnect_support::frame;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The version of the handshake this host speaks; `hello` and `welcome` carry it, and each
/// side refuses another with a [`VersionMismatch`] naming both.
pub const PROTOCOL_VERSION: u32 = 1;

/// The protocol's name in a version mismatch.
const PROTOCOL: &str = "side-channel handshake";

/// The largest frame either side accepts (16 MiB): far above any real handshake, far below
/// what would let a peer make the server allocate without bound.
pub use kvconnect_support::frame::DEFAULT_MAX_FRAME;

/// How long a peer may wait before starting a frame, and then how long the whole frame may
/// take, before the connection is dropped; also the limit on writing one.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections served at once by default; more are closed at once.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;

/// The channel name both sides put into their proofs (`kvconnect_dataplane::auth::proof`).
pub const CHANNEL: &str = "kvconnect-side-channel";

/// What went wrong on the side channel.
#[derive(Debug, thiserror::Error)]
pub enum SideChannelError {
    /// The listener could not bind.
    #[error(
        "side channel: cannot listen on {addr}: {source}; pick a free port with --side-channel-port or 0 \
        for any"
    )]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// Bound beyond loopback without a secret.
    #[error(
        "side channel: refusing to listen on {addr} beyond loopback without a data-plane secret, which \
        would let any host handshake; set KVCONNECT_SIDE_CHANNEL_TOKEN (at least 16 random bytes, the same \
        on every worker of the deployment) or pass --secret-file, or bind --side-channel-host 127.0.0.1"
    )]
    Open {
        /// The address.
        addr: SocketAddr,
    },
    /// Connecting to a peer failed.
    #[error(
        "side channel: cannot connect to {addr}: {message}; is the prefill worker running and is \
        remote_host/remote_port right?"
    )]
    Connect {
        /// The peer address as given.
        addr: String,
        /// What failed.
        message: String,
    },
    /// A socket read or write failed.
    #[error("side channel: I/O with {peer} failed: {source}")]
    Io {
        /// The peer.
        peer: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The peer closed the connection before a whole frame arrived.
    #[error("side channel: {peer} closed the connection in the middle of a frame")]
    Closed {
        /// The peer.
        peer: String,
    },
    /// A read took longer than the timeout.
    #[error("side channel: {peer} sent nothing for {after:?} while {what}; closing the connection")]
    Timeout {
        /// The peer.
        peer: String,
        /// What was being read.
        what: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// A frame's length prefix is above the cap.
    #[error(
        "side channel: {peer} announced a {len}-byte frame, above the {cap}-byte cap; closing the connection"
    )]
    FrameTooLarge {
        /// The peer.
        peer: String,
        /// The announced length.
        len: u64,
        /// The cap.
        cap: usize,
    },
    /// A frame is not a message of this protocol.
    #[error(
        "side channel: {peer} sent a frame that is not a kvconnect handshake message ({message}); \
        closing the connection"
    )]
    Garbage {
        /// The peer.
        peer: String,
        /// The parser's message.
        message: String,
    },
    /// The peer answered with a message that makes no sense at this point.
    #[error("side channel: {peer} answered with an unexpected '{got}' message")]
    Unexpected {
        /// The peer.
        peer: String,
        /// The message type.
        got: &'static str,
    },
    /// A message could not be encoded (a bug, or metadata that is not JSON-encodable).
    #[error("side channel: cannot encode a message: {0}")]
    Encode(String),
}

/// One message on the side channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    /// Prefill → decode, first on every connection: prove the secret over this nonce.
    Challenge {
        /// The prefill side's nonce for this connection (hex).
        nonce: String,
    },
    /// Decode → prefill: who I am and how my KV cache is laid out.
    Hello {
        /// [`PROTOCOL_VERSION`] of the decode side (absent from releases before it was sent).
        #[serde(default)]
        version: Option<u32>,
        /// The decode engine's descriptor.
        compat: CompatDescriptor,
        /// The decode engine's id.
        engine_id: String,
        /// The answer to the challenge.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        auth: Option<HelloAuth>,
    },
    /// Prefill → decode: compatible; here is how to reach my KV.
    Welcome {
        /// [`PROTOCOL_VERSION`] of the prefill side (absent from releases before it was sent).
        #[serde(default)]
        version: Option<u32>,
        /// The prefill engine's descriptor.
        compat: CompatDescriptor,
        /// The prefill engine's id.
        engine_id: String,
        /// The prefill connector's `handshake_metadata()`.
        metadata: Option<serde_json::Value>,
        /// The prefill side's proof of the secret over both nonces.
        #[serde(default)]
        proof: String,
        /// A random id of the prefill process, which its requests' `kv_transfer_params` carry
        /// as `remote_instance`: a decode that sees another one handshakes again (the peer
        /// restarted). Absent from releases before it was sent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        instance: Option<String>,
    },
    /// Prefill → decode: not compatible (or not allowed); nothing may be loaded.
    Refused {
        /// The strict fields that differ, with both sides' provenance.
        diff: Vec<FieldDiff>,
        /// The whole reason, worded by role, with remedies.
        message: String,
    },
}

/// A `hello`'s answer to the challenge: the decode side's nonce and its proof of the secret
/// over both nonces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloAuth {
    /// The decode side's nonce (hex).
    pub nonce: String,
    /// HMAC over both nonces (hex).
    pub proof: String,
}

impl Message {
    fn kind(&self) -> &'static str {
        match self {
            Message::Challenge { .. } => "challenge",
            Message::Hello { .. } => "hello",
            Message::Welcome { .. } => "welcome",
            Message::Refused { .. } => "refused",
        }
    }
}

/// Writes one frame: the JSON's length as a big-endian `u32`, then the JSON.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &Message,
    peer: &str,
) -> Result<(), SideChannelError> {
    let buf = frame::encode(msg).map_err(|e| SideChannelError::Encode(e.to_string()))?;
    let io = |source| SideChannelError::Io { peer: peer.to_owned(), source };
    w.write_all(&buf).await.map_err(io)?;
    w.flush().await.map_err(io)
}

/// Reads one frame, enforcing the cap before allocating: the frame must start within
/// `timeout`, and once started arrive whole within `timeout` more, however it is dripped.
/// `Ok(None)` means the peer closed the connection cleanly between frames.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    cap: usize,
    timeout: Duration,
    peer: &str,
) -> Result<Option<Message>, SideChannelError> {
    let mut len_buf = [0u8; 4];
    let mut got = 0;
    let mut deadline = tokio::time::Instant::now() + timeout;
    while got < 4 {
        let n = tokio::time::timeout_at(deadline, r.read(&mut len_buf[got..]))
            .await
            .map_err(|_| SideChannelError::Timeout {
                peer: peer.to_owned(),
                what: "reading a frame length",
                after: timeout,
            })?
            .map_err(|source| SideChannelError::Io { peer: peer.to_owned(), source })?;
        if n == 0 {
            return if got == 0 { Ok(None) } else { Err(SideChannelError::Closed { peer: peer.to_owned() }) };
        }
        if got == 0 {
            deadline = tokio::time::Instant::now() + timeout;
        }
        got += n;
    }
    let len = frame::body_len(len_buf, cap).map_err(|e| SideChannelError::FrameTooLarge {
        peer: peer.to_owned(),
        len: e.len as u64,
        cap,
    })?;
    let mut body = vec![0u8; len];
    tokio::time::timeout_at(deadline, r.read_exact(&mut body))
        .await
        .map_err(|_| SideChannelError::Timeout {
            peer: peer.to_owned(),
            what: "reading a frame body",
            after: timeout,
        })?
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::UnexpectedEof => SideChannelError::Closed { peer: peer.to_owned() },
            _ => SideChannelError::Io { peer: peer.to_owned(), source },
        })?;
    frame::decode(&body)
        .map(Some)
        .map_err(|e| SideChannelError::Garbage { peer: peer.to_owned(), message: e.to_string() })
}

/// Where and how the server listens.
#[derive(Debug, Clone)]
pub struct SideChannelConfig {
    /// Address to bind; loopback by default.
    pub host: IpAddr,
    /// Port; 0 picks a free one.
    pub port: u16,
    /// The deployment's secret every `hello` must prove; required beyond loopback.
    pub secret: Option<Secret>,
    /// How long a frame may take to start, and then to arrive whole; also the write limit.
    pub read_timeout: Duration,
    /// Frame size cap.
    pub max_frame: usize,
    /// Connections served at once.
    pub max_connections: usize,
}

impl Default for SideChannelConfig {
    fn default() -> Self {
        SideChannelConfig {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            secret: None,
            read_timeout: DEFAULT_READ_TIMEOUT,
            max_frame: DEFAULT_MAX_FRAME,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// What the prefill side answers with: its identity and its connector's metadata.
#[derive(Debug, Clone)]
pub struct LocalIdentity {
    /// This engine's descriptor.
    pub compat: CompatDescriptor,
    /// This engine's id.
    pub engine_id: String,
    /// The connector's `handshake_metadata()`.
    pub metadata: Option<serde_json::Value>,
}

/// Why the side channel refused a peer, named as /metrics names it (the producer listener's
/// names where they mean the same thing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A `hello` without a proof of the secret.
    Unauthenticated,
    /// A `hello` whose proof does not verify: the peer has another secret, or none.
    WrongSecret,
    /// A frame that is not a message of the protocol.
    Malformed,
    /// A frame announced over the cap.
    Oversized,
    /// A connection closed (or reset) in the middle of a frame.
    Truncated,
    /// A frame not started or not whole within its deadline, read or written (a peer that
    /// drips its frame, sends nothing, or does not read the answer).
    Timeout,
    /// A connection past the cap, closed at once.
    TooManyConnections,
}

impl Refusal {
    /// Every reason, in the order counted.
    pub const ALL: [Refusal; 7] = [
        Refusal::Unauthenticated,
        Refusal::WrongSecret,
        Refusal::Malformed,
        Refusal::Oversized,
        Refusal::Truncated,
        Refusal::Timeout,
        Refusal::TooManyConnections,
    ];

    /// The reason's name in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Refusal::Unauthenticated => "unauthenticated",
            Refusal::WrongSecret => "wrong_secret",
            Refusal::Malformed => "malformed",
            Refusal::Oversized => "oversized",
            Refusal::Truncated => "truncated",
            Refusal::Timeout => "timeout",
            Refusal::TooManyConnections => "too_many_connections",
        }
    }

    /// The reason a connection that failed with `e` is closed for; `None` for a socket error
    /// that is no peer's frame (the connection is still dropped and counted as such).
    fn of(e: &SideChannelError) -> Option<Refusal> {
        match e {
            SideChannelError::Garbage { .. } => Some(Refusal::Malformed),
            SideChannelError::FrameTooLarge { .. } => Some(Refusal::Oversized),
            SideChannelError::Closed { .. } => Some(Refusal::Truncated),
            SideChannelError::Timeout { .. } => Some(Refusal::Timeout),
            SideChannelError::Io { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
                ) =>
            {
                Some(Refusal::Truncated)
            }
            _ => None,
        }
    }
}

/// Counters a server exposes on /health and /metrics.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Handshakes answered with `welcome`.
    pub welcomed: AtomicU64,
    /// Handshakes answered with `refused`.
    pub refused: AtomicU64,
    /// Connections closed because the peer misbehaved (malformed, oversized, truncated,
    /// timeout) or its socket failed.
    pub dropped: AtomicU64,
    /// Refusals by reason, in the order of [`Refusal::ALL`].
    refusals: [AtomicU64; Refusal::ALL.len()],
}

/// A snapshot of [`ServerStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerStatsSnapshot {
    /// Handshakes answered with `welcome`.
    pub welcomed: u64,
    /// Handshakes answered with `refused`.
    pub refused: u64,
    /// Connections closed because the peer misbehaved or its socket failed.
    pub dropped: u64,
    /// Hellos refused without a proof of the secret.
    #[serde(default)]
    pub unauthenticated: u64,
    /// Hellos refused for a proof that does not verify.
    #[serde(default)]
    pub wrong_secret: u64,
    /// Connections closed for a frame that is not a message.
    #[serde(default)]
    pub malformed: u64,
    /// Connections closed for a frame over the cap.
    #[serde(default)]
    pub oversized: u64,
    /// Connections closed in the middle of a frame.
    #[serde(default)]
    pub truncated: u64,
    /// Connections closed for a frame not whole within its deadline, read or written.
    #[serde(default)]
    pub timeout: u64,
    /// Connections closed at once because the cap was reached.
    #[serde(default)]
    pub over_cap: u64,
}

impl ServerStats {
    /// Counts one refusal.
    pub fn count(&self, r: Refusal) {
        if let Some(i) = Refusal::ALL.iter().position(|x| *x == r) {
            self.refusals[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// How many refusals for `r` so far.
    pub fn refusals(&self, r: Refusal) -> u64 {
        Refusal::ALL.iter().position(|x| *x == r).map_or(0, |i| self.refusals[i].load(Ordering::Relaxed))
    }

    /// The current values.
    pub fn snapshot(&self) -> ServerStatsSnapshot {
        ServerStatsSnapshot {
            welcomed: self.welcomed.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            unauthenticated: self.refusals(Refusal::Unauthenticated),
            wrong_secret: self.refusals(Refusal::WrongSecret),
            malformed: self.refusals(Refusal::Malformed),
            oversized: self.refusals(Refusal::Oversized),
            truncated: self.refusals(Refusal::Truncated),
            timeout: self.refusals(Refusal::Timeout),
            over_cap: self.refusals(Refusal::TooManyConnections),
        }
    }
}

impl ServerStatsSnapshot {
    /// (reason, count) for every [`Refusal`], as /metrics labels them.
    pub fn refusals(&self) -> Vec<(&'static str, u64)> {
        Refusal::ALL
            .iter()
            .map(|r| {
                let n = match r {
                    Refusal::Unauthenticated => self.unauthenticated,
                    Refusal::WrongSecret => self.wrong_secret,
                    Refusal::Malformed => self.malformed,
                    Refusal::Oversized => self.oversized,
                    Refusal::Truncated => self.truncated,
                    Refusal::Timeout => self.timeout,
                    Refusal::TooManyConnections => self.over_cap,
                };
                (r.name(), n)
            })
            .collect()
    }
}

/// The role-aware wording of a refusal: a header naming both engines, then one line per
/// differing field, `hma: prefill=off (child 'lmcache' ...), decode=on (default): <remedy>`.
/// The diffs are those of `check_roles(prefill, decode)`.
pub fn render_refusal(prefill_engine: &str, decode_engine: &str, diffs: &[FieldDiff]) -> String {
    let mut s = format!(
        "prefill engine '{prefill_engine}' and decode engine '{decode_engine}' have incompatible KV caches; \
            no KV was transferred:"
    );
    for d in diffs {
        s.push_str("\n  ");
        s.push_str(&d.line("prefill", "decode"));
    }
    s
}

/// The prefill side's answer to one `hello` on a connection it challenged with
/// `server_nonce`, from the process whose id is `instance`.
pub fn answer_hello(
    local: &LocalIdentity,
    instance: &str,
    secret: Option<&Secret>,
    server_nonce: &str,
    hello: Message,
) -> Message {
    let Message::Hello { version, compat, engine_id, auth } = hello else {
        return Message::Refused {
            diff: Vec::new(),
            message: format!("expected a 'hello' message first, got '{}'", hello.kind()),
        };
    };
    if let Err(e) =
        VersionMismatch::check(PROTOCOL, "prefill worker", PROTOCOL_VERSION, "decode worker", version)
    {
        return Message::Refused { diff: Vec::new(), message: e.to_string() };
    }
    let proven = auth
        .as_ref()
        .is_some_and(|a| auth::verify(secret, CHANNEL, Side::Client, server_nonce, &a.nonce, &a.proof));
    let Some(HelloAuth { nonce, .. }) = auth.filter(|_| proven) else {
        return Message::Refused {
            diff: Vec::new(),
            message: format!(
                "{UNAUTHENTICATED}: prefill engine '{}' did not get a valid proof of the deployment's \
                    data-plane secret from decode engine '{engine_id}'; give both workers the same \
                    KVCONNECT_SIDE_CHANNEL_TOKEN or --secret-file",
                local.engine_id
            ),
        };
    };
    match check_roles(&local.compat, &compat) {
        Ok(_) => Message::Welcome {
            version: Some(PROTOCOL_VERSION),
            compat: local.compat.clone(),
            engine_id: local.engine_id.clone(),
            metadata: local.metadata.clone(),
            proof: auth::proof(secret, CHANNEL, Side::Server, server_nonce, &nonce),
            instance: Some(instance.to_owned()),
        },
        Err(inc) => Message::Refused {
            message: render_refusal(&local.engine_id, &engine_id, &inc.diffs),
            diff: inc.diffs,
        },
    }
}

/// How a refusal for a missing or wrong proof of the secret begins.
pub const UNAUTHENTICATED: &str = "unauthenticated";

/// Refuses to serve beyond loopback without a secret.
fn refuse_open(cfg: &SideChannelConfig, addr: SocketAddr) -> Result<(), SideChannelError> {
    if cfg.secret.is_none() && !addr.ip().is_loopback() {
        return Err(SideChannelError::Open { addr });
    }
    Ok(())
}

/// A running side-channel listener. Dropping it stops accepting.
pub struct SideChannelServer {
    addr: SocketAddr,
    stats: Arc<ServerStats>,
    stop: watch::Sender<bool>,
    instance: Arc<str>,
}

/// A new random id for this process's side channel (the `instance` of its welcomes).
fn new_instance() -> Result<Arc<str>, SideChannelError> {
    auth::nonce().map(Arc::from).map_err(|e| SideChannelError::Encode(e.to_string()))
}

impl SideChannelServer {
    /// Binds and starts serving on the current tokio runtime.
    pub async fn bind(
        cfg: SideChannelConfig,
        local: LocalIdentity,
    ) -> Result<SideChannelServer, SideChannelError> {
        let want = SocketAddr::new(cfg.host, cfg.port);
        let listener =
            TcpListener::bind(want).await.map_err(|source| SideChannelError::Bind { addr: want, source })?;
        let addr = listener.local_addr().map_err(|source| SideChannelError::Bind { addr: want, source })?;
        refuse_open(&cfg, addr)?;
        let stats = Arc::new(ServerStats::default());
        let (stop, stop_rx) = watch::channel(false);
        let instance = new_instance()?;
        let served = Arc::new(Served { local, instance: instance.clone() });
        tokio::spawn(accept_loop(listener, Arc::new(cfg), served, stats.clone(), stop_rx));
        Ok(SideChannelServer { addr, stats, stop, instance })
    }

    /// Starts serving on a listener bound earlier (the server binds first so it can tell its
    /// connector the port before the connector, whose metadata the server answers with,
    /// exists). Must be called inside a tokio runtime.
    pub fn from_std(
        listener: std::net::TcpListener,
        cfg: SideChannelConfig,
        local: LocalIdentity,
    ) -> Result<SideChannelServer, SideChannelError> {
        let want = SocketAddr::new(cfg.host, cfg.port);
        let bind_err = |source| SideChannelError::Bind { addr: want, source };
        listener.set_nonblocking(true).map_err(bind_err)?;
        let addr = listener.local_addr().map_err(bind_err)?;
        let listener = TcpListener::from_std(listener).map_err(bind_err)?;
        refuse_open(&cfg, addr)?;
        let stats = Arc::new(ServerStats::default());
        let (stop, stop_rx) = watch::channel(false);
        let instance = new_instance()?;
        let served = Arc::new(Served { local, instance: instance.clone() });
        tokio::spawn(accept_loop(listener, Arc::new(cfg), served, stats.clone(), stop_rx));
        Ok(SideChannelServer { addr, stats, stop, instance })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The counters.
    pub fn stats(&self) -> Arc<ServerStats> {
        self.stats.clone()
    }

    /// This process's random id, sent in every welcome; prefill puts it into its requests'
    /// `kv_transfer_params` as `remote_instance`.
    pub fn instance(&self) -> &str {
        &self.instance
    }
}

/// What a server answers with: the identity and the process's id.
struct Served {
    local: LocalIdentity,
    instance: Arc<str>,
}

impl Drop for SideChannelServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn accept_loop(
    listener: TcpListener,
    cfg: Arc<SideChannelConfig>,
    local: Arc<Served>,
    stats: Arc<ServerStats>,
    mut stop: watch::Receiver<bool>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections));
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            accepted = listener.accept() => match accepted {
                Ok((sock, peer)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        stats.count(Refusal::TooManyConnections);
                        tracing::warn!(%peer, cap = cfg.max_connections, "side channel: refusing a \
                            connection past the cap of {} open connections", cfg.max_connections);
                        drop(sock);
                        continue;
                    };
                    let (cfg, local, stats) = (cfg.clone(), local.clone(), stats.clone());
                    tokio::spawn(async move {
                        serve_connection(sock, peer, cfg, local, stats).await;
                        drop(slot);
                    });
                }
                Err(e) => {
                    // Running out of descriptors is transient; back off instead of spinning.
                    tracing::warn!(error = %e, "side channel: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// Writes one frame, whole within `within`: a peer that does not read cannot hold the task.
async fn write_within(
    sock: &mut TcpStream,
    m: &Message,
    peer: &str,
    within: Duration,
) -> Result<(), SideChannelError> {
    match tokio::time::timeout(within, write_frame(sock, m, peer)).await {
        Ok(r) => r,
        Err(_) => {
            Err(SideChannelError::Timeout { peer: peer.to_owned(), what: "writing a frame", after: within })
        }
    }
}

/// Closes a connection that failed with `e`: counted as dropped, and by its reason.
fn drop_connection(stats: &ServerStats, peer: &str, e: &SideChannelError) {
    stats.dropped.fetch_add(1, Ordering::Relaxed);
    if let Some(r) = Refusal::of(e) {
        stats.count(r);
    }
    tracing::warn!(peer = %peer, reason = %e, "side channel: closing connection");
}

async fn serve_connection(
    mut sock: TcpStream,
    peer: SocketAddr,
    cfg: Arc<SideChannelConfig>,
    served: Arc<Served>,
    stats: Arc<ServerStats>,
) {
    let peer_s = peer.to_string();
    let server_nonce = match auth::nonce() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(peer = %peer_s, "side channel: {e}");
            return;
        }
    };
    if let Err(e) = write_within(
        &mut sock,
        &Message::Challenge { nonce: server_nonce.clone() },
        &peer_s,
        cfg.read_timeout,
    )
    .await
    {
        drop_connection(&stats, &peer_s, &e);
        return;
    }
    // A peer may handshake several times on one connection; each `hello` gets an answer.
    loop {
        let msg = match read_frame(&mut sock, cfg.max_frame, cfg.read_timeout, &peer_s).await {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(e) => {
                drop_connection(&stats, &peer_s, &e);
                return;
            }
        };
        let proof_given = matches!(&msg, Message::Hello { auth: Some(_), .. });
        let answer = answer_hello(&served.local, &served.instance, cfg.secret.as_ref(), &server_nonce, msg);
        match &answer {
            Message::Welcome { .. } => {
                stats.welcomed.fetch_add(1, Ordering::Relaxed);
                tracing::info!(peer = %peer_s, "side channel: handshake accepted");
            }
            Message::Refused { message, .. } if message.starts_with(UNAUTHENTICATED) => {
                stats.count(if proof_given { Refusal::WrongSecret } else { Refusal::Unauthenticated });
                tracing::warn!(peer = %peer_s, "side channel: handshake refused: {message}");
                // No second guess on this connection.
                let _ = write_within(&mut sock, &answer, &peer_s, cfg.read_timeout).await;
                return;
            }
            Message::Refused { message, .. } => {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(peer = %peer_s, "side channel: handshake refused: {message}");
            }
            Message::Hello { .. } | Message::Challenge { .. } => {}
        }
        if let Err(e) = write_within(&mut sock, &answer, &peer_s, cfg.read_timeout).await {
            drop_connection(&stats, &peer_s, &e);
            return;
        }
    }
}

/// What a decode server learns from a handshake.
#[derive(Debug, Clone, PartialEq)]
pub enum HandshakeOutcome {
    /// The peer is compatible.
    Welcome {
        /// The peer's descriptor (boxed: it is large and the refusal is small).
        compat: Box<CompatDescriptor>,
        /// The peer's engine id.
        engine_id: String,
        /// The peer connector's handshake metadata.
        metadata: Option<serde_json::Value>,
        /// What this (receiving) side applies to the peer's bytes.
        plan: AdaptationPlan,
        /// The peer process's random id (absent from releases before it was sent).
        instance: Option<String>,
    },
    /// The peer refused, or its answer shows a mismatch: nothing may be loaded from it.
    Refused {
        /// The differing fields.
        diff: Vec<FieldDiff>,
        /// The reason, worded by role.
        message: String,
    },
}

/// Decode side: handshakes with the prefill server at `addr` (`host:port`).
pub async fn handshake(
    addr: &str,
    local: &CompatDescriptor,
    engine_id: &str,
    secret: Option<&Secret>,
    timeout: Duration,
) -> Result<HandshakeOutcome, SideChannelError> {
    let connect_err = |message: String| SideChannelError::Connect { addr: addr.to_owned(), message };
    let mut sock = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| connect_err(format!("no answer within {timeout:?}")))?
        .map_err(|e| connect_err(e.to_string()))?;
    let _ = sock.set_nodelay(true);
    let server_nonce = match read_frame(&mut sock, DEFAULT_MAX_FRAME, timeout, addr)
        .await?
        .ok_or_else(|| SideChannelError::Closed { peer: addr.to_owned() })?
    {
        Message::Challenge { nonce } => nonce,
        other => return Err(SideChannelError::Unexpected { peer: addr.to_owned(), got: other.kind() }),
    };
    let nonce = auth::nonce().map_err(|e| SideChannelError::Encode(e.to_string()))?;
    let hello = Message::Hello {
        version: Some(PROTOCOL_VERSION),
        compat: local.clone(),
        engine_id: engine_id.to_owned(),
        auth: Some(HelloAuth {
            proof: auth::proof(secret, CHANNEL, Side::Client, &server_nonce, &nonce),
            nonce: nonce.clone(),
        }),
    };
    write_within(&mut sock, &hello, addr, timeout).await?;
    let answer = read_frame(&mut sock, DEFAULT_MAX_FRAME, timeout, addr)
        .await?
        .ok_or_else(|| SideChannelError::Closed { peer: addr.to_owned() })?;
    match answer {
        Message::Welcome { proof, .. }
            if !auth::verify(secret, CHANNEL, Side::Server, &server_nonce, &nonce, &proof) =>
        {
            Ok(HandshakeOutcome::Refused {
                diff: Vec::new(),
                message: format!(
                    "{UNAUTHENTICATED}: the side channel at {addr} did not prove the \
                    deployment's data-plane secret; nothing is loaded from it. Give every worker the same \
                    KVCONNECT_SIDE_CHANNEL_TOKEN or --secret-file"
                ),
            })
        }
        Message::Welcome { version, compat, engine_id: peer_engine, metadata, instance, .. } => {
            if let Err(e) =
                VersionMismatch::check(PROTOCOL, "decode worker", PROTOCOL_VERSION, "prefill worker", version)
            {
                return Ok(HandshakeOutcome::Refused { diff: Vec::new(), message: e.to_string() });
            }
            // Check again from this side: the plan is what the receiver applies, and a peer
            // that welcomes a mismatch must not get its bytes written into our cache.
            match check_roles(&compat, local) {
                Ok(plan) => Ok(HandshakeOutcome::Welcome {
                    compat: Box::new(compat),
                    engine_id: peer_engine,
                    metadata,
                    plan,
                    instance,
                }),
                Err(inc) => Ok(HandshakeOutcome::Refused {
                    message: render_refusal(&peer_engine, engine_id, &inc.diffs),
                    diff: inc.diffs,
                }),
            }
        }
        Message::Refused { diff, message } => Ok(HandshakeOutcome::Refused { diff, message }),
        other @ (Message::Hello { .. } | Message::Challenge { .. }) => {
            Err(SideChannelError::Unexpected { peer: addr.to_owned(), got: other.kind() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::negotiate::{negotiate, ChildCaps, EngineOptions};
    use kvconnect_api::{KvTransferConfig, ModelSpec};

    const REFERENCE: &str = include_str!("../../fixtures/models/kvconnect--reference/config.json");

    fn descriptor(children: &[&str]) -> CompatDescriptor {
        descriptor_tp(children, 1)
    }

    /// Over nixl's backend `nixl`, which moves KV between equal TP sizes only.
    fn descriptor_tp(children: &[&str], tp_size: u32) -> CompatDescriptor {
        descriptor_on("nixl", children, tp_size)
    }

    fn descriptor_on(backend: &str, children: &[&str], tp_size: u32) -> CompatDescriptor {
        let model = ModelSpec::from_hf_config_json(REFERENCE).unwrap();
        let cfg = KvTransferConfig::from_json(&format!(
            r#"{{"kv_connector":"x","kv_connector_extra_config":{{"backend":"{backend}"}}}}"#
        ))
        .unwrap();
        let caps: Vec<ChildCaps> = children
            .iter()
            .map(|n| ChildCaps {
                name: (*n).to_owned(),
                version: "0.1.0".to_owned(),
                caps: match *n {
                    "nixl" => kvconnect_nixl::caps::capabilities(&cfg, Some(&model)).unwrap(),
                    "lmcache" => kvconnect_lmcache::caps::capabilities(&cfg, Some(&model)).unwrap(),
                    other => panic!("{other}"),
                },
            })
            .collect();
        let opts = EngineOptions { tp_size, ..EngineOptions::default() };
        let n = negotiate(&model, &opts, &caps).unwrap();
        CompatDescriptor::new(&model, &n, &opts)
    }

    fn identity(children: &[&str]) -> LocalIdentity {
        LocalIdentity {
            compat: descriptor(children),
            engine_id: "prefill-0".into(),
            metadata: Some(serde_json::json!({"nixl": {"addr": "127.0.0.1:1"}})),
        }
    }

    async fn server(children: &[&str], cfg: SideChannelConfig) -> SideChannelServer {
        SideChannelServer::bind(cfg, identity(children)).await.unwrap()
    }

    #[tokio::test]
    async fn frames_round_trip_through_a_pipe() {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let msg = Message::Refused { diff: Vec::new(), message: "x".repeat(1000) };
        write_frame(&mut a, &msg, "t").await.unwrap();
        write_frame(&mut a, &msg, "t").await.unwrap();
        drop(a);
        for _ in 0..2 {
            assert_eq!(
                read_frame(&mut b, DEFAULT_MAX_FRAME, DEFAULT_READ_TIMEOUT, "t").await.unwrap(),
                Some(msg.clone())
            );
        }
        assert_eq!(read_frame(&mut b, DEFAULT_MAX_FRAME, DEFAULT_READ_TIMEOUT, "t").await.unwrap(), None);
    }

    #[tokio::test]
    async fn length_prefix_is_big_endian_u32() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let msg = Message::Refused { diff: Vec::new(), message: "m".into() };
        write_frame(&mut a, &msg, "t").await.unwrap();
        let mut len = [0u8; 4];
        b.read_exact(&mut len).await.unwrap();
        let body = serde_json::to_vec(&msg).unwrap();
        assert_eq!(u32::from_be_bytes(len) as usize, body.len());
    }

    #[tokio::test]
    async fn oversized_frame_is_refused_before_reading_it() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&(1024u32).to_be_bytes()).await.unwrap();
        let e = read_frame(&mut b, 512, DEFAULT_READ_TIMEOUT, "peer").await.unwrap_err();
        assert!(matches!(e, SideChannelError::FrameTooLarge { len: 1024, cap: 512, .. }), "{e}");
        assert!(e.to_string().contains("above the 512-byte cap"), "{e}");
    }

    #[tokio::test]
    async fn a_stalled_peer_times_out() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&[0, 0]).await.unwrap();
        let e = read_frame(&mut b, 512, Duration::from_millis(50), "peer").await.unwrap_err();
        assert!(matches!(e, SideChannelError::Timeout { what: "reading a frame length", .. }), "{e}");
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&10u32.to_be_bytes()).await.unwrap();
        a.write_all(b"{\"ty").await.unwrap();
        let e = read_frame(&mut b, 512, Duration::from_millis(50), "peer").await.unwrap_err();
        assert!(matches!(e, SideChannelError::Timeout { what: "reading a frame body", .. }), "{e}");
    }

    #[tokio::test]
    async fn garbage_and_truncation_are_errors_not_panics() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&5u32.to_be_bytes()).await.unwrap();
        a.write_all(b"\xff\x00abc").await.unwrap();
        let e = read_frame(&mut b, 512, DEFAULT_READ_TIMEOUT, "peer").await.unwrap_err();
        assert!(matches!(e, SideChannelError::Garbage { .. }), "{e}");
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&100u32.to_be_bytes()).await.unwrap();
        a.write_all(b"{}").await.unwrap();
        drop(a);
        let e = read_frame(&mut b, 512, DEFAULT_READ_TIMEOUT, "peer").await.unwrap_err();
        assert!(matches!(e, SideChannelError::Closed { .. }), "{e}");
    }

    #[tokio::test]
    async fn compatible_peers_are_welcomed_with_metadata() {
        let s = server(&["nixl"], SideChannelConfig::default()).await;
        assert!(s.local_addr().ip().is_loopback());
        let out = handshake(
            &s.local_addr().to_string(),
            &descriptor(&["nixl"]),
            "decode-0",
            None,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        match out {
            HandshakeOutcome::Welcome { engine_id, metadata, plan, instance, .. } => {
                assert_eq!(engine_id, "prefill-0");
                assert_eq!(instance.as_deref(), Some(s.instance()), "the welcome names the process");
                assert_eq!(s.instance().len(), 32);
                assert_eq!(metadata.unwrap()["nixl"]["addr"], "127.0.0.1:1");
                assert!(plan.is_identity());
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.stats().snapshot().welcomed, 1);
    }

    #[tokio::test]
    async fn hma_mismatch_is_refused_with_the_field_diff() {
        // DYN-3545: a composite with lmcache on prefill turns HMA off; a plain nixl decode
        // negotiated alone keeps it on for the hybrid reference model.
        let s = server(&["lmcache", "nixl"], SideChannelConfig::default()).await;
        let out = handshake(
            &s.local_addr().to_string(),
            &descriptor(&["nixl"]),
            "decode-0",
            None,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        let HandshakeOutcome::Refused { diff, message } = out else { panic!("{out:?}") };
        assert!(diff.iter().any(|d| d.field == "hma"), "{diff:?}");
        assert!(message.contains("hma: prefill=off"), "{message}");
        assert!(message.contains("decode=on"), "{message}");
        assert!(message.contains("lmcache"), "{message}");
        assert_eq!(s.stats().snapshot().refused, 1);
    }

    /// A prefill engine with this descriptor, answering one handshake from `decode`.
    async fn handshake_with(prefill: CompatDescriptor, decode: &CompatDescriptor) -> HandshakeOutcome {
        let local = LocalIdentity { compat: prefill, engine_id: "prefill-0".into(), metadata: None };
        let s = SideChannelServer::bind(SideChannelConfig::default(), local).await.unwrap();
        let out = handshake(&s.local_addr().to_string(), decode, "decode-0", None, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(s.stats().snapshot().welcomed, u64::from(matches!(out, HandshakeOutcome::Welcome { .. })));
        out
    }

    #[tokio::test]
    async fn a_tp_mismatch_is_refused_naming_both_sizes_and_the_remedy() {
        // nixl over backend nixl loads only between equal TP sizes: prefill TP 2, decode TP 4
        // is refused.
        let out = handshake_with(descriptor_tp(&["nixl"], 2), &descriptor_tp(&["nixl"], 4)).await;
        let HandshakeOutcome::Refused { diff, message } = out else { panic!("{out:?}") };
        assert_eq!(diff.iter().map(|d| d.field.as_str()).collect::<Vec<_>>(), ["tp_size"]);
        assert!(
            message.contains(
                "tp_size: prefill=2 (user set tp_size=2; child 'nixl' moves KV only between equal TP sizes"
            ),
            "{message}"
        );
        assert!(message.contains("decode=4 (user set tp_size=4;"), "{message}");
        assert!(
            message.contains("run decode with tp_size=2 like prefill, or prefill with tp_size=4"),
            "{message}"
        );
        assert!(message.contains("no KV was transferred"), "{message}");
        // Equal sizes are welcomed.
        let out = handshake_with(descriptor_tp(&["nixl"], 2), &descriptor_tp(&["nixl"], 2)).await;
        assert!(matches!(out, HandshakeOutcome::Welcome { .. }), "{out:?}");
    }

    #[tokio::test]
    async fn tp_sizes_that_do_not_divide_are_refused_even_by_transports_that_regroup_heads() {
        // As a transport that declares heterogeneous TP would describe itself.
        let regrouping = |tp| CompatDescriptor { heterogeneous_tp: true, ..descriptor_tp(&["nixl"], tp) };
        let out = handshake_with(regrouping(2), &regrouping(3)).await;
        let HandshakeOutcome::Refused { message, .. } = out else { panic!("{out:?}") };
        assert!(message.contains("tp_size: prefill=2"), "{message}");
        assert!(message.contains("decode=3"), "{message}");
        assert!(message.contains("TP sizes 2 and 3 do not divide each other"), "{message}");
        let out = handshake_with(regrouping(2), &regrouping(4)).await;
        let HandshakeOutcome::Welcome { plan, .. } = out else { panic!("{out:?}") };
        assert_eq!(plan.tp_ratio, Some((2, 1)), "decode (4) receives from prefill (2)");
        // A peer that says nothing about heterogeneous TP (an older one) needs equal sizes.
        let out = handshake_with(descriptor_tp(&["nixl"], 2), &regrouping(4)).await;
        assert!(matches!(out, HandshakeOutcome::Refused { .. }), "{out:?}");
        // nixl over shm regroups heads: 2 -> 4 and 2 -> 1 are welcomed, 2 -> 3 is not.
        let shm = |tp| descriptor_on("shm", &["nixl"], tp);
        for (d, ratio) in [(4, (2, 1)), (1, (1, 2))] {
            let out = handshake_with(shm(2), &shm(d)).await;
            let HandshakeOutcome::Welcome { plan, .. } = out else { panic!("{out:?}") };
            assert_eq!(plan.tp_ratio, Some(ratio), "prefill 2, decode {d}");
        }
        let out = handshake_with(shm(2), &shm(3)).await;
        let HandshakeOutcome::Refused { message, .. } = out else { panic!("{out:?}") };
        assert!(message.contains("TP sizes 2 and 3 do not divide each other"), "{message}");
    }

    #[tokio::test]
    async fn decode_refuses_a_welcome_for_another_tp_size() {
        // A prefill engine that welcomes anyone: decode checks again and loads nothing.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let prefill = descriptor_tp(&["nixl"], 2);
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let challenge = Message::Challenge { nonce: "00".into() };
            write_frame(&mut sock, &challenge, "d").await.unwrap();
            let Ok(Some(Message::Hello { auth: Some(a), .. })) =
                read_frame(&mut sock, DEFAULT_MAX_FRAME, DEFAULT_READ_TIMEOUT, "d").await
            else {
                return;
            };
            let proof = auth::proof(None, CHANNEL, Side::Server, "00", &a.nonce);
            let welcome = Message::Welcome {
                version: Some(PROTOCOL_VERSION),
                compat: prefill,
                engine_id: "prefill-0".into(),
                metadata: None,
                proof,
                instance: None,
            };
            write_frame(&mut sock, &welcome, "d").await.unwrap();
        });
        let out = handshake(&addr, &descriptor_tp(&["nixl"], 1), "decode-0", None, Duration::from_secs(5))
            .await
            .unwrap();
        let HandshakeOutcome::Refused { message, .. } = out else { panic!("{out:?}") };
        assert!(message.contains("tp_size: prefill=2") && message.contains("decode=1"), "{message}");
    }

    #[tokio::test]
    async fn the_secret_is_proven_never_sent_and_a_wrong_one_refused() {
        let secret = Secret::from_text("the-deployment-secret-0123", "test").unwrap();
        let cfg = SideChannelConfig { secret: Some(secret.clone()), ..SideChannelConfig::default() };
        let s = server(&["nixl"], cfg).await;
        let addr = s.local_addr().to_string();
        let d = descriptor(&["nixl"]);
        let guess = Secret::from_text("a-guessed-secret-of-length", "test").unwrap();
        for wrong in [Some(&guess), None] {
            let bad = handshake(&addr, &d, "decode-0", wrong, Duration::from_secs(5)).await.unwrap();
            assert!(
                matches!(&bad, HandshakeOutcome::Refused { message, .. }
                    if message.starts_with(UNAUTHENTICATED)
                        && message.contains("KVCONNECT_SIDE_CHANNEL_TOKEN")),
                "{bad:?}"
            );
        }
        // A proof made with another secret, or with none, does not verify.
        assert_eq!(s.stats().snapshot().wrong_secret, 2);
        assert_eq!(s.stats().snapshot().unauthenticated, 0);
        // A hello with no proof at all.
        let mut c = challenged(&addr).await;
        let bare = Message::Hello {
            version: Some(PROTOCOL_VERSION),
            compat: d.clone(),
            engine_id: "d".into(),
            auth: None,
        };
        write_frame(&mut c, &bare, "server").await.unwrap();
        let m = read_frame(&mut c, DEFAULT_MAX_FRAME, Duration::from_secs(5), "server").await.unwrap();
        assert!(
            matches!(&m, Some(Message::Refused { message, .. }) if message.starts_with(UNAUTHENTICATED)),
            "{m:?}"
        );
        assert_eq!(
            read_frame(&mut c, DEFAULT_MAX_FRAME, Duration::from_secs(5), "server").await.unwrap(),
            None
        );
        assert_eq!(s.stats().snapshot().unauthenticated, 1);
        let good = handshake(&addr, &d, "decode-0", Some(&secret), Duration::from_secs(5)).await.unwrap();
        assert!(matches!(good, HandshakeOutcome::Welcome { .. }));
        // The hello carries a proof over both nonces, never the secret itself.
        let hello = Message::Hello {
            version: Some(PROTOCOL_VERSION),
            compat: d.clone(),
            engine_id: "d".into(),
            auth: Some(HelloAuth {
                nonce: "00".into(),
                proof: auth::proof(Some(&secret), CHANNEL, Side::Client, "11", "00"),
            }),
        };
        assert!(!serde_json::to_string(&hello).unwrap().contains(&secret.to_text()));
        // Two sides with different secrets (here none on the server) never agree.
        let open = server(&["nixl"], SideChannelConfig::default()).await;
        let out =
            handshake(&open.local_addr().to_string(), &d, "decode-0", Some(&secret), Duration::from_secs(5))
                .await
                .unwrap();
        assert!(
            matches!(&out, HandshakeOutcome::Refused { message, .. } if message.starts_with(UNAUTHENTICATED)),
            "{out:?}"
        );
        // Beyond loopback a secret is required.
        let wide =
            SideChannelConfig { host: IpAddr::V4(Ipv4Addr::UNSPECIFIED), ..SideChannelConfig::default() };
        let e = SideChannelServer::bind(wide, identity(&["nixl"])).await.err().unwrap().to_string();
        assert!(e.contains("without a data-plane secret") && e.contains("--secret-file"), "{e}");
    }

    /// A connection whose challenge was read.
    async fn challenged(addr: &str) -> TcpStream {
        let mut c = TcpStream::connect(addr).await.unwrap();
        let m = read_frame(&mut c, 4096, Duration::from_secs(5), "server").await.unwrap().unwrap();
        assert!(matches!(m, Message::Challenge { .. }), "{m:?}");
        c
    }

    #[tokio::test]
    async fn dripped_frames_and_connections_past_the_cap_are_dropped() {
        let cfg = SideChannelConfig {
            read_timeout: Duration::from_millis(300),
            max_connections: 2,
            ..SideChannelConfig::default()
        };
        let s = server(&["nixl"], cfg).await;
        let addr = s.local_addr().to_string();
        // One byte every 100 ms: no read waits past the timeout, the frame does.
        let mut drip = challenged(&addr).await;
        let t0 = std::time::Instant::now();
        let mut closed = false;
        for b in 200u32.to_be_bytes().into_iter().chain(std::iter::repeat_n(b'x', 200)) {
            if drip.write_all(&[b]).await.is_err() {
                closed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            if t0.elapsed() > Duration::from_secs(3) {
                break;
            }
        }
        let mut buf = [0u8; 1];
        closed = closed || matches!(drip.read(&mut buf).await, Ok(0) | Err(_));
        assert!(closed && t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        assert_eq!(s.stats().snapshot().dropped, 1);
        assert_eq!(s.stats().snapshot().timeout, 1);
        // Two held open; a third is closed at once without a challenge.
        let (_a, _b) = (challenged(&addr).await, challenged(&addr).await);
        let mut c = TcpStream::connect(&addr).await.unwrap();
        assert_eq!(c.read(&mut buf).await.unwrap_or(0), 0);
        assert_eq!(s.stats().snapshot().over_cap, 1);
    }

    #[tokio::test]
    async fn misbehaving_peers_are_dropped_and_others_still_served() {
        let cfg = SideChannelConfig {
            read_timeout: Duration::from_millis(200),
            max_frame: 4096,
            ..SideChannelConfig::default()
        };
        let s = server(&["nixl"], cfg).await;
        let addr = s.local_addr().to_string();
        // Garbage: a valid length, then bytes that are not a message.
        let mut g = challenged(&addr).await;
        g.write_all(&4u32.to_be_bytes()).await.unwrap();
        g.write_all(b"junk").await.unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(g.read(&mut buf).await.unwrap(), 0, "garbage connection must be closed");
        // Oversized: a length above the cap.
        let mut o = challenged(&addr).await;
        o.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        assert_eq!(o.read(&mut buf).await.unwrap(), 0, "oversized connection must be closed");
        // A stalled one is dropped after the timeout while a good one is served meanwhile.
        let mut stalled = challenged(&addr).await;
        stalled.write_all(&[0]).await.unwrap();
        let out =
            handshake(&addr, &descriptor(&["nixl"]), "decode-0", None, Duration::from_secs(5)).await.unwrap();
        assert!(matches!(out, HandshakeOutcome::Welcome { .. }));
        assert_eq!(stalled.read(&mut buf).await.unwrap(), 0, "stalled connection must be closed");
        let snap = s.stats().snapshot();
        assert_eq!(snap.dropped, 3);
        assert_eq!((snap.malformed, snap.oversized, snap.timeout, snap.truncated), (1, 1, 1, 0), "{snap:?}");
        // Cut in the middle of a frame.
        let mut t = challenged(&addr).await;
        t.write_all(&40u32.to_be_bytes()).await.unwrap();
        t.write_all(b"{\"type\":").await.unwrap();
        drop(t);
        let truncated = async {
            while s.stats().snapshot().truncated == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), truncated)
            .await
            .expect("the truncated frame was not counted");
        assert_eq!(s.stats().snapshot().dropped, 4);
        let reasons = s.stats().snapshot().refusals();
        assert_eq!(
            reasons,
            [
                ("unauthenticated", 0),
                ("wrong_secret", 0),
                ("malformed", 1),
                ("oversized", 1),
                ("truncated", 1),
                ("timeout", 1),
                ("too_many_connections", 0)
            ]
        );
    }

    #[tokio::test]
    async fn connecting_to_nobody_names_the_address() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        drop(l);
        let e =
            handshake(&addr, &descriptor(&["nixl"]), "d", None, Duration::from_secs(2)).await.unwrap_err();
        assert!(e.to_string().contains(&addr), "{e}");
    }

    #[test]
    fn a_message_that_is_not_hello_is_refused() {
        let local = identity(&["nixl"]);
        let m = answer_hello(
            &local,
            "i",
            None,
            "00",
            Message::Refused { diff: Vec::new(), message: String::new() },
        );
        assert!(matches!(m, Message::Refused { message, .. } if message.contains("expected a 'hello'")));
    }

    #[test]
    fn a_hello_of_another_version_is_refused_naming_both() {
        let local = identity(&["nixl"]);
        let hello = |version| Message::Hello {
            version,
            compat: descriptor(&["nixl"]),
            engine_id: "decode-0".into(),
            auth: Some(HelloAuth {
                nonce: "11".into(),
                proof: auth::proof(None, CHANNEL, Side::Client, "00", "11"),
            }),
        };
        assert!(matches!(
            answer_hello(&local, "i", None, "00", hello(Some(PROTOCOL_VERSION))),
            Message::Welcome { .. }
        ));
        let Message::Refused { message, diff } =
            answer_hello(&local, "i", None, "00", hello(Some(PROTOCOL_VERSION + 1)))
        else {
            panic!("a newer hello must be refused")
        };
        assert!(diff.is_empty());
        assert_eq!(
            message,
            format!(
                "side-channel handshake version mismatch: this prefill worker speaks version \
                 {PROTOCOL_VERSION}, the decode worker speaks version {} — run the same kvconnect \
                 release on both",
                PROTOCOL_VERSION + 1
            )
        );
        // A hello from before versions were sent decodes, and is refused as such.
        let old: Message = serde_json::from_value(serde_json::json!({
            "type": "hello", "compat": descriptor(&["nixl"]), "engine_id": "decode-0"
        }))
        .unwrap();
        let Message::Refused { message, .. } = answer_hello(&local, "i", None, "00", old) else {
            panic!("refused")
        };
        assert!(message.contains("the decode worker speaks no version"), "{message}");
    }

    #[tokio::test]
    async fn decode_refuses_a_welcome_of_another_version() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            write_frame(&mut sock, &Message::Challenge { nonce: "00".into() }, "d").await.unwrap();
            let Ok(Some(Message::Hello { auth: Some(a), .. })) =
                read_frame(&mut sock, DEFAULT_MAX_FRAME, DEFAULT_READ_TIMEOUT, "d").await
            else {
                return;
            };
            let welcome = Message::Welcome {
                version: Some(7),
                compat: descriptor(&["nixl"]),
                engine_id: "prefill-0".into(),
                metadata: None,
                proof: auth::proof(None, CHANNEL, Side::Server, "00", &a.nonce),
                instance: None,
            };
            write_frame(&mut sock, &welcome, "d").await.unwrap();
        });
        let out =
            handshake(&addr, &descriptor(&["nixl"]), "decode-0", None, Duration::from_secs(5)).await.unwrap();
        let HandshakeOutcome::Refused { message, .. } = out else { panic!("{out:?}") };
        assert_eq!(
            message,
            format!(
                "side-channel handshake version mismatch: this decode worker speaks version \
                 {PROTOCOL_VERSION}, the prefill worker speaks version 7 — run the same kvconnect \
                 release on both"
            )
        );
    }
}
