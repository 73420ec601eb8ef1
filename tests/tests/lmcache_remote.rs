//! lmcache's remote tier across worker processes: two prefill workers share one Redis
//! server, a prompt prefilled on A is a remote hit on B with the monolithic engine's tokens,
//! and B's answer and /metrics name the connector and the tier that served it. Skipped, with
//! a message, where redis-server is not installed.

#[path = "../../connectors/lmcache/tests/common/redis_server.rs"]
mod redis_server;

use kvconnect_api::KvLayout;
use kvconnect_tests::{metrics, monolithic, reference_model, token_ids, wait_until, Worker};
use redis_server::{skip, RedisServer};
use std::time::Duration;

const CHUNK: usize = 16;

fn worker(redis: &RedisServer, engine: &str) -> Worker {
    let cfg = format!(
        r#"{{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_producer","kv_connector_extra_config":{{"chunk_size":{CHUNK},"max_local_cpu_size":0.05,"remote_url":"{}"}}}}"#,
        redis.url()
    );
    let model = reference_model();
    Worker::start(&["--kv-transfer-config", &cfg, "--model", model.to_str().unwrap(), "--engine-id", engine])
}

#[test]
fn a_prompt_prefilled_on_one_worker_is_a_remote_hit_on_another() {
    let Some(redis) = RedisServer::start() else { return skip("lmcache_remote") };
    let a = worker(&redis, "remote-wa");
    let b = worker(&redis, "remote-wb");
    let prompt: Vec<u32> = (0..5 * CHUNK as u32 + 3).map(|i| (i * 37 + 11) % 256).collect();
    let mono = monolithic(std::slice::from_ref(&prompt), 4, KvLayout::NHD);
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 4});

    let (st, ra) = a.post("/v1/completions", &body);
    assert_eq!(st, 200, "{ra}\n{}", a.log());
    assert_eq!(ra["kvconnect"]["cache_sources"], serde_json::json!([]), "A computed the prompt: {ra}");
    // A's writes to the remote are in the background: wait for its five chunks.
    let mut conn = redis.client();
    assert!(
        wait_until(Duration::from_secs(10), || {
            redis::cmd("DBSIZE").query::<u64>(&mut conn).unwrap_or(0) >= 5
        }),
        "A's chunks never reached Redis\n{}",
        a.log()
    );

    let (st, rb) = b.post("/v1/completions", &body);
    assert_eq!(st, 200, "{rb}\n{}", b.log());
    let got: Vec<u32> = token_ids(&rb).into_iter().map(|t| t as u32).collect();
    assert_eq!(got, mono[0], "B's output equals the monolithic engine's");
    assert_eq!(rb["kvconnect"]["num_external_tokens"], 5 * CHUNK as u64, "{rb}");
    assert_eq!(
        rb["kvconnect"]["cache_sources"],
        serde_json::json!([{"connector": "lmcache", "tier": "remote", "tokens": 5 * CHUNK}]),
        "{rb}"
    );
    let m = metrics(&b.http);
    assert_eq!(
        m.get(r#"kvconnect_cache_hits_total{connector="lmcache",tier="remote"}"#),
        Some(&5.0),
        "{m:?}"
    );
    assert_eq!(
        m.get(r#"kvconnect_cache_remote_outcomes_total{connector="lmcache",outcome="corrupt"}"#),
        Some(&0.0),
        "{m:?}"
    );

    // Again on B: now from its CPU tier.
    let (_, rb2) = b.post("/v1/completions", &body);
    assert_eq!(
        rb2["kvconnect"]["cache_sources"],
        serde_json::json!([{"connector": "lmcache", "tier": "cpu", "tokens": 5 * CHUNK}]),
        "{rb2}"
    );
}
