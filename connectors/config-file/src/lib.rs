//! The config files cache connectors are configured with, read as their users write them:
//! LMCache's `LMCACHE_CONFIG_FILE` (YAML) and FlexKV's `FLEXKV_CONFIG_PATH` (YAML or JSON).
//!
//! A file is parsed whole by a YAML library (`serde_norway`; JSON with `serde_json`), so nested
//! values, lists (`nixl_backends: [UCX]`), quoting and every scalar form are read as YAML
//! defines them. The top level must be a mapping; each of its keys comes back with its value
//! as JSON and the line it is on, so a connector can say which file, key and line a bad value
//! came from. What a key means is the connector's business, not this crate's.

use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The largest config file read: far above any real one, small enough that a mistaken path
/// (a log, a model's weights) fails at once instead of filling memory.
pub const MAX_FILE_BYTES: u64 = 16 << 20;

/// Reads a config file's text: a regular file of at most [`MAX_FILE_BYTES`]. A device such as
/// `/dev/zero`, a pipe or a directory is refused before a byte is read, so a wrong path is an
/// error instead of a read without end.
pub fn read_text(path: &Path) -> std::io::Result<String> {
    use std::io::{Error, ErrorKind};
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "not a regular file (a device, a pipe or a directory); give the path of the file itself",
        ));
    }
    let too_big = || {
        Error::new(
            ErrorKind::InvalidData,
            format!(
                "larger than the {} MiB a config file may have; is this the right file?",
                MAX_FILE_BYTES >> 20
            ),
        )
    };
    if meta.len() > MAX_FILE_BYTES {
        return Err(too_big());
    }
    let mut text = String::new();
    // The cap holds even if the file grows between the check and the read.
    std::fs::File::open(path)?.take(MAX_FILE_BYTES + 1).read_to_string(&mut text)?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(too_big());
    }
    Ok(text)
}

/// How a file is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// YAML (also what plain `key: value` lines are).
    Yaml,
    /// JSON: the name ends in `.json` or the text starts with `{`.
    Json,
}

impl Format {
    /// `YAML` or `JSON`, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Format::Yaml => "YAML",
            Format::Json => "JSON",
        }
    }
}

/// One top-level key of a file.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The key as written.
    pub key: String,
    /// Its value (YAML's `null`, `~` and an empty value are `Value::Null`).
    pub value: Value,
    /// 1-based line of the key (0 when it cannot be placed, e.g. a flow mapping on one line).
    pub line: usize,
}

/// A config file, read and parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigFile {
    /// The environment variable that named it (`LMCACHE_CONFIG_FILE`), for messages.
    pub var: String,
    /// The path as given.
    pub path: PathBuf,
    /// How it is written.
    pub format: Format,
    /// Its top-level keys in file order.
    pub entries: Vec<Entry>,
}

