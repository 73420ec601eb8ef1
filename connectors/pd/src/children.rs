//! Turning the child configs into named factories: resolution through the host's
//! resolver, unique names, and the guard against composites nested too deep or containing
//! themselves.
//!
//! A composite reaches its nested composites only through the resolver and the factory
//! trait, so the depth and the chain of configs being expanded are kept per thread: every
//! factory call a composite makes on a child runs on the caller's thread, including calls
//! into plugins.

use crate::config::PdConfig;
use crate::error::PdError;
use kvconnect_api::{ConnectorFactory, ConnectorResolver, KvTransferConfig};
use std::cell::RefCell;
use std::sync::Arc;

/// How many composites may be nested inside one another (the outermost counts as 1).
pub const MAX_DEPTH: usize = 4;

/// One child, resolved.
#[derive(Clone)]
pub struct Child {
    /// Its unique name within the composite (`nixl`, or `nixl#2` for a second one).
    pub name: String,
    /// Its config.
    pub config: KvTransferConfig,
    /// Its factory.
    pub factory: Arc<dyn ConnectorFactory>,
}

impl std::fmt::Debug for Child {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Child")
            .field("name", &self.name)
            .field("connector", &self.config.kv_connector)
            .finish()
    }
}

/// Resolves every child of `cfg` and names them uniquely: the factory's own name, and for a
/// repeat `name#2`, `name#3`, ...
pub fn resolve_children(cfg: &PdConfig, resolver: &dyn ConnectorResolver) -> Result<Vec<Child>, PdError> {
    let mut out: Vec<Child> = Vec::with_capacity(cfg.children.len());
    for (index, config) in cfg.children.iter().enumerate() {
        let factory = resolver.resolve(config).map_err(|e| PdError::UnknownChild {
            index,
            name: config.kv_connector.clone(),
            message: match e {
                kvconnect_api::ConnectorError::InvalidConfig { message, .. } => message,
                other => other.to_string(),
            },
            known: resolver.known_names(),
        })?;
        let base = factory.info().name;
        let mut name = base.clone();
        let mut n = 1;
        while out.iter().any(|c| c.name == name) {
            n += 1;
            name = format!("{base}#{n}");
        }
        out.push(Child { name, config: config.clone(), factory });
    }
    Ok(out)
}

thread_local! {
    /// The composites being expanded on this thread, outermost first: (canonical config,
    /// connector name).
    static EXPANDING: RefCell<Vec<(String, String)>> = const { RefCell::new(Vec::new()) };
}

/// Marks one composite config as being expanded for as long as it lives.
pub struct ExpandGuard(());

impl ExpandGuard {
    /// Enters `config`; fails when it is already being expanded further out (a loop) or the
    /// nesting is deeper than `MAX_DEPTH`.
    pub fn enter(config: &KvTransferConfig) -> Result<ExpandGuard, PdError> {
        // Serialising a config made of JSON values cannot fail; an empty key would only
        // weaken loop detection, never cause a false one.
        let key = serde_json::to_string(config).unwrap_or_default();
        let name = config.kv_connector.clone();
        EXPANDING.with(|s| {
            let mut s = s.borrow_mut();
            let chain = |extra: &str| {
                s.iter()
                    .map(|(_, n)| n.as_str())
                    .chain(std::iter::once(extra))
                    .collect::<Vec<_>>()
                    .join(" -> ")
            };
            if !key.is_empty() && s.iter().any(|(k, _)| *k == key) {
                return Err(PdError::Loop { name: name.clone(), chain: chain(&name) });
            }
            if s.len() >= MAX_DEPTH {
                return Err(PdError::TooDeep { depth: s.len() + 1, max: MAX_DEPTH, chain: chain(&name) });
            }
            s.push((key, name));
            Ok(ExpandGuard(()))
        })
    }
}

impl Drop for ExpandGuard {
    fn drop(&mut self) {
        EXPANDING.with(|s| {
            s.borrow_mut().pop();
        });
    }
}
