//! The flexkv settings and where they come from.
//!
//! Keys (FlexKV's names): `cpu_cache_gb`, `ssd_cache_gb`, `ssd_cache_dir`,
//! `num_transfer_threads`, `enable_ssd_promotion`. Each is looked up, first match wins, in:
//!
//! 1. `kv_connector_extra_config` of the kv-transfer-config;
//! 2. the environment variable `FLEXKV_<KEY>` (upper case, e.g. `FLEXKV_CPU_CACHE_GB`);
//! 3. the file named by `FLEXKV_CONFIG_PATH`: JSON (`.json`, or text starting with `{`) or
//!    flat YAML (`key: value` lines);
//! 4. the default.
//!
//! Resolution is a pure function of the extra config and an environment lookup, so tests
//! never touch the process environment.

use crate::yaml;
use serde_json::{Map, Value};
use std::fmt;
use std::path::PathBuf;

/// Default CPU tier budget in GB.
pub const DEFAULT_CPU_CACHE_GB: f64 = 1.0;
/// Default number of transfer threads.
pub const DEFAULT_TRANSFER_THREADS: usize = 2;
/// The keys flexkv reads.
pub const KEYS: [&str; 5] =
    ["cpu_cache_gb", "ssd_cache_gb", "ssd_cache_dir", "num_transfer_threads", "enable_ssd_promotion"];
const MAX_THREADS: usize = 256;

/// Where a setting came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `kv_connector_extra_config`.
    ExtraConfig,
    /// An environment variable.
    Env(String),
    /// The file named by `FLEXKV_CONFIG_PATH`.
    File(PathBuf),
    /// Built in.
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::ExtraConfig => f.write_str("kv_connector_extra_config"),
            Source::Env(v) => write!(f, "environment variable {v}"),
            Source::File(p) => write!(f, "config file {}", p.display()),
            Source::Default => f.write_str("default"),
        }
    }
}

/// Settings that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// FLEXKV_CONFIG_PATH names a file that cannot be read.
    #[error("FLEXKV_CONFIG_PATH={path}: cannot read the file ({reason}); fix the path or unset FLEXKV_CONFIG_PATH")]
    FileUnreadable {
        /// The path.
        path: String,
        /// The OS error.
        reason: String,
    },
    /// The config file does not parse.
    #[error("FLEXKV_CONFIG_PATH={path}: not valid {format}: {reason}")]
    FileInvalid {
        /// The path.
        path: String,
        /// `JSON` or `flat YAML`.
        format: &'static str,
        /// What is wrong, with its line.
        reason: String,
    },
    /// A value of the wrong type or range.
    #[error("flexkv setting '{key}' = {value} (from {from}) is invalid: {reason}")]
    BadValue {
        /// The key.
        key: &'static str,
        /// The value as given.
        value: String,
        /// Where it came from.
        from: Source,
        /// What is expected.
        reason: String,
    },
    /// Settings that are fine alone but not together.
    #[error("flexkv settings do not fit together: {0}")]
    Inconsistent(String),
}

/// The resolved settings.
#[derive(Debug, Clone, PartialEq)]
pub struct FlexkvConfig {
    /// CPU tier budget in GB (10^9 bytes).
    pub cpu_cache_gb: f64,
    /// SSD tier budget in GB; 0 disables the SSD tier.
    pub ssd_cache_gb: f64,
    /// Directory (or existing file) of the SSD tier.
    pub ssd_cache_dir: Option<PathBuf>,
    /// Transfer worker threads.
    pub num_transfer_threads: usize,
    /// Copy a block hit on SSD back into the CPU tier.
    pub enable_ssd_promotion: bool,
    /// Where each key came from, in `KEYS` order.
    pub sources: Vec<(&'static str, Source)>,
}

impl FlexkvConfig {
    /// CPU tier budget in bytes.
    pub fn cpu_bytes(&self) -> u64 {
        (self.cpu_cache_gb * 1e9) as u64
    }

    /// SSD tier budget in bytes.
    pub fn ssd_bytes(&self) -> u64 {
        (self.ssd_cache_gb * 1e9) as u64
    }

