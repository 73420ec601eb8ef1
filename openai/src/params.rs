//! The OpenAI request parameters servers and the proxy read, checked into an [`OpenAiRequest`]
//! or refused with a [`ParamError`] naming the parameter.
//!
//! Every parameter OpenAI or vLLM define is either honoured, accepted without effect where
//! this engine already behaves as asked (no special tokens, no EOS), or refused unless it has
//! its default value (both lists are in `unsupported`). Parameters neither of them define are ignored with a
//! warning, as vLLM's OpenAI server does. docs/openai-api.md has the table.

use crate::chat_template;
use crate::unsupported::{refuse, NO_EFFECT, REFUSED};
use kvconnect_engine::{tokenize, SamplingParams};
use serde_json::{Map, Value};

/// `max_tokens` when the request gives none (OpenAI's completions default).
pub const DEFAULT_MAX_TOKENS: usize = 16;
/// Most choices one request may ask for (prompts × `n`).
pub const MAX_CHOICES: usize = 256;
/// Most stop strings (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Most top log-probabilities per token.
pub const MAX_LOGPROBS: usize = 20;

/// The parameters honoured (or checked) on both endpoints.
const HONOURED: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "best_of",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "min_tokens",
    "logprobs",
    "echo",
    "kv_transfer_params",
    "request_id",
];

/// The parameters honoured on one endpoint only.
const HONOURED_COMPLETIONS: &[&str] = &["prompt"];
const HONOURED_CHAT: &[&str] = &["messages", "top_logprobs", "add_generation_prompt"];

/// A refused or malformed parameter: the 400 (or 413/422 for the context) to answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ParamError {
    /// The parameter at fault (OpenAI's `param`), when there is one.
    pub param: Option<&'static str>,
    /// What is wrong and what to send instead.
    pub message: String,
    /// The HTTP status.
    pub status: u16,
}

impl ParamError {
    /// A 400 naming `param`.
    pub fn bad(param: &'static str, message: impl Into<String>) -> ParamError {
        ParamError { param: Some(param), message: message.into(), status: 400 }
    }
}

/// A checked request: what the server runs (or the proxy forwards).
#[derive(Debug, Clone, PartialEq)]
pub struct OpenAiRequest {
    /// `model`, when given (the server compares it with its own).
    pub model: Option<String>,
    /// `/v1/chat/completions` (else `/v1/completions`).
    pub chat: bool,
    /// The prompts as token ids (one for chat: the rendered template), at least one.
    pub prompts: Vec<Vec<u32>>,
    /// `max_completion_tokens` or `max_tokens`, when given.
    pub max_tokens: Option<usize>,
    /// Choices per prompt.
    pub n: usize,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with `usage` and no choices.
    pub include_usage: bool,
    /// 0 is greedy.
    pub temperature: f32,
    /// Nucleus mass, (0, 1].
    pub top_p: f32,
    /// 0 keeps every token.
    pub top_k: usize,
    /// 0 keeps every token.
    pub min_p: f32,
    /// `seed`, when given (choice `j` of a prompt uses `seed + j`).
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stop token ids (vLLM's extension).
    pub stop_token_ids: Vec<u32>,
    /// Keep the stop string (or token) in the text.
    pub include_stop_str_in_output: bool,
    /// No stop before this many tokens (vLLM's extension).
    pub min_tokens: usize,
    /// Top log-probabilities per token (completions `logprobs: N`, chat `logprobs: true` with
    /// `top_logprobs: N`).
    pub logprobs: Option<usize>,
    /// Completions `echo`: the prompt's text before each choice's.
    pub echo: bool,
    /// vLLM's `kv_transfer_params`.
    pub kv_transfer_params: Option<Map<String, Value>>,
    /// The caller's request id (the proxy hands prefill's to decode).
    pub request_id: Option<String>,
    /// Parameters neither OpenAI nor vLLM define, ignored (for the warning).
    pub ignored: Vec<String>,
}

impl OpenAiRequest {
    /// Choices in the answer: prompts × `n`, indexed `prompt * n + j`.
    pub fn choices(&self) -> usize {
        self.prompts.len() * self.n
    }

    /// Tokens to generate per choice.
    pub fn max_tokens_or_default(&self) -> usize {
        self.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)
    }

