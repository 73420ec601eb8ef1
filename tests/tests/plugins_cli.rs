//! `kvconnect plugins list | inspect` as a user runs them, against real plugin libraries.

use kvconnect_tests::plugin_fixtures::{self, broken_plugin, copy_with_mode};
use kvconnect_tests::{fixture_model, run_kvconnect, text};
use std::path::Path;

fn tmp() -> &'static Path {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
}

#[test]
fn list_shows_builtins_and_plugins_and_one_line_per_refused_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let example = plugin_fixtures::example_plugin(tmp());
    copy_with_mode(&example, dir.path(), "libexample.so", 0o755);
    broken_plugin(tmp(), "abi_major", dir.path());
    broken_plugin(tmp(), "invalid_caps", dir.path());
    std::fs::write(dir.path().join("libnotes.so"), "notes").unwrap();

    let d = dir.path().to_string_lossy().into_owned();
    let out = run_kvconnect(&["--plugin-dir", &d, "plugins", "list"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let header = stdout.lines().next().unwrap();
    assert!(
        header.starts_with("NAME") && header.contains("ORIGIN") && header.contains("CAPABILITIES"),
        "{stdout}"
    );
    let row = stdout.lines().find(|l| l.starts_with("example ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        row.contains("dynamic")
            && row.contains(&format!(
                " {}.{} ",
                kvconnect_api::abi::ABI_MAJOR,
                kvconnect_api::abi::ABI_MINOR
            ))
            && row.contains("libexample.so"),
        "{row}"
    );
    assert!(row.contains("hma=no") && row.contains("mode=none"), "{row}");
    for b in ["nixl", "lmcache", "flexkv", "pd"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(&format!("{b} ")) && l.contains("builtin")),
            "{b}: {stdout}"
        );
    }
    // Columns line up: ORIGIN starts at the same offset on every row.
    let col = header.find("ORIGIN").unwrap();
    assert!(
        stdout.lines().skip(1).all(|l| ["builtin", "dynamic"].iter().any(|o| l[col..].starts_with(o))),
        "{stdout}"
    );
    let stderr = text(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "one line per refused plugin:\n{stderr}");
    assert!(
        lines.iter().any(|l| l.contains("libbroken_abi_major.so: built for kvconnect ABI 2.x")),
        "{stderr}"
    );
    assert!(lines
        .iter()
        .any(|l| l.contains("libbroken_invalid_caps.so") && l.contains("both required and rejected")));
    assert!(lines.iter().any(|l| l.contains("libnotes.so: not a loadable shared library")), "{stderr}");

    let out = run_kvconnect(&["--plugin-dir", &d, "plugins", "list", "--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ex = v["connectors"].as_array().unwrap().iter().find(|c| c["name"] == "example").unwrap();
    assert_eq!(ex["origin"], "dynamic");
    assert_eq!(ex["abi"], "1.3");
    assert_eq!(ex["sdk_version"], kvconnect_api::abi::SDK_VERSION);
    assert!(ex["summary"].as_str().unwrap().starts_with("hma=no"));
    assert!(ex["capabilities_error"].is_null());
    let nixl = v["connectors"].as_array().unwrap().iter().find(|c| c["name"] == "nixl").unwrap();
    assert_eq!(nixl["origin"], "builtin");
    assert_eq!(nixl["aliases"], serde_json::json!(["NixlConnector"]));
    assert!(nixl["path"].is_null());
    assert_eq!(v["errors"].as_array().unwrap().len(), 3);
    assert!(v["errors"].as_array().unwrap().iter().all(|e| e["path"].as_str().unwrap().starts_with(&d)));
}

#[test]
fn inspect_a_plugin_by_path_with_config_and_model() {
    let example = plugin_fixtures::example_plugin(tmp());
    let dir = tempfile::tempdir().unwrap();
    let lib = copy_with_mode(&example, dir.path(), "libmine.so", 0o755);
    let model = fixture_model("Qwen--Qwen3-0.6B");
    let cfg =
        r#"{"kv_connector":"example","kv_role":"kv_both","kv_connector_extra_config":{"dir":"/tmp/x"}}"#;
    let out = run_kvconnect(&[
        "plugins",
        "inspect",
        &lib.to_string_lossy(),
        "--kv-transfer-config",
        cfg,
        "--model",
        &model.to_string_lossy(),
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["name"], "example");
    assert_eq!(v["path"], lib.to_string_lossy().as_ref());
    assert_eq!(v["capabilities"]["hma"], false);
    assert_eq!(v["capabilities"]["transfer_mode"], "none");
    assert_eq!(v["capabilities"]["layout"]["preferred"], serde_json::json!(["LBNHC"]));
    assert!(v["model"].is_string());

    let out = run_kvconnect(&["plugins", "inspect", "FlexKVConnectorV1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(s.lines().any(|l| l.starts_with("name") && l.ends_with("flexkv")), "{s}");
    assert!(
        s.lines().any(|l| l.trim_start().starts_with("layout") && l.contains("rejects HND (LBHNC)")),
        "{s}"
    );
}

#[test]
fn inspect_shows_a_composite_plugins_children() {
    let dir = tempfile::tempdir().unwrap();
    let lib = broken_plugin(tmp(), "composite", dir.path());
    let out = run_kvconnect(&["plugins", "inspect", &lib.to_string_lossy(), "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["abi"], format!("{}.{}", kvconnect_api::abi::ABI_MAJOR, kvconnect_api::abi::ABI_MINOR));
    let children = v["children"].as_array().unwrap_or_else(|| panic!("no children: {v}"));
    let names: Vec<&str> = children.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["cache", "net"]);
    for c in children {
        assert_eq!(c["version"], "0.1.0");
        assert!(c["summary"].as_str().unwrap().starts_with("hma=no"), "{c}");
        assert_eq!(c["capabilities"]["transfer_mode"], "none");
    }
    // A plain plugin has none.
    let plain = broken_plugin(tmp(), "method_panics", dir.path());
    let out = run_kvconnect(&["plugins", "inspect", &plain.to_string_lossy(), "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["children"].is_null(), "{v}");
}

#[test]
fn inspect_refuses_unknown_names_and_invalid_capabilities() {
    let out = run_kvconnect(&["plugins", "inspect", "MooncakeConnector"]);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(e.contains("no connector named 'MooncakeConnector'") && e.contains("NixlConnector"), "{e}");
    assert!(!e.contains("did you mean"), "{e}");
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    // A misspelling gets the closest name besides the list.
    let out = run_kvconnect(&["plugins", "inspect", "NixlConector"]);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(
        e.contains("no connector named 'NixlConector' (did you mean 'NixlConnector'?): known connectors are"),
        "{e}"
    );
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");

    let dir = tempfile::tempdir().unwrap();
    let bad = broken_plugin(tmp(), "invalid_caps", dir.path());
    let out = run_kvconnect(&["plugins", "inspect", &bad.to_string_lossy()]);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(
        e.contains("declares invalid capabilities: layout HND (LBHNC) is both required and rejected"),
        "{e}"
    );
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
}

/// `--kv-transfer-config` is read the same way by `negotiate` and `plugins inspect`: vLLM's
/// JSON inline, or a file holding it; anything else is refused naming the argument.
#[test]
fn kv_transfer_config_is_inline_json_or_a_file_for_every_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kv.json");
    std::fs::write(&file, "\n {\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}\n").unwrap();
    let file = file.to_string_lossy().into_owned();
    let inline = r#"  {"kv_connector": "NixlConnector", "kv_role": "kv_both"}"#;
    let model = fixture_model("Qwen--Qwen3-0.6B");
    let model = model.to_string_lossy().into_owned();
    let missing = dir.path().join("missing.json").to_string_lossy().into_owned();

    for arg in [inline, file.as_str()] {
        let out = run_kvconnect(&["plugins", "inspect", "nixl", "--kv-transfer-config", arg, "--json"]);
        assert!(out.status.success(), "{arg}: {}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["name"], "nixl", "{arg}");
        let out = run_kvconnect(&["negotiate", "--kv-transfer-config", arg, "--model", &model]);
        assert!(out.status.success(), "{arg}: {}", text(&out.stderr));
        assert!(text(&out.stdout).contains("HND"), "{arg}: {}", text(&out.stdout));
    }

    for sub in [&["plugins", "inspect", "nixl"][..], &["negotiate", "--model", &model][..]] {
        let out = run_kvconnect(&[sub, &["--kv-transfer-config", &missing]].concat());
        assert!(!out.status.success(), "{sub:?}");
        let err = text(&out.stderr);
        assert!(
            err.contains(&format!("--kv-transfer-config {missing}: not inline JSON"))
                && err.contains("not a readable file"),
            "{sub:?}: {err}"
        );
    }
}
