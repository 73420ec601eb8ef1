//! LMCache's disaggregated-prefill settings (`enable_pd`, `pd_role`, `transfer_channel`,
//! `nixl_*`, ...) read as what they are: a request for P/D.
//!
//! In kvconnect, P/D is the nixl connector: prefill keeps a request's KV blocks and decode
//! pulls them. LMCache's prefiller (`pd_role: sender`) is therefore a `PdConnector` of lmcache
//! (the cache, when the file keeps chunks somewhere) and `NixlConnector`, as `kv_producer`; its
//! decoder (`pd_role: receiver`) is the nixl connector as `kv_consumer`, beside lmcache when
//! the file keeps chunks. [`PdRequest::kv_transfer_config`] builds that config; the host turns
//! a deployment into it (and says so), and an lmcache created directly from such settings
//! refuses with the JSON to use ([`PdRequest::refusal`]).

use crate::config::{LmcacheConfig, Raw};
use kvconnect_api::{ConnectorError, KvRole, KvTransferConfig};
use serde_json::{json, Value};

/// LMCache's side of a P/D pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdRole {
    /// `pd_role: sender`: the prefiller.
    Sender,
    /// `pd_role: receiver`: the decoder.
    Receiver,
}

impl PdRole {
    /// The kvconnect role of that side.
    pub fn kv_role(self) -> KvRole {
        match self {
            PdRole::Sender => KvRole::Producer,
            PdRole::Receiver => KvRole::Consumer,
        }
    }

    /// `sender` or `receiver`.
    pub fn name(self) -> &'static str {
        match self {
            PdRole::Sender => "sender",
            PdRole::Receiver => "receiver",
        }
    }
}

/// The P/D keys given, in the order read; a later source's value replaces an earlier one.
#[derive(Debug, Default)]
pub(crate) struct PdKeys {
    entries: Vec<(String, Raw, String)>,
}

impl PdKeys {
    pub(crate) fn add(&mut self, key: &str, raw: Raw, source: &str) {
        self.entries.retain(|(k, _, _)| k != key);
        self.entries.push((key.to_owned(), raw, source.to_owned()));
    }

    fn get(&self, names: &[&str]) -> Option<&(String, Raw, String)> {
        // The latest of the names given (LMCache's aliases: enable_xpyd, nixl_role, ...).
        self.entries.iter().rev().find(|(k, _, _)| names.contains(&k.as_str()))
    }

    /// What the keys ask for: `None` when none is given; with P/D off they are logged as not
    /// read (into `mapped`).
    pub(crate) fn finish(self, mapped: &mut Vec<String>) -> Result<Option<PdRequest>, ConnectorError> {
        if self.entries.is_empty() {
            return Ok(None);
        }
        let bad = |key: &str, source: &str, raw: &Raw, want: &str| {
            ConnectorError::config(
                "lmcache",
                format!("{key} from {source} must be {want}, got {}", raw.shown()),
            )
        };
        let listed = || self.entries.iter().map(|(k, _, _)| k.as_str()).collect::<Vec<_>>().join(", ");
        let enable = match self.get(&["enable_pd", "enable_xpyd", "enable_nixl"]) {
            None => None,
            Some((k, raw, source)) => {
                let b = if raw.is_null() {
                    false
                } else {
                    raw.as_bool().ok_or_else(|| bad(k, source, raw, "true or false"))?
                };
                Some((b, format!("{k}: {b} from {source}")))
            }
        };
        let Some((true, enabled_by)) = enable else {
            mapped.push(format!(
                "{} : P/D keys, not read because enable_pd is off for this lmcache; in kvconnect the nixl \
                    connector beside lmcache in a PdConnector carries KV from prefill to decode",
                listed()
            ));
            return Ok(None);
        };
        let role = match self.get(&["pd_role", "nixl_role"]) {
            None => {
                return Err(ConnectorError::config(
                    "lmcache",
                    format!(
                        "{enabled_by} asks for P/D but pd_role is not set; set pd_role: sender on \
                        prefill or pd_role: receiver on decode"
                    ),
                ))
            }
            Some((k, raw, source)) => match raw.as_str().map(|s| s.trim().to_ascii_lowercase()) {
                Some(s) if s == "sender" || s == "producer" || s == "prefiller" => PdRole::Sender,
                Some(s) if s == "receiver" || s == "consumer" || s == "decoder" => PdRole::Receiver,
                _ => return Err(bad(k, source, raw, "\"sender\" (prefill) or \"receiver\" (decode)")),
            },
        };
        if let Some((k, raw, source)) = self.get(&["transfer_channel"]) {
            let ch = raw.as_str().map(|s| s.trim().to_ascii_lowercase());
            if !raw.is_null() && ch.as_deref() != Some("nixl") {
                mapped.push(format!(
                    "{k} = {} (from {source}): KV moves through kvconnect's nixl connector (shared memory on \
                        one host; \"backend\": \"tcp\" or \"nixl\" across hosts)",
                    raw.shown()
                ));
            }
        }
        let keys = self.entries.iter().map(|(k, _, s)| format!("{k} ({s})")).collect();
        Ok(Some(PdRequest { role, enabled_by, keys }))
    }
}

