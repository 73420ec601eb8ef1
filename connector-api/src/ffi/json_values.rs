//! The JSON values that cross the C ABI, as `kvconnect.h` shows them to C plugin authors: one
//! example of each, made by serialising real values of the types the host decodes them into,
//! so the header's examples cannot drift from what the host sends and accepts.

use crate::caps::{Capabilities, LayoutConstraint, MemoryKind, TransferMode};
use crate::connector::{
    BlocksPerGroup, ConnectorContext, ConnectorInfo, FinishedTransfers, MatchResult, Request, RequestFinished,
};
use crate::connector_metrics::ConnectorMetric;
use crate::error::ConnectorError;
use crate::ids::{BlockId, LayerId, RequestId};
use crate::layout::{EffectiveLayout, KvGroup, KvLayout};
use crate::model::{AttentionKind, Dtype, ModelSpec};
use crate::region::KvRegionSpec;
use crate::{KvRole, KvTransferConfig};

/// One JSON value of the ABI: its Rust type (whose serde form is the schema), where it
/// crosses, and an example.
#[derive(Debug, Clone)]
pub struct JsonValue {
    /// The kvconnect-api type.
    pub rust_type: &'static str,
    /// Which entries send or return it.
    pub used_by: &'static str,
    /// What a plugin must know beyond the example.
    pub rules: &'static str,
    /// An example, compact JSON.
    pub example: String,
}

fn json<T: serde::Serialize>(v: &T) -> String {
    // These types serialise infallibly (string keys, no non-finite floats).
    serde_json::to_string(v).unwrap_or_default()
}

fn model() -> ModelSpec {
    ModelSpec {
        name: "tiny".into(),
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 4,
        dtype: Some(Dtype::F16),
        layers: vec![AttentionKind::Full; 2],
        state: None,
    }
}

/// Every JSON value of the ABI, in the order the header lists them.
pub fn json_values() -> Vec<JsonValue> {
    let mut finished =
        FinishedTransfers { finished_recving: vec![RequestId::from("req-1")], ..Default::default() };
    finished.add_load(&RequestId::from("req-1"), "my-plugin", "disk", 16);
    let mut config = KvTransferConfig::named("my-plugin");
    config.kv_connector_extra_config.insert("dir".into(), "/var/cache/kv".into());
    let ctx = ConnectorContext {
        config: config.clone(),
        model: model(),
        effective: EffectiveLayout {
            layout: KvLayout::NHD,
            hma: false,
            block_size: 16,
            cache_dtype: Dtype::F16,
            memory: MemoryKind::Host,
            transfer_mode: TransferMode::None,
            groups: vec![KvGroup { kind: AttentionKind::Full, layers: vec![LayerId(0), LayerId(1)] }],
            state_groups: vec![],
            opaque_blocks: false,
        },
        role: KvRole::Both,
        engine_id: "engine-0".into(),
        tp_rank: 0,
        tp_size: 1,
    };
    let caps = Capabilities {
        hma: false,
        layout: LayoutConstraint {
            required: vec![],
            rejected: vec![KvLayout::BLNHC],
            preferred: vec![KvLayout::NHD],
        },
        adapt: None,
        block_size_multiple: 1,
        block_size_divides: None,
        cache_dtypes: vec![],
        memory_kinds: vec![MemoryKind::Host],
        transfer_mode: TransferMode::None,
        roles: vec![KvRole::Producer, KvRole::Consumer, KvRole::Both],
        layerwise: true,
        heterogeneous_tp: false,
        mla: false,
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
    };
    let region = KvRegionSpec {
        name: "layer.0".into(),
        addr: 0x7f00_0000_0000,
        len: 8192,
        memory: MemoryKind::Host,
        device: -1,
        layers: vec![LayerId(0)],
        group: 0,
        num_blocks: 16,
        shm_name: None,
    };
    vec![
        JsonValue {
            rust_type: "ConnectorInfo",
            used_by: "factory info (*out)",
            rules: "all three strings required",
            example: json(&ConnectorInfo {
                name: "my-plugin".into(),
                version: "0.1.0".into(),
                description: "one line on what it does".into(),
            }),
        },
        JsonValue {
            rust_type: "Capabilities",
            used_by: "factory capabilities (*out)",
            rules: "unknown fields are refused; layouts are dimension orders (NHD = LBNHC, \
                    HND = LBHNC); memory_kinds host|device|disk; transfer_mode none|pull|push; \
                    roles kv_producer|kv_consumer|kv_both",
            example: json(&caps),
        },
        JsonValue {
            rust_type: "KvTransferConfig",
            used_by: "factory capabilities and child_capabilities (config); ConnectorContext.config",
            rules: "a plugin's own settings are in kv_connector_extra_config",
            example: json(&config),
        },
        JsonValue {
            rust_type: "ConnectorContext",
            used_by: "create_scheduler, create_worker (ctx)",
            rules: "effective is the negotiated layout the KV regions follow",
            example: json(&ctx),
        },
        JsonValue {
            rust_type: "ConnectorError",
            used_by: "every entry's *err, with a status other than KVC_OK",
            rules: "one key naming the kind (NotImplemented {connector, method}, InvalidConfig, \
                    InvalidArgument, Io, Other {connector, message}); the status code says the same kind",
            example: json(&ConnectorError::invalid(
                "my-plugin",
                "block 9 is out of range for layer 0 (8 blocks)",
            )),
        },
        JsonValue {
            rust_type: "Request",
            used_by: "scheduler entries (req)",
            rules: "kv_transfer_params may be absent",
            example: json(&Request {
                id: RequestId::from("req-1"),
                prompt_tokens: vec![101, 2023, 2003],
                kv_transfer_params: Default::default(),
            }),
        },
        JsonValue {
            rust_type: "MatchResult",
            used_by: "get_num_new_matched_tokens (*out)",
            rules: "or \"Pending\" to be asked again next step",
            example: json(&MatchResult::Matched { tokens: 16, async_load: false }),
        },
        JsonValue {
            rust_type: "BlocksPerGroup",
            used_by: "update_state_after_alloc, request_finished (blocks)",
            rules: "one list of block ids per KV cache group",
            example: json(&BlocksPerGroup(vec![vec![BlockId(3), BlockId(5)]])),
        },
        JsonValue {
            rust_type: "RequestFinished",
            used_by: "request_finished (*out)",
            rules: "transfer_params: an object for the peer, or null",
            example: json(&RequestFinished::default()),
        },
        JsonValue {
            rust_type: "Vec<KvRegionSpec>",
            used_by: "register_kv_caches (regions)",
            rules: "addr is an address in this process for memory host; shm_name may be absent",
            example: json(&vec![region]),
        },
        JsonValue {
            rust_type: "FinishedTransfers",
            used_by: "get_finished (*out)",
            rules: "request ids as strings; load_sources (what a cache tier supplied to a request's \
                load, reported once) may be absent",
            example: json(&finished),
        },
        JsonValue {
            rust_type: "Vec<ConnectorMetric>",
            used_by: "metrics (*out; scheduler and worker)",
            rules: "kind \"counter\" or \"gauge\"; a counter's name without _total (the host adds it); \
                labels may be absent; the host adds up equal samples of the two halves and the ranks",
            example: json(&vec![
                ConnectorMetric::counter("my_plugin_hits", "Blocks found on disk.", 3).label("tier", "disk")
            ]),
        },
    ]
}

