//! Everything a server's `GET /metrics` shows, in the Prometheus text format (0.0.4) through
//! `prometheus-client`. One server process serves one engine, so the metrics are
//! process-wide. Families are kept under kvconnect's names, and those that vLLM's P/D tests
//! and dashboards scrape also under vLLM's names (`vllm:...`), with the same values.
//!
//! Values that live elsewhere (the block pool, the side channel, the cache tiers) are read
//! when scraped ([`Scraped`]).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};
use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Latency buckets in seconds (1 ms to 10 s), as the proxy's.
pub const SECONDS: [f64; 12] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

type Labels = Vec<(&'static str, String)>;

/// Where a request's prompt tokens came from, counted as vLLM counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptSources {
    /// Computed by this engine.
    pub local_compute: u64,
    /// Found in this engine's own prefix cache.
    pub local_cache_hit: u64,
    /// Loaded through the connector (a peer or an external cache).
    pub external_kv_transfer: u64,
}

impl PromptSources {
    /// The sources of a `prompt`-token prompt of which `cached` tokens were found in the
    /// engine's prefix cache and `external` loaded through the connector. Every engine
    /// recomputes the prompt's last token to get its logits; as in vLLM, that token counts
    /// as external when the connector supplied all the others (vLLM's connectors claim the
    /// whole prompt and the scheduler then recomputes the last token).
    pub fn of(prompt: u64, cached: u64, external: u64) -> PromptSources {
        let cached = cached.min(prompt);
        let mut external = external.min(prompt - cached);
        if external > 0 && cached + external + 1 == prompt {
            external += 1;
        }
        PromptSources {
            local_compute: prompt - cached - external,
            local_cache_hit: cached,
            external_kv_transfer: external,
        }
    }
}

/// One value read at scrape time.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Family name (counters without `_total`: it is added).
    pub name: Cow<'static, str>,
    /// Help text.
    pub help: Cow<'static, str>,
    /// Counter or gauge.
    pub counter: bool,
    /// Labels.
    pub labels: Vec<(Cow<'static, str>, String)>,
    /// The value.
    pub value: u64,
}

impl Sample {
    /// A gauge.
    pub fn gauge(name: &'static str, help: &'static str, value: u64) -> Sample {
        Sample { name: name.into(), help: help.into(), counter: false, labels: Vec::new(), value }
    }

    /// A counter.
    pub fn counter(name: &'static str, help: &'static str, value: u64) -> Sample {
        Sample { name: name.into(), help: help.into(), counter: true, labels: Vec::new(), value }
    }

    /// With labels.
    pub fn with(mut self, labels: Labels) -> Sample {
        self.labels = labels.into_iter().map(|(k, v)| (k.into(), v)).collect();
        self
    }

    /// A sample whose name, help and labels are made at run time (what a connector reports).
    pub fn owned(
        name: String,
        help: String,
        counter: bool,
        labels: Vec<(String, String)>,
        value: u64,
    ) -> Sample {
        let labels = labels.into_iter().map(|(k, v)| (k.into(), v)).collect();
        Sample { name: name.into(), help: help.into(), counter, labels, value }
    }
}

/// The values set just before each scrape, encoded as they are.
#[derive(Debug, Default)]
struct Scraped {
    samples: Mutex<Vec<Sample>>,
}

impl Collector for Scraped {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let samples = self.samples.lock().map(|s| s.clone()).unwrap_or_default();
        // One family per name, in the order names first appear, whatever order the samples
        // came in; a family's kind and help are its first sample's.
        let mut names: Vec<&str> = Vec::new();
        for s in &samples {
            if !names.contains(&s.name.as_ref()) {
                names.push(&s.name);
            }
        }
        for name in names {
            let of: Vec<&Sample> = samples.iter().filter(|s| s.name == name).collect();
            let (help, counter) = (&of[0].help, of[0].counter);
            let kind = if counter { MetricType::Counter } else { MetricType::Gauge };
            let mut m = encoder.encode_descriptor(name, help, None, kind)?;
            for s in of.into_iter().filter(|s| s.counter == counter) {
                let e = m.encode_family(&s.labels)?;
                if counter {
                    ConstCounter::new(s.value).encode(e)?;
                } else {
                    ConstGauge::new(s.value as i64).encode(e)?;
                }
            }
        }
        Ok(())
    }
}

