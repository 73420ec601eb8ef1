//! `kvconnect up`: the whole P/D deployment in one command. Starts the prefill and decode
//! servers as child processes of this binary (`worker` subcommand), runs the P/D proxy in
//! this process, prints where it listens, and serves until SIGINT/SIGTERM; or, with
//! `--workload N`, sends N built-in requests through the proxy, checks each answer against
//! the monolithic reference engine run in-process, prints a report and exits.

pub mod files;
pub mod report;
pub mod supervisor;
pub mod workload;

use anyhow::{anyhow, Context, Result};
use kvconnect_api::Role;
use kvconnect_deployment::exit::Exit;
use kvconnect_deployment::Deployment;
use kvconnect_openai::{gate, serve};
use kvconnect_proxy::backends::Backends;
use kvconnect_proxy::{client, Proxy};
use report::{Comparison, Report, Sample};
use serde_json::{json, Value};
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use supervisor::{Launch, RestartPolicy, Supervisor};
use workload::{Item, Prompts};

/// Arguments of `kvconnect up`.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// A deployment file (TOML); default: the embedded examples/deployments/default-up.toml
    /// (reference engine, prefill PdConnector[LMCache, NIXL shm], decode NIXL shm).
    #[arg(value_name = "DEPLOYMENT.toml")]
    pub deployment: Option<PathBuf>,
    /// Number of prefill workers.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub prefill: u16,
    /// Number of decode workers.
    #[arg(long, value_name = "M", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub decode: u16,
    /// Bind address of the proxy and the workers.
    #[arg(long, value_name = "IP", default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Proxy port (0 = any free port; the chosen one is printed). Workers always take free ports.
    #[arg(long, value_name = "P", default_value_t = 0)]
    pub port: u16,
    /// Negotiate each worker alone (as independently started vLLM workers do) instead of
    /// jointly from the deployment; a mismatch then shows at the handshake.
    #[arg(long)]
    pub independent: bool,
    /// KV blocks per cache group on each worker (16 tokens a block).
    #[arg(long = "num-blocks", value_name = "N", default_value_t = 256)]
    pub num_blocks: u32,
    /// Send N built-in requests through the proxy, print a report and exit (non-zero when
    /// any output differs from the monolithic engine).
    #[arg(long, value_name = "N")]
    pub workload: Option<usize>,
    /// Which prompts the workload sends.
    #[arg(long, value_enum, default_value = "mixed")]
    pub prompts: Prompts,
    /// How many distinct long prefixes (600 tokens) the workload's shared prompts start with;
    /// each request's is a fixed pseudo-random draw. Fewer repeats of each prefix make
    /// where a request lands matter more (KV routing against round-robin).
    #[arg(long, value_name = "N", default_value_t = workload::DEFAULT_PREFIXES,
          value_parser = clap::value_parser!(u16).range(1..=4096), requires = "workload")]
    pub prefixes: u16,
    /// Workload requests in flight at once.
    #[arg(long, value_name = "C", default_value_t = 4)]
    pub concurrency: usize,
    /// Also start one monolithic worker and send it the same workload; report TTFT ratios.
    #[arg(long = "compare-monolithic", requires = "workload")]
    pub compare_monolithic: bool,
    /// Print the workload report as JSON.
    #[arg(long, requires = "workload")]
    pub json: bool,
    /// API key clients of the proxy must send (`Authorization: Bearer <key>`), as vLLM's
    /// flag; the workers require it too and get it through their environment (default:
    /// $KVCONNECT_API_KEY, else $VLLM_API_KEY, else none).
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_key: Option<String>,
    /// How the proxy picks prefill workers: round-robin, or kv (by the workers' KV cache
    /// events; round-robin, said so, while there are none to go by).
    #[arg(long, value_enum, default_value = "round-robin")]
    pub routing: kvconnect_proxy::routing::Routing,
    /// Seconds between health checks of each worker; a worker that reports itself
    /// unhealthy, or misses five checks in a row, is restarted.
    #[arg(
        long = "health-interval",
        value_name = "SECS",
        default_value_t = 1.0,
        value_parser = positive_seconds
    )]
    pub health_interval: f64,
}

