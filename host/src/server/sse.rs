//! OpenAI response shapes: the chat form of a text completion, and the server-sent-event
//! stream (built whole from a finished completion, or event by event as tokens arrive) (`data: {...}\n\n` per token, a last chunk
//! with `finish_reason` and `usage`, then `data: [DONE]\n\n`). The worker and the proxy both
//! use these, so a stream looks the same from either.

use crate::worker::detokenize;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// A `text_completion` response rewritten as a `chat.completion` (the assistant's message
/// holds the text; `kv_transfer_params`, `usage` and `kvconnect` are kept).
pub fn as_chat(mut v: Value) -> Value {
    let text = v["choices"][0]["text"].take();
    let finish = v["choices"][0]["finish_reason"].take();
    let ids = v["choices"][0]["token_ids"].take();
    // The id stays the engine's request id: a proxy hands it to decode as `request_id`.
    v["object"] = json!("chat.completion");
    v["choices"] = json!([{
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "token_ids": ids,
        "finish_reason": finish,
    }]);
    v
}

fn object(chat: bool) -> &'static str {
    if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    }
}

/// The event of one generated token; `first` marks the stream's first token (a chat delta
/// then carries the assistant role).
pub fn token_event(id: &Value, model: &Value, chat: bool, token: u32, first: bool) -> String {
    let text = detokenize(std::slice::from_ref(&token));
    let delta = if chat {
        let mut d = json!({"content": text});
        if first {
            d["role"] = json!("assistant");
        }
        json!({"index": 0, "delta": d, "token_ids": [token], "finish_reason": null})
    } else {
        json!({"index": 0, "text": text, "token_ids": [token], "finish_reason": null})
    };
    let c = json!({"id": id, "object": object(chat), "model": model, "choices": [delta]});
    format!("data: {c}\n\n")
}

/// The closing events of a finished response: the chunk with `finish_reason`, `usage`,
/// `kv_transfer_params` and `kvconnect`, then `data: [DONE]`.
pub fn final_events(v: &Value, chat: bool) -> String {
    let choice = &v["choices"][0];
    let last = if chat {
        json!({"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]})
    } else {
        json!({"index": 0, "text": "", "finish_reason": choice["finish_reason"]})
    };
    let c = json!({
        "id": v["id"], "object": object(chat), "model": v["model"], "choices": [last],
        "usage": v["usage"], "kv_transfer_params": v["kv_transfer_params"], "kvconnect": v["kvconnect"],
    });
    format!("data: {c}\n\ndata: [DONE]\n\n")
}

/// The stream of a finished response (`chat` picks the chunk shape).
pub fn body(v: &Value, chat: bool) -> String {
    let ids: Vec<u32> = v["choices"][0]["token_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok())).collect())
        .unwrap_or_default();
    let mut out = String::new();
    for (i, t) in ids.iter().enumerate() {
        out.push_str(&token_event(&v["id"], &v["model"], chat, *t, i == 0));
    }
    out.push_str(&final_events(v, chat));
    out
}

/// The stream as an HTTP response (`text/event-stream`).
pub fn response(v: &Value, chat: bool) -> Response {
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], body(v, chat))
        .into_response()
}

/// The text a stream carries, joined from its chunks (for clients and tests); `None` when a
/// chunk is not JSON or `[DONE]` is missing.
pub fn collect_text(stream: &str) -> Option<String> {
    let mut text = String::new();
    let mut done = false;
    for ev in stream.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = ev.trim().strip_prefix("data: ")?;
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let c: Value = serde_json::from_str(data).ok()?;
        let ch = &c["choices"][0];
        if let Some(t) = ch["text"].as_str().or(ch["delta"]["content"].as_str()) {
            text.push_str(t);
        }
    }
    done.then_some(text)
}

/// The token ids a stream carries (each chunk's `token_ids`), joined; `None` as for
/// [`collect_text`]. Byte-level tokens that are not whole UTF-8 characters arrive as U+FFFD in
/// a chunk's text, so the ids are what to compare exactly.
pub fn collect_token_ids(stream: &str) -> Option<Vec<u32>> {
    let mut ids = Vec::new();
    let mut done = false;
    for ev in stream.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = ev.trim().strip_prefix("data: ")?;
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let c: Value = serde_json::from_str(data).ok()?;
        if let Some(a) = c["choices"][0]["token_ids"].as_array() {
            ids.extend(a.iter().filter_map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok())));
        }
    }
    done.then_some(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done() -> Value {
        json!({"id": "cmpl-1", "object": "text_completion", "model": "m",
               "choices": [{"index": 0, "text": "ab", "token_ids": [97, 98], "finish_reason": "length"}],
               "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})
    }

    #[test]
    fn a_stream_has_one_chunk_per_token_then_done() {
        let s = body(&done(), false);
        assert_eq!(s.matches("data: ").count(), 4, "{s}");
        assert!(s.ends_with("data: [DONE]\n\n"));
        assert_eq!(collect_text(&s).as_deref(), Some("ab"));
        let c = body(&as_chat(done()), true);
        assert!(c.contains("\"role\":\"assistant\""), "{c}");
        assert!(c.contains("chat.completion.chunk"));
        assert_eq!(collect_text(&c).as_deref(), Some("ab"));
        assert_eq!(collect_token_ids(&c), Some(vec![97, 98]));
    }

    #[test]
    fn chat_form_moves_the_text_into_the_message() {
        let c = as_chat(done());
        assert_eq!(c["choices"][0]["message"]["content"], "ab");
        assert_eq!(c["object"], "chat.completion");
        assert_eq!(collect_text("data: {}\n\n"), None, "no [DONE]");
    }
}