/// A file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// It cannot be read.
    #[error("{var}={}: cannot read the file: {source}; fix the path or unset {var}", path.display())]
    Unreadable {
        /// The variable naming it.
        var: String,
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// It does not parse.
    #[error("{var}={}: line {line}, column {column}: not valid {}: {message}", path.display(), format.name())]
    Syntax {
        /// The variable naming it.
        var: String,
        /// The path.
        path: PathBuf,
        /// The format it was read as.
        format: Format,
        /// 1-based line (0 when the parser gave none).
        line: usize,
        /// 1-based column.
        column: usize,
        /// The parser's message.
        message: String,
    },
    /// It parses, but is not a mapping of keys to values.
    #[error("{var}={}: the top level is {found}, not a mapping of keys to values; write one `key: value` per \
        line (e.g. `{example}`)", path.display())]
    NotAMapping {
        /// The variable naming it.
        var: String,
        /// The path.
        path: PathBuf,
        /// What it is instead (`a list`, `a number`, ...).
        found: String,
        /// A line of the right shape for this connector.
        example: String,
    },
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "empty",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

impl ConfigFile {
    /// Reads the file `var` names. `example` is a line shown when the file is not a mapping.
    pub fn read(var: &str, path: &Path, example: &str) -> Result<ConfigFile, FileError> {
        let text = read_text(path).map_err(|source| FileError::Unreadable {
            var: var.to_owned(),
            path: path.to_owned(),
            source,
        })?;
        ConfigFile::parse(var, path, &text, example)
    }

    /// Parses `text` as the file `var` names (`path` is for messages and the format).
    pub fn parse(var: &str, path: &Path, text: &str, example: &str) -> Result<ConfigFile, FileError> {
        let is_json = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"))
            || text.trim_start().starts_with('{');
        let format = if is_json { Format::Json } else { Format::Yaml };
        let syntax = |line: usize, column: usize, message: String| FileError::Syntax {
            var: var.to_owned(),
            path: path.to_owned(),
            format,
            line,
            column,
            message,
        };
        let value: Value = match format {
            Format::Json => serde_json::from_str(text).map_err(|e| {
                let m = e.to_string();
                // serde_json appends " at line L column C"; the variant carries them.
                let m = m.split(" at line ").next().unwrap_or(&m).to_owned();
                syntax(e.line(), e.column(), m)
            })?,
            Format::Yaml => {
                let y: serde_norway::Value = serde_norway::from_str(text).map_err(|e| {
                    let (mut line, mut column) = e.location().map_or((0, 0), |l| (l.line(), l.column()));
                    let m = e.to_string();
                    let m = m.split(" at line ").next().unwrap_or(&m).to_owned();
                    // The parser places a repeated key at the start of its mapping: point at
                    // the repetition instead.
                    // A line without its `:` is found only where the next one starts: point
                    // at the last written line before that.
                    if m.contains("could not find expected ':'") && line > 0 {
                        if let Some(l) = (1..=line).rev().find(|l| {
                            text.lines().nth(l - 1).is_some_and(|t| {
                                let t = t.trim();
                                !t.is_empty() && !t.starts_with('#') && !t.contains(':')
                            })
                        }) {
                            (line, column) = (l, 1);
                        }
                    }
                    if let Some(key) = m.strip_prefix("duplicate entry with key ") {
                        let key = key.trim_matches('"');
                        if let Some(second) = key_lines(text, key).get(1) {
                            (line, column) = (*second, 1);
                        }
                    }
                    syntax(line, column, m)
                })?;
                serde_json::to_value(&y)
                    .map_err(|e| syntax(0, 0, format!("{e} (keys must be strings and values plain YAML)")))?
            }
        };
        let map = match value {
            Value::Object(m) => m,
            // An empty file (or only comments) sets nothing.
            Value::Null => serde_json::Map::new(),
            other => {
                return Err(FileError::NotAMapping {
                    var: var.to_owned(),
                    path: path.to_owned(),
                    found: kind(&other).to_owned(),
                    example: example.to_owned(),
                })
            }
        };
        let mut entries: Vec<Entry> =
            map.into_iter().map(|(key, value)| Entry { line: key_line(text, &key), key, value }).collect();
        entries.sort_by_key(|e| e.line);
        Ok(ConfigFile { var: var.to_owned(), path: path.to_owned(), format, entries })
    }

    /// The entry of `key`, if the file sets it.
    pub fn get(&self, key: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.key == key)
    }

    /// `LMCACHE_CONFIG_FILE /etc/lmcache.yaml line 3`: where an entry came from.
    pub fn place(&self, entry: &Entry) -> String {
        if entry.line == 0 {
            format!("{} {}", self.var, self.path.display())
        } else {
            format!("{} {} line {}", self.var, self.path.display(), entry.line)
        }
    }
}

/// The 1-based line on which top-level `key` is written (unindented, plain or quoted, then
/// `:`; for JSON the first line holding `"key"` followed by `:`), or 0.
pub fn key_line(text: &str, key: &str) -> usize {
    key_lines(text, key).first().copied().unwrap_or(0)
}

