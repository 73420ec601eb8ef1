//! Settings a user writes where nothing reads them inside vLLM: refused (a setting that
//! changes what a failed request does) or warned about (one that is merely unused), at
//! startup, each naming where it was found and what to write instead.

use kvconnect_api::KvRole;
use serde_json::{Map, Value};

const POLICY: &str = "kv_load_failure_policy";

/// Where in the adapter's `kv_connector_extra_config` a `kv_load_failure_policy` was written,
/// with the remedy, or `None` when there is none. vLLM reads the policy only at the top level
/// of `--kv-transfer-config` (its scheduler applies it; default `fail`, an HTTP 500). The
/// adapter's own keys do not include it, and kvconnect's kv-transfer-config (`kvconnect`, and
/// each child of a composite) does take it, but for kvconnect's own workers: inside vLLM no
/// one reads it there.
pub fn misplaced_failure_policy(extra: &Map<String, Value>) -> Option<String> {
    if let Some(v) = extra.get(POLICY) {
        return Some(refusal("kv_connector_extra_config", "the adapter's keys do not include it", v));
    }
    let inner = match extra.get("kvconnect")? {
        Value::String(s) => serde_json::from_str(s).ok()?,
        v => v.clone(),
    };
    let (path, v) = in_kvconnect_config(&inner, "kv_connector_extra_config.kvconnect".to_owned())?;
    Some(refusal(&path, "kvconnect's own workers read it there, but inside vLLM only vLLM applies it", &v))
}

/// The first `kv_load_failure_policy` in a kvconnect kv-transfer-config: at its top level,
/// in its `kv_connector_extra_config`, or in a composite's children.
fn in_kvconnect_config(config: &Value, path: String) -> Option<(String, Value)> {
    let obj = config.as_object()?;
    if let Some(v) = obj.get(POLICY) {
        return Some((path, v.clone()));
    }
    let extra = obj.get("kv_connector_extra_config")?.as_object()?;
    let extra_path = format!("{path}.kv_connector_extra_config");
    if let Some(v) = extra.get(POLICY) {
        return Some((extra_path, v.clone()));
    }
    let children = extra.get("connectors")?.as_array()?;
    children
        .iter()
        .enumerate()
        .find_map(|(i, c)| in_kvconnect_config(c, format!("{extra_path}.connectors[{i}]")))
}

fn refusal(path: &str, why: &str, given: &Value) -> String {
    let value = given.as_str().filter(|p| matches!(*p, "recompute" | "fail")).unwrap_or("recompute");
    format!(
        "{POLICY} is set in {path}, where it has no effect ({why}): vLLM reads it only at the top level of \
            --kv-transfer-config; move it there, beside kv_connector: \
            '{{\"kv_connector\":\"KvconnectConnector\",\"{POLICY}\":\"{value}\",...}}' (vLLM's default is \
            \"fail\": a failed KV load ends the request with HTTP 500; \"recompute\" computes the prompt \
            instead)"
    )
}

