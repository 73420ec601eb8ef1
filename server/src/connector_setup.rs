//! Turning a server's kv-transfer-config into connector instances: the host writes its
//! side-channel address (so `request_finished` can hand it to the peer) and the deployment's
//! data-plane secret (in memory only) into every config whose connector declares it needs
//! them (`Capabilities::needs_side_channel`, `needs_data_plane_secret`; top level or a
//! composite's child, at any depth; a built-in or a plugin), and tells whether one declares
//! it needs a producer's KV regions in shared memory (`needs_shared_memory_kv`).

use kvconnect_api::{Capabilities, ConnectorContext, KvTransferConfig, SchedulerConnector, WorkerConnector};
use kvconnect_dataplane::auth::{Secret, SECRET_CONFIG_KEY};
use kvconnect_registry::Registry;
use serde_json::Value;

/// What the host writes into the config of a connector that declares it needs it.
struct Injected<'a> {
    host: &'a str,
    port: u16,
    secret: Option<&'a Secret>,
}

/// What a connector's config declares: its factory's capabilities for that config (the model
/// is not known yet). None for a connector the registry does not know, or whose capabilities
/// cannot be had: it needs nothing from the host (creating it then says why).
fn declared(registry: &Registry, config: &KvTransferConfig) -> Option<Capabilities> {
    registry.find_for_config(config).ok().and_then(|e| e.factory.capabilities(config, None).ok())
}

/// The side channel and the secret a connector's config declares it needs.
fn needs(registry: &Registry, config: &KvTransferConfig) -> (bool, bool) {
    declared(registry, config).map_or((false, false), |c| (c.needs_side_channel, c.needs_data_plane_secret))
}

