//! A deployment file (TOML), with a model config.json beside it.
#![no_main]

use kvconnect_deployment::Deployment;
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

const MODEL: &str = include_str!("../../fixtures/models/kvconnect--reference/config.json");

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("kvconnect-fuzz-deployment-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("temp dir");
        std::fs::write(d.join("config.json"), MODEL).expect("model file");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else { return };
    let _ = Deployment::parse(&dir().join("deployment.toml"), src);
});
