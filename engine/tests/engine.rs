//! The reference engine as the ground truth of disaggregated serving: monolithic runs are
//! deterministic and independent of the KV layout and of HMA, and a prefill on one engine
//! plus a decode on another (KV moved by a loopback connector through the real connector
//! API) gives exactly the monolithic tokens.

use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorResult, Dtype, FailurePolicy, FinishedTransfers, KvLayout, KvRegion,
    LayerId, LoadSource, MatchResult, Request, RequestFinished, RequestId, SchedulerConnector, StepInfo,
    TierTokens, WorkerConnector,
};
use kvconnect_engine::{
    detokenize, local_effective_layout, tokenize, Completion, Engine, EngineConfig, FinishReason, GenRequest,
    ReferenceConfig,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const SEED: u64 = 1234;
const BLOCKS: u32 = 48;

fn config(layout: KvLayout, hma: bool, dtype: Dtype) -> EngineConfig {
    let model = ReferenceConfig::builtin().unwrap();
    let spec = model.model_spec().unwrap();
    EngineConfig {
        effective: local_effective_layout(&spec, layout, hma, 16, dtype),
        model,
        num_blocks: BLOCKS,
        seed: SEED,
        shm: None,
        tp_size: 1,
    }
}

fn monolithic(layout: KvLayout, hma: bool, dtype: Dtype) -> Engine {
    Engine::new(config(layout, hma, dtype), None, FailurePolicy::Recompute).unwrap()
}

/// Prompts of varied length: 1 token, shorter than a block, exactly a block, many blocks,
/// longer than the sliding window (32).
fn prompts(n: usize) -> Vec<Vec<u32>> {
    let text = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. \
                Sphinx of black quartz, judge my vow! How vexingly quick daft zebras jump. ";
    let lens = [1usize, 2, 3, 7, 15, 16, 17, 31, 32, 33, 40, 47, 48, 49, 63, 64, 65, 90, 120, 150];
    (0..n)
        .map(|i| {
            let len = lens[i % lens.len()] + (i / lens.len()) * 3;
            text.bytes().cycle().skip(i * 7).take(len).map(u32::from).collect()
        })
        .collect()
}

fn generate(engine: &mut Engine, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    for (i, p) in prompts.iter().enumerate() {
        engine.add_request(GenRequest::new(format!("r{i}"), p.clone(), max_tokens)).unwrap();
    }
    let done = engine.run_to_completion(10_000).unwrap();
    assert_eq!(engine.free_blocks(), engine.total_blocks(), "pool back to full");
    done.into_iter()
        .map(|c| {
            assert_eq!(c.finish, FinishReason::Length, "{}", c.id);
            c.tokens
        })
        .collect()
}

#[test]
fn the_prefix_cache_reuses_whole_prompt_blocks_and_changes_no_output() {
    for hma in [false, true] {
        let ps = prompts(20);
        let want = generate(&mut monolithic(KvLayout::HND, hma, Dtype::Bf16), &ps, 6);
        let mut e = monolithic(KvLayout::HND, hma, Dtype::Bf16);
        e.enable_prefix_caching().unwrap();
        let run = |e: &mut Engine, id: &str, p: &[u32]| -> Completion {
            e.add_request(GenRequest::new(id.to_owned(), p.to_vec(), 6)).unwrap();
            let done = e.run_to_completion(10_000).unwrap().remove(0);
            assert_eq!(e.free_blocks(), e.total_blocks(), "idle cached blocks count as free");
            done
        };
        for (i, p) in ps.iter().enumerate() {
            let first = run(&mut e, &format!("a{i}"), p);
            assert_eq!(first.tokens, want[i], "prompt {i}, first run");
            let again = run(&mut e, &format!("b{i}"), p);
            assert_eq!(again.tokens, want[i], "prompt {i} from the cache (hma {hma})");
            // Whole blocks, always leaving the last token to compute.
            assert_eq!(again.num_cached_tokens, (p.len() - 1) / 16 * 16, "prompt {i} ({} tokens)", p.len());
        }
        // A prompt sharing only its first block with a cached one hits that block only.
        let long = ps.iter().find(|p| p.len() > 40).unwrap();
        let mut other = long[..20].to_vec();
        other.extend(std::iter::repeat_n(b'z' as u32, 30));
        let cold =
            generate(&mut monolithic(KvLayout::HND, hma, Dtype::Bf16), std::slice::from_ref(&other), 6);
        let warm = run(&mut e, "c", &other);
        assert_eq!(warm.tokens, cold[0]);
        assert_eq!(warm.num_cached_tokens, 16);
    }
}

#[test]
fn monolithic_is_deterministic_and_context_dependent() {
    let ps = prompts(6);
    let a = generate(&mut monolithic(KvLayout::HND, true, Dtype::Bf16), &ps, 8);
    let b = generate(&mut monolithic(KvLayout::HND, true, Dtype::Bf16), &ps, 8);
    assert_eq!(a, b);
    assert!(a.iter().all(|t| t.len() == 8));
    // The model is not degenerate: different prompts give different continuations.
    let distinct: std::collections::BTreeSet<_> = a.iter().collect();
    assert!(distinct.len() >= 4, "{a:?}");
    // A request alone gives what it gives in a batch.
    let alone = generate(&mut monolithic(KvLayout::HND, true, Dtype::Bf16), &ps[3..4], 8);
    assert_eq!(alone[0], a[3]);
    // The pool is full again after every single request.
    let mut e = monolithic(KvLayout::BLNHC, true, Dtype::Bf16);
    for (i, p) in ps.iter().enumerate() {
        e.add_request(GenRequest::new(format!("one{i}"), p.clone(), 8)).unwrap();
        let done = e.run_to_completion(100).unwrap();
        assert_eq!(done[0].tokens, a[i]);
        assert_eq!(e.free_blocks(), e.total_blocks(), "after request {i}");
    }
    let s = detokenize(&a[0]);
    assert_eq!(tokenize(&s).len(), s.len());
}

#[test]
fn layouts_and_hma_only_change_storage_order() {
    // 1 token, a block, past the sliding window, many blocks (HMA gives back old
    // sliding-window blocks of the long ones while they decode).
    let ps: Vec<_> = prompts(20)
        .into_iter()
        .enumerate()
        .filter(|(i, _)| [0, 5, 9, 16, 19].contains(i))
        .map(|(_, p)| p)
        .collect();
    for dtype in [Dtype::Bf16, Dtype::F32] {
        let reference = generate(&mut monolithic(KvLayout::NHD, false, dtype), &ps, 6);
        for (layout, hma) in [
            (KvLayout::NHD, true),
            (KvLayout::HND, false),
            (KvLayout::HND, true),
            (KvLayout::BLHNC, false),
            (KvLayout::BLNHC, true),
            ("LBCNH".parse().unwrap(), true),
        ] {
            let got = generate(&mut monolithic(layout, hma, dtype), &ps, 6);
            assert_eq!(got, reference, "{dtype:?} {layout} hma={hma}");
        }
    }
}

// ---- A loopback connector: saves a finished prefill's blocks into a shared store, loads
// them into another engine's pool. It goes through the same calls a real transport does.

#[derive(Debug, Default)]
struct Stored {
    num_tokens: usize,
    /// (layer, part, index in the request's block list) -> bytes.
    blocks: HashMap<(u32, u32, usize), Vec<u8>>,
}

type Store = Arc<Mutex<HashMap<String, Stored>>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// Report the async load as failed.
    FailRecv,
    /// Load nothing but report every block as a load error.
    ErrorBlocks,
    /// As ErrorBlocks, but the load is reported finished one step after its bad blocks.
    ErrorBlocksEarly,
    /// Load zeros instead of the stored bytes and report success (to prove the tests see KV).
    Corrupt,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Meta {
    saves: Vec<(String, Vec<Vec<u32>>, usize)>,
    loads: Vec<(String, Vec<Vec<u32>>, usize)>,
}

struct LoopSched {
    store: Store,
    async_load: bool,
    meta: Meta,
}

impl SchedulerConnector for LoopSched {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed: usize,
    ) -> ConnectorResult<MatchResult> {
        if req.kv_transfer_params.get("do_remote_prefill") != Some(&json!(true)) {
            return Ok(MatchResult::Matched { tokens: 0, async_load: false });
        }
        let n = req.kv_transfer_params.get("remote_num_tokens").and_then(Value::as_u64).unwrap_or(0) as usize;
        if !self.store.lock().unwrap().contains_key(&req.id.0) {
            return Ok(MatchResult::Pending);
        }
        Ok(MatchResult::Matched { tokens: n.saturating_sub(num_computed), async_load: self.async_load })
    }

    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
        ext: usize,
    ) -> ConnectorResult<()> {
        if ext > 0 {
            let ids = blocks.0.iter().map(|g| g.iter().map(|b| b.0).collect()).collect();
            self.meta.loads.push((req.id.0.clone(), ids, ext));
        }
        Ok(())
    }

    fn build_connector_meta(&mut self, _: &StepInfo) -> ConnectorResult<Vec<u8>> {
        Ok(serde_json::to_vec(&std::mem::take(&mut self.meta)).unwrap())
    }

    fn request_finished(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
    ) -> ConnectorResult<RequestFinished> {
        if req.kv_transfer_params.get("do_remote_decode") != Some(&json!(true)) {
            return Ok(RequestFinished::default());
        }
        let ids: Vec<Vec<u32>> = blocks.0.iter().map(|g| g.iter().map(|b| b.0).collect()).collect();
        let n = req.prompt_tokens.len();
        self.meta.saves.push((req.id.0.clone(), ids.clone(), n));
        let mut p = Map::new();
        p.insert("do_remote_prefill".into(), json!(true));
        p.insert("do_remote_decode".into(), json!(false));
        p.insert("remote_engine_id".into(), json!("loopback"));
        p.insert("remote_block_ids".into(), json!(ids));
        p.insert("remote_num_tokens".into(), json!(n));
        Ok(RequestFinished { delay_free: true, transfer_params: Some(p) })
    }
}

