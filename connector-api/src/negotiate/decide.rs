//! One `decide_*` function per field of the effective layout: its value, who decided it
//! and why, or the conflict.

use crate::caps::{Capabilities, MemoryKind, TransferMode};
use crate::layout::{EffectiveLayout, KvGroup, KvLayout, StateGroup};
use crate::math::gcd;
use crate::model::{AttentionKind, Dtype, ModelSpec};

use super::allowed::{joined, AllowedValue};
use super::conflict::{list_does, them, verb, Conflict};
use super::groups::{describe_state_groups, kv_groups, kv_kinds, state_groups};
use super::layout_choice::{adapter_clause, adapters_for, layout_remedy, native_layout, pick_layout};
use super::options::{EngineOptions, HmaOption};
use super::outcome::{DecidedBy, FieldProvenance, LayoutAdapter, LayoutField};
use super::party::{constraints, labels, Party};

pub(super) const BLOCK_SIZES: [u32; 13] = [16, 32, 64, 128, 8, 256, 4, 512, 2, 1024, 1, 2048, 4096];

/// The block size every child accepts: the first of 16, 32, 64, 128, 8, 256, ... or, for
/// unusual constraints, the least common multiple of the children's multiples.
pub(super) fn fitting_block_size(parties: &[Party]) -> Option<u32> {
    if let Some(b) = BLOCK_SIZES.iter().copied().find(|b| parties.iter().all(|p| p.block_ok(*b))) {
        return Some(b);
    }
    let mut l: u64 = 1;
    for p in parties {
        let m = u64::from(p.caps.block_size_multiple.max(1));
        l = l / gcd(l, m) * m;
        if l > u64::from(u32::MAX) {
            return None;
        }
    }
    let l = l as u32;
    parties.iter().all(|p| p.block_ok(l)).then_some(l)
}

pub(super) fn field(
    field: LayoutField,
    value: String,
    decided_by: DecidedBy,
    reason: String,
) -> FieldProvenance {
    FieldProvenance { field, value, decided_by, reason }
}

/// Adapters, each with the index of the party that adapts.
pub(super) type Adapters = Vec<(usize, LayoutAdapter)>;

/// The effective layout, its provenance, and the adapters.
pub(super) type Decision = (EffectiveLayout, Vec<FieldProvenance>, Adapters);

/// One field's value, who decided it and why.
pub(super) struct Decided<T> {
    pub(super) value: T,
    pub(super) by: DecidedBy,
    pub(super) reason: String,
}

pub(super) fn decided<T>(value: T, by: DecidedBy, reason: String) -> Decided<T> {
    Decided { value, by, reason }
}

/// Options and declarations no negotiation can work with.
pub(super) fn check_inputs(
    model: &ModelSpec,
    opts: &EngineOptions,
    parties: &[Party],
) -> Result<(), Conflict> {
    for p in parties {
        if let Err(e) = p.caps.validate() {
            return Err(Conflict::InvalidCaps { child: p.label.clone(), error: e.to_string() });
        }
    }
    if opts.tp_size == 0 {
        return Err(Conflict::InvalidOption {
            option: "tp_size".to_owned(),
            value: "0".to_owned(),
            reason: "the tensor-parallel size is at least 1".to_owned(),
        });
    }
    if opts.tp_rank >= opts.tp_size {
        return Err(Conflict::InvalidOption {
            option: "tp_rank".to_owned(),
            value: opts.tp_rank.to_string(),
            reason: format!("ranks go from 0 to tp_size-1 = {}", opts.tp_size - 1),
        });
    }
    if opts.ranks_per_worker == 0 || opts.ranks_per_worker > opts.tp_size {
        return Err(Conflict::InvalidOption {
            option: "ranks_per_worker".to_owned(),
            value: opts.ranks_per_worker.to_string(),
            reason: format!("one connector serves 1 to tp_size = {} ranks", opts.tp_size),
        });
    }
    if opts.ranks_per_worker > 1 {
        let single: Vec<&Party> = parties.iter().filter(|p| !p.caps.ranks_in_one_worker).collect();
        if !single.is_empty() {
            return Err(Conflict::RanksInOneWorker {
                ranks: opts.ranks_per_worker,
                children: labels(&single),
            });
        }
    }
    if opts.block_size == Some(0) {
        return Err(Conflict::InvalidOption {
            option: "block_size".to_owned(),
            value: "0".to_owned(),
            reason: "a block holds at least one token; leave it unset for the default 16".to_owned(),
        });
    }
    if model.layers.iter().any(|k| matches!(k, AttentionKind::Mla { .. })) {
        let unsupported: Vec<&Party> = parties.iter().filter(|p| !p.caps.mla).collect();
        if !unsupported.is_empty() {
            return Err(Conflict::MlaUnsupported {
                model: model.name.clone(),
                unsupported: labels(&unsupported),
            });
        }
    }
    Ok(())
}

