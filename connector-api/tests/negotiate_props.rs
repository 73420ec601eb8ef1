//! Property tests of negotiation and the compat hash over generated children, models and
//! options: deterministic, alias-blind, sound (every result satisfies every child, directly
//! or through a listed adapter), complete (a conflict means no answer exists), and joint
//! negotiation gives both roles one hash.

use kvconnect_api::compat::{check, check_roles, diff, LayoutPermutation};
use kvconnect_api::layout::Dim;
use kvconnect_api::KvRole;
use kvconnect_api::{
    negotiate, negotiate_deployment, AdaptCost, AttentionKind, Capabilities, ChildCaps, CompatDescriptor,
    Conflict, Dtype, EngineOptions, HmaOption, KvLayout, LayoutConstraint, MemoryKind, ModelSpec, Negotiated,
    TransferMode,
};
use kvconnect_api::{FieldClass, LayoutField};
use proptest::prelude::*;
use proptest::sample::{select, subsequence};
use std::hash::{DefaultHasher, Hash, Hasher};

fn all_layouts() -> &'static [KvLayout] {
    static ALL: std::sync::OnceLock<Vec<KvLayout>> = std::sync::OnceLock::new();
    ALL.get_or_init(KvLayout::all)
}

fn layout() -> impl Strategy<Value = KvLayout> {
    prop_oneof![
        3 => select(KvLayout::COMMON.to_vec()),
        1 => select(all_layouts()),
    ]
}

fn cost() -> impl Strategy<Value = Option<AdaptCost>> {
    prop_oneof![2 => Just(None), 1 => select(vec![AdaptCost::Low, AdaptCost::Medium, AdaptCost::High]).prop_map(Some)]
}

fn capabilities() -> impl Strategy<Value = Capabilities> {
    (
        any::<bool>(),
        prop::collection::vec(layout(), 0..3),
        prop::collection::vec(layout(), 0..3),
        prop::collection::vec(layout(), 0..3),
        cost(),
        select(vec![1u32, 1, 1, 2, 8, 16, 24, 32]),
        prop_oneof![2 => Just(None), 1 => select(vec![16u32, 48, 64, 96, 256, 512]).prop_map(Some)],
        prop_oneof![3 => Just(vec![]), 1 => subsequence(vec![Dtype::Bf16, Dtype::F16, Dtype::Fp8E4m3], 1..3)],
        subsequence(vec![MemoryKind::Host, MemoryKind::Device, MemoryKind::Disk], 0..3),
        select(vec![TransferMode::None, TransferMode::None, TransferMode::Pull, TransferMode::Push]),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(hma, required, rejected, preferred, adapt, mult, div, dtypes, mem, mode, mla, pref_ok)| {
                // Mostly valid declarations (preferred ones accepted), some contradictory ones.
                let mut layout = LayoutConstraint { required, rejected, preferred };
                if pref_ok {
                    let c = layout.clone();
                    layout.preferred.retain(|l| c.accepts(*l));
                    let req = layout.required.clone();
                    layout.rejected.retain(|l| !req.contains(l));
                }
                Capabilities {
                    hma,
                    layout,
                    adapt,
                    block_size_multiple: mult,
                    block_size_divides: div.map(|d: u32| if d.is_multiple_of(mult) { d } else { d * mult }),
                    cache_dtypes: dtypes,
                    memory_kinds: if mem.is_empty() { vec![MemoryKind::Host] } else { mem },
                    transfer_mode: mode,
                    roles: vec![KvRole::Both],
                    layerwise: false,
                    heterogeneous_tp: false,
                    mla,
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
                }
            },
        )
}

fn children() -> impl Strategy<Value = Vec<ChildCaps>> {
    // Half the time every child carries per-request state, so models with state layers
    // negotiate too; a quarter of the time also at tp_size > 1.
    (prop::collection::vec(capabilities(), 0..4), any::<bool>(), any::<bool>()).prop_map(|(v, state, tp)| {
        v.into_iter()
            .enumerate()
            .map(|(i, caps)| ChildCaps {
                name: format!("c{i}"),
                version: "1".into(),
                caps: Capabilities { carries_state: state, state_with_tp: state && tp, ..caps },
            })
            .collect()
    })
}

