//! Compatibility of two workers' negotiated layouts: the descriptor each side sends at
//! handshake, its hash, a field-level diff that carries both sides' provenance, and the
//! adaptation plan the receiver applies when the sides differ only in adaptable fields.
//!
//! Strict fields (model, cache dtype, KV cache groups, state groups, transfer mode) must be
//! equal; the compat hash covers exactly these. Adaptable fields (layout, block size, TP size) may
//! differ when the receiver can convert: any layout by a permutation of dimensions, block
//! sizes when one divides the other, TP sizes when one divides the other and the transports
//! on both sides declare `heterogeneous_tp` (otherwise they must be equal). HMA is
//! compared through the KV cache groups it produces, so HMA on and off on a model with one
//! attention kind are compatible. Adaptations combined with tensor parallelism or with a
//! model's per-request state need the children on both sides to support the combination
//! ([`Limits`]); a pair that would need one they lack is refused like any other blocking
//! difference, naming those children.

use crate::caps::{Capabilities, TransferMode};
use crate::layout::{EffectiveLayout, KvGroup, KvLayout, StateGroup};
use crate::math::divisible_ratio;
use crate::model::{Dtype, ModelSpec};
use crate::negotiate::{
    describe_groups_with, describe_state_groups, loads_across_tp, ChildCaps, EngineOptions, FieldProvenance,
    LayoutField, Negotiated,
};
use crate::negotiate::{tp_exchangeable, tp_refusal};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;

/// Bumped when the set or encoding of the hashed fields changes, so old and new peers
/// never compare equal by accident.
const HASH_SCHEMA: &str = "kvconnect.compat.v1";

/// What a worker tells its peer about its KV cache, at handshake and in `kvconnect plan`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompatDescriptor {
    /// `ModelSpec::fingerprint()`: the model's KV geometry.
    pub model_fingerprint: String,
    /// The model's name, for messages.
    pub model_name: String,
    /// The negotiated layout.
    pub effective: EffectiveLayout,
    /// KV heads per layer (`ModelSpec::num_kv_heads`; 1 for MLA). With one head on both
    /// sides, layouts that differ only in where the head axis sits are the same bytes and
    /// are neither a difference nor a permutation. Not hashed (the model fingerprint covers
    /// it); 0, as from an older peer, compares layouts as they are.
    #[serde(default)]
    pub kv_heads: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// This worker's tensor-parallel rank.
    pub tp_rank: u32,
    /// Whether this worker's transport moves KV to or from a peer with another `tp_size`
    /// (every child that moves KV between engines declares `heterogeneous_tp`). Not hashed;
    /// a descriptor without it (an older peer) is taken to need equal TP sizes.
    #[serde(default)]
    pub heterogeneous_tp: bool,
    /// Which combinations of adaptations this worker's children lack (not hashed). A
    /// descriptor without it (an older peer) is taken to lack every one.
    #[serde(default = "Limits::undescribed")]
    pub limits: Limits,
    /// (name, version) of each child connector; informational, not hashed.
    pub connectors: Vec<(String, String)>,
    /// Provenance of the negotiated fields, for diffs; not hashed.
    pub provenance: Vec<FieldProvenance>,
}

/// The combinations of adaptations a worker's children do not support, each with the
/// children that lack it, as messages name them (`child 'nixl'`). Empty lists: no limit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Children that carry per-request state only at TP 1 (no `state_with_tp`).
    pub no_state_with_tp: Vec<String>,
    /// Children moving KV between engines that adapt blocks only when both sides run TP 1
    /// (no `adapts_with_tp`).
    pub no_adapts_with_tp: Vec<String>,
    /// Children that move per-request state only beside blocks copied as they are (no
    /// `adapts_with_state`).
    pub no_adapts_with_state: Vec<String>,
}

impl Limits {
    /// The limits of a worker with these children.
    pub fn of(children: &[ChildCaps]) -> Limits {
        let lacking = |movers_only: bool, has: fn(&Capabilities) -> bool| -> Vec<String> {
            children
                .iter()
                .filter(|c| !movers_only || c.caps.transfer_mode != TransferMode::None)
                .filter(|c| !has(&c.caps))
                .map(|c| format!("child '{}'", c.name))
                .collect()
        };
        Limits {
            no_state_with_tp: lacking(false, |c| c.state_with_tp),
            no_adapts_with_tp: lacking(true, |c| c.adapts_with_tp),
            no_adapts_with_state: lacking(false, |c| c.adapts_with_state),
        }
    }

    /// What a descriptor that does not describe its limits (an older peer's) is taken to
    /// have: every limit, imposed by connectors it does not name.
    pub fn undescribed() -> Limits {
        let who = || vec!["the connectors of a peer that does not describe its limits".to_owned()];
        Limits { no_state_with_tp: who(), no_adapts_with_tp: who(), no_adapts_with_state: who() }
    }
}

/// The hashed part of a descriptor. A struct (never a map) so the JSON field order is fixed.
#[derive(Serialize)]
struct StrictFields<'a> {
    schema: &'static str,
    model_fingerprint: &'a str,
    cache_dtype: Dtype,
    kv_groups: &'a [KvGroup],
    /// Left out when empty, so models without state layers hash as they always have.
    #[serde(skip_serializing_if = "<[StateGroup]>::is_empty")]
    state_groups: &'a [StateGroup],
    transfer_mode: TransferMode,
    /// Left out when false, so engines over known layouts hash as they always have.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    opaque_blocks: bool,
}

impl CompatDescriptor {
    /// The descriptor of a worker that negotiated `n` for `model` with `opts`.
    pub fn new(model: &ModelSpec, n: &Negotiated, opts: &EngineOptions) -> Self {
        CompatDescriptor {
            model_fingerprint: model.fingerprint(),
            model_name: model.name.clone(),
            effective: n.effective.clone(),
            kv_heads: model.num_kv_heads,
            tp_size: opts.tp_size,
            tp_rank: opts.tp_rank,
            heterogeneous_tp: loads_across_tp(n.children.iter().map(|c| &c.caps)),
            limits: Limits::of(&n.children),
            connectors: n.children.iter().map(|c| (c.name.clone(), c.version.clone())).collect(),
            provenance: n.provenance.clone(),
        }
    }

    /// The canonical JSON of the strict fields, exactly what [`Self::compat_hash`] hashes.
    pub fn strict_json(&self) -> String {
        let strict = StrictFields {
            schema: HASH_SCHEMA,
            model_fingerprint: &self.model_fingerprint,
            cache_dtype: self.effective.cache_dtype,
            kv_groups: &self.effective.groups,
            state_groups: &self.effective.state_groups,
            transfer_mode: self.effective.transfer_mode,
            opaque_blocks: self.effective.opaque_blocks,
        };
        // Structs, enums, strings and integers only: serialising cannot fail; an empty
        // string would still hash to a value no real descriptor produces.
        serde_json::to_string(&strict).unwrap_or_default()
    }

