//! Plugin logs reach the host's tracing subscriber through the log callback.

#![allow(unsafe_code)] // Tests vouch for their own KV buffers as regions (KvRegion::new).

use kvconnect_api::KvTransferConfig;
use kvconnect_registry::{Registry, RegistryConfig};
use kvconnect_tests::plugin_fixtures;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn plugin_events_appear_in_the_host_subscriber() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::registry().with(
        tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO),
    );
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let lib = plugin_fixtures::example_plugin(Path::new(env!("CARGO_TARGET_TMPDIR")));
    let r = Registry::load(&RegistryConfig { plugin_dirs: vec![lib], use_env: false, allow_insecure: false });
    let f = r.find("example").unwrap().factory;
    assert!(f.capabilities(&KvTransferConfig::named("example"), None).is_ok());

    // A load of an entry that is not there: the plugin logs a warning and reports the blocks.
    let dir = tempfile::tempdir().unwrap();
    let mut config = KvTransferConfig::named("example");
    config.kv_connector_extra_config.insert("dir".into(), dir.path().to_string_lossy().into_owned().into());
    let ctx = kvconnect_api::ConnectorContext {
        config,
        model: kvconnect_api::ModelSpec {
            name: "m".into(),
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 8,
            dtype: None,
            layers: vec![kvconnect_api::AttentionKind::Full],
            state: None,
        },
        effective: kvconnect_api::EffectiveLayout {
            layout: kvconnect_api::KvLayout::NHD,
            hma: false,
            block_size: 4,
            cache_dtype: kvconnect_api::Dtype::F16,
            memory: kvconnect_api::MemoryKind::Host,
            transfer_mode: kvconnect_api::TransferMode::None,
            groups: vec![],
            state_groups: vec![],
            opaque_blocks: false,
        },
        role: kvconnect_api::KvRole::Both,
        engine_id: "e".into(),
        tp_rank: 0,
        tp_size: 1,
    };
    // Declared before the worker, so it is dropped after it.
    let mut region = vec![0u8; 4 * 2 * 4 * 8 * 2];
    let mut w = f.create_worker(&ctx).unwrap();
    // SAFETY: `region` outlives the worker and nothing else touches it meanwhile.
    w.register_kv_caches(&[unsafe {
        kvconnect_api::KvRegion::new(kvconnect_api::KvRegionSpec::host(
            "l0",
            &mut region,
            vec![kvconnect_api::LayerId(0)],
            0,
            4,
        ))
    }])
    .unwrap();
    let meta =
        serde_json::json!({"loads": [{"key": "0000000000000bad", "first": 0, "blocks": [2]}], "saves": []});
    w.bind_connector_meta(meta.to_string().as_bytes()).unwrap();
    w.start_load_kv().unwrap();
    assert_eq!(w.block_ids_with_load_errors().unwrap(), vec![kvconnect_api::BlockId(2)]);

    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("load failed"))
        .unwrap_or_else(|| panic!("no plugin log line in:\n{text}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("plugin=example"), "{line}");
    assert!(line.contains("kvconnect_plugin_example::worker"), "the plugin's module is kept: {line}");
    assert!(line.contains("key=0000000000000bad"), "fields are kept: {line}");
}
