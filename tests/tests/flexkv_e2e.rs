//! flexkv on the real engine: its cache hits must give exactly the tokens of an engine
//! without any connector.
//!
//! * In process: the reference engine with flexkv alone, in NHD and in HND (where flexkv
//!   transposes on its copy path), with a CPU tier small enough that blocks go to the SSD
//!   tier and come back from it. Every prompt runs twice; the second run must load its
//!   prefix from the cache and still produce the monolithic tokens.
//! * Across processes: prefill runs PdConnector[flexkv, nixl] and decode a plain nixl, from
//!   one deployment negotiated jointly, so the layout is HND (nixl requires it) and flexkv
//!   adapts. Each prompt goes through twice; the second time prefill's flexkv must hit, and
//!   decode must load the KV from prefill and produce the monolithic tokens both times.

use kvconnect_api::{ConnectorContext, Dtype, FailurePolicy, KvLayout, KvRole, KvTransferConfig};
use kvconnect_engine::{local_effective_layout, Engine, EngineConfig, GenRequest, ReferenceConfig};
use kvconnect_tests::{disaggregated, monolithic, reference_model, token_ids, varied_prompts, Worker};

const MAX_TOKENS: usize = 4;
const BLOCK: usize = 16;

fn flexkv_engine(layout: KvLayout, extra: serde_json::Value, engine_id: &str) -> Engine {
    let model = ReferenceConfig::builtin().unwrap();
    let spec = model.model_spec().unwrap();
    let eff = local_effective_layout(&spec, layout, false, BLOCK as u32, Dtype::Bf16);
    let mut config = KvTransferConfig::named("FlexKVConnectorV1");
    config.kv_connector_extra_config = extra.as_object().cloned().unwrap();
    config.engine_id = Some(engine_id.to_owned());
    let ctx = ConnectorContext {
        config,
        model: spec,
        effective: eff.clone(),
        role: KvRole::Both,
        engine_id: engine_id.to_owned(),
        tp_rank: 0,
        tp_size: 1,
    };
    let f = kvconnect_registry::builtin::flexkv();
    let conn = (f.create_scheduler(&ctx).unwrap(), f.create_worker(&ctx).unwrap());
    let cfg = EngineConfig { model, effective: eff, num_blocks: 256, seed: 0, shm: None, tp_size: 1 };
    Engine::new(cfg, Some(conn), FailurePolicy::Fail).unwrap()
}

/// Tokens the cache can give a prompt that is fully cached: whole blocks, one token left.
fn cached_tokens(len: usize) -> usize {
    (len - 1) / BLOCK * BLOCK
}

/// Runs every prompt twice; returns the cache's events (stored/removed, per tier) of the
/// first round, and its metrics at the end.
fn twice_through(
    layout: KvLayout,
    extra: serde_json::Value,
    id: &str,
) -> (Vec<kvconnect_api::KvEvent>, Vec<kvconnect_api::ConnectorMetric>) {
    let prompts = varied_prompts(25);
    let mono = monolithic(&prompts, MAX_TOKENS, layout);
    let mut e = flexkv_engine(layout, extra, id);
    let mut events = Vec::new();
    for round in 0..2 {
        if round == 1 {
            events = e.scheduler_connector().unwrap().take_events().unwrap();
        }
        for (i, p) in prompts.iter().enumerate() {
            e.add_request(GenRequest::new(format!("r{round}-{i}"), p.clone(), MAX_TOKENS)).unwrap();
            let done = e.run_to_completion(10_000).unwrap();
            // flexkv holds the blocks until their save is done: after this the prompt is
            // cached (or counted as not cacheable), so round 1 sees a settled cache.
            e.wait_for_pending_frees(10_000).unwrap();
            let c = &done[0];
            assert_eq!(c.tokens, mono[i], "{layout} round {round} prompt {i} (len {}): {c:?}", p.len());
            let want = if round == 0 { 0 } else { cached_tokens(p.len()) };
            assert_eq!(c.num_external_tokens, want, "{layout} round {round} prompt {i} (len {})", p.len());
        }
    }
    let metrics = e.scheduler_connector().unwrap().metrics().unwrap();
    e.shutdown().unwrap();
    (events, metrics)
}