    /// Hex SHA-256 of the canonical JSON of the strict fields. Two workers whose hashes
    /// match can exchange KV, possibly through an [`AdaptationPlan`].
    pub fn compat_hash(&self) -> String {
        let digest = Sha256::digest(self.strict_json().as_bytes());
        let mut s = String::with_capacity(64);
        for b in digest {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
        s
    }

    fn why(&self, field: LayoutField) -> String {
        self.provenance
            .iter()
            .find(|p| p.field == field)
            .map(|p| p.why())
            .unwrap_or_else(|| "no provenance sent".to_owned())
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Whether a field must be equal or can be converted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FieldClass {
    /// Must be equal on both sides.
    Strict,
    /// May differ when the receiver can convert.
    Adaptable,
}

/// One field that differs between two descriptors, with both sides' values and reasons.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldDiff {
    /// `model`, `cache_dtype`, `hma`, `kv_groups`, `state_groups`, `transfer_mode`,
    /// `layout`, `block_size` or `tp_size`.
    pub field: LayoutField,
    /// Strict or adaptable.
    pub class: FieldClass,
    /// This side's value.
    pub local: String,
    /// Why this side has it.
    pub local_why: String,
    /// The peer's value.
    pub peer: String,
    /// Why the peer has it.
    pub peer_why: String,
    /// What to change (or, for an adaptable field, what the receiver does).
    pub remedy: String,
    /// More detail, e.g. both sides' KV cache groups for `hma`.
    #[serde(default)]
    pub detail: String,
}

impl FieldDiff {
    /// `hma: prefill=off (child 'lmcache' ...), decode=on (default: ...): <remedy>`.
    pub fn line(&self, local_role: &str, peer_role: &str) -> String {
        format!(
            "{}: {local_role}={} ({}), {peer_role}={} ({}): {}",
            self.field, self.local, self.local_why, self.peer, self.peer_why, self.remedy
        )
    }
}

/// A permutation of the five logical KV dimensions the receiver applies to what it reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutPermutation {
    /// The sender's layout.
    pub from: KvLayout,
    /// The receiver's layout.
    pub to: KvLayout,
    /// `perm[i]` is the axis of `from` that becomes axis `i` of `to` (numpy's
    /// `transpose(perm)` over the `[.., .., .., .., ..]` order of `from`).
    pub perm: [usize; 5],
}

impl LayoutPermutation {
    /// The permutation that turns `from` into `to`.
    pub fn between(from: KvLayout, to: KvLayout) -> Self {
        let mut perm = [0usize; 5];
        for (i, d) in to.order().iter().enumerate() {
            perm[i] = from.position(*d);
        }
        LayoutPermutation { from, to, perm }
    }
}

/// What the receiver does so two compatible descriptors can exchange KV. All `None` when
/// the adaptable fields are equal.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdaptationPlan {
    /// Permute the sender's layout into the receiver's.
    pub layout: Option<LayoutPermutation>,
    /// (receiver, sender) block sizes, reduced: `(1, 2)` means each sender block fills two
    /// receiver blocks.
    pub block_size_ratio: Option<(u32, u32)>,
    /// (receiver, sender) TP sizes, reduced.
    pub tp_ratio: Option<(u32, u32)>,
}

impl AdaptationPlan {
    /// True when nothing needs converting.
    pub fn is_identity(&self) -> bool {
        self.layout.is_none() && self.block_size_ratio.is_none() && self.tp_ratio.is_none()
    }
}

/// Two descriptors that cannot exchange KV: the strict fields that differ and the
/// adaptable ones that cannot be converted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{}", render(.diffs, .local_role, .peer_role))]
pub struct Incompatible {
    /// The differences that block the exchange.
    pub diffs: Vec<FieldDiff>,
    /// How messages name the local side (`prefill`, `local`).
    pub local_role: String,
    /// How messages name the peer (`decode`, `peer`).
    pub peer_role: String,
}

impl Incompatible {
    /// The message with other role names, e.g. `render("decode", "prefill")` for a check
    /// made as local/peer on the decode side. Role names inside remedies are renamed too.
    pub fn render(&self, local_role: &str, peer_role: &str) -> String {
        let diffs: Vec<FieldDiff> = self
            .diffs
            .iter()
            .map(|d| FieldDiff {
                remedy: rename_roles(&d.remedy, [&self.local_role, &self.peer_role], [local_role, peer_role]),
                detail: rename_roles(&d.detail, [&self.local_role, &self.peer_role], [local_role, peer_role]),
                ..d.clone()
            })
            .collect();
        render(&diffs, local_role, peer_role)
    }

    /// The diff that names `field` (a [`LayoutField`] or its name), if any.
    pub fn diff_of<F>(&self, field: F) -> Option<&FieldDiff>
    where
        LayoutField: PartialEq<F>,
    {
        self.diffs.iter().find(|d| d.field == field)
    }
}

/// Replaces whole words `from[i]` by `to[i]` in one pass, so swapping names works.
fn rename_roles(text: &str, from: [&str; 2], to: [&str; 2]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        match from.iter().position(|f| *f == word.as_str()) {
            Some(i) => out.push_str(to[i]),
            None => out.push_str(word),
        }
        word.clear();
    };
    for ch in text.chars() {
        if ch.is_alphanumeric() || ch == '_' || ch == '-' {
            word.push(ch);
        } else {
            flush(&mut word, &mut out);
            out.push(ch);
        }
    }
    flush(&mut word, &mut out);
    out
}

fn render(diffs: &[FieldDiff], a: &str, b: &str) -> String {
    let mut s = format!(
        "{a} and {b} cannot exchange KV ({} field{} differ{}); refused before any KV moves:",
        diffs.len(),
        if diffs.len() == 1 { "" } else { "s" },
        if diffs.len() == 1 { "s" } else { "" }
    );
    for d in diffs {
        s.push_str("\n  ");
        s.push_str(&d.line(a, b));
        if !d.detail.is_empty() {
            s.push_str("\n    ");
            s.push_str(&d.detail);
        }
    }
    s
}

/// The head count both descriptors agree on, or 0 (compare layouts exactly) when they do not.
fn shared_heads(a: &CompatDescriptor, b: &CompatDescriptor) -> u32 {
    if a.kv_heads == b.kv_heads && a.model_fingerprint == b.model_fingerprint {
        a.kv_heads
    } else {
        0
    }
}

/// Whether two descriptors' layouts put the same bytes in the same places.
fn same_layout_bytes(a: &CompatDescriptor, b: &CompatDescriptor) -> bool {
    a.effective.layout.same_bytes(b.effective.layout, shared_heads(a, b))
}

/// Why two descriptors with different layouts need no permutation between them, when that
/// is so: [`KvLayout::one_head_note`] of the sender's and the receiver's layouts.
pub fn same_bytes_note(sender: &CompatDescriptor, receiver: &CompatDescriptor) -> Option<String> {
    let (s, r) = (sender.effective.layout, receiver.effective.layout);
    (s != r && same_layout_bytes(sender, receiver)).then(|| s.one_head_note(r))
}

/// The children of `a` (on `ar`) and `b` (on `br`) that one limit names, each once:
/// `child 'nixl' (prefill and decode)`, `child 'x' on decode`.
fn limited_by(a: &[String], b: &[String], ar: &str, br: &str) -> String {
    let mut out: Vec<String> = a
        .iter()
        .map(|l| if b.contains(l) { format!("{l} ({ar} and {br})") } else { format!("{l} on {ar}") })
        .collect();
    out.extend(b.iter().filter(|l| !a.contains(l)).map(|l| format!("{l} on {br}")));
    out.join(", ")
}

