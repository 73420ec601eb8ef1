//! Abuse of a live prefill worker's data plane, as a peer on the network would try it: on its
//! producer listener and its side channel, requests without the deployment's secret or with a
//! wrong one, a wrong capability and one replayed from another request, garbage, oversized
//! and truncated frames, a flood of connections and a frame dripped a byte at a time. Each is
//! refused and counted in /metrics, no block is read or freed, and the worker then serves a
//! normal P/D request. And a decode request whose `kv_transfer_params` point outside the
//! decode worker's allow-list is refused without any connection being made.

use kvconnect_api::BlockId;
use kvconnect_dataplane::auth::Secret;
use kvconnect_nixl::wire::{authenticate_client, read_frame, write_frame, ClientMsg, ServerMsg};
use kvconnect_server::sidechannel::Message;
use kvconnect_tests::{
    closed_by_peer, metrics, prefill_for_remote_decode, reference_model, reference_worker_with_secret,
    side_channel, varied_prompts, Worker,
};
use serde_json::json;
use side_channel::frame;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

const SECRET: &str = "abuse-suite-deployment-secret-0123456789";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn nixl(role: &str, extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","kv_connector_extra_config":{{"backend":"tcp","io_timeout":2{extra}}}}}"#
    )
}

fn worker(config: &str, id: &str, more: &[&str]) -> Worker {
    reference_worker_with_secret(config, id, more, SECRET)
}

/// A connection whose first frame (the challenge) was read.
fn challenged(addr: &str) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let m: ServerMsg = read_frame(&mut c, 1 << 20).unwrap();
    assert!(matches!(m, ServerMsg::Challenge { .. }), "{m:?}");
    c
}

fn authed(addr: &str) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    authenticate_client(&mut c, Some(&Secret::from_text(SECRET, "test").unwrap()), 1 << 20).unwrap();
    c
}

fn ask(c: &mut TcpStream, m: &ClientMsg) -> ServerMsg {
    write_frame(c, m).unwrap();
    read_frame(c, 1 << 20).unwrap()
}

fn refused_with(m: &ServerMsg, needle: &str) -> bool {
    matches!(m, ServerMsg::Error { reason } if reason.contains(needle))
}

/// The value of the metric whose name starts with `name` and carries every label in `labels`.
fn metric(w: &Worker, name: &str, labels: &[&str]) -> f64 {
    let m = metrics(&w.http);
    m.iter()
        .find(|(k, _)| k.starts_with(name) && labels.iter().all(|l| k.contains(l)))
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("{name} {labels:?} missing from /metrics: {m:#?}"))
}

fn refused(w: &Worker, listener: &str, reason: &str) -> f64 {
    let (l, r) = (format!("listener=\"{listener}\""), format!("reason=\"{reason}\""));
    metric(w, "kvconnect_data_plane_refused", &[&l, &r])
}

/// Writes `bytes` one every `gap`; true when the peer cut the connection within `limit`.
fn drip(c: &mut TcpStream, bytes: &[u8], gap: Duration, limit: Duration) -> bool {
    let t0 = Instant::now();
    for b in bytes {
        if c.write_all(&[*b]).is_err() {
            return t0.elapsed() < limit;
        }
        std::thread::sleep(gap);
        if t0.elapsed() > limit {
            return false;
        }
    }
    closed_by_peer(c) && t0.elapsed() < limit
}

