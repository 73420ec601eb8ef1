//! The OpenAI-compatible face of a server: `GET /v1/models`, `POST /v1/completions` and
//! `POST /v1/chat/completions`, with `stream: true` answered as server-sent events.
//!
//! A request is checked into an [`OpenAiRequest`] (`params`: every parameter honoured or
//! refused with a 400 naming it), the model name and the context are checked, and each of its
//! choices (prompts × `n`) runs as one engine request ([`http::run_one`]), all at once; choice
//! `j` of a prompt samples from `seed + j` (a seed is picked per request when none is given).
//! Answers are built by `response` (one body) or `sse` (a stream); every error becomes
//! OpenAI's body `{"error": {"message", "type", "param", "code"}}` with a fitting status.
//!
//! Streaming: the engine thread sends each step's new tokens through the request's channel
//! (one for all its choices), and each becomes an SSE chunk as soon as it exists; the closing
//! chunks and `data: [DONE]` follow when every choice has ended. The status line waits for the
//! first token, so a request refused before generating anything still gets its OpenAI error
//! status. A client that leaves mid-stream only closes the channel: the requests run to their
//! end and free their blocks as usual.

use crate::engine_loop::{TokenSink, TokenStream};
use crate::http::{self, AppState, Failure, Finished, OneRequest};
use crate::response::{self, ChoiceOutput, Head, Shape};
use crate::sse::{Chunks, Tail};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvconnect_api::TierTokens;
use kvconnect_openai::params::{self, OpenAiRequest};
use kvconnect_openai::{metrics, request_id};
use serde_json::{json, Value};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use kvconnect_openai::chat_template::chat_prompt;
pub use kvconnect_openai::error::{json_object, openai_error, openai_error_with_code, param_error};
use kvconnect_openai::stream::sse;
pub use kvconnect_openai::stream::Events;
pub use kvconnect_openai::CONTEXT_TOKENS;

// The error is the finished response; it is built once per refused request, so its size
// does not matter.
#[allow(clippy::result_large_err)]
fn check(st: &AppState, raw: &[u8], chat: bool) -> Result<OpenAiRequest, Response> {
    let body = json_object(raw)?;
    if let Some(name) = body.get("model").and_then(Value::as_str) {
        if name != st.model {
            return Err(openai_error(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "the model '{name}' does not exist here; this worker serves '{}' (see GET /v1/models)",
                    st.model
                ),
                Some("model"),
            ));
        }
    }
    let req = params::parse(&body, chat).map_err(param_error)?;
    if !req.ignored.is_empty() {
        tracing::warn!(fields = ?req.ignored, "request fields neither OpenAI nor vLLM define were ignored");
    }
    for p in &req.prompts {
        params::check_context(p.len(), req.max_tokens, st.max_model_len).map_err(param_error)?;
    }
    Ok(req)
}

/// An engine failure as OpenAI's error response (a full pool is the prompt's fault: 413).
fn failure_response(f: Failure) -> Response {
    if f.diff.is_some() {
        metrics::refusal(&f.message);
    }
    let (status, param) = if f.message.contains("but the pool has") {
        (StatusCode::PAYLOAD_TOO_LARGE, Some("prompt"))
    } else if f.message.contains("engine thread") || f.status == StatusCode::SERVICE_UNAVAILABLE {
        (StatusCode::SERVICE_UNAVAILABLE, None)
    } else {
        (f.status, None)
    };
    let mut r = openai_error(status, f.kind, f.message.clone(), param);
    // Keep the server's structured extras (the handshake diff under `fail`).
    if let Some(diff) = f.diff {
        let body = json!({"error": {
            "message": f.message, "type": f.kind, "param": param, "code": Value::Null, "diff": diff,
        }});
        r = (status, Json(body)).into_response();
    }
    r
}

/// A seed for a request that gave none: different for every request.
fn fresh_seed(n: u64) -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// A checked request as it runs: its id, creation time and choices' engine requests.
struct Plan {
    req: OpenAiRequest,
    head: Head,
    t0: Instant,
}

impl Plan {
    /// The request's id is vLLM's: from the X-Request-Id header, else the body's
    /// `request_id`, else a fresh one (see `request_id`). `Err` is the answer to send instead.
    #[allow(clippy::result_large_err)] // Built once per request, on its way out: no cost worth a box.
    fn new(st: &AppState, headers: &HeaderMap, req: OpenAiRequest, t0: Instant) -> Result<Plan, Response> {
        let fresh = || format!("{}-{}", st.engine_id, st.next_id.fetch_add(1, Ordering::Relaxed));
        let body_id = req.request_id.clone().map(Value::String);
        let id = request_id::engine_request_id(headers, body_id.as_ref(), req.chat, fresh).map_err(|e| {
            openai_error(StatusCode::BAD_REQUEST, "invalid_request_error", e, Some("request_id"))
        })?;
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let head = Head { id, model: st.model.clone(), created, chat: req.chat };
        Ok(Plan { req, head, t0 })
    }

