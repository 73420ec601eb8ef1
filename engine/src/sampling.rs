//! Choosing the next token from the model's logits, and what a request asked to be told about
//! the choice: greedy argmax (the default), or sampling at a temperature with top-k, min-p and
//! nucleus (top-p) filtering from a per-request generator seeded by the request's `seed`; the
//! log-probabilities of the chosen token and of the most likely ones; and the stop sequences
//! that end a request early.
//!
//! Everything here is a pure function of the logits, the parameters and the generator's
//! state, so a request with the same prompt and seed gets the same tokens on any engine: a
//! monolithic one, or a decode engine that continues from transferred KV (decode samples
//! every generated token, so the generator sees the same draws in the same order).

use crate::model::argmax;
use crate::prng::SplitMix64;

/// How a request's tokens are chosen and reported. `Default` is greedy decoding with nothing
/// reported and no stop sequences: exactly what the engine did before sampling existed.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy (argmax; every other sampling field is then ignored); above 0 the logits
    /// are divided by it before the softmax.
    pub temperature: f32,
    /// Nucleus sampling: only the most likely tokens whose probabilities add up to at least
    /// this are kept. In (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// Only the `top_k` most likely tokens are kept; 0 keeps every token.
    pub top_k: usize,
    /// Tokens less likely than `min_p` times the most likely one are dropped; 0 keeps all.
    pub min_p: f32,
    /// Seed of the request's generator (one draw per sampled token).
    pub seed: u64,
    /// Report the chosen token's log-probability and the `n` most likely tokens' (`Some(0)`:
    /// the chosen token's only).
    pub logprobs: Option<usize>,
    /// No stop sequence ends the request before this many tokens were generated.
    pub min_tokens: usize,
    /// Token sequences that end the request once the output ends with one of them.
    pub stop: Vec<Vec<u32>>,
}

impl Default for SamplingParams {
    fn default() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 0,
            logprobs: None,
            min_tokens: 0,
            stop: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// True when the next token is the argmax of the logits (no generator draw).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// True when nothing but the greedy token is asked for: no sampling, no log-probabilities,
    /// no stop sequences (what an engine that computes no logits can serve).
    pub fn is_plain_greedy(&self) -> bool {
        self.is_greedy() && self.logprobs.is_none() && self.stop.is_empty()
    }

    /// What is wrong with these parameters, if anything (the OpenAI layer refuses such
    /// requests earlier with the parameter's name; this guards the engine's own API).
    pub fn check(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!("temperature {} must be a finite number >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        if self.stop.iter().any(Vec::is_empty) {
            return Err("a stop sequence is empty; leave it out".into());
        }
        Ok(())
    }
}

/// The log-probabilities reported for one generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token.
    pub token: u32,
    /// Its log-probability under the model's distribution (before temperature and filtering).
    pub logprob: f32,
    /// The most likely tokens with theirs, most likely first (ties: lowest id first).
    pub top: Vec<(u32, f32)>,
}

/// Token ids ordered from the largest logit to the smallest, ties to the lowest id, NaN last.
fn ranked(logits: &[f32]) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|a, b| {
        let (x, y) = (logits[*a as usize], logits[*b as usize]);
        match (x.is_nan(), y.is_nan()) {
            (false, false) => y.total_cmp(&x).then(a.cmp(b)),
            (nx, ny) => nx.cmp(&ny).then(a.cmp(b)),
        }
    });
    ids
}

/// The log-softmax of the logits, computed in f64 and rounded to f32.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().filter(|x| !x.is_nan()).fold(f64::NEG_INFINITY, |m, x| m.max(x as f64));
    let sum: f64 = logits.iter().filter(|x| !x.is_nan()).map(|x| (*x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|x| (*x as f64 - lse) as f32).collect()
}

/// What [`SamplingParams::logprobs`] reports for `token`: its log-probability and the `n`
/// most likely tokens' (log-softmax of the raw logits, as vLLM reports by default).
pub fn token_logprobs(logits: &[f32], token: u32, n: usize) -> TokenLogprobs {
    let lp = log_softmax(logits);
    let top = ranked(logits).into_iter().take(n).map(|t| (t, lp[t as usize])).collect();
    TokenLogprobs { token, logprob: lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY), top }
}

/// The next token: the argmax when greedy; otherwise one draw from `rng` over the softmax of
/// `logits / temperature`, restricted by top-k, min-p and top-p (in that order) and
/// renormalised.
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut SplitMix64) -> u32 {
    if p.is_greedy() || logits.is_empty() {
        return argmax(logits);
    }
    let order = ranked(logits);
    let best = logits[order[0] as usize] as f64;
    let t = p.temperature as f64;
    // Unnormalised probabilities, most likely first; NaN logits weigh nothing.
    let mut kept: Vec<(u32, f64)> = order
        .iter()
        .map(|&id| {
            let l = logits[id as usize];
            (id, if l.is_nan() { 0.0 } else { ((l as f64 - best) / t).exp() })
        })
        .collect();
    if p.top_k > 0 {
        kept.truncate(p.top_k);
    }
    if p.min_p > 0.0 {
        // The first weight is the largest (exp(0) = 1 before normalising).
        let floor = p.min_p as f64 * kept[0].1;
        kept.retain(|(_, w)| *w >= floor);
    }
    if p.top_p < 1.0 {
        let want = p.top_p as f64 * kept.iter().map(|(_, w)| w).sum::<f64>();
        let mut acc = 0.0;
        let mut keep = 0;
        for (_, w) in &kept {
            acc += w;
            keep += 1;
            if acc >= want {
                break;
            }
        }
        kept.truncate(keep.max(1));
    }
    let mass: f64 = kept.iter().map(|(_, w)| w).sum();
    let u = rng.next_unit_f64() * mass;
    let mut acc = 0.0;
    for (id, w) in &kept {
        acc += w;
        if u < acc {
            return *id;
        }
    }
    kept.last().map_or(order[0], |(id, _)| *id)
}

