//! The block pool's state slots: for models with state-space / linear-attention layers, one
//! region per state layer after the KV regions, each with one fixed-size slot per request
//! (`kvconnect_api::state_slots`), and per state group a free list of slots. A request holds
//! one slot per state group for its whole life; its id is the request's block list for that
//! group, after the KV cache groups' lists.

use crate::error::EngineError;
use crate::pool::{push_host_region, HostRegion};
use crate::region::RegionMemory;
use kvconnect_api::state_slots::StateSlots;
use kvconnect_api::{BlockId, EffectiveLayout, KvRegion};

/// Free and used state slots, per state group.
#[derive(Debug, Default)]
pub struct StatePool {
    free: Vec<Vec<u32>>,
    used: Vec<Vec<bool>>,
}

impl StatePool {
    /// Allocates `num_slots` slots in every state layer of `eff`, appending their regions
    /// (and the memory behind them) after the KV regions. Nothing for a model without state.
    pub fn allocate(
        eff: &EffectiveLayout,
        num_slots: u32,
        shm_engine_id: Option<&str>,
        regions: &mut Vec<KvRegion>,
        memories: &mut Vec<RegionMemory>,
    ) -> Result<StatePool, EngineError> {
        if eff.state_groups.is_empty() {
            return Ok(StatePool::default());
        }
        let slot_bytes = StateSlots::slot_bytes_of(eff).ok_or_else(|| {
            EngineError::Layout(
                "the model's state layers have no state shape; give the conv and recurrent state dimensions \
                    in its config.json"
                    .into(),
            )
        })?;
        let kv_groups = eff.groups.len();
        for (si, g) in eff.state_groups.iter().enumerate() {
            for layer in &g.layers {
                let name = format!("state.{}", layer.0);
                let len = usize::try_from(slot_bytes)
                    .ok()
                    .and_then(|b| b.checked_mul(num_slots as usize))
                    .ok_or_else(|| EngineError::Alloc { name: name.clone(), bytes: usize::MAX })?;
                let r = HostRegion {
                    name,
                    len,
                    layers: vec![*layer],
                    group: kv_groups + si,
                    num_blocks: num_slots,
                };
                push_host_region(r, shm_engine_id, regions, memories)?;
            }
        }
        let n = eff.state_groups.len();
        Ok(StatePool {
            free: vec![(0..num_slots).rev().collect(); n],
            used: vec![vec![false; num_slots as usize]; n],
        })
    }

    /// Number of state groups.
    pub fn groups(&self) -> usize {
        self.free.len()
    }

    /// One free slot of every state group, or None (nothing taken) when a group has none.
    pub fn take(&mut self) -> Option<Vec<u32>> {
        if self.free.iter().any(Vec::is_empty) {
            return None;
        }
        let mut out = Vec::with_capacity(self.free.len());
        for (free, used) in self.free.iter_mut().zip(&mut self.used) {
            let s = free.pop()?;
            used[s as usize] = true;
            out.push(s);
        }
        Some(out)
    }

    /// Gives the slots of state group `g` back; ids out of range or not in use are ignored
    /// with a warning.
    pub fn release(&mut self, g: usize, slots: &[BlockId]) {
        let (Some(free), Some(used)) = (self.free.get_mut(g), self.used.get_mut(g)) else { return };
        for s in slots {
            match used.get_mut(s.0 as usize) {
                Some(u) if *u => {
                    *u = false;
                    free.push(s.0);
                }
                _ => tracing::warn!(
                    state_group = g,
                    slot = s.0,
                    "release of an invalid or free state slot ignored"
                ),
            }
        }
    }
}
