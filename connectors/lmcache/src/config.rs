//! The LMCache settings users already write, read from three places, highest precedence
//! first: `kv_connector_extra_config` (keys plain or with LMCache's `lmcache.` prefix),
//! `LMCACHE_<KEY>` environment variables, and the flat YAML file named by
//! `LMCACHE_CONFIG_FILE`. Unknown keys are reported (and logged with `tracing::warn`), never
//! silently dropped.

use crate::yaml;
use kvconnect_api::{ConnectorError, KvTransferConfig};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

const NAME: &str = "lmcache";

/// The keys this connector reads (LMCache's names).
pub const KNOWN_KEYS: [&str; 7] = [
    "chunk_size",
    "local_cpu",
    "max_local_cpu_size",
    "local_disk",
    "max_local_disk_size",
    "save_unfull_chunk",
    "use_layerwise",
];

/// Bytes in one of LMCache's "GB" (it multiplies by 1024**3).
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

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
        }
    }
}

/// A resolved config plus the keys nobody reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// The settings.
    pub config: LmcacheConfig,
    /// Unknown keys, each with where it came from, e.g. `chunksize (kv_connector_extra_config)`.
    pub unknown_keys: Vec<String>,
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

    /// Reads the config from the connector's `kv_connector_extra_config`, the process
    /// environment and `LMCACHE_CONFIG_FILE`. Unknown keys are logged once each.
    pub fn from_kv_config(cfg: &KvTransferConfig) -> Result<LmcacheConfig, ConnectorError> {
        let env_vars: Vec<(String, String)> =
            std::env::vars().filter(|(k, _)| k.starts_with("LMCACHE_")).collect();
        let r = resolve(&cfg.kv_connector_extra_config, &env_vars)?;
        warn_unknown_once(&r.unknown_keys);
        Ok(r.config)
    }
}

fn warn_unknown_once(keys: &[String]) {
    static WARNED: OnceLock<Mutex<BTreeSet<String>>> = OnceLock::new();
    if keys.is_empty() {
        return;
    }
    let set = WARNED.get_or_init(|| Mutex::new(BTreeSet::new()));
    let mut set = match set.lock() {
        Ok(s) => s,
        Err(p) => p.into_inner(),
    };
    let fresh: Vec<&String> = keys.iter().filter(|k| set.insert((*k).clone())).collect();
    if !fresh.is_empty() {
        let list = fresh.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
        tracing::warn!(
            unknown_keys = %list,
            "lmcache: ignoring unknown config keys: {list}; known keys are {}",
            KNOWN_KEYS.join(", ")
        );
    }
}

/// A raw value and where it came from.
enum Raw<'a> {
    Json(&'a serde_json::Value),
    Text(Option<String>),
}

/// Resolves the config from `extra` and the given `LMCACHE_*` environment variables (the
/// YAML file is the one `LMCACHE_CONFIG_FILE` names among them). Pure except for reading that
/// file, so tests pass their own environment.
pub fn resolve(
    extra: &serde_json::Map<String, serde_json::Value>,
    env_vars: &[(String, String)],
) -> Result<Resolved, ConnectorError> {
    let mut cfg = LmcacheConfig::default();
    let mut unknown = Vec::new();

    // Lowest precedence first; later sources overwrite.
    if let Some((_, path)) = env_vars.iter().find(|(k, _)| k == "LMCACHE_CONFIG_FILE") {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConnectorError::config(
                NAME,
                format!("cannot read LMCACHE_CONFIG_FILE '{path}': {e}; fix the path or unset the variable"),
            )
        })?;
        let entries = yaml::parse_flat(&text).map_err(|e| {
            ConnectorError::config(
                NAME,
                format!("LMCACHE_CONFIG_FILE '{path}' {e}; only flat `key: value` lines are read"),
            )
        })?;
        for e in entries {
            let source = format!("{path} line {}", e.line);
            if !KNOWN_KEYS.contains(&e.key.as_str()) {
                unknown.push(format!("{} ({source})", e.key));
                continue;
            }
            if e.nested_lines > 0 {
                return Err(ConnectorError::config(
                    NAME,
                    format!("'{}' at {source} has a nested value; it must be a plain scalar", e.key),
                ));
            }
            apply(&mut cfg, &e.key, Raw::Text(e.value), &source)?;
        }
    }

    for (k, v) in env_vars {
        let Some(rest) = k.strip_prefix("LMCACHE_") else { continue };
        if rest == "CONFIG_FILE" {
            continue;
        }
        let key = rest.to_ascii_lowercase();
        if !KNOWN_KEYS.contains(&key.as_str()) {
            unknown.push(format!("{k} (environment)"));
            continue;
        }
        let text = if v.is_empty() || v == "None" || v == "null" { None } else { Some(v.clone()) };
        apply(&mut cfg, &key, Raw::Text(text), &format!("environment variable {k}"))?;
    }

    for (k, v) in extra {
        let key = k.strip_prefix("lmcache.").unwrap_or(k);
        if !KNOWN_KEYS.contains(&key) {
            unknown.push(format!("{k} (kv_connector_extra_config)"));
            continue;
        }
        apply(&mut cfg, key, Raw::Json(v), &format!("kv_connector_extra_config key '{k}'"))?;
    }

    validate(&cfg)?;
    Ok(Resolved { config: cfg, unknown_keys: unknown })
}

