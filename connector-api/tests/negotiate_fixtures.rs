//! Negotiation and compatibility over the real Hugging Face configs in fixtures/models,
//! with children declared like the built-in nixl, lmcache and flexkv connectors.

#[path = "support/children.rs"]
mod children;

use children::{caps, flexkv};
use kvconnect_api::compat::{check, check_roles};
use kvconnect_api::{
    negotiate, negotiate_deployment, AttentionKind, ChildCaps, CompatDescriptor, Conflict, DecidedBy, Dtype,
    EngineOptions, KvLayout, LayoutConstraint, MemoryKind, ModelSpec, TransferMode,
};

fn model(json: &str) -> ModelSpec {
    ModelSpec::from_hf_config_json(json).unwrap()
}

fn gpt_oss() -> ModelSpec {
    model(include_str!("../fixtures/models/openai--gpt-oss-20b/config.json"))
}
fn gemma3() -> ModelSpec {
    model(include_str!("../fixtures/models/google--gemma-3-1b-it/config.json"))
}
fn qwen3() -> ModelSpec {
    model(include_str!("../fixtures/models/Qwen--Qwen3-0.6B/config.json"))
}
fn llama() -> ModelSpec {
    model(include_str!("../fixtures/models/meta-llama--Llama-3.1-8B-Instruct/config.json"))
}
fn mistral() -> ModelSpec {
    model(include_str!("../fixtures/models/mistralai--Mistral-7B-v0.1/config.json"))
}
fn qwen3_next() -> ModelSpec {
    model(include_str!("../fixtures/models/Qwen--Qwen3-Next-80B-A3B-Thinking/config.json"))
}
fn nemotron_h() -> ModelSpec {
    model(include_str!("../fixtures/models/nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/config.json"))
}
fn deepseek_v2() -> ModelSpec {
    model(include_str!("../fixtures/models/deepseek-ai--DeepSeek-V2-Lite/config.json"))
}

fn lmcache() -> ChildCaps {
    children::lmcache(256)
}

/// nixl's declaration depends on the model: no layout constraint for MLA.
fn nixl(m: &ModelSpec) -> ChildCaps {
    let mla = m.layers.iter().any(|k| matches!(k, AttentionKind::Mla { .. }));
    let layout = if mla {
        LayoutConstraint::default()
    } else {
        LayoutConstraint { required: vec![KvLayout::HND], rejected: vec![], preferred: vec![KvLayout::HND] }
    };
    let mut c = caps(true, layout, None, TransferMode::Pull);
    c.memory_kinds = vec![MemoryKind::Host];
    c.mla = true;
    children::child("nixl", c)
}

fn opts() -> EngineOptions {
    EngineOptions::default()
}

fn hash(m: &ModelSpec, children: &[ChildCaps]) -> (CompatDescriptor, String) {
    let d = CompatDescriptor::new(m, &negotiate(m, &opts(), children).unwrap(), &opts());
    let h = d.compat_hash();
    (d, h)
}

#[test]
fn dyn_3545_on_hybrid_models() {
    for m in [gpt_oss(), gemma3()] {
        let (p, ph) = hash(&m, &[lmcache(), nixl(&m)]);
        let (d, dh) = hash(&m, &[nixl(&m)]);
        assert!(!p.effective.hma && d.effective.hma, "{}", m.name);
        assert_ne!(ph, dh);
        let e = check_roles(&p, &d).unwrap_err();
        let line = e.diff_of("hma").unwrap().line("prefill", "decode");
        assert!(line.starts_with("hma: prefill=off (child 'lmcache' does not support HMA), decode=on (default: every child supports HMA and the model has 2 attention kinds)"), "{line}");
        assert!(
            line.ends_with(
                "run decode with the same connector set, or set hybrid_kv_cache_manager=off on decode"
            ),
            "{line}"
        );

        let (pn, dn) =
            negotiate_deployment(&m, (&opts(), &[lmcache(), nixl(&m)]), (&opts(), &[nixl(&m)])).unwrap();
        let pd = CompatDescriptor::new(&m, &pn, &opts());
        let dd = CompatDescriptor::new(&m, &dn, &opts());
        assert_eq!(pd.compat_hash(), dd.compat_hash());
        assert!(check_roles(&pd, &dd).unwrap().is_identity());
    }
}

#[test]
fn gemma3_groups_follow_its_schedule() {
    let m = gemma3();
    let n = negotiate(&m, &opts(), &[nixl(&m)]).unwrap();
    assert_eq!(n.effective.groups.len(), 2);
    assert_eq!(n.effective.groups[0].kind, AttentionKind::SlidingWindow { window: 512 });
    assert_eq!(n.effective.groups[0].layers.len(), 22);
    assert_eq!(n.effective.groups[1].layers.iter().map(|l| l.0).collect::<Vec<_>>(), [5, 11, 17, 23]);
}

