//! A Hugging Face config.json, and what the rest of the code derives from the spec.
#![no_main]

use kvconnect_api::ModelSpec;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(m) = ModelSpec::from_hf_config_json(text) {
        let _ = m.fingerprint();
        let _ = m.kv_layers();
        let _ = m.attention_kinds();
        for d in [kvconnect_api::model::Dtype::F16, kvconnect_api::model::Dtype::F32] {
            let _ = m.kv_bytes_per_token(d);
        }
    }
});
