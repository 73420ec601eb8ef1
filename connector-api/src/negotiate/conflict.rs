//! Why no effective layout exists, in words that name every child's constraint and a remedy.

use crate::layout::KvLayout;
use serde::{Deserialize, Serialize};

/// One child's constraint on the field a conflict is about, in words.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildConstraint {
    /// The child, as messages name it (`child 'nixl'`, `decode child 'nixl'`).
    pub child: String,
    /// Its constraint (`requires HND (LBHNC), prefers HND (LBHNC); cannot adapt`).
    pub constraint: String,
}

/// Why no effective layout exists. Each message names every child's constraint on the
/// field and says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum Conflict {
    /// A child declared capabilities that contradict themselves.
    #[error(
        "{child} declares invalid capabilities: {error}; fix the connector's capability declaration (or \
        remove the child)"
    )]
    InvalidCaps {
        /// The child.
        child: String,
        /// What is wrong.
        error: String,
    },
    /// An engine option has a value no negotiation can use.
    #[error("engine option {option}={value} is invalid: {reason}")]
    InvalidOption {
        /// The option.
        option: String,
        /// Its value.
        value: String,
        /// Why, and what to set instead.
        reason: String,
    },
    /// The user asked for HMA and some children do not support it.
    #[error("hybrid_kv_cache_manager=on was set, but {} not support the hybrid KV cache manager{}; set \
        hybrid_kv_cache_manager=auto or off, or remove {}",
        list_does(.unsupported), supporters(.supported), them(.unsupported))]
    HmaUnsupported {
        /// Children without HMA.
        unsupported: Vec<String>,
        /// Children with it.
        supported: Vec<String>,
    },
    /// The model needs HMA (state-space or linear-attention layers) and it cannot be on.
    #[error("model '{model}' has {linear_layers} state-space/linear-attention layer(s), which need the \
        hybrid KV cache manager; {}", hma_required_tail(.user_off, .unsupported))]
    HmaRequired {
        /// The model's name.
        model: String,
        /// How many layers without KV blocks it has.
        linear_layers: u32,
        /// The user set HMA off.
        user_off: bool,
        /// Children without HMA.
        unsupported: Vec<String>,
    },
    /// A model with state-space or linear-attention layers and children that do not carry
    /// their per-request state: decode would get the KV of the attention layers and not the
    /// recurrent state.
    #[error("model '{model}' keeps per-request state in {state_layers} state-space/linear-attention layer(s) \
        ({groups}), which decode needs besides the KV blocks, but {} not carry per-request state \
        (carries_state); nothing would give decode that state. Remedy: {remedy}", list_does(.unsupported))]
    StateUnsupported {
        /// The model's name.
        model: String,
        /// How many layers keep state.
        state_layers: u32,
        /// The state groups, described (`1 group: mamba2 x23 (conv 3x6144 bf16, ...)`).
        groups: String,
        /// Children that do not carry state.
        unsupported: Vec<String>,
        /// What to change.
        remedy: String,
    },
    /// A model with state layers whose KV heads are split over several tensor-parallel ranks,
    /// and children that carry its per-request state only at `tp_size` 1.
    #[error("model '{model}' keeps per-request state in {state_layers} state-space/linear-attention \
        layer(s), and tp_size={tp_size} splits its KV heads over {tp_size} tensor-parallel ranks, but {} \
        that state only at tp_size 1 (no state_with_tp). Remedy: {remedy}",
        verb(.children, "carries", "carry"))]
    StateWithTp {
        /// The model's name.
        model: String,
        /// How many layers keep state.
        state_layers: u32,
        /// The tensor-parallel size asked for.
        tp_size: u32,
        /// Children that carry state only at TP 1.
        children: Vec<String>,
        /// What to change.
        remedy: String,
    },
    /// An engine whose tensor-parallel ranks share one connector, with children that serve
    /// one rank's regions per worker.
    #[error("this engine serves its {ranks} tensor-parallel ranks through one connector (kvconnect's \
        reference engine runs them as threads of one process), but {} one rank's KV regions per worker (no \
        ranks_in_one_worker). Remedy: run tp_size=1, or use connectors that declare ranks_in_one_worker (the \
        nixl connector does with backend shm or tcp) instead of {}; vLLM gives each rank its own connector \
        (engine = \"vllm\" in a deployment file)", verb(.children, "serves", "serve"), them(.children))]
    RanksInOneWorker {
        /// The ranks one connector serves.
        ranks: u32,
        /// Children that serve one rank per worker.
        children: Vec<String>,
    },
    /// An MLA model with children that do not handle latent KV caches.
    #[error("model '{model}' uses MLA (latent KV), but {} not declare MLA support; remove {} or use a \
        connector version that supports MLA", list_does(.unsupported), them(.unsupported))]
    MlaUnsupported {
        /// The model's name.
        model: String,
        /// Children without MLA support.
        unsupported: Vec<String>,
    },
    /// No layout satisfies every child, or the user's layout does not.
    #[error("{}: {}. Remedy: {remedy}", layout_head(.requested, .violators), constraint_list(.constraints))]
    Layout {
        /// The user's `kv_cache_layout`, when set.
        requested: Option<KvLayout>,
        /// Children the requested layout fails (empty when nothing was requested).
        violators: Vec<String>,
        /// Every child's layout constraint.
        constraints: Vec<ChildConstraint>,
        /// What to change.
        remedy: String,
    },
    /// The engine's blocks are opaque and a child would need a layout adapter, which looks
    /// inside blocks.
    #[error("the engine's KV blocks are opaque ({why}), but {} would need a layout adapter ({}), which \
        re-lays-out block contents; blocks can only move whole. Remedy: use connectors that accept the \
        engine's layout {layout} as it is (nixl, lmcache, pd over them), or run an engine backend whose \
        in-block layout is NHD or HND", them(.children), .adapters.join("; "))]
    OpaqueBlocks {
        /// Why the engine's blocks are opaque.
        why: String,
        /// The layout the engine's blocks are addressed in.
        layout: KvLayout,
        /// The children that would adapt.
        children: Vec<String>,
        /// Each adapter, in words (`child 'flexkv': LBNHC -> BLHNC`).
        adapters: Vec<String>,
    },
    /// No block size satisfies every child, or the user's does not.
    #[error("{}: {}. Children's block-size constraints: {}. Remedy: {remedy}",
        block_head(.block_size, .by_user), .violations.join("; "), constraint_list(.constraints))]
    BlockSize {
        /// The block size that failed (the user's, or the default).
        block_size: u32,
        /// The user set it.
        by_user: bool,
        /// What fails, one entry per child, naming the child and both numbers.
        violations: Vec<String>,
        /// Every child's block-size constraint.
        constraints: Vec<ChildConstraint>,
        /// What to change.
        remedy: String,
    },
    /// A child cannot store the cache dtype.
    #[error("cache dtype {dtype} ({source_of}) is not supported by {}. Children's dtypes: {}. Remedy: \
        {remedy}", .violators.join(", "), constraint_list(.constraints))]
    CacheDtype {
        /// The dtype.
        dtype: String,
        /// Where it came from (`set by user`, `model torch_dtype`, ...).
        source_of: String,
        /// Children that cannot store it.
        violators: Vec<String>,
        /// Every child's dtype constraint.
        constraints: Vec<ChildConstraint>,
        /// What to change.
        remedy: String,
    },
    /// A child cannot read or write KV in the memory kind.
    #[error("KV memory {memory} ({source_of}) is not usable by {}. Children's memory kinds: {}. Remedy: \
        {remedy}", .violators.join(", "), constraint_list(.constraints))]
    Memory {
        /// The memory kind.
        memory: String,
        /// Where it came from.
        source_of: String,
        /// Children that cannot use it.
        violators: Vec<String>,
        /// Every child's memory kinds.
        constraints: Vec<ChildConstraint>,
        /// What to change.
        remedy: String,
    },
    /// Some children pull and others push.
    #[error("children disagree on the transfer direction: {} pull (the consumer reads), {} push (the \
        producer writes); keep transport children of one mode only (remove {} or {})",
        .pull.join(", "), .push.join(", "), them(.pull), them(.push))]
    TransferMode {
        /// Children that pull.
        pull: Vec<String>,
        /// Children that push.
        push: Vec<String>,
    },
    /// Prefill and decode set an option that must be equal to different values.
    #[error(
        "option {option} differs between the roles: prefill={prefill}, decode={decode}; both workers \
        must use the same {option}: set it to the same value on both, or leave it unset on one side"
    )]
    OptionMismatch {
        /// The option.
        option: String,
        /// Prefill's value.
        prefill: String,
        /// Decode's value.
        decode: String,
    },
    /// Prefill and decode use different tensor-parallel sizes, and the KV cannot be moved
    /// between them.
    #[error(
        "prefill has tp_size={prefill} and decode tp_size={decode}, but {reason}; no KV would be moved \
        between them. Remedy: {remedy}"
    )]
    TpSize {
        /// Prefill's TP size.
        prefill: u32,
        /// Decode's TP size.
        decode: u32,
        /// Children that move KV only between equal TP sizes.
        children: Vec<String>,
        /// Why the sizes cannot differ, naming those children.
        reason: String,
        /// What to change.
        remedy: String,
    },
}