#[test]
fn a_live_prefill_worker_refuses_and_counts_abuse_then_serves_normally() {
    let port = free_port();
    let prefill = worker(
        &nixl("kv_producer", &format!(r#","port":{port},"max_connections":8"#)),
        "prefill-abuse",
        &["--side-channel-timeout", "2", "--side-channel-max-connections", "4"],
    );
    let decode =
        worker(&nixl("kv_consumer", ""), "decode-abuse", &["--kv-producers", "prefill-abuse@127.0.0.1"]);
    let producer = format!("127.0.0.1:{port}");
    let sc = prefill.side_channel.clone().expect("side channel");
    let prompts = varied_prompts(30);
    let (pa, pb) = (&prompts[26], &prompts[27]);
    let a = prefill_for_remote_decode(&prefill, pa);
    let b = prefill_for_remote_decode(&prefill, pb);
    let (id_a, id_b) = (a["id"].as_str().unwrap().to_owned(), b["id"].as_str().unwrap().to_owned());
    let cap_b = b["kv_transfer_params"]["remote_capability"].as_str().unwrap().to_owned();
    assert_eq!(cap_b.len(), 32, "{b}");
    let held = |w: &Worker| w.get("/health").1["pool"]["pending_frees"].as_u64().unwrap();
    assert_eq!(held(&prefill), 2);
    let runs = vec![(0u32, 0u64, 64u64)];

    // Producer listener: no proof, then a wrong one.
    let mut c = challenged(&producer);
    let read_a = |capability: &str| ClientMsg::Read {
        request: id_a.clone(),
        capability: capability.into(),
        runs: runs.clone(),
    };
    assert!(refused_with(&ask(&mut c, &read_a(&cap_b)), "data-plane secret"));
    assert!(closed_by_peer(&mut c));
    for m in [
        ClientMsg::Hold { request: id_a.clone(), capability: cap_b.clone() },
        ClientMsg::Done { request: id_a.clone(), capability: cap_b.clone() },
    ] {
        let mut c = challenged(&producer);
        assert!(refused_with(&ask(&mut c, &m), "data-plane secret"), "{m:?}");
    }
    let mut c = TcpStream::connect(&producer).unwrap();
    let wrong = Secret::from_text("not-the-deployment-secret-at-all", "test").unwrap();
    let e = authenticate_client(&mut c, Some(&wrong), 1 << 20).unwrap_err().to_string();
    assert!(e.contains("proof of the data-plane secret is wrong"), "{e}");
    assert_eq!(refused(&prefill, "producer", "unauthenticated"), 4.0);

    // Authenticated, but a guessed capability and B's capability replayed on A, on every op.
    let mut c = authed(&producer);
    for cap in ["00000000000000000000000000000000", cap_b.as_str()] {
        for m in [
            ClientMsg::Hold { request: id_a.clone(), capability: cap.into() },
            ClientMsg::Pin { request: id_a.clone(), capability: cap.into(), blocks: vec![vec![BlockId(0)]] },
            read_a(cap),
            ClientMsg::Done { request: id_a.clone(), capability: cap.into() },
        ] {
            assert!(refused_with(&ask(&mut c, &m), "capability does not match"), "{m:?}");
        }
    }
    assert_eq!(refused(&prefill, "producer", "bad_capability"), 8.0);
    drop(c);

    // Garbage, oversized and truncated frames, before and after the proof.
    for mut c in [challenged(&producer), authed(&producer)] {
        c.write_all(&frame(b"\x00\x01 not a message")).unwrap();
        assert!(closed_by_peer(&mut c));
    }
    for mut c in [challenged(&producer), authed(&producer)] {
        c.write_all(&(512u32 << 20).to_be_bytes()).unwrap();
        assert!(closed_by_peer(&mut c));
    }
    let mut c = authed(&producer);
    let whole = frame(br#"{"op":"hold","request":"x","capability":"y"}"#);
    c.write_all(&whole[..whole.len() / 2]).unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(closed_by_peer(&mut c));
    assert_eq!(refused(&prefill, "producer", "malformed"), 2.0);
    assert_eq!(refused(&prefill, "producer", "oversized"), 2.0);
    assert_eq!(refused(&prefill, "producer", "truncated"), 1.0);

    // A frame dripped a byte every 300 ms: cut at the 2 s frame deadline.
    let mut c = authed(&producer);
    assert!(drip(&mut c, &whole, Duration::from_millis(300), Duration::from_secs(10)), "drip not cut");
    assert!(refused(&prefill, "producer", "timeout") >= 1.0);
    drop(c);
    std::thread::sleep(Duration::from_millis(300));

    // A flood of connections: past the cap of 8, refused at once.
    let flood: Vec<TcpStream> = (0..8).map(|_| challenged(&producer)).collect();
    let mut extra = TcpStream::connect(&producer).unwrap();
    extra.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let m: ServerMsg = read_frame(&mut extra, 1 << 20).unwrap();
    assert!(refused_with(&m, "at most 8 connections"), "{m:?}");
    assert!(refused(&prefill, "producer", "too_many_connections") >= 1.0);
    drop(flood);

    // Side channel: a hello without any proof, one proving another secret, garbage,
    // oversized, truncated, a drip, and a flood past its cap of 4; each refused by reason.
    let sc_refused = |reason: &str| refused(&prefill, "side_channel", reason);
    let compat = side_channel::descriptor(&nixl("kv_consumer", ""), &reference_model());
    let (mut c, _) = side_channel::challenged(&sc);
    c.write_all(&side_channel::hello(&compat, "intruder", None)).unwrap();
    let answer = side_channel::read_message(&mut c);
    assert!(
        matches!(&answer, Some(Message::Refused { message, .. }) if message.starts_with("unauthenticated")),
        "{answer:?}"
    );
    assert!(closed_by_peer(&mut c));
    let out = side_channel::handshake(&sc, &compat, Some(&wrong));
    assert!(
        matches!(&out, Some(Message::Refused { message, .. }) if message.contains("did not get a valid proof")),
        "{out:?}"
    );
    assert_eq!(sc_refused("unauthenticated"), 1.0);
    assert_eq!(sc_refused("wrong_secret"), 1.0);
    let (mut c, _) = side_channel::challenged(&sc);
    c.write_all(&frame(b"garbage!")).unwrap();
    assert!(closed_by_peer(&mut c));
    let (mut c, _) = side_channel::challenged(&sc);
    c.write_all(&u32::MAX.to_be_bytes()).unwrap();
    assert!(closed_by_peer(&mut c));
    let (mut c, _) = side_channel::challenged(&sc);
    c.write_all(&whole[..5]).unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(closed_by_peer(&mut c));
    assert_eq!(sc_refused("malformed"), 1.0);
    assert_eq!(sc_refused("oversized"), 1.0);
    assert_eq!(sc_refused("truncated"), 1.0);
    // A byte every 300 ms: cut at the 2 s frame deadline (--side-channel-timeout).
    let (mut c, _) = side_channel::challenged(&sc);
    let t0 = Instant::now();
    assert!(drip(&mut c, &frame(&[b' '; 200]), Duration::from_millis(300), Duration::from_secs(10)));
    assert!(t0.elapsed() >= Duration::from_secs(2), "cut before its deadline: {:?}", t0.elapsed());
    assert_eq!(sc_refused("timeout"), 1.0);
    let flood: Vec<_> = (0..4).map(|_| side_channel::challenged(&sc)).collect();
    let mut extra = TcpStream::connect(&sc).unwrap();
    extra.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert!(side_channel::read_message(&mut extra).is_none(), "a connection past the cap got a challenge");
    assert_eq!(sc_refused("too_many_connections"), 1.0);
    drop(flood);
    let h = prefill.get("/health").1;
    assert_eq!(h["side_channel"]["welcomed"], 0, "{h}");
    assert_eq!(h["side_channel"]["dropped"], 4, "{h}");
    assert_eq!(metric(&prefill, "kvconnect_side_channel_dropped", &[]), 4.0);

    // Nothing was read or freed: both requests are still held, and A is served to its decode.
    assert_eq!(held(&prefill), 2);
    let (st, d) = decode.post(
        "/v1/completions",
        &json!({"request_id": a["id"], "prompt": pa, "max_tokens": 3, "kv_transfer_params": a["kv_transfer_params"]}),
    );
    assert_eq!(st, 200, "{d}\n{}", decode.log());
    assert_eq!(d["kvconnect"]["num_external_tokens"].as_u64(), Some(pa.len() as u64 - 1), "{d}");
    let (st, d) = decode.post(
        "/v1/completions",
        &json!({"request_id": b["id"], "prompt": pb, "max_tokens": 3, "kv_transfer_params": b["kv_transfer_params"]}),
    );
    assert_eq!(st, 200, "{d}");
    assert_eq!(d["kvconnect"]["num_external_tokens"].as_u64(), Some(pb.len() as u64 - 1), "{d}");
    let _ = id_b;
}

#[test]
fn decode_refuses_params_pointing_outside_its_allow_list_without_connecting() {
    let prefill = worker(&nixl("kv_producer", ""), "prefill-allowed", &[]);
    let sc = prefill.side_channel.clone().expect("side channel");
    let sc_port: u16 = sc.rsplit_once(':').unwrap().1.parse().unwrap();
    let decode = worker(
        &nixl("kv_consumer", "").replacen('{', r#"{"kv_load_failure_policy":"fail","#, 1),
        "decode-allow",
        &["--kv-producers", &format!("prefill-allowed@127.0.0.1:{sc_port}")],
    );
    // A listener the params point at instead: it must never see a connection.
    let trap = TcpListener::bind("127.0.0.2:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let trap_port = trap.local_addr().unwrap().port();
    let prompt = &varied_prompts(30)[26];
    let p = prefill_for_remote_decode(&prefill, prompt);
    // A host name is refused as a bad request before the allow-list is asked: nothing from a
    // client is resolved.
    for (engine, host, port, status, says) in [
        ("prefill-allowed", "127.0.0.2", trap_port, 502, "nothing was contacted"),
        ("someone-else", "127.0.0.1", sc_port, 502, "nothing was contacted"),
        ("prefill-allowed", "localhost", sc_port, 400, "is not an IP address"),
    ] {
        let mut params = p["kv_transfer_params"].clone();
        params["remote_engine_id"] = json!(engine);
        params["remote_host"] = json!(host);
        params["remote_port"] = json!(port);
        let (st, d) = decode.post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}),
        );
        assert_eq!(st, status, "{engine}@{host}:{port}: {d}");
        let msg = d["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(says), "{msg}");
    }
    assert!(
        matches!(trap.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "decode connected"
    );
    assert_eq!(metric(&decode, "kvconnect_kv_load_failures", &["reason=\"producer_not_allowed\""]), 2.0);
    assert_eq!(prefill.get("/health").1["side_channel"]["welcomed"], 0, "no handshake was made");
    // The listed producer is served.
    let (st, d) = decode.post(
        "/v1/completions",
        &json!({"request_id": p["id"], "prompt": prompt, "max_tokens": 2, "kv_transfer_params": p["kv_transfer_params"]}),
    );
    assert_eq!(st, 200, "{d}");
    assert_eq!(d["kvconnect"]["num_external_tokens"].as_u64(), Some(prompt.len() as u64 - 1), "{d}");
}
