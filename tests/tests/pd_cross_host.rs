//! Prefill and decode on different "hosts": `kvconnect worker` processes in their own network
//! namespaces, joined by a veth link, moving KV over the tcp backend with the deployment's
//! secret. A P/D request equals the monolithic output; a link cut in the middle of a transfer
//! makes decode apply its kv_load_failure_policy (counted, never a silent success) and prefill
//! free the blocks at lease expiry; a third namespace, routed to prefill but without the secret,
//! reads nothing from its producer listener or its side channel, and is counted. With feature
//! `nixl`, the same three over backend nixl (NIXL over UCX, TCP only).
//!
//! Needs root and iproute2 (`ip netns`, `tc`); skips with the reason otherwise.

use kvconnect_api::KvLayout;
use kvconnect_dataplane::auth::Secret;
use kvconnect_nixl::wire::{authenticate_client, read_frame, write_frame, ClientMsg, ServerMsg};
use kvconnect_server::sidechannel::Message;
use kvconnect_tests::netns::{self, link, Netns};
use kvconnect_tests::{
    closed_by_peer, kvconnect_bin, metrics, monolithic, reference_model, side_channel, token_ids,
    varied_prompts, wait_until, Worker,
};
use serde_json::{json, Value};
use std::net::TcpStream;
use std::time::Duration;

const SECRET: &str = "cross-host-deployment-secret-0123456789abcdef";
/// Prefill's address on the prefill–decode link, where its side channel and producer listen.
const PREFILL_IP: &str = "10.77.1.1";
const DECODE_IP: &str = "10.77.1.2";
/// The outsider's link to prefill's host.
const PREFILL_OUTSIDE_IP: &str = "10.77.2.1";
const OUTSIDER_IP: &str = "10.77.2.2";
const SIDE_CHANNEL_PORT: u16 = 7500;
const PRODUCER_PORT: u16 = 7400;
/// Prefill's end of the link to decode (what the cut takes down and the rate limit shapes).
const PREFILL_IF: &str = "to-decode";
const MAX_TOKENS: usize = 4;

/// Three hosts: prefill, decode linked to it, and an outsider routed to prefill's addresses.
struct Hosts {
    prefill: Netns,
    decode: Netns,
    outsider: Netns,
}

fn hosts(tag: &str) -> Option<Hosts> {
    if let Some(why) = netns::unavailable() {
        eprintln!("skipping the cross-host tests: {why}");
        return None;
    }
    let h = Hosts {
        prefill: Netns::new(&format!("{tag}-p")),
        decode: Netns::new(&format!("{tag}-d")),
        outsider: Netns::new(&format!("{tag}-x")),
    };
    link(
        &h.prefill,
        PREFILL_IF,
        &format!("{PREFILL_IP}/24"),
        &h.decode,
        "to-prefill",
        &format!("{DECODE_IP}/24"),
    );
    link(
        &h.prefill,
        "to-outsider",
        &format!("{PREFILL_OUTSIDE_IP}/24"),
        &h.outsider,
        "to-prefill",
        &format!("{OUTSIDER_IP}/24"),
    );
    h.outsider.ip(&["route", "add", "default", "via", PREFILL_OUTSIDE_IP]);
    Some(h)
}

fn config(backend: &str, role: &str, top: &str, extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"{role}"{top},"kv_connector_extra_config":{{"backend":"{backend}"{extra}}}}}"#
    )
}

/// Starts a worker in `ns`; UCX (backend nixl) uses the namespace's link `device` alone: with
/// every interface offered (prefill has two links), it may pick an address the peer cannot
/// reach and fail the handshake with "Destination is unreachable".
fn start(ns: &Netns, device: &str, config: &str, engine: &str, more: &[&str], secret: bool) -> Worker {
    let model = reference_model();
    let mut args =
        vec!["--kv-transfer-config", config, "--model", model.to_str().unwrap(), "--engine-id", engine];
    args.extend_from_slice(more);
    // UCX (backend nixl) over TCP only, so its bytes cross the link rather than shared memory.
    let mut env = vec![("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", device)];
    if secret {
        env.push(("KVCONNECT_SIDE_CHANNEL_TOKEN", SECRET));
    }
    Worker::start_command(ns.command(&kvconnect_bin()), &args, &env)
}

