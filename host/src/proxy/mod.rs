//! The P/D proxy, as vLLM's `toy_proxy_server` does it: each user request goes first to a
//! prefill worker (prefill only: `max_tokens: 1`, `kv_transfer_params: {"do_remote_decode":
//! true}`), then to a decode worker with the transfer params prefill returned and prefill's
//! request id; round-robin over several of each. The answer is decode's, with what the
//! proxy saw added under `kvconnect.proxy` (which workers, prefill time, time to first token)
//! and prefill's own `kvconnect` block under `kvconnect.prefill`.
//!
//! Errors keep the workers' OpenAI error bodies and statuses (a refused handshake under
//! `fail` arrives from decode naming the difference); a worker that cannot be reached is a
//! 503.

pub mod backends;
pub mod client;
pub mod metrics;

use crate::deployment::Role;
use crate::server::openai::{chat_prompt, openai_error, CONTEXT_TOKENS};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use backends::Backends;
use metrics::ProxyMetrics;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The proxy's workers and counters.
pub struct Proxy {
    /// The workers, with which of them are up (kept current by `kvconnect up`'s supervisor).
    pub backends: Arc<Backends>,
    /// How long one worker request may take.
    pub timeout: Duration,
    /// Counters for `/metrics`.
    pub metrics: ProxyMetrics,
}

impl Proxy {
    /// A proxy over these workers.
    pub fn new(backends: Arc<Backends>, timeout: Duration) -> Proxy {
        Proxy { backends, timeout, metrics: ProxyMetrics::default() }
    }

    /// Sends one request to a worker of `role` that is up. A worker that cannot be reached
    /// (it just died; the supervisor has not noticed yet) is skipped for the others of its
    /// role. Returns the worker's address with its answer, or the 503 to send.
    async fn send(
        &self,
        role: Role,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(String, client::Reply), Response> {
        let mut tried: Vec<String> = Vec::new();
        loop {
            let w = match self.backends.pick(role, &tried) {
                Ok(w) => w,
                Err(e) if tried.is_empty() => return Err(unreachable(role.name(), e)),
                Err(_) => break,
            };
            match client::request(&w, method, path, body, self.timeout).await {
                Ok(r) => return Ok((w, r)),
                Err(e @ client::ClientError::Connect { .. }) => {
                    tracing::warn!(worker = %w, "{role} worker unreachable, trying another: {e}");
                    tried.push(w);
                }
                Err(e) => return Err(unreachable(role.name(), e)),
            }
        }
        Err(unreachable(
            role.name(),
            format!("no {role} worker could be reached (tried {})", tried.join(", ")),
        ))
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

fn unreachable(role: &str, e: impl std::fmt::Display) -> Response {
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

async fn disaggregated(p: &Arc<Proxy>, raw: &[u8], chat: bool) -> Response {
    let t0 = Instant::now();
    let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
    let v: Value = match serde_json::from_slice(raw) {
        Ok(v) => v,
        Err(e) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("the body is not valid JSON: {e}"),
                None,
            )
        }
    };
    let Value::Object(mut body) = v else {
        return openai_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "the body must be a JSON object",
            None,
        );
    };
    let stream = match body.remove("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(other) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("'stream' must be true or false, not {other}"),
                Some("stream"),
            )
        }
    };
    // Prefill computes the prompt only (max_tokens 1), so the user's max_tokens is checked
    // here, before any KV is produced for a decode that would refuse it.
    let mut pre = body.clone();
    let checked_max = pre.remove("max_completion_tokens").or_else(|| pre.get("max_tokens").cloned());
    if let Some(m) = &checked_max {
        let Some(n) = m.as_u64().filter(|n| *n > 0) else {
            return openai_error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("'max_tokens' must be a positive integer, not {m}"),
                Some("max_tokens"),
            );
        };
        let prompt_len = prompt_tokens(&body, chat);
        if prompt_len.saturating_add(n as usize) > CONTEXT_TOKENS {
            return openai_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request_error",
                format!(
                    "max_tokens {n} with a {prompt_len}-token prompt exceeds the model's context of {CONTEXT_TOKENS} tokens; ask for at most {} tokens",
                    CONTEXT_TOKENS.saturating_sub(prompt_len)
                ),
                Some("max_tokens"),
            );
        }
    }
    pre.insert("max_tokens".into(), json!(1));
    pre.insert("kv_transfer_params".into(), json!({"do_remote_decode": true}));
    let (pw, pr) = match p.send(Role::Prefill, "POST", path, Some(&Value::Object(pre))).await {
        Ok(r) => r,
        Err(r) => {
            p.metrics.error();
            return r;
        }
    };
    let pv = pr.json();
    if pr.status != 200 {
        p.metrics.error();
        return relay(pr.status, pv);
    }
    let prefill_done = t0.elapsed();
    let mut dec = body;
    dec.insert("kv_transfer_params".into(), pv["kv_transfer_params"].clone());
    dec.insert("request_id".into(), pv["id"].clone());
    if stream {
        let dw = match p.backends.pick(Role::Decode, &[]) {
            Ok(dw) => dw,
            Err(e) => {
                p.metrics.error();
                return unreachable("decode", e);
            }
        };
        dec.insert("stream".into(), json!(true));
        let hop = Hop { pw, dw, prefill: pv["kvconnect"].clone(), t0, prefill_done };
        return stream_decode(p, path, dec, hop).await;
    }
    let (dw, dr) = match p.send(Role::Decode, "POST", path, Some(&Value::Object(dec))).await {
        Ok(r) => r,
        Err(r) => {
            p.metrics.error();
            return r;
        }
    };
    let mut dv = dr.json();
    if dr.status != 200 {
        p.metrics.error();
        return relay(dr.status, dv);
    }
    let decode_ttft = Duration::from_micros(dv["kvconnect"]["ttft_us"].as_u64().unwrap_or(0));
    let ttft = prefill_done + decode_ttft;
    let total = t0.elapsed();
    let tokens = dv["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    p.metrics.served(&pw, &dw, ttft, total, tokens);
    if dv.get("kvconnect").is_none_or(|k| !k.is_object()) {
        dv["kvconnect"] = json!({});
    }
    dv["kvconnect"]["prefill"] = pv["kvconnect"].clone();
    dv["kvconnect"]["proxy"] = json!({
        "prefill_worker": pw, "decode_worker": dw,
        "prefill_us": prefill_done.as_micros() as u64,
        "ttft_us": ttft.as_micros() as u64,
        "total_us": total.as_micros() as u64,
    });
    // A streamed request returned above, with decode's stream.
    Json(dv).into_response()
}

