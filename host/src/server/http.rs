//! The server's HTTP API (axum): the OpenAI routes (see `openai`), `GET /health` (role, pool
//! and side-channel counters as JSON) and `GET /metrics` (the same counters as Prometheus
//! text); and [`run_one`], which runs one engine request for the OpenAI layer (vLLM's
//! `kv_transfer_params` included).

use crate::server::engine_loop::{Done, EngineHandle, PoolStats, SubmitError, TokenSink};
use crate::server::peers::{remote_instance, remote_peer, strip_remote, Peers};
use crate::sidechannel::ServerStats;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvconnect_api::{FailurePolicy, Role};
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
        .route("/v1/completions", post(crate::server::openai::completions))
        .route("/v1/chat/completions", post(crate::server::openai::chat_completions))
        .route("/v1/models", get(crate::server::openai::models))
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
    now.extend(data_plane_refusals(&st.engine_id, &sc));
    now.extend(cache_metrics(&st.engine_id));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], metrics::render(now)).into_response()
}

/// Peers the data plane refused, by listener and reason: the side channel's, and this
/// server's nixl producer listener's (when it runs one).
fn data_plane_refusals(engine_id: &str, sc: &crate::sidechannel::ServerStatsSnapshot) -> Vec<Sample> {
    const HELP: &str = "Peers the data plane refused, by listener (side_channel, producer) and reason: \
        unauthenticated (no valid proof of the deployment's secret; on the side channel, no proof at all), \
        wrong_secret (side channel: a proof that does not verify), bad_capability (a request named with a \
        capability not its own), malformed, oversized, truncated (closed mid-frame), timeout (a frame not \
        whole within its deadline, read or written; a connection idle between frames past idle_timeout is \
        closed without one), too_many_connections, read_not_served (a read to a backend that copies without \
        it), lease_cap (a hold, check or read past kv_lease_max).";
    let one = |listener: &str, reason: &str, v: u64| {
        Sample::counter("kvconnect_data_plane_refused", HELP, v)
            .with(vec![("listener", listener.into()), ("reason", reason.into())])
    };
    let mut out: Vec<Sample> =
        sc.refusals().into_iter().map(|(reason, v)| one("side_channel", reason, v)).collect();
    for (reason, v) in kvconnect_nixl::producer::refusals(engine_id).unwrap_or_default() {
        out.push(one("producer", reason, v));
    }
    out
}

/// The cache tiers' hits, misses and bytes per direction, read at scrape time from the
/// process-global stores of this server's engine (the composite passes its engine id to its
/// children): lmcache's CPU, disk and remote tiers, flexkv's CPU and SSD tiers, and the
/// remote tier's failures by kind. Empty when this server runs neither.
fn cache_metrics(engine_id: &str) -> Vec<Sample> {
    const HITS: &str = "Chunks (lmcache) or blocks (flexkv) a KV load found in a cache tier.";
    const LOADED: &str = "Bytes read out of a cache tier into the KV cache.";
    const OFFLOAD: &str = "Bytes moved between the KV cache and the host-memory cache tiers: GPU_to_CPU \
        saved into a tier, CPU_to_GPU loaded from one (the KV cache may itself be in host memory).";
    let hit = |connector: &str, tier: &str, v: u64| {
        Sample::counter("kvconnect_cache_hits", HITS, v)
            .with(vec![("connector", connector.into()), ("tier", tier.into())])
    };
    let loaded = |connector: &str, tier: &str, v: u64| {
        Sample::counter("kvconnect_cache_loaded_bytes", LOADED, v)
            .with(vec![("connector", connector.into()), ("tier", tier.into())])
    };
    let (mut hits, mut loads, mut misses) = (Vec::new(), Vec::new(), Vec::new());
    let (mut saved, mut restored) = (0u64, 0u64);
    let mut remote = Vec::new();
    if let Some(s) = kvconnect_lmcache::stats(engine_id) {
        for (tier, t) in [("cpu", &s.cpu), ("disk", &s.disk), ("remote", &s.remote)] {
            hits.push(hit("lmcache", tier, t.hits));
            loads.push(loaded("lmcache", tier, t.bytes_loaded));
            restored += t.bytes_loaded;
        }
        saved += s.cpu.bytes_stored;
        misses.push(
            Sample::counter(
                "kvconnect_cache_misses",
                "Chunks a KV load expected but did not find.",
                s.misses,
            )
            .with(vec![("connector", "lmcache".into())]),
        );
        const REMOTE: &str =
            "lmcache remote tier (remote_url) outcomes other than hits: miss (not there, or \
            the remote could not answer), error (a failed lookup or read), skipped (not tried during the \
            back-off after a failure), corrupt (failed its checksum; never loaded), write_error, \
            write_dropped.";
        for (outcome, v) in [
            ("miss", s.remote_misses),
            ("error", s.remote_errors),
            ("skipped", s.remote_skipped),
            ("corrupt", s.remote_corrupt),
            ("write_error", s.remote_write_errors),
            ("write_dropped", s.remote_write_drops),
        ] {
            remote.push(
                Sample::counter("kvconnect_cache_remote_outcomes", REMOTE, v)
                    .with(vec![("connector", "lmcache".into()), ("outcome", outcome.into())]),
            );
        }
    }
    if let Some((s, block)) = kvconnect_flexkv::registry::stats(engine_id) {
        let block = block as u64;
        for (tier, n) in [("cpu", s.cpu_hits), ("ssd", s.ssd_hits)] {
            hits.push(hit("flexkv", tier, n));
            loads.push(loaded("flexkv", tier, n * block));
            restored += n * block;
        }
        saved += s.stored * block;
    }
    if hits.is_empty() {
        return Vec::new();
    }
    let offload = |direction: &str, v: u64| {
        Sample::counter("vllm:kv_offload_total_bytes", OFFLOAD, v)
            .with(vec![("transfer_type", direction.into())])
    };
    let mut out = hits;
    out.extend(misses);
    out.extend(remote);
    out.extend(loads);
    out.push(offload("GPU_to_CPU", saved));
    out.push(offload("CPU_to_GPU", restored));
    out
}