/// Why the adaptation `field` needs between `a` and `b` cannot be combined with their
/// tensor-parallel ranks or with the model's per-request state, naming the children that
/// lack the combination and the remedy; `None` when no such combination is needed or both
/// sides support it. For `tp_size` the adaptation is moving state across ranks at all.
fn combination_refusal(
    field: &LayoutField,
    a: &CompatDescriptor,
    b: &CompatDescriptor,
    ar: &str,
    br: &str,
) -> Option<String> {
    let (ea, eb) = (&a.effective, &b.effective);
    let state = !ea.state_groups.is_empty() || !eb.state_groups.is_empty();
    let ranks = a.tp_size > 1 || b.tp_size > 1;
    let sizes = format!("tp_size {} on {ar} and {} on {br}", a.tp_size, b.tp_size);
    let who = |f: fn(&Limits) -> &Vec<String>| limited_by(f(&a.limits), f(&b.limits), ar, br);
    let (what, remedy) = match field {
        LayoutField::TpSize => {
            let who = who(|l| &l.no_state_with_tp);
            return (state && ranks && !who.is_empty()).then(|| {
                format!(
                    "the model's state layers keep a per-request state, and moving it with {sizes} is not \
                        supported by {who} (no state_with_tp): run {ar} and {br} with tp_size=1"
                )
            });
        }
        LayoutField::BlockSize => {
            let (x, y) = divisible_ratio(ea.block_size, eb.block_size)?;
            (
                format!("blocks would be split or merged in a {x}:{y} ratio"),
                format!("set block_size to the same value on {ar} and {br}"),
            )
        }
        LayoutField::Layout => (
            format!(
                "the receiver would permute the blocks ({} and {})",
                ea.layout.canonical_name(),
                eb.layout.canonical_name()
            ),
            format!("set kv_cache_layout={} on both", ea.layout.canonical_name()),
        ),
        _ => return None,
    };
    if ea.opaque_blocks || eb.opaque_blocks {
        return None;
    }
    let tp_who = who(|l| &l.no_adapts_with_tp);
    if ranks && !tp_who.is_empty() {
        return Some(format!(
            "{what} with {sizes}, which is not supported by {tp_who} (no adapts_with_tp: across \
                tensor-parallel ranks blocks are copied as they are): {remedy}"
        ));
    }
    let state_who = who(|l| &l.no_adapts_with_state);
    (state && !state_who.is_empty()).then(|| {
        format!(
            "{what} beside the per-request state of the model's state layers, which is not supported by \
                {state_who} (no adapts_with_state): {remedy}"
        )
    })
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

fn diff_named(a: &CompatDescriptor, b: &CompatDescriptor, ar: &str, br: &str) -> Vec<FieldDiff> {
    let pair = Pair { a, b, ar, br };
    FIELD_CHECKS.iter().filter_map(|check| check(&pair)).collect()
}

/// Two descriptors and the names of their sides (`prefill`, `decode`), as the field checks
/// see them.
struct Pair<'a> {
    a: &'a CompatDescriptor,
    b: &'a CompatDescriptor,
    ar: &'a str,
    br: &'a str,
}

impl Pair<'_> {
    fn same_model(&self) -> bool {
        self.a.model_fingerprint == self.b.model_fingerprint
    }

    /// Opaque blocks (an engine-private in-block order) move whole: nothing about them adapts.
    fn opaque(&self) -> bool {
        self.a.effective.opaque_blocks || self.b.effective.opaque_blocks
    }

    /// A difference in `field`, each side's reason being the one its negotiation recorded.
    fn diff(
        &self,
        field: LayoutField,
        class: FieldClass,
        values: (String, String),
        remedy: String,
    ) -> FieldDiff {
        let (local, peer) = values;
        let (local_why, peer_why) = (self.a.why(field.clone()), self.b.why(field.clone()));
        FieldDiff { field, class, local, local_why, peer, peer_why, remedy, detail: String::new() }
    }

    /// The remedy for an adaptable field of opaque blocks.
    fn opaque_remedy(&self, field: &str) -> String {
        format!(
            "opaque blocks move whole, never adapted: set the same {field} on {} and {}",
            self.ar, self.br
        )
    }
}

/// One field's check: the difference, or `None` when the field does not differ (or another
/// check already says it).
type FieldCheck = fn(&Pair) -> Option<FieldDiff>;

/// The field checks, strict fields first, in the order a diff lists them.
const FIELD_CHECKS: &[FieldCheck] = &[
    model_differs,
    cache_dtype_differs,
    groups_differ,
    state_groups_differ,
    transfer_mode_differs,
    opaque_blocks_differ,
    layout_differs,
    block_size_differs,
    tp_size_differs,
];

fn model_differs(p: &Pair) -> Option<FieldDiff> {
    if p.same_model() {
        return None;
    }
    let short = |d: &CompatDescriptor| {
        format!("{} ({})", d.model_name, d.model_fingerprint.get(..12).unwrap_or(&d.model_fingerprint))
    };
    let why = "from its config.json".to_owned();
    Some(FieldDiff {
        field: LayoutField::Model,
        class: FieldClass::Strict,
        local: short(p.a),
        local_why: why.clone(),
        peer: short(p.b),
        peer_why: why,
        remedy: format!("serve the same model (the same config.json) on {} and {}", p.ar, p.br),
        detail: String::new(),
    })
}

fn cache_dtype_differs(p: &Pair) -> Option<FieldDiff> {
    let (ea, eb) = (&p.a.effective, &p.b.effective);
    (ea.cache_dtype != eb.cache_dtype).then(|| {
        p.diff(
            LayoutField::CacheDtype,
            FieldClass::Strict,
            (ea.cache_dtype.to_string(), eb.cache_dtype.to_string()),
            format!("set cache_dtype to the same value on {} and {}", p.ar, p.br),
        )
    })
}

/// KV cache groups follow from the model: when the models differ, the model diff says it
/// all. Groups that differ because HMA does are the `hma` field's difference.
fn groups_differ(p: &Pair) -> Option<FieldDiff> {
    let (ea, eb, ar, br) = (&p.a.effective, &p.b.effective, p.ar, p.br);
    if !p.same_model() || ea.groups == eb.groups {
        return None;
    }
    let (ga, gb) = (describe_groups_with(&ea.groups, ea.hma), describe_groups_with(&eb.groups, eb.hma));
    if ea.hma == eb.hma {
        let remedy =
            format!("negotiate {ar} and {br} together (kvconnect plan) so they get the same KV cache groups");
        return Some(p.diff(LayoutField::KvGroups, FieldClass::Strict, (ga, gb), remedy));
    }
    let on = if ea.hma { ar } else { br };
    let remedy = format!("run {on} with the same connector set, or set hybrid_kv_cache_manager=off on {on}");
    let values = (on_off(ea.hma).to_owned(), on_off(eb.hma).to_owned());
    let diff = p.diff(LayoutField::Hma, FieldClass::Strict, values, remedy);
    Some(FieldDiff { detail: format!("kv groups: {ar} {ga}; {br} {gb}"), ..diff })
}

/// State groups follow from the model too; they differ only with a peer that does not
/// describe them.
fn state_groups_differ(p: &Pair) -> Option<FieldDiff> {
    let (ea, eb) = (&p.a.effective, &p.b.effective);
    (p.same_model() && ea.state_groups != eb.state_groups).then(|| {
        p.diff(
            LayoutField::StateGroups,
            FieldClass::Strict,
            (describe_state_groups(&ea.state_groups), describe_state_groups(&eb.state_groups)),
            format!(
                "run the same kvconnect version on {} and {}, with connectors that carry the per-request \
                    state of the state layers",
                p.ar, p.br
            ),
        )
    })
}

fn transfer_mode_differs(p: &Pair) -> Option<FieldDiff> {
    let (ea, eb) = (&p.a.effective, &p.b.effective);
    (ea.transfer_mode != eb.transfer_mode).then(|| {
        p.diff(
            LayoutField::TransferMode,
            FieldClass::Strict,
            (ea.transfer_mode.to_string(), eb.transfer_mode.to_string()),
            format!("use the same transport connector (e.g. nixl) on {} and {}", p.ar, p.br),
        )
    })
}