fn apply(cfg: &mut LmcacheConfig, key: &str, raw: Raw<'_>, source: &str) -> Result<(), ConnectorError> {
    let shown = match &raw {
        Raw::Json(v) => v.to_string(),
        Raw::Text(Some(s)) => format!("'{s}'"),
        Raw::Text(None) => "null".to_owned(),
    };
    let bad =
        |want: &str| ConnectorError::config(NAME, format!("{key} from {source} must be {want}, got {shown}"));
    match key {
        "chunk_size" => {
            let n = match &raw {
                Raw::Json(v) => v.as_u64(),
                Raw::Text(Some(s)) => s.trim().parse::<u64>().ok(),
                Raw::Text(None) => None,
            };
            let n = n.ok_or_else(|| bad("a positive integer (tokens per chunk, e.g. 256)"))?;
            if n == 0 || n > (1 << 20) {
                return Err(bad("a positive integer no larger than 1048576 (tokens per chunk, e.g. 256)"));
            }
            cfg.chunk_size = n as u32;
        }
        "local_cpu" | "save_unfull_chunk" | "use_layerwise" => {
            let b = match &raw {
                Raw::Json(v) => v.as_bool(),
                Raw::Text(Some(s)) => parse_bool(s),
                Raw::Text(None) => None,
            };
            let b = b.ok_or_else(|| bad("true or false"))?;
            match key {
                "local_cpu" => cfg.local_cpu = b,
                "save_unfull_chunk" => cfg.save_unfull_chunk = b,
                _ => cfg.use_layerwise = b,
            }
        }
        "max_local_cpu_size" | "max_local_disk_size" => {
            let f = match &raw {
                Raw::Json(v) => v.as_f64(),
                Raw::Text(Some(s)) => s.trim().parse::<f64>().ok(),
                Raw::Text(None) => None,
            };
            let f = f.filter(|f| f.is_finite() && *f >= 0.0).ok_or_else(|| bad("a size in GB (e.g. 5.0)"))?;
            if key == "max_local_cpu_size" {
                cfg.max_local_cpu_size = f;
            } else {
                cfg.max_local_disk_size = f;
            }
        }
        "local_disk" => {
            let s = match &raw {
                Raw::Json(serde_json::Value::Null) => None,
                Raw::Json(v) => Some(v.as_str().ok_or_else(|| bad("a path or \"file:///path\""))?.to_owned()),
                Raw::Text(s) => s.clone(),
            };
            cfg.local_disk = match s {
                None => None,
                Some(s) => {
                    let p = s.strip_prefix("file://").unwrap_or(&s);
                    if p.is_empty() {
                        return Err(bad("a path or \"file:///path\""));
                    }
                    Some(PathBuf::from(p))
                }
            };
        }
        _ => {}
    }
    Ok(())
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

fn validate(cfg: &LmcacheConfig) -> Result<(), ConnectorError> {
    if cfg.local_cpu && cfg.cpu_budget_bytes() == 0 {
        return Err(ConnectorError::config(
            NAME,
            format!(
                "max_local_cpu_size is {} GB, which leaves the CPU tier no room; set a positive size (LMCache's default is 5.0) or local_cpu: false",
                cfg.max_local_cpu_size
            ),
        ));
    }
    if let Some(dir) = &cfg.local_disk {
        if cfg.disk_budget_bytes() == 0 {
            return Err(ConnectorError::config(
                NAME,
                format!(
                    "local_disk is '{}' but max_local_disk_size is {} GB; set a positive size or remove local_disk",
                    dir.display(),
                    cfg.max_local_disk_size
                ),
            ));
        }
    }
    if !cfg.local_cpu && cfg.local_disk.is_none() {
        return Err(ConnectorError::config(
            NAME,
            "local_cpu is false and no local_disk is set, so there is nowhere to store chunks; enable local_cpu or set local_disk",
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
            "chunk_size: 64\nmax_local_cpu_size: 1.5\nsave_unfull_chunk: true\nlocal_disk: \"file:///tmp/lmc\"\nmax_local_disk_size: 2\n",
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
    fn unknown_keys_are_named_with_their_source() {
        let env = vec![("LMCACHE_REMOTE_URL".to_owned(), "lm://x".to_owned())];
        let r = resolve(&extra(json!({"chunksize": 256, "chunk_size": 16})), &env).unwrap();
        assert!(
            r.unknown_keys.contains(&"chunksize (kv_connector_extra_config)".to_owned()),
            "{:?}",
            r.unknown_keys
        );
        assert!(
            r.unknown_keys.contains(&"LMCACHE_REMOTE_URL (environment)".to_owned()),
            "{:?}",
            r.unknown_keys
        );
    }

    #[test]
    fn unknown_keys_are_logged_as_warnings_naming_them() {
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
            extra(json!({"chunk_size": 64, "remote_url_for_warn_test": "lm://x"}));
        let c = tracing::subscriber::with_default(sub, || LmcacheConfig::from_kv_config(&cfg)).unwrap();
        assert_eq!(c.chunk_size, 64);
        let log = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        assert!(log.contains("WARN"), "{log}");
        assert!(
            log.contains(
                "ignoring unknown config keys: remote_url_for_warn_test (kv_connector_extra_config)"
            ),
            "{log}"
        );
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
        assert!(e.contains("cannot read LMCACHE_CONFIG_FILE '/nonexistent/lmc.yaml'"), "{e}");
    }
}
