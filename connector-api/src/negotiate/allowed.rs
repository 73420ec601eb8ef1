//! A field whose value every child it concerns must allow (the cache dtype, the KV memory
//! kind): one check, one remedy and one conflict shape for all of them.

use std::fmt;

use super::conflict::{them, ChildConstraint, Conflict};
use super::decide::Decided;
use super::outcome::DecidedBy;
use super::party::{constraints, labels, Party};

/// What a refused value gives the field's own [`Conflict`] variant.
pub(super) struct Refusal {
    /// The value, in words.
    pub(super) value: String,
    /// Where it came from (`set by user`, `default`, ...).
    pub(super) source_of: String,
    /// The children that do not allow it.
    pub(super) violators: Vec<String>,
    /// Every child's constraint on the field.
    pub(super) constraints: Vec<ChildConstraint>,
    /// What to change.
    pub(super) remedy: String,
}

/// The rules of one such field.
pub(super) struct AllowedValue<T: 'static> {
    /// Every value, in the order a remedy names the shared ones.
    pub(super) values: &'static [T],
    /// Whether a child allows a value.
    pub(super) allows: fn(&Party, &T) -> bool,
    /// A child's constraint, in words (`stores bf16, f16`).
    pub(super) describe: fn(&Party) -> String,
    /// The field in words, for children that share no value (`cache dtype`).
    pub(super) noun: &'static str,
    /// The setting a remedy asks for, given the shared values (`cache_dtype to bf16 or f16`).
    pub(super) setting: fn(&str) -> String,
    /// Where a value decided by this one came from, in words.
    pub(super) source_of: fn(&DecidedBy) -> &'static str,
    /// The field's conflict.
    pub(super) refuse: fn(Refusal) -> Conflict,
}

impl<T: fmt::Display> AllowedValue<T> {
    /// `chosen` when every one of `parties` allows it, else the conflict naming those that do
    /// not, every party's constraint, and the values they all allow.
    pub(super) fn check(&self, chosen: Decided<T>, parties: &[&Party]) -> Result<Decided<T>, Conflict> {
        let violators: Vec<&Party> =
            parties.iter().copied().filter(|p| !(self.allows)(p, &chosen.value)).collect();
        if violators.is_empty() {
            return Ok(chosen);
        }
        let common: Vec<String> = self
            .values
            .iter()
            .filter(|v| parties.iter().all(|p| (self.allows)(p, v)))
            .map(|v| v.to_string())
            .collect();
        let remove = them(&labels(&violators));
        let remedy = if common.is_empty() {
            format!("the children share no {}: remove {remove}", self.noun)
        } else {
            format!("set {}, or remove {remove}", (self.setting)(&common.join(" or ")))
        };
        Err((self.refuse)(Refusal {
            value: chosen.value.to_string(),
            source_of: (self.source_of)(&chosen.by).to_owned(),
            violators: labels(&violators),
            constraints: constraints(parties.iter().copied(), self.describe),
            remedy,
        }))
    }
}

/// `a, b, c`.
pub(super) fn joined<T: fmt::Display>(values: &[T]) -> String {
    values.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", ")
}
