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
//! nixl is audited per backend (`shm`, `tcp`, `nixl`, `cuda_ipc`): a claim that some of its
//! backends declare and others do not (heterogeneous TP, per-request state, each memory kind)
//! names one test per backend that declares it, a test that runs on that backend; a claim
//! every backend declares names one test.
//!
//! Claims are the capability fields that promise behaviour: `hma`, `layerwise`,
//! `heterogeneous_tp`, `ranks_in_one_worker`, `mla`, `async_load`, `adapt`, `carries_state`, `stores_opaque_blocks`, the combinations
//! `state_with_tp`, `adapts_with_tp` and `adapts_with_state` (no built-in declares them:
//! negotiation and the compat check refuse those pairs before launch), and each memory kind,
//! transfer mode and role. Layout, block-size and dtype fields restrict rather than promise;
//! negotiation checks them. `needs_side_channel`, `needs_data_plane_secret` and
//! `needs_shared_memory_kv` ask the host for something rather than promise it
//! (`server/src/connector_setup.rs` tests that it is given). Claims that only builds with `--features cuda` declare name the GPU tests that
//! exercise them; this build checks that those tests exist.

use kvconnect_api::KvRole;
use kvconnect_api::{Capabilities, ConnectorResolver, KvTransferConfig, MemoryKind, ModelSpec, TransferMode};
use kvconnect_registry::Registry;
use kvconnect_tests::{fixture_model, workspace_root};
use std::collections::{BTreeMap, BTreeSet};

/// One promise and the test that keeps it.
#[derive(Clone, Copy)]
struct Claim {
    connector: &'static str,
    /// The backend it is declared for, when the connector declares it on some backends only.
    backend: Option<&'static str>,
    claim: &'static str,
    /// `path/from/the/workspace/root.rs::test_function`.
    test: &'static str,
    /// Declared only in builds with this cargo feature, so required only where declared.
    only_with: Option<&'static str>,
}

const fn claim(connector: &'static str, claim: &'static str, test: &'static str) -> Claim {
    Claim { connector, backend: None, claim, test, only_with: None }
}

/// A claim of one backend of `connector`.
const fn on(
    connector: &'static str,
    backend: &'static str,
    claim: &'static str,
    test: &'static str,
) -> Claim {
    Claim { connector, backend: Some(backend), claim, test, only_with: None }
}

const fn gpu(connector: &'static str, claim: &'static str, test: &'static str) -> Claim {
    Claim { connector, backend: None, claim, test, only_with: Some("cuda") }
}