    /// True when the SSD tier is on.
    pub fn ssd_enabled(&self) -> bool {
        self.ssd_cache_gb > 0.0
    }

    /// Where `key` came from.
    pub fn source_of(&self, key: &str) -> Option<&Source> {
        self.sources.iter().find(|(k, _)| *k == key).map(|(_, s)| s)
    }

    /// Resolves the settings from the extra config, then the environment, then the file.
    pub fn resolve(
        extra: &Map<String, Value>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<FlexkvConfig, ConfigError> {
        let file = match env("FLEXKV_CONFIG_PATH").filter(|p| !p.trim().is_empty()) {
            Some(p) => Some(read_file(&p)?),
            None => None,
        };
        let mut sources = Vec::new();
        let mut lookup = |key: &'static str| -> Option<(Raw, Source)> {
            let found = if let Some(v) = extra.get(key).filter(|v| !v.is_null()) {
                Some((Raw::Json(v.clone()), Source::ExtraConfig))
            } else if let Some(v) = env(&format!("FLEXKV_{}", key.to_ascii_uppercase())) {
                Some((Raw::Text(v), Source::Env(format!("FLEXKV_{}", key.to_ascii_uppercase()))))
            } else if let Some((path, pairs)) = &file {
                pairs.iter().find(|(k, _)| k == key).map(|(_, v)| (v.clone(), Source::File(path.clone())))
            } else {
                None
            };
            sources.push((key, found.as_ref().map(|(_, s)| s.clone()).unwrap_or(Source::Default)));
            found
        };
        let cpu_cache_gb = match lookup("cpu_cache_gb") {
            Some((v, s)) => gb("cpu_cache_gb", v, s)?,
            None => DEFAULT_CPU_CACHE_GB,
        };
        let ssd_cache_gb = match lookup("ssd_cache_gb") {
            Some((v, s)) => gb("ssd_cache_gb", v, s)?,
            None => 0.0,
        };
        let ssd_cache_dir = match lookup("ssd_cache_dir") {
            Some((v, s)) => {
                let t = v.text();
                if t.trim().is_empty() {
                    return Err(bad("ssd_cache_dir", &v, s, "an empty path; give a directory"));
                }
                Some(PathBuf::from(t))
            }
            None => None,
        };
        let num_transfer_threads = match lookup("num_transfer_threads") {
            Some((v, s)) => match v.as_u64() {
                Some(n) if n >= 1 && n as usize <= MAX_THREADS => n as usize,
                _ => {
                    return Err(bad(
                        "num_transfer_threads",
                        &v,
                        s,
                        &format!("expected a whole number from 1 to {MAX_THREADS}"),
                    ))
                }
            },
            None => DEFAULT_TRANSFER_THREADS,
        };
        let enable_ssd_promotion = match lookup("enable_ssd_promotion") {
            Some((v, s)) => {
                v.as_bool().ok_or_else(|| bad("enable_ssd_promotion", &v, s, "expected true or false"))?
            }
            None => true,
        };
        if cpu_cache_gb == 0.0 {
            return Err(ConfigError::Inconsistent(
                "cpu_cache_gb is 0, but the CPU tier stages every block (saves land there first and SSD blocks \
                 are written from it); set cpu_cache_gb to a positive size such as 1"
                    .to_owned(),
            ));
        }
        if ssd_cache_gb > 0.0 && ssd_cache_dir.is_none() {
            return Err(ConfigError::Inconsistent(format!(
                "ssd_cache_gb is {ssd_cache_gb} but ssd_cache_dir is not set; set ssd_cache_dir to a writable \
                 directory or ssd_cache_gb to 0 to run without the SSD tier"
            )));
        }
        Ok(FlexkvConfig {
            cpu_cache_gb,
            ssd_cache_gb,
            ssd_cache_dir,
            num_transfer_threads,
            enable_ssd_promotion,
            sources,
        })
    }