/// Every line on which top-level `key` is written, as [`key_line`] finds them.
fn key_lines(text: &str, key: &str) -> Vec<usize> {
    let mut out = Vec::new();
    let quoted = [format!("\"{key}\""), format!("'{key}'"), key.to_owned()];
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        let indented = t.len() != line.len();
        for q in &quoted {
            // JSON keys are indented inside their braces; YAML's top-level keys are not.
            let json = q.starts_with('"') && (indented || t.starts_with('{') || t.starts_with(','));
            if indented && !json {
                continue;
            }
            let t = t.trim_start_matches(['{', ',']).trim_start();
            if let Some(rest) = t.strip_prefix(q.as_str()) {
                if rest.trim_start().starts_with(':') {
                    out.push(i + 1);
                    break;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(name: &str, text: &str) -> Result<ConfigFile, FileError> {
        ConfigFile::parse("LMCACHE_CONFIG_FILE", Path::new(name), text, "chunk_size: 256")
    }

    #[test]
    fn reads_yaml_scalars_lists_and_nesting_with_lines() {
        let f = parse(
            "p.yaml",
            "# LMCache prefiller\nlocal_cpu: False\nsave_unfull_chunk: true  # keep partial chunks\n\n\
             enable_pd: True\npd_role: \"sender\"\npd_buffer_size: 1073741824 # 1GB\nnixl_backends: [UCX]\n\
             remote_serde: NULL\nlocal_device: \"file://local_disk/\"\nextra_config:\n  a: 1\n",
        )
        .unwrap();
        assert_eq!(f.format, Format::Yaml);
        let keys: Vec<(&str, usize)> = f.entries.iter().map(|e| (e.key.as_str(), e.line)).collect();
        assert_eq!(
            keys,
            vec![
                ("local_cpu", 2),
                ("save_unfull_chunk", 3),
                ("enable_pd", 5),
                ("pd_role", 6),
                ("pd_buffer_size", 7),
                ("nixl_backends", 8),
                ("remote_serde", 9),
                ("local_device", 10),
                ("extra_config", 11),
            ]
        );
        assert_eq!(f.get("local_cpu").unwrap().value, json!(false));
        assert_eq!(f.get("enable_pd").unwrap().value, json!(true));
        assert_eq!(f.get("pd_buffer_size").unwrap().value, json!(1073741824u64));
        assert_eq!(f.get("nixl_backends").unwrap().value, json!(["UCX"]));
        assert_eq!(f.get("remote_serde").unwrap().value, Value::Null);
        assert_eq!(f.get("local_device").unwrap().value, json!("file://local_disk/"));
        assert_eq!(f.get("extra_config").unwrap().value, json!({"a": 1}));
        assert_eq!(f.place(f.get("pd_role").unwrap()), "LMCACHE_CONFIG_FILE p.yaml line 6");
    }

    #[test]
    fn reads_json_and_empty_files() {
        let f = parse("f.json", "{\n  \"cpu_cache_gb\": 4,\n  \"cache_config\": {\"enable_cpu\": true}\n}\n")
            .unwrap();
        assert_eq!(f.format, Format::Json);
        assert_eq!(f.get("cpu_cache_gb").unwrap().line, 2);
        assert_eq!(f.get("cache_config").unwrap().line, 3);
        assert!(parse("e.yaml", "# nothing set\n").unwrap().entries.is_empty());
    }

    #[test]
    fn errors_name_the_file_line_and_what_to_write() {
        let e = parse("bad.yaml", "chunk_size: 256\nlocal_cpu\nmax_local_cpu_size: 5\n").unwrap_err();
        let m = e.to_string();
        assert!(m.starts_with("LMCACHE_CONFIG_FILE=bad.yaml: line 2, column 1: "), "{m}");
        let m = parse("end.yaml", "chunk_size: 256\nlocal_cpu\n").unwrap_err().to_string();
        assert!(m.contains("line 2, column 1"), "{m}");
        assert!(m.contains("not valid YAML"), "{m}");
        let e = parse("dup.yaml", "chunk_size: 256\nchunk_size: 128\n").unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("duplicate"), "{e}");
        let e = parse("list.yaml", "- chunk_size: 256\n").unwrap_err().to_string();
        assert!(e.contains("the top level is a list") && e.contains("`chunk_size: 256`"), "{e}");
        let e = parse("bad.json", "{\"cpu_cache_gb\": }").unwrap_err().to_string();
        assert!(e.contains("line 1, column 18: not valid JSON"), "{e}");
        let e = ConfigFile::read("FLEXKV_CONFIG_PATH", Path::new("/nonexistent/f.yml"), "x: 1").unwrap_err();
        assert!(
            e.to_string().contains("cannot read the file")
                && e.to_string().contains("unset FLEXKV_CONFIG_PATH")
        );
    }

    #[test]
    fn devices_directories_and_huge_files_are_refused_unread() {
        let e = ConfigFile::read("LMCACHE_CONFIG_FILE", Path::new("/dev/zero"), "").unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let e = read_text(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let big = dir.path().join("big.yaml");
        std::fs::File::create(&big).unwrap().set_len(MAX_FILE_BYTES + 1).unwrap();
        let e = read_text(&big).unwrap_err().to_string();
        assert!(e.contains("larger than the 16 MiB"), "{e}");
        let ok = dir.path().join("ok.yaml");
        std::fs::write(&ok, "chunk_size: 256\n").unwrap();
        assert_eq!(read_text(&ok).unwrap(), "chunk_size: 256\n");
    }

    #[test]
    fn key_lines_ignore_nested_keys_and_comments() {
        let t = "extra_config:\n  chunk_size: 1\n# chunk_size: 2\n'chunk_size' : 3\n";
        assert_eq!(key_line(t, "chunk_size"), 4);
        assert_eq!(key_line(t, "absent"), 0);
    }
}
