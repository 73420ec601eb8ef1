//! The capabilities audit. A capability a built-in connector declares is a promise the host
//! and its peers act on, so every claim it makes names the test that exercises it.
//!
//! For each built-in (nixl, lmcache, flexkv, and the pd composite over the composites this
//! project ships), the claims it declares under configurations that turn each one on must
//! equal the table below, and every test the table names must exist as a `#[test]` function
//! in the file it names. A claim added without a test, a claim dropped while the table
//! still promises it, or a named test that is renamed or removed, fails here. A claim with no
//! test is declared false in the connector instead.
//!
//! Claims are the capability fields that promise behaviour: `hma`, `layerwise`,
//! `heterogeneous_tp`, `mla`, `async_load`, `adapt`, `carries_state`, and each memory kind,
//! transfer mode and role. Layout, block-size and dtype fields restrict rather than promise; negotiation checks
//! them. Claims that only builds with `--features cuda` declare (device memory) name the GPU
//! tests that exercise them; this build checks that those tests exist.

use kvconnect_api::KvRole;
use kvconnect_api::{Capabilities, ConnectorResolver, KvTransferConfig, MemoryKind, ModelSpec, TransferMode};
use kvconnect_host::registry::Registry;
use kvconnect_tests::{fixture_model, workspace_root};
use std::collections::{BTreeMap, BTreeSet};

/// One promise and the test that keeps it.
struct Claim {
    connector: &'static str,
    claim: &'static str,
    /// `path/from/the/workspace/root.rs::test_function`.
    test: &'static str,
    /// Declared only in builds with this cargo feature, so required only where declared.
    only_with: Option<&'static str>,
}

const fn claim(connector: &'static str, claim: &'static str, test: &'static str) -> Claim {
    Claim { connector, claim, test, only_with: None }
}

const fn gpu(connector: &'static str, claim: &'static str, test: &'static str) -> Claim {
    Claim { connector, claim, test, only_with: Some("cuda") }
}

const NIXL_FLOW: &str = "connectors/nixl/tests/pull.rs::shm_pull_full_worker_flow";
const DEEPSEEK_PD: &str =
    "tests/tests/mla_layout_free.rs::deepseek_kv_moves_from_a_composite_prefill_to_a_plain_decode";
const LMCACHE_ROLES: &str = "connectors/lmcache/tests/flow.rs::every_declared_role_saves_and_loads";
const FLEXKV_ROLES: &str = "connectors/flexkv/tests/connector.rs::every_declared_role_saves_and_loads";
const PD_PRODUCER: &str =
    "tests/tests/pd_composite.rs::composite_prefill_and_plain_decode_from_one_deployment_give_monolithic_tokens";
const PD_DECODE: &str =
    "tests/tests/pd_composite.rs::a_composite_decode_loads_through_its_nixl_child_as_consumer_and_as_both";

const CLAIMS: &[Claim] = &[
    claim("nixl", "hma", "tests/tests/pd_determinism.rs::shm_hma_on"),
    claim("nixl", "heterogeneous_tp", "tests/tests/pd_determinism.rs::shm_tp_2_to_1"),
    claim("nixl", "mla", DEEPSEEK_PD),
    // Declared with backends shm (the default) and tcp; both run in the matrix.
    claim("nixl", "carries_state", "tests/tests/pd_determinism.rs::hybrid_model_shm_hma_on"),
    claim("nixl", "async_load", NIXL_FLOW),
    claim("nixl", "memory:host", NIXL_FLOW),
    gpu("nixl", "memory:device", "connectors/nixl/tests/cuda_ipc.rs::same_process_equal_layouts"),
    claim("nixl", "transfer:pull", "connectors/nixl/tests/pull.rs::tcp_pull_full_worker_flow"),
    claim("nixl", "role:kv_producer", NIXL_FLOW),
    claim("nixl", "role:kv_consumer", NIXL_FLOW),
    claim("nixl", "role:kv_both", "tests/tests/pd_determinism.rs::shm_kv_both_on_each_side"),
    claim("lmcache", "layerwise", "connectors/lmcache/tests/flow.rs::layerwise_load_and_save"),
    claim("lmcache", "mla", "connectors/lmcache/tests/flow.rs::mla_caches_round_trip"),
    claim("lmcache", "memory:host", "connectors/lmcache/tests/flow.rs::nhd_and_hnd_over_several_block_sizes"),
    claim(
        "lmcache",
        "memory:disk",
        "connectors/lmcache/tests/tiers.rs::evicted_chunks_go_to_disk_and_are_served_from_there_also_after_a_restart",
    ),
    gpu("lmcache", "memory:device", "connectors/lmcache/tests/lmcache_device.rs::nhd_save_poison_load_into_other_blocks"),
    claim("lmcache", "role:kv_producer", LMCACHE_ROLES),
    claim("lmcache", "role:kv_consumer", LMCACHE_ROLES),
    claim("lmcache", "role:kv_both", LMCACHE_ROLES),
    claim("flexkv", "adapt", "connectors/flexkv/tests/connector.rs::hnd_deployment_is_adapted_by_transpose_exactly"),
    claim(
        "flexkv",
        "async_load",
        "connectors/flexkv/tests/connector.rs::prefix_hits_of_every_length_at_block_granularity",
    ),
    claim(
        "flexkv",
        "memory:host",
        "connectors/flexkv/tests/connector.rs::prefix_hits_of_every_length_at_block_granularity",
    ),
    claim("flexkv", "memory:disk", "connectors/flexkv/tests/connector.rs::cpu_evicts_to_ssd_and_ssd_hits_load_exactly"),
    gpu("flexkv", "memory:device", "connectors/flexkv/tests/flexkv_device.rs::per_layer_nhd_and_hnd"),
    claim("flexkv", "role:kv_producer", FLEXKV_ROLES),
    claim("flexkv", "role:kv_consumer", FLEXKV_ROLES),
    claim("flexkv", "role:kv_both", FLEXKV_ROLES),
    claim("pd", "mla", DEEPSEEK_PD),
    claim("pd", "layerwise", "connectors/pd/src/factory.rs::worker_calls_fan_out_to_every_child_in_order"),
    claim(
        "pd",
        "async_load",
        "connectors/pd/src/factory.rs::finished_recving_waits_for_every_loading_child_and_failures_win",
    ),
    claim("pd", "memory:host", PD_PRODUCER),
    claim("pd", "transfer:pull", PD_PRODUCER),
    claim("pd", "role:kv_producer", PD_PRODUCER),
    claim("pd", "role:kv_consumer", PD_DECODE),
    claim("pd", "role:kv_both", PD_DECODE),
];

