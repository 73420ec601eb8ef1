//! The flexkv connector through its two halves, in vLLM's call order, over real host
//! regions: prefix hits, CPU->SSD eviction, SSD corruption, the HND transpose adapter and
//! bad input.

#![allow(unsafe_code)] // Tests vouch for their own KV buffers as regions (KvRegion::new).

mod support;

use kvconnect_api::{BlockId, BlocksPerGroup, ConnectorFactory, KvLayout, KvRole, MatchResult, Request};
use kvconnect_flexkv::factory::Engine;
use kvconnect_flexkv::FlexkvFactory;
use serde_json::json;
use support::*;

/// Bytes one block of every KV layer takes in the test model (2 layers x K,V x 2x4x8 bf16).
const SLOT: f64 = 512.0;

fn gb(blocks: f64) -> f64 {
    blocks * SLOT / (1u64 << 30) as f64
}

#[test]
fn prefix_hits_of_every_length_at_block_granularity() {
    let mut sim = Sim::new(effective(KvLayout::NHD), json!({"cpu_cache_gb": gb(64.0)}), "prefix", 64);
    let base = tokens(1, 8 * BS + 1);
    let first = sim.run("base", &base);
    assert_eq!(first.matched, 0);
    assert!(first.delayed, "the save holds the blocks until it is done");
    for k in 0..=8 {
        // Shares k full blocks, then diverges inside block k.
        let mut p = base[..k * BS].to_vec();
        p.extend(tokens(100 + k as u32, 2 * BS + 1));
        assert_eq!(sim.lookup(&p), k * BS, "shared {k} blocks");
        if k == 8 {
            continue;
        }
        // A partial block of agreement adds nothing.
        let mut q = base[..k * BS + 2].to_vec();
        q.extend(tokens(200 + k as u32, BS));
        assert_eq!(sim.lookup(&q), k * BS, "shared {k} blocks and 2 tokens");
    }
    // The whole prompt cached: one token is left to compute.
    assert_eq!(sim.lookup(&base[..8 * BS]), 7 * BS);
    assert_eq!(sim.lookup(&base), 8 * BS);
    // Loading every prefix length gives the exact KV.
    for k in 1..=8 {
        let mut p = base[..k * BS].to_vec();
        p.extend(tokens(300 + k as u32, 3));
        let o = sim.run(&format!("r{k}"), &p);
        assert_eq!(o.matched, k * BS);
        assert!(!o.load_failed && o.wrong_blocks.is_empty(), "{o:?}");
    }
}

#[test]
fn cpu_evicts_to_ssd_and_ssd_hits_load_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let extra = json!({
        "cpu_cache_gb": gb(4.0),
        "ssd_cache_gb": 64.0 * 8192.0 / (1u64 << 30) as f64,
        "ssd_cache_dir": dir.path().join("ssd"),
        "enable_ssd_promotion": false,
    });
    let mut sim = Sim::new(effective(KvLayout::NHD), extra.clone(), "evict", 64);
    let a = tokens(1, 4 * BS + 1);
    let b = tokens(2, 4 * BS + 1);
    sim.run("a", &a);
    sim.run("b", &b);
    let cache = Engine::open(&ctx(effective(KvLayout::NHD), extra, "evict")).unwrap().cache;
    let st = cache.stats();
    assert_eq!(st.demoted, 4, "{st:?}");
    assert_eq!(cache.sizes(), (8, 4, 4));
    let o = sim.run("a2", &a);
    assert_eq!(o.matched, 4 * BS);
    assert!(!o.load_failed && o.wrong_blocks.is_empty(), "{o:?}");
    assert_eq!(cache.stats().ssd_hits, 4);
    // No promotion: still on SSD only.
    let o = sim.run("a3", &a);
    assert!(o.wrong_blocks.is_empty());
    assert_eq!(cache.stats().ssd_hits, 8);
    assert_eq!(cache.stats().promoted, 0);
}

