//! KV cache layouts over vLLM's logical shape `[L, B, H, N, C]`.
//!
//! `L` layers, `B` blocks, `H` KV heads, `N` tokens in a block, `C` head dim (channels). A
//! layout is the physical order of those five dimensions, outermost first. K and V are an
//! outer dimension placed directly inside `L`: a per-layer layout `LBNHC` is stored as
//! `[L][K|V][B][N][H][C]` (vLLM's `(2, num_blocks, block_size, heads, head_dim)` per layer),
//! a cross-layer layout `BLHNC` as `[B][L][K|V][H][N][C]`.
//!
//! The names vLLM users write are aliases: `NHD` is `LBNHC`, `HND` is `LBHNC`. They are
//! normalised on parse, so two layouts are compared as permutations, never as strings. With
//! one KV head per layer the head axis may sit anywhere without changing a byte;
//! [`KvLayout::normalized`] is the one place that says so.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// One of the five logical dimensions of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dim {
    /// Layers.
    L,
    /// Blocks.
    B,
    /// KV heads.
    H,
    /// Tokens within a block.
    N,
    /// Head dim (channels).
    C,
}

impl Dim {
    /// Every dimension, in the canonical `[L, B, H, N, C]` order.
    pub const ALL: [Dim; 5] = [Dim::L, Dim::B, Dim::H, Dim::N, Dim::C];

    fn letter(self) -> char {
        match self {
            Dim::L => 'L',
            Dim::B => 'B',
            Dim::H => 'H',
            Dim::N => 'N',
            Dim::C => 'C',
        }
    }

    fn from_letter(c: char) -> Option<Dim> {
        match c.to_ascii_uppercase() {
            'L' => Some(Dim::L),
            'B' => Some(Dim::B),
            'H' => Some(Dim::H),
            'N' => Some(Dim::N),
            'C' => Some(Dim::C),
            _ => None,
        }
    }
}

/// A physical order of the logical KV dimensions, outermost first. Always a permutation of
/// all five dimensions: a value of this type cannot be half a layout.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KvLayout {
    order: [Dim; 5],
}

/// A layout string that names no layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown KV layout '{input}': {reason}; valid layouts are NHD (= LBNHC), HND (= LBHNC), the \
    cross-layer forms BLNHC and BLHNC, or any ordering of the letters L, B, H, N, C"
)]
pub struct LayoutParseError {
    /// What was given.
    pub input: String,
    /// What is wrong with it.
    pub reason: String,
}

impl KvLayout {
    /// Per-layer, token-major blocks: `[L][K|V][B][N][H][C]`; vLLM's `NHD`.
    pub const LBNHC: KvLayout = KvLayout { order: [Dim::L, Dim::B, Dim::N, Dim::H, Dim::C] };
    /// Per-layer, head-major blocks: `[L][K|V][B][H][N][C]`; vLLM's `HND`.
    pub const LBHNC: KvLayout = KvLayout { order: [Dim::L, Dim::B, Dim::H, Dim::N, Dim::C] };
    /// Cross-layer, token-major blocks: a block holds every layer.
    pub const BLNHC: KvLayout = KvLayout { order: [Dim::B, Dim::L, Dim::N, Dim::H, Dim::C] };
    /// Cross-layer, head-major blocks.
    pub const BLHNC: KvLayout = KvLayout { order: [Dim::B, Dim::L, Dim::H, Dim::N, Dim::C] };
    /// vLLM's `NHD`.
    pub const NHD: KvLayout = KvLayout::LBNHC;
    /// vLLM's `HND`.
    pub const HND: KvLayout = KvLayout::LBHNC;

    /// The four layouts engines use, in the order negotiation tries them by default.
    pub const COMMON: [KvLayout; 4] = [KvLayout::LBHNC, KvLayout::LBNHC, KvLayout::BLHNC, KvLayout::BLNHC];

    /// Builds a layout from an order of dimensions; `None` unless it is a permutation of all
    /// five.
    pub fn from_order(order: [Dim; 5]) -> Option<KvLayout> {
        let mut seen = [false; 5];
        for d in order {
            let i = Dim::ALL.iter().position(|x| *x == d)?;
            if seen[i] {
                return None;
            }
            seen[i] = true;
        }
        Some(KvLayout { order })
    }

    /// The physical order, outermost first.
    pub fn order(&self) -> [Dim; 5] {
        self.order
    }

    /// Position of a dimension in the physical order (0 = outermost).
    pub fn position(&self, d: Dim) -> usize {
        // A KvLayout is always a full permutation, so every dimension is present.
        self.order.iter().position(|x| *x == d).unwrap_or(0)
    }

    /// The canonical five-letter name, e.g. `LBHNC`.
    pub fn canonical_name(&self) -> String {
        self.order.iter().map(|d| d.letter()).collect()
    }

