//! The composite's capabilities, combined from its children's declarations. Nothing here
//! looks at the composite's own name: a composite of HMA-capable children supports HMA, one
//! with a single HMA-less child does not.
//!
//! The combined value is a summary (for `plugins inspect` and for a composite nested inside
//! another); negotiation itself works on the children's own declarations, so adapters stay
//! attached to the child that needs them.

use crate::error::PdError;
use kvconnect_api::math::{gcd, lcm};
use kvconnect_api::KvRole;
use kvconnect_api::{Capabilities, KvLayout, LayoutConstraint, TransferMode};

/// Combines the children's capabilities, in child order.
///
/// * HMA, heterogeneous TP, MLA, carrying per-request state, and the adaptations combined
///   with TP or state (`state_with_tp`, `adapts_with_tp`, `adapts_with_state`): only if every
///   child has it.
/// * Layout: the hard constraints of children that cannot adapt are intersected; a child
///   that can adapt (e.g. flexkv transposing on its copy path) does not narrow the set.
///   Preferred layouts are the children's, in child order, those needing no adapter first.
/// * Block size: the least common multiple of the multiples; the gcd of the divisors.
/// * Dtypes, memory kinds, roles: intersected.
/// * Transfer mode: the transport child's (the one child that moves KV between engines).
/// * Layer-wise, async load: if any child does (the composite forwards every per-layer call).
/// * The side channel, the data-plane secret and shared-memory KV: never needed by the
///   composite itself (the host serves each child that declares the need).
pub fn combine(children: &[(String, Capabilities)]) -> Result<Capabilities, PdError> {
    let first = match children.first() {
        Some((_, c)) => c,
        None => return Err(PdError::NoChildren),
    };
    let all = |f: fn(&Capabilities) -> bool| children.iter().all(|(_, c)| f(c));
    let any = |f: fn(&Capabilities) -> bool| children.iter().any(|(_, c)| f(c));

    let layout = combine_layout(children)?;
    let adapt = if children.iter().all(|(_, c)| c.adapt.is_some()) {
        children.iter().filter_map(|(_, c)| c.adapt).max()
    } else {
        None
    };

    let mut multiple = 1u32;
    let mut divides: Option<u32> = None;
    for (_, c) in children {
        multiple = lcm(multiple, c.block_size_multiple.max(1)).ok_or_else(|| {
            PdError::Incompatible(format!(
                "the children's block-size multiples have no common multiple below 2^32 ({})",
                describe(children, |c| format!("block size multiple of {}", c.block_size_multiple))
            ))
        })?;
        if let Some(d) = c.block_size_divides {
            divides = Some(divides.map_or(d, |x| gcd(x, d)));
        }
    }
    if let Some(d) = divides {
        if d % multiple != 0 {
            return Err(PdError::Incompatible(format!(
                "no block size is a multiple of {multiple} and divides {d} ({})",
                describe(children, |c| {
                    format!(
                        "block size multiple of {}, dividing {:?}",
                        c.block_size_multiple, c.block_size_divides
                    )
                })
            )));
        }
    }

    let mut cache_dtypes: Vec<_> = Vec::new();
    for (_, c) in children.iter().filter(|(_, c)| !c.cache_dtypes.is_empty()) {
        cache_dtypes = if cache_dtypes.is_empty() {
            c.cache_dtypes.clone()
        } else {
            cache_dtypes.into_iter().filter(|d| c.cache_dtypes.contains(d)).collect()
        };
        if cache_dtypes.is_empty() {
            return Err(PdError::Incompatible(format!(
                "no cache dtype suits every child ({})",
                describe(children, |c| format!("{:?}", c.cache_dtypes))
            )));
        }
    }

    let memory_kinds: Vec<_> = first
        .memory_kinds
        .iter()
        .copied()
        .filter(|m| children.iter().all(|(_, c)| c.memory_kinds.contains(m)))
        .collect();
    if memory_kinds.is_empty() {
        return Err(PdError::Incompatible(format!(
            "no memory kind suits every child ({})",
            describe(children, |c| format!("{:?}", c.memory_kinds))
        )));
    }

    let movers: Vec<&(String, Capabilities)> =
        children.iter().filter(|(_, c)| c.transfer_mode != TransferMode::None).collect();
    let transfer_mode = match movers.first() {
        None => TransferMode::None,
        Some((_, c)) => {
            if movers.iter().any(|(_, o)| o.transfer_mode != c.transfer_mode) {
                return Err(PdError::Incompatible(format!(
                    "children move KV in different directions ({}); keep one transport child",
                    describe(children, |c| c.transfer_mode.to_string())
                )));
            }
            c.transfer_mode
        }
    };

    let roles: Vec<KvRole> = [KvRole::Producer, KvRole::Consumer, KvRole::Both]
        .into_iter()
        .filter(|r| children.iter().all(|(_, c)| plays(c, *r)))
        .collect();
    if roles.is_empty() {
        return Err(PdError::Incompatible(format!(
            "no role suits every child ({})",
            describe(children, |c| format!("{:?}", c.roles))
        )));
    }

    Ok(Capabilities {
        hma: all(|c| c.hma),
        layout,
        adapt,
        block_size_multiple: multiple,
        block_size_divides: divides,
        cache_dtypes,
        memory_kinds,
        transfer_mode,
        roles,
        layerwise: any(|c| c.layerwise),
        heterogeneous_tp: all(|c| c.heterogeneous_tp),
        mla: all(|c| c.mla),
        async_load: any(|c| c.async_load),
        carries_state: all(|c| c.carries_state),
        state_with_tp: all(|c| c.state_with_tp),
        adapts_with_tp: all(|c| c.adapts_with_tp),
        adapts_with_state: all(|c| c.adapts_with_state),
        stores_opaque_blocks: all(|c| c.stores_opaque_blocks),
        ranks_in_one_worker: all(|c| c.ranks_in_one_worker),
        // The host hands the side channel and the secret to each child that declares it
        // needs them; the composite itself reads neither.
        needs_side_channel: false,
        needs_data_plane_secret: false,
        needs_shared_memory_kv: false,
    })
}

