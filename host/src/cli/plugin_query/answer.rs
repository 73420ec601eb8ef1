//! What a plugin's query process answers: one line of JSON on its stdout, the last line it
//! prints (a plugin may print lines of its own before it). Both sides are this binary, so
//! the format is private to it.

use crate::loader::{self, LoaderOptions};
use kvconnect_api::{
    Capabilities, ChildCaps, ConnectorError, ConnectorFactory, ConnectorInfo, KvTransferConfig, ModelSpec,
};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A query process's answer about one plugin file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    /// The plugin loaded; what it is and what it answered.
    Loaded(Box<Loaded>),
    /// The loader refused it: the loader's one line, naming the file.
    Refused(String),
}

/// A plugin that loaded, as the registry shows it, and its answer to one capability query.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Loaded {
    /// The connector name it registers.
    pub name: String,
    /// Its ABI version, `major.minor`.
    pub abi: String,
    /// The kvconnect-api version it was built against.
    pub sdk_version: String,
    /// Its factory's info.
    pub info: ConnectorInfo,
    /// Its factory's answer, error included, exactly as the factory gave it.
    pub capabilities: Result<Capabilities, ConnectorError>,
    /// Its children's capabilities for the same query (`None`: not a composite).
    pub children: Result<Option<Vec<ChildCaps>>, ConnectorError>,
}

impl Answer {
    /// Loads the plugin into this process (the query process) and asks it for its own and its
    /// children's capabilities for `config` (default: the plain config naming it) and `model`.
    pub fn ask(
        path: &Path,
        options: &LoaderOptions,
        config: Option<KvTransferConfig>,
        model: Option<&ModelSpec>,
    ) -> Answer {
        let plugin = match loader::load_plugin(path, options) {
            Ok(p) => p,
            Err(e) => return Answer::Refused(e.to_string()),
        };
        let name = plugin.library.name().to_owned();
        let config = config.unwrap_or_else(|| KvTransferConfig::named(&name));
        Answer::Loaded(Box::new(Loaded {
            abi: plugin.library.abi_version(),
            sdk_version: plugin.library.sdk_version().to_owned(),
            info: plugin.factory.info(),
            capabilities: plugin.factory.capabilities(&config, model),
            children: plugin.factory.child_capabilities(&config, model),
            name,
        }))
    }

    /// The answer in a query process's stdout, if its last line holds one.
    pub fn parse(stdout: &[u8]) -> Option<Answer> {
        let text = String::from_utf8_lossy(stdout);
        let last = text.lines().rev().find(|l| !l.trim().is_empty())?;
        serde_json::from_str(last).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(capabilities: Result<Capabilities, ConnectorError>) -> Answer {
        let children = match &capabilities {
            Ok(caps) => {
                Ok(Some(vec![ChildCaps { name: "leaf".into(), version: "1".into(), caps: caps.clone() }]))
            }
            Err(_) => Ok(None),
        };
        Answer::Loaded(Box::new(Loaded {
            name: "mine".into(),
            abi: "1.0".into(),
            sdk_version: "0.1.0".into(),
            info: ConnectorInfo { name: "mine".into(), version: "2.0".into(), description: "d".into() },
            capabilities,
            children,
        }))
    }

    #[test]
    fn answers_cross_as_the_last_line_whatever_the_plugin_printed_before() {
        let caps = kvconnect_registry::builtin::lmcache()
            .capabilities(&KvTransferConfig::named("lmcache"), None)
            .unwrap();
        for a in [
            loaded(Ok(caps)),
            loaded(Err(ConnectorError::config("mine", "set kv_connector_extra_config.dir"))),
            Answer::Refused("plugin ./libx.so: not a loadable shared library".into()),
        ] {
            let out =
                format!("a plugin's own output\n{{not an answer\n{}\n\n", serde_json::to_string(&a).unwrap());
            assert_eq!(Answer::parse(out.as_bytes()), Some(a));
        }
    }

    #[test]
    fn no_answer_without_a_json_last_line() {
        assert_eq!(Answer::parse(b""), None);
        assert_eq!(Answer::parse(b"hello\n"), None);
        let cut = serde_json::to_string(&Answer::Refused("x".into())).unwrap();
        assert_eq!(Answer::parse(&cut.as_bytes()[..cut.len() - 1]), None);
    }
}
