//! `kv_transfer_params` as a client sends them: the nixl connector's reading and the host's
//! choice of peer.
#![no_main]

use kvconnect_api::Request;
use kvconnect_dataplane::params::TransferParams;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(data) else { return };
    let _ = kvconnect_server::peers::remote_peer(&map);
    let req = Request { id: "fuzz".into(), prompt_tokens: vec![1, 2, 3], kv_transfer_params: map };
    if let Ok(Some(p)) = TransferParams::from_request(kvconnect_nixl::config::NAME, &req) {
        let _ = p.blocks();
        let _ = p.to_map();
    }
});
