//! The `kvconnect` command ([`cli`]; the binary is `src/main.rs`). What it runs lives in
//! crates of its own (ARCHITECTURE.md §1): the connector registry (`kvconnect-registry`),
//! deployment files (`kvconnect-deployment`), the worker server (`kvconnect-server`), the
//! supervisor behind `kvconnect up` (`kvconnect-up`) and the P/D proxy (`kvconnect-proxy`).
pub mod cli;
/// The plugin loader (crate `kvconnect-loader`), under the name the host has always used.
pub use kvconnect_loader as loader;
