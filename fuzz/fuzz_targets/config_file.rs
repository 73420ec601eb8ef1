//! The YAML/JSON config file reader shared by LMCACHE_CONFIG_FILE and FLEXKV_CONFIG_PATH.
#![no_main]

use kvconnect_config_file::{key_line, ConfigFile};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    for name in ["c.yaml", "c.json"] {
        if let Ok(f) = ConfigFile::parse("FUZZ_CONFIG", Path::new(name), text, "key: 1") {
            for e in &f.entries {
                let _ = f.place(e);
                let _ = key_line(text, &e.key);
            }
        }
    }
});
