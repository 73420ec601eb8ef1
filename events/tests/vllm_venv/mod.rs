//! Where the tests find vLLM's own Python classes to check kvconnect's bytes against.

use std::path::PathBuf;

/// The vLLM venv's python: `KVCONNECT_VLLM_VENV` when set, else the repository's
/// `.venv-vllm` once `scripts/install-vllm.sh` has finished it (its marker file says so: CI
/// makes that venv while these tests run, and a half-installed one lacks vLLM's modules),
/// else none (the tests that need it skip, saying so).
pub fn vllm_python() -> Option<PathBuf> {
    let venv = match std::env::var_os("KVCONNECT_VLLM_VENV") {
        Some(v) => PathBuf::from(v),
        None => {
            let v = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv-vllm");
            if !v.join(".kvconnect-vllm-ok").exists() {
                return None;
            }
            v
        }
    };
    let py = venv.join("bin/python");
    py.exists().then_some(py)
}

/// Why a test that needs the venv did not run.
pub const SKIPPED: &str =
    "skipped: no vLLM venv (set KVCONNECT_VLLM_VENV, or run scripts/install-vllm.sh to the end)";
