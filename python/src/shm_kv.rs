//! vLLM's KV cache in shared memory, for the nixl connector's `shm` backend: a same-host
//! decode maps the producer's KV regions by name and copies blocks straight out of them.
//!
//! vLLM (0.32) allocates its whole KV cache as one `torch.zeros(size, int8)` inside the
//! connector's `get_mem_pool_context`, then views each layer's part of it
//! (`KVCacheTensor`: layer `l`'s block `b` at `offset + l * layer_stride + b * block_stride`).
//! `kvconnect.vllm` hands that one call a buffer made here instead: an [`ShmArena`] whose
//! slabs, one per layer's blocks, are shared-memory segments, so each layer's region is one
//! whole segment, as the shm backend maps it. The buffer lives for the process (vLLM keeps
//! its KV cache for the engine's life); its segments are unlinked at exit
//! ([`unlink_at_exit`]) or, since vLLM kills its workers with SIGKILL when it shuts down, by
//! Python's multiprocessing resource tracker, which `kvconnect.vllm` registers them with and
//! which unlinks what is left once the server's processes are gone; after a crash of the
//! whole tree, the next kvconnect process sweeps segments whose process is gone.
//!
//! Cost: none per step (vLLM computes into the same memory it always had); the KV cache is
//! shared memory (`/dev/shm`) instead of private memory, allocated and mapped when it is made,
//! as vLLM's `torch.zeros` touches every page of a private one (left to fault in as vLLM
//! first wrote each block, a fresh 410-token prompt's four 128-token blocks cost about
//! 0.4 ms more than on private memory); a decode that maps it touches every page of it once.
//! A `/dev/shm` too small for the whole KV cache fails vLLM's startup with the remedy.

use crate::error::AdapterError;
use kvconnect_api::engine_tensor::{layer_ranges, Placement};
use kvconnect_dataplane::shm::{unlink_live_segments, ShmArena};
use kvconnect_engine::shm::{segment_name, sweep_dead};
use std::sync::{Mutex, MutexGuard};

/// The process's KV arena, once vLLM allocated its KV cache through it.
static ARENA: Mutex<Option<ShmArena>> = Mutex::new(None);

fn arena() -> MutexGuard<'static, Option<ShmArena>> {
    ARENA.lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes the `size`-byte KV buffer vLLM views as `placements`, each layer's blocks a segment
/// named for `engine_id`; returns its address and the segments' names. Once per process.
pub fn allocate(
    engine_id: &str,
    size: u64,
    placements: &[Placement],
) -> Result<(u64, Vec<String>), AdapterError> {
    let slabs: Vec<(usize, usize)> = layer_ranges(size, placements)
        .map_err(|e| {
            AdapterError::NotImplemented(format!(
                "the nixl backend 'shm' over this KV cache: {e}; use backend 'tcp'"
            ))
        })?
        .into_iter()
        .map(|(o, l)| (o as usize, l as usize))
        .collect();
    let mut a = arena();
    if a.is_some() {
        return Err(AdapterError::NotImplemented(
            "a second KV cache in shared memory in one process (vLLM allocated its KV cache twice)".into(),
        ));
    }
    let swept = sweep_dead();
    if swept > 0 {
        tracing::info!("kvconnect: removed {swept} shared-memory segments of processes that are gone");
    }
    let len = usize::try_from(size).map_err(|_| {
        AdapterError::Setup(format!("a KV cache of {size} bytes does not fit this address space"))
    })?;
    let seg_names: Vec<String> = (0..slabs.len())
        .map(|i| segment_name(engine_id, i))
        .collect::<Result<_, _>>()
        .map_err(|e| AdapterError::Setup(format!("cannot name vLLM's KV cache segments: {e}")))?;
    let made = ShmArena::create(len, &slabs, |i| seg_names[i].clone()).map_err(|e| {
        AdapterError::SideChannel(format!(
            "cannot put vLLM's KV cache into shared memory: {e}; /dev/shm needs room for the whole KV cache \
                (VLLM_CPU_KVCACHE_SPACE), or use backend 'tcp'"
        ))
    })?;
    let addr = made.ptr() as u64;
    let names = made.names();
    tracing::info!(
        "kvconnect: vLLM's KV cache ({size} bytes, {} layer segments) is in shared memory: {}",
        names.len(),
        names.join(", ")
    );
    *a = Some(made);
    Ok((addr, names))
}

/// The shared-memory segment that is exactly `[addr, addr + len)`, if vLLM's KV cache is in
/// the arena and that tensor is one of its layers.
pub fn segment_at(addr: u64, len: u64) -> Option<String> {
    arena().as_ref().and_then(|a| a.segment_at(addr, len)).map(str::to_owned)
}

/// Unlinks the arena's segment names (the mapping stays valid until the process exits), for
/// the interpreter's exit: peers that already mapped them keep their mappings.
pub fn unlink_at_exit() -> usize {
    unlink_live_segments()
}
