//! The kvconnect host: finds and loads connectors (built in and plugins), and runs workers.
pub mod worker;
pub mod builtin;
pub mod cli;
pub mod loader;
pub mod registry;
