//! The OpenAI parameters clients and vLLM's P/D tests send, through `kvconnect up`'s proxy
//! (one prefill and one decode worker process) and against one of its workers asked directly
//! (a monolithic run: no `kv_transfer_params`). Checked: logprobs through the proxy agree with
//! the worker's own (non-streaming, streaming, chat); seeded sampling is reproducible and the
//! proxy's output equals the worker's, `n` choices included; stop strings and `min_tokens`
//! cut where the greedy output says they must, streamed too; `stream_options.include_usage`;
//! a list of prompts; `echo`; and every refused parameter gets a 400 naming it, from the
//! proxy and from a worker.

use kvconnect_api::KvLayout;
use kvconnect_engine::{detokenize, tokenize};
use kvconnect_openai::stream::{collect_choices, collect_text, collect_token_ids};
use kvconnect_tests::{http_request, monolithic, token_ids};
use serde_json::{json, Value};
use std::process::Child;

/// `kvconnect up`, SIGKILLed with its workers on drop.
struct Up {
    child: Child,
    line: Value,
}

impl Up {
    fn start() -> Up {
        let (child, line) =
            kvconnect_tests::spawn_up(&["--prefill", "1", "--decode", "1", "--num-blocks", "256"]);
        Up { child, line }
    }

    fn proxy(&self) -> String {
        self.line["proxy"].as_str().unwrap().trim_start_matches("http://").to_owned()
    }

