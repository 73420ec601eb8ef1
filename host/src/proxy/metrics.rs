//! The proxy's Prometheus counters: requests served and failed, tokens, requests per worker,
//! and histograms of time to first token and of whole-request latency.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

/// Histogram bucket bounds in seconds.
const BUCKETS: [f64; 12] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// A Prometheus histogram with fixed buckets (1 ms to 10 s).
#[derive(Debug, Default, Clone)]
pub struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    n: u64,
}

impl Histogram {
    /// Counts one observation.
    pub fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        for (c, b) in self.counts.iter_mut().zip(BUCKETS) {
            if s <= b {
                *c += 1;
            }
        }
        self.sum += s;
        self.n += 1;
    }

    /// Appends the histogram as Prometheus text.
    pub fn render(&self, name: &str, help: &str, out: &mut String) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        for (c, b) in self.counts.iter().zip(BUCKETS) {
            out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {c}\n"));
        }
        out.push_str(&format!(
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}\n",
            self.n, self.sum, self.n
        ));
    }
}

#[derive(Debug, Default)]
struct Inner {
    served: u64,
    failed: u64,
    tokens: u64,
    per_worker: BTreeMap<(String, String), u64>,
    ttft: Histogram,
    latency: Histogram,
}

/// The counters (shared by the handlers).
#[derive(Debug, Default)]
pub struct ProxyMetrics {
    inner: Mutex<Inner>,
}

impl ProxyMetrics {
    /// A request served by prefill `pw` and decode `dw`.
    pub fn served(&self, pw: &str, dw: &str, ttft: Duration, total: Duration, tokens: u64) {
        if let Ok(mut m) = self.inner.lock() {
            m.served += 1;
            m.tokens += tokens;
            *m.per_worker.entry(("prefill".into(), pw.into())).or_default() += 1;
            *m.per_worker.entry(("decode".into(), dw.into())).or_default() += 1;
            m.ttft.observe(ttft);
            m.latency.observe(total);
        }
    }

    /// A request that ended with an error.
    pub fn error(&self) {
        if let Ok(mut m) = self.inner.lock() {
            m.failed += 1;
        }
    }

    /// Prometheus text.
    pub fn render(&self) -> String {
        let Ok(m) = self.inner.lock() else { return String::new() };
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, v: u64| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}\n"));
        };
        counter("kvconnect_proxy_requests_total", "Requests served through prefill and decode.", m.served);
        counter("kvconnect_proxy_requests_failed_total", "Requests answered with an error.", m.failed);
        counter("kvconnect_proxy_completion_tokens_total", "Tokens generated.", m.tokens);
        out.push_str("# HELP kvconnect_proxy_worker_requests_total Requests per worker.\n# TYPE kvconnect_proxy_worker_requests_total counter\n");
        for ((role, w), n) in &m.per_worker {
            out.push_str(&format!(
                "kvconnect_proxy_worker_requests_total{{role=\"{role}\",worker=\"{w}\"}} {n}\n"
            ));
        }
        m.ttft.render(
            "kvconnect_proxy_ttft_seconds",
            "Time to first token (prefill round trip plus decode's first token).",
            &mut out,
        );
        m.latency.render("kvconnect_proxy_request_seconds", "Whole-request latency at the proxy.", &mut out);
        out
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
    }
}
