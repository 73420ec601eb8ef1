//! The CPU and disk tiers: LRU under a small budget, eviction to disk, hits from disk, a
//! restart, a corrupt chunk, a disk that refuses writes.

mod common;

use common::*;
use kvconnect_api::KvLayout;
use serde_json::json;

const CHUNK: usize = 16;

/// Budget for `n` chunks and a half.
fn budget(n: usize) -> f64 {
    gb(n * chunk_bytes(CHUNK) + chunk_bytes(CHUNK) / 2)
}

#[test]
fn lru_eviction_under_a_small_budget() {
    let id = "tiers-lru";
    let mut e =
        Engine::new(id, KvLayout::NHD, 8, json!({"chunk_size": CHUNK, "max_local_cpu_size": budget(3)}));
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(100 + i, CHUNK + 1)).collect();
    for (i, p) in prompts.iter().enumerate().take(3) {
        e.run(&format!("w{i}"), p, 0);
    }
    // Use prompt 0, so prompt 1 is the least recently used when two more arrive.
    let (m, _, _) = e.load_only("use0", &prompts[0]);
    assert_eq!(m, CHUNK);
    e.run("w3", &prompts[3], 0);
    e.run("w4", &prompts[4], 0);
    let hits: Vec<usize> = prompts.iter().map(|p| e.lookup(&request("q", p), 0)).collect();
    assert_eq!(hits, vec![CHUNK, 0, 0, CHUNK, CHUNK], "prompts 1 and 2 were evicted, 0 was kept by its use");
    let s = kvconnect_lmcache::stats(id).unwrap();
    assert_eq!(s.cpu.evictions, 2);
    assert_eq!(s.cpu.chunks, 3);
    assert!(s.cpu.bytes_used <= s.cpu.budget_bytes);
}

fn disk_extra(dir: &std::path::Path, cpu_chunks: usize, disk_gb: f64) -> serde_json::Value {
    json!({
        "chunk_size": CHUNK,
        "max_local_cpu_size": budget(cpu_chunks),
        "local_disk": format!("file://{}", dir.display()),
        "max_local_disk_size": disk_gb,
    })
}

#[test]
fn evicted_chunks_go_to_disk_and_are_served_from_there_also_after_a_restart() {
    let id = "tiers-disk";
    let dir = tempfile::tempdir().unwrap();
    let extra = disk_extra(dir.path(), 2, 1.0);
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(200 + i, 2 * CHUNK + 3)).collect();
    {
        let mut e = Engine::new(id, KvLayout::HND, 8, extra.clone());
        for (i, p) in prompts.iter().enumerate() {
            e.run(&format!("w{i}"), p, 0);
        }
        kvconnect_lmcache::flush(id);
        let s = kvconnect_lmcache::stats(id).unwrap();
        assert_eq!(s.cpu.chunks, 2);
        assert_eq!(s.cpu.evictions, 8);
        assert_eq!(s.disk.chunks, 8, "every chunk the CPU tier evicted is on disk");
        assert_eq!(s.disk_write_errors, 0);
        // Prompt 0 is entirely on disk now.
        e.zero();
        let (m, blocks, errs) = e.load_only("r0", &prompts[0]);
        assert_eq!(m, 2 * CHUNK);
        assert!(errs.is_empty());
        assert!(e.mismatches(&prompts[0], &blocks, 0, m).is_empty(), "disk bytes are the saved bytes");
        let s = kvconnect_lmcache::stats(id).unwrap();
        assert_eq!(s.disk.hits, 2);
        assert_eq!(s.disk.bytes_loaded, 2 * chunk_bytes(CHUNK) as u64);
    }
    assert!(kvconnect_lmcache::stats(id).is_none(), "the store closed with its last half");

    // A new process would find the same files: the index is rebuilt from them.
    let mut e = Engine::new(id, KvLayout::HND, 8, extra);
    assert_eq!(kvconnect_lmcache::stats(id).unwrap().disk.chunks, 8);
    for (i, p) in prompts.iter().enumerate().take(4) {
        e.zero();
        let (m, blocks, errs) = e.load_only(&format!("after{i}"), p);
        assert_eq!(m, 2 * CHUNK, "prompt {i} hits on disk after the restart");
        assert!(errs.is_empty());
        assert!(e.mismatches(p, &blocks, 0, m).is_empty());
    }
    // Prompt 4 lived only in the CPU tier, which a restart empties.
    assert_eq!(e.lookup(&request("p4", &prompts[4]), 0), 0);
}

/// The chunk files in a disk tier's directory (beside them: its lock file).
fn chunk_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|f| f.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "chunk"))
        .collect()
}

