//! From vLLM's configuration to a negotiated kvconnect connector: reads the adapter's part of
//! `kv_connector_extra_config`, turns vLLM's own settings (model, block size, cache dtype,
//! hybrid KV cache manager, TP, KV device, in-block layout) into engine options, resolves the
//! kvconnect connector through the host's registry (built-ins and plugins) and negotiates.
//! The scheduler and worker halves run in separate processes; each negotiates over the same
//! inputs, so they agree by construction.

use crate::error::AdapterError;
use crate::ignored;
use crate::joint::Joint;
use kvconnect_api::compat::CompatDescriptor;
use kvconnect_api::negotiate::{Conflict, DecidedBy, EngineOptions, HmaOption, LayoutField, Negotiated};
use kvconnect_api::{ConnectorContext, KvLayout, KvRole, KvTransferConfig, ModelSpec};
use kvconnect_dataplane::auth::{Secret, SECRET_ENV};
use kvconnect_deployment::{negotiate_worker, parse_cache_dtype, DeploymentError};
use kvconnect_registry::{Registry, RegistryConfig};
use kvconnect_server::connector_setup::{needs_shared_memory_kv, with_side_channel};
use kvconnect_server::producers::Producers;
use serde::Deserialize;
use serde_json::{Map, Value};
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

/// What the Python half reads from vLLM's config, as JSON.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VllmSide {
    /// vLLM's `kv_transfer_config.kv_role`.
    pub kv_role: Option<KvRole>,
    /// vLLM's `kv_transfer_config.engine_id`.
    pub engine_id: String,
    /// vLLM's `kv_transfer_config.kv_connector_extra_config`.
    pub extra_config: Map<String, Value>,
    /// The model's `hf_config` as a dict.
    pub hf_config: Value,
    /// `cache_config.block_size`.
    pub block_size: u32,
    /// `cache_config.cache_dtype` (`auto`, `bfloat16`, `fp8`, ...).
    pub cache_dtype: String,
    /// `model_config.dtype`, which `auto` means.
    pub model_dtype: String,
    /// Whether vLLM kept its hybrid KV cache manager on.
    pub hma: bool,
    /// `parallel_config.tensor_parallel_size`.
    pub tp_size: u32,
    /// This worker's TP rank (0 in the scheduler).
    pub tp_rank: u32,
    /// Where vLLM keeps the KV cache (`cpu`, `cuda`, ...).
    pub kv_device: String,
    /// The KV cache layout vLLM's attention backend uses (`HND`, `NHD`, ...).
    pub kv_cache_layout: Option<String>,
    /// Why the backend's blocks are opaque, when they are.
    pub opaque_blocks: Option<String>,
}

/// The adapter's keys in `kv_connector_extra_config`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdapterExtra {
    /// The kvconnect kv-transfer-config, exactly as kvconnect takes it.
    #[serde(default)]
    kvconnect: Option<Value>,
    /// A kvconnect deployment file naming both roles' configs: this server negotiates
    /// jointly with its peer from it (`joint`), instead of `kvconnect`.
    #[serde(default)]
    deployment: Option<PathBuf>,
    /// This server's role in `deployment` (`prefill`, `decode`); default from kv_role.
    #[serde(default)]
    deployment_role: Option<String>,
    /// Address prefill's side channel binds and decode reaches it at (default 127.0.0.1).
    #[serde(default)]
    side_channel_host: Option<String>,
    /// Its port; needed by a producer whose connector moves KV to a peer.
    #[serde(default)]
    side_channel_port: Option<u16>,
    /// Seconds a handshake may take (default 10).
    #[serde(default)]
    handshake_timeout_s: Option<f64>,
    /// Where plugins are found, besides KVCONNECT_PLUGIN_PATH.
    #[serde(default)]
    plugin_dirs: Vec<PathBuf>,
    /// Load plugins that are group- or world-writable.
    #[serde(default)]
    allow_insecure_plugins: bool,
    /// Decode: the producers KV may be loaded from, `[ENGINE@]IP[:PORT]` (a list or one
    /// comma-separated string), as kvconnect workers' `--kv-producers`; unset: this host only.
    #[serde(default)]
    kv_producers: Option<Value>,
    /// The longest a worker's idle step waits (milliseconds, default
    /// [`IDLE_STEP_WAIT_MS`], 0: never); the Python adapter asks the worker for it.
    #[serde(default)]
    idle_step_wait_ms: Option<f64>,
}

