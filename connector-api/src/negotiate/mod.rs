//! Negotiation: the children's declared capabilities, the model and the engine options give
//! one effective KV layout, every field with its provenance, or a [`Conflict`] that names
//! every child's constraint and a remedy.
//!
//! [`negotiate`] is pure and deterministic, so a prefill worker and a decode worker that run
//! it over the same inputs agree by construction. [`negotiate_deployment`] runs it for both
//! roles of a deployment over the union of their children, which is what keeps a composite
//! on prefill and a plain transport on decode from disagreeing about HMA (Dynamo DYN-3545).

mod allowed;
mod conflict;
mod decide;
mod deployment;
mod groups;
mod layout_choice;
mod options;
mod outcome;
mod party;
#[cfg(test)]
mod tests;
mod tp_sizes;

pub use conflict::{ChildConstraint, Conflict};
pub use decide::loads_across_tp;
pub use deployment::negotiate_deployment;
pub use groups::{
    describe_groups, describe_groups_with, describe_state_groups, kv_groups, kv_kinds, state_groups,
};
pub use options::{ChildCaps, EngineOptions, HmaOption, OptionParseError};
pub use outcome::{DecidedBy, FieldProvenance, LayoutAdapter, LayoutField, Negotiated};
pub(crate) use tp_sizes::{tp_exchangeable, tp_refusal};

use crate::caps::{Capabilities, LayoutConstraint};
use crate::layout::EffectiveLayout;
use crate::model::ModelSpec;
use decide::{
    check_inputs, decide_block_size, decide_dtype, decide_hma, decide_layout, decide_memory, decide_mode,
    decide_state, decide_tp, field, Decision,
};
use party::Party;

/// The whole negotiation over one set of parties. `opts` holds the shared options already
/// merged; memory is checked against the own parties only.
fn decide(model: &ModelSpec, opts: &EngineOptions, parties: &[Party]) -> Result<Decision, Conflict> {
    check_inputs(model, opts, parties)?;
    let (hma, groups) = decide_hma(model, opts, parties)?;
    let state = decide_state(model, opts.tp_size, parties)?;
    // Over opaque blocks, a child that stores them whole takes the engine's layout as it is:
    // its own constraint (and adapter) is for blocks it looks inside.
    let whole: Vec<Capabilities> = parties
        .iter()
        .map(|p| match opts.opaque_blocks.is_some() && p.caps.stores_opaque_blocks {
            true => Capabilities { layout: LayoutConstraint::default(), adapt: None, ..p.caps.clone() },
            false => p.caps.clone(),
        })
        .collect();
    let layout_parties: Vec<Party> =
        parties.iter().zip(&whole).map(|(p, c)| Party { caps: c, ..p.clone() }).collect();
    let (layout, adapters) = decide_layout(opts, &layout_parties)?;
    if let (Some(why), false) = (&opts.opaque_blocks, adapters.is_empty()) {
        let children: Vec<String> = adapters.iter().map(|(i, _)| parties[*i].label.clone()).collect();
        let words = adapters
            .iter()
            .map(|(i, a)| format!("{}: {} -> {}", parties[*i].label, a.native, a.effective))
            .collect();
        return Err(Conflict::OpaqueBlocks {
            why: why.clone(),
            layout: layout.value,
            children,
            adapters: words,
        });
    }
    let block = decide_block_size(opts, parties)?;
    let dtype = decide_dtype(model, opts, parties)?;
    let memory = decide_memory(opts, parties)?;
    let mode = decide_mode(parties)?;
    let tp = decide_tp(opts, parties);

    let mut provenance = vec![
        field(LayoutField::Layout, layout.value.display_name(), layout.by, layout.reason),
        field(LayoutField::Hma, if hma.value { "on" } else { "off" }.to_owned(), hma.by, hma.reason),
        field(LayoutField::BlockSize, block.value.to_string(), block.by, block.reason),
        field(LayoutField::CacheDtype, dtype.value.to_string(), dtype.by, dtype.reason),
        field(LayoutField::Memory, memory.value.to_string(), memory.by, memory.reason),
        field(LayoutField::TransferMode, mode.value.to_string(), mode.by, mode.reason),
        field(
            LayoutField::KvGroups,
            describe_groups_with(&groups.value, hma.value),
            groups.by,
            groups.reason,
        ),
        field(LayoutField::TpSize, tp.value.to_string(), tp.by, tp.reason),
    ];
    let state_groups = match state {
        Some(st) => {
            // Next to the KV cache groups.
            let at = provenance
                .iter()
                .position(|p| p.field == LayoutField::KvGroups)
                .map_or(provenance.len(), |i| i + 1);
            provenance.insert(
                at,
                field(LayoutField::StateGroups, describe_state_groups(&st.value), st.by, st.reason),
            );
            st.value
        }
        None => Vec::new(),
    };
    let effective = EffectiveLayout {
        layout: layout.value,
        hma: hma.value,
        block_size: block.value,
        cache_dtype: dtype.value,
        memory: memory.value,
        transfer_mode: mode.value,
        groups: groups.value,
        state_groups,
        opaque_blocks: opts.opaque_blocks.is_some(),
    };
    Ok((effective, provenance, adapters))
}

/// Negotiates one worker's effective layout from its children's capabilities.
pub fn negotiate(
    model: &ModelSpec,
    opts: &EngineOptions,
    children: &[ChildCaps],
) -> Result<Negotiated, Conflict> {
    let parties: Vec<Party> = children
        .iter()
        .map(|c| Party {
            name: &c.name,
            label: format!("child '{}'", c.name),
            own: true,
            caps: &c.caps,
            may_adapt: opts.allow_adapters,
            heads: model.num_kv_heads,
        })
        .collect();
    let (effective, provenance, adapters) = decide(model, opts, &parties)?;
    Ok(Negotiated {
        effective,
        provenance,
        adapters: adapters.into_iter().map(|(_, a)| a).collect(),
        children: children.to_vec(),
    })
}
