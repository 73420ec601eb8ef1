//! The proxy's Prometheus metrics (through `prometheus-client`): requests served and failed,
//! tokens, requests per server, and histograms of time to first token and of whole-request
//! latency.

use crate::server::metrics::SECONDS;
use kvconnect_api::Role;
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
            "Time to first token (prefill round trip plus decode's first token)",
            ttft.clone(),
        );
        r.register("kvconnect_proxy_request_seconds", "Whole-request latency at the proxy", latency.clone());
        ProxyMetrics { registry: r, served, failed, tokens, per_server, ttft, latency }
    }
}

impl ProxyMetrics {
    /// A request served by prefill `pw` and decode `dw`.
    pub fn served(&self, pw: &str, dw: &str, ttft: Duration, total: Duration, tokens: u64) {
        self.served.inc();
        self.tokens.inc_by(tokens);
        for (role, w) in [(Role::Prefill, pw), (Role::Decode, dw)] {
            self.per_server.get_or_create(&vec![("role", role.to_string()), ("worker", w.to_owned())]).inc();
        }
        self.ttft.observe(ttft.as_secs_f64());
        self.latency.observe(total.as_secs_f64());
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
        m.served("p", "d", Duration::from_millis(3), Duration::from_millis(30), 4);
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
}
