//! The same lmcache cache used in-process and through the dynamically loaded plugin: chunks
//! one side saves, the other loads byte for byte (through a shared `local_disk`, since the
//! plugin library has its own copy of the connector and its in-memory stores).

#[path = "../../../connectors/lmcache/tests/common/mod.rs"]
mod common;

use common::*;
use kvconnect_api::{ConnectorFactory, KvLayout};
use kvconnect_lmcache::LmcacheFactory;
use kvconnect_registry::loader::{load_plugin, LoaderOptions};
use serde_json::json;
use std::path::PathBuf;

const CHUNK: usize = 16;

/// The cdylib cargo built for this package before running its tests.
fn plugin_path() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let name =
        format!("{}kvconnect_plugin_lmcache{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    for dir in [deps, deps.parent().unwrap()] {
        let p = dir.join(&name);
        if p.exists() {
            return p;
        }
    }
    panic!(
        "{name} not found next to {}: run through `cargo test -p kvconnect-plugin-lmcache`",
        exe.display()
    );
}

#[test]
fn one_cache_through_the_plugin_and_in_process() {
    let plugin = load_plugin(&plugin_path(), &LoaderOptions::default()).unwrap();
    assert_eq!(plugin.library.name(), "lmcache");
    let foreign: &dyn ConnectorFactory = &*plugin.factory;
    assert_eq!(foreign.info(), LmcacheFactory.info());

    let dir = tempfile::tempdir().unwrap();
    let extra = json!({
        "chunk_size": CHUNK,
        "local_cpu": false,
        "local_disk": format!("file://{}", dir.path().display()),
        "max_local_disk_size": 0.01,
    });
    let c = ctx("same-cache", KvLayout::HND, 8, extra.clone());
    assert_eq!(
        foreign.capabilities(&c.config, Some(&c.model)).unwrap(),
        LmcacheFactory.capabilities(&c.config, Some(&c.model)).unwrap()
    );

    let a = prompt(1, 2 * CHUNK + 3);
    let b = prompt(2, 3 * CHUNK + 1);
    {
        let mut inproc = Engine::new("same-cache", KvLayout::HND, 8, extra.clone());
        assert_eq!(inproc.run("a", &a, 0).0, 0);
    } // the store closes and finishes its disk writes

    {
        let mut dynamic = Engine::with_factory(foreign, "same-cache", KvLayout::HND, 8, extra.clone());
        let (m, blocks, errs) = dynamic.load_only("a2", &a);
        assert_eq!(m, 2 * CHUNK, "the plugin hits what the in-process connector saved");
        assert!(errs.is_empty());
        assert!(dynamic.mismatches(&a, &blocks, 0, m).is_empty(), "byte for byte");
        assert_eq!(dynamic.run("b", &b, 0).0, 0);
        // The plugin's own store, which this process's `kvconnect_lmcache::stats` cannot see,
        // reports through the ABI's `metrics` entries as the built-in does.
        let m = dynamic.sched.metrics().unwrap();
        let disk_hits = m
            .iter()
            .find(|m| m.name == "kvconnect_cache_hits" && m.labels.contains(&("tier".into(), "disk".into())))
            .map(|m| m.value);
        assert_eq!(disk_hits, Some(2), "{m:?}");
        assert!(m.iter().all(|m| m.check().is_ok()), "{m:?}");
        assert_eq!(
            dynamic.worker.metrics().unwrap(),
            vec![],
            "lmcache's worker half counts nothing of its own"
        );
        dynamic.worker.shutdown().unwrap();
    }

    let mut inproc = Engine::new("same-cache", KvLayout::HND, 8, extra);
    let (m, blocks, errs) = inproc.load_only("b2", &b);
    assert_eq!(m, 3 * CHUNK, "and the other way round");
    assert!(errs.is_empty());
    assert!(inproc.mismatches(&b, &blocks, 0, m).is_empty());
    let s = kvconnect_lmcache::stats("same-cache").unwrap();
    assert_eq!((s.disk.hits, s.misses), (3, 0));
}
