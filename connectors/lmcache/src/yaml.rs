//! The subset of YAML LMCache config files use: flat `key: value` lines with scalars and
//! `#` comments. Written here so the crate needs no (deprecated) YAML dependency.

/// One `key: value` line of a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct YamlEntry {
    /// The key.
    pub key: String,
    /// The scalar, unquoted; `None` for `null`, `~`, `None` or an empty value.
    pub value: Option<String>,
    /// 1-based line number, for messages.
    pub line: usize,
    /// Indented lines that followed the key (a nested map or list the parser does not read).
    pub nested_lines: usize,
}

/// A line the parser cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct YamlError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

/// Parses flat `key: value` YAML. Indented lines are counted against the key above them (so
/// the caller can refuse nested values for keys it knows and skip them for keys it does not).
pub fn parse_flat(text: &str) -> Result<Vec<YamlEntry>, YamlError> {
    let mut out: Vec<YamlEntry> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let content = strip_comment(raw);
        if content.trim().is_empty() || content.trim() == "---" {
            continue;
        }
        if content.starts_with(' ') || content.starts_with('\t') || content.trim_start().starts_with("- ") {
            match out.last_mut() {
                Some(e) => {
                    e.nested_lines += 1;
                    continue;
                }
                None => {
                    return Err(YamlError { line, message: "indented line before any key".to_owned() });
                }
            }
        }
        let Some((k, v)) = content.split_once(':') else {
            return Err(YamlError { line, message: format!("expected `key: value`, got '{}'", raw.trim()) });
        };
        let key = k.trim().to_owned();
        if key.is_empty() {
            return Err(YamlError { line, message: "empty key".to_owned() });
        }
        let value = unquote(v.trim());
        out.push(YamlEntry { key, value, line, nested_lines: 0 });
    }
    Ok(out)
}

/// Drops a `#` comment that is not inside quotes.
fn strip_comment(line: &str) -> &str {
    let mut quote: Option<char> = None;
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            // YAML needs whitespace (or line start) before a comment's '#'.
            (None, '#') if i == 0 || line[..i].ends_with([' ', '\t']) => return &line[..i],
            _ => {}
        }
    }
    line
}

fn unquote(v: &str) -> Option<String> {
    if v.is_empty() || v == "~" || v == "null" || v == "Null" || v == "NULL" || v == "None" {
        return None;
    }
    for q in ['"', '\''] {
        if v.len() >= 2 && v.starts_with(q) && v.ends_with(q) {
            return Some(v[1..v.len() - 1].to_owned());
        }
    }
    Some(v.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_lmcache_style_file() {
        let text = "# LMCache config\nchunk_size: 256\nlocal_cpu: True  # keep\nlocal_disk: \"file:///tmp/x#y\"\nmax_local_disk_size: 5.0\nremote_url: null\nextra_config:\n  a: 1\n  b: 2\n";
        let e = parse_flat(text).unwrap();
        assert_eq!(
            e[0],
            YamlEntry { key: "chunk_size".into(), value: Some("256".into()), line: 2, nested_lines: 0 }
        );
        assert_eq!(e[1].value.as_deref(), Some("True"));
        assert_eq!(e[2].value.as_deref(), Some("file:///tmp/x#y"));
        assert_eq!(e[4].value, None);
        assert_eq!(e[5].key, "extra_config");
        assert_eq!(e[5].nested_lines, 2);
    }

    #[test]
    fn malformed_lines_name_the_line() {
        let e = parse_flat("chunk_size: 256\njust words\n").unwrap_err();
        assert_eq!(e.line, 2);
        assert!(e.to_string().contains("expected `key: value`"), "{e}");
        assert_eq!(parse_flat("  a: 1").unwrap_err().line, 1);
    }
}