#[test]
fn ssd_promotion_brings_hits_back_to_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let extra = json!({
        "cpu_cache_gb": gb(4.0),
        "ssd_cache_gb": 64.0 * 8192.0 / (1u64 << 30) as f64,
        "ssd_cache_dir": dir.path(),
    });
    let mut sim = Sim::new(effective(KvLayout::NHD), extra.clone(), "promote", 64);
    let a = tokens(1, 2 * BS + 1);
    let b = tokens(2, 4 * BS + 1);
    sim.run("a", &a);
    sim.run("b", &b);
    let cache = Engine::open(&ctx(effective(KvLayout::NHD), extra, "promote")).unwrap().cache;
    assert_eq!(cache.stats().demoted, 2);
    let o = sim.run("a2", &a);
    assert!(o.wrong_blocks.is_empty() && o.matched == 2 * BS, "{o:?}");
    let st = cache.stats();
    assert_eq!((st.ssd_hits, st.promoted), (2, 2), "{st:?}");
    sim.run("a3", &a);
    assert_eq!(cache.stats().cpu_hits, 2);
}

#[test]
fn a_corrupted_ssd_block_fails_the_load_loads_nothing_wrong_and_then_misses() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let extra = json!({
        "cpu_cache_gb": gb(2.0),
        "ssd_cache_gb": 64.0 * 8192.0 / (1u64 << 30) as f64,
        "ssd_cache_dir": dir.path(),
        "enable_ssd_promotion": false,
    });
    let mut sim = Sim::new(effective(KvLayout::NHD), extra.clone(), "corrupt", 64);
    let a = tokens(1, 3 * BS + 1);
    let b = tokens(2, 2 * BS + 1);
    sim.run("a", &a);
    sim.run("b", &b);
    let cache = Engine::open(&ctx(effective(KvLayout::NHD), extra.clone(), "corrupt")).unwrap().cache;
    assert_eq!(cache.sizes(), (5, 2, 3));
    // Eviction order with 2 CPU slots: a1 (record 0, while a2 was saved), a0 (record 1,
    // for b0), a2 (record 2, for b1).
    let seed = Engine::open(&ctx(effective(KvLayout::NHD), extra.clone(), "corrupt")).unwrap().seed;
    let hashes = kvconnect_flexkv::hash::block_hashes(seed, &a, BS);
    assert!(hashes.iter().all(|h| cache.locate(*h) == Some((false, true, 0))));
    let path = cache.ssd().unwrap().path().to_path_buf();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    // Record 0 (a's middle block): flip two payload bytes.
    f.write_all_at(&[0x5a, 0xa5], 4096 + 100).unwrap();
    let o = sim.run_opts("a2", &a, false);
    assert_eq!(o.matched, 3 * BS);
    assert!(o.load_failed, "{o:?}");
    assert!(o.wrong_blocks.is_empty(), "the block before the corrupt one is exact: {o:?}");
    assert_eq!(o.error_blocks.len(), 2, "the corrupt block and the one after it: {o:?}");
    assert_eq!(cache.stats().ssd_corrupt, 1);
    // The corrupt block is gone from the index: the next lookup stops before it.
    assert_eq!(sim.lookup(&a), BS);
    // Recomputing re-caches it, and then it loads exactly.
    let o = sim.run("a3", &a);
    assert_eq!(o.matched, BS);
    assert!(!o.load_failed && o.wrong_blocks.is_empty(), "{o:?}");
    let o = sim.run("a4", &a);
    assert_eq!(o.matched, 3 * BS);
    assert!(!o.load_failed && o.wrong_blocks.is_empty(), "{o:?}");
}