fn model() -> impl Strategy<Value = ModelSpec> {
    let kind = prop_oneof![
        6 => Just(AttentionKind::Full),
        4 => Just(AttentionKind::SlidingWindow { window: 128 }),
        1 => Just(AttentionKind::SlidingWindow { window: 512 }),
        1 => Just(AttentionKind::Linear),
        1 => Just(AttentionKind::FeedForward),
        1 => Just(AttentionKind::Mla { kv_lora_rank: 512, qk_rope_head_dim: 64 }),
    ];
    (
        prop::collection::vec(kind, 1..40),
        prop::option::of(select(vec![Dtype::Bf16, Dtype::F16, Dtype::F32])),
        select(vec![1u32, 8]),
    )
        .prop_map(|(layers, dtype, heads)| ModelSpec {
            name: "m".into(),
            num_layers: layers.len() as u32,
            num_kv_heads: heads,
            head_dim: 128,
            dtype,
            layers,
            state: None,
        })
}

fn options() -> impl Strategy<Value = EngineOptions> {
    (
        select(vec![HmaOption::Auto, HmaOption::Auto, HmaOption::On, HmaOption::Off]),
        prop::option::of(layout()),
        prop::option::of(select(vec![8u32, 16, 24, 32, 48, 64, 256])),
        prop::option::of(select(vec![Dtype::Bf16, Dtype::F16, Dtype::Fp8E4m3])),
        prop::option::of(select(vec![MemoryKind::Host, MemoryKind::Device])),
        (1u32..5),
        any::<bool>(),
        // Now and then an engine whose ranks share one connector (kvconnect's own).
        prop::bool::weighted(0.2),
    )
        .prop_map(|(hma, layout, block, dtype, memory, tp, allow, shared)| EngineOptions {
            hybrid_kv_cache_manager: hma,
            kv_cache_layout: layout,
            block_size: block,
            cache_dtype: dtype,
            memory,
            tp_size: tp,
            tp_rank: tp - 1,
            allow_adapters: allow,
            opaque_blocks: None,
            ranks_per_worker: if shared { tp } else { 1 },
        })
}

/// Re-spells every layout through its alias or a lower-case name.
fn respell(children: &[ChildCaps]) -> Vec<ChildCaps> {
    let spell = |l: &KvLayout| -> KvLayout {
        let s = match *l {
            KvLayout::NHD => "nhd".to_owned(),
            KvLayout::HND => " HND ".to_owned(),
            other => other.canonical_name().to_ascii_lowercase(),
        };
        s.parse().unwrap()
    };
    children
        .iter()
        .map(|c| {
            let mut c = c.clone();
            let l = &mut c.caps.layout;
            l.required = l.required.iter().map(spell).collect();
            l.rejected = l.rejected.iter().map(spell).collect();
            l.preferred = l.preferred.iter().map(spell).collect();
            c
        })
        .collect()
}

fn block_fits(c: &Capabilities, b: u32) -> bool {
    b.is_multiple_of(c.block_size_multiple.max(1)) && c.block_size_divides.is_none_or(|d| d.is_multiple_of(b))
}

/// The child takes `l` without adapting: it accepts it, or with one KV head it accepts a
/// layout that differs from `l` only in where the head axis sits (stated here apart from
/// the crate's own rule).
fn takes(c: &Capabilities, l: KvLayout, heads: u32) -> bool {
    let no_h = |x: KvLayout| x.order().into_iter().filter(|d| *d != Dim::H).collect::<Vec<_>>();
    c.layout.accepts(l)
        || (heads == 1 && all_layouts().iter().any(|x| no_h(*x) == no_h(l) && c.layout.accepts(*x)))
}

/// (adapters, total cost) for a layout, by the rules, or None.
fn fit(children: &[ChildCaps], l: KvLayout, allow: bool, heads: u32) -> Option<(usize, u32)> {
    let mut n = (0, 0);
    for c in children {
        if takes(&c.caps, l, heads) {
            continue;
        }
        let cost = c.caps.adapt.filter(|_| allow)?;
        n.0 += 1;
        n.1 += match cost {
            AdaptCost::Low => 1,
            AdaptCost::Medium => 2,
            AdaptCost::High => 3,
        };
    }
    Some(n)
}

