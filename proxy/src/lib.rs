//! The P/D proxy, speaking vLLM's P/D proxy protocol (`toy_proxy_server`): each user request
//! goes first to a prefill server (prefill only: `max_tokens: 1`, not streamed, vLLM's
//! `kv_transfer_params` with `do_remote_decode: true`), then to a decode server with the
//! client's body and the `kv_transfer_params` prefill returned, verbatim; both hops carry one
//! fresh `X-Request-Id` (uuid4) and the client's `Authorization`. Round-robin over the
//! servers of each role that are up, or for prefill by the servers' KV cache events with
//! `--routing kv` (`routing`). The answer is decode's, with what the
//! proxy saw added under `kvconnect.proxy` (which servers, prefill time, time to first token)
//! and prefill's own `kvconnect` block under `kvconnect.prefill`.
//!
//! The proxy checks every OpenAI parameter as a server does (`kvconnect_openai::params`) before prefill
//! produces any KV, and leaves the ones only decode acts on (`n`, `logprobs`, `min_tokens`,
//! `stream_options`, ...) out of prefill's request. A request of several choices (a list of
//! prompts, `n` above 1) is split into one request per choice (`fanout`).
//!
//! Errors keep the servers' OpenAI error bodies and statuses (a refused handshake under
//! `fail` arrives from decode naming the difference); a server that cannot be reached is a
//! 503.

pub mod backends;
pub mod client;
pub mod fanout;
pub mod first_token;
pub mod health;
pub mod kv_subscriber;
pub mod metrics;
pub mod routing;
pub mod tokenize;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use backends::Backends;
use kvconnect_api::Role;
use kvconnect_openai::error::{json_object, openai_error, param_error};
use kvconnect_openai::CONTEXT_TOKENS;
use kvconnect_openai::{params, request_id, stream};
use metrics::ProxyMetrics;
use serde_json::{json, Map, Value};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// The proxy's servers and counters.
pub struct Proxy {
    /// The servers, with which of them are up (kept current by `kvconnect up`'s supervisor, or
    /// `kvconnect proxy`'s watch, `health`).
    pub backends: Arc<Backends>,
    /// How long one server request may take.
    pub timeout: Duration,
    /// Counters for `/metrics`.
    pub metrics: ProxyMetrics,
    /// Numbers the ids of answers the proxy puts together itself.
    next_id: AtomicU64,
    /// Whose turn it is to tokenize a prompt for the KV router (`verbatim_tokens`).
    tokenize_turn: AtomicUsize,
    /// The API key the servers require, sent on every hop.
    pub server_key: Option<String>,
    /// The workers are not kvconnect's (`kvconnect proxy` in front of vLLM servers): the
    /// client's body goes on as it came, as vLLM's own proxy sends it, and each server checks
    /// its own parameters (its model's context, its tokenizer, its sampling options).
    pub verbatim: bool,
    /// The KV router of the prefill servers (`--routing kv`); None: round-robin.
    pub kv: Option<Arc<routing::KvRouter>>,
    /// Which server's token a streamed completion starts with (`--first-token`).
    pub first_token: first_token::FirstToken,
}

impl Proxy {
    /// A proxy over these servers.
    pub fn new(backends: Arc<Backends>, timeout: Duration) -> Proxy {
        Proxy {
            backends,
            timeout,
            metrics: ProxyMetrics::default(),
            next_id: AtomicU64::new(0),
            tokenize_turn: AtomicUsize::new(0),
            server_key: None,
            verbatim: false,
            kv: None,
            first_token: first_token::FirstToken::Decode,
        }
    }

