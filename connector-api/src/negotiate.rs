//! Negotiation: the children's declared capabilities, the model and the engine options give
//! one effective KV layout, every field with its provenance, or a [`Conflict`] that names
//! every child's constraint and a remedy.
//!
//! [`negotiate`] is pure and deterministic, so a prefill worker and a decode worker that run
//! it over the same inputs agree by construction. [`negotiate_deployment`] runs it for both
//! roles of a deployment over the union of their children, which is what keeps a composite
//! on prefill and a plain transport on decode from disagreeing about HMA (Dynamo DYN-3545).

use crate::caps::{AdaptCost, Capabilities, MemoryKind, TransferMode};
use crate::ids::LayerId;
use crate::layout::{EffectiveLayout, KvGroup, KvLayout, StateGroup};
use crate::model::{AttentionKind, Dtype, ModelSpec, StateKind};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

/// The hybrid KV cache manager setting (vLLM's `--disable-hybrid-kv-cache-manager`, as a
/// tri-state so "let negotiation decide" is the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum HmaOption {
    /// On iff every child supports it and it changes the KV cache groups.
    #[default]
    Auto,
    /// On; a child that does not support it is a conflict.
    On,
    /// Off; a model with state-space or linear-attention layers then cannot run.
    Off,
}

/// An engine option string that names no valid value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{option}: '{input}' is not a valid value; expected {expected}")]
pub struct OptionParseError {
    /// The option.
    pub option: String,
    /// What was given.
    pub input: String,
    /// The valid values.
    pub expected: String,
}

impl FromStr for HmaOption {
    type Err = OptionParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(HmaOption::Auto),
            "on" | "true" => Ok(HmaOption::On),
            "off" | "false" => Ok(HmaOption::Off),
            _ => Err(OptionParseError {
                option: "hybrid_kv_cache_manager".to_owned(),
                input: s.to_owned(),
                expected: "auto, on or off (or true/false)".to_owned(),
            }),
        }
    }
}

impl fmt::Display for HmaOption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HmaOption::Auto => "auto",
            HmaOption::On => "on",
            HmaOption::Off => "off",
        })
    }
}

/// The engine options negotiation reads. `None` means "not set by the user".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineOptions {
    /// Hybrid KV cache manager; default `Auto`.
    pub hybrid_kv_cache_manager: HmaOption,
    /// User override of the KV layout.
    pub kv_cache_layout: Option<KvLayout>,
    /// User override of the block size; 16 when unset (vLLM's default).
    pub block_size: Option<u32>,
    /// `None` = "auto": the model's dtype, else bf16.
    pub cache_dtype: Option<Dtype>,
    /// Where the KV cache lives (from `kv_buffer_device`); host when unset.
    pub memory: Option<MemoryKind>,
    /// Tensor-parallel size; default 1.
    pub tp_size: u32,
    /// This worker's tensor-parallel rank; default 0.
    pub tp_rank: u32,
    /// Whether a child may adapt its own data path to a layout it does not accept.
    pub allow_adapters: bool,
    /// The engine's in-block order is its own (`Some(why)`), e.g. vLLM's CPU attention backend,
    /// which stores K transposed inside a block. `kv_cache_layout` then only says where whole
    /// blocks are; blocks move whole and are never adapted, so a layout adapter is a conflict.
    pub opaque_blocks: Option<String>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            hybrid_kv_cache_manager: HmaOption::Auto,
            kv_cache_layout: None,
            block_size: None,
            cache_dtype: None,
            memory: None,
            tp_size: 1,
            tp_rank: 0,
            allow_adapters: true,
            opaque_blocks: None,
        }
    }
}

impl EngineOptions {
    /// Maps vLLM's `kv_buffer_device` (`cpu`, `cuda`, ...) to a memory kind.
    pub fn memory_from_kv_buffer_device(s: &str) -> Result<MemoryKind, OptionParseError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" | "host" => Ok(MemoryKind::Host),
            "cuda" | "gpu" | "device" | "xpu" => Ok(MemoryKind::Device),
            "disk" => Ok(MemoryKind::Disk),
            _ => Err(OptionParseError {
                option: "kv_buffer_device".to_owned(),
                input: s.to_owned(),
                expected: "cpu or cuda".to_owned(),
            }),
        }
    }
}

/// One child connector as negotiation sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildCaps {
    /// The child's name (`nixl`, `lmcache`, ...), used in every message.
    pub name: String,
    /// The child's version, for descriptors and messages.
    pub version: String,
    /// What it declared.
    pub caps: Capabilities,
}

/// Who decided a field's value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "by", content = "name", rename_all = "snake_case")]
pub enum DecidedBy {
    /// An engine option the user set.
    User,
    /// A default, because nothing constrained the field.
    Default,
    /// The model (its config.json).
    Model,
    /// A child of this worker, by name.
    Child(String),
    /// A child of the peer worker in a deployment, by name.
    Peer(String),
}

impl fmt::Display for DecidedBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecidedBy::User => f.write_str("user"),
            DecidedBy::Default => f.write_str("default"),
            DecidedBy::Model => f.write_str("model"),
            DecidedBy::Child(n) => write!(f, "child {n}"),
            DecidedBy::Peer(n) => write!(f, "peer {n}"),
        }
    }
}

/// A field of the negotiated result, its value, who decided it and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldProvenance {
    /// `layout`, `hma`, `block_size`, `cache_dtype`, `memory`, `transfer_mode`, `kv_groups`
    /// or `tp_size`.
    pub field: String,
    /// The value, in words (`HND (LBHNC)`, `on`, `16`, ...).
    pub value: String,
    /// Who decided it.
    pub decided_by: DecidedBy,
    /// Why, in words.
    pub reason: String,
}

impl FieldProvenance {
    /// The reason as a diff shows it: defaults are marked as such
    /// (`default: every child supports HMA ...`), other reasons already name their source.
    pub fn why(&self) -> String {
        match self.decided_by {
            DecidedBy::Default => format!("default: {}", self.reason),
            _ => self.reason.clone(),
        }
    }
}

/// A child that adapts its own data path to the effective layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutAdapter {
    /// The child.
    pub child: String,
    /// The layout it works in natively.
    pub native: KvLayout,
    /// The effective layout it adapts to.
    pub effective: KvLayout,
    /// What the adaptation costs.
    pub cost: AdaptCost,
}

/// The outcome of negotiation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Negotiated {
    /// The effective layout as plain values.
    pub effective: EffectiveLayout,
    /// One entry per field: layout, hma, block_size, cache_dtype, memory, transfer_mode,
    /// kv_groups, tp_size.
    pub provenance: Vec<FieldProvenance>,
    /// This worker's children that adapt to the effective layout.
    pub adapters: Vec<LayoutAdapter>,
    /// This worker's children, in order.
    pub children: Vec<ChildCaps>,
}

impl Negotiated {
    /// The provenance of one field, by name.
    pub fn provenance_of(&self, field: &str) -> Option<&FieldProvenance> {
        self.provenance.iter().find(|p| p.field == field)
    }

    /// One aligned line per field: `layout        = HND (LBHNC)  [child nixl]  child 'nixl' requires ...`.
    pub fn explain(&self) -> String {
        let by: Vec<String> = self.provenance.iter().map(|p| format!("[{}]", p.decided_by)).collect();
        let fw = self.provenance.iter().map(|p| p.field.len()).max().unwrap_or(0);
        let vw = self.provenance.iter().map(|p| p.value.chars().count()).max().unwrap_or(0);
        let bw = by.iter().map(|b| b.chars().count()).max().unwrap_or(0);
        let mut out = String::new();
        for (p, b) in self.provenance.iter().zip(&by) {
            let line = format!("{:<fw$} = {:<vw$}  {:<bw$}  {}", p.field, p.value, b, p.reason);
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

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
    #[error("{child} declares invalid capabilities: {error}; fix the connector's capability declaration (or remove the child)")]
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
    #[error("hybrid_kv_cache_manager=on was set, but {} not support the hybrid KV cache manager{}; set hybrid_kv_cache_manager=auto or off, or remove {}", list_does(.unsupported), supporters(.supported), them(.unsupported))]
    HmaUnsupported {
        /// Children without HMA.
        unsupported: Vec<String>,
        /// Children with it.
        supported: Vec<String>,
    },
    /// The model needs HMA (state-space or linear-attention layers) and it cannot be on.
    #[error("model '{model}' has {linear_layers} state-space/linear-attention layer(s), which need the hybrid KV cache manager; {}", hma_required_tail(.user_off, .unsupported))]
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
    #[error("model '{model}' keeps per-request state in {state_layers} state-space/linear-attention layer(s) ({groups}), which decode needs besides the KV blocks, but {} not carry per-request state (carries_state); nothing would give decode that state. Remedy: {remedy}", list_does(.unsupported))]
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
    /// An MLA model with children that do not handle latent KV caches.
    #[error("model '{model}' uses MLA (latent KV), but {} not declare MLA support; remove {} or use a connector version that supports MLA", list_does(.unsupported), them(.unsupported))]
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
    #[error("the engine's KV blocks are opaque ({why}), but {} would need a layout adapter ({}), which re-lays-out block contents; blocks can only move whole. Remedy: use connectors that accept the engine's layout {layout} as it is (nixl, lmcache, pd over them), or run an engine backend whose in-block layout is NHD or HND", them(.children), .adapters.join("; "))]
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
    #[error("{}: {}. Children's block-size constraints: {}. Remedy: {remedy}", block_head(.block_size, .by_user), .violations.join("; "), constraint_list(.constraints))]
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
    #[error("cache dtype {dtype} ({source_of}) is not supported by {}. Children's dtypes: {}. Remedy: {remedy}", .violators.join(", "), constraint_list(.constraints))]
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
    #[error("KV memory {memory} ({source_of}) is not usable by {}. Children's memory kinds: {}. Remedy: {remedy}", .violators.join(", "), constraint_list(.constraints))]
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
    #[error("children disagree on the transfer direction: {} pull (the consumer reads), {} push (the producer writes); keep transport children of one mode only (remove {} or {})", .pull.join(", "), .push.join(", "), them(.pull), them(.push))]
    TransferMode {
        /// Children that pull.
        pull: Vec<String>,
        /// Children that push.
        push: Vec<String>,
    },
    /// Prefill and decode set an option that must be equal to different values.
    #[error("option {option} differs between the roles: prefill={prefill}, decode={decode}; both workers must use the same {option}: set it to the same value on both, or leave it unset on one side")]
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
    #[error("prefill has tp_size={prefill} and decode tp_size={decode}, but {reason}; no KV would be moved between them. Remedy: {remedy}")]
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

fn list_does(v: &[String]) -> String {
    match v.len() {
        1 => format!("{} does", v[0]),
        _ => format!("{} do", v.join(", ")),
    }
}

fn them(v: &[String]) -> String {
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
            "{} not support the hybrid KV cache manager: remove {} (a child without HMA cannot serve this model)",
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

// ---------------------------------------------------------------------------------------
// Names of values, as messages and provenance print them.

pub(crate) fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "f32",
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
        Dtype::Fp8E4m3 => "fp8_e4m3",
        Dtype::Fp8E5m2 => "fp8_e5m2",
    }
}

pub(crate) fn memory_name(m: MemoryKind) -> &'static str {
    match m {
        MemoryKind::Host => "host",
        MemoryKind::Device => "device",
        MemoryKind::Disk => "disk",
    }
}

pub(crate) fn mode_name(m: TransferMode) -> &'static str {
    match m {
        TransferMode::None => "none",
        TransferMode::Pull => "pull",
        TransferMode::Push => "push",
    }
}