/// HMA and the KV cache groups it gives.
pub(super) fn decide_hma(
    model: &ModelSpec,
    opts: &EngineOptions,
    parties: &[Party],
) -> Result<(Decided<bool>, Decided<Vec<KvGroup>>), Conflict> {
    let kinds = kv_kinds(model);
    // State-space and linear-attention layers keep per-sequence state that only the hybrid
    // manager can allocate; feed-forward-only blocks keep nothing and do not count.
    let linear = model.layers.iter().filter(|k| matches!(k, AttentionKind::Linear)).count() as u32;
    let lacking: Vec<&Party> = parties.iter().filter(|p| !p.caps.hma).collect();
    let matters = kinds.len() > 1 || linear > 0;
    let (hma, hma_by, hma_reason) =
        match opts.hybrid_kv_cache_manager {
            HmaOption::On => {
                if !lacking.is_empty() {
                    return Err(Conflict::HmaUnsupported {
                        unsupported: labels(&lacking),
                        supported: parties.iter().filter(|p| p.caps.hma).map(|p| p.label.clone()).collect(),
                    });
                }
                (true, DecidedBy::User, "user set hybrid_kv_cache_manager=on".to_owned())
            }
            HmaOption::Off => {
                if linear > 0 {
                    return Err(Conflict::HmaRequired {
                        model: model.name.clone(),
                        linear_layers: linear,
                        user_off: true,
                        unsupported: labels(&lacking),
                    });
                }
                (false, DecidedBy::User, "user set hybrid_kv_cache_manager=off".to_owned())
            }
            HmaOption::Auto => {
                if linear > 0 && !lacking.is_empty() {
                    return Err(Conflict::HmaRequired {
                        model: model.name.clone(),
                        linear_layers: linear,
                        user_off: false,
                        unsupported: labels(&lacking),
                    });
                }
                if linear > 0 {
                    (
                    true,
                    DecidedBy::Model,
                    format!("model has {linear} state-space/linear-attention layer(s), which need the hybrid \
                        KV cache manager; every child supports it"),
                )
                } else if !matters {
                    let kind = kinds.first().map(|k| k.to_string()).unwrap_or_else(|| "none".to_owned());
                    (
                        false,
                        DecidedBy::Model,
                        format!(
                            "model has one attention kind ({kind}): HMA would not change the KV cache groups"
                        ),
                    )
                } else if let Some(first) = lacking.first() {
                    let names = labels(&lacking);
                    (false, first.decided_by(), format!("{} not support HMA", list_does(&names)))
                } else {
                    (
                        true,
                        DecidedBy::Default,
                        format!("every child supports HMA and the model has {} attention kinds", kinds.len()),
                    )
                }
            }
        };
    let groups = kv_groups(model, hma);
    let (groups_by, groups_reason) = if !matters {
        (
            DecidedBy::Model,
            "model has one attention kind: all KV layers share one block table whatever HMA is".to_owned(),
        )
    } else if hma {
        (hma_by.clone(), "HMA on: one block table per attention kind".to_owned())
    } else {
        (hma_by.clone(), "HMA off: all KV layers share one block table".to_owned())
    };
    Ok((decided(hma, hma_by, hma_reason), decided(groups, groups_by, groups_reason)))
}

