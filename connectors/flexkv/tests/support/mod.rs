//! A tiny engine around the two flexkv halves: host KV regions, a block allocator, a
//! deterministic "forward pass" that writes each block's KV, and the vLLM call order.

#![allow(unsafe_code)] // Tests vouch for their own KV buffers as regions (KvRegion::new).
#![allow(dead_code)]

use kvconnect_api::geometry::{BlockShape, Geometry};
use kvconnect_api::{
    AttentionKind, BlockId, BlocksPerGroup, Capabilities, ChildCaps, ConnectorContext, ConnectorFactory,
    Dtype, EffectiveLayout, EngineOptions, KvGroup, KvLayout, KvRegion, KvRegionSpec, KvRole,
    KvTransferConfig, LayerId, LayoutConstraint, MatchResult, MemoryKind, ModelSpec, Request, RequestId,
    SchedulerConnector, StepInfo, TransferMode, WorkerConnector,
};
use kvconnect_flexkv::FlexkvFactory;
use std::time::{Duration, Instant};

pub const BS: usize = 4;
pub const HEADS: u32 = 2;
pub const DIM: u32 = 8;

pub fn model() -> ModelSpec {
    ModelSpec {
        name: "flexkv-test".into(),
        num_layers: 3,
        num_kv_heads: HEADS,
        head_dim: DIM,
        dtype: Some(Dtype::Bf16),
        layers: vec![AttentionKind::Full, AttentionKind::FeedForward, AttentionKind::Full],
        state: None,
    }
}

pub fn effective(layout: KvLayout) -> EffectiveLayout {
    EffectiveLayout {
        layout,
        hma: false,
        block_size: BS as u32,
        cache_dtype: Dtype::Bf16,
        memory: MemoryKind::Host,
        transfer_mode: TransferMode::None,
        groups: vec![KvGroup { kind: AttentionKind::Full, layers: vec![LayerId(0), LayerId(2)] }],
        state_groups: vec![],
        opaque_blocks: false,
    }
}

/// The effective layout negotiation gives flexkv next to a transport that requires HND.
pub fn negotiated_with_hnd_transport() -> EffectiveLayout {
    let flex = kvconnect_flexkv::caps::capabilities(&KvTransferConfig::named("flexkv"), None).unwrap();
    let hnd_transport = Capabilities::builder(TransferMode::Pull, [MemoryKind::Host], [KvRole::Both])
        .hma(true)
        .layout(LayoutConstraint { required: vec![KvLayout::HND], rejected: vec![], preferred: vec![] })
        .async_load(true)
        .build()
        .unwrap();
    let children = [
        ChildCaps { name: "flexkv".into(), version: "0".into(), caps: flex },
        ChildCaps { name: "nixl".into(), version: "0".into(), caps: hnd_transport },
    ];
    let opts = EngineOptions { block_size: Some(BS as u32), ..EngineOptions::default() };
    let n = kvconnect_api::negotiate(&model(), &opts, &children).unwrap();
    assert_eq!(n.effective.layout, KvLayout::HND, "{}", n.explain());
    assert!(n.adapters.iter().any(|a| a.child == "flexkv"), "{}", n.explain());
    n.effective
}

/// flexkv alone over an engine whose blocks are opaque (vLLM's CPU backend, HND): no
/// adapter, the engine's layout kept.
pub fn negotiated_over_opaque_blocks() -> EffectiveLayout {
    let flex = kvconnect_flexkv::caps::capabilities(&KvTransferConfig::named("flexkv"), None).unwrap();
    let children = [ChildCaps { name: "flexkv".into(), version: "0".into(), caps: flex }];
    let opts = EngineOptions {
        block_size: Some(BS as u32),
        kv_cache_layout: Some(KvLayout::HND),
        opaque_blocks: Some("the test engine's in-block format is its own".into()),
        ..EngineOptions::default()
    };
    let n = kvconnect_api::negotiate(&model(), &opts, &children).unwrap();
    assert!(n.effective.opaque_blocks && n.adapters.is_empty(), "{}", n.explain());
    assert_eq!(n.effective.layout, KvLayout::HND, "{}", n.explain());
    n.effective
}

pub fn ctx(eff: EffectiveLayout, extra: serde_json::Value, engine_id: &str) -> ConnectorContext {
    let mut config = KvTransferConfig::named("flexkv");
    config.kv_connector_extra_config = extra.as_object().cloned().unwrap_or_default();
    config.engine_id = Some(engine_id.to_owned());
    ConnectorContext {
        config,
        model: model(),
        effective: eff,
        role: KvRole::Both,
        engine_id: engine_id.to_owned(),
        tp_rank: 0,
        tp_size: 1,
    }
}

/// The KV the "forward pass" writes for element (h, n, c) of `part` of `layer` in the block
/// that ends prompt prefix `prefix` (as tokens): a function of the prefix, so equal prefixes
/// give equal blocks and any misplaced byte shows.
pub fn kv_value(prefix: &[u32], layer: u32, part: u32, h: u32, n: u32, c: u32) -> [u8; 2] {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for t in prefix {
        x = (x ^ *t as u64).wrapping_mul(0x1000_0000_01b3);
    }
    x ^= ((layer as u64) << 48) ^ ((part as u64) << 40) ^ ((h as u64) << 32) ^ ((n as u64) << 16) ^ c as u64;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 29;
    [x as u8, (x >> 8) as u8]
}

