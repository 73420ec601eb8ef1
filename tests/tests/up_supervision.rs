//! `kvconnect up` kept running the way a user runs it: serving for a minute with idle gaps,
//! a decode worker killed with SIGKILL (restarted; the proxy answers 503 naming the role, or
//! routes to the other decode worker), a plugin that panics inside a worker (the worker says
//! so on /health and fails requests at once, then `up` restarts it), a worker that cannot be
//! restarted (`up` gives up with its error instead of looping), and a taken proxy port.

#![allow(unsafe_code)] // Signals to worker processes the test's `up` started (kill(2)).

use kvconnect_api::KvLayout;
use kvconnect_tests::plugin_fixtures::broken_plugin;
use kvconnect_tests::{
    http_request, kvconnect_bin, monolithic, reference_model, token_ids, varied_prompts, wait_until,
};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAX: usize = 4;

/// A running `kvconnect up` whose stderr is kept for the assertions.
struct Up {
    child: Child,
    proxy: String,
    line: Value,
    stderr: Arc<Mutex<String>>,
}

impl Up {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Up {
        let mut cmd = Command::new(kvconnect_bin());
        cmd.arg("up").args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn kvconnect up");
        let stderr = Arc::new(Mutex::new(String::new()));
        let (err, log) = (child.stderr.take().expect("piped stderr"), stderr.clone());
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("[up] {l}");
                log.lock().unwrap().push_str(&(l + "\n"));
            }
        });
        let out = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines();
            if let Some(Ok(l)) = lines.next() {
                let _ = tx.send(l);
            }
            for _ in lines {}
        });
        let line: Value = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(l) => serde_json::from_str(&l).expect("address line is JSON"),
            Err(_) => panic!("kvconnect up printed no address line:\n{}", stderr.lock().unwrap()),
        };
        let proxy = line["proxy"].as_str().unwrap().trim_start_matches("http://").to_owned();
        Up { child, proxy, line, stderr }
    }

    fn worker(&self, role: &str, i: usize) -> String {
        self.line[role][i].as_str().unwrap().to_owned()
    }

    fn pid_of(&self, i: usize) -> i32 {
        self.line["worker_pids"][i].as_i64().unwrap() as i32
    }

    fn complete(&self, prompt: &[u32]) -> (u16, Value) {
        http_request(
            &self.proxy,
            "POST",
            "/v1/completions",
            Some(&json!({"prompt": prompt, "max_tokens": MAX})),
        )
    }

    /// The proxy's view of its workers: (engine id, http, ok).
    fn workers(&self) -> Vec<(String, String, bool)> {
        let (_, h) = http_request(&self.proxy, "GET", "/health", None);
        h["workers"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|w| {
                        (
                            w["engine_id"].as_str().unwrap_or_default().to_owned(),
                            w["http"].as_str().unwrap_or_default().to_owned(),
                            w["ok"] == true,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    fn stop(mut self) {
        let status = kvconnect_tests::terminate(&mut self.child, Duration::from_secs(30));
        let status = status.expect("kvconnect up did not exit within 30 s of SIGTERM");
        assert!(status.success(), "up exited with {status:?}:\n{}", self.log());
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only asks whether the pid exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

fn kill9(pid: i32) {
    // SAFETY: kill(2) of a worker process this test's `up` started.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
}

fn check_answer(what: &str, st: u16, d: &Value, want: &[u32], prompt_len: usize) {
    assert_eq!(st, 200, "{what}: {d}");
    let got: Vec<u32> = token_ids(d).into_iter().map(|t| t as u32).collect();
    assert_eq!(got, want, "{what}: through the proxy != monolithic");
    assert_eq!(
        d["kvconnect"]["num_external_tokens"].as_u64(),
        Some(prompt_len as u64 - 1),
        "{what}: decode loaded the KV instead of recomputing: {d}"
    );
}

#[test]
fn up_serves_for_a_minute_with_idle_gaps_and_keeps_its_workers() {
    let up = Up::start(&[], &[]);
    let pids = [up.pid_of(0), up.pid_of(1)];
    let prompts = varied_prompts(8);
    let mono = monolithic(&prompts, MAX, KvLayout::HND);
    let t0 = Instant::now();
    let mut sent = 0;
    for (at, batch) in [(0u64, 0..2), (15, 2..4), (30, 4..6), (62, 6..8)] {
        let due = Duration::from_secs(at);
        if let Some(wait) = due.checked_sub(t0.elapsed()) {
            std::thread::sleep(wait);
        }
        for i in batch {
            let (st, d) = up.complete(&prompts[i]);
            check_answer(&format!("prompt {i} at {at} s"), st, &d, &mono[i], prompts[i].len());
            sent += 1;
        }
        let (st, h) = http_request(&up.worker("prefill", 0), "GET", "/health", None);
        assert_eq!(st, 200, "prefill health at {at} s: {h}");
        assert!(pids.iter().all(|p| alive(*p)), "a worker died by {at} s:\n{}", up.log());
    }
    assert_eq!(sent, 8);
    assert!(t0.elapsed() >= Duration::from_secs(60));
    assert!(!up.log().contains("restart"), "no worker was restarted:\n{}", up.log());
    up.stop();
    for p in pids {
        assert!(!alive(p), "worker {p} outlived kvconnect up");
    }
}

#[test]
fn a_killed_decode_worker_comes_back_and_meanwhile_the_proxy_says_which_role_is_down() {
    let up = Up::start(&[], &[]);
    let prompts = varied_prompts(4);
    let mono = monolithic(&prompts, MAX, KvLayout::HND);
    let (st, d) = up.complete(&prompts[0]);
    check_answer("before the kill", st, &d, &mono[0], prompts[0].len());

    let decode_pid = up.pid_of(1);
    kill9(decode_pid);
    let (st, e) = up.complete(&prompts[1]);
    assert_eq!(st, 503, "a request while decode is down: {e}");
    let msg = e["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("decode worker"), "the 503 names the role: {msg}");

    let mut last = (0, Value::Null);
    assert!(
        wait_until(Duration::from_secs(60), || {
            last = up.complete(&prompts[2]);
            last.0 == 200
        }),
        "decode did not come back: {}\n{}",
        last.1,
        up.log()
    );
    check_answer("after the restart", last.0, &last.1, &mono[2], prompts[2].len());
    let (st, d) = up.complete(&prompts[3]);
    check_answer("after the restart, again", st, &d, &mono[3], prompts[3].len());
    let log = up.log();
    assert!(log.contains("killed by signal 9 (SIGKILL)") && log.contains("restarted"), "{log}");
    assert!(up.workers().iter().all(|w| w.2), "{:?}", up.workers());
    up.stop();
    assert!(!alive(decode_pid));
}

#[test]
fn with_two_decode_workers_the_proxy_routes_around_a_killed_one() {
    let up = Up::start(&["--decode", "2"], &[]);
    let prompts = varied_prompts(6);
    let mono = monolithic(&prompts, MAX, KvLayout::HND);
    kill9(up.pid_of(1));
    for i in 0..6 {
        let (st, d) = up.complete(&prompts[i]);
        check_answer(
            &format!("prompt {i} with one decode worker killed"),
            st,
            &d,
            &mono[i],
            prompts[i].len(),
        );
    }
    assert!(
        wait_until(Duration::from_secs(60), || {
            let w = up.workers();
            w.len() == 3 && w.iter().all(|w| w.2)
        }),
        "the killed decode worker was not restarted: {:?}\n{}",
        up.workers(),
        up.log()
    );
    up.stop();
}

/// A deployment whose prefill and decode workers run the broken plugin that panics in
/// `save_kv_layer` (once, while `flag` exists).
fn panicking_plugin_deployment(dir: &Path) -> PathBuf {
    let lib = broken_plugin(Path::new(env!("CARGO_TARGET_TMPDIR")), "method_panics", dir);
    let cfg = json!({"kv_connector": "broken", "kv_connector_module_path": lib}).to_string();
    let toml = format!(
        "model = {:?}\n\n[prefill]\nkv_transfer_config = '{cfg}'\n\n[decode]\nkv_transfer_config = '{cfg}'\n",
        reference_model().to_string_lossy()
    );
    let path = dir.join("panics.toml");
    std::fs::write(&path, toml).unwrap();
    path
}

#[test]
fn a_plugin_that_panics_leaves_a_worker_that_says_so_fails_fast_and_is_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let deployment = panicking_plugin_deployment(dir.path());
    let flag = dir.path().join("panic-once");
    std::fs::write(&flag, "").unwrap();
    let up = Up::start(
        &[deployment.to_str().unwrap(), "--health-interval", "4"],
        &[("KVC_BROKEN_PANIC_ONCE", flag.to_str().unwrap())],
    );
    let prefill = up.worker("prefill", 0);
    let prompt: Vec<u32> = (0..40).collect();

    // The first request reaches save_kv_layer on prefill, which panics.
    let (st, e) = up.complete(&prompt);
    assert_ne!(st, 200, "the request whose step panicked fails: {e}");
    assert!(!flag.exists(), "the plugin panicked");
    // The worker says why on /health, with every block back in the pool.
    let (st, h) = http_request(&prefill, "GET", "/health", None);
    assert_eq!(st, 503, "{h}");
    assert_eq!(h["status"], "unhealthy", "{h}");
    let reason = h["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("panicked in save_kv_layer") && reason.contains("restart"), "{reason}");
    assert_eq!(h["pool"]["free_blocks"], h["pool"]["total_blocks"], "no block stays allocated: {h}");
    assert_eq!(h["pool"]["unfinished"], 0, "{h}");
    // Requests fail at once with the reason, no retry loop.
    let t = Instant::now();
    let (st, e) =
        http_request(&prefill, "POST", "/v1/completions", Some(&json!({"prompt": "hi", "max_tokens": 2})));
    assert_eq!(st, 503, "{e}");
    assert!(e["error"]["message"].as_str().unwrap_or_default().contains("panicked in save_kv_layer"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2), "failed fast");

    // `up` restarts it; requests then succeed again.
    let mut last = (0, Value::Null);
    assert!(
        wait_until(Duration::from_secs(60), || {
            last = up.complete(&prompt);
            last.0 == 200
        }),
        "no recovery: {}\n{}",
        last.1,
        up.log()
    );
    assert!(up.log().contains("reports itself unhealthy"), "{}", up.log());
    let restarted = up.workers().into_iter().find(|w| w.0.ends_with("prefill-0")).unwrap();
    assert_ne!(restarted.1, prefill, "a new prefill process");
    let (st, h) = http_request(&restarted.1, "GET", "/health", None);
    assert_eq!(st, 200, "{h}");
    assert_eq!(h["pool"]["free_blocks"], h["pool"]["total_blocks"], "{h}");
    up.stop();
}

#[test]
fn a_worker_that_cannot_be_restarted_makes_up_give_up_with_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(
        kvconnect_tests::workspace_root().join("examples/deployments/default-up.toml"),
    )
    .unwrap();
    let model = reference_model().to_string_lossy().into_owned();
    let deployment = dir.path().join("d.toml");
    std::fs::write(
        &deployment,
        src.replace("../../fixtures/models/kvconnect--reference/config.json", &model),
    )
    .unwrap();
    let mut up = Up::start(&[deployment.to_str().unwrap()], &[]);
    // The file changes under the running deployment: restarts now fail.
    std::fs::write(&deployment, "model = 'nowhere/config.json'\n").unwrap();
    kill9(up.pid_of(1));
    let mut status = None;
    assert!(
        wait_until(Duration::from_secs(90), || {
            status = up.child.try_wait().unwrap();
            status.is_some()
        }),
        "up kept restarting:\n{}",
        up.log()
    );
    assert!(!status.unwrap().success());
    let log = up.log();
    assert!(log.contains("giving up"), "{log}");
    assert!(log.contains("nowhere/config.json"), "the worker's own error is shown: {log}");
    assert!(!alive(up.pid_of(0)), "the other workers were stopped");
}

#[test]
fn a_taken_proxy_port_is_refused_naming_it_before_any_worker_starts() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let t = Instant::now();
    let out = Command::new(kvconnect_bin()).args(["up", "--port", &port]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("127.0.0.1:{port}")) && err.contains("--port"), "{err}");
    assert!(!err.contains("worker ready"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(10));
}
