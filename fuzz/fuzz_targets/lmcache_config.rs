//! LMCache's settings: LMCACHE_CONFIG_FILE (YAML), LMCACHE_* variables, the extra config.
#![no_main]

#[path = "../common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let input = common::ConfigInput::split(data);
    let path = input.write_file("yaml");
    let mut env: Vec<(String, String)> =
        input.env.into_iter().filter(|(k, _)| k != "LMCACHE_CONFIG_FILE").collect();
    env.push(("LMCACHE_CONFIG_FILE".into(), path.display().to_string()));
    if let Ok(r) = kvconnect_lmcache::config::resolve_all(&input.extra, &env) {
        let _ = r.config.cpu_budget_bytes();
        let _ = r.config.disk_budget_bytes();
    }
});