struct LoopWorker {
    store: Store,
    fault: Fault,
    block_size: usize,
    mem: Option<KvMemory>,
    regions: Vec<KvRegion>,
    meta: Meta,
    sent: Vec<RequestId>,
    recvd: Vec<RequestId>,
    recvd_later: Vec<RequestId>,
    failed: Vec<RequestId>,
    err_blocks: Vec<BlockId>,
    layers_saved: Vec<u32>,
    /// What its one tier ("store") supplied, for the next `get_finished`.
    sources: Vec<LoadSource>,
}

impl LoopWorker {
    fn layers(&self) -> Vec<(u32, usize)> {
        self.regions.iter().flat_map(|r| r.layers().iter().map(move |l| (l.0, r.group() as usize))).collect()
    }
}

impl WorkerConnector for LoopWorker {
    fn register_kv_caches(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        let cfg = ReferenceConfig::builtin().unwrap();
        let spec = cfg.model_spec().unwrap();
        let hma = regions.iter().any(|r| r.group() > 0);
        let layout = if regions.len() < 4 { KvLayout::BLHNC } else { KvLayout::HND };
        let eff = local_effective_layout(&spec, layout, hma, self.block_size as u32, Dtype::Bf16);
        self.mem = Some(KvMemory::new(regions, &spec, &eff).unwrap());
        self.regions = regions.to_vec();
        Ok(())
    }

