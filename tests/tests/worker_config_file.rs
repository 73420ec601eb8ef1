//! `kvconnect worker --kv-transfer-config` takes the JSON itself or the path of a file holding
//! it, as `negotiate` and `plugins inspect` do: a worker started from a file serves, and a path
//! that is neither JSON nor a readable file is refused with a message saying what to pass.

use kvconnect_tests::{reference_model, run_kvconnect, text, Worker};

#[test]
fn a_worker_reads_its_config_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kv.json");
    std::fs::write(&path, "\n  {\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_producer\"}\n").unwrap();
    let model = reference_model();
    let w = Worker::start(&[
        "--kv-transfer-config",
        path.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--engine-id",
        "prefill-from-file",
    ]);
    let (st, m) = w.get("/v1/models");
    assert_eq!(st, 200, "{m}");
    assert!(w.side_channel.is_some(), "a producer serves a side channel; log:\n{}", w.log());
}

#[test]
fn a_config_that_is_neither_json_nor_a_file_is_refused() {
    let model = reference_model();
    let out = run_kvconnect(&[
        "worker",
        "--kv-transfer-config",
        "/nonexistent/kv.json",
        "--model",
        model.to_str().unwrap(),
    ]);
    assert!(!out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("--kv-transfer-config /nonexistent/kv.json: not inline JSON")
            && err.contains("not a readable file"),
        "{err}"
    );
}