    /// The engine's parameters for one choice, its generator seeded with `seed`.
    pub fn sampling(&self, seed: u64) -> SamplingParams {
        let mut stop: Vec<Vec<u32>> = self.stop.iter().map(|s| tokenize(s)).collect();
        stop.extend(self.stop_token_ids.iter().map(|t| vec![*t]));
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed,
            logprobs: self.logprobs,
            min_tokens: self.min_tokens,
            stop,
        }
    }
}

fn int(body: &Map<String, Value>, name: &'static str, what: &str) -> Result<Option<i64>, ParamError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| ParamError::bad(name, format!("'{name}' must be {what}, not {v}"))),
    }
}

fn bounded(
    body: &Map<String, Value>,
    name: &'static str,
    lo: i64,
    hi: i64,
) -> Result<Option<usize>, ParamError> {
    let what = format!("an integer from {lo} to {hi}");
    match int(body, name, &what)? {
        None => Ok(None),
        Some(n) if (lo..=hi).contains(&n) => Ok(Some(n.max(0) as usize)),
        Some(n) => Err(ParamError::bad(name, format!("'{name}' must be {what}, not {n}"))),
    }
}

fn number(
    body: &Map<String, Value>,
    name: &'static str,
    ok: impl Fn(f64) -> bool,
    what: &str,
) -> Result<Option<f32>, ParamError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if ok(x) => Ok(Some(x as f32)),
            _ => Err(ParamError::bad(name, format!("'{name}' must be {what}, not {v}"))),
        },
    }
}

fn text(body: &Map<String, Value>, name: &'static str) -> Result<Option<String>, ParamError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(ParamError::bad(name, format!("'{name}' must be a string, not {v}"))),
    }
}

fn flag(body: &Map<String, Value>, name: &'static str) -> Result<bool, ParamError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ParamError::bad(name, format!("'{name}' must be true or false, not {v}"))),
    }
}

/// The prompts of a completions request: a string, a list of token ids, a list of strings or
/// a list of token-id lists.
pub fn prompts(v: Option<&Value>) -> Result<Vec<Vec<u32>>, ParamError> {
    let bad = |m: String| ParamError::bad("prompt", m);
    let ids = |a: &[Value]| -> Result<Vec<u32>, ParamError> {
        a.iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| bad(format!("prompt token {t} is not a non-negative integer token id")))
            })
            .collect()
    };
    let list = match v {
        Some(Value::String(s)) => return Ok(vec![tokenize(s)]),
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(bad(format!(
                "'prompt' must be a string, a list of token ids, a list of strings or a list of token-id \
                    lists, not {other}"
            )))
        }
        None => return Err(bad("the request has no 'prompt'; send a string or a list of token ids".into())),
    };
    match list.first() {
        None => Err(bad("'prompt' is an empty list; send at least one prompt".into())),
        Some(Value::String(_)) => list
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Value::String(s) => Ok(tokenize(s)),
                other => Err(bad(format!("prompt[{i}] is {other}; a list of prompts holds strings only"))),
            })
            .collect(),
        Some(Value::Array(_)) => list
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Value::Array(a) => ids(a),
                other => {
                    Err(bad(format!("prompt[{i}] is {other}; a list of token-id lists holds lists only")))
                }
            })
            .collect(),
        Some(_) => Ok(vec![ids(list)?]),
    }
}

fn stop_strings(v: Option<&Value>) -> Result<Vec<String>, ParamError> {
    let bad = |m: String| ParamError::bad("stop", m);
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| bad(format!("stop strings must be strings, not {s}")))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(bad(format!("'stop' must be a string or a list of strings, not {other}"))),
    };
    if list.len() > MAX_STOP {
        return Err(bad(format!("'stop' has {} strings; send at most {MAX_STOP}", list.len())));
    }
    if list.iter().any(String::is_empty) {
        return Err(bad("a stop string is empty; leave it out".into()));
    }
    Ok(list)
}

fn stop_token_ids(v: Option<&Value>) -> Result<Vec<u32>, ParamError> {
    let bad = |m: String| ParamError::bad("stop_token_ids", m);
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .filter(|n| *n < u64::from(kvconnect_engine::tokenizer::VOCAB_SIZE))
                    .map(|n| n as u32)
                    .ok_or_else(|| {
                        bad(format!("stop token {t} is not a token id of the byte vocabulary (0..=255)"))
                    })
            })
            .collect(),
        Some(other) => Err(bad(format!("'stop_token_ids' must be a list of token ids, not {other}"))),
    }
}

