//! The report of `kvconnect up --workload`: what each request measured, percentiles over
//! them, and the text and JSON forms.

use kvconnect_api::TierTokens;
use kvconnect_proxy::metrics::RouterTally;
use serde::Serialize;

/// What one request measured.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Time to first token, microseconds.
    pub ttft_us: u64,
    /// Whole request, microseconds.
    pub total_us: u64,
    /// Tokens generated.
    pub tokens: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens decode loaded from prefill.
    pub loaded_tokens: u64,
    /// Decode's own time to first token (the KV load is inside it), microseconds.
    pub decode_ttft_us: u64,
    /// Prompt tokens prefill's cache connectors supplied, by connector and tier (prefill's
    /// `kvconnect.cache_sources`).
    pub cache_sources: Vec<TierTokens>,
    /// The tokens equal the monolithic engine's.
    pub matches: bool,
    /// Decode computed a prompt it should have loaded from prefill (a failed or refused KV
    /// load, or none attempted).
    pub recomputed: bool,
    /// An error instead of an answer.
    pub error: Option<String>,
}

/// p50/p90/p99 of a series.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles; zeros for an empty series.
    pub fn of(v: Vec<f64>) -> Percentiles {
        let [p50, p90, p99] = nearest_rank(v, [0.50, 0.90, 0.99]);
        Percentiles { p50, p90, p99 }
    }
}

/// The monolithic comparison.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// TTFT of the single monolithic server, ms.
    pub monolithic_ttft_ms: Percentiles,
    /// Disaggregated p50 TTFT over monolithic p50 TTFT.
    pub ttft_p50_ratio: f64,
    /// Disaggregated p99 TTFT over monolithic p99 TTFT.
    pub ttft_p99_ratio: f64,
    /// Per prompt, disaggregated TTFT over monolithic TTFT (both answered): the quartiles.
    pub ttft_pair_ratio: Quartiles,
    /// Prompts both answered.
    pub pairs: usize,
    /// Monolithic outputs that differ from the in-process ground truth.
    pub monolithic_mismatches: usize,
}

impl Comparison {
    /// Compares two runs of one workload, `pd[i]` and `mono[i]` being the same prompt.
    pub fn of(pd: &[Sample], mono: &[Sample], pd_ttft_ms: &Percentiles) -> Comparison {
        let ok = |s: &&Sample| s.error.is_none();
        let mp = Percentiles::of(mono.iter().filter(ok).map(|s| s.ttft_us as f64 / 1e3).collect());
        let ratio = |d: f64, m: f64| if m > 0.0 { d / m } else { 0.0 };
        let pair_ratios: Vec<f64> = pd
            .iter()
            .zip(mono)
            .filter(|(d, m)| d.error.is_none() && m.error.is_none() && m.ttft_us > 0)
            .map(|(d, m)| d.ttft_us as f64 / m.ttft_us as f64)
            .collect();
        Comparison {
            ttft_p50_ratio: ratio(pd_ttft_ms.p50, mp.p50),
            ttft_p99_ratio: ratio(pd_ttft_ms.p99, mp.p99),
            monolithic_ttft_ms: mp,
            pairs: pair_ratios.len(),
            ttft_pair_ratio: Quartiles::of(pair_ratios),
            monolithic_mismatches: mono.iter().filter(|s| s.error.is_some() || !s.matches).count(),
        }
    }
}

use kvconnect_support::stats::nearest_rank;
pub use kvconnect_support::stats::Quartiles;

/// Prefill cache hits of one connector's tier.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheHits {
    /// The connector that produced them.
    pub connector: String,
    /// Its tier.
    pub tier: String,
    /// Prompt tokens it supplied.
    pub tokens: u64,
    /// Over all prompt tokens.
    pub rate: f64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Requests sent.
    pub requests: usize,
    /// Which prompts.
    pub prompts: String,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Requests answered with an error.
    pub failed: usize,
    /// Answers whose tokens differ from the monolithic engine's.
    pub mismatches: usize,
    /// Time to first token through the proxy (prefill round trip + decode's first token), ms.
    pub ttft_ms: Percentiles,
    /// Of it, decode's own time to first token (its queue, the KV load and the first step), ms;
    /// the rest is the prefill round trip.
    pub decode_ttft_ms: Percentiles,
    /// Tokens per second of each request.
    pub tokens_per_s: Percentiles,
    /// Tokens generated over the workload's wall time.
    pub throughput_tokens_per_s: f64,
    /// KV bytes decode loaded from prefill.
    pub kv_bytes: u64,
    /// Requests whose decode loaded the prompt's KV from prefill (or found it cached).
    pub loaded_requests: usize,
    /// Requests whose decode computed the prompt instead of loading it.
    pub recomputed_requests: usize,
    /// KV bytes over the summed decode time to first token (the load is inside it), GB/s.
    pub kv_gb_per_s: f64,
    /// Prompt tokens prefill's cache connectors supplied over all prompt tokens.
    pub prefill_cache_hit_rate: f64,
    /// The same by connector and tier (`lmcache` `cpu`/`disk`/`remote`, `flexkv`
    /// `cpu`/`ssd`), largest first.
    pub prefill_cache_hits: Vec<CacheHits>,
    /// Wall time, seconds.
    pub wall_s: f64,
    /// The first errors, verbatim.
    pub errors: Vec<String>,
    /// Against a monolithic server process, when asked for.
    pub compare_monolithic: Option<Comparison>,
    /// With `--routing kv`: the router's decisions and predicted hits against the servers'.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterTally>,
}

