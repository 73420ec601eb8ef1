//! `kvconnect._kvconnect`: any kvconnect connector (a built-in or a plugin) behind vLLM's KV
//! connector API. The Python package (`kvconnect.vllm`) only adapts vLLM's calls and tensors;
//! negotiation, the handshake, the connectors and their transfers run here, through the same
//! registry, side channel and negotiation as kvconnect's own workers.

mod error;
mod ignored;
mod joint;
mod meta;
mod peer_gate;
mod regions;
mod sched_link;
mod scheduler;
mod setup;
mod shm_kv;
mod worker;

use pyo3::prelude::*;

/// kvconnect's log lines go to stderr, beside vLLM's; `KVCONNECT_LOG` filters them (default
/// `info`).
pub(crate) fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVCONNECT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// Unlinks the names of this process's shared-memory KV segments (at interpreter exit; the
/// memory stays mapped until the process ends). Returns how many went.
#[pyfunction]
fn unlink_shared_kv() -> usize {
    shm_kv::unlink_at_exit()
}

/// The in-block layout the connector needs vLLM to allocate (`"HND"`, `"NHD"`) or `None`, for
/// vLLM's `get_required_kvcache_layout` (`setup::required_layout`).
#[pyfunction]
fn required_kv_cache_layout(setup_json: &str) -> PyResult<Option<&'static str>> {
    Ok(setup::required_layout(setup_json)?)
}

#[pymodule]
fn _kvconnect(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<scheduler::Scheduler>()?;
    m.add_class::<worker::Worker>()?;
    m.add_function(wrap_pyfunction!(unlink_shared_kv, m)?)?;
    m.add_function(wrap_pyfunction!(required_kv_cache_layout, m)?)?;
    m.add("KvconnectError", m.py().get_type::<error::KvconnectError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // How this module was compiled: "release" (`pip install ./python`) or "debug" (maturin's
    // `--profile dev`, as CI builds it for its tests), whose calls cost several times more.
    m.add("BUILD", if cfg!(debug_assertions) { "debug" } else { "release" })?;
    Ok(())
}
