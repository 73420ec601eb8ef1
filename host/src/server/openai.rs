//! The OpenAI-compatible face of a worker: `GET /v1/models`, `POST /v1/completions` and
//! `POST /v1/chat/completions`, with `stream: true` answered as server-sent events.
//!
//! The generation itself is the worker's own completions handler ([`http::completions`]);
//! this layer checks what OpenAI clients send (model name, `max_tokens` against the model's
//! context, chat messages), applies the chat template, and turns every error into OpenAI's
//! body `{"error": {"message", "type", "param", "code"}}` with a fitting status.
//!
//! Chat template (the reference engine has a byte-level tokenizer and no template of its
//! own): each message becomes `"<role>: <content>\n"`, then `"assistant: "` is appended.
//!
//! Streaming: the engine thread sends each step's new tokens through a per-request channel,
//! and each becomes an SSE chunk as soon as it exists; the closing chunk (`finish_reason`,
//! `usage`, `kv_transfer_params`) and `data: [DONE]` follow when the request ends. The status
//! line waits for the first token, so a request refused before generating anything still gets
//! its OpenAI error status. A client that leaves mid-stream only closes the channel: the
//! request runs to its end and frees its blocks as usual.

use crate::server::http::{self, AppState};
use crate::server::{request_id, sse, worker_metrics};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::sync::mpsc;

/// Largest response body this layer reads back from the inner handler.
const MAX_BODY: usize = 64 << 20;

/// The reference engine's context window (`max_position_embeddings` of its config).
pub const CONTEXT_TOKENS: usize = 4096;

/// An OpenAI-style error response.
pub fn openai_error(
    status: StatusCode,
    kind: &str,
    message: impl Into<String>,
    param: Option<&str>,
) -> Response {
    let code = match status {
        StatusCode::NOT_FOUND => json!("model_not_found"),
        StatusCode::PAYLOAD_TOO_LARGE => json!("context_length_exceeded"),
        _ => Value::Null,
    };
    (status, Json(json!({"error": {"message": message.into(), "type": kind, "param": param, "code": code}})))
        .into_response()
}

/// The chat template: `"<role>: <content>\n"` per message, then `"assistant: "`.
pub fn chat_prompt(messages: &Value) -> Result<String, String> {
    let Some(list) = messages.as_array() else {
        return Err("'messages' must be a list of {\"role\", \"content\"} objects".into());
    };
    if list.is_empty() {
        return Err("'messages' is empty; send at least one message".into());
    }
    let mut out = String::new();
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let content = match m.get("content") {
            Some(Value::String(s)) => Some(s.clone()),
            // OpenAI's content parts: only text parts carry anything for this model.
            Some(Value::Array(parts)) => parts
                .iter()
                .map(|p| p.get("text").and_then(Value::as_str).map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .map(|v| v.concat()),
            _ => None,
        };
        match (role, content) {
            (Some(r), Some(c)) => out.push_str(&format!("{r}: {c}\n")),
            _ => return Err(format!("messages[{i}] needs a string 'role' and a text 'content': {m}")),
        }
    }
    out.push_str("assistant: ");
    Ok(out)
}

/// What the OpenAI layer checked and will pass on.
struct Checked {
    body: Map<String, Value>,
    stream: bool,
}

// The error is the finished response; it is built once per refused request, so its size
// does not matter.
#[allow(clippy::result_large_err)]
fn check(st: &AppState, raw: &[u8], chat: bool) -> Result<Checked, Response> {
    let bad =
        |m: String, p: Option<&str>| openai_error(StatusCode::BAD_REQUEST, "invalid_request_error", m, p);
    let v: Value =
        serde_json::from_slice(raw).map_err(|e| bad(format!("the body is not valid JSON: {e}"), None))?;
    let Value::Object(mut body) = v else {
        return Err(bad("the body must be a JSON object".into(), None));
    };
    if let Some(m) = body.get("model") {
        match m.as_str() {
            Some(name) if name == st.model => {}
            Some(name) => {
                return Err(openai_error(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    format!(
                    "the model '{name}' does not exist here; this worker serves '{}' (see GET /v1/models)",
                    st.model
                ),
                    Some("model"),
                ))
            }
            None => return Err(bad(format!("'model' must be a string, not {m}"), Some("model"))),
        }
    }
    let stream = match body.remove("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(other) => {
            return Err(bad(format!("'stream' must be true or false, not {other}"), Some("stream")))
        }
    };
    if chat {
        let messages = body.remove("messages").unwrap_or(Value::Null);
        let prompt = chat_prompt(&messages).map_err(|m| bad(m, Some("messages")))?;
        body.insert("prompt".into(), Value::String(prompt));
        // OpenAI's newer name for the same limit.
        if let Some(m) = body.remove("max_completion_tokens") {
            body.entry("max_tokens").or_insert(m);
        }
    }
    let max_tokens = match body.get("max_tokens") {
        None | Some(Value::Null) => None,
        Some(m) => match m.as_u64() {
            Some(n) if n > 0 => Some(n as usize),
            _ => {
                return Err(bad(
                    format!("'max_tokens' must be a positive integer, not {m}"),
                    Some("max_tokens"),
                ))
            }
        },
    };
    let prompt_len = match body.get("prompt") {
        Some(Value::String(s)) => s.len(),
        Some(Value::Array(a)) => a.len(),
        _ => 0,
    };
    if let Some(n) = max_tokens {
        if prompt_len.saturating_add(n) > st.max_model_len {
            return Err(openai_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request_error",
                format!(
                    "max_tokens {n} with a {prompt_len}-token prompt exceeds the model's context of {} tokens; ask for at most {} tokens",
                    st.max_model_len,
                    st.max_model_len.saturating_sub(prompt_len)
                ),
                Some("max_tokens"),
            ));
        }
    }
    if prompt_len > st.max_model_len {
        return Err(openai_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the prompt has {prompt_len} tokens; the model's context is {} tokens", st.max_model_len),
            Some("prompt"),
        ));
    }
    Ok(Checked { body, stream })
}