    /// Resolves against the real process environment.
    pub fn from_extra_and_process_env(extra: &Map<String, Value>) -> Result<FlexkvConfig, ConfigError> {
        FlexkvConfig::resolve(extra, &|k| std::env::var(k).ok())
    }
}

/// A raw value before it is typed: JSON from the extra config or a JSON file, text from the
/// environment or a YAML file.
#[derive(Debug, Clone)]
enum Raw {
    Json(Value),
    Text(String),
}

impl Raw {
    fn text(&self) -> String {
        match self {
            Raw::Json(Value::String(s)) | Raw::Text(s) => s.clone(),
            Raw::Json(v) => v.to_string(),
        }
    }

    fn shown(&self) -> String {
        match self {
            Raw::Json(v) => v.to_string(),
            Raw::Text(s) => format!("'{s}'"),
        }
    }

    fn as_f64(&self) -> Option<f64> {
        match self {
            Raw::Json(Value::Number(n)) => n.as_f64(),
            Raw::Json(Value::String(s)) | Raw::Text(s) => s.trim().parse().ok(),
            _ => None,
        }
    }

    fn as_u64(&self) -> Option<u64> {
        match self {
            Raw::Json(Value::Number(n)) => n.as_u64(),
            Raw::Json(Value::String(s)) | Raw::Text(s) => s.trim().parse().ok(),
            _ => None,
        }
    }