/// The files under `connector-api/schema/` that hold the JSON Schemas of the ABI's values.
pub const SCHEMA_DIR: &str = "connector-api/schema";

/// The JSON Schemas of the values a plugin returns or is given at setup, as the types make
/// them: `(file name under SCHEMA_DIR, schema)`. The header points C authors at the files;
/// tests/tests/plugins_json_schemas.rs keeps them equal to this and validates real values
/// against them.
#[cfg(feature = "schema")]
pub fn json_schemas() -> Vec<(&'static str, serde_json::Value)> {
    fn schema<T: schemars::JsonSchema>() -> serde_json::Value {
        schemars::schema_for!(T).to_value()
    }
    vec![
        ("connector_info.schema.json", schema::<ConnectorInfo>()),
        ("capabilities.schema.json", schema::<Capabilities>()),
        ("connector_context.schema.json", schema::<ConnectorContext>()),
        ("connector_error.schema.json", schema::<ConnectorError>()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_example_decodes_as_its_type() {
        let v = json_values();
        let ex = |t: &str| &v.iter().find(|j| j.rust_type == t).unwrap().example;
        serde_json::from_str::<ConnectorInfo>(ex("ConnectorInfo")).unwrap();
        serde_json::from_str::<Capabilities>(ex("Capabilities")).unwrap().validate().unwrap();
        serde_json::from_str::<ConnectorContext>(ex("ConnectorContext")).unwrap();
        serde_json::from_str::<ConnectorError>(ex("ConnectorError")).unwrap();
        serde_json::from_str::<Request>(ex("Request")).unwrap();
        serde_json::from_str::<MatchResult>(ex("MatchResult")).unwrap();
        serde_json::from_str::<BlocksPerGroup>(ex("BlocksPerGroup")).unwrap();
        serde_json::from_str::<RequestFinished>(ex("RequestFinished")).unwrap();
        serde_json::from_str::<Vec<KvRegionSpec>>(ex("Vec<KvRegionSpec>")).unwrap();
        serde_json::from_str::<FinishedTransfers>(ex("FinishedTransfers")).unwrap();
        for m in serde_json::from_str::<Vec<ConnectorMetric>>(ex("Vec<ConnectorMetric>")).unwrap() {
            m.check().unwrap();
        }
        serde_json::from_str::<KvTransferConfig>(ex("KvTransferConfig")).unwrap();
        assert!(v.iter().all(|j| !j.example.is_empty() && !j.example.contains("*/")));
    }
}
