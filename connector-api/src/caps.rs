//! What a connector declares it can do. Capabilities are data: the framework checks them
//! once, at load (`Capabilities::validate`), and negotiation reads them; nothing probes a
//! connector at run time to find out. [`Capabilities::builder`] makes a declaration that is
//! validated as it is built.

mod builder;

pub use builder::CapabilitiesBuilder;

use crate::layout::KvLayout;
use crate::model::Dtype;
use crate::role::KvRole;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Where KV bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum MemoryKind {
    /// Host DRAM.
    Host,
    /// Accelerator memory.
    Device,
    /// A local disk or SSD.
    Disk,
}

impl fmt::Display for MemoryKind {
    /// The name messages and provenance print (`host`, `device`, `disk`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemoryKind::Host => "host",
            MemoryKind::Device => "device",
            MemoryKind::Disk => "disk",
        })
    }
}

/// How a connector moves KV between engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum TransferMode {
    /// It moves nothing between engines (a local cache).
    None,
    /// The consumer reads from the producer (NIXL READ).
    Pull,
    /// The producer writes into the consumer.
    Push,
}

impl fmt::Display for TransferMode {
    /// The name messages and provenance print (`none`, `pull`, `push`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransferMode::None => "none",
            TransferMode::Pull => "pull",
            TransferMode::Push => "push",
        })
    }
}

/// The relative cost of adapting a connector's own data path to another layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum AdaptCost {
    /// About the cost of a plain copy (e.g. a permute fused into a copy that happens anyway).
    Low,
    /// A separate pass over the bytes (e.g. a transpose on the copy path).
    Medium,
    /// Much slower than a plain copy.
    High,
}

impl fmt::Display for AdaptCost {
    /// The name messages print (`low`, `medium`, `high`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AdaptCost::Low => "low",
            AdaptCost::Medium => "medium",
            AdaptCost::High => "high",
        })
    }
}

/// Which layouts a connector accepts. An empty `required` set means "any layout not
/// rejected"; `preferred` orders the acceptable ones, most wanted first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct LayoutConstraint {
    /// If not empty, the layout must be one of these.
    #[serde(default)]
    pub required: Vec<KvLayout>,
    /// The layout must not be one of these (unless the connector adapts).
    #[serde(default)]
    pub rejected: Vec<KvLayout>,
    /// Acceptable layouts, most wanted first.
    #[serde(default)]
    pub preferred: Vec<KvLayout>,
}

impl LayoutConstraint {
    /// True when `layout` is acceptable without adaptation.
    pub fn accepts(&self, layout: KvLayout) -> bool {
        !self.rejected.contains(&layout) && (self.required.is_empty() || self.required.contains(&layout))
    }

    /// True when `layout`, or a layout with the same bytes for `heads` KV heads per layer
    /// (with one head the head axis may sit anywhere; see [`KvLayout::normalized`]), is
    /// acceptable without adaptation.
    pub fn accepts_with_heads(&self, layout: KvLayout, heads: u32) -> bool {
        self.accepts(layout) || (heads == 1 && (0..5).any(|pos| self.accepts(layout.with_head_at(pos))))
    }

    /// A short human description, e.g. `requires HND (LBHNC)` or `rejects HND (LBHNC)`.
    pub fn describe(&self) -> String {
        let names = |v: &[KvLayout]| v.iter().map(|l| l.display_name()).collect::<Vec<_>>().join(" or ");
        let mut parts = Vec::new();
        if !self.required.is_empty() {
            parts.push(format!("requires {}", names(&self.required)));
        }
        if !self.rejected.is_empty() {
            parts.push(format!("rejects {}", names(&self.rejected)));
        }
        if parts.is_empty() {
            parts.push("accepts any layout".to_owned());
        }
        if !self.preferred.is_empty() {
            parts.push(format!("prefers {}", names(&self.preferred)));
        }
        parts.join(", ")
    }
}

/// The roles a connector can play: vLLM's `kv_role` values, [`KvRole`] (this name is kept
/// for the connectors and plugins written against it).
pub type KvRoleCap = KvRole;