fn opaque_blocks_differ(p: &Pair) -> Option<FieldDiff> {
    let (ea, eb, ar, br) = (&p.a.effective, &p.b.effective, p.ar, p.br);
    if ea.opaque_blocks == eb.opaque_blocks {
        return None;
    }
    let name = |o: bool| if o { "opaque" } else { "known layout" }.to_owned();
    let which = if ea.opaque_blocks { ar } else { br };
    let why = "from the engine backend".to_owned();
    Some(FieldDiff {
        field: LayoutField::OpaqueBlocks,
        class: FieldClass::Strict,
        local: name(ea.opaque_blocks),
        local_why: why.clone(),
        peer: name(eb.opaque_blocks),
        peer_why: why,
        remedy: format!(
            "{which}'s engine backend keeps its in-block order private, so its blocks cannot be re-laid-out \
                for the other side: run the same engine backend on {ar} and {br}"
        ),
        detail: String::new(),
    })
}

/// Layout and block size adapt, unless the blocks are opaque.
fn adaptable(p: &Pair) -> FieldClass {
    if p.opaque() {
        FieldClass::Strict
    } else {
        FieldClass::Adaptable
    }
}

fn layout_differs(p: &Pair) -> Option<FieldDiff> {
    let (a, b, ea, eb) = (p.a, p.b, &p.a.effective, &p.b.effective);
    if same_layout_bytes(a, b) {
        return None;
    }
    let remedy = if p.opaque() {
        p.opaque_remedy("kv_cache_layout")
    } else if let Some(refusal) = combination_refusal(&LayoutField::Layout, a, b, p.ar, p.br) {
        refusal
    } else {
        let perm = LayoutPermutation::between(eb.layout, ea.layout);
        format!(
            "the receiver permutes the blocks (axes {:?} of {} give {}); to avoid the extra pass set \
                kv_cache_layout={} on both",
            perm.perm,
            perm.from.canonical_name(),
            perm.to.canonical_name(),
            ea.layout.canonical_name()
        )
    };
    Some(p.diff(
        LayoutField::Layout,
        adaptable(p),
        (ea.layout.display_name(), eb.layout.display_name()),
        remedy,
    ))
}

fn block_size_differs(p: &Pair) -> Option<FieldDiff> {
    let (ea, eb, ar, br) = (&p.a.effective, &p.b.effective, p.ar, p.br);
    if ea.block_size == eb.block_size {
        return None;
    }
    let remedy = if p.opaque() {
        p.opaque_remedy("block_size")
    } else if let Some(refusal) = combination_refusal(&LayoutField::BlockSize, p.a, p.b, ar, br) {
        refusal
    } else {
        match divisible_ratio(ea.block_size, eb.block_size) {
            Some((x, y)) => format!(
                "blocks are split or merged in a {x}:{y} ratio on receive; set block_size to the same value \
                    on both to avoid it"
            ),
            None => format!(
                "{} and {} do not divide each other: set block_size to the same value on {ar} and {br} (or \
                    sizes where one divides the other)",
                ea.block_size, eb.block_size
            ),
        }
    };
    Some(p.diff(
        LayoutField::BlockSize,
        adaptable(p),
        (ea.block_size.to_string(), eb.block_size.to_string()),
        remedy,
    ))
}

/// Equal TP sizes above 1 are a difference only for a model whose state the children
/// cannot move across ranks.
fn tp_size_differs(p: &Pair) -> Option<FieldDiff> {
    let (a, b, ar, br) = (p.a, p.b, p.ar, p.br);
    let state_refusal = combination_refusal(&LayoutField::TpSize, a, b, ar, br);
    if a.tp_size == b.tp_size && state_refusal.is_none() {
        return None;
    }
    let heterogeneous = a.heterogeneous_tp && b.heterogeneous_tp;
    let remedy = match (tp_refusal((ar, a.tp_size), (br, b.tp_size), heterogeneous), state_refusal) {
        (Some(refusal), _) | (None, Some(refusal)) => refusal,
        (None, None) => {
            let (x, y) = divisible_ratio(a.tp_size, b.tp_size).unwrap_or((1, 1));
            format!("heads are regrouped across ranks in a {x}:{y} ratio on receive")
        }
    };
    Some(p.diff(
        LayoutField::TpSize,
        FieldClass::Adaptable,
        (a.tp_size.to_string(), b.tp_size.to_string()),
        remedy,
    ))
}

/// Every field that differs between two descriptors, strict fields first.
pub fn diff(local: &CompatDescriptor, peer: &CompatDescriptor) -> Vec<FieldDiff> {
    diff_named(local, peer, "local", "peer")
}

/// Like [`diff`], with role names in the remedies.
pub fn diff_roles(a: &CompatDescriptor, b: &CompatDescriptor, a_role: &str, b_role: &str) -> Vec<FieldDiff> {
    diff_named(a, b, a_role, b_role)
}

/// True when an adaptable diff cannot actually be converted.
fn blocks(d: &FieldDiff, a: &CompatDescriptor, b: &CompatDescriptor) -> bool {
    match (d.class, &d.field) {
        (FieldClass::Strict, _) => true,
        (FieldClass::Adaptable, LayoutField::BlockSize) => {
            divisible_ratio(a.effective.block_size, b.effective.block_size).is_none()
                || combination_refusal(&d.field, a, b, "", "").is_some()
        }
        (FieldClass::Adaptable, LayoutField::TpSize) => {
            !tp_exchangeable(a.tp_size, b.tp_size, a.heterogeneous_tp && b.heterogeneous_tp)
                || combination_refusal(&d.field, a, b, "", "").is_some()
        }
        (FieldClass::Adaptable, LayoutField::Layout) => combination_refusal(&d.field, a, b, "", "").is_some(),
        (FieldClass::Adaptable, _) => false,
    }
}

fn plan(receiver: &CompatDescriptor, sender: &CompatDescriptor) -> AdaptationPlan {
    let (r, s) = (&receiver.effective, &sender.effective);
    AdaptationPlan {
        layout: (!same_layout_bytes(receiver, sender))
            .then(|| LayoutPermutation::between(s.layout, r.layout)),
        block_size_ratio: if r.block_size == s.block_size {
            None
        } else {
            divisible_ratio(r.block_size, s.block_size)
        },
        tp_ratio: if receiver.tp_size == sender.tp_size {
            None
        } else {
            divisible_ratio(receiver.tp_size, sender.tp_size)
        },
    }
}

fn check_named(
    a: &CompatDescriptor,
    b: &CompatDescriptor,
    ar: &str,
    br: &str,
    receiver_is_a: bool,
) -> Result<AdaptationPlan, Incompatible> {
    let blocking: Vec<FieldDiff> = diff_named(a, b, ar, br).into_iter().filter(|d| blocks(d, a, b)).collect();
    if !blocking.is_empty() {
        return Err(Incompatible { diffs: blocking, local_role: ar.to_owned(), peer_role: br.to_owned() });
    }
    Ok(if receiver_is_a { plan(a, b) } else { plan(b, a) })
}

/// Whether `local` can receive KV from `peer`: the plan `local` applies to what it reads
/// (identity when the adaptable fields are equal), or every blocking difference.
pub fn check(local: &CompatDescriptor, peer: &CompatDescriptor) -> Result<AdaptationPlan, Incompatible> {
    check_named(local, peer, "local", "peer", true)
}

/// [`check`] with role names in the messages, e.g. `("decode", "prefill")` on the decode
/// side of a handshake. The plan is still what `local` applies to what it reads.
pub fn check_with_roles(
    local: &CompatDescriptor,
    peer: &CompatDescriptor,
    local_role: &str,
    peer_role: &str,
) -> Result<AdaptationPlan, Incompatible> {
    check_named(local, peer, local_role, peer_role, true)
}