/// A metric of flexkv's `tier`, by family.
fn tier_metric(metrics: &[kvconnect_api::ConnectorMetric], name: &str, tier: &str) -> Option<u64> {
    let tier_label = ("tier".to_owned(), tier.to_owned());
    metrics.iter().find(|m| m.name == name && m.labels.contains(&tier_label)).map(|m| m.value)
}

fn stored_on(events: &[kvconnect_api::KvEvent], tier: &str) -> usize {
    events
        .iter()
        .map(|ev| match ev {
            kvconnect_api::KvEvent::BlockStored(s) if s.medium.as_str() == tier => s.block_hashes.len(),
            _ => 0,
        })
        .sum()
}

/// Every stored block carries its tokens: one full block of one of the prompts, and the
/// block its parent names holds the tokens just before it in that prompt.
fn check_tokens(events: &[kvconnect_api::KvEvent]) {
    let blocks: std::collections::HashSet<Vec<u32>> = varied_prompts(25)
        .iter()
        .flat_map(|p| p.chunks_exact(BLOCK).map(|b| b.to_vec()).collect::<Vec<_>>())
        .collect();
    let mut tokens_of = std::collections::HashMap::new();
    for ev in events {
        if let kvconnect_api::KvEvent::BlockStored(s) = ev {
            assert_eq!((s.block_hashes.len(), s.token_ids.len()), (1, BLOCK), "{s:?}");
            assert!(blocks.contains(&s.token_ids), "a stored block's tokens are a prompt's block: {s:?}");
            tokens_of.insert(s.block_hashes[0], (s.parent_block_hash, s.token_ids.clone()));
        }
    }
    for (parent, tokens) in tokens_of.values() {
        let Some((_, before)) = parent.and_then(|p| tokens_of.get(&p)) else { continue };
        let joined = [before.clone(), tokens.clone()].concat();
        assert!(
            varied_prompts(25).iter().any(|p| p.windows(2 * BLOCK).any(|w| w == &joined[..])),
            "a block follows its parent's tokens in some prompt"
        );
    }
}

#[test]
fn engine_with_flexkv_nhd_hits_give_monolithic_tokens() {
    let (ev, _) = twice_through(KvLayout::NHD, serde_json::json!({"cpu_cache_gb": 0.5}), "flexkv-e2e-nhd");
    let full_blocks: usize = varied_prompts(25).iter().map(|p| p.len() / BLOCK).sum();
    assert_eq!(stored_on(&ev, "cpu_tier"), full_blocks);
    check_tokens(&ev);
}

#[test]
fn engine_with_flexkv_hnd_transposed_hits_give_monolithic_tokens() {
    twice_through(KvLayout::HND, serde_json::json!({"cpu_cache_gb": 0.5}), "flexkv-e2e-hnd");
}

#[test]
fn engine_with_flexkv_ssd_tier_hits_give_monolithic_tokens() {
    // The reference model's block (every layer, K and V) is a few KiB: a CPU tier of 8
    // blocks sends most of the 25 prompts' blocks to SSD, and the second round reads them
    // back from there.
    let dir = tempfile::tempdir().unwrap();
    let model = ReferenceConfig::builtin().unwrap().model_spec().unwrap();
    let eff = local_effective_layout(&model, KvLayout::HND, false, BLOCK as u32, Dtype::Bf16);
    let block =
        kvconnect_api::geometry::BlockShape::of(&model, &eff).layer_block_bytes() * model.kv_layers().len();
    let extra = serde_json::json!({
        "cpu_cache_gb": (8 * block) as f64 / 1e9,
        "ssd_cache_gb": 1,
        "ssd_cache_dir": dir.path(),
        "enable_ssd_promotion": false,
    });
    let (ev, m) = twice_through(KvLayout::HND, extra, "flexkv-e2e-ssd");
    let full_blocks: usize = varied_prompts(25).iter().map(|p| p.len() / BLOCK).sum();
    assert_eq!(stored_on(&ev, "disk"), full_blocks - 8, "all but the CPU tier's 8 blocks went to SSD");
    // The metrics say the CPU tier is full and let every other block go (to SSD); the SSD
    // tier holds them all and let none go.
    let cpu = |name| tier_metric(&m, name, "cpu");
    let block = block as u64;
    assert_eq!(cpu("kvconnect_cache_capacity_bytes"), Some(8 * block), "{m:?}");
    assert_eq!(cpu("kvconnect_cache_used_bytes"), Some(8 * block), "{m:?}");
    assert_eq!(cpu("kvconnect_cache_evictions"), Some(full_blocks as u64 - 8), "{m:?}");
    let ssd = |name| tier_metric(&m, name, "ssd");
    assert_eq!(ssd("kvconnect_cache_used_bytes"), Some((full_blocks as u64 - 8) * block), "{m:?}");
    assert_eq!(ssd("kvconnect_cache_evictions"), Some(0), "{m:?}");
    // The blocks that moved from the CPU tier to the SSD carry their tokens there too.
    check_tokens(&ev);
}