#[test]
fn hnd_deployment_is_adapted_by_transpose_exactly() {
    let eff = negotiated_with_hnd_transport();
    let extra = json!({"cpu_cache_gb": gb(64.0)});
    let mut sim = Sim::new(eff.clone(), extra.clone(), "hnd", 64);
    let a = tokens(7, 5 * BS + 3);
    sim.run("a", &a);
    // Stored form: NHD, element by element.
    let engine = Engine::open(&ctx(eff.clone(), extra, "hnd")).unwrap();
    assert!(engine.adapter.transposes());
    let hashes = kvconnect_flexkv::hash::block_hashes(engine.seed, &a, BS);
    let nhd = kvconnect_api::geometry::Geometry::new(
        kvconnect_api::geometry::BlockShape::of(&model(), &eff),
        KvLayout::NHD,
        vec![],
    );
    let sub = (HEADS * BS as u32 * DIM * 2) as usize;
    for (i, h) in hashes.iter().enumerate() {
        let mut stored = Vec::new();
        engine
            .cache
            .load(*h, &mut Vec::new(), |b| {
                stored = b.to_vec();
                Ok(())
            })
            .unwrap();
        for (li, layer) in [0u32, 2].iter().enumerate() {
            for part in 0..2u32 {
                let base = (li * 2 + part as usize) * sub;
                for hd in 0..HEADS {
                    for n in 0..BS as u32 {
                        for c in 0..DIM {
                            let o = base + nhd.inner_offset(hd, n, c);
                            assert_eq!(
                                stored[o..o + 2],
                                kv_value(&a[..(i + 1) * BS], *layer, part, hd, n, c),
                                "block {i} layer {layer} part {part} ({hd},{n},{c})"
                            );
                        }
                    }
                }
            }
        }
    }
    // Saved from HND regions, loaded back into HND regions: exact.
    let o = sim.run("a2", &a);
    assert_eq!(o.matched, 5 * BS);
    assert!(!o.load_failed && o.wrong_blocks.is_empty(), "{o:?}");
}

#[test]
fn opaque_blocks_are_stored_and_loaded_whole() {
    let eff = negotiated_over_opaque_blocks();
    let extra = json!({"cpu_cache_gb": gb(64.0)});
    let mut sim = Sim::new(eff.clone(), extra.clone(), "opaque", 64);
    let a = tokens(11, 5 * BS + 3);
    sim.run("a", &a);
    // Stored form: each block's K and V spans of every layer, byte for byte as the engine
    // wrote them, never transposed.
    let engine = Engine::open(&ctx(eff.clone(), extra, "opaque")).unwrap();
    assert!(!engine.adapter.transposes());
    let sub = (HEADS * BS as u32 * DIM * 2) as usize;
    let mut want = vec![0u8; 4 * sub];
    for (li, layer) in [0u32, 2].iter().enumerate() {
        for part in 0..2u32 {
            let base = (li * 2 + part as usize) * sub;
            for h in 0..HEADS {
                for n in 0..BS as u32 {
                    for c in 0..DIM {
                        // Where the engine's own layout puts the element: HND, not flexkv's NHD.
                        let o = base + sim.geo.inner_offset(h, n, c);
                        want[o..o + 2].copy_from_slice(&kv_value(&a[..BS], *layer, part, h, n, c));
                    }
                }
            }
        }
    }
    let hashes = kvconnect_flexkv::hash::block_hashes(engine.seed, &a, BS);
    let mut stored = Vec::new();
    engine
        .cache
        .load(hashes[0], &mut Vec::new(), |b| {
            stored = b.to_vec();
            Ok(())
        })
        .unwrap();
    assert_eq!(stored, want, "stored whole");
    // Loaded back into other blocks of the same engine: exact.
    let o = sim.run("a2", &a);
    assert_eq!(o.matched, 5 * BS);
    assert!(!o.load_failed && o.wrong_blocks.is_empty(), "{o:?}");
    // An engine over a known layout keys its blocks apart: it never reads opaque bytes.
    let known =
        Engine::open(&ctx(negotiated_with_hnd_transport(), json!({"cpu_cache_gb": gb(64.0)}), "opaque"));
    assert!(known.is_err() || known.unwrap().seed != engine.seed);
}

#[test]
fn both_halves_share_one_cache_per_engine_id() {
    let extra = json!({"cpu_cache_gb": gb(8.0)});
    let mut a = Sim::new(effective(KvLayout::NHD), extra.clone(), "share-a", 16);
    let mut b = Sim::new(effective(KvLayout::NHD), extra, "share-b", 16);
    let p = tokens(3, 2 * BS + 1);
    a.run("x", &p);
    assert_eq!(a.lookup(&p), 2 * BS);
    assert_eq!(b.lookup(&p), 0, "another engine has its own cache");
}

