//! The composite on the real data path: prefill runs PdConnector[lmcache, nixl] and decode a
//! plain nixl, both started from one deployment file and negotiated jointly (`--joint`), so
//! they agree on HMA off by construction (the fix for DYN-3545). Every decode must load the
//! prompt's KV from prefill through the composite's nixl child and produce exactly the tokens
//! of a single worker. A repeated prompt is then found in the composite's lmcache child on
//! prefill (first hit wins) and still decodes to the same tokens. The composite on decode,
//! as kv_consumer or kv_both, loads through its own nixl child the same way.

use kvconnect_api::KvLayout;
use kvconnect_tests::{
    disaggregated, monolithic, reference_model, token_ids, varied_prompts, write_deployment, Worker,
};

const MAX_TOKENS: usize = 4;

/// PdConnector[lmcache, nixl over shared memory] in `role`.
fn composite(role: &str) -> String {
    format!(
        r#"{{"kv_connector":"PdConnector","kv_role":"{role}","kv_connector_extra_config":{{"connectors":[{{"kv_connector":"LMCacheConnectorV1"}},{{"kv_connector":"NixlConnector","kv_connector_extra_config":{{"backend":"shm"}}}}]}}}}"#
    )
}

/// A deployment file `name` with the composite on prefill and `decode` on decode.
fn deployment_with(dir: &std::path::Path, name: &str, decode: &str) -> std::path::PathBuf {
    write_deployment(dir, name, &reference_model(), (&composite("kv_producer"), ""), (decode, ""))
}

/// Every prompt through prefill then decode: monolithic tokens, and decode loaded all but
/// the last prompt token from prefill.
fn all_loaded(prefill: &Worker, decode: &Worker, prompts: &[Vec<u32>], what: &str) {
    let mono = monolithic(prompts, MAX_TOKENS, KvLayout::HND);
    for (i, p) in prompts.iter().enumerate() {
        let (st, d) = disaggregated(prefill, decode, p, MAX_TOKENS);
        assert_eq!(
            st,
            200,
            "{what} prompt {i}: {d}\nprefill log:\n{}\ndecode log:\n{}",
            prefill.log(),
            decode.log()
        );
        let got: Vec<u32> = token_ids(&d).into_iter().map(|t| t as u32).collect();
        assert_eq!(got, mono[i], "{what} prompt {i} (len {}): disaggregated != monolithic", p.len());
        assert_eq!(
            d["kvconnect"]["num_external_tokens"].as_u64(),
            Some(p.len() as u64 - 1),
            "{what} prompt {i}: decode must load all but the last prompt token from prefill: {d}"
        );
    }
}

fn deployment(dir: &std::path::Path) -> std::path::PathBuf {
    deployment_with(
        dir,
        "pd.toml",
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"backend":"shm"}}"#,
    )
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
    all_loaded(&prefill, &decode, &varied_prompts(12), "plain decode");
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

#[test]
fn a_composite_decode_loads_through_its_nixl_child_as_consumer_and_as_both() {
    let dir = tempfile::tempdir().unwrap();
    for role in ["kv_consumer", "kv_both"] {
        let file = deployment_with(dir.path(), &format!("pd-{role}.toml"), &composite(role));
        let file = file.to_str().unwrap();
        let start = |side: &str| {
            let id = format!("pdd-{side}-{role}");
            Worker::start(&["--deployment", file, "--role", side, "--joint", "--engine-id", &id])
        };
        all_loaded(&start("prefill"), &start("decode"), &varied_prompts(6), role);
    }
}
