//! Links that sat idle: decode keeps its data-plane connections to a prefill worker between
//! requests, and prefill closes those idle past its `idle_timeout` (shortened to 1 s here; 300
//! s by default). A request after such a lull loads its KV over a new connection, as the first
//! did: decode's metrics count every prompt token but the last as loaded, none recomputed and
//! no load failed, and the output equals the monolithic one. Prefill closes the idle
//! connections quietly: no WARN, no `timeout` refusal.

use kvconnect_api::KvLayout;
use kvconnect_tests::{
    disaggregated, metrics, monolithic, reference_worker_with_secret, token_ids, varied_prompts, wait_until,
    Worker,
};
use std::time::Duration;

const SECRET: &str = "idle-links-deployment-secret-0123456789";

/// Prefill's idle timeout, seconds.
const IDLE_S: f64 = 1.0;

fn worker(backend: &str, role: &str, id: &str, extra: &str) -> Worker {
    let config = format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","kv_connector_extra_config":{{"backend":"{backend}"{extra}}}}}"#
    );
    reference_worker_with_secret(&config, id, &[], SECRET)
}

/// The sum of decode's samples of `name` (every label set).
fn total(w: &Worker, name: &str) -> f64 {
    metrics(&w.http).iter().filter(|(k, _)| k.split('{').next() == Some(name)).map(|(_, v)| *v).sum()
}

fn a_request_after_a_lull_loads_its_kv(backend: &str) {
    let prefill = worker(
        backend,
        "kv_producer",
        &format!("prefill-idle-{backend}"),
        &format!(r#","idle_timeout":{IDLE_S}"#),
    );
    let decode = worker(backend, "kv_consumer", &format!("decode-idle-{backend}"), "");
    // 97, 128 and 129 tokens: several blocks each.
    let prompts: Vec<Vec<u32>> = varied_prompts(30).into_iter().skip(21).take(3).collect();
    let mono = monolithic(&prompts, 3, KvLayout::HND);
    for (i, (prompt, want)) in prompts.iter().zip(&mono).enumerate() {
        if i > 0 {
            // A lull: prefill closes decode's idle connections.
            std::thread::sleep(Duration::from_secs_f64(IDLE_S * 2.5));
        }
        let loaded_before = total(&decode, "kvconnect_kv_loaded_tokens_total");
        let (st, r) = disaggregated(&prefill, &decode, prompt, 3);
        assert_eq!(st, 200, "{backend} request {i}: {r}\n{}", decode.log());
        let what =
            format!("{backend}: request {i} ({} tokens, after a lull of {}s)", prompt.len(), IDLE_S * 2.5);
        assert_eq!(
            r["kvconnect"]["num_external_tokens"].as_u64(),
            Some(prompt.len() as u64 - 1),
            "{what}: {r}"
        );
        let loaded = total(&decode, "kvconnect_kv_loaded_tokens_total") - loaded_before;
        assert_eq!(loaded, (prompt.len() - 1) as f64, "{what}: loaded tokens\n{}", decode.log());
        assert_eq!(total(&decode, "kvconnect_kv_recomputed_requests_total"), 0.0, "{what}\n{}", decode.log());
        assert_eq!(total(&decode, "kvconnect_kv_load_failures_total"), 0.0, "{what}\n{}", decode.log());
        assert_eq!(&token_ids(&r).into_iter().map(|t| t as u32).collect::<Vec<_>>(), want, "{what}");
    }
    // Every hold ended by decode's done, none by its lease: no done went astray on a link
    // prefill had closed (decode sends it without waiting for the answer).
    let ended = |how: &str| {
        let key = format!("kvconnect_kv_holds_ended_total{{how=\"{how}\"}}");
        metrics(&prefill.http).get(&key).copied().unwrap_or(0.0)
    };
    let n = prompts.len() as f64;
    assert!(
        wait_until(Duration::from_secs(10), || ended("done") == n),
        "{backend}: holds done {}",
        ended("done")
    );
    assert_eq!(ended("expired"), 0.0, "{backend}: a hold ended by its lease");
    // The idle closes were quiet: no WARN, no refusal.
    let timeouts = r#"kvconnect_data_plane_refused_total{listener="producer",reason="timeout"}"#;
    assert_eq!(metrics(&prefill.http).get(timeouts).copied().unwrap_or(0.0), 0.0, "{backend}");
    let log = prefill.log();
    let warned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN"))
        .filter(|l| l.contains("Resource temporarily unavailable") || l.contains("nixl producer"))
        .collect();
    assert!(warned.is_empty(), "{backend}: prefill warned of an idle connection:\n{}", warned.join("\n"));
}

#[test]
fn a_request_after_a_lull_loads_its_kv_over_tcp() {
    a_request_after_a_lull_loads_its_kv("tcp");
}

#[test]
fn a_request_after_a_lull_loads_its_kv_over_shm() {
    a_request_after_a_lull_loads_its_kv("shm");
}