/// Prefill in its namespace: side channel and producer listener on the link's address, HTTP on
/// its loopback (the test reaches it from a thread in the namespace).
/// Its io_timeout, which also bounds how long one read's answer may take to send, is long
/// enough for the slow link: only the cut, not prefill's own deadline, can end a transfer.
fn prefill_worker(h: &Hosts, backend: &str, engine: &str, lease_s: u32) -> Worker {
    let config = config(
        backend,
        "kv_producer",
        "",
        &format!(
            r#","host":"{PREFILL_IP}","port":{PRODUCER_PORT},"kv_lease_duration":{lease_s},"io_timeout":20"#
        ),
    );
    let sc_port = SIDE_CHANNEL_PORT.to_string();
    start(
        &h.prefill,
        PREFILL_IF,
        &config,
        engine,
        &["--side-channel-host", PREFILL_IP, "--side-channel-port", &sc_port],
        true,
    )
}

/// Decode in `ns`, allowed to load from `prefill_engine`. Its io_timeout (3 s) also bounds a
/// NIXL READ, with the bytes at 100 MB/s on top: over a shaped link NIXL needs more
/// ([`decode_worker_within`]).
fn decode_worker(ns: &Netns, backend: &str, prefill_engine: &str, policy: &str, secret: bool) -> Worker {
    decode_worker_within(ns, backend, prefill_engine, policy, secret, 3)
}

fn decode_worker_within(
    ns: &Netns,
    backend: &str,
    prefill_engine: &str,
    policy: &str,
    secret: bool,
    io_timeout_s: u32,
) -> Worker {
    let config = config(
        backend,
        "kv_consumer",
        &format!(r#","kv_load_failure_policy":"{policy}""#),
        &format!(r#","io_timeout":{io_timeout_s}"#),
    );
    let producers = format!("{prefill_engine}@{PREFILL_IP}:{SIDE_CHANNEL_PORT}");
    start(
        ns,
        "to-prefill",
        &config,
        &format!("{prefill_engine}-decode"),
        &["--kv-producers", &producers],
        secret,
    )
}

fn prefill_one(h: &Hosts, w: &Worker, prompt: &[u32]) -> Value {
    let (st, p) = h.prefill.run(|| {
        w.post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
        )
    });
    assert_eq!(st, 200, "{p}\n{}", w.log());
    assert_eq!(p["kv_transfer_params"]["remote_host"], PREFILL_IP, "{p}");
    p
}

fn decode_one(ns: &Netns, w: &Worker, prompt: &[u32], p: &Value) -> (u16, Value) {
    ns.run(|| {
        w.post(
            "/v1/completions",
            &json!({"request_id": p["id"], "prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": p["kv_transfer_params"]}),
        )
    })
}

/// A metric whose name starts with `name` and carries every label in `labels`; 0 when absent.
fn metric(ns: &Netns, w: &Worker, name: &str, labels: &[&str]) -> f64 {
    ns.run(|| metrics(&w.http))
        .iter()
        .find(|(k, _)| k.starts_with(name) && labels.iter().all(|l| k.contains(l)))
        .map(|(_, v)| *v)
        .unwrap_or(0.0)
}

fn pool(ns: &Netns, w: &Worker) -> Value {
    let (st, h) = ns.run(|| w.get("/health"));
    assert_eq!(st, 200, "{h}");
    h["pool"].clone()
}

fn all_free(ns: &Netns, w: &Worker) -> bool {
    let p = pool(ns, w);
    p["free_blocks"] == p["total_blocks"] && p["pending_frees"] == 0
}

/// Prompts of several lengths through prefill and decode across the link, each output equal
/// to the monolithic one with every prompt token but the last loaded; then prefill's blocks
/// are all free. Returns the prompts and their monolithic outputs.
fn pd_equals_monolithic(h: &Hosts, prefill: &Worker, decode: &Worker) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let prompts: Vec<Vec<u32>> = varied_prompts(25).into_iter().skip(18).collect();
    let mono = monolithic(&prompts, MAX_TOKENS, KvLayout::HND);
    for (prompt, want) in prompts.iter().zip(&mono) {
        let p = prefill_one(h, prefill, prompt);
        let (st, d) = decode_one(&h.decode, decode, prompt, &p);
        assert_eq!(st, 200, "{d}\n{}", decode.log());
        let got: Vec<u32> = token_ids(&d).into_iter().map(|t| t as u32).collect();
        assert_eq!(&got, want, "prompt of {} tokens: disaggregated across hosts != monolithic", prompt.len());
        assert_eq!(d["kvconnect"]["num_external_tokens"].as_u64(), Some(prompt.len() as u64 - 1), "{d}");
    }
    assert!(
        wait_until(Duration::from_secs(30), || all_free(&h.prefill, prefill)),
        "{}",
        pool(&h.prefill, prefill)
    );
    (prompts, mono)
}

