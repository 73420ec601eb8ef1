//! The remote tier's read of one 8 MiB chunk (GET, header and checksum check) against a plain
//! Redis GET of the same bytes on the same server, in interleaved pairs, and its hit latency.
//!
//! `cargo bench -p kvconnect-lmcache --bench remote` (needs redis-server on PATH; skips
//! otherwise, saying so). Prints one line per figure and a JSON summary. Without `--bench` (as
//! `cargo test` runs it) it reads a 4 KiB chunk in one pair. Every read's bytes are checked.

#[path = "../tests/common/redis_server.rs"]
mod redis_server;

use kvconnect_lmcache::config::RemoteConfig;
use kvconnect_lmcache::key::ChunkKey;
use kvconnect_lmcache::remote_tier::{redis_key, RemoteRead, RemoteTier};
use std::sync::Arc;
use std::time::Instant;

/// The chunk and the pairs of one run: the benchmark's (`REMOTE_BENCH_PAIRS`, 41 by default),
/// or the tiny one of a test run.
fn size() -> (usize, usize) {
    match kvconnect_support::stats::bench_pairs("REMOTE_BENCH_PAIRS", 41) {
        None => (4096, 1),
        Some(pairs) => (8 << 20, pairs),
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    let i = ((q * (sorted.len() - 1) as f64).round() as usize).min(sorted.len() - 1);
    sorted[i]
}

fn main() {
    let (chunk, pairs) = size();
    let Some(redis) = redis_server::RedisServer::start() else {
        redis_server::skip("bench remote");
        return;
    };
    let cfg = RemoteConfig { url: redis.url(), timeout_ms: 2000, retry_ms: 500 };
    let tier = RemoteTier::open(&cfg).expect("remote tier");
    let key = ChunkKey([0x1234_5678, 0x9abc_def0]);
    let data: Vec<u8> = (0..chunk).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    tier.put(key, Arc::new(data.clone().into()));
    tier.flush();
    let mut conn = redis.client();
    let plain_key = "bench:plain";
    let () = redis::cmd("SET").arg(plain_key).arg(&data).query(&mut conn).expect("SET");
    // Warm both paths.
    for _ in 0..3 {
        assert!(matches!(tier.get(&key), RemoteRead::Hit(_)));
        let _: Vec<u8> = redis::cmd("GET").arg(plain_key).query(&mut conn).expect("GET");
    }
    let (mut tier_ms, mut plain_ms, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..pairs {
        // Alternate which goes first, so neither always runs on a warmer cache.
        let mut one = |which: bool| -> f64 {
            let t0 = Instant::now();
            if which {
                match tier.get(&key) {
                    RemoteRead::Hit(c) => {
                        assert!(c.data() == data.as_slice(), "the tier read back other bytes")
                    }
                    _ => panic!("the remote chunk was not read back"),
                }
            } else {
                let v: Vec<u8> = redis::cmd("GET").arg(plain_key).query(&mut conn).expect("GET");
                assert!(v == data, "the plain GET read back other bytes");
            }
            t0.elapsed().as_secs_f64() * 1e3
        };
        let (t, p) = if i % 2 == 0 {
            let t = one(true);
            (t, one(false))
        } else {
            let p = one(false);
            (one(true), p)
        };
        tier_ms.push(t);
        plain_ms.push(p);
        // Throughput of the tier's read relative to a plain GET: 1.0 = as fast.
        ratio.push(p / t);
    }
    for v in [&mut tier_ms, &mut plain_ms, &mut ratio] {
        v.sort_by(f64::total_cmp);
    }
    let q = |v: &[f64]| (quantile(v, 0.25), quantile(v, 0.5), quantile(v, 0.75));
    let (r1, r2, r3) = q(&ratio);
    println!("remote tier read of one {} KiB chunk vs plain GET, {pairs} interleaved pairs:", chunk >> 10);
    println!(
        "  throughput ratio (plain GET time / tier read time): median {r2:.3}, quartiles {r1:.3} .. {r3:.3}"
    );
    println!(
        "  tier read ms: p50 {:.2}  p99 {:.2}   plain GET ms: p50 {:.2}  p99 {:.2}",
        quantile(&tier_ms, 0.5),
        quantile(&tier_ms, 0.99),
        quantile(&plain_ms, 0.5),
        quantile(&plain_ms, 0.99)
    );
    println!(
        "{}",
        serde_json::json!({
            "pairs": pairs,
            "chunk_bytes": chunk,
            "ratio_median": r2, "ratio_q1": r1, "ratio_q3": r3,
            "tier_ms_p50": quantile(&tier_ms, 0.5), "tier_ms_p99": quantile(&tier_ms, 0.99),
            "plain_ms_p50": quantile(&plain_ms, 0.5), "plain_ms_p99": quantile(&plain_ms, 0.99),
            "key": redis_key(&key),
        })
    );
}