/// The layout and the children that adapt to it.
pub(super) fn decide_layout(
    opts: &EngineOptions,
    parties: &[Party],
) -> Result<(Decided<KvLayout>, Adapters), Conflict> {
    let (layout, layout_by, layout_reason) = match opts.kv_cache_layout {
        Some(l) => {
            let violators: Vec<&Party> =
                parties.iter().filter(|p| !p.accepts(l) && p.can_adapt().is_none()).collect();
            if !violators.is_empty() {
                let mut remedy = match pick_layout(parties) {
                    Some(best) => format!(
                        "leave kv_cache_layout unset (negotiation picks {}) or set kv_cache_layout={}",
                        best.display_name(),
                        best.canonical_name()
                    ),
                    None => layout_remedy(parties),
                };
                if violators.iter().any(|p| p.caps.adapt.is_some() && !p.may_adapt) {
                    remedy.push_str("; or allow adapters (allow_adapters=true)");
                }
                return Err(Conflict::Layout {
                    requested: Some(l),
                    violators: labels(&violators),
                    constraints: constraints(parties, |p| p.layout_constraint()),
                    remedy,
                });
            }
            (l, DecidedBy::User, format!("user set kv_cache_layout={}", l.canonical_name()))
        }
        None => {
            let Some(l) = pick_layout(parties) else {
                return Err(Conflict::Layout {
                    requested: None,
                    violators: vec![],
                    constraints: constraints(parties, |p| p.layout_constraint()),
                    remedy: layout_remedy(parties),
                });
            };
            let name = l.display_name();
            if parties.is_empty() {
                (
                    l,
                    DecidedBy::Default,
                    format!("no child constrains the layout; {name} is the first common layout"),
                )
            } else if let Some(p) = parties.iter().find(|p| p.caps.layout.required == [l]) {
                (l, p.decided_by(), format!("{} requires {name}", p.label))
            } else if let Some(p) = parties.iter().find(|p| p.caps.layout.preferred.contains(&l)) {
                (l, p.decided_by(), format!("{} prefers {name}", p.label))
            } else {
                (l, DecidedBy::Default, format!("{name} is the first common layout every child accepts"))
            }
        }
    };
    let adapters = adapters_for(layout, parties);
    let mut layout_reason = if adapters.is_empty() {
        if parties.is_empty() {
            layout_reason
        } else {
            format!("{layout_reason}; every child accepts it")
        }
    } else {
        format!("{layout_reason}{}", adapter_clause(&adapters, parties))
    };
    for p in parties.iter().filter(|p| p.accepts_only_as_same_bytes(layout)) {
        layout_reason.push_str(&format!("; {}: {}", p.label, native_layout(p.caps).one_head_note(layout)));
    }
    Ok((decided(layout, layout_by, layout_reason), adapters))
}

/// The block size: the user's, else 16, else the first size every child accepts.
pub(super) fn decide_block_size(opts: &EngineOptions, parties: &[Party]) -> Result<Decided<u32>, Conflict> {
    let (block_size, block_by, block_reason) = match opts.block_size {
        Some(b) => {
            let violations: Vec<String> = parties.iter().filter_map(|p| p.block_violation(b)).collect();
            if !violations.is_empty() {
                let remedy = match fitting_block_size(parties) {
                    Some(ok) => {
                        format!("set block_size={ok} (or leave it unset), or remove the child named above")
                    }
                    None => {
                        "no block size fits every child: remove one of the children named above".to_owned()
                    }
                };
                return Err(Conflict::BlockSize {
                    block_size: b,
                    by_user: true,
                    violations,
                    constraints: constraints(parties, |p| p.block_constraint()),
                    remedy,
                });
            }
            (b, DecidedBy::User, format!("user set block_size={b}; every child accepts it"))
        }
        None => {
            let default = BLOCK_SIZES[0];
            let violations: Vec<(usize, String)> = parties
                .iter()
                .enumerate()
                .filter_map(|(i, p)| p.block_violation(default).map(|v| (i, v)))
                .collect();
            match violations.first() {
                None => (
                    default,
                    DecidedBy::Default,
                    "vLLM's default block size; every child accepts it".to_owned(),
                ),
                Some((first, _)) => match fitting_block_size(parties) {
                    Some(b) => (
                        b,
                        parties[*first].decided_by(),
                        format!(
                            "the default 16 does not fit ({}); {b} is the first of 16, 32, 64, 128, 8, 256, \
                                ... that every child accepts",
                            violations.iter().map(|(_, v)| v.as_str()).collect::<Vec<_>>().join("; ")
                        ),
                    ),
                    None => {
                        return Err(Conflict::BlockSize {
                            block_size: default,
                            by_user: false,
                            violations: violations.into_iter().map(|(_, v)| v).collect(),
                            constraints: constraints(parties, |p| p.block_constraint()),
                            remedy:
                                "the children's block-size constraints exclude each other: remove one of \
                                them or change its chunk size"
                                    .to_owned(),
                        })
                    }
                },
            }
        }
    };
    Ok(decided(block_size, block_by, block_reason))
}

