//! The one shutdown signal of every long-running command (`worker`, `up`, `proxy`).

use anyhow::{Context, Result};

/// Registers the SIGTERM and SIGINT handlers now (a signal that arrives before the server
/// announces itself must not kill it with the default action and leak its shared memory);
/// the returned future completes on the first of them.
pub fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot listen for SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}