/// [`check`] for a deployment: diffs are worded `prefill=..., decode=...` and the plan is
/// what decode (the receiver) applies to what it reads from prefill.
pub fn check_roles(
    prefill: &CompatDescriptor,
    decode: &CompatDescriptor,
) -> Result<AdaptationPlan, Incompatible> {
    check_named(prefill, decode, "prefill", "decode", false)
}

impl fmt::Display for LayoutPermutation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {} (axes {:?})", self.from.canonical_name(), self.to.canonical_name(), self.perm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caps::MemoryKind;
    use crate::children;
    use crate::ids::LayerId;
    use crate::model::{AttentionKind, ModelSpec};
    use crate::negotiate::{negotiate, negotiate_deployment, ChildCaps, DecidedBy, HmaOption};

    /// lmcache as compat's tests have always declared it: no MLA.
    fn lmcache() -> ChildCaps {
        let mut c = children::lmcache(256);
        c.caps.mla = false;
        c
    }

    /// nixl as compat's tests have always declared it: host and disk memory.
    fn nixl() -> ChildCaps {
        let mut c = children::nixl();
        c.caps.memory_kinds = vec![MemoryKind::Host, MemoryKind::Disk];
        c
    }

    fn gpt_oss() -> ModelSpec {
        ModelSpec::from_hf_config_json(include_str!("../fixtures/models/openai--gpt-oss-20b/config.json"))
            .unwrap()
    }

    fn gemma3() -> ModelSpec {
        ModelSpec::from_hf_config_json(include_str!("../fixtures/models/google--gemma-3-1b-it/config.json"))
            .unwrap()
    }

    fn qwen3() -> ModelSpec {
        ModelSpec::from_hf_config_json(include_str!("../fixtures/models/Qwen--Qwen3-0.6B/config.json"))
            .unwrap()
    }

    fn desc(model: &ModelSpec, opts: &EngineOptions, children: &[ChildCaps]) -> CompatDescriptor {
        CompatDescriptor::new(model, &negotiate(model, opts, children).unwrap(), opts)
    }

    fn opts() -> EngineOptions {
        EngineOptions::default()
    }

    #[test]
    fn dyn_3545_separate_negotiation_is_caught_with_the_reason() {
        for model in [gpt_oss(), gemma3()] {
            let prefill = desc(&model, &opts(), &[lmcache(), nixl()]);
            let decode = desc(&model, &opts(), &[nixl()]);
            assert_ne!(prefill.compat_hash(), decode.compat_hash());
            let e = check_roles(&prefill, &decode).unwrap_err();
            assert_eq!(e.diffs.len(), 1, "{e}");
            let d = e.diff_of("hma").unwrap();
            assert_eq!(d.class, FieldClass::Strict);
            assert_eq!(
                d.line("prefill", "decode"),
                "hma: prefill=off (child 'lmcache' does not support HMA), decode=on (default: every child \
                 supports HMA and the model has 2 attention kinds): run decode with the same connector set, \
                 or set hybrid_kv_cache_manager=off on decode"
            );
            assert!(
                d.detail.contains("prefill 1 group: ") && d.detail.contains("decode 2 groups: "),
                "{}",
                d.detail
            );
            let text = e.to_string();
            assert!(text.starts_with("prefill and decode cannot exchange KV (1 field differs)"), "{text}");
            // The same check from decode's side names the fields the other way round.
            let e = check(&decode, &prefill).unwrap_err();
            assert!(e.to_string().contains("hma: local=on"), "{e}");
            let r = e.render("decode", "prefill");
            assert!(r.contains("hma: decode=on"), "{r}");
            assert!(
                r.contains(
                    "run decode with the same connector set, or set hybrid_kv_cache_manager=off on decode"
                ),
                "{r}"
            );
            assert!(r.contains("kv groups: decode 2 groups"), "{r}");
            let e = check_with_roles(&decode, &prefill, "decode", "prefill").unwrap_err();
            assert_eq!(e.to_string(), r);
            // Swapping the names is a rename, not a double replacement.
            let swapped = e.render("prefill", "decode");
            assert!(swapped.contains("hma: prefill=on") && swapped.contains("off on prefill"), "{swapped}");
        }
    }

    #[test]
    fn dyn_3545_remedy_works_and_joint_negotiation_agrees() {
        let model = gpt_oss();
        // The remedy: hybrid_kv_cache_manager=off on decode.
        let off = EngineOptions { hybrid_kv_cache_manager: HmaOption::Off, ..opts() };
        let prefill = desc(&model, &opts(), &[lmcache(), nixl()]);
        let decode = desc(&model, &off, &[nixl()]);
        assert_eq!(prefill.compat_hash(), decode.compat_hash());
        // Joint negotiation gets there by itself.
        let (p, d) =
            negotiate_deployment(&model, (&opts(), &[lmcache(), nixl()]), (&opts(), &[nixl()])).unwrap();
        let (pd, dd) =
            (CompatDescriptor::new(&model, &p, &opts()), CompatDescriptor::new(&model, &d, &opts()));
        assert_eq!(pd.compat_hash(), dd.compat_hash());
        assert!(check_roles(&pd, &dd).unwrap().is_identity());
    }

    #[test]
    fn dense_model_hma_flag_does_not_matter() {
        let model = qwen3();
        let prefill = desc(&model, &opts(), &[lmcache(), nixl()]);
        let decode = desc(&model, &opts(), &[nixl()]);
        assert_eq!(prefill.compat_hash(), decode.compat_hash());
        // Even with the raw flag forced different, the groups (and the hash) are equal.
        let on = desc(&model, &EngineOptions { hybrid_kv_cache_manager: HmaOption::On, ..opts() }, &[nixl()]);
        let off =
            desc(&model, &EngineOptions { hybrid_kv_cache_manager: HmaOption::Off, ..opts() }, &[nixl()]);
        assert!(on.effective.hma && !off.effective.hma);
        assert_eq!(on.compat_hash(), off.compat_hash());
        assert!(diff(&on, &off).is_empty());
        assert!(check(&on, &off).unwrap().is_identity());
    }

    #[test]
    fn aliases_are_not_a_difference_but_cross_layer_is_adaptable() {
        let model = qwen3();
        let a = EngineOptions { kv_cache_layout: Some("HND".parse().unwrap()), ..opts() };
        let b = EngineOptions { kv_cache_layout: Some("LBHNC".parse().unwrap()), ..opts() };
        let da = desc(&model, &a, &[]);
        let db = desc(&model, &b, &[]);
        assert!(diff(&da, &db).is_empty());
        assert!(check(&da, &db).unwrap().is_identity());

        let c = EngineOptions { kv_cache_layout: Some(KvLayout::BLHNC), ..opts() };
        let dc = desc(&model, &c, &[]);
        assert_eq!(da.compat_hash(), dc.compat_hash(), "layout is adaptable, not hashed");
        let d = diff(&da, &dc);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].field, "layout");
        assert_eq!(d[0].class, FieldClass::Adaptable);
        assert_eq!(d[0].local, "HND (LBHNC)");
        assert_eq!(d[0].peer, "BLHNC");
        assert_eq!(d[0].local_why, "user set kv_cache_layout=LBHNC");
        // local (LBHNC) receives from the peer (BLHNC): output axis 0 (L) is input axis 1.
        let plan = check(&da, &dc).unwrap();
        assert_eq!(
            plan.layout,
            Some(LayoutPermutation { from: KvLayout::BLHNC, to: KvLayout::LBHNC, perm: [1, 0, 2, 3, 4] })
        );
        assert_eq!(plan.block_size_ratio, None);
        // Decode (BLHNC) receiving from prefill (LBHNC).
        let plan = check_roles(&da, &dc).unwrap();
        assert_eq!(plan.layout.unwrap().perm, [1, 0, 2, 3, 4]);
    }

    #[test]
    fn opaque_blocks_are_strict_and_never_adapted() {
        let cpu = |bs| EngineOptions {
            kv_cache_layout: Some(KvLayout::HND),
            block_size: Some(bs),
            opaque_blocks: Some("engine-private in-block order".into()),
            ..opts()
        };
        let (a, b) = (desc(&qwen3(), &cpu(16), &[nixl()]), desc(&qwen3(), &cpu(16), &[nixl()]));
        assert!(check_roles(&a, &b).unwrap().is_identity());
        assert_eq!(a.compat_hash(), b.compat_hash());
        // Against an engine over a known layout: different hashes and a strict diff.
        let known =
            desc(&qwen3(), &EngineOptions { kv_cache_layout: Some(KvLayout::HND), ..opts() }, &[nixl()]);
        assert_ne!(a.compat_hash(), known.compat_hash());
        let e = check_roles(&a, &known).unwrap_err();
        assert_eq!(e.diffs[0].field, "opaque_blocks", "{e}");
        assert!(e.to_string().contains("prefill's engine backend keeps its in-block order private"), "{e}");
        // Block sizes that would otherwise split or merge blocks are refused between opaque ones.
        let e = check_roles(&a, &desc(&qwen3(), &cpu(32), &[nixl()])).unwrap_err();
        assert_eq!(e.diffs[0].field, "block_size");
        assert!(e.diffs[0].remedy.contains("opaque blocks move whole"), "{e}");
        // Engines over known layouts hash as before: the field is absent from their JSON.
        assert!(!known.strict_json().contains("opaque"));
    }

    #[test]
    fn one_kv_head_layouts_are_one_layout_across_workers() {
        let layout = |l| EngineOptions { kv_cache_layout: Some(l), ..opts() };
        // Gemma 3 1B has one KV head: NHD and HND are the same bytes.
        let (nhd, hnd) =
            (desc(&gemma3(), &layout(KvLayout::NHD), &[]), desc(&gemma3(), &layout(KvLayout::HND), &[]));
        assert_eq!(nhd.kv_heads, 1);
        assert!(diff_roles(&nhd, &hnd, "prefill", "decode").is_empty());
        assert!(check_roles(&nhd, &hnd).unwrap().is_identity());
        assert_eq!(nhd.compat_hash(), hnd.compat_hash());
        assert_eq!(
            same_bytes_note(&nhd, &hnd).as_deref(),
            Some("no adapter: one KV head, so LBNHC and LBHNC are the same bytes")
        );
        assert_eq!(same_bytes_note(&nhd, &nhd), None, "equal layouts need no note");
        // Cross-layer is not a head move: still a permutation.
        let blhnc = desc(&gemma3(), &layout(KvLayout::BLHNC), &[]);
        assert!(check_roles(&nhd, &blhnc).unwrap().layout.is_some());
        // Qwen3 has eight: a diff and a permutation, as before.
        let (nhd8, hnd8) =
            (desc(&qwen3(), &layout(KvLayout::NHD), &[]), desc(&qwen3(), &layout(KvLayout::HND), &[]));
        assert_eq!(diff(&nhd8, &hnd8).len(), 1);
        assert_eq!(check_roles(&nhd8, &hnd8).unwrap().layout.unwrap().perm, [0, 1, 3, 2, 4]);
        assert_eq!(same_bytes_note(&nhd8, &hnd8), None);
        // A peer that does not send its head count (an older one) is compared exactly.
        let mut old = hnd.clone();
        old.kv_heads = 0;
        assert!(check_roles(&nhd, &old).unwrap().layout.is_some());
    }

    #[test]
    fn state_groups_are_strict_and_hashed() {
        let nemotron = ModelSpec::from_hf_config_json(include_str!(
            "../../fixtures/models/nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/config.json"
        ))
        .unwrap();
        let mut carrier = nixl();
        carrier.caps.carries_state = true;
        let a = desc(&nemotron, &opts(), std::slice::from_ref(&carrier));
        assert!(a.strict_json().contains(r#""state_groups":[{"layers":[0,2,4,"#), "{}", a.strict_json());
        assert!(a.strict_json().contains(r#""ssm_shape":[64,64,128],"ssm_dtype":"f32""#));
        // A peer that does not describe the state (an older one) is refused on that field.
        let mut b = a.clone();
        b.effective.state_groups.clear();
        assert_ne!(a.compat_hash(), b.compat_hash());
        let e = check_roles(&a, &b).unwrap_err();
        let d = e.diff_of("state_groups").unwrap();
        assert_eq!(d.class, FieldClass::Strict);
        assert_eq!(d.local, "1 group: mamba2 x23 (conv 3x6144 bf16, ssm 64x64x128 f32)");
        assert_eq!(d.peer, "none");
        // Models without state layers keep the hash they had (see golden_hash).
        assert!(!desc(&qwen3(), &opts(), &[nixl()]).strict_json().contains("state_groups"));
    }

    #[test]
    fn permutation_maps_every_axis() {
        for from in KvLayout::all() {
            for to in [KvLayout::LBHNC, KvLayout::BLNHC, KvLayout::LBNHC] {
                let p = LayoutPermutation::between(from, to);
                for (i, src) in p.perm.iter().enumerate() {
                    assert_eq!(from.order()[*src], to.order()[i]);
                }
            }
        }
    }

    #[test]
    fn block_size_and_tp_ratios() {
        let model = qwen3();
        let b16 = desc(&model, &opts(), &[nixl()]);
        let b32 = desc(&model, &EngineOptions { block_size: Some(32), ..opts() }, &[nixl()]);
        let b24 = desc(&model, &EngineOptions { block_size: Some(24), ..opts() }, &[nixl()]);
        let plan = check(&b16, &b32).unwrap();
        assert_eq!(plan.block_size_ratio, Some((1, 2)));
        assert!(!plan.is_identity());
        let e = check_roles(&b16, &b24).unwrap_err();
        let d = e.diff_of("block_size").unwrap();
        assert_eq!(d.class, FieldClass::Adaptable);
        assert!(e.to_string().contains(
            "block_size: prefill=16 (default: vLLM's default block size; every child accepts it), decode=24 \
             (user set block_size=24; every child accepts it): 16 and 24 do not divide each other"
        ), "{e}");

        // A transport that declares heterogeneous TP regroups heads when one size divides
        // the other.
        let mut any_tp = nixl();
        any_tp.caps.heterogeneous_tp = true;
        let tp = |n| EngineOptions { tp_size: n, ..opts() };
        let t2 = desc(&model, &tp(2), std::slice::from_ref(&any_tp));
        let t4 = desc(&model, &tp(4), std::slice::from_ref(&any_tp));
        let t3 = desc(&model, &tp(3), std::slice::from_ref(&any_tp));
        assert!(t2.heterogeneous_tp);
        assert_eq!(check(&t2, &t4).unwrap().tp_ratio, Some((1, 2)));
        assert_eq!(check(&t4, &t2).unwrap().tp_ratio, Some((2, 1)));
        // Decode (4) receives from prefill (2).
        assert_eq!(check_roles(&t2, &t4).unwrap().tp_ratio, Some((2, 1)));
        let e = check_roles(&t2, &t3).unwrap_err();
        let d = e.diff_of("tp_size").unwrap();
        assert_eq!(d.class, FieldClass::Adaptable);
        assert!(
            e.to_string().contains(
                "tp_size: prefill=2 (user set tp_size=2; child 'nixl' loads KV across different TP \
                 sizes), decode=3 (user set tp_size=3; child 'nixl' loads KV across different TP sizes): \
                 TP sizes 2 and 3 do not divide each other"
            ),
            "{e}"
        );
    }

    #[test]
    fn tp_sizes_must_be_equal_when_a_transport_lacks_heterogeneous_tp() {
        let model = qwen3();
        let tp = |n| EngineOptions { tp_size: n, ..opts() };
        let mut any_tp = nixl();
        any_tp.caps.heterogeneous_tp = true;
        // nixl() declares no heterogeneous TP, like the built-in nixl connector.
        for (prefill, decode) in [(2, 4), (4, 2), (2, 3)] {
            let p = desc(&model, &tp(prefill), &[nixl()]);
            let d = desc(&model, &tp(decode), &[nixl()]);
            assert!(!p.heterogeneous_tp && !d.heterogeneous_tp);
            assert_eq!(p.compat_hash(), d.compat_hash(), "the TP size is not hashed");
            let e = check_roles(&p, &d).unwrap_err();
            let diff = e.diff_of("tp_size").unwrap();
            assert_eq!(diff.class, FieldClass::Adaptable, "not hashed, but not convertible here");
            assert_eq!((diff.local.clone(), diff.peer.clone()), (prefill.to_string(), decode.to_string()));
            let text = e.to_string();
            assert!(
                text.contains(&format!(
                    "tp_size: prefill={prefill} (user set tp_size={prefill}; child 'nixl' moves KV only \
                     between equal TP sizes: the peer must use tp_size={prefill} too), decode={decode}"
                )),
                "{text}"
            );
            assert!(
                text.contains(&format!(
                    "run decode with tp_size={prefill} like prefill, or prefill with tp_size={decode}"
                )),
                "{text}"
            );
            // One side that handles it is not enough: the other's transport cannot.
            let d_any = desc(&model, &tp(decode), std::slice::from_ref(&any_tp));
            assert!(check_roles(&p, &d_any).unwrap_err().diff_of("tp_size").is_some());
            assert!(check_roles(&d_any, &p).unwrap_err().diff_of("tp_size").is_some());
        }
        // Equal sizes stay compatible, and a descriptor from an older peer (no
        // heterogeneous_tp) is taken to need equal sizes.
        let p = desc(&model, &tp(2), &[nixl()]);
        assert!(check_roles(&p, &desc(&model, &tp(2), &[nixl()])).unwrap().is_identity());
        let mut json = serde_json::to_value(desc(&model, &tp(4), &[any_tp])).unwrap();
        json.as_object_mut().unwrap().remove("heterogeneous_tp");
        let old: CompatDescriptor = serde_json::from_value(json).unwrap();
        assert!(!old.heterogeneous_tp);
        assert!(check_roles(&p, &old).unwrap_err().diff_of("tp_size").is_some());
    }

    /// The hybrid reference model (two state layers) and nixl as it declares itself over
    /// shm: heterogeneous TP and state, neither combined with adapting blocks nor state with TP.
    fn hybrid_ref() -> ModelSpec {
        ModelSpec::from_hf_config_json(include_str!(
            "../../fixtures/models/kvconnect--reference-hybrid/config.json"
        ))
        .unwrap()
    }

    fn shm_nixl() -> ChildCaps {
        let mut c = nixl();
        c.caps.heterogeneous_tp = true;
        c.caps.carries_state = true;
        c
    }

    fn with(tp_size: u32, block_size: u32) -> EngineOptions {
        EngineOptions { tp_size, block_size: Some(block_size), ..opts() }
    }

    #[test]
    fn adapting_blocks_across_tp_ranks_needs_adapts_with_tp_on_both_sides() {
        let (model, c) = (qwen3(), shm_nixl());
        let d = |tp, bs| desc(&model, &with(tp, bs), std::slice::from_ref(&c));
        assert_eq!(d(2, 16).limits.no_adapts_with_tp, ["child 'nixl'"]);
        // Either alone adapts; together (even at equal TP sizes above 1) they are refused on
        // the block size, naming the child and the remedy.
        assert!(check_roles(&d(2, 16), &d(1, 16)).unwrap().tp_ratio.is_some());
        assert!(check_roles(&d(1, 16), &d(1, 32)).unwrap().block_size_ratio.is_some());
        for (p, q) in [(2, 1), (1, 2), (2, 2)] {
            let e = check_roles(&d(p, 16), &d(q, 32)).unwrap_err();
            let diff = e.diff_of("block_size").unwrap();
            assert_eq!(
                diff.remedy,
                format!(
                    "blocks would be split or merged in a 1:2 ratio with tp_size {p} on prefill and {q} on \
                     decode, which is not supported by child 'nixl' (prefill and decode) (no \
                     adapts_with_tp: across tensor-parallel ranks blocks are copied as they are): set \
                     block_size to the same value on prefill and decode"
                )
            );
            assert!(e.diff_of("tp_size").is_none() || p != q, "{e}");
            // The same check from decode's side at the handshake.
            let e = check_with_roles(&d(q, 32), &d(p, 16), "decode", "prefill").unwrap_err();
            assert!(e.to_string().contains("not supported by child 'nixl' (decode and prefill)"), "{e}");
        }
        // One side that can is not enough.
        let mut both = c.clone();
        both.caps.adapts_with_tp = true;
        let able = |tp, bs| desc(&model, &with(tp, bs), std::slice::from_ref(&both));
        let e = check_roles(&able(2, 16), &d(1, 32)).unwrap_err();
        assert!(
            e.diff_of("block_size").unwrap().remedy.contains("child 'nixl' on decode (no adapts_with_tp"),
            "{e}"
        );
        let plan = check_roles(&able(2, 16), &able(1, 32)).unwrap();
        assert_eq!((plan.tp_ratio, plan.block_size_ratio), (Some((1, 2)), Some((2, 1))));
        // A peer that does not describe its limits (an older one) is taken to have them all.
        let mut json = serde_json::to_value(able(1, 32)).unwrap();
        json.as_object_mut().unwrap().remove("limits");
        let old: CompatDescriptor = serde_json::from_value(json).unwrap();
        let e = check_roles(&able(2, 16), &old).unwrap_err();
        assert!(
            e.to_string().contains("the connectors of a peer that does not describe its limits on decode"),
            "{e}"
        );
        assert!(check_roles(&able(2, 16), &{
            let mut o = old.clone();
            o.effective.block_size = 16;
            o
        })
        .is_ok());
    }

    #[test]
    fn state_beside_adapted_blocks_needs_adapts_with_state() {
        let (model, c) = (hybrid_ref(), shm_nixl());
        let d = |bs| desc(&model, &with(1, bs), std::slice::from_ref(&c));
        assert!(check_roles(&d(16), &d(16)).unwrap().is_identity());
        let e = check_roles(&d(16), &d(32)).unwrap_err();
        assert_eq!(e.diffs.len(), 1, "{e}");
        assert_eq!(
            e.diffs[0].remedy,
            "blocks would be split or merged in a 1:2 ratio beside the per-request state of the model's \
             state layers, which is not supported by child 'nixl' (prefill and decode) (no \
             adapts_with_state): set block_size to the same value on prefill and decode"
        );
        // The same sizes on a model without state layers adapt.
        let q = |bs| desc(&qwen3(), &with(1, bs), std::slice::from_ref(&c));
        assert!(check_roles(&q(16), &q(32)).is_ok());
        let mut able = c.clone();
        able.caps.adapts_with_state = true;
        let a = |bs| desc(&model, &with(1, bs), std::slice::from_ref(&able));
        assert_eq!(check_roles(&a(16), &a(32)).unwrap().block_size_ratio, Some((2, 1)));
    }

    #[test]
    fn state_across_tp_ranks_needs_state_with_tp_on_both_sides() {
        let (model, c) = (hybrid_ref(), shm_nixl());
        let tp1 = desc(&model, &with(1, 16), std::slice::from_ref(&c));
        assert_eq!(tp1.limits.no_state_with_tp, ["child 'nixl'"]);
        // Negotiation already refuses a worker at TP 2 with this child; a peer whose
        // descriptor says TP 2 anyway is refused at the handshake, with or without a TP
        // difference.
        for (p, q) in [(1, 2), (2, 1), (2, 2)] {
            let (mut a, mut b) = (tp1.clone(), tp1.clone());
            a.tp_size = p;
            b.tp_size = q;
            let e = check_roles(&a, &b).unwrap_err();
            let diff = e.diff_of("tp_size").unwrap_or_else(|| panic!("{p}->{q}: {e}"));
            assert_eq!(
                diff.remedy,
                format!(
                    "the model's state layers keep a per-request state, and moving it with tp_size {p} on \
                     prefill and {q} on decode is not supported by child 'nixl' (prefill and decode) (no \
                     state_with_tp): run prefill and decode with tp_size=1"
                )
            );
        }
        let mut able = c.clone();
        able.caps.state_with_tp = true;
        let mut a = desc(&model, &with(1, 16), std::slice::from_ref(&able));
        let mut b = a.clone();
        a.tp_size = 2;
        b.tp_size = 2;
        assert!(check_roles(&a, &b).unwrap().is_identity());
    }

    #[test]
    fn strict_fields_other_than_hma() {
        let q = desc(&qwen3(), &opts(), &[nixl()]);
        let g = desc(&gemma3(), &opts(), &[nixl()]);
        let e = check(&q, &g).unwrap_err();
        assert_eq!(e.diffs.iter().map(|d| d.field.as_str()).collect::<Vec<_>>(), ["model"]);
        assert!(
            e.to_string().contains("serve the same model (the same config.json) on local and peer"),
            "{e}"
        );

        let f16 = desc(&qwen3(), &EngineOptions { cache_dtype: Some(Dtype::F16), ..opts() }, &[nixl()]);
        let e = check(&q, &f16).unwrap_err();
        let d = e.diff_of("cache_dtype").unwrap();
        assert_eq!((d.local.as_str(), d.peer.as_str()), ("bf16", "f16"));
        assert_eq!(d.local_why, "model torch_dtype is bf16");
        assert_eq!(d.peer_why, "user set cache_dtype=f16");

        let local_only = desc(&qwen3(), &opts(), &[lmcache()]);
        let e = check(&q, &local_only).unwrap_err();
        let d = e.diff_of("transfer_mode").unwrap();
        assert_eq!((d.local.as_str(), d.peer.as_str()), ("pull", "none"));
        assert_ne!(q.compat_hash(), local_only.compat_hash());
    }

    #[test]
    fn peer_without_provenance_still_diffs() {
        let model = gpt_oss();
        let a = desc(&model, &opts(), &[nixl()]);
        let mut b = desc(&model, &opts(), &[lmcache(), nixl()]);
        b.provenance.clear();
        let e = check(&a, &b).unwrap_err();
        assert_eq!(e.diff_of("hma").unwrap().peer_why, "no provenance sent");
    }

    #[test]
    fn hash_is_stable_through_serde_and_ignores_informational_fields() {
        let model = gpt_oss();
        let a = desc(&model, &opts(), &[lmcache(), nixl()]);
        let json = serde_json::to_string(&a).unwrap();
        let back: CompatDescriptor = serde_json::from_str(&json).unwrap();
        assert_eq!(back, a);
        assert_eq!(back.compat_hash(), a.compat_hash());
        let mut c = a.clone();
        c.connectors.push(("flexkv".into(), "9".into()));
        c.provenance[0].reason = "something else".into();
        c.tp_rank = 0;
        c.model_name = "renamed".into();
        c.effective.layout = KvLayout::BLNHC;
        c.effective.block_size = 64;
        c.effective.memory = MemoryKind::Device;
        assert_eq!(c.compat_hash(), a.compat_hash());
        assert_eq!(a.compat_hash().len(), 64);
        assert!(a.compat_hash().bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
    }

    #[test]
    fn nonsense_from_a_peer_is_an_error_not_a_panic() {
        let good = desc(&qwen3(), &opts(), &[nixl()]);
        let mut bad = good.clone();
        bad.effective.block_size = 0;
        bad.tp_size = 0;
        // Byte 12 falls inside a two-byte character: the short form must not slice there.
        bad.model_fingerprint = format!("a{}", "é".repeat(6));
        bad.provenance.clear();
        let e = check(&good, &bad).unwrap_err();
        let fields: Vec<&str> = e.diffs.iter().map(|d| d.field.as_str()).collect();
        assert_eq!(fields, ["model", "block_size", "tp_size"]);
        assert!(e.to_string().contains("16 and 0 do not divide each other"), "{e}");
    }

    /// Pins the hash of one fixed descriptor: a change here breaks every deployed peer's
    /// handshake, so it must be deliberate (and bump `HASH_SCHEMA`).
    #[test]
    fn golden_hash() {
        let d = CompatDescriptor {
            model_fingerprint: "f".repeat(64),
            model_name: "golden".into(),
            effective: EffectiveLayout {
                layout: KvLayout::HND,
                hma: true,
                block_size: 16,
                cache_dtype: Dtype::Bf16,
                memory: MemoryKind::Host,
                transfer_mode: TransferMode::Pull,
                groups: vec![
                    KvGroup {
                        kind: AttentionKind::SlidingWindow { window: 128 },
                        layers: vec![LayerId(0), LayerId(2)],
                    },
                    KvGroup { kind: AttentionKind::Full, layers: vec![LayerId(1), LayerId(3)] },
                ],
                state_groups: vec![],
                opaque_blocks: false,
            },
            kv_heads: 8,
            tp_size: 1,
            tp_rank: 0,
            heterogeneous_tp: false,
            limits: Limits::default(),
            connectors: vec![("nixl".into(), "0.1.0".into())],
            provenance: vec![],
        };
        assert_eq!(
            d.strict_json(),
            concat!(
                r#"{"schema":"kvconnect.compat.v1","#,
                r#""model_fingerprint":"ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff","#,
                r#""cache_dtype":"bf16","kv_groups":[{"kind":{"kind":"sliding_window","window":128},"#,
                r#""layers":[0,2]},{"kind":{"kind":"full"},"layers":[1,3]}],"transfer_mode":"pull"}"#
            )
        );
        // Cross-checked with `printf %s <strict_json> | sha256sum`.
        assert_eq!(d.compat_hash(), "33a45f5e299d74a76c6bc0d83b65bd0ebf19e4be74c90c03d8f812686cc28009");
    }

    #[test]
    fn provenance_reaches_the_descriptor() {
        let model = gpt_oss();
        let (_, d) =
            negotiate_deployment(&model, (&opts(), &[lmcache(), nixl()]), (&opts(), &[nixl()])).unwrap();
        let dd = CompatDescriptor::new(&model, &d, &opts());
        let hma = dd.provenance.iter().find(|p| p.field == "hma").unwrap();
        assert_eq!(hma.decided_by, DecidedBy::Peer("lmcache".into()));
        assert_eq!(dd.connectors, vec![("nixl".to_owned(), "0.1.0".to_owned())]);
        assert_eq!(dd.model_fingerprint, model.fingerprint());
    }
}
