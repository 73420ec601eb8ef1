//! Producer and consumer at different tensor-parallel sizes, each rank its own connector
//! instance over its own rank's KV (as inside vLLM), over backend tcp: every consumer rank
//! ends with exactly its KV heads' bytes of the producer ranks holding them, and a producer
//! rank read by several consumer ranks frees its blocks only after the last.

use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::tp_ranks::{combine_finished, params_for_rank};
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorFactory, EffectiveLayout, FinishedTransfers, KvLayout, KvRole,
    MatchResult, ModelSpec, Request, RequestId, SchedulerConnector, StepInfo, WorkerConnector,
};
use kvconnect_bench::harness::{context, effective, model, Regions};
use kvconnect_nixl::NixlFactory;
use serde_json::{json, Map, Value};
use std::time::{Duration, Instant};

const HEADS: u32 = 4;
const BLOCK: u32 = 4;
const PROMPT: usize = 13;
const PBLOCKS: [u32; 4] = [3, 4, 5, 6];
const DBLOCKS: [u32; 4] = [9, 2, 7, 1];

/// One rank's connector: `rank` of `tp`, holding `HEADS / tp` heads of a 2-layer model.
struct Rank {
    sched: Box<dyn SchedulerConnector>,
    worker: Box<dyn WorkerConnector>,
    mem: Regions,
    model: ModelSpec,
    eff: EffectiveLayout,
    rank: u32,
    /// A producer rank's side channel, `host:port`.
    side_channel: String,
}

fn rank(role: KvRole, id: &str, rank: u32, tp: u32, port: u16) -> Rank {
    let whole = model(2, HEADS, 8);
    let m = whole.tp_shard(tp).unwrap();
    let eff = effective(&whole, KvLayout::HND, BLOCK);
    let extra = match role {
        KvRole::Consumer => json!({"backend": "tcp", "io_timeout": 2, "connect_timeout": 1}),
        _ => json!({"backend": "tcp", "io_timeout": 2, "side_channel_host": "127.0.0.1",
            "side_channel_port": port + rank as u16}),
    };
    let mut ctx = context(&m, &eff, role, id, extra);
    (ctx.tp_rank, ctx.tp_size) = (rank, tp);
    let sched = NixlFactory.create_scheduler(&ctx).unwrap();
    let mut worker = NixlFactory.create_worker(&ctx).unwrap();
    let mut mem = Regions::allocate(&m, &eff, 16, None).unwrap();
    // Distinct, position-dependent bytes, different on every rank, so a misplaced copy fails.
    for i in 0..mem.regions().len() {
        let salt = (id.len() as u32 * 31) ^ (rank * 977) ^ (i as u32 * 7);
        for (j, b) in mem.bytes_mut(i).iter_mut().enumerate() {
            *b = ((j as u32).wrapping_mul(2654435761).wrapping_add(salt) >> 13) as u8;
        }
    }
    worker.register_kv_caches(mem.regions()).unwrap();
    let side_channel = format!("127.0.0.1:{}", port + rank as u16);
    Rank { sched, worker, mem, model: m, eff, rank, side_channel }
}

fn blocks(ids: &[u32]) -> BlocksPerGroup {
    BlocksPerGroup(vec![ids.iter().map(|b| BlockId(*b)).collect()])
}

fn step() -> StepInfo {
    StepInfo { step: 1, scheduled: vec![], finished: vec![] }
}

/// Every producer rank finishes the request; the params as the scheduler process combines them.
fn prefill(ranks: &mut [Rank]) -> Map<String, Value> {
    let mut params = Map::new();
    params.insert("do_remote_decode".into(), json!(true));
    let r = Request { id: "req".into(), prompt_tokens: vec![7; PROMPT], kv_transfer_params: params };
    let each = ranks
        .iter_mut()
        .map(|p| {
            let f = p.sched.request_finished(&r, &blocks(&PBLOCKS)).unwrap();
            let meta = p.sched.build_connector_meta(&step()).unwrap();
            p.worker.bind_connector_meta(&meta).unwrap();
            f
        })
        .collect();
    combine_finished(each).transfer_params.unwrap()
}

/// Consumer rank `d` handshakes with every producer rank and starts the request's load.
fn decode_start(d: &mut Rank, ranks: usize, producers: &mut [Rank], params: &Map<String, Value>) {
    for p in producers.iter_mut() {
        // As the host's handshake names it: at the side channel the params carry.
        let meta = p.worker.handshake_metadata().unwrap().unwrap();
        let envelope = json!({"engine_id": "prefill", "peer": meta, "side_channel": p.side_channel});
        d.worker.set_peer_handshake_metadata(&envelope).unwrap();
    }
    let mine = params_for_rank(params, d.rank as usize, ranks).unwrap();
    let r = Request { id: "req".into(), prompt_tokens: vec![7; PROMPT], kv_transfer_params: mine };
    let m = d.sched.get_num_new_matched_tokens(&r, 0).unwrap();
    assert_eq!(m, MatchResult::Matched { tokens: PROMPT - 1, async_load: true });
    d.sched.update_state_after_alloc(&r, &blocks(&DBLOCKS), PROMPT - 1).unwrap();
    let meta = d.sched.build_connector_meta(&step()).unwrap();
    d.worker.bind_connector_meta(&meta).unwrap();
    d.worker.start_load_kv().unwrap();
}

