//! What the nixl connector tells, in one place: the step metadata its scheduler half hands
//! its worker half every step ([`step`]), and the handshake metadata a producer publishes to
//! its consumers ([`handshake`]; ARCHITECTURE.md §7).

pub mod handshake;
pub mod step;

pub use handshake::*;
pub use step::{LoadSpec, NixlMeta, SendSpec};

#[cfg(test)]
pub(crate) use handshake::sample_metadata;
