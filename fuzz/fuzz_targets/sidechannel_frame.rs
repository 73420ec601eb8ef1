//! The host's side-channel frames (length prefix and JSON message), as a peer sends them,
//! and a decoded `hello`'s descriptor checked against a real one.
#![no_main]

use kvconnect_api::compat::{check_roles, CompatDescriptor};
use kvconnect_api::negotiate::{negotiate, ChildCaps, EngineOptions};
use kvconnect_api::{KvTransferConfig, ModelSpec};
use kvconnect_server::sidechannel::{read_frame, Message};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use std::time::Duration;

const MODEL: &str = include_str!("../../fixtures/models/kvconnect--reference/config.json");

fn local() -> &'static CompatDescriptor {
    static LOCAL: OnceLock<CompatDescriptor> = OnceLock::new();
    LOCAL.get_or_init(|| {
        let model = ModelSpec::from_hf_config_json(MODEL).expect("fixture model");
        let cfg = KvTransferConfig::named("nixl");
        let caps = vec![ChildCaps {
            name: "nixl".into(),
            version: "0.1.0".into(),
            caps: kvconnect_nixl::caps::capabilities(&cfg, Some(&model)).expect("nixl caps"),
        }];
        let opts = EngineOptions::default();
        let n = negotiate(&model, &opts, &caps).expect("negotiation");
        CompatDescriptor::new(&model, &n, &opts)
    })
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime"))
}

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    let got = runtime().block_on(read_frame(&mut r, 1 << 20, Duration::from_secs(1), "fuzz"));
    if let Ok(Some(Message::Hello { compat, .. })) = got {
        let _ = check_roles(local(), &compat);
        let _ = check_roles(&compat, local());
    }
});