/// Rewrites an error from the inner handler as an OpenAI error with a fitting status.
async fn openai_from_inner(resp: Response) -> Result<Value, Response> {
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), MAX_BODY).await.map_err(|e| {
        openai_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("cannot read the engine's answer: {e}"),
            None,
        )
    })?;
    let v: Value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| json!({"error": {"message": String::from_utf8_lossy(&bytes)}}));
    if status.is_success() {
        return Ok(v);
    }
    let message = v["error"]["message"].as_str().unwrap_or("the engine failed this request").to_owned();
    if v["error"].get("diff").is_some() {
        worker_metrics::refusal(&message);
    }
    let kind = v["error"]["type"].as_str().unwrap_or("server_error").to_owned();
    let (status, param) = if message.contains("but the pool has") {
        (StatusCode::PAYLOAD_TOO_LARGE, Some("prompt"))
    } else if message.contains("engine thread") || status == StatusCode::SERVICE_UNAVAILABLE {
        (StatusCode::SERVICE_UNAVAILABLE, None)
    } else {
        (status, None)
    };
    let mut r = openai_error(status, &kind, message, param);
    // Keep the worker's structured extras (the handshake diff under `fail`).
    if let Some(diff) = v["error"].get("diff") {
        let body = json!({"error": {"message": v["error"]["message"], "type": kind, "param": param, "code": Value::Null, "diff": diff}});
        r = (status, Json(body)).into_response();
    }
    Err(r)
}

async fn generate(st: Arc<AppState>, headers: &HeaderMap, raw: Bytes, chat: bool) -> Response {
    let route = if chat { "/v1/chat/completions" } else { "/v1/completions" };
    let r = generate_inner(st, headers, raw, chat).await;
    worker_metrics::request(route, r.status().as_u16());
    r
}

async fn generate_inner(st: Arc<AppState>, headers: &HeaderMap, raw: Bytes, chat: bool) -> Response {
    let t0 = std::time::Instant::now();
    let mut c = match check(&st, &raw, chat) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let fresh = || format!("{}-{}", st.engine_id, st.next_id.fetch_add(1, Ordering::Relaxed));
    match request_id::engine_request_id(headers, c.body.get("request_id"), chat, fresh) {
        Ok(id) => c.body.insert("request_id".into(), Value::String(id)),
        Err(e) => {
            return openai_error(StatusCode::BAD_REQUEST, "invalid_request_error", e, Some("request_id"))
        }
    };
    if c.stream {
        return stream(st, c.body, chat, t0).await;
    }
    let inner = http::completions(State(st.clone()), Bytes::from(Value::Object(c.body).to_string())).await;
    match finished(inner, chat, t0).await {
        Ok(v) => Json(v).into_response(),
        Err(r) => r,
    }
}

/// The inner handler's answer as the OpenAI response value (chat form for chat), with the
/// request's metrics recorded.
async fn finished(inner: Response, chat: bool, t0: Instant) -> Result<Value, Response> {
    let v = openai_from_inner(inner).await?;
    let k = &v["kvconnect"];
    worker_metrics::generation(
        std::time::Duration::from_micros(k["ttft_us"].as_u64().unwrap_or(0)),
        t0.elapsed(),
        v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        k["num_external_tokens"].as_u64().unwrap_or(0),
    );
    if let Some(reason) = k["kv_load"]["reason"].as_str() {
        worker_metrics::refusal(reason);
    }
    Ok(if chat { sse::as_chat(v) } else { v })
}