pub struct Sim {
    pub eff: EffectiveLayout,
    pub sched: Box<dyn SchedulerConnector>,
    pub worker: Box<dyn WorkerConnector>,
    pub regions: Vec<Vec<u8>>,
    pub geo: Geometry,
    pub num_blocks: u32,
    pub free: Vec<u32>,
    step: u64,
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Tokens the connector said it would load.
    pub matched: usize,
    /// The load failed.
    pub load_failed: bool,
    /// Blocks reported by block_ids_with_load_errors.
    pub error_blocks: Vec<BlockId>,
    /// Loaded blocks that did not hold the expected KV.
    pub wrong_blocks: Vec<usize>,
    /// request_finished asked to delay freeing.
    pub delayed: bool,
}

impl Sim {
    pub fn new(eff: EffectiveLayout, extra: serde_json::Value, engine_id: &str, num_blocks: u32) -> Sim {
        Sim::with_ctx(ctx(eff, extra, engine_id), num_blocks)
    }

    /// A simulation over a context built by the caller (another role, say).
    pub fn with_ctx(c: ConnectorContext, num_blocks: u32) -> Sim {
        let eff = c.effective.clone();
        let f = FlexkvFactory;
        let sched = f.create_scheduler(&c).unwrap();
        let mut worker = f.create_worker(&c).unwrap();
        let shape = BlockShape::of(&model(), &eff);
        let per_region = num_blocks as usize * shape.layer_block_bytes();
        let mut regions: Vec<Vec<u8>> = vec![vec![0u8; per_region]; 2];
        let kv: Vec<KvRegion> = [0u32, 2]
            .iter()
            .zip(regions.iter_mut())
            .map(|(l, buf)| {
                // SAFETY: the buffers move into the Sim with the worker, which is declared before
                // them and so dropped first; moving a Vec does not move its heap buffer.
                unsafe {
                    KvRegion::new(KvRegionSpec::host(
                        format!("layer.{l}"),
                        buf,
                        vec![LayerId(*l)],
                        0,
                        num_blocks,
                    ))
                }
            })
            .collect();
        worker.register_kv_caches(&kv).unwrap();
        let geo = Geometry::new(
            shape,
            eff.layout,
            kv.iter()
                .map(|r| kvconnect_api::geometry::RegionShape { layers: r.layers().to_vec(), num_blocks })
                .collect(),
        )
        .with_opaque_blocks(eff.opaque_blocks);
        Sim { eff, sched, worker, regions, geo, num_blocks, free: (0..num_blocks).rev().collect(), step: 0 }
    }

    pub fn write_block(&mut self, block: BlockId, prefix: &[u32]) {
        for (ri, layer) in [0u32, 2].iter().enumerate() {
            for part in 0..2 {
                let span = self.geo.span(LayerId(*layer), part, block).unwrap();
                for h in 0..HEADS {
                    for n in 0..BS as u32 {
                        for c in 0..DIM {
                            let o = span.offset + self.geo.inner_offset(h, n, c);
                            self.regions[ri][o..o + 2]
                                .copy_from_slice(&kv_value(prefix, *layer, part, h, n, c));
                        }
                    }
                }
            }
        }
    }

    pub fn block_is(&self, block: BlockId, prefix: &[u32]) -> bool {
        for (ri, layer) in [0u32, 2].iter().enumerate() {
            for part in 0..2 {
                let span = self.geo.span(LayerId(*layer), part, block).unwrap();
                for h in 0..HEADS {
                    for n in 0..BS as u32 {
                        for c in 0..DIM {
                            let o = span.offset + self.geo.inner_offset(h, n, c);
                            if self.regions[ri][o..o + 2] != kv_value(prefix, *layer, part, h, n, c) {
                                return false;
                            }
                        }
                    }
                }
            }
        }
        true
    }

    fn zero_block(&mut self, block: BlockId) {
        self.fill_block(block, 0);
    }

    /// Sets every byte of `block` (all layers, K and V) to `byte`.
    pub fn fill_block(&mut self, block: BlockId, byte: u8) {
        for (ri, layer) in [0u32, 2].iter().enumerate() {
            for part in 0..2 {
                let span = self.geo.span(LayerId(*layer), part, block).unwrap();
                self.regions[ri][span.offset..span.offset + span.len].fill(byte);
            }
        }
    }

    /// True when every byte of `block` is `byte`.
    pub fn block_all(&self, block: BlockId, byte: u8) -> bool {
        [0u32, 2].iter().enumerate().all(|(ri, layer)| {
            (0..2).all(|part| {
                let span = self.geo.span(LayerId(*layer), part, block).unwrap();
                self.regions[ri][span.offset..span.offset + span.len].iter().all(|b| *b == byte)
            })
        })
    }