const EXTRA_KEYS: &str =
    "kvconnect (the kvconnect kv-transfer-config) or deployment (a kvconnect deployment \
    file, negotiated jointly) with deployment_role, side_channel_host, side_channel_port, \
    handshake_timeout_s, plugin_dirs, allow_insecure_plugins, kv_producers, idle_step_wait_ms";

/// Default of `idle_step_wait_ms`, the Python adapter's pacing of steps that schedule nothing
/// and finish nothing (vLLM steps without pause while requests wait on the connector).
pub const IDLE_STEP_WAIT_MS: f64 = 2.0;

/// The range `idle_step_wait_ms` is accepted in.
const IDLE_STEP_WAIT_RANGE: std::ops::RangeInclusive<f64> = 0.0..=100.0;

/// A negotiated connector, ready for either half to be created.
pub struct Setup {
    /// Every connector the host can create.
    pub registry: Registry,
    /// The context both halves are created with.
    pub ctx: ConnectorContext,
    /// The negotiation result.
    pub negotiated: Negotiated,
    /// This engine's descriptor, as the side channel compares it.
    pub compat: CompatDescriptor,
    /// Side channel: bind address and port (a producer whose connector moves KV).
    pub side_channel: Option<(IpAddr, u16)>,
    /// The deployment's data-plane secret (KVCONNECT_SIDE_CHANNEL_TOKEN), which the side
    /// channel and the nixl listener prove on every connection.
    pub secret: Option<Secret>,
    /// Handshake timeout.
    pub handshake_timeout: Duration,
    /// vLLM's KV cache goes into shared memory (a producer over nixl's `shm` backend).
    pub shm_kv: bool,
    /// How it was negotiated jointly, when a deployment file was given.
    pub joint: Option<String>,
    /// Decode: the producers KV may be loaded from (empty: this host only).
    pub producers: Producers,
    /// The longest an idle step waits, milliseconds (`idle_step_wait_ms`; see
    /// [`IDLE_STEP_WAIT_MS`]).
    pub idle_step_wait_ms: f64,
}

fn extra_err(m: impl Into<String>) -> AdapterError {
    AdapterError::ExtraConfig(m.into())
}

