//! The remote tier on a real Redis server: two prefill-side stores share it (a prompt
//! prefilled on A is a remote hit on B, with the KV a monolithic engine computes), a server
//! killed mid-workload costs misses (counted) and never a wrong or failed request, a restarted
//! one serves hits again, and a corrupt value under a real key is a miss counted as corrupt.
//! The remote's KV events, replayed, give what Redis holds, through eviction, a DEL and a
//! restart. Skipped, with a message, where redis-server is not installed. A remote that
//! accepts connections and never answers (no Redis needed) costs timeouts, counted, never an
//! answer.

mod common;
#[path = "common/redis_server.rs"]
mod redis_server;

use common::*;
use kvconnect_api::TierTokens;
use kvconnect_api::{BlocksPerGroup, KvEvent, KvLayout, Medium, StepInfo};
use kvconnect_lmcache::key::{chunk_keys, Namespace};
use kvconnect_lmcache::remote_tier::redis_key;
use kvconnect_lmcache::remote_watch::chunk_of;
use redis_server::{skip, RedisServer};
use serde_json::json;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const CHUNK: usize = 16;

/// The timeout is generous: these tests are about what is shared and what a dead server
/// costs (a refused connection fails at once), and a loaded 2-core machine can stall a
/// 100 ms call, which would drop writes the tests count on. The back-off is short so the
/// restart test need not wait long.
fn extra(url: &str) -> serde_json::Value {
    extra_with_timeout(url, 5000)
}

fn extra_with_timeout(url: &str, timeout_ms: u64) -> serde_json::Value {
    json!({
        "chunk_size": CHUNK,
        "max_local_cpu_size": gb(64 * chunk_bytes(CHUNK)),
        "remote_url": url,
        "remote_timeout_ms": timeout_ms,
        "remote_retry_ms": 50,
    })
}

/// Runs `tokens` on `e` and checks its KV cache holds exactly what computing the prompt gives.
fn run_checked(e: &mut Engine, id: &str, tokens: &[u32]) -> (usize, usize) {
    let (matched, blocks, errors) = e.run(id, tokens, 0);
    let bad = e.mismatches(tokens, &blocks, 0, tokens.len());
    assert!(bad.is_empty(), "{id}: KV differs from the computed prompt at positions {bad:?}");
    (matched, errors.len())
}

#[test]
fn a_prompt_prefilled_on_one_store_is_a_remote_hit_on_another() {
    let Some(redis) = RedisServer::start() else { return skip("remote_redis") };
    let p = prompt(7, 3 * CHUNK + 5);
    let mut a = Engine::new("remote-share-a", KvLayout::NHD, 8, extra(&redis.url()));
    assert_eq!(run_checked(&mut a, "a0", &p), (0, 0));
    kvconnect_lmcache::flush("remote-share-a");
    let sa = kvconnect_lmcache::stats("remote-share-a").unwrap();
    assert_eq!(sa.remote_writes, 3, "three full chunks written to the remote: {sa:?}");

    let mut b = Engine::new("remote-share-b", KvLayout::NHD, 8, extra(&redis.url()));
    let (matched, errors) = run_checked(&mut b, "b0", &p);
    assert_eq!((matched, errors), (3 * CHUNK, 0), "B loads A's three chunks");
    let sb = kvconnect_lmcache::stats("remote-share-b").unwrap();
    assert_eq!((sb.remote.hits, sb.cpu.hits, sb.remote_corrupt), (3, 0, 0), "{sb:?}");
    assert_eq!(sb.remote.bytes_loaded, 3 * chunk_bytes(CHUNK) as u64);
    // The request's tokens are reported as the remote tier's, for the host's answer.
    let tier =
        |t: &str, n: usize| TierTokens { connector: "lmcache".into(), tier: t.into(), tokens: n as u64 };
    let reported = |e: &Engine, r: &str| -> Vec<TierTokens> {
        e.load_sources.iter().filter(|s| s.request.0 == r).map(|s| s.source.clone()).collect()
    };
    assert_eq!(reported(&b, "b0"), vec![tier("remote", 3 * CHUNK)]);
    // The chunks are now in B's CPU tier: the next hit is local.
    let (matched, _) = run_checked(&mut b, "b1", &p);
    assert_eq!(matched, 3 * CHUNK);
    let sb = kvconnect_lmcache::stats("remote-share-b").unwrap();
    assert_eq!((sb.remote.hits, sb.cpu.hits), (3, 3), "{sb:?}");
    assert_eq!(reported(&b, "b1"), vec![tier("cpu", 3 * CHUNK)]);

    // A worker with another layout (or TP rank) never shares A's chunks: the keys differ.
    let mut c = Engine::new("remote-share-c", KvLayout::HND, 8, extra(&redis.url()));
    assert_eq!(run_checked(&mut c, "c0", &p).0, 0);
    let mut other_tp = ctx("remote-share-d", KvLayout::NHD, 8, extra(&redis.url()));
    other_tp.tp_rank = 1;
    let mut d = Engine::with_ctx(&kvconnect_lmcache::LmcacheFactory, other_tp);
    assert_eq!(run_checked(&mut d, "d0", &p).0, 0);
}

