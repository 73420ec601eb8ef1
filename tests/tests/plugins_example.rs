//! The example plugin through the real dynamic path: built as a cdylib, loaded by the host's
//! loader, driven through the C ABI; and the same scenario in-process, to show the host cannot
//! tell the two apart.

use kvconnect_api::{
    AttentionKind, BlockId, BlocksPerGroup, ConnectorContext, ConnectorFactory, Dtype, EffectiveLayout,
    KvGroup, KvLayout, KvRegion, KvRegionSpec, KvRole, KvTransferConfig, LayerId, MatchResult, MemoryKind,
    ModelSpec, Request, RequestId, StepInfo, TransferMode,
};
use kvconnect_host::registry::{Origin, Registry, RegistryConfig};
use kvconnect_tests::plugin_fixtures;
use std::path::Path;

const LAYERS: u32 = 2;
const NUM_BLOCKS: u32 = 8;

fn model() -> ModelSpec {
    ModelSpec {
        name: "tiny".into(),
        num_layers: LAYERS,
        num_kv_heads: 2,
        head_dim: 4,
        dtype: Some(Dtype::F16),
        layers: vec![AttentionKind::Full; LAYERS as usize],
        state: None,
    }
}

fn ctx(dir: &Path) -> ConnectorContext {
    let mut config = KvTransferConfig::named("example");
    config.kv_connector_extra_config.insert("dir".into(), dir.to_string_lossy().into_owned().into());
    ConnectorContext {
        config,
        model: model(),
        effective: EffectiveLayout {
            layout: KvLayout::NHD,
            hma: false,
            block_size: 4,
            cache_dtype: Dtype::F16,
            memory: MemoryKind::Host,
            transfer_mode: TransferMode::None,
            groups: vec![KvGroup { kind: AttentionKind::Full, layers: (0..LAYERS).map(LayerId).collect() }],
            state_groups: vec![],
            opaque_blocks: false,
        },
        role: KvRole::Both,
        engine_id: "e0".into(),
        tp_rank: 0,
        tp_size: 1,
    }
}

/// Per-layer KV regions: 8 blocks of 2 heads x 4 tokens x 4 channels x 2 bytes, K and V.
struct Engine {
    bufs: Vec<Vec<u8>>,
}

const PART: usize = 2 * 4 * 4 * 2;

impl Engine {
    fn new(fill: impl Fn(usize, usize) -> u8) -> Engine {
        let len = NUM_BLOCKS as usize * 2 * PART;
        Engine { bufs: (0..LAYERS as usize).map(|l| (0..len).map(|i| fill(l, i)).collect()).collect() }
    }

    fn regions(&mut self) -> Vec<KvRegion> {
        KvRegionSpec::per_layer(&mut self.bufs, NUM_BLOCKS)
            .into_iter()
            // SAFETY: the buffers belong to this Engine, which outlives every worker a test
            // registers them with, and are read only between worker calls.
            .map(|spec| unsafe { KvRegion::new(spec) })
            .collect()
    }

    /// K then V of one block of one layer ([L][KV][B][N][H][C] per-layer regions).
    fn block(&self, layer: usize, block: u32) -> Vec<u8> {
        let b = block as usize;
        let nb = NUM_BLOCKS as usize;
        let mut v = self.bufs[layer][b * PART..(b + 1) * PART].to_vec();
        v.extend_from_slice(&self.bufs[layer][(nb + b) * PART..(nb + b + 1) * PART]);
        v
    }
}

fn request(tokens: usize) -> Request {
    Request {
        id: RequestId::from("r1"),
        prompt_tokens: (0..tokens as u32).map(|t| t * 7 + 3).collect(),
        kv_transfer_params: Default::default(),
    }
}

/// One step of one request: lookup, allocate, bind, load, save every layer, wait.
fn step(
    f: &dyn ConnectorFactory,
    dir: &Path,
    engine: &mut Engine,
    req: &Request,
    num_computed: usize,
    blocks: &[u32],
) -> MatchResult {
    let mut sched = f.create_scheduler(&ctx(dir)).unwrap();
    let mut worker = f.create_worker(&ctx(dir)).unwrap();
    worker.register_kv_caches(&engine.regions()).unwrap();
    let m = sched.get_num_new_matched_tokens(req, num_computed).unwrap();
    let ext = match m {
        MatchResult::Matched { tokens, .. } => tokens,
        MatchResult::Pending => 0,
    };
    let table = BlocksPerGroup(vec![blocks.iter().map(|b| BlockId(*b)).collect()]);
    sched.update_state_after_alloc(req, &table, ext).unwrap();
    let meta = sched
        .build_connector_meta(&StepInfo { step: 1, scheduled: vec![req.id.clone()], finished: vec![] })
        .unwrap();
    worker.bind_connector_meta(&meta).unwrap();
    worker.start_load_kv().unwrap();
    for l in 0..LAYERS {
        worker.wait_for_layer_load(LayerId(l)).unwrap();
        worker.save_kv_layer(LayerId(l), &table.0[0]).unwrap();
    }
    worker.wait_for_save().unwrap();
    assert_eq!(worker.block_ids_with_load_errors().unwrap(), vec![]);
    assert_eq!(worker.get_finished(std::slice::from_ref(&req.id)).unwrap(), Default::default());
    sched.request_finished(req, &table).unwrap();
    worker.shutdown().unwrap();
    m
}

/// Stores a prompt's blocks from one engine, loads them into another engine's different
/// blocks, and checks the bytes.
fn store_then_load(f: &dyn ConnectorFactory) {
    let dir = tempfile::tempdir().unwrap();
    let req = request(9); // 8 cacheable tokens = 2 blocks of 4
    let mut a = Engine::new(|l, i| (l * 31 + i * 13 % 251) as u8 ^ 0x5a);
    assert_eq!(
        step(f, dir.path(), &mut a, &req, 0, &[3, 5, 6]),
        MatchResult::Matched { tokens: 0, async_load: false }
    );

    let mut b = Engine::new(|_, _| 0);
    assert_eq!(
        step(f, dir.path(), &mut b, &req, 0, &[1, 2, 7]),
        MatchResult::Matched { tokens: 8, async_load: false }
    );
    for l in 0..LAYERS as usize {
        assert_eq!(b.block(l, 1), a.block(l, 3), "layer {l} block 0");
        assert_eq!(b.block(l, 2), a.block(l, 5), "layer {l} block 1");
        assert!(b.block(l, 7).iter().all(|x| *x == 0), "the block past the cached prefix is untouched");
    }

    // Four tokens already computed: only the second block comes from the store.
    let mut c = Engine::new(|_, _| 0);
    assert_eq!(
        step(f, dir.path(), &mut c, &req, 4, &[4, 0, 2]),
        MatchResult::Matched { tokens: 4, async_load: false }
    );
    for l in 0..LAYERS as usize {
        assert!(c.block(l, 4).iter().all(|x| *x == 0), "the computed block is not overwritten");
        assert_eq!(c.block(l, 0), a.block(l, 5));
    }

    // Another prompt misses.
    let mut d = Engine::new(|_, _| 0);
    let other = Request { prompt_tokens: vec![1; 9], ..request(9) };
    assert_eq!(
        step(f, dir.path(), &mut d, &other, 0, &[0, 1, 2]),
        MatchResult::Matched { tokens: 0, async_load: false }
    );
}

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
    assert_eq!(e.abi.as_deref(), Some("1.1"));
    store_then_load(e.factory.as_ref());
}

#[test]
fn example_in_process_behaves_the_same() {
    store_then_load(&kvconnect_plugin_example::ExampleFactory::new());
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
