//! The default build needs nothing but cargo: no crate in the default dependency graph runs
//! bindgen (which needs libclang). Real NIXL, whose binding does, is behind feature `nixl`,
//! which `.ci/run` builds and tests.

use std::process::Command;

fn cargo_tree(args: &[&str]) -> (bool, String) {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .args(["tree", "--offline", "--workspace", "-e", "normal,build,dev"])
        .args(args)
        .current_dir(kvconnect_tests::workspace_root())
        .output()
        .expect("run cargo tree");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn the_default_dependency_graph_has_no_bindgen() {
    let (found, text) = cargo_tree(&["-i", "bindgen"]);
    assert!(
        !found,
        "bindgen is in the default build (a fresh machine without libclang cannot build it):\n{text}"
    );
    assert!(text.contains("did not match any packages"), "{text}");
}
