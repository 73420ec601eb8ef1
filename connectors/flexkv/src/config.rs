//! The flexkv settings and where they come from.
//!
//! Keys are FlexKV's (`cpu_cache_gb`, `ssd_cache_gb`, `ssd_cache_dir`, `enable_gds` and the
//! advanced ones of its config reference), plus kvconnect's `num_transfer_threads` and
//! `enable_ssd_promotion`. Each is looked up, first match wins, in:
//!
//! 1. `kv_connector_extra_config` of the kv-transfer-config;
//! 2. the file named by `FLEXKV_CONFIG_PATH`: YAML or JSON (`.json`, or text starting with
//!    `{`), read by a YAML library, including FlexKV's older nested `cache_config`;
//! 3. the environment variable `FLEXKV_<KEY>` (upper case, e.g. `FLEXKV_CPU_CACHE_GB`);
//! 4. the default.
//!
//! The file before the environment is FlexKV's own order ("configuration file > environment
//! variables > defaults"). Every FlexKV key is honoured, mapped to what kvconnect does
//! instead (logged at info) or refused with the kvconnect way ([`KEYS`]); a key FlexKV does
//! not have is an error in the file (as FlexKV's own loader makes it) and a warning in the
//! extra config. Sizes are FlexKV's GB: 1024^3 bytes.
//!
//! Resolution is a pure function of the extra config and an environment lookup, so tests
//! never touch the process environment.

use kvconnect_config_file::ConfigFile;
use serde_json::{Map, Value};
use std::fmt;
use std::path::{Path, PathBuf};

/// Default CPU tier budget in GB.
pub const DEFAULT_CPU_CACHE_GB: f64 = 1.0;
/// Default number of transfer threads.
pub const DEFAULT_TRANSFER_THREADS: usize = 2;
const MAX_THREADS: usize = 256;
/// Bytes in one of FlexKV's GB.
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// How one key is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Read into the settings.
    Setting,
    /// Honoured at this default (compared case-insensitively as text); any other value is
    /// refused with the remedy.
    DefaultOnly(&'static str, &'static str),
    /// Mapped to what kvconnect does instead (the info line's explanation).
    Mapped(&'static str),
    /// FlexKV's older nested `cache_config`.
    CacheConfig,
}

const SHARED: &str = "kvconnect's flexkv runs inside each worker; for a cache shared by workers use the \
    lmcache connector's remote tier (remote_url: redis://host:port)";
const ONE_FILE: &str = "the SSD tier is one file per worker, read and written with positional I/O by the \
    transfer threads (num_transfer_threads)";
const COPY_PATH: &str = "blocks are copied by kvconnect's transfer threads (host KV) or one gather kernel \
    launch per request (device KV, feature cuda)";
const LOGGING: &str = "kvconnect logs through tracing: set RUST_LOG=kvconnect_flexkv=debug; \
    counters are on the worker's /metrics";
const NO_GDS: &str =
    "kvconnect has no GPU Direct Storage path: SSD blocks are read into host memory; set enable_gds: false";
const LRU: &str =
    "kvconnect's flexkv evicts least recently used blocks; set eviction_policy: lru or remove it";
const NO_SERVER_PORT: &str =
    "the scheduler and worker halves share the cache inside the worker process; no server port is used";
const NO_MASTER: &str =
    "each kvconnect worker (one per TP rank) keeps its own cache; there is no multi-node master";
const TRACE: &str = "no trace file is written; per-tier hits and bytes are on the worker's /metrics";
const EVICTION: &str = "eviction is least recently used, of only as many blocks as the next write needs";

