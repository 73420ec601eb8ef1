//! `kvconnect up`: the one-command P/D deployment (servers, proxy, optional workload); the
//! work is in the crate [`kvconnect_up`].

pub use kvconnect_up::UpArgs;

/// Runs `kvconnect up`.
pub fn run(a: &UpArgs) -> anyhow::Result<()> {
    kvconnect_up::run(a)
}