#[test]
fn a_remote_killed_mid_workload_costs_misses_never_answers() {
    let Some(mut redis) = RedisServer::start() else { return skip("remote_redis") };
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(300 + i, 2 * CHUNK + 3)).collect();
    let mut a = Engine::new("remote-kill-a", KvLayout::NHD, 8, extra(&redis.url()));
    for (i, p) in prompts.iter().enumerate() {
        run_checked(&mut a, &format!("a{i}"), p);
    }
    kvconnect_lmcache::flush("remote-kill-a");

    let sa = kvconnect_lmcache::stats("remote-kill-a").unwrap();
    assert_eq!(sa.remote_writes, 8 * 2, "two full chunks per prompt written to the remote: {sa:?}");
    let mut b = Engine::new("remote-kill-b", KvLayout::NHD, 8, extra(&redis.url()));
    assert_eq!(run_checked(&mut b, "b0", &prompts[0]), (2 * CHUNK, 0));

    // A lookup while the server is up, then it dies before the load: the load misses, the
    // blocks are reported, the engine computes them, and the KV is still right.
    let req = request("b1", &prompts[1]);
    let matched = b.lookup(&req, 0);
    assert_eq!(matched, 2 * CHUNK);
    redis.kill();
    let blocks = b.alloc(prompts[1].len());
    b.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![blocks.clone()]), matched).unwrap();
    let meta = b.sched.build_connector_meta(&StepInfo { step: 100, ..StepInfo::default() }).unwrap();
    b.worker.bind_connector_meta(&meta).unwrap();
    b.worker.start_load_kv().unwrap();
    let failed = b.worker.block_ids_with_load_errors().unwrap();
    assert!(!failed.is_empty(), "the load that could not read its chunks reports its blocks");
    b.compute(&prompts[1], &blocks, 0, prompts[1].len());
    b.worker.wait_for_save().unwrap();
    assert!(b.mismatches(&prompts[1], &blocks, 0, prompts[1].len()).is_empty());

    // The rest of the workload runs against a dead remote: every answer right, none waiting
    // on it. A dead server refuses at once; six requests that each waited out the 5 s timeout
    // would take 30 s, so 15 s tells the two apart even on a stalled machine.
    let t0 = Instant::now();
    for (i, p) in prompts.iter().enumerate().skip(2) {
        assert_eq!(run_checked(&mut b, &format!("b{i}"), p), (0, 0), "prompt {i}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "six requests took {:?} with the remote down: requests wait on a dead remote",
        t0.elapsed()
    );
    let s = kvconnect_lmcache::stats("remote-kill-b").unwrap();
    assert!(s.remote_misses >= 1, "{s:?}");
    assert!(s.remote_errors >= 1, "{s:?}");
    assert!(s.remote_errors + s.remote_skipped >= 7, "every remote lookup after the kill is counted: {s:?}");

    // Restarted (empty): once the back-off has passed, writes and hits resume.
    redis.restart();
    std::thread::sleep(Duration::from_millis(900));
    let fresh = prompt(999, 2 * CHUNK + 1);
    let mut a2 = Engine::new("remote-kill-a2", KvLayout::NHD, 8, extra(&redis.url()));
    run_checked(&mut a2, "a2", &fresh);
    kvconnect_lmcache::flush("remote-kill-a2");
    let before = kvconnect_lmcache::stats("remote-kill-b").unwrap().remote.hits;
    assert_eq!(run_checked(&mut b, "b-after", &fresh), (2 * CHUNK, 0));
    assert_eq!(kvconnect_lmcache::stats("remote-kill-b").unwrap().remote.hits, before + 2);
}

