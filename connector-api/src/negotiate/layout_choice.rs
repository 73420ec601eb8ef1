//! Choosing the layout: the order layouts are tried in, the fewest and cheapest adapters,
//! and the remedy when no layout fits.

use crate::caps::{AdaptCost, Capabilities};
use crate::layout::KvLayout;
use std::sync::OnceLock;

use super::outcome::LayoutAdapter;
use super::party::Party;

pub(super) fn cost_weight(c: AdaptCost) -> u32 {
    match c {
        AdaptCost::Low => 1,
        AdaptCost::Medium => 2,
        AdaptCost::High => 3,
    }
}

/// Every layout, built once: `KvLayout::all()` filters 3125 candidate orders each call.
pub(super) fn all_layouts() -> &'static [KvLayout] {
    static ALL: OnceLock<Vec<KvLayout>> = OnceLock::new();
    ALL.get_or_init(KvLayout::all)
}

/// The order layouts are tried in: children's preferences in child order, then the common
/// layouts, then every permutation.
pub(super) fn preference_order(parties: &[Party], with_all: bool) -> Vec<KvLayout> {
    let mut out: Vec<KvLayout> = Vec::with_capacity(if with_all { 120 } else { 8 });
    let mut push = |l: KvLayout| {
        if !out.contains(&l) {
            out.push(l);
        }
    };
    for p in parties {
        for l in &p.caps.layout.preferred {
            push(*l);
        }
    }
    for l in KvLayout::COMMON {
        push(l);
    }
    if with_all {
        for l in all_layouts().iter().copied() {
            push(l);
        }
    }
    out
}

/// (adapters needed, total adapter cost) for a layout, or `None` when a child can neither
/// accept nor adapt to it.
pub(super) fn layout_fit(layout: KvLayout, parties: &[Party]) -> Option<(usize, u32)> {
    let mut n = 0;
    let mut cost = 0;
    for p in parties {
        if p.accepts(layout) {
            continue;
        }
        let c = p.can_adapt()?;
        n += 1;
        cost += cost_weight(c);
    }
    Some((n, cost))
}

/// The best layout by (fewest adapters, lowest cost, preference order).
pub(super) fn pick_layout(parties: &[Party]) -> Option<KvLayout> {
    let short = preference_order(parties, false);
    // The short list usually holds a layout no child has to adapt to; the rest of the 120
    // are only looked at when it does not.
    let rest = all_layouts().iter().filter(|l| !short.contains(l));
    let mut best: Option<((usize, u32), KvLayout)> = None;
    for l in short.iter().chain(rest) {
        if let Some(fit) = layout_fit(*l, parties) {
            if best.as_ref().is_none_or(|(b, _)| fit < *b) {
                best = Some((fit, *l));
                if fit.0 == 0 {
                    // Nothing beats no adapter, and earlier layouts win ties.
                    break;
                }
            }
        }
    }
    best.map(|(_, l)| l)
}

/// The layout a child works in when it does not adapt.
pub(super) fn native_layout(caps: &Capabilities) -> KvLayout {
    let c = &caps.layout;
    c.preferred
        .iter()
        .chain(KvLayout::COMMON.iter())
        .copied()
        .find(|l| c.accepts(*l))
        .or_else(|| all_layouts().iter().copied().find(|l| c.accepts(*l)))
        .or_else(|| c.required.first().copied())
        .unwrap_or(KvLayout::LBNHC)
}

pub(super) fn adapters_for(layout: KvLayout, parties: &[Party]) -> Vec<(usize, LayoutAdapter)> {
    parties
        .iter()
        .enumerate()
        .filter(|(_, p)| !p.accepts(layout))
        .filter_map(|(i, p)| {
            p.can_adapt().map(|cost| {
                (
                    i,
                    LayoutAdapter {
                        child: p.name.to_owned(),
                        native: native_layout(p.caps),
                        effective: layout,
                        cost,
                    },
                )
            })
        })
        .collect()
}

pub(super) fn layout_remedy(parties: &[Party]) -> String {
    let mut out = Vec::new();
    if parties.iter().any(|p| p.caps.adapt.is_some() && !p.may_adapt) {
        let enabled: Vec<Party> = parties.iter().map(|p| Party { may_adapt: true, ..p.clone() }).collect();
        if let Some(l) = pick_layout(&enabled) {
            let who: Vec<String> =
                adapters_for(l, &enabled).into_iter().map(|(i, _)| enabled[i].label.clone()).collect();
            let verb = if who.len() == 1 { "adapts" } else { "adapt" };
            out.push(format!(
                "allow adapters (allow_adapters=true): {} then {verb} to {}",
                who.join(", "),
                l.display_name()
            ));
        }
    }
    for (i, p) in parties.iter().enumerate() {
        let rest: Vec<Party> =
            parties.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, q)| q.clone()).collect();
        if let Some(l) = pick_layout(&rest) {
            out.push(format!("remove {} (the others agree on {})", p.label, l.display_name()));
        }
    }
    if out.is_empty() {
        out.push("use children that share a layout, or a child version that can adapt its layout".to_owned());
    }
    out.join("; or ")
}

pub(super) fn adapter_clause(adapters: &[(usize, LayoutAdapter)], parties: &[Party]) -> String {
    adapters
        .iter()
        .map(|(i, a)| {
            format!(
                "; {} does not accept it and adapts with a transpose \
                 {} <-> {} on its own copy path ({} cost)",
                parties[*i].label,
                a.native.display_name(),
                a.effective.display_name(),
                a.cost
            )
        })
        .collect()
}
