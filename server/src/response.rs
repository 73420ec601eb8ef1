//! OpenAI response bodies built from finished choices: `text_completion` and
//! `chat.completion`, each choice with its text (the stop sequence that ended it cut off, the
//! prompt in front with `echo`), `token_ids`, `logprobs` and `finish_reason`, plus `usage`
//! and this server's `kv_transfer_params` and `kvconnect` blocks.

use crate::logprobs;
use kvconnect_engine::{detokenize, FinishReason, TokenLogprobs};
use serde_json::{json, Value};

/// A finished choice: what the engine generated for it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceOutput {
    /// Generated tokens (the stop sequence included).
    pub tokens: Vec<u32>,
    /// Their log-probabilities, when asked for.
    pub logprobs: Vec<TokenLogprobs>,
    /// Why it ended (`Length` or `Stop`).
    pub finish: FinishReason,
}

/// How a request's choices are shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Chat shape (`message`, chat logprobs) rather than completions.
    pub chat: bool,
    /// `logprobs` were asked for.
    pub logprobs: bool,
    /// `include_stop_str_in_output`: the text keeps the stop sequence.
    pub include_stop: bool,
}

/// What identifies a response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// The response id (the engine's request id for one choice).
    pub id: String,
    /// The model's name.
    pub model: String,
    /// Unix seconds when the request arrived.
    pub created: u64,
    /// Chat or completions.
    pub chat: bool,
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(f: &FinishReason) -> &'static str {
    match f {
        FinishReason::Stop { .. } => "stop",
        _ => "length",
    }
}

/// How many leading tokens of a choice's output its text shows: all but the stop sequence
/// that ended it (all of them with `include_stop`).
pub fn visible(tokens: usize, finish: &FinishReason, include_stop: bool) -> usize {
    match finish {
        FinishReason::Stop { matched_tokens } if !include_stop => tokens.saturating_sub(*matched_tokens),
        _ => tokens,
    }
}

/// One choice at `index`; `echo` is the prompt to show before the output.
pub fn choice(index: usize, c: &ChoiceOutput, echo: Option<&[u32]>, shape: Shape) -> Value {
    let shown = visible(c.tokens.len(), &c.finish, shape.include_stop);
    let prefix = echo.unwrap_or_default();
    let text = detokenize(&[prefix, &c.tokens[..shown]].concat());
    let finish = finish_reason(&c.finish);
    if shape.chat {
        let lp = if shape.logprobs { logprobs::chat(&c.logprobs) } else { Value::Null };
        return json!({
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": lp,
            "token_ids": c.tokens,
            "finish_reason": finish,
        });
    }
    let lp = if shape.logprobs {
        let prefix_bytes: Vec<u8> = prefix.iter().filter_map(|t| u8::try_from(*t).ok()).collect();
        logprobs::completion(&c.logprobs, &logprobs::text_offsets(&prefix_bytes, &c.tokens))
    } else {
        Value::Null
    };
    json!({"index": index, "text": text, "logprobs": lp, "token_ids": c.tokens, "finish_reason": finish})
}

/// `usage`.
pub fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// OpenAI's `object` of a response (`chunk` for a stream's).
pub fn object(chat: bool, chunk: bool) -> &'static str {
    match (chat, chunk) {
        (true, true) => "chat.completion.chunk",
        (true, false) => "chat.completion",
        (false, _) => "text_completion",
    }
}

/// The whole response.
pub fn body(
    head: &Head,
    choices: Vec<Value>,
    usage: Value,
    kv_transfer_params: Value,
    kvconnect: Value,
) -> Value {
    json!({
        "id": head.id,
        "object": object(head.chat, false),
        "created": head.created,
        "model": head.model,
        "choices": choices,
        "usage": usage,
        "kv_transfer_params": kv_transfer_params,
        "kvconnect": kvconnect,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(tokens: &[u32], finish: FinishReason) -> ChoiceOutput {
        ChoiceOutput { tokens: tokens.to_vec(), logprobs: Vec::new(), finish }
    }

    const PLAIN: Shape = Shape { chat: false, logprobs: false, include_stop: false };

    #[test]
    fn a_stop_sequence_is_cut_from_the_text_but_not_from_the_tokens() {
        let c = out(b"ab\n\n".map(u32::from).as_slice(), FinishReason::Stop { matched_tokens: 2 });
        let v = choice(0, &c, None, PLAIN);
        assert_eq!(v["text"], "ab");
        assert_eq!(v["finish_reason"], "stop");
        assert_eq!(v["token_ids"].as_array().unwrap().len(), 4);
        let kept = choice(0, &c, None, Shape { include_stop: true, ..PLAIN });
        assert_eq!(kept["text"], "ab\n\n");
        assert_eq!(choice(0, &out(&[97], FinishReason::Length), None, PLAIN)["finish_reason"], "length");
    }

    #[test]
    fn echo_puts_the_prompt_in_front_and_chat_moves_the_text_into_the_message() {
        let c = out(&[33], FinishReason::Length);
        assert_eq!(choice(3, &c, Some(&[104, 105]), PLAIN)["text"], "hi!");
        let chat = choice(1, &c, None, Shape { chat: true, ..PLAIN });
        assert_eq!(chat["message"], json!({"role": "assistant", "content": "!"}));
        assert_eq!(chat["index"], 1);
        let head = Head { id: "x".into(), model: "m".into(), created: 5, chat: true };
        let b = body(&head, vec![chat], usage(2, 1), Value::Null, json!({}));
        assert_eq!(b["object"], "chat.completion");
        assert_eq!(b["usage"]["total_tokens"], 3);
    }
}