/// `stream_options`: `include_usage` (true when the object leaves it out, as vLLM reads it).
fn include_usage(body: &Map<String, Value>, stream: bool) -> Result<bool, ParamError> {
    let bad = |m: String| ParamError::bad("stream_options", m);
    match body.get("stream_options") {
        None | Some(Value::Null) => Ok(false),
        Some(_) if !stream => Err(bad("'stream_options' is only allowed with \"stream\": true".into())),
        Some(Value::Object(o)) => {
            if o.get("continuous_usage_stats").is_some_and(|c| c.as_bool() == Some(true)) {
                return Err(bad(
                    "stream_options.continuous_usage_stats is not supported: usage comes in the last chunk; \
                        leave it out"
                        .into(),
                ));
            }
            match o.get("include_usage") {
                None | Some(Value::Null) => Ok(true),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => Err(bad(format!("stream_options.include_usage must be true or false, not {v}"))),
            }
        }
        Some(other) => Err(bad(format!("'stream_options' must be an object, not {other}"))),
    }
}

/// `logprobs` (completions: top-N 0..=20; chat: a flag, with `top_logprobs` 0..=20).
fn logprobs(body: &Map<String, Value>, chat: bool) -> Result<Option<usize>, ParamError> {
    if !chat {
        return bounded(body, "logprobs", 0, MAX_LOGPROBS as i64);
    }
    let on = flag(body, "logprobs")?;
    let top = bounded(body, "top_logprobs", 0, MAX_LOGPROBS as i64)?;
    match (on, top) {
        (false, Some(n)) if n > 0 => Err(ParamError::bad(
            "top_logprobs",
            "'top_logprobs' needs \"logprobs\": true; send both or neither",
        )),
        (false, _) => Ok(None),
        (true, n) => Ok(Some(n.unwrap_or(0))),
    }
}

