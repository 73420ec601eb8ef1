//! LMCache's own example config files (fixtures/lmcache, verbatim), given through
//! `LMCACHE_CONFIG_FILE` as an LMCache user would: each does what it asks, is mapped to what
//! kvconnect does instead, or is refused naming the kvconnect way.

use kvconnect_api::{KvRole, KvTransferConfig};
use kvconnect_lmcache::config::{resolve, resolve_all};
use kvconnect_lmcache::pd;
use kvconnect_lmcache::store::ChunkStore;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/lmcache").join(name)
}

fn env(name: &str) -> Vec<(String, String)> {
    vec![("LMCACHE_CONFIG_FILE".to_owned(), fixture(name).display().to_string())]
}

const GIB: u64 = 1 << 30;

#[test]
fn the_disk_backend_example_runs_with_the_disk_tier() {
    let r = resolve(&Default::default(), &env("disk-local.yaml")).unwrap();
    assert_eq!(r.config.chunk_size, 256);
    assert_eq!(r.config.local_disk, Some(PathBuf::from("local_disk/")), "local_device: file://local_disk/");
    assert_eq!(r.config.disk_budget_bytes(), 20 * GIB, "LMCache v0's default size");
    assert!(r.unknown_keys.is_empty(), "{:?}", r.unknown_keys);
    assert!(
        r.mapped.iter().any(|m| m.contains("local_device = file://local_disk/") && m.contains("mapped to the disk tier")),
        "{:?}",
        r.mapped
    );
    // The store opens the disk tier it names (relative paths are relative to the worker's
    // directory; here a temporary one).
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = r.config.clone();
    cfg.local_disk = cfg.local_disk.map(|p| dir.path().join(p));
    let store = ChunkStore::open(&cfg).unwrap();
    let s = store.stats();
    assert_eq!(s.disk.budget_bytes, 20 * GIB);
    assert!(dir.path().join("local_disk").is_dir());
}

#[test]
fn the_cpu_backend_examples_are_the_cpu_tier() {
    for name in ["cpu.yaml", "cpu-offload.yaml"] {
        let r = resolve(&Default::default(), &env(name)).unwrap();
        assert!(r.config.local_cpu && r.config.local_disk.is_none() && r.config.remote.is_none(), "{name}");
        assert_eq!(r.config.cpu_budget_bytes(), 5 * GIB, "{name}");
        assert!(r.unknown_keys.is_empty(), "{name}: {:?}", r.unknown_keys);
    }
    let r = resolve(&Default::default(), &env("cpu.yaml")).unwrap();
    assert!(r
        .mapped
        .iter()
        .any(|m| m.contains("local_device = cpu") && m.contains("mapped to the CPU tier")));
    assert!(r.mapped.iter().any(|m| m.starts_with("pipelined_backend")), "{:?}", r.mapped);
}

#[test]
fn the_redis_example_selects_the_remote_tier() {
    let r = resolve(&Default::default(), &env("redis.yaml")).unwrap();
    let remote = r.config.remote.clone().expect("remote_url: redis:// is the remote tier");
    assert_eq!(remote.url, "redis://localhost:65432");
    assert!(r.config.local_cpu, "local_device: cpu");
    assert!(r.mapped.iter().any(|m| m.contains("remote_serde = cachegen") && m.contains("mapped to naive")));
}

#[test]
fn the_lm_server_example_is_refused_naming_redis() {
    let e = resolve(&Default::default(), &env("centralized-lm.yaml")).unwrap_err().to_string();
    assert!(e.contains("remote_url 'lm://localhost:65432'"), "{e}");
    assert!(e.contains("centralized-lm.yaml line 3"), "the file and line: {e}");
    assert!(e.contains("redis://host:port"), "{e}");
}

#[test]
fn the_pd_prefiller_is_a_request_for_pd() {
    let e = resolve(&Default::default(), &env("pd-prefiller.yaml")).unwrap_err().to_string();
    assert!(e.contains("P/D is the nixl connector beside lmcache in a PdConnector"), "{e}");
    assert!(!e.contains("nowhere to store chunks;"), "{e}");
    assert!(e.contains("pd-prefiller.yaml line 4"), "where enable_pd came from: {e}");
    // Both kv-transfer-configs it names are ones kvconnect runs.
    let json: Vec<&str> = e.split("'{").skip(1).filter_map(|p| p.split("}'").next()).collect();
    let json: Vec<String> = json.iter().map(|j| format!("{{{j}}}")).collect();
    assert_eq!(json.len(), 2, "{e}");
    let composite = KvTransferConfig::from_json(&json[0]).unwrap();
    assert_eq!(composite.kv_connector, "PdConnector");
    assert_eq!(composite.kv_role, Some(KvRole::Producer));
    let lmcache: KvTransferConfig =
        serde_json::from_value(composite.kv_connector_extra_config["connectors"][0].clone()).unwrap();
    let child = resolve(&lmcache.kv_connector_extra_config, &env("pd-prefiller.yaml")).unwrap();
    assert!(child.config.local_cpu && child.config.save_unfull_chunk);
    assert_eq!(KvTransferConfig::from_json(&json[1]).unwrap().kv_connector, "NixlConnector");

    // A worker given LMCacheConnectorV1 with this file runs the nixl connector as producer
    // (the file keeps no chunks) and says so.
    let cfg = KvTransferConfig::named("LMCacheConnectorV1");
    let rw = pd::rewrite(&cfg, &env("pd-prefiller.yaml")).unwrap().unwrap();
    assert_eq!(rw.config.kv_connector, "NixlConnector");
    assert_eq!(rw.config.kv_role, Some(KvRole::Producer));
    assert!(rw.announcement.contains("pd_role: sender"), "{}", rw.announcement);
    // The P/D keys with no kvconnect counterpart are all accounted for.
    let all = resolve_all(&Default::default(), &env("pd-prefiller.yaml")).unwrap();
    assert!(all.unknown_keys.is_empty(), "{:?}", all.unknown_keys);
    assert_eq!(all.pd.unwrap().keys.len(), 8);
}

#[test]
fn the_pd_decoder_is_the_nixl_consumer() {
    let e = resolve(&Default::default(), &env("pd-decoder.yaml")).unwrap_err().to_string();
    assert!(e.contains("pd_role: receiver") && e.contains("decode worker"), "{e}");
    let cfg = KvTransferConfig::named("LMCacheConnectorV1");
    let rw = pd::rewrite(&cfg, &env("pd-decoder.yaml")).unwrap().unwrap();
    assert_eq!(rw.config.kv_connector, "NixlConnector");
    assert_eq!(rw.config.kv_role, Some(KvRole::Consumer));
    // With a cache tier asked for as well, decode runs lmcache beside nixl.
    let mut with_cpu = cfg.clone();
    with_cpu.kv_connector_extra_config.insert("local_cpu".into(), true.into());
    with_cpu.kv_connector_extra_config.insert("max_local_cpu_size".into(), 1.into());
    let rw = pd::rewrite(&with_cpu, &env("pd-decoder.yaml")).unwrap().unwrap();
    assert_eq!(rw.config.kv_connector, "PdConnector");
    assert_eq!(rw.config.kv_role, Some(KvRole::Consumer));
}
