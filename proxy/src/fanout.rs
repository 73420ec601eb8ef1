//! Requests of several choices through the proxy: a list of prompts, or `n` above 1. Prefill
//! returns one set of `kv_transfer_params` per request, so each choice becomes a request of
//! its own (one prompt, `n` 1; choice `j` of a prompt gets `seed + j`, as a server seeds its
//! own choices), all run through prefill and decode at once; their answers are merged into
//! one with the choices in OpenAI's order (`index = prompt * n + j`). A streamed request
//! opens every choice's decode stream before answering (its status is then known), passes
//! token chunks on as they arrive under the choice's index, and closes the way a server's
//! stream closes.

use crate::{one, one_stream, sse_response, Proxy};
use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvconnect_openai::params::OpenAiRequest;
use serde_json::{json, Map, Value};
use std::future::Future;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// The request of each choice, in `index` order.
pub fn split(body: &Map<String, Value>, req: &OpenAiRequest) -> Vec<Map<String, Value>> {
    let prompts: Vec<Option<Value>> = match body.get("prompt") {
        Some(Value::Array(list)) if req.prompts.len() > 1 => list.iter().cloned().map(Some).collect(),
        other => vec![other.cloned()],
    };
    let mut out = Vec::with_capacity(req.choices());
    for prompt in &prompts {
        for j in 0..req.n {
            let mut b = body.clone();
            if let Some(p) = prompt {
                b.insert("prompt".into(), p.clone());
            }
            b.remove("n");
            b.remove("best_of");
            // Each choice's stream ends with its usage; the merged stream adds the total.
            b.remove("stream_options");
            if let Some(s) = req.seed {
                b.insert("seed".into(), json!(s.wrapping_add(j as u64) as i64));
            }
            out.push(b);
        }
    }
    out
}

