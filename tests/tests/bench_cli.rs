//! `kvconnect bench transfer` and `bench ttft` as a user runs them (small sizes, debug build):
//! every transfer is verified by decode, and the JSON carries the median ratio of the
//! interleaved pairs with its quartiles and the machine it ran on.

use kvconnect_tests::kvconnect_bin;
use std::process::Command;

fn bench(args: &[&str]) -> serde_json::Value {
    let out = Command::new(kvconnect_bin())
        .arg("bench")
        .args(args)
        .arg("--json")
        .current_dir(env!("CARGO_MANIFEST_DIR").to_owned() + "/..")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kvconnect bench {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

fn check_pairs(r: &serde_json::Value, pairs: u64) {
    assert_eq!(r["pairs"], pairs, "{r}");
    let (q1, m, q3) =
        (r["ratio_q1"].as_f64().unwrap(), r["ratio"].as_f64().unwrap(), r["ratio_q3"].as_f64().unwrap());
    assert!(q1 > 0.0 && q1 <= m && m <= q3, "{r}");
    assert!(r["machine"]["cores"].as_u64().unwrap() >= 1, "{r}");
}

#[test]
fn bench_transfer_verifies_every_pair_and_reports_quartiles() {
    for backend in ["shm", "tcp"] {
        let r = bench(&[
            "transfer",
            "--backend",
            backend,
            "--model",
            "fixtures/models/Qwen--Qwen3-0.6B/config.json",
            "--tokens",
            "200",
            "--pairs",
            "3",
        ]);
        check_pairs(&r, 3);
        // 200 tokens: decode loads 199 of them, in 13 whole 16-token blocks of 28 layers x K
        // and V x 8 heads x 128 channels x bf16.
        assert_eq!(r["bytes"], 13 * 16 * 28 * 2 * 8 * 128 * 2, "{r}");
        // shm's baseline is the memcpy way with the lowest median, named.
        let baseline = r["baseline"].as_str().unwrap_or_default();
        match backend {
            "shm" => assert!(baseline.starts_with("fastest memcpy: ") && baseline.contains(" thread"), "{r}"),
            _ => assert_eq!(baseline, "raw loopback socket", "{r}"),
        }
    }
}

/// Backend nixl against raw nixl-sys READs from a second process, in the same tiny
/// configuration; skipped with a message where the NIXL library is absent (CI fetches it).
#[cfg(feature = "nixl")]
#[test]
fn bench_transfer_nixl_pairs_the_connector_with_raw_nixl_between_two_processes() {
    if let Err(e) = kvconnect_nixl::nixl_lib::find() {
        eprintln!("skipping backend nixl: {e}");
        return;
    }
    let r = bench(&[
        "transfer",
        "--backend",
        "nixl",
        "--model",
        "fixtures/models/Qwen--Qwen3-0.6B/config.json",
        "--tokens",
        "200",
        "--pairs",
        "3",
    ]);
    check_pairs(&r, 3);
    assert_eq!(r["bytes"], 13 * 16 * 28 * 2 * 8 * 128 * 2, "{r}");
    assert_eq!(r["baseline"], "raw NIXL READ between two processes (nixl-sys)", "{r}");
    assert!(r["machine"]["load_average_before"].as_f64().is_some(), "{r}");
}

#[test]
fn bench_transfer_across_tp_sizes_pairs_tp_2_to_1_with_tp_1_to_1() {
    for backend in ["shm", "tcp"] {
        let r = bench(&[
            "transfer",
            "--backend",
            backend,
            "--model",
            "fixtures/models/Qwen--Qwen3-0.6B/config.json",
            "--tokens",
            "200",
            "--pairs",
            "3",
            "--tp-size",
            "2",
        ]);
        check_pairs(&r, 3);
        assert_eq!((r["prefill_tp_size"].as_u64(), r["decode_tp_size"].as_u64()), (Some(2), Some(1)), "{r}");
        // The same bytes as TP 1 -> TP 1: every head of every block, from two prefill ranks.
        assert_eq!(r["bytes"], 13 * 16 * 28 * 2 * 8 * 128 * 2, "{r}");
    }
    let out = Command::new(kvconnect_bin())
        .args(["bench", "transfer", "--backend", "nixl", "--tp-size", "2", "--model"])
        .arg(kvconnect_tests::reference_model())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("loads across TP sizes run on backends shm and tcp"), "{err}");
}

#[test]
fn bench_ttft_pairs_monolithic_and_disaggregated_requests() {
    let r = bench(&["ttft", "--tokens", "64", "--pairs", "3"]);
    check_pairs(&r, 3);
    assert_eq!(r["same_first_token"], true, "{r}");
}