/// Whether backend nixl can run here (the NIXL library found); says why not otherwise.
#[cfg(feature = "nixl")]
fn nixl_here() -> bool {
    match kvconnect_nixl::nixl_lib::find() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipping backend nixl across hosts: {e}");
            false
        }
    }
}

#[cfg(feature = "nixl")]
#[test]
fn pd_across_hosts_over_nixl_ucx_equals_monolithic_and_an_outsider_without_the_secret_reads_nothing() {
    if !nixl_here() {
        return;
    }
    let Some(h) = hosts("nixl") else { return };
    let prefill = prefill_worker(&h, "nixl", "prefill-xn", 30);
    let decode = decode_worker(&h.decode, "nixl", "prefill-xn", "fail", true);
    let (prompts, mono) = pd_equals_monolithic(&h, &prefill, &decode);
    an_outsider_without_the_secret_reads_nothing(&h, "nixl", &prefill, &decode, &prompts[0], &mono[0]);
}

#[test]
fn pd_across_hosts_equals_monolithic_and_an_outsider_without_the_secret_reads_nothing() {
    let Some(h) = hosts("eq") else { return };
    let prefill = prefill_worker(&h, "tcp", "prefill-xh", 30);
    let decode = decode_worker(&h.decode, "tcp", "prefill-xh", "fail", true);
    // (a) P/D across the link equals the monolithic output, every prompt token loaded.
    let (prompts, mono) = pd_equals_monolithic(&h, &prefill, &decode);
    an_outsider_without_the_secret_reads_nothing(&h, "tcp", &prefill, &decode, &prompts[0], &mono[0]);
}