    fn bind_connector_meta(&mut self, meta: &[u8]) -> ConnectorResult<()> {
        self.meta = serde_json::from_slice(meta).unwrap();
        Ok(())
    }

    fn start_load_kv(&mut self) -> ConnectorResult<()> {
        let mem = self.mem.as_ref().unwrap();
        for (id, blocks, ext) in std::mem::take(&mut self.meta.loads) {
            let n = ext.div_ceil(self.block_size);
            match self.fault {
                Fault::FailRecv => {
                    self.failed.push(RequestId(id));
                    continue;
                }
                Fault::ErrorBlocks | Fault::ErrorBlocksEarly => {
                    self.err_blocks.extend(blocks[0].iter().take(n).map(|b| BlockId(*b)));
                    if self.fault == Fault::ErrorBlocks {
                        self.recvd.push(RequestId(id));
                    } else {
                        self.recvd_later.push(RequestId(id));
                    }
                    continue;
                }
                _ => {}
            }
            let store = self.store.lock().unwrap();
            let stored = &store[&id];
            assert!(ext <= stored.num_tokens);
            for (layer, group) in self.layers() {
                for part in 0..2 {
                    for (i, b) in blocks[group].iter().take(n).enumerate() {
                        let span = mem.span(LayerId(layer), part, BlockId(*b)).unwrap();
                        let bytes = &stored.blocks[&(layer, part, i)];
                        let data =
                            if self.fault == Fault::Corrupt { vec![0u8; bytes.len()] } else { bytes.clone() };
                        mem.write(span, &data).unwrap();
                    }
                }
            }
            if ext > 0 {
                self.sources.push(LoadSource::new(&RequestId(id.clone()), "loop", "store", ext as u64));
            }
            self.recvd.push(RequestId(id));
        }
        Ok(())
    }