    /// A number for the id of an answer the proxy puts together itself.
    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends one request to a server of `role` that is up. A server that cannot be reached
    /// (it just died; the supervisor has not noticed yet) is skipped for the others of its
    /// role. Returns the server's address with its answer, or the 503 to send.
    async fn send(
        &self,
        role: Role,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> Result<(String, client::Reply), Response> {
        self.send_first(role, None, method, path, body, headers).await
    }

    /// [`Proxy::send`], trying `first` (a server already picked) before the others.
    async fn send_first(
        &self,
        role: Role,
        mut first: Option<String>,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> Result<(String, client::Reply), Response> {
        let mut tried: Vec<String> = Vec::new();
        loop {
            let w = match first.take().map_or_else(|| self.backends.pick(role, &tried), Ok) {
                Ok(w) => w,
                Err(e) if tried.is_empty() => return Err(unreachable(role, e)),
                Err(_) => break,
            };
            let call = client::Call { headers, ..client::Call::new(&w, method, path, body, self.timeout) };
            match client::call(call).await {
                Ok(r) => return Ok((w, r)),
                Err(e @ client::ClientError::Connect { .. }) => {
                    tracing::warn!(worker = %w, "{role} worker unreachable, trying another: {e}");
                    tried.push(w);
                }
                Err(e) => return Err(unreachable(role, e)),
            }
        }
        Err(unreachable(role, format!("no {role} worker could be reached (tried {})", tried.join(", "))))
    }
}

/// The proxy's routes.
pub fn router(p: Arc<Proxy>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(prom))
        .with_state(p)
}

fn unreachable(role: Role, e: impl std::fmt::Display) -> Response {
    openai_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        format!("{role} worker unavailable: {e}"),
        None,
    )
}

fn relay(status: u16, body: Value) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    (status, Json(body)).into_response()
}

/// Parameters only decode acts on: prefill computes the prompt alone (`max_tokens: 1`), so a
/// limit, a choice count or an output option there would only refuse or slow it.
const DECODE_ONLY: &[&str] = &[
    "max_completion_tokens",
    "min_tokens",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "echo",
];

async fn disaggregated(p: &Arc<Proxy>, raw: &[u8], chat: bool, auth: Option<String>) -> Response {
    let t0 = Instant::now();
    let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
    let mut body = match json_object(raw) {
        Ok(b) => b,
        Err(r) => return r,
    };
    if p.verbatim {
        if p.first_token == first_token::FirstToken::Prefill {
            match first_token::plan(&body, chat) {
                Ok(rest) => return first_token::serve(p, path, body, t0, auth, rest).await,
                Err(why) => p.metrics.first_token_from_decode(why),
            }
        }
        let stream = body.remove("stream").is_some_and(|s| s == json!(true));
        return match one_or_stream(p, path, body, t0, auth, stream).await {
            Ok(Either::One(v)) => Json(v).into_response(),
            Ok(Either::Stream(events)) => sse_response(events),
            Err(r) => r,
        };
    }
    // Every parameter is checked here, before prefill produces KV for a decode that would
    // refuse the request.
    let req = match params::parse(&body, chat) {
        Ok(r) => r,
        Err(e) => return param_error(e),
    };
    for prompt in &req.prompts {
        if let Err(e) = params::check_context(prompt.len(), req.max_tokens, CONTEXT_TOKENS) {
            return param_error(e);
        }
    }
    body.remove("stream");
    if req.choices() > 1 {
        return fanout::serve(p, path, body, &req, auth).await;
    }
    if !req.stream {
        return match one(p, path, body, t0, auth).await {
            Ok(v) => Json(v).into_response(),
            Err(r) => r,
        };
    }
    match one_stream(p, path, body, t0, auth).await {
        Ok(events) => sse_response(events),
        Err(r) => r,
    }
}

/// One choice's answer: whole, or decode's stream.
enum Either {
    One(Value),
    Stream(mpsc::Receiver<Bytes>),
}

async fn one_or_stream(
    p: &Arc<Proxy>,
    path: &str,
    body: Map<String, Value>,
    t0: Instant,
    auth: Option<String>,
    stream: bool,
) -> Result<Either, Response> {
    if stream {
        one_stream(p, path, body, t0, auth).await.map(Either::Stream)
    } else {
        one(p, path, body, t0, auth).await.map(Either::One)
    }
}

