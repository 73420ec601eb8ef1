//! How the proxy picks a prefill server: round-robin (the default), or by KV (`--routing
//! kv`): the server whose cache holds most of the request's prefix, against its load
//! (`kvconnect_router::choose`, whose doc states the formula and the tier weights).
//!
//! The KV router keeps the index of every prefill server's blocks (`kvconnect_router::
//! Indexer`), fed by [`KvRouter::apply`] with each server's event batches, and the proxy's
//! own count of the requests each server has in flight. A request's hashes are the router's
//! chain over its prompt tokens (`kvconnect_router::chain::prefix_hashes`, in pieces of the
//! engine's block size), the same chain the indexer computes from the token ids of every
//! stored block, whoever stored it; cut as the engine cuts its prefix (the last prompt token
//! is always computed), so the predicted hits are ones the engine can take.
//!
//! In front of servers that tokenize for themselves (`kvconnect proxy` in front of vLLM) the
//! prompt's ids come from the body or the servers' `/tokenize` (`crate::tokenize`).
//!
//! Without events to go by (none arrived yet, or the subscriber cannot reach the servers), or
//! without the prompt's ids (several prompts in one request, or no `/tokenize` answer), it
//! routes round-robin, logs why once per change, and
//! counts each such choice (`kvconnect_router_decisions_total{by="round_robin",reason}`).
//! A server the supervisor marks down is killed in the index (never routed to); one that
//! comes back up starts a fresh stream.

use super::backends::{Backends, NoBackend};
use super::metrics::RouterMetrics;
use kvconnect_api::Role;
use kvconnect_router::{choose, Candidate, Indexer, KvEventBatch, Outcome, Overlap, Weights, WorkerId};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// `--routing`: how prefill servers are picked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Routing {
    /// In turn, among the servers that are up.
    #[default]
    RoundRobin,
    /// By the KV cache events of the servers: cached prefix against load.
    Kv,
}

/// What the index predicted for a request sent to a prefill server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prediction {
    /// Tokens of the prompt the server holds (whole blocks).
    pub tokens: u64,
}

/// A prefill server picked, with the count of its requests in flight held until dropped.
pub struct Picked {
    /// Its HTTP address.
    pub http: String,
    /// What the index predicted (None: picked round-robin).
    pub prediction: Option<Prediction>,
    _in_flight: Option<InFlight>,
}

struct InFlight {
    router: Arc<KvRouter>,
    worker: WorkerId,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.router.in_flight[usize::from(self.worker)].fetch_sub(1, Ordering::Relaxed);
    }
}

struct State {
    indexer: Indexer,
    /// Per server: the backend generation last seen (a change: it restarted).
    generations: Vec<u64>,
    scratch: Vec<Overlap>,
    /// The last fallback reason logged (None: routing by KV).
    logged: Option<&'static str>,
}

/// The KV router of the prefill servers.
pub struct KvRouter {
    /// The prefill servers' names (engine ids), by their number in the index.
    names: Vec<String>,
    state: Mutex<State>,
    in_flight: Vec<AtomicU32>,
    turn: AtomicUsize,
    weights: Weights,
    metrics: RouterMetrics,
}

