//! The proxy's Prometheus metrics (through `prometheus-client`): requests served and failed,
//! tokens, requests per server, and histograms of time to first token and of whole-request
//! latency; and the KV router's ([`RouterMetrics`]): its decisions, the hits it predicted
//! against those the prefill servers reported, and the event batches it applied or dropped.

use kvconnect_api::Role;
use kvconnect_openai::metrics::SECONDS;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::time::Duration;

type Labels = Vec<(&'static str, String)>;

/// The proxy's metrics (shared by the handlers).
#[derive(Debug)]
pub struct ProxyMetrics {
    registry: Registry,
    served: Counter,
    failed: Counter,
    tokens: Counter,
    per_server: Family<Labels, Counter>,
    ttft: Histogram,
    latency: Histogram,
    first_token: Family<Labels, Counter>,
    /// The KV router's (registered here, counted while `--routing kv` routes).
    pub router: RouterMetrics,
}

/// The KV router's decisions and predictions, counted (what `kvconnect up --workload` reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RouterTally {
    /// Prefill servers picked by the KV index.
    pub by_kv: u64,
    /// Picked round-robin instead (no server's events live yet, or no tokens to hash).
    pub round_robin: u64,
    /// Prompt tokens the index predicted the chosen servers hold.
    pub predicted_hit_tokens: u64,
    /// Prompt tokens those servers then reported they did not compute.
    pub actual_hit_tokens: u64,
    /// Decisions whose prediction equalled the server's hits, or was above or below them.
    pub exact: u64,
    /// See `exact`.
    pub over: u64,
    /// See `exact`.
    pub under: u64,
}

/// The KV router's metrics.
#[derive(Debug, Clone, Default)]
pub struct RouterMetrics {
    decisions: Family<Labels, Counter>,
    predicted: Counter,
    hit: Counter,
    predictions: Family<Labels, Counter>,
    applied: Counter,
    dropped: Family<Labels, Counter>,
    replays: Counter,
}

impl RouterMetrics {
    fn register(&self, r: &mut Registry) {
        r.register(
            "kvconnect_router_decisions",
            "Prefill servers picked by --routing kv: by the KV index (by=kv), or round-robin and why \
                (no_events: no server's events are live; no_tokens: the prompt's token ids are not known)",
            self.decisions.clone(),
        );
        r.register(
            "kvconnect_router_predicted_hit_tokens",
            "Prompt tokens the KV index predicted the chosen prefill server holds",
            self.predicted.clone(),
        );
        r.register(
            "kvconnect_router_actual_hit_tokens",
            "Prompt tokens those prefill servers reported they did not compute (prefix cache and cache \
                connector)",
            self.hit.clone(),
        );
        r.register(
            "kvconnect_router_predictions",
            "KV routing decisions by how the prediction compared with the server's hits (exact, over, under)",
            self.predictions.clone(),
        );
        r.register(
            "kvconnect_router_event_batches_applied",
            "KV event batches applied to the index",
            self.applied.clone(),
        );
        r.register(
            "kvconnect_router_event_batches_dropped",
            "KV event batches dropped, by reason (replayed, gap, dead_worker, malformed, unknown_worker)",
            self.dropped.clone(),
        );
        r.register(
            "kvconnect_router_replays_requested",
            "Replays asked of a server after a gap in its events",
            self.replays.clone(),
        );
    }

    /// A decision: by the index (`fallback` empty) or round-robin for that reason.
    pub fn decided(&self, fallback: &str) {
        let labels = if fallback.is_empty() {
            vec![("by", "kv".to_owned())]
        } else {
            vec![("by", "round_robin".to_owned()), ("reason", fallback.to_owned())]
        };
        self.decisions.get_or_create(&labels).inc();
    }

    /// A server reported `hit` tokens where the index predicted `predicted`.
    pub fn observed(&self, predicted: u64, hit: u64) {
        self.predicted.inc_by(predicted);
        self.hit.inc_by(hit);
        let outcome = match predicted.cmp(&hit) {
            std::cmp::Ordering::Equal => "exact",
            std::cmp::Ordering::Greater => "over",
            std::cmp::Ordering::Less => "under",
        };
        self.predictions.get_or_create(&vec![("outcome", outcome.to_owned())]).inc();
    }

    /// What the router decided and predicted so far, against what the servers then hit.
    pub fn tally(&self) -> RouterTally {
        let decisions = |by: &str, reason: Option<&str>| {
            let mut labels = vec![("by", by.to_owned())];
            labels.extend(reason.map(|r| ("reason", r.to_owned())));
            self.decisions.get(&labels).map_or(0, |c| c.get())
        };
        let outcome = |o: &str| self.predictions.get(&vec![("outcome", o.to_owned())]).map_or(0, |c| c.get());
        RouterTally {
            by_kv: decisions("kv", None),
            round_robin: ["no_events", "no_tokens"].iter().map(|r| decisions("round_robin", Some(r))).sum(),
            predicted_hit_tokens: self.predicted.get(),
            actual_hit_tokens: self.hit.get(),
            exact: outcome("exact"),
            over: outcome("over"),
            under: outcome("under"),
        }
    }