fn positive_seconds(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 3600.0 => Ok(v),
        _ => Err(format!("'{s}' is not a number of seconds between 0 and 3600")),
    }
}

/// Runs `kvconnect up`.
pub fn run(a: &UpArgs) -> Result<()> {
    if a.concurrency == 0 {
        return Err(Exit::bad_input(anyhow!("--concurrency must be at least 1")));
    }
    if a.num_blocks == 0 {
        return Err(Exit::bad_input(anyhow!("--num-blocks must be a positive integer, got 0")));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let r = rt.block_on(up(a));
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}

async fn up(a: &UpArgs) -> Result<()> {
    let mut stop = Box::pin(kvconnect_deployment::shutdown::shutdown_signal()?);
    let files = files::DeploymentFiles::resolve(a.deployment.as_deref())?;
    // Refuse a broken file before any process starts.
    let deployment = Deployment::load(&files.path).map_err(|e| Exit::bad_input(anyhow!(e)))?;
    deployment.for_kvconnect_servers().map_err(|e| Exit::bad_input(anyhow!(e)))?;
    // The proxy's port first: a port in use is refused before any server starts.
    let want = SocketAddr::new(a.host, a.port);
    let listener = tokio::net::TcpListener::bind(want).await.map_err(|e| {
        Exit::bad_input(anyhow!(
            "cannot bind the proxy on {want}: {e}; pick another --port (0 = any free port)"
        ))
    })?;
    let addr = listener.local_addr().context("proxy address")?;
    let pid = std::process::id();
    // One secret for the deployment: the caller's, else a fresh one. Servers get it in their
    // environment, and decode servers the list of this deployment's prefill engines.
    let secret = match kvconnect_deployment::secret::data_plane_secret(None)? {
        Some(s) => s,
        None => kvconnect_dataplane::auth::Secret::generate().map_err(|e| anyhow!("kvconnect up: {e}"))?,
    };
    let producers: Vec<String> = (0..a.prefill).map(|i| format!("up{pid}-prefill-{i}@127.0.0.1")).collect();
    let mut launches = Vec::new();
    for (role, n) in [(Role::Prefill, a.prefill), (Role::Decode, a.decode)] {
        for i in 0..n {
            let mut l =
                launch(a, &files.path, role, role.name(), format!("up{pid}-{role}-{i}"), true, &secret);
            if role == Role::Decode && !producers.is_empty() {
                l.kv_producers = Some(producers.join(","));
            }
            if role == Role::Prefill && a.routing == kvconnect_proxy::routing::Routing::Kv {
                l.kv_events = Some((free_endpoint(a.host)?, free_endpoint(a.host)?));
            }
            launches.push(l);
        }
    }
    if a.compare_monolithic {
        launches.push(launch(
            a,
            &files.path,
            Role::Decode,
            "monolithic",
            format!("up{pid}-monolithic"),
            false,
            &secret,
        ));
    }
    let key = gate::api_key(a.api_key.as_deref());
    let gate = gate::Gate::new(key.clone(), gate::DEFAULT_MAX_IN_FLIGHT);
    let backends = Arc::new(Backends::default());
    let event_sources: Vec<kvconnect_proxy::kv_subscriber::EventSource> = launches
        .iter()
        .filter_map(|l| {
            let (endpoint, replay) = l.kv_events.clone()?;
            Some(kvconnect_proxy::kv_subscriber::EventSource {
                name: l.engine_id.clone(),
                endpoint,
                replay: Some(replay),
            })
        })
        .collect();
    let starting = Supervisor::start(
        launches,
        backends.clone(),
        RestartPolicy::default(),
        tokio::runtime::Handle::current(),
    );
    let (mut sup, started, mut gave_up) = tokio::select! {
        r = starting => r?,
        _ = &mut stop => return Err(anyhow!("interrupted while starting the workers")),
    };
    let of = |label: &str| -> Vec<String> {
        started.iter().filter(|s| s.label == label).map(|s| s.http.clone()).collect()
    };
    let (prefill, decode, mono) = (of("prefill"), of("decode"), of("monolithic"));
    let mut proxy = Proxy::new(backends, Duration::from_secs(300));
    proxy.server_key = key.clone();
    if a.routing == kvconnect_proxy::routing::Routing::Kv {
        let names = (0..a.prefill).map(|i| format!("up{pid}-{}-{i}", Role::Prefill)).collect();
        // The engines' block size: the deployment's, else the reference engine's 16.
        let unit = deployment.prefill.options.block_size.unwrap_or(16);
        let kv = kvconnect_proxy::routing::KvRouter::new(names, unit, proxy.metrics.router.clone())
            .map_err(|e| Exit::bad_input(anyhow!(e)))?;
        let kv = Arc::new(kv);
        // The subscribers end with the runtime, when up does.
        for source in event_sources {
            tokio::spawn(kvconnect_proxy::kv_subscriber::follow(kv.clone(), source));
        }
        proxy.kv = Some(kv);
    }
    let router = proxy.kv.as_ref().map(|_| proxy.metrics.router.clone());
    let proxy = Arc::new(proxy);
    let pids: Vec<u32> = started.iter().map(|s| s.pid).collect();
    let line = json!({
        "proxy": format!("http://{addr}"), "prefill": prefill, "decode": decode,
        "monolithic": mono, "worker_pids": pids,
    });
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").context("cannot write the address line to stdout")?;
        out.flush().context("cannot flush stdout")?;
    }
    let (quit_tx, quit_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        serve::serve(
            listener,
            gate.wrap(kvconnect_proxy::router(proxy)),
            serve::DEFAULT_HEADER_TIMEOUT,
            serve::DEFAULT_MAX_CONNECTIONS,
            async {
                let _ = quit_rx.await;
            },
        )
        .await
    });

    let result = match a.workload {
        Some(n) => {
            let proxy_addr = addr.to_string();
            tokio::select! {
                r = run_workload(
                    a, n, &proxy_addr, mono.first().cloned(), key.as_deref(), &deployment.model_path, router,
                ) => r,
                _ = &mut stop => Err(anyhow!("interrupted during the workload")),
                why = &mut gave_up => {
                    Err(anyhow!("{}", why.unwrap_or_else(|_| "the supervisor stopped".into())))
                }
            }
        }
        None => {
            eprintln!(
                "kvconnect up: proxy on http://{addr} ({} prefill, {} decode); Ctrl-C to stop\n  curl \
                    http://{addr}/v1/completions -H 'Content-Type: application/json' -d '{{\"prompt\": \
                    \"Hello\", \"max_tokens\": 8}}'",
                prefill.len(),
                decode.len()
            );
            tokio::select! {
                _ = &mut stop => Ok(()),
                why = &mut gave_up => Err(anyhow!("{}; stopping the rest", why.unwrap_or_else(|_| "the \
                    supervisor stopped".into()))),
            }
        }
    };
    let _ = quit_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    let _ = tokio::task::spawn_blocking(move || sup.stop()).await;
    drop(files);
    result
}

