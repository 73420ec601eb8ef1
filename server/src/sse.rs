//! The server-sent-event stream of a `stream: true` request, built chunk by chunk as tokens
//! arrive ([`Chunks`]), and readers of such a stream for clients and tests.
//!
//! A stream is one `data: {...}\n\n` chunk per generated token (its choice's `index`,
//! `token_ids`, `logprobs` when asked for, and the text that became safe to show), then per
//! choice a chunk with `finish_reason`, then `data: [DONE]\n\n`. Without
//! `stream_options.include_usage` the last `finish_reason` chunk also carries `usage`,
//! `kv_transfer_params` and `kvconnect`; with it every chunk has `"usage": null` and one more
//! chunk with no choices carries them, as OpenAI sends it. With stop sequences a choice's
//! text is held back by the longest one's length, so no part of the stop sequence that ends
//! it is ever sent (the token that completes it arrives before the request's end). The
//! server and the proxy send the same shapes.

use crate::engine_loop::Produced;
use crate::logprobs;
use crate::response::{self, ChoiceOutput, Head, Shape};
use kvconnect_engine::detokenize;
use serde_json::{json, Value};

pub use kvconnect_openai::stream::{collect_choices, collect_text, collect_token_ids};

/// A choice's text as its stream has shown it.
#[derive(Debug, Clone, Default)]
struct ChoiceText {
    /// The echoed prompt (completions with `echo`).
    prefix: Vec<u32>,
    /// Tokens streamed so far.
    tokens: Vec<u32>,
    /// Leading tokens whose text went out.
    shown: usize,
    /// A chunk of this choice went out (a chat delta's first carries the role).
    started: bool,
}

/// What closes a stream besides the choices' endings.
#[derive(Debug, Clone, PartialEq)]
pub struct Tail {
    /// `usage` of the whole request.
    pub usage: Value,
    /// `kv_transfer_params` (one choice only).
    pub kv_transfer_params: Value,
    /// The `kvconnect` block.
    pub kvconnect: Value,
}

/// The chunks of one streamed response.
#[derive(Debug, Clone)]
pub struct Chunks {
    head: Head,
    shape: Shape,
    include_usage: bool,
    /// Tokens of each choice held back from its text (a stop sequence may still complete).
    hold: usize,
    choices: Vec<ChoiceText>,
}

impl Chunks {
    /// A stream of `prefixes.len()` choices; `prefixes[i]` is the prompt choice `i` echoes
    /// (empty without `echo`); `longest_stop` is the longest stop sequence, in tokens.
    pub fn new(
        head: Head,
        shape: Shape,
        include_usage: bool,
        longest_stop: usize,
        prefixes: Vec<Vec<u32>>,
    ) -> Chunks {
        let hold = if shape.include_stop { 0 } else { longest_stop };
        let choices =
            prefixes.into_iter().map(|prefix| ChoiceText { prefix, ..ChoiceText::default() }).collect();
        Chunks { head, shape, include_usage, hold, choices }
    }

    fn event(&self, choices: Vec<Value>, last: Option<&Tail>) -> String {
        let mut c = json!({
            "id": self.head.id, "object": response::object(self.head.chat, true),
            "created": self.head.created, "model": self.head.model, "choices": choices,
        });
        if let Some(t) = last {
            c["usage"] = t.usage.clone();
            c["kv_transfer_params"] = t.kv_transfer_params.clone();
            c["kvconnect"] = t.kvconnect.clone();
        } else if self.include_usage {
            c["usage"] = Value::Null;
        }
        format!("data: {c}\n\n")
    }

    /// A choice entry carrying `text` (and, for a token, its id and logprobs).
    fn entry(&mut self, index: usize, text: String, token: Option<&Produced>, finish: Value) -> Value {
        let first = self.choices.get(index).is_some_and(|c| !c.started);
        if let Some(c) = self.choices.get_mut(index) {
            c.started = true;
        }
        let lp = match token.and_then(|t| t.logprobs.as_ref()).filter(|_| self.shape.logprobs) {
            None => Value::Null,
            Some(l) if self.shape.chat => {
                json!({"content": logprobs::chat_content(std::slice::from_ref(l)), "refusal": null})
            }
            Some(l) => {
                let c = self.choices.get(index);
                let before: Vec<u8> = c
                    .map(|c| {
                        c.prefix
                            .iter()
                            .chain(&c.tokens[..c.tokens.len().saturating_sub(1)])
                            .filter_map(|t| u8::try_from(*t).ok())
                            .collect()
                    })
                    .unwrap_or_default();
                logprobs::completion(std::slice::from_ref(l), &[logprobs::char_len(&before)])
            }
        };
        let mut e = if self.shape.chat {
            let mut d = json!({});
            if !text.is_empty() || token.is_some() {
                d["content"] = json!(text);
            }
            if first {
                d["role"] = json!("assistant");
            }
            json!({"index": index, "delta": d, "logprobs": lp, "finish_reason": finish})
        } else {
            json!({"index": index, "text": text, "logprobs": lp, "finish_reason": finish})
        };
        if let Some(t) = token {
            e["token_ids"] = json!([t.token]);
        }
        e
    }

