//! The server's HTTP API (axum): the OpenAI routes (see `openai`), `GET /health` (role, pool
//! and side-channel counters as JSON) and `GET /metrics` (the same counters as Prometheus
//! text); and [`run_one`], which runs one engine request for the OpenAI layer (vLLM's
//! `kv_transfer_params` included).

use crate::engine_loop::{Done, EngineHandle, PoolStats, SubmitError, TokenSink};
use crate::peers::{remote_instance, remote_peer, strip_remote, Peers};
use crate::sidechannel::ServerStats;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvconnect_api::{FailurePolicy, MetricKind, Role};
use kvconnect_engine::{FinishReason, GenRequest, SamplingParams};
use kvconnect_openai::metrics::{self, PromptSources, Sample};
use serde_json::{json, Map, Value};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// What the handlers share.
pub struct AppState {
    /// The engine thread.
    pub engine: EngineHandle,
    /// Handshakes with prefill peers (every server can load from a peer when asked).
    pub peers: Peers,
    /// `kv_load_failure_policy`.
    pub policy: FailurePolicy,
    /// Prefill or decode.
    pub role: Role,
    /// This engine's id.
    pub engine_id: String,
    /// The model's name, echoed in responses.
    pub model: String,
    /// Longest prompt plus completion this server accepts, in tokens: the reference
    /// engine's context, or unbounded (only the KV pool limits it) for the transfer-only
    /// engine, which moves synthetic KV of any model's geometry.
    pub max_model_len: usize,
    /// This server's compat hash.
    pub compat_hash: String,
    /// Side-channel server counters.
    pub side_channel: Arc<ServerStats>,
    /// This process's random id (its side channel's): prefill's `kv_transfer_params` carry it
    /// as `remote_instance`, so a decode notices a restart at the same address.
    pub instance: String,
    /// Request counter for ids.
    pub next_id: AtomicU64,
    /// KV bytes one token occupies in this server's cache (the model at the effective cache
    /// dtype), to turn tokens loaded through the connector into bytes moved.
    pub kv_bytes_per_token: u64,
}

/// The router.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(crate::openai::completions))
        .route("/v1/chat/completions", post(crate::openai::chat_completions))
        .route("/v1/models", get(crate::openai::models))
        .route("/health", get(health))
        .route("/metrics", get(prom))
        .with_state(state)
}

fn error(status: StatusCode, kind: &str, message: String, extra: Option<(&str, Value)>) -> Response {
    let mut e = json!({"message": message, "type": kind});
    if let Some((k, v)) = extra {
        e[k] = v;
    }
    (status, Json(json!({ "error": e }))).into_response()
}

/// Why one engine request got no answer: the status, error type and message, with the
/// handshake's field-by-field difference when a peer was refused. The OpenAI layer turns it
/// into OpenAI's error body.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Failure {
    /// The HTTP status.
    pub status: StatusCode,
    /// OpenAI's error `type`.
    pub kind: &'static str,
    /// What went wrong.
    pub message: String,
    /// The handshake difference (`kv_load_failure_policy = "fail"`).
    pub diff: Option<Value>,
}

impl Failure {
    fn new(status: StatusCode, kind: &'static str, message: String) -> Failure {
        Failure { status, kind, message, diff: None }
    }
}

/// One engine request, as the OpenAI layer hands it over: one prompt, one choice.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OneRequest {
    /// The engine's request id.
    pub id: String,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// How tokens are chosen and reported.
    pub sampling: SamplingParams,
    /// vLLM's `kv_transfer_params` (empty for none).
    pub kv_transfer_params: Map<String, Value>,
}

/// A finished engine request.
#[derive(Debug, Clone)]
pub(crate) struct Finished {
    /// What the engine returned.
    pub done: Done,
    /// Set when the peer handshake failed and the prompt was recomputed (policy
    /// `recompute`): `{"recomputed": true, "reason"}`.
    pub kv_note: Value,
}

