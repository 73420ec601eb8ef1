//! `kvconnect bench transfer --backend cuda_ipc --device cuda`: the GPU transfer benchmark.
//! The producer half runs in this process, the consumer half in a second `kvconnect`
//! process (`bench cuda-ipc-peer`), so the KV really crosses a process boundary over CUDA
//! IPC. Built only with the `cuda` feature; without it the command says how to get it.

use super::bench::TransferArgs;
use anyhow::Result;

#[cfg(not(feature = "cuda"))]
pub fn transfer(_a: &TransferArgs) -> Result<()> {
    anyhow::bail!(
        "this kvconnect was built without GPU support: rebuild it with `cargo build --release -p \
            kvconnect-host --features cuda` to use --backend cuda_ipc / --device cuda"
    )
}

#[cfg(not(feature = "cuda"))]
pub fn peer() -> Result<()> {
    anyhow::bail!("this kvconnect was built without GPU support (the cuda feature)")
}

#[cfg(feature = "cuda")]
pub fn transfer(a: &TransferArgs) -> Result<()> {
    use anyhow::{bail, Context};
    use kvconnect_bench::cuda_ipc::{run_producer, Geometry};
    use std::io::Write;
    use std::process::{Command, Stdio};

    if a.backend != "cuda_ipc" || a.device != "cuda" {
        bail!(
            "GPU transfers need both --backend cuda_ipc and --device cuda (got --backend {} --device {})",
            a.backend,
            a.device
        );
    }
    let text = std::fs::read_to_string(&a.model).with_context(|| format!("model {}", a.model.display()))?;
    let model = kvconnect_api::ModelSpec::from_hf_config_json(&text)
        .with_context(|| format!("model {}", a.model.display()))?;
    let mla = model.layers.iter().any(|k| matches!(k, kvconnect_api::AttentionKind::Mla { .. }));
    let geometry = Geometry {
        layers: model.layers.iter().filter(|k| k.has_kv_blocks()).count() as u32,
        kv_parts: if mla { 1 } else { 2 },
        heads: model.num_kv_heads,
        head_dim: model.head_dim,
        elem_size: model.dtype.map(|d| d.size() as u32).unwrap_or(2),
        block_tokens: 16,
    };
    let exe = std::env::current_exe().context("locating the kvconnect binary")?;
    let report = run_producer(a.gpu, a.peer_gpu, geometry, a.tokens as u32, a.pairs.max(1) as u32, |spec| {
        let mut child = Command::new(&exe)
            .args(["bench", "cuda-ipc-peer"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting {}: {e}", exe.display()))?;
        let body = serde_json::to_string(spec).map_err(|e| e.to_string())?;
        child
            .stdin
            .take()
            .ok_or("no stdin")?
            .write_all(body.as_bytes())
            .map_err(|e| format!("writing the spec: {e}"))?;
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout.lines().rev().find(|l| l.starts_with('{')).unwrap_or("");
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{e}: output was {stdout}"))?;
        if let Some(err) = v.get("error").and_then(|e| e.as_str()) {
            return Err(err.to_owned());
        }
        Ok(v)
    })?;
    if a.json {
        println!("{report}");
    } else {
        let f = |k: &str| report.get(k).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
        println!(
            "cuda_ipc transfer on {} ({} bytes, GPU {} -> GPU {})",
            report["device"], report["bytes"], a.gpu, a.peer_gpu
        );
        println!("  gather kernel        {:8.1} GB/s  {:.2}x contiguous copy", f("gbps"), f("ratio"));
        println!("  fused NHD->HND       {:8.1} GB/s  {:.2}x", f("permute_gbps"), f("permute_ratio"));
        println!(
            "  per-block memcpy     {:8.1} GB/s  {:.3}x",
            f("per_block_memcpy_gbps"),
            f("per_block_memcpy_ratio")
        );
        println!("  contiguous baseline  {:8.1} GB/s", f("baseline_gbps"));
        println!(
            "  save to pinned host  {:8.1} GB/s  {:.2}x contiguous D2H",
            f("save_to_pinned_gbps"),
            f("save_ratio")
        );
        println!("  small requests (us)  {}", report["small_requests"]);
    }
    Ok(())
}

#[cfg(feature = "cuda")]
pub fn peer() -> Result<()> {
    use std::io::Read;
    let mut body = String::new();
    std::io::stdin().read_to_string(&mut body)?;
    let out = match serde_json::from_str::<kvconnect_bench::cuda_ipc::PeerSpec>(&body) {
        Ok(spec) => match kvconnect_bench::cuda_ipc::run_consumer(&spec) {
            Ok(v) => v,
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        },
        Err(e) => serde_json::json!({ "error": format!("malformed peer spec: {e}") }),
    };
    println!("{out}");
    Ok(())
}
