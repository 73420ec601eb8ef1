//! A small engine for the lmcache tests: host buffers registered as regions per the
//! geometry, a block allocator, pattern "compute", and the vLLM call order.

#![allow(unsafe_code)] // A test harness that vouches for the KV buffers it owns.
#![allow(dead_code)]

use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{
    AttentionKind, BlockId, BlocksPerGroup, ConnectorContext, ConnectorFactory, Dtype, EffectiveLayout,
    KvGroup, KvLayout, KvRegion, KvRegionSpec, KvRole, KvTransferConfig, LayerId, LoadSource, MatchResult,
    MemoryKind, ModelSpec, Request, RequestId, SchedulerConnector, StepInfo, TransferMode, WorkerConnector,
};
use kvconnect_lmcache::LmcacheFactory;

pub const LAYERS: u32 = 3;
pub const HEADS: u32 = 2;
pub const HEAD_DIM: u32 = 8;
pub const NUM_BLOCKS: u32 = 512;

pub fn model() -> ModelSpec {
    ModelSpec {
        name: "lmcache-test".into(),
        num_layers: LAYERS,
        num_kv_heads: HEADS,
        head_dim: HEAD_DIM,
        dtype: Some(Dtype::F16),
        layers: vec![AttentionKind::Full; LAYERS as usize],
        state: None,
    }
}

pub fn effective(layout: KvLayout, block_size: u32) -> EffectiveLayout {
    EffectiveLayout {
        layout,
        hma: false,
        block_size,
        cache_dtype: Dtype::F16,
        memory: MemoryKind::Host,
        transfer_mode: TransferMode::None,
        groups: vec![KvGroup { kind: AttentionKind::Full, layers: (0..LAYERS).map(LayerId).collect() }],
        state_groups: vec![],
        opaque_blocks: false,
    }
}

/// An MLA model: one latent "head" per token (kv_lora_rank + rope dims), no separate V.
pub fn mla_model() -> ModelSpec {
    ModelSpec {
        name: "lmcache-test-mla".into(),
        num_layers: LAYERS,
        num_kv_heads: 1,
        head_dim: 12,
        dtype: Some(Dtype::F16),
        layers: vec![AttentionKind::Mla { kv_lora_rank: 8, qk_rope_head_dim: 4 }; LAYERS as usize],
        state: None,
    }
}

pub fn ctx(engine_id: &str, layout: KvLayout, block_size: u32, extra: serde_json::Value) -> ConnectorContext {
    ctx_for(model(), engine_id, layout, block_size, extra)
}

pub fn ctx_for(
    model: ModelSpec,
    engine_id: &str,
    layout: KvLayout,
    block_size: u32,
    extra: serde_json::Value,
) -> ConnectorContext {
    let mut config = KvTransferConfig::named("LMCacheConnectorV1");
    config.kv_connector_extra_config = extra.as_object().cloned().unwrap_or_default();
    ConnectorContext {
        config,
        model,
        effective: effective(layout, block_size),
        role: KvRole::Both,
        engine_id: engine_id.to_owned(),
        tp_rank: 0,
        tp_size: 1,
    }
}

/// Bytes of one token of one layer and K/V part, all heads, as the pattern says.
pub fn pattern(tokens: &[u32], pos: usize, layer: u32, part: u32, head: u32, ch: u32) -> [u8; 2] {
    let t = tokens[pos];
    let v = t.wrapping_mul(2654435761)
        ^ (pos as u32).wrapping_mul(40503)
        ^ layer << 20
        ^ part << 19
        ^ head << 12
        ^ ch;
    let v = v ^ (v >> 13);
    [v as u8, (v >> 8) as u8]
}

pub struct Engine {
    pub id: String,
    pub sched: Box<dyn SchedulerConnector>,
    pub worker: Box<dyn WorkerConnector>,
    pub geometry: Geometry,
    pub buffers: Vec<Vec<u8>>,
    pub block_size: u32,
    /// What `get_finished` said the tiers supplied, every run's in order.
    pub load_sources: Vec<LoadSource>,
    next_block: u32,
    step: u64,
}

impl Engine {
    pub fn new(id: &str, layout: KvLayout, block_size: u32, extra: serde_json::Value) -> Engine {
        Self::with_factory(&LmcacheFactory, id, layout, block_size, extra)
    }

    pub fn with_factory(
        f: &dyn ConnectorFactory,
        id: &str,
        layout: KvLayout,
        block_size: u32,
        extra: serde_json::Value,
    ) -> Engine {
        Self::with_ctx(f, ctx(id, layout, block_size, extra))
    }

