//! MLA KV (DeepSeek-V2-Lite: one 576-wide latent per token and layer, no separate K and V)
//! through real worker processes moving synthetic KV: prefill runs PdConnector[lmcache, nixl],
//! decode a plain nixl, each negotiated alone. lmcache prefers NHD and nixl takes any layout
//! for MLA, so prefill works in NHD and decode in HND; with one KV head those are the same
//! bytes. Decode loads every prompt token but the last and checks every loaded block against
//! the pattern prefill wrote.

use kvconnect_tests::{fixture_model, http_request_with, write_deployment, Worker};

const COMPOSITE: &str = r#"{"kv_connector":"PdConnector","kv_role":"kv_producer","kv_connector_extra_config":{"connectors":[{"kv_connector":"LMCacheConnectorV1"},{"kv_connector":"NixlConnector","kv_connector_extra_config":{"backend":"shm"}}]}}"#;
const NIXL: &str = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"backend":"shm"}}"#;

#[test]
fn deepseek_kv_moves_from_a_composite_prefill_to_a_plain_decode() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture_model("deepseek-ai--DeepSeek-V2-Lite");
    let file = write_deployment(dir.path(), "deepseek.toml", &model, (COMPOSITE, ""), (NIXL, ""));
    let start = |role: &str| {
        let id = format!("mla-{role}");
        let args =
            ["--deployment", file.to_str().unwrap(), "--role", role, "--synthetic-kv", "--engine-id", &id];
        Worker::start(&[&args[..], &["--num-blocks", "64"]].concat())
    };
    let (p, d) = (start("prefill"), start("decode"));
    for len in [17usize, 100, 300] {
        let prompt: Vec<u32> = (0..len as u32).map(|i| (i * 13 + 5) % 256).collect();
        // One request id on both sides, as a proxy sends it: the pattern is salted with it.
        let rid = format!("mla-{len}");
        let post = |w: &Worker, body: serde_json::Value| {
            http_request_with(&w.http, "POST", "/v1/completions", &[("X-Request-Id", &rid)], Some(&body))
        };
        let (st, pre) = post(
            &p,
            serde_json::json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
        );
        assert_eq!(st, 200, "{pre}\n{}", p.log());
        let (st, r) = post(
            &d,
            serde_json::json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": pre["kv_transfer_params"]}),
        );
        assert_eq!(st, 200, "len {len}: {r}\n{}", d.log());
        assert_eq!(r["kvconnect"]["num_external_tokens"].as_u64(), Some(len as u64 - 1), "len {len}: {r}");
        assert_eq!(
            r["kv_transfer_params"]["verified"], true,
            "len {len}: every loaded block holds prefill's bytes: {r}"
        );
    }
}
