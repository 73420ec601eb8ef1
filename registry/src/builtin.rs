//! The factories of the connectors linked into the host.

use kvconnect_api::ConnectorFactory;
use std::sync::Arc;

/// The nixl transport.
pub fn nixl() -> Arc<dyn ConnectorFactory> {
    Arc::new(kvconnect_nixl::NixlFactory)
}

/// The LMCache-style chunk cache.
pub fn lmcache() -> Arc<dyn ConnectorFactory> {
    Arc::new(kvconnect_lmcache::LmcacheFactory)
}

/// The FlexKV-style block cache.
pub fn flexkv() -> Arc<dyn ConnectorFactory> {
    Arc::new(kvconnect_flexkv::FlexkvFactory::new())
}
