//! A child as one run of the core sees it, and what it accepts.

use crate::caps::{AdaptCost, Capabilities};
use crate::layout::KvLayout;

use super::conflict::ChildConstraint;
use super::outcome::DecidedBy;

/// A child as one run of the core sees it: one of this worker's own, or the peer's.
#[derive(Clone)]
pub(super) struct Party<'a> {
    pub(super) name: &'a str,
    /// How messages name it (`child 'nixl'`, `decode child 'flexkv'`).
    pub(super) label: String,
    pub(super) own: bool,
    pub(super) caps: &'a Capabilities,
    pub(super) may_adapt: bool,
    /// KV heads per layer of the model: with one, layouts that differ only in where the
    /// head axis sits are the same bytes.
    pub(super) heads: u32,
}

impl Party<'_> {
    /// Takes `layout` without adapting: it accepts it, or one with the same bytes.
    pub(super) fn accepts(&self, layout: KvLayout) -> bool {
        self.caps.layout.accepts_with_heads(layout, self.heads)
    }

    /// Takes `layout` only because, with one KV head, a layout it accepts has the same bytes.
    pub(super) fn accepts_only_as_same_bytes(&self, layout: KvLayout) -> bool {
        !self.caps.layout.accepts(layout) && self.accepts(layout)
    }

    pub(super) fn decided_by(&self) -> DecidedBy {
        if self.own {
            DecidedBy::Child(self.name.to_owned())
        } else {
            DecidedBy::Peer(self.name.to_owned())
        }
    }

    pub(super) fn can_adapt(&self) -> Option<AdaptCost> {
        if self.may_adapt {
            self.caps.adapt
        } else {
            None
        }
    }

    pub(super) fn layout_constraint(&self) -> String {
        let adapt = match (self.caps.adapt, self.may_adapt) {
            (None, _) => "cannot adapt".to_owned(),
            (Some(c), true) => format!("can adapt at {} cost", c),
            (Some(c), false) => format!("could adapt at {} cost, but adapters are disabled", c),
        };
        format!("{}; {}", self.caps.layout.describe(), adapt)
    }

    pub(super) fn block_ok(&self, b: u32) -> bool {
        let m = self.caps.block_size_multiple.max(1);
        b.is_multiple_of(m) && self.caps.block_size_divides.is_none_or(|d| b != 0 && d.is_multiple_of(b))
    }

    pub(super) fn block_constraint(&self) -> String {
        let m = self.caps.block_size_multiple.max(1);
        match (m, self.caps.block_size_divides) {
            (1, None) => "accepts any block size".to_owned(),
            (m, None) => format!("needs a multiple of {m}"),
            (1, Some(d)) => format!("needs a divisor of {d} (its chunk size)"),
            (m, Some(d)) => format!("needs a multiple of {m} that divides {d} (its chunk size)"),
        }
    }

    /// Why `b` does not fit, naming the child and both numbers; `None` when it fits.
    pub(super) fn block_violation(&self, b: u32) -> Option<String> {
        let m = self.caps.block_size_multiple.max(1);
        let mut why = Vec::new();
        if !b.is_multiple_of(m) {
            why.push(format!("{} needs a block size that is a multiple of {m}; {b} is not", self.label));
        }
        if let Some(d) = self.caps.block_size_divides {
            if b == 0 || d % b != 0 {
                why.push(format!(
                    "{} has chunk_size {d}, which must be a multiple of the block size; block size {b} does \
                        not divide {d}",
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

/// Every party's constraint on one field, as a conflict lists them.
pub(super) fn constraints<'p, 'a: 'p>(
    parties: impl IntoIterator<Item = &'p Party<'a>>,
    constraint: impl Fn(&Party) -> String,
) -> Vec<ChildConstraint> {
    parties
        .into_iter()
        .map(|p| ChildConstraint { child: p.label.clone(), constraint: constraint(p) })
        .collect()
}

pub(super) fn labels(parties: &[&Party]) -> Vec<String> {
    parties.iter().map(|p| p.label.clone()).collect()
}