#[test]
fn dense_models_agree_even_when_negotiated_apart() {
    for m in [qwen3(), llama(), mistral()] {
        let (_, ph) = hash(&m, &[lmcache(), nixl(&m)]);
        let (_, dh) = hash(&m, &[nixl(&m)]);
        assert_eq!(ph, dh, "{}", m.name);
    }
}

#[test]
fn gpt_oss_dtype_defaults_to_bf16_with_the_reason() {
    let m = gpt_oss();
    let n = negotiate(&m, &opts(), &[nixl(&m)]).unwrap();
    assert_eq!(n.effective.cache_dtype, Dtype::Bf16);
    assert_eq!(n.provenance_of("cache_dtype").unwrap().why(), "default: config has no torch_dtype");
}

#[test]
fn state_space_models_refuse_children_without_hma_or_state() {
    for m in [qwen3_next(), nemotron_h()] {
        let e = negotiate(&m, &opts(), &[lmcache(), nixl(&m)]).unwrap_err();
        assert!(
            matches!(&e, Conflict::HmaRequired { unsupported, .. } if unsupported == &["child 'lmcache'"]),
            "{}: {e}",
            m.name
        );
        // With HMA, nixl still cannot give decode the state of the state layers.
        let e = negotiate(&m, &opts(), &[nixl(&m)]).unwrap_err();
        assert!(
            matches!(&e, Conflict::StateUnsupported { unsupported, .. } if unsupported == &["child 'nixl'"]),
            "{}: {e}",
            m.name
        );
        // A transport that carries it negotiates, with the state groups beside the KV groups.
        let mut carrier = nixl(&m);
        carrier.caps.carries_state = true;
        let n = negotiate(&m, &opts(), &[carrier]).unwrap();
        let fields: Vec<&str> = n.provenance.iter().map(|p| p.field.as_str()).collect();
        let at = fields.iter().position(|f| *f == "kv_groups").unwrap();
        assert_eq!(fields[at + 1], "state_groups", "{fields:?}");
        assert_eq!(n.effective.state_groups.len(), 1);
        assert_eq!(n.effective.state_groups[0].state, m.state);
        assert!(n.effective.hma);
        assert_eq!(n.provenance_of("hma").unwrap().decided_by, DecidedBy::Model);
        let kv_layers = m.layers.iter().filter(|k| k.has_kv_blocks()).count();
        let grouped: usize = n.effective.groups.iter().map(|g| g.layers.len()).sum();
        assert_eq!(grouped, kv_layers, "{}", m.name);
        assert!(kv_layers < m.layers.len());
        let stateful = m.layers.iter().filter(|k| matches!(k, AttentionKind::Linear)).count();
        assert_eq!(n.effective.state_groups[0].layers.len(), stateful, "{}", m.name);
    }
    let state = |m: &ModelSpec| {
        let mut carrier = nixl(m);
        carrier.caps.carries_state = true;
        n_state(m, carrier)
    };
    assert_eq!(state(&nemotron_h()), "1 group: mamba2 x23 (conv 3x6144 bf16, ssm 64x64x128 f32)");
    assert_eq!(state(&qwen3_next()), "1 group: gated_delta_net x36 (conv 3x8192 bf16, ssm 32x128x128 bf16)");
}

fn n_state(m: &ModelSpec, child: ChildCaps) -> String {
    negotiate(m, &opts(), &[child]).unwrap().provenance_of("state_groups").unwrap().value.clone()
}

#[test]
fn mla_model() {
    let m = deepseek_v2();
    let n = negotiate(&m, &opts(), &[lmcache(), nixl(&m)]).unwrap();
    // nixl has no layout constraint for MLA, so lmcache's preference decides.
    assert_eq!(n.effective.layout, KvLayout::NHD);
    assert_eq!(n.provenance_of("layout").unwrap().decided_by, DecidedBy::Child("lmcache".into()));
    let e = negotiate(&m, &opts(), &[flexkv(), nixl(&m)]).unwrap_err();
    assert!(
        e.to_string().contains("uses MLA (latent KV), but child 'flexkv' does not declare MLA support"),
        "{e}"
    );
}

#[test]
fn three_child_composite_on_a_hybrid_model() {
    let m = gpt_oss();
    let n = negotiate(&m, &opts(), &[lmcache(), flexkv(), nixl(&m)]).unwrap();
    assert_eq!(n.effective.layout, KvLayout::HND);
    assert_eq!(n.adapters.len(), 1);
    assert_eq!(n.adapters[0].child, "flexkv");
    assert!(!n.effective.hma);
    let hma = n.provenance_of("hma").unwrap();
    assert_eq!(hma.reason, "child 'lmcache', child 'flexkv' do not support HMA");
    // The plain-nixl decode side gets told exactly why it would mismatch.
    let pd = CompatDescriptor::new(&m, &n, &opts());
    let (dd, _) = hash(&m, &[nixl(&m)]);
    assert!(check(&dd, &pd).is_err());
}
