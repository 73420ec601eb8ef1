//! The LMCache settings users already write, read from three places, highest precedence
//! first: `kv_connector_extra_config` (keys plain or with LMCache's `lmcache.` prefix),
//! `LMCACHE_<KEY>` environment variables, and the YAML file named by `LMCACHE_CONFIG_FILE`.
//!
//! Every key of LMCache's is handled one of three ways ([`crate::keys`]): honoured; mapped to
//! what kvconnect does instead, with an info line naming the mapping (`local_device:
//! "file://…"` is the disk tier, `local_device: "cpu"` the CPU tier, ...); or refused with
//! the kvconnect way to get the same thing. LMCache's P/D settings (`enable_pd: true`) are a
//! request for disaggregated prefill, which kvconnect serves with the nixl connector beside
//! lmcache in a `PdConnector` ([`crate::pd`]). Only keys LMCache does not have are warned
//! about (as LMCache itself does), with the closest known key.

use crate::keys::{self, Kind};
use crate::pd::{PdKeys, PdRequest};
use kvconnect_api::{ConnectorError, KvTransferConfig};
use kvconnect_config_file::ConfigFile;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

pub(crate) const NAME: &str = "lmcache";

/// Bytes in one of LMCache's "GB" (it multiplies by 1024**3).
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// LMCache v0's default `max_local_cache_size` in GB, for `local_device` configs that give
/// no size.
const V0_DEFAULT_CACHE_GB: f64 = 20.0;

/// The remote tier's settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteConfig {
    /// `redis://[user:password@]host:port[/db]`.
    pub url: String,
    /// Longest wait for one remote operation (connect, read or write), milliseconds.
    pub timeout_ms: u64,
    /// Back-off after a failed remote operation, milliseconds; doubles with each further
    /// failure up to 16 times this, and resets at the first success.
    pub retry_ms: u64,
}

/// The resolved settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LmcacheConfig {
    /// Tokens per chunk (LMCache default 256).
    pub chunk_size: u32,
    /// Keep chunks in host memory.
    pub local_cpu: bool,
    /// Host-memory budget in GB (LMCache's float, GiB-based).
    pub max_local_cpu_size: f64,
    /// Directory of the disk tier (`file://` stripped), if any.
    pub local_disk: Option<PathBuf>,
    /// Disk budget in GB.
    pub max_local_disk_size: f64,
    /// Also store the last, partial chunk of a prompt.
    pub save_unfull_chunk: bool,
    /// Save and load layer by layer.
    pub use_layerwise: bool,
    /// Fewer matched tokens than this load nothing (LMCache's `min_retrieve_tokens`; 0 = off).
    #[serde(default)]
    pub min_retrieve_tokens: u32,
    /// The shared remote tier behind the CPU and disk tiers (`remote_url: redis://...`).
    #[serde(default)]
    pub remote: Option<RemoteConfig>,
}

impl Default for LmcacheConfig {
    fn default() -> Self {
        LmcacheConfig {
            chunk_size: 256,
            local_cpu: true,
            max_local_cpu_size: 5.0,
            local_disk: None,
            max_local_disk_size: 0.0,
            save_unfull_chunk: false,
            use_layerwise: false,
            min_retrieve_tokens: 0,
            remote: None,
        }
    }
}

/// A resolved config, what was mapped and what nobody reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// The settings.
    pub config: LmcacheConfig,
    /// Keys LMCache does not have, each with where it came from (and the closest known key),
    /// e.g. `chunksize (kv_connector_extra_config; did you mean chunk_size?)`.
    pub unknown_keys: Vec<String>,
    /// One line per mapped key: what kvconnect does instead.
    pub mapped: Vec<String>,
    /// LMCache's P/D settings, when any are given.
    pub pd: Option<PdRequest>,
}

impl LmcacheConfig {
    /// The CPU budget in bytes.
    pub fn cpu_budget_bytes(&self) -> u64 {
        if self.local_cpu {
            (self.max_local_cpu_size * GIB) as u64
        } else {
            0
        }
    }

    /// The disk budget in bytes.
    pub fn disk_budget_bytes(&self) -> u64 {
        (self.max_local_disk_size * GIB) as u64
    }

    /// True when some tier can keep chunks.
    pub fn has_storage(&self) -> bool {
        self.local_cpu || self.local_disk.is_some() || self.remote.is_some()
    }