impl Report {
    /// Builds the report.
    pub fn new(
        samples: &[Sample],
        prompts: &str,
        concurrency: usize,
        wall_s: f64,
        kv_bytes_per_token: u64,
    ) -> Report {
        let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
        let tokens: u64 = ok.iter().map(|s| s.tokens).sum();
        let kv_bytes: u64 = ok.iter().map(|s| s.loaded_tokens * kv_bytes_per_token).sum();
        let decode_s: f64 = ok.iter().map(|s| s.decode_ttft_us as f64 / 1e6).sum();
        let prompt: u64 = ok.iter().map(|s| s.prompt_tokens).sum();
        let mut by_tier: Vec<CacheHits> = Vec::new();
        for t in ok.iter().flat_map(|s| &s.cache_sources) {
            match by_tier.iter_mut().find(|h| h.connector == t.connector && h.tier == t.tier) {
                Some(h) => h.tokens += t.tokens,
                None => by_tier.push(CacheHits {
                    connector: t.connector.clone(),
                    tier: t.tier.clone(),
                    tokens: t.tokens,
                    rate: 0.0,
                }),
            }
        }
        let rate = |n: u64| if prompt > 0 { n as f64 / prompt as f64 } else { 0.0 };
        for h in &mut by_tier {
            h.rate = rate(h.tokens);
        }
        by_tier.sort_by(|a, b| b.tokens.cmp(&a.tokens).then_with(|| a.connector.cmp(&b.connector)));
        let hits: u64 = by_tier.iter().map(|h| h.tokens).sum();
        Report {
            requests: samples.len(),
            prompts: prompts.to_owned(),
            concurrency,
            failed: samples.len() - ok.len(),
            mismatches: ok.iter().filter(|s| !s.matches).count(),
            loaded_requests: ok.iter().filter(|s| !s.recomputed).count(),
            recomputed_requests: ok.iter().filter(|s| s.recomputed).count(),
            ttft_ms: Percentiles::of(ok.iter().map(|s| s.ttft_us as f64 / 1e3).collect()),
            decode_ttft_ms: Percentiles::of(ok.iter().map(|s| s.decode_ttft_us as f64 / 1e3).collect()),
            tokens_per_s: Percentiles::of(
                ok.iter()
                    .filter(|s| s.total_us > 0)
                    .map(|s| s.tokens as f64 * 1e6 / s.total_us as f64)
                    .collect(),
            ),
            throughput_tokens_per_s: if wall_s > 0.0 { tokens as f64 / wall_s } else { 0.0 },
            kv_bytes,
            kv_gb_per_s: if decode_s > 0.0 { kv_bytes as f64 / decode_s / 1e9 } else { 0.0 },
            prefill_cache_hit_rate: rate(hits),
            prefill_cache_hits: by_tier,
            wall_s,
            errors: samples.iter().filter_map(|s| s.error.clone()).take(5).collect(),
            compare_monolithic: None,
            router: None,
        }
    }

    /// True when every request was answered with the monolithic engine's tokens and every
    /// decode loaded its prompt's KV (a P/D deployment that silently recomputes is broken).
    pub fn all_correct(&self) -> bool {
        self.failed == 0
            && self.mismatches == 0
            && self.recomputed_requests == 0
            && self.compare_monolithic.as_ref().is_none_or(|c| c.monolithic_mismatches == 0)
    }

    /// `: lmcache remote 10.0%, lmcache cpu 4.8%`, or nothing without hits.
    fn hits_by_tier(&self) -> String {
        if self.prefill_cache_hits.is_empty() {
            return String::new();
        }
        let parts: Vec<String> = self
            .prefill_cache_hits
            .iter()
            .map(|h| format!("{} {} {:.1}%", h.connector, h.tier, h.rate * 100.0))
            .collect();
        format!(" ({})", parts.join(", "))
    }

