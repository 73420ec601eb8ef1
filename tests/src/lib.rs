//! Shared helpers for kvconnect's end-to-end tests: start `kvconnect worker` processes, read
//! the addresses they print, and talk HTTP/1.1 to them without pulling in a client library.

#![allow(unsafe_code)] // Signals to processes the tests spawned (kill(2)); setns(2) in netns.

pub mod cargo_cmd;
pub mod netns;
pub mod plugin_fixtures;
pub mod readme;
pub mod round_trip;
pub mod side_channel;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, Stdio};
use std::time::{Duration, Instant};

/// Path of the `kvconnect` binary the tests drive. The tests crate builds its own copy of the
/// command (`kvconnect-e2e`, the same `kvconnect_host::cli` entry point); cargo builds a
/// package's binaries before its integration tests, into the directory above the test
/// executable's `deps/`.
pub fn kvconnect_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current test executable");
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join(format!("kvconnect-e2e{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: run the tests through `cargo test -p kvconnect-tests`",
        bin.display()
    );
    bin
}

/// Runs `kvconnect ARGS` as a user would, with no plugin path from the environment and logging
/// off, and waits for it.
pub fn run_kvconnect(args: &[&str]) -> std::process::Output {
    Command::new(kvconnect_bin())
        .args(args)
        .env_remove("KVCONNECT_PLUGIN_PATH")
        .env("RUST_LOG", "off")
        .output()
        .expect("run kvconnect")
}

/// Bytes a command printed, as text.
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The workspace root (for fixtures).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

/// A model config from fixtures/models.
pub fn fixture_model(dir: &str) -> PathBuf {
    workspace_root().join("fixtures/models").join(dir).join("config.json")
}

/// A running worker process. Killed (SIGKILL) on drop unless already stopped.
pub struct Worker {
    /// The process.
    pub child: Child,
    /// `host:port` of its HTTP API.
    pub http: String,
    /// `host:port` of its side channel, when it has one.
    pub side_channel: Option<String>,
    /// What it logged, collected by a thread.
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Worker {
    /// Starts `kvconnect worker ARGS...` and waits (up to 60 s) for the line with its
    /// addresses.
    pub fn start(args: &[&str]) -> Worker {
        Worker::start_with_env(args, &[])
    }

    /// As [`Worker::start`], with these variables added to its environment (a secret, which
    /// must never be on its command line).
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Worker {
        Worker::start_command(Command::new(kvconnect_bin()), args, env)
    }

    /// As [`Worker::start_with_env`], with `kvconnect` run by `command` (which ends with the
    /// kvconnect binary: `ip netns exec NS kvconnect`, say).
    pub fn start_command(mut command: Command, args: &[&str], env: &[(&str, &str)]) -> Worker {
        let mut child = command
            .arg("worker")
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvconnect worker");
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        spawn_log_reader(stderr, log.clone());
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            for line in lines.by_ref() {
                let Ok(line) = line else { break };
                if line.trim_start().starts_with('{') {
                    let _ = tx.send(line);
                    break;
                }
            }
            // Keep draining so the worker never blocks on a full pipe.
            for _ in lines {}
        });
        let line = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                std::thread::sleep(Duration::from_millis(200));
                panic!(
                    "worker {args:?} printed no address line; log:\n{}",
                    log.lock().map(|l| l.clone()).unwrap_or_default()
                );
            }
        };
        let v: serde_json::Value = serde_json::from_str(&line).expect("address line is JSON");
        let http = v["http"].as_str().expect("http address").to_owned();
        let side_channel = v["side_channel"].as_str().map(str::to_owned);
        Worker { child, http, side_channel, log }
    }

    /// Everything the worker logged so far.
    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Sends SIGTERM and waits up to `within` for the process to exit; returns its status.
    pub fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        terminate(&mut self.child, within)
    }

    /// Kills the process at once (SIGKILL), as a crash would. A killed worker cannot unlink
    /// its shared-memory segments, so the test removes them afterwards (as an operator
    /// would) to keep /dev/shm clean on CI machines.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let prefix = format!("kvc-{}-", self.child.id());
        if let Ok(d) = std::fs::read_dir("/dev/shm") {
            for e in d.filter_map(|e| e.ok()) {
                if e.file_name().to_string_lossy().starts_with(&prefix) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    /// GET a path; the body as JSON.
    pub fn get(&self, path: &str) -> (u16, serde_json::Value) {
        http_request(&self.http, "GET", path, None)
    }

    /// POST JSON to a path.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        http_request(&self.http, "POST", path, Some(body))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SIGTERM first so the worker unlinks its shared memory; SIGKILL if it hangs.
        if let Ok(None) = self.child.try_wait() {
            if self.terminate(Duration::from_secs(5)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}

fn spawn_log_reader(stderr: ChildStderr, log: std::sync::Arc<std::sync::Mutex<String>>) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(stderr);
        let mut line = String::new();
        while let Ok(n) = r.read_line(&mut line) {
            if n == 0 {
                break;
            }
            if std::env::var_os("KVCONNECT_TEST_ECHO").is_some() {
                eprint!("{line}");
            }
            if let Ok(mut l) = log.lock() {
                l.push_str(&line);
            }
            line.clear();
        }
    });
}