fn cost_name(c: AdaptCost) -> &'static str {
    match c {
        AdaptCost::Low => "low",
        AdaptCost::Medium => "medium",
        AdaptCost::High => "high",
    }
}

fn cost_weight(c: AdaptCost) -> u32 {
    match c {
        AdaptCost::Low => 1,
        AdaptCost::Medium => 2,
        AdaptCost::High => 3,
    }
}

pub(crate) fn kind_name(k: &AttentionKind) -> String {
    match k {
        AttentionKind::Full => "full".to_owned(),
        AttentionKind::SlidingWindow { window } => format!("sliding_window({window})"),
        AttentionKind::Mla { .. } => "mla".to_owned(),
        AttentionKind::Linear => "linear".to_owned(),
        AttentionKind::FeedForward => "feed_forward".to_owned(),
    }
}

/// The KV cache groups as one short string: `2 groups: sliding_window(128) x12, full x12`,
/// or with HMA off `1 group: all 24 KV layers` (the group's `kind` is
/// then only its first layer's, so it is not printed).
pub fn describe_groups_with(groups: &[KvGroup], hma: bool) -> String {
    match groups {
        [one] if !hma => format!("1 group: all {} KV layers", one.layers.len()),
        _ => describe_groups(groups),
    }
}

/// The state groups as one short string:
/// `1 group: mamba2 x23 (conv 3x6144 bf16, ssm 64x64x128 f32)`, or `none`.
pub fn describe_state_groups(groups: &[StateGroup]) -> String {
    if groups.is_empty() {
        return "none".to_owned();
    }
    let dims = |v: &[u32]| v.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x");
    let parts: Vec<String> = groups
        .iter()
        .map(|g| match &g.state {
            Some(st) => format!(
                "{} x{} (conv {} {}, ssm {} {})",
                state_kind_name(st.kind),
                g.layers.len(),
                dims(&st.conv_shape),
                dtype_name(st.conv_dtype),
                dims(&st.ssm_shape),
                dtype_name(st.ssm_dtype)
            ),
            None => format!("linear x{} (state shape not in the config)", g.layers.len()),
        })
        .collect();
    format!("{} group{}: {}", groups.len(), if groups.len() == 1 { "" } else { "s" }, parts.join(", "))
}

fn state_kind_name(k: StateKind) -> &'static str {
    match k {
        StateKind::Mamba2 => "mamba2",
        StateKind::GatedDeltaNet => "gated_delta_net",
    }
}

/// The state groups a model gets: its state-space / linear-attention layers, which all keep
/// the state the config describes, as one group; none without such layers.
pub fn state_groups(model: &ModelSpec) -> Vec<StateGroup> {
    let layers: Vec<LayerId> = (0u32..)
        .zip(&model.layers)
        .filter(|(_, k)| matches!(k, AttentionKind::Linear))
        .map(|(i, _)| LayerId(i))
        .collect();
    if layers.is_empty() {
        return Vec::new();
    }
    vec![StateGroup { layers, state: model.state.clone() }]
}

/// The state groups, and a refusal when a child cannot carry their state.
fn decide_state(model: &ModelSpec, parties: &[Party]) -> Result<Option<Decided<Vec<StateGroup>>>, Conflict> {
    let groups = state_groups(model);
    if groups.is_empty() {
        return Ok(None);
    }
    let state_layers = groups.iter().map(|g| g.layers.len() as u32).sum::<u32>();
    let unsupported: Vec<&Party> = parties.iter().filter(|p| !p.caps.carries_state).collect();
    if !unsupported.is_empty() {
        return Err(Conflict::StateUnsupported {
            model: model.name.clone(),
            state_layers,
            groups: describe_state_groups(&groups),
            unsupported: labels(&unsupported),
            remedy: format!(
                "use connectors that declare carries_state (none of the built-in ones does yet), or serve this model without disaggregation (remove {})",
                them(&labels(&unsupported))
            ),
        });
    }
    let reason = format!(
        "model has {state_layers} state-space/linear-attention layer(s); every child carries their per-request state"
    );
    Ok(Some(decided(groups, DecidedBy::Model, reason)))
}

/// The KV cache groups as one short string: `2 groups: sliding_window(128) x12, full x12`.
pub fn describe_groups(groups: &[KvGroup]) -> String {
    if groups.is_empty() {
        return "no groups (the model has no KV layers)".to_owned();
    }
    let parts: Vec<String> =
        groups.iter().map(|g| format!("{} x{}", kind_name(&g.kind), g.layers.len())).collect();
    format!("{} group{}: {}", groups.len(), if groups.len() == 1 { "" } else { "s" }, parts.join(", "))
}

// ---------------------------------------------------------------------------------------
// KV cache groups.

/// The distinct attention kinds of the layers that hold KV blocks, in first-layer order.
pub fn kv_kinds(model: &ModelSpec) -> Vec<AttentionKind> {
    let mut kinds: Vec<AttentionKind> = Vec::new();
    for k in model.layers.iter().filter(|k| k.has_kv_blocks()) {
        if !kinds.contains(k) {
            kinds.push(*k);
        }
    }
    kinds
}

/// The KV cache groups a model gets: with HMA, one group per attention kind (in the order
/// the kinds first appear); without it, one group of every KV layer. Layers without KV
/// blocks are in no group.
pub fn kv_groups(model: &ModelSpec, hma: bool) -> Vec<KvGroup> {
    let kv_layers = || {
        model
            .layers
            .iter()
            .enumerate()
            .filter(|(_, k)| k.has_kv_blocks())
            .map(|(i, k)| (LayerId(i as u32), k))
    };
    if hma {
        kv_kinds(model)
            .into_iter()
            .map(|kind| KvGroup {
                kind,
                layers: kv_layers().filter(|(_, k)| **k == kind).map(|(i, _)| i).collect(),
            })
            .collect()
    } else {
        let layers: Vec<LayerId> = kv_layers().map(|(i, _)| i).collect();
        match kv_layers().next() {
            Some((_, first)) => vec![KvGroup { kind: *first, layers }],
            None => vec![],
        }
    }
}

// ---------------------------------------------------------------------------------------
// The core.

/// A child as one run of the core sees it: one of this worker's own, or the peer's.
#[derive(Clone)]
struct Party<'a> {
    name: &'a str,
    /// How messages name it (`child 'nixl'`, `decode child 'flexkv'`).
    label: String,
    own: bool,
    caps: &'a Capabilities,
    may_adapt: bool,
    /// KV heads per layer of the model: with one, layouts that differ only in where the
    /// head axis sits are the same bytes.
    heads: u32,
}

impl Party<'_> {
    /// Takes `layout` without adapting: it accepts it, or one with the same bytes.
    fn accepts(&self, layout: KvLayout) -> bool {
        self.caps.layout.accepts_with_heads(layout, self.heads)
    }

    /// Takes `layout` only because, with one KV head, a layout it accepts has the same bytes.
    fn accepts_only_as_same_bytes(&self, layout: KvLayout) -> bool {
        !self.caps.layout.accepts(layout) && self.accepts(layout)
    }

    fn decided_by(&self) -> DecidedBy {
        if self.own {
            DecidedBy::Child(self.name.to_owned())
        } else {
            DecidedBy::Peer(self.name.to_owned())
        }
    }

    fn can_adapt(&self) -> Option<AdaptCost> {
        if self.may_adapt {
            self.caps.adapt
        } else {
            None
        }
    }

    fn layout_constraint(&self) -> String {
        let adapt = match (self.caps.adapt, self.may_adapt) {
            (None, _) => "cannot adapt".to_owned(),
            (Some(c), true) => format!("can adapt at {} cost", cost_name(c)),
            (Some(c), false) => format!("could adapt at {} cost, but adapters are disabled", cost_name(c)),
        };
        format!("{}; {}", self.caps.layout.describe(), adapt)
    }

    fn block_ok(&self, b: u32) -> bool {
        let m = self.caps.block_size_multiple.max(1);
        b.is_multiple_of(m) && self.caps.block_size_divides.is_none_or(|d| b != 0 && d.is_multiple_of(b))
    }

    fn block_constraint(&self) -> String {
        let m = self.caps.block_size_multiple.max(1);
        match (m, self.caps.block_size_divides) {
            (1, None) => "accepts any block size".to_owned(),
            (m, None) => format!("needs a multiple of {m}"),
            (1, Some(d)) => format!("needs a divisor of {d} (its chunk size)"),
            (m, Some(d)) => format!("needs a multiple of {m} that divides {d} (its chunk size)"),
        }
    }

    /// Why `b` does not fit, naming the child and both numbers; `None` when it fits.
    fn block_violation(&self, b: u32) -> Option<String> {
        let m = self.caps.block_size_multiple.max(1);
        let mut why = Vec::new();
        if !b.is_multiple_of(m) {
            why.push(format!("{} needs a block size that is a multiple of {m}; {b} is not", self.label));
        }
        if let Some(d) = self.caps.block_size_divides {
            if b == 0 || d % b != 0 {
                why.push(format!(
                    "{} has chunk_size {d}, which must be a multiple of the block size; block size {b} does not divide {d}",
                    self.label
                ));
            }
        }
        if why.is_empty() {
            None
        } else {
            Some(why.join("; "))
        }
    }
}

fn labels(parties: &[&Party]) -> Vec<String> {
    parties.iter().map(|p| p.label.clone()).collect()
}

/// Every layout, built once: `KvLayout::all()` filters 3125 candidate orders each call.
fn all_layouts() -> &'static [KvLayout] {
    static ALL: OnceLock<Vec<KvLayout>> = OnceLock::new();
    ALL.get_or_init(KvLayout::all)
}