/// FlexKV's keys (and kvconnect's own), with how each is handled. docs/connectors/flexkv.md lists
/// the same keys (a test keeps them in step).
pub const KEYS: &[(&str, Kind)] = &[
    ("cpu_cache_gb", Kind::Setting),
    ("ssd_cache_gb", Kind::Setting),
    ("ssd_cache_dir", Kind::Setting),
    ("num_transfer_threads", Kind::Setting),
    ("enable_ssd_promotion", Kind::Setting),
    ("enable_gds", Kind::DefaultOnly("false", NO_GDS)),
    ("server_client_mode", Kind::DefaultOnly("false", SHARED)),
    ("instance_num", Kind::DefaultOnly("1", SHARED)),
    ("eviction_policy", Kind::DefaultOnly("lru", LRU)),
    ("server_recv_port", Kind::Mapped(NO_SERVER_PORT)),
    ("instance_id", Kind::Mapped("each worker has its own cache (instance_num 1)")),
    ("cpu_layout", Kind::Mapped("blocks are stored block-first, one record per block")),
    ("ssd_layout", Kind::Mapped("blocks are stored block-first, one record per block")),
    ("remote_layout", Kind::Mapped("blocks are stored block-first, one record per block")),
    ("gds_layout", Kind::Mapped("blocks are stored block-first, one record per block")),
    ("use_ce_transfer_h2d", Kind::Mapped(COPY_PATH)),
    ("use_ce_transfer_d2h", Kind::Mapped(COPY_PATH)),
    ("transfer_sms_h2d", Kind::Mapped(COPY_PATH)),
    ("transfer_sms_d2h", Kind::Mapped(COPY_PATH)),
    ("max_file_size_gb", Kind::Mapped(ONE_FILE)),
    ("iouring_entries", Kind::Mapped(ONE_FILE)),
    ("iouring_flags", Kind::Mapped(ONE_FILE)),
    ("ioring_entries", Kind::Mapped(ONE_FILE)),
    ("ioring_flags", Kind::Mapped(ONE_FILE)),
    ("master_host", Kind::Mapped(NO_MASTER)),
    ("master_ports", Kind::Mapped(NO_MASTER)),
    ("logging_prefix", Kind::Mapped(LOGGING)),
    ("log_level", Kind::Mapped(LOGGING)),
    ("num_log_interval_requests", Kind::Mapped(LOGGING)),
    ("enable_trace", Kind::Mapped(TRACE)),
    ("trace_file_path", Kind::Mapped(TRACE)),
    ("trace_max_file_size_mb", Kind::Mapped(TRACE)),
    ("trace_max_files", Kind::Mapped(TRACE)),
    ("trace_flush_interval_ms", Kind::Mapped(TRACE)),
    ("index_accel", Kind::Mapped("the radix tree is kvconnect's own (Rust)")),
    ("evict_ratio", Kind::Mapped(EVICTION)),
    ("evict_start_threshold", Kind::Mapped(EVICTION)),
    ("hit_reward_seconds", Kind::Mapped(EVICTION)),
    ("cache_config", Kind::CacheConfig),
];

/// The keys FlexKV reads only from the environment (FlexKV's `ENABLE_FLEXKV` has no prefix).
const ENV_ONLY: [&str; 1] = ["ENABLE_FLEXKV"];

/// How `key` is handled, or `None` for a key FlexKV does not have.
pub fn kind_of(key: &str) -> Option<Kind> {
    KEYS.iter().find(|(k, _)| *k == key).map(|(_, kind)| *kind)
}

/// Where a setting came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `kv_connector_extra_config`.
    ExtraConfig,
    /// An environment variable.
    Env(String),
    /// The file named by `FLEXKV_CONFIG_PATH`, at this line (0: unknown).
    File(PathBuf, usize),
    /// Built in.
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::ExtraConfig => f.write_str("kv_connector_extra_config"),
            Source::Env(v) => write!(f, "environment variable {v}"),
            Source::File(p, 0) => write!(f, "config file {}", p.display()),
            Source::File(p, line) => write!(f, "config file {} line {line}", p.display()),
            Source::Default => f.write_str("default"),
        }
    }
}

