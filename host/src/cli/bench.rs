//! `kvconnect bench`: end-to-end figures from real server processes, each reported as a
//! ratio against a baseline measured in the same run.
//!
//! * `bench transfer` starts a prefill and a decode server (two processes, the transfer-only
//!   engine with synthetic KV of the given model's geometry), moves one prompt's KV through
//!   the nixl connector, and compares the rate with a plain memcpy (`shm`) or a raw loopback
//!   socket (`tcp`) over the same number of bytes.
//! * `bench ttft` starts a prefill and a decode server on the reference engine and compares
//!   the time to first token of a long prompt served disaggregated with the same prompt
//!   computed by one server.

#![allow(unsafe_code)] // Signals the benchmark's server process (libc).

use anyhow::{anyhow, bail, Context, Result};
use kvconnect_proxy::client;
use kvconnect_support::stats::Quartiles;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// `kvconnect bench ...`.
#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Moves one prompt's KV between two worker processes; ratio against memcpy / a raw socket.
    Transfer(TransferArgs),
    /// Time to first token of a long prompt, disaggregated vs one worker (reference engine).
    Ttft(TtftArgs),
    /// lmcache save of one request whose KV is in GPU memory; ratio against a contiguous
    /// device-to-pinned-host copy of the same bytes (needs the cuda feature and a GPU).
    LmcacheDevice(super::bench_lmcache_device::LmcacheDeviceArgs),
    /// NIXL (UCX) READ of GPU memory registered as VRAM, checked byte for byte; ratio against
    /// a contiguous cuMemcpyDtoD of the same bytes (needs the cuda feature, a GPU and NIXL).
    NixlVram(super::bench_nixl_vram::NixlVramArgs),
    /// The consumer half of `bench transfer --backend cuda_ipc` (started by it; reads its
    /// spec as JSON on stdin).
    #[command(hide = true)]
    CudaIpcPeer,
    /// The source process of `bench transfer --backend nixl`'s raw NIXL baseline (started by
    /// it; reads the transfer's shape as JSON on stdin, serves until stdin closes).
    #[command(hide = true)]
    NixlRawPeer,
}

/// Arguments of `bench transfer`.
#[derive(Debug, Clone, clap::Args)]
pub struct TransferArgs {
    /// nixl backend: shm (same host, shared memory), tcp, or nixl (the NIXL library).
    #[arg(long, value_name = "shm|tcp|nixl", default_value = "shm")]
    pub backend: String,
    /// The model's config.json (any model: the KV contents are synthetic).
    #[arg(long, value_name = "CONFIG.json")]
    pub model: PathBuf,
    /// Prompt length in tokens.
    #[arg(long, value_name = "N", default_value_t = 8192)]
    pub tokens: usize,
    /// Measured pairs of (baseline, transfer), interleaved, after one warm-up; the median of
    /// the per-pair ratios is reported with its quartiles.
    #[arg(long, alias = "repeat", value_name = "N", default_value_t = 15)]
    pub pairs: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Where the KV regions live: cpu, or cuda (with --backend cuda_ipc).
    #[arg(long, value_name = "cpu|cuda", default_value = "cpu")]
    pub device: String,
    /// GPU of the prefill (producer) process (cuda_ipc).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub gpu: usize,
    /// GPU of the decode (consumer) process (cuda_ipc); another GPU of the host crosses NVLink.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub peer_gpu: usize,
    /// Prefill's tensor-parallel size: above 1, times the load from prefill TP P into decode
    /// TP 1 against TP 1 -> TP 1 (the baseline) in interleaved pairs (backends shm and tcp).
    #[arg(long = "tp-size", value_name = "P", default_value_t = 1)]
    pub tp_size: u32,
    /// tcp: parallel streams of one pull (the connector's `tcp_streams`; default one per two
    /// cores, at most 4); the raw-socket baseline uses as many.
    #[arg(long, value_name = "N")]
    pub streams: Option<usize>,
    /// tcp: send and receive buffer of every socket, bytes (the connector's
    /// `tcp_socket_buffer`; 0 for the kernel's autotuning); the baseline's are the same.
    #[arg(long, value_name = "BYTES", default_value_t = kvconnect_nixl::tcp_data::DEFAULT_SOCKET_BUFFER)]
    pub socket_buffer: usize,
}