    /// The chunks that open the stream: each choice's echoed prompt (nothing without echo).
    pub fn open(&mut self) -> String {
        let mut out = String::new();
        for i in 0..self.choices.len() {
            if self.choices[i].prefix.is_empty() {
                continue;
            }
            let text = detokenize(&self.choices[i].prefix);
            let e = self.entry(i, text, None, Value::Null);
            out.push_str(&self.event(vec![e], None));
        }
        out
    }

    /// The chunks of choice `index`'s new tokens, one per token.
    pub fn tokens(&mut self, index: usize, new: &[Produced]) -> String {
        let mut out = String::new();
        for p in new {
            let Some(c) = self.choices.get_mut(index) else { return out };
            c.tokens.push(p.token);
            let safe = c.tokens.len().saturating_sub(self.hold);
            let text = if safe > c.shown { detokenize(&c.tokens[c.shown..safe]) } else { String::new() };
            c.shown = c.shown.max(safe);
            let e = self.entry(index, text, Some(p), Value::Null);
            out.push_str(&self.event(vec![e], None));
        }
        out
    }

    /// The closing chunks: each choice's held-back text up to its stop sequence with its
    /// `finish_reason` (in `index` order), the usage chunk, `[DONE]`.
    pub fn close(&mut self, finished: &[ChoiceOutput], tail: &Tail) -> String {
        let mut out = String::new();
        for (i, f) in finished.iter().enumerate() {
            let shown = self.choices.get(i).map_or(0, |c| c.shown);
            let end = response::visible(f.tokens.len(), &f.finish, self.shape.include_stop);
            let text = if end > shown { detokenize(&f.tokens[shown..end]) } else { String::new() };
            let e = self.entry(i, text, None, json!(response::finish_reason(&f.finish)));
            let last = !self.include_usage && i + 1 == finished.len();
            out.push_str(&self.event(vec![e], last.then_some(tail)));
        }
        if self.include_usage || finished.is_empty() {
            out.push_str(&self.event(Vec::new(), Some(tail)));
        }
        out.push_str("data: [DONE]\n\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_engine::{FinishReason, TokenLogprobs};
    use kvconnect_openai::stream::events;

    fn head(chat: bool) -> Head {
        Head { id: "cmpl-1".into(), model: "m".into(), created: 1, chat }
    }

    fn tail() -> Tail {
        Tail {
            usage: response::usage(1, 2),
            kv_transfer_params: Value::Null,
            kvconnect: json!({"engine_id": "e"}),
        }
    }

    fn produced(t: &[u8]) -> Vec<Produced> {
        t.iter().map(|b| Produced { token: u32::from(*b), logprobs: None }).collect()
    }

    const PLAIN: Shape = Shape { chat: false, logprobs: false, include_stop: false };

    fn stream(
        shape: Shape,
        include_usage: bool,
        longest_stop: usize,
        tokens: &[u8],
        finish: FinishReason,
    ) -> String {
        let mut c = Chunks::new(head(shape.chat), shape, include_usage, longest_stop, vec![Vec::new()]);
        let mut s = c.open();
        for t in produced(tokens) {
            s.push_str(&c.tokens(0, &[t]));
        }
        let out = ChoiceOutput {
            tokens: tokens.iter().map(|b| u32::from(*b)).collect(),
            logprobs: Vec::new(),
            finish,
        };
        s + &c.close(&[out], &tail())
    }

    #[test]
    fn a_stream_has_one_chunk_per_token_then_the_closing_chunk_then_done() {
        let s = stream(PLAIN, false, 0, b"ab", FinishReason::Length);
        assert_eq!(s.matches("data: ").count(), 4, "{s}");
        assert!(s.ends_with("data: [DONE]\n\n"));
        assert_eq!(collect_text(&s).as_deref(), Some("ab"));
        assert_eq!(collect_token_ids(&s), Some(vec![97, 98]));
        let ev = events(&s).unwrap();
        assert_eq!(ev[2]["choices"][0]["finish_reason"], "length");
        assert_eq!(ev[2]["usage"]["total_tokens"], 3, "without include_usage the closing chunk has usage");
        assert!(ev[0].get("usage").is_none());
        let c = stream(Shape { chat: true, ..PLAIN }, false, 0, b"ab", FinishReason::Length);
        assert!(c.contains("\"role\":\"assistant\"") && c.contains("chat.completion.chunk"), "{c}");
        assert_eq!(collect_text(&c).as_deref(), Some("ab"));
    }

    #[test]
    fn include_usage_adds_a_chunk_without_choices() {
        let s = stream(PLAIN, true, 0, b"ab", FinishReason::Length);
        let ev = events(&s).unwrap();
        assert_eq!(ev.len(), 4, "{s}");
        assert!(ev[..3].iter().all(|e| e["usage"].is_null() && e.get("usage").is_some()), "{s}");
        assert_eq!(ev[3]["choices"], json!([]));
        assert_eq!(ev[3]["usage"]["completion_tokens"], 2);
        assert_eq!(ev[3]["kvconnect"]["engine_id"], "e");
    }

    #[test]
    fn no_part_of_the_stop_sequence_is_ever_sent() {
        // Stop "\n\n" (2 tokens): two tokens are held back, since the token that completes
        // the stop string arrives before the request's end does.
        let s = stream(PLAIN, false, 2, b"ab\n\n", FinishReason::Stop { matched_tokens: 2 });
        assert_eq!(collect_text(&s).as_deref(), Some("ab"), "{s}");
        assert_eq!(collect_token_ids(&s).unwrap().len(), 4, "every token's id still goes out");
        let ev = events(&s).unwrap();
        let texts: Vec<&str> = ev.iter().map(|e| e["choices"][0]["text"].as_str().unwrap()).collect();
        assert_eq!(texts, vec!["", "", "a", "b", ""]);
        // A stream that ends by length shows its held-back tail in the closing chunk.
        let s = stream(PLAIN, false, 3, b"abc", FinishReason::Length);
        assert_eq!(collect_text(&s).as_deref(), Some("abc"));
        let kept = stream(
            Shape { include_stop: true, ..PLAIN },
            false,
            2,
            b"a\n\n",
            FinishReason::Stop { matched_tokens: 2 },
        );
        assert_eq!(collect_text(&kept).as_deref(), Some("a\n\n"));
    }

    #[test]
    fn choices_keep_their_index_and_echo_opens_the_stream() {
        let mut c = Chunks::new(head(false), PLAIN, false, 0, vec![vec![104, 105], vec![104, 105]]);
        let mut s = c.open();
        s += &c.tokens(1, &produced(b"y"));
        s += &c.tokens(0, &produced(b"x"));
        let out = |b: u8| ChoiceOutput {
            tokens: vec![u32::from(b)],
            logprobs: Vec::new(),
            finish: FinishReason::Length,
        };
        s += &c.close(&[out(b'x'), out(b'y')], &tail());
        let got = collect_choices(&s).unwrap();
        assert_eq!(got, vec![("hix".to_owned(), vec![120]), ("hiy".to_owned(), vec![121])]);
    }

    #[test]
    fn token_chunks_carry_their_logprobs() {
        let shape = Shape { logprobs: true, ..PLAIN };
        let mut c = Chunks::new(head(false), shape, false, 0, vec![Vec::new()]);
        let lp = TokenLogprobs { token: 98, logprob: -0.25, top: vec![(98, -0.25)] };
        c.tokens(0, &produced(b"a"));
        let s = c.tokens(0, &[Produced { token: 98, logprobs: Some(lp) }]);
        let ev = events(&format!("{s}data: [DONE]\n\n")).unwrap();
        let l = &ev[0]["choices"][0]["logprobs"];
        assert_eq!(l["tokens"], json!(["b"]));
        assert_eq!(l["token_logprobs"], json!([-0.25]));
        assert_eq!(l["text_offset"], json!([1]));
        let mut chat = Chunks::new(head(true), Shape { chat: true, ..shape }, false, 0, vec![Vec::new()]);
        let lp = TokenLogprobs { token: 98, logprob: -0.25, top: Vec::new() };
        let s = chat.tokens(0, &[Produced { token: 98, logprobs: Some(lp) }]);
        assert!(s.contains("\"content\":[{\"bytes\":[98]"), "{s}");
    }
}