/// Writes what `config` declares it needs into its extra config; false when it needs nothing.
fn set_in_extra(registry: &Registry, config: &mut KvTransferConfig, i: &Injected) -> bool {
    let (side_channel, secret) = needs(registry, config);
    let extra = &mut config.kv_connector_extra_config;
    if side_channel {
        extra.insert("side_channel_host".into(), Value::String(i.host.to_owned()));
        extra.insert("side_channel_port".into(), Value::from(i.port));
    }
    if secret {
        match i.secret {
            Some(s) => extra.insert(SECRET_CONFIG_KEY.into(), Value::String(s.to_text())),
            None => extra.remove(SECRET_CONFIG_KEY),
        };
    }
    side_channel || secret
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

/// Serves `config` if it declares a need, else its children (a composite's `connectors`), at
/// any depth; every config served is pushed onto `served`, as written.
fn serve(
    registry: &Registry,
    config: &mut KvTransferConfig,
    i: &Injected,
    served: &mut Vec<KvTransferConfig>,
) {
    if set_in_extra(registry, config, i) {
        served.push(config.clone());
        return;
    }
    let Some(Value::Array(children)) = config.kv_connector_extra_config.get_mut("connectors") else { return };
    for child in children.iter_mut() {
        let Ok(mut c) = serde_json::from_value::<KvTransferConfig>(child.clone()) else { continue };
        let before = served.len();
        serve(registry, &mut c, i, served);
        if served.len() == before {
            continue;
        }
        // Only the keys the host writes change: the child's own JSON keeps everything else.
        let Value::Object(obj) = child else { continue };
        obj.insert("kv_connector_extra_config".into(), Value::Object(c.kv_connector_extra_config));
    }
}

/// The config with `side_channel_host`/`side_channel_port` and the data-plane secret set in
/// every config in it whose connector declares it needs them, and those configs (as written,
/// after the change).
pub fn with_side_channel(
    registry: &Registry,
    config: &KvTransferConfig,
    host: &str,
    port: u16,
    secret: Option<&Secret>,
) -> (KvTransferConfig, Vec<KvTransferConfig>) {
    let mut c = config.clone();
    let mut served = Vec::new();
    serve(registry, &mut c, &Injected { host, port, secret }, &mut served);
    (c, served)
}

/// Whether `config`, or a composite child in it at any depth, declares it needs a producer's
/// KV regions in shared memory (`Capabilities::needs_shared_memory_kv`; nixl's `shm` backend
/// does): the host then allocates them as shared-memory segments.
pub fn needs_shared_memory_kv(registry: &Registry, config: &KvTransferConfig) -> bool {
    declared(registry, config).is_some_and(|c| c.needs_shared_memory_kv)
        || match config.kv_connector_extra_config.get("connectors") {
            Some(Value::Array(children)) => children.iter().any(|child| {
                serde_json::from_value::<KvTransferConfig>(child.clone())
                    .is_ok_and(|c| needs_shared_memory_kv(registry, &c))
            }),
            _ => false,
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
    use kvconnect_api::{ConnectorFactory, ConnectorInfo, ConnectorResult, ModelSpec};
    use kvconnect_registry::loader::LoaderOptions;
    use kvconnect_registry::{Entry, OpenPlugin, Origin, RegistryConfig};
    use std::path::Path;
    use std::sync::Arc;

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
        assert!(children[0].get("kv_connector_extra_config").is_none());
        assert_eq!(children[1]["kv_connector_extra_config"]["side_channel_port"], 4242);
        assert_eq!(children[1]["kv_connector_extra_config"][SECRET_CONFIG_KEY], "a-secret-of-enough-bytes");
        assert_eq!(children[1]["kv_connector_extra_config"]["backend"], "tcp");
        assert!(out.kv_connector_extra_config.get("side_channel_port").is_none());
        assert!(!carries_secret(&c) && carries_secret(&out));
        assert_eq!(nixl.len(), 1);
        // Backend tcp needs no shared memory; shm (the default) does, also as a nested child.
        assert!(!needs_shared_memory_kv(&r, &c));
        let shm_child = KvTransferConfig::from_json(
            &serde_json::to_string(&c).unwrap().replace(r#""backend":"tcp""#, r#""backend":"shm""#),
        )
        .unwrap();
        assert!(needs_shared_memory_kv(&r, &shm_child));

        let plain = KvTransferConfig::from_json(r#"{"kv_connector":"NixlConnector"}"#).unwrap();
        let (out, _) = with_side_channel(&r, &plain, "127.0.0.1", 7, None);
        assert_eq!(out.kv_connector_extra_config["side_channel_host"], "127.0.0.1");
        assert!(needs_shared_memory_kv(&r, &plain));
        assert!(!needs_shared_memory_kv(&r, &KvTransferConfig::named("LMCacheConnectorV1")));
    }

    /// lmcache's factory under another name, declaring what `needs` says: the side channel,
    /// the secret, shared-memory KV.
    struct Declaring {
        name: &'static str,
        needs: (bool, bool, bool),
    }

    impl ConnectorFactory for Declaring {
        fn info(&self) -> ConnectorInfo {
            ConnectorInfo { name: self.name.into(), ..kvconnect_registry::builtin::lmcache().info() }
        }

        fn capabilities(
            &self,
            config: &KvTransferConfig,
            model: Option<&ModelSpec>,
        ) -> ConnectorResult<Capabilities> {
            let mut c = kvconnect_registry::builtin::lmcache().capabilities(config, model)?;
            (c.needs_side_channel, c.needs_data_plane_secret, c.needs_shared_memory_kv) = self.needs;
            Ok(c)
        }

        fn create_scheduler(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
            kvconnect_registry::builtin::lmcache().create_scheduler(ctx)
        }

        fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
            kvconnect_registry::builtin::lmcache().create_worker(ctx)
        }
    }

    /// A registry with three plugins, each a file in a temporary folder: `libmover.so`
    /// ("mover", needs all three), `libsecret.so` ("secret-only", needs the secret only) and
    /// `libnixl.so` (named "nixl", needs nothing).
    fn registry_with_plugins() -> (Registry, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        for f in ["libmover.so", "libsecret.so", "libnixl.so"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let open: OpenPlugin = Arc::new(|path: &Path, _: &LoaderOptions| {
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let (name, needs) = match file.as_str() {
                "libmover.so" => ("mover", (true, true, true)),
                "libsecret.so" => ("secret-only", (false, true, false)),
                _ => ("nixl", (false, false, false)),
            };
            Ok(Entry {
                name: name.into(),
                aliases: Vec::new(),
                origin: Origin::Dynamic,
                path: Some(path.to_path_buf()),
                abi: Some("1.0".into()),
                sdk_version: Some("0.1.0".into()),
                factory: Arc::new(Declaring { name, needs }),
            })
        });
        let config = RegistryConfig {
            plugin_dirs: vec![dir.path().to_path_buf()],
            use_env: false,
            allow_insecure: false,
        };
        (Registry::load_with(&config, open), dir)
    }

    #[test]
    fn any_connector_that_declares_the_need_gets_the_side_channel_and_the_secret_and_no_other() {
        let (r, dir) = registry_with_plugins();
        let nixl_plugin = dir.path().join("libnixl.so").to_string_lossy().into_owned();
        let c = KvTransferConfig::from_json(&format!(
            r#"{{"kv_connector":"PdConnector","kv_connector_extra_config":{{"connectors":[
                {{"kv_connector":"lmcache"}},
                {{"kv_connector":"PdConnector","kv_connector_extra_config":{{"connectors":[
                    {{"kv_connector":"mover","kv_connector_extra_config":{{"k":1}}}}]}}}},
                {{"kv_connector":"secret-only"}},
                {{"kv_connector":"{nixl_plugin}"}}]}}}}"#
        ))
        .unwrap();
        let secret = Secret::from_text("a-secret-of-enough-bytes", "test").unwrap();
        let (out, served) = with_side_channel(&r, &c, "10.0.0.2", 4242, Some(&secret));
        let children = out.kv_connector_extra_config["connectors"].as_array().unwrap();
        let extra = |v: &Value| v.get("kv_connector_extra_config").cloned().unwrap_or(Value::Null);

        // A plugin nested two composites deep that declares both needs gets both, beside its own keys.
        let mover = extra(&extra(&children[1])["connectors"][0]);
        assert_eq!(mover["side_channel_host"], "10.0.0.2");
        assert_eq!(mover["side_channel_port"], 4242);
        assert_eq!(mover[SECRET_CONFIG_KEY], "a-secret-of-enough-bytes");
        assert_eq!(mover["k"], 1);
        // One that declares the secret only gets the secret only.
        let secret_only = extra(&children[2]);
        assert_eq!(secret_only[SECRET_CONFIG_KEY], "a-secret-of-enough-bytes");
        assert!(secret_only.get("side_channel_port").is_none());
        // A plugin named nixl that declares nothing, and a cache, get nothing.
        assert_eq!(extra(&children[3]), Value::Null);
        assert_eq!(extra(&children[0]), Value::Null);
        assert!(out.kv_connector_extra_config.get("side_channel_port").is_none());

        let names: Vec<&str> = served.iter().map(|c| c.kv_connector.as_str()).collect();
        assert_eq!(names, ["mover", "secret-only"]);
        // Shared-memory KV by what a connector declares, not by its name: the plugin two
        // composites deep asks for it; without it, the plugin named nixl does not.
        assert!(needs_shared_memory_kv(&r, &c));
        let mut without = c.clone();
        if let Some(Value::Array(children)) = without.kv_connector_extra_config.get_mut("connectors") {
            children.remove(1);
        }
        assert!(!needs_shared_memory_kv(&r, &without));

        // At the top level too; without a secret the key is removed.
        let mut top = KvTransferConfig::named("mover");
        top.kv_connector_extra_config.insert(SECRET_CONFIG_KEY.into(), Value::from("stale"));
        let (out, served) = with_side_channel(&r, &top, "10.0.0.2", 7, None);
        assert_eq!(out.kv_connector_extra_config["side_channel_port"], 7);
        assert!(out.kv_connector_extra_config.get(SECRET_CONFIG_KEY).is_none());
        assert_eq!(served.len(), 1);
        let (out, served) =
            with_side_channel(&r, &KvTransferConfig::named(&nixl_plugin), "10.0.0.2", 7, None);
        assert!(out.kv_connector_extra_config.is_empty() && served.is_empty());
    }
}
