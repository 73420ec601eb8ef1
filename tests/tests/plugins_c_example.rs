//! The C example plugin (`plugins/c-example`), written against `kvconnect.h` alone: compiled
//! with the system C compiler, loaded by the host's loader, and put through the same round
//! trip as the Rust example plugin. A C plugin built for another ABI major is refused with a
//! message naming header versions, not kvconnect-api's.

use kvconnect_api::{abi, BlockId, KvTransferConfig, LayerId, TransferMode};
use kvconnect_registry::{Origin, Registry, RegistryConfig};
use kvconnect_tests::round_trip::{ctx, model, store_then_load, Engine, NUM_BLOCKS};
use kvconnect_tests::{plugin_fixtures, run_kvconnect, text};
use std::path::Path;

fn load(lib: &Path) -> Registry {
    Registry::load(&RegistryConfig {
        plugin_dirs: vec![lib.to_path_buf()],
        use_env: false,
        allow_insecure: false,
    })
}

#[test]
fn c_plugin_stores_and_loads_blocks_through_the_c_abi() {
    let out = tempfile::tempdir().unwrap();
    let lib = plugin_fixtures::c_example_plugin(out.path(), "", &[]);
    let r = load(&lib);
    assert_eq!(r.load_errors(), &[], "the C example plugin must load");
    let e = r.find("c-example").unwrap();
    assert_eq!(e.origin, Origin::Dynamic);
    assert_eq!(e.abi.as_deref(), Some(&*format!("{}.{}", abi::ABI_MAJOR, abi::ABI_MINOR)));
    let f = e.factory.as_ref();
    assert_eq!(f.info().name, "c-example");
    let caps = f.capabilities(&KvTransferConfig::named("c-example"), Some(&model())).unwrap();
    assert_eq!(caps.transfer_mode, TransferMode::None);
    // No child_capabilities entry: the host applies the header's fallback, no children.
    assert_eq!(f.child_capabilities(&KvTransferConfig::named("c-example"), Some(&model())).unwrap(), None);
    store_then_load(f, Path::new("/unused"));
}

#[test]
fn c_plugin_errors_cross_as_connector_errors() {
    let out = tempfile::tempdir().unwrap();
    let r = load(&plugin_fixtures::c_example_plugin(out.path(), "", &[]));
    let f = r.find("c-example").unwrap().factory.clone();
    let c = ctx(Path::new("/unused"));

    let mut w = f.create_worker(&c).unwrap();
    let e = w.save_kv_layer(LayerId(0), &[BlockId(1)]).unwrap_err();
    assert!(e.to_string().contains("register_kv_caches first"), "{e}");
    let mut eng = Engine::new(|_, _| 0);
    w.register_kv_caches(&eng.regions()).unwrap();
    let e = w.save_kv_layer(LayerId(0), &[BlockId(NUM_BLOCKS)]).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "connector 'c-example': block {NUM_BLOCKS} is out of range for layer 0 ({NUM_BLOCKS} blocks)"
        )
    );
    let e = w.save_kv_layer(LayerId(9), &[BlockId(0)]).unwrap_err();
    assert!(e.to_string().contains("no registered region holds layer 9"), "{e}");
    let e = w.bind_connector_meta(b"abc").unwrap_err();
    assert!(e.to_string().contains("is not u32 words"), "{e}");
    let e = w.bind_connector_meta(&[9, 0, 0, 0]).unwrap_err();
    assert!(e.to_string().contains("claims 9 jobs"), "{e}");

    // A cross-layer layout, which the capabilities reject, is refused if a host asks anyway.
    let mut cross = c.clone();
    cross.effective.layout = kvconnect_api::KvLayout::BLNHC;
    let e = f.create_worker(&cross).err().unwrap();
    assert!(e.to_string().contains("invalid config: layout BLNHC keeps layers inside blocks"), "{e}");
}

#[test]
fn c_plugin_built_for_another_major_is_refused_naming_header_versions() {
    let out = tempfile::tempdir().unwrap();
    let lib = plugin_fixtures::c_example_plugin(out.path(), "_abi2", &["-DKVC_EXAMPLE_ABI_MAJOR=2"]);
    let r = load(&lib);
    assert!(r.find("c-example").is_err());
    let errors: Vec<String> = r.load_errors().iter().map(|e| e.to_string()).collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    let want = format!(
        "plugin {}: built for kvconnect ABI 2.x (kvconnect.h 2.{minor}), this host speaks {major}.x — rebuild it \
         against kvconnect.h {major}.{minor} (connector-api/include/kvconnect.h of kvconnect-api {})",
        lib.display(),
        env!("CARGO_PKG_VERSION"),
        major = abi::ABI_MAJOR,
        minor = abi::ABI_MINOR,
    );
    assert_eq!(errors[0], want);
    assert!(!errors[0].contains("rebuild it against kvconnect-api"), "{}", errors[0]);
}

#[test]
fn kvconnect_plugins_inspects_the_c_plugin_and_lists_the_refused_one() {
    let dir = tempfile::tempdir().unwrap();
    plugin_fixtures::c_example_plugin(dir.path(), "", &[]);
    let d = dir.path().to_string_lossy().into_owned();
    let out = run_kvconnect(&["--plugin-dir", &d, "plugins", "inspect", "c-example", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["abi"], format!("{}.{}", abi::ABI_MAJOR, abi::ABI_MINOR));
    assert_eq!(v["capabilities"]["layout"]["rejected"], serde_json::json!(["BLNHC", "BLHNC"]));
    assert!(v["children"].is_null(), "{v}");

    // With a plugin built for another major beside it, `list` shows the good one and the
    // refusal in one line naming header versions.
    plugin_fixtures::c_example_plugin(dir.path(), "_abi2", &["-DKVC_EXAMPLE_ABI_MAJOR=2"]);
    let out = run_kvconnect(&["--plugin-dir", &d, "plugins", "list"]);
    let s = text(&out.stdout) + &text(&out.stderr);
    assert!(s.lines().any(|l| l.starts_with("c-example") && l.contains("dynamic")), "{s}");
    assert!(
        s.lines().any(|l| l.contains("libc_example_abi2.so: built for kvconnect ABI 2.x (kvconnect.h 2.")
            && l.contains("rebuild it against kvconnect.h")),
        "{s}"
    );
}
