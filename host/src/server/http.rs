//! The worker's HTTP API (axum): `POST /v1/completions` (OpenAI-style, plus vLLM's
//! `kv_transfer_params`), `GET /health` (role, pool and side-channel counters as JSON) and
//! `GET /metrics` (the same counters as Prometheus text).

use crate::server::engine_loop::{EngineHandle, PoolStats, SubmitError, TokenSink};
use crate::server::peers::{remote_peer, strip_remote, Peers};
use crate::sidechannel::ServerStats;
use crate::worker::{detokenize, tokenize, FinishReason, GenRequest};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvconnect_api::FailurePolicy;
use serde_json::{json, Map, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What the handlers share.
pub struct AppState {
    /// The engine thread.
    pub engine: EngineHandle,
    /// Handshakes with prefill peers (every worker can load from a peer when asked).
    pub peers: Peers,
    /// `kv_load_failure_policy`.
    pub policy: FailurePolicy,
    /// `prefill` or `decode`.
    pub role: String,
    /// This engine's id.
    pub engine_id: String,
    /// The model's name, echoed in responses.
    pub model: String,
    /// Longest prompt plus completion this worker accepts, in tokens: the reference
    /// engine's context, or unbounded (only the KV pool limits it) for the transfer-only
    /// engine, which moves synthetic KV of any model's geometry.
    pub max_model_len: usize,
    /// This worker's compat hash.
    pub compat_hash: String,
    /// Side-channel server counters.
    pub side_channel: Arc<ServerStats>,
    /// Request counter for ids.
    pub next_id: AtomicU64,
    /// KV bytes one token occupies in this worker's cache (the model at the effective cache
    /// dtype), to turn tokens loaded through the connector into bytes moved.
    pub kv_bytes_per_token: u64,
}

/// The router.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(crate::server::openai::completions))
        .route("/v1/chat/completions", post(crate::server::openai::chat_completions))
        .route("/v1/models", get(crate::server::openai::models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(state)
}

fn error(status: StatusCode, kind: &str, message: String, extra: Option<(&str, Value)>) -> Response {
    let mut e = json!({"message": message, "type": kind});
    if let Some((k, v)) = extra {
        e[k] = v;
    }
    (status, Json(json!({ "error": e }))).into_response()
}

fn bad_request(message: String) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message, None)
}

fn parse_prompt(v: Option<&Value>) -> Result<Vec<u32>, String> {
    match v {
        Some(Value::String(s)) => Ok(tokenize(s)),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| format!("prompt token {t} is not a non-negative integer token id"))
            })
            .collect(),
        Some(other) => Err(format!("'prompt' must be a string or a list of token ids, not {other}")),
        None => Err("the request has no 'prompt'; send a string or a list of token ids".into()),
    }
}

/// The engine-facing completions handler (the OpenAI layer in `openai` checks and wraps it).
pub(crate) async fn completions(st: State<Arc<AppState>>, body: Bytes) -> Response {
    completions_with(st, body, None).await
}

/// [`completions`], with each step's new tokens also sent to `sink` as the engine produces
/// them (the streaming path).
pub(crate) async fn completions_with(
    State(st): State<Arc<AppState>>,
    body: Bytes,
    sink: Option<TokenSink>,
) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return bad_request(format!("the body is not JSON: {e}")),
    };
    let Value::Object(obj) = v else { return bad_request("the body must be a JSON object".into()) };
    let prompt = match parse_prompt(obj.get("prompt")) {
        Ok(p) => p,
        Err(e) => return bad_request(e),
    };
    let max_tokens = match obj.get("max_tokens") {
        None | Some(Value::Null) => 16,
        Some(m) => match m.as_u64() {
            Some(n) if n > 0 => n as usize,
            _ => return bad_request(format!("'max_tokens' must be a positive integer, not {m}")),
        },
    };
    let mut params: Map<String, Value> = match obj.get("kv_transfer_params") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(other) => return bad_request(format!("'kv_transfer_params' must be an object, not {other}")),
    };
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match obj.get("request_id").and_then(Value::as_str) {
        Some(s) => s.to_owned(),
        None => format!("cmpl-{}-{n}", st.engine_id),
    };

    // Before any KV is loaded from a peer: the handshake, once per peer.
    let mut kv_note = Value::Null;
    match remote_peer(&params) {
        Err(e) => return bad_request(e),
        Ok(None) => {}
        Ok(Some((engine, addr))) => {
            if let Err(f) = st.peers.ensure(&engine, &addr, &st.engine).await {
                match st.policy {
                    FailurePolicy::Recompute => {
                        tracing::warn!(request = %id, peer = %engine, "no KV will be loaded ({}); recomputing the prompt locally", f.message);
                        params = strip_remote(&params);
                        kv_note = json!({"recomputed": true, "reason": f.message});
                    }
                    FailurePolicy::Fail => {
                        return error(
                            StatusCode::BAD_GATEWAY,
                            "kv_transfer_failed",
                            format!("request {id}: {} (kv_load_failure_policy is 'fail')", f.message),
                            Some(("diff", serde_json::to_value(&f.diff).unwrap_or(Value::Null))),
                        );
                    }
                }
            }
        }
    }

    let prompt_len = prompt.len();
    let req = GenRequest {
        id: id.clone(),
        prompt,
        max_tokens,
        kv_transfer_params: params,
        sampling: Default::default(),
    };
    let done = match st.engine.submit_streaming(req, sink).await {
        Ok(d) => d,
        Err(SubmitError::Rejected(e)) if e.starts_with("request '") => return bad_request(e),
        Err(e @ (SubmitError::Unhealthy(_) | SubmitError::Gone)) => {
            return error(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", e.to_string(), None)
        }
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, "engine_error", e.to_string(), None),
    };
    if let FinishReason::Error(message) = &done.finish {
        return error(
            StatusCode::BAD_GATEWAY,
            "kv_transfer_failed",
            format!("request {id}: {message}"),
            None,
        );
    }
    let mut resp = json!({
        "id": id,
        "object": "text_completion",
        "model": st.model,
        "choices": [{
            "index": 0,
            "text": detokenize(&done.tokens),
            "token_ids": done.tokens,
            "finish_reason": "length",
        }],
        "usage": {"prompt_tokens": prompt_len, "completion_tokens": done.tokens.len(), "total_tokens": prompt_len + done.tokens.len()},
        "kv_transfer_params": done.kv_transfer_params,
        "kvconnect": {
            "engine_id": st.engine_id,
            "ttft_us": done.ttft.map(|d| d.as_micros() as u64),
            "num_external_tokens": done.num_external_tokens,
        },
    });
    if !kv_note.is_null() {
        resp["kvconnect"]["kv_load"] = kv_note;
    }
    Json(resp).into_response()
}

