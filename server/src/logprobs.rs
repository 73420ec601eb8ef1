//! Log-probabilities in OpenAI's shapes: a completion choice's `logprobs` (`tokens`,
//! `token_logprobs`, `top_logprobs` as token text → logprob with the chosen token included,
//! as vLLM does, and `text_offset`) and a chat choice's (`content: [{token, logprob, bytes,
//! top_logprobs: [{token, logprob, bytes}]}]`).
//!
//! A token's text is its byte when that byte is a character (ASCII); any other byte is shown
//! as `bytes:\xNN`, as OpenAI shows tokens that are not whole characters, so every byte keeps
//! its own key in `top_logprobs`. `bytes` always holds the token's byte.

use kvconnect_engine::TokenLogprobs;
use serde_json::{json, Map, Value};

/// The lowest log-probability written (OpenAI and vLLM write -9999.0 for -inf).
const FLOOR: f32 = -9999.0;

/// A token as logprobs name it.
pub fn token_text(token: u32) -> String {
    match u8::try_from(token) {
        Ok(b) if b.is_ascii() => char::from(b).to_string(),
        Ok(b) => format!("bytes:\\x{b:02x}"),
        Err(_) => format!("token_id:{token}"),
    }
}

fn token_bytes(token: u32) -> Vec<u8> {
    u8::try_from(token).map(|b| vec![b]).unwrap_or_default()
}

fn value(lp: f32) -> Value {
    let lp = if lp.is_nan() { FLOOR } else { lp.max(FLOOR) };
    json!(lp)
}

/// Characters of the text these bytes show (an incomplete or invalid sequence counts as the
/// replacement characters the text holds for it).
pub fn char_len(bytes: &[u8]) -> usize {
    String::from_utf8_lossy(bytes).chars().count()
}

/// The character offset in a choice's text of each of `tokens`, the text starting with
/// `prefix` (the echoed prompt's bytes, or nothing).
pub fn text_offsets(prefix: &[u8], tokens: &[u32]) -> Vec<usize> {
    let mut bytes = prefix.to_vec();
    let mut out = Vec::with_capacity(tokens.len());
    for t in tokens {
        out.push(char_len(&bytes));
        bytes.extend(token_bytes(*t));
    }
    out
}

/// A completion choice's `logprobs` for these tokens at these text offsets.
pub fn completion(lps: &[TokenLogprobs], offsets: &[usize]) -> Value {
    let top: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut m = Map::new();
            for (t, lp) in &l.top {
                m.insert(token_text(*t), value(*lp));
            }
            m.insert(token_text(l.token), value(l.logprob));
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": lps.iter().map(|l| token_text(l.token)).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| value(l.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// The entries of a chat choice's `logprobs.content` for these tokens.
pub fn chat_content(lps: &[TokenLogprobs]) -> Vec<Value> {
    let entry =
        |t: u32, lp: f32| json!({"token": token_text(t), "logprob": value(lp), "bytes": token_bytes(t)});
    lps.iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = Value::Array(l.top.iter().map(|(t, lp)| entry(*t, *lp)).collect());
            e
        })
        .collect()
}

/// A chat choice's `logprobs`.
pub fn chat(lps: &[TokenLogprobs]) -> Value {
    json!({"content": chat_content(lps), "refusal": null})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(token: u32, logprob: f32, top: &[(u32, f32)]) -> TokenLogprobs {
        TokenLogprobs { token, logprob, top: top.to_vec() }
    }

    #[test]
    fn bytes_that_are_no_character_get_their_own_names() {
        assert_eq!(token_text(65), "A");
        assert_eq!(token_text(0xe2), "bytes:\\xe2");
        assert_ne!(token_text(0xe2), token_text(0x82));
    }

    #[test]
    fn completion_logprobs_include_the_chosen_token_in_the_top_dict() {
        let v = completion(&[lp(97, -0.5, &[(98, -0.2)]), lp(98, f32::NEG_INFINITY, &[])], &[0, 1]);
        assert_eq!(v["tokens"], json!(["a", "b"]));
        assert_eq!(v["token_logprobs"], json!([-0.5, -9999.0]));
        assert_eq!(v["top_logprobs"][0], json!({"a": -0.5, "b": -0.2f32}));
        assert_eq!(v["top_logprobs"][1], json!({"b": -9999.0}));
        assert_eq!(v["text_offset"], json!([0, 1]));
    }

    #[test]
    fn chat_logprobs_list_the_top_tokens_with_bytes() {
        let v = chat(&[lp(0xc3, -1.0, &[(0xc3, -1.0), (32, -2.0)])]);
        let c = &v["content"][0];
        assert_eq!(c["token"], "bytes:\\xc3");
        assert_eq!(c["bytes"], json!([0xc3]));
        assert_eq!(c["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(c["top_logprobs"][1], json!({"token": " ", "logprob": -2.0, "bytes": [32]}));
    }

    #[test]
    fn text_offsets_count_characters_of_the_text() {
        // "é" is two bytes but one character; the echoed prefix "ab" shifts everything by 2.
        assert_eq!(text_offsets(b"ab", &[0xc3, 0xa9, 120]), vec![2, 3, 3]);
    }
}
