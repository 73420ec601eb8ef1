//! Every connector the host can create: the built-ins (nixl, lmcache, flexkv and the pd
//! composite) and the plugins found on the plugin path, resolved by name.
//!
//! Names vLLM and Dynamo users write (`NixlConnector`, `LMCacheConnectorV1`,
//! `FlexKVConnectorV1`, `PdConnector`, `MultiConnector`) resolve to the built-ins. The name
//! only finds the connector: what it does comes from its capabilities, never from the name.
//! `kv_connector_module_path` forces a plugin (by name or by path).

pub mod builtin;
/// The plugin loader (crate `kvconnect-loader`), under the name the host has always used.
pub use kvconnect_loader as loader;

use crate::loader::{LoadError, LoadedPlugin, LoaderOptions};
use kvconnect_api::{ConnectorError, ConnectorFactory, ConnectorResolver, ConnectorResult, KvTransferConfig};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Where a connector comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// Linked into the host.
    Builtin,
    /// Loaded from a plugin library.
    Dynamic,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Origin::Builtin => "builtin",
            Origin::Dynamic => "dynamic",
        })
    }
}

/// A connector the registry knows.
#[derive(Clone)]
pub struct Entry {
    /// The name it is registered under.
    pub name: String,
    /// Other names that resolve to it.
    pub aliases: Vec<String>,
    /// Built in or a plugin.
    pub origin: Origin,
    /// The plugin file, for a plugin.
    pub path: Option<PathBuf>,
    /// The plugin's ABI version (`1.0`), for a plugin.
    pub abi: Option<String>,
    /// The kvconnect-api version a plugin was built against.
    pub sdk_version: Option<String>,
    /// Its factory.
    pub factory: Arc<dyn ConnectorFactory>,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("name", &self.name)
            .field("origin", &self.origin)
            .field("path", &self.path)
            .finish()
    }
}

/// A name or path that resolves to nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// No connector has this name.
    #[error(
        "no connector named '{name}'{}: known connectors are {}; a plugin is found through \
         KVCONNECT_PLUGIN_PATH or --plugin-dir, or named by path",
        suggestion.as_ref().map(|s| format!(" (did you mean '{s}'?)")).unwrap_or_default(),
        known.join(", ")
    )]
    Unknown {
        /// The name asked for.
        name: String,
        /// Every name that resolves.
        known: Vec<String>,
        /// The known name closest to it, when one is close enough ([`closest_name`]).
        suggestion: Option<String>,
    },
    /// A plugin named by path could not be loaded.
    #[error(transparent)]
    Plugin(#[from] LoadError),
}

/// Where to look for plugins.
#[derive(Debug, Clone, Default)]
pub struct RegistryConfig {
    /// Directories (or files) given on the command line or in a config file.
    pub plugin_dirs: Vec<PathBuf>,
    /// Also read `KVCONNECT_PLUGIN_PATH`.
    pub use_env: bool,
    /// `--allow-insecure-plugins`.
    pub allow_insecure: bool,
}

impl RegistryConfig {
    /// Plugin dirs from the command line plus `KVCONNECT_PLUGIN_PATH`.
    pub fn with_env(plugin_dirs: Vec<PathBuf>, allow_insecure: bool) -> RegistryConfig {
        RegistryConfig { plugin_dirs, use_env: true, allow_insecure }
    }
}

/// Opens one plugin file as a registry entry, or says in one line why it cannot be used.
/// Servers open plugins in their own process ([`open_in_process`]); `kvconnect plugins`
/// opens each in a query process of its own, so that a plugin that crashes or hangs takes
/// only that process down.
pub type OpenPlugin = Arc<dyn Fn(&Path, &LoaderOptions) -> Result<Entry, LoadError> + Send + Sync>;

/// Loads a plugin into this process: [`loader::load_plugin`] as a registry entry.
pub fn open_in_process(path: &Path, options: &LoaderOptions) -> Result<Entry, LoadError> {
    loader::load_plugin(path, options).map(|p| plugin_entry(&p))
}

/// The built-in connectors and the loaded plugins. Cheap to clone (one `Arc`); the pd
/// composite gets a clone as its resolver.
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