    /// A worker asked directly: a monolithic run of the same model and weights.
    fn worker(&self) -> String {
        self.line["prefill"][0].as_str().unwrap().trim_start_matches("http://").to_owned()
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn post(addr: &str, path: &str, body: &Value) -> Value {
    let (st, v) = http_request(addr, "POST", path, Some(body));
    assert_eq!(st, 200, "{addr}{path} {body}: {v}");
    v
}

fn completion(addr: &str, body: Value) -> Value {
    post(addr, "/v1/completions", &body)
}

/// The data of every event of a stream (`[DONE]` checked and left out).
fn events(stream: &Value) -> Vec<Value> {
    let s = stream.as_str().unwrap_or_else(|| panic!("not a stream: {stream}"));
    assert!(s.ends_with("data: [DONE]\n\n"), "{s}");
    s.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn close(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-3, "{a:?} vs {b:?}");
    }
}

/// The largest logprob of each token's `top_logprobs` dict (the top-1).
fn top1(lp: &Value) -> Vec<f64> {
    lp["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_object().unwrap().values().map(|x| x.as_f64().unwrap()).fold(f64::MIN, f64::max))
        .collect()
}

fn ids(v: &Value, choice: usize) -> Vec<u32> {
    v["choices"][choice]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

const N: usize = 8;

#[test]
fn parameters_through_the_proxy_match_a_monolithic_worker() {
    let up = Up::start();
    let (proxy, worker) = (up.proxy(), up.worker());
    let prompt = "The quick brown fox jumps over the lazy dog.";
    let greedy = monolithic(&[tokenize(prompt)], 32, KvLayout::HND).remove(0);

    // Logprobs: the proxy's (decode continuing from prefill's KV) agree with the worker's own.
    let d = completion(&proxy, json!({"prompt": prompt, "max_tokens": N, "logprobs": 3}));
    let m = completion(&worker, json!({"prompt": prompt, "max_tokens": N, "logprobs": 3}));
    assert_eq!(ids(&d, 0), greedy[..N], "greedy stays greedy with logprobs");
    assert_eq!(ids(&d, 0), ids(&m, 0));
    let (dl, ml) = (&d["choices"][0]["logprobs"], &m["choices"][0]["logprobs"]);
    close(&top1(dl), &top1(ml));
    close(&floats(&dl["token_logprobs"]), &floats(&ml["token_logprobs"]));
    assert_eq!(dl["tokens"].as_array().unwrap().len(), N, "{dl}");
    assert_eq!(dl["text_offset"], ml["text_offset"]);
    for (i, t) in dl["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let n = t.as_object().unwrap().len();
        assert!(n == 3 || n == 4, "top 3 and the chosen token: {t}");
        // Greedy: the chosen token is the most likely one.
        assert!((floats(&dl["token_logprobs"])[i] - top1(dl)[i]).abs() < 1e-6, "{dl}");
        assert!(top1(dl)[i] <= 0.0);
    }
    // Streamed: each token's chunk carries its logprobs.
    let s = completion(&proxy, json!({"prompt": prompt, "max_tokens": N, "logprobs": 3, "stream": true}));
    let streamed: Vec<f64> =
        events(&s).iter().filter_map(|e| e["choices"][0]["logprobs"]["token_logprobs"][0].as_f64()).collect();
    close(&streamed, &floats(&ml["token_logprobs"]));
    // Chat: logprobs.content with top_logprobs lists.
    let messages = json!([{"role": "user", "content": prompt}]);
    let body = json!({"messages": messages, "max_tokens": 4, "logprobs": true, "top_logprobs": 2});
    let (c, cm) = (post(&proxy, "/v1/chat/completions", &body), post(&worker, "/v1/chat/completions", &body));
    let content = c["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    assert_eq!(content.len(), 4, "{c}");
    for (e, w) in content.iter().zip(cm["choices"][0]["logprobs"]["content"].as_array().unwrap()) {
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2, "{e}");
        assert_eq!(e["token"], w["token"]);
        assert!((e["logprob"].as_f64().unwrap() - w["logprob"].as_f64().unwrap()).abs() < 1e-3);
    }

    // Seeded sampling: reproducible, and decode (which samples every token) equals a worker.
    let sampled =
        json!({"prompt": prompt, "max_tokens": 24, "temperature": 1.0, "top_p": 0.95, "seed": 1234});
    let a = completion(&proxy, sampled.clone());
    assert_eq!(ids(&a, 0), ids(&completion(&proxy, sampled.clone()), 0), "same seed, same tokens");
    assert_eq!(ids(&a, 0), ids(&completion(&worker, sampled.clone()), 0), "proxy == monolithic worker");
    assert_ne!(ids(&a, 0), greedy[..24], "temperature 1 does not follow the argmax for 24 tokens");
    let mut other = sampled.clone();
    other["seed"] = json!(99);
    assert_ne!(ids(&a, 0), ids(&completion(&proxy, other), 0), "another seed, other tokens");
    let mut streamed = sampled.clone();
    streamed["stream"] = json!(true);
    let s = completion(&proxy, streamed);
    assert_eq!(collect_token_ids(s.as_str().unwrap()).unwrap(), ids(&a, 0), "streamed through the proxy");
    let mut two = sampled.clone();
    two["n"] = json!(2);
    let (p2, w2) = (completion(&proxy, two.clone()), completion(&worker, two));
    assert_eq!(p2["choices"].as_array().unwrap().len(), 2, "{p2}");
    assert_eq!((ids(&p2, 0), ids(&p2, 1)), (ids(&w2, 0), ids(&w2, 1)), "choice j samples from seed + j");
    assert_eq!(ids(&p2, 0), ids(&a, 0));
    assert_ne!(ids(&p2, 0), ids(&p2, 1));
    assert_eq!(p2["usage"]["completion_tokens"], 48, "{p2}");
    assert_eq!(p2["usage"]["prompt_tokens"], prompt.len(), "the prompt counts once");

    // Stop strings: cut at the first place the greedy output holds them.
    let at = greedy
        .windows(2)
        .position(|w| w.iter().all(|t| (32..127).contains(t)))
        .expect("two ASCII bytes in a row");
    let stop = detokenize(&greedy[at..at + 2]);
    let first = greedy.windows(2).position(|w| detokenize(w) == stop).unwrap();
    let body = json!({"prompt": prompt, "max_tokens": 32, "stop": [stop.clone(), "\u{1F600}"]});
    for addr in [&proxy, &worker] {
        let v = completion(addr, body.clone());
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        assert_eq!(ids(&v, 0), greedy[..first + 2], "the stop string's tokens stay in token_ids");
        assert_eq!(v["choices"][0]["text"].as_str(), Some(detokenize(&greedy[..first]).as_str()));
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let s = completion(&proxy, streamed);
    assert_eq!(
        collect_text(s.as_str().unwrap()),
        Some(detokenize(&greedy[..first])),
        "no part of the stop string is streamed"
    );
    assert!(events(&s).iter().any(|e| e["choices"][0]["finish_reason"] == "stop"));
    let kept = completion(
        &proxy,
        json!({"prompt": prompt, "max_tokens": 32, "stop": stop, "include_stop_str_in_output": true}),
    );
    assert_eq!(kept["choices"][0]["text"].as_str(), Some(detokenize(&greedy[..first + 2]).as_str()));
    // min_tokens: no stop before that many tokens.
    let min = (first + 3).min(32);
    let later = (0..31).find(|l| l + 2 >= min && detokenize(&greedy[*l..l + 2]) == stop);
    let v = completion(&proxy, json!({"prompt": prompt, "max_tokens": 32, "stop": stop, "min_tokens": min}));
    match later {
        Some(l) => assert_eq!(ids(&v, 0), greedy[..l + 2], "{v}"),
        None => assert_eq!(
            (ids(&v, 0), v["choices"][0]["finish_reason"].clone()),
            (greedy.clone(), json!("length"))
        ),
    }
    let plain = completion(&proxy, json!({"prompt": prompt, "max_tokens": 4}));
    assert_eq!(plain["choices"][0]["finish_reason"], "length");

    // stream_options.include_usage: a last chunk with usage and no choices.
    let body =
        json!({"prompt": prompt, "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}});
    for addr in [&proxy, &worker] {
        let ev = events(&completion(addr, body.clone()));
        let last = ev.last().unwrap();
        assert_eq!(last["choices"], json!([]), "{last}");
        assert_eq!(last["usage"]["completion_tokens"], 4, "{last}");
        assert!(ev[..ev.len() - 1].iter().all(|e| e.get("usage") == Some(&Value::Null)), "{ev:?}");
    }
    let ev = events(&completion(&proxy, body));
    assert!(ev.last().unwrap()["kvconnect"]["proxy"]["decode_worker"].is_string(), "{ev:?}");

    // A list of prompts: one choice each, in order, as each prompt alone gives.
    let prompts = ["abc", "Hello, world"];
    let want = monolithic(&prompts.map(tokenize), 4, KvLayout::HND);
    let v = completion(&proxy, json!({"prompt": prompts, "max_tokens": 4}));
    let got: Vec<(u64, Vec<u32>)> =
        (0..2).map(|i| (v["choices"][i]["index"].as_u64().unwrap(), ids(&v, i))).collect();
    assert_eq!(got, vec![(0, want[0].clone()), (1, want[1].clone())], "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 15);
    let tokens: Vec<Vec<u32>> = prompts.iter().map(|p| tokenize(p)).collect();
    let w = completion(&worker, json!({"prompt": tokens, "max_tokens": 4}));
    assert_eq!((ids(&w, 0), ids(&w, 1)), (want[0].clone(), want[1].clone()), "token-id lists on a worker");
    let s = completion(&proxy, json!({"prompt": prompts, "max_tokens": 4, "stream": true}));
    let streamed = collect_choices(s.as_str().unwrap()).unwrap();
    assert_eq!(streamed.iter().map(|c| c.1.clone()).collect::<Vec<_>>(), want, "streamed prompt list");

    // echo: the prompt's text before the choice's.
    let v = completion(&proxy, json!({"prompt": prompt, "max_tokens": 4, "echo": true}));
    assert_eq!(
        v["choices"][0]["text"].as_str(),
        Some(format!("{prompt}{}", detokenize(&greedy[..4])).as_str())
    );
    assert_eq!(token_ids(&v).len(), 4);
}

#[test]
fn refused_parameters_get_a_400_naming_them_from_the_proxy_and_a_worker() {
    let up = Up::start();
    let m = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, Value)> = vec![
        ("logit_bias", json!({"prompt": "hi", "logit_bias": {"65": 10}})),
        ("suffix", json!({"prompt": "hi", "suffix": "end"})),
        ("presence_penalty", json!({"prompt": "hi", "presence_penalty": 0.5})),
        ("frequency_penalty", json!({"prompt": "hi", "frequency_penalty": 0.5})),
        ("best_of", json!({"prompt": "hi", "best_of": 3})),
        ("echo", json!({"prompt": "hi", "echo": true, "logprobs": 1})),
        ("temperature", json!({"prompt": "hi", "temperature": 3})),
        ("top_p", json!({"prompt": "hi", "top_p": 0})),
        ("n", json!({"prompt": "hi", "n": 0})),
        ("stop", json!({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]})),
        ("logprobs", json!({"prompt": "hi", "logprobs": 21})),
        ("min_tokens", json!({"prompt": "hi", "max_tokens": 2, "min_tokens": 3})),
        ("stream_options", json!({"prompt": "hi", "stream_options": {"include_usage": true}})),
        ("prompt", json!({"prompt": ["hi", 3]})),
        ("prompt_logprobs", json!({"prompt": "hi", "prompt_logprobs": 1})),
        ("use_beam_search", json!({"prompt": "hi", "use_beam_search": true})),
        ("guided_json", json!({"prompt": "hi", "guided_json": {"type": "object"}})),
        ("tools", json!({"messages": m, "tools": [{"type": "function", "function": {"name": "f"}}]})),
        ("tool_choice", json!({"messages": m, "tool_choice": "auto"})),
        ("response_format", json!({"messages": m, "response_format": {"type": "json_object"}})),
        ("top_logprobs", json!({"messages": m, "top_logprobs": 2})),
        ("echo", json!({"messages": m, "echo": true})),
        ("chat_template", json!({"messages": m, "chat_template": "{{ messages }}"})),
    ];
    for addr in [up.proxy(), up.worker()] {
        for (param, body) in &cases {
            let path =
                if body.get("messages").is_some() { "/v1/chat/completions" } else { "/v1/completions" };
            let (st, e) = http_request(&addr, "POST", path, Some(body));
            assert_eq!(st, 400, "{addr}{path} {body}: {e}");
            assert_eq!(e["error"]["param"], *param, "{body}: {e}");
            assert_eq!(e["error"]["type"], "invalid_request_error");
            let msg = e["error"]["message"].as_str().unwrap();
            assert!(msg.contains(param), "the message names '{param}': {msg}");
        }
        // Defaults of refused parameters, and fields neither OpenAI nor vLLM define, pass.
        let fine = json!({"prompt": "hi", "max_tokens": 2, "logit_bias": {}, "presence_penalty": 0,
                          "tools": [], "response_format": {"type": "text"}, "user": "me", "x_custom": 1});
        let (st, v) = http_request(&addr, "POST", "/v1/completions", Some(&fine));
        assert_eq!(st, 200, "{v}");
    }
}
