//! `kvconnect worker`: runs one prefill or decode server, negotiated from a deployment file
//! (alone, or jointly with its peer's config with `--joint`) or from a kv-transfer-config and
//! a model, alone, as vLLM does.

use super::config_arg::read_config;
use anyhow::{anyhow, bail, Context, Result};
use kvconnect_api::negotiate::EngineOptions;
use kvconnect_api::{KvTransferConfig, ModelSpec, Role};
use kvconnect_deployment::secret::data_plane_secret;
use kvconnect_deployment::{negotiate_alone, negotiate_role, Deployment, Negotiating};
use kvconnect_openai::{gate, serve};
use kvconnect_registry::Registry;
use kvconnect_server::producers::Producers;
use kvconnect_server::sidechannel::{
    SideChannelConfig, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_FRAME, DEFAULT_READ_TIMEOUT,
};
use kvconnect_server::{run as run_server, ServerSpec};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

/// Arguments of `kvconnect worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerArgs {
    /// A deployment file (TOML); with --role, runs that role's worker.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["kv_transfer_config", "model"])]
    pub deployment: Option<PathBuf>,
    /// prefill or decode (default from kv_role: kv_producer = prefill, kv_consumer = decode).
    #[arg(long, value_name = "prefill|decode")]
    pub role: Option<String>,
    /// Negotiate jointly with the peer role's config from the deployment file.
    #[arg(long, requires = "deployment")]
    pub joint: bool,
    /// The worker's vLLM --kv-transfer-config JSON, or a file holding it (negotiated alone).
    #[arg(long = "kv-transfer-config", value_name = "JSON|FILE", requires = "model")]
    pub kv_transfer_config: Option<String>,
    /// The model's config.json (the reference engine's, or any model with --synthetic-kv).
    #[arg(long, value_name = "CONFIG.json")]
    pub model: Option<PathBuf>,
    /// Engine options, with --kv-transfer-config (a deployment file sets its own).
    #[command(flatten)]
    pub engine: super::engine_args::EngineArgs,
    /// Tensor-parallel size (with --kv-transfer-config; a deployment file sets `tp_size`):
    /// the KV heads are split across this many ranks, each with its own KV regions.
    #[arg(long = "tp-size", value_name = "N", default_value_t = 1, conflicts_with = "deployment")]
    pub tp_size: u32,
    /// HTTP API bind address.
    #[arg(long, value_name = "IP", default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// HTTP API port (0 = any free port; the chosen one is printed).
    #[arg(long, value_name = "P", default_value_t = 0)]
    pub port: u16,
    /// Side-channel bind address (loopback unless you need another host to reach it).
    #[arg(long = "side-channel-host", value_name = "IP", default_value = "127.0.0.1")]
    pub side_channel_host: IpAddr,
    /// Side-channel port (0 = any free port; the chosen one is printed).
    #[arg(long = "side-channel-port", value_name = "P", default_value_t = 0)]
    pub side_channel_port: u16,
    /// Seconds a side-channel peer may take to start a frame, then to send it whole, and to
    /// take each answer; its connection is closed past that.
    #[arg(long = "side-channel-timeout", value_name = "SECONDS", default_value_t =
        DEFAULT_READ_TIMEOUT.as_secs_f64())]
    pub side_channel_timeout: f64,
    /// Side-channel connections served at once; more are closed at once.
    #[arg(long = "side-channel-max-connections", value_name = "N", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub side_channel_max_connections: usize,
    /// A file holding the deployment's data-plane secret (mode 0600; the same on every
    /// worker). Default: $KVCONNECT_SIDE_CHANNEL_TOKEN. Required when the side channel or the
    /// nixl listener binds beyond loopback. Never given on the command line itself.
    #[arg(long = "secret-file", value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Decode: the producers KV may be loaded from, comma-separated `[ENGINE@]IP[:PORT]` (their
    /// side-channel addresses). Default: `kv_producers` of the deployment file, else only
    /// producers on this host.
    #[arg(long = "kv-producers", value_name = "LIST")]
    pub kv_producers: Option<String>,
    /// Engine id (default: engine_id from the config, else `<role>-<pid>`).
    #[arg(long = "engine-id", value_name = "ID")]
    pub engine_id: Option<String>,
    /// KV blocks per cache group.
    #[arg(long = "num-blocks", value_name = "N", default_value_t = 1024)]
    pub num_blocks: u32,
    /// Weight seed of the reference engine (prefill and decode must match).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
    /// Move synthetic KV instead of running the reference model (transfer benchmarks).
    #[arg(long = "synthetic-kv")]
    pub synthetic_kv: bool,
    /// API key clients must send as `Authorization: Bearer <key>` on /v1 routes (as vLLM's
    /// flag; default: $KVCONNECT_API_KEY, else $VLLM_API_KEY, else none).
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_key: Option<String>,
    /// Requests handled at once; more get 503 instead of waiting in an unbounded queue.
    #[arg(long = "max-concurrent-requests", value_name = "N", default_value_t = gate::DEFAULT_MAX_IN_FLIGHT)]
    pub max_concurrent_requests: usize,
    /// The model name clients use (`model` in requests, `GET /v1/models`), as vLLM's flag;
    /// default: `served_model_name` of the deployment file, else the config's
    /// `_name_or_path`, else the name of the directory holding config.json.
    #[arg(long = "served-model-name", value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Keep the KV of full prompt blocks for later prompts with the same prefix (vLLM's flag;
    /// also `enable_prefix_caching = true` in a deployment file's role section).
    #[arg(long = "enable-prefix-caching")]
    pub enable_prefix_caching: bool,
    /// The largest request body taken (bytes); larger ones get 413.
    #[arg(long = "max-request-body-bytes", value_name = "N", default_value_t = gate::DEFAULT_MAX_BODY_BYTES)]
    pub max_request_body_bytes: usize,
    /// Seconds a client may take to send a request's head (line and headers); slower ones,
    /// and idle kept-alive connections, are closed.
    #[arg(long = "request-header-timeout", value_name = "SECONDS", default_value_t =
        serve::DEFAULT_HEADER_TIMEOUT.as_secs_f64())]
    pub request_header_timeout: f64,
    /// Seconds a client may take to send a request's body; slower ones get 408.
    #[arg(long = "request-body-timeout", value_name = "SECONDS", default_value_t =
        gate::DEFAULT_BODY_TIMEOUT.as_secs_f64())]
    pub request_body_timeout: f64,
    /// Seconds a whole request may take (its body, its run, its streamed answer); past it a
    /// whole answer is 504, a stream ends with an error event, and the request is cancelled.
    #[arg(long = "request-timeout", value_name = "SECONDS", default_value_t =
        gate::DEFAULT_RUN_TIMEOUT.as_secs_f64())]
    pub request_timeout: f64,
    /// HTTP connections open at once (idle kept-alive ones count); past it a new connection
    /// is answered 503 and closed.
    #[arg(long = "max-connections", value_name = "N", default_value_t = serve::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Seconds a handshake with a peer may take.
    #[arg(long = "handshake-timeout", value_name = "SECONDS", default_value_t = 10.0)]
    pub handshake_timeout: f64,
    /// Publish KV cache events (the prefix cache's and the connector's tiers') as vLLM's
    /// `--kv-events-config` zmq publisher does: msgpack `KVEventBatch`es on a ZeroMQ PUB
    /// socket bound here, e.g. `tcp://*:5557`.
    #[arg(long = "kv-events-endpoint", value_name = "tcp://HOST:PORT")]
    pub kv_events_endpoint: Option<String>,
    /// The ROUTER socket that answers replay requests for missed batches (vLLM's
    /// `replay_endpoint`), e.g. `tcp://*:5558`.
    #[arg(
        long = "kv-events-replay-endpoint",
        value_name = "tcp://HOST:PORT",
        requires = "kv_events_endpoint"
    )]
    pub kv_events_replay_endpoint: Option<String>,
    /// The topic frame of every KV event message (vLLM's `topic`).
    #[arg(
        long = "kv-events-topic",
        value_name = "TOPIC",
        default_value = "",
        requires = "kv_events_endpoint"
    )]
    pub kv_events_topic: String,
}