    fn shape(&self) -> Shape {
        Shape {
            chat: self.req.chat,
            logprobs: self.req.logprobs.is_some(),
            include_stop: self.req.include_stop_str_in_output,
        }
    }

    /// One engine request per choice, choice `prompt * n + j` sampling from `seed + j`; a
    /// lone choice runs under the response's id (a proxy hands it to decode).
    fn engine_requests(&self, seed: u64) -> Vec<OneRequest> {
        let r = &self.req;
        let many = r.choices() > 1;
        let mut out = Vec::with_capacity(r.choices());
        for prompt in &r.prompts {
            for j in 0..r.n {
                let index = out.len();
                out.push(OneRequest {
                    id: if many { format!("{}-{index}", self.head.id) } else { self.head.id.clone() },
                    prompt: prompt.clone(),
                    max_tokens: r.max_tokens_or_default(),
                    sampling: r.sampling(seed.wrapping_add(j as u64)),
                    kv_transfer_params: r.kv_transfer_params.clone().unwrap_or_default(),
                });
            }
        }
        out
    }

    /// The prompt each choice shows before its text (`echo`), or nothing.
    fn prefixes(&self) -> Vec<Vec<u32>> {
        let r = &self.req;
        r.prompts
            .iter()
            .flat_map(|p| std::iter::repeat_n(if r.echo { p.clone() } else { Vec::new() }, r.n))
            .collect()
    }

    /// Records each choice's metrics and returns the choices with the closing fields.
    fn finish(&self, st: &AppState, results: &[Finished]) -> (Vec<ChoiceOutput>, Tail) {
        for f in results {
            let d = &f.done;
            metrics::generation(
                d.ttft.unwrap_or_default(),
                self.t0.elapsed(),
                d.tokens.len() as u64,
                d.num_external_tokens as u64,
            );
            if let Some(reason) = f.kv_note["reason"].as_str() {
                metrics::refusal(reason);
            }
        }
        let outputs: Vec<ChoiceOutput> = results
            .iter()
            .map(|f| ChoiceOutput {
                tokens: f.done.tokens.clone(),
                logprobs: f.done.logprobs.clone(),
                finish: f.done.finish.clone(),
            })
            .collect();
        let prompt_tokens: usize = self.req.prompts.iter().map(Vec::len).sum();
        let completion_tokens: usize = outputs.iter().map(|o| o.tokens.len()).sum();
        let mut kvconnect = json!({
            "engine_id": st.engine_id,
            "ttft_us": results.iter().filter_map(|f| f.done.ttft).min().map(|d| d.as_micros() as u64),
            "num_external_tokens": results.iter().map(|f| f.done.num_external_tokens).sum::<usize>(),
            "num_cached_tokens": results.iter().map(|f| f.done.num_cached_tokens).sum::<usize>(),
        });
        if let Some(note) = results.iter().map(|f| &f.kv_note).find(|n| !n.is_null()) {
            kvconnect["kv_load"] = note.clone();
        }
        // Which cache connector and tier served the external tokens, summed over the choices.
        let mut sources: Vec<TierTokens> = Vec::new();
        for t in results.iter().flat_map(|f| &f.done.load_sources) {
            TierTokens::add_to(&mut sources, t.clone());
        }
        kvconnect["cache_sources"] = serde_json::to_value(&sources).unwrap_or(Value::Null);
        let kv_transfer_params = match results {
            [one] => serde_json::to_value(&one.done.kv_transfer_params).unwrap_or(Value::Null),
            _ => Value::Null,
        };
        (
            outputs,
            Tail { usage: response::usage(prompt_tokens, completion_tokens), kv_transfer_params, kvconnect },
        )
    }

    fn body(&self, st: &AppState, results: &[Finished]) -> Value {
        let (outputs, tail) = self.finish(st, results);
        let prefixes = self.prefixes();
        let choices = outputs
            .iter()
            .enumerate()
            .map(|(i, o)| response::choice(i, o, self.req.echo.then(|| prefixes[i].as_slice()), self.shape()))
            .collect();
        response::body(&self.head, choices, tail.usage, tail.kv_transfer_params, tail.kvconnect)
    }

    fn longest_stop(&self) -> usize {
        self.req.sampling(0).stop.iter().map(Vec::len).max().unwrap_or(0)
    }
}

async fn generate(st: Arc<AppState>, headers: &HeaderMap, raw: Bytes, chat: bool) -> Response {
    let route = if chat { "/v1/chat/completions" } else { "/v1/completions" };
    let r = generate_inner(st, headers, raw, chat).await;
    metrics::request(route, r.status().as_u16());
    r
}

type Job = JoinHandle<Result<Finished, Failure>>;

/// Aborts the jobs it holds when dropped (finished ones are unaffected): a handler dropped
/// because its client disconnected takes its engine requests with it, and the engine cancels
/// them, freeing their blocks.
struct AbortOnDrop(Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}