/// The server's metrics.
#[derive(Debug)]
pub struct ServerMetrics {
    registry: Registry,
    /// The names of the families registered in `new` (not the scraped ones).
    own: HashSet<String>,
    scraped: Arc<Scraped>,
    http: Family<Labels, Counter>,
    ttft: Histogram,
    inter_token: Histogram,
    external_first_token: Histogram,
    loaded_tokens: Counter,
    refusals: Family<Labels, Counter>,
    completed: Counter,
    failed: Counter,
    prompt_tokens: Family<Labels, Counter>,
    transfer_bytes: Histogram,
    load_failures: Family<Labels, Counter>,
    recomputed: Counter,
    http_refused: Family<Labels, Counter>,
    cancelled: Counter,
}

fn seconds() -> Histogram {
    Histogram::new(SECONDS)
}

impl ServerMetrics {
    fn new() -> ServerMetrics {
        let mut r = Registry::default();
        let mut own = HashSet::new();
        let m = ServerMetrics {
            registry: Registry::default(),
            own: HashSet::new(),
            scraped: Arc::new(Scraped::default()),
            http: Family::default(),
            ttft: seconds(),
            inter_token: seconds(),
            external_first_token: seconds(),
            loaded_tokens: Counter::default(),
            refusals: Family::default(),
            completed: Counter::default(),
            failed: Counter::default(),
            prompt_tokens: Family::default(),
            // 4 KiB to 32 GiB.
            transfer_bytes: Histogram::new(exponential_buckets(4096.0, 4.0, 12)),
            load_failures: Family::default(),
            recomputed: Counter::default(),
            http_refused: Family::default(),
            cancelled: Counter::default(),
        };
        register(
            &mut r,
            &mut own,
            "kvconnect_http_requests",
            "OpenAI-route requests by route and status",
            m.http.clone(),
        );
        register(
            &mut r,
            &mut own,
            "kvconnect_ttft_seconds",
            "Time to first token, from the request's hand-off to the engine (the wait for a running step \
                included)",
            m.ttft.clone(),
        );
        register(
            &mut r,
            &mut own,
            "kvconnect_inter_token_seconds",
            "Mean time between tokens of each request (after the first)",
            m.inter_token.clone(),
        );
        register(
            &mut r,
            &mut own,
            "kvconnect_external_kv_first_token_seconds",
            "Admission to first token of requests that loaded prompt KV through the connector (the external \
                load plus one forward step)",
            m.external_first_token.clone(),
        );
        register(
            &mut r,
            &mut own,
            "kvconnect_kv_loaded_tokens",
            "Prompt tokens whose KV came from a peer or cache through the connector (OpenAI routes)",
            m.loaded_tokens.clone(),
        );
        register(
            &mut r,
            &mut own,
            "kvconnect_handshake_refusals",
            "Refused handshakes seen by requests, by the field that differed",
            m.refusals.clone(),
        );
        register(&mut r, &mut own, "kvconnect_requests_completed", "Requests completed", m.completed.clone());
        register(
            &mut r,
            &mut own,
            "kvconnect_requests_failed",
            "Requests that ended with an error",
            m.failed.clone(),
        );
        let sources = "Prompt tokens of finished requests by where their KV came from: computed here \
            (local_compute), this engine's prefix cache (local_cache_hit), or loaded through the connector \
            (external_kv_transfer)";
        register(&mut r, &mut own, "kvconnect_prompt_tokens_by_source", sources, m.prompt_tokens.clone());
        register(&mut r, &mut own, "vllm:prompt_tokens_by_source", sources, m.prompt_tokens.clone());
        let bytes =
            "KV bytes of each request's prompt loaded through the connector (its loaded tokens times \
            the model's KV bytes per token)";
        register(&mut r, &mut own, "kvconnect_kv_transfer_bytes", bytes, m.transfer_bytes.clone());
        register(&mut r, &mut own, "vllm:nixl_bytes_transferred", bytes, m.transfer_bytes.clone());
        register(
            &mut r,
            &mut own,
            "kvconnect_kv_load_failures",
            "Requests whose external KV could not be loaded, by reason: producer_not_allowed (params naming \
                a producer outside the allow-list; nothing contacted), peer_unreachable, wrong_engine, \
                peer_rejected, unauthenticated, handshake_refused (at the handshake) or load_failed (the \
                transfer)",
            m.load_failures.clone(),
        );
        register(
            &mut r,
            &mut own,
            "kvconnect_kv_recomputed_requests",
            "Requests that were to load external KV and computed their prompt here instead \
                (kv_load_failure_policy recompute)",
            m.recomputed.clone(),
        );
        register(
            &mut r,
            &mut own,
            "kvconnect_http_refused",
            "HTTP clients refused or cut off, by reason: header_timeout (the request head not whole in time; \
                the connection is closed), body_timeout (408), body_too_large (413), too_many_requests (503 \
                past --max-concurrent-requests), too_many_connections (a connection past --max-connections, \
                answered 503 and closed), run_timeout (a request past --request-timeout: 504, or its stream \
                ended)",
            m.http_refused.clone(),
        );
        register(
            &mut r,
            &mut own,
            "kvconnect_requests_cancelled",
            "Requests ended before their end because their client disconnected (their blocks freed then)",
            m.cancelled.clone(),
        );
        r.register_collector(Box::new(m.scraped.clone()));
        ServerMetrics { registry: r, own, ..m }
    }
}

