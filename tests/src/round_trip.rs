//! The round trip every KV store plugin is tested with, whatever it is written in: one engine's
//! prompt is saved, then loaded into another engine's different blocks, byte for byte, through
//! a `ConnectorFactory` (a plugin loaded by the host's loader, or a connector in-process).

#![allow(unsafe_code)] // Tests vouch for their own KV buffers as regions (KvRegion::new).

use kvconnect_api::{
    AttentionKind, BlockId, BlocksPerGroup, ConnectorContext, ConnectorFactory, Dtype, EffectiveLayout,
    KvGroup, KvLayout, KvRegion, KvRegionSpec, KvRole, KvTransferConfig, LayerId, MatchResult, MemoryKind,
    ModelSpec, Request, RequestId, StepInfo, TransferMode,
};
use std::path::Path;

pub const LAYERS: u32 = 2;
pub const NUM_BLOCKS: u32 = 8;

pub fn model() -> ModelSpec {
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

pub fn ctx(dir: &Path) -> ConnectorContext {
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
pub struct Engine {
    bufs: Vec<Vec<u8>>,
}

const PART: usize = 2 * 4 * 4 * 2;

impl Engine {
    pub fn new(fill: impl Fn(usize, usize) -> u8) -> Engine {
        let len = NUM_BLOCKS as usize * 2 * PART;
        Engine { bufs: (0..LAYERS as usize).map(|l| (0..len).map(|i| fill(l, i)).collect()).collect() }
    }

    pub fn regions(&mut self) -> Vec<KvRegion> {
        KvRegionSpec::per_layer(&mut self.bufs, NUM_BLOCKS)
            .into_iter()
            // SAFETY: the buffers belong to this Engine, which outlives every worker a test
            // registers them with, and are read only between worker calls.
            .map(|spec| unsafe { KvRegion::new(spec) })
            .collect()
    }

    /// K then V of one block of one layer ([L][KV][B][N][H][C] per-layer regions).
    pub fn block(&self, layer: usize, block: u32) -> Vec<u8> {
        let b = block as usize;
        let nb = NUM_BLOCKS as usize;
        let mut v = self.bufs[layer][b * PART..(b + 1) * PART].to_vec();
        v.extend_from_slice(&self.bufs[layer][(nb + b) * PART..(nb + b + 1) * PART]);
        v
    }
}

pub fn request(tokens: usize) -> Request {
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
/// blocks, and checks the bytes. `dir` is the config's `dir`, for a plugin that stores there.
pub fn store_then_load(f: &dyn ConnectorFactory, dir: &Path) {
    let req = request(9); // 8 cacheable tokens = 2 blocks of 4
    let mut a = Engine::new(|l, i| (l * 31 + i * 13 % 251) as u8 ^ 0x5a);
    assert_eq!(
        step(f, dir, &mut a, &req, 0, &[3, 5, 6]),
        MatchResult::Matched { tokens: 0, async_load: false }
    );

    let mut b = Engine::new(|_, _| 0);
    assert_eq!(
        step(f, dir, &mut b, &req, 0, &[1, 2, 7]),
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
        step(f, dir, &mut c, &req, 4, &[4, 0, 2]),
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
        step(f, dir, &mut d, &other, 0, &[0, 1, 2]),
        MatchResult::Matched { tokens: 0, async_load: false }
    );
}
