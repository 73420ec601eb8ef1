//! The server process behind `kvconnect worker`: one engine (the reference engine, or the
//! transfer-only engine of `kvconnect bench transfer`) with its connector, the P/D side
//! channel, and an HTTP API.
//!
//! Start-up order matters: the side-channel listener is bound first so its address can go
//! into the connector's config (`side_channel_host`/`side_channel_port`, which nixl puts into
//! the transfer params it returns); then the engine thread builds the block pool and the
//! connector; then the side channel starts answering with the connector's handshake
//! metadata; last the HTTP listener opens and the addresses are printed as one JSON line.

pub mod connector_setup;
pub mod engine_loop;
pub mod http;
pub mod logprobs;
pub mod openai;
pub mod peers;
pub mod producers;
pub mod response;
pub mod sidechannel;
pub mod sse;
pub mod synthetic;

use crate::sidechannel::{LocalIdentity, SideChannelConfig, SideChannelServer};
use anyhow::{anyhow, Context, Result};
use kvconnect_api::compat::CompatDescriptor;
use kvconnect_api::negotiate::{EngineOptions, Negotiated};
use kvconnect_api::Role;
use kvconnect_api::{ConnectorContext, KvTransferConfig, ModelSpec};
use kvconnect_engine::{Engine, EngineConfig, ReferenceConfig};
use kvconnect_openai::{gate, serve};
use kvconnect_registry::Registry;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

/// Everything a server is started with, negotiated already.
#[derive(Debug, Clone)]
pub struct ServerSpec {
    /// Prefill or decode.
    pub role: Role,
    /// The kv-transfer-config as given (the side-channel keys are added here).
    pub config: KvTransferConfig,
    /// The model's `config.json` text (the reference engine reads it too).
    pub model_json: String,
    /// The model as negotiation saw it.
    pub model: ModelSpec,
    /// The negotiation result.
    pub negotiated: Negotiated,
    /// This server's compat descriptor.
    pub compat: CompatDescriptor,
    /// Engine options (TP rank and size).
    pub options: EngineOptions,
    /// This engine's id.
    pub engine_id: String,
    /// HTTP listen address.
    pub http_addr: SocketAddr,
    /// Side-channel listener settings.
    pub side_channel: SideChannelConfig,
    /// Blocks per KV cache group.
    pub num_blocks: u32,
    /// Weight seed of the reference engine (both roles must use the same one).
    pub seed: u64,
    /// Run the transfer-only engine (synthetic KV contents, no model compute).
    pub synthetic: bool,
    /// The reference engine's prefix cache.
    pub prefix_caching: bool,
    /// The model name clients use.
    pub served_model_name: String,
    /// API key, in-flight bound and body limits of the HTTP API.
    pub gate: gate::Gate,
    /// How long an HTTP client may take to send a request's head.
    pub http_header_timeout: Duration,
    /// HTTP connections open at once.
    pub http_max_connections: usize,
    /// Timeout of a handshake with a peer.
    pub handshake_timeout: Duration,
    /// The producers a decode server may load KV from.
    pub producers: producers::Producers,
    /// Where to publish KV events (`--kv-events-endpoint`); `None`: not published.
    pub kv_events: Option<kvconnect_events::PublisherConfig>,
}

/// Runs the server until SIGTERM or Ctrl-C.
pub fn run(spec: ServerSpec, registry: Registry) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let r = rt.block_on(serve(spec, registry));
    // Connections still open (a peer mid-handshake) must not keep the process alive.
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}