/// The order layouts are tried in: children's preferences in child order, then the common
/// layouts, then every permutation.
fn preference_order(parties: &[Party], with_all: bool) -> Vec<KvLayout> {
    let mut out: Vec<KvLayout> = Vec::with_capacity(if with_all { 120 } else { 8 });
    let mut push = |l: KvLayout| {
        if !out.contains(&l) {
            out.push(l);
        }
    };
    for p in parties {
        for l in &p.caps.layout.preferred {
            push(*l);
        }
    }
    for l in KvLayout::COMMON {
        push(l);
    }
    if with_all {
        for l in all_layouts().iter().copied() {
            push(l);
        }
    }
    out
}

/// (adapters needed, total adapter cost) for a layout, or `None` when a child can neither
/// accept nor adapt to it.
fn layout_fit(layout: KvLayout, parties: &[Party]) -> Option<(usize, u32)> {
    let mut n = 0;
    let mut cost = 0;
    for p in parties {
        if p.accepts(layout) {
            continue;
        }
        let c = p.can_adapt()?;
        n += 1;
        cost += cost_weight(c);
    }
    Some((n, cost))
}

/// The best layout by (fewest adapters, lowest cost, preference order).
fn pick_layout(parties: &[Party]) -> Option<KvLayout> {
    let short = preference_order(parties, false);
    // The short list usually holds a layout no child has to adapt to; the rest of the 120
    // are only looked at when it does not.
    let rest = all_layouts().iter().filter(|l| !short.contains(l));
    let mut best: Option<((usize, u32), KvLayout)> = None;
    for l in short.iter().chain(rest) {
        if let Some(fit) = layout_fit(*l, parties) {
            if best.as_ref().is_none_or(|(b, _)| fit < *b) {
                best = Some((fit, *l));
                if fit.0 == 0 {
                    // Nothing beats no adapter, and earlier layouts win ties.
                    break;
                }
            }
        }
    }
    best.map(|(_, l)| l)
}

/// The layout a child works in when it does not adapt.
fn native_layout(caps: &Capabilities) -> KvLayout {
    let c = &caps.layout;
    c.preferred
        .iter()
        .chain(KvLayout::COMMON.iter())
        .copied()
        .find(|l| c.accepts(*l))
        .or_else(|| all_layouts().iter().copied().find(|l| c.accepts(*l)))
        .or_else(|| c.required.first().copied())
        .unwrap_or(KvLayout::LBNHC)
}

fn adapters_for(layout: KvLayout, parties: &[Party]) -> Vec<(usize, LayoutAdapter)> {
    parties
        .iter()
        .enumerate()
        .filter(|(_, p)| !p.accepts(layout))
        .filter_map(|(i, p)| {
            p.can_adapt().map(|cost| {
                (
                    i,
                    LayoutAdapter {
                        child: p.name.to_owned(),
                        native: native_layout(p.caps),
                        effective: layout,
                        cost,
                    },
                )
            })
        })
        .collect()
}

fn layout_remedy(parties: &[Party]) -> String {
    let mut out = Vec::new();
    if parties.iter().any(|p| p.caps.adapt.is_some() && !p.may_adapt) {
        let enabled: Vec<Party> = parties.iter().map(|p| Party { may_adapt: true, ..p.clone() }).collect();
        if let Some(l) = pick_layout(&enabled) {
            let who: Vec<String> =
                adapters_for(l, &enabled).into_iter().map(|(i, _)| enabled[i].label.clone()).collect();
            let verb = if who.len() == 1 { "adapts" } else { "adapt" };
            out.push(format!(
                "allow adapters (allow_adapters=true): {} then {verb} to {}",
                who.join(", "),
                l.display_name()
            ));
        }
    }
    for (i, p) in parties.iter().enumerate() {
        let rest: Vec<Party> =
            parties.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, q)| q.clone()).collect();
        if let Some(l) = pick_layout(&rest) {
            out.push(format!("remove {} (the others agree on {})", p.label, l.display_name()));
        }
    }
    if out.is_empty() {
        out.push("use children that share a layout, or a child version that can adapt its layout".to_owned());
    }
    out.join("; or ")
}

fn adapter_clause(adapters: &[(usize, LayoutAdapter)], parties: &[Party]) -> String {
    adapters
        .iter()
        .map(|(i, a)| {
            format!(
                "; {} does not accept it and adapts with a transpose {} <-> {} on its own copy path ({} cost)",
                parties[*i].label,
                a.native.display_name(),
                a.effective.display_name(),
                cost_name(a.cost)
            )
        })
        .collect()
}

const BLOCK_SIZES: [u32; 13] = [16, 32, 64, 128, 8, 256, 4, 512, 2, 1024, 1, 2048, 4096];

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The block size every child accepts: the first of 16, 32, 64, 128, 8, 256, ... or, for
/// unusual constraints, the least common multiple of the children's multiples.
fn fitting_block_size(parties: &[Party]) -> Option<u32> {
    if let Some(b) = BLOCK_SIZES.iter().copied().find(|b| parties.iter().all(|p| p.block_ok(*b))) {
        return Some(b);
    }
    let mut l: u64 = 1;
    for p in parties {
        let m = u64::from(p.caps.block_size_multiple.max(1));
        l = l / gcd(l, m) * m;
        if l > u64::from(u32::MAX) {
            return None;
        }
    }
    let l = l as u32;
    parties.iter().all(|p| p.block_ok(l)).then_some(l)
}

fn field(field: &str, value: String, decided_by: DecidedBy, reason: String) -> FieldProvenance {
    FieldProvenance { field: field.to_owned(), value, decided_by, reason }
}

/// Adapters, each with the index of the party that adapts.
type Adapters = Vec<(usize, LayoutAdapter)>;

/// The effective layout, its provenance, and the adapters.
type Decision = (EffectiveLayout, Vec<FieldProvenance>, Adapters);

/// One field's value, who decided it and why.
struct Decided<T> {
    value: T,
    by: DecidedBy,
    reason: String,
}

fn decided<T>(value: T, by: DecidedBy, reason: String) -> Decided<T> {
    Decided { value, by, reason }
}

/// Options and declarations no negotiation can work with.
fn check_inputs(model: &ModelSpec, opts: &EngineOptions, parties: &[Party]) -> Result<(), Conflict> {
    for p in parties {
        if let Err(e) = p.caps.validate() {
            return Err(Conflict::InvalidCaps { child: p.label.clone(), error: e.to_string() });
        }
    }
    if opts.tp_size == 0 {
        return Err(Conflict::InvalidOption {
            option: "tp_size".to_owned(),
            value: "0".to_owned(),
            reason: "the tensor-parallel size is at least 1".to_owned(),
        });
    }
    if opts.tp_rank >= opts.tp_size {
        return Err(Conflict::InvalidOption {
            option: "tp_rank".to_owned(),
            value: opts.tp_rank.to_string(),
            reason: format!("ranks go from 0 to tp_size-1 = {}", opts.tp_size - 1),
        });
    }
    if opts.block_size == Some(0) {
        return Err(Conflict::InvalidOption {
            option: "block_size".to_owned(),
            value: "0".to_owned(),
            reason: "a block holds at least one token; leave it unset for the default 16".to_owned(),
        });
    }
    if model.layers.iter().any(|k| matches!(k, AttentionKind::Mla { .. })) {
        let unsupported: Vec<&Party> = parties.iter().filter(|p| !p.caps.mla).collect();
        if !unsupported.is_empty() {
            return Err(Conflict::MlaUnsupported {
                model: model.name.clone(),
                unsupported: labels(&unsupported),
            });
        }
    }
    Ok(())
}

/// HMA and the KV cache groups it gives.
fn decide_hma(
    model: &ModelSpec,
    opts: &EngineOptions,
    parties: &[Party],
) -> Result<(Decided<bool>, Decided<Vec<KvGroup>>), Conflict> {
    let kinds = kv_kinds(model);
    // State-space and linear-attention layers keep per-sequence state that only the hybrid
    // manager can allocate; feed-forward-only blocks keep nothing and do not count.
    let linear = model.layers.iter().filter(|k| matches!(k, AttentionKind::Linear)).count() as u32;
    let lacking: Vec<&Party> = parties.iter().filter(|p| !p.caps.hma).collect();
    let matters = kinds.len() > 1 || linear > 0;
    let (hma, hma_by, hma_reason) = match opts.hybrid_kv_cache_manager {
        HmaOption::On => {
            if !lacking.is_empty() {
                return Err(Conflict::HmaUnsupported {
                    unsupported: labels(&lacking),
                    supported: parties.iter().filter(|p| p.caps.hma).map(|p| p.label.clone()).collect(),
                });
            }
            (true, DecidedBy::User, "user set hybrid_kv_cache_manager=on".to_owned())
        }
        HmaOption::Off => {
            if linear > 0 {
                return Err(Conflict::HmaRequired {
                    model: model.name.clone(),
                    linear_layers: linear,
                    user_off: true,
                    unsupported: labels(&lacking),
                });
            }
            (false, DecidedBy::User, "user set hybrid_kv_cache_manager=off".to_owned())
        }
        HmaOption::Auto => {
            if linear > 0 && !lacking.is_empty() {
                return Err(Conflict::HmaRequired {
                    model: model.name.clone(),
                    linear_layers: linear,
                    user_off: false,
                    unsupported: labels(&lacking),
                });
            }
            if linear > 0 {
                (
                    true,
                    DecidedBy::Model,
                    format!("model has {linear} state-space/linear-attention layer(s), which need the hybrid KV cache manager; every child supports it"),
                )
            } else if !matters {
                let kind = kinds.first().map(kind_name).unwrap_or_else(|| "none".to_owned());
                (
                    false,
                    DecidedBy::Model,
                    format!(
                        "model has one attention kind ({kind}): HMA would not change the KV cache groups"
                    ),
                )
            } else if let Some(first) = lacking.first() {
                let names = labels(&lacking);
                (false, first.decided_by(), format!("{} not support HMA", list_does(&names)))
            } else {
                (
                    true,
                    DecidedBy::Default,
                    format!("every child supports HMA and the model has {} attention kinds", kinds.len()),
                )
            }
        }
    };
    let groups = kv_groups(model, hma);
    let (groups_by, groups_reason) = if !matters {
        (
            DecidedBy::Model,
            "model has one attention kind: all KV layers share one block table whatever HMA is".to_owned(),
        )
    } else if hma {
        (hma_by.clone(), "HMA on: one block table per attention kind".to_owned())
    } else {
        (hma_by.clone(), "HMA off: all KV layers share one block table".to_owned())
    };
    Ok((decided(hma, hma_by, hma_reason), decided(groups, groups_by, groups_reason)))
}

