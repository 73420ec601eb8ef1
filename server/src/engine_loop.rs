//! The engine's own thread: it steps continuously while there is work and talks to the HTTP
//! handlers only through a command channel, so no handler ever holds the engine.

use kvconnect_api::{ConnectorMetric, KvEvent, KvEventBatch, TierTokens};
use kvconnect_engine::{Cancel, Engine, FinishReason, GenRequest, RequestOutput, TokenLogprobs};
use kvconnect_events::ZmqEventPublisher;
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc as tmpsc, oneshot};

/// One generated token as a stream passes it on.
#[derive(Debug, Clone, PartialEq)]
pub struct Produced {
    /// The token.
    pub token: u32,
    /// Its log-probabilities, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// What a stream receives: a choice's index and that choice's tokens of one step.
pub type TokenStream = tmpsc::UnboundedReceiver<(usize, Vec<Produced>)>;

/// Where a streaming request's new tokens go, step by step, as the engine produces them. The
/// choices of one OpenAI request share one channel, each sending under its own index, so the
/// stream sees every choice's tokens in the order they were produced.
#[derive(Debug, Clone)]
pub struct TokenSink {
    tx: tmpsc::UnboundedSender<(usize, Vec<Produced>)>,
    choice: usize,
}

impl TokenSink {
    /// A channel for `choices` choices: the sinks (choice `i` sends under index `i`) and the
    /// stream they feed. The stream ends once every sink is dropped.
    pub fn channel(choices: usize) -> (Vec<TokenSink>, TokenStream) {
        let (tx, rx) = tmpsc::unbounded_channel();
        ((0..choices).map(|choice| TokenSink { tx: tx.clone(), choice }).collect(), rx)
    }

    /// Sends one step's tokens; false when the stream's reader is gone (the client left).
    pub fn send(&self, tokens: Vec<Produced>) -> bool {
        self.tx.send((self.choice, tokens)).is_ok()
    }
}

/// One output's tokens paired with their log-probabilities (absent when not asked for).
fn produced(o: &RequestOutput) -> Vec<Produced> {
    o.new_tokens
        .iter()
        .enumerate()
        .map(|(i, t)| Produced { token: *t, logprobs: o.logprobs.get(i).cloned() })
        .collect()
}

/// What a driven engine must offer: the reference engine, or the transfer-only engine the
/// transfer benchmark uses.
pub trait Driver {
    /// Queues a request.
    fn add(&mut self, req: GenRequest) -> Result<(), SubmitError>;
    /// One step.
    fn step(&mut self) -> Result<Vec<RequestOutput>, StepFailure>;
    /// Ends every unfinished request after a failed step and frees its blocks. With
    /// `connector_dead` (the connector instance panicked and refuses every call), blocks
    /// parked for the connector are freed too, since it will never report them sent.
    /// Returns how many requests it ended.
    fn abort_all(&mut self, why: &str, connector_dead: bool) -> usize;
    /// Ends request `id` because its client is gone, freeing its blocks (see
    /// [`Engine::cancel`]).
    fn cancel(&mut self, id: &str, why: &str) -> Cancel;
    /// True while requests run or delayed blocks wait for the connector.
    fn busy(&self) -> bool;
    /// True when the last step computed nothing (only waiting): the loop then naps briefly.
    fn idle_step(&self) -> bool;
    /// Passes a peer's handshake envelope to the connector's worker half.
    fn set_peer(&mut self, envelope: &Value) -> Result<(), String>;
    /// Pool and request counters.
    fn stats(&self) -> PoolStats;
    /// Shuts the connector down.
    fn shutdown(&mut self);
    /// KV events since the last call (the engine's prefix cache, the connector's tiers).
    /// None by default: an engine without a cache publishes nothing.
    fn take_kv_events(&mut self) -> Result<Vec<KvEvent>, String> {
        Ok(Vec::new())
    }
    /// What the connector counts for `/metrics`. None by default.
    fn connector_metrics(&mut self) -> Result<Vec<ConnectorMetric>, String> {
        Ok(Vec::new())
    }
}

/// A step that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepFailure {
    /// What failed.
    pub message: String,
    /// The connector instance is unusable from now on (a call panicked; it answers
    /// `Poisoned` to every later call).
    pub connector_dead: bool,
}