impl Setup {
    /// Reads, resolves and negotiates. Every refusal is one line: an unknown connector names
    /// the known ones, a conflict the field, each side's reason and the remedy.
    pub fn from_vllm(side_json: &str) -> Result<Setup, AdapterError> {
        let side: VllmSide =
            serde_json::from_str(side_json).map_err(|e| AdapterError::Setup(e.to_string()))?;
        if let Some(m) = ignored::misplaced_failure_policy(&side.extra_config) {
            return Err(extra_err(m));
        }
        let extra: AdapterExtra = serde_json::from_value(Value::Object(side.extra_config.clone()))
            .map_err(|e| extra_err(format!("{e}; its keys are {EXTRA_KEYS}")))?;
        let (mut config, joint) = match (&extra.kvconnect, &extra.deployment) {
            (Some(v), None) => (kvconnect_config(v)?, None),
            (None, Some(path)) => {
                let j = Joint::load(path, extra.deployment_role.as_deref(), side.kv_role)?;
                let config = j.config();
                if let Some(p) = config.kv_load_failure_policy {
                    tracing::warn!(
                        "kvconnect: the deployment file's {} kv_load_failure_policy ({p:?}) is for \
                         kvconnect's own workers; inside vLLM, vLLM applies its own, read only at the top \
                         level of --kv-transfer-config (default \"fail\")",
                        j.role.name()
                    );
                }
                (config, Some(j))
            }
            (Some(_), Some(_)) => return Err(extra_err(
                "give either 'kvconnect' (this server's kvconnect kv-transfer-config) or 'deployment' (a \
                 kvconnect deployment file with both roles' configs, negotiated jointly), not both",
            )),
            (None, None) => {
                return Err(extra_err(format!(
                    "no kvconnect connector named: give 'kvconnect' (a kvconnect kv-transfer-config, e.g. \
                     {{\"kv_connector\":\"NixlConnector\",\
                     \"kv_connector_extra_config\":{{\"backend\":\"tcp\"}}}}) or 'deployment' (a kvconnect \
                     deployment file); its keys are {EXTRA_KEYS}"
                )))
            }
        };
        let idle_step_wait_ms = extra.idle_step_wait_ms.unwrap_or(IDLE_STEP_WAIT_MS);
        if !IDLE_STEP_WAIT_RANGE.contains(&idle_step_wait_ms) {
            return Err(extra_err(format!(
                "idle_step_wait_ms = {idle_step_wait_ms}: expected milliseconds from 0 (idle steps never \
                 wait) to 100; leave it out for {IDLE_STEP_WAIT_MS}"
            )));
        }
        let role = config.kv_role.or(side.kv_role).unwrap_or(KvRole::Both);
        config.kv_role = Some(role);
        if config.engine_id.is_none() {
            config.engine_id = Some(side.engine_id.clone());
        }
        let engine_id = config.engine_id.clone().unwrap_or_default();

        let model = ModelSpec::from_hf_config_json(&side.hf_config.to_string())
            .map_err(|e| AdapterError::Model(e.to_string()))?;
        let opts = engine_options(&side)?;

        let registry = Registry::load(&RegistryConfig::with_env(
            extra.plugin_dirs.clone(),
            extra.allow_insecure_plugins,
        ));
        registry.warn_load_errors();

        let host: IpAddr = match &extra.side_channel_host {
            None => IpAddr::V4(Ipv4Addr::LOCALHOST),
            Some(h) => h.parse().map_err(|_| {
                extra_err(format!(
                    "side_channel_host '{h}' is not an IP address; give the address decode \
                    reaches prefill at, e.g. 127.0.0.1"
                ))
            })?,
        };
        // Each TP rank serves its own KV on its own side channel: rank r at the port plus r,
        // as vLLM's NixlConnector numbers its ranks' side channels.
        let rank_port = match extra.side_channel_port {
            None | Some(0) => None,
            Some(p) => {
                Some(p.checked_add(u16::try_from(side.tp_rank).unwrap_or(u16::MAX)).ok_or_else(|| {
                    extra_err(format!(
                    "side_channel_port {p}: TP rank {} serves its side channel at the port plus its rank, \
                        past 65535; pick a port below {}",
                    side.tp_rank,
                    65536 - side.tp_size.max(1)
                ))
                })?)
            }
        };
        let port = rank_port.unwrap_or(0);
        let secret = data_plane_secret()?;
        let (mut config, transports) =
            with_side_channel(&registry, &config, &host.to_string(), port, secret.as_ref());
        // vLLM's CPU backend's blocks are opaque with their KV heads outermost (`[B, H, N,
        // 2C]`, checked on every tensor in `regions`): nixl may move a slice of heads between
        // TP sizes.
        if side.opaque_blocks.is_some()
            && transports.first().is_some_and(|t| t.kv_connector == config.kv_connector)
        {
            config.kv_connector_extra_config.insert("opaque_heads_outer".into(), Value::Bool(true));
        }
        // A producer whose connector needs shared-memory KV (nixl's shm backend) serves its KV
        // cache from shared memory, which kvconnect.vllm allocates it in (shm_kv); a consumer
        // reads the producer's segments.
        let shm_kv =
            needs_shared_memory_kv(&registry, &config) && matches!(role, KvRole::Producer | KvRole::Both);
        let given: Vec<&str> = [
            ("side_channel_host", extra.side_channel_host.is_some()),
            ("side_channel_port", extra.side_channel_port.is_some()),
        ]
        .into_iter()
        .filter_map(|(k, set)| set.then_some(k))
        .collect();
        if let Some(w) =
            ignored::unused_side_channel(role, !transports.is_empty(), &config.kv_connector, &given)
        {
            tracing::warn!("kvconnect: {w}");
        }
        let side_channel = match (transports.is_empty(), role, rank_port) {
            (true, _, _) | (false, KvRole::Consumer, _) => None,
            (false, _, Some(p)) if p > 0 => Some((host, p)),
            (false, _, _) => {
                return Err(extra_err(format!(
                    "kv_role is {} and '{}' moves KV to a decode engine, so prefill needs a side channel: \
                        set side_channel_port to a free port (and side_channel_host to an address decode can \
                        reach, default 127.0.0.1)",
                    role_name(role),
                    config.kv_connector
                )))
            }
        };

        let (negotiated, compat, joint_note) = match &joint {
            Some(j) => {
                let o = j.negotiate(&registry, &config, &model, &opts)?;
                (o.negotiated, o.compat, Some(o.note))
            }
            None => {
                let (n, c) = negotiate_worker(&registry, &config, &model, &opts, role_name(role)).map_err(
                    |e| match &e {
                        DeploymentError::Conflict { conflict, .. }
                            if matches!(**conflict, Conflict::HmaUnsupported { .. }) =>
                        {
                            AdapterError::Negotiation(format!(
                            "{e}; inside vLLM: name KvconnectConnector instead of KvconnectHmaConnector, and \
                                vLLM turns its hybrid KV cache manager off"
                        ))
                        }
                        _ => AdapterError::Negotiation(e.to_string()),
                    },
                )?;
                (n, c, None)
            }
        };
        let producers = match &extra.kv_producers {
            None => Ok(Producers::default()),
            Some(Value::String(s)) => Producers::parse_list(s),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().ok_or_else(|| format!("{v} is not a string")).and_then(str::parse))
                .collect::<Result<Vec<_>, _>>()
                .map(Producers),
            Some(v) => Err(format!("{v} is neither a list nor a comma-separated string")),
        }
        .map_err(|e| extra_err(format!("kv_producers: {e}")))?;
        let timeout = extra.handshake_timeout_s.unwrap_or(10.0);
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(extra_err(format!(
                "handshake_timeout_s is {timeout}; give a positive number of seconds"
            )));
        }
        // Negotiation and the compat descriptor describe the whole model; each rank's
        // connector holds its rank's share of the KV heads, as vLLM's worker allocates them.
        let rank_model = model.tp_shard(opts.tp_size).map_err(|e| AdapterError::Model(e.to_string()))?;
        let ctx = ConnectorContext {
            config,
            model: rank_model,
            effective: negotiated.effective.clone(),
            role,
            engine_id,
            tp_rank: opts.tp_rank,
            tp_size: opts.tp_size,
        };
        Ok(Setup {
            registry,
            ctx,
            negotiated,
            compat,
            side_channel,
            secret,
            handshake_timeout: Duration::from_secs_f64(timeout),
            shm_kv,
            joint: joint_note,
            producers,
            idle_step_wait_ms,
        })
    }

    /// One line for the log: connector, role, effective layout, compat hash.
    pub fn summary(&self) -> String {
        let e = &self.negotiated.effective;
        format!(
            "connector {} ({}) role {} engine {}: layout {}{}, block_size {}, cache_dtype {:?}, hma {}, \
                groups {}, tp {}/{}; compat hash {}",
            self.ctx.config.kv_connector,
            self.compat.connectors.iter().map(|(n, v)| format!("{n} {v}")).collect::<Vec<_>>().join(", "),
            role_name(self.ctx.role),
            self.ctx.engine_id,
            e.layout.display_name(),
            if e.opaque_blocks { " (opaque blocks: moved whole, never adapted)" } else { "" },
            e.block_size,
            e.cache_dtype,
            if e.hma { "on" } else { "off" },
            e.groups.len(),
            self.ctx.tp_rank,
            self.ctx.tp_size,
            self.compat.compat_hash()
        ) + &self.joint.as_ref().map(|j| format!("; {j}")).unwrap_or_default()
    }
}