fn launch(
    a: &UpArgs,
    deployment: &std::path::Path,
    role: Role,
    label: &str,
    engine_id: String,
    behind_proxy: bool,
    secret: &kvconnect_dataplane::auth::Secret,
) -> Launch {
    Launch {
        deployment: deployment.to_path_buf(),
        role,
        label: label.to_owned(),
        joint: !a.independent,
        engine_id,
        num_blocks: a.num_blocks,
        host: a.host,
        behind_proxy,
        api_key: gate::api_key(a.api_key.as_deref()),
        secret: secret.clone(),
        kv_producers: None,
        kv_events: None,
    }
}

/// A free local TCP port for a worker's KV event sockets (`tcp://HOST:PORT`), below the
/// kernel's ephemeral range. The worker binds it only later, and again after each restart; a
/// port from the range (what binding port 0 gives) may meanwhile go to any outgoing
/// connection on this machine, and the worker then fails with `Address already in use`. Below
/// the range the kernel hands out none; only another program's own choice can collide.
fn free_endpoint(host: IpAddr) -> Result<String> {
    use std::hash::{BuildHasher, Hasher};
    let (first, end) = below_ephemeral_range();
    // A random start (std's per-process hash keys), so that two `kvconnect up` on one
    // machine do not try the same ports in the same order.
    let start = std::collections::hash_map::RandomState::new().build_hasher().finish();
    let span = u64::from(end - first);
    for i in 0..span.min(200) {
        let port = first + ((start.wrapping_add(i.wrapping_mul(7919))) % span) as u16;
        if let Ok(l) = std::net::TcpListener::bind(SocketAddr::new(host, port)) {
            return Ok(format!("tcp://{}", l.local_addr().context("a free port's address")?));
        }
    }
    Err(anyhow!(
        "cannot find a free port on {host} for a worker's KV events among ports {first}-{} \
         (below the kernel's ephemeral range, /proc/sys/net/ipv4/ip_local_port_range); free \
         some, or run fewer workers with --routing kv",
        end - 1
    ))
}