/// What the proxy knows of a request when decode's stream starts.
struct Hop {
    pw: String,
    dw: String,
    prefill: Value,
    t0: Instant,
    prefill_done: Duration,
}

/// Decode's SSE stream, passed through to the client as it arrives; the closing chunk (the
/// one with `usage`) gets the proxy's `kvconnect` block added, as a non-streaming answer does.
/// TTFT counts to the first token chunk the proxy forwards.
async fn stream_decode(
    p: &Arc<Proxy>,
    path: &str,
    dec: serde_json::Map<String, Value>,
    hop: Hop,
) -> Response {
    let mut ds =
        match client::request_streaming(&hop.dw, "POST", path, Some(&Value::Object(dec)), p.timeout).await {
            Ok(s) => s,
            Err(e) => {
                p.metrics.error();
                return unreachable("decode", e);
            }
        };
    if ds.status != 200 {
        let mut b = Vec::new();
        while let Some(Ok(piece)) = ds.body.recv().await {
            b.extend_from_slice(&piece);
        }
        p.metrics.error();
        let v = serde_json::from_slice(&b)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&b).into_owned()));
        return relay(ds.status, v);
    }
    let (out, events) = tokio::sync::mpsc::channel::<Bytes>(64);
    let p = p.clone();
    tokio::spawn(async move {
        let mut client = Some(out);
        let mut pending: Vec<u8> = Vec::new();
        let (mut tokens, mut ttft, mut failed) = (0u64, None, false);
        loop {
            let piece = match ds.body.recv().await {
                None => break,
                Some(Ok(b)) => b,
                Some(Err(e)) => {
                    failed = true;
                    let ev = json!({"error": {"message": format!("decode worker's stream broke: {e}"), "type": "service_unavailable"}});
                    pending.extend_from_slice(format!("data: {ev}\n\n").as_bytes());
                    Vec::new()
                }
            };
            pending.extend_from_slice(&piece);
            // Forward whole events only, so the closing one can be annotated.
            while let Some(at) = pending.windows(2).position(|w| w == b"\n\n") {
                let raw: Vec<u8> = pending.drain(..at + 2).collect();
                let mut ev = raw.clone();
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
                        });
                        ev = format!("data: {v}\n\n").into_bytes();
                    }
                }
                // A client that left stops the writes; decode's stream is still read to its
                // end so the request is counted.
                if let Some(c) = &client {
                    if c.send(Bytes::from(ev)).await.is_err() {
                        client = None;
                    }
                }
            }
        }
        if failed {
            p.metrics.error();
        } else {
            let total = hop.t0.elapsed();
            p.metrics.served(&hop.pw, &hop.dw, ttft.unwrap_or(total), total, tokens);
        }
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")],
        axum::body::Body::from_stream(crate::server::openai::Events(events)),
    )
        .into_response()
}

/// Prompt length in tokens as the byte-level reference engine counts it (0 when the prompt
/// is malformed: the worker then says what is wrong with it).
fn prompt_tokens(body: &serde_json::Map<String, Value>, chat: bool) -> usize {
    if chat {
        return body.get("messages").and_then(|m| chat_prompt(m).ok()).map_or(0, |p| p.len());
    }
    match body.get("prompt") {
        Some(Value::String(s)) => s.len(),
        Some(Value::Array(a)) => a.len(),
        _ => 0,
    }
}

async fn completions(State(p): State<Arc<Proxy>>, raw: Bytes) -> Response {
    disaggregated(&p, &raw, false).await
}

async fn chat_completions(State(p): State<Arc<Proxy>>, raw: Bytes) -> Response {
    disaggregated(&p, &raw, true).await
}

async fn models(State(p): State<Arc<Proxy>>) -> Response {
    match p.send(Role::Decode, "GET", "/v1/models", None).await {
        Ok((_, r)) => relay(r.status, r.json()),
        Err(r) => r,
    }
}

async fn health(State(p): State<Arc<Proxy>>) -> Response {
    let mut workers = Vec::new();
    let mut ok = true;
    for b in p.backends.all() {
        let up = b.down.is_none()
            && matches!(client::request(&b.http, "GET", "/health", None, Duration::from_secs(2)).await, Ok(r) if r.status == 200);
        ok &= up;
        workers.push(
            json!({"role": b.role.name(), "engine_id": b.name, "http": b.http, "ok": up, "down": b.down}),
        );
    }
    let status = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({"status": if ok { "ok" } else { "degraded" }, "workers": workers}))).into_response()
}

async fn prom(State(p): State<Arc<Proxy>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], p.metrics.render()).into_response()
}
