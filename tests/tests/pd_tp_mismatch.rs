//! Workers whose tensor-parallel sizes do not divide one another, started from one
//! deployment file and each negotiated alone: decode's ranks could not each read their heads
//! from whole prefill ranks, so decode's handshake with prefill is refused naming both sizes,
//! nothing is loaded, and decode computes the prompt itself (the output still equals the
//! monolithic one). The model has 6 KV heads, so TP 2 and TP 3 both run.

use kvconnect_api::{Dtype, FailurePolicy, KvLayout};
use kvconnect_engine::{local_effective_layout, Engine, EngineConfig, GenRequest, ReferenceConfig};
use kvconnect_tests::{disaggregated, reference_model, token_ids, varied_prompts, write_deployment, Worker};

/// The reference config with 6 query and 6 KV heads.
fn six_heads() -> String {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(reference_model()).unwrap()).unwrap();
    v["num_attention_heads"] = 6.into();
    v["num_key_value_heads"] = 6.into();
    v.to_string()
}

fn monolithic(config: &str, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let model = ReferenceConfig::from_json(config).unwrap();
    let spec = model.model_spec().unwrap();
    let effective = local_effective_layout(&spec, KvLayout::HND, true, 16, Dtype::Bf16);
    let cfg = EngineConfig { model, effective, num_blocks: 64, seed: 0, shm: None, tp_size: 1 };
    let mut e = Engine::new(cfg, None, FailurePolicy::Recompute).unwrap();
    e.add_request(GenRequest::new("m", prompt.to_vec(), max_tokens)).unwrap();
    e.run_to_completion(1000).unwrap().remove(0).tokens
}

#[test]
fn a_decode_whose_tp_size_does_not_divide_prefills_loads_nothing_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let config = six_heads();
    let model = dir.path().join("config.json");
    std::fs::write(&model, &config).unwrap();
    let nixl = r#"{"kv_connector":"NixlConnector","kv_connector_extra_config":{"backend":"shm"}}"#;
    let file = write_deployment(dir.path(), "tp.toml", &model, (nixl, "tp_size = 2"), (nixl, "tp_size = 3"));
    let start = |role| Worker::start(&["--deployment", file.to_str().unwrap(), "--role", role]);
    let (p, d) = (start("prefill"), start("decode"));
    let prompts = varied_prompts(14);
    let prompt = &prompts[13];
    let mono = monolithic(&config, prompt, 4);

    let (st, r) = disaggregated(&p, &d, prompt, 4);
    assert_eq!(st, 200, "{r}");
    assert_eq!(token_ids(&r).into_iter().map(|t| t as u32).collect::<Vec<_>>(), mono);
    assert_eq!(r["kvconnect"]["num_external_tokens"], 0, "{r}");
    assert_eq!(r["kvconnect"]["kv_load"]["recomputed"], true, "{r}");
    let why = r["kvconnect"]["kv_load"]["reason"].as_str().unwrap_or_default();
    assert!(why.contains("tp_size: prefill=2") && why.contains("decode=3"), "{why}");
    assert!(why.contains("TP sizes 2 and 3 do not divide each other"), "{why}");
    let (_, h) = d.get("/health");
    assert_eq!(h["pool"]["external_tokens"], 0, "nothing may be loaded from a refused peer: {h}");
    let (_, h) = p.get("/health");
    assert_eq!(h["side_channel"]["refused"], 1, "{h}");
    assert_eq!(h["side_channel"]["welcomed"], 0, "{h}");
}

#[test]
fn a_tp_size_that_does_not_divide_the_kv_heads_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let nixl = r#"{"kv_connector":"NixlConnector","kv_connector_extra_config":{"backend":"shm"}}"#;
    let file = write_deployment(dir.path(), "tp.toml", &reference_model(), (nixl, "tp_size = 4"), (nixl, ""));
    let out = std::process::Command::new(kvconnect_tests::kvconnect_bin())
        .args(["worker", "--deployment", file.to_str().unwrap(), "--role", "prefill"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("tp_size 4 does not divide the model's 2 KV heads")
            && err.contains("use a tp_size that divides 2"),
        "{err}"
    );
}

#[test]
fn state_layers_across_tensor_parallel_ranks_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let nixl = r#"{"kv_connector":"NixlConnector","kv_connector_extra_config":{"backend":"shm"}}"#;
    let file = write_deployment(
        dir.path(),
        "hybrid-tp.toml",
        &kvconnect_tests::hybrid_reference_model(),
        (nixl, "tp_size = 2\nhybrid_kv_cache_manager = \"on\""),
        (nixl, "hybrid_kv_cache_manager = \"on\""),
    );
    let out = std::process::Command::new(kvconnect_tests::kvconnect_bin())
        .args(["worker", "--deployment", file.to_str().unwrap(), "--role", "prefill"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("not implemented: state layers") && err.contains("at tp_size 1"), "{err}");
}
