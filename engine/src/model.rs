//! The reference model: a small decoder-only transformer (RMSNorm, GQA attention with RoPE,
//! full-attention and sliding-window layers, state layers (`state_layer`), SiLU-gated MLP),
//! described by a Hugging Face
//! style `config.json` and given weights drawn from a fixed-seed generator.
//!
//! All math is f32 and written so that a token's result depends only on its own inputs and
//! the KV it reads, never on which other tokens share the step: prefill on one engine and
//! decode on another then agree bit for bit.

use crate::error::EngineError;
use crate::prng::SplitMix64;
use crate::state_layer::{StateDims, StateWeights};
use crate::tokenizer::VOCAB_SIZE;
use kvconnect_api::{AttentionKind, ModelSpec};
use serde::Deserialize;

/// The reference model's `config.json`, as checked in at
/// `fixtures/models/kvconnect--reference/config.json`.
pub const REFERENCE_CONFIG_JSON: &str =
    include_str!("../../fixtures/models/kvconnect--reference/config.json");

/// The hybrid reference model's `config.json` (sliding-window, state and full-attention
/// layers), as checked in at `fixtures/models/kvconnect--reference-hybrid/config.json`.
pub const REFERENCE_HYBRID_CONFIG_JSON: &str =
    include_str!("../../fixtures/models/kvconnect--reference-hybrid/config.json");

/// The fields of a Hugging Face `config.json` the reference model reads.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ReferenceConfig {
    /// `model_type` (`kvconnect-reference`).
    pub model_type: String,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads (GQA).
    pub num_key_value_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// `full_attention`, `sliding_attention` or `linear_attention` (a state layer, whose
    /// dimensions come from the `linear_*` fields) per layer.
    pub layer_types: Vec<String>,
    /// Window of the sliding layers, in tokens.
    #[serde(default)]
    pub sliding_window: Option<u32>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f64,
    /// Vocabulary (256: the byte tokenizer).
    pub vocab_size: usize,
    /// The model dtype (`bfloat16`, `float32`, `float16`).
    #[serde(default)]
    pub torch_dtype: Option<String>,
    /// The JSON text it was read from (what negotiation parses).
    #[serde(skip)]
    pub raw: String,
}

impl ReferenceConfig {
    /// Parses and checks a `config.json`.
    pub fn from_json(json: &str) -> Result<ReferenceConfig, EngineError> {
        let mut c: ReferenceConfig = serde_json::from_str(json)
            .map_err(|e| EngineError::ModelConfig(format!("not a reference model config: {e}")))?;
        c.raw = json.to_owned();
        c.validate()?;
        c.model_spec()?;
        Ok(c)
    }

    /// The checked-in reference config (`fixtures/models/kvconnect--reference/config.json`).
    pub fn builtin() -> Result<ReferenceConfig, EngineError> {
        ReferenceConfig::from_json(REFERENCE_CONFIG_JSON)
    }

    /// The checked-in hybrid reference config
    /// (`fixtures/models/kvconnect--reference-hybrid/config.json`).
    pub fn builtin_hybrid() -> Result<ReferenceConfig, EngineError> {
        ReferenceConfig::from_json(REFERENCE_HYBRID_CONFIG_JSON)
    }

    fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::ModelConfig(m));
        if self.vocab_size != VOCAB_SIZE as usize {
            return bad(format!("vocab_size is {}; the byte tokenizer needs 256", self.vocab_size));
        }
        if self.hidden_size == 0 || self.intermediate_size == 0 || self.num_hidden_layers == 0 {
            return bad("hidden_size, intermediate_size and num_hidden_layers must be positive".into());
        }
        if self.num_key_value_heads == 0 || !self.num_attention_heads.is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim is {}; RoPE needs a positive even head_dim", self.head_dim));
        }
        if self.layer_types.len() != self.num_hidden_layers {
            return bad(format!(
                "layer_types has {} entries but num_hidden_layers is {}",
                self.layer_types.len(),
                self.num_hidden_layers
            ));
        }
        self.attention_kinds().map(|_| ())
    }

    /// The attention kind of every layer.
    pub fn attention_kinds(&self) -> Result<Vec<AttentionKind>, EngineError> {
        self.layer_types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                "full_attention" => Ok(AttentionKind::Full),
                "linear_attention" => Ok(AttentionKind::Linear),
                "sliding_attention" => match self.sliding_window {
                    Some(w) if w > 0 => Ok(AttentionKind::SlidingWindow { window: w }),
                    _ => Err(EngineError::ModelConfig(format!(
                        "layer {i} is sliding_attention but sliding_window is missing or 0"
                    ))),
                },
                other => Err(EngineError::ModelConfig(format!(
                    "layer_types[{i}] is '{other}'; the reference model knows full_attention, \
                        sliding_attention and linear_attention"
                ))),
            })
            .collect()
    }

    /// The model as negotiation and the KV pool see it: the generic Hugging Face parser's
    /// reading of the same `config.json`, checked against what the engine computes, so a
    /// disagreement is an error here rather than a silent layout mismatch later.
    pub fn model_spec(&self) -> Result<ModelSpec, EngineError> {
        let kinds = self.attention_kinds()?;
        let spec = ModelSpec::from_hf_config_json(&self.raw).map_err(|e| {
            EngineError::ModelConfig(format!("negotiation cannot read this config.json: {e}"))
        })?;
        if spec.layers != kinds
            || spec.num_kv_heads as usize != self.num_key_value_heads
            || spec.head_dim as usize != self.head_dim
        {
            return Err(EngineError::ModelConfig(format!(
                "the Hugging Face config parser reads {} layers {:?} with {} KV heads of dim {}, but the \
                    engine computes {:?} with {} KV heads of dim {}",
                spec.num_layers,
                spec.layers,
                spec.num_kv_heads,
                spec.head_dim,
                kinds,
                self.num_key_value_heads,
                self.head_dim
            )));
        }
        self.state_dims(&spec)?;
        Ok(spec)
    }

    /// The dimensions of the state layers' state, when the model has state layers.
    pub fn state_dims(&self, spec: &ModelSpec) -> Result<Option<StateDims>, EngineError> {
        if !spec.has_state_layers() {
            return Ok(None);
        }
        let st = spec.state.as_ref().ok_or_else(|| {
            EngineError::ModelConfig(
                "the config has linear_attention layers but no state dimensions: give \
                    linear_num_value_heads, linear_num_key_heads, linear_key_head_dim, linear_value_head_dim \
                    and linear_conv_kernel_dim"
                    .into(),
            )
        })?;
        StateDims::of(st).map(Some)
    }
}

/// One layer's weights. Matrices are row-major `[out][in]` so each output is one dot
/// product over a contiguous row.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// Attention kind.
    pub kind: AttentionKind,
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    mlp_norm: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

/// The reference model: config plus seeded weights.
#[derive(Debug, Clone)]
pub struct ReferenceModel {
    /// The config.
    pub cfg: ReferenceConfig,
    embed: Vec<f32>,
    /// Per-layer weights.
    pub layers: Vec<LayerWeights>,
    final_norm: Vec<f32>,
    lm_head: Vec<f32>,
    inv_freq: Vec<f64>,
    /// Per layer: the state layer's weights (None for attention layers).
    state: Vec<Option<StateWeights>>,
}

fn uniform(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.next_signed_unit() * scale).collect()
}

fn norm_weights(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| 1.0 + 0.1 * rng.next_signed_unit()).collect()
}