/// Checks an OpenAI completions (`chat` false) or chat completions body.
pub fn parse(body: &Map<String, Value>, chat: bool) -> Result<OpenAiRequest, ParamError> {
    let model = text(body, "model")?;
    refuse(body)?;
    let prompts = if chat {
        if flag(body, "echo")? {
            return Err(ParamError::bad(
                "echo",
                "chat 'echo' (prepend the last message to the answer) is not supported; leave it out",
            ));
        }
        let generation_prompt = match body.get("add_generation_prompt") {
            None | Some(Value::Null) => true,
            Some(_) => flag(body, "add_generation_prompt")?,
        };
        let messages = body.get("messages").unwrap_or(&Value::Null);
        let text =
            chat_template::render(messages, generation_prompt).map_err(|m| ParamError::bad("messages", m))?;
        vec![tokenize(&text)]
    } else {
        prompts(body.get("prompt"))?
    };
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        let which = if prompts.len() == 1 {
            "the prompt is empty".to_owned()
        } else {
            format!("prompt[{i}] is empty")
        };
        return Err(ParamError::bad("prompt", format!("{which}; send at least one token")));
    }
    let stream = flag(body, "stream")?;
    // OpenAI's newer name for the same limit wins over the old one, as in vLLM.
    let max_name = if body.get("max_completion_tokens").is_some_and(|v| !v.is_null()) {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = match int(body, max_name, "a positive integer")? {
        None => None,
        Some(n) if n > 0 => Some(n as usize),
        Some(n) => {
            return Err(ParamError::bad(
                "max_tokens",
                format!("'{max_name}' must be a positive integer, not {n}"),
            ))
        }
    };
    let n = bounded(body, "n", 1, MAX_CHOICES as i64)?.unwrap_or(1);
    if let Some(b) = int(body, "best_of", "an integer")? {
        if b != n as i64 {
            return Err(ParamError::bad(
                "best_of",
                format!(
                    "'best_of' {b} is not supported (keeping the n most likely of best_of samples); \
                    leave it out or set it to n ({n})"
                ),
            ));
        }
    }
    if prompts.len() * n > MAX_CHOICES {
        return Err(ParamError::bad(
            "n",
            format!(
                "{} prompts × n {n} is {} choices; ask for at most {MAX_CHOICES} in one request",
                prompts.len(),
                prompts.len() * n
            ),
        ));
    }
    let temperature =
        number(body, "temperature", |t| (0.0..=2.0).contains(&t), "a number from 0 to 2")?.unwrap_or(0.0);
    let top_p = number(body, "top_p", |p| p > 0.0 && p <= 1.0, "a number in (0, 1]")?.unwrap_or(1.0);
    let top_k = bounded(body, "top_k", -1, i64::from(u32::MAX))?.unwrap_or(0);
    let min_p = number(body, "min_p", |p| (0.0..=1.0).contains(&p), "a number from 0 to 1")?.unwrap_or(0.0);
    let seed = match body.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| {
            ParamError::bad("seed", format!("'seed' must be an integer from -2^63 to 2^63-1, not {v}"))
        })? as u64),
    };
    let min_tokens = bounded(body, "min_tokens", 0, i64::MAX)?.unwrap_or(0);
    let max = max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    if min_tokens > max {
        return Err(ParamError::bad(
            "min_tokens",
            format!("'min_tokens' {min_tokens} is more than max_tokens {max}; ask for at most max_tokens"),
        ));
    }
    let logprobs = logprobs(body, chat)?;
    let echo = !chat && flag(body, "echo")?;
    if echo && logprobs.is_some() {
        return Err(ParamError::bad(
            "echo",
            "'echo' with 'logprobs' would need the prompt's log-probabilities, which are not computed (in \
                P/D prefill computes the prompt); send one of them",
        ));
    }
    let kv_transfer_params = match body.get("kv_transfer_params") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) => Some(m.clone()),
        Some(other) => {
            return Err(ParamError::bad(
                "kv_transfer_params",
                format!("'kv_transfer_params' must be an object, not {other}"),
            ))
        }
    };
    if kv_transfer_params.is_some() && prompts.len() * n > 1 {
        return Err(ParamError::bad(
            "kv_transfer_params",
            "'kv_transfer_params' belongs to one prompt and one choice; send one prompt with n 1 per request \
                (the proxy splits larger requests)",
        ));
    }
    let request_id = text(body, "request_id")?;
    let endpoint = if chat { HONOURED_CHAT } else { HONOURED_COMPLETIONS };
    let known = |k: &str| {
        HONOURED.contains(&k)
            || endpoint.contains(&k)
            || NO_EFFECT.contains(&k)
            || REFUSED.iter().any(|r| r.name == k)
    };
    Ok(OpenAiRequest {
        model,
        chat,
        prompts,
        max_tokens,
        n,
        stream,
        include_usage: include_usage(body, stream)?,
        temperature,
        top_p,
        top_k,
        min_p,
        seed,
        stop: stop_strings(body.get("stop"))?,
        stop_token_ids: stop_token_ids(body.get("stop_token_ids"))?,
        include_stop_str_in_output: flag(body, "include_stop_str_in_output")?,
        min_tokens,
        logprobs,
        echo,
        kv_transfer_params,
        request_id,
        ignored: body.keys().filter(|k| !known(k)).cloned().collect(),
    })
}