#[test]
fn a_corrupt_or_truncated_remote_value_is_a_miss_counted_as_corrupt() {
    let Some(redis) = RedisServer::start() else { return skip("remote_redis") };
    let p = prompt(42, 2 * CHUNK + 1);
    let mut a = Engine::new("remote-corrupt-a", KvLayout::NHD, 8, extra(&redis.url()));
    run_checked(&mut a, "a0", &p);
    kvconnect_lmcache::flush("remote-corrupt-a");

    // The real keys of the prompt's chunks, as every worker of this layout derives them.
    let c = ctx("remote-corrupt-a", KvLayout::NHD, 8, extra(&redis.url()));
    let keys = chunk_keys(Namespace::of(&c, CHUNK as u32), &p, CHUNK, false);
    assert_eq!(keys.len(), 2);
    let mut conn = redis.client();
    let k0 = redis_key(&keys[0].key);
    let sa = kvconnect_lmcache::stats("remote-corrupt-a").unwrap();
    assert_eq!(sa.remote_writes, 2, "A's two chunks written to the remote: {sa:?}");
    let mut v: Vec<u8> = redis::cmd("GET").arg(&k0).query(&mut conn).unwrap();
    v[100] ^= 0x40;
    let () = redis::cmd("SET").arg(&k0).arg(&v).query(&mut conn).unwrap();

    let mut b = Engine::new("remote-corrupt-b", KvLayout::NHD, 8, extra(&redis.url()));
    let (matched, errors) = run_checked(&mut b, "b0", &p);
    assert_eq!(matched, 2 * CHUNK, "the lookup sees the key");
    assert!(errors > 0, "the corrupt chunk is not loaded; its blocks are recomputed");
    let s = kvconnect_lmcache::stats("remote-corrupt-b").unwrap();
    assert_eq!((s.remote_corrupt, s.remote.hits), (1, 0), "{s:?}");

    // Truncated: the same. B saved what it recomputed; its writes must land before the
    // truncated value is written, or one would overwrite it.
    kvconnect_lmcache::flush("remote-corrupt-b");
    let k1 = redis_key(&keys[1].key);
    let v: Vec<u8> = redis::cmd("GET").arg(&k1).query(&mut conn).unwrap();
    let () = redis::cmd("SET").arg(&k1).arg(&v[..v.len() - 7]).query(&mut conn).unwrap();
    let mut b2 = Engine::new("remote-corrupt-b2", KvLayout::NHD, 8, extra(&redis.url()));
    let req = request("b2", &p);
    // Chunk 0 is still corrupt, so a load stops there; ask for chunk 1 alone past it.
    let (_, errors) = {
        let m = b2.lookup(&req, CHUNK);
        assert_eq!(m, CHUNK);
        let blocks = b2.alloc(p.len());
        b2.compute(&p, &blocks, 0, CHUNK);
        b2.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![blocks.clone()]), m).unwrap();
        let meta = b2.sched.build_connector_meta(&StepInfo { step: 1, ..StepInfo::default() }).unwrap();
        b2.worker.bind_connector_meta(&meta).unwrap();
        b2.worker.start_load_kv().unwrap();
        let errors = b2.worker.block_ids_with_load_errors().unwrap();
        b2.compute(&p, &blocks, CHUNK, p.len());
        b2.worker.wait_for_save().unwrap();
        assert!(b2.mismatches(&p, &blocks, 0, p.len()).is_empty());
        (m, errors)
    };
    assert!(!errors.is_empty());
    let s = kvconnect_lmcache::stats("remote-corrupt-b2").unwrap();
    assert_eq!((s.remote_corrupt, s.remote.hits), (1, 0), "{s:?}");
}

/// The path the timeout exists for: a remote that takes connections and never answers (a hung
/// or partitioned server). Every request is answered with the computed KV, every remote lookup
/// and every chunk handed to the writer is counted as failed, skipped or dropped, and a flush
/// returns. Run on a thread: a missing timeout would hang, and that must fail, not stall.
#[test]
fn a_remote_that_never_answers_costs_timeouts_never_answers() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}", silent.local_addr().unwrap());
    std::thread::spawn(move || {
        // Holds every connection open and reads nothing.
        let held: Vec<_> = silent.incoming().map_while(Result::ok).collect();
        drop(held);
    });
    const REQUESTS: usize = 6;
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut a = Engine::new("remote-silent", KvLayout::NHD, 8, extra_with_timeout(&url, 200));
        for i in 0..REQUESTS {
            let p = prompt(500 + i as u32, 2 * CHUNK + 3);
            assert_eq!(run_checked(&mut a, &format!("s{i}"), &p), (0, 0), "prompt {i}");
        }
        kvconnect_lmcache::flush("remote-silent");
        // Read while the engine (and so its store) is still registered.
        let _ = done_tx.send(kvconnect_lmcache::stats("remote-silent"));
    });
    let s = done_rx.recv_timeout(Duration::from_secs(60)).expect(
        "requests or the flush did not finish within 60 s against a remote that never answers \
         (200 ms timeout): they wait on it, or a request failed (see its panic above)",
    );
    let s = s.expect("the store is registered while its engine lives");
    assert!(s.remote_errors >= 1, "the timeouts are counted: {s:?}");
    assert!(s.remote_errors + s.remote_skipped >= REQUESTS as u64, "every remote lookup is counted: {s:?}");
    assert_eq!(s.remote_writes, 0, "{s:?}");
    assert_eq!(
        s.remote_write_errors + s.remote_write_drops,
        2 * REQUESTS as u64,
        "every chunk handed to the writer is counted as failed or dropped: {s:?}"
    );
}

