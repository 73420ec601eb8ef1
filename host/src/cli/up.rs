//! `kvconnect up`: the one-command P/D deployment (servers, proxy, optional workload); the
//! work is in [`crate::up`].

pub use crate::up::UpArgs;

/// Runs `kvconnect up`.
pub fn run(a: &UpArgs) -> anyhow::Result<()> {
    crate::up::run(a)
}
