//! `kvconnect proxy`: the P/D proxy alone, in front of prefill and decode servers that
//! kvconnect did not start: vLLM servers running `kvconnect.vllm.KvconnectConnector`, or any
//! servers speaking vLLM's P/D proxy protocol. Requests are routed as `kvconnect up`'s proxy
//! routes them (crate `kvconnect-proxy`); the client's body goes on verbatim, so each server checks its
//! own parameters. The proxy watches each server's `/health` (`kvconnect_proxy::health`): a
//! server that died or hangs is not picked until it answers again.

use anyhow::{anyhow, Context, Result};
use kvconnect_api::Role;
use kvconnect_deployment::exit::Exit;
use kvconnect_openai::{gate, serve};
use kvconnect_proxy::backends::Backends;
use kvconnect_proxy::first_token::FirstToken;
use kvconnect_proxy::health;
use kvconnect_proxy::kv_subscriber::{follow, EventSource};
use kvconnect_proxy::routing::{KvRouter, Routing};
use kvconnect_proxy::Proxy;
use serde_json::json;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// `kvconnect proxy`.
#[derive(clap::Args, Debug, Clone)]
pub struct ProxyArgs {
    /// A prefill server's HTTP address (`http://HOST:PORT` or `HOST:PORT`); repeat for
    /// several (round-robin).
    #[arg(long, value_name = "URL", required = true)]
    pub prefill: Vec<String>,
    /// A decode server's HTTP address; repeat for several.
    #[arg(long, value_name = "URL", required = true)]
    pub decode: Vec<String>,
    /// Address and port the proxy listens on (port 0: any free port; the address line on
    /// stdout says which).
    #[arg(long, default_value = "127.0.0.1:8000", value_name = "HOST:PORT")]
    pub listen: SocketAddr,
    /// Seconds one request to a server may take.
    #[arg(long = "timeout-s", default_value_t = 300)]
    pub timeout_s: u64,
    /// API key clients must send, and the proxy sends the servers (default:
    /// $KVCONNECT_API_KEY, else $VLLM_API_KEY, else none).
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_key: Option<String>,
    /// How prefill servers are picked: round-robin, or kv (by the servers' KV cache events,
    /// each prompt's token ids from the body or a prefill server's /tokenize; round-robin,
    /// said so, while there are no events or ids to go by).
    #[arg(long, value_enum, default_value = "round-robin")]
    pub routing: Routing,
    /// Which server's token a streamed completion starts with: prefill's, sent as soon as
    /// prefill answers, decode continuing after it (time to first token: prefill's round
    /// trip), or decode's (vLLM's P/D protocol, where decode computes the prompt's last token
    /// again). Requests whose output prefill's token could change (chat, a seed, stop strings,
    /// ...), and servers whose transfer params do not say they hold the whole prompt (vLLM's
    /// NixlConnector), keep decode's; /metrics counts which and why.
    #[arg(long = "first-token", value_enum, default_value = "prefill")]
    pub first_token: FirstToken,
    /// With --routing kv: a prefill server's KV event publisher, `tcp://HOST:PORT`, or
    /// `tcp://HOST:PORT,tcp://HOST:PORT` with its replay endpoint; one per --prefill, in the
    /// same order.
    #[arg(long = "kv-events", value_name = "ENDPOINT[,REPLAY]", requires = "routing")]
    pub kv_events: Vec<String>,
    /// With --routing kv: the prefill engines' block size in tokens (the router's hashing
    /// unit).
    #[arg(
        long = "kv-block-size",
        value_name = "TOKENS",
        default_value_t = 16,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub kv_block_size: u32,
}

/// The event sources of `--kv-events`, one per prefill server named `names`.
pub fn event_sources(flags: &[String], names: &[String]) -> Result<Vec<EventSource>, String> {
    if flags.len() != names.len() {
        return Err(format!(
            "--kv-events given {} times for {} --prefill servers: give one per prefill server, in the same \
                order",
            flags.len(),
            names.len()
        ));
    }
    let tcp = |e: &str| {
        let ok = e
            .strip_prefix("tcp://")
            .and_then(|r| r.rsplit_once(':'))
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        ok.then(|| e.to_owned()).ok_or_else(|| {
            format!("--kv-events {e}: expected tcp://HOST:PORT (a vLLM or kvconnect KV events publisher)")
        })
    };
    flags
        .iter()
        .zip(names)
        .map(|(f, name)| {
            let (pub_ep, replay) = match f.split_once(',') {
                Some((a, b)) => (tcp(a.trim())?, Some(tcp(b.trim())?)),
                None => (tcp(f.trim())?, None),
            };
            Ok(EventSource { name: name.clone(), endpoint: pub_ep, replay })
        })
        .collect()
}

/// `http://HOST:PORT`, `HOST:PORT` or either with a trailing `/`, as the proxy's client
/// takes it (`HOST:PORT`).
pub fn server_addr(flag: &str, url: &str) -> Result<String, String> {
    let t = url.trim().trim_end_matches('/');
    let rest = t.strip_prefix("http://").unwrap_or(t);
    let bad = || format!("--{flag} {url}: expected http://HOST:PORT or HOST:PORT (plain HTTP, no path)");
    if rest.contains("://") || rest.contains('/') || rest.is_empty() {
        return Err(bad());
    }
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(bad());
    }
    Ok(rest.to_owned())
}

