//! `--first-token prefill`: a streamed completion starts with prefill's token, sent to the
//! client the moment prefill answers; decode continues after it.
//!
//! In vLLM's P/D protocol (`--first-token decode`, the default) prefill computes the prompt
//! and samples a token the proxy drops; decode loads the prompt's KV, computes the prompt's
//! last token again and samples the first token the client sees. The time to first token is
//! prefill's round trip plus a decode step. Here prefill is also asked for the prompt's and
//! its token's ids (vLLM's `return_token_ids`); its token goes to the client at once, and
//! decode gets the prompt's ids with that token after them, `max_tokens` one fewer, and
//! prefill's transfer params: it loads the KV of every prompt token and computes only the new
//! one. The time to first token is prefill's round trip.
//!
//! What the client sees is what a monolithic server streams: decode's usage counts prefill's
//! token as a prompt token, so it is moved back to the completion tokens; decode's prompt ids
//! (when asked for) include it, so they are left out, the client's going with the first chunk.
//! A request for one token is prefill's alone: it asks prefill to keep no KV.
//!
//! Only requests whose output this cannot change take this path ([`plan`]); the others go
//! vLLM's two-request way, counted by why (`kvconnect_proxy_first_token_total`):
//! - `chat`: a chat completion (its output options, tools and reasoning among them, work on
//!   the whole message, and decode would continue it from token ids);
//! - `not_streamed`: nothing to send early;
//! - `prompts`: several prompts in one request;
//! - `parameters`: a parameter outside [`KEYS`] with an effect: a `seed` (the seeded sampler
//!   would start over at decode), stop strings (one may span prefill's token and decode's),
//!   presence or frequency penalties (decode would not count prefill's token as output),
//!   `min_tokens`, `logprobs`, `echo`, `n` above 1, structured outputs, ...;
//! - `no_token_ids`: prefill answered without token ids (not a vLLM that returns them); its
//!   KV goes to decode the two-request way;
//! - `params`: prefill's transfer params do not say that it holds the whole prompt
//!   (`remote_num_tokens`: KvconnectConnector's do; vLLM's NixlConnector's do not, and its
//!   decode loads every token of its prompt, one more than prefill holds).
//!
//! If prefill's token ends the completion (an end-of-sequence or stop token), the client's
//! stream ends with it; decode is still sent the prompt in the background, for one token
//! whose answer is dropped, so that prefill's blocks are read and freed at once, not held
//! until their lease ends ([`release`]).

use crate::{
    forward, open_decode, prefill, sse_event, sse_response, sse_response_then, DecodeOpen, Hop, Proxy,
};
use axum::body::Bytes;
use axum::response::Response;
use kvconnect_api::Role;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

/// Which server's token a streamed completion starts with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum FirstToken {
    /// vLLM's P/D protocol: decode's, after it loaded the prompt's KV.
    #[default]
    Decode,
    /// Prefill's, sent as soon as prefill answers; decode continues after it.
    Prefill,
}

/// The parameters a completion may carry, whatever their values, and take its first token
/// from prefill: they act on each token alone, on the prompt, or on the request as a whole.
pub const KEYS: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "add_special_tokens",
    "return_token_ids",
    "cache_salt",
    "priority",
    "user",
];

/// vLLM's default `max_tokens` for a completion.
const DEFAULT_MAX_TOKENS: u64 = 16;

/// Whether a parameter outside [`KEYS`] is at its no-effect value.
fn neutral(key: &str, v: &Value) -> bool {
    v.is_null()
        || match key {
            "n" | "best_of" => v.as_u64() == Some(1),
            "min_tokens" => v.as_u64() == Some(0),
            "presence_penalty" | "frequency_penalty" => v.as_f64() == Some(0.0),
            "echo" => v == &Value::Bool(false),
            "stop" => v.as_str() == Some("") || v.as_array().is_some_and(Vec::is_empty),
            _ => false,
        }
}