fn options(a: &ServerArgs) -> Result<EngineOptions> {
    let mut o = a.engine.options(a.tp_size)?;
    // The engine's ranks are threads of this process behind one connector.
    o.ranks_per_worker = a.tp_size;
    Ok(o)
}

/// Device KV (`kv_buffer_device = "cuda"`) needs a build with the `cuda` feature; say so
/// before negotiation reports it as a memory kind no connector supports.
fn device_kv_available(o: &EngineOptions) -> Result<()> {
    if o.memory == Some(kvconnect_api::MemoryKind::Device) && !cfg!(feature = "cuda") {
        bail!(
            "kv_buffer_device=\"cuda\" asks for KV regions in GPU memory, but this kvconnect was built \
            without GPU support: rebuild with `cargo build --release -p kvconnect-host --features cuda`, or \
            use kv_buffer_device=\"cpu\""
        );
    }
    Ok(())
}

fn role_of(a: &ServerArgs, config: Option<&KvTransferConfig>) -> Result<Role> {
    if let Some(r) = &a.role {
        return r.parse::<Role>().map_err(|e| anyhow!("--role: {e}"));
    }
    match config.and_then(|c| c.kv_role) {
        Some(k) => Role::from_kv_role(k).ok_or_else(|| {
            anyhow!("kv_role is {k}; say which side this worker is with --role prefill|decode")
        }),
        None => bail!("no role: pass --role prefill|decode (or set kv_role in the kv-transfer-config)"),
    }
}

