//! Store a prompt and look it up again through the real scheduler/worker flow, over host
//! buffers registered as regions: matched tokens, loaded bytes, layouts, block sizes.

mod common;

use common::*;
use kvconnect_api::{KvLayout, KvRole};
use serde_json::json;

const CHUNK: usize = 32;

fn round_trip(layout: KvLayout, block_size: u32, layerwise: bool) {
    let id = format!("flow-{}-{block_size}-{layerwise}", layout.canonical_name());
    let mut e =
        Engine::new(&id, layout, block_size, json!({"chunk_size": CHUNK, "use_layerwise": layerwise}));
    let p = prompt(1, 2 * CHUNK + 9); // two full chunks and 9 tokens more
    let (m, _, errs) = e.run("a", &p, 0);
    assert_eq!((m, errs.len()), (0, 0), "cold cache");
    let s = kvconnect_lmcache::stats(&id).unwrap();
    assert_eq!(s.chunks_saved, 2, "the partial chunk is not saved without save_unfull_chunk");
    assert_eq!(s.cpu.bytes_stored, 2 * chunk_bytes(CHUNK) as u64);

    // The same prompt: both full chunks; the 9 tokens after them are computed.
    e.zero();
    let (m, blocks, errs) = e.load_only("b", &p);
    assert_eq!(m, 2 * CHUNK);
    assert!(errs.is_empty());
    assert_eq!(e.mismatches(&p, &blocks, 0, m), Vec::<usize>::new(), "loaded bytes are the saved bytes");
    assert!(e.all_zero(&blocks, m, p.len()), "nothing past the match is written");

    // A longer prompt extending it: the same two chunks.
    let mut longer = p.clone();
    longer.extend(prompt(9, 100));
    e.zero();
    let (m, blocks, _) = e.load_only("c", &longer);
    assert_eq!(m, 2 * CHUNK);
    assert!(e.mismatches(&longer, &blocks, 0, m).is_empty());

    // A chunk-aligned prompt fully stored matches all but its last token.
    let exact = &p[..2 * CHUNK];
    e.zero();
    let (m, blocks, _) = e.load_only("d", exact);
    assert_eq!(m, 2 * CHUNK - 1);
    assert!(e.mismatches(exact, &blocks, 0, m).is_empty());
    assert!(e.all_zero(&blocks, m, exact.len()), "the last token is left for the engine");

    // A prompt that differs in its first chunk matches nothing.
    let mut other = p.clone();
    other[0] += 1;
    assert_eq!(e.lookup(&request("e", &other), 0), 0);

    let s = kvconnect_lmcache::stats(&id).unwrap();
    assert_eq!(s.hits, 6, "2 chunks x 3 loads");
    assert_eq!(s.misses, 0);
    assert_eq!(s.cpu.bytes_loaded, 6 * chunk_bytes(CHUNK) as u64);
}

#[test]
fn nhd_and_hnd_over_several_block_sizes() {
    for layout in [KvLayout::NHD, KvLayout::HND] {
        for bs in [1, 4, 16, 32] {
            round_trip(layout, bs, false);
        }
    }
}

#[test]
fn layerwise_load_and_save() {
    round_trip(KvLayout::HND, 8, true);
    round_trip(KvLayout::NHD, 16, true);
}

#[test]
fn lookup_is_side_effect_free_and_repeatable() {
    let id = "flow-repeat";
    let mut e = Engine::new(id, KvLayout::NHD, 16, json!({"chunk_size": CHUNK}));
    let p = prompt(2, 3 * CHUNK + 1);
    e.run("a", &p, 0);
    let events = e.sched.take_events().unwrap();
    let stored: Vec<_> = events
        .iter()
        .filter(|ev| matches!(ev, kvconnect_api::KvEvent::BlockStored(s) if s.medium == kvconnect_api::Medium::CpuTier))
        .collect();
    assert_eq!(stored.len(), 3, "one stored event per chunk: {events:?}");
    assert!(e.sched.take_events().unwrap().is_empty(), "events are taken once");
    let before = kvconnect_lmcache::stats(id).unwrap();
    let r = request("b", &p);
    assert_eq!(e.lookup(&r, 0), 3 * CHUNK);
    assert_eq!(e.lookup(&r, 0), 3 * CHUNK);
    // The engine's own prefix cache already has 16 tokens: only the rest is external.
    assert_eq!(e.lookup(&r, 16), 3 * CHUNK - 16);
    assert_eq!(e.lookup(&r, 200), 0);
    assert_eq!(kvconnect_lmcache::stats(id).unwrap(), before, "lookups change no counter");
}

