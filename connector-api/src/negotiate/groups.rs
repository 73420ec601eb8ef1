//! The KV cache groups and state groups a model gets, and their one-line descriptions.

use crate::ids::LayerId;
use crate::layout::{KvGroup, StateGroup};
use crate::model::{AttentionKind, ModelSpec};

/// The KV cache groups as one short string: `2 groups: sliding_window(128) x12, full x12`,
/// or with HMA off `1 group: all 24 KV layers` (the group's `kind` is
/// then only its first layer's, so it is not printed).
pub fn describe_groups_with(groups: &[KvGroup], hma: bool) -> String {
    match groups {
        [one] if !hma => format!("1 group: all {} KV layers", one.layers.len()),
        _ => describe_groups(groups),
    }
}

/// The state groups as one short string:
/// `1 group: mamba2 x23 (conv 3x6144 bf16, ssm 64x64x128 f32)`, or `none`.
pub fn describe_state_groups(groups: &[StateGroup]) -> String {
    if groups.is_empty() {
        return "none".to_owned();
    }
    let dims = |v: &[u32]| v.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x");
    let parts: Vec<String> = groups
        .iter()
        .map(|g| match &g.state {
            Some(st) => format!(
                "{} x{} (conv {} {}, ssm {} {})",
                st.kind,
                g.layers.len(),
                dims(&st.conv_shape),
                st.conv_dtype,
                dims(&st.ssm_shape),
                st.ssm_dtype
            ),
            None => format!("linear x{} (state shape not in the config)", g.layers.len()),
        })
        .collect();
    format!("{} group{}: {}", groups.len(), if groups.len() == 1 { "" } else { "s" }, parts.join(", "))
}

/// The state groups a model gets: its state-space / linear-attention layers, which all keep
/// the state the config describes, as one group; none without such layers.
pub fn state_groups(model: &ModelSpec) -> Vec<StateGroup> {
    let layers: Vec<LayerId> = (0u32..)
        .zip(&model.layers)
        .filter(|(_, k)| matches!(k, AttentionKind::Linear))
        .map(|(i, _)| LayerId(i))
        .collect();
    if layers.is_empty() {
        return Vec::new();
    }
    vec![StateGroup { layers, state: model.state.clone() }]
}

/// The KV cache groups as one short string: `2 groups: sliding_window(128) x12, full x12`.
pub fn describe_groups(groups: &[KvGroup]) -> String {
    if groups.is_empty() {
        return "no groups (the model has no KV layers)".to_owned();
    }
    let parts: Vec<String> = groups.iter().map(|g| format!("{} x{}", g.kind, g.layers.len())).collect();
    format!("{} group{}: {}", groups.len(), if groups.len() == 1 { "" } else { "s" }, parts.join(", "))
}

/// The distinct attention kinds of the layers that hold KV blocks, in first-layer order.
pub fn kv_kinds(model: &ModelSpec) -> Vec<AttentionKind> {
    let mut kinds: Vec<AttentionKind> = Vec::new();
    for k in model.layers.iter().filter(|k| k.has_kv_blocks()) {
        if !kinds.contains(k) {
            kinds.push(*k);
        }
    }
    kinds
}

/// The KV cache groups a model gets: with HMA, one group per attention kind (in the order
/// the kinds first appear); without it, one group of every KV layer. Layers without KV
/// blocks are in no group.
pub fn kv_groups(model: &ModelSpec, hma: bool) -> Vec<KvGroup> {
    let kv_layers = || {
        model
            .layers
            .iter()
            .enumerate()
            .filter(|(_, k)| k.has_kv_blocks())
            .map(|(i, k)| (LayerId(i as u32), k))
    };
    if hma {
        kv_kinds(model)
            .into_iter()
            .map(|kind| KvGroup {
                kind,
                layers: kv_layers().filter(|(_, k)| **k == kind).map(|(i, _)| i).collect(),
            })
            .collect()
    } else {
        let layers: Vec<LayerId> = kv_layers().map(|(i, _)| i).collect();
        match kv_layers().next() {
            Some((_, first)) => vec![KvGroup { kind: *first, layers }],
            None => vec![],
        }
    }
}
