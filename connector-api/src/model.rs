//! The model geometry a KV cache depends on, read from a Hugging Face `config.json`.
//!
//! Only what shapes the KV cache is kept: layer count, KV heads, head dim, dtype and the
//! attention kind of every layer. The reader (`ModelSpec::from_hf_config_json`, in
//! `model/hf_config.rs`) follows the rules `transformers` and vLLM use to turn a config into
//! a per-layer schedule, and refuses a config whose fields disagree rather than guessing
//! which one is meant.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::ids::LayerId;
use std::fmt;

mod hf_config;

/// Element type of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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

    /// The dtype a Hugging Face / PyTorch / vLLM name stands for (`"bfloat16"`, `"torch.float16"`,
    /// `"fp8"`, `"float8_e5m2"`, ...), case-insensitive; `None` for anything else.
    ///
    /// Bare `"fp8"` is e4m3, as in vLLM's `kv_cache_dtype`. AMD's `*fnuz` encodings are not
    /// accepted: their bytes differ from the OCP e4m3/e5m2 ones, so treating them as equal
    /// would let two incompatible caches pass as one.
    pub fn from_hf_name(name: &str) -> Option<Dtype> {
        let lower = name.trim().to_ascii_lowercase();
        let bare = lower.strip_prefix("torch.").unwrap_or(&lower);
        match bare {
            "float32" | "fp32" | "float" => Some(Dtype::F32),
            "float16" | "fp16" | "half" => Some(Dtype::F16),
            "bfloat16" | "bf16" => Some(Dtype::Bf16),
            "fp8" | "fp8_e4m3" | "float8_e4m3fn" | "float8_e4m3" | "e4m3" => Some(Dtype::Fp8E4m3),
            "fp8_e5m2" | "float8_e5m2" | "e5m2" => Some(Dtype::Fp8E5m2),
            _ => None,
        }
    }
}

impl fmt::Display for Dtype {
    /// The name messages and provenance print (`bf16`, `fp8_e4m3`, ...).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
        })
    }
}

/// How one layer attends, which decides what (if anything) it keeps in KV blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
    /// A state-space or linear-attention layer (Mamba, Gated DeltaNet): a fixed
    /// per-sequence state, no KV blocks.
    Linear,
    /// A block with no token mixer at all: Nemotron-H's MLP (`-`) and MoE (`E`) blocks,
    /// which hybrid models count as layers of their own. It holds neither KV blocks nor
    /// per-sequence state, but it keeps its index so that layer numbers match the model's.
    FeedForward,
}

impl AttentionKind {
    /// True when the layer stores per-token KV in blocks.
    pub fn has_kv_blocks(&self) -> bool {
        !matches!(self, AttentionKind::Linear | AttentionKind::FeedForward)
    }

    /// KV vectors stored per token and head: 2 (K and V), 1 for MLA's single latent, 0 for
    /// layers without KV blocks.
    pub fn kv_parts(&self) -> u64 {
        match self {
            AttentionKind::Full | AttentionKind::SlidingWindow { .. } => 2,
            AttentionKind::Mla { .. } => 1,
            AttentionKind::Linear | AttentionKind::FeedForward => 0,
        }
    }
}

impl fmt::Display for AttentionKind {
    /// The name messages print (`full`, `sliding_window(128)`, `mla`, ...).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttentionKind::Full => f.write_str("full"),
            AttentionKind::SlidingWindow { window } => write!(f, "sliding_window({window})"),
            AttentionKind::Mla { .. } => f.write_str("mla"),
            AttentionKind::Linear => f.write_str("linear"),
            AttentionKind::FeedForward => f.write_str("feed_forward"),
        }
    }
}

/// Which mixer keeps a state-space or linear-attention layer's per-request state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum StateKind {
    /// Mamba2 (Nemotron-H's `M` layers): a causal-conv window and the SSM state.
    Mamba2,
    /// Gated DeltaNet (Qwen3-Next's linear attention): a causal-conv window and the
    /// delta-rule recurrent state.
    GatedDeltaNet,
}

impl fmt::Display for StateKind {
    /// The name messages print (`mamba2`, `gated_delta_net`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StateKind::Mamba2 => "mamba2",
            StateKind::GatedDeltaNet => "gated_delta_net",
        })
    }
}

/// The state one state-space or linear-attention layer keeps per request instead of KV
/// blocks (vLLM's Mamba-style cache), for the whole layer before any tensor-parallel split:
/// the shapes of its two tensors and their dtypes, from the config.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct LayerState {
    /// The mixer.
    pub kind: StateKind,
    /// The conv state: `[conv_kernel - 1, conv_dim]`.
    pub conv_shape: Vec<u32>,
    /// Element type of the conv state (the model's dtype).
    pub conv_dtype: Dtype,
    /// The recurrent state: Mamba2 `[num_heads, head_dim, ssm_state_size]`, Gated DeltaNet
    /// `[num_value_heads, key_head_dim, value_head_dim]`.
    pub ssm_shape: Vec<u32>,
    /// Element type of the recurrent state (Mamba2's `mamba_ssm_cache_dtype`, else the
    /// model's dtype).
    pub ssm_dtype: Dtype,
}

impl LayerState {
    /// Bytes of one request's state in one layer.
    pub fn bytes(&self) -> u64 {
        let elems = |shape: &[u32]| shape.iter().map(|d| u64::from(*d)).fold(1u64, u64::saturating_mul);
        elems(&self.conv_shape)
            .saturating_mul(self.conv_dtype.size() as u64)
            .saturating_add(elems(&self.ssm_shape).saturating_mul(self.ssm_dtype.size() as u64))
    }
}

