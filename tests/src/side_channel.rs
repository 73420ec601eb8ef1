//! A side-channel peer written out by hand, as a client on the network would speak to a
//! worker's side channel (`kvconnect_server::sidechannel`): blocking sockets, the frames and the
//! proof of the secret built here, so a test can send what a real decode worker never would
//! (no proof, a wrong one, hellos it never reads the answers to).

use kvconnect_api::compat::CompatDescriptor;
use kvconnect_api::negotiate::EngineOptions;
use kvconnect_api::{KvTransferConfig, ModelSpec};
use kvconnect_dataplane::auth::{self, Secret, Side};
use kvconnect_server::sidechannel::{HelloAuth, Message, CHANNEL, PROTOCOL_VERSION};
use kvconnect_support::frame;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

/// The descriptor a worker of `config` (a kv-transfer-config's JSON) on `model` sends with
/// default flags, as its `hello` carries it.
pub fn descriptor(config: &str, model: &Path) -> CompatDescriptor {
    let model = std::fs::read_to_string(model).expect("read the model's config.json");
    let model = ModelSpec::from_hf_config_json(&model).expect("model config");
    let config = KvTransferConfig::from_json(config).expect("kv-transfer-config");
    let registry = kvconnect_registry::Registry::builtins_only();
    kvconnect_deployment::negotiate_worker(&registry, &config, &model, &EngineOptions::default(), "decode")
        .expect("negotiate")
        .1
}

/// `body` as one frame: its length as a big-endian u32, then the bytes.
pub fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// Reads one message (at most 1 MiB); `None` once the connection is closed or failed.
pub fn read_message(c: &mut TcpStream) -> Option<Message> {
    let mut len = [0u8; frame::HEADER_LEN];
    c.read_exact(&mut len).ok()?;
    let n = frame::body_len(len, 1 << 20).ok()?;
    let mut body = vec![0u8; n];
    c.read_exact(&mut body).ok()?;
    frame::decode(&body).ok()
}

/// A connection to the side channel at `addr` whose challenge was read; its nonce.
pub fn challenged(addr: &str) -> (TcpStream, String) {
    let mut c = TcpStream::connect(addr).expect("connect to the side channel");
    c.set_read_timeout(Some(Duration::from_secs(20))).expect("read timeout");
    match read_message(&mut c) {
        Some(Message::Challenge { nonce }) => (c, nonce),
        other => panic!("the side channel at {addr} opened with {other:?}, not a challenge"),
    }
}

/// A `hello` of `engine` with descriptor `compat`, as a frame. `proof`: the server's nonce and
/// the secret to prove (`None` as the secret proves none), or no proof at all.
pub fn hello(compat: &CompatDescriptor, engine: &str, proof: Option<(&str, Option<&Secret>)>) -> Vec<u8> {
    let client_nonce = "5eed".repeat(8);
    let auth = proof.map(|(server_nonce, secret)| HelloAuth {
        proof: auth::proof(secret, CHANNEL, Side::Client, server_nonce, &client_nonce),
        nonce: client_nonce.clone(),
    });
    let m = Message::Hello {
        version: Some(PROTOCOL_VERSION),
        compat: compat.clone(),
        engine_id: engine.to_owned(),
        auth,
    };
    frame::encode(&m).expect("encode a hello")
}

/// One whole handshake with the side channel at `addr` proving `secret`: the answer.
pub fn handshake(addr: &str, compat: &CompatDescriptor, secret: Option<&Secret>) -> Option<Message> {
    let (mut c, nonce) = challenged(addr);
    c.write_all(&hello(compat, "side-channel-client", Some((&nonce, secret)))).ok()?;
    read_message(&mut c)
}