/// Settings that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file named by FLEXKV_CONFIG_PATH cannot be read or parsed.
    #[error("{0}")]
    File(#[from] kvconnect_config_file::FileError),
    /// A value of the wrong type or range.
    #[error("flexkv setting '{key}' = {value} (from {from}) is invalid: {reason}")]
    BadValue {
        /// The key.
        key: String,
        /// The value as given.
        value: String,
        /// Where it came from.
        from: Source,
        /// What is expected.
        reason: String,
    },
    /// A FlexKV feature kvconnect does not have.
    #[error("flexkv setting '{key}' = {value} (from {from}) is not supported: {remedy}")]
    Refused {
        /// The key.
        key: String,
        /// The value as given.
        value: String,
        /// Where it came from.
        from: Source,
        /// The kvconnect way to get the same thing.
        remedy: String,
    },
    /// A key FlexKV does not have, in its config file.
    #[error("{from}: '{key}' is not a FlexKV setting{hint}; FlexKV's are: {known}")]
    UnknownKey {
        /// The key.
        key: String,
        /// Where.
        from: Source,
        /// `; did you mean ...?` or empty.
        hint: String,
        /// The known keys.
        known: String,
    },
    /// Settings that are fine alone but not together.
    #[error("flexkv settings do not fit together: {0}")]
    Inconsistent(String),
}

/// The resolved settings.
#[derive(Debug, Clone, PartialEq)]
pub struct FlexkvConfig {
    /// CPU tier budget in GB (1024^3 bytes, as FlexKV counts them).
    pub cpu_cache_gb: f64,
    /// SSD tier budget in GB; 0 disables the SSD tier.
    pub ssd_cache_gb: f64,
    /// Directory (or existing file) of the SSD tier.
    pub ssd_cache_dir: Option<PathBuf>,
    /// Transfer worker threads.
    pub num_transfer_threads: usize,
    /// Copy a block hit on SSD back into the CPU tier.
    pub enable_ssd_promotion: bool,
    /// Where each setting came from, in `KEYS` order.
    pub sources: Vec<(&'static str, Source)>,
    /// One line per mapped key: what kvconnect does instead.
    pub mapped: Vec<String>,
    /// Keys of the extra config FlexKV does not have.
    pub unknown_keys: Vec<String>,
}

impl FlexkvConfig {
    /// CPU tier budget in bytes.
    pub fn cpu_bytes(&self) -> u64 {
        (self.cpu_cache_gb * GIB) as u64
    }

    /// SSD tier budget in bytes.
    pub fn ssd_bytes(&self) -> u64 {
        (self.ssd_cache_gb * GIB) as u64
    }

    /// True when the SSD tier is on.
    pub fn ssd_enabled(&self) -> bool {
        self.ssd_cache_gb > 0.0
    }

    /// Where `key` came from.
    pub fn source_of(&self, key: &str) -> Option<&Source> {
        self.sources.iter().find(|(k, _)| *k == key).map(|(_, s)| s)
    }

