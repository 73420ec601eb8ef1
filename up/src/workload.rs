//! The built-in workload of `kvconnect up --workload N`: deterministic requests (completions
//! and chat), some sharing long prefixes so the cache on prefill finds them, and the ground
//! truth for each from the reference engine run in-process as a single monolithic engine.

use anyhow::{anyhow, Context, Result};
use kvconnect_api::{Dtype, FailurePolicy, KvLayout};
use kvconnect_engine::{local_effective_layout, tokenize, Engine, EngineConfig, GenRequest, ReferenceConfig};
use kvconnect_openai::chat_template::chat_prompt;
use serde_json::{json, Value};

/// Which prompts the workload sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Prompts {
    /// About half share one of a few long prefixes, the others unique.
    Mixed,
    /// Every prompt starts with one of a few long prefixes.
    Shared,
    /// No two prompts share more than a few tokens.
    Unique,
}

/// Tokens generated per request.
pub const MAX_TOKENS: usize = 8;

/// One request of the workload.
#[derive(Debug, Clone)]
pub struct Item {
    /// `/v1/completions` or `/v1/chat/completions`.
    pub path: &'static str,
    /// The JSON body.
    pub body: Value,
    /// The prompt as the engine sees it.
    pub prompt: Vec<u32>,
    /// True when the prompt starts with a shared prefix.
    pub shared: bool,
}

fn letters(seed: usize, len: usize) -> String {
    // Printable ASCII so chat content stays text; a cheap LCG keeps it deterministic.
    let mut x = (seed as u64).wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (b'a' + ((x >> 33) % 26) as u8) as char
        })
        .collect()
}

/// The long prefixes the shared prompts start with, unless `--prefixes` says otherwise.
pub const DEFAULT_PREFIXES: u16 = 3;

/// A fixed pseudo-random draw in `0..count` for request `i` (`salt` keeps draws of different
/// things apart). Which prefix a request starts with, and whether it is a chat request, are
/// drawn so, as requests from many users arrive, so that neither follows the proxy's
/// round-robin cycle: with `i % count`, a count that shares a factor with the number of
/// prefill workers would send every repeat of a prefix (or every chat request) to the same
/// worker under round-robin too.
fn draw(i: usize, salt: u64, count: usize) -> usize {
    // SplitMix64's finaliser: consecutive `i` give unrelated draws.
    let mut x = (i as u64 ^ salt.rotate_left(32)).wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((x ^ (x >> 31)) % count.max(1) as u64) as usize
}

/// The `n` requests of a workload; shared prompts start with one of `prefixes` long prefixes.
pub fn items(n: usize, kind: Prompts, prefixes: u16) -> Vec<Item> {
    // Prefixes of 600 bytes: two LMCache chunks of 256 tokens each are reusable.
    let prefixes: Vec<String> = (0..usize::from(prefixes.max(1))).map(|i| letters(1000 + i, 600)).collect();
    (0..n)
        .map(|i| {
            let shared = match kind {
                Prompts::Shared => true,
                Prompts::Unique => false,
                Prompts::Mixed => draw(i, 3, 2) == 0,
            };
            let suffix = letters(i, 20 + (i * 7) % 60);
            let text = if shared {
                format!("{}{suffix}", prefixes[draw(i, 1, prefixes.len())])
            } else {
                letters(50_000 + i, 300 + (i * 13) % 300)
            };
            // A quarter of the requests are chat requests.
            if draw(i, 2, 4) == 3 {
                let messages = json!([{"role": "user", "content": text}]);
                let prompt = chat_prompt(&messages).map(|p| tokenize(&p)).unwrap_or_default();
                Item {
                    path: "/v1/chat/completions",
                    body: json!({"messages": messages, "max_tokens": MAX_TOKENS}),
                    prompt,
                    shared,
                }
            } else {
                Item {
                    path: "/v1/completions",
                    body: json!({"prompt": text, "max_tokens": MAX_TOKENS}),
                    prompt: tokenize(&text),
                    shared,
                }
            }
        })
        .collect()
}

/// The reference model the deployment names (its `model`), which the servers run and the
/// ground truth is computed with.
pub fn reference_model(path: &std::path::Path) -> Result<ReferenceConfig> {
    let json =
        std::fs::read_to_string(path).with_context(|| format!("model {}: cannot read it", path.display()))?;
    ReferenceConfig::from_json(&json).map_err(|e| {
        anyhow!(
            "model {}: {e}; --workload checks outputs against the reference engine, so the deployment \
            must name a reference model (fixtures/models/kvconnect--reference*)",
            path.display()
        )
    })
}

