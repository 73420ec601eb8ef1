use super::layout_choice::{all_layouts, preference_order};
use super::*;
use crate::caps::{AdaptCost, LayoutConstraint, MemoryKind, TransferMode};
use crate::children::{caps, child, flexkv, lmcache, nixl};
use crate::ids::LayerId;
use crate::layout::KvLayout;
use crate::model::{AttentionKind, Dtype};

fn model(name: &str, layers: Vec<AttentionKind>, dtype: Option<Dtype>) -> ModelSpec {
    ModelSpec {
        name: name.to_owned(),
        num_layers: layers.len() as u32,
        num_kv_heads: 8,
        head_dim: 64,
        dtype,
        layers,
        state: None,
    }
}

/// gpt-oss-20b-like: 24 layers, sliding (128) at even indices, full at odd; no torch_dtype.
fn hybrid() -> ModelSpec {
    let layers = (0..24)
        .map(|i| if i % 2 == 0 { AttentionKind::SlidingWindow { window: 128 } } else { AttentionKind::Full })
        .collect();
    model("gpt_oss", layers, None)
}

/// Qwen3-0.6B-like: 28 full layers, bf16.
fn dense() -> ModelSpec {
    model("qwen3", vec![AttentionKind::Full; 28], Some(Dtype::Bf16))
}

/// Qwen3-Next-like: 3 linear-attention layers then one full, 12 times.
fn with_linear() -> ModelSpec {
    let layers =
        (0..48).map(|i| if i % 4 == 3 { AttentionKind::Full } else { AttentionKind::Linear }).collect();
    model("qwen3_next", layers, Some(Dtype::Bf16))
}

fn mla_model() -> ModelSpec {
    model(
        "deepseek_v2",
        vec![AttentionKind::Mla { kv_lora_rank: 512, qk_rope_head_dim: 64 }; 27],
        Some(Dtype::Bf16),
    )
}

fn opts() -> EngineOptions {
    EngineOptions::default()
}

fn prov<'a>(n: &'a Negotiated, f: &str) -> &'a FieldProvenance {
    n.provenance_of(f).unwrap()
}

#[test]
fn dyn_3545_composite_turns_hma_off_and_names_lmcache() {
    let n = negotiate(&hybrid(), &opts(), &[lmcache(256), nixl()]).unwrap();
    assert!(!n.effective.hma);
    assert_eq!(n.effective.groups.len(), 1);
    assert_eq!(n.effective.groups[0].layers.len(), 24);
    let h = prov(&n, "hma");
    assert_eq!(h.decided_by, DecidedBy::Child("lmcache".into()));
    assert_eq!(h.why(), "child 'lmcache' does not support HMA");
    assert_eq!(n.effective.layout, KvLayout::HND);
    assert_eq!(prov(&n, "layout").decided_by, DecidedBy::Child("nixl".into()));
    assert_eq!(n.effective.transfer_mode, TransferMode::Pull);
    // bf16 because gpt-oss has no torch_dtype.
    assert_eq!(n.effective.cache_dtype, Dtype::Bf16);
    assert_eq!(prov(&n, "cache_dtype").why(), "default: config has no torch_dtype");
}

#[test]
fn dyn_3545_plain_nixl_keeps_hma_on_with_one_group_per_kind() {
    let n = negotiate(&hybrid(), &opts(), &[nixl()]).unwrap();
    assert!(n.effective.hma);
    assert_eq!(n.effective.groups.len(), 2);
    assert_eq!(n.effective.groups[0].kind, AttentionKind::SlidingWindow { window: 128 });
    assert_eq!(n.effective.groups[0].layers[..2], [LayerId(0), LayerId(2)]);
    assert_eq!(n.effective.groups[1].kind, AttentionKind::Full);
    assert_eq!(n.effective.groups[1].layers[..2], [LayerId(1), LayerId(3)]);
    assert_eq!(
        prov(&n, "hma").why(),
        "default: every child supports HMA and the model has 2 attention kinds"
    );
}

#[test]
fn deployment_gives_both_roles_the_same_answer() {
    let (p, d) =
        negotiate_deployment(&hybrid(), (&opts(), &[lmcache(256), nixl()]), (&opts(), &[nixl()])).unwrap();
    assert_eq!(p.effective, d.effective);
    assert!(!d.effective.hma);
    // Decode is told that the peer's child decided it.
    assert_eq!(prov(&d, "hma").decided_by, DecidedBy::Peer("lmcache".into()));
    assert!(prov(&d, "hma").reason.contains("prefill child 'lmcache'"), "{}", prov(&d, "hma").reason);
    assert_eq!(prov(&p, "hma").decided_by, DecidedBy::Child("lmcache".into()));
    assert_eq!(d.children.len(), 1);
    assert_eq!(p.children.len(), 2);
}