/// Every job's result in order; the first failure (or a job that panicked) ends it.
async fn join(jobs: Vec<Job>) -> Result<Vec<Finished>, Response> {
    let _abort = AbortOnDrop(jobs.iter().map(JoinHandle::abort_handle).collect());
    let mut out = Vec::with_capacity(jobs.len());
    let mut failed = None;
    for j in jobs {
        // Every job is awaited, so none outlives the answer unaccounted.
        match j.await {
            Ok(Ok(f)) => out.push(f),
            Ok(Err(f)) => {
                failed.get_or_insert_with(|| failure_response(f));
            }
            Err(e) => {
                failed.get_or_insert_with(|| {
                    openai_error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        format!("the request's task failed: {e}"),
                        None,
                    )
                });
            }
        }
    }
    failed.map_or(Ok(out), Err)
}

async fn generate_inner(st: Arc<AppState>, headers: &HeaderMap, raw: Bytes, chat: bool) -> Response {
    let t0 = Instant::now();
    let req = match check(&st, &raw, chat) {
        Ok(r) => r,
        Err(r) => return r,
    };
    let plan = match Plan::new(&st, headers, req, t0) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let seed = plan.req.seed.unwrap_or_else(|| fresh_seed(st.next_id.load(Ordering::Relaxed)));
    let ones = plan.engine_requests(seed);
    if plan.req.stream {
        let (sinks, tokens) = TokenSink::channel(ones.len());
        let jobs: Vec<Job> = ones
            .into_iter()
            .zip(sinks)
            .map(|(one, sink)| tokio::spawn(http::run_one(st.clone(), one, Some(sink))))
            .collect();
        return stream(st, plan, jobs, tokens).await;
    }
    let jobs: Vec<Job> =
        ones.into_iter().map(|one| tokio::spawn(http::run_one(st.clone(), one, None))).collect();
    match join(jobs).await {
        Ok(results) => Json(plan.body(&st, &results)).into_response(),
        Err(r) => r,
    }
}

/// A `stream: true` request: SSE chunks leave as the engine produces tokens.
async fn stream(st: Arc<AppState>, plan: Plan, jobs: Vec<Job>, mut tokens: TokenStream) -> Response {
    // The channel closes when every choice has ended; ending before any token means the
    // request was refused or failed: answer it whole, with its status.
    let Some(first) = tokens.recv().await else {
        return match join(jobs).await {
            Ok(results) => {
                let mut chunks = chunks_of(&plan);
                let (outputs, tail) = plan.finish(&st, &results);
                let body = chunks.open() + &chunks.close(&outputs, &tail);
                sse(body)
            }
            Err(r) => r,
        };
    };
    let (out, events) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let mut client = Some(out);
        let mut chunks = chunks_of(&plan);
        push(&mut client, chunks.open()).await;
        let mut batch = Some(first);
        while let Some((index, new)) = batch {
            push(&mut client, chunks.tokens(index, &new)).await;
            batch = if client.is_some() { tokens.recv().await } else { None };
        }
        // A client that left closes the token channel: the engine stops sending to it.
        drop(tokens);
        let tail = match join(jobs).await {
            Ok(results) => {
                let (outputs, tail) = plan.finish(&st, &results);
                chunks.close(&outputs, &tail)
            }
            Err(r) => error_event(r).await,
        };
        push(&mut client, tail).await;
    });
    sse(Body::from_stream(Events(events)))
}

fn chunks_of(plan: &Plan) -> Chunks {
    Chunks::new(plan.head.clone(), plan.shape(), plan.req.include_usage, plan.longest_stop(), plan.prefixes())
}

/// Writes one event to the client; a client that left is forgotten (the request still runs
/// to its end).
async fn push(client: &mut Option<mpsc::Sender<Bytes>>, event: String) {
    if event.is_empty() {
        return;
    }
    if let Some(c) = client {
        if c.send(Bytes::from(event)).await.is_err() {
            *client = None;
        }
    }
}

/// Largest error body read back into a stream's error event.
const MAX_ERROR_BODY: usize = 1 << 20;

/// An error response, as the SSE event that ends a stream already under way (OpenAI sends
/// `data: {"error": ...}` and closes; no `[DONE]` follows).
async fn error_event(r: Response) -> String {
    let bytes = axum::body::to_bytes(r.into_body(), MAX_ERROR_BODY).await.unwrap_or_default();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or_else(
        |_| json!({"error": {"message": String::from_utf8_lossy(&bytes), "type": "server_error"}}),
    );
    format!("data: {v}\n\n")
}

/// `POST /v1/completions`.
pub async fn completions(State(st): State<Arc<AppState>>, headers: HeaderMap, raw: Bytes) -> Response {
    generate(st, &headers, raw, false).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(st): State<Arc<AppState>>, headers: HeaderMap, raw: Bytes) -> Response {
    generate(st, &headers, raw, true).await
}

/// `GET /v1/models`.
pub async fn models(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.model, "object": "model", "owned_by": "kvconnect", "max_model_len": st.max_model_len,
        }],
    }))
    .into_response()
}
