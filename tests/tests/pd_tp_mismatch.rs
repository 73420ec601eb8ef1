//! Workers whose tensor-parallel sizes differ, started from one deployment file and each
//! negotiated alone: the nixl connector moves KV only between equal TP sizes, so decode's
//! handshake with prefill is refused naming both sizes and the remedy, nothing is loaded,
//! and decode computes the prompt itself (the output still equals the monolithic one).

use kvconnect_api::KvLayout;
use kvconnect_tests::{
    disaggregated, monolithic, reference_model, token_ids, varied_prompts, write_deployment, Worker,
};

#[test]
fn a_decode_with_another_tp_size_loads_nothing_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let nixl = r#"{"kv_connector":"NixlConnector","kv_connector_extra_config":{"backend":"shm"}}"#;
    let file = write_deployment(
        dir.path(),
        "tp.toml",
        &reference_model(),
        (nixl, "tp_size = 1"),
        (nixl, "tp_size = 2"),
    );
    let start = |role| Worker::start(&["--deployment", file.to_str().unwrap(), "--role", role]);
    let (p, d) = (start("prefill"), start("decode"));
    let prompts = varied_prompts(14);
    let prompt = &prompts[13];
    let mono = monolithic(std::slice::from_ref(prompt), 4, KvLayout::HND);

    let (st, r) = disaggregated(&p, &d, prompt, 4);
    assert_eq!(st, 200, "{r}");
    assert_eq!(token_ids(&r).into_iter().map(|t| t as u32).collect::<Vec<_>>(), mono[0]);
    assert_eq!(r["kvconnect"]["num_external_tokens"], 0, "{r}");
    assert_eq!(r["kvconnect"]["kv_load"]["recomputed"], true, "{r}");
    let why = r["kvconnect"]["kv_load"]["reason"].as_str().unwrap_or_default();
    assert!(why.contains("tp_size: prefill=1") && why.contains("decode=2"), "{why}");
    assert!(why.contains("run decode with tp_size=1 like prefill, or prefill with tp_size=2"), "{why}");
    let (_, h) = d.get("/health");
    assert_eq!(h["pool"]["external_tokens"], 0, "nothing may be loaded from a refused peer: {h}");
    let (_, h) = p.get("/health");
    assert_eq!(h["side_channel"]["refused"], 1, "{h}");
    assert_eq!(h["side_channel"]["welcomed"], 0, "{h}");
}
