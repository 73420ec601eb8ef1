//! kvconnect-api stands on its own: its manifest inherits nothing from the workspace yet
//! agrees with it on every version, and its package carries the C header, the build script
//! and every file its tests read.

use kvconnect_tests::{cargo_cmd, workspace_root};
use toml::{Table, Value};

fn manifest(path: &str) -> Table {
    let p = workspace_root().join(path);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
    text.parse().unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn table<'a>(t: &'a Table, key: &str) -> &'a Table {
    t.get(key).and_then(Value::as_table).unwrap_or_else(|| panic!("no [{key}] table"))
}

/// A dependency as `(version, default-features, features)`, however it is spelled.
fn dependency(spec: &Value) -> (String, bool, Vec<String>) {
    match spec {
        Value::String(v) => (v.clone(), true, vec![]),
        Value::Table(t) => (
            t.get("version").and_then(Value::as_str).unwrap_or_default().to_owned(),
            t.get("default-features").and_then(Value::as_bool).unwrap_or(true),
            t.get("features")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
                .unwrap_or_default(),
        ),
        other => panic!("a dependency written as {other}"),
    }
}

fn inherits(v: &Value) -> bool {
    match v {
        Value::Table(t) => t.iter().any(|(k, v)| k == "workspace" || inherits(v)),
        Value::Array(a) => a.iter().any(inherits),
        _ => false,
    }
}

#[test]
fn the_api_manifest_is_self_contained_and_agrees_with_the_workspace() {
    let api = manifest("connector-api/Cargo.toml");
    let ws = manifest("Cargo.toml");
    let ws = table(&ws, "workspace");
    assert!(
        !inherits(&Value::Table(api.clone())),
        "connector-api/Cargo.toml must not inherit from the workspace (a vendored copy has none)"
    );
    let package = table(&api, "package");
    for key in ["version", "edition", "license"] {
        assert_eq!(package.get(key), table(ws, "package").get(key), "package.{key}");
    }
    let ws_deps = table(ws, "dependencies");
    for section in ["dependencies", "dev-dependencies"] {
        for (name, spec) in table(&api, section) {
            let theirs = ws_deps.get(name).unwrap_or_else(|| panic!("{name} is not a workspace dependency"));
            assert_eq!(
                dependency(spec),
                dependency(theirs),
                "{section}.{name}: the API's and the workspace's"
            );
        }
    }
    let own = dependency(&ws_deps["kvconnect-api"]).0;
    assert_eq!(Some(own.as_str()), package.get("version").and_then(Value::as_str), "workspace kvconnect-api");
}

#[test]
fn the_api_package_carries_its_header_build_script_and_fixtures() {
    let out = cargo_cmd::run(
        &["package", "-p", "kvconnect-api", "--list", "--allow-dirty", "--offline"],
        &workspace_root(),
    );
    let listed = String::from_utf8_lossy(&out.stdout);
    let listed: Vec<&str> = listed.lines().collect();
    let mut needed = vec!["include/kvconnect.h".to_owned(), "build.rs".to_owned()];
    let api = workspace_root().join("connector-api");
    for dir in ["src", "tests", "benches"] {
        for entry in std::fs::read_dir(api.join(dir)).expect("read a connector-api folder") {
            let text = std::fs::read_to_string(entry.expect("a folder entry").path()).unwrap_or_default();
            // `include_str!("../x")` in a file one folder down reads `x` of the package.
            let mut rest = text.as_str();
            while let Some(i) = rest.find("!(\"../") {
                let path = &rest[i + 6..];
                let end = path.find('"').unwrap_or(path.len());
                assert!(
                    !path.starts_with("../"),
                    "connector-api/{dir} reads a file outside the package: {path}"
                );
                needed.push(path[..end].to_owned());
                rest = &path[end..];
            }
        }
    }
    assert!(needed.len() > 2, "the scan found the fixtures the tests read");
    for file in &needed {
        assert!(listed.contains(&file.as_str()), "the kvconnect-api package lacks {file}: {listed:?}");
    }
}