/// Runs one engine request to its end (loading KV from a peer first when its transfer
/// params name one), sending each step's new tokens to `sink` as the engine produces them.
pub(crate) async fn run_one(
    st: Arc<AppState>,
    req: OneRequest,
    sink: Option<TokenSink>,
) -> Result<Finished, Failure> {
    let OneRequest { id, prompt, max_tokens, sampling, kv_transfer_params: mut params } = req;
    let bad = |m: String| Failure::new(StatusCode::BAD_REQUEST, "invalid_request_error", m);
    // Before any KV is loaded from a peer: the handshake, once per peer.
    let mut kv_note = Value::Null;
    let remote = match remote_peer(&params) {
        Err(e) => return Err(bad(e)),
        Ok(r) => r,
    };
    if let Some((engine, addr)) = &remote {
        if let Err(f) = st.peers.ensure(engine, addr, remote_instance(&params), &st.engine).await {
            metrics::load_failure(f.reason, st.policy == FailurePolicy::Recompute);
            match st.policy {
                FailurePolicy::Recompute => {
                    tracing::warn!(request = %id, peer = %engine, "no KV will be loaded ({}); recomputing \
                        the prompt locally", f.message);
                    params = strip_remote(&params);
                    kv_note = json!({"recomputed": true, "reason": f.message});
                }
                FailurePolicy::Fail => {
                    return Err(Failure {
                        status: StatusCode::BAD_GATEWAY,
                        kind: "kv_transfer_failed",
                        message: format!("request {id}: {} (kv_load_failure_policy is 'fail')", f.message),
                        diff: Some(serde_json::to_value(&f.diff).unwrap_or(Value::Null)),
                    });
                }
            }
        }
    }

    let prompt_len = prompt.len();
    let req = GenRequest { id: id.clone(), prompt, max_tokens, kv_transfer_params: params, sampling };
    let mut done = match st.engine.submit_streaming(req, sink).await {
        Ok(d) => d,
        Err(SubmitError::Rejected(e)) if e.starts_with("request '") => return Err(bad(e)),
        Err(SubmitError::Duplicate(e)) => return Err(Failure::new(StatusCode::CONFLICT, "conflict", e)),
        Err(e @ (SubmitError::Unhealthy(_) | SubmitError::Gone)) => {
            return Err(Failure::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", e.to_string()))
        }
        Err(e) => return Err(Failure::new(StatusCode::INTERNAL_SERVER_ERROR, "engine_error", e.to_string())),
    };
    if let Some(p) =
        done.kv_transfer_params.as_mut().filter(|p| p.get("do_remote_prefill") == Some(&Value::Bool(true)))
    {
        p.insert("remote_instance".into(), Value::String(st.instance.clone()));
    }
    let failed_load = matches!(done.finish, FinishReason::Error(_)) || done.kv_load_failure.is_some();
    if let (true, Some((engine, addr))) = (failed_load, &remote) {
        // The peer may have restarted: handshake again before the next load from it.
        st.peers.forget(engine, addr).await;
    }
    if let FinishReason::Error(message) = &done.finish {
        if remote.is_some() {
            metrics::load_failure("load_failed", false);
        }
        return Err(Failure::new(
            StatusCode::BAD_GATEWAY,
            "kv_transfer_failed",
            format!("request {id}: {message}"),
        ));
    }
    if let Some(why) = &done.kv_load_failure {
        metrics::load_failure("load_failed", true);
        kv_note = json!({"recomputed": true, "reason": why});
    }
    let external = done.num_external_tokens as u64;
    metrics::prompt(
        PromptSources::of(prompt_len as u64, done.num_cached_tokens as u64, external),
        external.saturating_mul(st.kv_bytes_per_token),
    );
    Ok(Finished { done, kv_note })
}

async fn current(st: &AppState) -> Result<PoolStats, Response> {
    st.engine.stats().await.map_err(|e| error(StatusCode::SERVICE_UNAVAILABLE, "engine_error", e, None))
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let pool = match current(&st).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    // A server that can serve nothing says so: supervisors (kvconnect up, a liveness probe)
    // restart it.
    let status = if pool.unhealthy.is_some() { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    let body = json!({
        "status": if pool.unhealthy.is_some() { "unhealthy" } else { "ok" },
        "reason": pool.unhealthy,
        "role": st.role.name(),
        "engine_id": st.engine_id,
        "compat_hash": st.compat_hash,
        "pool": pool,
        "side_channel": st.side_channel.snapshot(),
    });
    (status, Json(body)).into_response()
}

async fn prom(State(st): State<Arc<AppState>>) -> Response {
    let p = match current(&st).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let sc = st.side_channel.snapshot();
    let mut now = vec![
        Sample::gauge("kvconnect_pool_blocks", "KV blocks over all cache groups.", p.total_blocks as u64),
        Sample::gauge(
            "kvconnect_pool_free_blocks",
            "Free KV blocks over all cache groups.",
            p.free_blocks as u64,
        ),
        Sample::gauge(
            "kvconnect_requests_unfinished",
            "Requests waiting, loading or running.",
            p.unfinished as u64,
        ),
        Sample::gauge(
            "kvconnect_pending_frees",
            "Finished requests whose blocks the connector still holds.",
            p.pending_frees as u64,
        ),
        Sample::gauge(
            "kvconnect_worker_healthy",
            "1 while the worker can serve; 0 once its connector is poisoned (see /health for why).",
            u64::from(p.unhealthy.is_none()),
        ),
        Sample::counter(
            "kvconnect_external_tokens",
            "Prompt tokens whose KV was loaded through the connector.",
            p.external_tokens,
        ),
        Sample::counter(
            "kvconnect_kv_bytes_moved",
            "KV bytes loaded through the connector: external prompt tokens times the model's KV bytes per \
                token at the cache dtype.",
            p.external_tokens.saturating_mul(st.kv_bytes_per_token),
        ),
        Sample::counter("kvconnect_side_channel_welcomed", "Handshakes accepted.", sc.welcomed),
        Sample::counter("kvconnect_side_channel_refused", "Handshakes refused.", sc.refused),
        Sample::counter(
            "kvconnect_side_channel_dropped",
            "Side-channel connections closed for misbehaving.",
            sc.dropped,
        ),
    ];
    now.extend(side_channel_refusals(&sc));
    now.extend(connector_samples(&st).await);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], metrics::render(now)).into_response()
}