    /// What became of an event batch.
    pub fn outcome(&self, o: kvconnect_router::Outcome) {
        match o {
            kvconnect_router::Outcome::Applied => {
                self.applied.inc();
            }
            kvconnect_router::Outcome::Dropped(why) => {
                self.dropped.get_or_create(&vec![("reason", why.label().to_owned())]).inc();
            }
            kvconnect_router::Outcome::Replay { .. } => {
                self.replays.inc();
                self.dropped.get_or_create(&vec![("reason", "gap".to_owned())]).inc();
            }
        }
    }
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        let mut r = Registry::default();
        let (served, failed, tokens) = (Counter::default(), Counter::default(), Counter::default());
        let per_server = Family::<Labels, Counter>::default();
        let (ttft, latency) = (Histogram::new(SECONDS), Histogram::new(SECONDS));
        r.register("kvconnect_proxy_requests", "Requests served through prefill and decode", served.clone());
        r.register("kvconnect_proxy_requests_failed", "Requests answered with an error", failed.clone());
        r.register("kvconnect_proxy_completion_tokens", "Tokens generated", tokens.clone());
        r.register("kvconnect_proxy_worker_requests", "Requests per worker", per_server.clone());
        r.register(
            "kvconnect_proxy_ttft_seconds",
            "Time to first token: to the first token chunk the proxy sent (prefill's round trip, plus \
                decode's first token when decode's token comes first)",
            ttft.clone(),
        );
        r.register("kvconnect_proxy_request_seconds", "Whole-request latency at the proxy", latency.clone());
        let first_token = Family::<Labels, Counter>::default();
        r.register(
            "kvconnect_proxy_first_token",
            "With --first-token prefill: streamed completions that started with prefill's token \
                (from=prefill), or with decode's and why (from=decode; reason: chat, not_streamed, prompts, \
                parameters, no_token_ids, params)",
            first_token.clone(),
        );
        let router = RouterMetrics::default();
        router.register(&mut r);
        ProxyMetrics { registry: r, served, failed, tokens, per_server, ttft, latency, first_token, router }
    }
}

impl ProxyMetrics {
    /// A request served by prefill `pw` and decode `dw` (None: prefill's answer was the
    /// whole answer).
    pub fn served(&self, pw: &str, dw: Option<&str>, ttft: Duration, total: Duration, tokens: u64) {
        self.served.inc();
        self.tokens.inc_by(tokens);
        for (role, w) in [(Role::Prefill, Some(pw)), (Role::Decode, dw)] {
            if let Some(w) = w {
                self.per_server
                    .get_or_create(&vec![("role", role.to_string()), ("worker", w.to_owned())])
                    .inc();
            }
        }
        self.ttft.observe(ttft.as_secs_f64());
        self.latency.observe(total.as_secs_f64());
    }

    /// A streamed completion that starts with prefill's token (`--first-token prefill`).
    pub fn first_token_from_prefill(&self) {
        self.first_token.get_or_create(&vec![("from", "prefill".to_owned())]).inc();
    }

    /// One that starts with decode's instead, and why (a label of [`crate::first_token::plan`]).
    pub fn first_token_from_decode(&self, why: &str) {
        self.first_token
            .get_or_create(&vec![("from", "decode".to_owned()), ("reason", why.to_owned())])
            .inc();
    }

    /// A request that ended with an error.
    pub fn error(&self) {
        self.failed.inc();
    }

    /// Prometheus text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        match prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry) {
            Ok(()) => out,
            Err(e) => format!("# metrics could not be encoded: {e}\n"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = ProxyMetrics::default();
        m.served("p", Some("d"), Duration::from_millis(3), Duration::from_millis(30), 4);
        m.error();
        let t = m.render();
        assert!(t.contains("kvconnect_proxy_requests_total 1\n"), "{t}");
        assert!(t.contains("kvconnect_proxy_requests_failed_total 1\n"), "{t}");
        assert!(t.contains("kvconnect_proxy_ttft_seconds_bucket{le=\"0.0025\"} 0\n"), "{t}");
        assert!(t.contains("kvconnect_proxy_ttft_seconds_bucket{le=\"0.005\"} 1\n"), "{t}");
        assert!(t.contains("worker=\"d\"} 1\n"), "{t}");
        // The registry ends each registered help with a period; scraped samples bring their own.
        for help in t.lines().filter(|l| l.starts_with("# HELP")) {
            assert!(help.ends_with('.') && !help.ends_with(".."), "one period ends a help text: {help}");
        }
    }

    #[test]
    fn router_metrics_count_predictions_against_hits_and_drops_by_reason() {
        let m = ProxyMetrics::default();
        m.router.decided("");
        m.router.decided("no_events");
        m.router.observed(32, 32);
        m.router.observed(32, 16);
        m.router.outcome(kvconnect_router::Outcome::Dropped(kvconnect_router::Dropped::Malformed));
        let t = m.render();
        assert!(t.contains("kvconnect_router_decisions_total{by=\"kv\"} 1\n"), "{t}");
        assert!(
            t.contains("kvconnect_router_decisions_total{by=\"round_robin\",reason=\"no_events\"} 1\n"),
            "{t}"
        );
        assert!(t.contains("kvconnect_router_predicted_hit_tokens_total 64\n"), "{t}");
        assert!(t.contains("kvconnect_router_actual_hit_tokens_total 48\n"), "{t}");
        assert!(t.contains("kvconnect_router_predictions_total{outcome=\"over\"} 1\n"), "{t}");
        assert!(t.contains("kvconnect_router_event_batches_dropped_total{reason=\"malformed\"} 1\n"), "{t}");
        m.router.decided("no_tokens");
        let want = RouterTally {
            by_kv: 1,
            round_robin: 2,
            predicted_hit_tokens: 64,
            actual_hit_tokens: 48,
            exact: 1,
            over: 1,
            under: 0,
        };
        assert_eq!(m.router.tally(), want);
        // The tally creates no series: /metrics shows only what was counted.
        assert!(!m.render().contains("outcome=\"under\""));
    }
}
