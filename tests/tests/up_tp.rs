//! `kvconnect up` on a deployment whose prefill runs TP 2 and decode TP 1: every output of
//! the workload equals the monolithic (TP 1) engine's, and decode loaded the KV from prefill
//! rather than recomputing it.

use kvconnect_tests::{kvconnect_bin, workspace_root};
use serde_json::Value;
use std::process::{Command, Stdio};

#[test]
fn up_with_prefill_tp_2_and_decode_tp_1_gives_monolithic_outputs() {
    let file = workspace_root().join("examples/deployments/up-tp.toml");
    let out = Command::new(kvconnect_bin())
        .args(["up", file.to_str().unwrap(), "--workload", "8", "--json", "--compare-monolithic"])
        .stdin(Stdio::null())
        .output()
        .expect("run kvconnect up --workload");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_str(stdout.split_once('\n').unwrap().1).unwrap();
    assert_eq!(report["requests"], 8, "{report}");
    assert_eq!(report["failed"], 0, "{report}");
    assert_eq!(report["mismatches"], 0, "{report}");
    assert_eq!(report["compare_monolithic"]["monolithic_mismatches"], 0, "{report}");
    assert!(report["kv_bytes"].as_u64().unwrap() > 0, "decode loaded KV from prefill: {report}");
}