fn deployment(dir: &std::path::Path) -> std::path::PathBuf {
    let model = reference_model();
    let text = format!(
        r#"model = "{}"

[prefill]
kv_transfer_config = '{{"kv_connector":"PdConnector","kv_role":"kv_producer","kv_connector_extra_config":{{"connectors":[{{"kv_connector":"FlexKVConnectorV1","kv_connector_extra_config":{{"cpu_cache_gb":0.5}}}},{{"kv_connector":"NixlConnector","kv_connector_extra_config":{{"backend":"shm"}}}}]}}}}'

[decode]
kv_transfer_config = '{{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{{"backend":"shm"}}}}'
"#,
        model.display()
    );
    let path = dir.join("flexkv-pd.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn pd_flexkv_nixl_in_an_hnd_deployment_gives_monolithic_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let file = deployment(dir.path());
    let file = file.to_str().unwrap();
    let prefill =
        Worker::start(&["--deployment", file, "--role", "prefill", "--joint", "--engine-id", "fx-prefill"]);
    let decode =
        Worker::start(&["--deployment", file, "--role", "decode", "--joint", "--engine-id", "fx-decode"]);
    let prompts = varied_prompts(12);
    let mono = monolithic(&prompts, MAX_TOKENS, KvLayout::HND);
    for round in 0..2 {
        for (i, p) in prompts.iter().enumerate() {
            // The prefill side on its own first: on the second round flexkv must hit.
            let (st, pre) =
                prefill.post("/v1/completions", &serde_json::json!({"prompt": p, "max_tokens": 1}));
            assert_eq!(st, 200, "prefill: {pre}\n{}", prefill.log());
            let want = if round == 0 { 0 } else { cached_tokens(p.len()) as u64 };
            assert_eq!(
                pre["kvconnect"]["num_external_tokens"].as_u64(),
                Some(want),
                "round {round} prompt {i} (len {}): flexkv tokens on prefill: {pre}",
                p.len()
            );
            // The answer names the connector and the tier that supplied those tokens.
            let sources = pre["kvconnect"]["cache_sources"].as_array().cloned().unwrap_or_default();
            assert!(sources.iter().all(|s| s["connector"] == "flexkv" && s["tier"] == "cpu"), "{pre}");
            assert_eq!(sources.iter().filter_map(|s| s["tokens"].as_u64()).sum::<u64>(), want, "{pre}");
            assert_eq!(
                token_ids(&pre)[0] as u32,
                mono[i][0],
                "round {round} prompt {i}: prefill's first token"
            );
            let (st, d) = disaggregated(&prefill, &decode, p, MAX_TOKENS);
            assert_eq!(
                st,
                200,
                "round {round} prompt {i}: {d}\nprefill log:\n{}\ndecode log:\n{}",
                prefill.log(),
                decode.log()
            );
            let got: Vec<u32> = token_ids(&d).into_iter().map(|t| t as u32).collect();
            assert_eq!(
                got,
                mono[i],
                "round {round} prompt {i} (len {}): disaggregated != monolithic",
                p.len()
            );
            assert_eq!(
                d["kvconnect"]["num_external_tokens"].as_u64(),
                Some(p.len() as u64 - 1),
                "round {round} prompt {i}: decode must load all but the last prompt token from prefill: {d}"
            );
            assert_eq!(
                d["kvconnect"]["cache_sources"],
                serde_json::json!([]),
                "decode's tokens came through nixl: {d}"
            );
        }
    }
}