impl StepFailure {
    /// A failure the engine can go on after (its requests are ended).
    pub fn recoverable(message: impl Into<String>) -> StepFailure {
        StepFailure { message: message.into(), connector_dead: false }
    }

    /// From a connector call's error: dead when the call panicked or the instance is poisoned.
    pub fn from_connector(message: impl Into<String>, e: &kvconnect_api::ConnectorError) -> StepFailure {
        StepFailure { message: message.into(), connector_dead: e.poisons_instance() }
    }
}

/// Why a submitted request got no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The engine refused the request (`request '<id>': ...` for a malformed one).
    #[error("{0}")]
    Rejected(String),
    /// A request with the same id is still in the engine.
    #[error("{0}")]
    Duplicate(String),
    /// The server cannot serve any request (its connector is poisoned): it says so on
    /// `/health` and must be restarted.
    #[error("worker unhealthy: {0}")]
    Unhealthy(String),
    /// The step running the request failed; the request was ended and its blocks freed.
    #[error("{0}")]
    Failed(String),
    /// The engine thread is gone.
    #[error("{ENGINE_GONE}")]
    Gone,
}

/// Counters for /health and /metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PoolStats {
    /// Blocks over all KV cache groups.
    pub total_blocks: usize,
    /// Free blocks over all KV cache groups.
    pub free_blocks: usize,
    /// Requests waiting, loading or running.
    pub unfinished: usize,
    /// Finished requests whose blocks the connector still holds (delayed free).
    pub pending_frees: usize,
    /// Requests completed.
    pub completed: u64,
    /// Requests that ended with an error.
    pub failed: u64,
    /// Prompt tokens whose KV came through the connector.
    pub external_tokens: u64,
    /// Why this server can serve nothing (its connector is poisoned); `None` when healthy.
    pub unhealthy: Option<String>,
}

impl Driver for Engine {
    fn add(&mut self, req: GenRequest) -> Result<(), SubmitError> {
        self.add_request(req).map_err(|e| match e {
            kvconnect_engine::EngineError::DuplicateId { .. } => SubmitError::Duplicate(e.to_string()),
            e => SubmitError::Rejected(e.to_string()),
        })
    }

    fn step(&mut self) -> Result<Vec<RequestOutput>, StepFailure> {
        Engine::step(self).map_err(|e| match e.connector_error() {
            Some(c) => StepFailure::from_connector(e.to_string(), c),
            None => StepFailure::recoverable(e.to_string()),
        })
    }

    fn abort_all(&mut self, why: &str, connector_dead: bool) -> usize {
        Engine::abort_all(self, why, connector_dead)
    }
    fn cancel(&mut self, id: &str, why: &str) -> Cancel {
        Engine::cancel(self, id, why)
    }

    fn busy(&self) -> bool {
        self.has_unfinished() || !self.pending_frees().is_empty()
    }

    fn idle_step(&self) -> bool {
        self.last_step_stats().is_none_or(|s| s.scheduled == 0)
    }

    fn set_peer(&mut self, envelope: &Value) -> Result<(), String> {
        match self.worker_connector() {
            Some(w) => w.set_peer_handshake_metadata(envelope).map_err(|e| e.to_string()),
            None => Err("this worker has no connector".into()),
        }
    }

    fn stats(&self) -> PoolStats {
        PoolStats {
            total_blocks: self.total_blocks(),
            free_blocks: self.free_blocks(),
            unfinished: self.num_unfinished(),
            pending_frees: self.pending_frees().len(),
            ..PoolStats::default()
        }
    }

    fn shutdown(&mut self) {
        if let Err(e) = Engine::shutdown(self) {
            tracing::warn!(error = %e, "connector shutdown failed");
        }
    }