/// Sends SIGTERM to a process this test spawned and waits up to `within` for it to exit;
/// returns its status (`None` if it is still running).
pub fn terminate(child: &mut std::process::Child, within: Duration) -> Option<std::process::ExitStatus> {
    let pid = child.id() as libc::pid_t;
    // SAFETY: kill(2) with a pid this test spawned and has not reaped; no memory involved.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// One HTTP/1.1 request with `Connection: close`; returns the status and the body parsed as
/// JSON (`Value::String` holding the raw body when it is not JSON).
pub fn http_request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> (u16, serde_json::Value) {
    http_request_with(addr, method, path, &[], body)
}

/// [`http_request`] with extra headers.
pub fn http_request_with(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&serde_json::Value>,
) -> (u16, serde_json::Value) {
    let mut s = TcpStream::connect(addr).expect("connect to worker");
    s.set_read_timeout(Some(Duration::from_secs(300))).ok();
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{payload}",
        payload.len()
    );
    s.write_all(req.as_bytes()).expect("send request");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_owned()
    };
    let json = serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body));
    (status, json)
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

/// A worker's `/metrics`: every sample line's value by its name with labels, as written
/// (`vllm:prompt_tokens_by_source_total{source="local_compute"}`).
pub fn metrics(addr: &str) -> std::collections::BTreeMap<String, f64> {
    let (status, body) = http_request(addr, "GET", "/metrics", None);
    assert_eq!(status, 200, "GET /metrics on {addr}");
    let text = body.as_str().unwrap_or_default().to_owned();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(k, v)| v.parse::<f64>().ok().map(|v| (k.to_owned(), v)))
        .collect()
}

/// True once the peer closes `s` (within 20 s); what it sent before (a challenge, a refusal;
/// at most 4 KiB) is read past.
pub fn closed_by_peer(s: &mut std::net::TcpStream) -> bool {
    use std::io::Read;
    let _ = s.set_read_timeout(Some(Duration::from_secs(20)));
    let mut b = [0u8; 512];
    let mut got = 0;
    loop {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return true,
            Ok(n) if got + n > 4096 => return false,
            Ok(n) => got += n,
        }
    }
}