    /// The vLLM alias where one exists (`NHD`, `HND`), else the canonical name.
    pub fn display_name(&self) -> String {
        match *self {
            KvLayout::LBNHC => "NHD (LBNHC)".to_owned(),
            KvLayout::LBHNC => "HND (LBHNC)".to_owned(),
            _ => self.canonical_name(),
        }
    }

    /// True when a block holds every layer (blocks outside layers).
    pub fn is_cross_layer(&self) -> bool {
        self.position(Dim::B) < self.position(Dim::L)
    }

    /// True when heads are outside tokens within a block (HND-like).
    pub fn is_head_major(&self) -> bool {
        self.position(Dim::H) < self.position(Dim::N)
    }

    /// The layout with the head axis moved to position `pos` (0 = outermost, clamped to 4),
    /// the other four axes kept in their order.
    pub fn with_head_at(self, pos: usize) -> KvLayout {
        let mut rest = self.order.iter().copied().filter(|d| *d != Dim::H);
        let mut order = [Dim::H; 5];
        for (i, slot) in order.iter_mut().enumerate() {
            if i != pos.min(4) {
                // Four axes for four slots: `rest` cannot run out.
                *slot = rest.next().unwrap_or(Dim::H);
            }
        }
        KvLayout { order }
    }

    /// The layout as its bytes are for `heads` KV heads per layer. With one head the head
    /// axis has size 1 and adds nothing to any offset, so wherever it sits the bytes are the
    /// same: it is moved to just outside `N` (`LBNHC` and `LBHNC` both give `LBHNC`, `BLNHC`
    /// gives `BLHNC`). With more heads the layout is returned as it is. Layouts are compared
    /// through this wherever the head count is known: negotiation's adapter decision, the
    /// compatibility diff and the receiver's permutation.
    pub fn normalized(self, heads: u32) -> KvLayout {
        if heads != 1 {
            return self;
        }
        let n = self.order.iter().filter(|d| **d != Dim::H).position(|d| *d == Dim::N).unwrap_or(0);
        self.with_head_at(n)
    }

    /// True when the two layouts put the same bytes in the same places for `heads` KV heads.
    pub fn same_bytes(self, other: KvLayout, heads: u32) -> bool {
        self.normalized(heads) == other.normalized(heads)
    }

    /// `no adapter: one KV head, so LBNHC and LBHNC are the same bytes`: why this layout and
    /// `other` need no adapter between them on a model with one KV head.
    pub fn one_head_note(self, other: KvLayout) -> String {
        format!(
            "no adapter: one KV head, so {} and {} are the same bytes",
            self.canonical_name(),
            other.canonical_name()
        )
    }

    /// Every valid layout (120 permutations), in a fixed order.
    pub fn all() -> Vec<KvLayout> {
        // Lexicographic over dimension indices; repeated indices are skipped as soon as
        // they appear (Capabilities::validate calls this on every negotiation, so it should
        // not test all 3125 tuples).
        let mut out = Vec::with_capacity(120);
        let dims = Dim::ALL;
        for a in 0..5 {
            for b in (0..5).filter(|b| *b != a) {
                for c in (0..5).filter(|c| ![a, b].contains(c)) {
                    for d in (0..5).filter(|d| ![a, b, c].contains(d)) {
                        // The one index left: 0 + 1 + 2 + 3 + 4 = 10.
                        let e = 10 - a - b - c - d;
                        out.push(KvLayout { order: [dims[a], dims[b], dims[c], dims[d], dims[e]] });
                    }
                }
            }
        }
        out
    }
}

impl FromStr for KvLayout {
    type Err = LayoutParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let err = |reason: &str| LayoutParseError { input: s.to_owned(), reason: reason.to_owned() };
        match t.to_ascii_uppercase().as_str() {
            "NHD" => return Ok(KvLayout::NHD),
            "HND" => return Ok(KvLayout::HND),
            _ => {}
        }
        let chars: Vec<char> = t.chars().collect();
        if chars.len() != 5 {
            return Err(err("a layout has exactly five letters (or is one of the aliases NHD, HND)"));
        }
        let mut order = [Dim::L; 5];
        for (i, c) in chars.iter().enumerate() {
            order[i] =
                Dim::from_letter(*c).ok_or_else(|| err(&format!("'{c}' is not one of L, B, H, N, C")))?;
        }
        KvLayout::from_order(order).ok_or_else(|| err("each of L, B, H, N, C must appear exactly once"))
    }
}

/// A layout crosses as its name: an alias or the five dimension letters in storage order.
#[cfg(feature = "schema")]
impl schemars::JsonSchema for KvLayout {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "KvLayout".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "A KV layout: NHD or HND (aliases), or the five letters L (layer), B (block), N \
                (token), H (head), C (channel) in storage order, each once",
            "type": "string",
            "pattern": "^(NHD|HND|[LBNHC]{5})$"
        })
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.canonical_name())
    }
}

impl fmt::Debug for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KvLayout({})", self.canonical_name())
    }
}