/// What Redis holds now of kvconnect's chunks, as KV events name them.
fn remote_holdings(redis: &RedisServer) -> BTreeSet<u64> {
    let keys: Vec<String> = redis::cmd("KEYS").arg("kvconnect:lmcache:*").query(&mut redis.client()).unwrap();
    keys.iter().filter_map(|k| chunk_of(k)).map(|k| k.0[0]).collect()
}

/// The remote's events, applied in order: each removal must name a chunk stored before it.
#[derive(Default)]
struct RemoteReplay {
    index: BTreeSet<u64>,
    stores: usize,
    removals: usize,
}

impl RemoteReplay {
    fn apply(&mut self, e: &mut Engine) {
        for ev in e.sched.take_events().unwrap() {
            match ev {
                KvEvent::BlockStored(s) if s.medium == Medium::Remote => {
                    self.index.extend(&s.block_hashes);
                    self.stores += s.block_hashes.len();
                }
                KvEvent::BlockRemoved(r) if r.medium == Medium::Remote => {
                    for h in r.block_hashes {
                        assert!(self.index.remove(&h), "{h} removed from the remote, never stored there");
                        self.removals += 1;
                    }
                }
                KvEvent::AllBlocksCleared => panic!("the remote tier never clears everything"),
                _ => {}
            }
        }
    }

    /// Applies `e`'s events until they give what Redis holds (notifications arrive on their
    /// own thread), or panics after 10 s with both.
    fn settle(&mut self, e: &mut Engine, redis: &RedisServer, what: &str) {
        let t0 = Instant::now();
        loop {
            self.apply(e);
            let held = remote_holdings(redis);
            if self.index == held {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{what}: the remote tier's events give {:?}, Redis holds {held:?}",
                self.index
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[test]
fn remote_events_replay_to_what_redis_holds_through_eviction_and_a_restart() {
    let Some(mut redis) =
        RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru", "--notify-keyspace-events", "Exeg"])
    else {
        return skip("remote_redis");
    };
    // Room for 1 MiB beyond what the empty server uses (clients' buffers take some of it):
    // 1,024 chunks of 3 KiB evict most of them.
    let used: String = redis::cmd("INFO").arg("memory").query(&mut redis.client()).unwrap();
    let used: u64 = used
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("INFO memory names used_memory");
    let room = used + (1 << 20);
    let _: () =
        redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(room).query(&mut redis.client()).unwrap();

    let id = "remote-events";
    let mut e = Engine::new(id, KvLayout::NHD, 8, extra(&redis.url()));
    let mut r = RemoteReplay::default();
    for i in 0..512 {
        run_checked(&mut e, &format!("r{i}"), &prompt(500 + i, 2 * CHUNK + 1));
        kvconnect_lmcache::flush(id);
        r.apply(&mut e);
    }
    r.settle(&mut e, &redis, "after 1,024 chunks written");
    let st = kvconnect_lmcache::stats(id).unwrap();
    assert_eq!(
        (r.stores, st.remote_writes),
        (1024, 1024),
        "every chunk written is one store on the remote: {st:?}"
    );
    assert!(r.removals >= 512, "Redis evicted chunks and each is a removal: {} removals", r.removals);
    assert!(!r.index.is_empty(), "some chunks are still on the remote");

    // A chunk deleted by someone else is a removal too.
    let victim = *r.index.iter().next().unwrap();
    let key: Vec<String> = redis::cmd("KEYS").arg("kvconnect:lmcache:*").query(&mut redis.client()).unwrap();
    let key = key.into_iter().find(|k| chunk_of(k).is_some_and(|c| c.0[0] == victim)).unwrap();
    let _: () = redis::cmd("DEL").arg(&key).query(&mut redis.client()).unwrap();
    r.settle(&mut e, &redis, "after a DEL");
    assert!(!r.index.contains(&victim));

    // The server restarts empty: no notification says so, but the watcher, subscribing
    // again, finds the chunks it wrote gone and publishes their removal.
    redis.restart();
    let _: () =
        redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(room).query(&mut redis.client()).unwrap();
    r.settle(&mut e, &redis, "after a restart");
    assert!(r.index.is_empty(), "nothing is claimed on a server that restarted empty");
    // And the chunks written after it are stores again.
    std::thread::sleep(Duration::from_millis(300));
    run_checked(&mut e, "after", &prompt(900, 2 * CHUNK + 1));
    kvconnect_lmcache::flush(id);
    r.settle(&mut e, &redis, "after a write past the restart");
    assert_eq!(r.index.len(), 2, "{:?}", r.index);
}
