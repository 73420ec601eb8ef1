//! The flat subset of YAML that FlexKV config files use: one `key: value` per line,
//! comments, blank lines and a leading `---`. Anything nested (indented lines, lists, empty
//! values followed by a block) is refused with its line number rather than half-read.

/// A line the parser cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct YamlError {
    /// 1-based line.
    pub line: usize,
    /// What is wrong.
    pub reason: String,
}

/// Parses `text` into `(key, scalar)` pairs in file order. Scalars keep their text with
/// quotes removed; `~`/`null`/empty values are `None`.
pub fn parse_flat(text: &str) -> Result<Vec<(String, Option<String>)>, YamlError> {
    let mut out: Vec<(String, Option<String>)> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let err = |reason: String| YamlError { line, reason };
        let content = strip_comment(raw);
        if content.trim().is_empty() || (line == 1 || out.is_empty()) && content.trim() == "---" {
            continue;
        }
        if content.starts_with(' ') || content.starts_with('\t') {
            return Err(err(format!(
                "'{}' is indented: only flat 'key: value' lines are supported, no nested maps",
                raw.trim()
            )));
        }
        if content.starts_with("- ") || content.trim() == "-" {
            return Err(err("lists are not supported: write flat 'key: value' lines".to_owned()));
        }
        let Some((k, v)) = content.split_once(':') else {
            return Err(err(format!("'{}' is not a 'key: value' line", raw.trim())));
        };
        let key = unquote(k.trim()).map_err(&err)?;
        if key.is_empty() {
            return Err(err("empty key".to_owned()));
        }
        let v = v.trim();
        let value = match v {
            "" | "~" | "null" | "Null" | "NULL" => None,
            _ if v.starts_with('{') || v.starts_with('[') || v.starts_with('|') || v.starts_with('>') => {
                return Err(err(format!(
                    "value of '{key}' is a flow or block collection ('{v}'): only scalars are supported"
                )))
            }
            _ => Some(unquote(v).map_err(&err)?),
        };
        if out.iter().any(|(k2, _)| *k2 == key) {
            return Err(err(format!("'{key}' appears twice")));
        }
        out.push((key, value));
    }
    Ok(out)
}

fn strip_comment(line: &str) -> &str {
    // A '#' starts a comment at the line start or after whitespace, outside quotes.
    let mut quote: Option<char> = None;
    let mut prev_space = true;
    for (i, c) in line.char_indices() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '"' || c == '\'' => quote = Some(c),
            None if c == '#' && prev_space => return line[..i].trim_end(),
            None => {}
        }
        prev_space = c.is_whitespace();
    }
    line.trim_end()
}

fn unquote(s: &str) -> Result<String, String> {
    for q in ['"', '\''] {
        if let Some(rest) = s.strip_prefix(q) {
            return match rest.strip_suffix(q) {
                Some(inner) => Ok(inner.to_owned()),
                None => Err(format!("unterminated quote in {s}")),
            };
        }
    }
    Ok(s.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_flat_pairs_with_comments_and_quotes() {
        let t = "---\n# FlexKV\ncpu_cache_gb: 4   # four\nssd_cache_dir: \"/data/kv #1\"\nenable_ssd_promotion: true\nempty:\n";
        let p = parse_flat(t).unwrap();
        assert_eq!(
            p,
            vec![
                ("cpu_cache_gb".into(), Some("4".into())),
                ("ssd_cache_dir".into(), Some("/data/kv #1".into())),
                ("enable_ssd_promotion".into(), Some("true".into())),
                ("empty".into(), None),
            ]
        );
    }

    #[test]
    fn nested_lists_and_garbage_are_errors_with_lines() {
        assert_eq!(parse_flat("a: 1\nb:\n  c: 2\n").unwrap_err().line, 3);
        assert_eq!(parse_flat("- 1\n").unwrap_err().line, 1);
        assert_eq!(parse_flat("a: 1\njust words\n").unwrap_err().line, 2);
        assert!(parse_flat("a: [1, 2]").unwrap_err().reason.contains("only scalars"));
        assert!(parse_flat("a: 1\na: 2").unwrap_err().reason.contains("twice"));
        assert!(parse_flat("a: \"x").unwrap_err().reason.contains("unterminated"));
    }
}
