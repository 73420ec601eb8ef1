//! KV regions in GPU memory (feature `cuda`): saves and loads go through a pinned host copy
//! of the request's blocks ([`kvconnect_cuda::KvStage`]).
//!
//! A save gathers the request's blocks of every layer with one kernel launch, then the usual
//! chunk code copies out of the host copy. A load writes the stored chunks into a host copy
//! and scatters the blocks it wrote back with one launch, before `start_load_kv` returns.
//! Both are whole-request: with device KV, `use_layerwise` saves everything at
//! `wait_for_save` and loads everything at `start_load_kv` (a per-layer gather would cost a
//! launch and a synchronisation per layer and request, and the engine's layer waits then
//! return at once). Blocks a load writes only partly (a load that starts or ends inside a
//! block) are gathered first, so the scatter leaves their other tokens as they were.

use crate::chunk_layout::ChunkLayout;
use crate::meta::{LoadSpec, SaveSpec};
use crate::store::ChunkBytes;
use kvconnect_api::{BlockId, ConnectorError, EffectiveLayout, KvRegion, ModelSpec};
use kvconnect_cuda::KvStage;

/// Opens the regions' GPU and prepares the stage; any failure (no driver, no GPU, regions on
/// two GPUs, a layout one gather cannot copy) is a config error naming the cause.
pub fn open(
    regions: &[KvRegion],
    model: &ModelSpec,
    eff: &EffectiveLayout,
) -> Result<KvStage, ConnectorError> {
    KvStage::open(regions, model, eff)
        .map_err(|e| ConnectorError::config("lmcache", format!("device KV regions cannot be staged: {e}")))
}

/// Block-table entries a save reads: those holding its chunks' tokens.
fn save_blocks<'a>(layout: &ChunkLayout, spec: &'a SaveSpec) -> &'a [BlockId] {
    let end = spec.chunks.iter().map(|c| c.start + c.tokens).max().unwrap_or(0);
    let n = layout.block_indices(0, end).end.min(spec.blocks.len());
    &spec.blocks[..n]
}

/// Bytes of chunk copies one thread takes on, at least (smaller saves stay on the caller's
/// thread: spawning costs more than it saves).
const BYTES_PER_THREAD: usize = 8 << 20;
/// At most this many copy threads per save.
const MAX_THREADS: usize = 8;

/// Gathers a save's blocks and copies every layer of every chunk into `bufs`. The host
/// copies of a long request are split across a few threads by chunk (each chunk's buffer is
/// built by one thread, in layer order), so the copy out of pinned memory keeps up with the
/// gather.
pub fn save(
    stage: &KvStage,
    layout: &ChunkLayout,
    spec: &SaveSpec,
    bufs: &mut [Vec<u8>],
) -> Result<(), String> {
    let copy = stage.gather(save_blocks(layout, spec)).map_err(|e| e.to_string())?;
    let ids = copy.block_ids();
    let mem = copy.memory();
    let one = |chunks: &[crate::key::ChunkRef], bufs: &mut [Vec<u8>]| -> Result<(), String> {
        for (c, buf) in chunks.iter().zip(bufs.iter_mut()) {
            for layer in layout.kv_layers() {
                layout.save_layer(mem, *layer, &ids, c.start, c.tokens, buf).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    };
    let n = spec.chunks.len().min(bufs.len());
    let bytes: usize = spec.chunks.iter().map(|c| layout.chunk_bytes(c.tokens)).sum();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (bytes / BYTES_PER_THREAD).min(cores).min(MAX_THREADS).min(n).max(1);
    if threads == 1 {
        return one(&spec.chunks[..n], &mut bufs[..n]);
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = spec.chunks[..n]
            .chunks(per)
            .zip(bufs[..n].chunks_mut(per))
            .map(|(c, b)| s.spawn(move || one(c, b)))
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|_| Err("a chunk copy thread panicked".into())))
    })
}

/// Writes a load's fetched chunks into a host copy and scatters them into the device
/// blocks. Returns the first token that did not load (`spec.end` when everything did) and
/// the reason.
pub fn load(
    stage: &KvStage,
    layout: &ChunkLayout,
    spec: &LoadSpec,
    chunks: &[(usize, ChunkBytes)],
) -> (usize, Option<String>) {
    // Chunks were fetched in order and stop at the first missing one.
    let mut hi = chunks
        .last()
        .and_then(|(ci, _)| spec.chunks.get(*ci))
        .map_or(spec.start, |c| (c.start + c.tokens).min(spec.end));
    if hi <= spec.start {
        return (spec.start, None);
    }
    let bs = layout.block_size().max(1);
    let idx = layout.block_indices(spec.start, hi);
    if idx.end > spec.blocks.len() {
        return (
            spec.start,
            Some(format!(
                "tokens up to {hi} need {} blocks but the request has {}",
                idx.end,
                spec.blocks.len()
            )),
        );
    }
    let mut copy = match stage.host_copy(idx.end) {
        Ok(c) => c,
        Err(e) => return (spec.start, Some(e.to_string())),
    };
    // Partly written blocks keep their other tokens: bring them up first.
    let mut edges: Vec<(BlockId, u32)> = Vec::new();
    if !spec.start.is_multiple_of(bs) {
        edges.push((spec.blocks[idx.start], idx.start as u32));
    }
    if !hi.is_multiple_of(bs) && (idx.end - 1 != idx.start || edges.is_empty()) {
        edges.push((spec.blocks[idx.end - 1], (idx.end - 1) as u32));
    }
    if let Err(e) = stage.gather_into(&mut copy, &edges) {
        return (spec.start, Some(e.to_string()));
    }
    let ids = copy.block_ids();
    let mut why = None;
    'chunks: for (ci, bytes) in chunks {
        let c = spec.chunks[*ci];
        let t0 = spec.start.max(c.start) - c.start;
        let t1 = spec.end.min(c.start + c.tokens) - c.start;
        for li in 0..layout.kv_layers().len() {
            if let Err(e) =
                layout.load_layer(copy.memory(), li, &ids, c.start, c.tokens, t0, t1, bytes.as_slice())
            {
                hi = hi.min(c.start.max(spec.start));
                why = Some(e.to_string());
                break 'chunks;
            }
        }
    }
    let pairs: Vec<(u32, BlockId)> =
        layout.block_indices(spec.start, hi).map(|i| (i as u32, spec.blocks[i])).collect();
    if let Err(e) = stage.scatter(&copy, &pairs) {
        return (spec.start, Some(e.to_string()));
    }
    (hi, why)
}
