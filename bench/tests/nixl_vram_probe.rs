//! The raw NIXL VRAM probe behind `kvconnect bench nixl-vram`: two agents, UCX, two device
//! buffers registered as VRAM, one READ of shuffled blocks, a notification, every byte
//! compared. Needs a GPU and the NIXL library, and skips, saying so, where either is missing
//! (`NIXL_LIB_DIR` names the library's directory; scripts/fetch-nixl.sh fetches it).
#![cfg(feature = "cuda")]

use kvconnect_bench::nixl_vram::{probe, VramProbe};

/// True (after saying which is missing) when there is no GPU or no NIXL library.
fn skip() -> bool {
    if let Err(e) = kvconnect_cuda::Gpu::open(0) {
        eprintln!("skipping: no GPU ({e})");
        return true;
    }
    if let Err(e) = kvconnect_nixl::nixl_lib::load() {
        eprintln!("skipping: NIXL library not found (set NIXL_LIB_DIR or run scripts/fetch-nixl.sh): {e}");
        return true;
    }
    false
}

#[test]
fn vram_read_of_shuffled_blocks_delivers_every_byte() {
    if skip() {
        return;
    }
    // 4 MiB in 257 blocks: a prime count, so the block size is not a power of two either.
    let r = match probe(VramProbe { gpu: 0, bytes: 4 << 20, blocks: 257, repeat: 2 }) {
        Ok(r) => r,
        Err(e) => panic!("NIXL VRAM probe failed: {e}"),
    };
    eprintln!("{}", serde_json::to_string(&r).unwrap());
    assert_eq!(r.blocks, 257);
    assert_eq!(r.bytes, r.block_bytes * 257);
    assert!(r.verified, "destination differs from its source blocks at offset {:?}", r.first_mismatch);
    assert_eq!(r.notifications, 3, "one notification per READ (warm-up + 2)");
    assert!(r.nixl_read_ms > 0.0 && r.dtod_ms > 0.0);
}
