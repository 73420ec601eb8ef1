//! What negotiation gives: the effective layout, every field with who decided it and why,
//! and the children that adapt.

use crate::caps::AdaptCost;
use crate::layout::{EffectiveLayout, KvLayout};
use serde::{Deserialize, Serialize};
use std::fmt;

use super::options::ChildCaps;

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

/// A field of the negotiated result or of a compatibility diff. On the wire and in messages
/// it is the snake_case name (`layout`, `hma`, `block_size`, ...), so descriptors, diffs and
/// their hashes read as they did when the field was a string.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum LayoutField {
    /// The model (its config.json fingerprint).
    Model,
    /// The KV layout.
    Layout,
    /// The hybrid KV cache manager.
    Hma,
    /// Tokens per block.
    BlockSize,
    /// The cache dtype.
    CacheDtype,
    /// Where the KV cache lives.
    Memory,
    /// Pull, push or none.
    TransferMode,
    /// The KV cache groups.
    KvGroups,
    /// The state groups of state-space / linear-attention layers.
    StateGroups,
    /// The tensor-parallel size.
    TpSize,
    /// Whether the engine's in-block order is private (blocks move whole only).
    OpaqueBlocks,
    /// A name this build does not know, from a newer peer: kept as sent.
    Other(String),
}

impl LayoutField {
    /// Every field this build knows, in the order negotiation reports them.
    pub const KNOWN: [LayoutField; 11] = [
        LayoutField::Model,
        LayoutField::Layout,
        LayoutField::Hma,
        LayoutField::BlockSize,
        LayoutField::CacheDtype,
        LayoutField::Memory,
        LayoutField::TransferMode,
        LayoutField::KvGroups,
        LayoutField::StateGroups,
        LayoutField::TpSize,
        LayoutField::OpaqueBlocks,
    ];

    /// The field's name (`block_size`).
    pub fn as_str(&self) -> &str {
        match self {
            LayoutField::Model => "model",
            LayoutField::Layout => "layout",
            LayoutField::Hma => "hma",
            LayoutField::BlockSize => "block_size",
            LayoutField::CacheDtype => "cache_dtype",
            LayoutField::Memory => "memory",
            LayoutField::TransferMode => "transfer_mode",
            LayoutField::KvGroups => "kv_groups",
            LayoutField::StateGroups => "state_groups",
            LayoutField::TpSize => "tp_size",
            LayoutField::OpaqueBlocks => "opaque_blocks",
            LayoutField::Other(name) => name,
        }
    }
}

impl From<&str> for LayoutField {
    fn from(name: &str) -> Self {
        LayoutField::KNOWN
            .into_iter()
            .find(|f| f.as_str() == name)
            .unwrap_or_else(|| LayoutField::Other(name.to_owned()))
    }
}

impl From<String> for LayoutField {
    fn from(name: String) -> Self {
        match LayoutField::from(name.as_str()) {
            LayoutField::Other(_) => LayoutField::Other(name),
            known => known,
        }
    }
}

impl From<LayoutField> for String {
    fn from(f: LayoutField) -> Self {
        match f {
            LayoutField::Other(name) => name,
            known => known.as_str().to_owned(),
        }
    }
}

impl fmt::Display for LayoutField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `pad`, so that `{:<12}` aligns columns.
        f.pad(self.as_str())
    }
}

impl PartialEq<str> for LayoutField {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for LayoutField {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// A field of the negotiated result, its value, who decided it and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldProvenance {
    /// `layout`, `hma`, `block_size`, `cache_dtype`, `memory`, `transfer_mode`, `kv_groups`,
    /// `state_groups` or `tp_size`.
    pub field: LayoutField,
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
    /// The provenance of one field, by [`LayoutField`] or by name.
    pub fn provenance_of<F>(&self, field: F) -> Option<&FieldProvenance>
    where
        LayoutField: PartialEq<F>,
    {
        self.provenance.iter().find(|p| p.field == field)
    }

    /// One aligned line per field: `layout        = HND (LBHNC)  [child nixl]  child 'nixl' requires ...`.
    pub fn explain(&self) -> String {
        let by: Vec<String> = self.provenance.iter().map(|p| format!("[{}]", p.decided_by)).collect();
        let fw = self.provenance.iter().map(|p| p.field.as_str().len()).max().unwrap_or(0);
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
