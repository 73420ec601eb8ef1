//! Bad plugins, each built as a real shared library and loaded through the host's loader:
//! every one is refused with one line naming the file, what is wrong and what to do, and the
//! host goes on loading the rest. A plugin whose method panics loads, and only the instance
//! that panicked is poisoned.

use kvconnect_api::{
    BlockId, ConnectorContext, ConnectorError, Dtype, EffectiveLayout, KvRole, KvTransferConfig, LayerId,
    MemoryKind, ModelSpec, TransferMode,
};
use kvconnect_registry::loader::{load_plugin, LoadError, LoaderOptions};
use kvconnect_registry::{Registry, RegistryConfig};
use kvconnect_tests::plugin_fixtures::{self, broken_plugin, copy_with_mode, DEFECTS};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn tmp() -> &'static Path {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
}

/// The fixtures' directory, each defect's library, and the example plugin.
type Fixtures = (tempfile::TempDir, Vec<(String, PathBuf)>, PathBuf);

/// Every fixture library, built once per test binary.
fn fixtures() -> &'static Fixtures {
    static F: OnceLock<Fixtures> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let libs = DEFECTS.iter().map(|d| ((*d).to_owned(), broken_plugin(tmp(), d, dir.path()))).collect();
        let example = plugin_fixtures::example_plugin(tmp());
        (dir, libs, example)
    })
}

fn lib(defect: &str) -> PathBuf {
    fixtures().1.iter().find(|(d, _)| d == defect).map(|(_, p)| p.clone()).unwrap()
}

fn refuse(path: &Path) -> String {
    let e = match load_plugin(path, &LoaderOptions::default()) {
        Ok(_) => panic!("{} loaded but must be refused", path.display()),
        Err(e) => e,
    };
    let line = e.to_string();
    assert!(!line.contains('\n'), "one line: {line}");
    assert!(line.contains(&path.display().to_string()), "names the file: {line}");
    println!("{line}");
    line
}

#[test]
fn not_a_shared_library() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("libnotes.so");
    std::fs::write(&p, "these are notes, not a library\n").unwrap();
    let line = refuse(&p);
    assert!(line.contains("not a loadable shared library"), "{line}");
    assert!(line.contains("export_connector!"), "says what to do: {line}");
}

#[test]
fn library_without_the_entry_symbol() {
    let line = refuse(&lib("no_entry"));
    assert!(line.contains("has no `kvconnect_plugin_entry` symbol"), "{line}");
}

#[test]
fn wrong_magic() {
    let line = refuse(&lib("wrong_magic"));
    assert!(line.contains("0x0123456789abcdef") && line.contains("not kvconnect's magic"), "{line}");
    assert!(line.contains("rebuild it against kvconnect-api"), "{line}");
}

#[test]
fn another_abi_major() {
    let line = refuse(&lib("abi_major"));
    assert!(
        line.contains("built for kvconnect ABI 2.x (kvconnect-api 0.1.0), this host speaks 1.x"),
        "{line}"
    );
    assert!(line.contains("rebuild it against kvconnect-api 0.1.0"), "{line}");
}

#[test]
fn struct_too_short_for_a_call_the_host_makes() {
    let line = refuse(&lib("short_vtable"));
    assert!(line.contains("its worker vtable is"), "{line}");
    assert!(line.contains("this host calls entries up to byte"), "{line}");
    assert!(line.contains("plugin built for ABI 1.3"), "{line}");
}

#[test]
fn struct_too_short_for_the_minor_the_plugin_declares() {
    let line = refuse(&lib("minor_without_entry"));
    assert!(line.contains("declares ABI 1.3 but its factory vtable is"), "{line}");
    assert!(line.contains("so it was built from mismatched definitions"), "{line}");
    assert!(line.contains("rebuild it against kvconnect-api"), "{line}");
}

#[test]
fn layout_fingerprint_mismatch() {
    let line = refuse(&lib("bad_fingerprint"));
    assert!(line.contains("ABI layout fingerprint"), "{line}");
    assert!(line.contains(&format!("{:#018x}", kvconnect_api::abi::LAYOUT_FINGERPRINT)), "{line}");
}

#[test]
fn factory_that_panics() {
    let line = refuse(&lib("factory_panics"));
    assert!(line.contains("its factory failed"), "{line}");
    assert!(line.contains("panicked on purpose"), "{line}");
}

#[test]
fn invalid_capabilities() {
    let line = refuse(&lib("invalid_caps"));
    assert!(
        line.contains("declares invalid capabilities: layout HND (LBHNC) is both required and rejected"),
        "{line}"
    );
}

#[test]
fn world_writable_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = copy_with_mode(&fixtures().2, dir.path(), "libexample_insecure.so", 0o666);
    let line = refuse(&p);
    assert!(line.contains("world-writable") && line.contains("--allow-insecure-plugins"), "{line}");
    // The flag lets it through.
    let ok = load_plugin(&p, &LoaderOptions { allow_insecure: true }).unwrap();
    assert_eq!(ok.library.name(), "example");
}