#[test]
fn deployment_keeps_each_roles_adapters() {
    let (p, d) =
        negotiate_deployment(&dense(), (&opts(), &[flexkv(), nixl()]), (&opts(), &[nixl()])).unwrap();
    assert_eq!(p.effective.layout, KvLayout::HND);
    assert_eq!(d.effective.layout, KvLayout::HND);
    assert_eq!(p.adapters.len(), 1);
    assert_eq!(p.adapters[0].child, "flexkv");
    assert!(d.adapters.is_empty());
}

#[test]
fn one_kv_head_needs_no_layout_adapter() {
    // Gemma-3-1B-like: one KV head. flexkv works in NHD and nixl requires HND; with one
    // head those are the same bytes, so nobody adapts.
    let one_head = ModelSpec { num_kv_heads: 1, ..dense() };
    let n = negotiate(&one_head, &opts(), &[flexkv(), nixl()]).unwrap();
    assert!(n.adapters.is_empty(), "{}", n.explain());
    assert_eq!(n.effective.layout, KvLayout::NHD, "flexkv's preference, nixl takes it as is");
    let why = &prov(&n, "layout").reason;
    assert!(
        why.contains("child 'nixl': no adapter: one KV head, so LBHNC and LBNHC are the same bytes"),
        "{why}"
    );
    // Adapters off is then no conflict, and a layout nixl does not list is no violation.
    let no_adapters = EngineOptions { allow_adapters: false, ..opts() };
    assert!(negotiate(&one_head, &no_adapters, &[flexkv(), nixl()]).unwrap().adapters.is_empty());
    let nhd = EngineOptions { kv_cache_layout: Some(KvLayout::NHD), ..opts() };
    assert_eq!(negotiate(&one_head, &nhd, &[nixl()]).unwrap().effective.layout, KvLayout::NHD);
    // Only the head axis is free: cross-layer is still a different layout.
    let cross = EngineOptions { kv_cache_layout: Some(KvLayout::BLNHC), ..no_adapters.clone() };
    assert!(negotiate(&one_head, &cross, &[nixl()]).is_err());
    // With two heads nothing changes: flexkv transposes to nixl's HND.
    let n = negotiate(&dense(), &opts(), &[flexkv(), nixl()]).unwrap();
    assert_eq!((n.effective.layout, n.adapters.len()), (KvLayout::HND, 1));
    assert!(!prov(&n, "layout").reason.contains("one KV head"));
}

#[test]
fn deployment_roles_keep_layouts_that_are_the_same_bytes() {
    let lay = |l| EngineOptions { kv_cache_layout: Some(l), ..opts() };
    let one_head = ModelSpec { num_kv_heads: 1, ..dense() };
    let (p, d) = negotiate_deployment(
        &one_head,
        (&lay(KvLayout::NHD), &[lmcache(256), nixl()]),
        (&lay(KvLayout::HND), &[nixl()]),
    )
    .unwrap();
    assert_eq!((p.effective.layout, d.effective.layout), (KvLayout::NHD, KvLayout::HND));
    // With more heads they are two layouts, and the roles must agree.
    let e =
        negotiate_deployment(&dense(), (&lay(KvLayout::NHD), &[lmcache(256)]), (&lay(KvLayout::HND), &[]))
            .unwrap_err();
    assert!(matches!(e, Conflict::OptionMismatch { .. }), "{e}");
}

#[test]
fn tp_size_says_whether_the_peer_may_use_another() {
    let n = negotiate(&dense(), &opts(), &[lmcache(256), nixl()]).unwrap();
    let tp = prov(&n, "tp_size");
    assert_eq!((tp.value.as_str(), &tp.decided_by), ("1", &DecidedBy::Default));
    assert_eq!(
        tp.why(),
        "default: one tensor-parallel rank unless tp_size says otherwise; child 'nixl' moves KV only between \
            equal TP sizes: the peer must use tp_size=1 too"
    );
    let mut any_tp = nixl();
    any_tp.caps.heterogeneous_tp = true;
    let n = negotiate(&dense(), &EngineOptions { tp_size: 2, ..opts() }, &[lmcache(256), any_tp]).unwrap();
    assert_eq!(
        prov(&n, "tp_size").why(),
        "user set tp_size=2; child 'nixl' loads KV across different TP sizes"
    );
    let n = negotiate(&dense(), &opts(), &[lmcache(256)]).unwrap();
    assert!(prov(&n, "tp_size").reason.ends_with("no child moves KV between engines"));
}

