//! What a decode worker pays once per prefill peer before its first load, timed by
//! `bench transfer` against the prefill worker it benchmarks: the side-channel handshake
//! (challenge, hello with the proof of the deployment's secret, welcome with prefill's proof,
//! the descriptors compared on both sides) and one authenticated connection to the producer
//! listener (connect, challenge, both proofs). A consumer opens one such connection per tcp
//! stream and keeps them; the transfers that follow pay neither again.

use anyhow::{anyhow, bail, Context, Result};
use kvconnect_api::negotiate::EngineOptions;
use kvconnect_api::{KvTransferConfig, ModelSpec};
use kvconnect_dataplane::auth::{self, Secret, Side};
use kvconnect_registry::Registry;
use kvconnect_server::sidechannel::{handshake, HandshakeOutcome};
use kvconnect_support::stats::Quartiles;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(10);

/// `rounds` side-channel handshakes with the prefill worker whose side channel is at
/// `side_channel`, as a decode of `consumer_config` on `model` makes them, then as many
/// authenticated connections to its producer listener; the quartiles of each in
/// milliseconds, and what one HMAC proof costs alone, in microseconds.
pub(super) fn measure(
    side_channel: &str,
    consumer_config: &str,
    model: &ModelSpec,
    rounds: usize,
) -> Result<Value> {
    let config = KvTransferConfig::from_json(consumer_config).context("the consumer's kv-transfer-config")?;
    let (_, compat) = kvconnect_deployment::negotiate_worker(
        &Registry::builtins_only(),
        &config,
        model,
        &EngineOptions::default(),
        "decode",
    )?;
    let secret = kvconnect_deployment::secret::data_plane_secret(None)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let (mut side, mut producer) = (Vec::new(), Vec::new());
    let mut listen: Option<SocketAddr> = None;
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        let out =
            rt.block_on(handshake(side_channel, &compat, "bench-handshake", secret.as_ref(), TIMEOUT))?;
        side.push(t.elapsed().as_secs_f64() * 1e3);
        let HandshakeOutcome::Welcome { metadata, .. } = out else {
            bail!("prefill refused the benchmark's handshake: {out:?}");
        };
        if listen.is_none() {
            let addr = metadata.as_ref().and_then(|m| m["listen"].as_str()).ok_or_else(|| {
                anyhow!("prefill's handshake metadata names no producer listener: {metadata:?}")
            })?;
            listen = Some(addr.parse().with_context(|| format!("producer listener {addr}"))?);
        }
    }
    let listen = listen.ok_or_else(|| anyhow!("no handshake was made"))?;
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        let mut s = kvconnect_nixl::tcp_data::connect(listen, TIMEOUT, 0)
            .with_context(|| format!("connecting to the producer listener {listen}"))?;
        kvconnect_nixl::wire::authenticate_client(
            &mut s,
            secret.as_ref(),
            kvconnect_support::frame::DEFAULT_MAX_FRAME,
        )
        .map_err(|e| anyhow!("authenticating to the producer listener {listen}: {e}"))?;
        producer.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(json!({
        "rounds": rounds.max(1),
        "side_channel_ms": Quartiles::of(side),
        "producer_connection_ms": Quartiles::of(producer),
        "hmac_proof_us": hmac_proof_us(secret.as_ref())?,
    }))
}

/// The time of one proof (HMAC-SHA256 over both nonces), the mean of many.
fn hmac_proof_us(secret: Option<&Secret>) -> Result<f64> {
    const N: u32 = 10_000;
    let (a, b) = (auth::nonce()?, auth::nonce()?);
    let t = Instant::now();
    for _ in 0..N {
        std::hint::black_box(auth::proof(secret, "bench", Side::Client, std::hint::black_box(&a), &b));
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / f64::from(N))
}
