//! A deployment: both roles negotiated over the union of their children, so that they agree.

use crate::caps::TransferMode;
use crate::model::ModelSpec;
use crate::role::Role;

use super::conflict::{list_does, Conflict};
use super::decide;
use super::decide::loads_across_tp;
use super::options::{ChildCaps, EngineOptions, HmaOption};
use super::outcome::Negotiated;
use super::party::{labels, Party};

/// Merges one option of the two roles: unset on one side takes the other's value; two set
/// values must agree.
fn merge_opt<T: PartialEq + Copy>(
    option: &str,
    p: Option<T>,
    d: Option<T>,
    show: impl Fn(T) -> String,
) -> Result<Option<T>, Conflict> {
    match (p, d) {
        (Some(a), Some(b)) if a != b => {
            Err(Conflict::OptionMismatch { option: option.to_owned(), prefill: show(a), decode: show(b) })
        }
        (Some(a), _) => Ok(Some(a)),
        (None, b) => Ok(b),
    }
}

/// Negotiates a deployment: both roles get the same layout, HMA and KV groups, block size,
/// dtype and transfer mode, computed from the union of both roles' children; each role
/// keeps its own memory kind and its own adapters. An option both roles set must agree
/// (`auto`/unset on one side takes the other side's value).
pub fn negotiate_deployment(
    model: &ModelSpec,
    prefill: (&EngineOptions, &[ChildCaps]),
    decode: (&EngineOptions, &[ChildCaps]),
) -> Result<(Negotiated, Negotiated), Conflict> {
    let (po, pc) = prefill;
    let (dopt, dc) = decode;
    let hma_of = |o: &EngineOptions| match o.hybrid_kv_cache_manager {
        HmaOption::Auto => None,
        h => Some(h),
    };
    let hma = merge_opt("hybrid_kv_cache_manager", hma_of(po), hma_of(dopt), |h| h.to_string())?;
    // Two layouts with the same bytes (one KV head, the head axis elsewhere) do not
    // conflict: each role keeps the one it was given.
    let (pl, dl) = (po.kv_cache_layout, dopt.kv_cache_layout);
    let own_layouts = matches!((pl, dl), (Some(a), Some(b)) if a.same_bytes(b, model.num_kv_heads));
    let layout =
        if own_layouts { None } else { merge_opt("kv_cache_layout", pl, dl, |l| l.canonical_name())? };
    let block = merge_opt("block_size", po.block_size, dopt.block_size, |b| b.to_string())?;
    let dtype = merge_opt("cache_dtype", po.cache_dtype, dopt.cache_dtype, |d| d.to_string())?;
    let shared = |o: &EngineOptions| EngineOptions {
        hybrid_kv_cache_manager: hma.unwrap_or(HmaOption::Auto),
        kv_cache_layout: layout.or(o.kv_cache_layout.filter(|_| own_layouts)),
        block_size: block,
        cache_dtype: dtype,
        ..o.clone()
    };

    // A child with the same name and capabilities on both sides (nixl on both) is one party.
    let in_decode = |c: &ChildCaps| dc.iter().any(|d| d.name == c.name && d.caps == c.caps);
    let in_prefill = |c: &ChildCaps| pc.iter().any(|p| p.name == c.name && p.caps == c.caps);

    let view = |role: Role| -> Vec<Party> {
        let mut parties = Vec::with_capacity(pc.len() + dc.len());
        for c in pc {
            let both = in_decode(c);
            parties.push(Party {
                name: &c.name,
                label: if both {
                    format!("child '{}' (prefill and decode)", c.name)
                } else {
                    format!("prefill child '{}'", c.name)
                },
                own: both || role == Role::Prefill,
                caps: &c.caps,
                may_adapt: po.allow_adapters && (!both || dopt.allow_adapters),
                heads: model.num_kv_heads,
            });
        }
        for c in dc.iter().filter(|c| !in_prefill(c)) {
            parties.push(Party {
                name: &c.name,
                label: format!("decode child '{}'", c.name),
                own: role == Role::Decode,
                caps: &c.caps,
                may_adapt: dopt.allow_adapters,
                heads: model.num_kv_heads,
            });
        }
        parties
    };

    let run = |role: Role, opts: &EngineOptions, children: &[ChildCaps]| -> Result<Negotiated, Conflict> {
        let parties = view(role);
        let (effective, provenance, adapters) = decide(model, &shared(opts), &parties)?;
        Ok(Negotiated {
            effective,
            provenance,
            adapters: adapters.into_iter().filter(|(i, _)| parties[*i].own).map(|(_, a)| a).collect(),
            children: children.to_vec(),
        })
    };
    let p = run(Role::Prefill, po, pc)?;
    let d = run(Role::Decode, dopt, dc)?;
    if let Some(remedy) = super::tp_refusal(
        (Role::Prefill.name(), po.tp_size),
        (Role::Decode.name(), dopt.tp_size),
        loads_across_tp(pc.iter().chain(dc).map(|c| &c.caps)),
    ) {
        let parties = view(Role::Prefill);
        let children = labels(&parties.iter().filter(|p| p.caps.needs_equal_tp()).collect::<Vec<_>>());
        let reason = if !children.is_empty() {
            format!("{} not load KV across different TP sizes (no heterogeneous_tp)", list_does(&children))
        } else if parties.iter().all(|p| p.caps.transfer_mode == TransferMode::None) {
            "no child moves KV between the roles".to_owned()
        } else {
            format!("{} and {} do not divide each other", po.tp_size, dopt.tp_size)
        };
        return Err(Conflict::TpSize { prefill: po.tp_size, decode: dopt.tp_size, children, reason, remedy });
    }
    Ok((p, d))
}