fn worker_ctx() -> ConnectorContext {
    ConnectorContext {
        config: KvTransferConfig::named("broken"),
        model: ModelSpec {
            name: "m".into(),
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 8,
            dtype: None,
            layers: vec![kvconnect_api::AttentionKind::Full; 2],
            state: None,
        },
        effective: EffectiveLayout {
            layout: kvconnect_api::KvLayout::NHD,
            hma: false,
            block_size: 16,
            cache_dtype: Dtype::F16,
            memory: MemoryKind::Host,
            transfer_mode: TransferMode::None,
            groups: vec![],
            state_groups: vec![],
            opaque_blocks: false,
        },
        role: KvRole::Both,
        engine_id: "e".into(),
        tp_rank: 0,
        tp_size: 1,
    }
}

#[test]
fn a_newer_minor_is_accepted() {
    let p = load_plugin(&lib("newer_minor"), &LoaderOptions::default()).unwrap();
    assert_eq!(
        p.library.abi_version(),
        format!("{}.{}", kvconnect_api::abi::ABI_MAJOR, kvconnect_api::abi::ABI_MINOR + 1)
    );
    assert_eq!(p.library.name(), "broken");
    // Its worker vtable is longer than this host's; the host calls only the entries it knows.
    let mut w = kvconnect_api::ConnectorFactory::create_worker(p.factory.as_ref(), &worker_ctx()).unwrap();
    w.save_kv_layer(LayerId(0), &[BlockId(1)]).unwrap();
    assert_eq!(w.handshake_metadata().unwrap(), Some(serde_json::json!(1)));
    w.shutdown().unwrap();
}

#[test]
fn method_that_panics_poisons_only_its_instance() {
    let p = load_plugin(&lib("method_panics"), &LoaderOptions::default()).unwrap();
    let f = p.factory.clone();
    let mut w = kvconnect_api::ConnectorFactory::create_worker(f.as_ref(), &worker_ctx()).unwrap();
    let mut other = kvconnect_api::ConnectorFactory::create_worker(f.as_ref(), &worker_ctx()).unwrap();
    w.save_kv_layer(LayerId(0), &[BlockId(1)]).unwrap();
    let e = w.save_kv_layer(LayerId(1), &[BlockId(1), BlockId(2)]).unwrap_err();
    assert!(
        matches!(&e, ConnectorError::Panicked { method, message, .. }
            if method == "save_kv_layer" && message.contains("panicked on purpose (layer 1, 2 blocks)")),
        "{e:?}"
    );
    // The next call on the same instance is refused, whatever it is.
    let e = w.wait_for_save().unwrap_err();
    assert!(
        matches!(&e, ConnectorError::Poisoned { message, .. } if message.contains("in save_kv_layer")),
        "{e:?}"
    );
    assert!(e.to_string().contains("recreate it"), "{e}");
    assert!(matches!(w.save_kv_layer(LayerId(0), &[]), Err(ConnectorError::Poisoned { .. })));
    // The host, the factory and other instances carry on.
    other.save_kv_layer(LayerId(0), &[BlockId(3)]).unwrap();
    assert_eq!(other.handshake_metadata().unwrap(), Some(serde_json::json!(1)));
    let mut fresh = kvconnect_api::ConnectorFactory::create_worker(f.as_ref(), &worker_ctx()).unwrap();
    fresh.wait_for_save().unwrap();
}

#[test]
fn a_directory_of_broken_plugins_still_loads_the_good_one() {
    let dir = tempfile::tempdir().unwrap();
    let (_, libs, example) = fixtures();
    let mut broken = Vec::new();
    for (defect, p) in libs {
        if defect == "newer_minor" {
            // Also named "broken": it would be refused as a duplicate of method_panics.
            continue;
        }
        let dst = copy_with_mode(p, dir.path(), &format!("libbroken_{defect}.so"), 0o755);
        if defect != "method_panics" {
            broken.push(dst);
        }
    }
    copy_with_mode(example, dir.path(), "libexample.so", 0o755);
    broken.push(copy_with_mode(example, dir.path(), "libexample_world_writable.so", 0o666));
    let notes = dir.path().join("libnotes.so");
    std::fs::write(&notes, "not a library").unwrap();
    broken.push(notes);
    // Not a library name: ignored, not an error.
    std::fs::write(dir.path().join("README.txt"), "plugins live here").unwrap();

    let r = Registry::load(&RegistryConfig {
        plugin_dirs: vec![dir.path().to_path_buf()],
        use_env: false,
        allow_insecure: false,
    });
    let names: Vec<String> = r.entries().iter().map(|e| e.name.clone()).collect();
    assert!(names.contains(&"example".to_owned()), "{names:?}");
    assert!(names.contains(&"broken".to_owned()), "the method_panics plugin loads: {names:?}");
    let errors: Vec<&LoadError> = r.load_errors().iter().collect();
    assert_eq!(errors.len(), broken.len(), "one error per broken plugin: {errors:#?}");
    for b in &broken {
        let shown = b.display().to_string();
        let matching: Vec<_> = errors.iter().filter(|e| e.path() == shown).collect();
        assert_eq!(matching.len(), 1, "exactly one line for {shown}: {errors:#?}");
        assert!(!matching[0].to_string().contains('\n'));
    }
}
