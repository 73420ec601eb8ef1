//! vLLM's `--kv-transfer-config` JSON, read verbatim.

pub use crate::role::KvRole;
use serde::{Deserialize, Serialize};

/// `kv_load_failure_policy`: what to do when external KV cannot be loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum FailurePolicy {
    /// The engine computes the missing tokens itself.
    #[default]
    Recompute,
    /// The request ends with an error that says why.
    Fail,
}

/// A KV transfer config as vLLM users write it. Unknown top-level keys are kept in `other`
/// (vLLM has many that kvconnect does not use, e.g. `kv_ip`, `kv_buffer_size`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct KvTransferConfig {
    /// The connector's name (`NixlConnector`, `LMCacheConnectorV1`, `PdConnector`, ...).
    pub kv_connector: String,
    /// The role of this engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_role: Option<KvRole>,
    /// This engine's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_id: Option<String>,
    /// Connector-specific settings; for a composite, `connectors: [ {...}, ... ]`.
    #[serde(default)]
    pub kv_connector_extra_config: serde_json::Map<String, serde_json::Value>,
    /// A plugin name or a path to a plugin library to take the connector from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_connector_module_path: Option<String>,
    /// What to do when KV cannot be loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_load_failure_policy: Option<FailurePolicy>,
    /// `cpu` or `cuda`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_buffer_device: Option<String>,
    /// Other vLLM keys, kept as given.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

/// A kv-transfer-config that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("kv-transfer-config is invalid at line {line}, column {column}: {message}")]
pub struct ConfigError {
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
    /// serde's message.
    pub message: String,
}

impl KvTransferConfig {
    /// Parses the JSON a user passes to `--kv-transfer-config`.
    pub fn from_json(s: &str) -> Result<Self, ConfigError> {
        serde_json::from_str(s).map_err(|e| ConfigError {
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        })
    }

    /// A minimal config naming only a connector.
    pub fn named(kv_connector: &str) -> Self {
        KvTransferConfig {
            kv_connector: kv_connector.to_owned(),
            kv_role: None,
            engine_id: None,
            kv_connector_extra_config: serde_json::Map::new(),
            kv_connector_module_path: None,
            kv_load_failure_policy: None,
            kv_buffer_device: None,
            other: serde_json::Map::new(),
        }
    }

    /// The policy, defaulting to `recompute` as vLLM does.
    pub fn failure_policy(&self) -> FailurePolicy {
        self.kv_load_failure_policy.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_config_verbatim() {
        let c = KvTransferConfig::from_json(concat!(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cuda","#,
            r#""kv_ip":"127.0.0.1"}"#
        ))
        .unwrap();
        assert_eq!(c.kv_connector, "NixlConnector");
        assert_eq!(c.kv_role, Some(KvRole::Both));
        assert_eq!(c.other.get("kv_ip").and_then(|v| v.as_str()), Some("127.0.0.1"));
        assert_eq!(c.failure_policy(), FailurePolicy::Recompute);
    }

    #[test]
    fn malformed_json_names_line_and_column() {
        let e = KvTransferConfig::from_json("{\n \"kv_connector\": ,\n}").unwrap_err();
        assert_eq!(e.line, 2);
        assert!(e.to_string().contains("line 2"), "{e}");
    }
}