/// How many trailing tokens of `output` form the stop sequence it now ends with, if it ends
/// with one and at least `min_tokens` tokens were generated (the longest such sequence when
/// several match).
pub fn stop_match(output: &[u32], p: &SamplingParams) -> Option<usize> {
    if output.len() < p.min_tokens.max(1) {
        return None;
    }
    p.stop.iter().filter(|s| !s.is_empty() && output.ends_with(s)).map(Vec::len).max()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(seed: u64) -> Vec<f32> {
        let mut r = SplitMix64::new(seed);
        (0..256).map(|_| r.next_signed_unit() * 4.0).collect()
    }

    fn run(p: &SamplingParams, steps: u64) -> Vec<u32> {
        let mut rng = SplitMix64::new(p.seed);
        (0..steps).map(|i| sample(&logits(i), p, &mut rng)).collect()
    }

    fn warm(seed: u64) -> SamplingParams {
        SamplingParams { temperature: 1.0, seed, ..SamplingParams::default() }
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        assert_eq!(run(&warm(7), 64), run(&warm(7), 64));
        assert_ne!(run(&warm(7), 64), run(&warm(8), 64));
    }

    #[test]
    fn temperature_zero_and_tiny_top_p_are_greedy() {
        let greedy: Vec<u32> = (0..64).map(|i| argmax(&logits(i))).collect();
        assert_eq!(run(&SamplingParams { seed: 3, ..SamplingParams::default() }, 64), greedy);
        let nucleus = SamplingParams { top_p: 1e-6, ..warm(3) };
        assert_eq!(run(&nucleus, 64), greedy);
        let top1 = SamplingParams { top_k: 1, ..warm(3) };
        assert_eq!(run(&top1, 64), greedy);
        // Sampling at temperature 1 over 256 tokens does not follow the argmax for 64 steps.
        assert_ne!(run(&warm(3), 64), greedy);
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Probabilities 0.5, 0.3, 0.2: top_p 0.7 keeps the first two only.
        let l: Vec<f32> = [0.5f32, 0.3, 0.2].iter().map(|p| p.ln()).collect();
        let p = SamplingParams { top_p: 0.7, ..warm(1) };
        let mut rng = SplitMix64::new(1);
        let seen: std::collections::BTreeSet<u32> = (0..500).map(|_| sample(&l, &p, &mut rng)).collect();
        assert_eq!(seen, [0, 1].into_iter().collect());
        let p = SamplingParams { min_p: 0.5, ..warm(1) };
        let seen: std::collections::BTreeSet<u32> = (0..500).map(|_| sample(&l, &p, &mut rng)).collect();
        assert_eq!(seen, [0, 1].into_iter().collect(), "0.2 < 0.5 * 0.5 is dropped");
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_tokens_in_order() {
        let l = [1.0f32, 3.0, 3.0, 2.0];
        let lp = log_softmax(&l);
        let total: f64 = lp.iter().map(|x| (*x as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        let t = token_logprobs(&l, 3, 2);
        assert_eq!(t.token, 3);
        assert!((t.logprob - lp[3]).abs() < 1e-7);
        assert_eq!(t.top.iter().map(|(id, _)| *id).collect::<Vec<_>>(), vec![1, 2], "ties: lowest id first");
        assert!(token_logprobs(&l, 0, 0).top.is_empty());
    }

    #[test]
    fn stop_sequences_match_at_the_end_after_min_tokens() {
        let p =
            SamplingParams { stop: vec![vec![3, 4], vec![4]], min_tokens: 3, ..SamplingParams::default() };
        assert_eq!(stop_match(&[3, 4], &p), None, "before min_tokens");
        assert_eq!(stop_match(&[1, 3, 4], &p), Some(2), "the longest match");
        assert_eq!(stop_match(&[1, 2, 4], &p), Some(1));
        assert_eq!(stop_match(&[4, 1, 2], &p), None, "only at the end");
    }

    #[test]
    fn bad_parameters_are_named() {
        let bad = |p: SamplingParams| p.check().unwrap_err();
        assert!(
            bad(SamplingParams { temperature: -1.0, ..SamplingParams::default() }).contains("temperature")
        );
        assert!(bad(SamplingParams { top_p: 0.0, ..SamplingParams::default() }).contains("top_p"));
        assert!(bad(SamplingParams { stop: vec![vec![]], ..SamplingParams::default() }).contains("empty"));
        assert!(SamplingParams::default().check().is_ok());
    }
}
