//! What transparent huge pages give KV regions: a region allocated as the engine allocates
//! it (`RegionMemory::heap`, advised for huge pages) against the same allocation without the
//! advice (`RegionMemory::heap_with(.., false)`), in the same run as interleaved pairs
//! (`kvconnect_support::stats::interleaved`, the order alternating). Each run maps a fresh region,
//! fills it (first touch: the page faults), then copies its blocks out in a scattered order,
//! one 32 KiB block at a time, as a pull of a prompt's blocks does (TLB misses), and unmaps it.
//! Every copy's bytes are checked after the run.
//!
//! Run: `cargo bench -p kvconnect-engine --bench region_pages` (`REGION_BENCH_PAIRS` sets the
//! pairs, 21 by default). Without `--bench` (as `cargo test` runs it) one pair of a small
//! region runs, checking its bytes. On a kernel without transparent huge pages both sides
//! get ordinary pages and the ratio is about 1.

#![allow(unsafe_code)] // A benchmark harness over the regions it maps.

use kvconnect_engine::region::RegionMemory;
use kvconnect_support::host_buffer::HUGE_PAGE;
use kvconnect_support::stats::{interleaved_timed, Machine};

const BLOCK: usize = 32 << 10;

fn main() {
    let (test, pairs, len) = match kvconnect_support::stats::bench_pairs("REGION_BENCH_PAIRS", 21) {
        None => (true, 1, 2 * HUGE_PAGE),
        Some(pairs) => (false, pairs, 512 << 20),
    };
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    println!(
        "region_pages bench: {} MiB regions, {pairs} pairs; transparent huge pages: {}",
        len >> 20,
        thp.trim()
    );
    let blocks = len / BLOCK;
    // A fixed scattered order: a stride coprime with the block count visits every block once.
    let stride = (blocks / 3) | 1;
    let order: Vec<usize> = (0..blocks).map(|i| i * stride % blocks).collect();
    let mut out = vec![0u8; len];
    let mut run = |huge: bool| {
        let m = RegionMemory::heap_with("bench", len, huge).expect("map a region");
        // SAFETY: the region is `len` bytes of this bench's own mapping, dropped at the end of
        // this closure, after the last use of the slice.
        let region = unsafe { std::slice::from_raw_parts_mut(m.ptr(), len) };
        for (i, b) in region.chunks_mut(BLOCK).enumerate() {
            b.fill(i as u8 ^ 0x5a);
        }
        for (j, &b) in order.iter().enumerate() {
            out[j * BLOCK..(j + 1) * BLOCK].copy_from_slice(&region[b * BLOCK..(b + 1) * BLOCK]);
        }
        std::hint::black_box(&mut out);
    };
    let check = |out: &[u8]| {
        for (j, &b) in order.iter().enumerate() {
            assert!(
                out[j * BLOCK..(j + 1) * BLOCK].iter().all(|x| *x == b as u8 ^ 0x5a),
                "block {b} copied wrong"
            );
        }
    };
    let m = Machine::start();
    let cell = std::cell::RefCell::new(&mut run);
    let p = interleaved_timed(
        pairs,
        if test { 0 } else { 2 },
        || (cell.borrow_mut())(false),
        || (cell.borrow_mut())(true),
    );
    check(&out);
    println!(
        "RATIO fill + scattered block copies of a fresh region, huge pages advised vs not: {}; {}",
        p.summary(Some(2 * len)),
        m.finish()
    );
}
