//! GPU tests: exactness of gather, scatter and the fused permutes on random data with
//! poisoned destinations, CUDA IPC across two processes, and a dead peer's handle. They
//! need a GPU and skip, saying so, without one. The host-staged copy between GPUs (run on
//! one GPU, or from GPU 0 to `KVC_TEST_DECODE_GPU`) is checked the same way; on a machine without a driver they check
//! that opening a GPU is a clean error.
#![cfg(feature = "cuda")]

use kvconnect_cuda::device::check_libraries;
use kvconnect_cuda::testing::random_bytes;
use kvconnect_cuda::{
    CudaError, DeviceBuffer, GatherKernel, GatherSpec, Gpu, ImportedRegion, IpcHandle, Permute, StagedConfig,
    StagedCopy,
};
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;

fn gpu() -> Option<Gpu> {
    kvconnect_cuda::testing::gpu_or_skip(0)
}

#[test]
fn no_driver_is_a_clean_error() {
    if check_libraries().is_ok() {
        eprintln!("skipping: a CUDA driver is present here");
        return;
    }
    match Gpu::open(0) {
        Err(CudaError::NoDriver(_)) | Err(CudaError::NoNvrtc(_)) => {}
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("opened a GPU without a driver"),
    }
    let msg = Gpu::open(0).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("kv_buffer_device"), "{msg}");
}

const HEADS: u32 = 4;
const TOKENS: u32 = 16;
const DIM: u32 = 64; // bf16: 128-byte rows
const ELEM: u32 = 2;
const BLOCK: usize = (HEADS * TOKENS * DIM * ELEM) as usize;

/// `n` device regions of `len` random bytes (seeded from `seed`), with their host copies.
fn random_regions(gpu: &Gpu, n: usize, len: usize, seed: u64) -> (Vec<Vec<u8>>, Vec<DeviceBuffer>) {
    let host: Vec<Vec<u8>> = (0..n).map(|r| random_bytes(len, r as u64 + seed)).collect();
    let dev = host
        .iter()
        .map(|h| {
            let b = gpu.alloc(h.len()).unwrap();
            gpu.upload(b.ptr(), h).unwrap();
            b
        })
        .collect();
    (host, dev)
}

/// `n` device regions of `len` bytes of 0xEE.
fn poisoned_regions(gpu: &Gpu, n: usize, len: usize) -> Vec<DeviceBuffer> {
    let dst: Vec<_> = (0..n).map(|_| gpu.alloc(len).unwrap()).collect();
    for d in &dst {
        gpu.memset_async(d.ptr(), 0xEE, d.len()).unwrap();
    }
    dst
}

#[test]
fn gather_is_exact_and_touches_nothing_else() {
    let Some(gpu) = gpu() else { return };
    let mut k = GatherKernel::new(&gpu).unwrap();
    let (nreg, nsrc, ndst) = (6usize, 40u32, 32u32);
    let (src_host, src) = random_regions(&gpu, nreg, nsrc as usize * BLOCK, 1);
    let dst = poisoned_regions(&gpu, nreg, ndst as usize * BLOCK);
    let sb = [3u32, 39, 0, 17, 18, 19, 5];
    let db = [31u32, 0, 7, 8, 9, 10, 2];
    let spec = GatherSpec {
        src_bases: &src.iter().map(|b| b.ptr()).collect::<Vec<_>>(),
        dst_bases: &dst.iter().map(|b| b.ptr()).collect::<Vec<_>>(),
        src_blocks: &sb,
        dst_blocks: &db,
        block_bytes: BLOCK as u64,
        permute: Permute::None,
    };
    k.launch(&gpu, &spec).unwrap();
    gpu.synchronize().unwrap();
    for r in 0..nreg {
        let mut out = vec![0u8; ndst as usize * BLOCK];
        gpu.download(&mut out, dst[r].ptr()).unwrap();
        for blk in 0..ndst as usize {
            let got = &out[blk * BLOCK..(blk + 1) * BLOCK];
            match db.iter().position(|d| *d as usize == blk) {
                Some(i) => {
                    let s = sb[i] as usize;
                    assert_eq!(got, &src_host[r][s * BLOCK..(s + 1) * BLOCK], "region {r} block {blk}");
                }
                None => assert!(got.iter().all(|b| *b == 0xEE), "region {r} block {blk} was written"),
            }
        }
    }
}