/// The context checks of one prompt: `max_tokens` past the context is a 422, a prompt longer
/// than the context a 413.
pub fn check_context(
    prompt_len: usize,
    max_tokens: Option<usize>,
    max_model_len: usize,
) -> Result<(), ParamError> {
    if let Some(n) = max_tokens {
        if prompt_len.saturating_add(n) > max_model_len {
            return Err(ParamError {
                param: Some("max_tokens"),
                message: format!(
                    "max_tokens {n} with a {prompt_len}-token prompt exceeds the model's context of \
                        {max_model_len} tokens; ask for at most {} tokens",
                    max_model_len.saturating_sub(prompt_len)
                ),
                status: 422,
            });
        }
    }
    if prompt_len > max_model_len {
        return Err(ParamError {
            param: Some("prompt"),
            message: format!(
                "the prompt has {prompt_len} tokens; the model's context is {max_model_len} tokens"
            ),
            status: 413,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn completions(v: Value) -> Result<OpenAiRequest, ParamError> {
        parse(v.as_object().unwrap(), false)
    }

    fn chat(v: Value) -> Result<OpenAiRequest, ParamError> {
        parse(v.as_object().unwrap(), true)
    }

    fn refused_param(r: Result<OpenAiRequest, ParamError>) -> &'static str {
        let e = r.unwrap_err();
        assert_eq!(e.status, 400, "{e}");
        e.param.unwrap()
    }

    #[test]
    fn defaults_are_greedy_one_choice_sixteen_tokens() {
        let r = completions(json!({"prompt": "hi"})).unwrap();
        assert_eq!(r.prompts, vec![vec![104, 105]]);
        assert_eq!((r.n, r.choices(), r.max_tokens_or_default()), (1, 1, 16));
        assert!(r.sampling(9).is_plain_greedy());
        assert_eq!(r.sampling(9).seed, 9);
        assert!(!r.stream && !r.include_usage && !r.echo && r.logprobs.is_none());
    }

    #[test]
    fn prompt_lists_of_strings_and_of_token_lists() {
        let r = completions(json!({"prompt": ["a", "bc"], "n": 2})).unwrap();
        assert_eq!(r.prompts, vec![vec![97], vec![98, 99]]);
        assert_eq!(r.choices(), 4);
        let r = completions(json!({"prompt": [[1, 2], [3]]})).unwrap();
        assert_eq!(r.prompts, vec![vec![1, 2], vec![3]]);
        assert_eq!(completions(json!({"prompt": [5, 6]})).unwrap().prompts, vec![vec![5, 6]]);
        assert_eq!(refused_param(completions(json!({"prompt": ["a", [1]]}))), "prompt");
        assert_eq!(refused_param(completions(json!({"prompt": []}))), "prompt");
        assert_eq!(refused_param(completions(json!({"prompt": ["a", ""]}))), "prompt");
        assert_eq!(refused_param(completions(json!({"prompt": [-1]}))), "prompt");
        assert_eq!(refused_param(completions(json!({}))), "prompt");
    }

    #[test]
    fn sampling_parameters_are_checked_and_mapped() {
        let r = completions(
            json!({"prompt": "x", "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": -1}),
        )
        .unwrap();
        let s = r.sampling(r.seed.unwrap());
        assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p, s.seed), (0.7, 0.9, 5, 0.1, u64::MAX));
        for (k, v) in [
            ("temperature", json!(2.5)),
            ("temperature", json!(-0.1)),
            ("top_p", json!(0)),
            ("top_p", json!(1.5)),
            ("seed", json!(1.5)),
            ("seed", json!(u64::MAX)),
            ("n", json!(0)),
            ("top_k", json!(-2)),
        ] {
            let mut b = json!({"prompt": "x"});
            b[k] = v;
            assert_eq!(refused_param(completions(b)), k);
        }
        let e = completions(json!({"prompt": "x", "max_tokens": 0})).unwrap_err();
        assert!(e.message.contains("positive integer"), "{e}");
        let r = completions(json!({"prompt": "x", "max_tokens": 4, "max_completion_tokens": 9})).unwrap();
        assert_eq!(r.max_tokens, Some(9), "the newer name wins");
    }

    #[test]
    fn stop_strings_and_token_ids_become_stop_sequences() {
        let r =
            completions(json!({"prompt": "x", "stop": ["ab", "\n"], "stop_token_ids": [0], "min_tokens": 2}))
                .unwrap();
        let s = r.sampling(0);
        assert_eq!(s.stop, vec![vec![97, 98], vec![10], vec![0]]);
        assert_eq!(s.min_tokens, 2);
        assert_eq!(completions(json!({"prompt": "x", "stop": "z"})).unwrap().stop, vec!["z"]);
        assert_eq!(
            refused_param(completions(json!({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}))),
            "stop"
        );
        assert_eq!(refused_param(completions(json!({"prompt": "x", "stop": [""]}))), "stop");
        assert_eq!(refused_param(completions(json!({"prompt": "x", "stop": 3}))), "stop");
        assert_eq!(
            refused_param(completions(json!({"prompt": "x", "stop_token_ids": [256]}))),
            "stop_token_ids"
        );
        assert_eq!(refused_param(completions(json!({"prompt": "x", "min_tokens": 20}))), "min_tokens");
    }

    #[test]
    fn logprobs_shapes_per_endpoint() {
        assert_eq!(completions(json!({"prompt": "x", "logprobs": 3})).unwrap().logprobs, Some(3));
        assert_eq!(completions(json!({"prompt": "x", "logprobs": 0})).unwrap().logprobs, Some(0));
        assert_eq!(refused_param(completions(json!({"prompt": "x", "logprobs": 21}))), "logprobs");
        assert_eq!(refused_param(completions(json!({"prompt": "x", "logprobs": true}))), "logprobs");
        let m = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(
            chat(json!({"messages": m, "logprobs": true, "top_logprobs": 2})).unwrap().logprobs,
            Some(2)
        );
        assert_eq!(chat(json!({"messages": m, "logprobs": true})).unwrap().logprobs, Some(0));
        assert_eq!(chat(json!({"messages": m, "logprobs": false})).unwrap().logprobs, None);
        assert_eq!(refused_param(chat(json!({"messages": m, "top_logprobs": 2}))), "top_logprobs");
        assert_eq!(refused_param(chat(json!({"messages": m, "logprobs": 2}))), "logprobs");
        assert_eq!(refused_param(completions(json!({"prompt": "x", "echo": true, "logprobs": 1}))), "echo");
        assert!(completions(json!({"prompt": "x", "echo": true})).unwrap().echo);
        assert_eq!(refused_param(chat(json!({"messages": m, "echo": true}))), "echo");
    }

    #[test]
    fn stream_options_need_a_stream() {
        let r =
            completions(json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": true}}))
                .unwrap();
        assert!(r.include_usage);
        let r =
            completions(json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": false}}))
                .unwrap();
        assert!(!r.include_usage);
        assert_eq!(
            refused_param(completions(json!({"prompt": "x", "stream_options": {"include_usage": true}}))),
            "stream_options"
        );
        let b = json!({"prompt": "x", "stream": true, "stream_options": {"continuous_usage_stats": true}});
        assert_eq!(refused_param(completions(b)), "stream_options");
    }

    #[test]
    fn refused_parameters_are_named_unless_default_and_unknown_ones_are_ignored() {
        assert_eq!(refused_param(completions(json!({"prompt": "x", "logit_bias": {"1": 2}}))), "logit_bias");
        let defaults = json!({"prompt": "x", "logit_bias": {}, "presence_penalty": 0, "repetition_penalty": 1,
            "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "suffix": null,
            "modalities": ["text"], "user": "u", "ignore_eos": true, "best_of": 1, "made_up": 1});
        let r = completions(defaults).unwrap();
        assert_eq!(r.ignored, vec!["made_up"]);
        assert_eq!(refused_param(completions(json!({"prompt": "x", "best_of": 2}))), "best_of");
        assert_eq!(completions(json!({"prompt": "x", "best_of": 2, "n": 2})).unwrap().n, 2);
        let m = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(
            chat(json!({"messages": m, "add_generation_prompt": false})).unwrap().prompts[0],
            tokenize("user: hi\n")
        );
    }

    #[test]
    fn transfer_params_belong_to_one_choice() {
        let b = json!({"prompt": ["a", "b"], "kv_transfer_params": {"do_remote_decode": true}});
        assert_eq!(refused_param(completions(b)), "kv_transfer_params");
        let b = json!({"prompt": "a", "n": 2, "kv_transfer_params": {"do_remote_decode": true}});
        assert_eq!(refused_param(completions(b)), "kv_transfer_params");
    }

    #[test]
    fn context_checks_are_422_and_413() {
        assert_eq!(check_context(10, Some(4090), 4096).unwrap_err().status, 422);
        assert_eq!(check_context(5000, None, 4096).unwrap_err().status, 413);
        assert!(check_context(10, Some(4086), 4096).is_ok());
    }

    #[test]
    fn the_docs_table_names_every_parameter() {
        let readme = include_str!("../../docs/openai-api.md");
        let names =
            REFUSED.iter().map(|r| r.name).chain(NO_EFFECT.iter().copied()).chain(HONOURED.iter().copied());
        for name in names.chain(HONOURED_COMPLETIONS.iter().copied()).chain(HONOURED_CHAT.iter().copied()) {
            assert!(
                readme.contains(&format!("`{name}`")),
                "docs/openai-api.md's parameter table lacks `{name}`"
            );
        }
    }
}
