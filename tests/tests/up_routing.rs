//! `kvconnect up --routing kv` end to end: the prefill workers publish their KV events, the
//! proxy follows them, and a prompt sent again goes to the prefill worker that cached it (in
//! lmcache's CPU tier, the default deployment's prefill cache: chunks of 256 tokens), which
//! loads its two full chunks instead of computing them; the router's predicted hits equal
//! what that worker reports. Against it, `--routing round-robin` spreads the same repeats over both
//! prefill workers.

use kvconnect_tests::http_request;
use serde_json::{json, Value};
use std::time::Duration;

/// A running `kvconnect up` (killed on drop; its workers die with it).
struct Up {
    child: std::process::Child,
    proxy: String,
    model: String,
    /// The prefill workers' HTTP addresses.
    prefill: Vec<String>,
}

impl Up {
    fn start(routing: &str) -> Up {
        Up::start_with(&[], routing)
    }

    /// With more arguments first (a deployment file).
    fn start_with(first: &[&str], routing: &str) -> Up {
        let mut args = first.to_vec();
        args.extend(["--prefill", "2", "--decode", "1", "--num-blocks", "128", "--routing", routing]);
        let (child, line) = kvconnect_tests::spawn_up(&args);
        let proxy = line["proxy"].as_str().unwrap().trim_start_matches("http://").to_owned();
        let (status, models) = http_request(&proxy, "GET", "/v1/models", None);
        assert_eq!(status, 200, "{models}");
        let model = models["data"][0]["id"].as_str().unwrap().to_owned();
        let prefill =
            line["prefill"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
        Up { child, proxy, model, prefill }
    }

    fn complete(&self, prompt: &str) -> Value {
        let body = json!({"model": self.model, "prompt": prompt, "max_tokens": 2, "temperature": 0});
        let (status, v) = http_request(&self.proxy, "POST", "/v1/completions", Some(&body));
        assert_eq!(status, 200, "{v}");
        v
    }

    /// The proxy's /metrics line starting with `name` (labels included), as a number.
    fn metric(&self, name: &str) -> u64 {
        let (_, body) = http_request(&self.proxy, "GET", "/metrics", None);
        let text = body.as_str().unwrap_or_default().to_owned();
        text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok())).unwrap_or(0)
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Distinct prompt `p` of 600 bytes (the reference tokenizer: one token a byte).
fn prompt(p: usize) -> String {
    (0..600).map(|i| char::from(b'a' + ((i * 7 + p * 3) % 26) as u8)).collect()
}

/// Sends `prompt`; which prefill worker served it, and the tokens it took from cache.
fn served(up: &Up, prompt: &str) -> (String, u64) {
    let v = up.complete(prompt);
    // Give the worker's events time to reach the proxy.
    std::thread::sleep(Duration::from_millis(300));
    let k = &v["kvconnect"];
    let worker = k["proxy"]["prefill_worker"].as_str().unwrap().to_owned();
    let hit = k["prefill"]["num_cached_tokens"].as_u64().unwrap_or(0)
        + k["prefill"]["num_external_tokens"].as_u64().unwrap_or(0);
    (worker, hit)
}

/// Four distinct prompts, each sent four times in a row.
fn repeats(up: &Up) -> Vec<Vec<(String, u64)>> {
    (0..4).map(|p| (0..4).map(|_| served(up, &prompt(p))).collect()).collect()
}

#[test]
fn routing_kv_sends_a_repeated_prompt_to_the_prefill_worker_that_cached_it() {
    let up = Up::start("kv");
    let served = repeats(&up);
    for (p, runs) in served.iter().enumerate() {
        let first = &runs[0].0;
        for (i, (worker, hit)) in runs.iter().enumerate().skip(1) {
            assert_eq!(worker, first, "prompt {p} repeat {i} left the worker that cached it: {runs:?}");
            // 600 tokens: two full chunks of 256 in lmcache.
            assert_eq!(*hit, 512, "prompt {p} repeat {i}: {runs:?}");
        }
    }
    let by_kv = up.metric("kvconnect_router_decisions_total{by=\"kv\"}");
    assert!(by_kv >= 12, "the repeats were routed by the index: {by_kv}");
    let predicted = up.metric("kvconnect_router_predicted_hit_tokens_total");
    let actual = up.metric("kvconnect_router_actual_hit_tokens_total");
    assert!(predicted >= 12 * 512, "{predicted}");
    assert_eq!(predicted, actual, "the index predicted what the workers hit");
    assert_eq!(up.metric("kvconnect_router_event_batches_dropped_total{reason=\"malformed\"}"), 0);

    // The same repeats round-robin: each prompt's repeats go to both prefill workers.
    let rr = Up::start("round-robin");
    let served = repeats(&rr);
    for runs in &served {
        let first = &runs[0].0;
        assert!(runs.iter().any(|(w, _)| w != first), "round-robin kept a prompt on one worker: {runs:?}");
    }
    assert_eq!(rr.metric("kvconnect_router_decisions_total{by=\"kv\"}"), 0);
}

/// Prefill workers whose LMCache CPU tiers hold two prompts each (4 chunks of 256 tokens), six
/// prompts through them, some repeated while cached and some after eviction. The router
/// learns each eviction from the worker's events, so a prompt evicted from the worker that had
/// it is predicted as no hit: every prediction equals what the worker then hit. The workers'
/// /metrics show the tiers full and evicting.
#[test]
fn routing_kv_follows_evictions_from_tiers_too_small_for_the_prompts() {
    let dir = tempfile::tempdir().unwrap();
    // The reference model's KV is 512 bytes a token: 128 KiB a chunk.
    let (chunk, slots) = (512 * 256u64, 4u64);
    let gib = (slots * chunk) as f64 / (1u64 << 30) as f64;
    let prefill = format!(
        r#"{{"kv_connector":"PdConnector","kv_role":"kv_producer","kv_connector_extra_config":{{"connectors":[{{"kv_connector":"LMCacheConnectorV1","kv_connector_extra_config":{{"max_local_cpu_size":{gib}}}}},{{"kv_connector":"NixlConnector","kv_connector_extra_config":{{"backend":"shm"}}}}]}}}}"#
    );
    let decode = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"backend":"shm"}}"#;
    let model = kvconnect_tests::reference_model();
    let file =
        kvconnect_tests::write_deployment(dir.path(), "small.toml", &model, (&prefill, ""), (decode, ""));
    let up = Up::start_with(&[file.to_str().unwrap()], "kv");
    // Four prompts fill the two tiers, two of them come again (hits), two new ones evict, and
    // all six come again.
    let order = [0, 1, 2, 3, 0, 1, 4, 5, 0, 1, 2, 3, 4, 5];
    let seq: Vec<(String, u64)> = order.iter().map(|p| served(&up, &prompt(*p))).collect();
    let predicted = up.metric("kvconnect_router_predicted_hit_tokens_total");
    let actual = up.metric("kvconnect_router_actual_hit_tokens_total");
    assert_eq!(predicted, actual, "the index predicted what the workers hit: {seq:?}");
    assert_eq!(up.metric("kvconnect_router_predictions_total{outcome=\"over\"}"), 0, "{seq:?}");
    // Twelve chunks through two tiers of four: some repeats hit, and some find their prompt
    // evicted.
    let repeat = |i: usize| order[..i].contains(&order[i]);
    assert!(seq.iter().enumerate().any(|(i, (_, hit))| repeat(i) && *hit > 0), "no repeat hit: {seq:?}");
    assert!(seq.iter().enumerate().any(|(i, (_, hit))| repeat(i) && *hit == 0), "none evicted: {seq:?}");
    let mut evicted = 0;
    for w in &up.prefill {
        let m = kvconnect_tests::metrics(w);
        let get =
            |k: &str| m.get(&format!(r#"{k}{{connector="lmcache",tier="cpu"}}"#)).copied().unwrap_or(-1.0);
        assert_eq!(get("kvconnect_cache_capacity_bytes"), (slots * chunk) as f64, "{w}: {m:?}");
        assert!(get("kvconnect_cache_used_bytes") <= (slots * chunk) as f64, "{w}: {m:?}");
        evicted += get("kvconnect_cache_evictions_total") as i64;
    }
    assert!(evicted > 0, "the tiers evicted nothing: {seq:?}");
}