/// The layout and the children that adapt to it.
fn decide_layout(opts: &EngineOptions, parties: &[Party]) -> Result<(Decided<KvLayout>, Adapters), Conflict> {
    let (layout, layout_by, layout_reason) = match opts.kv_cache_layout {
        Some(l) => {
            let violators: Vec<&Party> =
                parties.iter().filter(|p| !p.accepts(l) && p.can_adapt().is_none()).collect();
            if !violators.is_empty() {
                let mut remedy = match pick_layout(parties) {
                    Some(best) => format!(
                        "leave kv_cache_layout unset (negotiation picks {}) or set kv_cache_layout={}",
                        best.display_name(),
                        best.canonical_name()
                    ),
                    None => layout_remedy(parties),
                };
                if violators.iter().any(|p| p.caps.adapt.is_some() && !p.may_adapt) {
                    remedy.push_str("; or allow adapters (allow_adapters=true)");
                }
                return Err(Conflict::Layout {
                    requested: Some(l),
                    violators: labels(&violators),
                    constraints: parties
                        .iter()
                        .map(|p| ChildConstraint {
                            child: p.label.clone(),
                            constraint: p.layout_constraint(),
                        })
                        .collect(),
                    remedy,
                });
            }
            (l, DecidedBy::User, format!("user set kv_cache_layout={}", l.canonical_name()))
        }
        None => {
            let Some(l) = pick_layout(parties) else {
                return Err(Conflict::Layout {
                    requested: None,
                    violators: vec![],
                    constraints: parties
                        .iter()
                        .map(|p| ChildConstraint {
                            child: p.label.clone(),
                            constraint: p.layout_constraint(),
                        })
                        .collect(),
                    remedy: layout_remedy(parties),
                });
            };
            let name = l.display_name();
            if parties.is_empty() {
                (
                    l,
                    DecidedBy::Default,
                    format!("no child constrains the layout; {name} is the first common layout"),
                )
            } else if let Some(p) = parties.iter().find(|p| p.caps.layout.required == [l]) {
                (l, p.decided_by(), format!("{} requires {name}", p.label))
            } else if let Some(p) = parties.iter().find(|p| p.caps.layout.preferred.contains(&l)) {
                (l, p.decided_by(), format!("{} prefers {name}", p.label))
            } else {
                (l, DecidedBy::Default, format!("{name} is the first common layout every child accepts"))
            }
        }
    };
    let adapters = adapters_for(layout, parties);
    let mut layout_reason = if adapters.is_empty() {
        if parties.is_empty() {
            layout_reason
        } else {
            format!("{layout_reason}; every child accepts it")
        }
    } else {
        format!("{layout_reason}{}", adapter_clause(&adapters, parties))
    };
    for p in parties.iter().filter(|p| p.accepts_only_as_same_bytes(layout)) {
        layout_reason.push_str(&format!(
            "; {}: {}",
            p.label,
            crate::compat::one_head_note(native_layout(p.caps), layout)
        ));
    }
    Ok((decided(layout, layout_by, layout_reason), adapters))
}

/// The block size: the user's, else 16, else the first size every child accepts.
fn decide_block_size(opts: &EngineOptions, parties: &[Party]) -> Result<Decided<u32>, Conflict> {
    let (block_size, block_by, block_reason) = match opts.block_size {
        Some(b) => {
            let violations: Vec<String> = parties.iter().filter_map(|p| p.block_violation(b)).collect();
            if !violations.is_empty() {
                let remedy = match fitting_block_size(parties) {
                    Some(ok) => {
                        format!("set block_size={ok} (or leave it unset), or remove the child named above")
                    }
                    None => {
                        "no block size fits every child: remove one of the children named above".to_owned()
                    }
                };
                return Err(Conflict::BlockSize {
                    block_size: b,
                    by_user: true,
                    violations,
                    constraints: parties
                        .iter()
                        .map(|p| ChildConstraint { child: p.label.clone(), constraint: p.block_constraint() })
                        .collect(),
                    remedy,
                });
            }
            (b, DecidedBy::User, format!("user set block_size={b}; every child accepts it"))
        }
        None => {
            let default = BLOCK_SIZES[0];
            let violations: Vec<(usize, String)> = parties
                .iter()
                .enumerate()
                .filter_map(|(i, p)| p.block_violation(default).map(|v| (i, v)))
                .collect();
            match violations.first() {
                None => (default, DecidedBy::Default, "vLLM's default block size; every child accepts it".to_owned()),
                Some((first, _)) => match fitting_block_size(parties) {
                    Some(b) => (
                        b,
                        parties[*first].decided_by(),
                        format!(
                            "the default 16 does not fit ({}); {b} is the first of 16, 32, 64, 128, 8, 256, ... that every child accepts",
                            violations.iter().map(|(_, v)| v.as_str()).collect::<Vec<_>>().join("; ")
                        ),
                    ),
                    None => {
                        return Err(Conflict::BlockSize {
                            block_size: default,
                            by_user: false,
                            violations: violations.into_iter().map(|(_, v)| v).collect(),
                            constraints: parties
                                .iter()
                                .map(|p| ChildConstraint { child: p.label.clone(), constraint: p.block_constraint() })
                                .collect(),
                            remedy: "the children's block-size constraints exclude each other: remove one of them or change its chunk size".to_owned(),
                        })
                    }
                },
            }
        }
    };
    Ok(decided(block_size, block_by, block_reason))
}

/// The cache dtype: the user's, else the model's, else bf16.
fn decide_dtype(
    model: &ModelSpec,
    opts: &EngineOptions,
    parties: &[Party],
) -> Result<Decided<Dtype>, Conflict> {
    let (dtype, dtype_by, dtype_reason) = match (opts.cache_dtype, model.dtype) {
        (Some(d), _) => (d, DecidedBy::User, format!("user set cache_dtype={}", dtype_name(d))),
        (None, Some(d)) => (d, DecidedBy::Model, format!("model torch_dtype is {}", dtype_name(d))),
        (None, None) => (Dtype::Bf16, DecidedBy::Default, "config has no torch_dtype".to_owned()),
    };
    let dtype_violators: Vec<&Party> = parties
        .iter()
        .filter(|p| !p.caps.cache_dtypes.is_empty() && !p.caps.cache_dtypes.contains(&dtype))
        .collect();
    if !dtype_violators.is_empty() {
        let restricted: Vec<&Party> = parties.iter().filter(|p| !p.caps.cache_dtypes.is_empty()).collect();
        let common: Vec<&str> = [Dtype::Bf16, Dtype::F16, Dtype::F32, Dtype::Fp8E4m3, Dtype::Fp8E5m2]
            .into_iter()
            .filter(|d| restricted.iter().all(|p| p.caps.cache_dtypes.contains(d)))
            .map(dtype_name)
            .collect();
        let remedy = if common.is_empty() {
            format!("the children share no cache dtype: remove {}", them(&labels(&dtype_violators)))
        } else {
            format!(
                "set cache_dtype to {}, or remove {}",
                common.join(" or "),
                them(&labels(&dtype_violators))
            )
        };
        return Err(Conflict::CacheDtype {
            dtype: dtype_name(dtype).to_owned(),
            source_of: match dtype_by {
                DecidedBy::User => "set by user".to_owned(),
                DecidedBy::Model => "the model's torch_dtype".to_owned(),
                _ => "default: config has no torch_dtype".to_owned(),
            },
            violators: labels(&dtype_violators),
            constraints: parties
                .iter()
                .map(|p| ChildConstraint {
                    child: p.label.clone(),
                    constraint: if p.caps.cache_dtypes.is_empty() {
                        "stores any dtype".to_owned()
                    } else {
                        format!(
                            "stores {}",
                            p.caps.cache_dtypes.iter().map(|d| dtype_name(*d)).collect::<Vec<_>>().join(", ")
                        )
                    },
                })
                .collect(),
            remedy,
        });
    }
    Ok(decided(dtype, dtype_by, dtype_reason))
}

/// The memory kind. Only this worker's own children touch its KV memory.
fn decide_memory(opts: &EngineOptions, parties: &[Party]) -> Result<Decided<MemoryKind>, Conflict> {
    let (memory, memory_by, memory_reason) = match opts.memory {
        Some(m) => (m, DecidedBy::User, format!("user set kv_buffer_device ({})", memory_name(m))),
        None => (
            MemoryKind::Host,
            DecidedBy::Default,
            "KV buffers in host memory unless kv_buffer_device says otherwise".to_owned(),
        ),
    };
    let own: Vec<&Party> = parties.iter().filter(|p| p.own).collect();
    let memory_violators: Vec<&Party> =
        own.iter().copied().filter(|p| !p.caps.memory_kinds.contains(&memory)).collect();
    if !memory_violators.is_empty() {
        let common: Vec<&str> = [MemoryKind::Host, MemoryKind::Device, MemoryKind::Disk]
            .into_iter()
            .filter(|m| own.iter().all(|p| p.caps.memory_kinds.contains(m)))
            .map(memory_name)
            .collect();
        let remedy = if common.is_empty() {
            format!("the children share no memory kind: remove {}", them(&labels(&memory_violators)))
        } else {
            format!(
                "set kv_buffer_device to {} memory, or remove {}",
                common.join(" or "),
                them(&labels(&memory_violators))
            )
        };
        return Err(Conflict::Memory {
            memory: memory_name(memory).to_owned(),
            source_of: if memory_by == DecidedBy::User { "set by user" } else { "default" }.to_owned(),
            violators: labels(&memory_violators),
            constraints: own
                .iter()
                .map(|p| ChildConstraint {
                    child: p.label.clone(),
                    constraint: format!(
                        "uses {}",
                        p.caps.memory_kinds.iter().map(|m| memory_name(*m)).collect::<Vec<_>>().join(", ")
                    ),
                })
                .collect(),
            remedy,
        });
    }
    Ok(decided(memory, memory_by, memory_reason))
}

