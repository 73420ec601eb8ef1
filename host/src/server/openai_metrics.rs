//! Counters the OpenAI layer of a worker keeps for `/metrics`: requests per route and status,
//! time to first token and mean inter-token time per request as histograms, tokens loaded
//! through the connector, the admission-to-first-token time of requests that loaded external
//! KV, and handshake refusals by the field that differed (`hma`,
//! `block_size`, ...). One worker process serves one engine, so the counters are
//! process-wide.

use crate::proxy::metrics::Histogram;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

#[derive(Debug, Default)]
struct Inner {
    requests: BTreeMap<(&'static str, u16), u64>,
    ttft: Histogram,
    inter_token: Histogram,
    external_first_token: Histogram,
    loaded_tokens: u64,
    refusals: BTreeMap<String, u64>,
}

static METRICS: Mutex<Option<Inner>> = Mutex::new(None);

fn with(f: impl FnOnce(&mut Inner)) {
    if let Ok(mut g) = METRICS.lock() {
        f(g.get_or_insert_with(Inner::default));
    }
}

/// A request answered on `route` with `status`.
pub fn request(route: &'static str, status: u16) {
    with(|m| *m.requests.entry((route, status)).or_default() += 1);
}

/// A completed generation: engine TTFT, whole time, tokens, tokens loaded from a peer.
pub fn generation(ttft: Duration, total: Duration, tokens: u64, loaded: u64) {
    with(|m| {
        m.ttft.observe(ttft);
        if tokens > 1 {
            m.inter_token.observe(total.saturating_sub(ttft) / (tokens as u32 - 1).max(1));
        }
        m.loaded_tokens += loaded;
    });
}

/// The time from admission to the first token of a request that loaded prompt KV through the
/// connector (any route; the engine thread reports it). The engine does not expose the end of
/// the load itself, so this is the load plus the first forward step: an upper bound on the
/// transfer latency.
pub fn external_first_token(t: Duration) {
    with(|m| m.external_first_token.observe(t));
}

/// A handshake refusal; `reason` is the refusal message, whose indented `field: ...` lines
/// name what differed.
pub fn refusal(reason: &str) {
    let fields = refusal_fields(reason);
    with(|m| {
        for f in fields {
            *m.refusals.entry(f).or_default() += 1;
        }
    });
}

fn refusal_fields(reason: &str) -> Vec<String> {
    let mut out: Vec<String> = reason
        .lines()
        .filter(|l| l.starts_with("  "))
        .filter_map(|l| l.trim().split_once(':').map(|(f, _)| f.trim().to_owned()))
        .filter(|f| !f.is_empty() && f.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.'))
        .collect();
    if out.is_empty() {
        out.push("unknown".into());
    }
    out
}

/// Prometheus text of these counters.
pub fn render() -> String {
    let mut out = String::new();
    with(|m| {
        out.push_str("# HELP kvconnect_http_requests_total OpenAI-route requests by route and status.\n# TYPE kvconnect_http_requests_total counter\n");
        for ((route, status), n) in &m.requests {
            out.push_str(&format!(
                "kvconnect_http_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}\n"
            ));
        }
        m.ttft.render("kvconnect_ttft_seconds", "Engine time to first token.", &mut out);
        m.inter_token.render(
            "kvconnect_inter_token_seconds",
            "Mean time between tokens of each request (after the first).",
            &mut out,
        );
        m.external_first_token.render(
            "kvconnect_external_kv_first_token_seconds",
            "Admission to first token of requests that loaded prompt KV through the connector (the external load plus one forward step).",
            &mut out,
        );
        out.push_str(&format!(
            "# HELP kvconnect_kv_loaded_tokens_total Prompt tokens whose KV came from a peer or cache through the connector (OpenAI routes).\n# TYPE kvconnect_kv_loaded_tokens_total counter\nkvconnect_kv_loaded_tokens_total {}\n",
            m.loaded_tokens
        ));
        out.push_str("# HELP kvconnect_handshake_refusals_total Refused handshakes seen by requests, by the field that differed.\n# TYPE kvconnect_handshake_refusals_total counter\n");
        for (f, n) in &m.refusals {
            out.push_str(&format!("kvconnect_handshake_refusals_total{{field=\"{f}\"}} {n}\n"));
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_fields_come_from_the_indented_diff_lines() {
        let r = "prefill engine 'p' and decode engine 'd' have incompatible KV caches; no KV was transferred:\n  hma: prefill=off, decode=on\n  block_size: 16 vs 32";
        assert_eq!(refusal_fields(r), vec!["hma", "block_size"]);
        assert_eq!(refusal_fields("peer gone"), vec!["unknown"]);
    }
}
