//! Bad input: each a clear error (or a counted degradation), no panic, nothing wrong loaded.

#![allow(unsafe_code)] // Tests vouch for their own KV buffers as regions (KvRegion::new).

mod common;

use common::*;
use kvconnect_api::{BlockId, BlocksPerGroup, ConnectorFactory, KvLayout, KvRegion, LayerId};
use kvconnect_lmcache::LmcacheFactory;
use serde_json::json;

fn scheduler_error(extra: serde_json::Value, layout: KvLayout, block_size: u32) -> String {
    let c = ctx("bad-input", layout, block_size, extra);
    match LmcacheFactory.create_scheduler(&c) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn chunk_size_zero_or_not_a_multiple_of_the_block_size() {
    let e = scheduler_error(json!({"chunk_size": 0}), KvLayout::NHD, 16);
    assert!(
        e.contains("chunk_size from kv_connector_extra_config key 'chunk_size' must be a positive integer"),
        "{e}"
    );
    let e = scheduler_error(json!({"chunk_size": 40}), KvLayout::NHD, 16);
    assert!(e.contains("chunk_size 40 is not a multiple of the block size 16"), "{e}");
    // Negotiation sees the same constraint in the capabilities.
    let c = ctx("bad-input", KvLayout::NHD, 16, json!({"chunk_size": 40}));
    assert_eq!(LmcacheFactory.capabilities(&c.config, None).unwrap().block_size_divides, Some(40));
}

#[test]
fn zero_budgets_and_an_unwritable_disk() {
    let e = scheduler_error(json!({"max_local_cpu_size": 0.0}), KvLayout::NHD, 16);
    assert!(e.contains("max_local_cpu_size is 0 GB"), "{e}");
    let e = scheduler_error(json!({"local_disk": "/tmp/x", "max_local_disk_size": 0}), KvLayout::NHD, 16);
    assert!(e.contains("max_local_disk_size is 0 GB"), "{e}");
    // A path below a regular file cannot be created, even by root.
    let f = tempfile::NamedTempFile::new().unwrap();
    let path = f.path().join("cache");
    let e = scheduler_error(json!({"local_disk": path, "max_local_disk_size": 1}), KvLayout::NHD, 16);
    assert!(e.contains(&format!("local_disk '{}' cannot be used", path.display())), "{e}");
    assert!(e.contains("point local_disk at a writable directory"), "{e}");
}

#[test]
fn unknown_keys_are_named() {
    let r = kvconnect_lmcache::config::resolve(
        json!({"chunk_size": 16, "max_local_cpu_size_gb": 2, "lmcache.not_a_key": 1}).as_object().unwrap(),
        &[],
    )
    .unwrap();
    assert_eq!(
        r.unknown_keys,
        vec!["not_a_key (kv_connector_extra_config)", "max_local_cpu_size_gb (kv_connector_extra_config)"]
    );
    // They are warnings, not errors: the connector still starts.
    let c = ctx("bad-input-unknown", KvLayout::NHD, 16, json!({"chunk_size": 16, "not_a_key": 1}));
    assert!(LmcacheFactory.create_scheduler(&c).is_ok());
    // LMCache's own keys are never unknown: a remote kvconnect cannot use is refused.
    let e = scheduler_error(json!({"lmcache.remote_url": "lm://x:1"}), KvLayout::NHD, 16);
    assert!(e.contains("LMCache's own server protocol") && e.contains("redis://host:port"), "{e}");
}

#[test]
fn unsupported_layouts_are_refused() {
    let e = scheduler_error(json!({}), KvLayout::BLHNC, 16);
    assert!(e.contains("lmcache stores NHD (LBNHC) or HND (LBHNC) caches only"), "{e}");
}

/// Device regions: without the `cuda` feature the error says how to rebuild; with it and no
/// usable GPU here, the error is the driver's (never a panic).
#[test]
fn device_regions_without_cuda_or_a_gpu() {
    let c = ctx("bad-input-device", KvLayout::NHD, 16, json!({"chunk_size": 32}));
    let mut w = LmcacheFactory.create_worker(&c).unwrap();
    let mut bufs: Vec<Vec<u8>> =
        (0..LAYERS).map(|_| vec![0u8; 2 * 16 * 2 * 8 * 2 * NUM_BLOCKS as usize]).collect();
    // SAFETY: the regions are relabelled as device memory below: the worker refuses them, or,
    // on a machine with a GPU, only records them and is dropped without a transfer.
    let regions: Vec<KvRegion> = unsafe { region_list(&mut bufs) }
        .iter()
        .map(|r| {
            let mut spec = r.spec().clone();
            spec.memory = kvconnect_api::MemoryKind::Device;
            spec.device = 0;
            // SAFETY: as above.
            unsafe { KvRegion::new(spec) }
        })
        .collect();
    match (w.register_kv_caches(&regions), cfg!(feature = "cuda")) {
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
fn regions_that_do_not_match_the_layout() {
    let c = ctx("bad-input-regions", KvLayout::HND, 16, json!({"chunk_size": 32}));
    let mut w = LmcacheFactory.create_worker(&c).unwrap();
    // One byte short per region.
    let mut bufs: Vec<Vec<u8>> =
        (0..LAYERS).map(|_| vec![0u8; 2 * 16 * 2 * 8 * 2 * NUM_BLOCKS as usize - 1]).collect();
    // SAFETY: the worker refuses these regions, so it never uses them after this call.
    let e = w.register_kv_caches(&unsafe { region_list(&mut bufs) }).unwrap_err().to_string();
    assert!(e.contains("registered KV regions do not match the effective layout"), "{e}");
    assert!(e.contains("region 'layer.0' is"), "{e}");
    // A layer missing.
    let mut bufs: Vec<Vec<u8>> =
        (0..2).map(|_| vec![0u8; 2 * 16 * 2 * 8 * 2 * NUM_BLOCKS as usize]).collect();
    // SAFETY: as above.
    let e = w.register_kv_caches(&unsafe { region_list(&mut bufs) }).unwrap_err().to_string();
    assert!(e.contains("layer 2 holds KV but no registered region covers it"), "{e}");
    // Loading before any registration is an error, not a crash.
    let s = LmcacheFactory.create_scheduler(&c).unwrap();
    drop(s);
    let meta = br#"{"connector":"lmcache","loads":[{"req":"r","start":0,"end":32,"chunks":[{"key":[1,2],"start":0,"tokens":32}],"blocks":[0,1]}],"saves":[]}"#;
    w.bind_connector_meta(meta).unwrap();
    let e = w.start_load_kv().unwrap_err().to_string();
    assert!(e.contains("call register_kv_caches before loading"), "{e}");
}

#[test]
fn metadata_and_block_tables_that_do_not_fit() {
    let id = "bad-input-meta";
    let mut e = Engine::new(id, KvLayout::NHD, 16, json!({"chunk_size": 32}));
    let err = e.worker.bind_connector_meta(b"\x00garbage").unwrap_err().to_string();
    assert!(err.contains("is not lmcache's"), "{err}");
    let err = e
        .worker
        .bind_connector_meta(br#"{"connector":"nixl","loads":[],"saves":[]}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("from 'nixl', not lmcache"), "{err}");

    // Blocks past the pool's end: the load is reported failed, nothing is written.
    let p = prompt(1, 33);
    e.run("a", &p, 0);
    let req = request("b", &p);
    let m = e.lookup(&req, 0);
    assert_eq!(m, 32);
    let blocks = vec![BlockId(NUM_BLOCKS + 5), BlockId(NUM_BLOCKS + 6), BlockId(0)];
    e.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![blocks.clone()]), m).unwrap();
    let meta = e.sched.build_connector_meta(&Default::default()).unwrap();
    e.zero();
    e.worker.bind_connector_meta(&meta).unwrap();
    e.worker.start_load_kv().unwrap();
    assert_eq!(e.worker.block_ids_with_load_errors().unwrap(), blocks[..2].to_vec());
    assert!(e.buffers.iter().all(|b| b.iter().all(|x| *x == 0)));
    e.worker.save_kv_layer(LayerId(0), &blocks).unwrap();
    e.worker.wait_for_save().unwrap();

    // Two block tables (HMA) are refused; asking for more than was matched too.
    let err = e.sched.update_state_after_alloc(&req, &BlocksPerGroup(vec![vec![], vec![]]), 0).unwrap_err();
    assert!(err.to_string().contains("lmcache supports one"), "{err}");
    let req = request("c", &p);
    let m = e.lookup(&req, 0);
    let table = BlocksPerGroup(vec![e.alloc(33)]);
    let err = e.sched.update_state_after_alloc(&req, &table, m + 1).unwrap_err();
    assert!(err.to_string().contains("only 0..32 were matched"), "{err}");
    let err = e.sched.update_state_after_alloc(&request("d", &p), &table, 5).unwrap_err();
    assert!(err.to_string().contains("get_num_new_matched_tokens was not called"), "{err}");
}

#[test]
fn a_bad_yaml_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("lmcache.yaml");
    std::fs::write(&f, "chunk_size: 256\nlocal_cpu\n").unwrap();
    let env = vec![("LMCACHE_CONFIG_FILE".to_owned(), f.display().to_string())];
    let e = kvconnect_lmcache::config::resolve(&Default::default(), &env).unwrap_err().to_string();
    assert!(
        e.contains(&format!("LMCACHE_CONFIG_FILE={}: line 2, column 1: not valid YAML", f.display())),
        "{e}"
    );
    std::fs::write(&f, "local_cpu: true\nchunk_size:\n  - 256\n").unwrap();
    let e = kvconnect_lmcache::config::resolve(&Default::default(), &env).unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "chunk_size from LMCACHE_CONFIG_FILE {} line 2 must be a positive integer",
            f.display()
        )) && e.contains("got [256]"),
        "{e}"
    );
}