#[test]
fn deployment_tp_sizes_must_match_without_heterogeneous_tp() {
    let tp = |n| EngineOptions { tp_size: n, ..opts() };
    let e =
        negotiate_deployment(&dense(), (&tp(2), &[lmcache(256), nixl()]), (&tp(4), &[nixl()])).unwrap_err();
    assert!(matches!(&e, Conflict::TpSize { prefill: 2, decode: 4, .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "prefill has tp_size=2 and decode tp_size=4, but child 'nixl' (prefill and decode) does not load KV \
            across different TP sizes (no heterogeneous_tp); no KV would be moved between them. Remedy: the \
            KV transport moves KV only between equal tensor-parallel sizes (it does not declare \
            heterogeneous_tp), and 2 != 4: run decode with tp_size=2 like prefill, or prefill with tp_size=4"
    );
    // Equal sizes are fine, and so are divisible sizes with a transport that handles them.
    negotiate_deployment(&dense(), (&tp(2), &[nixl()]), (&tp(2), &[nixl()])).unwrap();
    let mut any_tp = nixl();
    any_tp.caps.heterogeneous_tp = true;
    let both = std::slice::from_ref(&any_tp);
    negotiate_deployment(&dense(), (&tp(2), both), (&tp(4), both)).unwrap();
    // Sizes that do not divide each other are refused even then.
    let e = negotiate_deployment(&dense(), (&tp(2), both), (&tp(3), both)).unwrap_err();
    assert!(e.to_string().contains("but 2 and 3 do not divide each other"), "{e}");
    assert!(e.to_string().contains("TP sizes 2 and 3 do not divide each other"), "{e}");
    // One role's transport lacking it is enough to refuse.
    let e = negotiate_deployment(&dense(), (&tp(2), both), (&tp(4), &[nixl()])).unwrap_err();
    assert!(e.to_string().contains("decode child 'nixl' does not load KV"), "{e}");
}

#[test]
fn deployment_options_must_agree() {
    let off = EngineOptions { hybrid_kv_cache_manager: HmaOption::Off, ..opts() };
    let on = EngineOptions { hybrid_kv_cache_manager: HmaOption::On, ..opts() };
    let e = negotiate_deployment(&hybrid(), (&off, &[nixl()]), (&on, &[nixl()])).unwrap_err();
    assert_eq!(
        e,
        Conflict::OptionMismatch {
            option: "hybrid_kv_cache_manager".into(),
            prefill: "off".into(),
            decode: "on".into()
        }
    );
    assert!(e.to_string().contains("prefill=off, decode=on"), "{e}");
    let b16 = EngineOptions { block_size: Some(16), ..opts() };
    let b32 = EngineOptions { block_size: Some(32), ..opts() };
    let e = negotiate_deployment(&dense(), (&b16, &[nixl()]), (&b32, &[nixl()])).unwrap_err();
    assert!(e.to_string().contains("option block_size differs"), "{e}");
    // Unset on one side takes the other's value.
    let (p, d) = negotiate_deployment(&hybrid(), (&off, &[nixl()]), (&opts(), &[nixl()])).unwrap();
    assert!(!p.effective.hma && !d.effective.hma);
    assert_eq!(prov(&d, "hma").decided_by, DecidedBy::User);
}

#[test]
fn deployment_conflict_names_the_role() {
    let e = negotiate_deployment(
        &dense(),
        (&EngineOptions { allow_adapters: false, ..opts() }, &[flexkv()]),
        (&opts(), &[nixl()]),
    )
    .unwrap_err();
    let s = e.to_string();
    assert!(s.contains("prefill child 'flexkv'") && s.contains("decode child 'nixl'"), "{s}");
}

#[test]
fn dense_model_hma_does_not_change_groups() {
    let a = negotiate(&dense(), &opts(), &[lmcache(256), nixl()]).unwrap();
    let b = negotiate(&dense(), &opts(), &[nixl()]).unwrap();
    let c =
        negotiate(&dense(), &EngineOptions { hybrid_kv_cache_manager: HmaOption::On, ..opts() }, &[nixl()])
            .unwrap();
    assert_eq!(a.effective.groups, b.effective.groups);
    assert_eq!(a.effective.groups, c.effective.groups);
    assert_eq!(a.effective.groups.len(), 1);
    assert_eq!(prov(&b, "hma").decided_by, DecidedBy::Model);
}

#[test]
fn flexkv_adapts_to_nixls_hnd() {
    let n = negotiate(&dense(), &opts(), &[flexkv(), nixl()]).unwrap();
    assert_eq!(n.effective.layout, KvLayout::HND);
    assert_eq!(
        n.adapters,
        vec![LayoutAdapter {
            child: "flexkv".into(),
            native: KvLayout::NHD,
            effective: KvLayout::HND,
            cost: AdaptCost::Medium
        }]
    );
    let text = n.explain();
    let line = text.lines().find(|l| l.starts_with("layout")).unwrap();
    assert!(line.contains("[child nixl]"), "{text}");
    assert!(line.contains("child 'flexkv' does not accept it and adapts with a transpose"), "{text}");
    assert_eq!(text.lines().count(), 8, "{text}");
    println!("{text}");
}

#[test]
fn opaque_blocks_refuse_an_adapter_and_name_why() {
    let cpu = EngineOptions {
        kv_cache_layout: Some(KvLayout::HND),
        opaque_blocks: Some("vLLM's CPU backend stores K transposed inside a block".into()),
        ..opts()
    };
    let n = negotiate(&dense(), &cpu, &[nixl()]).unwrap();
    assert!(n.effective.opaque_blocks);
    assert!(n.adapters.is_empty());
    let e = negotiate(&dense(), &cpu, &[flexkv(), nixl()]).unwrap_err();
    assert!(matches!(e, Conflict::OpaqueBlocks { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("stores K transposed"), "{msg}");
    assert!(msg.contains("child 'flexkv': LBNHC -> LBHNC"), "{msg}");
    // The same children over a known layout adapt as before.
    assert_eq!(negotiate(&dense(), &opts(), &[flexkv(), nixl()]).unwrap().adapters.len(), 1);
    // A child that stores opaque blocks whole takes the engine's layout without an adapter;
    // over a known layout its own constraint still holds.
    let mut whole = flexkv();
    whole.caps.stores_opaque_blocks = true;
    let n = negotiate(&dense(), &cpu, &[whole.clone(), nixl()]).unwrap();
    assert!(n.adapters.is_empty() && n.effective.opaque_blocks, "{}", n.explain());
    assert_eq!(n.effective.layout, KvLayout::HND);
    assert_eq!(negotiate(&dense(), &opts(), &[whole, nixl()]).unwrap().adapters.len(), 1);
}

#[test]
fn explain_is_aligned() {
    let n = negotiate(&hybrid(), &opts(), &[lmcache(256), nixl()]).unwrap();
    let text = n.explain();
    let cols: Vec<usize> = text.lines().map(|l| l.find(" = ").unwrap()).collect();
    assert!(cols.windows(2).all(|w| w[0] == w[1]), "{text}");
    let brackets: Vec<usize> = text.lines().map(|l| l.find("  [").unwrap()).collect();
    assert!(brackets.windows(2).all(|w| w[0] == w[1]), "{text}");
    for f in ["layout", "hma", "block_size", "cache_dtype", "memory", "transfer_mode", "kv_groups", "tp_size"]
    {
        assert!(text.lines().any(|l| l.starts_with(f)), "{f} missing: {text}");
    }
}

#[test]
fn adapters_disabled_is_a_conflict_naming_both() {
    let o = EngineOptions { allow_adapters: false, ..opts() };
    let e = negotiate(&dense(), &o, &[flexkv(), nixl()]).unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, Conflict::Layout { requested: None, .. }));
    assert!(s.contains("child 'flexkv' rejects HND (LBHNC)"), "{s}");
    assert!(s.contains("child 'nixl' requires HND (LBHNC)"), "{s}");
    assert!(s.contains("allow adapters (allow_adapters=true)"), "{s}");
    assert!(s.contains("remove child 'flexkv'") && s.contains("remove child 'nixl'"), "{s}");
}

#[test]
fn user_layout_override() {
    // Satisfied directly.
    let o = EngineOptions { kv_cache_layout: Some(KvLayout::HND), ..opts() };
    let n = negotiate(&dense(), &o, &[lmcache(256), nixl()]).unwrap();
    assert_eq!(prov(&n, "layout").decided_by, DecidedBy::User);
    // Not satisfiable: NHD against nixl.
    let o = EngineOptions { kv_cache_layout: Some(KvLayout::NHD), ..opts() };
    let e = negotiate(&dense(), &o, &[lmcache(256), nixl()]).unwrap_err();
    let s = e.to_string();
    assert!(s.contains("kv_cache_layout=NHD (LBNHC) was set, but child 'nixl' does not accept it"), "{s}");
    assert!(s.contains("set kv_cache_layout=LBHNC"), "{s}");
    // Satisfied through an adapter.
    let o = EngineOptions { kv_cache_layout: Some(KvLayout::HND), ..opts() };
    let n = negotiate(&dense(), &o, &[flexkv()]).unwrap();
    assert_eq!(n.adapters.len(), 1);
}

#[test]
fn no_common_layout_without_adapters() {
    let nhd_only = child(
        "cache",
        caps(
            false,
            LayoutConstraint { required: vec![KvLayout::NHD], rejected: vec![], preferred: vec![] },
            None,
            TransferMode::None,
        ),
    );
    let e = negotiate(&dense(), &opts(), &[nhd_only, nixl()]).unwrap_err();
    let s = e.to_string();
    assert!(s.starts_with("no KV layout satisfies every child"), "{s}");
    assert!(s.contains("child 'cache' requires NHD (LBNHC); cannot adapt"), "{s}");
    assert!(s.contains("remove child 'cache' (the others agree on HND (LBHNC))"), "{s}");
}

#[test]
fn fewest_adapters_then_cost() {
    let cheap = |n: &str, cost| {
        child(
            n,
            caps(
                true,
                LayoutConstraint { required: vec![KvLayout::BLNHC], rejected: vec![], preferred: vec![] },
                Some(cost),
                TransferMode::None,
            ),
        )
    };
    let blh = child(
        "x",
        caps(
            true,
            LayoutConstraint { required: vec![KvLayout::BLHNC], rejected: vec![], preferred: vec![] },
            Some(AdaptCost::High),
            TransferMode::None,
        ),
    );
    // Two children want BLNHC (one adapter if chosen), one wants BLHNC: BLNHC wins.
    let n =
        negotiate(&dense(), &opts(), &[blh.clone(), cheap("a", AdaptCost::Low), cheap("b", AdaptCost::Low)])
            .unwrap();
    assert_eq!(n.effective.layout, KvLayout::BLNHC);
    assert_eq!(n.adapters.len(), 1);
    // One each: the cheaper adapter wins (x adapts at high cost, a at low cost).
    let n = negotiate(&dense(), &opts(), &[blh, cheap("a", AdaptCost::Low)]).unwrap();
    assert_eq!(n.effective.layout, KvLayout::BLHNC);
    assert_eq!(n.adapters[0].child, "a");
}

#[test]
fn hma_on_with_unsupporting_child() {
    let o = EngineOptions { hybrid_kv_cache_manager: HmaOption::On, ..opts() };
    let e = negotiate(&hybrid(), &o, &[lmcache(256), nixl()]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "hybrid_kv_cache_manager=on was set, but child 'lmcache' does not support the hybrid KV cache \
            manager (child 'nixl' supports it); set hybrid_kv_cache_manager=auto or off, or remove child \
            'lmcache'"
    );
}

#[test]
fn linear_layers_need_hma() {
    let e = negotiate(&with_linear(), &opts(), &[lmcache(256), nixl()]).unwrap_err();
    assert!(
        matches!(&e, Conflict::HmaRequired { unsupported, user_off: false, .. } if unsupported == &["child \
            'lmcache'"])
    );
    let s = e.to_string();
    assert!(s.contains("36 state-space/linear-attention layer(s)"), "{s}");
    assert!(
        s.contains("child 'lmcache' does not support the hybrid KV cache manager: remove child 'lmcache'"),
        "{s}"
    );

    let off = EngineOptions { hybrid_kv_cache_manager: HmaOption::Off, ..opts() };
    let e = negotiate(&with_linear(), &off, &[nixl()]).unwrap_err();
    assert!(e.to_string().contains("hybrid_kv_cache_manager=off was set: set it to auto or on"), "{e}");

    // HMA alone is not enough: nixl does not carry the state layers' per-request state.
    let e = negotiate(&with_linear(), &opts(), &[nixl()]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "model 'qwen3_next' keeps per-request state in 36 state-space/linear-attention layer(s) (1 group: \
            linear x36 (state shape not in the config)), which decode needs besides the KV blocks, but child \
            'nixl' does not carry per-request state (carries_state); nothing would give decode that state. \
            Remedy: use connectors that declare carries_state (the nixl connector does, with backend shm or \
            tcp), or serve this model without disaggregation (remove child 'nixl')"
    );
    let mut carrier = nixl();
    carrier.caps.carries_state = true;
    let n = negotiate(&with_linear(), &opts(), &[carrier]).unwrap();
    assert!(n.effective.hma);
    assert_eq!(prov(&n, "hma").decided_by, DecidedBy::Model);
    assert_eq!(n.effective.state_groups.len(), 1);
    assert_eq!(n.effective.state_groups[0].layers.len(), 36);
    assert_eq!(prov(&n, "state_groups").value, "1 group: linear x36 (state shape not in the config)");
    // The linear layers are in no group; only the 12 full layers are.
    assert_eq!(n.effective.groups.len(), 1);
    assert_eq!(n.effective.groups[0].layers.len(), 12);
}

#[test]
fn state_at_tp_above_one_needs_children_that_carry_it_across_ranks() {
    let mut carrier = nixl();
    carrier.caps.carries_state = true;
    carrier.caps.heterogeneous_tp = true;
    let tp = |n| EngineOptions { tp_size: n, ..opts() };
    assert!(negotiate(&with_linear(), &tp(1), std::slice::from_ref(&carrier)).is_ok());
    let e = negotiate(&with_linear(), &tp(2), std::slice::from_ref(&carrier)).unwrap_err();
    assert!(
        matches!(&e, Conflict::StateWithTp { tp_size: 2, children, .. } if children == &["child 'nixl'"])
    );
    assert_eq!(
        e.to_string(),
        "model 'qwen3_next' keeps per-request state in 36 state-space/linear-attention layer(s), and \
            tp_size=2 splits its KV heads over 2 tensor-parallel ranks, but child 'nixl' carries that state \
            only at tp_size 1 (no state_with_tp). Remedy: run this model with tp_size=1 on prefill and \
            decode, or use connectors that declare state_with_tp (instead of child 'nixl')"
    );
    // A model without state layers is not concerned.
    assert!(negotiate(&dense(), &tp(2), std::slice::from_ref(&carrier)).is_ok());
    // Jointly, the side with TP 1 is refused too when its peer splits the heads: the children
    // of both roles carry the state.
    let e = negotiate_deployment(
        &with_linear(),
        (&tp(1), std::slice::from_ref(&carrier)),
        (&tp(2), std::slice::from_ref(&carrier)),
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("but child 'nixl' (prefill and decode) carries that state only at tp_size 1"),
        "{e}"
    );
    carrier.caps.state_with_tp = true;
    let n = negotiate(&with_linear(), &tp(2), std::slice::from_ref(&carrier)).unwrap();
    assert_eq!(n.effective.state_groups.len(), 1);
    assert!(negotiate_deployment(
        &with_linear(),
        (&tp(1), std::slice::from_ref(&carrier)),
        (&tp(2), std::slice::from_ref(&carrier)),
    )
    .is_ok());
}

#[test]
fn mla_needs_declared_support() {
    let n = negotiate(&mla_model(), &opts(), &[lmcache(256)]).unwrap();
    assert_eq!(n.effective.groups.len(), 1);
    let e = negotiate(&mla_model(), &opts(), &[lmcache(256), flexkv()]).unwrap_err();
    assert_eq!(
        e,
        Conflict::MlaUnsupported { model: "deepseek_v2".into(), unsupported: vec!["child 'flexkv'".into()] }
    );
}

#[test]
fn lmcache_chunk_must_be_a_multiple_of_the_block_size() {
    let o = EngineOptions { block_size: Some(48), ..opts() };
    let e = negotiate(&dense(), &o, &[lmcache(256), nixl()]).unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains(
            "child 'lmcache' has chunk_size 256, which must be a multiple of the block size; block \
            size 48 does not divide 256"
        ),
        "{s}"
    );
    assert!(s.contains("set block_size=16"), "{s}");
    assert!(s.contains("child 'nixl' accepts any block size"), "{s}");
}

#[test]
fn default_block_size_moves_when_it_does_not_fit() {
    let mut c = lmcache(256);
    c.caps.block_size_multiple = 64;
    let n = negotiate(&dense(), &opts(), &[c, nixl()]).unwrap();
    assert_eq!(n.effective.block_size, 64);
    let p = prov(&n, "block_size");
    assert_eq!(p.decided_by, DecidedBy::Child("lmcache".into()));
    assert!(p.reason.contains("the default 16 does not fit"), "{}", p.reason);
    // Only 8 fits: small chunks.
    let n = negotiate(&dense(), &opts(), &[lmcache(8)]).unwrap();
    assert_eq!(n.effective.block_size, 8);
    // A multiple outside the list: lcm.
    let mut c = lmcache(96);
    c.caps.block_size_multiple = 24;
    let n = negotiate(&dense(), &opts(), &[c]).unwrap();
    assert_eq!(n.effective.block_size, 24);
}

#[test]
fn disjoint_block_constraints_are_a_conflict() {
    let mut a = nixl();
    a.caps.block_size_multiple = 32;
    let e = negotiate(&dense(), &opts(), &[a, lmcache(16)]).unwrap_err();
    let s = e.to_string();
    assert!(s.starts_with("no block size fits every child"), "{s}");
    assert!(s.contains("child 'nixl' needs a multiple of 32"), "{s}");
}

#[test]
fn dtype_and_memory() {
    let mut n = nixl();
    n.caps.cache_dtypes = vec![Dtype::Bf16, Dtype::F16];
    let o = EngineOptions { cache_dtype: Some(Dtype::Fp8E4m3), ..opts() };
    let e = negotiate(&dense(), &o, &[lmcache(256), n.clone()]).unwrap_err();
    let s = e.to_string();
    assert!(s.starts_with("cache dtype fp8_e4m3 (set by user) is not supported by child 'nixl'"), "{s}");
    assert!(s.contains("set cache_dtype to bf16 or f16"), "{s}");
    let ok = negotiate(&dense(), &opts(), &[n]).unwrap();
    assert_eq!(prov(&ok, "cache_dtype").decided_by, DecidedBy::Model);

    let o = EngineOptions { memory: Some(MemoryKind::Device), ..opts() };
    let e = negotiate(&dense(), &o, &[lmcache(256), nixl()]).unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("KV memory device (set by user) is not usable by child 'lmcache', child 'nixl'"),
        "{s}"
    );
    assert!(s.contains("set kv_buffer_device to host memory"), "{s}");
}