    pub fn with_ctx(f: &dyn ConnectorFactory, c: ConnectorContext) -> Engine {
        let (id, layout, block_size) = (c.engine_id.clone(), c.effective.layout, c.effective.block_size);
        let sched = f.create_scheduler(&c).unwrap();
        let mut worker = f.create_worker(&c).unwrap();
        let shape = BlockShape::of(&c.model, &c.effective);
        let regions: Vec<RegionShape> =
            (0..LAYERS).map(|l| RegionShape { layers: vec![LayerId(l)], num_blocks: NUM_BLOCKS }).collect();
        let geometry = Geometry::new(shape, layout, regions.clone());
        let mut buffers: Vec<Vec<u8>> = regions.iter().map(|r| vec![0u8; geometry.region_bytes(r)]).collect();
        // SAFETY: the buffers move into the Engine after its worker, so they are dropped after
        // it (moving a Vec does not move its heap buffer); tests touch them between steps only.
        let kv_regions = unsafe { region_list(&mut buffers) };
        worker.register_kv_caches(&kv_regions).unwrap();
        Engine {
            id,
            sched,
            worker,
            geometry,
            buffers,
            block_size,
            load_sources: Vec::new(),
            next_block: 0,
            step: 0,
        }
    }

    pub fn alloc(&mut self, tokens: usize) -> Vec<BlockId> {
        let n = tokens.div_ceil(self.block_size as usize) as u32;
        // Blocks from the end of the pool backwards, so block ids differ from positions.
        let out = (0..n).map(|i| BlockId(NUM_BLOCKS - 1 - (self.next_block + i) % NUM_BLOCKS)).collect();
        self.next_block = (self.next_block + n) % NUM_BLOCKS;
        out
    }

    pub fn zero(&mut self) {
        for b in &mut self.buffers {
            b.fill(0);
        }
    }

    fn token_offsets(&self, layer: u32, part: u32, block: BlockId, tib: u32) -> Vec<(usize, usize)> {
        let span = self.geometry.span(LayerId(layer), part, block).unwrap();
        let mut v = Vec::new();
        let shape = self.geometry.shape();
        for h in 0..shape.heads {
            for c in 0..shape.head_dim {
                v.push((span.region, span.offset + self.geometry.inner_offset(h, tib, c)));
            }
        }
        v
    }

    /// The engine "computes" tokens `[from, to)`: writes their pattern into the blocks.
    pub fn compute(&mut self, tokens: &[u32], blocks: &[BlockId], from: usize, to: usize) {
        let bs = self.block_size as usize;
        for pos in from..to {
            for l in 0..LAYERS {
                for p in 0..self.geometry.shape().kv_parts {
                    let offs = self.token_offsets(l, p, blocks[pos / bs], (pos % bs) as u32);
                    let mut i = 0;
                    for h in 0..self.geometry.shape().heads {
                        for c in 0..self.geometry.shape().head_dim {
                            let (r, o) = offs[i];
                            self.buffers[r][o..o + 2].copy_from_slice(&pattern(tokens, pos, l, p, h, c));
                            i += 1;
                        }
                    }
                }
            }
        }
    }