/// A `stream: true` request: SSE chunks leave as the engine produces tokens.
async fn stream(st: Arc<AppState>, body: Map<String, Value>, chat: bool, t0: Instant) -> Response {
    // The id goes into the chunks before the request ends (`generate` fixed it).
    let id = body.get("request_id").and_then(Value::as_str).unwrap_or_default().to_owned();
    let (sink, mut tokens) = mpsc::unbounded_channel::<Vec<u32>>();
    let inner_st = st.clone();
    let raw = Bytes::from(Value::Object(body).to_string());
    // Its own task: it runs to the request's end even when the client is gone.
    let mut job = tokio::spawn(async move { http::completions_with(State(inner_st), raw, Some(sink)).await });
    let first = tokio::select! {
        biased;
        t = tokens.recv() => t,
        r = &mut job => {
            // Ended (or refused) before a token was sent: answer it whole.
            return match r {
                Ok(inner) => match finished(inner, chat, t0).await {
                    Ok(v) => sse::response(&v, chat),
                    Err(r) => r,
                },
                Err(e) => openai_error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", format!("the request's task failed: {e}"), None),
            };
        }
    };
    let Some(first) = first else {
        // The sink closed without a token: the request ended; its answer says how.
        return match job.await {
            Ok(inner) => match finished(inner, chat, t0).await {
                Ok(v) => sse::response(&v, chat),
                Err(r) => r,
            },
            Err(e) => openai_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                format!("the request's task failed: {e}"),
                None,
            ),
        };
    };
    let (out, events) = mpsc::channel::<Bytes>(64);
    let (id, model) = (Value::String(id), Value::String(st.model.clone()));
    tokio::spawn(async move {
        let mut client = Some(out);
        let mut n = 0usize;
        let mut batch = Some(first);
        while let Some(toks) = batch {
            for t in toks {
                push(&mut client, sse::token_event(&id, &model, chat, t, n == 0)).await;
                n += 1;
            }
            batch = if client.is_some() { tokens.recv().await } else { None };
        }
        // A client that left closes the token channel: the engine stops sending to it.
        drop(tokens);
        let tail = match job.await {
            Ok(inner) => match finished(inner, chat, t0).await {
                Ok(v) => sse::final_events(&v, chat),
                Err(r) => error_event(r).await,
            },
            Err(e) => format!(
                "data: {}\n\n",
                json!({"error": {"message": format!("the request's task failed: {e}"), "type": "server_error"}})
            ),
        };
        push(&mut client, tail).await;
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")],
        Body::from_stream(Events(events)),
    )
        .into_response()
}

/// Writes one event to the client; a client that left is forgotten (the request still runs
/// to its end).
async fn push(client: &mut Option<mpsc::Sender<Bytes>>, event: String) {
    if let Some(c) = client {
        if c.send(Bytes::from(event)).await.is_err() {
            *client = None;
        }
    }
}

/// An error response, as the SSE event that ends a stream already under way (OpenAI sends
/// `data: {"error": ...}` and closes; no `[DONE]` follows).
async fn error_event(r: Response) -> String {
    let bytes = axum::body::to_bytes(r.into_body(), MAX_BODY).await.unwrap_or_default();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or_else(
        |_| json!({"error": {"message": String::from_utf8_lossy(&bytes), "type": "server_error"}}),
    );
    format!("data: {v}\n\n")
}

/// A stream's events as a response body (the proxy's streams use it too).
pub(crate) struct Events(pub(crate) mpsc::Receiver<Bytes>);

impl futures_core::Stream for Events {
    type Item = Result<Bytes, std::convert::Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|e| e.map(Ok))
    }
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
        "data": [{"id": st.model, "object": "model", "owned_by": "kvconnect", "max_model_len": st.max_model_len}],
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_template_is_role_colon_content_lines_then_assistant() {
        let p = chat_prompt(
            &json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]),
        );
        assert_eq!(p.unwrap(), "system: be brief\nuser: hi\nassistant: ");
        let parts = chat_prompt(
            &json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
        );
        assert_eq!(parts.unwrap(), "user: ab\nassistant: ");
    }

    #[test]
    fn chat_template_refuses_what_it_cannot_render() {
        assert!(chat_prompt(&json!([])).unwrap_err().contains("empty"));
        assert!(chat_prompt(&json!("hi")).unwrap_err().contains("list"));
        assert!(chat_prompt(&json!([{"role": "user"}])).unwrap_err().contains("messages[0]"));
    }
}