/// The claims one declaration makes. Every field is named, so a new capability field does
/// not compile here until the audit says whether it is a claim.
fn claims_of(c: &Capabilities) -> BTreeSet<String> {
    let Capabilities {
        hma,
        layout: _,
        adapt,
        block_size_multiple: _,
        block_size_divides: _,
        cache_dtypes: _,
        memory_kinds,
        transfer_mode,
        roles,
        layerwise,
        heterogeneous_tp,
        mla,
        async_load,
        carries_state,
    } = c;
    let mut out = BTreeSet::new();
    for (on, name) in [
        (*hma, "hma"),
        (*layerwise, "layerwise"),
        (*heterogeneous_tp, "heterogeneous_tp"),
        (*mla, "mla"),
        (*async_load, "async_load"),
        (adapt.is_some(), "adapt"),
        (*carries_state, "carries_state"),
    ] {
        if on {
            out.insert(name.to_owned());
        }
    }
    for m in memory_kinds {
        out.insert(
            match m {
                MemoryKind::Host => "memory:host",
                MemoryKind::Device => "memory:device",
                MemoryKind::Disk => "memory:disk",
            }
            .to_owned(),
        );
    }
    match transfer_mode {
        TransferMode::None => {}
        TransferMode::Pull => {
            out.insert("transfer:pull".to_owned());
        }
        TransferMode::Push => {
            out.insert("transfer:push".to_owned());
        }
    }
    for r in roles {
        out.insert(
            match r {
                KvRole::Producer => "role:kv_producer",
                KvRole::Consumer => "role:kv_consumer",
                KvRole::Both => "role:kv_both",
            }
            .to_owned(),
        );
    }
    out
}

/// The kv-transfer-configs under which each built-in declares every claim it can make: the
/// plain config and the settings that turn on config-dependent claims. pd is audited over
/// the composites the examples and tests run.
fn configurations(tmp: &std::path::Path) -> Vec<(&'static str, String)> {
    let disk = format!("file://{}", tmp.join("lmcache-disk").display());
    let ssd = tmp.join("flexkv-ssd").display().to_string();
    let lmcache_all = format!(
        r#"{{"kv_connector":"LMCacheConnectorV1","kv_connector_extra_config":{{"use_layerwise":true,"local_disk":"{disk}","max_local_disk_size":1}}}}"#
    );
    let flexkv_all = format!(
        r#"{{"kv_connector":"FlexKVConnectorV1","kv_connector_extra_config":{{"ssd_cache_gb":1,"ssd_cache_dir":"{ssd}"}}}}"#
    );
    let pd = |children: &[&str]| {
        format!(
            r#"{{"kv_connector":"PdConnector","kv_connector_extra_config":{{"connectors":[{}]}}}}"#,
            children.join(",")
        )
    };
    let (nixl, lmcache, flexkv) = (
        r#"{"kv_connector":"NixlConnector"}"#,
        r#"{"kv_connector":"LMCacheConnectorV1"}"#,
        r#"{"kv_connector":"FlexKVConnectorV1"}"#,
    );
    vec![
        ("nixl", nixl.to_owned()),
        (
            "nixl",
            r#"{"kv_connector":"NixlConnector","kv_connector_extra_config":{"backend":"tcp"}}"#.to_owned(),
        ),
        ("lmcache", lmcache.to_owned()),
        ("lmcache", lmcache_all.clone()),
        ("flexkv", flexkv.to_owned()),
        ("flexkv", flexkv_all),
        ("pd", pd(&[lmcache, nixl])),
        ("pd", pd(&[flexkv, nixl])),
        ("pd", pd(&[&lmcache_all, nixl])),
    ]
}