/// LMCache P/D settings with P/D on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdRequest {
    /// Which side.
    pub role: PdRole,
    /// `enable_pd: true from LMCACHE_CONFIG_FILE /x.yaml line 5`.
    pub enabled_by: String,
    /// Every P/D key given, with its source.
    pub keys: Vec<String>,
}

impl PdRequest {
    /// True: a request is only made with P/D on.
    pub fn enabled(&self) -> bool {
        true
    }

    /// The kv-transfer-config kvconnect runs for `original` (an lmcache config carrying these
    /// settings) whose cache settings resolved to `cache`: the nixl connector with the role of
    /// `pd_role`, beside lmcache in a `PdConnector` when `cache` keeps chunks somewhere. The
    /// lmcache child gets `enable_pd: false` (the nixl child does the P/D); everything the
    /// original sets besides its extra config stays on the top level.
    pub fn kv_transfer_config(&self, original: &KvTransferConfig, cache: &LmcacheConfig) -> KvTransferConfig {
        let mut top = original.clone();
        top.kv_role = Some(original.kv_role.unwrap_or(self.role.kv_role()));
        top.kv_connector_module_path = None;
        if !cache.has_storage() {
            top.kv_connector = "NixlConnector".to_owned();
            top.kv_connector_extra_config = serde_json::Map::new();
            return top;
        }
        let mut extra = original.kv_connector_extra_config.clone();
        extra.insert("enable_pd".to_owned(), Value::Bool(false));
        let mut lmcache = json!({"kv_connector": original.kv_connector, "kv_connector_extra_config": extra});
        if let Some(p) = &original.kv_connector_module_path {
            lmcache["kv_connector_module_path"] = json!(p);
        }
        top.kv_connector = "PdConnector".to_owned();
        top.kv_connector_extra_config = serde_json::Map::new();
        top.kv_connector_extra_config
            .insert("connectors".to_owned(), json!([lmcache, {"kv_connector": "NixlConnector"}]));
        top
    }

    /// One paragraph for the log and `kvconnect plan`: what was asked and what runs.
    pub fn announcement(&self, original: &KvTransferConfig, cache: &LmcacheConfig) -> String {
        let cfg = self.kv_transfer_config(original, cache);
        let json = serde_json::to_string(&cfg).unwrap_or_default();
        let what = if cache.has_storage() {
            "the nixl connector beside lmcache in a PdConnector"
        } else {
            "the nixl connector alone (these settings keep no chunks: local_cpu is false and neither \
                local_disk nor remote_url is set)"
        };
        format!(
            "LMCache P/D settings ({}; pd_role: {}) ask for disaggregated prefill: in kvconnect that is \
                {what}, as {}; running {json}",
            self.enabled_by,
            self.role.name(),
            role_name(self.role.kv_role()),
        )
    }

    /// The error an lmcache created straight from these settings answers: P/D is the nixl
    /// connector beside lmcache in a PdConnector, and the kv-transfer-config to use.
    pub fn refusal(&self, cache: &LmcacheConfig) -> String {
        let original = KvTransferConfig::named("LMCacheConnectorV1");
        let mut with_cache = cache.clone();
        with_cache.local_cpu = true;
        let mut composite = self.kv_transfer_config(&original, &with_cache);
        if !cache.has_storage() {
            // The file's local_cpu: false would leave the lmcache child nowhere to store.
            if let Some(extra) = composite
                .kv_connector_extra_config
                .get_mut("connectors")
                .and_then(|c| c.get_mut(0))
                .and_then(|c| c.get_mut("kv_connector_extra_config"))
                .and_then(Value::as_object_mut)
            {
                extra.insert("local_cpu".to_owned(), Value::Bool(true));
            }
        }
        let mut s = format!(
            "LMCache P/D settings ({}; pd_role: {}) ask for disaggregated prefill, which kvconnect's lmcache \
                does not do itself: in kvconnect, P/D is the nixl connector beside lmcache in a PdConnector. \
                Run this {} with --kv-transfer-config '{}'",
            self.enabled_by,
            self.role.name(),
            if self.role == PdRole::Sender { "prefill worker" } else { "decode worker" },
            serde_json::to_string(&composite).unwrap_or_default(),
        );
        if !cache.has_storage() {
            let nixl = self.kv_transfer_config(&original, cache);
            s.push_str(&format!(
                " (lmcache with its CPU tier, since local_cpu: false leaves it nowhere to keep chunks), or \
                    '{}' to move KV without caching it",
                serde_json::to_string(&nixl).unwrap_or_default()
            ));
        }
        s.push_str(
            "; a deployment file or --kv-transfer-config naming LMCacheConnectorV1 with these settings is \
                turned into that by the worker and `kvconnect plan`",
        );
        s
    }
}