#[test]
fn bad_settings_are_clear_errors() {
    let f = FlexkvFactory;
    let eff = effective(KvLayout::NHD);
    let err = |extra: serde_json::Value, id: &str| {
        f.create_worker(&ctx(eff.clone(), extra, id)).err().map(|e| e.to_string()).unwrap_or_default()
    };
    let e = err(json!({"cpu_cache_gb": 0}), "bad0");
    assert!(e.contains("cpu_cache_gb is 0"), "{e}");
    let e = err(json!({"cpu_cache_gb": 1e-12}), "bad1");
    assert_eq!(
        e,
        "connector 'flexkv': invalid config: cpu_cache_gb = 0.000000000001 holds no block: one block of every \
         KV layer is 512 bytes; raise cpu_cache_gb to at least 0.000001"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let e = err(json!({"ssd_cache_gb": 1, "ssd_cache_dir": file.join("ssd")}), "bad2");
    assert!(e.contains("point ssd_cache_dir at a writable directory"), "{e}");
    let e = err(json!({"ssd_cache_gb": 1e-9, "ssd_cache_dir": dir.path()}), "bad3");
    assert!(e.contains("holds no block"), "{e}");
    let e = err(json!({"num_transfer_threads": "many"}), "bad4");
    assert!(e.contains("num_transfer_threads"), "{e}");
    // Capabilities read the config too.
    let mut cfg = kvconnect_api::KvTransferConfig::named("flexkv");
    cfg.kv_connector_extra_config = json!({"ssd_cache_gb": 1}).as_object().cloned().unwrap();
    let e = f.capabilities(&cfg, None).unwrap_err().to_string();
    assert!(e.contains("ssd_cache_dir is not set"), "{e}");
}

#[test]
fn bad_metadata_and_missing_regions_are_errors_not_panics() {
    let c = ctx(effective(KvLayout::NHD), json!({}), "badmeta");
    let mut w = FlexkvFactory.create_worker(&c).unwrap();
    let e = w.bind_connector_meta(b"{not json").unwrap_err().to_string();
    assert!(e.contains("not flexkv metadata"), "{e}");
    let e = w.register_kv_caches(&[]).unwrap_err().to_string();
    assert!(e.contains("no registered region covers it"), "{e}");
    let mut hma = effective(KvLayout::NHD);
    hma.groups.push(hma.groups[0].clone());
    let e = FlexkvFactory.create_scheduler(&ctx(hma, json!({}), "badhma")).err().unwrap().to_string();
    assert!(e.contains("hybrid_kv_cache_manager=off"), "{e}");
}

/// Device regions: without the `cuda` feature the error says how to rebuild; with it and no
/// usable GPU here, the error names the cause (never a panic).
#[test]
fn device_regions_without_cuda_or_a_gpu() {
    let c = ctx(effective(KvLayout::NHD), json!({}), "device-regions");
    let mut w = FlexkvFactory.create_worker(&c).unwrap();
    let region = |l: u32| {
        // SAFETY: fake device addresses: the worker refuses them, or, on a machine with a GPU, only
        // records them and is dropped without a transfer.
        unsafe {
            kvconnect_api::KvRegion::new(kvconnect_api::KvRegionSpec {
                name: format!("layer.{l}"),
                addr: 0x10000,
                len: 8 * 512 / 2,
                memory: kvconnect_api::MemoryKind::Device,
                device: 0,
                layers: vec![kvconnect_api::LayerId(l)],
                group: 0,
                num_blocks: 8,
                shm_name: None,
            })
        }
    };
    match (w.register_kv_caches(&[region(0), region(2)]), cfg!(feature = "cuda")) {
        (Err(e), true) => {
            let e = e.to_string();
            assert!(e.contains("device KV regions cannot be staged"), "{e}");
        }
        (Err(e), false) => {
            let e = e.to_string();
            assert!(e.contains("built without its `cuda` feature") && e.contains("kv_buffer_device"), "{e}");
        }
        // A machine with a GPU: the fake addresses are never touched at registration.
        (Ok(()), true) => {}
        (Ok(()), false) => panic!("device regions accepted without the cuda feature"),
    }
}

#[test]
fn a_full_disk_is_counted_and_nothing_wrong_is_loaded() {
    if !std::path::Path::new("/dev/full").exists() {
        eprintln!("skipping: /dev/full is not available");
        return;
    }
    let extra = json!({"cpu_cache_gb": gb(2.0), "ssd_cache_gb": 1, "ssd_cache_dir": "/dev/full"});
    let mut sim = Sim::new(effective(KvLayout::NHD), extra.clone(), "full", 32);
    let a = tokens(1, 2 * BS + 1);
    let b = tokens(2, 2 * BS + 1);
    sim.run("a", &a);
    sim.run("b", &b);
    let cache = Engine::open(&ctx(effective(KvLayout::NHD), extra, "full")).unwrap().cache;
    assert!(cache.stats().ssd_write_errors >= 1, "{:?}", cache.stats());
    assert_eq!(cache.sizes().2, 0, "nothing is kept on a full disk");
    for (id, p) in [("a2", &a), ("b2", &b)] {
        let o = sim.run(id, p);
        assert!(!o.load_failed && o.wrong_blocks.is_empty(), "{id}: {o:?}");
    }
}

#[test]
fn a_prefix_the_engine_already_has_is_not_loaded_again() {
    let mut sim = Sim::new(effective(KvLayout::NHD), json!({"cpu_cache_gb": gb(64.0)}), "local-prefix", 64);
    let a = tokens(5, 6 * BS + 1);
    sim.run("a", &a);
    // The engine computed (or had cached) the first 2 blocks itself.
    let req = Request { id: "b".into(), prompt_tokens: a.clone(), kv_transfer_params: Default::default() };
    let m = sim.sched.get_num_new_matched_tokens(&req, 2 * BS).unwrap();
    assert_eq!(m, MatchResult::Matched { tokens: 4 * BS, async_load: true });
    let blocks: Vec<BlockId> = (50..57).map(BlockId).collect();
    for b in &blocks {
        sim.fill_block(*b, 0xab);
    }
    sim.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![blocks.clone()]), 4 * BS).unwrap();
    sim.meta(&[]);
    sim.worker.start_load_kv().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let f = sim.worker.get_finished(&[]).unwrap();
        assert!(f.failed_recving.is_empty(), "{f:?}");
        if f.finished_recving.contains(&req.id) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "load never finished");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(
        sim.block_all(blocks[0], 0xab) && sim.block_all(blocks[1], 0xab),
        "the engine's own blocks were written"
    );
    for i in 2..6 {
        assert!(sim.block_is(blocks[i], &a[..(i + 1) * BS]), "block {i} not loaded exactly");
    }
    assert!(sim.block_all(blocks[6], 0xab), "the block left to compute was written");
    // A lookup that asks from past everything cached promises nothing and holds nothing.
    let m = sim.sched.get_num_new_matched_tokens(&req, 6 * BS).unwrap();
    assert_eq!(m, MatchResult::Matched { tokens: 0, async_load: false });
    // Every reference taken by lookups and loads was given back.
    let engine =
        Engine::open(&ctx(effective(KvLayout::NHD), json!({"cpu_cache_gb": gb(64.0)}), "local-prefix"))
            .unwrap();
    for h in kvconnect_flexkv::hash::block_hashes(engine.seed, &a, BS) {
        assert_eq!(engine.cache.locate(h), Some((true, false, 0)));
    }
}