/// Gathers past what a launch's parameters carry (more blocks, or more regions, than
/// `INLINE_MAX_*`) upload their index arrays first, and are as exact.
#[test]
fn gathers_too_large_for_the_launchs_parameters_are_exact() {
    use kvconnect_cuda::kernel::{INLINE_MAX_BLOCKS, INLINE_MAX_REGIONS};
    let Some(gpu) = gpu() else { return };
    let mut k = GatherKernel::new(&gpu).unwrap();
    let small = 256usize;
    for (nreg, n) in [(2usize, INLINE_MAX_BLOCKS as u32 + 416), (INLINE_MAX_REGIONS + 2, 8)] {
        let (nsrc, ndst) = (n + 10, n + 20);
        let (src_host, src) = random_regions(&gpu, nreg, nsrc as usize * small, 7);
        let dst = poisoned_regions(&gpu, nreg, ndst as usize * small);
        // Source blocks in order from 5, destination blocks reversed from 15: both scattered
        // against each other, each side's first blocks left alone.
        let sb: Vec<u32> = (0..n).map(|i| 5 + i).collect();
        let db: Vec<u32> = (0..n).rev().map(|i| 15 + i).collect();
        let spec = GatherSpec {
            src_bases: &src.iter().map(|b| b.ptr()).collect::<Vec<_>>(),
            dst_bases: &dst.iter().map(|b| b.ptr()).collect::<Vec<_>>(),
            src_blocks: &sb,
            dst_blocks: &db,
            block_bytes: small as u64,
            permute: Permute::None,
        };
        k.launch(&gpu, &spec).unwrap();
        gpu.synchronize().unwrap();
        for r in 0..nreg {
            let mut out = vec![0u8; ndst as usize * small];
            gpu.download(&mut out, dst[r].ptr()).unwrap();
            for blk in 0..ndst {
                let got = &out[blk as usize * small..(blk as usize + 1) * small];
                if (15..15 + n).contains(&blk) {
                    let s = sb[(n - 1 - (blk - 15)) as usize] as usize;
                    assert_eq!(
                        got,
                        &src_host[r][s * small..(s + 1) * small],
                        "{nreg} regions: region {r} block {blk}"
                    );
                } else {
                    assert!(
                        got.iter().all(|b| *b == 0xEE),
                        "{nreg} regions: region {r} block {blk} was written"
                    );
                }
            }
        }
    }
}

