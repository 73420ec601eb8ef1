//! Building a [`Capabilities`] declaration that is checked when it is made.

use super::{AdaptCost, Capabilities, CapsError, KvRole, LayoutConstraint, MemoryKind, TransferMode};
use crate::model::Dtype;

/// Builds a [`Capabilities`] from what a connector must declare (how it moves KV, where it
/// keeps it, which roles it plays) and whatever it adds; [`CapabilitiesBuilder::build`]
/// validates the result, so a declaration that contradicts itself never leaves the builder.
///
/// Everything not set is the most modest claim: no HMA, any layout and no adapter, any block
/// size, any cache dtype, not layerwise, equal TP sizes only, no MLA, synchronous loads, no
/// state, and no adaptation combined with tensor parallelism or state.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until build() is called"]
pub struct CapabilitiesBuilder {
    caps: Capabilities,
}

impl Capabilities {
    /// A builder for a connector that moves KV by `transfer_mode`, keeps it in
    /// `memory_kinds` and plays `roles`.
    pub fn builder(
        transfer_mode: TransferMode,
        memory_kinds: impl IntoIterator<Item = MemoryKind>,
        roles: impl IntoIterator<Item = KvRole>,
    ) -> CapabilitiesBuilder {
        CapabilitiesBuilder {
            caps: Capabilities {
                hma: false,
                layout: LayoutConstraint::default(),
                adapt: None,
                block_size_multiple: 1,
                block_size_divides: None,
                cache_dtypes: Vec::new(),
                memory_kinds: memory_kinds.into_iter().collect(),
                transfer_mode,
                roles: roles.into_iter().collect(),
                layerwise: false,
                heterogeneous_tp: false,
                mla: false,
                async_load: false,
                carries_state: false,
                state_with_tp: false,
                adapts_with_tp: false,
                adapts_with_state: false,
                stores_opaque_blocks: false,
                ranks_in_one_worker: false,
                needs_side_channel: false,
                needs_data_plane_secret: false,
                needs_shared_memory_kv: false,
            },
        }
    }
}

impl CapabilitiesBuilder {
    /// Supports the hybrid KV cache manager.
    pub fn hma(mut self, yes: bool) -> Self {
        self.caps.hma = yes;
        self
    }

    /// The layouts it accepts.
    pub fn layout(mut self, layout: LayoutConstraint) -> Self {
        self.caps.layout = layout;
        self
    }

    /// Adapts its own data path to a layout it does not accept, at this cost (`None`: never).
    pub fn adapt(mut self, cost: Option<AdaptCost>) -> Self {
        self.caps.adapt = cost;
        self
    }

    /// The block size must be a multiple of `n`.
    pub fn block_size_multiple(mut self, n: u32) -> Self {
        self.caps.block_size_multiple = n;
        self
    }

    /// The block size must divide `tokens` (`None`: no such constraint).
    pub fn block_size_divides(mut self, tokens: Option<u32>) -> Self {
        self.caps.block_size_divides = tokens;
        self
    }

    /// The cache dtypes it can store (empty: any).
    pub fn cache_dtypes(mut self, dtypes: impl IntoIterator<Item = Dtype>) -> Self {
        self.caps.cache_dtypes = dtypes.into_iter().collect();
        self
    }

    /// Saves and loads layer by layer.
    pub fn layerwise(mut self, yes: bool) -> Self {
        self.caps.layerwise = yes;
        self
    }

    /// Handles different tensor-parallel sizes on the two sides.
    pub fn heterogeneous_tp(mut self, yes: bool) -> Self {
        self.caps.heterogeneous_tp = yes;
        self
    }

    /// Supports MLA (latent) KV caches.
    pub fn mla(mut self, yes: bool) -> Self {
        self.caps.mla = yes;
        self
    }

    /// Loads complete asynchronously.
    pub fn async_load(mut self, yes: bool) -> Self {
        self.caps.async_load = yes;
        self
    }

    /// Carries the per-request state of state-space layers with the KV.
    pub fn carries_state(mut self, yes: bool) -> Self {
        self.caps.carries_state = yes;
        self
    }

    /// Carries that state also when either side has `tp_size` > 1.
    pub fn state_with_tp(mut self, yes: bool) -> Self {
        self.caps.state_with_tp = yes;
        self
    }

    /// Adapts blocks (block size, layout) also when either side has `tp_size` > 1.
    pub fn adapts_with_tp(mut self, yes: bool) -> Self {
        self.caps.adapts_with_tp = yes;
        self
    }

    /// Adapts blocks (block size, layout) also for a model with state layers.
    pub fn adapts_with_state(mut self, yes: bool) -> Self {
        self.caps.adapts_with_state = yes;
        self
    }

    /// Serves the regions of several tensor-parallel ranks in one worker
    /// (`Capabilities::ranks_in_one_worker`).
    pub fn ranks_in_one_worker(mut self, yes: bool) -> Self {
        self.caps.ranks_in_one_worker = yes;
        self
    }

    /// Needs the host's side channel (`Capabilities::needs_side_channel`).
    pub fn needs_side_channel(mut self, yes: bool) -> Self {
        self.caps.needs_side_channel = yes;
        self
    }

    /// Needs the deployment's data-plane secret (`Capabilities::needs_data_plane_secret`).
    pub fn needs_data_plane_secret(mut self, yes: bool) -> Self {
        self.caps.needs_data_plane_secret = yes;
        self
    }

    /// Needs a producer's KV regions in shared memory (`Capabilities::needs_shared_memory_kv`).
    pub fn needs_shared_memory_kv(mut self, yes: bool) -> Self {
        self.caps.needs_shared_memory_kv = yes;
        self
    }

    /// Stores and loads an engine's opaque blocks whole (`Capabilities::stores_opaque_blocks`).
    pub fn stores_opaque_blocks(mut self, yes: bool) -> Self {
        self.caps.stores_opaque_blocks = yes;
        self
    }

    /// The declaration, or why it contradicts itself ([`Capabilities::validate`]).
    pub fn build(self) -> Result<Capabilities, CapsError> {
        self.caps.validate()?;
        Ok(self.caps)
    }
}