#[test]
fn load_after_the_engines_own_prefix_hit() {
    let id = "flow-prefix";
    let mut e = Engine::new(id, KvLayout::HND, 8, json!({"chunk_size": CHUNK}));
    let p = prompt(3, 2 * CHUNK + 5);
    e.run("a", &p, 0);
    e.zero();
    // The engine has tokens [0, 24) itself (written by `run` before the step); lmcache loads
    // [24, 64) into the rest, starting inside the first chunk.
    let (m, blocks, errs) = e.run("b", &p, 24);
    assert_eq!(m, 2 * CHUNK - 24);
    assert!(errs.is_empty());
    assert!(e.mismatches(&p, &blocks, 0, p.len()).is_empty());
}

#[test]
fn unfull_chunks_are_saved_and_loaded_when_asked() {
    for layout in [KvLayout::NHD, KvLayout::HND] {
        let id = format!("flow-unfull-{}", layout.canonical_name());
        let mut e = Engine::new(&id, layout, 8, json!({"chunk_size": CHUNK, "save_unfull_chunk": true}));
        let p = prompt(4, CHUNK + 13);
        e.run("a", &p, 0);
        assert_eq!(kvconnect_lmcache::stats(&id).unwrap().chunks_saved, 2);
        e.zero();
        // The same prompt: the full chunk and the partial one, less the last token.
        let (m, blocks, errs) = e.load_only("b", &p);
        assert_eq!(m, CHUNK + 12);
        assert!(errs.is_empty());
        assert!(e.mismatches(&p, &blocks, 0, m).is_empty(), "{layout:?}");
        assert!(e.all_zero(&blocks, m, p.len()));
        // A longer prompt has a different second chunk: only the first matches.
        let mut longer = p.clone();
        longer.push(7);
        assert_eq!(e.lookup(&request("c", &longer), 0), CHUNK);
    }
}

#[test]
fn layouts_never_share_chunks() {
    // One engine id and config, so one store: only the key keeps NHD and HND apart.
    let extra = json!({"chunk_size": CHUNK});
    let mut nhd = Engine::new("flow-layouts", KvLayout::NHD, 16, extra.clone());
    let mut hnd = Engine::new("flow-layouts", KvLayout::HND, 16, extra.clone());
    let p = prompt(5, CHUNK + 1);
    nhd.run("a", &p, 0);
    assert_eq!(nhd.lookup(&request("b", &p), 0), CHUNK);
    assert_eq!(hnd.lookup(&request("b", &p), 0), 0, "an NHD chunk is never an HND hit");
    let mut bs8 = Engine::new("flow-layouts", KvLayout::NHD, 8, extra);
    assert_eq!(bs8.lookup(&request("b", &p), 0), 0, "nor one of another block size");
}

#[test]
fn mla_caches_round_trip() {
    // MLA: one latent per token and layer (no separate K and V), as the capabilities declare.
    for layout in [KvLayout::NHD, KvLayout::HND] {
        let id = format!("flow-mla-{}", layout.canonical_name());
        let c = ctx_for(mla_model(), &id, layout, 8, json!({"chunk_size": CHUNK}));
        let mut e = Engine::with_ctx(&kvconnect_lmcache::LmcacheFactory, c);
        let p = prompt(6, 2 * CHUNK + 3);
        e.run("a", &p, 0);
        let s = kvconnect_lmcache::stats(&id).unwrap();
        // 3 layers x 1 part x 32 tokens x 12 dims x 2 bytes per chunk.
        assert_eq!(s.cpu.bytes_stored, 2 * 3 * 32 * 12 * 2);
        e.zero();
        let (m, blocks, errs) = e.load_only("b", &p);
        assert_eq!(m, 2 * CHUNK);
        assert!(errs.is_empty());
        assert!(e.mismatches(&p, &blocks, 0, m).is_empty());
        assert!(e.all_zero(&blocks, m, p.len()));
    }
}

#[test]
fn every_declared_role_saves_and_loads() {
    // The capabilities declare kv_producer, kv_consumer and kv_both: a cache on prefill, on
    // decode or on one engine stores what it computes and serves it back alike.
    for role in [KvRole::Producer, KvRole::Consumer, KvRole::Both] {
        let id = format!("flow-role-{role:?}");
        let mut c = ctx(&id, KvLayout::NHD, 16, json!({"chunk_size": CHUNK}));
        c.role = role;
        c.config.kv_role = Some(role);
        let mut e = Engine::with_ctx(&kvconnect_lmcache::LmcacheFactory, c);
        let p = prompt(12, 2 * CHUNK + 5);
        let (m, _, errs) = e.run("a", &p, 0);
        assert_eq!((m, errs.len()), (0, 0), "{role:?}: cold cache");
        e.zero();
        let (m, blocks, errs) = e.load_only("b", &p);
        assert_eq!(m, 2 * CHUNK, "{role:?}");
        assert!(errs.is_empty(), "{role:?}: {errs:?}");
        assert!(e.mismatches(&p, &blocks, 0, m).is_empty(), "{role:?}: loaded bytes are the saved bytes");
    }
}