struct Inner {
    builtins: Vec<Builtin>,
    // Origin::Dynamic entries, in load order.
    plugins: Vec<Entry>,
    errors: Vec<LoadError>,
    options: LoaderOptions,
    open: OpenPlugin,
    // Plugins loaded later by path (`inspect ./libx.so`, `kv_connector_module_path`).
    by_path: Mutex<HashMap<PathBuf, Entry>>,
}

struct Builtin {
    name: &'static str,
    aliases: &'static [&'static str],
    // None for the composite, which is made per resolve around a clone of the registry.
    factory: Option<Arc<dyn ConnectorFactory>>,
}

fn builtins() -> Vec<Builtin> {
    vec![
        Builtin { name: "nixl", aliases: &["NixlConnector"], factory: Some(crate::builtin::nixl()) },
        Builtin {
            name: "lmcache",
            aliases: &["LMCacheConnectorV1", "LMCacheConnector"],
            factory: Some(crate::builtin::lmcache()),
        },
        Builtin {
            name: "flexkv",
            aliases: &["FlexKVConnectorV1", "FlexKVConnector"],
            factory: Some(crate::builtin::flexkv()),
        },
        Builtin { name: "pd", aliases: &["PdConnector", "MultiConnector"], factory: None },
    ]
}

impl Registry {
    /// The built-ins only, no plugins.
    pub fn builtins_only() -> Registry {
        Registry::from_parts(Vec::new(), Vec::new(), LoaderOptions::default(), Arc::new(open_in_process))
    }

    /// The built-ins plus every plugin found where `config` says, loaded into this process.
    /// A plugin that fails its checks is left out and its one-line reason kept in
    /// [`Registry::load_errors`] for the caller to report; loading goes on with the rest.
    pub fn load(config: &RegistryConfig) -> Registry {
        Registry::load_with(config, Arc::new(open_in_process))
    }

    /// [`Registry::load`], opening each plugin file (found on the path, or named by path
    /// later) with `open`.
    pub fn load_with(config: &RegistryConfig, open: OpenPlugin) -> Registry {
        let options = LoaderOptions { allow_insecure: config.allow_insecure };
        let mut places = Vec::new();
        if config.use_env {
            if let Some(v) = std::env::var_os(loader::PLUGIN_PATH_ENV) {
                places.extend(loader::split_plugin_path(&v.to_string_lossy()));
            }
        }
        places.extend(config.plugin_dirs.iter().cloned());
        let (files, mut errors) = loader::discover(&places);
        let mut plugins: Vec<Entry> = Vec::new();
        let mut seen_files = Vec::new();
        for f in files {
            let canon = std::fs::canonicalize(&f).unwrap_or_else(|_| f.clone());
            if seen_files.contains(&canon) {
                continue;
            }
            seen_files.push(canon);
            match open(&f, &options) {
                Ok(p) => {
                    if let Some(other) = plugins.iter().find(|o| o.name == p.name) {
                        errors.push(LoadError::DuplicateName {
                            path: f.display().to_string(),
                            name: p.name,
                            other: shown_path(other),
                        });
                    } else {
                        tracing::debug!(plugin = p.name, path = %f.display(), "loaded plugin");
                        plugins.push(p);
                    }
                }
                Err(e) => errors.push(e),
            }
        }
        Registry::from_parts(plugins, errors, options, open)
    }

