//! FlexKV's settings: FLEXKV_CONFIG_PATH (YAML or JSON), FLEXKV_* variables, the extra config.
#![no_main]

#[path = "../common.rs"]
mod common;

use kvconnect_flexkv::config::FlexkvConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let input = common::ConfigInput::split(data);
    let path = input.write_file("yml").display().to_string();
    let env = |k: &str| {
        if k == "FLEXKV_CONFIG_PATH" {
            return Some(path.clone());
        }
        input.env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    };
    if let Ok(c) = FlexkvConfig::resolve(&input.extra, &env) {
        let _ = c.cpu_bytes();
        let _ = c.ssd_bytes();
    }
});
