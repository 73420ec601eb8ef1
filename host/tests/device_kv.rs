//! KV caches in GPU memory (`kv_buffer_device = "cuda"`): a prefill engine and a decode engine
//! whose connectors see device regions, KV moved by the nixl connector's cuda_ipc backend
//! (one gather kernel per request), give exactly the monolithic tokens, with and without an
//! NHD->HND permute fused into the copy. Needs a GPU: skips, saying so, where there is none.
#![cfg(feature = "cuda")]

use kvconnect_api::{ConnectorFactory, Dtype, FailurePolicy, KvLayout, KvRole, MemoryKind};
use kvconnect_bench::harness::context;
use kvconnect_engine::{
    local_effective_layout, Engine, EngineConfig, FinishReason, GenRequest, ReferenceConfig,
};
use kvconnect_nixl::NixlFactory;
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const SEED: u64 = 1234;

fn have_gpu() -> bool {
    match kvconnect_cuda::Gpu::open(0) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipping: no GPU ({e})");
            false
        }
    }
}

fn config(layout: KvLayout, memory: MemoryKind) -> EngineConfig {
    let model = ReferenceConfig::builtin().unwrap();
    let spec = model.model_spec().unwrap();
    let mut effective = local_effective_layout(&spec, layout, true, 16, Dtype::Bf16);
    effective.memory = memory;
    EngineConfig { effective, model, num_blocks: 512, seed: SEED, shm: None, tp_size: 1 }
}

fn engine(role: KvRole, id: &str, layout: KvLayout) -> Engine {
    let cfg = config(layout, MemoryKind::Device);
    let spec = cfg.model.model_spec().unwrap();
    let ctx = context(
        &spec,
        &cfg.effective,
        role,
        id,
        json!({"backend": "cuda_ipc", "side_channel_host": "127.0.0.1", "side_channel_port": 5600}),
    );
    let conn = (NixlFactory.create_scheduler(&ctx).unwrap(), NixlFactory.create_worker(&ctx).unwrap());
    Engine::new(cfg, Some(conn), FailurePolicy::Fail).unwrap()
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    let text = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. ";
    let lens = [1usize, 2, 15, 16, 17, 31, 33, 48, 49, 65, 90, 150];
    (0..n)
        .map(|i| {
            let len = lens[i % lens.len()] + (i / lens.len()) * 3;
            text.bytes().cycle().skip(i * 7).take(len).map(u32::from).collect()
        })
        .collect()
}

fn monolithic(ps: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    let mut e = Engine::new(config(KvLayout::HND, MemoryKind::Host), None, FailurePolicy::Fail).unwrap();
    for (i, p) in ps.iter().enumerate() {
        e.add_request(GenRequest::new(format!("r{i}"), p.clone(), max_tokens)).unwrap();
    }
    e.run_to_completion(100_000).unwrap().into_iter().map(|c| c.tokens).collect()
}

fn check(play: KvLayout, dlay: KvLayout) {
    if !have_gpu() {
        return;
    }
    let ps = prompts(24);
    let mono = monolithic(&ps, 4);
    let mut p = engine(KvRole::Producer, "prefill-0", play);
    let mut d = engine(KvRole::Consumer, "decode-0", dlay);
    assert!(p.regions().iter().all(|r| r.memory() == MemoryKind::Device && r.device() >= 0));
    let meta = p.worker_connector().unwrap().handshake_metadata().unwrap().unwrap();
    d.worker_connector()
        .unwrap()
        .set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta}))
        .unwrap();
    for (i, pr) in ps.iter().enumerate() {
        let mut r = GenRequest::new(format!("r{i}"), pr.clone(), 1);
        r.kv_transfer_params.insert("do_remote_decode".into(), json!(true));
        p.add_request(r).unwrap();
    }
    let pre = p.run_to_completion(100_000).unwrap();
    for c in &pre {
        let params = c.kv_transfer_params.clone().expect("prefill returns transfer params");
        let i: usize = c.id[1..].parse().unwrap();
        d.add_request(GenRequest {
            id: c.id.clone(),
            prompt: ps[i].clone(),
            max_tokens: 4,
            kv_transfer_params: params,
            sampling: Default::default(),
        })
        .unwrap();
    }
    // The producer keeps stepping while decode pulls from it, as a server does: the
    // requests it finished in its last step reach its connector (which then holds their blocks
    // for decode) only in the step after, and decode's "done" frees them later still.
    let stop = AtomicBool::new(false);
    let dec = std::thread::scope(|s| {
        let producer = s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                p.step().unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let dec = d.run_to_completion(100_000);
        stop.store(true, Ordering::Relaxed);
        producer.join().unwrap();
        dec
    })
    .unwrap();
    assert_eq!(dec.len(), ps.len());
    for c in &dec {
        let i: usize = c.id[1..].parse().unwrap();
        assert_eq!(c.finish, FinishReason::Length, "{}", c.id);
        assert_eq!(
            c.tokens,
            mono[i],
            "prompt {i} (len {}): disaggregated over device KV != monolithic",
            ps[i].len()
        );
        assert_eq!(
            c.num_external_tokens,
            ps[i].len() - 1,
            "prompt {i}: all but the last prompt token loaded"
        );
    }
    let t0 = Instant::now();
    while !p.pending_frees().is_empty() && t0.elapsed() < Duration::from_secs(10) {
        p.step().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(p.free_blocks(), p.total_blocks(), "prefill pool back to full");
    assert_eq!(d.free_blocks(), d.total_blocks(), "decode pool back to full");
}

#[test]
fn device_kv_over_cuda_ipc_equals_monolithic() {
    check(KvLayout::HND, KvLayout::HND);
}

#[test]
fn device_kv_with_fused_nhd_to_hnd_permute_equals_monolithic() {
    check(KvLayout::NHD, KvLayout::HND);
}