/// The tensor-parallel size, and whether the peer may use another one: only when every
/// child that moves KV between engines declares `heterogeneous_tp`.
fn decide_tp(opts: &EngineOptions, parties: &[Party]) -> Decided<u32> {
    let tp = opts.tp_size;
    let (by, head) = if tp == 1 {
        (DecidedBy::Default, "one tensor-parallel rank unless tp_size says otherwise".to_owned())
    } else {
        (DecidedBy::User, format!("user set tp_size={tp}"))
    };
    let movers: Vec<&Party> =
        parties.iter().filter(|p| p.own && p.caps.transfer_mode != TransferMode::None).collect();
    let fixed: Vec<&Party> = movers.iter().copied().filter(|p| p.caps.needs_equal_tp()).collect();
    let tail = match (movers.is_empty(), fixed.is_empty()) {
        (true, _) => "no child moves KV between engines".to_owned(),
        (false, true) => {
            format!("{} KV across different TP sizes", verb_of(&labels(&movers), "loads", "load"))
        }
        (false, false) => format!(
            "{} KV only between equal TP sizes: the peer must use tp_size={tp} too",
            verb_of(&labels(&fixed), "moves", "move")
        ),
    };
    decided(tp, by, format!("{head}; {tail}"))
}

/// `a moves` or `a, b move`.
fn verb_of(names: &[String], one: &str, many: &str) -> String {
    format!("{} {}", names.join(", "), if names.len() == 1 { one } else { many })
}

/// True when a worker with these children can load KV from, or serve it to, a peer with
/// another tensor-parallel size: some child moves KV between engines and every such child
/// declares `heterogeneous_tp`.
pub fn loads_across_tp<'a>(caps: impl IntoIterator<Item = &'a Capabilities>) -> bool {
    let mut moves = false;
    for c in caps {
        if c.needs_equal_tp() {
            return false;
        }
        moves |= c.transfer_mode != TransferMode::None;
    }
    moves
}

/// The transfer mode: pull if a child pulls, push if one pushes, never both.
fn decide_mode(parties: &[Party]) -> Result<Decided<TransferMode>, Conflict> {
    let pull: Vec<&Party> = parties.iter().filter(|p| p.caps.transfer_mode == TransferMode::Pull).collect();
    let push: Vec<&Party> = parties.iter().filter(|p| p.caps.transfer_mode == TransferMode::Push).collect();
    let (mode, mode_by, mode_reason) = match (pull.first(), push.first()) {
        (Some(_), Some(_)) => {
            return Err(Conflict::TransferMode { pull: labels(&pull), push: labels(&push) })
        }
        (Some(p), None) => (
            TransferMode::Pull,
            p.decided_by(),
            format!("{} pulls: the consumer reads KV from the producer", p.label),
        ),
        (None, Some(p)) => (
            TransferMode::Push,
            p.decided_by(),
            format!("{} pushes: the producer writes KV into the consumer", p.label),
        ),
        (None, None) => {
            (TransferMode::None, DecidedBy::Default, "no child moves KV between engines".to_owned())
        }
    };
    Ok(decided(mode, mode_by, mode_reason))
}

/// The whole negotiation over one set of parties. `opts` holds the shared options already
/// merged; memory is checked against the own parties only.
fn decide(model: &ModelSpec, opts: &EngineOptions, parties: &[Party]) -> Result<Decision, Conflict> {
    check_inputs(model, opts, parties)?;
    let (hma, groups) = decide_hma(model, opts, parties)?;
    let state = decide_state(model, parties)?;
    let (layout, adapters) = decide_layout(opts, parties)?;
    if let (Some(why), false) = (&opts.opaque_blocks, adapters.is_empty()) {
        let children: Vec<String> = adapters.iter().map(|(i, _)| parties[*i].label.clone()).collect();
        let words = adapters
            .iter()
            .map(|(i, a)| format!("{}: {} -> {}", parties[*i].label, a.native, a.effective))
            .collect();
        return Err(Conflict::OpaqueBlocks { why: why.clone(), layout: layout.value, children, adapters: words });
    }
    let block = decide_block_size(opts, parties)?;
    let dtype = decide_dtype(model, opts, parties)?;
    let memory = decide_memory(opts, parties)?;
    let mode = decide_mode(parties)?;
    let tp = decide_tp(opts, parties);

    let mut provenance = vec![
        field("layout", layout.value.display_name(), layout.by, layout.reason),
        field("hma", if hma.value { "on" } else { "off" }.to_owned(), hma.by, hma.reason),
        field("block_size", block.value.to_string(), block.by, block.reason),
        field("cache_dtype", dtype_name(dtype.value).to_owned(), dtype.by, dtype.reason),
        field("memory", memory_name(memory.value).to_owned(), memory.by, memory.reason),
        field("transfer_mode", mode_name(mode.value).to_owned(), mode.by, mode.reason),
        field("kv_groups", describe_groups_with(&groups.value, hma.value), groups.by, groups.reason),
        field("tp_size", tp.value.to_string(), tp.by, tp.reason),
    ];
    let state_groups = match state {
        Some(st) => {
            // Next to the KV cache groups.
            let at =
                provenance.iter().position(|p| p.field == "kv_groups").map_or(provenance.len(), |i| i + 1);
            provenance.insert(at, field("state_groups", describe_state_groups(&st.value), st.by, st.reason));
            st.value
        }
        None => Vec::new(),
    };
    let effective = EffectiveLayout {
        layout: layout.value,
        hma: hma.value,
        block_size: block.value,
        cache_dtype: dtype.value,
        memory: memory.value,
        transfer_mode: mode.value,
        groups: groups.value,
        state_groups,
        opaque_blocks: opts.opaque_blocks.is_some(),
    };
    Ok((effective, provenance, adapters))
}

/// Negotiates one worker's effective layout from its children's capabilities.
pub fn negotiate(
    model: &ModelSpec,
    opts: &EngineOptions,
    children: &[ChildCaps],
) -> Result<Negotiated, Conflict> {
    let parties: Vec<Party> = children
        .iter()
        .map(|c| Party {
            name: &c.name,
            label: format!("child '{}'", c.name),
            own: true,
            caps: &c.caps,
            may_adapt: opts.allow_adapters,
            heads: model.num_kv_heads,
        })
        .collect();
    let (effective, provenance, adapters) = decide(model, opts, &parties)?;
    Ok(Negotiated {
        effective,
        provenance,
        adapters: adapters.into_iter().map(|(_, a)| a).collect(),
        children: children.to_vec(),
    })
}

/// The role a worker plays in a deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Prefill,
    Decode,
}

/// Merges one option of the two roles: unset on one side takes the other's value; two set
/// values must agree.
fn merge_opt<T: PartialEq + Copy>(
    option: &str,
    p: Option<T>,
    d: Option<T>,
    show: impl Fn(T) -> String,
) -> Result<Option<T>, Conflict> {
    match (p, d) {
        (Some(a), Some(b)) if a != b => {
            Err(Conflict::OptionMismatch { option: option.to_owned(), prefill: show(a), decode: show(b) })
        }
        (Some(a), _) => Ok(Some(a)),
        (None, b) => Ok(b),
    }
}