impl ReferenceModel {
    /// Builds the model with weights drawn from `seed`: the same config and seed give the
    /// same weights in every process.
    pub fn new(cfg: &ReferenceConfig, seed: u64) -> Result<ReferenceModel, EngineError> {
        cfg.validate()?;
        let kinds = cfg.attention_kinds()?;
        let mut rng = SplitMix64::new(seed);
        let (d, ff, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (qd, kvd) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        // Uniform(-a, a) has variance a^2/3: a = sqrt(3/fan_in) keeps activations near unit
        // scale; queries and keys get a larger gain so attention is sharp and the output
        // depends visibly on which past tokens are in the cache.
        let a = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        let embed = uniform(&mut rng, cfg.vocab_size * d, 1.0);
        let layers: Vec<LayerWeights> = kinds
            .into_iter()
            .map(|kind| LayerWeights {
                kind,
                attn_norm: norm_weights(&mut rng, d),
                wq: uniform(&mut rng, qd * d, 2.0 * a(d)),
                wk: uniform(&mut rng, kvd * d, 2.0 * a(d)),
                wv: uniform(&mut rng, kvd * d, a(d)),
                wo: uniform(&mut rng, d * qd, a(qd)),
                mlp_norm: norm_weights(&mut rng, d),
                w_gate: uniform(&mut rng, ff * d, a(d)),
                w_up: uniform(&mut rng, ff * d, a(d)),
                w_down: uniform(&mut rng, d * ff, a(ff)),
            })
            .collect();
        let final_norm = norm_weights(&mut rng, d);
        let lm_head = uniform(&mut rng, cfg.vocab_size * d, 2.0 * a(d));
        let inv_freq = (0..hd / 2).map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64)).collect();
        // State weights come from a generator of their own, so adding state layers leaves
        // every attention-only model's weights as they were.
        let dims = cfg.state_dims(&cfg.model_spec()?)?;
        let mut srng = SplitMix64::new(seed ^ 0x5354_4154_455f_4c59);
        let state = state_weights_for(&layers, dims, d, &mut srng);
        Ok(ReferenceModel { cfg: cfg.clone(), embed, layers, final_norm, lm_head, inv_freq, state })
    }

    /// The weights of state layer `l` (None for an attention layer).
    pub fn state_weights(&self, l: usize) -> Option<&StateWeights> {
        self.state.get(l).and_then(Option::as_ref)
    }

    /// Residual width.
    pub fn hidden(&self) -> usize {
        self.cfg.hidden_size
    }

    /// The embedding of `token` (ids past the vocabulary are refused earlier).
    pub fn embed(&self, token: u32, out: &mut [f32]) {
        let d = self.hidden();
        let t = token as usize % self.cfg.vocab_size;
        out.copy_from_slice(&self.embed[t * d..(t + 1) * d]);
    }

    /// Query, key and value of one token at `pos` for layer `l` (RoPE applied to q and k).
    /// `h` is the residual stream; `q` is `heads*head_dim`, `k`/`v` `kv_heads*head_dim`.
    pub fn qkv(&self, l: usize, h: &[f32], pos: usize, q: &mut [f32], k: &mut [f32], v: &mut [f32]) {
        let w = &self.layers[l];
        let mut x = vec![0.0f32; h.len()];
        rms_norm(h, &w.attn_norm, self.cfg.rms_norm_eps, &mut x);
        matvec(&w.wq, &x, q);
        matvec(&w.wk, &x, k);
        matvec(&w.wv, &x, v);
        self.rope(q, pos);
        self.rope(k, pos);
    }

    fn rope(&self, x: &mut [f32], pos: usize) {
        let hd = self.cfg.head_dim;
        let half = hd / 2;
        for head in x.chunks_exact_mut(hd) {
            for i in 0..half {
                let ang = pos as f64 * self.inv_freq[i];
                let (s, c) = (ang.sin() as f32, ang.cos() as f32);
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c - b * s;
                head[i + half] = b * c + a * s;
            }
        }
    }

    /// Attention of one query over cached keys/values, adding the projected result to `h`.
    /// `keys`/`vals` hold `n` positions of `kv_heads*head_dim` values each, oldest first;
    /// the query attends to all of them.
    pub fn attend_and_mlp(&self, l: usize, q: &[f32], keys: &[f32], vals: &[f32], n: usize, h: &mut [f32]) {
        let c = &self.cfg;
        let hd = c.head_dim;
        let kvd = c.num_key_value_heads * hd;
        let group = c.num_attention_heads / c.num_key_value_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0.0f32; c.num_attention_heads * hd];
        let mut scores = vec![0.0f32; n];
        for qh in 0..c.num_attention_heads {
            let kvh = qh / group;
            let qv = &q[qh * hd..(qh + 1) * hd];
            let mut max = f32::NEG_INFINITY;
            for (s, sc) in scores.iter_mut().enumerate() {
                let kv = &keys[s * kvd + kvh * hd..s * kvd + (kvh + 1) * hd];
                *sc = dot(qv, kv) * scale;
                max = max.max(*sc);
            }
            let mut sum = 0.0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - max).exp();
                sum += *sc;
            }
            let o = &mut out[qh * hd..(qh + 1) * hd];
            for (s, sc) in scores.iter().enumerate() {
                let p = sc / sum;
                let vv = &vals[s * kvd + kvh * hd..s * kvd + (kvh + 1) * hd];
                for (oi, vi) in o.iter_mut().zip(vv) {
                    *oi += p * vi;
                }
            }
        }
        let w = &self.layers[l];
        let mut proj = vec![0.0f32; h.len()];
        matvec(&w.wo, &out, &mut proj);
        for (hi, pi) in h.iter_mut().zip(&proj) {
            *hi += pi;
        }
        self.mlp(l, h);
    }

    /// Layer `l`'s MLP (RMSNorm, SiLU-gated), added to the residual `h`.
    pub fn mlp(&self, l: usize, h: &mut [f32]) {
        let c = &self.cfg;
        let w = &self.layers[l];
        let mut proj = vec![0.0f32; h.len()];
        let mut x = vec![0.0f32; h.len()];
        rms_norm(h, &w.mlp_norm, c.rms_norm_eps, &mut x);
        let mut g = vec![0.0f32; c.intermediate_size];
        let mut u = vec![0.0f32; c.intermediate_size];
        matvec(&w.w_gate, &x, &mut g);
        matvec(&w.w_up, &x, &mut u);
        for (gi, ui) in g.iter_mut().zip(&u) {
            *gi = *gi / (1.0 + (-*gi).exp()) * ui;
        }
        matvec(&w.w_down, &g, &mut proj);
        for (hi, pi) in h.iter_mut().zip(&proj) {
            *hi += pi;
        }
    }

    /// The logits over the vocabulary from the final residual (final RMSNorm, then the LM
    /// head); sampling and log-probabilities start from these.
    pub fn logits(&self, h: &[f32]) -> Vec<f32> {
        let mut x = vec![0.0f32; h.len()];
        rms_norm(h, &self.final_norm, self.cfg.rms_norm_eps, &mut x);
        let mut logits = vec![0.0f32; self.cfg.vocab_size];
        matvec(&self.lm_head, &x, &mut logits);
        logits
    }

    /// Greedy next token from the final residual: argmax of the logits, ties to the lowest id.
    pub fn next_token(&self, h: &[f32]) -> u32 {
        argmax(&self.logits(h))
    }
}

