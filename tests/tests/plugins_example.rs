//! The example plugin through the real dynamic path: built as a cdylib, loaded by the host's
//! loader, driven through the C ABI; and the same scenario in-process, to show the host cannot
//! tell the two apart.

use kvconnect_api::{BlockId, ConnectorFactory, KvTransferConfig, LayerId};
use kvconnect_registry::{Origin, Registry, RegistryConfig};
use kvconnect_tests::plugin_fixtures;
use kvconnect_tests::round_trip::{ctx, model, store_then_load, Engine, NUM_BLOCKS};
use std::path::Path;

fn registry_with_example() -> (Registry, std::path::PathBuf) {
    let lib = plugin_fixtures::example_plugin(Path::new(env!("CARGO_TARGET_TMPDIR")));
    let r = Registry::load(&RegistryConfig {
        plugin_dirs: vec![lib.clone()],
        use_env: false,
        allow_insecure: false,
    });
    assert_eq!(r.load_errors(), &[], "the example plugin must load");
    (r, lib)
}

#[test]
fn example_plugin_stores_and_loads_blocks_through_the_c_abi() {
    let (r, lib) = registry_with_example();
    let e = r.find("example").unwrap();
    assert_eq!(e.origin, Origin::Dynamic);
    assert_eq!(e.path.as_deref(), Some(lib.as_path()));
    assert_eq!(e.abi.as_deref(), Some("1.3"));
    store_then_load(e.factory.as_ref(), tempfile::tempdir().unwrap().path());
}

#[test]
fn example_in_process_behaves_the_same() {
    store_then_load(&kvconnect_plugin_example::ExampleFactory::new(), tempfile::tempdir().unwrap().path());
}

#[test]
fn plugin_capabilities_and_errors_cross_intact() {
    let (r, lib) = registry_with_example();
    let by_path = r.find(&lib.to_string_lossy()).unwrap();
    let dynamic = by_path.factory.capabilities(&KvTransferConfig::named("example"), Some(&model())).unwrap();
    let native = kvconnect_plugin_example::ExampleFactory::new()
        .capabilities(&KvTransferConfig::named("example"), Some(&model()))
        .unwrap();
    assert_eq!(dynamic, native);
    assert_eq!(by_path.factory.info().name, "example");

    // A config error made inside the plugin arrives as the same ConnectorError.
    let mut c = ctx(Path::new("/unused"));
    c.config.kv_connector_extra_config.clear();
    let err = by_path.factory.create_worker(&c).err().unwrap();
    let native_err = kvconnect_plugin_example::ExampleFactory::new().create_worker(&c).err().unwrap();
    assert_eq!(err, native_err);
    assert!(err.to_string().contains("set kv_connector_extra_config.dir"), "{err}");

    // Calls out of order are errors, not crashes.
    let dir = tempfile::tempdir().unwrap();
    let mut w = by_path.factory.create_worker(&ctx(dir.path())).unwrap();
    let e = w.save_kv_layer(LayerId(0), &[BlockId(1)]).unwrap_err();
    assert!(e.to_string().contains("register_kv_caches first"), "{e}");
    let mut eng = Engine::new(|_, _| 0);
    w.register_kv_caches(&eng.regions()).unwrap();
    let e = w.save_kv_layer(LayerId(0), &[BlockId(NUM_BLOCKS)]).unwrap_err();
    assert!(e.to_string().contains("out of range"), "{e}");
    assert!(w.bind_connector_meta(b"not json").is_err());
}

#[test]
fn module_path_selects_the_plugin_by_path_or_name() {
    let (r, lib) = registry_with_example();
    let mut c = KvTransferConfig::named("SomethingElse");
    c.kv_connector_module_path = Some(lib.to_string_lossy().into_owned());
    assert_eq!(r.find_for_config(&c).unwrap().name, "example");
    c.kv_connector_module_path = Some("example".into());
    assert_eq!(r.find_for_config(&c).unwrap().origin, Origin::Dynamic);
    assert!(r.names().contains(&"example".to_owned()));
}