    fn as_bool(&self) -> Option<bool> {
        match self {
            Raw::Json(Value::Bool(b)) => Some(*b),
            Raw::Json(Value::String(s)) | Raw::Text(s) => match s.trim().to_ascii_lowercase().as_str() {
                "true" | "yes" | "on" | "1" => Some(true),
                "false" | "no" | "off" | "0" => Some(false),
                _ => None,
            },
            _ => None,
        }
    }
}

fn bad(key: &'static str, v: &Raw, source: Source, reason: &str) -> ConfigError {
    ConfigError::BadValue { key, value: v.shown(), from: source, reason: reason.to_owned() }
}

fn gb(key: &'static str, v: Raw, s: Source) -> Result<f64, ConfigError> {
    match v.as_f64() {
        Some(x) if (0.0..=1e6).contains(&x) => Ok(x),
        _ => Err(bad(key, &v, s, "expected a size in GB, a number from 0 to 1000000 (e.g. 4 or 0.5)")),
    }
}

type FilePairs = (PathBuf, Vec<(String, Raw)>);

fn read_file(path: &str) -> Result<FilePairs, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::FileUnreadable { path: path.to_owned(), reason: e.to_string() })?;
    let is_json = path.to_ascii_lowercase().ends_with(".json") || text.trim_start().starts_with('{');
    let pairs = if is_json {
        let v: Value = serde_json::from_str(&text).map_err(|e| ConfigError::FileInvalid {
            path: path.to_owned(),
            format: "JSON",
            reason: e.to_string(),
        })?;
        let Value::Object(obj) = v else {
            return Err(ConfigError::FileInvalid {
                path: path.to_owned(),
                format: "JSON",
                reason: "the top level must be an object like {\"cpu_cache_gb\": 4}".to_owned(),
            });
        };
        obj.into_iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k, Raw::Json(v))).collect()
    } else {
        yaml::parse_flat(&text)
            .map_err(|e| ConfigError::FileInvalid {
                path: path.to_owned(),
                format: "flat YAML",
                reason: e.to_string(),
            })?
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| (k, Raw::Text(v))))
            .collect()
    };
    Ok((PathBuf::from(path), pairs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    fn extra(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn defaults() {
        let c = FlexkvConfig::resolve(&Map::new(), &env(&[])).unwrap();
        assert_eq!(c.cpu_cache_gb, DEFAULT_CPU_CACHE_GB);
        assert!(!c.ssd_enabled());
        assert_eq!(c.num_transfer_threads, DEFAULT_TRANSFER_THREADS);
        assert!(c.enable_ssd_promotion);
        assert_eq!(c.source_of("cpu_cache_gb"), Some(&Source::Default));
    }

    #[test]
    fn precedence_is_extra_then_env_then_file() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("flexkv.yml");
        std::fs::write(
            &yaml,
            "cpu_cache_gb: 3\nssd_cache_gb: 5\nssd_cache_dir: /from/file\nnum_transfer_threads: 3\n",
        )
        .unwrap();
        let p = yaml.to_str().unwrap();
        let e = env(&[("FLEXKV_CONFIG_PATH", p), ("FLEXKV_CPU_CACHE_GB", "2"), ("FLEXKV_SSD_CACHE_GB", "7")]);
        let c = FlexkvConfig::resolve(&extra(serde_json::json!({"cpu_cache_gb": 1.5})), &e).unwrap();
        assert_eq!(c.cpu_cache_gb, 1.5);
        assert_eq!(c.source_of("cpu_cache_gb"), Some(&Source::ExtraConfig));
        assert_eq!(c.ssd_cache_gb, 7.0);
        assert_eq!(c.source_of("ssd_cache_gb"), Some(&Source::Env("FLEXKV_SSD_CACHE_GB".into())));
        assert_eq!(c.ssd_cache_dir.as_deref(), Some(std::path::Path::new("/from/file")));
        assert_eq!(c.num_transfer_threads, 3);
        assert_eq!(c.source_of("num_transfer_threads"), Some(&Source::File(yaml.clone())));

        let json = dir.path().join("flexkv.json");
        std::fs::write(&json, r#"{"cpu_cache_gb": 0.25, "enable_ssd_promotion": false, "other": [1]}"#)
            .unwrap();
        let c = FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CONFIG_PATH", json.to_str().unwrap())]))
            .unwrap();
        assert_eq!(c.cpu_cache_gb, 0.25);
        assert!(!c.enable_ssd_promotion);
    }

    #[test]
    fn bad_values_name_key_value_and_source() {
        let e = FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CPU_CACHE_GB", "lots")])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "flexkv setting 'cpu_cache_gb' = 'lots' (from environment variable FLEXKV_CPU_CACHE_GB) is invalid: \
             expected a size in GB, a number from 0 to 1000000 (e.g. 4 or 0.5)"
        );
        let e =
            FlexkvConfig::resolve(&extra(serde_json::json!({"cpu_cache_gb": -1})), &env(&[])).unwrap_err();
        assert!(e.to_string().contains("kv_connector_extra_config"), "{e}");
        let e = FlexkvConfig::resolve(&extra(serde_json::json!({"num_transfer_threads": 0})), &env(&[]))
            .unwrap_err();
        assert!(e.to_string().contains("from 1 to 256"), "{e}");
        let e = FlexkvConfig::resolve(&extra(serde_json::json!({"cpu_cache_gb": 0})), &env(&[])).unwrap_err();
        assert!(e.to_string().contains("cpu_cache_gb is 0"), "{e}");
        let e = FlexkvConfig::resolve(&extra(serde_json::json!({"ssd_cache_gb": 2})), &env(&[])).unwrap_err();
        assert!(e.to_string().contains("ssd_cache_dir is not set"), "{e}");
        let e =
            FlexkvConfig::resolve(&extra(serde_json::json!({"enable_ssd_promotion": "maybe"})), &env(&[]))
                .unwrap_err();
        assert!(e.to_string().contains("expected true or false"), "{e}");
    }

    #[test]
    fn unparsable_or_missing_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let y = dir.path().join("bad.yaml");
        std::fs::write(&y, "cpu_cache_gb: 1\nssd:\n  dir: x\n").unwrap();
        let e = FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CONFIG_PATH", y.to_str().unwrap())]))
            .unwrap_err();
        assert!(matches!(e, ConfigError::FileInvalid { format: "flat YAML", .. }), "{e}");
        assert!(e.to_string().contains("line 3"), "{e}");
        let j = dir.path().join("bad.json");
        std::fs::write(&j, "{\"cpu_cache_gb\": }").unwrap();
        let e = FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CONFIG_PATH", j.to_str().unwrap())]))
            .unwrap_err();
        assert!(matches!(e, ConfigError::FileInvalid { format: "JSON", .. }), "{e}");
        let e =
            FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CONFIG_PATH", "/nonexistent/flexkv.yml")]))
                .unwrap_err();
        assert!(e.to_string().contains("cannot read the file"), "{e}");
    }
}
