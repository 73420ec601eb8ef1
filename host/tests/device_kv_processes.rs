//! Device KV across processes: a prefill and a decode `kvconnect worker`, both with
//! `kv_buffer_device = "cuda"` and the nixl connector's cuda_ipc backend, so decode opens
//! prefill's CUDA IPC handles and copies each request with one gather kernel. Outputs must
//! equal a monolithic engine's token for token, every decode must really load all but the
//! last prompt token, and after prefill dies a load from it fails instead of hanging.
//! The same again with `cuda_ipc_path = "staged"` (the host-staged copy a GPU without peer
//! access to the producer's gets by itself); the decode server's log must name the path taken.
//! Needs a GPU: skips, saying so, where there is none.
#![cfg(feature = "cuda")]

use kvconnect_api::{Dtype, FailurePolicy, KvLayout};
use kvconnect_engine::{local_effective_layout, Engine, EngineConfig, GenRequest, ReferenceConfig};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const MAX_TOKENS: usize = 4;

/// The fixture, from this checkout or (a test binary carried to another machine and run in
/// the repository root there) relative to the working directory.
fn reference_model() -> PathBuf {
    let built =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/kvconnect--reference/config.json");
    if built.exists() {
        built
    } else {
        PathBuf::from("fixtures/models/kvconnect--reference/config.json")
    }
}

/// The `kvconnect` binary built with this test, or `KVCONNECT_BIN` (a carried binary).
fn kvconnect_bin() -> PathBuf {
    std::env::var_os("KVCONNECT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kvconnect")))
}

struct Server {
    child: Child,
    http: String,
    log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// GPU of the decode server: `KVC_TEST_DECODE_GPU` (default 0, the prefill server's GPU);
/// on a host with two GPUs, 1 puts decode on the other GPU so the KV crosses NVLink.
fn decode_gpu() -> String {
    std::env::var("KVC_TEST_DECODE_GPU").unwrap_or_else(|_| "0".to_owned())
}

fn start(role: &str, id: &str, gpu: &str, path: &str) -> Server {
    let cfg = format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","kv_buffer_device":"cuda","kv_connector_extra_config":{{"backend":"cuda_ipc","cuda_ipc_path":"{path}","io_timeout":3,"connect_timeout":2}}}}"#
    );
    let model = reference_model();
    let log = std::env::temp_dir().join(format!("kvc-{id}-{}.log", std::process::id()));
    let mut child = Command::new(kvconnect_bin())
        .args(["worker", "--kv-transfer-config", &cfg, "--model", model.to_str().unwrap(), "--engine-id", id])
        .args(["--num-blocks", "512"])
        .env("KVCONNECT_GPU", gpu)
        .env("RUST_LOG", "warn,kvconnect_nixl=info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    let line = loop {
        match lines.next() {
            Some(Ok(l)) if l.trim_start().starts_with('{') => break l,
            Some(Ok(_)) => continue,
            _ => panic!("worker {id} ended without printing its addresses"),
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let v: Value = serde_json::from_str(&line).unwrap();
    Server { child, http: v["http"].as_str().unwrap().to_owned(), log }
}

impl Server {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let payload = body.to_string();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{payload}",
        payload.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, serde_json::from_str(body).unwrap_or(Value::String(body.to_owned())))
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    let lens = [2usize, 15, 16, 17, 33, 49, 65, 97, 129];
    (0..n)
        .map(|i| {
            let len = lens[i % lens.len()] + (i / lens.len()) * 3;
            (0..len).map(|j| ((i * 131 + j * 29 + j * j * 7) % 256) as u32).collect()
        })
        .collect()
}

fn monolithic(ps: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let model = ReferenceConfig::builtin().unwrap();
    let spec = model.model_spec().unwrap();
    let effective = local_effective_layout(&spec, KvLayout::HND, true, 16, Dtype::Bf16);
    let cfg = EngineConfig { model, effective, num_blocks: 256, seed: 0, shm: None, tp_size: 1 };
    let mut e = Engine::new(cfg, None, FailurePolicy::Fail).unwrap();
    let mut out = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        e.add_request(GenRequest::new(format!("m{i}"), p.clone(), MAX_TOKENS)).unwrap();
        out.push(e.run_to_completion(100_000).unwrap().remove(0).tokens);
    }
    out
}

#[test]
fn two_server_processes_over_cuda_ipc_equal_monolithic() {
    two_servers("auto", 18);
}

#[test]
fn two_server_processes_host_staged_equal_monolithic() {
    two_servers("staged", 9);
}

fn two_servers(path: &str, n: usize) {
    if let Err(e) = kvconnect_cuda::Gpu::open(0) {
        eprintln!("skipping: no GPU ({e})");
        return;
    }
    let ps = prompts(n);
    let mono = monolithic(&ps);
    let prefill = start("kv_producer", &format!("prefill-{path}"), "0", path);
    let decode = start("kv_consumer", &format!("decode-{path}"), &decode_gpu(), path);
    for (i, p) in ps.iter().enumerate() {
        let (st, pre) = post(
            &prefill.http,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
        );
        assert_eq!(st, 200, "prefill of prompt {i}: {pre}");
        let params = pre["kv_transfer_params"].clone();
        let (st, d) = post(
            &decode.http,
            "/v1/completions",
            &json!({"request_id": pre["id"], "prompt": p, "max_tokens": MAX_TOKENS, "kv_transfer_params": params}),
        );
        assert_eq!(st, 200, "decode of prompt {i}: {d}");
        let got: Vec<u32> = d["choices"][0]["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(got, mono[i], "prompt {i} (len {}): device KV over cuda_ipc != monolithic", p.len());
        assert_eq!(
            d["kvconnect"]["num_external_tokens"].as_u64(),
            Some(p.len() as u64 - 1),
            "prompt {i}: decode must load all but the last prompt token: {d}"
        );
    }
    // The path taken is reported once per producer, with its reason.
    let log = decode.log();
    let want = match (path, decode_gpu().as_str()) {
        ("staged", _) => "through pinned host memory",
        (_, "0") => "same GPU, direct",
        _ => "peer access",
    };
    assert!(log.contains("cuda_ipc: GPU") && log.contains(want), "decode log lacks '{want}':\n{log}");
    eprintln!("decode worker reported: {}", log.lines().find(|l| l.contains("cuda_ipc: GPU")).unwrap_or(""));
    // Prefill dies: decode's load from it fails (kv_load_failure_policy applies: recompute
    // gives the right tokens without external ones, fail gives an error), never a hang.
    let p = ps[0].clone();
    let (st, pre) = post(
        &prefill.http,
        "/v1/completions",
        &json!({"prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    );
    assert_eq!(st, 200, "{pre}");
    let params = pre["kv_transfer_params"].clone();
    drop(prefill);
    let (st, d) = post(
        &decode.http,
        "/v1/completions",
        &json!({"request_id": pre["id"], "prompt": p, "max_tokens": MAX_TOKENS, "kv_transfer_params": params}),
    );
    if st == 200 {
        let got: Vec<u32> = d["choices"][0]["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(got, mono[0], "recomputed after the dead peer: {d}");
    } else {
        assert!(d.to_string().contains("prefill") || d.to_string().contains("load"), "{st} {d}");
    }
}