/// The host-staged path (what cuda_ipc takes without peer access): small staging buffers
/// force many chunks and a short tail chunk; the permute is fused into the unpacking.
#[test]
fn host_staged_copy_is_exact_with_permute_over_many_chunks() {
    let Some(src_gpu) = gpu() else { return };
    let src_gpu = Arc::new(src_gpu);
    let dst_ordinal = std::env::var("KVC_TEST_DECODE_GPU").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let dst_gpu = Gpu::open(dst_ordinal).unwrap();
    let mut k = GatherKernel::new(&dst_gpu).unwrap();
    let (nreg, nsrc, ndst) = (5usize, 64u32, 48u32);
    let src_host: Vec<Vec<u8>> =
        (0..nreg).map(|r| random_bytes(nsrc as usize * BLOCK, r as u64 + 7)).collect();
    let src: Vec<_> = src_host
        .iter()
        .map(|h| {
            let b = src_gpu.alloc(h.len()).unwrap();
            src_gpu.upload(b.ptr(), h).unwrap();
            b
        })
        .collect();
    let dst: Vec<_> = (0..nreg).map(|_| dst_gpu.alloc(ndst as usize * BLOCK).unwrap()).collect();
    // 23 blocks: 3 per chunk (5 regions x 3 blocks fit in the staging buffers) make 8 chunks,
    // the last one with 2 blocks; 1 per chunk makes 23, each buffer set reused many times.
    let sb: Vec<u32> = (0..23u32).map(|i| (i * 37 + 5) % nsrc).collect();
    let db: Vec<u32> = (0..23u32).map(|i| 47 - 2 * i).collect();
    let spec = GatherSpec {
        src_bases: &src.iter().map(|b| b.ptr()).collect::<Vec<_>>(),
        dst_bases: &dst.iter().map(|b| b.ptr()).collect::<Vec<_>>(),
        src_blocks: &sb,
        dst_blocks: &db,
        block_bytes: BLOCK as u64,
        permute: Permute::NhdToHnd { heads: HEADS, tokens: TOKENS },
    };
    let configs = [
        (3, StagedConfig::default()),
        (1, StagedConfig::default()),
        (1, StagedConfig { buffers: 3, ..StagedConfig::default() }),
        (3, StagedConfig { copy_streams: false, ..StagedConfig::default() }),
    ];
    for (per_chunk, config) in configs {
        let config = StagedConfig { chunk_bytes: per_chunk * nreg * BLOCK + 100, ..config };
        let mut staged = StagedCopy::configured(src_gpu.clone(), &dst_gpu, config).unwrap();
        // Twice: the second pass reuses buffers and events the first one left behind.
        for pass in 0..2 {
            for d in &dst {
                dst_gpu.memset_async(d.ptr(), 0xEE, d.len()).unwrap();
            }
            staged.copy(&dst_gpu, &mut k, &spec).unwrap();
            dst_gpu.synchronize().unwrap();
            for r in 0..nreg {
                let mut out = vec![0u8; ndst as usize * BLOCK];
                dst_gpu.download(&mut out, dst[r].ptr()).unwrap();
                for blk in 0..ndst as usize {
                    let got = &out[blk * BLOCK..(blk + 1) * BLOCK];
                    match db.iter().position(|d| *d as usize == blk) {
                        Some(i) => {
                            let s = sb[i] as usize;
                            let want = permute_reference(&src_host[r][s * BLOCK..(s + 1) * BLOCK], true);
                            assert_eq!(got, &want[..], "{config:?} pass {pass} region {r} block {blk}");
                        }
                        None => assert!(
                            got.iter().all(|b| *b == 0xEE),
                            "{config:?} pass {pass} region {r} block {blk} was written"
                        ),
                    }
                }
            }
        }
        // Another handle of the destination GPU has another stream, which the path's last
        // unpack would not be ordered on: refused.
        let other = Gpu::open(dst_ordinal).unwrap();
        let e = staged.copy(&other, &mut k, &spec).unwrap_err().to_string();
        assert!(e.contains("same Gpu"), "{e}");
    }
}

#[test]
fn a_stale_prepared_gather_is_refused() {
    let Some(gpu) = gpu() else { return };
    let mut k = GatherKernel::new(&gpu).unwrap();
    let buf = gpu.alloc(2 * BLOCK).unwrap();
    let spec = GatherSpec {
        src_bases: &[buf.ptr()],
        dst_bases: &[buf.ptr()],
        src_blocks: &[0],
        dst_blocks: &[1],
        block_bytes: BLOCK as u64,
        permute: Permute::None,
    };
    let old = k.prepare(&gpu, std::slice::from_ref(&spec)).unwrap();
    let new = k.prepare(&gpu, std::slice::from_ref(&spec)).unwrap();
    let e = k.launch_prepared(&gpu, &old, 0).unwrap_err().to_string();
    assert!(e.contains("replaced"), "{e}");
    k.launch_prepared(&gpu, &new, 0).unwrap();
    assert!(k.launch_prepared(&gpu, &new, 1).is_err());
    gpu.synchronize().unwrap();
}

fn permute_reference(src: &[u8], to_hnd: bool) -> Vec<u8> {
    let row = (DIM * ELEM) as usize;
    let mut out = vec![0u8; src.len()];
    for n in 0..TOKENS as usize {
        for h in 0..HEADS as usize {
            let nhd = (n * HEADS as usize + h) * row;
            let hnd = (h * TOKENS as usize + n) * row;
            let (s, d) = if to_hnd { (nhd, hnd) } else { (hnd, nhd) };
            out[d..d + row].copy_from_slice(&src[s..s + row]);
        }
    }
    out
}