/// The in-block layout the connector needs vLLM to allocate (`HND` or `NHD`), which the
/// adapter answers vLLM's `get_required_kvcache_layout` with: negotiated from vLLM's other
/// settings with the layout left open, as [`Setup::from_vllm`] would with vLLM's default.
/// `None` where vLLM may keep its own: no child constrains the layout, each rank holds one KV
/// head (MLA: both layouts are the same bytes), or the connector needs a layout vLLM cannot
/// allocate (the worker's setup then refuses it with the remedy).
pub fn required_layout(side_json: &str) -> Result<Option<&'static str>, AdapterError> {
    let mut side: Value = serde_json::from_str(side_json).map_err(|e| AdapterError::Setup(e.to_string()))?;
    if let Some(o) = side.as_object_mut() {
        o.insert("kv_cache_layout".into(), Value::Null);
    }
    let setup = Setup::from_vllm(&side.to_string())?;
    let by_child = setup
        .negotiated
        .provenance_of(LayoutField::Layout)
        .is_some_and(|p| matches!(p.decided_by, DecidedBy::Child(_) | DecidedBy::Peer(_)));
    let layout = setup.negotiated.effective.layout;
    if !by_child || KvLayout::HND.same_bytes(KvLayout::NHD, setup.ctx.model.num_kv_heads) {
        return Ok(None);
    }
    Ok([("HND", KvLayout::HND), ("NHD", KvLayout::NHD)]
        .into_iter()
        .find(|(_, l)| *l == layout)
        .map(|(n, _)| n))
}