/// The cache dtype: the user's, else the model's, else bf16.
pub(super) fn decide_dtype(
    model: &ModelSpec,
    opts: &EngineOptions,
    parties: &[Party],
) -> Result<Decided<Dtype>, Conflict> {
    let chosen = match (opts.cache_dtype, model.dtype) {
        (Some(d), _) => decided(d, DecidedBy::User, format!("user set cache_dtype={d}")),
        (None, Some(d)) => decided(d, DecidedBy::Model, format!("model torch_dtype is {d}")),
        (None, None) => decided(Dtype::Bf16, DecidedBy::Default, "config has no torch_dtype".to_owned()),
    };
    let cache_dtype = AllowedValue {
        values: &[Dtype::Bf16, Dtype::F16, Dtype::F32, Dtype::Fp8E4m3, Dtype::Fp8E5m2],
        // A child that lists no dtype stores any.
        allows: |p, d| p.caps.cache_dtypes.is_empty() || p.caps.cache_dtypes.contains(d),
        describe: |p| {
            if p.caps.cache_dtypes.is_empty() {
                "stores any dtype".to_owned()
            } else {
                format!("stores {}", joined(&p.caps.cache_dtypes))
            }
        },
        noun: "cache dtype",
        setting: |common| format!("cache_dtype to {common}"),
        source_of: |by| match by {
            DecidedBy::User => "set by user",
            DecidedBy::Model => "the model's torch_dtype",
            _ => "default: config has no torch_dtype",
        },
        refuse: |r| Conflict::CacheDtype {
            dtype: r.value,
            source_of: r.source_of,
            violators: r.violators,
            constraints: r.constraints,
            remedy: r.remedy,
        },
    };
    cache_dtype.check(chosen, &parties.iter().collect::<Vec<_>>())
}

/// The memory kind. Only this worker's own children touch its KV memory.
pub(super) fn decide_memory(
    opts: &EngineOptions,
    parties: &[Party],
) -> Result<Decided<MemoryKind>, Conflict> {
    let chosen = match opts.memory {
        Some(m) => decided(m, DecidedBy::User, format!("user set kv_buffer_device ({m})")),
        None => decided(
            MemoryKind::Host,
            DecidedBy::Default,
            "KV buffers in host memory unless kv_buffer_device says otherwise".to_owned(),
        ),
    };
    let memory = AllowedValue {
        values: &[MemoryKind::Host, MemoryKind::Device, MemoryKind::Disk],
        allows: |p, m| p.caps.memory_kinds.contains(m),
        describe: |p| format!("uses {}", joined(&p.caps.memory_kinds)),
        noun: "memory kind",
        setting: |common| format!("kv_buffer_device to {common} memory"),
        source_of: |by| {
            if *by == DecidedBy::User {
                "set by user"
            } else {
                "default"
            }
        },
        refuse: |r| Conflict::Memory {
            memory: r.value,
            source_of: r.source_of,
            violators: r.violators,
            constraints: r.constraints,
            remedy: r.remedy,
        },
    };
    memory.check(chosen, &parties.iter().filter(|p| p.own).collect::<Vec<_>>())
}