    /// Resolves the settings from the extra config, then the file, then the environment.
    pub fn resolve(
        extra: &Map<String, Value>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<FlexkvConfig, ConfigError> {
        let file = match env("FLEXKV_CONFIG_PATH").filter(|p| !p.trim().is_empty()) {
            Some(p) => Some(ConfigFile::read("FLEXKV_CONFIG_PATH", Path::new(&p), "cpu_cache_gb: 4")?),
            None => None,
        };
        let mut mapped = Vec::new();
        let mut unknown_keys = Vec::new();
        // The file's keys, FlexKV's older `cache_config` flattened into the ones it means.
        let mut from_file: Vec<(String, Raw, Source)> = Vec::new();
        if let Some(f) = &file {
            for e in &f.entries {
                let src = Source::File(f.path.clone(), e.line);
                if kind_of(&e.key).is_none() {
                    return Err(unknown(&e.key, src));
                }
                if e.key == "cache_config" {
                    cache_config(&e.value, &src, &mut from_file, &mut mapped)?;
                } else {
                    from_file.push((e.key.clone(), Raw::Json(e.value.clone()), src));
                }
            }
        }
        for k in extra.keys().filter(|k| kind_of(k).is_none()) {
            unknown_keys.push(format!("{k} (kv_connector_extra_config)"));
        }
        for var in ENV_ONLY {
            if let Some(v) = env(var) {
                if parse_bool(&v) == Some(false) {
                    return Err(ConfigError::Refused {
                        key: var.to_owned(),
                        value: format!("'{v}'"),
                        from: Source::Env(var.to_owned()),
                        remedy:
                            "to run without flexkv, leave FlexKVConnectorV1 out of the kv-transfer-config"
                                .to_owned(),
                    });
                }
            }
        }
        let mut sources = Vec::new();
        let mut settings: Vec<(&'static str, Raw, Source)> = Vec::new();
        for (key, kind) in KEYS {
            if *kind == Kind::CacheConfig {
                continue;
            }
            let env_var = format!("FLEXKV_{}", key.to_ascii_uppercase());
            let found = if let Some(v) = extra.get(*key).filter(|v| !v.is_null()) {
                Some((Raw::Json(v.clone()), Source::ExtraConfig))
            } else if let Some((_, v, s)) = from_file.iter().rev().find(|(k, v, _)| k == key && !v.is_null())
            {
                Some((v.clone(), s.clone()))
            } else {
                env(&env_var).map(|v| (Raw::Text(v), Source::Env(env_var)))
            };
            let Some((raw, src)) = found else {
                if *kind == Kind::Setting {
                    sources.push((*key, Source::Default));
                }
                continue;
            };
            match kind {
                Kind::Setting => {
                    sources.push((*key, src.clone()));
                    settings.push((key, raw, src));
                }
                Kind::DefaultOnly(default, remedy) => {
                    if !(raw.text().trim().eq_ignore_ascii_case(default)
                        || *default == "false" && raw.as_bool() == Some(false))
                    {
                        return Err(ConfigError::Refused {
                            key: (*key).to_owned(),
                            value: raw.shown(),
                            from: src,
                            remedy: (*remedy).to_owned(),
                        });
                    }
                }
                Kind::Mapped(what) => mapped.push(format!("{key} (from {src}): {what}")),
                Kind::CacheConfig => {}
            }
        }
        let get =
            |key: &str| settings.iter().find(|(k, _, _)| *k == key).map(|(_, r, s)| (r.clone(), s.clone()));
        let cpu_cache_gb = match get("cpu_cache_gb") {
            Some((v, s)) => gb("cpu_cache_gb", v, s)?,
            None => DEFAULT_CPU_CACHE_GB,
        };
        let ssd_cache_gb = match get("ssd_cache_gb") {
            Some((v, s)) => gb("ssd_cache_gb", v, s)?,
            None => 0.0,
        };
        let ssd_cache_dir = match get("ssd_cache_dir") {
            Some((v, s)) => {
                let t = v.text();
                let dirs: Vec<&str> = t.split(';').map(str::trim).filter(|d| !d.is_empty()).collect();
                match dirs.as_slice() {
                    [] => return Err(bad("ssd_cache_dir", &v, s, "an empty path; give a directory")),
                    [one] => Some(PathBuf::from(one)),
                    _ => {
                        return Err(ConfigError::Refused {
                            key: "ssd_cache_dir".to_owned(),
                            value: v.shown(),
                            from: s,
                            remedy: "kvconnect's flexkv writes one SSD file per worker; give one directory \
                                     (run one worker per SSD to use several)"
                                .to_owned(),
                        })
                    }
                }
            }
            None => None,
        };
        let num_transfer_threads = match get("num_transfer_threads") {
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
        let enable_ssd_promotion = match get("enable_ssd_promotion") {
            Some((v, s)) => {
                v.as_bool().ok_or_else(|| bad("enable_ssd_promotion", &v, s, "expected true or false"))?
            }
            None => true,
        };
        if cpu_cache_gb == 0.0 {
            return Err(ConfigError::Inconsistent(
                "cpu_cache_gb is 0, but the CPU tier stages every block (saves land there first and SSD \
                 blocks are written from it); set cpu_cache_gb to a positive size such as 1"
                    .to_owned(),
            ));
        }
        if ssd_cache_gb > 0.0 && ssd_cache_dir.is_none() {
            return Err(ConfigError::Inconsistent(format!(
                "ssd_cache_gb is {ssd_cache_gb} but ssd_cache_dir is not set; set ssd_cache_dir to a \
                 writable directory or ssd_cache_gb to 0 to run without the SSD tier"
            )));
        }
        Ok(FlexkvConfig {
            cpu_cache_gb,
            ssd_cache_gb,
            ssd_cache_dir,
            num_transfer_threads,
            enable_ssd_promotion,
            sources,
            mapped,
            unknown_keys,
        })
    }

    /// Resolves against the real process environment; mapped keys are logged at info and
    /// unknown ones as warnings.
    pub fn from_extra_and_process_env(extra: &Map<String, Value>) -> Result<FlexkvConfig, ConfigError> {
        let c = FlexkvConfig::resolve(extra, &|k| std::env::var(k).ok())?;
        for m in &c.mapped {
            tracing::info!("flexkv: {m}");
        }
        if !c.unknown_keys.is_empty() {
            tracing::warn!(
                "flexkv: ignoring config keys FlexKV does not have: {}",
                c.unknown_keys.join(", ")
            );
        }
        Ok(c)
    }
}

fn unknown(key: &str, from: Source) -> ConfigError {
    let known: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
    let hint = known
        .iter()
        .find(|k| k.replace('_', "") == key.replace('_', "").to_ascii_lowercase())
        .map(|k| format!("; did you mean {k}?"))
        .unwrap_or_default();
    ConfigError::UnknownKey { key: key.to_owned(), from, hint, known: known.join(", ") }
}

/// FlexKV's older `cache_config` mapping (`enable_cpu`, `num_cpu_blocks`, `enable_ssd`,
/// `ssd_cache_dir`, ...): what has a counterpart is mapped, the rest refused or noted.
fn cache_config(
    v: &Value,
    src: &Source,
    out: &mut Vec<(String, Raw, Source)>,
    mapped: &mut Vec<String>,
) -> Result<(), ConfigError> {
    let Value::Object(m) = v else {
        return Err(ConfigError::BadValue {
            key: "cache_config".to_owned(),
            value: v.to_string(),
            from: src.clone(),
            reason: "expected a mapping such as {enable_cpu: true, ...}".to_owned(),
        });
    };
    for (k, val) in m {
        let raw = Raw::Json(val.clone());
        let refuse = |remedy: &str| ConfigError::Refused {
            key: format!("cache_config.{k}"),
            value: raw.shown(),
            from: src.clone(),
            remedy: remedy.to_owned(),
        };
        match k.as_str() {
            "ssd_cache_dir" => out.push(("ssd_cache_dir".to_owned(), raw.clone(), src.clone())),
            "enable_cpu" if raw.as_bool() == Some(true) => {}
            "enable_cpu" => return Err(refuse("the CPU tier stages every block; remove enable_cpu: false")),
            "enable_ssd" | "enable_remote" | "enable_gds" if raw.as_bool() == Some(false) => {}
            "enable_ssd" => {
                return Err(refuse(
                    "the SSD tier is on when ssd_cache_gb > 0: set ssd_cache_gb and ssd_cache_dir",
                ))
            }
            "num_cpu_blocks" | "num_ssd_blocks" => {
                let top = if k == "num_cpu_blocks" { "cpu_cache_gb" } else { "ssd_cache_gb" };
                return Err(refuse(&format!(
                    "kvconnect sizes tiers in GB: write {top}: <blocks x bytes per block / 1024^3>"
                )));
            }
            "enable_remote"
            | "num_remote_blocks"
            | "remote_cache_size_mode"
            | "remote_file_size"
            | "remote_file_num"
            | "remote_file_prefix"
            | "remote_cache_path"
            | "remote_config_custom" => {
                if raw.is_unset() {
                    continue;
                }
                return Err(refuse(
                    "kvconnect's flexkv has no remote tier; for a shared remote tier use the lmcache \
                     connector with remote_url: redis://host:port",
                ));
            }
            "enable_gds" | "num_gds_blocks" | "gds_cache_dir" => {
                if raw.is_unset() || k == "num_gds_blocks" {
                    continue;
                }
                return Err(refuse("kvconnect has no GPU Direct Storage path"));
            }
            "tokens_per_block" => mapped.push(format!(
                "cache_config.tokens_per_block (from {src}): the block size is the engine's, \
                 agreed by negotiation (--block-size)"
            )),
            other => {
                return Err(ConfigError::UnknownKey {
                    key: format!("cache_config.{other}"),
                    from: src.clone(),
                    hint: String::new(),
                    known: "enable_cpu, num_cpu_blocks, enable_ssd, num_ssd_blocks, ssd_cache_dir, \
                            tokens_per_block, enable_remote, enable_gds and the remote_* and gds keys"
                        .to_owned(),
                })
            }
        }
    }
    Ok(())
}

/// A raw value before it is typed: JSON from the extra config or the file, text from the
/// environment.
#[derive(Debug, Clone)]
enum Raw {
    Json(Value),
    Text(String),
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" | "1" => Some(true),
        "false" | "no" | "off" | "0" => Some(false),
        _ => None,
    }
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

    fn is_null(&self) -> bool {
        matches!(self, Raw::Json(Value::Null))
    }

    fn is_unset(&self) -> bool {
        match self {
            Raw::Json(Value::Null) => true,
            Raw::Json(Value::Bool(b)) => !b,
            Raw::Json(Value::Array(a)) => a.is_empty(),
            _ => false,
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
            Raw::Json(Value::Number(n)) => n.as_u64().filter(|n| *n <= 1).map(|n| n == 1),
            Raw::Json(Value::String(s)) | Raw::Text(s) => parse_bool(s),
            _ => None,
        }
    }
}

fn bad(key: &str, v: &Raw, source: Source, reason: &str) -> ConfigError {
    ConfigError::BadValue { key: key.to_owned(), value: v.shown(), from: source, reason: reason.to_owned() }
}

fn gb(key: &str, v: Raw, s: Source) -> Result<f64, ConfigError> {
    match v.as_f64() {
        Some(x) if (0.0..=1e6).contains(&x) => Ok(x),
        _ => Err(bad(key, &v, s, "expected a size in GB, a number from 0 to 1000000 (e.g. 4 or 0.5)")),
    }
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
        assert_eq!(c.cpu_bytes(), 1 << 30, "FlexKV's GB is 1024^3 bytes");
        assert!(!c.ssd_enabled());
        assert_eq!(c.num_transfer_threads, DEFAULT_TRANSFER_THREADS);
        assert!(c.enable_ssd_promotion);
        assert_eq!(c.source_of("cpu_cache_gb"), Some(&Source::Default));
    }

    #[test]
    fn precedence_is_extra_then_file_then_env() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("flexkv.yml");
        std::fs::write(
            &yaml,
            "cpu_cache_gb: 3\nssd_cache_gb: 5\nssd_cache_dir: /from/file\nnum_transfer_threads: 3\n",
        )
        .unwrap();
        let p = yaml.to_str().unwrap();
        let e = env(&[
            ("FLEXKV_CONFIG_PATH", p),
            ("FLEXKV_CPU_CACHE_GB", "2"),
            ("FLEXKV_ENABLE_SSD_PROMOTION", "0"),
        ]);
        let c = FlexkvConfig::resolve(&extra(serde_json::json!({"cpu_cache_gb": 1.5})), &e).unwrap();
        assert_eq!(c.cpu_cache_gb, 1.5);
        assert_eq!(c.source_of("cpu_cache_gb"), Some(&Source::ExtraConfig));
        assert_eq!(c.ssd_cache_gb, 5.0, "the file beats the environment, as in FlexKV");
        assert_eq!(c.source_of("ssd_cache_gb"), Some(&Source::File(yaml.clone(), 2)));
        assert!(!c.enable_ssd_promotion, "the environment beats the default");
        assert_eq!(c.ssd_cache_dir.as_deref(), Some(std::path::Path::new("/from/file")));
        assert_eq!(c.num_transfer_threads, 3);

        let json = dir.path().join("flexkv.json");
        std::fs::write(
            &json,
            r#"{"cpu_cache_gb": 0.25, "enable_ssd_promotion": false, "log_level": "INFO"}"#,
        )
        .unwrap();
        let c = FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CONFIG_PATH", json.to_str().unwrap())]))
            .unwrap();
        assert_eq!(c.cpu_cache_gb, 0.25);
        assert!(!c.enable_ssd_promotion);
        assert!(
            c.mapped.iter().any(|m| m.starts_with("log_level") && m.contains("RUST_LOG")),
            "{:?}",
            c.mapped
        );
    }

