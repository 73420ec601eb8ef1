//! `kvconnect plugins list | inspect` next to plugins that abort or hang in their capability
//! query: each plugin is loaded in a query process of its own, so the command survives
//! them, lists every other connector and names each of them in one line.

use kvconnect_tests::kvconnect_bin;
use kvconnect_tests::plugin_fixtures::{self, broken_plugin, copy_with_mode};
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn tmp() -> &'static Path {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs kvconnect with a 3 s query time limit from the environment, and no log.
fn kvconnect(args: &[&str]) -> Output {
    kvconnect_logging(args, "off")
}

fn kvconnect_logging(args: &[&str], rust_log: &str) -> Output {
    Command::new(kvconnect_bin())
        .args(args)
        .env_remove("KVCONNECT_PLUGIN_PATH")
        .env("KVCONNECT_PLUGIN_QUERY_TIMEOUT", "3")
        .env("RUST_LOG", rust_log)
        .output()
        .unwrap()
}

/// Processes whose command line mentions `needle` (a query process left behind would).
fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) {
            let cmdline = text(&cmdline).replace('\0', " ");
            if cmdline.contains(needle) {
                found.push(format!("{}: {cmdline}", e.file_name().to_string_lossy()));
            }
        }
    }
    found
}

#[test]
fn list_survives_plugins_that_abort_or_hang() {
    let dir = tempfile::tempdir().unwrap();
    let example = plugin_fixtures::example_plugin(tmp());
    copy_with_mode(&example, dir.path(), "libexample.so", 0o755);
    let aborts = broken_plugin(tmp(), "caps_aborts", dir.path());
    let hangs = broken_plugin(tmp(), "caps_hangs", dir.path());
    let d = dir.path().to_string_lossy().into_owned();

    let started = Instant::now();
    let out = kvconnect(&["--plugin-dir", &d, "plugins", "list"]);
    let took = started.elapsed();
    assert!(out.status.success(), "{out:?}");
    assert!(took < Duration::from_secs(30), "the hung plugin's query was not cut short: {took:?}");
    let stdout = text(&out.stdout);
    for name in ["nixl", "lmcache", "flexkv", "pd", "example"] {
        assert!(stdout.lines().any(|l| l.starts_with(&format!("{name} "))), "{name}: {stdout}");
    }
    assert!(!stdout.contains("broken"), "{stdout}");
    let stderr = text(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "one line per plugin that crashed or hung:\n{stderr}");
    let aborted = format!("plugin {}: the query process was killed by signal 6 (SIGABRT)", aborts.display());
    assert!(lines.iter().any(|l| l.starts_with(&aborted) && l.contains("fix it or remove it")), "{stderr}");
    let hung = format!("plugin {}: no answer within 3 s", hangs.display());
    assert!(lines.iter().any(|l| l.starts_with(&hung) && l.contains("killed (SIGKILL)")), "{stderr}");
    assert_eq!(processes_mentioning(&d), Vec::<String>::new(), "no query process may outlive the command");

    // The flag overrides the environment; --json reports both with the other refusals.
    let out = kvconnect(&["--plugin-dir", &d, "plugins", "list", "--json", "--query-timeout", "1.5"]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> =
        v["connectors"].as_array().unwrap().iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(names, ["nixl", "lmcache", "flexkv", "pd", "example"]);
    let errors = v["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 2, "{errors:#?}");
    let error_for = |p: &Path| {
        let shown = p.display().to_string();
        errors.iter().find(|e| e["path"] == shown.as_str()).unwrap_or_else(|| panic!("{shown}: {errors:#?}"))
            ["message"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(error_for(&aborts).starts_with(&aborted), "{errors:#?}");
    assert!(error_for(&hangs).starts_with(&format!("plugin {}: no answer within 1.5 s", hangs.display())));
    assert_eq!(text(&out.stderr), "", "--json prints the refusals in errors only");
    assert_eq!(processes_mentioning(&d), Vec::<String>::new(), "no query process may outlive the command");
}

#[test]
fn inspect_an_aborting_plugin_fails_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let aborts = broken_plugin(tmp(), "caps_aborts", dir.path());
    let p = aborts.to_string_lossy().into_owned();

    let out = kvconnect(&["plugins", "inspect", &p]);
    assert!(!out.status.success(), "{out:?}");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!("error: plugin {p}: the query process was killed by signal 6 (SIGABRT)")),
        "{stderr}"
    );
    assert_eq!(text(&out.stdout), "");

    // The plugin's log lines still reach stderr, from its query process.
    let out = kvconnect_logging(&["plugins", "inspect", &p], "warn");
    let stderr = text(&out.stderr);
    assert!(
        stderr.lines().any(|l| l.contains("about to abort on purpose") && l.contains("plugin=broken")),
        "{stderr}"
    );
    assert!(stderr.contains("signal 6 (SIGABRT)"), "{stderr}");
}
