//! The reference engine's byte-level tokenizer: token `i` is byte `i` (vocab 256), so any
//! UTF-8 text round-trips and no vocabulary file is needed.

/// Vocabulary size of the byte tokenizer.
pub const VOCAB_SIZE: u32 = 256;

/// The text's UTF-8 bytes as token ids.
pub fn tokenize(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Token ids back to text. Ids past 255 cannot come from this tokenizer and become U+FFFD,
/// as do byte sequences that are not valid UTF-8.
pub fn detokenize(tokens: &[u32]) -> String {
    let mut bytes = Vec::with_capacity(tokens.len());
    let mut out = String::new();
    for t in tokens {
        match u8::try_from(*t) {
            Ok(b) => bytes.push(b),
            Err(_) => {
                out.push_str(&String::from_utf8_lossy(&bytes));
                bytes.clear();
                out.push(char::REPLACEMENT_CHARACTER);
            }
        }
    }
    out.push_str(&String::from_utf8_lossy(&bytes));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let s = "héllo, wörld ✓";
        assert_eq!(detokenize(&tokenize(s)), s);
        assert_eq!(tokenize("AB"), vec![65, 66]);
    }

    #[test]
    fn out_of_vocab_ids_become_replacement_chars() {
        assert_eq!(detokenize(&[104, 300, 105]), "h\u{FFFD}i");
    }
}