pub(super) fn list_does(v: &[String]) -> String {
    match v.len() {
        1 => format!("{} does", v[0]),
        _ => format!("{} do", v.join(", ")),
    }
}

/// `a carries` or `a, b carry`.
pub(super) fn verb(names: &[String], one: &str, many: &str) -> String {
    format!("{} {}", names.join(", "), if names.len() == 1 { one } else { many })
}

pub(super) fn them(v: &[String]) -> String {
    match v.len() {
        0 => "nothing".to_owned(),
        1 => v[0].clone(),
        _ => format!("one of {}", v.join(", ")),
    }
}

fn supporters(v: &[String]) -> String {
    if v.is_empty() {
        String::new()
    } else {
        format!(" ({} {} it)", v.join(", "), if v.len() == 1 { "supports" } else { "support" })
    }
}

fn hma_required_tail(user_off: &bool, unsupported: &[String]) -> String {
    let mut parts = Vec::new();
    if *user_off {
        parts.push("hybrid_kv_cache_manager=off was set: set it to auto or on".to_owned());
    }
    if !unsupported.is_empty() {
        parts.push(format!(
            "{} not support the hybrid KV cache manager: remove {} (a child without HMA cannot serve this \
                model)",
            list_does(unsupported),
            them(unsupported)
        ));
    }
    parts.join("; ")
}

fn layout_head(requested: &Option<KvLayout>, violators: &[String]) -> String {
    match requested {
        Some(l) => format!(
            "kv_cache_layout={} was set, but {} not accept it and cannot adapt to it",
            l.display_name(),
            list_does(violators)
        ),
        None => "no KV layout satisfies every child, even with adapters".to_owned(),
    }
}

fn block_head(block_size: &u32, by_user: &bool) -> String {
    if *by_user {
        format!("block_size={block_size} was set, but it does not fit every child")
    } else {
        format!(
            "no block size fits every child (tried the default {block_size} and 32, 64, 128, 8, 256, ...)"
        )
    }
}

fn constraint_list(c: &[ChildConstraint]) -> String {
    if c.is_empty() {
        return "no children".to_owned();
    }
    c.iter().map(|c| format!("{} {}", c.child, c.constraint)).collect::<Vec<_>>().join("; ")
}
