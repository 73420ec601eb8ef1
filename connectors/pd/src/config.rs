//! The composite's own config: `kv_connector_extra_config.connectors` (the children, in
//! order) and `lookup`.

use crate::error::PdError;
use kvconnect_api::KvTransferConfig;

/// How lookups combine children's hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LookupMode {
    /// The first child (in order) with a hit provides the tokens; the others load nothing.
    #[default]
    FirstHit,
    /// Tiers stack: each child is asked for the tokens past what the previous ones matched,
    /// and every child with a hit loads its own part.
    Sum,
}

/// The composite's config, read from a vLLM-style kv-transfer-config.
#[derive(Debug, Clone, PartialEq)]
pub struct PdConfig {
    /// The children's configs, in order, with the parent's role, engine id, buffer device
    /// and failure policy filled in where a child leaves them unset.
    pub children: Vec<KvTransferConfig>,
    /// How lookups combine.
    pub lookup: LookupMode,
}

impl PdConfig {
    /// Reads the composite's part of `config`.
    pub fn from_config(config: &KvTransferConfig) -> Result<PdConfig, PdError> {
        let extra = &config.kv_connector_extra_config;
        let unknown: Vec<String> =
            extra.keys().filter(|k| *k != "connectors" && *k != "lookup").cloned().collect();
        if !unknown.is_empty() {
            return Err(PdError::UnknownKeys { keys: unknown });
        }
        let lookup = match extra.get("lookup") {
            None => LookupMode::FirstHit,
            Some(v) => match v.as_str() {
                Some("first_hit") => LookupMode::FirstHit,
                Some("sum") => LookupMode::Sum,
                _ => return Err(PdError::BadLookup { given: v.to_string() }),
            },
        };
        let list = match extra.get("connectors") {
            None => return Err(PdError::NoChildren),
            Some(serde_json::Value::Array(a)) => a,
            Some(other) => return Err(PdError::BadChildList { what: format!("got {other}") }),
        };
        if list.is_empty() {
            return Err(PdError::NoChildren);
        }
        let mut children = Vec::with_capacity(list.len());
        for (index, v) in list.iter().enumerate() {
            if !v.is_object() {
                return Err(PdError::BadChildList { what: format!("entry {index} is {v}, not an object") });
            }
            let mut child: KvTransferConfig = serde_json::from_value(v.clone())
                .map_err(|e| PdError::BadChild { index, message: e.to_string() })?;
            inherit(&mut child, config);
            children.push(child);
        }
        Ok(PdConfig { children, lookup })
    }
}

/// vLLM's MultiConnector gives each child the parent's engine id; kvconnect also passes the
/// role, buffer device and failure policy down when the child does not set its own, so a
/// user writes them once.
fn inherit(child: &mut KvTransferConfig, parent: &KvTransferConfig) {
    if child.kv_role.is_none() {
        child.kv_role = parent.kv_role;
    }
    if child.engine_id.is_none() {
        child.engine_id.clone_from(&parent.engine_id);
    }
    if child.kv_buffer_device.is_none() {
        child.kv_buffer_device.clone_from(&parent.kv_buffer_device);
    }
    if child.kv_load_failure_policy.is_none() {
        child.kv_load_failure_policy = parent.kv_load_failure_policy;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::KvRole;

    fn cfg(json: &str) -> KvTransferConfig {
        KvTransferConfig::from_json(json).unwrap()
    }

    #[test]
    fn reads_children_in_order_and_inherits_role() {
        let c = PdConfig::from_config(&cfg(
            r#"{"kv_connector":"PdConnector","kv_role":"kv_producer","engine_id":"p0",
                "kv_connector_extra_config":{"connectors":[
                  {"kv_connector":"LMCacheConnectorV1","kv_connector_extra_config":{"chunk_size":128}},
                  {"kv_connector":"NixlConnector","kv_role":"kv_both"}]}}"#,
        ))
        .unwrap();
        assert_eq!(c.lookup, LookupMode::FirstHit);
        assert_eq!(c.children.len(), 2);
        assert_eq!(c.children[0].kv_connector, "LMCacheConnectorV1");
        assert_eq!(c.children[0].kv_role, Some(KvRole::Producer));
        assert_eq!(c.children[0].engine_id.as_deref(), Some("p0"));
        assert_eq!(c.children[1].kv_role, Some(KvRole::Both), "a child's own role wins");
    }

    #[test]
    fn empty_or_missing_child_list_is_an_error() {
        for j in [
            r#"{"kv_connector":"PdConnector"}"#,
            r#"{"kv_connector":"PdConnector","kv_connector_extra_config":{"connectors":[]}}"#,
        ] {
            let e = PdConfig::from_config(&cfg(j)).unwrap_err();
            assert_eq!(e, PdError::NoChildren);
            assert!(e.to_string().contains("kv_connector_extra_config.connectors"), "{e}");
        }
    }

    #[test]
    fn bad_entries_lookup_and_keys_are_named() {
        let e = PdConfig::from_config(&cfg(
            r#"{"kv_connector":"PdConnector","kv_connector_extra_config":{"connectors":["nixl"]}}"#,
        ))
        .unwrap_err();
        assert!(e.to_string().contains("entry 0 is \"nixl\""), "{e}");
        let e = PdConfig::from_config(&cfg(concat!(
            r#"{"kv_connector":"PdConnector","#,
            r#""kv_connector_extra_config":{"connectors":[{"kv_role":"kv_both"}]}}"#
        )))
        .unwrap_err();
        assert!(e.to_string().contains("child 0") && e.to_string().contains("kv_connector"), "{e}");
        let e = PdConfig::from_config(&cfg(concat!(
            r#"{"kv_connector":"PdConnector","#,
            r#""kv_connector_extra_config":{"connectors":[{"kv_connector":"a"}],"lookup":"max"}}"#
        )))
        .unwrap_err();
        assert!(e.to_string().contains("\"max\"") && e.to_string().contains("first_hit"), "{e}");
        let e = PdConfig::from_config(&cfg(concat!(
            r#"{"kv_connector":"PdConnector","#,
            r#""kv_connector_extra_config":{"connectors":[{"kv_connector":"a"}],"conectors":[]}}"#
        )))
        .unwrap_err();
        assert!(e.to_string().contains("'conectors'"), "{e}");
    }

    #[test]
    fn sum_lookup_is_read() {
        let c = PdConfig::from_config(&cfg(concat!(
            r#"{"kv_connector":"PdConnector","#,
            r#""kv_connector_extra_config":{"connectors":[{"kv_connector":"a"}],"lookup":"sum"}}"#
        )))
        .unwrap();
        assert_eq!(c.lookup, LookupMode::Sum);
    }
}