impl Serialize for KvLayout {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.canonical_name())
    }
}

impl<'de> Deserialize<'de> for KvLayout {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// One KV cache group: layers that share a block table. With the hybrid KV cache manager
/// on, a hybrid model has one group per attention kind; with it off, all KV layers form one
/// group.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct KvGroup {
    /// The attention kind of the group's layers (the first layer's, when mixed).
    pub kind: crate::model::AttentionKind,
    /// The layers, ascending.
    pub layers: Vec<crate::ids::LayerId>,
}

/// One state group: state-space or linear-attention layers that keep the same per-request
/// state instead of KV blocks (vLLM's Mamba-style cache). Decode needs this state as much as
/// the KV of the attention layers: a transport that moves only KV blocks leaves it behind.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct StateGroup {
    /// The layers, ascending.
    pub layers: Vec<crate::ids::LayerId>,
    /// Their state's shapes and dtypes; `None` when the config does not give them.
    pub state: Option<crate::model::LayerState>,
}

/// The layout both sides of a deployment use, as plain values. Negotiation computes it
/// (with provenance, in `negotiate`); connectors and the worker runtime read it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct EffectiveLayout {
    /// Physical order of the KV dimensions.
    pub layout: KvLayout,
    /// Hybrid KV cache manager on: one block table per group.
    pub hma: bool,
    /// Tokens per block.
    pub block_size: u32,
    /// Element type of the cache.
    pub cache_dtype: crate::model::Dtype,
    /// Where the KV cache lives.
    pub memory: crate::caps::MemoryKind,
    /// How KV moves between engines.
    pub transfer_mode: crate::caps::TransferMode,
    /// KV cache groups (layers that hold no KV blocks are in none).
    pub groups: Vec<KvGroup>,
    /// State groups: the state-space / linear-attention layers and their per-request state.
    /// Empty for models without such layers (and then left out of the JSON).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_groups: Vec<StateGroup>,
    /// The engine's in-block order is its own (vLLM's CPU attention backend stores K
    /// transposed inside a block): `layout` then only says that each layer's blocks are
    /// addressed per layer, and a block's K and V parts lie together, K first, as one
    /// contiguous block that moves whole and is never adapted. Left out of the JSON when
    /// false, so every other engine's descriptors and hashes are unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub opaque_blocks: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_normalise() {
        assert_eq!("HND".parse::<KvLayout>().unwrap(), "LBHNC".parse::<KvLayout>().unwrap());
        assert_eq!("nhd".parse::<KvLayout>().unwrap(), KvLayout::LBNHC);
        assert_eq!(KvLayout::HND.canonical_name(), "LBHNC");
    }

    #[test]
    fn cross_layer_and_head_major() {
        assert!(KvLayout::BLHNC.is_cross_layer());
        assert!(!KvLayout::LBHNC.is_cross_layer());
        assert!(KvLayout::LBHNC.is_head_major());
        assert!(!KvLayout::NHD.is_head_major());
    }

    #[test]
    fn bad_strings_are_errors_listing_valid_ones() {
        for bad in ["", "LBHN", "LBHNX", "LLHNC", "HNDX"] {
            let e = bad.parse::<KvLayout>().unwrap_err().to_string();
            assert!(e.contains("valid layouts are NHD"), "{e}");
        }
    }

    #[test]
    fn all_is_every_permutation() {
        let all = KvLayout::all();
        assert_eq!(all.len(), 120);
        for l in &all {
            assert_eq!(l.canonical_name().parse::<KvLayout>().unwrap(), *l);
        }
    }

    #[test]
    fn one_head_makes_the_head_axis_position_irrelevant() {
        assert_eq!(KvLayout::NHD.normalized(1), KvLayout::HND);
        assert_eq!(KvLayout::HND.normalized(1), KvLayout::HND);
        assert_eq!(KvLayout::BLNHC.normalized(1), KvLayout::BLHNC);
        assert_eq!(KvLayout::NHD.normalized(8), KvLayout::NHD);
        assert!(KvLayout::NHD.same_bytes(KvLayout::HND, 1));
        assert!(!KvLayout::NHD.same_bytes(KvLayout::HND, 2));
        // Only the head axis may move: cross-layer and per-layer stay different.
        assert!(!KvLayout::LBHNC.same_bytes(KvLayout::BLHNC, 1));
        assert_eq!(KvLayout::BLNHC.with_head_at(0).canonical_name(), "HBLNC");
        assert_eq!(KvLayout::BLNHC.with_head_at(9).canonical_name(), "BLNCH");
    }

    #[test]
    fn serde_round_trip_uses_canonical_name() {
        let j = serde_json::to_string(&KvLayout::HND).unwrap();
        assert_eq!(j, "\"LBHNC\"");
        let back: KvLayout = serde_json::from_str("\"HND\"").unwrap();
        assert_eq!(back, KvLayout::LBHNC);
    }
}