/// `all` is every child whose transfer mode counts: this worker's own, or in a deployment
/// both roles' children.
fn check_sound(
    m: &ModelSpec,
    o: &EngineOptions,
    children: &[ChildCaps],
    all: &[ChildCaps],
    n: &Negotiated,
) -> Result<(), TestCaseError> {
    let e = &n.effective;
    for c in children {
        prop_assert!(c.caps.validate().is_ok());
        // Layout: accepted, or adapted through a listed adapter the child declared.
        if !takes(&c.caps, e.layout, m.num_kv_heads) {
            prop_assert!(o.allow_adapters && c.caps.adapt.is_some(), "{} neither accepts nor adapts", c.name);
            prop_assert!(n.adapters.iter().any(|a| a.child == c.name && a.effective == e.layout));
        }
        prop_assert!(block_fits(&c.caps, e.block_size), "{}: block {}", c.name, e.block_size);
        prop_assert!(c.caps.cache_dtypes.is_empty() || c.caps.cache_dtypes.contains(&e.cache_dtype));
        prop_assert!(c.caps.memory_kinds.contains(&e.memory));
        if e.hma {
            prop_assert!(c.caps.hma, "hma on but {} lacks it", c.name);
        }
    }
    prop_assert_eq!(
        n.adapters.len(),
        children.iter().filter(|c| !takes(&c.caps, e.layout, m.num_kv_heads)).count()
    );
    // User overrides are obeyed.
    if let Some(l) = o.kv_cache_layout {
        prop_assert_eq!(e.layout, l);
    } else {
        // Optimal: no layout needs fewer adapters or less cost.
        let got = fit(children, e.layout, o.allow_adapters, m.num_kv_heads).unwrap();
        for l in all_layouts().iter().copied() {
            if let Some(f) = fit(children, l, o.allow_adapters, m.num_kv_heads) {
                prop_assert!(f >= got, "{l} fits with {f:?}, chosen {} with {got:?}", e.layout);
            }
        }
    }
    if let Some(b) = o.block_size {
        prop_assert_eq!(e.block_size, b);
    }
    if let Some(d) = o.cache_dtype {
        prop_assert_eq!(e.cache_dtype, d);
    }
    match o.hybrid_kv_cache_manager {
        HmaOption::On => prop_assert!(e.hma),
        HmaOption::Off => prop_assert!(!e.hma),
        HmaOption::Auto => {}
    }
    if m.layers.iter().any(|k| matches!(k, AttentionKind::Linear)) {
        prop_assert!(e.hma);
        prop_assert!(children.iter().all(|c| c.caps.carries_state));
        prop_assert!(o.tp_size == 1 || children.iter().all(|c| c.caps.state_with_tp));
    }
    // State groups: every state layer, with the model's state.
    let state_layers: Vec<u32> =
        (0u32..).zip(&m.layers).filter(|(_, k)| matches!(k, AttentionKind::Linear)).map(|(i, _)| i).collect();
    let grouped: Vec<u32> = e.state_groups.iter().flat_map(|g| g.layers.iter().map(|l| l.0)).collect();
    prop_assert_eq!(grouped, state_layers);
    prop_assert!(e.state_groups.iter().all(|g| g.state == m.state));
    // Groups: every KV layer exactly once, no other layer.
    let mut grouped: Vec<u32> = e.groups.iter().flat_map(|g| g.layers.iter().map(|l| l.0)).collect();
    grouped.sort_unstable();
    let kv: Vec<u32> = (0u32..).zip(&m.layers).filter(|(_, k)| k.has_kv_blocks()).map(|(i, _)| i).collect();
    prop_assert_eq!(grouped, kv);
    for g in &e.groups {
        prop_assert!(!e.hma || g.layers.iter().all(|l| m.layers[l.0 as usize] == g.kind));
    }
    let pulls = all.iter().any(|c| c.caps.transfer_mode == TransferMode::Pull);
    let pushes = all.iter().any(|c| c.caps.transfer_mode == TransferMode::Push);
    prop_assert!(!(pulls && pushes));
    let want = if pulls {
        TransferMode::Pull
    } else if pushes {
        TransferMode::Push
    } else {
        TransferMode::None
    };
    prop_assert_eq!(e.transfer_mode, want);
    for f in ["layout", "hma", "block_size", "cache_dtype", "memory", "transfer_mode", "kv_groups", "tp_size"]
    {
        prop_assert!(n.provenance_of(f).is_some(), "no provenance for {}", f);
    }
    Ok(())
}