    /// The human form.
    pub fn text(&self) -> String {
        let p = |x: &Percentiles| format!("p50 {:.2}  p90 {:.2}  p99 {:.2}", x.p50, x.p90, x.p99);
        let mut s = format!(
            "workload: {} requests ({} prompts, {} in flight) in {:.2} s\n\
             outputs equal to the monolithic engine: {}/{} ({} failed)\n\
             TTFT ms (prefill + decode first token): {}\n\
             of which decode's own (queue, KV load, first step): {}\n\
             tokens/s per request: {}\n\
             throughput: {:.1} tokens/s\n\
             decode loaded the prompt's KV: {}/{} requests ({} recomputed instead)\n\
             KV moved prefill -> decode: {:.2} MB, {:.3} GB/s (over decode's time to first token)\n\
             cache hits on prefill: {:.1}% of prompt tokens{}\n",
            self.requests,
            self.prompts,
            self.concurrency,
            self.wall_s,
            self.requests - self.failed - self.mismatches,
            self.requests,
            self.failed,
            p(&self.ttft_ms),
            p(&self.decode_ttft_ms),
            p(&self.tokens_per_s),
            self.throughput_tokens_per_s,
            self.loaded_requests,
            self.requests - self.failed,
            self.recomputed_requests,
            self.kv_bytes as f64 / 1e6,
            self.kv_gb_per_s,
            self.prefill_cache_hit_rate * 100.0,
            self.hits_by_tier(),
        );
        if let Some(c) = &self.compare_monolithic {
            s.push_str(&format!(
                "monolithic worker TTFT ms: {}\nTTFT disaggregated / monolithic: p50 {:.2}x  p99 {:.2}x; per \
                    prompt, interleaved rounds: median {:.2}x (quartiles {:.2}x .. {:.2}x over {} pairs) ({} \
                    monolithic outputs differ)\n",
                p(&c.monolithic_ttft_ms),
                c.ttft_p50_ratio,
                c.ttft_p99_ratio,
                c.ttft_pair_ratio.median,
                c.ttft_pair_ratio.q1,
                c.ttft_pair_ratio.q3,
                c.pairs,
                c.monolithic_mismatches
            ));
        }
        if let Some(r) = &self.router {
            s.push_str(&format!(
                "KV router: {} picks by the index, {} round-robin; it predicted {} hit tokens, the prefill \
                    servers hit {} (exact {}, over {}, under {})\n",
                r.by_kv, r.round_robin, r.predicted_hit_tokens, r.actual_hit_tokens, r.exact, r.over, r.under
            ));
        }
        for e in &self.errors {
            s.push_str(&format!("error: {e}\n"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert_eq!(Percentiles::of(vec![]).p50, 0.0);
    }

    #[test]
    fn cache_hits_name_the_connector_and_tier_that_produced_them() {
        let t =
            |c: &str, tier: &str, n: u64| TierTokens { connector: c.into(), tier: tier.into(), tokens: n };
        let a = Sample {
            prompt_tokens: 1000,
            matches: true,
            cache_sources: vec![t("flexkv", "cpu", 100), t("flexkv", "ssd", 48)],
            ..Sample::default()
        };
        let b = Sample {
            prompt_tokens: 1000,
            matches: true,
            cache_sources: vec![t("flexkv", "cpu", 100)],
            ..Sample::default()
        };
        let r = Report::new(&[a, b], "shared", 1, 1.0, 512);
        assert!((r.prefill_cache_hit_rate - 0.124).abs() < 1e-9);
        assert_eq!(r.prefill_cache_hits[0].connector, "flexkv");
        assert_eq!((r.prefill_cache_hits[0].tier.as_str(), r.prefill_cache_hits[0].tokens), ("cpu", 200));
        let text = r.text();
        assert!(
            text.contains(
                "cache hits on prefill: 12.4% of prompt tokens (flexkv cpu 10.0%, flexkv ssd 2.4%)"
            ),
            "{text}"
        );
        assert!(!text.contains("LMCache"), "{text}");
    }

    #[test]
    fn a_mismatch_or_failure_makes_the_report_incorrect() {
        let good = Sample { tokens: 4, total_us: 1000, ttft_us: 10, matches: true, ..Sample::default() };
        let r = Report::new(std::slice::from_ref(&good), "mixed", 1, 1.0, 512);
        assert!(r.all_correct());
        let bad = Sample { matches: false, ..good.clone() };
        assert!(!Report::new(&[good.clone(), bad], "mixed", 1, 1.0, 512).all_correct());
        let recomputed = Sample { recomputed: true, ..good.clone() };
        let r = Report::new(&[good.clone(), recomputed], "mixed", 1, 1.0, 512);
        assert_eq!((r.loaded_requests, r.recomputed_requests), (1, 1));
        assert!(!r.all_correct(), "a recomputed P/D request is a failure");
        assert!(
            r.text().contains("decode loaded the prompt's KV: 1/2 requests (1 recomputed instead)"),
            "{}",
            r.text()
        );
        let failed = Sample { error: Some("x".into()), ..good };
        let r = Report::new(&[failed], "mixed", 1, 1.0, 512);
        assert_eq!(r.failed, 1);
        assert!(!r.all_correct());
    }
}