    fn take_kv_events(&mut self) -> Result<Vec<KvEvent>, String> {
        Engine::take_kv_events(self).map_err(|e| e.to_string())
    }

    fn connector_metrics(&mut self) -> Result<Vec<ConnectorMetric>, String> {
        Engine::connector_metrics(self).map_err(|e| e.to_string())
    }
}

/// A finished request.
#[derive(Debug, Clone)]
pub struct Done {
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Their log-probabilities, when the request asked for them.
    pub logprobs: Vec<TokenLogprobs>,
    /// Why it ended.
    pub finish: FinishReason,
    /// What the connector returned for the peer.
    pub kv_transfer_params: Option<Map<String, Value>>,
    /// Time to first token, from the moment the request was handed to the engine thread (the
    /// wait for the step that was running then included, as vLLM counts from arrival).
    pub ttft: Option<Duration>,
    /// Prompt tokens loaded through the connector.
    pub num_external_tokens: usize,
    /// Prompt tokens found in the engine's prefix cache.
    pub num_cached_tokens: usize,
    /// Why the external KV load failed when the prompt was recomputed instead.
    pub kv_load_failure: Option<String>,
    /// Which cache connector and tier supplied the external tokens (lmcache's cpu, disk or
    /// remote tier, flexkv's cpu or ssd tier, a plugin's own), as the connector reported
    /// them in `get_finished`.
    pub load_sources: Vec<TierTokens>,
}

/// A command for the engine thread.
pub enum Command {
    /// Run a request; the answer comes when it ends. With a sink, each step's new tokens are
    /// also sent there as they are produced (the sink closes when the request ends).
    Submit(GenRequest, oneshot::Sender<Result<Done, SubmitError>>, Option<TokenSink>, Instant),
    /// Pass a peer's handshake envelope to the connector.
    SetPeer(Value, oneshot::Sender<Result<(), String>>),
    /// Read the counters.
    Stats(oneshot::Sender<PoolStats>),
    /// Read what the connector counts.
    ConnectorMetrics(oneshot::Sender<Result<Vec<ConnectorMetric>, String>>),
    /// Stop: fail what is unfinished, shut the connector down, drop the engine.
    Shutdown,
}

/// The handlers' end of the channel.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
}

/// The engine thread is gone (it failed to start or was shut down).
pub const ENGINE_GONE: &str = "the engine thread has stopped; the worker is shutting down";

impl EngineHandle {
    /// Runs a request to its end.
    pub async fn submit(&self, req: GenRequest) -> Result<Done, SubmitError> {
        self.submit_streaming(req, None).await
    }

    /// Runs a request to its end, sending each step's new tokens to `sink` as they exist.
    /// A sink whose receiver is gone (the client left) is dropped; the request still runs to
    /// its end so its blocks are freed as usual.
    pub async fn submit_streaming(
        &self,
        req: GenRequest,
        sink: Option<TokenSink>,
    ) -> Result<Done, SubmitError> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::Submit(req, tx, sink, Instant::now())).map_err(|_| SubmitError::Gone)?;
        rx.await.map_err(|_| SubmitError::Gone)?
    }

    /// Hands a peer envelope to the connector.
    pub async fn set_peer(&self, envelope: Value) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::SetPeer(envelope, tx)).map_err(|_| ENGINE_GONE.to_owned())?;
        rx.await.map_err(|_| ENGINE_GONE.to_owned())?
    }

    /// The counters.
    pub async fn stats(&self) -> Result<PoolStats, String> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::Stats(tx)).map_err(|_| ENGINE_GONE.to_owned())?;
        rx.await.map_err(|_| ENGINE_GONE.to_owned())
    }

    /// What the connector counts, asked between steps.
    pub async fn connector_metrics(&self) -> Result<Vec<ConnectorMetric>, String> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::ConnectorMetrics(tx)).map_err(|_| ENGINE_GONE.to_owned())?;
        rx.await.map_err(|_| ENGINE_GONE.to_owned())?
    }

    /// Asks the thread to stop.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