/// One prompt: a string, token ids, or a list holding one of either.
fn one_prompt(v: Option<&Value>) -> bool {
    let ids = |a: &Vec<Value>| !a.is_empty() && a.iter().all(Value::is_u64);
    match v {
        Some(Value::String(_)) => true,
        Some(Value::Array(a)) if ids(a) => true,
        Some(Value::Array(a)) if a.len() == 1 => a[0].is_string() || a[0].as_array().is_some_and(ids),
        _ => false,
    }
}

/// The `max_tokens` decode gets when a completion takes its first token from prefill (0:
/// prefill's token is the whole answer), or why it goes the two-request way (a label of
/// `kvconnect_proxy_first_token_total`).
pub fn plan(body: &Map<String, Value>, chat: bool) -> Result<u64, &'static str> {
    if chat {
        return Err("chat");
    }
    if body.get("stream") != Some(&Value::Bool(true)) {
        return Err("not_streamed");
    }
    if !one_prompt(body.get("prompt")) {
        return Err("prompts");
    }
    if body.iter().any(|(k, v)| !KEYS.contains(&k.as_str()) && !neutral(k, v)) {
        return Err("parameters");
    }
    let max = match body.get("max_tokens") {
        None | Some(Value::Null) => DEFAULT_MAX_TOKENS,
        // Anything else (0, negative, not a number) is the server's to refuse.
        Some(v) => v.as_u64().filter(|m| *m > 0).ok_or("parameters")?,
    };
    Ok(max - 1)
}

/// Prefill's token, as its answer gave it.
struct First {
    prompt_ids: Vec<Value>,
    token: Value,
    text: Value,
    finish: Value,
    stop_reason: Value,
}

impl First {
    /// Prefill's token from its answer (asked with `return_token_ids`); None if the answer
    /// carries no ids.
    fn of(answer: &Value) -> Option<First> {
        let c = &answer["choices"][0];
        let prompt_ids = c["prompt_token_ids"].as_array().filter(|a| !a.is_empty())?.clone();
        let token = c["token_ids"].as_array().filter(|a| a.len() == 1)?[0].clone();
        Some(First {
            prompt_ids,
            token,
            text: c["text"].clone(),
            finish: c["finish_reason"].clone(),
            stop_reason: c["stop_reason"].clone(),
        })
    }
}

/// Whether the client asked for token ids, usage at the end, and usage on every chunk.
struct Asked {
    ids: bool,
    usage: bool,
    continuous_usage: bool,
}

impl Asked {
    fn of(body: &Map<String, Value>) -> Asked {
        let opts = body.get("stream_options");
        let on = |k: &str| opts.is_some_and(|o| o[k] == Value::Bool(true));
        Asked {
            ids: body.get("return_token_ids") == Some(&Value::Bool(true)),
            usage: on("include_usage"),
            continuous_usage: on("continuous_usage_stats"),
        }
    }
}

/// The chunk of prefill's token, as vLLM streams a completion's chunk.
fn first_chunk(answer: &Value, f: &First, ends: bool, asked: &Asked) -> Value {
    let mut choice = json!({"index": 0, "text": f.text, "logprobs": null,
        "finish_reason": if ends { f.finish.clone() } else { Value::Null },
        "stop_reason": if ends { f.stop_reason.clone() } else { Value::Null }});
    if asked.ids {
        choice["prompt_token_ids"] = Value::Array(f.prompt_ids.clone());
        choice["token_ids"] = json!([f.token]);
    }
    let mut chunk = json!({"id": answer["id"], "object": "text_completion", "created": answer["created"],
        "model": answer["model"], "choices": [choice]});
    if asked.continuous_usage {
        chunk["usage"] = answer["usage"].clone();
    }
    chunk
}

