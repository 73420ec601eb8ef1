//! A request's prompt token ids for `--routing kv` where the servers tokenize for themselves
//! (`kvconnect proxy` in front of vLLM, which passes bodies on verbatim): the router hashes
//! token ids, as the servers' KV events carry them.
//!
//! A completion whose `prompt` is token ids (one list, or a list holding one) gives them
//! itself. Any other prompt, text or a chat's messages, is tokenized by a prefill server's
//! `/tokenize` (vLLM's), with the request's own tokenization parameters, so the ids are
//! the ones that server then computes: its tokenizer, its chat template, its special tokens.
//! That costs one round trip to the server's API process (not its engine) per request
//! routed by KV.

use serde_json::{Map, Value};

/// What a completion's tokens depend on, as vLLM's `/tokenize` takes them.
const COMPLETION_KEYS: &[&str] = &["model", "add_special_tokens"];

/// What a chat completion's tokens depend on (the messages, and how the server's chat
/// template renders them), as vLLM's `/tokenize` takes them.
const CHAT_KEYS: &[&str] = &[
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
    "mm_processor_kwargs",
];

/// The path of the servers' tokenizer.
pub const PATH: &str = "/tokenize";

/// Token ids out of a JSON list (None where any item is not one).
fn ids(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
}

/// The prompt's token ids where the completion gives them itself: `prompt` as one list of
/// ids, or a list holding one such list.
pub fn given(body: &Map<String, Value>) -> Option<Vec<u32>> {
    let prompt = body.get("prompt")?.as_array()?;
    match prompt.first() {
        Some(Value::Array(_)) if prompt.len() == 1 => ids(&prompt[0]).filter(|t| !t.is_empty()),
        Some(Value::Number(_)) => ids(&Value::Array(prompt.clone())),
        _ => None,
    }
}

/// The body of the `/tokenize` request that gives the token ids of `body`'s prompt (a chat
/// completion's messages where `chat`), or None where it has not exactly one prompt to
/// tokenize (several prompts, none, or ids already: see [`given`]).
pub fn request(body: &Map<String, Value>, chat: bool) -> Option<Value> {
    let mut out = Map::new();
    let keep = if chat { CHAT_KEYS } else { COMPLETION_KEYS };
    for k in keep {
        if let Some(v) = body.get(*k) {
            out.insert((*k).to_owned(), v.clone());
        }
    }
    if chat {
        body.get("messages")?.as_array()?;
    } else {
        let text = match body.get("prompt")? {
            Value::String(s) => s.clone(),
            Value::Array(a) if a.len() == 1 => a[0].as_str()?.to_owned(),
            _ => return None,
        };
        out.insert("prompt".into(), Value::String(text));
    }
    Some(Value::Object(out))
}

/// The token ids of a `/tokenize` answer (vLLM's `{"tokens": [...], "count": ...}`).
pub fn answer(v: &Value) -> Option<Vec<u32>> {
    ids(v.get("tokens")?)
}