struct Pending {
    reply: oneshot::Sender<Result<Done, SubmitError>>,
    done: Done,
    sink: Option<TokenSink>,
    /// The client is gone (its stream's reader was dropped).
    client_gone: bool,
    /// The engine will not cancel it (it runs every request to its end).
    uncancellable: bool,
    /// When the handler sent it; the engine only takes requests in between steps.
    sent: Instant,
}

/// Why a request is cancelled.
const CLIENT_GONE: &str = "the client disconnected before the request finished";

/// Ends the requests whose clients are gone (a dropped answer or stream), so their blocks
/// are freed now rather than when they would have finished.
fn cancel_abandoned<D: Driver>(driver: &mut D, pending: &mut BTreeMap<String, Pending>) {
    let gone: Vec<String> = pending
        .iter()
        .filter(|(_, p)| !p.uncancellable && (p.client_gone || p.reply.is_closed()))
        .map(|(id, _)| id.clone())
        .collect();
    for id in gone {
        match driver.cancel(&id, CLIENT_GONE) {
            Cancel::Ended => {
                if let Some(p) = pending.remove(&id) {
                    // A streaming handler may still wait for the answer its client will not read.
                    let _ = p.reply.send(Err(SubmitError::Failed(CLIENT_GONE.to_owned())));
                }
                kvconnect_openai::metrics::cancelled();
                tracing::info!(request = %id, "{CLIENT_GONE}; ended it and freed its blocks");
            }
            Cancel::Later => {}
            Cancel::Unknown | Cancel::NotSupported => {
                if let Some(p) = pending.get_mut(&id) {
                    p.uncancellable = true;
                }
            }
        }
    }
}

/// Starts the engine thread. `build` runs on that thread (the engine owns raw memory and is
/// not moved between threads); its `Ok` value (e.g. the connector's handshake metadata) is
/// returned once the engine is up.
pub fn spawn<D, T, F>(build: F) -> Result<(EngineHandle, std::thread::JoinHandle<()>, T), String>
where
    D: Driver + 'static,
    T: Send + 'static,
    F: FnOnce() -> Result<(D, T), String> + Send + 'static,
{
    spawn_publishing(build, None)
}

/// As [`spawn`], the engine's KV events published after each step on `events`.
pub fn spawn_publishing<D, T, F>(
    build: F,
    events: Option<ZmqEventPublisher>,
) -> Result<(EngineHandle, std::thread::JoinHandle<()>, T), String>
where
    D: Driver + 'static,
    T: Send + 'static,
    F: FnOnce() -> Result<(D, T), String> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Command>();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<T, String>>();
    let join = std::thread::Builder::new()
        .name("kvconnect-engine".into())
        .spawn(move || {
            let (driver, extra) = match build() {
                Ok(v) => v,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(extra));
            run(driver, rx, events);
        })
        .map_err(|e| format!("cannot start the engine thread: {e}"))?;
    match ready_rx.recv() {
        Ok(Ok(extra)) => Ok((EngineHandle { tx }, join, extra)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("the engine thread exited while starting (it panicked; see the log)".into()),
    }
}

/// Counts a finished request in /health's counters and in /metrics.
fn count(counters: &mut PoolStats, ok: bool) {
    if ok {
        counters.completed += 1;
    } else {
        counters.failed += 1;
    }
    kvconnect_openai::metrics::finished(ok);
}

/// Publishes the driver's KV events of the last step as one batch (none when there are none).
fn publish_events<D: Driver>(driver: &mut D, publisher: &ZmqEventPublisher) {
    match driver.take_kv_events() {
        Ok(events) if events.is_empty() => {}
        Ok(events) => {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let batch = KvEventBatch { ts, events, data_parallel_rank: Some(0) };
            if let Err(e) = publisher.publish(&batch) {
                tracing::warn!("KV events not published: {e}");
            }
        }
        Err(e) => tracing::warn!("KV events not taken: {e}"),
    }
}

