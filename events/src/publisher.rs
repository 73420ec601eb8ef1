//! A worker's KV events on ZeroMQ, as vLLM's `ZmqEventPublisher` sends them: each batch on a
//! PUB socket as the multipart `(topic, seq, payload)`, `seq` an 8-byte big-endian counter
//! from 0 and `payload` the msgpack `KVEventBatch`; the last `buffer_steps` batches kept for
//! a ROUTER socket that answers a replay request (`start_seq`, 8 bytes big-endian, behind an
//! empty delimiter frame as a REQ socket sends it) with every kept batch from that seq on,
//! each as `(topic, seq, payload)`, then `("", -1, "")`.
//!
//! The sockets live on a thread of their own (a single-threaded tokio runtime), so a caller
//! publishes from synchronous code; a full queue drops the batch and counts it, rather than
//! stall the engine.

use crate::codec::{encode_batch, EncodeError};
use kvconnect_api::KvEventBatch;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// The end-of-replay marker's seq (vLLM's `END_SEQ`).
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Where and how to publish (vLLM's `KVEventsConfig` fields of the zmq publisher).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherConfig {
    /// PUB address to bind, e.g. `tcp://*:5557` (`*` binds every interface; port 0 picks one).
    pub endpoint: String,
    /// ROUTER address for replay requests; `None` for no replay.
    pub replay_endpoint: Option<String>,
    /// The topic frame of every message.
    pub topic: String,
    /// How many past batches the replay socket can send.
    pub buffer_steps: usize,
    /// Batches queued for the socket thread at most; more are dropped and counted.
    pub max_queue: usize,
}

impl PublisherConfig {
    /// vLLM's defaults (`buffer_steps` 10000, queue 100000) for `endpoint`, no replay, no topic.
    pub fn new(endpoint: impl Into<String>) -> PublisherConfig {
        PublisherConfig {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            max_queue: 100_000,
        }
    }
}

/// Why publishing could not start or a batch could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The endpoint is not one this publisher can bind.
    #[error(
        "KV events endpoint {endpoint:?}: {why}; give tcp://HOST:PORT (tcp://*:PORT for every interface)"
    )]
    Endpoint {
        /// The endpoint.
        endpoint: String,
        /// What is wrong.
        why: String,
    },
    /// Binding failed (the port is taken, the address is not local).
    #[error("KV events: cannot bind {endpoint}: {source}; choose a free port")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// The socket's error.
        source: zeromq::ZmqError,
    },
    /// The socket thread could not start.
    #[error("KV events: cannot start the publisher thread: {0}")]
    Thread(String),
    /// The batch is too large to encode.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// The publisher has stopped.
    #[error("KV events: the publisher has stopped; no more batches are sent")]
    Stopped,
}

/// Counters of a publisher.
#[derive(Debug, Default)]
pub struct PublisherCounters {
    /// Batches sent on the PUB socket.
    pub published: AtomicU64,
    /// Batches dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Replay requests answered.
    pub replays: AtomicU64,
    /// Replay requests refused as malformed.
    pub bad_replays: AtomicU64,
}

/// A running publisher; dropping it sends what was queued and closes the sockets.
pub struct ZmqEventPublisher {
    tx: Option<mpsc::Sender<Vec<u8>>>,
    thread: Option<JoinHandle<()>>,
    endpoint: String,
    replay_endpoint: Option<String>,
    counters: Arc<PublisherCounters>,
}

impl ZmqEventPublisher {
    /// Binds the sockets (errors are returned here, not later) and starts the thread.
    pub fn start(cfg: &PublisherConfig) -> Result<ZmqEventPublisher, PublishError> {
        let endpoint = bindable(&cfg.endpoint)?;
        let replay = cfg.replay_endpoint.as_deref().map(bindable).transpose()?;
        let (tx, rx) = mpsc::channel::<Vec<u8>>(cfg.max_queue.max(1));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let counters = Arc::new(PublisherCounters::default());
        let c = counters.clone();
        let topic = cfg.topic.clone().into_bytes();
        let buffer_steps = cfg.buffer_steps;
        let thread = std::thread::Builder::new()
            .name("kv-events-pub".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(PublishError::Thread(e.to_string())));
                        return;
                    }
                };
                rt.block_on(async move {
                    let sockets = match bind(&endpoint, replay.as_deref()).await {
                        Ok((pub_sock, router, bound)) => {
                            let _ = ready_tx.send(Ok(bound));
                            (pub_sock, router)
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let mut state = Loop { topic, buffer: VecDeque::new(), buffer_steps, next_seq: 0, c };
                    state.run(sockets.0, sockets.1, rx).await;
                });
            })
            .map_err(|e| PublishError::Thread(e.to_string()))?;
        let (endpoint, replay_endpoint) = match ready_rx.recv() {
            Ok(Ok(bound)) => bound,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => return Err(PublishError::Thread("the publisher thread ended before binding".into())),
        };
        Ok(ZmqEventPublisher { tx: Some(tx), thread: Some(thread), endpoint, replay_endpoint, counters })
    }

    /// Queues a batch; the thread numbers and sends it. A full queue drops it (counted in
    /// [`PublisherCounters::dropped`]) and answers `Ok`, as a slow subscriber must not stall
    /// the engine.
    pub fn publish(&self, batch: &KvEventBatch) -> Result<(), PublishError> {
        let bytes = encode_batch(batch)?;
        let tx = self.tx.as_ref().ok_or(PublishError::Stopped)?;
        match tx.try_send(bytes) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(PublishError::Stopped),
        }
    }

    /// The PUB endpoint as bound (port 0 resolved), for subscribers to connect to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint as bound, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The counters.
    pub fn counters(&self) -> &PublisherCounters {
        &self.counters
    }
}