/// The ports `free_endpoint` picks from: 12,000 below the kernel's ephemeral range, not below
/// 1024 (where binding needs privileges).
fn below_ephemeral_range() -> (u16, u16) {
    let lo = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse::<u16>().ok()))
        .unwrap_or(32768);
    let end = lo.max(1024 + 1000);
    (end.saturating_sub(12000).max(1024), end)
}

fn sample(v: &Value, elapsed: Duration, truth: &[u32], direct: bool) -> Sample {
    let k = &v["kvconnect"];
    let ids: Vec<u32> = v["choices"][0]["token_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok())).collect())
        .unwrap_or_default();
    Sample {
        ttft_us: if direct {
            k["ttft_us"].as_u64().unwrap_or(0)
        } else {
            k["proxy"]["ttft_us"].as_u64().unwrap_or(0)
        },
        total_us: elapsed.as_micros() as u64,
        tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        loaded_tokens: k["num_external_tokens"].as_u64().unwrap_or(0),
        decode_ttft_us: k["ttft_us"].as_u64().unwrap_or(0),
        cache_sources: serde_json::from_value(k["prefill"]["cache_sources"].clone()).unwrap_or_default(),
        matches: ids == truth,
        recomputed: !direct && recomputed_on_decode(v),
        error: None,
    }
}

/// Decode computed the prompt of a P/D request instead of loading it: it says so
/// (`kv_load.recomputed`), or it neither loaded nor found in its cache a prompt of more than
/// one token (the last is always computed).
fn recomputed_on_decode(v: &Value) -> bool {
    let k = &v["kvconnect"];
    let got = k["num_external_tokens"].as_u64().unwrap_or(0) + k["num_cached_tokens"].as_u64().unwrap_or(0);
    k["kv_load"]["recomputed"] == true || (got == 0 && v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 1)
}

/// Sends every item to `addr` with `concurrency` in flight; samples in item order.
async fn send_all(
    addr: &str,
    items: &[Item],
    truth: &[Vec<u32>],
    concurrency: usize,
    direct: bool,
    what: &str,
    key: Option<&str>,
) -> Vec<Sample> {
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let total = items.len();
    // Drawn on stderr only when it is a terminal.
    let bar = indicatif::ProgressBar::new(total as u64).with_message(what.to_owned());
    if let Ok(style) = indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len}") {
        bar.set_style(style.progress_chars("#>."));
    }
    let auth = key.map(|k| format!("Bearer {k}"));
    let mut tasks = Vec::with_capacity(total);
    for (it, t) in items.iter().zip(truth) {
        let (sem, bar, addr, it, t) = (sem.clone(), bar.clone(), addr.to_owned(), it.clone(), t.clone());
        let auth = auth.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await;
            let t0 = Instant::now();
            let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
            let call = client::Call {
                headers: &headers,
                ..client::Call::new(&addr, "POST", it.path, Some(&it.body), Duration::from_secs(300))
            };
            let r = client::call(call).await;
            let s = match r {
                Ok(r) if r.status == 200 => sample(&r.json(), t0.elapsed(), &t, direct),
                Ok(r) => {
                    Sample { error: Some(format!("HTTP {}: {}", r.status, r.body)), ..Sample::default() }
                }
                Err(e) => Sample { error: Some(e.to_string()), ..Sample::default() },
            };
            bar.inc(1);
            s
        }));
    }
    let mut out = Vec::with_capacity(total);
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| Sample {
            error: Some(format!("request task failed: {e}")),
            ..Sample::default()
        }));
    }
    bar.finish();
    out
}