/// Greedy tokens of the single monolithic reference engine (no connector), in order.
pub fn ground_truth(items: &[Item], seed: u64, model: ReferenceConfig) -> Result<Vec<Vec<u32>>> {
    let spec = model.model_spec().map_err(|e| anyhow!("reference model: {e}"))?;
    let eff = local_effective_layout(&spec, KvLayout::HND, true, 16, Dtype::Bf16);
    let cfg = EngineConfig { model, effective: eff, num_blocks: 256, seed, shm: None, tp_size: 1 };
    let mut e =
        Engine::new(cfg, None, FailurePolicy::Recompute).map_err(|e| anyhow!("monolithic engine: {e}"))?;
    let mut out = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        e.add_request(GenRequest::new(format!("truth-{i}"), it.prompt.clone(), MAX_TOKENS))
            .map_err(|e| anyhow!("monolithic engine, request {i}: {e}"))?;
        let done =
            e.run_to_completion(1_000_000).map_err(|e| anyhow!("monolithic engine, request {i}: {e}"))?;
        out.push(
            done.into_iter().next().map(|c| c.tokens).context("the monolithic engine returned nothing")?,
        );
    }
    Ok(out)
}

/// KV bytes per token over the KV layers (K and V) of the reference model, in its dtype.
pub fn kv_bytes_per_token(model: &ReferenceConfig) -> Result<u64> {
    let spec = model.model_spec().map_err(|e| anyhow!("reference model: {e}"))?;
    Ok(spec.kv_bytes_per_token(spec.dtype.unwrap_or(Dtype::Bf16)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_workload_shares_prefixes_and_has_chat() {
        let it = items(8, Prompts::Mixed, DEFAULT_PREFIXES);
        let shared = it.iter().filter(|i| i.shared).count();
        assert!((2..=6).contains(&shared), "{shared} of 8 shared");
        assert!(it.iter().any(|i| i.path == "/v1/chat/completions"));
        let unique: Vec<&[u32]> = it.iter().filter(|i| !i.shared).map(|i| &i.prompt[..20]).collect();
        assert!(
            unique.iter().enumerate().all(|(k, a)| unique[k + 1..].iter().all(|b| a != b)),
            "unique prompts"
        );
        assert!(items(4, Prompts::Unique, DEFAULT_PREFIXES).iter().all(|i| !i.shared));
    }

    #[test]
    fn shared_prompts_draw_every_prefix_out_of_step_with_round_robin() {
        let n = 96;
        for count in [1u16, 3, 4, 12] {
            let it = items(n, Prompts::Shared, count);
            // Completions only: chat wraps its text in the template.
            let heads: Vec<(usize, &[u32])> = it
                .iter()
                .enumerate()
                .filter(|(_, i)| i.path == "/v1/completions")
                .map(|(k, i)| (k, &i.prompt[..600]))
                .collect();
            let mut distinct: Vec<&[u32]> = heads.iter().map(|h| h.1).collect();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), usize::from(count), "{count} prefixes, each drawn at least once");
            // Under round-robin over 4 workers, some prefix reaches more than one worker.
            if count > 1 {
                let spread = distinct.iter().any(|d| {
                    let mut w: Vec<usize> = heads.iter().filter(|h| h.1 == *d).map(|h| h.0 % 4).collect();
                    w.sort();
                    w.dedup();
                    w.len() > 1
                });
                assert!(spread, "{count} prefixes follow a 4-worker round-robin cycle");
            }
        }
        // Chat requests reach every slot of a 4-worker round-robin cycle.
        let mut slots: Vec<usize> = items(n, Prompts::Shared, 3)
            .iter()
            .enumerate()
            .filter(|(_, i)| i.path != "/v1/completions")
            .map(|(k, _)| k % 4)
            .collect();
        slots.sort();
        slots.dedup();
        assert_eq!(slots, [0, 1, 2, 3], "chat requests follow the round-robin cycle");
        assert_eq!(
            items(10, Prompts::Shared, 5)[3].prompt,
            items(10, Prompts::Shared, 5)[3].prompt,
            "fixed draw"
        );
    }

    #[test]
    fn ground_truth_is_deterministic() {
        let it = items(2, Prompts::Unique, DEFAULT_PREFIXES);
        let m = ReferenceConfig::builtin().unwrap();
        let a = ground_truth(&it, 0, m.clone()).unwrap();
        assert_eq!(a, ground_truth(&it, 0, m).unwrap());
        assert_eq!(a[0].len(), MAX_TOKENS);
    }
}