/// Why `side_channel_host` / `side_channel_port`, when given, go unused on this server, or
/// `None` when they are used (or not given). `moves_kv`: the connector moves KV to a peer
/// engine (it has a transport).
pub fn unused_side_channel(role: KvRole, moves_kv: bool, connector: &str, given: &[&str]) -> Option<String> {
    if given.is_empty() {
        return None;
    }
    let keys = given.join(" and ");
    if !moves_kv {
        return Some(format!(
            "{keys} ignored: '{connector}' moves no KV to another engine, so this server serves no side \
                channel"
        ));
    }
    (role == KvRole::Consumer).then(|| {
        format!(
            "{keys} ignored: kv_role is kv_consumer, and a decode serves no side channel; it reaches each \
                prefill at the address that prefill's kv_transfer_params carry (set the port on prefill, \
                kv_producer)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn extra(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn a_failure_policy_in_the_adapter_keys_is_refused_with_the_top_level_remedy() {
        let e = misplaced_failure_policy(&extra(json!({"kv_load_failure_policy": "recompute",
            "kvconnect": {"kv_connector": "NixlConnector"}})))
        .unwrap();
        assert!(e.starts_with("kv_load_failure_policy is set in kv_connector_extra_config, "), "{e}");
        assert!(e.contains("the adapter's keys do not include it"), "{e}");
        assert!(e.contains("only at the top level of --kv-transfer-config"), "{e}");
        assert!(
            e.contains(r#"'{"kv_connector":"KvconnectConnector","kv_load_failure_policy":"recompute",...}'"#),
            "{e}"
        );
        assert_eq!(e.lines().count(), 1);
    }

    #[test]
    fn a_failure_policy_inside_kvconnect_is_refused_naming_where() {
        let cases = [
            (
                json!({"kvconnect": {"kv_connector": "NixlConnector", "kv_load_failure_policy": "fail"}}),
                "kv_connector_extra_config.kvconnect,",
                "fail",
            ),
            (
                // The JSON-text form of `kvconnect`.
                json!({
                    "kvconnect": r#"{"kv_connector":"NixlConnector","kv_load_failure_policy":"recompute"}"#
                }),
                "kv_connector_extra_config.kvconnect,",
                "recompute",
            ),
            (
                json!({"kvconnect": {"kv_connector": "NixlConnector",
                    "kv_connector_extra_config": {"backend": "tcp", "kv_load_failure_policy": "fail"}}}),
                "kv_connector_extra_config.kvconnect.kv_connector_extra_config,",
                "fail",
            ),
            (
                // A value vLLM does not take: the remedy shows one it does.
                json!({"kvconnect": {"kv_connector": "PdConnector",
                    "kv_connector_extra_config": {"connectors": [
                    {"kv_connector": "LMCacheConnectorV1"},
                    {"kv_connector": "NixlConnector", "kv_load_failure_policy": "retry"}]}}}),
                "kv_connector_extra_config.kvconnect.kv_connector_extra_config.connectors[1],",
                "recompute",
            ),
        ];
        for (v, path, value) in cases {
            let e = misplaced_failure_policy(&extra(v)).unwrap();
            assert!(e.contains(&format!("is set in {path}")), "{e}");
            assert!(e.contains("kvconnect's own workers read it there"), "{e}");
            assert!(e.contains(&format!(r#""kv_load_failure_policy":"{value}",...}}'"#)), "{e}");
        }
    }

    #[test]
    fn no_failure_policy_or_an_unreadable_kvconnect_is_left_to_the_parser() {
        for v in [
            json!({"kvconnect": {
                "kv_connector": "NixlConnector", "kv_connector_extra_config": {"backend": "tcp"},
            }}),
            json!({"kvconnect": "{not json"}),
            json!({"kvconnect": 3}),
            json!({"deployment": "/x.toml"}),
        ] {
            assert_eq!(misplaced_failure_policy(&extra(v.clone())), None, "{v}");
        }
    }

    #[test]
    fn a_side_channel_on_a_consumer_or_a_cache_connector_is_named_unused() {
        let w = unused_side_channel(KvRole::Consumer, true, "NixlConnector", &["side_channel_port"]).unwrap();
        assert!(w.starts_with("side_channel_port ignored: kv_role is kv_consumer"), "{w}");
        assert!(w.contains("kv_transfer_params"), "{w}");
        let w = unused_side_channel(
            KvRole::Both,
            false,
            "LMCacheConnectorV1",
            &["side_channel_host", "side_channel_port"],
        )
        .unwrap();
        assert!(
            w.starts_with(
                "side_channel_host and side_channel_port ignored: 'LMCacheConnectorV1' moves no KV"
            ),
            "{w}"
        );
        assert_eq!(
            unused_side_channel(KvRole::Producer, true, "NixlConnector", &["side_channel_port"]),
            None
        );
        assert_eq!(unused_side_channel(KvRole::Both, true, "NixlConnector", &["side_channel_port"]), None);
        assert_eq!(unused_side_channel(KvRole::Consumer, true, "NixlConnector", &[]), None);
    }
}