async fn run_workload(
    a: &UpArgs,
    n: usize,
    proxy: &str,
    mono: Option<String>,
    key: Option<&str>,
    model_path: &std::path::Path,
    router: Option<kvconnect_proxy::metrics::RouterMetrics>,
) -> Result<()> {
    let model = workload::reference_model(model_path)?;
    let items = workload::items(n, a.prompts, a.prefixes);
    let it2 = items.clone();
    let m2 = model.clone();
    let truth = tokio::task::spawn_blocking(move || workload::ground_truth(&it2, 0, m2))
        .await
        .context("ground truth task")??;
    let prompts = match a.prompts {
        Prompts::Unique => "unique".to_owned(),
        p => format!("{} ({} prefixes)", format!("{p:?}").to_lowercase(), a.prefixes),
    };
    // With a monolithic server to compare against, the two run in interleaved rounds of
    // `concurrency` requests (which of the two goes first alternates), so both see the same
    // machine load; each prompt's two TTFTs form a pair.
    let round = if mono.is_some() { a.concurrency.max(1) } else { items.len().max(1) };
    let (mut samples, mut mono_samples) = (Vec::with_capacity(items.len()), Vec::new());
    let mut pd_seconds = 0.0;
    for (k, (batch, truth)) in items.chunks(round).zip(truth.chunks(round)).enumerate() {
        let mono_first = k % 2 == 1;
        if let (true, Some(m)) = (mono_first, &mono) {
            mono_samples.extend(send_all(m, batch, truth, a.concurrency, true, "monolithic", key).await);
        }
        let t0 = Instant::now();
        samples.extend(send_all(proxy, batch, truth, a.concurrency, false, "disaggregated", key).await);
        pd_seconds += t0.elapsed().as_secs_f64();
        if let (false, Some(m)) = (mono_first, &mono) {
            mono_samples.extend(send_all(m, batch, truth, a.concurrency, true, "monolithic", key).await);
        }
    }
    let mut report =
        Report::new(&samples, &prompts, a.concurrency, pd_seconds, workload::kv_bytes_per_token(&model)?);
    if mono.is_some() {
        report.compare_monolithic = Some(Comparison::of(&samples, &mono_samples, &report.ttft_ms));
    }
    report.router = router.map(|r| r.tally());
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report).context("report as JSON")?)
            .context("stdout")?;
    } else {
        write!(out, "{}", report.text()).context("stdout")?;
    }
    out.flush().context("stdout")?;
    if report.all_correct() {
        Ok(())
    } else {
        Err(anyhow::Error::new(Exit {
            code: 1,
            error: Some(anyhow!(
                "{} of {} requests failed or differ from the monolithic engine, and {} P/D requests \
                    recomputed their prompt on decode instead of loading its KV",
                report.failed + report.mismatches,
                report.requests,
                report.recomputed_requests
            )),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_event_ports_come_from_below_the_ephemeral_range_and_differ() {
        let (first, end) = below_ephemeral_range();
        assert!(first >= 1024 && first < end, "{first}..{end}");
        let host: IpAddr = "127.0.0.1".parse().unwrap();
        let port = |e: &str| e.rsplit(':').next().unwrap().parse::<u16>().unwrap();
        let a = free_endpoint(host).unwrap();
        // Held, so the next pick must be another port.
        let _held = std::net::TcpListener::bind(("127.0.0.1", port(&a))).unwrap();
        let b = free_endpoint(host).unwrap();
        assert!(a.starts_with("tcp://127.0.0.1:"), "{a}");
        for e in [&a, &b] {
            assert!((first..end).contains(&port(e)), "{e} outside {first}..{end}");
        }
        assert_ne!(a, b);
    }
}
