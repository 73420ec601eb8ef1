//! Workers started from one deployment file: negotiated alone, DYN-3545 reappears at the
//! handshake (refused, recomputed); negotiated jointly (`--joint`), prefill's
//! PdConnector[lmcache, nixl] and decode's plain nixl agree on HMA and the KV moves.

use kvconnect_api::KvLayout;
use kvconnect_tests::{disaggregated, monolithic, reference_model, token_ids, varied_prompts, Worker};

fn deployment(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("dyn3545.toml");
    let src = format!(
        r#"model = "{}"

[prefill]
kv_transfer_config = '{{"kv_connector":"PdConnector","kv_connector_extra_config":{{"connectors":[{{"kv_connector":"LMCacheConnectorV1"}},{{"kv_connector":"NixlConnector"}}]}}}}'

[decode]
kv_transfer_config = '{{"kv_connector":"NixlConnector"}}'
"#,
        reference_model().display()
    );
    std::fs::write(&path, src).unwrap();
    path
}

fn start(file: &std::path::Path, role: &str, joint: bool) -> Worker {
    let mut args = vec!["--deployment", file.to_str().unwrap(), "--role", role];
    if joint {
        args.push("--joint");
    }
    Worker::start(&args)
}

#[test]
fn joint_negotiation_lets_the_kv_move_and_alone_it_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = deployment(dir.path());
    let prompts = varied_prompts(24);
    let picks = [&prompts[13], &prompts[23]]; // 40 and 160 tokens: past the sliding window
    let mono = monolithic(&picks.iter().map(|p| p.to_vec()).collect::<Vec<_>>(), 4, KvLayout::HND);

    let (p, d) = (start(&file, "prefill", true), start(&file, "decode", true));
    let (_, ph) = p.get("/health");
    let (_, dh) = d.get("/health");
    assert_eq!(ph["compat_hash"], dh["compat_hash"], "joint negotiation gives one hash");
    for (i, prompt) in picks.iter().enumerate() {
        let (st, r) = disaggregated(&p, &d, prompt, 4);
        assert_eq!(st, 200, "{r}");
        assert_eq!(token_ids(&r).into_iter().map(|t| t as u32).collect::<Vec<_>>(), mono[i]);
        assert_eq!(r["kvconnect"]["num_external_tokens"].as_u64(), Some(prompt.len() as u64 - 1), "{r}");
    }
    drop((p, d));

    let (p, d) = (start(&file, "prefill", false), start(&file, "decode", false));
    let (st, r) = disaggregated(&p, &d, picks[0], 4);
    assert_eq!(st, 200, "{r}");
    assert_eq!(token_ids(&r).into_iter().map(|t| t as u32).collect::<Vec<_>>(), mono[0]);
    assert_eq!(r["kvconnect"]["num_external_tokens"], 0, "{r}");
    let why = r["kvconnect"]["kv_load"]["reason"].as_str().unwrap_or_default();
    assert!(why.contains("hma: prefill=off"), "{why}");
}
