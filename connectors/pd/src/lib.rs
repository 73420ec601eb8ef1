//! The composite connector (PdConnector): any number of children, in order, built in or
//! loaded from plugins, driven as one connector.
//!
//! It owns the routing between children (first-hit or summed lookups, saves to every child,
//! per-child tracking of finished transfers, transfer params and handshake metadata keyed by
//! child) and the derivation of its capabilities from its children's. It must not decide
//! anything from its own name, and it does no negotiation of its own: the effective layout
//! comes from `kvconnect_api::negotiate` over the children's declarations.

pub mod caps;
pub mod children;
pub mod config;
pub mod error;
pub mod factory;
pub mod meta;
pub mod scheduler;
pub mod worker;

#[cfg(test)]
mod fake;

pub use config::{LookupMode, PdConfig};
pub use error::PdError;
pub use factory::PdFactory;
pub use scheduler::PdScheduler;
pub use worker::PdWorker;