    fn from_parts(
        plugins: Vec<Entry>,
        errors: Vec<LoadError>,
        options: LoaderOptions,
        open: OpenPlugin,
    ) -> Registry {
        Registry {
            inner: Arc::new(Inner {
                builtins: builtins(),
                plugins,
                errors,
                options,
                open,
                by_path: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Why plugins on the path were refused, one line each.
    pub fn load_errors(&self) -> &[LoadError] {
        &self.inner.errors
    }

    /// Logs each of [`Registry::load_errors`] and [`Registry::shadowed`] as a warning.
    pub fn warn_load_errors(&self) {
        for e in &self.inner.errors {
            tracing::warn!("{e}");
        }
        for note in self.shadowed() {
            tracing::warn!("{note}");
        }
    }

    /// The plugins whose name is also a built-in's name or alias, one line each: the name
    /// resolves to the built-in, and the line says how to reach the plugin instead.
    pub fn shadowed(&self) -> Vec<String> {
        self.inner
            .plugins
            .iter()
            .filter_map(|p| {
                let b = self.builtin(&p.name)?;
                Some(format!(
                    "plugin {}: its name '{}' is the built-in connector '{}'s, and the built-in wins \
                     where a config names it in kv_connector; to use the plugin, name it in \
                     kv_connector_module_path (its name or its path), or rename it",
                    shown_path(p),
                    p.name,
                    b.name
                ))
            })
            .collect()
    }

    /// Every connector: built-ins first, then plugins in load order (a plugin named like a
    /// built-in is listed too; [`Registry::shadowed`] says which name wins).
    pub fn entries(&self) -> Vec<Entry> {
        let mut v: Vec<Entry> = self.inner.builtins.iter().map(|b| self.builtin_entry(b)).collect();
        v.extend(self.inner.plugins.iter().cloned());
        v
    }

    /// Every name that resolves (built-in names, their aliases, plugin names).
    pub fn names(&self) -> Vec<String> {
        let mut v = Vec::new();
        for b in &self.inner.builtins {
            v.push(b.name.to_owned());
            v.extend(b.aliases.iter().map(|a| (*a).to_owned()));
        }
        for p in &self.inner.plugins {
            if !v.contains(&p.name) {
                v.push(p.name.clone());
            }
        }
        v
    }

    /// The connector a user names: a built-in name or alias, a plugin name, or a path to a
    /// plugin file (anything with a `/` or a library suffix).
    pub fn find(&self, name_or_path: &str) -> Result<Entry, RegistryError> {
        if looks_like_path(name_or_path) {
            return self.load_path(Path::new(name_or_path));
        }
        if let Some(b) = self.builtin(name_or_path) {
            return Ok(self.builtin_entry(b));
        }
        if let Some(p) = self.inner.plugins.iter().find(|p| p.name == name_or_path) {
            return Ok(p.clone());
        }
        Err(self.unknown(name_or_path))
    }

    /// The connector a kv-transfer-config names.
    pub fn find_for_config(&self, config: &KvTransferConfig) -> Result<Entry, RegistryError> {
        if let Some(m) = config.kv_connector_module_path.as_deref().filter(|m| !m.is_empty()) {
            if looks_like_path(m) {
                return self.load_path(Path::new(m));
            }
            if let Some(p) = self.inner.plugins.iter().find(|p| p.name == m) {
                return Ok(p.clone());
            }
            if let Some(b) = self.builtin(m) {
                return Ok(self.builtin_entry(b));
            }
            // vLLM configs carry Python module paths here (`lmcache.integration.vllm...`);
            // those mean nothing to this host, so the connector name decides.
            if !m.contains('.') {
                return Err(self.unknown(m));
            }
            tracing::debug!(
                module_path = m,
                "kv_connector_module_path is a Python module path; resolving kv_connector instead"
            );
        }
        self.find(&config.kv_connector)
    }

    fn unknown(&self, name: &str) -> RegistryError {
        let known = self.names();
        RegistryError::Unknown { name: name.to_owned(), suggestion: closest_name(name, &known), known }
    }

    fn builtin(&self, name: &str) -> Option<&Builtin> {
        self.inner.builtins.iter().find(|b| b.name.eq_ignore_ascii_case(name) || b.aliases.contains(&name))
    }

    fn builtin_entry(&self, b: &Builtin) -> Entry {
        let factory: Arc<dyn ConnectorFactory> = match &b.factory {
            Some(f) => f.clone(),
            None => Arc::new(kvconnect_pd::PdFactory::new(Arc::new(self.clone()))),
        };
        Entry {
            name: b.name.to_owned(),
            aliases: b.aliases.iter().map(|a| (*a).to_owned()).collect(),
            origin: Origin::Builtin,
            path: None,
            abi: None,
            sdk_version: None,
            factory,
        }
    }

    fn load_path(&self, path: &Path) -> Result<Entry, RegistryError> {
        let canon = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        for p in &self.inner.plugins {
            if p.path.as_ref().and_then(|f| std::fs::canonicalize(f).ok()).as_ref() == Some(&canon) {
                return Ok(p.clone());
            }
        }
        let mut cache = self.inner.by_path.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = cache.get(&canon) {
            return Ok(p.clone());
        }
        let e = (self.inner.open)(path, &self.inner.options)?;
        cache.insert(canon, e.clone());
        Ok(e)
    }
}

fn shown_path(e: &Entry) -> String {
    e.path.as_ref().map(|p| p.display().to_string()).unwrap_or_default()
}

fn plugin_entry(p: &LoadedPlugin) -> Entry {
    Entry {
        name: p.library.name().to_owned(),
        aliases: Vec::new(),
        origin: Origin::Dynamic,
        path: Some(p.library.path().to_path_buf()),
        abi: Some(p.library.abi_version()),
        sdk_version: Some(p.library.sdk_version().to_owned()),
        factory: p.factory.clone(),
    }
}

/// The name in `known` closest to `name` by edit distance, ignoring case (the first of equally
/// close ones), when it is close enough to be a misspelling: at most one edit in four
/// characters of `name`, and one edit for names under eight.
pub fn closest_name(name: &str, known: &[String]) -> Option<String> {
    let lower = name.to_lowercase();
    let allowed = (lower.chars().count() / 4).max(1);
    known
        .iter()
        .map(|k| (strsim::levenshtein(&lower, &k.to_lowercase()), k))
        .filter(|(d, _)| *d <= allowed)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.clone())
}

fn looks_like_path(s: &str) -> bool {
    s.contains('/') || s.ends_with(".so") || s.contains(".so.") || s.ends_with(".dylib")
}

impl ConnectorResolver for Registry {
    fn resolve(&self, config: &KvTransferConfig) -> ConnectorResult<Arc<dyn ConnectorFactory>> {
        self.find_for_config(config)
            .map(|e| e.factory)
            .map_err(|e| ConnectorError::config(&config.kv_connector, e.to_string()))
    }

    fn known_names(&self) -> Vec<String> {
        self.names()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_and_dynamo_names_resolve_to_builtins() {
        let r = Registry::builtins_only();
        for (alias, name) in [
            ("NixlConnector", "nixl"),
            ("LMCacheConnectorV1", "lmcache"),
            ("FlexKVConnectorV1", "flexkv"),
            ("PdConnector", "pd"),
            ("MultiConnector", "pd"),
            ("NIXL", "nixl"),
        ] {
            let e = r.find(alias).unwrap();
            assert_eq!(e.name, name, "{alias}");
            assert_eq!(e.origin, Origin::Builtin);
        }
    }

    #[test]
    fn unknown_name_lists_the_known_ones() {
        let r = Registry::builtins_only();
        let e = r.find("MooncakeConnector").unwrap_err().to_string();
        assert!(e.contains("no connector named 'MooncakeConnector'"), "{e}");
        for n in ["nixl", "lmcache", "flexkv", "pd", "NixlConnector", "MultiConnector"] {
            assert!(e.contains(n), "{e}");
        }
        let err = r.resolve(&KvTransferConfig::named("MooncakeConnector")).err().unwrap();
        assert!(matches!(err, ConnectorError::InvalidConfig { .. }), "{err}");
    }

    #[test]
    fn a_misspelled_name_suggests_the_closest_known_one() {
        let r = Registry::builtins_only();
        for (typed, meant) in [
            ("NixlConector", "NixlConnector"),
            ("nixlconnector", "NixlConnector"),
            ("LMCacheConnectorV2", "LMCacheConnectorV1"),
            ("lmcach", "lmcache"),
            ("FlexKvConnecter", "FlexKVConnector"),
            ("nxl", "nixl"),
        ] {
            let e = r.find(typed).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!(
                    "no connector named '{typed}' (did you mean '{meant}'?): known connectors are nixl, "
                )),
                "{e}"
            );
        }
        // Too far from every name: no guess, the list alone.
        for typed in ["MooncakeConnector", "P2pNcclConnector", "NoSuchConnector", "x"] {
            let e = r.find(typed).unwrap_err().to_string();
            assert!(e.starts_with(&format!("no connector named '{typed}': known connectors are ")), "{e}");
        }
        // kv_connector_module_path's plugin name is checked the same way.
        let mut c = KvTransferConfig::named("NixlConnector");
        c.kv_connector_module_path = Some("pdconector".into());
        let e = r.find_for_config(&c).unwrap_err().to_string();
        assert!(e.contains("no connector named 'pdconector' (did you mean 'PdConnector'?)"), "{e}");
    }

    #[test]
    fn module_path_forces_the_plugin_and_python_paths_fall_back_to_the_name() {
        let r = Registry::builtins_only();
        let mut c = KvTransferConfig::named("LMCacheConnectorV1");
        c.kv_connector_module_path = Some("lmcache.integration.vllm.lmcache_connector_v1".into());
        assert_eq!(r.find_for_config(&c).unwrap().name, "lmcache");
        c.kv_connector_module_path = Some("myplugin".into());
        assert!(matches!(r.find_for_config(&c), Err(RegistryError::Unknown { .. })));
        c.kv_connector_module_path = Some("/nonexistent/libmine.so".into());
        let e = r.find_for_config(&c).unwrap_err().to_string();
        assert!(e.starts_with("plugin /nonexistent/libmine.so: cannot read it"), "{e}");
    }

    #[test]
    fn plugins_are_opened_with_the_registrys_opener_once_each() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["liba.so", "libb.so", "libc.so"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let opened = Arc::new(Mutex::new(Vec::new()));
        let seen = opened.clone();
        let open: OpenPlugin = Arc::new(move |path: &Path, _: &LoaderOptions| {
            let file = path.display().to_string();
            seen.lock().unwrap().push(path.file_name().unwrap().to_string_lossy().into_owned());
            if file.ends_with("libc.so") {
                return Err(LoadError::QueryProcess {
                    message: format!("plugin {file}: crashed"),
                    path: file,
                });
            }
            Ok(Entry {
                name: "same".into(),
                aliases: Vec::new(),
                origin: Origin::Dynamic,
                path: Some(path.to_path_buf()),
                abi: Some("1.0".into()),
                sdk_version: Some("0.1.0".into()),
                factory: crate::builtin::lmcache(),
            })
        });
        let config = RegistryConfig {
            plugin_dirs: vec![dir.path().to_path_buf()],
            use_env: false,
            allow_insecure: false,
        };
        let r = Registry::load_with(&config, open);
        assert_eq!(*opened.lock().unwrap(), ["liba.so", "libb.so", "libc.so"]);
        let a = r.find("same").unwrap();
        assert_eq!(a.path, Some(dir.path().join("liba.so")));
        let errors: Vec<String> = r.load_errors().iter().map(|e| e.to_string()).collect();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].contains("libb.so: connector name 'same' is already taken by"), "{errors:?}");
        assert!(errors[1].ends_with("libc.so: crashed"), "{errors:?}");

        // By path: a plugin already open is not opened again; another file is, once.
        assert_eq!(r.find(&dir.path().join("liba.so").to_string_lossy()).unwrap().name, "same");
        let b = dir.path().join("libb.so").to_string_lossy().into_owned();
        assert_eq!(r.find(&b).unwrap().path, Some(PathBuf::from(&b)));
        assert_eq!(r.find(&b).unwrap().name, "same");
        assert_eq!(opened.lock().unwrap().len(), 4);
    }