/// The prompt tokens a vLLM server reports it did not compute for a request: its prefix
/// cache's and its KV connector's (`usage.prompt_tokens_details.cached_tokens`, which vLLM
/// reports when started with `--enable-prompt-tokens-details`).
pub fn cached_tokens(answer: &Value) -> Option<u64> {
    answer.pointer("/usage/prompt_tokens_details/cached_tokens")?.as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn ids_in_the_body_are_taken_as_they_are() {
        assert_eq!(given(&obj(json!({"prompt": [5, 6, 7]}))), Some(vec![5, 6, 7]));
        assert_eq!(given(&obj(json!({"prompt": [[5, 6]]}))), Some(vec![5, 6]));
        for other in [
            json!({"prompt": "text"}),
            json!({"prompt": [[1], [2]]}),
            json!({"prompt": [1, "x"]}),
            json!({"prompt": [-1]}),
            json!({"prompt": [5_000_000_000u64]}),
            json!({"prompt": [[]]}),
            json!({"messages": []}),
        ] {
            assert_eq!(given(&obj(other.clone())), None, "{other}");
        }
    }

    #[test]
    fn a_tokenize_request_carries_the_prompt_and_what_its_tokens_depend_on() {
        let c = obj(json!({"model": "m", "prompt": "hello", "max_tokens": 5, "add_special_tokens": false}));
        assert_eq!(
            request(&c, false),
            Some(json!({"model": "m", "prompt": "hello", "add_special_tokens": false}))
        );
        assert_eq!(request(&obj(json!({"prompt": ["one"]})), false), Some(json!({"prompt": "one"})));
        for none in [json!({"prompt": ["a", "b"]}), json!({"prompt": [1, 2]}), json!({"max_tokens": 1})] {
            assert_eq!(request(&obj(none.clone()), false), None, "{none}");
        }
        let chat = obj(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": false}, "stream": true
        }));
        assert_eq!(
            request(&chat, true),
            Some(json!({
                "model": "m", "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"enable_thinking": false}
            }))
        );
        assert_eq!(request(&obj(json!({"model": "m"})), true), None, "a chat without messages");
    }

    #[test]
    fn answers_give_token_ids_and_cached_tokens() {
        assert_eq!(answer(&json!({"tokens": [1, 2], "count": 2, "max_model_len": 8})), Some(vec![1, 2]));
        assert_eq!(answer(&json!({"error": "no"})), None);
        assert_eq!(answer(&json!({"tokens": ["a"]})), None);
        let usage = json!({"usage": {"prompt_tokens": 70, "prompt_tokens_details": {"cached_tokens": 64}}});
        assert_eq!(cached_tokens(&usage), Some(64));
        assert_eq!(cached_tokens(&json!({"usage": {"prompt_tokens": 70}})), None);
    }

    /// `kvconnect proxy --routing kv` in front of servers that tokenize for themselves: the
    /// prompt's ids from a prefill server's /tokenize, the pick by the events, the prediction
    /// against vLLM's `cached_tokens`.
    mod in_front_of_vllm {
        use super::*;
        use crate::backends::Backends;
        use crate::routing::KvRouter;
        use crate::Proxy;
        use axum::extract::State;
        use axum::routing::post;
        use kvconnect_api::Role;
        use kvconnect_router::{KvEvent, KvEventBatch, Medium};
        use std::sync::{Arc, Mutex};

        const BS: u32 = 4;
        /// What the servers' tokenizer makes of any prompt: two whole blocks and one token.
        const IDS: [u32; 9] = [11, 12, 13, 14, 15, 16, 17, 18, 19];

        /// A server's log: the paths it was asked, in order.
        type Asked = Arc<Mutex<Vec<String>>>;

        /// A vLLM-like server: /tokenize gives `IDS` (or fails, `tokenizes` false), a
        /// completion reports `cached` prompt tokens not computed.
        async fn server(tokenizes: bool, cached: u64) -> (String, Asked) {
            let asked = Asked::default();
            let tok = move |State(a): State<Asked>, axum::Json(b): axum::Json<Value>| async move {
                a.lock().unwrap().push(format!("/tokenize {}", b["prompt"]));
                if !tokenizes {
                    return (axum::http::StatusCode::NOT_FOUND, axum::Json(json!({"detail": "Not Found"})));
                }
                (axum::http::StatusCode::OK, axum::Json(json!({"tokens": IDS, "count": IDS.len()})))
            };
            let done = move |State(a): State<Asked>| async move {
                a.lock().unwrap().push("/v1/completions".into());
                axum::Json(json!({"id": "c", "object": "text_completion", "model": "tiny",
                    "choices": [{"index": 0, "text": " x", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": IDS.len(), "completion_tokens": 1, "total_tokens": 10,
                        "prompt_tokens_details": {"cached_tokens": cached}},
                    "kv_transfer_params": {"do_remote_prefill": true}}))
            };
            let app = axum::Router::new()
                .route(PATH, post(tok))
                .route("/v1/completions", post(done))
                .with_state(asked.clone());
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap().to_string();
            tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
            (addr, asked)
        }

        fn stored(tokens: &[u32]) -> KvEventBatch {
            let hashes = (0..tokens.len() as u64 / u64::from(BS)).map(|i| 700 + i).collect();
            let events = vec![KvEvent::stored(hashes, None, tokens.to_vec(), BS, Medium::Gpu)];
            KvEventBatch { ts: 0.0, events, data_parallel_rank: None }
        }

        async fn ask(p: &Arc<Proxy>, body: Value) {
            let r = crate::disaggregated(p, body.to_string().as_bytes(), false, None).await;
            assert_eq!(r.status(), 200);
        }

        /// `kvconnect proxy --routing kv` over two such prefill servers (`tokenizes`: whether
        /// they tokenize; the second reports 8 cached tokens) and a decode, with events (where
        /// `events`) saying that prefill-1 holds the prompt's two whole blocks and prefill-0
        /// something else.
        async fn proxy(tokenizes: bool, events: bool) -> (Arc<Proxy>, Asked, Asked) {
            let ((p0, a0), (p1, a1), (d, _)) =
                (server(tokenizes, 0).await, server(tokenizes, 8).await, server(true, 0).await);
            let names = vec!["prefill-0".to_owned(), "prefill-1".to_owned()];
            let b = Backends::new([
                (Role::Prefill, names[0].clone(), p0),
                (Role::Prefill, names[1].clone(), p1),
                (Role::Decode, "decode-0".to_owned(), d),
            ]);
            let mut p = Proxy::new(Arc::new(b), std::time::Duration::from_secs(10));
            p.verbatim = true;
            let kv = Arc::new(KvRouter::new(names, BS, p.metrics.router.clone()).unwrap());
            if events {
                kv.apply("prefill-1", 0, &stored(&IDS[..8]), false);
                kv.apply("prefill-0", 0, &stored(&[1, 2, 3, 4]), false);
            }
            p.kv = Some(kv);
            (Arc::new(p), a0, a1)
        }

        fn count(a: &Asked, what: &str) -> usize {
            a.lock().unwrap().iter().filter(|x| x.starts_with(what)).count()
        }

        #[tokio::test]
        async fn a_text_prompt_goes_to_the_server_holding_its_prefix() {
            let (p, a0, a1) = proxy(true, true).await;
            for _ in 0..3 {
                ask(&p, json!({"model": "tiny", "prompt": "some text", "max_tokens": 2})).await;
            }
            // Ids in the body are hashed as they are: no /tokenize.
            ask(&p, json!({"model": "tiny", "prompt": IDS, "max_tokens": 2})).await;
            let done = "/v1/completions";
            assert_eq!(
                (count(&a0, done), count(&a1, done)),
                (0, 4),
                "every prefill to the server holding it"
            );
            assert_eq!(count(&a0, PATH) + count(&a1, PATH), 3, "text prompts tokenized by a prefill server");
            assert!(a1.lock().unwrap().contains(&format!("{PATH} \"some text\"")));
            let m = p.metrics.render();
            assert!(m.contains("kvconnect_router_decisions_total{by=\"kv\"} 4\n"), "{m}");
            assert!(m.contains("kvconnect_router_predicted_hit_tokens_total 32\n"), "{m}");
            assert!(m.contains("kvconnect_router_predictions_total{outcome=\"exact\"} 4\n"), "{m}");
        }

        #[tokio::test]
        async fn without_a_tokenizer_it_routes_round_robin_and_says_why() {
            let (p, a0, a1) = proxy(false, true).await;
            for _ in 0..4 {
                ask(&p, json!({"model": "tiny", "prompt": "some text", "max_tokens": 2})).await;
            }
            let done = "/v1/completions";
            assert_eq!((count(&a0, done), count(&a1, done)), (2, 2), "round-robin");
            let m = p.metrics.render();
            let rr = "kvconnect_router_decisions_total{by=\"round_robin\",reason=\"no_tokens\"} 4\n";
            assert!(m.contains(rr), "{m}");
            assert!(m.contains("kvconnect_router_predicted_hit_tokens_total 0\n"), "{m}");
        }

        #[tokio::test]
        async fn without_events_no_prompt_is_tokenized() {
            let (p, a0, a1) = proxy(true, false).await;
            for _ in 0..2 {
                ask(&p, json!({"model": "tiny", "prompt": "some text", "max_tokens": 2})).await;
            }
            assert_eq!(count(&a0, PATH) + count(&a1, PATH), 0, "no round trip the router cannot use");
            let m = p.metrics.render();
            let rr = "kvconnect_router_decisions_total{by=\"round_robin\",reason=\"no_events\"} 2\n";
            assert!(m.contains(rr), "{m}");
        }
    }
}