/// The tensor-parallel size, and whether the peer may use another one: only when every
/// child that moves KV between engines declares `heterogeneous_tp`.
pub(super) fn decide_tp(opts: &EngineOptions, parties: &[Party]) -> Decided<u32> {
    let tp = opts.tp_size;
    let (by, head) = if tp == 1 {
        (DecidedBy::Default, "one tensor-parallel rank unless tp_size says otherwise".to_owned())
    } else {
        (DecidedBy::User, format!("user set tp_size={tp}"))
    };
    let movers: Vec<&Party> =
        parties.iter().filter(|p| p.own && p.caps.transfer_mode != TransferMode::None).collect();
    let fixed: Vec<&Party> = movers.iter().copied().filter(|p| p.caps.needs_equal_tp()).collect();
    let tail = match (movers.is_empty(), fixed.is_empty()) {
        (true, _) => "no child moves KV between engines".to_owned(),
        (false, true) => {
            format!("{} KV across different TP sizes", verb(&labels(&movers), "loads", "load"))
        }
        (false, false) => format!(
            "{} KV only between equal TP sizes: the peer must use tp_size={tp} too",
            verb(&labels(&fixed), "moves", "move")
        ),
    };
    decided(tp, by, format!("{head}; {tail}"))
}

/// True when a worker with these children can load KV from, or serve it to, a peer with
/// another tensor-parallel size: some child moves KV between engines and every such child
/// declares `heterogeneous_tp`.
pub fn loads_across_tp<'a>(caps: impl IntoIterator<Item = &'a Capabilities>) -> bool {
    let mut moves = false;
    for c in caps {
        if c.needs_equal_tp() {
            return false;
        }
        moves |= c.transfer_mode != TransferMode::None;
    }
    moves
}

/// The transfer mode: pull if a child pulls, push if one pushes, never both.
pub(super) fn decide_mode(parties: &[Party]) -> Result<Decided<TransferMode>, Conflict> {
    let pull: Vec<&Party> = parties.iter().filter(|p| p.caps.transfer_mode == TransferMode::Pull).collect();
    let push: Vec<&Party> = parties.iter().filter(|p| p.caps.transfer_mode == TransferMode::Push).collect();
    let (mode, mode_by, mode_reason) = match (pull.first(), push.first()) {
        (Some(_), Some(_)) => {
            return Err(Conflict::TransferMode { pull: labels(&pull), push: labels(&push) })
        }
        (Some(p), None) => (
            TransferMode::Pull,
            p.decided_by(),
            format!("{} pulls: the consumer reads KV from the producer", p.label),
        ),
        (None, Some(p)) => (
            TransferMode::Push,
            p.decided_by(),
            format!("{} pushes: the producer writes KV into the consumer", p.label),
        ),
        (None, None) => {
            (TransferMode::None, DecidedBy::Default, "no child moves KV between engines".to_owned())
        }
    };
    Ok(decided(mode, mode_by, mode_reason))
}

/// The state groups, and a refusal when a child cannot carry their state, or cannot carry
/// it at this worker's `tp_size`.
pub(super) fn decide_state(
    model: &ModelSpec,
    tp_size: u32,
    parties: &[Party],
) -> Result<Option<Decided<Vec<StateGroup>>>, Conflict> {
    let groups = state_groups(model);
    if groups.is_empty() {
        return Ok(None);
    }
    let state_layers = groups.iter().map(|g| g.layers.len() as u32).sum::<u32>();
    let unsupported: Vec<&Party> = parties.iter().filter(|p| !p.caps.carries_state).collect();
    if !unsupported.is_empty() {
        return Err(Conflict::StateUnsupported {
            model: model.name.clone(),
            state_layers,
            groups: describe_state_groups(&groups),
            unsupported: labels(&unsupported),
            remedy: format!(
                "use connectors that declare carries_state (the nixl connector does, with backend shm or \
                    tcp), or serve this model without disaggregation (remove {})",
                them(&labels(&unsupported))
            ),
        });
    }
    let single_rank: Vec<&Party> = parties.iter().filter(|p| !p.caps.state_with_tp).collect();
    if tp_size > 1 && !single_rank.is_empty() {
        return Err(Conflict::StateWithTp {
            model: model.name.clone(),
            state_layers,
            tp_size,
            children: labels(&single_rank),
            remedy: format!(
                "run this model with tp_size=1 on prefill and decode, or use connectors that declare \
                    state_with_tp (instead of {})",
                them(&labels(&single_rank))
            ),
        });
    }
    let reason = format!(
        "model has {state_layers} state-space/linear-attention layer(s); every child carries their \
            per-request state"
    );
    Ok(Some(decided(groups, DecidedBy::Model, reason)))
}