    fn save_kv_layer(&mut self, layer: LayerId, _: &[BlockId]) -> ConnectorResult<()> {
        self.layers_saved.push(layer.0);
        Ok(())
    }

    fn wait_for_save(&mut self) -> ConnectorResult<()> {
        // Finished prefills: copy their blocks out, then report them sent.
        let mem = self.mem.as_ref().unwrap();
        for (id, blocks, n) in std::mem::take(&mut self.meta.saves) {
            let mut s = Stored { num_tokens: n, ..Default::default() };
            for (layer, group) in self.layers() {
                for part in 0..2 {
                    for (i, b) in blocks[group].iter().take(n.div_ceil(self.block_size)).enumerate() {
                        let span = mem.span(LayerId(layer), part, BlockId(*b)).unwrap();
                        let mut buf = vec![0u8; span.len];
                        mem.read(span, &mut buf).unwrap();
                        s.blocks.insert((layer, part, i), buf);
                    }
                }
            }
            self.store.lock().unwrap().insert(id.clone(), s);
            self.sent.push(RequestId(id));
        }
        Ok(())
    }

    fn get_finished(&mut self, _: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        let later = std::mem::take(&mut self.recvd_later);
        let recvd = std::mem::replace(&mut self.recvd, later);
        Ok(FinishedTransfers {
            finished_recving: recvd,
            finished_sending: std::mem::take(&mut self.sent),
            failed_recving: std::mem::take(&mut self.failed),
            load_sources: std::mem::take(&mut self.sources),
        })
    }

    fn block_ids_with_load_errors(&mut self) -> ConnectorResult<Vec<BlockId>> {
        Ok(std::mem::take(&mut self.err_blocks))
    }

    fn shutdown(&mut self) -> ConnectorResult<()> {
        self.mem = None;
        Ok(())
    }
}

fn loopback_engine(
    store: &Store,
    layout: KvLayout,
    hma: bool,
    async_load: bool,
    fault: Fault,
    policy: FailurePolicy,
) -> Engine {
    let sched = LoopSched { store: store.clone(), async_load, meta: Meta::default() };
    let worker = LoopWorker {
        store: store.clone(),
        fault,
        block_size: 16,
        mem: None,
        regions: Vec::new(),
        meta: Meta::default(),
        sent: Vec::new(),
        recvd: Vec::new(),
        recvd_later: Vec::new(),
        failed: Vec::new(),
        err_blocks: Vec::new(),
        layers_saved: Vec::new(),
        sources: Vec::new(),
    };
    Engine::new(config(layout, hma, Dtype::Bf16), Some((Box::new(sched), Box::new(worker))), policy).unwrap()
}