/// Arguments of `bench ttft`.
#[derive(Debug, Clone, clap::Args)]
pub struct TtftArgs {
    /// nixl backend: shm or tcp.
    #[arg(long, value_name = "shm|tcp", default_value = "shm")]
    pub backend: String,
    /// The reference model's config.json.
    #[arg(
        long,
        value_name = "CONFIG.json",
        default_value = "fixtures/models/kvconnect--reference/config.json"
    )]
    pub model: PathBuf,
    /// Prompt length in tokens.
    #[arg(long, value_name = "N", default_value_t = 2048)]
    pub tokens: usize,
    /// Measured pairs of (monolithic, disaggregated) requests, interleaved; the median of the
    /// per-pair ratios is reported with its quartiles.
    #[arg(long, alias = "repeat", value_name = "N", default_value_t = 15)]
    pub pairs: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs `kvconnect bench`.
pub fn run(cmd: &BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Transfer(a) if a.backend == "cuda_ipc" || a.device == "cuda" => {
            super::bench_cuda::transfer(a)
        }
        BenchCommand::Transfer(a) if a.tp_size != 1 => super::bench_tp::transfer(a),
        BenchCommand::Transfer(a) => transfer(a),
        BenchCommand::Ttft(a) => ttft(a),
        BenchCommand::CudaIpcPeer => super::bench_cuda::peer(),
        BenchCommand::NixlRawPeer => nixl_raw_peer(),
        BenchCommand::LmcacheDevice(a) => super::bench_lmcache_device::run(a),
        BenchCommand::NixlVram(a) => super::bench_nixl_vram::run(a),
    }
}

/// A server process the benchmark started; killed (SIGTERM first) on drop.
pub(super) struct BenchServer {
    child: Child,
    http: String,
    /// Its side channel, `host:port`, when it has one.
    side_channel: Option<String>,
}

impl BenchServer {
    fn start(args: &[String]) -> Result<BenchServer> {
        let exe = std::env::current_exe().context("cannot find the kvconnect executable")?;
        let mut child = Command::new(exe)
            .arg("worker")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start a worker process")?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("worker stdout is not piped"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            for line in lines.by_ref().map_while(Result::ok) {
                if line.starts_with('{') {
                    let _ = tx.send(line);
                    break;
                }
            }
            for _ in lines {}
        });
        let mut w = BenchServer { child, http: String::new(), side_channel: None };
        let line = rx
            .recv_timeout(Duration::from_secs(120))
            .map_err(|_| anyhow!("a worker did not start within 120 s (its log is above)"))?;
        let v: Value = serde_json::from_str(&line).context("worker address line")?;
        w.http =
            v["http"].as_str().ok_or_else(|| anyhow!("worker printed no http address: {line}"))?.to_owned();
        w.side_channel = v["side_channel"].as_str().map(str::to_owned);
        Ok(w)
    }

    fn post(&self, body: &Value) -> Result<Value> {
        let (status, v) = http_post(&self.http, "/v1/completions", body)?;
        if status != 200 {
            bail!("worker {} answered {status}: {v}", self.http);
        }
        Ok(v)
    }
}

impl Drop for BenchServer {
    fn drop(&mut self) {
        // SIGTERM lets the server unlink its shared memory.
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: kill(2) on a child this process spawned and has not reaped.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// POSTs `body` to a server through the proxy's pooled HTTP client, on one runtime kept for
/// the benchmark's life (its pooled connections live there).
fn http_post(addr: &str, path: &str, body: &Value) -> Result<(u16, Value)> {
    static RUNTIME: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    let rt = RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| anyhow!("cannot start the async runtime: {e}"))?;
    let reply = rt
        .block_on(client::request(addr, "POST", path, Some(body), Duration::from_secs(600)))
        .context("a request to a worker")?;
    Ok((reply.status, reply.json()))
}

pub(super) fn backend(s: &str) -> Result<&'static str> {
    match s {
        "shm" => Ok("shm"),
        "tcp" => Ok("tcp"),
        "nixl" => Ok("nixl"),
        other => bail!("--backend '{other}': use shm, tcp or nixl"),
    }
}