#[test]
fn a_corrupt_disk_chunk_is_a_miss_and_nothing_is_loaded() {
    let id = "tiers-corrupt";
    let dir = tempfile::tempdir().unwrap();
    let mut e = Engine::new(id, KvLayout::NHD, 16, disk_extra(dir.path(), 1, 1.0));
    let a = prompt(300, CHUNK + 1);
    let b = prompt(301, CHUNK + 1);
    e.run("a", &a, 0);
    e.run("b", &b, 0); // evicts a's chunk to disk
    kvconnect_lmcache::flush(id);
    let files = chunk_files(dir.path());
    assert_eq!(files.len(), 1);
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    std::fs::write(&files[0], &bytes).unwrap();

    e.zero();
    let (m, blocks, errs) = e.load_only("a2", &a);
    assert_eq!(m, CHUNK, "the index still lists the chunk");
    assert_eq!(errs, blocks[..CHUNK / 16].to_vec(), "its blocks are reported as load errors");
    assert!(e.all_zero(&blocks, 0, a.len()), "nothing was written into the KV cache");
    let s = kvconnect_lmcache::stats(id).unwrap();
    assert_eq!((s.disk_corrupt_chunks, s.misses, s.load_error_blocks), (1, 1, 1));
    assert!(!files[0].exists(), "the corrupt file was removed");
    assert_eq!(e.lookup(&request("a3", &a), 0), 0, "and it is a miss from now on");

    // A truncated file found at start is dropped from the index.
    e.run("c", &prompt(302, CHUNK + 1), 0); // evicts b's chunk
    kvconnect_lmcache::flush(id);
    let f = chunk_files(dir.path()).remove(0);
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() - 1]).unwrap();
    let extra = disk_extra(dir.path(), 1, 1.0);
    drop(e);
    let mut e = Engine::new(id, KvLayout::NHD, 16, extra);
    assert_eq!(e.lookup(&request("b2", &b), 0), 0);
    assert_eq!(kvconnect_lmcache::stats(id).unwrap().disk.chunks, 0);
}

#[test]
fn a_disk_that_refuses_writes_is_counted_and_the_cpu_tier_keeps_serving() {
    // The directory turns into a file after start: every write fails (as root, permissions
    // would not stop it).
    let id = "tiers-full";
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache");
    let mut e = Engine::new(id, KvLayout::HND, 8, disk_extra(&path, 2, 1.0));
    std::fs::remove_dir_all(&path).unwrap();
    std::fs::write(&path, b"not a directory").unwrap();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(400 + i, CHUNK + 1)).collect();
    for (i, p) in prompts.iter().enumerate() {
        e.run(&format!("w{i}"), p, 0);
    }
    kvconnect_lmcache::flush(id);
    let s = kvconnect_lmcache::stats(id).unwrap();
    assert_eq!(s.disk_write_errors, 2);
    assert_eq!(s.disk.chunks, 0);
    for p in &prompts[2..] {
        e.zero();
        let (m, blocks, errs) = e.load_only("r", p);
        assert_eq!(m, CHUNK);
        assert!(errs.is_empty());
        assert!(e.mismatches(p, &blocks, 0, m).is_empty());
    }
    assert_eq!(e.lookup(&request("gone", &prompts[0]), 0), 0);

    // A disk budget smaller than one chunk: the same, counted.
    let id = "tiers-tiny";
    let dir = tempfile::tempdir().unwrap();
    let mut e = Engine::new(id, KvLayout::NHD, 8, disk_extra(dir.path(), 1, gb(100)));
    e.run("a", &prompts[0], 0);
    e.run("b", &prompts[1], 0);
    kvconnect_lmcache::flush(id);
    let s = kvconnect_lmcache::stats(id).unwrap();
    assert_eq!((s.disk_write_errors, s.disk.chunks, s.cpu.chunks), (1, 0, 1));
    assert_eq!(e.lookup(&request("b2", &prompts[1]), 0), CHUNK);
}

#[test]
fn a_chunk_evicted_without_a_disk_tier_is_a_load_error_not_a_wrong_load() {
    let id = "tiers-lost";
    let mut e =
        Engine::new(id, KvLayout::NHD, 8, json!({"chunk_size": CHUNK, "max_local_cpu_size": budget(1)}));
    let a = prompt(500, 2 * CHUNK + 1);
    e.run("a", &a, 0); // stores 2 chunks; the first is evicted by the second
    let req = request("a2", &a);
    assert_eq!(e.lookup(&req, 0), 0, "chunk 0 is gone, so nothing matches");
    // The worker also refuses when a chunk vanishes between lookup and load.
    let b = prompt(501, CHUNK + 1);
    e.run("b", &b, 0);
    let rb = request("b2", &b);
    let m = e.lookup(&rb, 0);
    assert_eq!(m, CHUNK);
    e.run("c", &prompt(502, CHUNK + 1), 0); // evicts b's chunk after the lookup
    let blocks = e.alloc(b.len());
    e.zero();
    e.sched.update_state_after_alloc(&rb, &kvconnect_api::BlocksPerGroup(vec![blocks.clone()]), m).unwrap();
    let meta = e.sched.build_connector_meta(&Default::default()).unwrap();
    e.worker.bind_connector_meta(&meta).unwrap();
    e.worker.start_load_kv().unwrap();
    let errs = e.worker.block_ids_with_load_errors().unwrap();
    assert_eq!(errs.len(), CHUNK / 8);
    assert!(e.all_zero(&blocks, 0, b.len()));
    assert!(e.worker.block_ids_with_load_errors().unwrap().is_empty(), "reported once");
}
