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
//! Streaming: the engine hands a request back when it ends, so the SSE chunks (one per
//! token, then `data: [DONE]`) are written once the whole completion is known; the client
//! sees the OpenAI stream format, not earlier first bytes.

use crate::server::http::{self, AppState};
use crate::server::{openai_metrics, sse};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::sync::Arc;

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
        openai_metrics::refusal(&message);
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

async fn generate(st: Arc<AppState>, raw: Bytes, chat: bool) -> Response {
    let route = if chat { "/v1/chat/completions" } else { "/v1/completions" };
    let r = generate_inner(st, raw, chat).await;
    openai_metrics::request(route, r.status().as_u16());
    r
}

async fn generate_inner(st: Arc<AppState>, raw: Bytes, chat: bool) -> Response {
    let t0 = std::time::Instant::now();
    let c = match check(&st, &raw, chat) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let inner = http::completions(State(st.clone()), Bytes::from(Value::Object(c.body).to_string())).await;
    let v = match openai_from_inner(inner).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let k = &v["kvconnect"];
    openai_metrics::generation(
        std::time::Duration::from_micros(k["ttft_us"].as_u64().unwrap_or(0)),
        t0.elapsed(),
        v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        k["num_external_tokens"].as_u64().unwrap_or(0),
    );
    if let Some(reason) = k["kv_load"]["reason"].as_str() {
        openai_metrics::refusal(reason);
    }
    let v = if chat { sse::as_chat(v) } else { v };
    if c.stream {
        sse::response(&v, chat)
    } else {
        Json(v).into_response()
    }
}

/// `POST /v1/completions`.
pub async fn completions(State(st): State<Arc<AppState>>, raw: Bytes) -> Response {
    generate(st, raw, false).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(st): State<Arc<AppState>>, raw: Bytes) -> Response {
    generate(st, raw, true).await
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