/// Peers the side channel refused, by reason (a connector's own listeners report theirs in
/// its metrics, in the same family).
fn side_channel_refusals(sc: &crate::sidechannel::ServerStatsSnapshot) -> Vec<Sample> {
    const HELP: &str = "Peers the data plane refused, by listener (side_channel, producer) and reason: \
        unauthenticated (no valid proof of the deployment's secret; on the side channel, no proof at all), \
        wrong_secret (side channel: a proof that does not verify), bad_capability (a request named with a \
        capability not its own), malformed, oversized, truncated (closed mid-frame), timeout (a frame not \
        whole within its deadline, read or written; a connection idle between frames past idle_timeout is \
        closed without one), too_many_connections, read_not_served (a read to a backend that copies without \
        it), lease_cap (a hold, check or read past kv_lease_max).";
    let one = |reason: &str, v: u64| {
        Sample::counter("kvconnect_data_plane_refused", HELP, v)
            .with(vec![("listener", "side_channel".into()), ("reason", reason.into())])
    };
    sc.refusals().into_iter().map(|(reason, v)| one(reason, v)).collect()
}

/// What the connector counts (`SchedulerConnector::metrics` and `WorkerConnector::metrics`,
/// a plugin's through the ABI alike), asked of the engine thread now. A sample the host
/// cannot show (a bad name, or one of the server's own families) is left out with a
/// warning, and so is everything when the connector cannot answer: the scrape itself
/// never fails for it.
async fn connector_samples(st: &AppState) -> Vec<Sample> {
    let all = match st.engine.connector_metrics().await {
        Ok(all) => all,
        Err(e) => {
            tracing::warn!("/metrics: the connector's own metrics are left out: {e}");
            return Vec::new();
        }
    };
    let mut out = Vec::with_capacity(all.len());
    for m in all {
        let why = match m.check() {
            Err(e) => e.to_string(),
            Ok(()) if metrics::is_own_family(&m.name) => {
                format!("{} is one of the server's own metrics; rename it in the connector", m.name)
            }
            Ok(()) => {
                let counter = m.kind == MetricKind::Counter;
                out.push(Sample::owned(m.name, m.help, counter, m.labels, m.value));
                continue;
            }
        };
        tracing::warn!("/metrics: a sample of the connector's is left out: {why}");
    }
    out
}