/// The adapter's `kvconnect` key as a kvconnect kv-transfer-config.
fn kvconnect_config(v: &Value) -> Result<KvTransferConfig, AdapterError> {
    match v {
        Value::Object(_) => serde_json::from_value(v.clone())
            .map_err(|e| extra_err(format!("'kvconnect' is not a kvconnect kv-transfer-config: {e}"))),
        Value::String(s) => KvTransferConfig::from_json(s)
            .map_err(|e| extra_err(format!("'kvconnect' is not a kvconnect kv-transfer-config: {e}"))),
        _ => Err(extra_err(
            "'kvconnect' must be a kv-transfer-config object, e.g. \
            {\"kv_connector\":\"NixlConnector\",\"kv_connector_extra_config\":{\"backend\":\"tcp\"}}",
        )),
    }
}

fn role_name(role: KvRole) -> &'static str {
    match role {
        KvRole::Producer => "kv_producer",
        KvRole::Consumer => "kv_consumer",
        KvRole::Both => "kv_both",
    }
}

/// vLLM's settings as kvconnect engine options. Each one is what vLLM will actually do, so
/// negotiation refuses (instead of silently overriding) a child that cannot live with it.
fn engine_options(side: &VllmSide) -> Result<EngineOptions, AdapterError> {
    let dtype_name = if side.cache_dtype.trim().eq_ignore_ascii_case("auto") {
        side.model_dtype.as_str()
    } else {
        side.cache_dtype.as_str()
    };
    let cache_dtype = parse_cache_dtype(dtype_name.trim_start_matches("torch."))
        .map_err(|e| AdapterError::Setup(format!("vLLM's cache dtype: {e}")))?;
    let memory = EngineOptions::memory_from_kv_buffer_device(&side.kv_device)
        .map_err(|e| AdapterError::Setup(e.to_string()))?;
    let layout = match &side.kv_cache_layout {
        None => None,
        Some(l) => Some(l.parse::<KvLayout>().map_err(|e| AdapterError::Setup(e.to_string()))?),
    };
    Ok(EngineOptions {
        hybrid_kv_cache_manager: if side.hma { HmaOption::On } else { HmaOption::Off },
        kv_cache_layout: layout,
        block_size: Some(side.block_size),
        cache_dtype,
        memory: Some(memory),
        tp_size: side.tp_size.max(1),
        tp_rank: side.tp_rank,
        allow_adapters: true,
        opaque_blocks: side.opaque_blocks.clone(),
        // vLLM gives every tensor-parallel rank its own connector.
        ranks_per_worker: 1,
    })
}