    #[test]
    fn a_plugin_named_like_a_builtin_is_reachable_only_by_module_path_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("libnixl.so"), b"").unwrap();
        let open: OpenPlugin = Arc::new(|path: &Path, _: &LoaderOptions| {
            Ok(Entry {
                name: "NixlConnector".into(),
                aliases: Vec::new(),
                origin: Origin::Dynamic,
                path: Some(path.to_path_buf()),
                abi: Some("1.0".into()),
                sdk_version: Some("0.1.0".into()),
                factory: crate::builtin::lmcache(),
            })
        });
        let config = RegistryConfig {
            plugin_dirs: vec![dir.path().to_path_buf()],
            use_env: false,
            allow_insecure: false,
        };
        let r = Registry::load_with(&config, open);
        assert_eq!(r.find("NixlConnector").unwrap().origin, Origin::Builtin);
        let mut c = KvTransferConfig::named("NixlConnector");
        c.kv_connector_module_path = Some("NixlConnector".into());
        assert_eq!(r.find_for_config(&c).unwrap().origin, Origin::Dynamic);
        let notes = r.shadowed();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].ends_with(
                "libnixl.so: its name 'NixlConnector' is the built-in connector 'nixl's, and the \
                 built-in wins where a config names it in kv_connector; to use the plugin, name it \
                 in kv_connector_module_path (its name or its path), or rename it"
            ),
            "{}",
            notes[0]
        );
        assert!(Registry::builtins_only().shadowed().is_empty());
    }

    #[test]
    fn pd_is_built_with_the_registry_as_resolver() {
        let r = Registry::builtins_only();
        let pd = r.find("PdConnector").unwrap();
        assert_eq!(pd.factory.info().name, "pd");
    }
}