    /// Reads the config from the connector's `kv_connector_extra_config`, the process
    /// environment and `LMCACHE_CONFIG_FILE`. Mapped keys are logged at info and unknown
    /// keys as warnings, once each.
    pub fn from_kv_config(cfg: &KvTransferConfig) -> Result<LmcacheConfig, ConnectorError> {
        let r = resolve(&cfg.kv_connector_extra_config, &lmcache_env())?;
        log_once(&r.mapped, false);
        log_once(&r.unknown_keys, true);
        Ok(r.config)
    }
}

/// The process's `LMCACHE_*` variables.
pub fn lmcache_env() -> Vec<(String, String)> {
    std::env::vars().filter(|(k, _)| k.starts_with("LMCACHE_")).collect()
}

fn log_once(lines: &[String], warn: bool) {
    static SEEN: OnceLock<Mutex<BTreeSet<String>>> = OnceLock::new();
    let set = SEEN.get_or_init(|| Mutex::new(BTreeSet::new()));
    let mut set = match set.lock() {
        Ok(s) => s,
        Err(p) => p.into_inner(),
    };
    let fresh: Vec<&String> = lines.iter().filter(|k| set.insert((*k).clone())).collect();
    if fresh.is_empty() {
        return;
    }
    if warn {
        let list = fresh.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
        tracing::warn!(unknown_keys = %list, "lmcache: ignoring config keys LMCache does not have: {list}");
    } else {
        for line in fresh {
            tracing::info!("lmcache: {line}");
        }
    }
}

/// A raw value: JSON from the extra config or the file, text from the environment.
#[derive(Debug, Clone)]
pub(crate) enum Raw {
    Json(Value),
    Text(Option<String>),
}

impl Raw {
    pub(crate) fn shown(&self) -> String {
        match self {
            Raw::Json(v) => v.to_string(),
            Raw::Text(Some(s)) => format!("'{s}'"),
            Raw::Text(None) => "null".to_owned(),
        }
    }

    pub(crate) fn is_null(&self) -> bool {
        matches!(self, Raw::Json(Value::Null) | Raw::Text(None))
    }

    pub(crate) fn as_bool(&self) -> Option<bool> {
        match self {
            Raw::Json(Value::Bool(b)) => Some(*b),
            Raw::Json(Value::Number(n)) => n.as_u64().filter(|n| *n <= 1).map(|n| n == 1),
            Raw::Json(Value::String(s)) | Raw::Text(Some(s)) => parse_bool(s),
            _ => None,
        }
    }

    fn as_u64(&self) -> Option<u64> {
        match self {
            Raw::Json(v) => v.as_u64().or_else(|| v.as_str().and_then(|s| s.trim().parse().ok())),
            Raw::Text(Some(s)) => s.trim().parse().ok(),
            Raw::Text(None) => None,
        }
    }

    fn as_f64(&self) -> Option<f64> {
        match self {
            Raw::Json(v) => v.as_f64().or_else(|| v.as_str().and_then(|s| s.trim().parse().ok())),
            Raw::Text(Some(s)) => s.trim().parse().ok(),
            Raw::Text(None) => None,
        }
    }

    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Raw::Json(Value::String(s)) => Some(s),
            Raw::Text(Some(s)) => Some(s),
            _ => None,
        }
    }

    /// False, null, zero, empty: the value asks for nothing.
    fn is_unset(&self) -> bool {
        match self {
            Raw::Json(Value::Null) | Raw::Text(None) => true,
            Raw::Json(Value::Bool(b)) => !b,
            Raw::Json(Value::Array(a)) => a.is_empty(),
            Raw::Json(Value::Object(o)) => o.is_empty(),
            Raw::Json(Value::String(s)) | Raw::Text(Some(s)) => {
                let t = s.trim();
                t.is_empty() || t == "[]" || t.eq_ignore_ascii_case("none") || parse_bool(t) == Some(false)
            }
            Raw::Json(Value::Number(n)) => n.as_f64() == Some(0.0),
        }
    }
}