/// Rewrites one of decode's chunks to what the client sees when the first token was
/// prefill's; whether anything changed.
pub(crate) fn as_client_sees(v: &mut Value) -> bool {
    let mut changed = false;
    if let Some(u) = v.get_mut("usage").and_then(Value::as_object_mut) {
        if let (Some(p), Some(c)) = (
            u.get("prompt_tokens").and_then(Value::as_u64),
            u.get("completion_tokens").and_then(Value::as_u64),
        ) {
            u.insert("prompt_tokens".into(), json!(p.saturating_sub(1)));
            u.insert("completion_tokens".into(), json!(c + 1));
            changed = true;
        }
    }
    for c in v.get_mut("choices").and_then(Value::as_array_mut).into_iter().flatten() {
        if c.get("prompt_token_ids").is_some_and(|p| !p.is_null()) {
            c["prompt_token_ids"] = Value::Null;
            changed = true;
        }
    }
    changed
}

/// An error event in a stream already started, as vLLM sends one.
fn error_event(status: u16, message: String) -> Bytes {
    sse_event(&json!({"error": {"message": message, "type": "service_unavailable", "code": status}}))
}

const DONE: &[u8] = b"data: [DONE]\n\n";

/// Serves one streamed completion whose first token is prefill's; `rest`: decode's
/// `max_tokens` ([`plan`]).
pub(crate) async fn serve(
    p: &Arc<Proxy>,
    path: &str,
    body: Map<String, Value>,
    t0: Instant,
    auth: Option<String>,
    rest: u64,
) -> Response {
    let asked = Asked::of(&body);
    let ask = crate::PrefillAsk { token_ids: true, remote_decode: rest > 0 };
    let mut pf = match prefill(p, path, body, t0, auth, ask).await {
        Ok(pf) => pf,
        Err(r) => return r,
    };
    let first = First::of(&pf.answer);
    // Decode can continue after prefill's token only if its connector loads as many tokens
    // as prefill's params say prefill holds (`remote_num_tokens`, kvconnect's params): vLLM's
    // NixlConnector would load every token of decode's prompt, one more than prefill holds.
    let held = pf.answer["kv_transfer_params"]["remote_num_tokens"].as_u64();
    const NO_IDS: (&str, &str) =
        ("no_token_ids", "prefill answered without prompt_token_ids and token_ids (vLLM's return_token_ids)");
    let why = match &first {
        None => Some(NO_IDS),
        Some(f) if rest > 0 && f.finish == json!("length") && held != Some(f.prompt_ids.len() as u64) => Some((
            "params",
            "prefill's kv_transfer_params do not say that it holds the whole prompt (remote_num_tokens, as \
                KvconnectConnector's do), so decode's connector could not be trusted to continue after \
                prefill's token",
        )),
        _ => None,
    };
    let (Some(first), None) = (first, why) else {
        let (reason, message) = why.unwrap_or(NO_IDS);
        // Once per reason and proxy; the metric counts every request.
        static WARNED: [std::sync::Once; 2] = [std::sync::Once::new(), std::sync::Once::new()];
        WARNED[usize::from(reason != NO_IDS.0)].call_once(|| {
            tracing::warn!(
                prefill = %pf.pw,
                "{message}: such requests get decode's first token, the two-request way (counted in \
                    kvconnect_proxy_first_token_total{{reason=\"{reason}\"}}); run the proxy with \
                    --first-token decode in front of these servers"
            )
        });
        p.metrics.first_token_from_decode(reason);
        return match crate::decode_stream(p, path, pf, t0).await {
            Ok(events) => sse_response(events),
            Err(r) => r,
        };
    };
    p.metrics.first_token_from_prefill();
    let ends = rest == 0 || first.finish != json!("length");
    let (out, events) = mpsc::channel::<Bytes>(64);
    // A fresh channel has room: this cannot fail for want of it.
    let _ = out.try_send(sse_event(&first_chunk(&pf.answer, &first, ends, &asked)));
    let sent = t0.elapsed();
    if ends {
        if asked.usage && !asked.continuous_usage {
            let usage = json!({"id": pf.answer["id"], "object": "text_completion",
                "created": pf.answer["created"], "model": pf.answer["model"], "choices": [],
                "usage": pf.answer["usage"]});
            let _ = out.try_send(sse_event(&usage));
        }
        let _ = out.try_send(Bytes::from_static(DONE));
        p.metrics.served(&pf.pw, None, sent, t0.elapsed(), 1);
        if rest > 0 {
            release(p, path, pf, first.prompt_ids);
        }
        return sse_response(events);
    }
    let dw = match p.backends.pick(Role::Decode, &[]) {
        Ok(dw) => dw,
        Err(e) => {
            p.metrics.error();
            let _ = out.try_send(error_event(503, format!("decode worker unavailable: {e}")));
            let _ = out.try_send(Bytes::from_static(DONE));
            return sse_response(events);
        }
    };
    let mut prompt = first.prompt_ids;
    prompt.push(first.token);
    pf.dec.insert("prompt".into(), Value::Array(prompt));
    pf.dec.insert("max_tokens".into(), json!(rest));
    pf.dec.insert("stream".into(), json!(true));
    let prefill = pf.answer["kvconnect"].clone();
    let hop = Hop { pw: pf.pw, dw, prefill, t0, prefill_done: pf.done, first_sent: Some(sent) };
    let (p, path, dec, headers) = (p.clone(), path.to_owned(), Value::Object(pf.dec), pf.headers);
    // Decode's request waits until the client's connection has taken the first chunk: sent
    // at once, decode's work (and prefill's steps while it holds the blocks) could take the
    // cores of a busy machine from the write that brings the client its first token. If the
    // client is gone first, decode is still asked, so that it reads prefill's blocks and they
    // are freed.
    let (taken, first_taken) = oneshot::channel();
    tokio::spawn(async move {
        let _ = first_taken.await;
        match open_decode(&p, &path, &dec, &headers, &hop.dw).await {
            Ok(ds) => forward(p, ds, Some(out), hop).await,
            Err(e) => {
                p.metrics.error();
                let ev = match e {
                    DecodeOpen::Unreachable(e) => error_event(503, format!("decode worker unavailable: {e}")),
                    DecodeOpen::Refused(status, v) => match v.get("error") {
                        Some(err) => sse_event(&json!({"error": err})),
                        None => error_event(status, format!("decode worker answered {status}: {v}")),
                    },
                };
                let _ = out.send(ev).await;
                let _ = out.send(Bytes::from_static(DONE)).await;
            }
        }
    });
    sse_response_then(events, taken)
}

