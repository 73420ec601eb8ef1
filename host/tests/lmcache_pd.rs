//! LMCache's P/D settings through the real `kvconnect` binary: a deployment whose lmcache
//! asks for P/D (in its extra config, or through LMCACHE_CONFIG_FILE with LMCache's own
//! prefiller example) is planned, and run, as the nixl connector beside lmcache, and `plan`
//! says so.

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn plan(deployment: &str, env: &[(&str, PathBuf)], extra: &[&str]) -> (i32, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.toml");
    let model = root().join("fixtures/models/kvconnect--reference/config.json");
    std::fs::write(&path, format!("model = \"{}\"\n{deployment}", model.display())).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvconnect"));
    cmd.arg("plan").args(extra).arg(&path).current_dir(root()).env("RUST_LOG", "error");
    for (k, _) in std::env::vars() {
        if k.starts_with("LMCACHE_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = cmd.output().unwrap();
    let (out, err) =
        (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned());
    assert!(!err.contains("panicked"), "{err}");
    (o.status.code().unwrap_or(-1), out, err)
}

const DECODE_NIXL: &str =
    "[decode]\nkv_transfer_config = '{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_consumer\"}'\n";

#[test]
fn an_lmcache_child_with_enable_pd_is_planned_as_lmcache_beside_nixl() {
    let d = format!(
        "[prefill]\nkv_transfer_config = '{{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_role\":\"kv_producer\",\"kv_connector_extra_config\":{{\"enable_pd\":true,\"pd_role\":\"sender\",\"chunk_size\":16}}}}'\n{DECODE_NIXL}"
    );
    let (code, out, err) = plan(&d, &[], &["--joint"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("prefill: PdConnector[lmcache"), "{out}");
    assert!(
        out.contains("note: LMCache P/D settings (enable_pd: true from kv_connector_extra_config"),
        "{out}"
    );
    assert!(out.contains("the nixl connector beside lmcache in a PdConnector"), "{out}");
    assert!(out.contains("COMPATIBLE"), "{out}");
}

#[test]
fn lmcaches_prefiller_example_is_planned_as_the_nixl_producer() {
    let d = format!(
        "[prefill]\nkv_transfer_config = '{{\"kv_connector\":\"LMCacheConnectorV1\"}}'\n{DECODE_NIXL}"
    );
    let file = root().join("fixtures/lmcache/pd-prefiller.yaml");
    let (code, out, err) = plan(&d, &[("LMCACHE_CONFIG_FILE", file)], &["--joint", "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let note = v["notes"]["prefill"][0].as_str().unwrap();
    assert!(note.contains("pd-prefiller.yaml line 4") && note.contains("the nixl connector alone"), "{note}");
    assert_eq!(v["compatible"], true, "{out}");
    // The storage message is not what a P/D user reads.
    assert!(!out.contains("nowhere to store") && !err.contains("nowhere to store"), "{out}{err}");
}

#[test]
fn a_pd_role_on_the_wrong_side_is_refused_naming_it() {
    let d = "[prefill]\nkv_transfer_config = '{\"kv_connector\":\"NixlConnector\"}'\n[decode]\nkv_transfer_config = '{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_connector_extra_config\":{\"enable_pd\":true,\"pd_role\":\"sender\"}}'\n";
    let (code, out, err) = plan(d, &[], &[]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("kv_role kv_producer (from LMCache's pd_role); a decode worker needs"), "{err}");
}