#[test]
fn fused_permutes_are_exact_both_ways() {
    let Some(gpu) = gpu() else { return };
    let mut k = GatherKernel::new(&gpu).unwrap();
    let host = random_bytes(4 * BLOCK, 99);
    let src = gpu.alloc(host.len()).unwrap();
    gpu.upload(src.ptr(), &host).unwrap();
    let mid = gpu.alloc(host.len()).unwrap();
    let back = gpu.alloc(host.len()).unwrap();
    gpu.memset_async(mid.ptr(), 0xEE, mid.len()).unwrap();
    let blocks = [0u32, 1, 2, 3];
    let to_hnd = GatherSpec {
        src_bases: &[src.ptr()],
        dst_bases: &[mid.ptr()],
        src_blocks: &blocks,
        dst_blocks: &[3, 2, 1, 0],
        block_bytes: BLOCK as u64,
        permute: Permute::NhdToHnd { heads: HEADS, tokens: TOKENS },
    };
    k.launch(&gpu, &to_hnd).unwrap();
    gpu.synchronize().unwrap();
    let mut got = vec![0u8; host.len()];
    gpu.download(&mut got, mid.ptr()).unwrap();
    for b in 0..4 {
        let want = permute_reference(&host[b * BLOCK..(b + 1) * BLOCK], true);
        let d = 3 - b;
        assert_eq!(&got[d * BLOCK..(d + 1) * BLOCK], &want[..], "block {b}");
    }
    let to_nhd = GatherSpec {
        src_bases: &[mid.ptr()],
        dst_bases: &[back.ptr()],
        src_blocks: &[3, 2, 1, 0],
        dst_blocks: &blocks,
        block_bytes: BLOCK as u64,
        permute: Permute::HndToNhd { heads: HEADS, tokens: TOKENS },
    };
    k.launch(&gpu, &to_nhd).unwrap();
    gpu.synchronize().unwrap();
    gpu.download(&mut got, back.ptr()).unwrap();
    assert_eq!(got, host, "NHD -> HND -> NHD must be the identity");
}

#[test]
fn scatter_from_pinned_host_is_exact() {
    let Some(gpu) = gpu() else { return };
    let mut k = GatherKernel::new(&gpu).unwrap();
    let mut pinned = gpu.alloc_pinned(3 * BLOCK).unwrap();
    let data = random_bytes(3 * BLOCK, 7);
    pinned.as_mut_slice().copy_from_slice(&data);
    let dst = gpu.alloc(8 * BLOCK).unwrap();
    gpu.memset_async(dst.ptr(), 0xEE, dst.len()).unwrap();
    let spec = GatherSpec {
        src_bases: &[pinned.device_ptr()],
        dst_bases: &[dst.ptr()],
        src_blocks: &[0, 1, 2],
        dst_blocks: &[5, 1, 7],
        block_bytes: BLOCK as u64,
        permute: Permute::None,
    };
    k.launch(&gpu, &spec).unwrap();
    gpu.synchronize().unwrap();
    let mut got = vec![0u8; 8 * BLOCK];
    gpu.download(&mut got, dst.ptr()).unwrap();
    for (s, d) in [(0usize, 5usize), (1, 1), (2, 7)] {
        assert_eq!(&got[d * BLOCK..(d + 1) * BLOCK], &data[s * BLOCK..(s + 1) * BLOCK]);
    }
    assert!(got[0..BLOCK].iter().all(|b| *b == 0xEE));
}

#[test]
fn invalid_specs_are_errors() {
    let Some(gpu) = gpu() else { return };
    let mut k = GatherKernel::new(&gpu).unwrap();
    let bad = GatherSpec {
        src_bases: &[1, 2],
        dst_bases: &[1],
        src_blocks: &[0],
        dst_blocks: &[0],
        block_bytes: 64,
        permute: Permute::None,
    };
    assert!(matches!(k.launch(&gpu, &bad), Err(CudaError::Invalid(_))));
    let odd = GatherSpec { src_bases: &[1], dst_bases: &[1], block_bytes: 24, ..bad.clone() };
    assert!(matches!(k.launch(&gpu, &odd), Err(CudaError::Invalid(_))));
}

