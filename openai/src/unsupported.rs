//! The parameters this server does not act on: refused with a 400 naming them unless they
//! have their default value ([`REFUSED`], with why), or accepted without effect because the
//! engine already behaves as they ask ([`NO_EFFECT`]).

use crate::params::ParamError;
use serde_json::{Map, Value};

/// A parameter this server does not honour: refused with a 400 unless it has its default.
#[derive(Debug, Clone, Copy)]
pub struct Refused {
    /// The parameter.
    pub name: &'static str,
    /// The values that ask for nothing (the default).
    pub unset: Unset,
    /// Why it is refused.
    pub why: &'static str,
}

/// Values of a refused parameter that ask for nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unset {
    /// `null`, or an empty string, list or object, `false` or `0`.
    Empty,
    /// `null` or `1`.
    One,
    /// `null` or `"none"`.
    NoneString,
    /// `null` or `{"type": "text"}`.
    TextFormat,
    /// `null` or `["text"]`.
    TextModality,
}

impl Unset {
    fn holds(self, v: &Value) -> bool {
        match (self, v) {
            (_, Value::Null) => true,
            (Unset::Empty, Value::Bool(b)) => !b,
            (Unset::Empty, Value::Number(n)) => n.as_f64() == Some(0.0),
            (Unset::Empty, Value::String(s)) => s.is_empty(),
            (Unset::Empty, Value::Array(a)) => a.is_empty(),
            (Unset::Empty, Value::Object(o)) => o.is_empty(),
            (Unset::One, Value::Number(n)) => n.as_f64() == Some(1.0),
            (Unset::NoneString, Value::String(s)) => s == "none",
            (Unset::TextFormat, Value::Object(o)) => o.len() == 1 && o.get("type") == Some(&"text".into()),
            (Unset::TextModality, Value::Array(a)) => a.len() == 1 && a[0] == "text",
            _ => false,
        }
    }
}

const fn refused(name: &'static str, unset: Unset, why: &'static str) -> Refused {
    Refused { name, unset, why }
}

/// The parameters refused unless they have their default value, with why.
pub const REFUSED: &[Refused] = &[
    refused("suffix", Unset::Empty, "the engine does not insert text after a suffix"),
    refused("logit_bias", Unset::Empty, "logits are not biased"),
    refused("presence_penalty", Unset::Empty, "no repetition penalty is applied"),
    refused("frequency_penalty", Unset::Empty, "no repetition penalty is applied"),
    refused("repetition_penalty", Unset::One, "no repetition penalty is applied"),
    refused("use_beam_search", Unset::Empty, "there is no beam search"),
    refused("length_penalty", Unset::One, "there is no beam search"),
    refused("tools", Unset::Empty, "the chat template has no tool calling"),
    refused("tool_choice", Unset::NoneString, "the chat template has no tool calling"),
    refused("functions", Unset::Empty, "the chat template has no tool calling"),
    refused("function_call", Unset::NoneString, "the chat template has no tool calling"),
    refused("response_format", Unset::TextFormat, "there is no structured output"),
    refused("guided_json", Unset::Empty, "there is no guided decoding"),
    refused("guided_regex", Unset::Empty, "there is no guided decoding"),
    refused("guided_choice", Unset::Empty, "there is no guided decoding"),
    refused("guided_grammar", Unset::Empty, "there is no guided decoding"),
    refused("guided_decoding_backend", Unset::Empty, "there is no guided decoding"),
    refused("guided_whitespace_pattern", Unset::Empty, "there is no guided decoding"),
    refused("structural_tag", Unset::Empty, "there is no guided decoding"),
    refused("structured_outputs", Unset::Empty, "there is no guided decoding"),
    refused(
        "prompt_logprobs",
        Unset::Empty,
        "prompt log-probabilities are not computed (in P/D prefill computes the prompt)",
    ),
    refused("prompt_embeds", Unset::Empty, "prompts are text or token ids"),
    refused("allowed_token_ids", Unset::Empty, "there are no logits processors"),
    refused("bad_words", Unset::Empty, "there are no logits processors"),
    refused("logits_processors", Unset::Empty, "there are no logits processors"),
    refused("truncate_prompt_tokens", Unset::Empty, "prompts are not truncated"),
    refused("priority", Unset::Empty, "the engine schedules first come, first served"),
    refused("cache_salt", Unset::Empty, "the KV caches are not salted"),
    refused(
        "return_tokens_as_token_ids",
        Unset::Empty,
        "logprob tokens are text ('bytes:\\xNN' for a byte that is no character)",
    ),
    refused("continue_final_message", Unset::Empty, "the chat template is fixed"),
    refused("chat_template", Unset::Empty, "the chat template is fixed"),
    refused("chat_template_kwargs", Unset::Empty, "the chat template is fixed"),
    refused("documents", Unset::Empty, "the chat template is fixed"),
    refused("mm_processor_kwargs", Unset::Empty, "the model reads text only"),
    refused("audio", Unset::Empty, "the model reads and writes text only"),
    refused("modalities", Unset::TextModality, "the model writes text only"),
    refused("prediction", Unset::Empty, "there are no predicted outputs"),
    refused("reasoning_effort", Unset::Empty, "the model does not reason"),
    refused("vllm_xargs", Unset::Empty, "there are no request extensions"),
];

/// Parameters accepted without effect: the engine already behaves as they ask (a byte
/// vocabulary has no special tokens and no EOS; there are no tools) or they only label the
/// request.
pub const NO_EFFECT: &[&str] = &[
    "user",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "add_special_tokens",
    "parallel_tool_calls",
    "include_reasoning",
];

/// Refuses a parameter from [`REFUSED`] that does not have its default value.
pub fn refuse(body: &Map<String, Value>) -> Result<(), ParamError> {
    for r in REFUSED {
        if let Some(v) = body.get(r.name) {
            if !r.unset.holds(v) {
                return Err(ParamError::bad(
                    r.name,
                    format!("'{}' is not supported by this server: {}; leave it out", r.name, r.why),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_pass_and_anything_else_is_refused_with_why() {
        let ok = json!({"logit_bias": {}, "presence_penalty": 0, "repetition_penalty": 1, "tools": [],
            "tool_choice": "none", "response_format": {"type": "text"}, "suffix": null,
            "modalities": ["text"]});
        assert!(refuse(ok.as_object().unwrap()).is_ok());
        for r in REFUSED {
            let e = refuse(json!({r.name: {"asks": "for something"}}).as_object().unwrap()).unwrap_err();
            assert_eq!(e.param, Some(r.name), "{e}");
            assert!(e.message.contains(r.name) && e.message.contains(r.why), "{e}");
        }
    }
}
