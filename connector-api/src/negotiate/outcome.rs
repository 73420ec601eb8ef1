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