/// Everything a connector declares about itself, for one config and model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Capabilities {
    /// Supports the hybrid KV cache manager (one block table per KV cache group).
    pub hma: bool,
    /// Which layouts it accepts.
    #[serde(default)]
    pub layout: LayoutConstraint,
    /// If set, the connector can adapt its own data path to a layout it does not accept, at
    /// this cost.
    #[serde(default)]
    pub adapt: Option<AdaptCost>,
    /// The block size (tokens per block) must be a multiple of this (1 = any).
    #[serde(default = "one")]
    pub block_size_multiple: u32,
    /// If set, the block size must divide this number of tokens (e.g. a cache's chunk size).
    #[serde(default)]
    pub block_size_divides: Option<u32>,
    /// Cache dtypes it can store; empty means any.
    #[serde(default)]
    pub cache_dtypes: Vec<Dtype>,
    /// Memory kinds it can read and write KV in.
    pub memory_kinds: Vec<MemoryKind>,
    /// How it moves KV between engines.
    pub transfer_mode: TransferMode,
    /// Roles it can play.
    pub roles: Vec<KvRole>,
    /// Saves and loads layer by layer.
    #[serde(default)]
    pub layerwise: bool,
    /// Handles different tensor-parallel sizes on the two sides.
    #[serde(default)]
    pub heterogeneous_tp: bool,
    /// Supports MLA (latent) KV caches.
    #[serde(default)]
    pub mla: bool,
    /// Loads complete asynchronously (reported through `get_finished`).
    #[serde(default)]
    pub async_load: bool,
    /// Saves and loads the per-request state of state-space / linear-attention layers
    /// (Mamba, Gated DeltaNet) with the KV, so a hybrid model's decode gets both. Left out
    /// of the JSON when false, so hosts that predate it read such declarations unchanged.
    #[serde(default, skip_serializing_if = "is_false")]
    pub carries_state: bool,
    /// Carries that state also when either side splits its KV heads over several
    /// tensor-parallel ranks (`tp_size` > 1). Without it, a model with state layers runs at
    /// `tp_size` 1 on both sides: negotiation refuses another size for such a model, and the
    /// compat check a peer with one. Left out of the JSON when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub state_with_tp: bool,
    /// Adapts blocks on receive (another block size or layout on the peer) also when either
    /// side splits its KV heads over several tensor-parallel ranks. Without it, a side with
    /// `tp_size` > 1 needs the peer's block size and layout: the compat check refuses the pair
    /// otherwise. Left out of the JSON when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub adapts_with_tp: bool,
    /// Adapts blocks on receive (another block size or layout on the peer) also for a model
    /// with state layers, whose per-request state moves beside the blocks. Without it, such a
    /// model needs the same block size and layout on both sides. Left out of the JSON when
    /// false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub adapts_with_state: bool,
    /// Over an engine whose blocks are opaque (`EngineOptions::opaque_blocks`), stores and
    /// loads them whole, byte for byte, in the engine's own layout: its layout constraint and
    /// adapter then do not apply. For caches whose blocks only the engine that stored them
    /// (same layout, same opaque format) reads back. Left out of the JSON when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub stores_opaque_blocks: bool,
    /// Serves the KV regions of several tensor-parallel ranks registered in one worker half:
    /// an engine whose ranks share one connector (`EngineOptions::ranks_per_worker` > 1, as
    /// kvconnect's reference engine runs its ranks as threads of one process). vLLM gives
    /// every rank its own connector and never needs it. Without it, negotiation refuses such
    /// an engine at `tp_size` > 1. Left out of the JSON when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub ranks_in_one_worker: bool,
    /// Needs the host's side channel (ARCHITECTURE.md §6): the host writes its address into
    /// the connector's `kv_connector_extra_config` as `side_channel_host` and
    /// `side_channel_port` (a producer hands it to its peers in the transfer params), whatever
    /// the connector's name, at the top level or as a composite's child at any depth. Left
    /// out of the JSON when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub needs_side_channel: bool,
    /// Needs the deployment's data-plane secret (ARCHITECTURE.md §10): the host writes it, in
    /// memory only, into the connector's `kv_connector_extra_config` under
    /// `data_plane_secret`, or removes that key when it has no secret; wherever the connector
    /// sits, as for `needs_side_channel`. Left out of the JSON when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub needs_data_plane_secret: bool,
    /// Needs a producer's KV regions in POSIX shared memory, where a consumer on the same
    /// host maps them: the host then allocates the producer's KV cache as shared-memory
    /// segments (kvconnect's block pool; vLLM's KV cache through the adapter), whatever the
    /// connector's name, at the top level or as a composite's child at any depth. Left out
    /// of the JSON when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub needs_shared_memory_kv: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn one() -> u32 {
    1
}

/// Declared capabilities that contradict themselves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapsError {
    /// A layout is both required and rejected.
    #[error("layout {layout} is both required and rejected")]
    RequiredAndRejected {
        /// The layout named in both sets.
        layout: String,
    },
    /// A preferred layout is rejected.
    #[error("layout {layout} is preferred but also rejected")]
    PreferredRejected {
        /// The layout.
        layout: String,
    },
    /// Every layout is rejected and the connector cannot adapt.
    #[error("it accepts no layout at all and cannot adapt")]
    NoLayout,
    /// A zero block-size constraint.
    #[error("block_size_multiple is 0; use 1 for 'any block size'")]
    ZeroBlockMultiple,
    /// A zero divisor constraint.
    #[error("block_size_divides is 0")]
    ZeroBlockDivides,
    /// The divisor is not compatible with the multiple.
    #[error(
        "block_size_divides {divides} is not a multiple of block_size_multiple {multiple}: no block size \
        satisfies both"
    )]
    BlockConstraintsDisjoint {
        /// block_size_divides.
        divides: u32,
        /// block_size_multiple.
        multiple: u32,
    },
    /// No memory kind.
    #[error("it declares no memory kind")]
    NoMemoryKind,
    /// No role.
    #[error("it declares no role")]
    NoRole,
}