#[test]
fn every_declared_role_saves_and_loads() {
    // The capabilities declare kv_producer, kv_consumer and kv_both: a cache on prefill, on
    // decode or on one engine stores what it computes and serves it back alike.
    for role in [KvRole::Producer, KvRole::Consumer, KvRole::Both] {
        let mut c =
            ctx(effective(KvLayout::NHD), json!({"cpu_cache_gb": gb(16.0)}), &format!("role-{role:?}"));
        c.role = role;
        c.config.kv_role = Some(role);
        let mut sim = Sim::with_ctx(c, 32);
        let p = tokens(40, 3 * BS + 2);
        assert_eq!(sim.run("a", &p).matched, 0, "{role:?}: cold cache");
        let o = sim.run("b", &p);
        assert_eq!(o.matched, 3 * BS, "{role:?}");
        assert!(!o.load_failed && o.wrong_blocks.is_empty(), "{role:?}: {o:?}");
    }
}

#[test]
fn two_engines_share_one_ssd_cache_dir_each_in_a_private_subdirectory() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    let extra = json!({
        "cpu_cache_gb": gb(4.0),
        "ssd_cache_gb": 64.0 * 8192.0 / (1u64 << 30) as f64,
        "ssd_cache_dir": ssd,
        "enable_ssd_promotion": false,
    });
    let mut one = Sim::new(effective(KvLayout::NHD), extra.clone(), "share-a", 64);
    let mut two = Sim::new(effective(KvLayout::NHD), extra, "share-b", 64);
    let (a, b) = (tokens(11, 4 * BS + 1), tokens(12, 4 * BS + 1));
    for sim in [&mut one, &mut two] {
        sim.run("a", &a);
        sim.run("b", &b); // evicts a's blocks to the SSD tier
        let o = sim.run("a2", &a);
        assert_eq!(o.matched, 4 * BS);
        assert!(!o.load_failed && o.wrong_blocks.is_empty(), "{o:?}");
    }
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&ssd), 0o700);
    let subs: Vec<_> = std::fs::read_dir(&ssd).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(subs.len(), 2, "{subs:?}");
    for s in &subs {
        let name = s.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("flexkv-share-a-") || name.starts_with("flexkv-share-b-"), "{name}");
        assert_eq!((mode(s), mode(&s.join("tier.ssd"))), (0o700, 0o600));
    }
}