    /// Positions in `[from, to)` whose bytes are not the pattern (the first few).
    pub fn mismatches(&self, tokens: &[u32], blocks: &[BlockId], from: usize, to: usize) -> Vec<usize> {
        let bs = self.block_size as usize;
        let mut bad = Vec::new();
        for pos in from..to {
            'tok: for l in 0..LAYERS {
                for p in 0..self.geometry.shape().kv_parts {
                    let offs = self.token_offsets(l, p, blocks[pos / bs], (pos % bs) as u32);
                    let mut i = 0;
                    for h in 0..self.geometry.shape().heads {
                        for c in 0..self.geometry.shape().head_dim {
                            let (r, o) = offs[i];
                            if self.buffers[r][o..o + 2] != pattern(tokens, pos, l, p, h, c) {
                                bad.push(pos);
                                break 'tok;
                            }
                            i += 1;
                        }
                    }
                }
            }
        }
        bad
    }

    /// True when every byte of tokens `[from, to)` is zero.
    pub fn all_zero(&self, blocks: &[BlockId], from: usize, to: usize) -> bool {
        let bs = self.block_size as usize;
        (from..to).all(|pos| {
            (0..LAYERS).all(|l| {
                (0..self.geometry.shape().kv_parts).all(|p| {
                    self.token_offsets(l, p, blocks[pos / bs], (pos % bs) as u32)
                        .iter()
                        .all(|(r, o)| self.buffers[*r][*o..*o + 2] == [0, 0])
                })
            })
        })
    }

    pub fn lookup(&mut self, req: &Request, num_computed: usize) -> usize {
        match self.sched.get_num_new_matched_tokens(req, num_computed).unwrap() {
            MatchResult::Matched { tokens, async_load } => {
                assert!(!async_load);
                tokens
            }
            MatchResult::Pending => panic!("lmcache never answers Pending"),
        }
    }

    /// One request through the vLLM call order: lookup, alloc, meta, load, compute the rest,
    /// save. `num_computed` plays the engine's own prefix-cache hit (its tokens are computed
    /// before the step). Returns (matched tokens, blocks, blocks with load errors).
    pub fn run(
        &mut self,
        id: &str,
        tokens: &[u32],
        num_computed: usize,
    ) -> (usize, Vec<BlockId>, Vec<BlockId>) {
        let req = request(id, tokens);
        let matched = self.lookup(&req, num_computed);
        let blocks = self.alloc(tokens.len());
        self.compute(tokens, &blocks, 0, num_computed);
        self.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![blocks.clone()]), matched).unwrap();
        self.step += 1;
        let meta = self
            .sched
            .build_connector_meta(&StepInfo {
                step: self.step,
                scheduled: vec![req.id.clone()],
                finished: vec![],
            })
            .unwrap();
        self.worker.bind_connector_meta(&meta).unwrap();
        self.worker.start_load_kv().unwrap();
        let errors = self.worker.block_ids_with_load_errors().unwrap();
        let mut done = num_computed + matched;
        if let Some(first) = errors.iter().map(|b| blocks.iter().position(|x| x == b).unwrap()).min() {
            done = done.min(first * self.block_size as usize);
        }
        for l in 0..LAYERS {
            self.worker.wait_for_layer_load(LayerId(l)).unwrap();
        }
        // The engine computes what was not loaded, layer by layer, saving as it goes.
        self.compute(tokens, &blocks, done, tokens.len());
        for l in 0..LAYERS {
            self.worker.save_kv_layer(LayerId(l), &blocks).unwrap();
        }
        self.worker.wait_for_save().unwrap();
        let fin = self.worker.get_finished(std::slice::from_ref(&req.id)).unwrap();
        assert!(fin.finished_recving.is_empty() && fin.failed_recving.is_empty());
        self.load_sources.extend(fin.load_sources);
        let f = self.sched.request_finished(&req, &BlocksPerGroup(vec![blocks.clone()])).unwrap();
        assert!(!f.delay_free);
        (matched, blocks, errors)
    }

    /// Loads only (no compute, no save): lookup, alloc, meta, start_load_kv, layer waits.
    pub fn load_only(&mut self, id: &str, tokens: &[u32]) -> (usize, Vec<BlockId>, Vec<BlockId>) {
        let req = request(id, tokens);
        let matched = self.lookup(&req, 0);
        let blocks = self.alloc(tokens.len());
        self.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![blocks.clone()]), matched).unwrap();
        self.step += 1;
        let meta =
            self.sched.build_connector_meta(&StepInfo { step: self.step, ..StepInfo::default() }).unwrap();
        self.worker.bind_connector_meta(&meta).unwrap();
        self.worker.start_load_kv().unwrap();
        for l in 0..LAYERS {
            self.worker.wait_for_layer_load(LayerId(l)).unwrap();
        }
        let errors = self.worker.block_ids_with_load_errors().unwrap();
        (matched, blocks, errors)
    }
}

pub fn request(id: &str, tokens: &[u32]) -> Request {
    Request {
        id: RequestId(id.to_owned()),
        prompt_tokens: tokens.to_vec(),
        kv_transfer_params: Default::default(),
    }
}

/// One host region per buffer, layer `i` in buffer `i`.
///
/// # Safety
/// The buffers must outlive every worker the regions are registered with and not be touched
/// while a worker may use them.
pub unsafe fn region_list(buffers: &mut [Vec<u8>]) -> Vec<KvRegion> {
    KvRegionSpec::per_layer(buffers, NUM_BLOCKS)
        .into_iter()
        // SAFETY: the caller's contract (`# Safety` above).
        .map(|spec| unsafe { KvRegion::new(spec) })
        .collect()
}

/// A prompt of `n` tokens, distinct per `seed`.
pub fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed.wrapping_mul(1000003).wrapping_add(i * 7 + 1) % 50_000).collect()
}

/// Bytes of one chunk of `chunk_size` tokens for the test model.
pub fn chunk_bytes(chunk_size: usize) -> usize {
    LAYERS as usize * 2 * chunk_size * HEADS as usize * HEAD_DIM as usize * 2
}

/// LMCache's GB for `bytes` bytes.
pub fn gb(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0 * 1024.0)
}