/// Registers `metric` as `name` and keeps the name among the server's own families.
fn register(r: &mut Registry, own: &mut HashSet<String>, name: &str, help: &str, metric: impl Metric) {
    own.insert(name.to_owned());
    r.register(name, help, metric);
}

/// The process's server metrics.
pub fn get() -> &'static ServerMetrics {
    static M: OnceLock<ServerMetrics> = OnceLock::new();
    M.get_or_init(ServerMetrics::new)
}

/// A request answered on `route` with `status`.
pub fn request(route: &'static str, status: u16) {
    get().http.get_or_create(&vec![("route", route.to_owned()), ("status", status.to_string())]).inc();
}

/// A completed generation: engine TTFT, whole time, tokens, tokens loaded from a peer.
pub fn generation(ttft: Duration, total: Duration, tokens: u64, loaded: u64) {
    let m = get();
    m.ttft.observe(ttft.as_secs_f64());
    if tokens > 1 {
        m.inter_token.observe((total.saturating_sub(ttft) / (tokens as u32 - 1).max(1)).as_secs_f64());
    }
    m.loaded_tokens.inc_by(loaded);
}

/// The time from admission to the first token of a request that loaded prompt KV through the
/// connector (the load plus the first forward step: an upper bound on the transfer latency).
pub fn external_first_token(t: Duration) {
    get().external_first_token.observe(t.as_secs_f64());
}

/// A request the engine finished (`ok`) or ended with an error.
pub fn finished(ok: bool) {
    if ok {
        get().completed.inc();
    } else {
        get().failed.inc();
    }
}

/// Where a request's prompt tokens came from; `transfer_bytes` is what its external tokens
/// weigh (nothing is observed when it loaded none).
pub fn prompt(sources: PromptSources, transfer_bytes: u64) {
    let m = get();
    for (source, n) in [
        ("local_compute", sources.local_compute),
        ("local_cache_hit", sources.local_cache_hit),
        ("external_kv_transfer", sources.external_kv_transfer),
    ] {
        m.prompt_tokens.get_or_create(&vec![("source", source.to_owned())]).inc_by(n);
    }
    if transfer_bytes > 0 {
        m.transfer_bytes.observe(transfer_bytes as f64);
    }
}

/// A request that was to load external KV could not (`reason`); `recomputed` when it then
/// computed its prompt here.
pub fn load_failure(reason: &'static str, recomputed: bool) {
    let m = get();
    m.load_failures.get_or_create(&vec![("reason", reason.to_owned())]).inc();
    if recomputed {
        m.recomputed.inc();
    }
}

/// A request ended because its client disconnected.
pub fn cancelled() {
    get().cancelled.inc();
}

/// An HTTP client refused or cut off (`reason`: header_timeout, body_timeout, body_too_large,
/// too_many_requests, too_many_connections, run_timeout).
pub fn http_refused(reason: &'static str) {
    get().http_refused.get_or_create(&vec![("reason", reason.to_owned())]).inc();
}