/// Run by `a_second_worker_on_one_local_disk_is_refused` in a child process: opens a store
/// on `KVC_HOLD_DISK`, says so, and holds it until killed.
#[test]
#[ignore = "a helper process of another test"]
fn hold_local_disk() {
    let Ok(dir) = std::env::var("KVC_HOLD_DISK") else { return };
    let c = ctx("bad-input-holder", KvLayout::NHD, 16, json!({"local_disk": dir, "max_local_disk_size": 1}));
    let _s = LmcacheFactory.create_scheduler(&c).unwrap();
    println!("HOLDING");
    std::thread::sleep(std::time::Duration::from_secs(120));
}

#[test]
fn a_second_worker_on_one_local_disk_is_refused_until_the_first_dies() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "hold_local_disk", "--ignored", "--nocapture", "--test-threads=1"])
        .env("KVC_HOLD_DISK", &disk)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("HOLDING") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the holder exited before opening the disk");
    }
    let extra = json!({"local_disk": disk, "max_local_disk_size": 1});
    let e = scheduler_error(extra.clone(), KvLayout::NHD, 16);
    assert!(
        e.contains(&format!(
            "local_disk '{}' is in use by another worker (pid {})",
            disk.display(),
            child.id()
        )) && e.contains("give each worker its own local_disk"),
        "{e}"
    );
    // A worker that dies (here: killed) leaves no lock behind.
    child.kill().unwrap();
    child.wait().unwrap();
    let c = ctx("bad-input-after", KvLayout::NHD, 16, extra);
    LmcacheFactory.create_scheduler(&c).expect("the directory is free once its holder is gone");
}
