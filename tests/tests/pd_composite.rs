//! The composite on the real data path: prefill runs PdConnector[lmcache, nixl] and decode a
//! plain nixl, both started from one deployment file and negotiated jointly (`--joint`), so
//! they agree on HMA off by construction (the fix for DYN-3545). Every decode must load the
//! prompt's KV from prefill through the composite's nixl child and produce exactly the tokens
//! of a single worker. A repeated prompt is then found in the composite's lmcache child on
//! prefill (first hit wins) and still decodes to the same tokens.

use kvconnect_api::KvLayout;
use kvconnect_tests::{disaggregated, monolithic, reference_model, token_ids, varied_prompts, Worker};

const MAX_TOKENS: usize = 4;

fn deployment(dir: &std::path::Path) -> std::path::PathBuf {
    let model = reference_model();
    let text = format!(
        r#"model = "{}"

[prefill]
kv_transfer_config = '{{"kv_connector":"PdConnector","kv_role":"kv_producer","kv_connector_extra_config":{{"connectors":[{{"kv_connector":"LMCacheConnectorV1"}},{{"kv_connector":"NixlConnector","kv_connector_extra_config":{{"backend":"shm"}}}}]}}}}'

[decode]
kv_transfer_config = '{{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{{"backend":"shm"}}}}'
"#,
        model.display()
    );
    let path = dir.join("pd.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn composite_prefill_and_plain_decode_from_one_deployment_give_monolithic_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let file = deployment(dir.path());
    let file = file.to_str().unwrap();
    let prefill =
        Worker::start(&["--deployment", file, "--role", "prefill", "--joint", "--engine-id", "pd-prefill"]);
    let decode =
        Worker::start(&["--deployment", file, "--role", "decode", "--joint", "--engine-id", "pd-decode"]);
    let prompts = varied_prompts(12);
    let mono = monolithic(&prompts, MAX_TOKENS, KvLayout::HND);
    for (i, p) in prompts.iter().enumerate() {
        let (st, d) = disaggregated(&prefill, &decode, p, MAX_TOKENS);
        assert_eq!(
            st,
            200,
            "prompt {i}: {d}\nprefill log:\n{}\ndecode log:\n{}",
            prefill.log(),
            decode.log()
        );
        let got: Vec<u32> = token_ids(&d).into_iter().map(|t| t as u32).collect();
        assert_eq!(got, mono[i], "prompt {i} (len {}): disaggregated != monolithic", p.len());
        assert_eq!(
            d["kvconnect"]["num_external_tokens"].as_u64(),
            Some(p.len() as u64 - 1),
            "prompt {i}: decode must load all but the last prompt token from prefill: {d}"
        );
    }
    // The same long prompt again: prefill's lookup reaches lmcache first (first hit wins), so
    // prefill loads the cached chunks instead of computing them.
    let long: Vec<u32> = (0..600u32).map(|j| (j * 37 + 11) % 256).collect();
    let ask = || {
        let (st, p) = prefill.post(
            "/v1/completions",
            &serde_json::json!({"prompt": long, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
        );
        assert_eq!(st, 200, "{p}");
        p
    };
    let first = ask();
    let second = ask();
    assert_eq!(first["kvconnect"]["num_external_tokens"], 0, "{first}");
    assert!(second["kvconnect"]["num_external_tokens"].as_u64().unwrap_or(0) >= 512, "{second}");
    assert_eq!(first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]);
    // Decode pulls those blocks (partly loaded from lmcache on prefill) through nixl and
    // still continues exactly as a single worker would.
    let (st, d) = decode.post(
        "/v1/completions",
        &serde_json::json!({"request_id": second["id"], "prompt": long, "max_tokens": MAX_TOKENS, "kv_transfer_params": second["kv_transfer_params"]}),
    );
    assert_eq!(st, 200, "{d}");
    assert_eq!(d["kvconnect"]["num_external_tokens"].as_u64(), Some(long.len() as u64 - 1), "{d}");
    let got: Vec<u32> = token_ids(&d).into_iter().map(|t| t as u32).collect();
    assert_eq!(got, monolithic(std::slice::from_ref(&long), MAX_TOKENS, KvLayout::HND)[0]);
}