/// A handshake refusal; `reason` is the refusal message, whose indented `field: ...` lines
/// name what differed.
pub fn refusal(reason: &str) {
    for f in refusal_fields(reason) {
        get().refusals.get_or_create(&vec![("field", f)]).inc();
    }
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

/// Whether `name` is one of the server's own families, whose samples it counts itself: a
/// scraped sample of that name would show the family twice.
pub fn is_own_family(name: &str) -> bool {
    let own = &get().own;
    own.contains(name) || name.strip_suffix("_total").is_some_and(|base| own.contains(base))
}

/// Prometheus text of every metric, with `scraped` as the values read now.
pub fn render(scraped: Vec<Sample>) -> String {
    let m = get();
    if let Ok(mut s) = m.scraped.samples.lock() {
        *s = scraped;
    }
    let mut out = String::new();
    match prometheus_client::encoding::prometheus_text::encode(&mut out, &m.registry) {
        Ok(()) => out,
        Err(e) => format!("# metrics could not be encoded: {e}\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_fields_come_from_the_indented_diff_lines() {
        let r = "prefill engine 'p' and decode engine 'd' have incompatible KV caches; no KV was \
                 transferred:\n  hma: prefill=off, decode=on\n  block_size: 16 vs 32";
        assert_eq!(refusal_fields(r), vec!["hma", "block_size"]);
        assert_eq!(refusal_fields("peer gone"), vec!["unknown"]);
    }

    #[test]
    fn prompt_sources_count_as_vllm_counts_them() {
        // A cold decode: the connector loaded all but the last token.
        assert_eq!(
            PromptSources::of(40, 0, 39),
            PromptSources { local_compute: 0, local_cache_hit: 0, external_kv_transfer: 40 }
        );
        // Primed with the same prompt: two whole 16-token blocks cached, the rest loaded.
        assert_eq!(
            PromptSources::of(40, 32, 7),
            PromptSources { local_compute: 0, local_cache_hit: 32, external_kv_transfer: 8 }
        );
        // Everything cached but the last token; nothing external.
        assert_eq!(
            PromptSources::of(33, 32, 0),
            PromptSources { local_compute: 1, local_cache_hit: 32, external_kv_transfer: 0 }
        );
        // A direct request.
        assert_eq!(
            PromptSources::of(5, 0, 0),
            PromptSources { local_compute: 5, local_cache_hit: 0, external_kv_transfer: 0 }
        );
        // A partial external load (an LMCache prefix hit) leaves the rest computed.
        assert_eq!(
            PromptSources::of(100, 0, 64),
            PromptSources { local_compute: 36, local_cache_hit: 0, external_kv_transfer: 64 }
        );
    }

    #[test]
    fn renders_both_names_and_scraped_values() {
        prompt(PromptSources::of(10, 0, 9), 4096);
        load_failure("handshake_refused", true);
        let text = render(vec![
            Sample::gauge("kvconnect_pool_free_blocks", "Free KV blocks.", 7),
            Sample::counter("kvconnect_cache_hits", "Chunks found.", 3).with(vec![("tier", "cpu".into())]),
        ]);
        for want in [
            "vllm:prompt_tokens_by_source_total{source=\"external_kv_transfer\"}",
            "kvconnect_prompt_tokens_by_source_total{source=\"local_compute\"}",
            "vllm:nixl_bytes_transferred_count",
            "vllm:nixl_bytes_transferred_sum",
            "kvconnect_kv_load_failures_total{reason=\"handshake_refused\"}",
            "kvconnect_kv_recomputed_requests_total",
            "kvconnect_pool_free_blocks 7",
            "kvconnect_cache_hits_total{tier=\"cpu\"} 3",
            "# TYPE kvconnect_ttft_seconds histogram",
        ] {
            assert!(text.contains(want), "missing {want}:\n{text}");
        }
        // The registry ends each registered help with a period; scraped samples bring their own.
        for help in text.lines().filter(|l| l.starts_with("# HELP")) {
            assert!(help.ends_with('.') && !help.ends_with(".."), "one period ends a help text: {help}");
        }
    }

    #[test]
    fn a_family_is_written_once_wherever_its_samples_come_and_of_its_first_samples_kind() {
        let scraped = Arc::new(Scraped::default());
        let hit = |tier: &str, v| Sample::counter("hits", "Hits.", v).with(vec![("tier", tier.into())]);
        *scraped.samples.lock().unwrap() = vec![
            hit("cpu", 1),
            Sample::gauge("free", "Free.", 7),
            Sample::owned("hits".into(), "Hits.".into(), true, vec![("tier".into(), "disk".into())], 2),
            Sample::gauge("hits", "Not a counter.", 9),
        ];
        let mut r = Registry::default();
        r.register_collector(Box::new(scraped));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &r).unwrap();
        assert_eq!(text.matches("# TYPE hits_total counter").count(), 1, "{text}");
        assert!(
            text.contains("hits_total{tier=\"cpu\"} 1") && text.contains("hits_total{tier=\"disk\"} 2"),
            "{text}"
        );
        assert!(!text.contains(" 9"), "a gauge sample in a counter family is left out: {text}");
    }

    #[test]
    fn the_servers_own_families_are_known_by_name() {
        for own in ["kvconnect_ttft_seconds", "kvconnect_requests_completed", "vllm:prompt_tokens_by_source"]
        {
            assert!(is_own_family(own), "{own}");
        }
        assert!(is_own_family("kvconnect_requests_completed_total"), "a gauge named as a counter's samples");
        for theirs in ["kvconnect_cache_hits", "kvconnect_data_plane_refused", "my_plugin_hits"] {
            assert!(!is_own_family(theirs), "{theirs}");
        }
    }
}
