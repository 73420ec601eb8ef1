//! A plugin cannot vouch for KV memory: `KvRegion::new` (kvconnect-api's `host` feature) is for
//! hosts, which own the memory. The nixl plugin and the connector it exports are built without
//! it; only their tests and the benchmark harness enable it.

#[test]
fn the_plugin_is_built_without_kvconnect_apis_host_feature() {
    let out = std::process::Command::new(env!("CARGO"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "tree",
            "--offline",
            "-p",
            "kvconnect-plugin-nixl",
            "-e",
            "features,normal",
            "-i",
            "kvconnect-api",
        ])
        .output()
        .expect("cargo runs");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(tree.contains("kvconnect-nixl"), "the plugin depends on the connector: {tree}");
    assert!(!tree.contains("feature \"host\""), "the plugin's build enables `host`:\n{tree}");
}
