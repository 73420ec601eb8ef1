//! Workers whose tensor-parallel sizes do not divide one another, started from one
//! deployment file and each negotiated alone: decode's ranks could not each read their heads
//! from whole prefill ranks, so decode's handshake with prefill is refused naming both sizes,
//! nothing is loaded, and decode computes the prompt itself (the output still equals the
//! monolithic one). The model has 6 KV heads, so TP 2 and TP 3 both run.

use kvconnect_api::{Dtype, FailurePolicy, KvLayout};
use kvconnect_engine::{local_effective_layout, Engine, EngineConfig, GenRequest, ReferenceConfig};
use kvconnect_tests::{
    assert_refused_at_the_handshake, disaggregated, reference_model, varied_prompts, write_deployment, Worker,
};

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
    assert_refused_at_the_handshake(
        &p,
        &d,
        (st, &r),
        &mono,
        &["tp_size: prefill=2", "decode=3", "TP sizes 2 and 3 do not divide each other"],
    );
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

/// nixl carries state only between TP 1 engines (no `state_with_tp`): negotiation refuses the
/// worker before its engine or connector starts, naming the child and the remedy. (The
/// engine's and the transport's own refusals stay behind it, as defence in depth.)
#[test]
fn state_layers_across_tensor_parallel_ranks_are_refused_at_negotiation() {
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
    assert!(
        err.contains("error: prefill: model 'kvconnect-reference (KvconnectReferenceForCausalLM)' keeps per-request state in 2 state-space/linear-attention layer(s), and tp_size=2 splits its KV heads over 2 tensor-parallel ranks, but child 'nixl' carries that state only at tp_size 1 (no state_with_tp)"),
        "{err}"
    );
    assert!(err.contains("Remedy: run this model with tp_size=1 on prefill and decode"), "{err}");
    assert!(!err.contains("not implemented"), "refused by negotiation, not by the engine: {err}");
}