fn nixl_config(role: &str, backend: &str, settings: &Value) -> String {
    let mut extra = json!({"backend": backend});
    if let (Some(e), Some(more)) = (extra.as_object_mut(), settings.as_object()) {
        e.extend(more.clone());
    }
    json!({"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}).to_string()
}

fn pair(model: &Path, backend: &str, settings: &Value, extra: &[&str]) -> Result<(BenchServer, BenchServer)> {
    pair_with(model, backend, settings, extra, &[], "bench")
}

/// A prefill and a decode server with connector `settings` and `extra` arguments, prefill
/// with `prefill_extra` too, named `<tag>-prefill` and `<tag>-decode`.
pub(super) fn pair_with(
    model: &Path,
    backend: &str,
    settings: &Value,
    extra: &[&str],
    prefill_extra: &[&str],
    tag: &str,
) -> Result<(BenchServer, BenchServer)> {
    let model = model.to_str().ok_or_else(|| anyhow!("--model path is not UTF-8"))?.to_owned();
    let mk = |role: &str, id: &str, more: &[&str]| -> Vec<String> {
        let config = nixl_config(role, backend, settings);
        let mut v: Vec<String> = ["--kv-transfer-config", &config, "--model", &model, "--engine-id", id]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(extra.iter().chain(more).map(|s| s.to_string()));
        v
    };
    let prefill = BenchServer::start(&mk("kv_producer", &format!("{tag}-prefill"), prefill_extra))?;
    let decode = BenchServer::start(&mk("kv_consumer", &format!("{tag}-decode"), &[]))?;
    Ok((prefill, decode))
}

/// One disaggregated request; returns decode's answer and the wall time of both requests.
pub(super) fn round(
    prefill: &BenchServer,
    decode: &BenchServer,
    prompt: &Value,
    max_tokens: usize,
) -> Result<(Value, Duration)> {
    let t0 = Instant::now();
    let p = prefill.post(
        &json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    )?;
    let d = decode.post(&json!({"request_id": p["id"], "prompt": prompt, "max_tokens": max_tokens,
                                "kv_transfer_params": p["kv_transfer_params"]}))?;
    Ok((d, t0.elapsed()))
}

/// The baseline over the same bytes, measured right after each transfer so both see the
/// same machine load (these machines are shared and noisy).
enum Baseline {
    /// The memcpy of shm, whose ways the decode process times right after each load (its
    /// `memcpy_ways_us`).
    Memcpy,
    Socket(kvconnect_bench::raw_socket::RawSocket),
    /// The same bytes in the same shape (one run per KV layer and K/V part, one prepared
    /// entry per block of each) READ through bare nixl-sys calls from a second process.
    #[cfg(feature = "nixl")]
    Nixl(kvconnect_bench::nixl_raw::RawNixlRead),
}

impl Baseline {
    /// `bytes` over `streams` loopback connections at once, `rounds` times
    /// (`kvconnect_bench::raw_socket`).
    fn socket(bytes: usize, rounds: usize, streams: usize, buffer: usize) -> Result<Baseline> {
        let s = kvconnect_bench::raw_socket::RawSocket::start(bytes, rounds, streams, buffer)
            .context("raw-socket baseline: listening on 127.0.0.1")?;
        Ok(Baseline::Socket(s))
    }

    fn name(&self) -> &'static str {
        match self {
            Baseline::Memcpy => "memcpy",
            Baseline::Socket(_) => "raw loopback socket",
            #[cfg(feature = "nixl")]
            Baseline::Nixl(_) => "raw NIXL READ between two processes (nixl-sys)",
        }
    }

    fn measure(&mut self) -> Result<Duration> {
        match self {
            Baseline::Memcpy => bail!("the memcpy baseline is timed by the decode process, not here"),
            Baseline::Socket(s) => s.measure().context("raw-socket baseline"),
            #[cfg(feature = "nixl")]
            Baseline::Nixl(r) => {
                let d = r.measure().map_err(|e| anyhow!("raw NIXL baseline: {e}"))?;
                if !r.verify() {
                    bail!("raw NIXL baseline: the READ delivered wrong bytes");
                }
                Ok(d)
            }
        }
    }

    fn finish(&mut self) -> Result<()> {
        if let Baseline::Socket(s) = self {
            s.finish().context("raw-socket baseline sender")?;
        }
        Ok(())
    }
}

/// The tcp streams of one pull and the connector settings `--streams` and `--socket-buffer`
/// ask for (tcp only; other backends take none).
pub(super) fn connector_settings(a: &TransferArgs, backend: &str) -> Result<(usize, Value)> {
    let streams = a.streams.unwrap_or_else(kvconnect_nixl::tcp_data::default_tcp_streams);
    if !(1..=16).contains(&streams) {
        bail!("--streams {streams}: expected 1 to 16");
    }
    let settings = match backend {
        "tcp" => json!({"tcp_streams": streams, "tcp_socket_buffer": a.socket_buffer}),
        _ => json!({}),
    };
    Ok((streams, settings))
}

fn transfer(a: &TransferArgs) -> Result<()> {
    let backend = backend(&a.backend)?;
    if a.tokens < 2 {
        bail!("--tokens must be at least 2 (decode loads all but the last prompt token)");
    }
    let model_json =
        std::fs::read_to_string(&a.model).with_context(|| format!("model {}", a.model.display()))?;
    let spec = kvconnect_api::ModelSpec::from_hf_config_json(&model_json)
        .with_context(|| format!("model {}", a.model.display()))?;
    let blocks = (a.tokens.div_ceil(16) + 8).to_string();
    let (streams, settings) = connector_settings(a, backend)?;
    let (prefill, decode) = pair(&a.model, backend, &settings, &["--synthetic-kv", "--num-blocks", &blocks])?;
    let prompt = json!(vec![0u32; a.tokens]);
    let total = a.pairs.max(1) + 1;
    let load_before = load_average();
    let mut bytes = 0u64;
    let mut baseline: Option<Baseline> = None;
    // Per pair: the transfer's time, and the baseline's by each of its ways (shm: every way
    // of the memcpy, timed in the decode process; otherwise the one baseline).
    let (mut times, mut base_ways): (Vec<f64>, Vec<Vec<f64>>) = (Vec::new(), Vec::new());
    // shm: the ways' names, as decode (which timed them) gives them.
    let mut way_names: Vec<String> = Vec::new();
    for i in 0..total {
        // Pairs alternate which of the two runs first, so neither always meets a warmer
        // machine; shm's baseline runs in the decode process right after its load.
        let base_first = i % 2 == 1 && baseline.is_some() && backend != "shm";
        let early = match (base_first, baseline.as_mut()) {
            (true, Some(b)) => Some(b.measure()?),
            _ => None,
        };
        let (d, _) = round(&prefill, &decode, &prompt, 1)?;
        let p = &d["kv_transfer_params"];
        if p["verified"] != true {
            bail!("decode did not verify the transferred KV: {d}");
        }
        bytes = p["bytes"].as_u64().ok_or_else(|| anyhow!("decode reported no byte count: {d}"))?;
        let ti = Duration::from_micros(p["transfer_us"].as_u64().unwrap_or(0));
        if baseline.is_none() {
            baseline = Some(match backend {
                "shm" => Baseline::Memcpy,
                #[cfg(feature = "nixl")]
                "nixl" => raw_nixl(&spec, a.tokens, bytes)?,
                _ => Baseline::socket(
                    bytes as usize,
                    total,
                    kvconnect_nixl::tcp_data::streams_for(
                        bytes,
                        streams,
                        kvconnect_nixl::tcp_data::STREAM_MIN_BYTES,
                    ),
                    a.socket_buffer,
                )?,
            });
        }
        let ways: Vec<f64> = if backend == "shm" {
            let ways: Vec<f64> = p["memcpy_ways_us"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|w| w.as_f64())
                .map(|us| us / 1e6)
                .collect();
            if ways.is_empty() || ways.iter().any(|w| *w <= 0.0) {
                bail!("decode reported no memcpy baseline for its load (its log says why): {d}");
            }
            way_names = p["memcpy_ways"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|w| w.as_str())
                .map(str::to_owned)
                .collect();
            if way_names.len() != ways.len() {
                bail!("decode named {} memcpy ways for {} times: {d}", way_names.len(), ways.len());
            }
            ways
        } else {
            let b = match early {
                Some(b) => b,
                None => baseline.as_mut().ok_or_else(|| anyhow!("no baseline"))?.measure()?,
            };
            vec![b.as_secs_f64()]
        };
        let fastest_now = ways.iter().copied().fold(f64::INFINITY, f64::min);
        if !a.json {
            eprintln!(
                "[{}/{total}] {backend}: {bytes} bytes in {:.1} ms; baseline {:.1} ms{}",
                i + 1,
                ti.as_secs_f64() * 1e3,
                fastest_now * 1e3,
                if i == 0 { " (warm-up)" } else { "" }
            );
        }
        if i > 0 {
            times.push(ti.as_secs_f64());
            base_ways.push(ways);
        }
    }
    // What decode paid once, in the warm-up, before its first load from this peer.
    let consumer = nixl_config("kv_consumer", backend, &settings);
    let mut handshake = match &prefill.side_channel {
        Some(sc) => super::bench_handshake::measure(sc, &consumer, &spec, a.pairs)?,
        None => Value::Null,
    };
    drop(decode);
    drop(prefill);
    let mut baseline = baseline.ok_or_else(|| anyhow!("no measured transfer"))?;
    baseline.finish()?;
    // Both moved the same bytes: the rate ratio is the inverse of the time ratio.
    let (paired, fastest) = kvconnect_support::stats::paired_fastest(&base_ways, &times);
    let baseline = match (&baseline, way_names.get(fastest)) {
        (Baseline::Memcpy, Some(way)) => format!("fastest memcpy: {way}"),
        _ => baseline.name().to_owned(),
    };
    let (t, bt, r) = (paired.subject_s, paired.baseline_s, paired.ratio);
    let (g, bg) = (bytes as f64 / t.median.max(1e-9) / 1e9, bytes as f64 / bt.median.max(1e-9) / 1e9);
    let mut out = json!({
        "backend": backend,
        "model": spec.name,
        "tokens": a.tokens,
        "bytes": bytes,
        "pairs": paired.pairs,
        "seconds": t.median,
        "gbps": g,
        "baseline": baseline,
        "baseline_seconds": bt.median,
        "baseline_gbps": bg,
        "ratio": r.median,
        "ratio_q1": r.q1,
        "ratio_q3": r.q3,
        "machine": machine(load_before),
    });
    let used_streams =
        kvconnect_nixl::tcp_data::streams_for(bytes, streams, kvconnect_nixl::tcp_data::STREAM_MIN_BYTES);
    if backend == "tcp" {
        out["streams"] = json!(used_streams);
        out["socket_buffer"] = json!(a.socket_buffer);
    }
    // Once per peer: one handshake, and one producer connection per stream (tcp) or one.
    let conns = if backend == "tcp" { used_streams } else { 1 } as f64;
    let per_peer_ms = handshake["side_channel_ms"]["median"].as_f64().unwrap_or(0.0)
        + conns * handshake["producer_connection_ms"]["median"].as_f64().unwrap_or(0.0);
    if !handshake.is_null() {
        handshake["per_peer_ms"] = json!(per_peer_ms);
        handshake["per_peer_over_one_transfer"] = json!(per_peer_ms / 1e3 / t.median.max(1e-9));
    }
    out["handshake"] = handshake;
    if a.json {
        println!("{out}");
    } else {
        println!(
            "transfer {backend}: {bytes} bytes ({} tokens of {}); median of {} interleaved pairs: {:.2} ms = \
                {g:.2} GB/s; {baseline}: {:.2} ms = {bg:.2} GB/s; ratio {:.3} (quartiles {:.3} .. {:.3}); \
                once per peer: {per_peer_ms:.2} ms of handshakes; {}",
            a.tokens,
            spec.name,
            paired.pairs,
            t.median * 1e3,
            bt.median * 1e3,
            r.median,
            r.q1,
            r.q3,
            out["machine"]
        );
    }
    Ok(())
}

/// The raw NIXL baseline of the transfer of `tokens` tokens (`bytes` of `model`'s KV): the
/// connector's shape (one run per KV layer and K/V part, of the 16-token blocks the
/// transfer engine loads, with spare blocks between runs as its pool has), its source in a
/// second `kvconnect` process.
#[cfg(feature = "nixl")]
fn raw_nixl(model: &kvconnect_api::ModelSpec, tokens: usize, bytes: u64) -> Result<Baseline> {
    use kvconnect_bench::nixl_raw::{RawNixlRead, Shape};
    let mla = model.layers.iter().any(|k| matches!(k, kvconnect_api::AttentionKind::Mla { .. }));
    let runs = model.kv_layers().len() * if mla { 1 } else { 2 };
    // Decode loads all but the last prompt token.
    let blocks = (tokens - 1).div_ceil(16);
    let bytes = bytes as usize;
    let unit = bytes.checked_div(runs * blocks).unwrap_or(0);
    if unit == 0 || unit * runs * blocks != bytes {
        bail!("raw NIXL baseline: {bytes} bytes are not {runs} runs of {blocks} blocks");
    }
    let shape = Shape { runs, run_bytes: blocks * unit, gap_bytes: 8 * unit, unit };
    let exe = std::env::current_exe().context("cannot find the kvconnect executable")?;
    let mut source = Command::new(exe);
    source.args(["bench", "nixl-raw-peer"]).stderr(Stdio::inherit());
    Ok(Baseline::Nixl(RawNixlRead::spawn(shape, source).map_err(|e| anyhow!("raw NIXL baseline: {e}"))?))
}

/// `bench nixl-raw-peer`: the raw NIXL baseline's source process.
fn nixl_raw_peer() -> Result<()> {
    #[cfg(feature = "nixl")]
    {
        kvconnect_bench::nixl_raw::serve_source(std::io::stdin(), std::io::stdout())
            .context("serving the raw NIXL baseline")
    }
    #[cfg(not(feature = "nixl"))]
    bail!("this kvconnect was built without NIXL support (the nixl feature)")
}

/// The 1-minute load average, from /proc/loadavg (None where there is none).
pub(super) fn load_average() -> Option<f64> {
    kvconnect_support::stats::load_average()
}

/// What the figures were measured on: cores, and the load average before and after.
pub(super) fn machine(load_before: Option<f64>) -> Value {
    let mut m = kvconnect_support::stats::Machine::start().finish();
    m.load_average_before = load_before;
    json!(m)
}

fn ttft(a: &TtftArgs) -> Result<()> {
    let backend = backend(&a.backend)?;
    if a.tokens < 2 {
        bail!("--tokens must be at least 2");
    }
    let blocks = (a.tokens.div_ceil(16) + 8).to_string();
    let (prefill, decode) = pair(&a.model, backend, &json!({}), &["--num-blocks", &blocks])?;
    // Bytes of the byte tokenizer's vocabulary, varied so the prompt is not degenerate.
    let prompt = json!((0..a.tokens).map(|i| ((i * 31 + i / 7) % 256) as u32).collect::<Vec<_>>());
    let n = a.pairs.max(1);
    let load_before = load_average();
    let (mut mono, mut disagg, mut decode_side, mut ratios) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut mono_tokens = Value::Null;
    let mut same = true;
    round(&prefill, &decode, &prompt, 1)?; // warm-up: handshake, page faults
    let monolithic = || -> Result<(Value, Duration)> {
        let t0 = Instant::now();
        let m = decode.post(&json!({"prompt": prompt, "max_tokens": 1}))?;
        Ok((m, t0.elapsed()))
    };
    for i in 0..n {
        // Pairs alternate which request runs first.
        let ((m, mt), (d, dt)) = if i % 2 == 0 {
            let m = monolithic()?;
            (m, round(&prefill, &decode, &prompt, 1)?)
        } else {
            let d = round(&prefill, &decode, &prompt, 1)?;
            (monolithic()?, d)
        };
        mono.push(mt.as_secs_f64());
        disagg.push(dt.as_secs_f64());
        ratios.push(dt.as_secs_f64() / mt.as_secs_f64().max(1e-9));
        decode_side.push(d["kvconnect"]["ttft_us"].as_u64().unwrap_or(0) as f64 / 1e6);
        same &= m["choices"][0]["token_ids"] == d["choices"][0]["token_ids"];
        mono_tokens = m["choices"][0]["token_ids"].clone();
        if !a.json {
            eprintln!(
                "[{}/{n}] monolithic {:.1} ms, disaggregated {:.1} ms",
                i + 1,
                mt.as_secs_f64() * 1e3,
                dt.as_secs_f64() * 1e3
            );
        }
    }
    let (m, d, ds, r) = (
        Quartiles::of(mono),
        Quartiles::of(disagg),
        Quartiles::of(decode_side),
        Quartiles::of(ratios.clone()),
    );
    let out = json!({
        "backend": backend,
        "tokens": a.tokens,
        "pairs": ratios.len(),
        "monolithic_ttft_ms": m.median * 1e3,
        "disaggregated_ttft_ms": d.median * 1e3,
        "decode_side_ttft_ms": ds.median * 1e3,
        "ratio": r.median,
        "ratio_q1": r.q1,
        "ratio_q3": r.q3,
        "same_first_token": same,
        "first_token": mono_tokens,
        "machine": machine(load_before),
    });
    if a.json {
        println!("{out}");
    } else {
        println!(
            "ttft {backend}, {} tokens, median of {} interleaved pairs: monolithic {:.1} ms, disaggregated \
                {:.1} ms (prefill + transfer + first decode step; decode side alone {:.1} ms); ratio {:.3} \
                (quartiles {:.3} .. {:.3}); same first token: {same}; {}",
            a.tokens,
            ratios.len(),
            m.median * 1e3,
            d.median * 1e3,
            ds.median * 1e3,
            r.median,
            r.q1,
            r.q3,
            out["machine"]
        );
    }
    Ok(())
}