/// The most layers a model config may declare. The deepest released models have a few
/// hundred; a larger count is a typo, and honouring it would build a per-layer schedule of
/// that many entries.
pub const MAX_LAYERS: u32 = 4096;

/// The KV geometry of a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
    /// The per-request state of its state-space / linear-attention layers, when it has any
    /// and the config gives their dimensions. Left out of the canonical JSON (and so of the
    /// fingerprint) when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<LayerState>,
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

impl ModelSpec {
    /// What one of `tp_size` tensor-parallel ranks holds when every rank keeps its own KV
    /// (vLLM's workers): `num_kv_heads / tp_size` heads per layer, or one replicated head
    /// when the model has fewer KV heads than ranks; an MLA latent is never split. Refused
    /// when the heads do not divide among the ranks (vLLM refuses such a model too).
    pub fn tp_shard(&self, tp_size: u32) -> Result<ModelSpec, ModelError> {
        let mla = self.layers.iter().any(|k| matches!(k, AttentionKind::Mla { .. }));
        if tp_size <= 1 || mla {
            return Ok(self.clone());
        }
        let heads = self.num_kv_heads;
        let per_rank = if heads < tp_size {
            if !tp_size.is_multiple_of(heads.max(1)) {
                return Err(ModelError::Invalid {
                    field: "num_key_value_heads".into(),
                    reason: format!(
                        "{heads} KV heads cannot be replicated evenly over {tp_size} tensor-parallel ranks; \
                            use a TP size that is a multiple of {heads}"
                    ),
                });
            }
            1
        } else {
            if !heads.is_multiple_of(tp_size) {
                return Err(ModelError::Invalid {
                    field: "num_key_value_heads".into(),
                    reason: format!(
                        "{heads} KV heads do not divide among {tp_size} tensor-parallel ranks; use a TP size \
                            that divides {heads}"
                    ),
                });
            }
            heads / tp_size
        };
        Ok(ModelSpec { num_kv_heads: per_rank, ..self.clone() })
    }

    /// Hex SHA-256 of the spec's canonical JSON (fields in declaration order, no maps), so
    /// two processes that read the same model get the same string.
    pub fn fingerprint(&self) -> String {
        let mut hasher = HashWriter(Sha256::new());
        // Plain structs, enums, strings and integers only: serialising cannot fail.
        serde_json::to_writer(&mut hasher, self).expect("ModelSpec serialises to JSON: it holds no maps");
        hasher.0.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The layers that store KV in blocks, ascending.
    pub fn kv_layers(&self) -> Vec<LayerId> {
        (0u32..).zip(&self.layers).filter(|(_, kind)| kind.has_kv_blocks()).map(|(i, _)| LayerId(i)).collect()
    }

    /// The distinct attention kinds of the KV-holding layers, in order of first appearance.
    pub fn attention_kinds(&self) -> Vec<AttentionKind> {
        let mut kinds = Vec::new();
        for kind in self.layers.iter().filter(|k| k.has_kv_blocks()) {
            if !kinds.contains(kind) {
                kinds.push(*kind);
            }
        }
        kinds
    }

    /// True when the KV-holding layers have more than one attention kind (what the hybrid
    /// KV cache manager splits into groups).
    pub fn is_hybrid(&self) -> bool {
        self.attention_kinds().len() > 1
    }

    /// True when some layers keep a per-sequence state (Mamba, linear attention) instead of
    /// KV blocks.
    pub fn has_state_layers(&self) -> bool {
        self.layers.iter().any(|k| matches!(k, AttentionKind::Linear))
    }

    /// Bytes one token adds to the KV cache at `dtype`, summed over the KV layers: K and V
    /// per head, or the one latent per token for MLA. Sliding layers count in full here;
    /// their window caps how many tokens they keep, not what one token costs.
    pub fn kv_bytes_per_token(&self, dtype: Dtype) -> u64 {
        let per_part = u64::from(self.num_kv_heads)
            .saturating_mul(u64::from(self.head_dim))
            .saturating_mul(dtype.size() as u64);
        self.layers.iter().map(|k| k.kv_parts().saturating_mul(per_part)).fold(0u64, u64::saturating_add)
    }
}

/// Feeds serde_json's output straight into the hash.
struct HashWriter(Sha256);

impl std::io::Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tp_shard_tests {
    use super::*;

    fn model(heads: u32, kind: AttentionKind) -> ModelSpec {
        ModelSpec {
            name: "m".into(),
            num_layers: 2,
            num_kv_heads: heads,
            head_dim: 64,
            dtype: None,
            layers: vec![kind; 2],
            state: None,
        }
    }

    #[test]
    fn a_rank_holds_its_share_of_the_kv_heads() {
        assert_eq!(model(8, AttentionKind::Full).tp_shard(2).unwrap().num_kv_heads, 4);
        assert_eq!(model(8, AttentionKind::Full).tp_shard(1).unwrap(), model(8, AttentionKind::Full));
        // Fewer heads than ranks: each rank keeps one, replicated (as vLLM does).
        assert_eq!(model(2, AttentionKind::Full).tp_shard(8).unwrap().num_kv_heads, 1);
        let mla = model(1, AttentionKind::Mla { kv_lora_rank: 512, qk_rope_head_dim: 64 });
        assert_eq!(mla.tp_shard(4).unwrap(), mla);
    }

    #[test]
    fn heads_that_do_not_divide_are_refused_with_the_remedy() {
        let e = model(6, AttentionKind::Full).tp_shard(4).unwrap_err().to_string();
        assert!(e.contains("6 KV heads do not divide among 4") && e.contains("num_key_value_heads"), "{e}");
        let e = model(3, AttentionKind::Full).tp_shard(4).unwrap_err().to_string();
        assert!(e.contains("cannot be replicated evenly"), "{e}");
    }
}