fn state_weights_for(
    layers: &[LayerWeights],
    dims: Option<StateDims>,
    d: usize,
    rng: &mut SplitMix64,
) -> Vec<Option<StateWeights>> {
    layers
        .iter()
        .map(|w| match (w.kind, dims) {
            (AttentionKind::Linear, Some(dims)) => Some(StateWeights::new(dims, d, rng)),
            _ => None,
        })
        .collect()
}

/// Index of the largest value; the lowest index among equals; NaN never wins.
pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, x) in xs.iter().enumerate() {
        if *x > xs[best] || xs[best].is_nan() && !x.is_nan() {
            best = i;
        }
    }
    best as u32
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub(crate) fn matvec(w: &[f32], x: &[f32], out: &mut [f32]) {
    let n = x.len();
    for (o, row) in out.iter_mut().zip(w.chunks_exact(n)) {
        *o = dot(row, x);
    }
}

pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    for ((o, xi), wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * r * wi;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::Dtype;

    #[test]
    fn builtin_config_describes_a_hybrid_model() {
        let c = ReferenceConfig::builtin().unwrap();
        let spec = c.model_spec().unwrap();
        assert!(spec.name.starts_with("kvconnect-reference"), "{}", spec.name);
        assert_eq!(spec.num_layers, 4);
        assert_eq!(spec.num_kv_heads, 2);
        assert_eq!(spec.head_dim, 16);
        assert_eq!(spec.dtype, Some(Dtype::Bf16));
        assert_eq!(spec.layers[0], AttentionKind::SlidingWindow { window: 32 });
        assert_eq!(spec.layers[1], AttentionKind::Full);
    }

    #[test]
    fn bad_configs_say_which_field() {
        let mut v: serde_json::Value = serde_json::from_str(REFERENCE_CONFIG_JSON).unwrap();
        v["layer_types"][2] = "mla".into();
        let e = ReferenceConfig::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("layer_types[2] is 'mla'"), "{e}");
        let mut v: serde_json::Value = serde_json::from_str(REFERENCE_CONFIG_JSON).unwrap();
        v["layer_types"][2] = "linear_attention".into();
        let e = ReferenceConfig::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("linear_attention layers but no state dimensions"), "{e}");
        let mut v: serde_json::Value = serde_json::from_str(REFERENCE_CONFIG_JSON).unwrap();
        v["vocab_size"] = 1000.into();
        let e = ReferenceConfig::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("vocab_size is 1000"), "{e}");
        let e = ReferenceConfig::from_json("{").unwrap_err().to_string();
        assert!(e.contains("not a reference model config"), "{e}");
    }

    #[test]
    fn same_seed_same_weights_other_seed_other_weights() {
        let c = ReferenceConfig::builtin().unwrap();
        let a = ReferenceModel::new(&c, 7).unwrap();
        let b = ReferenceModel::new(&c, 7).unwrap();
        let d = ReferenceModel::new(&c, 8).unwrap();
        assert_eq!(a.embed, b.embed);
        assert_eq!(a.layers[3].w_down, b.layers[3].w_down);
        assert_ne!(a.embed, d.embed);
    }

    #[test]
    fn argmax_ties_go_to_lowest_id() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
    }
}