impl KvRouter {
    /// A router over the prefill servers named `names`, whose engines' block size is `unit`.
    pub fn new(
        names: Vec<String>,
        unit: u32,
        metrics: RouterMetrics,
    ) -> Result<KvRouter, kvconnect_router::TooManyWorkers> {
        let indexer = Indexer::new(names.len(), unit)?;
        Ok(KvRouter {
            state: Mutex::new(State {
                indexer,
                generations: vec![0; names.len()],
                scratch: Vec::new(),
                logged: None,
            }),
            in_flight: names.iter().map(|_| AtomicU32::new(0)).collect(),
            names,
            turn: AtomicUsize::new(0),
            weights: Weights::default(),
            metrics,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn id(&self, name: &str) -> Option<WorkerId> {
        self.names.iter().position(|n| n == name).and_then(|i| WorkerId::try_from(i).ok())
    }

    /// Applies the event batch numbered `seq` of the prefill server `name`; `replay`: it came
    /// from the server's replay socket. `Outcome::Replay` asks the caller to request the
    /// replay.
    pub fn apply(&self, name: &str, seq: u64, batch: &KvEventBatch, replay: bool) -> Outcome {
        let mut st = self.lock();
        let o = match self.id(name) {
            Some(w) => st.indexer.apply(w, seq, batch, replay),
            None => st.indexer.reject(WorkerId::MAX),
        };
        drop(st);
        self.metrics.outcome(o);
        o
    }

    /// A batch from `name` that could not be decoded: dropped and counted.
    pub fn reject(&self, name: &str) {
        let mut st = self.lock();
        let o = st.indexer.reject(self.id(name).unwrap_or(WorkerId::MAX));
        drop(st);
        self.metrics.outcome(o);
    }

    /// Whether any prefill server's events are live: without them a request is routed
    /// round-robin whatever its prompt, so there is no prompt to hash.
    pub fn has_events(&self) -> bool {
        self.lock().indexer.any_live()
    }

    /// Picks the prefill server for a request with these prompt tokens (None: not known
    /// here), other than those in `avoid` (addresses that did not answer).
    pub fn pick(
        self: &Arc<Self>,
        backends: &Backends,
        prompt: Option<&[u32]>,
        avoid: &[String],
    ) -> Result<Picked, NoBackend> {
        let up = backends.of_role(Role::Prefill);
        let mut st = self.lock();
        // Servers the supervisor marked down are dead in the index; one that restarted (its
        // generation moved) starts a fresh stream.
        for b in &up {
            let Some(w) = self.id(&b.name) else { continue };
            let seen = &mut st.generations[usize::from(w)];
            if *seen != b.generation {
                *seen = b.generation;
                st.indexer.restart(w);
            }
            if b.down.is_some() {
                st.indexer.kill(w);
            }
        }
        let reason = if !st.indexer.any_live() {
            Some("no_events")
        } else if prompt.is_none() {
            Some("no_tokens")
        } else {
            None
        };
        if st.logged != reason {
            match reason {
                Some(r) => tracing::warn!(reason = r, "KV routing falls back to round-robin: {}", explain(r)),
                None => {
                    tracing::info!("KV routing: the prefill servers' events arrive, routing by cached prefix")
                }
            }
            st.logged = reason;
        }
        let (Some(prompt), None) = (prompt, reason) else {
            drop(st);
            self.metrics.decided(reason.unwrap_or("no_tokens"));
            let http = backends.pick(Role::Prefill, avoid)?;
            return Ok(Picked { http, prediction: None, _in_flight: None });
        };
        let unit = st.indexer.unit();
        let mut chain = kvconnect_router::chain::prefix_hashes(prompt, unit);
        chain.truncate(prompt.len().saturating_sub(1) / unit);
        let candidates: Vec<(Candidate, &str)> = up
            .iter()
            .filter(|b| b.down.is_none() && !avoid.contains(&b.http))
            .filter_map(|b| {
                let worker = self.id(&b.name)?;
                let in_flight = self.in_flight[usize::from(worker)].load(Ordering::Relaxed);
                Some((Candidate { worker, in_flight }, b.http.as_str()))
            })
            .collect();
        let only: Vec<Candidate> = candidates.iter().map(|c| c.0).collect();
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let st = &mut *st;
        let Some(c) = choose(&st.indexer, &self.weights, &chain, &only, turn, &mut st.scratch) else {
            return Err(backends.pick(Role::Prefill, avoid).err().unwrap_or_else(|| NoBackend {
                role: Role::Prefill,
                why: "no prefill server in the KV index is up".into(),
            }));
        };
        let http =
            candidates.iter().find(|x| x.0.worker == c.worker).map(|x| x.1.to_owned()).unwrap_or_default();
        self.metrics.decided(c.fallback.map_or("", |f| f.label()));
        self.in_flight[usize::from(c.worker)].fetch_add(1, Ordering::Relaxed);
        Ok(Picked {
            http,
            prediction: Some(Prediction { tokens: u64::from(c.predicted_blocks) * unit as u64 }),
            _in_flight: Some(InFlight { router: self.clone(), worker: c.worker }),
        })
    }

    /// The server then reported `hit` prompt tokens it did not compute (its prefix cache's
    /// and its cache connector's).
    pub fn observe(&self, p: Prediction, hit: u64) {
        self.metrics.observed(p.tokens, hit);
    }
}

fn explain(reason: &str) -> &'static str {
    match reason {
        "no_tokens" => {
            "the request's prompt token ids are not known (several prompts in one request, or the \
             prefill servers' /tokenize gave none)"
        }
        _ => "no prefill server's KV events have arrived (or none is live)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::ProxyMetrics;
    use kvconnect_router::{Dropped, KvEvent, Medium};

    const BS: u32 = 4;

    fn servers() -> (Arc<Backends>, Arc<KvRouter>, ProxyMetrics) {
        let b = Arc::new(Backends::new([
            (Role::Prefill, "p0".into(), "127.0.0.1:1".into()),
            (Role::Prefill, "p1".into(), "127.0.0.1:2".into()),
            (Role::Decode, "d0".into(), "127.0.0.1:3".into()),
        ]));
        let m = ProxyMetrics::default();
        let kv = KvRouter::new(vec!["p0".into(), "p1".into()], BS, m.router.clone()).unwrap();
        (b, Arc::new(kv), m)
    }

    /// The batch a server publishes after computing `prompt`'s full blocks (named by the
    /// engine's own block hashes).
    fn stored(prompt: &[u32]) -> KvEventBatch {
        let hashes = kvconnect_engine::prefix_cache::block_hashes(prompt, BS as usize);
        let tokens = prompt[..hashes.len() * BS as usize].to_vec();
        let events = vec![KvEvent::stored(hashes, None, tokens, BS, Medium::Cpu)];
        KvEventBatch { ts: 0.0, events, data_parallel_rank: None }
    }

    #[test]
    fn without_events_it_routes_round_robin_and_with_them_by_prefix() {
        let (b, kv, _) = servers();
        let prompt: Vec<u32> = (0..13).collect();
        let first: Vec<String> = (0..2).map(|_| kv.pick(&b, Some(&prompt), &[]).unwrap().http).collect();
        assert_eq!(first, ["127.0.0.1:1", "127.0.0.1:2"], "no events: round-robin");
        assert!(kv.pick(&b, Some(&prompt), &[]).unwrap().prediction.is_none());
        assert_eq!(kv.apply("p1", 0, &stored(&prompt), false), Outcome::Applied);
        assert_eq!(kv.apply("p0", 0, &stored(&[9, 9, 9, 9]), false), Outcome::Applied);
        for _ in 0..3 {
            let p = kv.pick(&b, Some(&prompt), &[]).unwrap();
            // 13 tokens: 3 full blocks, all held; the last token is always computed.
            assert_eq!((p.http.as_str(), p.prediction), ("127.0.0.1:2", Some(Prediction { tokens: 12 })));
        }
        // A prompt the index says p1 holds, but p1 did not answer: p0.
        let p = kv.pick(&b, Some(&prompt), &["127.0.0.1:2".into()]).unwrap();
        assert_eq!(p.http, "127.0.0.1:1");
    }

    #[test]
    fn in_flight_requests_weigh_against_a_cached_prefix() {
        let (b, kv, _) = servers();
        let prompt: Vec<u32> = (0..9).collect(); // 2 blocks to hash
        kv.apply("p0", 0, &stored(&prompt), false);
        kv.apply("p1", 0, &stored(&[7; 4]), false);
        let held = kv.pick(&b, Some(&prompt), &[]).unwrap();
        assert_eq!(held.http, "127.0.0.1:1");
        // p0 has one in flight: 2 - 2 + 4 = 4 > p1's 2.
        let other = kv.pick(&b, Some(&prompt), &[]).unwrap();
        assert_eq!(other.http, "127.0.0.1:2");
        drop((held, other));
        assert_eq!(kv.pick(&b, Some(&prompt), &[]).unwrap().http, "127.0.0.1:1", "back once it returned");
    }

    #[test]
    fn a_server_marked_down_is_never_picked_and_starts_a_fresh_stream_when_back() {
        let (b, kv, m) = servers();
        let prompt: Vec<u32> = (0..9).collect();
        kv.apply("p0", 0, &stored(&prompt), false);
        kv.apply("p0", 1, &stored(&prompt), false);
        kv.apply("p1", 0, &stored(&[7; 4]), false);
        b.set_down("p0", "exited; restarting");
        for _ in 0..3 {
            assert_eq!(kv.pick(&b, Some(&prompt), &[]).unwrap().http, "127.0.0.1:2");
        }
        assert_eq!(kv.apply("p0", 2, &stored(&prompt), false), Outcome::Dropped(Dropped::Dead));
        b.set_up("p0", "127.0.0.1:5");
        let p = kv.pick(&b, Some(&prompt), &[]).unwrap();
        assert_eq!(
            p.prediction,
            Some(Prediction { tokens: 0 }),
            "the restarted server's old blocks are gone"
        );
        // Its new publisher numbers from 0 again: applied, not taken for a replay.
        assert_eq!(kv.apply("p0", 0, &stored(&prompt), false), Outcome::Applied);
        drop(p);
        assert_eq!(kv.pick(&b, Some(&prompt), &[]).unwrap().http, "127.0.0.1:5");
        kv.reject("p1");
        kv.reject("nobody");
        let t = m.render();
        assert!(t.contains("kvconnect_router_event_batches_dropped_total{reason=\"dead_worker\"} 1"), "{t}");
        assert!(t.contains("reason=\"malformed\"} 1") && t.contains("reason=\"unknown_worker\"} 1"), "{t}");
    }

    #[test]
    fn without_prompt_tokens_it_says_why_it_routes_round_robin() {
        let (b, _, m) = servers();
        let kv = Arc::new(KvRouter::new(vec!["p0".into(), "p1".into()], BS, m.router.clone()).unwrap());
        kv.apply("p0", 0, &stored(&[1, 2, 3, 4, 5]), false);
        assert!(kv.pick(&b, None, &[]).unwrap().prediction.is_none());
        let t = m.render();
        assert!(
            t.contains("kvconnect_router_decisions_total{by=\"round_robin\",reason=\"no_tokens\"} 1"),
            "{t}"
        );
    }
}