/// A conflict is justified: what it claims to be impossible is.
fn check_conflict(
    m: &ModelSpec,
    o: &EngineOptions,
    children: &[ChildCaps],
    c: &Conflict,
) -> Result<(), TestCaseError> {
    let text = c.to_string();
    prop_assert!(!text.is_empty());
    match c {
        Conflict::InvalidCaps { .. } => prop_assert!(children.iter().any(|c| c.caps.validate().is_err())),
        Conflict::Layout { requested: None, constraints, .. } => {
            prop_assert!(all_layouts().iter().copied().all(|l| fit(
                children,
                l,
                o.allow_adapters,
                m.num_kv_heads
            )
            .is_none()));
            prop_assert_eq!(constraints.len(), children.len());
            for ch in children {
                prop_assert!(
                    text.contains(&format!("child '{}'", ch.name)),
                    "{} not named: {}",
                    ch.name,
                    text
                );
            }
        }
        Conflict::Layout { requested: Some(l), violators, .. } => {
            prop_assert_eq!(Some(*l), o.kv_cache_layout);
            prop_assert!(!violators.is_empty());
            prop_assert!(fit(children, *l, o.allow_adapters, m.num_kv_heads).is_none());
        }
        Conflict::BlockSize { by_user: false, .. } => {
            prop_assert!(o.block_size.is_none());
            prop_assert!((1..=4096).all(|b| !children.iter().all(|c| block_fits(&c.caps, b))));
        }
        Conflict::BlockSize { by_user: true, block_size, .. } => {
            prop_assert_eq!(Some(*block_size), o.block_size);
            prop_assert!(!children.iter().all(|c| block_fits(&c.caps, *block_size)));
        }
        Conflict::RanksInOneWorker { ranks, children: ch } => {
            prop_assert_eq!(*ranks, o.ranks_per_worker);
            prop_assert!(*ranks > 1);
            prop_assert!(!ch.is_empty());
            for c in children.iter().filter(|c| ch.contains(&format!("child '{}'", c.name))) {
                prop_assert!(!c.caps.ranks_in_one_worker);
            }
        }
        Conflict::OpaqueBlocks { children: ch, .. } => {
            prop_assert!(o.opaque_blocks.is_some());
            prop_assert!(!ch.is_empty());
        }
        Conflict::HmaUnsupported { unsupported, .. } => {
            prop_assert_eq!(o.hybrid_kv_cache_manager, HmaOption::On);
            prop_assert!(!unsupported.is_empty());
        }
        Conflict::HmaRequired { .. } => {
            prop_assert!(m.layers.iter().any(|k| matches!(k, AttentionKind::Linear)))
        }
        Conflict::MlaUnsupported { .. } => prop_assert!(children.iter().any(|c| !c.caps.mla)),
        Conflict::StateUnsupported { unsupported, .. } => {
            prop_assert!(m.layers.iter().any(|k| matches!(k, AttentionKind::Linear)));
            prop_assert!(!unsupported.is_empty());
            prop_assert!(children.iter().any(|c| !c.caps.carries_state));
        }
        Conflict::StateWithTp { tp_size, children: named, .. } => {
            prop_assert!(m.layers.iter().any(|k| matches!(k, AttentionKind::Linear)));
            prop_assert!(*tp_size > 1 && *tp_size == o.tp_size);
            prop_assert!(!named.is_empty());
            prop_assert!(children.iter().all(|c| c.caps.carries_state));
            prop_assert!(children.iter().any(|c| !c.caps.state_with_tp));
        }
        Conflict::TransferMode { pull, push } => prop_assert!(!pull.is_empty() && !push.is_empty()),
        Conflict::CacheDtype { violators, .. } | Conflict::Memory { violators, .. } => {
            prop_assert!(!violators.is_empty())
        }
        Conflict::InvalidOption { .. } | Conflict::OptionMismatch { .. } => {}
        // Only a deployment (two TP sizes) refuses these, and this checks one worker.
        Conflict::TpSize { .. } => prop_assert!(false, "one worker cannot have a TP conflict: {}", text),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// With one KV head, layouts that differ only in where the head axis sits are one layout:
    /// equal and equally hashed once normalised, no diff, no permutation, one compat hash.
    /// With more heads they stay different layouts: a diff and a permutation (the compat
    /// hash, which covers only the strict fields, is equal either way).
    #[test]
    fn the_head_axis_moves_freely_only_with_one_head(
        l in select(all_layouts()), pos in 0usize..5, heads in 1u32..4,
    ) {
        let other = l.with_head_at(pos);
        let std_hash = |x: KvLayout| {
            let mut h = DefaultHasher::new();
            x.hash(&mut h);
            h.finish()
        };
        let m = ModelSpec {
            name: "m".into(),
            num_layers: 4,
            num_kv_heads: heads,
            head_dim: 64,
            dtype: Some(Dtype::Bf16),
            layers: vec![AttentionKind::Full; 4],
            state: None,
        };
        let desc = |layout: KvLayout| {
            let o = EngineOptions { kv_cache_layout: Some(layout), ..EngineOptions::default() };
            CompatDescriptor::new(&m, &negotiate(&m, &o, &[]).unwrap(), &o)
        };
        let (a, b) = (desc(l), desc(other));
        prop_assert_eq!(a.compat_hash(), b.compat_hash());
        if heads == 1 {
            prop_assert_eq!(l.normalized(1), other.normalized(1));
            prop_assert_eq!(std_hash(l.normalized(1)), std_hash(other.normalized(1)));
            prop_assert!(diff(&a, &b).is_empty());
            prop_assert!(check(&a, &b).unwrap().is_identity());
        } else if other != l {
            prop_assert_ne!(l.normalized(heads), other.normalized(heads));
            prop_assert_ne!(std_hash(l.normalized(heads)), std_hash(other.normalized(heads)));
            let fields: Vec<LayoutField> = diff(&a, &b).into_iter().map(|d| d.field).collect();
            prop_assert_eq!(fields, vec![LayoutField::Layout]);
            prop_assert_eq!(check(&a, &b).unwrap().layout, Some(LayoutPermutation::between(other, l)));
        }
    }

    #[test]
    fn deterministic(m in model(), o in options(), c in children()) {
        prop_assert_eq!(negotiate(&m, &o, &c), negotiate(&m, &o, &c));
    }

    #[test]
    fn aliases_never_matter(m in model(), o in options(), c in children()) {
        prop_assert_eq!(negotiate(&m, &o, &c), negotiate(&m, &o, &respell(&c)));
    }

    #[test]
    fn sound_or_a_justified_conflict(m in model(), o in options(), c in children()) {
        match negotiate(&m, &o, &c) {
            Ok(n) => check_sound(&m, &o, &c, &c, &n)?,
            Err(e) => check_conflict(&m, &o, &c, &e)?,
        }
    }

    #[test]
    fn deployment_gives_one_hash(m in model(), o in options(), p in children(), d in children()) {
        let d: Vec<ChildCaps> = d.into_iter().map(|mut c| { c.name = format!("d{}", c.name); c }).collect();
        if let Ok((pn, dn)) = negotiate_deployment(&m, (&o, &p), (&o, &d)) {
            let (pe, de) = (&pn.effective, &dn.effective);
            prop_assert_eq!((pe.layout, pe.hma, pe.block_size, pe.cache_dtype, pe.transfer_mode), (de.layout, de.hma, de.block_size, de.cache_dtype, de.transfer_mode));
            prop_assert_eq!(&pe.groups, &de.groups);
            let pd = CompatDescriptor::new(&m, &pn, &o);
            let dd = CompatDescriptor::new(&m, &dn, &o);
            prop_assert_eq!(pd.compat_hash(), dd.compat_hash());
            prop_assert!(check_roles(&pd, &dd).is_ok());
            // Each role's result also satisfies its own children.
            let all: Vec<ChildCaps> = p.iter().chain(&d).cloned().collect();
            check_sound(&m, &EngineOptions { kv_cache_layout: Some(pe.layout), ..o.clone() }, &p, &all, &pn)?;
            check_sound(&m, &EngineOptions { kv_cache_layout: Some(de.layout), ..o.clone() }, &d, &all, &dn)?;
        }
    }

    #[test]
    fn hash_equality_is_no_strict_diff(
        m1 in model(), m2 in model(), o1 in options(), o2 in options(), c1 in children(), c2 in children(),
        same_model in any::<bool>(),
    ) {
        let m2 = if same_model { m1.clone() } else { m2 };
        if let (Ok(n1), Ok(n2)) = (negotiate(&m1, &o1, &c1), negotiate(&m2, &o2, &c2)) {
            let a = CompatDescriptor::new(&m1, &n1, &o1);
            let b = CompatDescriptor::new(&m2, &n2, &o2);
            let strict = diff(&a, &b).iter().any(|d| d.class == FieldClass::Strict);
            prop_assert_eq!(a.compat_hash() == b.compat_hash(), !strict);
            // Whether two sides can exchange KV does not depend on who asks.
            prop_assert_eq!(check(&a, &b).is_ok(), check(&b, &a).is_ok());
            prop_assert!(check(&a, &a).unwrap().is_identity());
            if strict {
                prop_assert!(check(&a, &b).is_err());
            }
        }
    }

    #[test]
    fn hash_is_stable(m in model(), o in options(), c in children()) {
        if let Ok(n) = negotiate(&m, &o, &c) {
            let a = CompatDescriptor::new(&m, &n, &o);
            let b = CompatDescriptor::new(&m, &negotiate(&m, &o, &c).unwrap(), &o);
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(a.compat_hash(), b.compat_hash());
            let back: CompatDescriptor = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
            prop_assert_eq!(back.compat_hash(), a.compat_hash());
            let n2: Negotiated = serde_json::from_str(&serde_json::to_string(&n).unwrap()).unwrap();
            prop_assert_eq!(n2, n);
        }
    }
}