/// The token ids of a completion response.
pub fn token_ids(resp: &serde_json::Value) -> Vec<u64> {
    resp["choices"][0]["token_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(|t| t.as_u64()).collect())
        .unwrap_or_default()
}

/// Waits until `f` holds, polling every 50 ms, up to `within`.
pub fn wait_until(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

/// The reference model's config (what the worker tests run).
pub fn reference_model() -> PathBuf {
    fixture_model("kvconnect--reference")
}

/// The hybrid reference model's config: sliding-window, state and full-attention layers.
pub fn hybrid_reference_model() -> PathBuf {
    fixture_model("kvconnect--reference-hybrid")
}

/// Writes `dir/name`, a deployment file for `model` with one table per role: the role's
/// kv-transfer-config and any more `key = value` lines for it.
pub fn write_deployment(
    dir: &Path,
    name: &str,
    model: &Path,
    prefill: (&str, &str),
    decode: (&str, &str),
) -> PathBuf {
    let text = format!(
        "model = \"{}\"\n\n[prefill]\nkv_transfer_config = '{}'\n{}\n\n[decode]\nkv_transfer_config = '{}'\n{}\n",
        model.display(),
        prefill.0,
        prefill.1,
        decode.0,
        decode.1
    );
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write the deployment file");
    path
}

/// A worker on the reference model with kv-transfer-config `config`, engine id `id` and the
/// arguments `more`, given `secret` as its data-plane secret (through its environment).
pub fn reference_worker_with_secret(config: &str, id: &str, more: &[&str], secret: &str) -> Worker {
    let model = reference_model();
    let mut args = vec![
        "--kv-transfer-config",
        config,
        "--model",
        model.to_str().unwrap_or_default(),
        "--engine-id",
        id,
    ];
    args.extend_from_slice(more);
    Worker::start_with_env(&args, &[("KVCONNECT_SIDE_CHANNEL_TOKEN", secret)])
}

/// Prefill of `prompt` for a decode elsewhere (`do_remote_decode`, one token), as a proxy
/// asks for it: prefill's answer, whose `kv_transfer_params` decode is to be given.
pub fn prefill_for_remote_decode(prefill: &Worker, prompt: &[u32]) -> serde_json::Value {
    let (st, p) = prefill.post(
        "/v1/completions",
        &serde_json::json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    );
    assert_eq!(st, 200, "prefill failed: {p}");
    p
}

/// One disaggregated request, as a proxy does it: prefill with `do_remote_decode`, then
/// decode with prefill's `kv_transfer_params` under prefill's request id. Returns decode's
/// status and body.
pub fn disaggregated(
    prefill: &Worker,
    decode: &Worker,
    prompt: &[u32],
    max_tokens: usize,
) -> (u16, serde_json::Value) {
    disaggregated_with(prefill, decode, prompt, max_tokens, || {})
}

/// [`disaggregated`], running `between` after prefill answered and before decode is asked
/// (a test that tampers with what decode will load).
pub fn disaggregated_with(
    prefill: &Worker,
    decode: &Worker,
    prompt: &[u32],
    max_tokens: usize,
    between: impl FnOnce(),
) -> (u16, serde_json::Value) {
    let p = prefill_for_remote_decode(prefill, prompt);
    let params = p["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "prefill returned no transfer params: {p}");
    between();
    decode.post(
        "/v1/completions",
        &serde_json::json!({"request_id": p["id"], "prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": params}),
    )
}

/// Asserts that decode answered `r` (its status `st`, for `prompt` whose monolithic output is
/// `mono`) after its handshake with prefill was refused: the output is still `mono`, because
/// decode computed the prompt itself; nothing was loaded; the request's load note says it was
/// recomputed with a reason containing each of `reason`; and prefill's side channel counted
/// one refusal and no welcome.
pub fn assert_refused_at_the_handshake(
    prefill: &Worker,
    decode: &Worker,
    (st, r): (u16, &serde_json::Value),
    mono: &[u32],
    reason: &[&str],
) {
    assert_eq!(st, 200, "{r}\n{}", decode.log());
    assert_eq!(token_ids(r).into_iter().map(|t| t as u32).collect::<Vec<_>>(), mono, "{r}");
    assert_eq!(r["kvconnect"]["num_external_tokens"], 0, "{r}");
    assert_eq!(r["kvconnect"]["kv_load"]["recomputed"], true, "{r}");
    let why = r["kvconnect"]["kv_load"]["reason"].as_str().unwrap_or_default();
    for w in reason {
        assert!(why.contains(w), "want {w:?} in the load note's reason: {why}");
    }
    let (_, h) = decode.get("/health");
    assert_eq!(h["pool"]["external_tokens"], 0, "nothing may be loaded from a refused peer: {h}");
    assert_eq!(h["pool"]["failed"], 0, "{h}");
    let (_, h) = prefill.get("/health");
    assert_eq!(h["side_channel"]["refused"], 1, "{h}");
    assert_eq!(h["side_channel"]["welcomed"], 0, "{h}");
}

/// Greedy output of a single in-process reference engine without any connector: the
/// monolithic baseline disaggregated output must equal token for token.
pub fn monolithic(prompts: &[Vec<u32>], max_tokens: usize, layout: kvconnect_api::KvLayout) -> Vec<Vec<u32>> {
    let model = kvconnect_engine::ReferenceConfig::builtin().expect("reference config");
    monolithic_of(model, prompts, max_tokens, layout)
}

/// [`monolithic`] with another reference model (e.g. the hybrid one).
pub fn monolithic_of(
    model: kvconnect_engine::ReferenceConfig,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    layout: kvconnect_api::KvLayout,
) -> Vec<Vec<u32>> {
    use kvconnect_engine::{local_effective_layout, Engine, EngineConfig, GenRequest};
    let spec = model.model_spec().expect("reference spec");
    let eff = local_effective_layout(&spec, layout, true, 16, kvconnect_api::Dtype::Bf16);
    let cfg = EngineConfig { model, effective: eff, num_blocks: 256, seed: 0, shm: None, tp_size: 1 };
    let mut e = Engine::new(cfg, None, kvconnect_api::FailurePolicy::Recompute).expect("engine");
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        e.add_request(GenRequest::new(format!("m{i}"), p.clone(), max_tokens)).expect("add");
        let done = e.run_to_completion(100_000).expect("run");
        out.push(done.into_iter().next().map(|c| c.tokens).unwrap_or_default());
    }
    out
}

/// `n` prompts of varied length (1 token, shorter than a block, block boundaries, longer
/// than the reference model's 32-token sliding window, many blocks), deterministic bytes.
pub fn varied_prompts(n: usize) -> Vec<Vec<u32>> {
    const LENGTHS: [usize; 25] =
        [1, 2, 3, 5, 8, 11, 15, 16, 17, 23, 31, 32, 33, 40, 47, 48, 49, 63, 64, 65, 80, 97, 128, 129, 160];
    (0..n)
        .map(|i| {
            let len = LENGTHS[i % LENGTHS.len()] + (i / LENGTHS.len()) * 3;
            (0..len).map(|j| ((i * 131 + j * 29 + j * j * 7) % 256) as u32).collect()
        })
        .collect()
}

/// Runs `kvconnect up ARGS` (which must include `--workload N --json`) to its end and returns
/// the workload report; panics, as a test helper, when it fails.
pub fn up_workload_report(args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(kvconnect_bin())
        .arg("up")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run kvconnect up --workload");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    // The first line is the address line; the report follows.
    let report = stdout.split_once('\n').map(|(_, r)| r).unwrap_or_default();
    serde_json::from_str(report).unwrap_or_else(|e| panic!("no workload report ({e}): {stdout}"))
}

/// Starts `kvconnect up ARGS` and returns the process with the JSON address line it prints
/// first (proxy, workers, their pids). Panics, as a test helper, when it prints none in 120 s.
pub fn spawn_up(args: &[&str]) -> (std::process::Child, serde_json::Value) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(kvconnect_bin())
        .arg("up")
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("spawn kvconnect up");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(stdout).lines();
        if let Some(Ok(l)) = lines.next() {
            let _ = tx.send(l);
        }
        for _ in lines {}
    });
    let line = rx.recv_timeout(Duration::from_secs(120)).expect("kvconnect up printed no address line");
    (child, serde_json::from_str(&line).expect("address line is JSON"))
}
