//! `kvconnect up` on a deployment whose prefill runs TP 2 and decode TP 1: every output of
//! the workload equals the monolithic (TP 1) engine's, and decode loaded the KV from prefill
//! rather than recomputing it.

use kvconnect_tests::{up_workload_report, workspace_root};

#[test]
fn up_with_prefill_tp_2_and_decode_tp_1_gives_monolithic_outputs() {
    let file = workspace_root().join("examples/deployments/up-tp.toml");
    let report =
        up_workload_report(&[file.to_str().unwrap(), "--workload", "8", "--json", "--compare-monolithic"]);
    assert_eq!(report["requests"], 8, "{report}");
    assert_eq!(report["failed"], 0, "{report}");
    assert_eq!(report["mismatches"], 0, "{report}");
    assert_eq!(report["compare_monolithic"]["monolithic_mismatches"], 0, "{report}");
    assert!(report["kv_bytes"].as_u64().unwrap() > 0, "decode loaded KV from prefill: {report}");
}