fn combine_layout(children: &[(String, Capabilities)]) -> Result<LayoutConstraint, PdError> {
    let hard: Vec<&(String, Capabilities)> = children.iter().filter(|(_, c)| c.adapt.is_none()).collect();
    let accepted: Vec<KvLayout> =
        KvLayout::all().into_iter().filter(|l| hard.iter().all(|(_, c)| c.layout.accepts(*l))).collect();
    if accepted.is_empty() {
        return Err(PdError::Incompatible(format!(
            "no KV layout is accepted by every child that cannot adapt ({})",
            hard.iter().map(|(n, c)| format!("{n} {}", c.layout.describe())).collect::<Vec<_>>().join("; ")
        )));
    }
    // Expressed as the smallest constraint: a required list when the hard children require
    // one, else the union of their rejections.
    let any_required = hard.iter().any(|(_, c)| !c.layout.required.is_empty());
    let (required, rejected) = if any_required {
        (accepted.clone(), Vec::new())
    } else {
        let mut rej: Vec<KvLayout> = Vec::new();
        for (_, c) in &hard {
            for l in &c.layout.rejected {
                if !rej.contains(l) {
                    rej.push(*l);
                }
            }
        }
        (Vec::new(), rej)
    };
    let mut preferred: Vec<KvLayout> = Vec::new();
    for (_, c) in children {
        for l in &c.layout.preferred {
            if accepted.contains(l) && !preferred.contains(l) {
                preferred.push(*l);
            }
        }
    }
    // Layouts no child has to adapt to come first; the sort is stable, so child order holds
    // within each class.
    preferred.sort_by_key(|l| children.iter().filter(|(_, c)| !c.layout.accepts(*l)).count());
    Ok(LayoutConstraint { required, rejected, preferred })
}