impl Drop for ZmqEventPublisher {
    fn drop(&mut self) {
        // Closing the queue ends the loop after the batches already queued are sent.
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `tcp://*:PORT` as the socket library binds it (`0.0.0.0`); other transports refused.
fn bindable(endpoint: &str) -> Result<String, PublishError> {
    let bad = |why: &str| PublishError::Endpoint { endpoint: endpoint.to_owned(), why: why.to_owned() };
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| bad("only tcp:// endpoints are supported"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no :PORT"))?;
    port.parse::<u16>().map_err(|_| bad("the port is not a number from 0 to 65535"))?;
    let host = match host {
        "*" => "0.0.0.0",
        "" => return Err(bad("no host (use * for every interface)")),
        h => h,
    };
    Ok(format!("tcp://{host}:{port}"))
}

type Bound = (String, Option<String>);

async fn bind(
    endpoint: &str,
    replay: Option<&str>,
) -> Result<(zeromq::PubSocket, Option<zeromq::RouterSocket>, Bound), PublishError> {
    let err = |endpoint: &str| {
        let endpoint = endpoint.to_owned();
        move |source| PublishError::Bind { endpoint, source }
    };
    let mut pub_sock = zeromq::PubSocket::new();
    let bound = pub_sock.bind(endpoint).await.map_err(err(endpoint))?.to_string();
    let (router, bound_replay) = match replay {
        Some(r) => {
            let mut router = zeromq::RouterSocket::new();
            let b = router.bind(r).await.map_err(err(r))?.to_string();
            (Some(router), Some(b))
        }
        None => (None, None),
    };
    Ok((pub_sock, router, (bound, bound_replay)))
}

struct Loop {
    topic: Vec<u8>,
    buffer: VecDeque<(u64, Arc<Vec<u8>>)>,
    buffer_steps: usize,
    next_seq: u64,
    c: Arc<PublisherCounters>,
}

impl Loop {
    async fn run(
        &mut self,
        mut pub_sock: zeromq::PubSocket,
        mut router: Option<zeromq::RouterSocket>,
        mut rx: mpsc::Receiver<Vec<u8>>,
    ) {
        loop {
            tokio::select! {
                // Batches first: a flood of replay requests must not delay them.
                biased;
                batch = rx.recv() => match batch {
                    Some(payload) => self.publish(&mut pub_sock, payload).await,
                    None => break,
                },
                req = recv_replay(&mut router) => match (req, router.as_mut()) {
                    (Ok(req), Some(r)) => self.replay(r, req).await,
                    (Err(e), _) => tracing::debug!("KV events: replay socket: {e}"),
                    _ => {}
                },
            }
        }
        let _ = pub_sock.close().await;
        if let Some(r) = router {
            let _ = r.close().await;
        }
    }

    async fn publish(&mut self, pub_sock: &mut zeromq::PubSocket, payload: Vec<u8>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = Arc::new(payload);
        let msg = frames(&[self.topic.clone(), seq.to_be_bytes().to_vec(), payload.to_vec()]);
        if let Err(e) = pub_sock.send(msg).await {
            tracing::warn!("KV events: batch {seq} not published: {e}");
        } else {
            self.c.published.fetch_add(1, Ordering::Relaxed);
        }
        if self.buffer_steps > 0 {
            if self.buffer.len() == self.buffer_steps {
                self.buffer.pop_front();
            }
            self.buffer.push_back((seq, payload));
        }
    }

    /// `[identity, "", start_seq]` as vLLM's publisher expects; anything else is counted and
    /// ignored (vLLM logs it the same way).
    async fn replay(&mut self, router: &mut zeromq::RouterSocket, req: ZmqMessage) {
        let frames_in = req.into_vec();
        let start = match frames_in.as_slice() {
            [_, empty, seq] if empty.is_empty() && seq.len() == 8 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(seq);
                u64::from_be_bytes(b)
            }
            _ => {
                self.c.bad_replays.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    frames = frames_in.len(),
                    "KV events: a replay request is not [\"\", start_seq as 8 bytes big-endian]; ignored"
                );
                return;
            }
        };
        let id = frames_in[0].to_vec();
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            let m = frames(&[
                id.clone(),
                vec![],
                self.topic.clone(),
                seq.to_be_bytes().to_vec(),
                payload.to_vec(),
            ]);
            if let Err(e) = router.send(m).await {
                tracing::debug!("KV events: replay to a gone subscriber: {e}");
                return;
            }
        }
        let end = frames(&[id, vec![], vec![], END_SEQ.to_vec(), vec![]]);
        let _ = router.send(end).await;
        self.c.replays.fetch_add(1, Ordering::Relaxed);
    }
}

async fn recv_replay(router: &mut Option<zeromq::RouterSocket>) -> zeromq::ZmqResult<ZmqMessage> {
    match router {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
}

fn frames(parts: &[Vec<u8>]) -> ZmqMessage {
    let mut m = ZmqMessage::from(parts[0].clone());
    for p in &parts[1..] {
        m.push_back(p.clone().into());
    }
    m
}