/// Prefill kept the prompt's KV for a decode, but its token ended the completion: decode is
/// still sent the prompt, in the background, for one token whose answer is dropped, so that
/// it reads prefill's blocks and prefill frees them now rather than when their lease ends
/// (vLLM's protocol would have sent decode the request too).
fn release(p: &Arc<Proxy>, path: &str, mut pf: crate::Prefilled, prompt_ids: Vec<Value>) {
    pf.dec.insert("prompt".into(), Value::Array(prompt_ids));
    pf.dec.insert("max_tokens".into(), json!(1));
    pf.dec.insert("stream".into(), json!(false));
    pf.dec.remove("stream_options");
    let (p, path) = (p.clone(), path.to_owned());
    tokio::spawn(async move {
        let headers = crate::borrowed(&pf.headers);
        let body = Value::Object(pf.dec);
        match p.send(Role::Decode, "POST", &path, Some(&body), &headers).await {
            Ok((_, r)) if r.status == 200 => {}
            Ok((dw, r)) => tracing::warn!(
                decode = %dw,
                "decode refused the request that would free prefill's blocks (HTTP {}): prefill frees them \
                    when their lease ends: {}",
                r.status,
                r.body.chars().take(300).collect::<String>()
            ),
            Err(_) => tracing::warn!(
                "no decode server could be reached to free prefill's blocks; prefill frees them when their \
                    lease ends"
            ),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn only_a_streamed_completion_whose_output_cannot_change_takes_prefills_token() {
        let ok = json!({"model": "m", "prompt": "Hello", "stream": true, "max_tokens": 8, "temperature": 0.7,
            "stream_options": {"include_usage": true}, "n": 1, "stop": [], "seed": null});
        assert_eq!(plan(&body(ok.clone()), false), Ok(7));
        let mut default_max = body(ok.clone());
        default_max.remove("max_tokens");
        assert_eq!(plan(&default_max, false), Ok(15));
        for prompt in [json!([1, 2, 3]), json!(["Hello"]), json!([[1, 2]])] {
            let mut b = body(ok.clone());
            b.insert("prompt".into(), prompt.clone());
            assert_eq!(plan(&b, false), Ok(7), "{prompt}");
        }
        let mut one = body(ok.clone());
        one.insert("max_tokens".into(), json!(1));
        assert_eq!(plan(&one, false), Ok(0), "one token: prefill's alone");

        assert_eq!(plan(&body(ok.clone()), true), Err("chat"));
        let mut b = body(ok.clone());
        b.insert("stream".into(), json!(false));
        assert_eq!(plan(&b, false), Err("not_streamed"));
        for prompt in [json!(["a", "b"]), json!([[1], [2]]), json!([]), json!(7), Value::Null] {
            let mut b = body(ok.clone());
            b.insert("prompt".into(), prompt.clone());
            assert_eq!(plan(&b, false), Err("prompts"), "{prompt}");
        }
        for (k, v) in [
            ("seed", json!(1)),
            ("stop", json!(["\n"])),
            ("stop", json!("x")),
            ("presence_penalty", json!(0.5)),
            ("frequency_penalty", json!(-0.1)),
            ("min_tokens", json!(2)),
            ("logprobs", json!(1)),
            ("echo", json!(true)),
            ("n", json!(2)),
            ("best_of", json!(3)),
            ("structured_outputs", json!({"regex": "a+"})),
            ("response_format", json!({"type": "json_object"})),
            ("bad_words", json!(["x"])),
            ("kv_transfer_params", json!({"do_remote_decode": true})),
            ("max_tokens", json!(0)),
            ("max_tokens", json!(-1)),
            ("max_tokens", json!("8")),
        ] {
            let mut b = body(ok.clone());
            b.insert(k.into(), v.clone());
            assert_eq!(plan(&b, false), Err("parameters"), "{k}: {v}");
        }
    }

    #[test]
    fn decodes_chunks_count_prefills_token_as_the_clients_output() {
        let mut usage = json!({"id": "cmpl-1", "choices": [],
            "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}});
        assert!(as_client_sees(&mut usage));
        assert_eq!(usage["usage"], json!({"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}));
        let mut first = json!({"choices": [{"index": 0, "text": " b", "prompt_token_ids": [1, 2, 3],
            "token_ids": [4]}]});
        assert!(as_client_sees(&mut first));
        assert_eq!(first["choices"][0]["prompt_token_ids"], Value::Null);
        assert_eq!(first["choices"][0]["token_ids"], json!([4]));
        let mut plain = json!({"choices": [{"index": 0, "text": " c", "prompt_token_ids": null}]});
        assert!(!as_client_sees(&mut plain));
    }

    #[test]
    fn prefills_token_is_streamed_as_vllm_streams_a_chunk() {
        let answer = json!({"id": "cmpl-7", "object": "text_completion", "created": 5, "model": "tiny",
            "choices": [{"index": 0, "text": " hi", "finish_reason": "length", "stop_reason": null,
                "prompt_token_ids": [1, 2], "token_ids": [9]}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}});
        let f = First::of(&answer).unwrap();
        let plain = Asked { ids: false, usage: true, continuous_usage: false };
        let c = first_chunk(&answer, &f, false, &plain);
        assert_eq!(c["id"], "cmpl-7");
        assert_eq!(c["choices"][0]["text"], " hi");
        assert_eq!(c["choices"][0]["finish_reason"], Value::Null, "decode goes on");
        assert!(c["choices"][0].get("token_ids").is_none() && c.get("usage").is_none(), "{c}");
        let all = Asked { ids: true, usage: true, continuous_usage: true };
        let c = first_chunk(&answer, &f, true, &all);
        assert_eq!(c["choices"][0]["finish_reason"], "length");
        assert_eq!(c["choices"][0]["prompt_token_ids"], json!([1, 2]));
        assert_eq!(c["choices"][0]["token_ids"], json!([9]));
        assert_eq!(c["usage"]["completion_tokens"], 1);
        let mut no_ids = answer.clone();
        no_ids["choices"][0]["prompt_token_ids"] = Value::Null;
        assert!(First::of(&no_ids).is_none());
    }

    /// Scripted servers: a prefill answering as vLLM does with `return_token_ids` (or without
    /// ids, `ids` false), and a decode streaming two chunks and the usage; each keeps the
    /// bodies it got.
    mod servers {
        use axum::extract::State;
        use axum::routing::post;
        use serde_json::{json, Value};
        use std::sync::{Arc, Mutex};

        pub type Got = Arc<Mutex<Vec<Value>>>;

        pub async fn start(app: axum::Router) -> String {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap().to_string();
            tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
            addr
        }

        /// A server answering `/v1/completions` with `f` of each body, which it keeps.
        async fn recording<R: axum::response::IntoResponse>(
            f: impl Fn(Value) -> R + Clone + Send + Sync + 'static,
        ) -> (String, Got) {
            let got = Got::default();
            let handler = move |State(g): State<Got>, axum::Json(b): axum::Json<Value>| {
                let f = f.clone();
                async move {
                    g.lock().unwrap().push(b.clone());
                    f(b)
                }
            };
            let app = axum::Router::new().route("/v1/completions", post(handler)).with_state(got.clone());
            (start(app).await, got)
        }

        /// `held`: the tokens prefill's params say it holds (3: the whole prompt).
        pub async fn prefill(ids: bool, finish: &'static str, held: Option<u64>) -> (String, Got) {
            recording(move |_| {
                let mut c = json!({"index": 0, "text": " A", "finish_reason": finish, "stop_reason": null});
                if ids {
                    c["prompt_token_ids"] = json!([5, 6, 7]);
                    c["token_ids"] = json!([40]);
                }
                axum::Json(json!({"id": "cmpl-r", "object": "text_completion", "created": 1,
                    "model": "tiny", "choices": [c],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                    "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "p0",
                        "remote_num_tokens": held}}))
            })
            .await
        }

        pub async fn decode(status: u16) -> (String, Got) {
            recording(move |b| {
                if status != 200 {
                    let e = json!({"error": {"message": "max_tokens is too large", "code": 400}});
                    return (axum::http::StatusCode::BAD_REQUEST, e.to_string());
                }
                let n = b["prompt"].as_array().map_or(0, Vec::len);
                let chunks = [
                    json!({"id": "cmpl-r", "choices": [{"index": 0, "text": " B",
                        "prompt_token_ids": b["prompt"], "token_ids": [41]}]}),
                    json!({"id": "cmpl-r", "choices": [{"index": 0, "text": " C", "token_ids": [42],
                        "finish_reason": "length"}]}),
                    json!({"id": "cmpl-r", "choices": [],
                        "usage": {"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2}}),
                ];
                let mut sse: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
                sse.push_str("data: [DONE]\n\n");
                (axum::http::StatusCode::OK, sse)
            })
            .await
        }
    }

    async fn proxy_of(prefill: &str, decode: &str) -> Arc<Proxy> {
        let b = crate::backends::Backends::new([
            (Role::Prefill, "prefill-0".to_owned(), prefill.to_owned()),
            (Role::Decode, "decode-0".to_owned(), decode.to_owned()),
        ]);
        let mut p = Proxy::new(Arc::new(b), std::time::Duration::from_secs(10));
        p.verbatim = true;
        p.first_token = FirstToken::Prefill;
        Arc::new(p)
    }

    /// The client's events (the `data: ` payloads) of one streamed completion.
    async fn events(p: &Arc<Proxy>, body: Value) -> Vec<String> {
        let r = crate::disaggregated(p, body.to_string().as_bytes(), false, None).await;
        assert_eq!(r.status(), 200);
        let b = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        let text = String::from_utf8(b.to_vec()).unwrap();
        text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_owned).collect()
    }

    fn json_of(e: &str) -> Value {
        serde_json::from_str(e).unwrap()
    }

    fn closed_port() -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    }

    const ASK: &str = r#"{"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": true,
        "return_token_ids": true, "stream_options": {"include_usage": true}}"#;

    #[tokio::test]
    async fn prefills_token_goes_first_and_decode_continues_from_it() {
        let ((pa, pgot), (da, dgot)) =
            (servers::prefill(true, "length", Some(3)).await, servers::decode(200).await);
        let p = proxy_of(&pa, &da).await;
        let ev = events(&p, json_of(ASK)).await;
        assert_eq!(ev.len(), 5, "{ev:?}");
        let first = json_of(&ev[0]);
        assert_eq!(first["choices"][0]["token_ids"], json!([40]));
        assert_eq!(first["choices"][0]["prompt_token_ids"], json!([5, 6, 7]));
        assert_eq!(
            json_of(&ev[1])["choices"][0]["prompt_token_ids"],
            Value::Null,
            "decode's prompt is not the client's"
        );
        let usage = json_of(&ev[3]);
        assert_eq!(usage["usage"], json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}));
        assert_eq!(usage["kvconnect"]["proxy"]["first_token"], "prefill");
        assert_eq!(ev[4], "[DONE]");
        let pre = pgot.lock().unwrap()[0].clone();
        assert_eq!((pre["return_token_ids"].clone(), pre["max_tokens"].clone()), (json!(true), json!(1)));
        assert_eq!(pre["kv_transfer_params"]["do_remote_decode"], true);
        let dec = dgot.lock().unwrap()[0].clone();
        assert_eq!(dec["prompt"], json!([5, 6, 7, 40]));
        assert_eq!((dec["max_tokens"].clone(), dec["stream"].clone()), (json!(2), json!(true)));
        assert_eq!(dec["kv_transfer_params"]["remote_engine_id"], "p0");
        let m = p.metrics.render();
        assert!(m.contains("kvconnect_proxy_first_token_total{from=\"prefill\"} 1\n"), "{m}");
        assert!(m.contains("kvconnect_proxy_requests_total 1\n"), "{m}");
    }

    /// Decode is asked only once the client's connection has taken the first chunk: while
    /// the response's body lies unread, decode gets nothing; once its first chunk is taken,
    /// decode gets the request and the rest of the stream follows.
    #[tokio::test]
    async fn decode_is_asked_only_once_the_first_chunk_is_taken() {
        use http_body_util::BodyExt;
        let ((pa, _), (da, dgot)) =
            (servers::prefill(true, "length", Some(3)).await, servers::decode(200).await);
        let p = proxy_of(&pa, &da).await;
        let r = crate::disaggregated(&p, ASK.as_bytes(), false, None).await;
        assert_eq!(r.status(), 200);
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(dgot.lock().unwrap().is_empty(), "decode was asked before the client took its first chunk");
        let mut body = r.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert!(first.starts_with(b"data: {"), "{first:?}");
        let t = Instant::now();
        while dgot.lock().unwrap().is_empty() {
            assert!(t.elapsed().as_secs() < 10, "decode was never asked after the first chunk was taken");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let rest = body.collect().await.unwrap().to_bytes();
        assert!(rest.ends_with(b"data: [DONE]\n\n"), "{rest:?}");
        assert_eq!(dgot.lock().unwrap()[0]["prompt"], json!([5, 6, 7, 40]));
    }

    #[tokio::test]
    async fn a_token_that_ends_the_completion_frees_prefills_kv_and_a_one_token_request_keeps_none() {
        let ((pa, pgot), (da, dgot)) =
            (servers::prefill(true, "stop", Some(3)).await, servers::decode(200).await);
        let p = proxy_of(&pa, &da).await;
        let ev = events(&p, json_of(ASK)).await;
        assert_eq!(json_of(&ev[0])["choices"][0]["finish_reason"], "stop");
        assert_eq!(json_of(&ev[1])["usage"]["completion_tokens"], 1);
        assert_eq!(ev[2], "[DONE]");
        // Decode is still asked, in the background, so prefill's blocks are read and freed.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while dgot.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let release =
            dgot.lock().unwrap().first().cloned().expect("decode is sent the prompt to free prefill's KV");
        assert_eq!((release["prompt"].clone(), release["max_tokens"].clone()), (json!([5, 6, 7]), json!(1)));
        assert_eq!(release["stream"], false);
        assert_eq!(release["kv_transfer_params"]["remote_engine_id"], "p0");
        let mut one = json_of(ASK);
        one["max_tokens"] = json!(1);
        let ev = events(&p, one).await;
        assert_eq!(json_of(&ev[0])["choices"][0]["finish_reason"], "stop");
        assert!(
            pgot.lock().unwrap()[1].get("kv_transfer_params").is_none(),
            "one token: no KV kept for decode"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(dgot.lock().unwrap().len(), 1, "one token: nothing kept for decode to free");
    }

    #[tokio::test]
    async fn a_decode_that_is_gone_or_refuses_after_the_first_token_ends_the_stream_with_an_error() {
        let (pa, _) = servers::prefill(true, "length", Some(3)).await;
        let p = proxy_of(&pa, &closed_port()).await;
        let ev = events(&p, json_of(ASK)).await;
        assert_eq!(json_of(&ev[0])["choices"][0]["token_ids"], json!([40]));
        let e = json_of(&ev[1]);
        assert!(e["error"]["message"].as_str().unwrap().contains("decode worker unavailable"), "{e}");
        assert_eq!(ev[2], "[DONE]");
        assert!(p.metrics.render().contains("kvconnect_proxy_requests_failed_total 1\n"));

        let (da, _) = servers::decode(400).await;
        let p = proxy_of(&pa, &da).await;
        let ev = events(&p, json_of(ASK)).await;
        assert_eq!(json_of(&ev[1])["error"]["message"], "max_tokens is too large", "{ev:?}");
        assert_eq!(ev[2], "[DONE]");
    }

    #[tokio::test]
    async fn a_prefill_without_token_ids_is_served_the_two_request_way() {
        let ((pa, _), (da, dgot)) =
            (servers::prefill(false, "length", Some(3)).await, servers::decode(200).await);
        let p = proxy_of(&pa, &da).await;
        let ev = events(&p, json_of(ASK)).await;
        assert_eq!(json_of(&ev[0])["choices"][0]["token_ids"], json!([41]), "decode's first token: {ev:?}");
        let dec = dgot.lock().unwrap()[0].clone();
        assert_eq!((dec["prompt"].clone(), dec["max_tokens"].clone()), (json!("hi"), json!(3)));
        let m = p.metrics.render();
        assert!(
            m.contains("kvconnect_proxy_first_token_total{from=\"decode\",reason=\"no_token_ids\"} 1\n"),
            "{m}"
        );

        // Params that do not say prefill holds the whole prompt (vLLM's NixlConnector's say
        // nothing of it): decode's connector might load more of its prompt than prefill holds.
        for held in [None, Some(2)] {
            let ((pa, _), (da, dgot)) =
                (servers::prefill(true, "length", held).await, servers::decode(200).await);
            let p = proxy_of(&pa, &da).await;
            let ev = events(&p, json_of(ASK)).await;
            assert_eq!(json_of(&ev[0])["choices"][0]["token_ids"], json!([41]), "{held:?}: {ev:?}");
            assert_eq!(dgot.lock().unwrap()[0]["prompt"], json!("hi"));
            let m = p.metrics.render();
            assert!(
                m.contains("kvconnect_proxy_first_token_total{from=\"decode\",reason=\"params\"} 1\n"),
                "{m}"
            );
        }
    }
}