/// `usage` summed over the choices' answers: each prompt's tokens once (choice `j == 0`),
/// every choice's completion tokens.
fn total_usage(usages: &[Value], n: usize) -> Value {
    let sum = |key: &str, every: usize| -> u64 {
        usages.iter().step_by(every.max(1)).map(|u| u[key].as_u64().unwrap_or(0)).sum()
    };
    let (prompt, completion) = (sum("prompt_tokens", n), sum("completion_tokens", 1));
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// The choices' answers (one choice each, in `index` order) as one answer under `id`.
pub fn merge(answers: &[Value], n: usize, id: &str) -> Value {
    let choices: Vec<Value> = answers
        .iter()
        .enumerate()
        .map(|(k, a)| {
            let mut c = a["choices"][0].clone();
            c["index"] = json!(k);
            c
        })
        .collect();
    let usages: Vec<Value> = answers.iter().map(|a| a["usage"].clone()).collect();
    let first = answers.first().cloned().unwrap_or(Value::Null);
    json!({
        "id": id, "object": first["object"], "created": first["created"], "model": first["model"],
        "choices": choices, "usage": total_usage(&usages, n), "kv_transfer_params": null,
        "kvconnect": {"choices": answers.iter().map(|a| a["kvconnect"].clone()).collect::<Vec<_>>()},
    })
}

/// The merged stream of the choices' streams: token chunks pass on as they arrive (under the
/// response's id and their choice's index); each choice's closing chunk is kept until every
/// choice has ended, then they go out in `index` order with the request's usage, as a server's
/// stream of several choices ends.
#[derive(Debug)]
pub struct Merge {
    id: String,
    created: u64,
    n: usize,
    include_usage: bool,
    object: Value,
    model: Value,
    finishes: Vec<Option<Value>>,
    usages: Vec<Value>,
    kvconnect: Vec<Value>,
    failed: bool,
}

impl Merge {
    /// A merge of `choices` streams of a request with `n` choices per prompt.
    pub fn new(id: String, created: u64, choices: usize, n: usize, include_usage: bool) -> Merge {
        Merge {
            id,
            created,
            n,
            include_usage,
            object: Value::Null,
            model: Value::Null,
            finishes: vec![None; choices],
            usages: vec![Value::Null; choices],
            kvconnect: vec![Value::Null; choices],
            failed: false,
        }
    }

    fn chunk(&self, choices: Vec<Value>) -> Value {
        let mut c = json!({
            "id": self.id, "object": self.object, "created": self.created, "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    /// One event of choice `k`'s stream; what to send on now, if anything.
    pub fn event(&mut self, k: usize, event: &str) -> Option<String> {
        let data = event.trim().strip_prefix("data: ")?;
        let Ok(v) = serde_json::from_str::<Value>(data) else { return None };
        if v.get("error").is_some() {
            self.failed = true;
            return Some(format!("data: {v}\n\n"));
        }
        if self.object.is_null() {
            (self.object, self.model) = (v["object"].clone(), v["model"].clone());
        }
        if v.get("usage").is_some_and(|u| !u.is_null()) && k < self.usages.len() {
            self.usages[k] = v["usage"].clone();
            self.kvconnect[k] = v["kvconnect"].clone();
        }
        let mut entries: Vec<Value> = v["choices"].as_array().cloned().unwrap_or_default();
        for e in &mut entries {
            e["index"] = json!(k);
        }
        if entries.iter().any(|e| !e["finish_reason"].is_null()) {
            if let Some(slot) = self.finishes.get_mut(k) {
                *slot = entries.pop();
            }
            return None;
        }
        (!entries.is_empty()).then(|| format!("data: {}\n\n", self.chunk(entries)))
    }

    /// The closing events once every stream has ended (nothing after an error event).
    pub fn close(&self) -> String {
        if self.failed {
            return String::new();
        }
        let tail = |mut c: Value| {
            c["usage"] = total_usage(&self.usages, self.n);
            c["kv_transfer_params"] = Value::Null;
            c["kvconnect"] = json!({"choices": self.kvconnect});
            c
        };
        let mut out = String::new();
        let last = self.finishes.len().saturating_sub(1);
        for (k, f) in self.finishes.iter().enumerate() {
            let entry = f.clone().unwrap_or_else(|| json!({"index": k, "finish_reason": null}));
            let mut c = self.chunk(vec![entry]);
            if !self.include_usage && k == last {
                c = tail(c);
            }
            out.push_str(&format!("data: {c}\n\n"));
        }
        if self.include_usage {
            out.push_str(&format!("data: {}\n\n", tail(self.chunk(Vec::new()))));
        }
        out.push_str("data: [DONE]\n\n");
        out
    }
}

/// Runs `run` on every choice's request at once; their results in order, or the first
/// refusal (the other choices run to their end on their own).
async fn all<T, Fut>(
    subs: Vec<Map<String, Value>>,
    run: impl Fn(Map<String, Value>) -> Fut,
) -> Result<Vec<T>, Response>
where
    T: Send + 'static,
    Fut: Future<Output = Result<T, Response>> + Send + 'static,
{
    let jobs: Vec<_> = subs.into_iter().map(|b| tokio::spawn(run(b))).collect();
    let mut out = Vec::with_capacity(jobs.len());
    for j in jobs {
        match j.await {
            Ok(r) => out.push(r?),
            Err(e) => return Err(task_failed(e)),
        }
    }
    Ok(out)
}

/// Serves a request of several choices (see the module's description).
pub async fn serve(
    p: &Arc<Proxy>,
    path: &str,
    body: Map<String, Value>,
    req: &OpenAiRequest,
    auth: Option<String>,
) -> Response {
    let t0 = Instant::now();
    let subs = split(&body, req);
    if !req.stream {
        let answers = all(subs, |b| {
            let (p, path, auth) = (p.clone(), path.to_owned(), auth.clone());
            async move { one(&p, &path, b, t0, auth).await }
        })
        .await;
        return match answers {
            Ok(answers) => {
                let id = answers.first().and_then(|a| a["id"].as_str()).unwrap_or("cmpl-pd").to_owned();
                Json(merge(&answers, req.n, &id)).into_response()
            }
            Err(r) => r,
        };
    }
    let streams = all(subs, |b| {
        let (p, path, auth) = (p.clone(), path.to_owned(), auth.clone());
        async move { one_stream(&p, &path, b, t0, auth).await }
    })
    .await;
    let streams = match streams {
        Ok(s) => s,
        Err(r) => return r,
    };
    let (merged_tx, mut merged) = mpsc::channel::<(usize, Bytes)>(64);
    for (k, mut s) in streams.into_iter().enumerate() {
        let tx = merged_tx.clone();
        tokio::spawn(async move {
            while let Some(ev) = s.recv().await {
                if tx.send((k, ev)).await.is_err() {
                    return;
                }
            }
        });
    }
    drop(merged_tx);
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let id = format!("cmpl-pd-{}", p.next_id());
    let mut m = Merge::new(id, created, req.choices(), req.n, req.include_usage);
    let (out, events) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        while let Some((k, ev)) = merged.recv().await {
            if let Some(e) = m.event(k, &String::from_utf8_lossy(&ev)) {
                if out.send(Bytes::from(e)).await.is_err() {
                    // The client left: dropping the merged channel stops the forwarding; each
                    // decode stream is still read to its end by its own task.
                    return;
                }
            }
        }
        let _ = out.send(Bytes::from(m.close())).await;
    });
    sse_response(events)
}

fn task_failed(e: tokio::task::JoinError) -> Response {
    kvconnect_openai::error::openai_error(
        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        format!("a choice's task failed: {e}"),
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_openai::params::parse;

    fn req(body: &Value) -> OpenAiRequest {
        parse(body.as_object().unwrap(), false).unwrap()
    }

    #[test]
    fn every_choice_is_a_request_of_one_prompt_with_its_seed() {
        let b = json!({"prompt": ["a", "b"], "n": 2, "seed": 7, "best_of": 2, "stream_options": null});
        let subs = split(b.as_object().unwrap(), &req(&b));
        let got: Vec<(Value, Value)> =
            subs.iter().map(|s| (s["prompt"].clone(), s["seed"].clone())).collect();
        assert_eq!(
            got,
            vec![
                (json!("a"), json!(7)),
                (json!("a"), json!(8)),
                (json!("b"), json!(7)),
                (json!("b"), json!(8))
            ]
        );
        assert!(subs.iter().all(|s| !s.contains_key("n") && !s.contains_key("best_of")));
        let b = json!({"prompt": [1, 2], "n": 2});
        let subs = split(b.as_object().unwrap(), &req(&b));
        assert_eq!(subs.len(), 2);
        assert!(subs.iter().all(|s| s["prompt"] == json!([1, 2]) && !s.contains_key("seed")));
    }

    #[test]
    fn answers_merge_in_index_order_counting_each_prompt_once() {
        let a = |t: &str, p: u64| {
            json!({"id": "x", "object": "text_completion", "model": "m",
                   "choices": [{"index": 0, "text": t, "finish_reason": "length"}],
                   "usage": {"prompt_tokens": p, "completion_tokens": 2}, "kvconnect": {"engine_id": t}})
        };
        let m = merge(&[a("a", 3), a("b", 3), a("c", 5), a("d", 5)], 2, "x");
        let idx: Vec<(u64, &str)> = m["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["index"].as_u64().unwrap(), c["text"].as_str().unwrap()))
            .collect();
        assert_eq!(idx, vec![(0, "a"), (1, "b"), (2, "c"), (3, "d")]);
        assert_eq!(m["usage"], json!({"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}));
        assert_eq!(m["kvconnect"]["choices"][2]["engine_id"], "c");
    }

    #[test]
    fn streams_merge_under_one_id_and_close_in_order() {
        let tok = |t: &str| {
            format!(
                "data: {}\n\n",
                json!({"id": "sub", "object": "text_completion", "model": "m",
                    "choices": [{"index": 0, "text": t, "token_ids": [1], "finish_reason": null}]})
            )
        };
        let fin = |p: u64| {
            format!(
                "data: {}\n\n",
                json!({"id": "sub", "object": "text_completion", "model": "m",
                    "choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": p, "completion_tokens": 1}, "kvconnect": {}})
            )
        };
        let mut m = Merge::new("pd".into(), 9, 2, 1, true);
        let mut s = String::new();
        for (k, e) in
            [(1, tok("y")), (0, tok("x")), (1, fin(2)), (0, fin(3)), (0, "data: [DONE]\n\n".to_owned())]
        {
            s.extend(m.event(k, &e));
        }
        s += &m.close();
        let got = kvconnect_openai::stream::collect_choices(&s).unwrap();
        assert_eq!(got, vec![("x".to_owned(), vec![1]), ("y".to_owned(), vec![1])]);
        let events: Vec<Value> = s
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect();
        assert!(events.iter().all(|e| e["id"] == "pd" && e.get("usage").is_some()), "{s}");
        let last = events.last().unwrap();
        assert_eq!(last["choices"], json!([]));
        assert_eq!(last["usage"]["total_tokens"], 7);
        assert_eq!(events[2]["choices"][0]["index"], 0, "closing chunks in index order");
        assert_eq!(events[3]["choices"][0]["index"], 1);
    }
}