/// Every claim each built-in declares, over every configuration and fixture model.
fn declared() -> BTreeMap<&'static str, BTreeSet<String>> {
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::builtins_only();
    let models: Vec<ModelSpec> = [
        "Qwen--Qwen3-0.6B",
        "deepseek-ai--DeepSeek-V2-Lite",
        "openai--gpt-oss-20b",
        "kvconnect--reference",
        "kvconnect--reference-hybrid",
    ]
    .iter()
    .map(|m| {
        let text = std::fs::read_to_string(fixture_model(m)).unwrap();
        ModelSpec::from_hf_config_json(&text).unwrap()
    })
    .collect();
    let mut out: BTreeMap<&'static str, BTreeSet<String>> = BTreeMap::new();
    for (name, json) in configurations(tmp.path()) {
        let config = KvTransferConfig::from_json(&json).unwrap();
        let factory = registry.resolve(&config).unwrap();
        assert_eq!(factory.info().name, name, "{json} resolves to another connector");
        for model in [None].into_iter().chain(models.iter().map(Some)) {
            let caps = factory
                .capabilities(&config, model)
                .unwrap_or_else(|e| panic!("{name} {json} on {:?}: {e}", model.map(|m| &m.name)));
            out.entry(name).or_default().extend(claims_of(&caps));
        }
    }
    out
}

#[test]
fn every_declared_claim_names_the_test_that_exercises_it() {
    let declared = declared();
    assert_eq!(declared.keys().copied().collect::<Vec<_>>(), ["flexkv", "lmcache", "nixl", "pd"]);
    let mut missing = Vec::new();
    let mut stale = Vec::new();
    for (connector, claims) in &declared {
        for c in claims {
            if !CLAIMS.iter().any(|e| e.connector == *connector && e.claim == c) {
                missing.push(format!("{connector} declares {c}"));
            }
        }
    }
    for e in CLAIMS {
        // A claim only some builds make is checked where it is declared.
        let is_declared = declared.get(e.connector).is_some_and(|c| c.contains(e.claim));
        if !is_declared && e.only_with.is_none() {
            stale.push(format!("{} {} ({})", e.connector, e.claim, e.test));
        }
    }
    assert!(
        missing.is_empty(),
        "claims without a test (name the test that exercises each in CLAIMS, or declare it false): {missing:#?}"
    );
    assert!(stale.is_empty(), "CLAIMS lists claims the connectors no longer declare: {stale:#?}");
}

#[test]
fn every_named_test_exists() {
    let mut bad = Vec::new();
    let tests: BTreeSet<&str> = CLAIMS.iter().map(|e| e.test).collect();
    for test in tests {
        let Some((path, name)) = test.split_once("::") else {
            bad.push(format!("{test}: not path::function"));
            continue;
        };
        let text = match std::fs::read_to_string(workspace_root().join(path)) {
            Ok(t) => t,
            Err(err) => {
                bad.push(format!("{test}: cannot read {path}: {err}"));
                continue;
            }
        };
        if !is_test_fn(&text, name) {
            bad.push(format!("{test}: no #[test] fn {name} in {path}"));
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// True when `text` defines `fn name(` right under a test attribute.
fn is_test_fn(text: &str, name: &str) -> bool {
    let lines: Vec<&str> = text.lines().collect();
    let head = format!("fn {name}(");
    lines.iter().enumerate().any(|(i, l)| {
        let l = l.trim_start();
        l.strip_prefix("async ").unwrap_or(l).starts_with(&head)
            && lines[..i]
                .iter()
                .rev()
                .take_while(|a| a.trim_start().starts_with("#["))
                .any(|a| a.contains("test]"))
    })
}

#[test]
fn the_test_finder_tells_tests_from_helpers() {
    let src = "#[test]\nfn a() {}\nfn b() {}\n#[tokio::test]\n#[ignore]\nasync fn c() {}\n#[test]\n#[cfg(x)]\nfn d() {}\n";
    assert!(is_test_fn(src, "a"));
    assert!(!is_test_fn(src, "b"), "a helper is not a test");
    assert!(!is_test_fn(src, "e"));
    assert!(is_test_fn(src, "d"));
    assert!(is_test_fn(src, "c"), "an async fn under #[tokio::test] counts too");
}