fn run<D: Driver>(mut driver: D, rx: mpsc::Receiver<Command>, events: Option<ZmqEventPublisher>) {
    let mut pending: BTreeMap<String, Pending> = BTreeMap::new();
    let mut counters = PoolStats::default();
    loop {
        // Block for a command only when there is nothing to step.
        let first = if driver.busy() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        } else {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(c) => Some(c),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        };
        let mut stop = false;
        let mut next = first;
        while let Some(cmd) = next {
            match cmd {
                Command::Submit(req, reply, sink, sent) => {
                    let id = req.id.clone();
                    if let Some(why) = counters.unhealthy.clone() {
                        count(&mut counters, false);
                        let _ = reply.send(Err(SubmitError::Unhealthy(why)));
                        next = rx.try_recv().ok();
                        continue;
                    }
                    match driver.add(req) {
                        Ok(()) => {
                            let done = Done {
                                tokens: Vec::new(),
                                logprobs: Vec::new(),
                                finish: FinishReason::Length,
                                kv_transfer_params: None,
                                ttft: None,
                                num_external_tokens: 0,
                                num_cached_tokens: 0,
                                kv_load_failure: None,
                                load_sources: Vec::new(),
                            };
                            pending.insert(
                                id,
                                Pending { reply, done, sink, client_gone: false, uncancellable: false, sent },
                            );
                        }
                        Err(e) => {
                            let _ = reply.send(Err(e));
                        }
                    }
                }
                Command::SetPeer(env, reply) => {
                    let _ = reply.send(driver.set_peer(&env));
                }
                Command::Stats(reply) => {
                    let s = driver.stats();
                    let _ = reply.send(PoolStats {
                        completed: counters.completed,
                        failed: counters.failed,
                        external_tokens: counters.external_tokens,
                        unhealthy: counters.unhealthy.clone(),
                        ..s
                    });
                }
                Command::ConnectorMetrics(reply) => {
                    let _ = reply.send(driver.connector_metrics());
                }
                Command::Shutdown => stop = true,
            }
            next = rx.try_recv().ok();
        }
        if stop {
            break;
        }
        if !driver.busy() {
            continue;
        }
        cancel_abandoned(&mut driver, &mut pending);
        let stepped = driver.step();
        if let Some(p) = &events {
            publish_events(&mut driver, p);
        }
        match stepped {
            Ok(outputs) => {
                for o in outputs {
                    let Some(p) = pending.get_mut(&o.id) else { continue };
                    p.done.tokens.extend(&o.new_tokens);
                    p.done.logprobs.extend(o.logprobs.iter().cloned());
                    if !o.new_tokens.is_empty() {
                        // A closed receiver means the client left: stop sending; the request
                        // is cancelled before the next step.
                        if p.sink.as_ref().is_some_and(|s| !s.send(produced(&o))) {
                            p.sink = None;
                            p.client_gone = true;
                        }
                    }
                    if o.first_token_latency.is_some() {
                        // From the handler's hand-off, not from the engine's admission: a
                        // request that came in during a long step waited for it too.
                        p.done.ttft = Some(p.sent.elapsed());
                        p.done.num_external_tokens = o.num_external_tokens;
                        p.done.num_cached_tokens = o.num_cached_tokens;
                        p.done.kv_load_failure = o.kv_load_failure.clone();
                        counters.external_tokens += o.num_external_tokens as u64;
                        if o.num_external_tokens > 0 {
                            if let Some(t) = p.done.ttft {
                                kvconnect_openai::metrics::external_first_token(t);
                            }
                        }
                    }
                    if let Some(f) = o.finished {
                        if let Some(mut p) = pending.remove(&o.id) {
                            if matches!(f, FinishReason::Error(_)) {
                                count(&mut counters, false);
                            } else {
                                count(&mut counters, true);
                            }
                            p.done.finish = f;
                            p.done.kv_transfer_params = o.kv_transfer_params;
                            p.done.load_sources = o.load_sources;
                            let _ = p.reply.send(Ok(p.done));
                        }
                    }
                }
                if driver.idle_step() {
                    // Only waiting for transfers or delayed frees: do not spin a core.
                    std::thread::sleep(Duration::from_micros(500));
                }
            }
            Err(f) => {
                // The step's requests are ended and their blocks freed: nothing is retried.
                let ended = driver.abort_all(&f.message, f.connector_dead);
                tracing::error!(error = %f.message, requests = ended, "engine step failed; its requests were \
                    ended");
                for (_, p) in std::mem::take(&mut pending) {
                    count(&mut counters, false);
                    let _ =
                        p.reply.send(Err(SubmitError::Failed(format!("engine step failed: {}", f.message))));
                }
                if f.connector_dead {
                    let why = format!(
                        "{}; the connector instance is unusable: restart this worker (kvconnect up restarts \
                            it by itself)",
                        f.message
                    );
                    tracing::error!("{why}");
                    counters.unhealthy = Some(why);
                }
            }
        }
    }
    for (_, p) in std::mem::take(&mut pending) {
        let _ = p.reply.send(Err(SubmitError::Failed("the worker is shutting down".into())));
    }
    driver.shutdown();
    drop(driver);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine whose every step takes `step` and gives each request it holds its one token;
    /// its own first-token latency says 0, as an engine that counts from its admission would.
    struct SlowDriver {
        held: Vec<String>,
        step: Duration,
    }

    impl Driver for SlowDriver {
        fn add(&mut self, req: GenRequest) -> Result<(), SubmitError> {
            self.held.push(req.id);
            Ok(())
        }
        fn step(&mut self) -> Result<Vec<RequestOutput>, StepFailure> {
            std::thread::sleep(self.step);
            Ok(self
                .held
                .drain(..)
                .map(|id| RequestOutput {
                    id,
                    new_tokens: vec![7],
                    finished: Some(FinishReason::Length),
                    first_token_latency: Some(Duration::ZERO),
                    ..RequestOutput::default()
                })
                .collect())
        }
        fn abort_all(&mut self, _why: &str, _connector_dead: bool) -> usize {
            std::mem::take(&mut self.held).len()
        }
        fn cancel(&mut self, _id: &str, _why: &str) -> Cancel {
            Cancel::NotSupported
        }
        fn busy(&self) -> bool {
            !self.held.is_empty()
        }
        fn idle_step(&self) -> bool {
            false
        }
        fn set_peer(&mut self, _envelope: &Value) -> Result<(), String> {
            Ok(())
        }
        fn stats(&self) -> PoolStats {
            PoolStats::default()
        }
        fn shutdown(&mut self) {}
    }

    #[test]
    fn time_to_first_token_counts_the_wait_for_a_running_step() {
        let step = Duration::from_millis(300);
        let (handle, join, ()) = spawn(move || Ok((SlowDriver { held: Vec::new(), step }, ()))).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (a, b, b_elapsed) = rt.block_on(async {
            let h = handle.clone();
            let a = tokio::spawn(async move { h.submit(GenRequest::new("a", vec![1], 1)).await });
            // `b` arrives while `a`'s step runs: the engine takes it only after that step.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let t0 = Instant::now();
            let b = handle.submit(GenRequest::new("b", vec![1], 1)).await;
            (a.await.unwrap(), b, t0.elapsed())
        });
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!((a.tokens, b.tokens.clone()), (vec![7], vec![7]));
        let ttft = b.ttft.expect("b had its first token");
        // The rest of `a`'s step (about 200 ms, less on a slow machine), then `b`'s own 300 ms:
        // at least that step, whatever the timing, where the engine's own count says 0.
        assert!(ttft >= step, "b's TTFT {ttft:?} leaves out the time after its hand-off");
        assert!(ttft <= b_elapsed, "b's TTFT {ttft:?} is longer than its whole request {b_elapsed:?}");
        drop(handle);
        join.join().unwrap();
    }
}