async fn current(st: &AppState) -> Result<PoolStats, Response> {
    st.engine.stats().await.map_err(|e| error(StatusCode::SERVICE_UNAVAILABLE, "engine_error", e, None))
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let pool = match current(&st).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    // A worker that can serve nothing says so: supervisors (kvconnect up, a liveness probe)
    // restart it.
    let status = if pool.unhealthy.is_some() { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    let body = json!({
        "status": if pool.unhealthy.is_some() { "unhealthy" } else { "ok" },
        "reason": pool.unhealthy,
        "role": st.role,
        "engine_id": st.engine_id,
        "compat_hash": st.compat_hash,
        "pool": pool,
        "side_channel": st.side_channel.snapshot(),
    });
    (status, Json(body)).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let p = match current(&st).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let sc = st.side_channel.snapshot();
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, kind: &str, v: u64| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"));
    };
    gauge("kvconnect_pool_blocks", "KV blocks over all cache groups.", "gauge", p.total_blocks as u64);
    gauge(
        "kvconnect_pool_free_blocks",
        "Free KV blocks over all cache groups.",
        "gauge",
        p.free_blocks as u64,
    );
    gauge(
        "kvconnect_requests_unfinished",
        "Requests waiting, loading or running.",
        "gauge",
        p.unfinished as u64,
    );
    gauge(
        "kvconnect_pending_frees",
        "Finished requests whose blocks the connector still holds.",
        "gauge",
        p.pending_frees as u64,
    );
    gauge("kvconnect_requests_completed_total", "Requests completed.", "counter", p.completed);
    gauge("kvconnect_requests_failed_total", "Requests that ended with an error.", "counter", p.failed);
    gauge(
        "kvconnect_external_tokens_total",
        "Prompt tokens whose KV was loaded through the connector.",
        "counter",
        p.external_tokens,
    );
    gauge(
        "kvconnect_kv_bytes_moved_total",
        "KV bytes loaded through the connector: external prompt tokens times the model's KV bytes per token at the cache dtype.",
        "counter",
        p.external_tokens.saturating_mul(st.kv_bytes_per_token),
    );
    gauge("kvconnect_side_channel_welcomed_total", "Handshakes accepted.", "counter", sc.welcomed);
    gauge("kvconnect_side_channel_refused_total", "Handshakes refused.", "counter", sc.refused);
    gauge(
        "kvconnect_side_channel_dropped_total",
        "Side-channel connections closed for misbehaving.",
        "counter",
        sc.dropped,
    );
    out.push_str(&crate::server::openai_metrics::render());
    out.push_str(&cache_metrics(&st.engine_id));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// The lmcache store's hits per tier, misses and bytes loaded per tier, read at scrape time
/// (the store is process-global, keyed by this worker's engine id, which the composite passes
/// to its children). Empty when this worker runs no lmcache connector.
fn cache_metrics(engine_id: &str) -> String {
    let Some(s) = kvconnect_lmcache::stats(engine_id) else { return String::new() };
    let mut out = String::new();
    out.push_str("# HELP kvconnect_cache_hits_total Chunks a KV load found in a cache tier.\n# TYPE kvconnect_cache_hits_total counter\n");
    for (tier, t) in [("cpu", &s.cpu), ("disk", &s.disk)] {
        out.push_str(&format!(
            "kvconnect_cache_hits_total{{connector=\"lmcache\",tier=\"{tier}\"}} {}\n",
            t.hits
        ));
    }
    out.push_str(&format!(
        "# HELP kvconnect_cache_misses_total Chunks a KV load expected but did not find.\n# TYPE kvconnect_cache_misses_total counter\nkvconnect_cache_misses_total{{connector=\"lmcache\"}} {}\n",
        s.misses
    ));
    out.push_str("# HELP kvconnect_cache_loaded_bytes_total Bytes read out of a cache tier into the KV cache.\n# TYPE kvconnect_cache_loaded_bytes_total counter\n");
    for (tier, t) in [("cpu", &s.cpu), ("disk", &s.disk)] {
        out.push_str(&format!(
            "kvconnect_cache_loaded_bytes_total{{connector=\"lmcache\",tier=\"{tier}\"}} {}\n",
            t.bytes_loaded
        ));
    }
    out
}