/// Computes `prompt` into fresh blocks in one step, as the engine does, up to the point where
/// its saves are queued (`bind_connector_meta`); returns the request and its blocks.
fn compute_until_saves_queued(sim: &mut Sim, id: &str, prompt: &[u32]) -> (Request, Vec<BlockId>) {
    let req =
        Request { id: id.into(), prompt_tokens: prompt.to_vec(), kv_transfer_params: Default::default() };
    assert_eq!(
        sim.sched.get_num_new_matched_tokens(&req, 0).unwrap(),
        MatchResult::Matched { tokens: 0, async_load: false }
    );
    let blocks: Vec<BlockId> =
        (0..prompt.len().div_ceil(BS)).map(|_| BlockId(sim.free.pop().unwrap())).collect();
    sim.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![blocks.clone()]), 0).unwrap();
    for (i, b) in blocks.iter().enumerate() {
        sim.write_block(*b, &prompt[..((i + 1) * BS).min(prompt.len())]);
    }
    sim.meta(std::slice::from_ref(&req.id));
    sim.worker.start_load_kv().unwrap();
    (req, blocks)
}

#[test]
fn a_preempted_requests_saves_in_flight_finish_before_its_blocks_are_reused() {
    let mut sim = Sim::new(effective(KvLayout::NHD), json!({"cpu_cache_gb": gb(64.0)}), "preempt", 64);
    let prompt = tokens(5, 6 * BS + 1);
    let (req, blocks) = compute_until_saves_queued(&mut sim, "a", &prompt);
    sim.worker.wait_for_save().unwrap(); // the saves run on the transfer threads now
    sim.worker.handle_preemptions(std::slice::from_ref(&req.id)).unwrap();
    // The engine frees the blocks and the next forward overwrites them.
    for b in &blocks {
        sim.fill_block(*b, 0xAB);
    }
    let again = sim.run("b", &prompt);
    assert_eq!(again.matched, 6 * BS, "every full block was stored before the blocks were reused");
    assert!(
        again.wrong_blocks.is_empty(),
        "blocks {:?} hold the overwrite, not the prompt's KV",
        again.wrong_blocks
    );
}

#[test]
fn a_preempted_requests_queued_saves_are_dropped_and_it_still_finishes() {
    let mut sim = Sim::new(effective(KvLayout::NHD), json!({"cpu_cache_gb": gb(64.0)}), "preempt-queued", 64);
    let prompt = tokens(6, 4 * BS + 1);
    let (req, blocks) = compute_until_saves_queued(&mut sim, "a", &prompt);
    // Preempted before this step's saves were submitted: they would read reused blocks.
    sim.worker.handle_preemptions(std::slice::from_ref(&req.id)).unwrap();
    for b in &blocks {
        sim.fill_block(*b, 0xAB);
    }
    sim.worker.wait_for_save().unwrap();
    assert_eq!(sim.lookup(&prompt), 0, "nothing of the preempted request was stored");
    // Its save count went back to zero: finishing it reports it finished sending at once,
    // so its blocks are not held forever.
    sim.sched.request_finished(&req, &BlocksPerGroup(vec![blocks])).unwrap();
    let f = sim.worker.get_finished(std::slice::from_ref(&req.id)).unwrap();
    assert_eq!(f.finished_sending, vec![req.id.clone()]);
}