pub(crate) fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Values read so far whose meaning depends on others (LMCache v0's `local_device` and
/// `max_local_cache_size`, explicit sizes).
#[derive(Default)]
struct Pending {
    local_device: Option<(String, String)>,
    max_local_cache_size: Option<(f64, String)>,
    local_disk_set: bool,
    disk_size_set: bool,
    cpu_size_set: bool,
}

struct State {
    cfg: LmcacheConfig,
    unknown: Vec<String>,
    mapped: Vec<String>,
    pd: PdKeys,
    pending: Pending,
    remote_url: Option<(String, String)>,
    timeout_ms: u64,
    retry_ms: u64,
}

/// Resolves the config from `extra` and the given `LMCACHE_*` environment variables (the
/// YAML file is the one `LMCACHE_CONFIG_FILE` names among them). Pure except for reading that
/// file, so tests pass their own environment. LMCache's `enable_pd: true` is an error that
/// says how kvconnect does P/D ([`PdRequest`]); [`resolve_all`] returns it instead.
pub fn resolve(
    extra: &serde_json::Map<String, Value>,
    env_vars: &[(String, String)],
) -> Result<Resolved, ConnectorError> {
    let r = resolve_all(extra, env_vars)?;
    if let Some(pd) = r.pd.as_ref().filter(|p| p.enabled()) {
        return Err(ConnectorError::config(NAME, pd.refusal(&r.config)));
    }
    Ok(r)
}

/// Like [`resolve`], but P/D settings are returned in [`Resolved::pd`], not refused.
pub fn resolve_all(
    extra: &serde_json::Map<String, Value>,
    env_vars: &[(String, String)],
) -> Result<Resolved, ConnectorError> {
    let mut st = State {
        cfg: LmcacheConfig::default(),
        unknown: Vec::new(),
        mapped: Vec::new(),
        pd: PdKeys::default(),
        pending: Pending::default(),
        remote_url: None,
        timeout_ms: 200,
        retry_ms: 500,
    };

    // Lowest precedence first; later sources overwrite.
    if let Some((_, path)) = env_vars.iter().find(|(k, _)| k == "LMCACHE_CONFIG_FILE") {
        let file = ConfigFile::read("LMCACHE_CONFIG_FILE", Path::new(path), "chunk_size: 256")
            .map_err(|e| ConnectorError::config(NAME, e.to_string()))?;
        for e in &file.entries {
            st.apply(&e.key, Raw::Json(e.value.clone()), &file.place(e))?;
        }
    }

    for (k, v) in env_vars {
        let Some(rest) = k.strip_prefix("LMCACHE_") else { continue };
        if rest == "CONFIG_FILE" {
            continue;
        }
        let key = rest.to_ascii_lowercase();
        let text = if v.is_empty() || v == "None" || v == "null" { None } else { Some(v.clone()) };
        st.apply(&key, Raw::Text(text), &format!("environment variable {k}"))?;
    }

    for (k, v) in extra {
        let key = k.strip_prefix("lmcache.").unwrap_or(k);
        st.apply(key, Raw::Json(v.clone()), &format!("kv_connector_extra_config key '{k}'"))?;
    }

    st.finish()
}

impl State {
    fn apply(&mut self, key: &str, raw: Raw, source: &str) -> Result<(), ConnectorError> {
        let Some(kind) = keys::kind_of(key) else {
            let hint = keys::closest(key).map(|k| format!("; did you mean {k}?")).unwrap_or_default();
            self.unknown.push(format!("{key} ({}{hint})", short(source)));
            return Ok(());
        };
        match kind {
            Kind::Setting => self.setting(key, &raw, source),
            Kind::Special => self.special(key, &raw, source),
            Kind::Pd => {
                self.pd.add(key, raw, source);
                Ok(())
            }
            Kind::DefaultOnly(_, remedy) => {
                if raw.is_unset() {
                    Ok(())
                } else {
                    Err(ConnectorError::config(
                        NAME,
                        format!("{key} = {} (from {source}) is not supported: {remedy}", raw.shown()),
                    ))
                }
            }
            Kind::Mapped(what) => {
                self.mapped.push(format!("{key} (from {source}): {what}"));
                Ok(())
            }
        }
    }

    fn setting(&mut self, key: &str, raw: &Raw, source: &str) -> Result<(), ConnectorError> {
        let bad = |want: &str| {
            ConnectorError::config(NAME, format!("{key} from {source} must be {want}, got {}", raw.shown()))
        };
        match key {
            "chunk_size" => {
                let n = raw.as_u64().ok_or_else(|| bad("a positive integer (tokens per chunk, e.g. 256)"))?;
                if n == 0 || n > (1 << 20) {
                    return Err(bad(
                        "a positive integer no larger than 1048576 (tokens per chunk, e.g. 256)",
                    ));
                }
                self.cfg.chunk_size = n as u32;
            }
            "min_retrieve_tokens" => {
                let n = raw
                    .as_u64()
                    .filter(|n| *n <= u32::MAX as u64)
                    .ok_or_else(|| bad("a whole number of tokens (0 = off)"))?;
                self.cfg.min_retrieve_tokens = n as u32;
            }
            "local_cpu" | "save_unfull_chunk" | "use_layerwise" => {
                let b = raw.as_bool().ok_or_else(|| bad("true or false"))?;
                match key {
                    "local_cpu" => self.cfg.local_cpu = b,
                    "save_unfull_chunk" => self.cfg.save_unfull_chunk = b,
                    _ => self.cfg.use_layerwise = b,
                }
            }
            "max_local_cpu_size" | "max_local_disk_size" => {
                let f = raw
                    .as_f64()
                    .filter(|f| f.is_finite() && *f >= 0.0)
                    .ok_or_else(|| bad("a size in GB (e.g. 5.0)"))?;
                if key == "max_local_cpu_size" {
                    self.cfg.max_local_cpu_size = f;
                    self.pending.cpu_size_set = true;
                } else {
                    self.cfg.max_local_disk_size = f;
                    self.pending.disk_size_set = true;
                }
            }
            "local_disk" => {
                self.pending.local_disk_set = true;
                // LMCache's examples also write `local_disk: False` for "none".
                if raw.is_unset() {
                    self.cfg.local_disk = None;
                    return Ok(());
                }
                let s = raw.as_str().ok_or_else(|| bad("a path or \"file:///path\""))?;
                self.cfg.local_disk = Some(disk_path(s).ok_or_else(|| bad("a path or \"file:///path\""))?);
            }
            "remote_url" => {
                if raw.is_unset() {
                    self.remote_url = None;
                    return Ok(());
                }
                let s = raw.as_str().ok_or_else(|| bad("a URL such as \"redis://host:6379\""))?;
                check_remote_url(s, source)?;
                self.remote_url = Some((s.trim().to_owned(), source.to_owned()));
            }
            "remote_timeout_ms" | "remote_retry_ms" => {
                let n = raw
                    .as_u64()
                    .filter(|n| (1..=600_000).contains(n))
                    .ok_or_else(|| bad("milliseconds from 1 to 600000"))?;
                if key == "remote_timeout_ms" {
                    self.timeout_ms = n;
                } else {
                    self.retry_ms = n;
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn special(&mut self, key: &str, raw: &Raw, source: &str) -> Result<(), ConnectorError> {
        let bad = |want: &str| {
            ConnectorError::config(NAME, format!("{key} from {source} must be {want}, got {}", raw.shown()))
        };
        match key {
            "remote_serde" => match raw.as_str().map(|s| s.trim().to_ascii_lowercase()) {
                None if raw.is_null() => {}
                Some(s) if s == "naive" => {}
                Some(s) if ["cachegen", "torch", "safetensor", "fast", "kivi"].contains(&s.as_str()) => {
                    self.mapped.push(format!(
                        "remote_serde = {s} (from {source}): mapped to naive: chunks are stored as their raw \
                            KV bytes with a checksum, lossless (kvconnect has no {s} codec)"
                    ));
                }
                _ => return Err(bad("naive, cachegen, torch, safetensor or fast")),
            },
            "local_device" => {
                if raw.is_unset() {
                    self.pending.local_device = None;
                    return Ok(());
                }
                let s = raw.as_str().ok_or_else(|| bad("\"cpu\", \"cuda\" or \"file:///path/\""))?;
                let t = s.trim();
                if t != "cpu" && t != "cuda" && !t.starts_with("file://") {
                    return Err(bad("\"cpu\", \"cuda\" or \"file:///path/\" (LMCache v0's local devices)"));
                }
                self.pending.local_device = Some((t.to_owned(), source.to_owned()));
            }
            "max_local_cache_size" => {
                let f = raw
                    .as_f64()
                    .filter(|f| f.is_finite() && *f >= 0.0)
                    .ok_or_else(|| bad("a size in GB (e.g. 20)"))?;
                self.pending.max_local_cache_size = Some((f, source.to_owned()));
            }
            "discard_partial_chunks" => {
                let b = raw.as_bool().ok_or_else(|| bad("true or false"))?;
                self.cfg.save_unfull_chunk = !b;
                self.mapped.push(format!(
                    "discard_partial_chunks = {b} (from {source}): mapped to save_unfull_chunk = {}",
                    !b
                ));
            }
            "skip_last_n_tokens" => {
                let n = raw.as_u64().ok_or_else(|| bad("a whole number of tokens"))?;
                if n > 1 {
                    return Err(ConnectorError::config(
                        NAME,
                        format!(
                            "skip_last_n_tokens = {n} (from {source}) is not supported: lookups always \
                            leave exactly the prompt's last token to the engine (skip_last_n_tokens: 1); \
                            remove the key"
                        ),
                    ));
                }
                self.mapped.push(format!(
                    "skip_last_n_tokens = {n} (from {source}): lookups always leave the prompt's last token \
                        to the engine, as skip_last_n_tokens: 1 does"
                ));
            }
            "cache_policy" => {
                let s = raw.as_str().map(|s| s.trim().to_ascii_uppercase());
                match s.as_deref() {
                    None if raw.is_null() => {}
                    Some("LRU") => {}
                    _ => {
                        return Err(ConnectorError::config(
                            NAME,
                            format!(
                                "cache_policy = {} (from {source}) is not supported: kvconnect's tiers \
                                evict least recently used chunks first (cache_policy: LRU); set LRU or \
                                remove the key",
                                raw.shown()
                            ),
                        ))
                    }
                }
            }
            "extra_config" => self.extra_config(raw, source)?,
            _ => {}
        }
        Ok(())
    }

    /// LMCache's `extra_config` mapping holds backend-specific extras; NIXL as a storage
    /// backend is refused, the rest have no kvconnect counterpart.
    fn extra_config(&mut self, raw: &Raw, source: &str) -> Result<(), ConnectorError> {
        let map = match raw {
            Raw::Json(Value::Object(m)) => m.clone(),
            Raw::Json(Value::Null) | Raw::Text(None) => return Ok(()),
            Raw::Text(Some(t)) => match serde_json::from_str::<Value>(t) {
                Ok(Value::Object(m)) => m,
                _ => {
                    return Err(ConnectorError::config(
                        NAME,
                        format!("extra_config from {source} must be a JSON object, got '{t}'"),
                    ))
                }
            },
            other => {
                return Err(ConnectorError::config(
                    NAME,
                    format!("extra_config from {source} must be a mapping, got {}", other.shown()),
                ))
            }
        };
        if map.get("enable_nixl_storage").is_some_and(|v| Raw::Json(v.clone()).as_bool() == Some(true)) {
            return Err(ConnectorError::config(
                NAME,
                format!(
                    "extra_config.enable_nixl_storage (from {source}) is not supported: kvconnect's \
                    lmcache has no NIXL storage backend; for chunks on disk set local_disk: file:///path and \
                    max_local_disk_size"
                ),
            ));
        }
        if !map.is_empty() {
            let keys: Vec<&str> = map.keys().map(String::as_str).collect();
            self.mapped.push(format!(
                "extra_config (from {source}): {} configure LMCache backends kvconnect does not have; not \
                    read",
                keys.join(", ")
            ));
        }
        Ok(())
    }

    fn finish(mut self) -> Result<Resolved, ConnectorError> {
        // LMCache v0: `local_device` names the one local backend, `max_local_cache_size`
        // its size. LMCache v1 spells the same as local_cpu / local_disk.
        let v0_size = self.pending.max_local_cache_size.clone();
        if let Some((dev, source)) = self.pending.local_device.clone() {
            if let Some(path) = dev.strip_prefix("file://") {
                if self.pending.local_disk_set {
                    self.mapped.push(format!(
                        "local_device = {dev} (from {source}): local_disk is also set and wins"
                    ));
                } else {
                    let dir = disk_path(&dev).ok_or_else(|| {
                        ConnectorError::config(
                            NAME,
                            format!(
                                "local_device from {source} names an empty path; write \"file:///path/\""
                            ),
                        )
                    })?;
                    self.cfg.local_disk = Some(dir);
                    if !self.pending.disk_size_set {
                        self.cfg.max_local_disk_size =
                            v0_size.as_ref().map_or(V0_DEFAULT_CACHE_GB, |(f, _)| *f);
                    }
                    self.mapped.push(format!(
                        "local_device = {dev} (from {source}): mapped to the disk tier (local_disk: {path}, \
                            max_local_disk_size: {} GB{}), with the CPU tier in front of it (local_cpu: {}, \
                            max_local_cpu_size: {} GB), as LMCache v1 writes it",
                        self.cfg.max_local_disk_size,
                        if self.pending.disk_size_set || v0_size.is_some() {
                            ""
                        } else {
                            ", LMCache v0's \
                            default size"
                        },
                        self.cfg.local_cpu,
                        self.cfg.max_local_cpu_size
                    ));
                }
            } else {
                // "cpu" or "cuda": the chunks stay in memory.
                if !self.pending.cpu_size_set {
                    if let Some((f, _)) = &v0_size {
                        self.cfg.max_local_cpu_size = *f;
                    }
                }
                self.cfg.local_cpu = true;
                let gpu = if dev == "cuda" {
                    " (kvconnect has no cache tier in GPU memory; chunks of device KV are kept in pinned \
                        host memory)"
                } else {
                    ""
                };
                self.mapped.push(format!(
                    "local_device = {dev} (from {source}): mapped to the CPU tier (local_cpu: true, \
                        max_local_cpu_size: {} GB){gpu}",
                    self.cfg.max_local_cpu_size
                ));
            }
        } else if let Some((f, source)) = v0_size {
            if !self.pending.cpu_size_set {
                self.cfg.max_local_cpu_size = f;
            }
            self.mapped.push(format!(
                "max_local_cache_size = {f} (from {source}): mapped to max_local_cpu_size: {} GB",
                self.cfg.max_local_cpu_size
            ));
        }
        if let Some((url, _)) = self.remote_url.take() {
            self.cfg.remote =
                Some(RemoteConfig { url, timeout_ms: self.timeout_ms, retry_ms: self.retry_ms });
        }
        let pd = self.pd.finish(&mut self.mapped)?;
        // With P/D asked for, storage is checked when the composite is built.
        if !pd.as_ref().is_some_and(|p| p.enabled()) {
            validate(&self.cfg)?;
        }
        Ok(Resolved { config: self.cfg, unknown_keys: self.unknown, mapped: self.mapped, pd })
    }
}

/// `kv_connector_extra_config key 'x'` → `kv_connector_extra_config`, for the unknown list.
fn short(source: &str) -> String {
    if source.starts_with("kv_connector_extra_config") {
        "kv_connector_extra_config".to_owned()
    } else if source.starts_with("environment") {
        "environment".to_owned()
    } else {
        source.to_owned()
    }
}

/// A disk directory as LMCache writes it: `/path`, `file:///path` or `file://relative/`.
fn disk_path(s: &str) -> Option<PathBuf> {
    let s = s.trim();
    let p = s.strip_prefix("file://").unwrap_or(s);
    (!p.is_empty()).then(|| PathBuf::from(p))
}

/// `redis://` is the remote kvconnect speaks; LMCache's own server protocol and the other
/// backends are refused, naming it.
fn check_remote_url(url: &str, source: &str) -> Result<(), ConnectorError> {
    let u = url.trim();
    let Some((scheme, rest)) = u.split_once("://") else {
        return Err(ConnectorError::config(
            NAME,
            format!(
                "remote_url '{u}' (from {source}) is not a URL; kvconnect's remote tier is a Redis server: \
                run redis-server and set remote_url: redis://host:port"
            ),
        ));
    };
    let scheme = scheme.to_ascii_lowercase();
    let refuse = |why: &str| {
        ConnectorError::config(
            NAME,
            format!(
                "remote_url '{u}' (from {source}) {why}; kvconnect's remote tier is a Redis server: run \
                redis-server and set remote_url: redis://host:port"
            ),
        )
    };
    match scheme.as_str() {
        "redis" => {
            let host_port = rest.rsplit('@').next().unwrap_or("").split('/').next().unwrap_or("");
            if host_port.is_empty() {
                return Err(refuse("names no host"));
            }
            Ok(())
        }
        "lm" => {
            Err(refuse("is LMCache's own server protocol (lmcache_server), which kvconnect does not speak"))
        }
        "rediss" => Err(refuse("asks for Redis over TLS, which this build does not include")),
        "redis-sentinel" | "sentinel" | "redis-cluster" => {
            Err(refuse("asks for Redis Sentinel or Cluster, which kvconnect does not use (one server)"))
        }
        "" => Err(refuse("is not a URL")),
        other => Err(refuse(&format!("uses a {other}:// backend kvconnect does not have"))),
    }
}

fn validate(cfg: &LmcacheConfig) -> Result<(), ConnectorError> {
    if cfg.local_cpu && cfg.cpu_budget_bytes() == 0 {
        return Err(ConnectorError::config(
            NAME,
            format!(
                "max_local_cpu_size is {} GB, which leaves the CPU tier no room; set a positive size \
                    (LMCache's default is 5.0) or local_cpu: false",
                cfg.max_local_cpu_size
            ),
        ));
    }
    if let Some(dir) = &cfg.local_disk {
        if cfg.disk_budget_bytes() == 0 {
            return Err(ConnectorError::config(
                NAME,
                format!(
                    "local_disk is '{}' but max_local_disk_size is {} GB; set a positive size or remove \
                        local_disk",
                    dir.display(),
                    cfg.max_local_disk_size
                ),
            ));
        }
    }
    if !cfg.has_storage() {
        return Err(ConnectorError::config(
            NAME,
            "local_cpu is false and neither local_disk nor remote_url is set, so there is nowhere to store \
                chunks; enable local_cpu, or set local_disk or remote_url",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn extra(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn defaults_are_lmcache_defaults() {
        let r = resolve(&serde_json::Map::new(), &[]).unwrap();
        assert_eq!(r.config, LmcacheConfig::default());
        assert_eq!(r.config.chunk_size, 256);
        assert_eq!(r.config.cpu_budget_bytes(), 5 * 1024 * 1024 * 1024);
    }

    #[test]
    fn precedence_extra_over_env_over_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("lmcache.yaml");
        std::fs::write(
            &file,
            "chunk_size: 64\nmax_local_cpu_size: 1.5\nsave_unfull_chunk: true\n\
             local_disk: \"file:///tmp/lmc\"\nmax_local_disk_size: 2\n",
        )
        .unwrap();
        let env = vec![
            ("LMCACHE_CONFIG_FILE".to_owned(), file.display().to_string()),
            ("LMCACHE_CHUNK_SIZE".to_owned(), "128".to_owned()),
            ("LMCACHE_USE_LAYERWISE".to_owned(), "True".to_owned()),
        ];
        let r = resolve(&extra(json!({"lmcache.chunk_size": 32})), &env).unwrap();
        assert_eq!(r.config.chunk_size, 32, "extra config wins");
        assert!(r.config.use_layerwise, "environment beats the default");
        assert_eq!(r.config.max_local_cpu_size, 1.5, "file beats the default");
        assert!(r.config.save_unfull_chunk);
        assert_eq!(r.config.local_disk, Some(PathBuf::from("/tmp/lmc")), "file:// is stripped");
        let r = resolve(&serde_json::Map::new(), &env).unwrap();
        assert_eq!(r.config.chunk_size, 128, "environment beats the file");
    }

    #[test]
    fn keys_lmcache_lacks_are_named_with_their_source_and_a_suggestion() {
        let env = vec![("LMCACHE_CHUNKSIZE".to_owned(), "16".to_owned())];
        let r = resolve(&extra(json!({"chunksize": 256, "chunk_size": 16})), &env).unwrap();
        assert!(
            r.unknown_keys
                .contains(&"chunksize (kv_connector_extra_config; did you mean chunk_size?)".to_owned()),
            "{:?}",
            r.unknown_keys
        );
        assert!(
            r.unknown_keys.contains(&"chunksize (environment; did you mean chunk_size?)".to_owned()),
            "{:?}",
            r.unknown_keys
        );
    }

    #[test]
    fn unknown_keys_are_warnings_and_mapped_keys_info_lines() {
        #[derive(Clone, Default)]
        struct Sink(std::sync::Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Sink {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let sink = Sink::default();
        let w = sink.clone();
        let sub = tracing_subscriber::fmt().with_writer(move || w.clone()).with_ansi(false).finish();
        let mut cfg = KvTransferConfig::named("LMCacheConnectorV1");
        cfg.kv_connector_extra_config =
            extra(json!({"chunk_size": 64, "no_such_key_for_warn_test": 1, "py_enable_gc": true}));
        let c = tracing::subscriber::with_default(sub, || LmcacheConfig::from_kv_config(&cfg)).unwrap();
        assert_eq!(c.chunk_size, 64);
        let log = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        assert!(
            log.contains("WARN") && log.contains("no_such_key_for_warn_test (kv_connector_extra_config)"),
            "{log}"
        );
        assert!(
            log.contains("INFO")
                && log.contains(
                    "py_enable_gc (from kv_connector_extra_config key \
                     'py_enable_gc'): kvconnect has no Python runtime"
                ),
            "{log}"
        );
    }

    #[test]
    fn v0_local_device_maps_to_tiers() {
        let r =
            resolve(&extra(json!({"chunk_size": 256, "local_device": "file://local_disk/"})), &[]).unwrap();
        assert_eq!(r.config.local_disk, Some(PathBuf::from("local_disk/")));
        assert_eq!(r.config.max_local_disk_size, 20.0, "LMCache v0's default size");
        assert!(r.config.local_cpu);
        assert!(
            r.mapped.iter().any(|m| m.starts_with("local_device = file://local_disk/")
                && m.contains("mapped to the disk tier")),
            "{:?}",
            r.mapped
        );
        let r = resolve(&extra(json!({"local_device": "cpu", "max_local_cache_size": 2})), &[]).unwrap();
        assert!(r.config.local_cpu && r.config.local_disk.is_none());
        assert_eq!(r.config.max_local_cpu_size, 2.0);
        assert!(r.mapped.iter().any(|m| m.contains("mapped to the CPU tier")), "{:?}", r.mapped);
        let e = resolve(&extra(json!({"local_device": "tape"})), &[]).unwrap_err().to_string();
        assert!(e.contains("local_device") && e.contains("\"cpu\""), "{e}");
    }

    #[test]
    fn refused_keys_name_the_kvconnect_way() {
        for (k, v, want) in [
            ("enable_blending", json!(true), "remove enable_blending"),
            ("enable_p2p", json!(true), "remote_url: redis://"),
            ("enable_controller", json!(true), "/metrics"),
            ("save_decode_cache", json!(true), "prompt KV only"),
            ("cache_policy", json!("LFU"), "least recently used"),
            ("gds_path", json!("/mnt/gds"), "local_disk"),
            ("remote_url", json!("lm://localhost:65432"), "redis://host:port"),
            ("remote_url", json!("mooncakestore://x:1"), "redis://host:port"),
            ("extra_config", json!({"enable_nixl_storage": true}), "local_disk"),
        ] {
            let e = resolve(&extra(json!({ k: v })), &[]).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(want), "{k}: {e}");
        }
        // Their default values ask for nothing and are honoured.
        for (k, v) in
            [("enable_blending", json!(false)), ("cache_policy", json!("LRU")), ("gds_path", Value::Null)]
        {
            assert!(resolve(&extra(json!({ k: v })), &[]).is_ok(), "{k}");
        }
    }

    #[test]
    fn a_redis_remote_url_is_read_with_its_timeouts() {
        let r =
            resolve(&extra(json!({"remote_url": "redis://localhost:6379", "remote_timeout_ms": 50})), &[])
                .unwrap();
        let remote = r.config.remote.unwrap();
        assert_eq!(
            (remote.url.as_str(), remote.timeout_ms, remote.retry_ms),
            ("redis://localhost:6379", 50, 500)
        );
        let r = resolve(&extra(json!({"local_cpu": false, "remote_url": "redis://h:1"})), &[]).unwrap();
        assert!(!r.config.local_cpu && r.config.has_storage(), "a remote tier alone is somewhere to store");
    }

    #[test]
    fn a_remote_url_without_a_scheme_separator_is_refused_not_a_panic() {
        // Found by the lmcache_config fuzz target: "redis" alone was sliced past its end.
        for url in ["redis", "redis:/h:1", "REDIS", "localhost:6379"] {
            let e = resolve(&extra(json!({"remote_url": url})), &[]).unwrap_err().to_string();
            assert!(e.contains("is not a URL") && e.contains("redis://host:port"), "{url}: {e}");
        }
        let e = resolve(&extra(json!({"remote_url": "redis://"})), &[]).unwrap_err().to_string();
        assert!(e.contains("names no host"), "{e}");
    }

    #[test]
    fn bad_values_are_clear_errors() {
        let e = resolve(&extra(json!({"chunk_size": 0})), &[]).unwrap_err().to_string();
        assert!(e.contains("chunk_size") && e.contains("positive integer") && e.contains("got 0"), "{e}");
        let e = resolve(&extra(json!({"max_local_cpu_size": 0})), &[]).unwrap_err().to_string();
        assert!(e.contains("max_local_cpu_size is 0 GB"), "{e}");
        let e = resolve(&extra(json!({"local_disk": "/tmp/x"})), &[]).unwrap_err().to_string();
        assert!(e.contains("max_local_disk_size is 0 GB"), "{e}");
        let e = resolve(&extra(json!({"local_cpu": false})), &[]).unwrap_err().to_string();
        assert!(e.contains("nowhere to store"), "{e}");
        let env = vec![("LMCACHE_CHUNK_SIZE".to_owned(), "abc".to_owned())];
        let e = resolve(&serde_json::Map::new(), &env).unwrap_err().to_string();
        assert!(e.contains("environment variable LMCACHE_CHUNK_SIZE") && e.contains("'abc'"), "{e}");
        let env = vec![("LMCACHE_CONFIG_FILE".to_owned(), "/nonexistent/lmc.yaml".to_owned())];
        let e = resolve(&serde_json::Map::new(), &env).unwrap_err().to_string();
        assert!(e.contains("LMCACHE_CONFIG_FILE=/nonexistent/lmc.yaml: cannot read the file"), "{e}");
    }

    #[test]
    fn a_bad_value_in_the_file_names_file_key_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("lmcache.yaml");
        std::fs::write(&f, "# cache\nchunk_size: 256\nmax_local_cpu_size: lots\n").unwrap();
        let env = vec![("LMCACHE_CONFIG_FILE".to_owned(), f.display().to_string())];
        let e = resolve(&serde_json::Map::new(), &env).unwrap_err().to_string();
        assert!(
            e.contains(&format!(
                "max_local_cpu_size from LMCACHE_CONFIG_FILE {} line 3 must be a size in GB",
                f.display()
            )),
            "{e}"
        );
    }
}