fn finished(w: &mut dyn WorkerConnector, pred: impl Fn(&FinishedTransfers) -> bool) -> FinishedTransfers {
    let t0 = Instant::now();
    let mut acc = FinishedTransfers::default();
    while t0.elapsed() < Duration::from_secs(15) {
        let f = w.get_finished(&[]).unwrap();
        acc.finished_sending.extend(f.finished_sending);
        acc.finished_recving.extend(f.finished_recving);
        acc.failed_recving.extend(f.failed_recving);
        if pred(&acc) {
            return acc;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("timed out waiting; got {acc:?}")
}

/// The two bytes of (layer, part, token, global head, channel) on `r`, which must hold the head.
fn element(r: &mut Rank, ids: &[u32], layer: u32, part: u32, t: usize, head: u32, c: u32) -> [u8; 2] {
    let shape = BlockShape::of(&r.model, &r.eff);
    let regions = r
        .mem
        .regions()
        .iter()
        .map(|x| RegionShape { layers: x.layers().to_vec(), num_blocks: x.num_blocks() })
        .collect();
    let g = Geometry::new(shape, r.eff.layout, regions);
    let s = g.span(kvconnect_api::LayerId(layer), part, BlockId(ids[t / BLOCK as usize])).unwrap();
    let at = s.offset + g.inner_offset(head - r.rank * shape.heads, (t % BLOCK as usize) as u32, c);
    let b = r.mem.bytes_mut(s.region);
    [b[at], b[at + 1]]
}

/// Every loaded element of every consumer rank equals the producer rank's holding its head.
fn assert_heads_moved(producers: &mut [Rank], consumers: &mut [Rank]) {
    let (pheads, dheads) = (HEADS / producers.len() as u32, HEADS / consumers.len() as u32);
    let mut checked = 0;
    for head in 0..HEADS {
        let (p, d) = (&mut producers[(head / pheads) as usize], &mut consumers[(head / dheads) as usize]);
        for layer in 0..2 {
            for part in 0..2 {
                for t in 0..PROMPT - 1 {
                    for c in 0..8 {
                        let want = element(p, &PBLOCKS, layer, part, t, head, c);
                        let got = element(d, &DBLOCKS, layer, part, t, head, c);
                        assert_eq!(got, want, "head {head} layer {layer} part {part} token {t} channel {c}");
                        checked += 1;
                    }
                }
            }
        }
    }
    assert_eq!(checked, HEADS as usize * 2 * 2 * (PROMPT - 1) * 8);
}

fn cross(ptp: u32, dtp: u32, port: u16) {
    let mut producers: Vec<Rank> =
        (0..ptp).map(|r| rank(KvRole::Producer, "prefill", r, ptp, port)).collect();
    let mut consumers: Vec<Rank> = (0..dtp).map(|r| rank(KvRole::Consumer, "decode", r, dtp, 0)).collect();
    let params = prefill(&mut producers);
    for d in consumers.iter_mut() {
        decode_start(d, dtp as usize, &mut producers, &params);
    }
    for d in consumers.iter_mut() {
        let f =
            finished(d.worker.as_mut(), |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty());
        assert_eq!((f.finished_recving, f.failed_recving), (vec![RequestId::from("req")], vec![]));
    }
    assert_heads_moved(&mut producers, &mut consumers);
    for p in producers.iter_mut() {
        let f = finished(p.worker.as_mut(), |f| !f.finished_sending.is_empty());
        assert_eq!(f.finished_sending, vec![RequestId::from("req")]);
    }
}

#[test]
fn tp2_to_tp1_reads_each_heads_half_from_its_producer_rank() {
    cross(2, 1, 5710);
}

#[test]
fn tp1_to_tp2_ranks_share_one_producer_block_set() {
    cross(1, 2, 5720);
}

#[test]
fn tp4_to_tp2_and_tp2_to_tp4() {
    cross(4, 2, 5730);
    cross(2, 4, 5740);
}

#[test]
fn a_producer_rank_read_by_two_keeps_its_blocks_until_the_second_is_done() {
    let mut producers = vec![rank(KvRole::Producer, "prefill", 0, 1, 5750)];
    let mut consumers: Vec<Rank> = (0..2).map(|r| rank(KvRole::Consumer, "decode", r, 2, 0)).collect();
    let params = prefill(&mut producers);
    decode_start(&mut consumers[0], 2, &mut producers, &params);
    let f = finished(consumers[0].worker.as_mut(), |f| !f.finished_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("req")]);
    // The first reader is done; the blocks stay held for the second.
    std::thread::sleep(Duration::from_millis(200));
    assert!(producers[0].worker.get_finished(&[]).unwrap().finished_sending.is_empty());
    decode_start(&mut consumers[1], 2, &mut producers, &params);
    let f = finished(consumers[1].worker.as_mut(), |f| !f.finished_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("req")]);
    assert_heads_moved(&mut producers, &mut consumers);
    let f = finished(producers[0].worker.as_mut(), |f| !f.finished_sending.is_empty());
    assert_eq!(f.finished_sending, vec![RequestId::from("req")]);
}
