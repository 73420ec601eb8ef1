//! lmcache and flexkv over KV caches in GPU memory (`kv_buffer_device = "cuda"`), end to end
//! on the reference engine: a first pass stores every prompt through the connector (saves
//! gather device blocks into pinned host copies), a second pass over the same prompts loads
//! their prefixes back (host copies scattered into device blocks) and must give exactly the
//! tokens of an engine without any connector, having loaded external tokens. Needs a GPU:
//! skips, saying so, where there is none.
#![cfg(feature = "cuda")]

use kvconnect_api::{
    ConnectorContext, ConnectorFactory, Dtype, FailurePolicy, KvLayout, KvRole, KvTransferConfig, MemoryKind,
};
use kvconnect_engine::{local_effective_layout, Engine, EngineConfig, GenRequest, ReferenceConfig};
use serde_json::json;

const SEED: u64 = 4321;

fn have_gpu() -> bool {
    match kvconnect_cuda::Gpu::open(0) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipping: no GPU ({e})");
            false
        }
    }
}

fn config(layout: KvLayout, memory: MemoryKind) -> EngineConfig {
    let model = ReferenceConfig::builtin().unwrap();
    let spec = model.model_spec().unwrap();
    let mut effective = local_effective_layout(&spec, layout, false, 16, Dtype::Bf16);
    effective.memory = memory;
    EngineConfig { effective, model, num_blocks: 512, seed: SEED, shm: None, tp_size: 1 }
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    let text = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. ";
    let lens = [17usize, 31, 33, 48, 49, 65, 90, 150];
    (0..n)
        .map(|i| {
            let len = lens[i % lens.len()] + (i / lens.len()) * 5;
            text.bytes().cycle().skip(i * 11).take(len).map(u32::from).collect()
        })
        .collect()
}

fn run(e: &mut Engine, ps: &[Vec<u32>], tag: &str) -> Vec<(Vec<u32>, usize)> {
    for (i, p) in ps.iter().enumerate() {
        e.add_request(GenRequest::new(format!("{tag}{i}"), p.clone(), 4)).unwrap();
    }
    let mut out = e.run_to_completion(100_000).unwrap();
    out.sort_by_key(|c| c.id[tag.len()..].parse::<usize>().unwrap());
    out.into_iter().map(|c| (c.tokens, c.num_external_tokens)).collect()
}

fn check(factory: &dyn ConnectorFactory, name: &str, layout: KvLayout, extra: serde_json::Value) {
    if !have_gpu() {
        return;
    }
    let ps = prompts(16);
    let mut plain = Engine::new(config(layout, MemoryKind::Host), None, FailurePolicy::Fail).unwrap();
    let want: Vec<Vec<u32>> = run(&mut plain, &ps, "r").into_iter().map(|(t, _)| t).collect();

    let cfg = config(layout, MemoryKind::Device);
    let mut config = KvTransferConfig::named(name);
    config.kv_connector_extra_config = extra.as_object().cloned().unwrap_or_default();
    let id = format!("device-caches-{name}-{}", layout.canonical_name());
    config.engine_id = Some(id.clone());
    let ctx = ConnectorContext {
        config,
        model: cfg.model.model_spec().unwrap(),
        effective: cfg.effective.clone(),
        role: KvRole::Both,
        engine_id: id,
        tp_rank: 0,
        tp_size: 1,
    };
    let conn = (factory.create_scheduler(&ctx).unwrap(), factory.create_worker(&ctx).unwrap());
    let mut e = Engine::new(cfg, Some(conn), FailurePolicy::Fail).unwrap();
    assert!(e.regions().iter().all(|r| r.memory() == MemoryKind::Device));
    let first = run(&mut e, &ps, "a");
    let second = run(&mut e, &ps, "b");
    for (i, ((t1, _), (t2, ext))) in first.iter().zip(&second).enumerate() {
        assert_eq!(t1, &want[i], "{name} {layout}: prompt {i}, first pass (saving)");
        assert_eq!(t2, &want[i], "{name} {layout}: prompt {i}, second pass (loading from device KV)");
        if ps[i].len() > 33 {
            assert!(*ext > 0, "{name} {layout}: prompt {i} (len {}) loaded nothing", ps[i].len());
        }
    }
    e.shutdown().unwrap();
}

#[test]
fn lmcache_on_device_kv_equals_no_connector() {
    let f = kvconnect_lmcache::LmcacheFactory;
    check(&f, "LMCacheConnectorV1", KvLayout::NHD, json!({"chunk_size": 16}));
    check(&f, "LMCacheConnectorV1", KvLayout::HND, json!({"chunk_size": 32, "use_layerwise": true}));
}

#[test]
fn flexkv_on_device_kv_equals_no_connector() {
    let f = kvconnect_flexkv::FlexkvFactory;
    check(&f, "FlexKVConnectorV1", KvLayout::NHD, json!({"cpu_cache_gb": 0.05}));
}
