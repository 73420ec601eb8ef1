//! Dynamo DYN-3545 at run time: prefill runs PdConnector[lmcache, nixl] (lmcache does not
//! support HMA, so negotiation turns it off), decode runs a plain NixlConnector negotiated
//! alone (HMA on for the hybrid reference model). The side-channel handshake is refused with
//! the HMA diff before any KV moves; `recompute` still gives the monolithic tokens, `fail`
//! ends the request with that reason. Nothing from the refused peer reaches decode's cache.

use kvconnect_api::KvLayout;
use kvconnect_tests::{disaggregated, monolithic, reference_model, token_ids, varied_prompts, Worker};

const PREFILL: &str = r#"{"kv_connector":"PdConnector","kv_role":"kv_producer","kv_connector_extra_config":{"connectors":[{"kv_connector":"LMCacheConnectorV1"},{"kv_connector":"NixlConnector","kv_connector_extra_config":{"backend":"shm"}}]}}"#;

fn decode_config(policy: &str) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"{policy}","kv_connector_extra_config":{{"backend":"shm"}}}}"#
    )
}

fn worker(config: &str, id: &str) -> Worker {
    let model = reference_model();
    Worker::start(&["--kv-transfer-config", config, "--model", model.to_str().unwrap(), "--engine-id", id])
}

#[test]
fn refused_handshake_recomputes_or_fails_with_the_hma_diff() {
    let prefill = worker(PREFILL, "prefill-pd");
    let recompute = worker(&decode_config("recompute"), "decode-recompute");
    let fail = worker(&decode_config("fail"), "decode-fail");
    let prompts = varied_prompts(6);
    let mono = monolithic(&prompts, 4, KvLayout::HND);

    for (i, p) in prompts.iter().enumerate() {
        let (st, d) = disaggregated(&prefill, &recompute, p, 4);
        assert_eq!(st, 200, "{d}");
        let got: Vec<u32> = token_ids(&d).into_iter().map(|t| t as u32).collect();
        assert_eq!(got, mono[i], "prompt {i}: recomputed output must equal monolithic");
        assert_eq!(d["kvconnect"]["num_external_tokens"], 0, "{d}");
        if p.len() > 1 {
            assert_eq!(d["kvconnect"]["kv_load"]["recomputed"], true, "{d}");
            let why = d["kvconnect"]["kv_load"]["reason"].as_str().unwrap_or_default();
            assert!(why.contains("hma: prefill=off") && why.contains("decode=on"), "{why}");
        }
    }
    let (_, h) = recompute.get("/health");
    assert_eq!(h["pool"]["external_tokens"], 0, "nothing may be loaded from a refused peer: {h}");
    assert!(recompute.log().contains("handshake refused"), "{}", recompute.log());

    let (st, d) = disaggregated(&prefill, &fail, &prompts[5], 4);
    assert_eq!(st, 502, "{d}");
    let msg = d["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("hma: prefill=off"), "{msg}");
    assert!(msg.contains("lmcache"), "the diff names the child that turned HMA off: {msg}");
    assert!(msg.contains("decode=on"), "{msg}");
    assert!(msg.contains("kv_load_failure_policy is 'fail'"), "{msg}");
    let diff = d["error"]["diff"].as_array().cloned().unwrap_or_default();
    assert!(diff.iter().any(|f| f["field"] == "hma"), "{d}");
    let (_, h) = fail.get("/health");
    assert_eq!(h["pool"]["external_tokens"], 0, "{h}");

    // The prefill side refused once per decode engine (the refusal is remembered).
    let (_, h) = prefill.get("/health");
    assert_eq!(h["side_channel"]["refused"], 2, "{h}");
    assert_eq!(h["side_channel"]["welcomed"], 0, "{h}");
}
