//! The model geometry a KV cache depends on, read from a Hugging Face `config.json`.
//!
//! Only what shapes the KV cache is kept: layer count, KV heads, head dim, dtype and the
//! attention kind of every layer.

use serde::{Deserialize, Serialize};

/// Element type of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float, e4m3.
    Fp8E4m3,
    /// 8-bit float, e5m2.
    Fp8E5m2,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 => 1,
        }
    }
}

/// How one layer attends, which decides what (if anything) it keeps in KV blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AttentionKind {
    /// Full attention: every past token's K and V.
    Full,
    /// Sliding-window attention: only the last `window` tokens matter.
    SlidingWindow {
        /// Window length in tokens.
        window: u32,
    },
    /// Multi-head latent attention: one latent vector per token (no separate K and V).
    Mla {
        /// Latent rank.
        kv_lora_rank: u32,
        /// Decoupled RoPE key dim stored beside the latent.
        qk_rope_head_dim: u32,
    },
    /// A state-space or linear-attention layer: a fixed per-sequence state, no KV blocks.
    Linear,
}

impl AttentionKind {
    /// True when the layer stores per-token KV in blocks.
    pub fn has_kv_blocks(&self) -> bool {
        !matches!(self, AttentionKind::Linear)
    }
}

/// The KV geometry of a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// A short name: `model_type` and/or the first architecture, for messages.
    pub name: String,
    /// Number of layers (all kinds).
    pub num_layers: u32,
    /// KV heads per attention layer (1 for MLA: one latent).
    pub num_kv_heads: u32,
    /// Channels per KV head (for MLA: kv_lora_rank + qk_rope_head_dim).
    pub head_dim: u32,
    /// The model's dtype (`torch_dtype`), when the config says.
    pub dtype: Option<Dtype>,
    /// The attention kind of every layer, `num_layers` entries.
    pub layers: Vec<AttentionKind>,
}

/// A `config.json` that cannot be read as a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// Not JSON, or not an object.
    #[error("model config is not valid JSON: {0}")]
    Json(String),
    /// A field that must be there is missing.
    #[error("model config has no '{field}': {hint}")]
    Missing {
        /// The field.
        field: String,
        /// What to do.
        hint: String,
    },
    /// A field has a value that cannot be used.
    #[error("model config field '{field}' is invalid: {reason}")]
    Invalid {
        /// The field.
        field: String,
        /// Why.
        reason: String,
    },
    /// Two fields disagree.
    #[error("model config fields '{a}' and '{b}' contradict each other: {reason}")]
    Contradiction {
        /// One field.
        a: String,
        /// The other.
        b: String,
        /// How.
        reason: String,
    },
}
