//! NIXL with GPU memory, through the connector (the raw probe's test is kvconnect-bench's
//! `tests/nixl_vram_probe.rs`). Needs a GPU and the NIXL library: every test skips, saying so,
//! where either is missing (`NIXL_LIB_DIR` names the library's directory;
//! scripts/fetch-nixl.sh fetches it).
//!
//! - backend nixl over device KV regions, driven through the connector API as a host would:
//!   a producer and a consumer engine in this process, a request loaded VRAM to VRAM and
//!   compared element by element, the producer told through NIXL's notification;
//! - a layout the consumer would have to permute on receive is refused at the handshake,
//!   naming backend cuda_ipc.
//!
//! NIXL agents created concurrently may deadlock (nixl-sys runs its own tests one at a
//! time), so every test holds `SERIAL`.
#![cfg(feature = "cuda")]

mod device;

use device::{assert_loaded, decode_start, device_engine, prefill_finish, wait, Engine, BLOCKS, BS};
use kvconnect_api::{ConnectorFactory, KvLayout, KvRole, RequestId};
use kvconnect_bench::harness::{context, effective, model, Regions};
use kvconnect_cuda::Gpu;
use kvconnect_nixl::NixlFactory;
use serde_json::json;
use std::sync::{Mutex, MutexGuard};

static SERIAL: Mutex<()> = Mutex::new(());

/// GPU 0 and the serialising lock when there is a GPU and the NIXL library; `None` (after
/// saying which is missing) otherwise.
fn gpu_and_nixl_or_skip() -> Option<(Gpu, MutexGuard<'static, ()>)> {
    let g = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("skipping: no GPU ({e})");
            return None;
        }
    };
    if let Err(e) = kvconnect_nixl::nixl_lib::load() {
        eprintln!("skipping: NIXL library not found (set NIXL_LIB_DIR or run scripts/fetch-nixl.sh): {e}");
        return None;
    }
    Some((g, SERIAL.lock().unwrap_or_else(|p| p.into_inner())))
}

/// An engine on backend nixl whose KV regions are device memory of `g`.
fn engine(g: &Gpu, role: KvRole, id: &str, layout: KvLayout) -> Engine {
    device_engine(g, role, id, layout, json!({"backend": "nixl", "io_timeout": 5, "connect_timeout": 2}))
}

#[test]
fn connector_loads_a_request_vram_to_vram() {
    let Some((g, _serial)) = gpu_and_nixl_or_skip() else { return };
    let mut p = engine(&g, KvRole::Producer, "prefill-0", KvLayout::HND);
    let mut d = engine(&g, KvRole::Consumer, "decode-0", KvLayout::HND);
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    assert_eq!(meta["nixl"]["vram_device"], json!(0), "{meta}");
    d.worker.set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta})).unwrap();
    let params = prefill_finish(&mut p, "req-1");
    decode_start(&mut d, "req-1", params);
    let f = wait(d.worker.as_mut(), |f| !f.finished_recving.is_empty() || !f.failed_recving.is_empty());
    assert_eq!(f.finished_recving, vec![RequestId::from("req-1")], "{f:?}");
    assert_loaded(&g, &mut p, &mut d);
    // The consumer's NIXL notification reaches the producer, which then frees the blocks.
    let f = wait(p.worker.as_mut(), |f| !f.finished_sending.is_empty());
    assert_eq!(f.finished_sending, vec![RequestId::from("req-1")]);
}

#[test]
fn layout_needing_a_permute_is_refused_naming_cuda_ipc() {
    let Some((g, _serial)) = gpu_and_nixl_or_skip() else { return };
    let mut p = engine(&g, KvRole::Producer, "prefill-0", KvLayout::NHD);
    let mut d = engine(&g, KvRole::Consumer, "decode-0", KvLayout::HND);
    let meta = p.worker.handshake_metadata().unwrap().unwrap();
    let e = d
        .worker
        .set_peer_handshake_metadata(&json!({"engine_id": "prefill-0", "peer": meta}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cuda_ipc") && e.contains("NHD") && e.contains("HND"), "{e}");
}

#[test]
fn host_kv_producer_is_refused_by_a_gpu_kv_consumer() {
    let Some((g, _serial)) = gpu_and_nixl_or_skip() else { return };
    let mut d = engine(&g, KvRole::Consumer, "decode-0", KvLayout::HND);
    // A producer whose KV is in host memory (same geometry, backend nixl, DRAM).
    let m = model(3, 2, 8);
    let eff = effective(&m, KvLayout::HND, BS);
    let ctx = context(
        &m,
        &eff,
        KvRole::Producer,
        "prefill-host",
        json!({"backend": "nixl", "side_channel_host": "127.0.0.1", "side_channel_port": 5600}),
    );
    // Declared before the worker, so that it outlives the worker's NIXL registrations.
    let mem = Regions::allocate(&m, &eff, BLOCKS, None).unwrap();
    let mut pw = NixlFactory.create_worker(&ctx).unwrap();
    pw.register_kv_caches(mem.regions()).unwrap();
    let meta = pw.handshake_metadata().unwrap().unwrap();
    assert!(meta["nixl"].get("vram_device").is_none(), "{meta}");
    let e = d
        .worker
        .set_peer_handshake_metadata(&json!({"engine_id": "prefill-host", "peer": meta}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("host memory (DRAM)") && e.contains("GPU memory (VRAM)"), "{e}");
}