fn role_name(r: KvRole) -> &'static str {
    match r {
        KvRole::Producer => "kv_producer",
        KvRole::Consumer => "kv_consumer",
        KvRole::Both => "kv_both",
    }
}

/// What kvconnect runs for a kv-transfer-config whose lmcache asks for P/D, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct PdRewrite {
    /// The config to run.
    pub config: KvTransferConfig,
    /// What was asked and what runs, for the log and `kvconnect plan`.
    pub announcement: String,
}

fn is_lmcache(name: &str) -> bool {
    matches!(name, "LMCacheConnectorV1" | "LMCacheConnector" | "lmcache")
}

fn is_nixl(name: &str) -> bool {
    matches!(name, "NixlConnector" | "nixl")
}

/// Turns a kv-transfer-config whose lmcache asks for P/D (in its extra config or through
/// `LMCACHE_*` variables and `LMCACHE_CONFIG_FILE` in `env`) into the one kvconnect runs:
/// a plain lmcache becomes [`PdRequest::kv_transfer_config`]; an lmcache child of a composite
/// gets `enable_pd: false`, and a nixl child when the composite has none. `Ok(None)`: nothing
/// to do. A role that contradicts `pd_role` is an error.
pub fn rewrite(
    cfg: &KvTransferConfig,
    env: &[(String, String)],
) -> Result<Option<PdRewrite>, ConnectorError> {
    if is_lmcache(&cfg.kv_connector) {
        let r = crate::config::resolve_all(&cfg.kv_connector_extra_config, env)?;
        let Some(pd) = r.pd else { return Ok(None) };
        check_role(cfg.kv_role, &pd)?;
        return Ok(Some(PdRewrite {
            config: pd.kv_transfer_config(cfg, &r.config),
            announcement: pd.announcement(cfg, &r.config),
        }));
    }
    let Some(Value::Array(children)) = cfg.kv_connector_extra_config.get("connectors") else {
        return Ok(None);
    };
    let mut children = children.clone();
    let mut notes = Vec::new();
    let has_nixl = children.iter().any(|c| c["kv_connector"].as_str().is_some_and(is_nixl));
    let mut add_nixl = false;
    for c in children.iter_mut() {
        let Some(name) = c["kv_connector"].as_str().filter(|n| is_lmcache(n)).map(str::to_owned) else {
            continue;
        };
        let child: KvTransferConfig = match serde_json::from_value(c.clone()) {
            Ok(k) => k,
            Err(_) => continue,
        };
        let r = crate::config::resolve_all(&child.kv_connector_extra_config, env)?;
        let Some(pd) = r.pd else { continue };
        check_role(child.kv_role.or(cfg.kv_role), &pd)?;
        if let Some(extra) = c.get_mut("kv_connector_extra_config").and_then(Value::as_object_mut) {
            extra.insert("enable_pd".to_owned(), Value::Bool(false));
        } else {
            c["kv_connector_extra_config"] = json!({"enable_pd": false});
        }
        add_nixl |= !has_nixl;
        notes.push(format!(
            "{name} child's LMCache P/D settings ({}; pd_role: {}) ask for disaggregated prefill: the \
                composite's nixl connector {} does it{}",
            pd.enabled_by,
            pd.role.name(),
            if has_nixl { "child" } else { "(added as a child)" },
            if r.config.has_storage() { ", and lmcache keeps its tiers" } else { "" },
        ));
    }
    if notes.is_empty() {
        return Ok(None);
    }
    if add_nixl {
        children.push(json!({"kv_connector": "NixlConnector"}));
    }
    let mut out = cfg.clone();
    out.kv_connector_extra_config.insert("connectors".to_owned(), Value::Array(children));
    let json = serde_json::to_string(&out).unwrap_or_default();
    Ok(Some(PdRewrite { announcement: format!("{}; running {json}", notes.join("; ")), config: out }))
}