    pub fn meta(&mut self, scheduled: &[RequestId]) {
        self.step += 1;
        let m = self
            .sched
            .build_connector_meta(&StepInfo {
                step: self.step,
                scheduled: scheduled.to_vec(),
                finished: vec![],
            })
            .unwrap();
        self.worker.bind_connector_meta(&m).unwrap();
    }

    /// Only the lookup.
    pub fn lookup(&mut self, prompt: &[u32]) -> usize {
        let req = Request {
            id: "lookup".into(),
            prompt_tokens: prompt.to_vec(),
            kv_transfer_params: Default::default(),
        };
        let m = self.sched.get_num_new_matched_tokens(&req, 0).unwrap();
        self.sched.request_finished(&req, &BlocksPerGroup::default()).unwrap();
        match m {
            MatchResult::Matched { tokens, .. } => tokens,
            MatchResult::Pending => panic!("flexkv never answers Pending"),
        }
    }

    /// Runs one request through lookup, load, compute, save and finish, in vLLM's order.
    pub fn run(&mut self, id: &str, prompt: &[u32]) -> Outcome {
        self.run_opts(id, prompt, true)
    }

    /// As `run`; with `schedule` false the request ends after its load, never computed.
    pub fn run_opts(&mut self, id: &str, prompt: &[u32], schedule: bool) -> Outcome {
        let req =
            Request { id: id.into(), prompt_tokens: prompt.to_vec(), kv_transfer_params: Default::default() };
        let rid = req.id.clone();
        let mut out = Outcome::default();
        let m = self.sched.get_num_new_matched_tokens(&req, 0).unwrap();
        let MatchResult::Matched { tokens, async_load } = m else { panic!("Pending") };
        assert!(tokens < prompt.len(), "must leave a token to compute");
        assert_eq!(tokens % BS, 0);
        assert_eq!(async_load, tokens > 0);
        out.matched = tokens;
        let nblocks = prompt.len().div_ceil(BS);
        let blocks: Vec<BlockId> =
            (0..nblocks).map(|_| BlockId(self.free.pop().expect("sim out of blocks"))).collect();
        for b in &blocks {
            self.zero_block(*b);
        }
        self.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![blocks.clone()]), tokens).unwrap();
        let mut computed_from = 0;
        if tokens > 0 {
            self.meta(&[]);
            self.worker.start_load_kv().unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let f = self.worker.get_finished(&[]).unwrap();
                if f.finished_recving.contains(&rid) {
                    break;
                }
                if f.failed_recving.contains(&rid) {
                    out.load_failed = true;
                    out.error_blocks = self.worker.block_ids_with_load_errors().unwrap();
                    break;
                }
                assert!(Instant::now() < deadline, "load of {id} never finished");
                std::thread::sleep(Duration::from_millis(1));
            }
            let loaded = if out.load_failed {
                blocks.iter().position(|b| out.error_blocks.contains(b)).unwrap_or(0)
            } else {
                tokens / BS
            };
            for (i, b) in blocks.iter().enumerate().take(loaded) {
                if !self.block_is(*b, &prompt[..(i + 1) * BS]) {
                    out.wrong_blocks.push(i);
                }
            }
            // Failed blocks hold no byte of what failed: untouched, or wiped (zero) where a
            // verifying copy had already written a corrupt record in.
            for b in &out.error_blocks {
                for (ri, layer) in [0u32, 2].iter().enumerate() {
                    let s = self.geo.span(LayerId(*layer), 0, *b).unwrap();
                    assert!(
                        self.regions[ri][s.offset..s.offset + s.len].iter().all(|x| *x == 0),
                        "failed block written"
                    );
                }
            }
            computed_from = loaded;
        }
        if !schedule {
            let rf = self.sched.request_finished(&req, &BlocksPerGroup(vec![blocks.clone()])).unwrap();
            assert!(!rf.delay_free, "nothing was saved for a request never computed");
            self.free.extend(blocks.iter().map(|b| b.0));
            return out;
        }
        // The forward pass computes the rest of the prompt.
        for (i, b) in blocks.iter().enumerate().skip(computed_from) {
            let end = ((i + 1) * BS).min(prompt.len());
            self.write_block(*b, &prompt[..end]);
        }
        self.meta(std::slice::from_ref(&rid));
        self.worker.start_load_kv().unwrap();
        self.worker.wait_for_save().unwrap();
        let rf = self.sched.request_finished(&req, &BlocksPerGroup(vec![blocks.clone()])).unwrap();
        out.delayed = rf.delay_free;
        if rf.delay_free {
            self.meta(&[]);
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut finished = vec![rid.clone()];
            loop {
                let f = self.worker.get_finished(&finished).unwrap();
                if f.finished_sending.contains(&rid) {
                    break;
                }
                finished.clear();
                assert!(Instant::now() < deadline, "save of {id} never finished");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        for b in blocks {
            self.free.push(b.0);
        }
        out
    }
}

pub fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed.wrapping_mul(1000).wrapping_add(i)).collect()
}
