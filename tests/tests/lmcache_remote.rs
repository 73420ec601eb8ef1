//! lmcache's remote tier across worker processes: two prefill workers share one Redis
//! server, a prompt prefilled on A is a remote hit on B with the monolithic engine's tokens,
//! and B's answer and /metrics name the connector and the tier that served it. Skipped, with
//! a message, where redis-server is not installed. A Redis killed mid-workload costs misses,
//! counted in /metrics, never a wrong or failed answer; restarted, hits resume; a corrupt
//! value under a real key is a miss counted as corrupt.

#[path = "../../connectors/lmcache/tests/common/redis_server.rs"]
mod redis_server;

use kvconnect_api::KvLayout;
use kvconnect_tests::{metrics, monolithic, reference_model, token_ids, wait_until, Worker};
use redis_server::{skip, RedisServer};
use std::time::Duration;

const CHUNK: usize = 16;

fn worker(redis: &RedisServer, engine: &str) -> Worker {
    // A short back-off after a failed remote call, so the restart test need not wait long, and
    // a generous timeout: a loaded 2-core machine can stall a call past the default 200 ms,
    // which drops writes the tests count on (a dead server refuses at once either way).
    let cfg = format!(
        r#"{{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_producer","kv_connector_extra_config":{{"chunk_size":{CHUNK},"max_local_cpu_size":0.05,"remote_url":"{}","remote_timeout_ms":2000,"remote_retry_ms":200}}}}"#,
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

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + seed * 101 + 11) % 256).collect()
}

fn keys(redis: &RedisServer) -> u64 {
    redis::cmd("DBSIZE").query::<u64>(&mut redis.client()).unwrap_or(0)
}

/// Posts `p` to `w` and checks the answer against the monolithic engine's.
fn complete_checked(w: &Worker, p: &[u32], what: &str) -> serde_json::Value {
    let mono = monolithic(&[p.to_vec()], 4, KvLayout::NHD);
    let (st, r) = w.post("/v1/completions", &serde_json::json!({"prompt": p, "max_tokens": 4}));
    assert_eq!(st, 200, "{what}: {r}\n{}", w.log());
    let got: Vec<u32> = token_ids(&r).into_iter().map(|t| t as u32).collect();
    assert_eq!(got, mono[0], "{what}: the answer equals the monolithic engine's");
    r
}

fn remote_outcome(w: &Worker, outcome: &str) -> f64 {
    let key = format!(r#"kvconnect_cache_remote_outcomes_total{{connector="lmcache",outcome="{outcome}"}}"#);
    metrics(&w.http).get(&key).copied().unwrap_or(0.0)
}

fn remote_hits(w: &Worker) -> f64 {
    let key = r#"kvconnect_cache_hits_total{connector="lmcache",tier="remote"}"#;
    metrics(&w.http).get(key).copied().unwrap_or(0.0)
}

#[test]
fn redis_killed_mid_workload_costs_counted_misses_and_restarted_serves_hits_again() {
    let Some(mut redis) = RedisServer::start() else { return skip("lmcache_remote") };
    let a = worker(&redis, "remote-kill-wa");
    let b = worker(&redis, "remote-kill-wb");
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(i, 3 * CHUNK + 2)).collect();

    // A prefills the whole workload; B hits the first prompt remotely.
    for (i, p) in prompts.iter().enumerate() {
        complete_checked(&a, p, &format!("A, prompt {i}"));
    }
    assert!(
        wait_until(Duration::from_secs(10), || keys(&redis) >= 6 * 3),
        "A's chunks never reached Redis\n{}",
        a.log()
    );
    let r = complete_checked(&b, &prompts[0], "B before the kill");
    assert_eq!(r["kvconnect"]["num_external_tokens"], 3 * CHUNK as u64, "{r}");

    // Redis dies mid-workload: B's remaining requests all answer right, and on time.
    redis.kill();
    let t0 = std::time::Instant::now();
    for (i, p) in prompts.iter().enumerate().skip(1) {
        let r = complete_checked(&b, p, &format!("B with Redis down, prompt {i}"));
        assert_eq!(r["kvconnect"]["cache_sources"], serde_json::json!([]), "nothing loaded: {r}");
    }
    assert!(t0.elapsed() < Duration::from_secs(20), "five requests took {:?} with Redis down", t0.elapsed());
    let failed = remote_outcome(&b, "error") + remote_outcome(&b, "miss") + remote_outcome(&b, "skipped");
    assert!(failed >= 5.0, "every remote lookup after the kill is counted, got {failed}\n{}", b.log());
    // A keeps serving too; its writes to the dead remote are counted, not fatal.
    complete_checked(&a, &prompt(50, 2 * CHUNK + 1), "A with Redis down");
    assert!(
        wait_until(Duration::from_secs(10), || remote_outcome(&a, "write_error")
            + remote_outcome(&a, "write_dropped")
            >= 1.0),
        "A's failed writes are counted\n{}",
        a.log()
    );

    // Restarted (empty): once the back-off has passed, A's next prefill reaches it (its kept
    // connections are replaced, not counted as failures) and B hits.
    redis.restart();
    std::thread::sleep(Duration::from_secs(4));
    let fresh = prompt(99, 2 * CHUNK + 5);
    complete_checked(&a, &fresh, "A after the restart");
    assert!(
        wait_until(Duration::from_secs(10), || keys(&redis) >= 2),
        "A's writes never resumed after the restart\n{}",
        a.log()
    );
    let before = remote_hits(&b);
    let r = complete_checked(&b, &fresh, "B after the restart");
    assert_eq!(
        r["kvconnect"]["cache_sources"],
        serde_json::json!([{"connector": "lmcache", "tier": "remote", "tokens": 2 * CHUNK}]),
        "{r}\n{}",
        b.log()
    );
    assert_eq!(remote_hits(&b), before + 2.0);
}

#[test]
fn a_corrupt_value_under_a_real_key_is_a_miss_counted_as_corrupt() {
    let Some(redis) = RedisServer::start() else { return skip("lmcache_remote") };
    let a = worker(&redis, "remote-corrupt-wa");
    let b = worker(&redis, "remote-corrupt-wb");
    let p = prompt(7, 2 * CHUNK + 3);
    complete_checked(&a, &p, "A");
    assert!(wait_until(Duration::from_secs(10), || keys(&redis) >= 2), "A's chunks never reached Redis");

    // Flip one byte in the middle of every value A wrote: the keys are the real ones.
    let mut conn = redis.client();
    let names: Vec<Vec<u8>> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert_eq!(names.len(), 2, "one key per full chunk");
    for k in &names {
        let mut v: Vec<u8> = redis::cmd("GET").arg(k).query(&mut conn).unwrap();
        let mid = v.len() / 2;
        v[mid] ^= 0x5a;
        let () = redis::cmd("SET").arg(k).arg(&v).query(&mut conn).unwrap();
    }

    let r = complete_checked(&b, &p, "B over corrupt values");
    assert_eq!(r["kvconnect"]["cache_sources"], serde_json::json!([]), "nothing corrupt is loaded: {r}");
    assert!(remote_outcome(&b, "corrupt") >= 1.0, "{}", b.log());
    assert_eq!(remote_hits(&b), 0.0);
}