/// A claim of one backend that only `--features cuda` builds declare.
const fn gpu_on(
    connector: &'static str,
    backend: &'static str,
    claim: &'static str,
    test: &'static str,
) -> Claim {
    Claim { connector, backend: Some(backend), claim, test, only_with: Some("cuda") }
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
    on("nixl", "shm", "heterogeneous_tp", "tests/tests/pd_determinism.rs::shm_tp_2_to_1"),
    on("nixl", "tcp", "heterogeneous_tp", "tests/tests/pd_determinism.rs::tcp_tp_2_to_1"),
    // A TP 2 prefill of the reference engine registers both ranks' regions in one worker.
    on("nixl", "shm", "ranks_in_one_worker", "tests/tests/pd_determinism.rs::shm_tp_2_to_1"),
    on("nixl", "tcp", "ranks_in_one_worker", "tests/tests/pd_determinism.rs::tcp_tp_2_to_1"),
    claim("nixl", "mla", DEEPSEEK_PD),
    on("nixl", "shm", "carries_state", "tests/tests/pd_determinism.rs::hybrid_model_shm_hma_on"),
    on("nixl", "tcp", "carries_state", "tests/tests/pd_determinism.rs::hybrid_model_tcp_hma_on"),
    claim("nixl", "async_load", NIXL_FLOW),
    on("nixl", "shm", "memory:host", NIXL_FLOW),
    on("nixl", "tcp", "memory:host", "connectors/nixl/tests/pull.rs::tcp_pull_full_worker_flow"),
    on("nixl", "nixl", "memory:host", "tests/tests/pd_determinism.rs::nixl_hma_on"),
    on("nixl", "cuda_ipc", "memory:device", "connectors/nixl/tests/cuda_ipc.rs::same_process_equal_layouts"),
    gpu_on("nixl", "nixl", "memory:device", "connectors/nixl/tests/nixl_vram.rs::connector_loads_a_request_vram_to_vram"),
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
    claim("flexkv", "stores_opaque_blocks", "connectors/flexkv/tests/connector.rs::opaque_blocks_are_stored_and_loaded_whole"),
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
        state_with_tp,
        adapts_with_tp,
        adapts_with_state,
        stores_opaque_blocks,
        ranks_in_one_worker,
        needs_side_channel: _,
        needs_data_plane_secret: _,
        needs_shared_memory_kv: _,
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
        (*state_with_tp, "state_with_tp"),
        (*adapts_with_tp, "adapts_with_tp"),
        (*adapts_with_state, "adapts_with_state"),
        (*stores_opaque_blocks, "stores_opaque_blocks"),
        (*ranks_in_one_worker, "ranks_in_one_worker"),
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
/// plain config and the settings that turn on config-dependent claims, and for nixl each
/// backend (named, so its claims are audited per backend). pd is audited over the composites
/// the examples and tests run.
fn configurations(tmp: &std::path::Path) -> Vec<(&'static str, Option<&'static str>, String)> {
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
    let backend = |b: &str| {
        format!(r#"{{"kv_connector":"NixlConnector","kv_connector_extra_config":{{"backend":"{b}"}}}}"#)
    };
    vec![
        // shm is the default backend.
        ("nixl", Some("shm"), nixl.to_owned()),
        ("nixl", Some("shm"), backend("shm")),
        ("nixl", Some("tcp"), backend("tcp")),
        ("nixl", Some("nixl"), backend("nixl")),
        (
            "nixl",
            Some("nixl"),
            r#"{"kv_connector":"NixlConnector","kv_connector_extra_config":{"backends":["UCX"]}}"#.to_owned(),
        ),
        ("nixl", Some("cuda_ipc"), backend("cuda_ipc")),
        ("lmcache", None, lmcache.to_owned()),
        ("lmcache", None, lmcache_all.clone()),
        ("flexkv", None, flexkv.to_owned()),
        ("flexkv", None, flexkv_all),
        ("pd", None, pd(&[lmcache, nixl])),
        ("pd", None, pd(&[flexkv, nixl])),
        ("pd", None, pd(&[&lmcache_all, nixl])),
    ]
}

/// A connector and, for one audited per backend, the backend.
type Variant = (&'static str, Option<&'static str>);

/// Every claim each built-in declares (per backend for nixl), over every configuration and
/// fixture model.
fn declared() -> BTreeMap<Variant, BTreeSet<String>> {
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
    let mut out: BTreeMap<Variant, BTreeSet<String>> = BTreeMap::new();
    for (name, backend, json) in configurations(tmp.path()) {
        let config = KvTransferConfig::from_json(&json).unwrap();
        let factory = registry.resolve(&config).unwrap();
        assert_eq!(factory.info().name, name, "{json} resolves to another connector");
        for model in [None].into_iter().chain(models.iter().map(Some)) {
            let caps = factory
                .capabilities(&config, model)
                .unwrap_or_else(|e| panic!("{name} {json} on {:?}: {e}", model.map(|m| &m.name)));
            out.entry((name, backend)).or_default().extend(claims_of(&caps));
        }
    }
    out
}

/// What the table lacks and what it promises in vain, against `declared`.
fn audit(declared: &BTreeMap<Variant, BTreeSet<String>>, claims: &[Claim]) -> (Vec<String>, Vec<String>) {
    let show = |(c, b): &Variant| match b {
        Some(b) => format!("{c} (backend {b})"),
        None => (*c).to_owned(),
    };
    let mut missing = Vec::new();
    for (variant, declares) in declared {
        for c in declares {
            // A claim of one backend is kept by a test of that backend, or by one test when
            // every backend of the connector declares it.
            let covered = claims.iter().any(|e| {
                e.connector == variant.0 && e.claim == c && (e.backend.is_none() || e.backend == variant.1)
            });
            if !covered {
                missing.push(format!("{} declares {c}", show(variant)));
            }
        }
    }
    let mut stale = Vec::new();
    for e in claims {
        // A claim only some builds make is checked where it is declared.
        if e.only_with.is_some() {
            continue;
        }
        let variants: Vec<(&Variant, &BTreeSet<String>)> = declared
            .iter()
            .filter(|((c, b), _)| *c == e.connector && (e.backend.is_none() || *b == e.backend))
            .collect();
        let kept = !variants.is_empty() && variants.iter().all(|(_, d)| d.contains(e.claim));
        if !kept {
            let not: Vec<String> =
                variants.iter().filter(|(_, d)| !d.contains(e.claim)).map(|(v, _)| show(v)).collect();
            stale.push(format!(
                "{} {} ({}): not declared by {}",
                e.backend.map_or(e.connector.to_owned(), |b| format!("{} (backend {b})", e.connector)),
                e.claim,
                e.test,
                if not.is_empty() { "any configuration".to_owned() } else { not.join(", ") }
            ));
        }
    }
    (missing, stale)
}

#[test]
fn every_declared_claim_names_the_test_that_exercises_it() {
    let declared = declared();
    let connectors: BTreeSet<&str> = declared.keys().map(|(c, _)| *c).collect();
    assert_eq!(connectors.into_iter().collect::<Vec<_>>(), ["flexkv", "lmcache", "nixl", "pd"]);
    let backends: Vec<_> = declared.keys().filter(|(c, _)| *c == "nixl").map(|(_, b)| *b).collect();
    assert_eq!(backends, [Some("cuda_ipc"), Some("nixl"), Some("shm"), Some("tcp")]);
    let (missing, stale) = audit(&declared, CLAIMS);
    assert!(
        missing.is_empty(),
        "claims without a test (name the test that exercises each in CLAIMS, per backend where only some backends declare it, or declare it false): {missing:#?}"
    );
    assert!(stale.is_empty(), "CLAIMS lists claims the connectors no longer declare: {stale:#?}");
}

#[test]
fn claims_that_depend_on_the_backend_are_audited_per_backend() {
    let declared = declared();
    let nixl = |b| &declared[&("nixl", Some(b))];
    // What this build's nixl declares on each backend: state and TP across sizes on the
    // paths that move them, memory kinds as each backend's copies reach them, and no
    // adaptation combined with TP or state anywhere.
    for b in ["shm", "tcp"] {
        assert!(nixl(b).contains("carries_state") && nixl(b).contains("heterogeneous_tp"), "{b}");
        assert!(nixl(b).contains("ranks_in_one_worker"), "{b}");
        assert!(nixl(b).contains("memory:host") && !nixl(b).contains("memory:device"), "{b}");
    }
    for b in ["nixl", "cuda_ipc"] {
        assert!(!nixl(b).contains("carries_state") && !nixl(b).contains("heterogeneous_tp"), "{b}");
        assert!(!nixl(b).contains("ranks_in_one_worker"), "{b}");
    }
    assert!(!nixl("cuda_ipc").contains("memory:host"));
    for (v, d) in &declared {
        for c in ["state_with_tp", "adapts_with_tp", "adapts_with_state"] {
            assert!(!d.contains(c), "{v:?} declares {c}");
        }
    }
    // A claim of shm and tcp kept by a test of one of them only is missing for the other.
    let one_test: Vec<Claim> = CLAIMS
        .iter()
        .filter(|e| !(e.claim == "carries_state" && e.backend == Some("tcp")))
        .copied()
        .collect();
    let (missing, _) = audit(&declared, &one_test);
    assert_eq!(missing, ["nixl (backend tcp) declares carries_state"]);
    // One entry for every backend, for a claim only some declare, is promised in vain.
    let mut blanket: Vec<Claim> = CLAIMS.to_vec();
    blanket.push(claim("nixl", "carries_state", "tests/tests/pd_determinism.rs::hybrid_model_shm_hma_on"));
    let (_, stale) = audit(&declared, &blanket);
    assert_eq!(stale.len(), 1, "{stale:#?}");
    assert!(stale[0].contains("not declared by nixl (backend cuda_ipc), nixl (backend nixl)"), "{stale:#?}");
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
