//! Where a request's per-request state is: the state-space / linear-attention layers keep,
//! instead of KV blocks, one fixed-size state per request (the conv window, then the
//! recurrent state, each in its dtype). An engine holds them in state regions registered
//! after its KV regions, one slot per request in each state layer; the request's slot id is
//! its block list for the state group (`BlocksPerGroup` lists the KV cache groups first, then
//! the state groups). Pure arithmetic, shared by the engine and the connectors.

use crate::geometry::{GeometryError, Span};
use crate::ids::{BlockId, LayerId};
use crate::layout::EffectiveLayout;
use serde::{Deserialize, Serialize};

/// One state region: the state layers it holds (one for the reference pool) and its slots.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StateRegion {
    /// Layers held, in storage order.
    pub layers: Vec<LayerId>,
    /// Slots (one request each) per layer.
    pub num_slots: u32,
}

/// The state regions of a set of registered regions, which come after the KV regions.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StateSlots {
    /// Bytes of one request's state in one layer (conv state, then recurrent state).
    pub slot_bytes: u64,
    /// Index of the first state region in the region list (the number of KV regions).
    pub first_region: usize,
    /// The state regions, in registration order.
    pub regions: Vec<StateRegion>,
}

impl StateSlots {
    /// Bytes of one slot for this effective layout: the state of its state groups (all of
    /// one shape), `None` when it has no state groups or a group's state shape is unknown.
    pub fn slot_bytes_of(eff: &EffectiveLayout) -> Option<u64> {
        let first = eff.state_groups.first()?;
        let state = first.state.as_ref()?;
        eff.state_groups.iter().all(|g| g.state.as_ref() == Some(state)).then(|| state.bytes())
    }

    /// True when no state region is known.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// True when a state region holds `layer`.
    pub fn holds(&self, layer: LayerId) -> bool {
        self.regions.iter().any(|r| r.layers.contains(&layer))
    }

    /// Bytes a state region occupies, `None` when that does not fit 64 bits (a peer's
    /// sizes are multiplied checked).
    pub fn region_bytes(&self, r: &StateRegion) -> Option<u64> {
        (r.layers.len() as u64).checked_mul(u64::from(r.num_slots))?.checked_mul(self.slot_bytes)
    }

    /// The bytes of `slot` of state layer `layer`.
    pub fn span(&self, layer: LayerId, slot: BlockId) -> Result<Span, GeometryError> {
        let (ri, r, li) = self
            .regions
            .iter()
            .enumerate()
            .find_map(|(i, r)| r.layers.iter().position(|l| *l == layer).map(|li| (i, r, li)))
            .ok_or(GeometryError::NoRegionForLayer(layer))?;
        if slot.0 >= r.num_slots {
            return Err(GeometryError::BlockOutOfRange { block: slot, layer, num_blocks: r.num_slots });
        }
        let len = usize::try_from(self.slot_bytes).map_err(|_| GeometryError::NoRegionForLayer(layer))?;
        let offset = (li * r.num_slots as usize + slot.0 as usize) * len;
        Ok(Span { region: self.first_region + ri, offset, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_kv_regions() {
        let s = StateSlots {
            slot_bytes: 100,
            first_region: 4,
            regions: vec![
                StateRegion { layers: vec![LayerId(1)], num_slots: 8 },
                StateRegion { layers: vec![LayerId(3)], num_slots: 8 },
            ],
        };
        assert_eq!(s.span(LayerId(3), BlockId(2)).unwrap(), Span { region: 5, offset: 200, len: 100 });
        assert!(s.holds(LayerId(1)) && !s.holds(LayerId(0)));
        assert!(matches!(s.span(LayerId(1), BlockId(8)), Err(GeometryError::BlockOutOfRange { .. })));
        assert!(matches!(s.span(LayerId(0), BlockId(0)), Err(GeometryError::NoRegionForLayer(_))));
        assert_eq!(s.region_bytes(&s.regions[0]), Some(800));
        let huge = StateSlots { slot_bytes: u64::MAX, ..s.clone() };
        assert_eq!(huge.region_bytes(&s.regions[0]), None);
    }
}