/// Prefill every prompt on `p` (max_tokens 1, do_remote_decode), then decode on `d`.
fn disaggregated(
    p: &mut Engine,
    d: &mut Engine,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> (Vec<Completion>, Vec<Completion>) {
    let pre = prefill_into(p, d, prompts, max_tokens);
    let dec = d.run_to_completion(1000).unwrap();
    assert_eq!(d.free_blocks(), d.total_blocks(), "decode pool back to full");
    (pre, dec)
}

/// Prefill every prompt on `p` (max_tokens 1, do_remote_decode), then add each to `d` with
/// the transfer params prefill returned.
fn prefill_into(p: &mut Engine, d: &mut Engine, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Completion> {
    for (i, pr) in prompts.iter().enumerate() {
        let mut r = GenRequest::new(format!("r{i}"), pr.clone(), 1);
        r.kv_transfer_params.insert("do_remote_decode".into(), json!(true));
        p.add_request(r).unwrap();
    }
    let pre = p.run_to_completion(1000).unwrap();
    p.wait_for_pending_frees(10).unwrap();
    assert_eq!(p.free_blocks(), p.total_blocks(), "prefill pool back to full");
    for c in &pre {
        let params = c.kv_transfer_params.clone().expect("prefill returns transfer params");
        assert_eq!(params["do_remote_prefill"], json!(true));
        let i: usize = c.id[1..].parse().unwrap();
        let r = GenRequest {
            id: c.id.clone(),
            prompt: prompts[i].clone(),
            max_tokens,
            kv_transfer_params: params,
            sampling: Default::default(),
        };
        d.add_request(r).unwrap();
    }
    pre
}

#[test]
fn disaggregated_equals_monolithic_for_many_prompts() {
    let ps = prompts(52);
    let mono = generate(&mut monolithic(KvLayout::HND, true, Dtype::Bf16), &ps, 5);
    let store = Store::default();
    let mut p = loopback_engine(&store, KvLayout::HND, true, true, Fault::None, FailurePolicy::Fail);
    let mut d = loopback_engine(&store, KvLayout::HND, true, true, Fault::None, FailurePolicy::Fail);
    let (pre, dec) = disaggregated(&mut p, &mut d, &ps, 5);
    for (i, (c, m)) in dec.iter().zip(&mono).enumerate() {
        assert_eq!(c.finish, FinishReason::Length, "{}", c.id);
        assert_eq!(&c.tokens, m, "prompt {i} (len {})", ps[i].len());
        assert_eq!(pre[i].tokens[0], m[0], "prefill's first token");
        assert_eq!(
            c.num_external_tokens,
            ps[i].len() - 1,
            "prompt {i}: all but the last prompt token loaded"
        );
    }
}

#[test]
fn disaggregated_cross_layer_hma_off_sync_load() {
    let ps = prompts(20);
    let mono = generate(&mut monolithic(KvLayout::BLHNC, false, Dtype::Bf16), &ps, 4);
    let store = Store::default();
    let mut p = loopback_engine(&store, KvLayout::BLHNC, false, false, Fault::None, FailurePolicy::Fail);
    let mut d = loopback_engine(&store, KvLayout::BLHNC, false, false, Fault::None, FailurePolicy::Fail);
    let (_, dec) = disaggregated(&mut p, &mut d, &ps, 4);
    let got: Vec<_> = dec.into_iter().map(|c| c.tokens).collect();
    assert_eq!(got, mono);
}

/// What the connector said its tiers supplied (`get_finished`'s `load_sources`) comes out on
/// the request's finishing output, for async and synchronous loads; nothing for a request
/// nothing was loaded for.
#[test]
fn load_sources_come_out_on_the_finishing_output() {
    for async_load in [true, false] {
        let ps = prompts(8);
        let store = Store::default();
        let mut p =
            loopback_engine(&store, KvLayout::HND, true, async_load, Fault::None, FailurePolicy::Fail);
        let mut d =
            loopback_engine(&store, KvLayout::HND, true, async_load, Fault::None, FailurePolicy::Fail);
        prefill_into(&mut p, &mut d, &ps, 3);
        let (mut external, mut reported) = (HashMap::new(), HashMap::new());
        for _ in 0..1000 {
            if !d.has_unfinished() {
                break;
            }
            for o in d.step().unwrap() {
                if o.first_token_latency.is_some() {
                    external.insert(o.id.clone(), o.num_external_tokens as u64);
                }
                if o.finished.is_some() {
                    reported.insert(o.id, o.load_sources);
                } else {
                    assert!(o.load_sources.is_empty(), "only the finishing output carries them");
                }
            }
        }
        assert_eq!(reported.len(), ps.len());
        let tier = |n: u64| TierTokens { connector: "loop".into(), tier: "store".into(), tokens: n };
        for (id, n) in &external {
            let want = if *n > 0 { vec![tier(*n)] } else { vec![] };
            assert_eq!(reported[id], want, "{id} (async {async_load})");
        }
        assert!(external.values().any(|n| *n > 0));
    }
}

#[test]
fn corrupt_kv_changes_the_output() {
    // Proves the equality above depends on the transferred KV: zeros instead of the real
    // blocks give different tokens for most prompts longer than a few tokens.
    let ps: Vec<_> = prompts(20).into_iter().filter(|p| p.len() > 8).collect();
    let mono = generate(&mut monolithic(KvLayout::HND, true, Dtype::Bf16), &ps, 5);
    let store = Store::default();
    let mut p = loopback_engine(&store, KvLayout::HND, true, true, Fault::None, FailurePolicy::Fail);
    let mut d = loopback_engine(&store, KvLayout::HND, true, true, Fault::Corrupt, FailurePolicy::Fail);
    let (_, dec) = disaggregated(&mut p, &mut d, &ps, 5);
    let differ = dec.iter().zip(&mono).filter(|(c, m)| &c.tokens != *m).count();
    assert!(differ * 4 >= ps.len() * 3, "only {differ} of {} differ", ps.len());
}

#[test]
fn load_failure_with_recompute_still_matches_monolithic() {
    let ps = prompts(12);
    let mono = generate(&mut monolithic(KvLayout::HND, true, Dtype::Bf16), &ps, 4);
    for fault in [Fault::FailRecv, Fault::ErrorBlocks, Fault::ErrorBlocksEarly] {
        let store = Store::default();
        let mut p = loopback_engine(&store, KvLayout::HND, true, true, Fault::None, FailurePolicy::Recompute);
        let mut d = loopback_engine(&store, KvLayout::HND, true, true, fault, FailurePolicy::Recompute);
        let (_, dec) = disaggregated(&mut p, &mut d, &ps, 4);
        let got: Vec<_> = dec.into_iter().map(|c| c.tokens).collect();
        assert_eq!(got, mono, "{fault:?}");
    }
}

#[test]
fn load_failure_with_fail_policy_ends_the_request_with_the_reason() {
    let ps: Vec<_> = prompts(6).into_iter().filter(|p| p.len() > 1).collect();
    for (fault, reason) in [
        (Fault::FailRecv, "the connector reported the async KV load as failed"),
        (Fault::ErrorBlocks, "the connector could not load block"),
        (Fault::ErrorBlocksEarly, "the connector could not load block"),
    ] {
        let store = Store::default();
        let mut p = loopback_engine(&store, KvLayout::HND, true, true, Fault::None, FailurePolicy::Fail);
        let mut d = loopback_engine(&store, KvLayout::HND, true, true, fault, FailurePolicy::Fail);
        let (_, dec) = disaggregated(&mut p, &mut d, &ps, 4);
        for c in dec {
            let FinishReason::Error(msg) = &c.finish else {
                panic!("{} finished without error: {:?}", c.id, c.finish)
            };
            assert!(msg.contains(reason) && msg.contains("kv_load_failure_policy is 'fail'"), "{msg}");
            assert!(c.tokens.is_empty());
        }
    }
}

#[test]
fn bad_requests_are_refused_with_reasons() {
    let mut e = monolithic(KvLayout::HND, true, Dtype::Bf16);
    let err = |e: &mut Engine, r: GenRequest| e.add_request(r).unwrap_err().to_string();
    assert!(err(&mut e, GenRequest::new("a", vec![], 1)).contains("the prompt is empty"));
    assert!(err(&mut e, GenRequest::new("a", vec![300], 1))
        .contains("token id 300 is outside the byte vocabulary"));
    assert!(err(&mut e, GenRequest::new("a", vec![1], 0)).contains("max_tokens is 0"));
    let m = err(&mut e, GenRequest::new("a", vec![1; 2000], 1));
    assert!(m.contains("needs 125 blocks") && m.contains("raise num_blocks"), "{m}");
    e.add_request(GenRequest::new("a", vec![1], 1)).unwrap();
    assert!(err(&mut e, GenRequest::new("a", vec![2], 1)).contains("still in the engine"));
}

#[test]
fn shared_memory_regions_give_the_same_tokens_and_are_unlinked() {
    let ps = prompts(4);
    let want = generate(&mut monolithic(KvLayout::HND, true, Dtype::Bf16), &ps, 4);
    let mut cfg = config(KvLayout::HND, true, Dtype::Bf16);
    cfg.shm = Some("engine test".into());
    let mut e = Engine::new(cfg, None, FailurePolicy::Recompute).unwrap();
    let names: Vec<String> = e.regions().iter().map(|r| r.shm_name().unwrap().to_owned()).collect();
    assert_eq!(names.len(), 4);
    let on_disk = |n: &str| std::path::Path::new(&format!("/dev/shm{n}")).exists();
    assert!(names.iter().all(|n| on_disk(n)), "{names:?}");
    assert_eq!(generate(&mut e, &ps, 4), want);
    drop(e);
    assert!(names.iter().all(|n| !on_disk(n)), "{names:?}");
}

#[test]
fn fixture_config_reads_like_any_model() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/models/kvconnect--reference/config.json");
    let spec =
        kvconnect_api::ModelSpec::from_hf_config_json(&std::fs::read_to_string(path).unwrap()).unwrap();
    let e = monolithic(KvLayout::HND, true, Dtype::Bf16);
    assert_eq!(&spec, e.model_spec());
    // Sliding and full layers: HMA gives two KV cache groups, hence two block tables.
    assert_eq!(kvconnect_api::negotiate::kv_groups(&spec, true).len(), 2);
    assert_eq!(e.pool().num_groups(), 2);
}