#[test]
fn transfer_modes() {
    let mut pusher = nixl();
    pusher.name = "p2p".into();
    pusher.caps.transfer_mode = TransferMode::Push;
    let e = negotiate(&dense(), &opts(), &[nixl(), pusher.clone()]).unwrap_err();
    assert!(e.to_string().contains("child 'nixl' pull"), "{e}");
    let n = negotiate(&dense(), &opts(), &[lmcache(256), pusher]).unwrap();
    assert_eq!(n.effective.transfer_mode, TransferMode::Push);
    let n = negotiate(&dense(), &opts(), &[lmcache(256)]).unwrap();
    assert_eq!(n.effective.transfer_mode, TransferMode::None);
    assert_eq!(prov(&n, "transfer_mode").decided_by, DecidedBy::Default);
}

#[test]
fn bad_options_and_caps_are_errors() {
    let e = negotiate(&dense(), &EngineOptions { block_size: Some(0), ..opts() }, &[nixl()]).unwrap_err();
    assert!(e.to_string().starts_with("engine option block_size=0 is invalid"), "{e}");
    let e = negotiate(&dense(), &EngineOptions { tp_size: 2, tp_rank: 2, ..opts() }, &[]).unwrap_err();
    assert!(e.to_string().contains("tp_rank=2"), "{e}");
    let mut bad = nixl();
    bad.caps.block_size_multiple = 0;
    let e = negotiate(&dense(), &opts(), &[bad]).unwrap_err();
    assert!(
        e.to_string().starts_with("child 'nixl' declares invalid capabilities: block_size_multiple is 0"),
        "{e}"
    );
}

