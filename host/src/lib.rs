//! The kvconnect host: finds and loads connectors (built in and plugins), and runs servers.
pub mod cli;
/// The plugin loader (crate `kvconnect-loader`), under the name the host has always used.
pub use kvconnect_loader as loader;