/// What prefill did for one choice, and what decode gets.
struct Prefilled {
    pw: String,
    /// Prefill's whole answer (its `kvconnect` block goes into decode's).
    answer: Value,
    done: Duration,
    dec: Map<String, Value>,
    /// The hop's headers: its X-Request-Id, and the client's Authorization.
    headers: Vec<(&'static str, String)>,
}

impl Prefilled {
    fn headers(&self) -> Vec<(&str, &str)> {
        borrowed(&self.headers)
    }
}

/// Owned header pairs as the client takes them.
fn borrowed<'a>(headers: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    headers.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// What vLLM's P/D proxy sends prefill: the client's body asking for one token, not
/// streamed, without what only decode acts on, and asking for the KV to be kept for a remote
/// decode.
pub fn prefill_body(body: &Map<String, Value>) -> Map<String, Value> {
    let mut pre = body.clone();
    for k in DECODE_ONLY {
        pre.remove(*k);
    }
    pre.insert("max_tokens".into(), json!(1));
    pre.insert("stream".into(), json!(false));
    pre.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    pre
}

/// What prefill is asked for besides vLLM's P/D protocol's one token.
#[derive(Clone, Copy, Debug)]
struct PrefillAsk {
    /// The prompt's and its token's ids (vLLM's `return_token_ids`).
    token_ids: bool,
    /// Keep the prompt's KV for a decode (false: prefill's answer is the whole answer).
    remote_decode: bool,
}

impl PrefillAsk {
    /// vLLM's P/D protocol: one token, its KV kept for decode.
    const PROTOCOL: PrefillAsk = PrefillAsk { token_ids: false, remote_decode: true };
}

/// Prefill's half of one choice, under a fresh X-Request-Id; decode's body is the client's
/// with the transfer params prefill returned, verbatim.
async fn prefill(
    p: &Arc<Proxy>,
    path: &str,
    body: Map<String, Value>,
    t0: Instant,
    auth: Option<String>,
    ask: PrefillAsk,
) -> Result<Prefilled, Response> {
    let mut headers = vec![(request_id::HEADER, uuid::Uuid::new_v4().to_string())];
    if let Some(a) = auth {
        headers.push(("authorization", a));
    }
    let mut pre = prefill_body(&body);
    if ask.token_ids {
        pre.insert("return_token_ids".into(), json!(true));
    }
    if !ask.remote_decode {
        pre.remove("kv_transfer_params");
    }
    let picked = match &p.kv {
        None => None,
        Some(kv) => {
            let chat = path.ends_with("chat/completions");
            // In front of vLLM the ids may cost a /tokenize round trip: not asked for while the
            // router has no events to use them with.
            let tokens = if !p.verbatim {
                params::parse(&body, chat).ok().and_then(|r| r.prompts.into_iter().next())
            } else if kv.has_events() {
                verbatim_tokens(p, &body, chat, &borrowed(&headers)).await
            } else {
                None
            };
            let picked = kv.pick(&p.backends, tokens.as_deref(), &[]).map_err(|e| {
                p.metrics.error();
                unreachable(Role::Prefill, e)
            })?;
            Some(picked)
        }
    };
    let first = picked.as_ref().map(|x| x.http.clone());
    let (pw, pr) = p
        .send_first(Role::Prefill, first, "POST", path, Some(&Value::Object(pre)), &borrowed(&headers))
        .await
        .inspect_err(|_| p.metrics.error())?;
    let pv = pr.json();
    if pr.status != 200 {
        p.metrics.error();
        return Err(relay(pr.status, pv));
    }
    if let (Some(kv), Some(x)) = (&p.kv, &picked) {
        if let (Some(pred), true) = (x.prediction, x.http == pw) {
            // kvconnect's workers say it in their `kvconnect` block; vLLM in its usage, when
            // asked (--enable-prompt-tokens-details). A server that says nothing is not counted.
            let k = &pv["kvconnect"];
            let hit = match (k["num_cached_tokens"].as_u64(), k["num_external_tokens"].as_u64()) {
                (None, None) => tokenize::cached_tokens(&pv),
                (c, e) => Some(c.unwrap_or(0) + e.unwrap_or(0)),
            };
            if let Some(hit) = hit {
                kv.observe(pred, hit);
            }
        }
    }
    drop(picked);
    let mut dec = body;
    dec.insert("kv_transfer_params".into(), pv["kv_transfer_params"].clone());
    Ok(Prefilled { pw, answer: pv, done: t0.elapsed(), dec, headers })
}

/// The prompt's token ids of a request the proxy passes on verbatim (`tokenize`): the
/// body's own ids, or a prefill server's `/tokenize` answer; None where neither gives them
/// (the router then routes round-robin, counted as `no_tokens`).
async fn verbatim_tokens(
    p: &Arc<Proxy>,
    body: &Map<String, Value>,
    chat: bool,
    headers: &[(&str, &str)],
) -> Option<Vec<u32>> {
    if !chat {
        if let Some(ids) = tokenize::given(body) {
            return Some(ids);
        }
    }
    let ask = tokenize::request(body, chat)?;
    // The prefill servers in a turn of their own, so that round-robin picks (where the router
    // falls back to them) stay in theirs.
    let up: Vec<String> =
        p.backends.of_role(Role::Prefill).into_iter().filter(|b| b.down.is_none()).map(|b| b.http).collect();
    let first = up.get(p.tokenize_turn.fetch_add(1, Ordering::Relaxed) % up.len().max(1)).cloned();
    let (w, r) =
        p.send_first(Role::Prefill, first, "POST", tokenize::PATH, Some(&ask), headers).await.ok()?;
    let ids = (r.status == 200).then(|| tokenize::answer(&r.json())).flatten();
    if ids.is_none() {
        tracing::debug!(worker = %w, status = r.status, "{} gave no token ids: routing this request round-robin", tokenize::PATH);
    }
    ids
}

/// One choice, prefill then decode; decode's answer with the proxy's `kvconnect` block.
pub(crate) async fn one(
    p: &Arc<Proxy>,
    path: &str,
    body: Map<String, Value>,
    t0: Instant,
    auth: Option<String>,
) -> Result<Value, Response> {
    let pf = prefill(p, path, body, t0, auth, PrefillAsk::PROTOCOL).await?;
    let dec = Value::Object(pf.dec.clone());
    let (dw, dr) = p
        .send(Role::Decode, "POST", path, Some(&dec), &pf.headers())
        .await
        .inspect_err(|_| p.metrics.error())?;
    let mut dv = dr.json();
    if dr.status != 200 {
        p.metrics.error();
        return Err(relay(dr.status, dv));
    }
    let decode_ttft = Duration::from_micros(dv["kvconnect"]["ttft_us"].as_u64().unwrap_or(0));
    let ttft = pf.done + decode_ttft;
    let total = t0.elapsed();
    let tokens = dv["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    p.metrics.served(&pf.pw, Some(&dw), ttft, total, tokens);
    if dv.get("kvconnect").is_none_or(|k| !k.is_object()) {
        dv["kvconnect"] = json!({});
    }
    dv["kvconnect"]["prefill"] = pf.answer["kvconnect"].clone();
    dv["kvconnect"]["proxy"] = json!({
        "prefill_worker": pf.pw, "decode_worker": dw,
        "prefill_us": pf.done.as_micros() as u64,
        "ttft_us": ttft.as_micros() as u64,
        "total_us": total.as_micros() as u64,
    });
    Ok(dv)
}

/// One streamed choice, prefill then decode's stream: its events as they arrive.
pub(crate) async fn one_stream(
    p: &Arc<Proxy>,
    path: &str,
    body: Map<String, Value>,
    t0: Instant,
    auth: Option<String>,
) -> Result<mpsc::Receiver<Bytes>, Response> {
    let pf = prefill(p, path, body, t0, auth, PrefillAsk::PROTOCOL).await?;
    decode_stream(p, path, pf, t0).await
}

/// Decode's half of one streamed choice, after prefill's: its events as they arrive.
async fn decode_stream(
    p: &Arc<Proxy>,
    path: &str,
    mut pf: Prefilled,
    t0: Instant,
) -> Result<mpsc::Receiver<Bytes>, Response> {
    let dw = p.backends.pick(Role::Decode, &[]).map_err(|e| {
        p.metrics.error();
        unreachable(Role::Decode, e)
    })?;
    pf.dec.insert("stream".into(), json!(true));
    let headers = pf.headers.clone();
    let prefill = pf.answer["kvconnect"].clone();
    let hop = Hop { pw: pf.pw, dw, prefill, t0, prefill_done: pf.done, first_sent: None };
    stream_decode(p, path, pf.dec, &headers, hop).await
}

/// Events as a `text/event-stream` response.
pub(crate) fn sse_response(events: mpsc::Receiver<Bytes>) -> Response {
    stream::sse(axum::body::Body::from_stream(stream::Events(events)))
}

/// [`sse_response`] whose `first` is told when the connection takes the first event
/// (`kvconnect_openai::stream::EventsThen`).
pub(crate) fn sse_response_then(events: mpsc::Receiver<Bytes>, first: oneshot::Sender<()>) -> Response {
    stream::sse(axum::body::Body::from_stream(stream::EventsThen::new(events, first)))
}

/// What the proxy knows of a request when decode's stream starts.
struct Hop {
    pw: String,
    dw: String,
    prefill: Value,
    t0: Instant,
    prefill_done: Duration,
    /// The first token came from prefill (`--first-token prefill`), sent to the client at
    /// this time: decode's prompt holds it, so decode's usage counts it as a prompt token
    /// (moved back here) and decode's own `prompt_token_ids` are not the client's.
    first_sent: Option<Duration>,
}

/// Why decode's stream could not be opened.
enum DecodeOpen {
    /// No decode server could be reached.
    Unreachable(String),
    /// Decode answered with this status and body.
    Refused(u16, Value),
}

/// Opens decode's SSE stream for `dec` on `hop.dw`.
async fn open_decode(
    p: &Proxy,
    path: &str,
    dec: &Value,
    headers: &[(&'static str, String)],
    dw: &str,
) -> Result<client::Streaming, DecodeOpen> {
    let headers = borrowed(headers);
    let call =
        client::Call { headers: &headers, ..client::Call::new(dw, "POST", path, Some(dec), p.timeout) };
    let mut ds = client::call_streaming(call).await.map_err(|e| DecodeOpen::Unreachable(e.to_string()))?;
    if ds.status != 200 {
        let mut b = Vec::new();
        while let Some(Ok(piece)) = ds.body.recv().await {
            b.extend_from_slice(&piece);
        }
        let v = serde_json::from_slice(&b)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&b).into_owned()));
        return Err(DecodeOpen::Refused(ds.status, v));
    }
    Ok(ds)
}

/// Decode's SSE stream, passed on event by event as it arrives; the chunk with `usage` gets
/// the proxy's `kvconnect` block added, as a non-streaming answer does. TTFT counts to the
/// first token chunk the proxy forwards.
async fn stream_decode(
    p: &Arc<Proxy>,
    path: &str,
    dec: Map<String, Value>,
    headers: &[(&'static str, String)],
    hop: Hop,
) -> Result<mpsc::Receiver<Bytes>, Response> {
    let ds = match open_decode(p, path, &Value::Object(dec), headers, &hop.dw).await {
        Ok(ds) => ds,
        Err(e) => {
            p.metrics.error();
            return Err(match e {
                DecodeOpen::Unreachable(e) => unreachable(Role::Decode, e),
                DecodeOpen::Refused(status, v) => relay(status, v),
            });
        }
    };
    let (out, events) = mpsc::channel::<Bytes>(64);
    tokio::spawn(forward(p.clone(), ds, Some(out), hop));
    Ok(events)
}

/// One SSE event carrying `v`.
fn sse_event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// Passes decode's stream `ds` on to the client (`client`: None once it left), whole events
/// only, so the closing one can be annotated, and counts the request.
async fn forward(
    p: Arc<Proxy>,
    mut ds: client::Streaming,
    mut client: Option<mpsc::Sender<Bytes>>,
    hop: Hop,
) {
    let mut pending: Vec<u8> = Vec::new();
    let (mut tokens, mut ttft, mut failed) = (u64::from(hop.first_sent.is_some()), hop.first_sent, false);
    loop {
        let piece = match ds.body.recv().await {
            None => break,
            Some(Ok(b)) => b,
            Some(Err(e)) => {
                failed = true;
                let message = format!("decode worker's stream broke: {e}");
                let ev = json!({"error": {"message": message, "type": "service_unavailable"}});
                pending.extend_from_slice(&sse_event(&ev));
                Vec::new()
            }
        };
        pending.extend_from_slice(&piece);
        while let Some(at) = pending.windows(2).position(|w| w == b"\n\n") {
            let raw: Vec<u8> = pending.drain(..at + 2).collect();
            let mut ev = Bytes::from(raw.clone());
            if let Some(mut v) = std::str::from_utf8(&raw)
                .ok()
                .and_then(|t| t.trim().strip_prefix("data: "))
                .and_then(|d| serde_json::from_str::<Value>(d).ok())
            {
                if v["choices"][0]["token_ids"].as_array().is_some_and(|a| !a.is_empty()) {
                    tokens += 1;
                    ttft.get_or_insert_with(|| hop.t0.elapsed());
                }
                if v.get("error").is_some() {
                    failed = true;
                }
                let mut changed = hop.first_sent.is_some() && first_token::as_client_sees(&mut v);
                if v.get("usage").is_some_and(|u| !u.is_null()) {
                    let total = hop.t0.elapsed();
                    if !v.get("kvconnect").is_some_and(Value::is_object) {
                        v["kvconnect"] = json!({});
                    }
                    v["kvconnect"]["prefill"] = hop.prefill.clone();
                    v["kvconnect"]["proxy"] = json!({
                        "prefill_worker": hop.pw, "decode_worker": hop.dw,
                        "prefill_us": hop.prefill_done.as_micros() as u64,
                        "ttft_us": ttft.unwrap_or(total).as_micros() as u64,
                        "total_us": total.as_micros() as u64,
                        "first_token": if hop.first_sent.is_some() { "prefill" } else { "decode" },
                    });
                    changed = true;
                }
                if changed {
                    ev = sse_event(&v);
                }
            }
            // A client that left stops the writes; decode's stream is still read to its
            // end so the request is counted.
            if let Some(c) = &client {
                if c.send(ev).await.is_err() {
                    client = None;
                }
            }
        }
    }
    if failed {
        p.metrics.error();
    } else {
        let total = hop.t0.elapsed();
        p.metrics.served(&hop.pw, Some(&hop.dw), ttft.unwrap_or(total), total, tokens);
    }
}

/// The Authorization the servers get: the servers' key when the proxy has one (as vLLM's
/// proxy sends its own key), else the client's header, passed on.
fn authorization(p: &Proxy, h: &HeaderMap) -> Option<String> {
    p.server_key
        .as_ref()
        .map(|k| format!("Bearer {k}"))
        .or_else(|| h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::to_owned))
}

async fn completions(State(p): State<Arc<Proxy>>, h: HeaderMap, raw: Bytes) -> Response {
    let auth = authorization(&p, &h);
    disaggregated(&p, &raw, false, auth).await
}

async fn chat_completions(State(p): State<Arc<Proxy>>, h: HeaderMap, raw: Bytes) -> Response {
    let auth = authorization(&p, &h);
    disaggregated(&p, &raw, true, auth).await
}

async fn models(State(p): State<Arc<Proxy>>, h: HeaderMap) -> Response {
    let auth = authorization(&p, &h);
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    match p.send(Role::Decode, "GET", "/v1/models", None, &headers).await {
        Ok((_, r)) => relay(r.status, r.json()),
        Err(r) => r,
    }
}

async fn health(State(p): State<Arc<Proxy>>) -> Response {
    let mut servers = Vec::new();
    let mut ok = true;
    for b in p.backends.all() {
        let up = b.down.is_none()
            && matches!(
                client::request(&b.http, "GET", "/health", None, Duration::from_secs(2)).await,
                Ok(r) if r.status == 200
            );
        ok &= up;
        servers.push(
            json!({"role": b.role.name(), "engine_id": b.name, "http": b.http, "ok": up, "down": b.down}),
        );
    }
    let status = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({"status": if ok { "ok" } else { "degraded" }, "workers": servers}))).into_response()
}

async fn prom(State(p): State<Arc<Proxy>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], p.metrics.render()).into_response()
}