fn plays(c: &Capabilities, r: KvRole) -> bool {
    let has = |x| c.roles.contains(&x);
    match r {
        KvRole::Both => has(KvRole::Both) || (has(KvRole::Producer) && has(KvRole::Consumer)),
        other => has(other) || has(KvRole::Both),
    }
}

fn describe(children: &[(String, Capabilities)], f: impl Fn(&Capabilities) -> String) -> String {
    children.iter().map(|(n, c)| format!("{n}: {}", f(c))).collect::<Vec<_>>().join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::{AdaptCost, MemoryKind};

    fn named(n: &str, c: Capabilities) -> (String, Capabilities) {
        (n.to_owned(), c)
    }

    // The three mirror the built-in connectors' declarations for a non-MLA model.
    fn nixl() -> Capabilities {
        let roles = [KvRole::Producer, KvRole::Consumer, KvRole::Both];
        Capabilities::builder(TransferMode::Pull, [MemoryKind::Host], roles)
            .hma(true)
            .layout(LayoutConstraint {
                required: vec![KvLayout::HND],
                rejected: vec![],
                preferred: vec![KvLayout::HND],
            })
            .mla(true)
            .async_load(true)
            .build()
            .unwrap()
    }

    fn lmcache() -> Capabilities {
        Capabilities {
            hma: false,
            layout: LayoutConstraint {
                required: vec![KvLayout::NHD, KvLayout::HND],
                rejected: vec![],
                preferred: vec![KvLayout::NHD, KvLayout::HND],
            },
            block_size_divides: Some(256),
            memory_kinds: vec![MemoryKind::Host, MemoryKind::Disk],
            transfer_mode: TransferMode::None,
            heterogeneous_tp: false,
            async_load: false,
            ..nixl()
        }
    }

    fn flexkv() -> Capabilities {
        Capabilities {
            hma: false,
            layout: LayoutConstraint {
                required: vec![],
                rejected: vec![KvLayout::HND],
                preferred: vec![KvLayout::NHD],
            },
            adapt: Some(AdaptCost::Medium),
            memory_kinds: vec![MemoryKind::Host, MemoryKind::Disk],
            transfer_mode: TransferMode::None,
            heterogeneous_tp: false,
            ..nixl()
        }
    }

    #[test]
    fn derived_from_children_not_from_the_name() {
        let c = combine(&[named("lmcache", lmcache()), named("nixl", nixl())]).unwrap();
        assert!(!c.hma, "one HMA-less child turns HMA off");
        assert_eq!(c.layout.required, vec![KvLayout::HND], "NHD|HND intersected with HND");
        assert_eq!(c.transfer_mode, TransferMode::Pull, "the transport child's mode");
        assert_eq!(c.memory_kinds, vec![MemoryKind::Host]);
        assert_eq!(c.block_size_divides, Some(256));
        assert!(!c.heterogeneous_tp);
        assert_eq!(c.validate(), Ok(()));
        // The same children under any composite name give the same answer; only the
        // children matter, and an all-HMA composite keeps HMA.
        let c2 = combine(&[named("nixl", nixl()), named("nixl#2", nixl())]).unwrap();
        assert!(c2.hma);
    }

    #[test]
    fn adapting_child_does_not_narrow_the_layout() {
        let c = combine(&[named("flexkv", flexkv()), named("nixl", nixl())]).unwrap();
        assert_eq!(c.layout.required, vec![KvLayout::HND]);
        assert_eq!(c.adapt, None, "nixl cannot adapt, so the composite as a whole cannot");
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn disjoint_children_are_an_error_naming_them() {
        let mut nhd_only = lmcache();
        nhd_only.layout.required = vec![KvLayout::NHD];
        nhd_only.layout.preferred = vec![];
        let e = combine(&[named("lmcache", nhd_only), named("nixl", nixl())]).unwrap_err().to_string();
        assert!(e.contains("lmcache requires NHD") && e.contains("nixl requires HND"), "{e}");
        let mut push = nixl();
        push.transfer_mode = TransferMode::Push;
        let e = combine(&[named("a", push), named("b", nixl())]).unwrap_err().to_string();
        assert!(e.contains("a: push") && e.contains("b: pull"), "{e}");
    }

    #[test]
    fn block_constraints_combine() {
        let mut a = nixl();
        a.block_size_multiple = 16;
        let mut b = lmcache();
        b.block_size_divides = Some(96);
        let c = combine(&[named("a", a.clone()), named("b", b)]).unwrap();
        assert_eq!((c.block_size_multiple, c.block_size_divides), (16, Some(96)));
        let mut b2 = lmcache();
        b2.block_size_divides = Some(40);
        assert!(combine(&[named("a", a), named("b", b2)]).is_err());
    }

    #[test]
    fn multiples_past_32_bits_are_an_error_not_an_overflow() {
        let (mut a, mut b) = (nixl(), lmcache());
        a.block_size_multiple = 65_537;
        b.block_size_multiple = 65_539;
        let e = combine(&[named("a", a), named("b", b)]).unwrap_err().to_string();
        assert!(e.contains("no common multiple below 2^32"), "{e}");
        assert!(e.contains("a: block size multiple of 65537"), "{e}");
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use kvconnect_api::{AdaptCost, MemoryKind};
    use proptest::prelude::*;

    fn layouts() -> impl Strategy<Value = Vec<KvLayout>> {
        proptest::sample::subsequence(KvLayout::COMMON.to_vec(), 0..=2)
    }

    fn child() -> impl Strategy<Value = Capabilities> {
        (
            any::<bool>(),
            layouts(),
            layouts(),
            any::<bool>(),
            proptest::sample::subsequence(
                vec![MemoryKind::Host, MemoryKind::Device, MemoryKind::Disk],
                1..=3,
            ),
            any::<bool>(),
        )
            .prop_map(|(hma, required, rejected, adapts, memory_kinds, moves)| {
                let rejected: Vec<KvLayout> =
                    rejected.into_iter().filter(|l| !required.contains(l)).collect();
                let mode = if moves { TransferMode::Pull } else { TransferMode::None };
                let mut c = Capabilities::builder(mode, memory_kinds, [KvRole::Both])
                    .hma(hma)
                    .adapt(adapts.then_some(AdaptCost::Medium))
                    .build()
                    .expect("the default layout is valid");
                // Any constraint, even one that leaves no layout: combine must say so.
                c.layout = LayoutConstraint { preferred: required.clone(), required, rejected };
                c
            })
    }

    proptest! {
        /// The combined declaration accepts exactly the layouts every non-adapting child
        /// accepts, keeps HMA only when every child has it, and never contradicts itself;
        /// it fails only when the children truly share no layout or no memory kind.
        #[test]
        fn combine_is_the_intersection_of_the_children(children in proptest::collection::vec(child(), 1..4)) {
            let named: Vec<(String, Capabilities)> =
                children.iter().enumerate().map(|(i, c)| (format!("c{i}"), c.clone())).collect();
            let hard =
                |l: KvLayout| children.iter().filter(|c| c.adapt.is_none()).all(|c| c.layout.accepts(l));
            let some_layout = KvLayout::all().into_iter().any(hard);
            let some_memory = [MemoryKind::Host, MemoryKind::Device, MemoryKind::Disk]
                .iter()
                .any(|m| children.iter().all(|c| c.memory_kinds.contains(m)));
            match combine(&named) {
                Ok(c) => {
                    prop_assert_eq!(c.hma, children.iter().all(|x| x.hma));
                    for l in KvLayout::all() {
                        prop_assert_eq!(c.layout.accepts(l), hard(l), "layout {}", l);
                    }
                    prop_assert_eq!(c.validate(), Ok(()));
                    let any_mover = children.iter().any(|x| x.transfer_mode != TransferMode::None);
                    prop_assert_eq!(c.transfer_mode != TransferMode::None, any_mover);
                }
                Err(_) => prop_assert!(!some_layout || !some_memory),
            }
        }
    }
}