/// The name a model is served under when none is given: the config's `_name_or_path`
/// (what Hugging Face saves), else the name of the directory holding `config.json`
/// (`fixtures/models/kvconnect--reference/config.json` serves `kvconnect--reference`).
fn default_served_name(config_json: &str, config_path: &std::path::Path) -> String {
    let from_config = serde_json::from_str::<serde_json::Value>(config_json)
        .ok()
        .and_then(|v| v["_name_or_path"].as_str().map(str::to_owned))
        .filter(|n| !n.trim().is_empty() && !n.contains(char::is_whitespace));
    from_config.unwrap_or_else(|| {
        let dir = std::fs::canonicalize(config_path).ok().and_then(|p| p.parent().map(|d| d.to_path_buf()));
        dir.as_deref()
            .and_then(|d| d.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".to_owned())
    })
}

fn check_served_name(name: String) -> Result<String> {
    if name.trim().is_empty() || name.contains(char::is_whitespace) {
        bail!("--served-model-name (or served_model_name) '{name}' must be a non-empty name without spaces");
    }
    Ok(name)
}

/// Runs `kvconnect worker`.
pub fn run(a: &ServerArgs, registry: Registry) -> Result<()> {
    if a.num_blocks == 0 {
        bail!("--num-blocks must be a positive integer, got 0");
    }
    if !(a.handshake_timeout.is_finite() && a.handshake_timeout > 0.0) {
        bail!("--handshake-timeout must be a positive number of seconds, got {}", a.handshake_timeout);
    }
    let mut prefix_caching = a.enable_prefix_caching;
    let mut served = a.served_model_name.clone();
    let mut producers = match &a.kv_producers {
        Some(l) => Some(Producers::parse_list(l).map_err(|e| anyhow!("--kv-producers: {e}"))?),
        None => None,
    };
    let (role, config, model_json, model, negotiated, compat, opts) = if let Some(path) = &a.deployment {
        let role = role_of(a, None)?;
        let d = Deployment::load(path)?;
        d.for_kvconnect_servers()?;
        let (n, c) = negotiate_role(&d, role, a.joint, &registry)?;
        let json = std::fs::read_to_string(&d.model_path)
            .with_context(|| format!("model {}: cannot read it", d.model_path.display()))?;
        let rc = d.role(role).clone();
        for note in &rc.notes {
            tracing::info!("{note}");
        }
        device_kv_available(&rc.options)?;
        prefix_caching |= rc.enable_prefix_caching;
        served = served.or(d.served_model_name.clone());
        served.get_or_insert_with(|| default_served_name(&json, &d.model_path));
        if producers.is_none() {
            let list = rc.kv_producers.join(",");
            producers = Some(
                Producers::parse_list(&list)
                    .map_err(|e| anyhow!("{}: [{role}] kv_producers: {e}", path.display()))?,
            );
        }
        (role, rc.kv_transfer_config, json, d.model, n, c, rc.options)
    } else {
        let (Some(cfg), Some(model_path)) = (&a.kv_transfer_config, &a.model) else {
            bail!(
                "say what to run: --deployment FILE --role prefill|decode, or --kv-transfer-config JSON \
                --model CONFIG.json"
            );
        };
        let config = read_config(cfg)?;
        let (config, notes) =
            kvconnect_deployment::lmcache_pd(config).map_err(|e| anyhow!("--kv-transfer-config: {e}"))?;
        for note in &notes {
            tracing::info!("{note}");
        }
        let role = role_of(a, Some(&config))?;
        let json = std::fs::read_to_string(model_path)
            .with_context(|| format!("model {}: cannot read it", model_path.display()))?;
        let model = ModelSpec::from_hf_config_json(&json)
            .with_context(|| format!("model {}", model_path.display()))?;
        served.get_or_insert_with(|| default_served_name(&json, model_path));
        let mut opts = options(a)?;
        if let Some(dev) = &config.kv_buffer_device {
            opts.memory = Some(
                EngineOptions::memory_from_kv_buffer_device(dev)
                    .map_err(|e| anyhow!("--kv-transfer-config kv_buffer_device: {e}"))?,
            );
        }
        device_kv_available(&opts)?;
        let (n, c) = negotiate_alone(&registry, &config, &model, &opts, Negotiating::Role(role))?;
        (role, config, json, model, n, c, opts)
    };
    let engine_id = a
        .engine_id
        .clone()
        .or_else(|| config.engine_id.clone())
        .unwrap_or_else(|| format!("{}-{}", role.name(), std::process::id()));
    let spec = ServerSpec {
        role,
        config,
        model_json,
        model,
        negotiated,
        compat,
        options: opts,
        engine_id,
        http_addr: SocketAddr::new(a.host, a.port),
        side_channel: SideChannelConfig {
            host: a.side_channel_host,
            port: a.side_channel_port,
            secret: data_plane_secret(a.secret_file.as_deref())?,
            read_timeout: seconds("--side-channel-timeout", a.side_channel_timeout)?,
            max_frame: DEFAULT_MAX_FRAME,
            max_connections: at_least_one("--side-channel-max-connections", a.side_channel_max_connections)?,
        },
        num_blocks: a.num_blocks,
        seed: a.seed,
        synthetic: a.synthetic_kv,
        prefix_caching,
        served_model_name: check_served_name(served.unwrap_or_default())?,
        gate: gate::Gate::new(gate::api_key(a.api_key.as_deref()), a.max_concurrent_requests)
            .with_body_limits(
                a.max_request_body_bytes,
                seconds("--request-body-timeout", a.request_body_timeout)?,
            )
            .with_run_timeout(seconds("--request-timeout", a.request_timeout)?),
        http_header_timeout: seconds("--request-header-timeout", a.request_header_timeout)?,
        http_max_connections: at_least_one("--max-connections", a.max_connections)?,
        handshake_timeout: Duration::from_secs_f64(a.handshake_timeout),
        producers: producers.unwrap_or_default(),
        kv_events: a.kv_events_endpoint.as_ref().map(|endpoint| {
            let mut c = kvconnect_events::PublisherConfig::new(endpoint.clone());
            c.replay_endpoint = a.kv_events_replay_endpoint.clone();
            c.topic = a.kv_events_topic.clone();
            c
        }),
    };
    run_server(spec, registry)
}

/// A positive, finite number of seconds from flag `flag`.
fn seconds(flag: &str, v: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow!("{flag} must be a positive number of seconds, got {v}"))
}

/// `n` from flag `flag`, which must be at least 1.
fn at_least_one(flag: &str, n: usize) -> Result<usize> {
    if n == 0 {
        bail!("{flag} must be at least 1, got 0");
    }
    Ok(n)
}

#[cfg(test)]
mod served_name_tests {
    use super::*;

    #[test]
    fn the_default_name_has_no_spaces() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("Qwen--Qwen3-0.6B");
        std::fs::create_dir(&d).unwrap();
        let cfg = d.join("config.json");
        std::fs::write(&cfg, "{}").unwrap();
        assert_eq!(default_served_name("{}", &cfg), "Qwen--Qwen3-0.6B");
        assert_eq!(default_served_name(r#"{"_name_or_path": "Qwen/Qwen3-0.6B"}"#, &cfg), "Qwen/Qwen3-0.6B");
        assert_eq!(default_served_name(r#"{"_name_or_path": "my model"}"#, &cfg), "Qwen--Qwen3-0.6B");
        assert!(check_served_name("a b".into()).unwrap_err().to_string().contains("without spaces"));
        assert!(check_served_name(String::new()).is_err());
    }
}