/// Runs `kvconnect proxy` until SIGINT or SIGTERM.
pub fn run(a: &ProxyArgs) -> Result<()> {
    let mut servers = Vec::new();
    for (role, urls) in [(Role::Prefill, &a.prefill), (Role::Decode, &a.decode)] {
        for (i, u) in urls.iter().enumerate() {
            let addr = server_addr(role.name(), u).map_err(|e| Exit::bad_input(anyhow!(e)))?;
            servers.push((role, format!("{role}-{i}"), addr));
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let r = rt.block_on(serve(a, servers));
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}

async fn serve(a: &ProxyArgs, servers: Vec<(Role, String, String)>) -> Result<()> {
    let stop = kvconnect_deployment::shutdown::shutdown_signal()?;
    let listener = tokio::net::TcpListener::bind(a.listen).await.map_err(|e| {
        Exit::bad_input(anyhow!(
            "cannot bind the proxy on {}: {e}; pick another --listen (port 0 = any free port)",
            a.listen
        ))
    })?;
    let addr = listener.local_addr().context("proxy address")?;
    let of = |r: Role| servers.iter().filter(|s| s.0 == r).map(|s| s.2.clone()).collect::<Vec<_>>();
    let line =
        json!({"proxy": format!("http://{addr}"), "prefill": of(Role::Prefill), "decode": of(Role::Decode)});
    let key = gate::api_key(a.api_key.as_deref());
    let gate = gate::Gate::new(key.clone(), gate::DEFAULT_MAX_IN_FLIGHT);
    let backends = Arc::new(Backends::new(servers));
    // No supervisor here: the proxy watches its servers' /health itself, so that one that died
    // is no longer picked (nor held in the KV index) and one that came back is again.
    let watch = tokio::spawn(health::watch(backends.clone(), key.clone()));
    let mut proxy = Proxy::new(backends, Duration::from_secs(a.timeout_s.max(1)));
    proxy.server_key = key;
    proxy.verbatim = true;
    proxy.first_token = a.first_token;
    let mut followers = Vec::new();
    if a.routing == Routing::Kv {
        let names: Vec<String> = (0..a.prefill.len()).map(|i| format!("{}-{i}", Role::Prefill)).collect();
        let sources = if a.kv_events.is_empty() {
            Vec::new()
        } else {
            event_sources(&a.kv_events, &names).map_err(|e| Exit::bad_input(anyhow!(e)))?
        };
        // The servers' bodies go on verbatim; the router hashes each prompt's ids as a prefill
        // server's /tokenize gives them (kvconnect_proxy::tokenize).
        let kv = KvRouter::new(names, a.kv_block_size, proxy.metrics.router.clone())
            .map_err(|e| Exit::bad_input(anyhow!(e)))?;
        let kv = Arc::new(kv);
        followers = sources.into_iter().map(|s| tokio::spawn(follow(kv.clone(), s))).collect();
        proxy.kv = Some(kv);
    }
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").context("cannot write the address line to stdout")?;
        out.flush().context("cannot flush stdout")?;
    }
    eprintln!(
        "kvconnect proxy: on http://{addr} in front of {} prefill and {} decode servers; Ctrl-C to stop",
        a.prefill.len(),
        a.decode.len()
    );
    serve::serve(
        listener,
        gate.wrap(kvconnect_proxy::router(Arc::new(proxy))),
        serve::DEFAULT_HEADER_TIMEOUT,
        serve::DEFAULT_MAX_CONNECTIONS,
        stop,
    )
    .await;
    followers.iter().for_each(|f| f.abort());
    watch.abort();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_event_sources_are_one_tcp_endpoint_per_prefill_server() {
        let names = vec!["prefill-0".to_owned(), "prefill-1".to_owned()];
        let flags = vec!["tcp://h:5557".to_owned(), "tcp://h:5558,tcp://h:5559".to_owned()];
        let s = event_sources(&flags, &names).unwrap();
        assert_eq!((s[0].endpoint.as_str(), s[0].replay.as_deref()), ("tcp://h:5557", None));
        assert_eq!((s[1].name.as_str(), s[1].replay.as_deref()), ("prefill-1", Some("tcp://h:5559")));
        let e = event_sources(&flags[..1], &names).unwrap_err();
        assert!(e.contains("one per prefill server"), "{e}");
        for bad in ["h:5557", "tcp://h", "tcp://:5", "tcp://h:0", "tcp://h:1,ipc:///x"] {
            let e = event_sources(&[bad.to_owned(), flags[0].clone()], &names).unwrap_err();
            assert!(e.contains("expected tcp://HOST:PORT"), "{bad}: {e}");
        }
    }

    #[test]
    fn server_addresses_are_plain_http_host_and_port() {
        assert_eq!(server_addr("prefill", "http://127.0.0.1:8100/").unwrap(), "127.0.0.1:8100");
        assert_eq!(server_addr("decode", "localhost:9").unwrap(), "localhost:9");
        for bad in ["https://h:1", "http://h:1/v1", "h", "h:0", "h:x", ":5", ""] {
            let e = server_addr("decode", bad).unwrap_err();
            assert!(e.contains("expected http://HOST:PORT"), "{bad}: {e}");
        }
    }
}