#[test]
fn no_children() {
    let n = negotiate(&hybrid(), &opts(), &[]).unwrap();
    assert_eq!(n.effective.layout, KvLayout::LBHNC);
    assert!(n.effective.hma);
    assert_eq!(n.effective.block_size, 16);
}

#[test]
fn layouts_are_tried_in_a_fixed_order() {
    // The fallback preference order is KvLayout::all(): ascending, so stable across builds.
    let all = all_layouts();
    assert_eq!(all.len(), 120);
    assert!(all.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(all[0].canonical_name(), "LBHNC");
    let c = preference_order(&[], true);
    assert_eq!(c[..4], KvLayout::COMMON);
    assert_eq!(c.len(), 120);
}

#[test]
fn option_strings() {
    assert_eq!("ON".parse::<HmaOption>().unwrap(), HmaOption::On);
    assert_eq!("false".parse::<HmaOption>().unwrap(), HmaOption::Off);
    let e = "maybe".parse::<HmaOption>().unwrap_err().to_string();
    assert_eq!(
        e,
        "hybrid_kv_cache_manager: 'maybe' is not a valid value; expected auto, on or off (or true/false)"
    );
    assert_eq!(EngineOptions::memory_from_kv_buffer_device("cuda").unwrap(), MemoryKind::Device);
    assert!(EngineOptions::memory_from_kv_buffer_device("tpu?").is_err());
    let o: EngineOptions =
        serde_json::from_str(r#"{"hybrid_kv_cache_manager":"off","kv_cache_layout":"HND"}"#).unwrap();
    assert_eq!(o.hybrid_kv_cache_manager, HmaOption::Off);
    assert_eq!(o.kv_cache_layout, Some(KvLayout::LBHNC));
    assert_eq!(o.tp_size, 1);
    assert!(o.allow_adapters);
}

/// The dtype and memory conflicts, word for word: one algorithm serves both fields, and a
/// change in either field's wording shows here.
#[test]
fn dtype_and_memory_conflicts_word_for_word() {
    let restricted = |name: &str, dtypes: Vec<Dtype>, memory: Vec<MemoryKind>| {
        let mut c = nixl();
        c.name = name.to_owned();
        c.caps.cache_dtypes = dtypes;
        c.caps.memory_kinds = memory;
        c
    };
    let host = || vec![MemoryKind::Host];
    let cases: Vec<(ModelSpec, EngineOptions, Vec<ChildCaps>)> = vec![
        (
            dense(),
            EngineOptions { cache_dtype: Some(Dtype::Fp8E4m3), ..opts() },
            vec![lmcache(256), restricted("nixl", vec![Dtype::Bf16, Dtype::F16], host())],
        ),
        (
            dense(),
            opts(),
            vec![restricted("a", vec![Dtype::F16], host()), restricted("b", vec![Dtype::F32], host())],
        ),
        (hybrid(), opts(), vec![lmcache(256), restricted("c", vec![Dtype::F16], host())]),
        (dense(), EngineOptions { memory: Some(MemoryKind::Device), ..opts() }, vec![lmcache(256), nixl()]),
        (dense(), opts(), vec![nixl(), restricted("gpu", vec![], vec![MemoryKind::Device])]),
    ];
    let got: Vec<String> =
        cases.iter().map(|(m, o, c)| negotiate(m, o, c).unwrap_err().to_string()).collect();
    let want = [
        "cache dtype fp8_e4m3 (set by user) is not supported by child 'nixl'. Children's dtypes: child \
            'lmcache' stores any dtype; child 'nixl' stores bf16, f16. Remedy: set cache_dtype to bf16 or \
            f16, or remove child 'nixl'",
        "cache dtype bf16 (the model's torch_dtype) is not supported by child 'a', child 'b'. Children's \
            dtypes: child 'a' stores f16; child 'b' stores f32. Remedy: the children share no cache dtype: \
            remove one of child 'a', child 'b'",
        "cache dtype bf16 (default: config has no torch_dtype) is not supported by child 'c'. Children's \
            dtypes: child 'lmcache' stores any dtype; child 'c' stores f16. Remedy: set cache_dtype to f16, \
            or remove child 'c'",
        "KV memory device (set by user) is not usable by child 'lmcache', child 'nixl'. Children's memory \
            kinds: child 'lmcache' uses host, disk; child 'nixl' uses host. Remedy: set kv_buffer_device to \
            host memory, or remove one of child 'lmcache', child 'nixl'",
        "KV memory host (default) is not usable by child 'gpu'. Children's memory kinds: child 'nixl' uses \
            host; child 'gpu' uses device. Remedy: the children share no memory kind: remove child 'gpu'",
    ];
    assert_eq!(got, want);
}

#[test]
fn layout_fields_read_and_write_their_names() {
    for f in LayoutField::KNOWN {
        let json = serde_json::to_string(&f).unwrap();
        assert_eq!(json, format!("\"{f}\""));
        assert_eq!(serde_json::from_str::<LayoutField>(&json).unwrap(), f);
        assert_eq!(LayoutField::from(f.as_str()), f);
    }
    assert_eq!(LayoutField::BlockSize.to_string(), "block_size");
    assert_eq!(format!("[{:<12}]", LayoutField::Hma), "[hma         ]");
    // A field a newer peer sends is kept as sent, not refused.
    let f: LayoutField = serde_json::from_str("\"kv_scale\"").unwrap();
    assert_eq!(f, LayoutField::Other("kv_scale".to_owned()));
    assert_eq!(serde_json::to_string(&f).unwrap(), "\"kv_scale\"");
    assert!(f == "kv_scale");
}