fn check_role(given: Option<KvRole>, pd: &PdRequest) -> Result<(), ConnectorError> {
    let want = pd.role.kv_role();
    match given {
        Some(r) if r != want && r != KvRole::Both => Err(ConnectorError::config(
            "lmcache",
            format!(
                "kv_role is {} but the LMCache P/D settings say pd_role: \
                 {} ({}); a {} is {}: make them agree",
                role_name(r),
                pd.role.name(),
                pd.enabled_by,
                pd.role.name(),
                role_name(want)
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_file(text: &str) -> (tempfile::TempDir, Vec<(String, String)>) {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("lmcache.yaml");
        std::fs::write(&f, text).unwrap();
        let env = vec![("LMCACHE_CONFIG_FILE".to_owned(), f.display().to_string())];
        (dir, env)
    }

    #[test]
    fn a_plain_lmcache_with_enable_pd_becomes_the_composite_or_nixl() {
        let (_d, env) = env_file("enable_pd: true\npd_role: sender\npd_buffer_size: 1024\n");
        let cfg = KvTransferConfig::from_json(r#"{"kv_connector":"LMCacheConnectorV1"}"#).unwrap();
        let r = rewrite(&cfg, &env).unwrap().unwrap();
        assert_eq!(r.config.kv_connector, "PdConnector");
        assert_eq!(r.config.kv_role, Some(KvRole::Producer));
        let children = r.config.kv_connector_extra_config["connectors"].as_array().unwrap();
        assert_eq!(children[0]["kv_connector_extra_config"]["enable_pd"], false);
        assert_eq!(children[1]["kv_connector"], "NixlConnector");
        assert!(
            r.announcement.contains("the nixl connector beside lmcache in a PdConnector"),
            "{}",
            r.announcement
        );
        // Its lmcache child no longer asks for P/D.
        let child: KvTransferConfig = serde_json::from_value(children[0].clone()).unwrap();
        assert!(crate::config::resolve(&child.kv_connector_extra_config, &env).is_ok());

        let (_d, env) = env_file("local_cpu: False\nenable_pd: True\npd_role: receiver\n");
        let r = rewrite(&cfg, &env).unwrap().unwrap();
        assert_eq!(r.config.kv_connector, "NixlConnector");
        assert_eq!(r.config.kv_role, Some(KvRole::Consumer));
        assert!(r.announcement.contains("keep no chunks"), "{}", r.announcement);
        let bad =
            KvTransferConfig::from_json(r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_producer"}"#)
                .unwrap();
        let e = rewrite(&bad, &env).unwrap_err().to_string();
        assert!(e.contains("kv_role is kv_producer") && e.contains("pd_role: receiver"), "{e}");
    }

    #[test]
    fn an_lmcache_child_is_switched_off_and_nixl_added_when_missing() {
        let cfg = KvTransferConfig::from_json(concat!(
            r#"{"kv_connector":"PdConnector","#,
            r#""kv_connector_extra_config":{"connectors":[{"kv_connector":"LMCacheConnectorV1","#,
            r#""kv_connector_extra_config":{"enable_pd":true,"pd_role":"sender"}}]}}"#
        ))
        .unwrap();
        let r = rewrite(&cfg, &[]).unwrap().unwrap();
        let children = r.config.kv_connector_extra_config["connectors"].as_array().unwrap();
        assert_eq!(children.len(), 2);
        assert_eq!(children[0]["kv_connector_extra_config"]["enable_pd"], false);
        assert_eq!(children[1]["kv_connector"], "NixlConnector");
        assert!(rewrite(&r.config, &[]).unwrap().is_none(), "a rewritten config needs nothing more");
        let plain = KvTransferConfig::from_json(r#"{"kv_connector":"LMCacheConnectorV1"}"#).unwrap();
        assert!(rewrite(&plain, &[]).unwrap().is_none());
    }

    #[test]
    fn the_refusal_says_p_d_is_nixl_beside_lmcache_with_the_json() {
        let (_d, env) = env_file(
            "local_cpu: False\nsave_unfull_chunk: true\nenable_pd: True\n\
             transfer_channel: \"nixl\"\npd_role: \"sender\"\n",
        );
        let e = crate::config::resolve(&serde_json::Map::new(), &env).unwrap_err().to_string();
        assert!(e.contains("in kvconnect, P/D is the nixl connector beside lmcache in a PdConnector"), "{e}");
        assert!(
            e.contains(r#""kv_connector":"PdConnector""#) && e.contains(r#""kv_role":"kv_producer""#),
            "{e}"
        );
        assert!(!e.contains("nowhere to store chunks;"), "the storage message is not the answer to P/D: {e}");
    }
}