/// The deployment's data-plane secret from the environment, as a kvconnect worker reads it: it
/// never travels in a kv-transfer-config, which vLLM logs.
fn data_plane_secret() -> Result<Option<Secret>, AdapterError> {
    match std::env::var(SECRET_ENV) {
        Ok(t) if !t.trim().is_empty() => {
            Secret::from_text(&t, SECRET_ENV).map(Some).map_err(|e| extra_err(e.to_string()))
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// vLLM's side as `kvconnect.vllm` passes it, over the reference model.
    fn side(kv_role: &str, extra: Value) -> String {
        let hf = include_str!("../../fixtures/models/kvconnect--reference/config.json");
        json!({
            "kv_role": kv_role, "engine_id": "e-setup", "extra_config": extra,
            "hf_config": serde_json::from_str::<Value>(hf).unwrap(), "block_size": 16,
            "cache_dtype": "auto", "model_dtype": "bfloat16", "hma": false, "tp_size": 1, "tp_rank": 0,
            "kv_device": "cpu", "kv_cache_layout": "HND", "opaque_blocks": null,
        })
        .to_string()
    }

    fn refusal(kv_role: &str, extra: Value) -> String {
        Setup::from_vllm(&side(kv_role, extra)).err().expect("refused").to_string()
    }

    #[test]
    fn vllm_is_asked_for_the_layout_the_connector_needs() {
        let with = |c: &Value| required_layout(&side("kv_consumer", json!({"kvconnect": c})));
        let nixl = json!({"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backend": "tcp"}});
        let lmcache =
            json!({"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {"chunk_size": 16}});
        let composite = json!({"kv_connector": "PdConnector",
            "kv_connector_extra_config": {"connectors": [lmcache.clone(), nixl.clone()]}});
        assert_eq!(with(&nixl).unwrap(), Some("HND"));
        assert_eq!(with(&lmcache).unwrap(), Some("NHD"));
        assert_eq!(with(&composite).unwrap(), Some("HND"), "nixl requires HND; lmcache takes it too");
        // Whatever layout vLLM chose is ignored: the question is what the connector needs.
        let nhd = side("kv_consumer", json!({"kvconnect": nixl})).replace("\"HND\"", "\"NHD\"");
        assert_eq!(required_layout(&nhd).unwrap(), Some("HND"));
        // MLA: one KV head, so both layouts are the same bytes and vLLM keeps its own.
        let mut mla: Value = serde_json::from_str(&side("kv_consumer", json!({"kvconnect": nixl}))).unwrap();
        mla["hf_config"] = serde_json::from_str(include_str!(
            "../../fixtures/models/deepseek-ai--DeepSeek-V2-Lite/config.json"
        ))
        .unwrap();
        assert_eq!(required_layout(&mla.to_string()).unwrap(), None);
        // A config that cannot be set up is the same one-line refusal the worker gives.
        let e = with(&json!({"kv_connector": "NixlConector"})).unwrap_err().to_string();
        assert!(e.contains("no connector named 'NixlConector'"), "{e}");
    }

    #[test]
    fn idle_step_wait_outside_its_range_is_refused_with_the_range() {
        let nixl = json!({"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backend": "tcp"}});
        for bad in [json!(-1), json!(101.5)] {
            let e = refusal("kv_consumer", json!({"kvconnect": nixl, "idle_step_wait_ms": bad}));
            assert!(e.contains("idle_step_wait_ms = ") && e.contains("expected milliseconds from 0"), "{e}");
        }
        let e = refusal("kv_consumer", json!({"kvconnect": nixl, "idle_step_wait_ms": "soon"}));
        assert!(e.contains("invalid type: string \"soon\""), "{e}");
        for ok in [0.0, 2.0, 100.0] {
            let s =
                Setup::from_vllm(&side("kv_consumer", json!({"kvconnect": nixl, "idle_step_wait_ms": ok})));
            assert_eq!(s.map(|s| s.idle_step_wait_ms).map_err(|e| e.to_string()), Ok(ok));
        }
        let s = Setup::from_vllm(&side("kv_consumer", json!({"kvconnect": nixl}))).map_err(|e| e.to_string());
        assert_eq!(s.map(|s| s.idle_step_wait_ms), Ok(IDLE_STEP_WAIT_MS));
    }

    #[test]
    fn a_failure_policy_below_the_top_level_is_refused_at_startup() {
        let nixl = json!({"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backend": "tcp"}});
        let e = refusal("kv_consumer", json!({"kvconnect": nixl, "kv_load_failure_policy": "recompute"}));
        assert!(
            e.starts_with(
                "kvconnect: kv_connector_extra_config: kv_load_failure_policy is \
                 set in kv_connector_extra_config, "
            ),
            "{e}"
        );
        assert!(!e.contains("unknown field"), "{e}");
        let mut inner = nixl.clone();
        inner["kv_load_failure_policy"] = json!("recompute");
        let e = refusal("kv_consumer", json!({"kvconnect": inner}));
        assert!(e.contains("is set in kv_connector_extra_config.kvconnect, where it has no effect"), "{e}");
        assert!(
            e.contains(r#"'{"kv_connector":"KvconnectConnector","kv_load_failure_policy":"recompute",...}'"#),
            "{e}"
        );
    }

    #[test]
    fn a_consumer_starts_without_a_side_channel_even_when_given_a_port() {
        let nixl = json!({"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backend": "tcp"}});
        let s = Setup::from_vllm(&side("kv_consumer", json!({"kvconnect": nixl, "side_channel_port": 5600})))
            .unwrap();
        assert_eq!(s.side_channel, None);
        let s = Setup::from_vllm(&side("kv_producer", json!({"kvconnect": nixl, "side_channel_port": 5600})))
            .unwrap();
        assert_eq!(s.side_channel, Some((IpAddr::V4(Ipv4Addr::LOCALHOST), 5600)));
        let e = refusal("kv_producer", json!({"kvconnect": nixl}));
        assert!(e.contains("set side_channel_port to a free port"), "{e}");
    }
}