/// The outsider holds a request's whole kv_transfer_params (capability included) but not the
/// secret: its reads on prefill's producer listener and its hellos on the side channel are
/// refused and counted, a decode worker of `backend` on its host loads nothing, and the
/// request is then served whole to the real decode (`want` its monolithic output).
fn an_outsider_without_the_secret_reads_nothing(
    h: &Hosts,
    backend: &str,
    prefill: &Worker,
    decode: &Worker,
    prompt: &[u32],
    want: &[u32],
) {
    let p = prefill_one(h, prefill, prompt);
    let params = p["kv_transfer_params"].clone();
    let capability = params["remote_capability"].as_str().expect("capability").to_owned();
    let request = p["id"].as_str().expect("id").to_owned();
    let producer = format!("{PREFILL_IP}:{PRODUCER_PORT}");
    let side_channel_addr = format!("{PREFILL_IP}:{SIDE_CHANNEL_PORT}");
    let consumer = config(backend, "kv_consumer", r#","kv_load_failure_policy":"fail""#, "");
    let compat = side_channel::descriptor(&consumer, &reference_model());
    h.outsider.run(|| {
        // The producer listener: a Read with the right capability but no proof of the secret.
        let mut c = TcpStream::connect(&producer).expect("the outsider reaches the producer listener");
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let m: ServerMsg = read_frame(&mut c, 1 << 20).unwrap();
        assert!(matches!(m, ServerMsg::Challenge { .. }), "{m:?}");
        let read = ClientMsg::Read {
            request: request.clone(),
            capability: capability.clone(),
            runs: vec![(0, 0, 64)],
        };
        write_frame(&mut c, &read).unwrap();
        let m: ServerMsg = read_frame(&mut c, 1 << 20).unwrap();
        assert!(matches!(&m, ServerMsg::Error { reason } if reason.contains("data-plane secret")), "{m:?}");
        assert!(closed_by_peer(&mut c));
        // A guessed secret.
        let mut c = TcpStream::connect(&producer).unwrap();
        let guess = Secret::from_text("a-guessed-secret-that-is-long-enough", "test").unwrap();
        let e = authenticate_client(&mut c, Some(&guess), 1 << 20).unwrap_err().to_string();
        assert!(e.contains("proof of the data-plane secret is wrong"), "{e}");
        // The side channel: a hello of a compatible decode, without the proof.
        let (mut c, _) = side_channel::challenged(&side_channel_addr);
        std::io::Write::write_all(&mut c, &side_channel::hello(&compat, "outsider", None)).unwrap();
        let answer = side_channel::read_message(&mut c);
        assert!(
            matches!(&answer, Some(Message::Refused { message, .. }) if message.starts_with("unauthenticated")),
            "{answer:?}"
        );
        assert!(closed_by_peer(&mut c));
    });
    // A real decode worker on the outsider's host, allowed to load from prefill but without
    // the secret: its handshake is refused, nothing is loaded.
    let engine = p["kv_transfer_params"]["remote_engine_id"].as_str().expect("remote_engine_id").to_owned();
    let stranger = decode_worker(&h.outsider, backend, &engine, "fail", false);
    let (st, d) = decode_one(&h.outsider, &stranger, prompt, &p);
    assert_eq!(st, 502, "{d}\n{}", stranger.log());
    assert!(d["kvconnect"]["num_external_tokens"].is_null(), "{d}");
    assert_eq!(
        metric(&h.outsider, &stranger, "kvconnect_kv_load_failures", &["reason=\"unauthenticated\""]),
        1.0
    );

    let refused = |listener: &str, reason: &str| {
        let (l, r) = (format!("listener=\"{listener}\""), format!("reason=\"{reason}\""));
        metric(&h.prefill, prefill, "kvconnect_data_plane_refused", &[&l, &r])
    };
    assert_eq!(refused("producer", "unauthenticated"), 2.0);
    // The hand-written hello carried no proof; the stranger's proves no secret.
    assert_eq!(refused("side_channel", "unauthenticated"), 1.0);
    assert_eq!(refused("side_channel", "wrong_secret"), 1.0);
    let sc = h.prefill.run(|| prefill.get("/health")).1["side_channel"].clone();
    assert_eq!(sc["welcomed"], 1, "only the real decode was welcomed: {sc}");

    // Nothing was read or freed: the request is still held, and its decode gets all of it.
    assert_eq!(pool(&h.prefill, prefill)["pending_frees"], 1);
    let (st, d) = decode_one(&h.decode, decode, prompt, &p);
    assert_eq!(st, 200, "{d}");
    assert_eq!(d["kvconnect"]["num_external_tokens"].as_u64(), Some(prompt.len() as u64 - 1), "{d}");
    let got: Vec<u32> = token_ids(&d).into_iter().map(|t| t as u32).collect();
    assert_eq!(got, want);
}

#[test]
fn a_link_cut_mid_transfer_applies_decodes_policy_and_prefill_frees_by_lease() {
    let Some(h) = hosts("cut") else { return };
    link_cut_mid_transfer(&h, "tcp", 3);
}

#[cfg(feature = "nixl")]
#[test]
fn a_link_cut_mid_transfer_over_nixl_ucx_applies_decodes_policy_and_prefill_frees_by_lease() {
    if !nixl_here() {
        return;
    }
    let Some(h) = hosts("ncut") else { return };
    // A NIXL READ must be whole within decode's io_timeout plus its bytes at 100 MB/s: the
    // uncut transfer over the shaped link takes about 10 s.
    link_cut_mid_transfer(&h, "nixl", 40);
}

/// Over `backend`, a long prompt's KV crosses a 1 Mbit/s link whole, then the link is cut in
/// the middle of the same transfer: decode (io_timeout `decode_io_timeout_s`) recomputes,
/// counted, and prefill frees the blocks when their lease runs out.
fn link_cut_mid_transfer(h: &Hosts, backend: &str, decode_io_timeout_s: u32) {
    // The lease outlasts the bytes that sit in socket buffers and the shaped queue after
    // prefill's last write (the consumer's done comes once they have crossed).
    let engine = format!("prefill-cut-{backend}");
    let prefill = prefill_worker(h, backend, &engine, 15);
    let decode = decode_worker_within(&h.decode, backend, &engine, "recompute", true, decode_io_timeout_s);
    // A long prompt over a slow link (1 Mbit/s): its KV takes seconds to cross, so the cut
    // lands inside the transfer.
    let prompt: Vec<u32> = (0..2000u32).map(|j| (j * 29 + j * j * 7) % 256).collect();
    let want = monolithic(std::slice::from_ref(&prompt), MAX_TOKENS, KvLayout::HND).remove(0);
    let shape = [
        "qdisc", "add", "dev", PREFILL_IF, "root", "tbf", "rate", "1mbit", "burst", "16kbit", "latency", "2s",
    ];
    let tc = h.prefill.command(std::path::Path::new("tc")).args(shape).output().expect("run tc");
    assert!(tc.status.success(), "tc {}: {}", shape.join(" "), String::from_utf8_lossy(&tc.stderr));

    // Uncut, the slow link carries the whole KV: what fails next is the cut's doing.
    let p = prefill_one(h, &prefill, &prompt);
    let sent_before = h.prefill.stat(PREFILL_IF, "tx_bytes");
    let (st, d) = decode_one(&h.decode, &decode, &prompt, &p);
    assert_eq!(st, 200, "{d}\n{}", decode.log());
    assert_eq!(
        d["kvconnect"]["num_external_tokens"].as_u64(),
        Some(prompt.len() as u64 - 1),
        "{d}\n{}\n{}",
        decode.log(),
        prefill.log()
    );
    let kv_bytes = h.prefill.stat(PREFILL_IF, "tx_bytes") - sent_before;
    let got: Vec<u32> = token_ids(&d).into_iter().map(|t| t as u32).collect();
    assert_eq!(got, want, "disaggregated over the slow link != monolithic");
    assert!(
        wait_until(Duration::from_secs(30), || all_free(&h.prefill, &prefill)),
        "{}",
        pool(&h.prefill, &prefill)
    );

    let p = prefill_one(h, &prefill, &prompt);
    let held = pool(&h.prefill, &prefill);
    assert_eq!(held["pending_frees"], 1, "{held}");
    let sent_before = h.prefill.stat(PREFILL_IF, "tx_bytes");
    std::thread::scope(|s| {
        let load = s.spawn(|| decode_one(&h.decode, &decode, &prompt, &p));
        // Cut once a good part of the first read has gone out.
        assert!(
            wait_until(Duration::from_secs(120), || h.prefill.stat(PREFILL_IF, "tx_bytes")
                > sent_before + 64 * 1024),
            "the transfer never started: {}",
            decode.log()
        );
        h.decode.ip(&["link", "set", "to-prefill", "down"]);
        let sent = h.prefill.stat(PREFILL_IF, "tx_bytes") - sent_before;
        eprintln!("link cut after {sent} of the {kv_bytes} bytes an uncut transfer sent");
        assert!(sent < kv_bytes / 2, "the cut came late: {sent} of {kv_bytes} bytes were sent");

        // Decode: the load fails, policy recompute computes the prompt here; counted.
        let (st, d) = load.join().expect("decode request");
        assert_eq!(st, 200, "{d}\n{}", decode.log());
        let got: Vec<u32> = token_ids(&d).into_iter().map(|t| t as u32).collect();
        assert_eq!(got, want, "recomputed output != monolithic");
        assert_eq!(d["kvconnect"]["num_external_tokens"].as_u64(), Some(0), "{d}");
    });
    assert_eq!(metric(&h.decode, &decode, "kvconnect_kv_load_failures", &["reason=\"load_failed\""]), 1.0);
    assert_eq!(metric(&h.decode, &decode, "kvconnect_kv_recomputed_requests", &[]), 1.0);
    // Prefill: no consumer said done; once its send gives up (io_timeout), the lease frees
    // the blocks.
    assert!(
        wait_until(Duration::from_secs(120), || all_free(&h.prefill, &prefill)),
        "prefill's blocks were never freed: {}\n{}",
        pool(&h.prefill, &prefill),
        prefill.log()
    );
    assert!(prefill.log().contains("within its lease; freeing its blocks"), "{}", prefill.log());
}