async fn serve(spec: ServerSpec, registry: Registry) -> Result<()> {
    let stop = kvconnect_deployment::shutdown::shutdown_signal()?;
    let swept = kvconnect_engine::shm::sweep_dead();
    if swept > 0 {
        tracing::warn!(
            segments = swept,
            "removed shared-memory segments left in /dev/shm by workers that died"
        );
    }
    if connector_setup::carries_secret(&spec.config) {
        anyhow::bail!(
            "the kv-transfer-config sets {}, which would put the deployment's secret on a command line or in \
                a config file others may read; remove it and set KVCONNECT_SIDE_CHANNEL_TOKEN or pass \
                --secret-file",
            kvconnect_dataplane::auth::SECRET_CONFIG_KEY
        );
    }
    let sc_want = SocketAddr::new(spec.side_channel.host, spec.side_channel.port);
    let sc_listener = std::net::TcpListener::bind(sc_want).with_context(|| {
        format!("cannot bind the side channel on {sc_want}; pick another --side-channel-port (0 = any)")
    })?;
    let sc_addr = sc_listener.local_addr().context("side channel address")?;

    let (mut config, _) = connector_setup::with_side_channel(
        &registry,
        &spec.config,
        &sc_addr.ip().to_string(),
        sc_addr.port(),
        spec.side_channel.secret.as_ref(),
    );
    if config.kv_role.is_none() {
        config.kv_role = Some(spec.role.kv_role());
    }
    if config.engine_id.is_none() {
        config.engine_id = Some(spec.engine_id.clone());
    }
    let shm = connector_setup::needs_shared_memory_kv(&registry, &config).then(|| spec.engine_id.clone());
    let ctx = ConnectorContext {
        config: config.clone(),
        model: spec.model.clone(),
        effective: spec.negotiated.effective.clone(),
        role: spec.role.kv_role(),
        engine_id: spec.engine_id.clone(),
        tp_rank: spec.options.tp_rank,
        tp_size: spec.options.tp_size,
    };
    let policy = config.failure_policy();
    let registry = Arc::new(registry);

    // Bound before the engine starts, so a taken port fails the start, not a later step.
    let events = match &spec.kv_events {
        Some(cfg) => {
            let p = kvconnect_events::ZmqEventPublisher::start(cfg)?;
            tracing::info!(endpoint = p.endpoint(), replay = ?p.replay_endpoint(), topic = %cfg.topic, "KV \
                events published");
            Some(p)
        }
        None => None,
    };
    let (handle, join, metadata) = if spec.synthetic {
        let reg = registry.clone();
        let (model, eff, blocks) = (spec.model.clone(), spec.negotiated.effective.clone(), spec.num_blocks);
        let tp_size = spec.options.tp_size;
        engine_loop::spawn_publishing(
            move || {
                let conn = connector_setup::create_connector(&reg, &ctx)?;
                let mut e =
                    synthetic::TransferEngine::new(&model, &eff, blocks, shm.as_deref(), tp_size, conn)?;
                let md = e.handshake_metadata()?;
                Ok((e, md))
            },
            events,
        )
    } else {
        let reference = ReferenceConfig::from_json(&spec.model_json).map_err(|e| {
            anyhow!(
                "{e}; the worker runs the reference engine: use \
                fixtures/models/kvconnect--reference/config.json (or --synthetic-kv to move synthetic KV of \
                any model)"
            )
        })?;
        let reg = registry.clone();
        let prefix_caching = spec.prefix_caching;
        let cfg = EngineConfig {
            model: reference,
            effective: spec.negotiated.effective.clone(),
            num_blocks: spec.num_blocks,
            seed: spec.seed,
            shm,
            tp_size: spec.options.tp_size,
        };
        engine_loop::spawn_publishing(
            move || {
                let conn = connector_setup::create_connector(&reg, &ctx)?;
                let mut e = Engine::new(cfg, Some(conn), policy).map_err(|e| e.to_string())?;
                if prefix_caching {
                    e.enable_prefix_caching().map_err(|e| e.to_string())?;
                }
                let md = match e.worker_connector() {
                    Some(w) => {
                        w.handshake_metadata().map_err(|e| format!("handshake_metadata failed: {e}"))?
                    }
                    None => None,
                };
                Ok((e, md))
            },
            events,
        )
    }
    .map_err(|e| anyhow!("cannot start the engine: {e}"))?;

    let secret = spec.side_channel.secret.clone();
    let server = SideChannelServer::from_std(
        sc_listener,
        spec.side_channel.clone(),
        LocalIdentity { compat: spec.compat.clone(), engine_id: spec.engine_id.clone(), metadata },
    )
    .context("cannot start the side channel")?;

    let state = Arc::new(http::AppState {
        engine: handle.clone(),
        peers: peers::Peers::new(
            spec.compat.clone(),
            spec.engine_id.clone(),
            secret,
            spec.handshake_timeout,
            spec.producers.clone(),
        ),
        policy,
        role: spec.role,
        engine_id: spec.engine_id.clone(),
        model: spec.served_model_name.clone(),
        max_model_len: if spec.synthetic { usize::MAX } else { openai::CONTEXT_TOKENS },
        compat_hash: spec.compat.compat_hash(),
        side_channel: server.stats(),
        instance: server.instance().to_owned(),
        next_id: AtomicU64::new(0),
        kv_bytes_per_token: spec.model.kv_bytes_per_token(spec.negotiated.effective.cache_dtype),
    });
    let listener = tokio::net::TcpListener::bind(spec.http_addr).await.with_context(|| {
        format!("cannot bind the HTTP API on {}; pick another --port (0 = any)", spec.http_addr)
    })?;
    let http_addr = listener.local_addr().context("HTTP address")?;
    let line = serde_json::json!({
        "http": http_addr.to_string(),
        "side_channel": server.local_addr().to_string(),
        "role": spec.role.name(),
        "engine_id": spec.engine_id,
        "compat_hash": spec.compat.compat_hash(),
        "effective": spec.negotiated.effective,
    });
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").context("cannot write the address line to stdout")?;
        out.flush().context("cannot flush stdout")?;
    }
    tracing::info!(
        http = %http_addr,
        side_channel = %server.local_addr(),
        role = spec.role.name(),
        engine = %spec.engine_id,
        "worker ready"
    );

    let app = spec.gate.clone().wrap(http::router(state));
    serve::serve(listener, app, spec.http_header_timeout, spec.http_max_connections, stop).await;
    tracing::info!("shutting down: stopping the engine and releasing KV memory");
    drop(server);
    handle.shutdown();
    let _ = tokio::task::spawn_blocking(move || join.join()).await;
    // The pool unlinks its segments on drop; this catches any a panic left behind.
    let left = kvconnect_engine::shm::unlink_live_segments();
    if left > 0 {
        tracing::warn!(segments = left, "unlinked shared-memory segments left behind");
    }
    Ok(())
}
