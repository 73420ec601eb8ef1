//! Turning a server's kv-transfer-config into connector instances: the host writes its
//! side-channel address into every nixl config (top level or a composite's child, at any
//! depth) so `request_finished` can hand it to the peer, and the deployment's data-plane
//! secret (in memory only), and reads which nixl backend is in use (the `shm` backend needs
//! the block pool in shared memory).

use crate::registry::Registry;
use kvconnect_api::{ConnectorContext, KvTransferConfig, SchedulerConnector, WorkerConnector};
use kvconnect_dataplane::auth::{Secret, SECRET_CONFIG_KEY};
use kvconnect_nixl::config::{Backend, NixlConfig};
use serde_json::{Map, Value};

fn is_nixl(registry: &Registry, name: &str) -> bool {
    registry.find(name).map(|e| e.name == "nixl").unwrap_or(false)
}

/// What the host writes into every nixl config.
struct Injected<'a> {
    host: &'a str,
    port: u16,
    secret: Option<&'a Secret>,
}

fn set_in_extra(extra: &mut Map<String, Value>, i: &Injected) {
    extra.insert("side_channel_host".into(), Value::String(i.host.to_owned()));
    extra.insert("side_channel_port".into(), Value::from(i.port));
    match i.secret {
        Some(s) => extra.insert(SECRET_CONFIG_KEY.into(), Value::String(s.to_text())),
        None => extra.remove(SECRET_CONFIG_KEY),
    };
}

/// True when a config (at any depth) sets the data-plane secret itself.
pub fn carries_secret(config: &KvTransferConfig) -> bool {
    fn walk(v: &Value) -> bool {
        match v {
            Value::Object(m) => m.contains_key(SECRET_CONFIG_KEY) || m.values().any(walk),
            Value::Array(a) => a.iter().any(walk),
            _ => false,
        }
    }
    config.kv_connector_extra_config.contains_key(SECRET_CONFIG_KEY)
        || config.kv_connector_extra_config.values().any(walk)
}

fn walk_children(registry: &Registry, extra: &mut Map<String, Value>, i: &Injected, found: &mut Vec<Value>) {
    let Some(Value::Array(children)) = extra.get_mut("connectors") else { return };
    for child in children.iter_mut() {
        let Value::Object(c) = child else { continue };
        let name = c.get("kv_connector").and_then(Value::as_str).unwrap_or_default().to_owned();
        let entry = c.entry("kv_connector_extra_config").or_insert_with(|| Value::Object(Map::new()));
        let Value::Object(child_extra) = entry else { continue };
        if is_nixl(registry, &name) {
            set_in_extra(child_extra, i);
            found.push(Value::Object(c.clone()));
            continue;
        }
        walk_children(registry, child_extra, i, found);
    }
}

/// The config with `side_channel_host`/`side_channel_port` and the data-plane secret set in
/// every nixl config in it, and the nixl configs found (as written, after the change).
pub fn with_side_channel(
    registry: &Registry,
    config: &KvTransferConfig,
    host: &str,
    port: u16,
    secret: Option<&Secret>,
) -> (KvTransferConfig, Vec<KvTransferConfig>) {
    let mut c = config.clone();
    let mut found = Vec::new();
    let i = Injected { host, port, secret };
    if is_nixl(registry, &c.kv_connector) {
        set_in_extra(&mut c.kv_connector_extra_config, &i);
        return (c.clone(), vec![c]);
    }
    let mut raw = Vec::new();
    walk_children(registry, &mut c.kv_connector_extra_config, &i, &mut raw);
    for v in raw {
        if let Ok(k) = serde_json::from_value::<KvTransferConfig>(v) {
            found.push(k);
        }
    }
    (c, found)
}

/// The nixl backend of the first nixl config, if any (it decides whether the pool lives in
/// shared memory).
pub fn nixl_backend(nixl_configs: &[KvTransferConfig]) -> Result<Option<Backend>, String> {
    match nixl_configs.first() {
        None => Ok(None),
        Some(c) => NixlConfig::from_config(c).map(|n| Some(n.backend)).map_err(|e| e.to_string()),
    }
}

/// Both halves of a connector instance.
pub type ConnectorHalves = (Box<dyn SchedulerConnector>, Box<dyn WorkerConnector>);

fn resolve(
    registry: &Registry,
    ctx: &ConnectorContext,
) -> Result<std::sync::Arc<dyn kvconnect_api::ConnectorFactory>, String> {
    use kvconnect_api::ConnectorResolver;
    registry
        .resolve(&ctx.config)
        .map_err(|e| format!("cannot resolve connector '{}': {e}", ctx.config.kv_connector))
}

/// Creates the scheduler half of the configured connector (an engine whose scheduler and
/// workers live in separate processes, as vLLM's do, creates each half where it runs).
pub fn create_scheduler(
    registry: &Registry,
    ctx: &ConnectorContext,
) -> Result<Box<dyn SchedulerConnector>, String> {
    resolve(registry, ctx)?
        .create_scheduler(ctx)
        .map_err(|e| format!("cannot create the scheduler half: {e}"))
}

/// Creates the worker half of the configured connector.
pub fn create_worker(
    registry: &Registry,
    ctx: &ConnectorContext,
) -> Result<Box<dyn WorkerConnector>, String> {
    resolve(registry, ctx)?.create_worker(ctx).map_err(|e| format!("cannot create the worker half: {e}"))
}

/// Creates both halves of the configured connector.
pub fn create_connector(registry: &Registry, ctx: &ConnectorContext) -> Result<ConnectorHalves, String> {
    Ok((create_scheduler(registry, ctx)?, create_worker(registry, ctx)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn side_channel_reaches_nested_nixl_children_only() {
        let r = Registry::builtins_only();
        let c = KvTransferConfig::from_json(
            r#"{"kv_connector":"PdConnector","kv_connector_extra_config":{"connectors":[
                {"kv_connector":"LMCacheConnectorV1"},
                {"kv_connector":"NixlConnector","kv_connector_extra_config":{"backend":"tcp"}}]}}"#,
        )
        .unwrap();
        let secret = Secret::from_text("a-secret-of-enough-bytes", "test").unwrap();
        let (out, nixl) = with_side_channel(&r, &c, "127.0.0.1", 4242, Some(&secret));
        let children = out.kv_connector_extra_config["connectors"].as_array().unwrap();
        assert!(children[0]["kv_connector_extra_config"].get("side_channel_port").is_none());
        assert_eq!(children[1]["kv_connector_extra_config"]["side_channel_port"], 4242);
        assert_eq!(children[1]["kv_connector_extra_config"][SECRET_CONFIG_KEY], "a-secret-of-enough-bytes");
        assert!(children[0]["kv_connector_extra_config"].get(SECRET_CONFIG_KEY).is_none());
        assert!(!carries_secret(&c) && carries_secret(&out));
        assert_eq!(nixl.len(), 1);
        assert_eq!(nixl_backend(&nixl).unwrap(), Some(Backend::parse("tcp").unwrap()));

        let plain = KvTransferConfig::from_json(r#"{"kv_connector":"NixlConnector"}"#).unwrap();
        let (out, nixl) = with_side_channel(&r, &plain, "127.0.0.1", 7, None);
        assert_eq!(out.kv_connector_extra_config["side_channel_host"], "127.0.0.1");
        assert_eq!(nixl_backend(&nixl).unwrap(), Some(Backend::parse("shm").unwrap()));
    }
}