impl Capabilities {
    /// Checks the declaration for contradictions. The loader calls this once per query and
    /// refuses a connector whose capabilities fail it.
    pub fn validate(&self) -> Result<(), CapsError> {
        for l in &self.layout.required {
            if self.layout.rejected.contains(l) {
                return Err(CapsError::RequiredAndRejected { layout: l.display_name() });
            }
        }
        for l in &self.layout.preferred {
            if self.layout.rejected.contains(l) {
                return Err(CapsError::PreferredRejected { layout: l.display_name() });
            }
        }
        if self.adapt.is_none() && !KvLayout::all().into_iter().any(|l| self.layout.accepts(l)) {
            return Err(CapsError::NoLayout);
        }
        if self.block_size_multiple == 0 {
            return Err(CapsError::ZeroBlockMultiple);
        }
        if let Some(d) = self.block_size_divides {
            if d == 0 {
                return Err(CapsError::ZeroBlockDivides);
            }
            if d % self.block_size_multiple != 0 {
                return Err(CapsError::BlockConstraintsDisjoint {
                    divides: d,
                    multiple: self.block_size_multiple,
                });
            }
        }
        if self.memory_kinds.is_empty() {
            return Err(CapsError::NoMemoryKind);
        }
        if self.roles.is_empty() {
            return Err(CapsError::NoRole);
        }
        Ok(())
    }

    /// True when the connector moves KV between engines but only between equal
    /// tensor-parallel sizes (it does not declare `heterogeneous_tp`): a peer with another
    /// `tp_size` cannot load from it or be loaded from.
    pub fn needs_equal_tp(&self) -> bool {
        self.transfer_mode != TransferMode::None && !self.heterogeneous_tp
    }

    /// A one-line summary for tables, e.g. `hma=yes layout=requires HND (LBHNC) mode=pull`.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "hma={} layout={} mode={}",
            if self.hma { "yes" } else { "no" },
            self.layout.describe(),
            self.transfer_mode
        );
        if let Some(c) = self.adapt {
            s.push_str(&format!(" adapt={c}"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Capabilities {
        Capabilities::builder(TransferMode::Pull, [MemoryKind::Host], [KvRole::Both])
            .hma(true)
            .build()
            .unwrap()
    }

    #[test]
    fn the_builder_validates_what_it_builds() {
        let any = || Capabilities::builder(TransferMode::None, [MemoryKind::Host], [KvRole::Both]);
        assert_eq!(any().block_size_multiple(0).build(), Err(CapsError::ZeroBlockMultiple));
        assert_eq!(
            any().block_size_multiple(16).block_size_divides(Some(24)).build(),
            Err(CapsError::BlockConstraintsDisjoint { divides: 24, multiple: 16 })
        );
        assert_eq!(
            Capabilities::builder(TransferMode::Pull, [], [KvRole::Both]).build(),
            Err(CapsError::NoMemoryKind)
        );
        assert_eq!(
            Capabilities::builder(TransferMode::Pull, [MemoryKind::Host], []).build(),
            Err(CapsError::NoRole)
        );
        let everything_rejected =
            LayoutConstraint { rejected: KvLayout::all(), ..LayoutConstraint::default() };
        assert_eq!(any().layout(everything_rejected.clone()).build(), Err(CapsError::NoLayout));
        let c = any()
            .layout(everything_rejected)
            .adapt(Some(AdaptCost::High))
            .mla(true)
            .async_load(true)
            .build()
            .unwrap();
        assert!(c.mla && c.async_load && !c.hma && c.block_size_multiple == 1 && c.cache_dtypes.is_empty());
        assert_eq!(c.adapt, Some(AdaptCost::High));
    }

    #[test]
    fn required_and_rejected_is_invalid() {
        let mut c = base();
        c.layout.required = vec![KvLayout::HND];
        c.layout.rejected = vec![KvLayout::LBHNC];
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("both required and rejected"), "{e}");
    }

    #[test]
    fn everything_rejected_without_adapter_is_invalid() {
        let mut c = base();
        c.layout.rejected = KvLayout::all();
        assert_eq!(c.validate(), Err(CapsError::NoLayout));
        c.adapt = Some(AdaptCost::Medium);
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn block_constraints() {
        let mut c = base();
        c.block_size_multiple = 0;
        assert_eq!(c.validate(), Err(CapsError::ZeroBlockMultiple));
        c.block_size_multiple = 16;
        c.block_size_divides = Some(40);
        assert!(matches!(c.validate(), Err(CapsError::BlockConstraintsDisjoint { .. })));
        c.block_size_divides = Some(256);
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn accepts_respects_required_and_rejected() {
        let c = LayoutConstraint { required: vec![KvLayout::HND], rejected: vec![], preferred: vec![] };
        assert!(c.accepts(KvLayout::LBHNC));
        assert!(!c.accepts(KvLayout::NHD));
        let r = LayoutConstraint { required: vec![], rejected: vec![KvLayout::HND], preferred: vec![] };
        assert!(!r.accepts(KvLayout::HND));
        assert!(r.accepts(KvLayout::BLNHC));
    }
}
