//! `kvconnect bench transfer --tp-size P`: the load of one prompt's KV from a prefill with
//! TP P into a decode with TP 1, against the TP 1 -> TP 1 load of the same prompt measured in
//! the same run, in interleaved pairs (which of the two runs first alternates), reported as
//! the median of the per-pair ratios (baseline time / TP P time, as `bench transfer` reports
//! rates against its baseline: below 1 is slower) with its quartiles.

use super::bench::{
    backend, connector_settings, load_average, machine, pair_with, round, BenchServer, TransferArgs,
};
use anyhow::{anyhow, bail, Context, Result};
use kvconnect_support::stats::Quartiles;
use serde_json::{json, Value};
use std::time::Duration;

/// One load through `(prefill, decode)`: its time and bytes, once decode verified them.
fn load(servers: &(BenchServer, BenchServer), prompt: &Value) -> Result<(Duration, u64)> {
    let (d, _) = round(&servers.0, &servers.1, prompt, 1)?;
    let p = &d["kv_transfer_params"];
    if p["verified"] != true {
        bail!("decode did not verify the transferred KV: {d}");
    }
    let bytes = p["bytes"].as_u64().ok_or_else(|| anyhow!("decode reported no byte count: {d}"))?;
    Ok((Duration::from_micros(p["transfer_us"].as_u64().unwrap_or(0)), bytes))
}

pub(super) fn transfer(a: &TransferArgs) -> Result<()> {
    let backend = backend(&a.backend)?;
    if backend == "nixl" || a.tp_size == 0 {
        bail!(
            "--tp-size {} with --backend {backend}: prefill's TP size must be positive, and loads across TP \
                sizes run on backends shm and tcp",
            a.tp_size
        );
    }
    if a.tokens < 2 {
        bail!("--tokens must be at least 2 (decode loads all but the last prompt token)");
    }
    let model_json =
        std::fs::read_to_string(&a.model).with_context(|| format!("model {}", a.model.display()))?;
    let spec = kvconnect_api::ModelSpec::from_hf_config_json(&model_json)
        .with_context(|| format!("model {}", a.model.display()))?;
    let blocks = (a.tokens.div_ceil(16) + 8).to_string();
    let extra = ["--synthetic-kv", "--num-blocks", &blocks];
    let tp = a.tp_size.to_string();
    let (_, settings) = connector_settings(a, backend)?;
    let base = pair_with(&a.model, backend, &settings, &extra, &[], "bench-tp1")?;
    let across =
        pair_with(&a.model, backend, &settings, &extra, &["--tp-size", &tp], &format!("bench-tp{tp}"))?;
    let prompt = json!(vec![0u32; a.tokens]);
    let total = a.pairs.max(1) + 1;
    let load_before = load_average();
    let (mut times, mut base_times, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut bytes = 0;
    for i in 0..total {
        let (t, b) = if i % 2 == 0 {
            let b = load(&base, &prompt)?;
            (load(&across, &prompt)?, b)
        } else {
            let t = load(&across, &prompt)?;
            (t, load(&base, &prompt)?)
        };
        if t.1 != b.1 {
            bail!("TP {tp} -> 1 moved {} bytes but TP 1 -> 1 moved {}: not the same KV", t.1, b.1);
        }
        bytes = t.1;
        if !a.json {
            eprintln!(
                "[{}/{total}] {backend}: {bytes} bytes; TP {tp} -> 1 {:.1} ms; TP 1 -> 1 {:.1} ms{}",
                i + 1,
                t.0.as_secs_f64() * 1e3,
                b.0.as_secs_f64() * 1e3,
                if i == 0 { " (warm-up)" } else { "" }
            );
        }
        if i > 0 {
            times.push(t.0.as_secs_f64());
            base_times.push(b.0.as_secs_f64());
            // Both moved the same bytes: the rate ratio is the inverse of the time ratio.
            ratios.push(b.0.as_secs_f64() / t.0.as_secs_f64().max(1e-9));
        }
    }
    drop(across);
    drop(base);
    let (t, bt, r) = (Quartiles::of(times), Quartiles::of(base_times), Quartiles::of(ratios.clone()));
    let out = json!({
        "backend": backend,
        "model": spec.name,
        "tokens": a.tokens,
        "bytes": bytes,
        "prefill_tp_size": a.tp_size,
        "decode_tp_size": 1,
        "pairs": ratios.len(),
        "seconds": t.median,
        "baseline": "the same load from TP 1 into TP 1",
        "baseline_seconds": bt.median,
        "ratio": r.median,
        "ratio_q1": r.q1,
        "ratio_q3": r.q3,
        "machine": machine(load_before),
    });
    if a.json {
        println!("{out}");
    } else {
        println!(
            "transfer {backend}: {bytes} bytes ({} tokens of {}); median of {} interleaved pairs: TP {tp} -> \
                1 {:.2} ms, TP 1 -> 1 {:.2} ms; rate ratio {:.3} (quartiles {:.3} .. {:.3}); {}",
            a.tokens,
            spec.name,
            ratios.len(),
            t.median * 1e3,
            bt.median * 1e3,
            r.median,
            r.q1,
            r.q3,
            out["machine"]
        );
    }
    Ok(())
}