/// Child half of the IPC tests: selected by an environment variable.
fn ipc_child() {
    let gpu = Gpu::open(0).unwrap();
    let mode = std::env::var("KVC_IPC_CHILD").unwrap_or_default();
    if mode == "export-and-exit" {
        let buf = gpu.alloc(1 << 20).unwrap();
        let h = IpcHandle::export(&gpu, &buf).unwrap();
        println!("\nKVC_HANDLE {}", serde_json::to_string(&h).unwrap());
        return; // the buffer and the process go away
    }
    // "import": read a handle, gather its blocks into local memory, print the bytes' sum.
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let h: IpcHandle = serde_json::from_str(line.trim()).unwrap();
    let peer = ImportedRegion::open(&gpu, &h).unwrap();
    let mut k = GatherKernel::new(&gpu).unwrap();
    let local = gpu.alloc(peer.len()).unwrap();
    let n = (peer.len() / BLOCK) as u32;
    let blocks: Vec<u32> = (0..n).collect();
    let rev: Vec<u32> = (0..n).rev().collect();
    let spec = GatherSpec {
        src_bases: &[peer.ptr()],
        dst_bases: &[local.ptr()],
        src_blocks: &blocks,
        dst_blocks: &rev,
        block_bytes: BLOCK as u64,
        permute: Permute::None,
    };
    k.launch(&gpu, &spec).unwrap();
    gpu.synchronize().unwrap();
    let mut out = vec![0u8; local.len()];
    gpu.download(&mut out, local.ptr()).unwrap();
    let sum: u64 = out.iter().map(|b| *b as u64).sum();
    let first_of_last = out[(n as usize - 1) * BLOCK];
    println!("\nKVC_RESULT {sum} {first_of_last}");
}

/// The text after `marker` on the child's output line that carries it.
fn marked(text: &str, marker: &str) -> Option<String> {
    text.lines().find_map(|l| l.split_once(marker).map(|(_, rest)| rest.trim().to_owned()))
}

fn child(mode: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "ipc_child_entry", "--ignored", "--nocapture", "--test-threads=1"])
        .env("KVC_IPC_CHILD", mode);
    c
}

#[test]
#[ignore = "entry point of the IPC tests' child process, run by them with --ignored"]
fn ipc_child_entry() {
    if std::env::var("KVC_IPC_CHILD").is_ok() {
        ipc_child();
    }
}

#[test]
fn ipc_gather_across_processes() {
    let Some(gpu) = gpu() else { return };
    let n = 8usize;
    let data = random_bytes(n * BLOCK, 5);
    let buf = gpu.alloc(data.len()).unwrap();
    gpu.upload(buf.ptr(), &data).unwrap();
    let h = IpcHandle::export(&gpu, &buf).unwrap();
    let mut c = child("import").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    writeln!(c.stdin.take().unwrap(), "{}", serde_json::to_string(&h).unwrap()).unwrap();
    let out = c.wait_with_output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let result = marked(&text, "KVC_RESULT ").unwrap_or_else(|| panic!("child output: {text}"));
    let sum: u64 = data.iter().map(|b| *b as u64).sum();
    // The child reversed block order: its last block is our first.
    assert_eq!(result, format!("{sum} {}", data[0]), "child output: {text}");
}

#[test]
fn dead_peer_handle_is_an_error_not_a_crash() {
    let Some(gpu) = gpu() else { return };
    let out = child("export-and-exit").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let line = marked(&text, "KVC_HANDLE ").unwrap_or_else(|| panic!("child output: {text}"));
    let h: IpcHandle = serde_json::from_str(&line).unwrap();
    match ImportedRegion::open(&gpu, &h) {
        Err(CudaError::IpcOpen(msg)) => assert!(!msg.is_empty()),
        Err(e) => panic!("unexpected error kind: {e}"),
        Ok(_) => panic!("opened the handle of a process that has exited"),
    }
    let garbage = IpcHandle { hex: "zz".into(), bytes: 1 };
    assert!(matches!(ImportedRegion::open(&gpu, &garbage), Err(CudaError::IpcOpen(_))));
}