/// Negotiates a deployment: both roles get the same layout, HMA and KV groups, block size,
/// dtype and transfer mode, computed from the union of both roles' children; each role
/// keeps its own memory kind and its own adapters. An option both roles set must agree
/// (`auto`/unset on one side takes the other side's value).
pub fn negotiate_deployment(
    model: &ModelSpec,
    prefill: (&EngineOptions, &[ChildCaps]),
    decode: (&EngineOptions, &[ChildCaps]),
) -> Result<(Negotiated, Negotiated), Conflict> {
    let (po, pc) = prefill;
    let (dopt, dc) = decode;
    let hma_of = |o: &EngineOptions| match o.hybrid_kv_cache_manager {
        HmaOption::Auto => None,
        h => Some(h),
    };
    let hma = merge_opt("hybrid_kv_cache_manager", hma_of(po), hma_of(dopt), |h| h.to_string())?;
    // Two layouts with the same bytes (one KV head, the head axis elsewhere) do not
    // conflict: each role keeps the one it was given.
    let (pl, dl) = (po.kv_cache_layout, dopt.kv_cache_layout);
    let own_layouts = matches!((pl, dl), (Some(a), Some(b)) if a.same_bytes(b, model.num_kv_heads));
    let layout =
        if own_layouts { None } else { merge_opt("kv_cache_layout", pl, dl, |l| l.canonical_name())? };
    let block = merge_opt("block_size", po.block_size, dopt.block_size, |b| b.to_string())?;
    let dtype = merge_opt("cache_dtype", po.cache_dtype, dopt.cache_dtype, |d| dtype_name(d).to_owned())?;
    let shared = |o: &EngineOptions| EngineOptions {
        hybrid_kv_cache_manager: hma.unwrap_or(HmaOption::Auto),
        kv_cache_layout: layout.or(o.kv_cache_layout.filter(|_| own_layouts)),
        block_size: block,
        cache_dtype: dtype,
        ..o.clone()
    };

    // A child with the same name and capabilities on both sides (nixl on both) is one party.
    let in_decode = |c: &ChildCaps| dc.iter().any(|d| d.name == c.name && d.caps == c.caps);
    let in_prefill = |c: &ChildCaps| pc.iter().any(|p| p.name == c.name && p.caps == c.caps);

    let view = |role: Role| -> Vec<Party> {
        let mut parties = Vec::with_capacity(pc.len() + dc.len());
        for c in pc {
            let both = in_decode(c);
            parties.push(Party {
                name: &c.name,
                label: if both {
                    format!("child '{}' (prefill and decode)", c.name)
                } else {
                    format!("prefill child '{}'", c.name)
                },
                own: both || role == Role::Prefill,
                caps: &c.caps,
                may_adapt: po.allow_adapters && (!both || dopt.allow_adapters),
                heads: model.num_kv_heads,
            });
        }
        for c in dc.iter().filter(|c| !in_prefill(c)) {
            parties.push(Party {
                name: &c.name,
                label: format!("decode child '{}'", c.name),
                own: role == Role::Decode,
                caps: &c.caps,
                may_adapt: dopt.allow_adapters,
                heads: model.num_kv_heads,
            });
        }
        parties
    };

    let run = |role: Role, opts: &EngineOptions, children: &[ChildCaps]| -> Result<Negotiated, Conflict> {
        let parties = view(role);
        let (effective, provenance, adapters) = decide(model, &shared(opts), &parties)?;
        Ok(Negotiated {
            effective,
            provenance,
            adapters: adapters.into_iter().filter(|(i, _)| parties[*i].own).map(|(_, a)| a).collect(),
            children: children.to_vec(),
        })
    };
    let p = run(Role::Prefill, po, pc)?;
    let d = run(Role::Decode, dopt, dc)?;
    if let Some(remedy) = crate::compat::tp_refusal(
        ("prefill", po.tp_size),
        ("decode", dopt.tp_size),
        loads_across_tp(pc.iter().chain(dc).map(|c| &c.caps)),
    ) {
        let parties = view(Role::Prefill);
        let children = labels(&parties.iter().filter(|p| p.caps.needs_equal_tp()).collect::<Vec<_>>());
        let reason = if !children.is_empty() {
            format!("{} not load KV across different TP sizes (no heterogeneous_tp)", list_does(&children))
        } else if parties.iter().all(|p| p.caps.transfer_mode == TransferMode::None) {
            "no child moves KV between the roles".to_owned()
        } else {
            format!("{} and {} do not divide each other", po.tp_size, dopt.tp_size)
        };
        return Err(Conflict::TpSize { prefill: po.tp_size, decode: dopt.tp_size, children, reason, remedy });
    }
    Ok((p, d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caps::{KvRoleCap, LayoutConstraint};

    fn caps(
        hma: bool,
        layout: LayoutConstraint,
        adapt: Option<AdaptCost>,
        mode: TransferMode,
    ) -> Capabilities {
        Capabilities {
            hma,
            layout,
            adapt,
            block_size_multiple: 1,
            block_size_divides: None,
            cache_dtypes: vec![],
            memory_kinds: vec![MemoryKind::Host, MemoryKind::Disk],
            transfer_mode: mode,
            roles: vec![KvRoleCap::Both],
            layerwise: false,
            heterogeneous_tp: false,
            mla: false,
            async_load: false,
            carries_state: false,
        }
    }

    fn child(name: &str, caps: Capabilities) -> ChildCaps {
        ChildCaps { name: name.to_owned(), version: "0.1.0".to_owned(), caps }
    }

    /// Like connectors/lmcache: no HMA, NHD or HND, block size must divide the chunk size.
    fn lmcache(chunk: u32) -> ChildCaps {
        let mut c = caps(
            false,
            LayoutConstraint {
                required: vec![KvLayout::NHD, KvLayout::HND],
                rejected: vec![],
                preferred: vec![KvLayout::NHD, KvLayout::HND],
            },
            None,
            TransferMode::None,
        );
        c.block_size_divides = Some(chunk);
        c.mla = true;
        child("lmcache", c)
    }

    /// Like connectors/nixl for a non-MLA model: HMA, requires HND, pulls.
    fn nixl() -> ChildCaps {
        let mut c = caps(
            true,
            LayoutConstraint {
                required: vec![KvLayout::HND],
                rejected: vec![],
                preferred: vec![KvLayout::HND],
            },
            None,
            TransferMode::Pull,
        );
        c.memory_kinds = vec![MemoryKind::Host];
        child("nixl", c)
    }

    /// Like connectors/flexkv: no HMA, rejects HND, adapts at medium cost.
    fn flexkv() -> ChildCaps {
        child(
            "flexkv",
            caps(
                false,
                LayoutConstraint {
                    required: vec![],
                    rejected: vec![KvLayout::HND],
                    preferred: vec![KvLayout::NHD],
                },
                Some(AdaptCost::Medium),
                TransferMode::None,
            ),
        )
    }

    fn model(name: &str, layers: Vec<AttentionKind>, dtype: Option<Dtype>) -> ModelSpec {
        ModelSpec {
            name: name.to_owned(),
            num_layers: layers.len() as u32,
            num_kv_heads: 8,
            head_dim: 64,
            dtype,
            layers,
            state: None,
        }
    }

    /// gpt-oss-20b-like: 24 layers, sliding (128) at even indices, full at odd; no torch_dtype.
    fn hybrid() -> ModelSpec {
        let layers =
            (0..24)
                .map(|i| {
                    if i % 2 == 0 {
                        AttentionKind::SlidingWindow { window: 128 }
                    } else {
                        AttentionKind::Full
                    }
                })
                .collect();
        model("gpt_oss", layers, None)
    }

    /// Qwen3-0.6B-like: 28 full layers, bf16.
    fn dense() -> ModelSpec {
        model("qwen3", vec![AttentionKind::Full; 28], Some(Dtype::Bf16))
    }

    /// Qwen3-Next-like: 3 linear-attention layers then one full, 12 times.
    fn with_linear() -> ModelSpec {
        let layers =
            (0..48).map(|i| if i % 4 == 3 { AttentionKind::Full } else { AttentionKind::Linear }).collect();
        model("qwen3_next", layers, Some(Dtype::Bf16))
    }

    fn mla_model() -> ModelSpec {
        model(
            "deepseek_v2",
            vec![AttentionKind::Mla { kv_lora_rank: 512, qk_rope_head_dim: 64 }; 27],
            Some(Dtype::Bf16),
        )
    }

    fn opts() -> EngineOptions {
        EngineOptions::default()
    }

    fn prov<'a>(n: &'a Negotiated, f: &str) -> &'a FieldProvenance {
        n.provenance_of(f).unwrap()
    }

    #[test]
    fn dyn_3545_composite_turns_hma_off_and_names_lmcache() {
        let n = negotiate(&hybrid(), &opts(), &[lmcache(256), nixl()]).unwrap();
        assert!(!n.effective.hma);
        assert_eq!(n.effective.groups.len(), 1);
        assert_eq!(n.effective.groups[0].layers.len(), 24);
        let h = prov(&n, "hma");
        assert_eq!(h.decided_by, DecidedBy::Child("lmcache".into()));
        assert_eq!(h.why(), "child 'lmcache' does not support HMA");
        assert_eq!(n.effective.layout, KvLayout::HND);
        assert_eq!(prov(&n, "layout").decided_by, DecidedBy::Child("nixl".into()));
        assert_eq!(n.effective.transfer_mode, TransferMode::Pull);
        // bf16 because gpt-oss has no torch_dtype.
        assert_eq!(n.effective.cache_dtype, Dtype::Bf16);
        assert_eq!(prov(&n, "cache_dtype").why(), "default: config has no torch_dtype");
    }

    #[test]
    fn dyn_3545_plain_nixl_keeps_hma_on_with_one_group_per_kind() {
        let n = negotiate(&hybrid(), &opts(), &[nixl()]).unwrap();
        assert!(n.effective.hma);
        assert_eq!(n.effective.groups.len(), 2);
        assert_eq!(n.effective.groups[0].kind, AttentionKind::SlidingWindow { window: 128 });
        assert_eq!(n.effective.groups[0].layers[..2], [LayerId(0), LayerId(2)]);
        assert_eq!(n.effective.groups[1].kind, AttentionKind::Full);
        assert_eq!(n.effective.groups[1].layers[..2], [LayerId(1), LayerId(3)]);
        assert_eq!(
            prov(&n, "hma").why(),
            "default: every child supports HMA and the model has 2 attention kinds"
        );
    }

    #[test]
    fn deployment_gives_both_roles_the_same_answer() {
        let (p, d) =
            negotiate_deployment(&hybrid(), (&opts(), &[lmcache(256), nixl()]), (&opts(), &[nixl()]))
                .unwrap();
        assert_eq!(p.effective, d.effective);
        assert!(!d.effective.hma);
        // Decode is told that the peer's child decided it.
        assert_eq!(prov(&d, "hma").decided_by, DecidedBy::Peer("lmcache".into()));
        assert!(prov(&d, "hma").reason.contains("prefill child 'lmcache'"), "{}", prov(&d, "hma").reason);
        assert_eq!(prov(&p, "hma").decided_by, DecidedBy::Child("lmcache".into()));
        assert_eq!(d.children.len(), 1);
        assert_eq!(p.children.len(), 2);
    }

    #[test]
    fn deployment_keeps_each_roles_adapters() {
        let (p, d) =
            negotiate_deployment(&dense(), (&opts(), &[flexkv(), nixl()]), (&opts(), &[nixl()])).unwrap();
        assert_eq!(p.effective.layout, KvLayout::HND);
        assert_eq!(d.effective.layout, KvLayout::HND);
        assert_eq!(p.adapters.len(), 1);
        assert_eq!(p.adapters[0].child, "flexkv");
        assert!(d.adapters.is_empty());
    }

    #[test]
    fn one_kv_head_needs_no_layout_adapter() {
        // Gemma-3-1B-like: one KV head. flexkv works in NHD and nixl requires HND; with one
        // head those are the same bytes, so nobody adapts.
        let one_head = ModelSpec { num_kv_heads: 1, ..dense() };
        let n = negotiate(&one_head, &opts(), &[flexkv(), nixl()]).unwrap();
        assert!(n.adapters.is_empty(), "{}", n.explain());
        assert_eq!(n.effective.layout, KvLayout::NHD, "flexkv's preference, nixl takes it as is");
        let why = &prov(&n, "layout").reason;
        assert!(
            why.contains("child 'nixl': no adapter: one KV head, so LBHNC and LBNHC are the same bytes"),
            "{why}"
        );
        // Adapters off is then no conflict, and a layout nixl does not list is no violation.
        let no_adapters = EngineOptions { allow_adapters: false, ..opts() };
        assert!(negotiate(&one_head, &no_adapters, &[flexkv(), nixl()]).unwrap().adapters.is_empty());
        let nhd = EngineOptions { kv_cache_layout: Some(KvLayout::NHD), ..opts() };
        assert_eq!(negotiate(&one_head, &nhd, &[nixl()]).unwrap().effective.layout, KvLayout::NHD);
        // Only the head axis is free: cross-layer is still a different layout.
        let cross = EngineOptions { kv_cache_layout: Some(KvLayout::BLNHC), ..no_adapters.clone() };
        assert!(negotiate(&one_head, &cross, &[nixl()]).is_err());
        // With two heads nothing changes: flexkv transposes to nixl's HND.
        let n = negotiate(&dense(), &opts(), &[flexkv(), nixl()]).unwrap();
        assert_eq!((n.effective.layout, n.adapters.len()), (KvLayout::HND, 1));
        assert!(!prov(&n, "layout").reason.contains("one KV head"));
    }

    #[test]
    fn deployment_roles_keep_layouts_that_are_the_same_bytes() {
        let lay = |l| EngineOptions { kv_cache_layout: Some(l), ..opts() };
        let one_head = ModelSpec { num_kv_heads: 1, ..dense() };
        let (p, d) = negotiate_deployment(
            &one_head,
            (&lay(KvLayout::NHD), &[lmcache(256), nixl()]),
            (&lay(KvLayout::HND), &[nixl()]),
        )
        .unwrap();
        assert_eq!((p.effective.layout, d.effective.layout), (KvLayout::NHD, KvLayout::HND));
        // With more heads they are two layouts, and the roles must agree.
        let e = negotiate_deployment(
            &dense(),
            (&lay(KvLayout::NHD), &[lmcache(256)]),
            (&lay(KvLayout::HND), &[]),
        )
        .unwrap_err();
        assert!(matches!(e, Conflict::OptionMismatch { .. }), "{e}");
    }

    #[test]
    fn tp_size_says_whether_the_peer_may_use_another() {
        let n = negotiate(&dense(), &opts(), &[lmcache(256), nixl()]).unwrap();
        let tp = prov(&n, "tp_size");
        assert_eq!((tp.value.as_str(), &tp.decided_by), ("1", &DecidedBy::Default));
        assert_eq!(
            tp.why(),
            "default: one tensor-parallel rank unless tp_size says otherwise; child 'nixl' moves KV only between equal TP sizes: the peer must use tp_size=1 too"
        );
        let mut any_tp = nixl();
        any_tp.caps.heterogeneous_tp = true;
        let n =
            negotiate(&dense(), &EngineOptions { tp_size: 2, ..opts() }, &[lmcache(256), any_tp]).unwrap();
        assert_eq!(
            prov(&n, "tp_size").why(),
            "user set tp_size=2; child 'nixl' loads KV across different TP sizes"
        );
        let n = negotiate(&dense(), &opts(), &[lmcache(256)]).unwrap();
        assert!(prov(&n, "tp_size").reason.ends_with("no child moves KV between engines"));
    }

    #[test]
    fn deployment_tp_sizes_must_match_without_heterogeneous_tp() {
        let tp = |n| EngineOptions { tp_size: n, ..opts() };
        let e = negotiate_deployment(&dense(), (&tp(2), &[lmcache(256), nixl()]), (&tp(4), &[nixl()]))
            .unwrap_err();
        assert!(matches!(&e, Conflict::TpSize { prefill: 2, decode: 4, .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "prefill has tp_size=2 and decode tp_size=4, but child 'nixl' (prefill and decode) does not load KV across different TP sizes (no heterogeneous_tp); no KV would be moved between them. Remedy: the KV transport moves KV only between equal tensor-parallel sizes (it does not declare heterogeneous_tp), and 2 != 4: run decode with tp_size=2 like prefill, or prefill with tp_size=4"
        );
        // Equal sizes are fine, and so are divisible sizes with a transport that handles them.
        negotiate_deployment(&dense(), (&tp(2), &[nixl()]), (&tp(2), &[nixl()])).unwrap();
        let mut any_tp = nixl();
        any_tp.caps.heterogeneous_tp = true;
        let both = std::slice::from_ref(&any_tp);
        negotiate_deployment(&dense(), (&tp(2), both), (&tp(4), both)).unwrap();
        // Sizes that do not divide each other are refused even then.
        let e = negotiate_deployment(&dense(), (&tp(2), both), (&tp(3), both)).unwrap_err();
        assert!(e.to_string().contains("but 2 and 3 do not divide each other"), "{e}");
        assert!(e.to_string().contains("TP sizes 2 and 3 do not divide each other"), "{e}");
        // One role's transport lacking it is enough to refuse.
        let e = negotiate_deployment(&dense(), (&tp(2), both), (&tp(4), &[nixl()])).unwrap_err();
        assert!(e.to_string().contains("decode child 'nixl' does not load KV"), "{e}");
    }

    #[test]
    fn deployment_options_must_agree() {
        let off = EngineOptions { hybrid_kv_cache_manager: HmaOption::Off, ..opts() };
        let on = EngineOptions { hybrid_kv_cache_manager: HmaOption::On, ..opts() };
        let e = negotiate_deployment(&hybrid(), (&off, &[nixl()]), (&on, &[nixl()])).unwrap_err();
        assert_eq!(
            e,
            Conflict::OptionMismatch {
                option: "hybrid_kv_cache_manager".into(),
                prefill: "off".into(),
                decode: "on".into()
            }
        );
        assert!(e.to_string().contains("prefill=off, decode=on"), "{e}");
        let b16 = EngineOptions { block_size: Some(16), ..opts() };
        let b32 = EngineOptions { block_size: Some(32), ..opts() };
        let e = negotiate_deployment(&dense(), (&b16, &[nixl()]), (&b32, &[nixl()])).unwrap_err();
        assert!(e.to_string().contains("option block_size differs"), "{e}");
        // Unset on one side takes the other's value.
        let (p, d) = negotiate_deployment(&hybrid(), (&off, &[nixl()]), (&opts(), &[nixl()])).unwrap();
        assert!(!p.effective.hma && !d.effective.hma);
        assert_eq!(prov(&d, "hma").decided_by, DecidedBy::User);
    }

    #[test]
    fn deployment_conflict_names_the_role() {
        let e = negotiate_deployment(
            &dense(),
            (&EngineOptions { allow_adapters: false, ..opts() }, &[flexkv()]),
            (&opts(), &[nixl()]),
        )
        .unwrap_err();
        let s = e.to_string();
        assert!(s.contains("prefill child 'flexkv'") && s.contains("decode child 'nixl'"), "{s}");
    }

    #[test]
    fn dense_model_hma_does_not_change_groups() {
        let a = negotiate(&dense(), &opts(), &[lmcache(256), nixl()]).unwrap();
        let b = negotiate(&dense(), &opts(), &[nixl()]).unwrap();
        let c = negotiate(
            &dense(),
            &EngineOptions { hybrid_kv_cache_manager: HmaOption::On, ..opts() },
            &[nixl()],
        )
        .unwrap();
        assert_eq!(a.effective.groups, b.effective.groups);
        assert_eq!(a.effective.groups, c.effective.groups);
        assert_eq!(a.effective.groups.len(), 1);
        assert_eq!(prov(&b, "hma").decided_by, DecidedBy::Model);
    }

    #[test]
    fn flexkv_adapts_to_nixls_hnd() {
        let n = negotiate(&dense(), &opts(), &[flexkv(), nixl()]).unwrap();
        assert_eq!(n.effective.layout, KvLayout::HND);
        assert_eq!(
            n.adapters,
            vec![LayoutAdapter {
                child: "flexkv".into(),
                native: KvLayout::NHD,
                effective: KvLayout::HND,
                cost: AdaptCost::Medium
            }]
        );
        let text = n.explain();
        let line = text.lines().find(|l| l.starts_with("layout")).unwrap();
        assert!(line.contains("[child nixl]"), "{text}");
        assert!(line.contains("child 'flexkv' does not accept it and adapts with a transpose"), "{text}");
        assert_eq!(text.lines().count(), 8, "{text}");
        println!("{text}");
    }

    #[test]
    fn opaque_blocks_refuse_an_adapter_and_name_why() {
        let cpu = EngineOptions {
            kv_cache_layout: Some(KvLayout::HND),
            opaque_blocks: Some("vLLM's CPU backend stores K transposed inside a block".into()),
            ..opts()
        };
        let n = negotiate(&dense(), &cpu, &[nixl()]).unwrap();
        assert!(n.effective.opaque_blocks);
        assert!(n.adapters.is_empty());
        let e = negotiate(&dense(), &cpu, &[flexkv(), nixl()]).unwrap_err();
        assert!(matches!(e, Conflict::OpaqueBlocks { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains("stores K transposed"), "{msg}");
        assert!(msg.contains("child 'flexkv': LBNHC -> LBHNC"), "{msg}");
        // The same children over a known layout adapt as before.
        assert_eq!(negotiate(&dense(), &opts(), &[flexkv(), nixl()]).unwrap().adapters.len(), 1);
    }

    #[test]
    fn explain_is_aligned() {
        let n = negotiate(&hybrid(), &opts(), &[lmcache(256), nixl()]).unwrap();
        let text = n.explain();
        let cols: Vec<usize> = text.lines().map(|l| l.find(" = ").unwrap()).collect();
        assert!(cols.windows(2).all(|w| w[0] == w[1]), "{text}");
        let brackets: Vec<usize> = text.lines().map(|l| l.find("  [").unwrap()).collect();
        assert!(brackets.windows(2).all(|w| w[0] == w[1]), "{text}");
        for f in
            ["layout", "hma", "block_size", "cache_dtype", "memory", "transfer_mode", "kv_groups", "tp_size"]
        {
            assert!(text.lines().any(|l| l.starts_with(f)), "{f} missing: {text}");
        }
    }

    #[test]
    fn adapters_disabled_is_a_conflict_naming_both() {
        let o = EngineOptions { allow_adapters: false, ..opts() };
        let e = negotiate(&dense(), &o, &[flexkv(), nixl()]).unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, Conflict::Layout { requested: None, .. }));
        assert!(s.contains("child 'flexkv' rejects HND (LBHNC)"), "{s}");
        assert!(s.contains("child 'nixl' requires HND (LBHNC)"), "{s}");
        assert!(s.contains("allow adapters (allow_adapters=true)"), "{s}");
        assert!(s.contains("remove child 'flexkv'") && s.contains("remove child 'nixl'"), "{s}");
    }

    #[test]
    fn user_layout_override() {
        // Satisfied directly.
        let o = EngineOptions { kv_cache_layout: Some(KvLayout::HND), ..opts() };
        let n = negotiate(&dense(), &o, &[lmcache(256), nixl()]).unwrap();
        assert_eq!(prov(&n, "layout").decided_by, DecidedBy::User);
        // Not satisfiable: NHD against nixl.
        let o = EngineOptions { kv_cache_layout: Some(KvLayout::NHD), ..opts() };
        let e = negotiate(&dense(), &o, &[lmcache(256), nixl()]).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("kv_cache_layout=NHD (LBNHC) was set, but child 'nixl' does not accept it"),
            "{s}"
        );
        assert!(s.contains("set kv_cache_layout=LBHNC"), "{s}");
        // Satisfied through an adapter.
        let o = EngineOptions { kv_cache_layout: Some(KvLayout::HND), ..opts() };
        let n = negotiate(&dense(), &o, &[flexkv()]).unwrap();
        assert_eq!(n.adapters.len(), 1);
    }

    #[test]
    fn no_common_layout_without_adapters() {
        let nhd_only = child(
            "cache",
            caps(
                false,
                LayoutConstraint { required: vec![KvLayout::NHD], rejected: vec![], preferred: vec![] },
                None,
                TransferMode::None,
            ),
        );
        let e = negotiate(&dense(), &opts(), &[nhd_only, nixl()]).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("no KV layout satisfies every child"), "{s}");
        assert!(s.contains("child 'cache' requires NHD (LBNHC); cannot adapt"), "{s}");
        assert!(s.contains("remove child 'cache' (the others agree on HND (LBHNC))"), "{s}");
    }

    #[test]
    fn fewest_adapters_then_cost() {
        let cheap = |n: &str, cost| {
            child(
                n,
                caps(
                    true,
                    LayoutConstraint { required: vec![KvLayout::BLNHC], rejected: vec![], preferred: vec![] },
                    Some(cost),
                    TransferMode::None,
                ),
            )
        };
        let blh = child(
            "x",
            caps(
                true,
                LayoutConstraint { required: vec![KvLayout::BLHNC], rejected: vec![], preferred: vec![] },
                Some(AdaptCost::High),
                TransferMode::None,
            ),
        );
        // Two children want BLNHC (one adapter if chosen), one wants BLHNC: BLNHC wins.
        let n = negotiate(
            &dense(),
            &opts(),
            &[blh.clone(), cheap("a", AdaptCost::Low), cheap("b", AdaptCost::Low)],
        )
        .unwrap();
        assert_eq!(n.effective.layout, KvLayout::BLNHC);
        assert_eq!(n.adapters.len(), 1);
        // One each: the cheaper adapter wins (x adapts at high cost, a at low cost).
        let n = negotiate(&dense(), &opts(), &[blh, cheap("a", AdaptCost::Low)]).unwrap();
        assert_eq!(n.effective.layout, KvLayout::BLHNC);
        assert_eq!(n.adapters[0].child, "a");
    }

    #[test]
    fn hma_on_with_unsupporting_child() {
        let o = EngineOptions { hybrid_kv_cache_manager: HmaOption::On, ..opts() };
        let e = negotiate(&hybrid(), &o, &[lmcache(256), nixl()]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "hybrid_kv_cache_manager=on was set, but child 'lmcache' does not support the hybrid KV cache manager (child 'nixl' supports it); set hybrid_kv_cache_manager=auto or off, or remove child 'lmcache'"
        );
    }

    #[test]
    fn linear_layers_need_hma() {
        let e = negotiate(&with_linear(), &opts(), &[lmcache(256), nixl()]).unwrap_err();
        assert!(
            matches!(&e, Conflict::HmaRequired { unsupported, user_off: false, .. } if unsupported == &["child 'lmcache'"])
        );
        let s = e.to_string();
        assert!(s.contains("36 state-space/linear-attention layer(s)"), "{s}");
        assert!(
            s.contains(
                "child 'lmcache' does not support the hybrid KV cache manager: remove child 'lmcache'"
            ),
            "{s}"
        );

        let off = EngineOptions { hybrid_kv_cache_manager: HmaOption::Off, ..opts() };
        let e = negotiate(&with_linear(), &off, &[nixl()]).unwrap_err();
        assert!(e.to_string().contains("hybrid_kv_cache_manager=off was set: set it to auto or on"), "{e}");

        // HMA alone is not enough: nixl does not carry the state layers' per-request state.
        let e = negotiate(&with_linear(), &opts(), &[nixl()]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "model 'qwen3_next' keeps per-request state in 36 state-space/linear-attention layer(s) (1 group: linear x36 (state shape not in the config)), which decode needs besides the KV blocks, but child 'nixl' does not carry per-request state (carries_state); nothing would give decode that state. Remedy: use connectors that declare carries_state (none of the built-in ones does yet), or serve this model without disaggregation (remove child 'nixl')"
        );
        let mut carrier = nixl();
        carrier.caps.carries_state = true;
        let n = negotiate(&with_linear(), &opts(), &[carrier]).unwrap();
        assert!(n.effective.hma);
        assert_eq!(prov(&n, "hma").decided_by, DecidedBy::Model);
        assert_eq!(n.effective.state_groups.len(), 1);
        assert_eq!(n.effective.state_groups[0].layers.len(), 36);
        assert_eq!(prov(&n, "state_groups").value, "1 group: linear x36 (state shape not in the config)");
        // The linear layers are in no group; only the 12 full layers are.
        assert_eq!(n.effective.groups.len(), 1);
        assert_eq!(n.effective.groups[0].layers.len(), 12);
    }

    #[test]
    fn mla_needs_declared_support() {
        let n = negotiate(&mla_model(), &opts(), &[lmcache(256)]).unwrap();
        assert_eq!(n.effective.groups.len(), 1);
        let e = negotiate(&mla_model(), &opts(), &[lmcache(256), flexkv()]).unwrap_err();
        assert_eq!(
            e,
            Conflict::MlaUnsupported {
                model: "deepseek_v2".into(),
                unsupported: vec!["child 'flexkv'".into()]
            }
        );
    }

    #[test]
    fn lmcache_chunk_must_be_a_multiple_of_the_block_size() {
        let o = EngineOptions { block_size: Some(48), ..opts() };
        let e = negotiate(&dense(), &o, &[lmcache(256), nixl()]).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("child 'lmcache' has chunk_size 256, which must be a multiple of the block size; block size 48 does not divide 256"),
            "{s}"
        );
        assert!(s.contains("set block_size=16"), "{s}");
        assert!(s.contains("child 'nixl' accepts any block size"), "{s}");
    }

    #[test]
    fn default_block_size_moves_when_it_does_not_fit() {
        let mut c = lmcache(256);
        c.caps.block_size_multiple = 64;
        let n = negotiate(&dense(), &opts(), &[c, nixl()]).unwrap();
        assert_eq!(n.effective.block_size, 64);
        let p = prov(&n, "block_size");
        assert_eq!(p.decided_by, DecidedBy::Child("lmcache".into()));
        assert!(p.reason.contains("the default 16 does not fit"), "{}", p.reason);
        // Only 8 fits: small chunks.
        let n = negotiate(&dense(), &opts(), &[lmcache(8)]).unwrap();
        assert_eq!(n.effective.block_size, 8);
        // A multiple outside the list: lcm.
        let mut c = lmcache(96);
        c.caps.block_size_multiple = 24;
        let n = negotiate(&dense(), &opts(), &[c]).unwrap();
        assert_eq!(n.effective.block_size, 24);
    }

    #[test]
    fn disjoint_block_constraints_are_a_conflict() {
        let mut a = nixl();
        a.caps.block_size_multiple = 32;
        let e = negotiate(&dense(), &opts(), &[a, lmcache(16)]).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("no block size fits every child"), "{s}");
        assert!(s.contains("child 'nixl' needs a multiple of 32"), "{s}");
    }

    #[test]
    fn dtype_and_memory() {
        let mut n = nixl();
        n.caps.cache_dtypes = vec![Dtype::Bf16, Dtype::F16];
        let o = EngineOptions { cache_dtype: Some(Dtype::Fp8E4m3), ..opts() };
        let e = negotiate(&dense(), &o, &[lmcache(256), n.clone()]).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("cache dtype fp8_e4m3 (set by user) is not supported by child 'nixl'"), "{s}");
        assert!(s.contains("set cache_dtype to bf16 or f16"), "{s}");
        let ok = negotiate(&dense(), &opts(), &[n]).unwrap();
        assert_eq!(prov(&ok, "cache_dtype").decided_by, DecidedBy::Model);

        let o = EngineOptions { memory: Some(MemoryKind::Device), ..opts() };
        let e = negotiate(&dense(), &o, &[lmcache(256), nixl()]).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("KV memory device (set by user) is not usable by child 'lmcache', child 'nixl'"),
            "{s}"
        );
        assert!(s.contains("set kv_buffer_device to host memory"), "{s}");
    }

    #[test]
    fn transfer_modes() {
        let mut pusher = nixl();
        pusher.name = "p2p".into();
        pusher.caps.transfer_mode = TransferMode::Push;
        let e = negotiate(&dense(), &opts(), &[nixl(), pusher.clone()]).unwrap_err();
        assert!(e.to_string().contains("child 'nixl' pull"), "{e}");
        let n = negotiate(&dense(), &opts(), &[lmcache(256), pusher]).unwrap();
        assert_eq!(n.effective.transfer_mode, TransferMode::Push);
        let n = negotiate(&dense(), &opts(), &[lmcache(256)]).unwrap();
        assert_eq!(n.effective.transfer_mode, TransferMode::None);
        assert_eq!(prov(&n, "transfer_mode").decided_by, DecidedBy::Default);
    }

    #[test]
    fn bad_options_and_caps_are_errors() {
        let e = negotiate(&dense(), &EngineOptions { block_size: Some(0), ..opts() }, &[nixl()]).unwrap_err();
        assert!(e.to_string().starts_with("engine option block_size=0 is invalid"), "{e}");
        let e = negotiate(&dense(), &EngineOptions { tp_size: 2, tp_rank: 2, ..opts() }, &[]).unwrap_err();
        assert!(e.to_string().contains("tp_rank=2"), "{e}");
        let mut bad = nixl();
        bad.caps.block_size_multiple = 0;
        let e = negotiate(&dense(), &opts(), &[bad]).unwrap_err();
        assert!(
            e.to_string().starts_with("child 'nixl' declares invalid capabilities: block_size_multiple is 0"),
            "{e}"
        );
    }

    #[test]
    fn no_children() {
        let n = negotiate(&hybrid(), &opts(), &[]).unwrap();
        assert_eq!(n.effective.layout, KvLayout::LBHNC);
        assert!(n.effective.hma);
        assert_eq!(n.effective.block_size, 16);
    }

    #[test]
    fn layouts_are_tried_in_a_fixed_order() {
        // The fallback preference order is KvLayout::all(): ascending, so stable across builds.
        let all = all_layouts();
        assert_eq!(all.len(), 120);
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(all[0].canonical_name(), "LBHNC");
        let c = preference_order(&[], true);
        assert_eq!(c[..4], KvLayout::COMMON);
        assert_eq!(c.len(), 120);
    }

    #[test]
    fn option_strings() {
        assert_eq!("ON".parse::<HmaOption>().unwrap(), HmaOption::On);
        assert_eq!("false".parse::<HmaOption>().unwrap(), HmaOption::Off);
        let e = "maybe".parse::<HmaOption>().unwrap_err().to_string();
        assert_eq!(
            e,
            "hybrid_kv_cache_manager: 'maybe' is not a valid value; expected auto, on or off (or true/false)"
        );
        assert_eq!(EngineOptions::memory_from_kv_buffer_device("cuda").unwrap(), MemoryKind::Device);
        assert!(EngineOptions::memory_from_kv_buffer_device("tpu?").is_err());
        let o: EngineOptions =
            serde_json::from_str(r#"{"hybrid_kv_cache_manager":"off","kv_cache_layout":"HND"}"#).unwrap();
        assert_eq!(o.hybrid_kv_cache_manager, HmaOption::Off);
        assert_eq!(o.kv_cache_layout, Some(KvLayout::LBHNC));
        assert_eq!(o.tp_size, 1);
        assert!(o.allow_adapters);
    }
}