    #[test]
    fn bad_values_name_key_value_and_source() {
        let e = FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CPU_CACHE_GB", "lots")])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "flexkv setting 'cpu_cache_gb' = 'lots' (from environment variable FLEXKV_CPU_CACHE_GB) is \
             invalid: expected a size in GB, a number from 0 to 1000000 (e.g. 4 or 0.5)"
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
    fn refused_keys_name_the_kvconnect_way() {
        for (k, v, want) in [
            ("enable_gds", serde_json::json!(true), "GPU Direct Storage"),
            ("server_client_mode", serde_json::json!(1), "remote_url: redis://"),
            ("eviction_policy", serde_json::json!("lfu"), "least recently used"),
            ("ssd_cache_dir", serde_json::json!("/a;/b"), "one directory"),
        ] {
            let e = FlexkvConfig::resolve(&extra(serde_json::json!({ k: v, "ssd_cache_gb": 0 })), &env(&[]))
                .unwrap_err();
            assert!(e.to_string().contains(k) && e.to_string().contains(want), "{k}: {e}");
        }
        assert!(FlexkvConfig::resolve(
            &extra(serde_json::json!({"enable_gds": false, "eviction_policy": "LRU"})),
            &env(&[])
        )
        .is_ok());
        let e = FlexkvConfig::resolve(&Map::new(), &env(&[("ENABLE_FLEXKV", "0")])).unwrap_err();
        assert!(e.to_string().contains("leave FlexKVConnectorV1 out"), "{e}");
    }

    #[test]
    fn unparsable_missing_or_unknown_file_content_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let y = dir.path().join("bad.yaml");
        std::fs::write(&y, "cpu_cache_gb: 1\nssd\n").unwrap();
        let e = FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CONFIG_PATH", y.to_str().unwrap())]))
            .unwrap_err();
        assert!(e.to_string().contains("line 2") && e.to_string().contains("not valid YAML"), "{e}");
        std::fs::write(&y, "cpu_cache_gb: 1\ncpu_cache_size: 2\n").unwrap();
        let e = FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CONFIG_PATH", y.to_str().unwrap())]))
            .unwrap_err();
        assert!(e.to_string().contains("line 2: 'cpu_cache_size' is not a FlexKV setting"), "{e}");
        let j = dir.path().join("bad.json");
        std::fs::write(&j, "{\"cpu_cache_gb\": }").unwrap();
        let e = FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CONFIG_PATH", j.to_str().unwrap())]))
            .unwrap_err();
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        let e =
            FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CONFIG_PATH", "/nonexistent/flexkv.yml")]))
                .unwrap_err();
        assert!(e.to_string().contains("cannot read the file"), "{e}");
    }

    #[test]
    fn flexkvs_example_files_resolve() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/flexkv");
        let yml = root.join("flexkv_config.yml");
        let c = FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CONFIG_PATH", yml.to_str().unwrap())]))
            .unwrap();
        assert_eq!((c.cpu_cache_gb, c.ssd_cache_gb), (32.0, 64.0));
        assert_eq!(c.ssd_cache_dir.as_deref(), Some(std::path::Path::new("./ssd_cache/")));
        let json = root.join("flexkv_config.json");
        let e = FlexkvConfig::resolve(&Map::new(), &env(&[("FLEXKV_CONFIG_PATH", json.to_str().unwrap())]))
            .unwrap_err();
        assert!(
            e.to_string().contains("cache_config.num_cpu_blocks") && e.to_string().contains("cpu_cache_gb"),
            "{e}"
        );
    }

    #[test]
    fn the_docs_list_every_key() {
        let readme = include_str!("../../../docs/connectors/flexkv.md");
        for (k, _) in KEYS {
            assert!(readme.contains(&format!("`{k}`")), "docs/connectors/flexkv.md does not list `{k}`");
        }
    }
}
