//! The worker half: runs the scheduler's loads and saves on the transfer pool.
//!
//! `start_load_kv` queues this step's loads and returns; each load reads its blocks (CPU
//! slot or verified SSD record) and scatters them into the KV regions through the layout
//! adapter, then drops the scheduler's references. `wait_for_save` queues this step's saves
//! (the forward pass has written the blocks by then) and returns at once: saves never block
//! the step loop. `get_finished` reports completed loads in `finished_recving`, failed ones in
//! `failed_recving` (their unloaded blocks in `block_ids_with_load_errors`), and finished
//! requests whose saves are done in `finished_sending`.
//!
//! KV regions in GPU memory need the `cuda` feature (see `device_kv`): a save gathers its
//! blocks into a pinned host copy when it is submitted and the pool job stores from there; a
//! load's pool job fills a host copy and scatters it back. Without the feature registering
//! them is an error that says how to rebuild.

use crate::adapter::BlockAdapter;
use crate::cache::{BlockCache, LoadError, StoreOutcome};
use crate::factory::{Engine, NAME};
use crate::meta::{FlexkvMeta, LoadOp, SaveOp};
use crate::radix::Tier;
use crate::transfer::TransferPool;
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{
    BlockId, ConnectorError, ConnectorResult, FinishedTransfers, KvRegion, LayerId, MemoryKind, RequestId,
    WorkerConnector,
};
use std::cell::RefCell;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;

/// How long `handle_preemptions` waits for a preempted request's saves in flight.
const PREEMPTED_SAVE_WAIT: Duration = Duration::from_secs(60);

enum Done {
    /// A load ended; `tiers` counts the blocks the CPU and SSD tiers supplied.
    Load {
        req: RequestId,
        failed: Option<(Vec<BlockId>, String)>,
        tiers: TierBlocks,
    },
    Save {
        req: RequestId,
    },
}

#[derive(Default)]
struct Saving {
    outstanding: usize,
    finished: bool,
}

/// The registered KV regions.
#[derive(Clone)]
enum Kv {
    /// Host memory, copied in place.
    Host(Arc<KvMemory>),
    /// GPU memory, staged through pinned host copies.
    #[cfg(feature = "cuda")]
    Device(Arc<kvconnect_cuda::KvStage>),
}

/// The flexkv worker half.
pub struct FlexkvWorker {
    engine: Engine,
    mem: Option<Kv>,
    pool: TransferPool,
    done_tx: Sender<Done>,
    done_rx: Receiver<Done>,
    loads: Vec<LoadOp>,
    saves: Vec<SaveOp>,
    saving: HashMap<RequestId, Saving>,
    /// Completions `handle_preemptions` received while waiting, for `get_finished`.
    early: Vec<Done>,
    load_errors: Vec<BlockId>,
}

thread_local! {
    static SCRATCH: RefCell<(Vec<u8>, Vec<u8>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

impl FlexkvWorker {
    /// The worker half over an engine's shared cache; starts the transfer threads.
    pub fn new(engine: Engine) -> ConnectorResult<Self> {
        let pool = TransferPool::new(engine.config.num_transfer_threads, "flexkv-xfer")
            .map_err(|e| ConnectorError::io(NAME, format!("starting transfer threads: {e}")))?;
        let (done_tx, done_rx) = channel();
        Ok(FlexkvWorker {
            engine,
            mem: None,
            pool,
            done_tx,
            done_rx,
            loads: Vec::new(),
            saves: Vec::new(),
            saving: HashMap::new(),
            early: Vec::new(),
            load_errors: Vec::new(),
        })
    }

    /// The shared cache (for stats and tests).
    pub fn cache(&self) -> &Arc<BlockCache> {
        &self.engine.cache
    }

    fn submit_saves(&mut self) {
        let saves = std::mem::take(&mut self.saves);
        for op in saves {
            let Some(mem) = self.mem.clone() else {
                tracing::warn!(req = %op.req, "flexkv: no KV caches registered; save skipped");
                let _ = self.done_tx.send(Done::Save { req: op.req });
                continue;
            };
            let (cache, adapter, tx) =
                (self.engine.cache.clone(), self.engine.adapter.clone(), self.done_tx.clone());
            let req = op.req.clone();
            let src = match mem {
                Kv::Host(m) => SaveSource::Host(m),
                #[cfg(feature = "cuda")]
                Kv::Device(stage) => match crate::device_kv::gather(&stage, &op.blocks) {
                    Ok(copy) => SaveSource::Staged(Box::new(copy)),
                    Err(e) => {
                        tracing::warn!(req = %op.req, "flexkv: gathering device blocks failed, save skipped: \
                            {e}");
                        let _ = self.done_tx.send(Done::Save { req: op.req });
                        continue;
                    }
                },
            };
            let job = move || {
                // A panic must still report the save as over, or the request's blocks would
                // be held forever.
                let r = catch_unwind(AssertUnwindSafe(|| match &src {
                    SaveSource::Host(mem) => save_blocks(&cache, &adapter, mem, &op.blocks, &op),
                    #[cfg(feature = "cuda")]
                    SaveSource::Staged(copy) => {
                        save_blocks(&cache, &adapter, copy.memory(), &copy.block_ids(), &op)
                    }
                }));
                if r.is_err() {
                    tracing::error!(req = %op.req, "flexkv: a save panicked; the blocks it had not stored \
                        are not cached");
                }
                let _ = tx.send(Done::Save { req: op.req });
            };
            if !self.pool.submit(job) {
                let _ = self.done_tx.send(Done::Save { req });
            }
        }
    }
}

/// Where a save job reads its blocks.
enum SaveSource {
    /// The host regions (blocks as the op names them).
    Host(Arc<KvMemory>),
    /// A host copy gathered from device regions (blocks 0..n).
    #[cfg(feature = "cuda")]
    Staged(Box<kvconnect_cuda::HostCopy>),
}

/// Stores `op`'s blocks, read from `mem` at `blocks` (the op's ids, or a host copy's).
fn save_blocks(cache: &BlockCache, adapter: &BlockAdapter, mem: &KvMemory, blocks: &[BlockId], op: &SaveOp) {
    let mut parent = None;
    for (hash, block) in op.hashes.iter().zip(blocks) {
        match cache.store_summed(*hash, parent, |slot| adapter.gather_summed(mem, *block, slot)) {
            Ok(StoreOutcome::Stored | StoreOutcome::Present) => parent = Some(*hash),
            // The rest of the chain could not be reached from the root.
            Ok(StoreOutcome::NoParent | StoreOutcome::NoSpace) => return,
            Err(e) => {
                tracing::warn!(req = %op.req, block = block.0, "flexkv: save failed: {e}");
                return;
            }
        }
    }
}

/// Blocks a load read from each tier: (CPU, SSD).
type TierBlocks = (u64, u64);

/// Loads `op` into `mem` at `blocks` (the op's ids, or a host copy's), counting in `tiers`
/// the blocks each tier supplied; on failure, the op's blocks from the first that did not
/// load, and why.
fn load_blocks(
    cache: &BlockCache,
    adapter: &BlockAdapter,
    mem: &KvMemory,
    blocks: &[BlockId],
    op: &LoadOp,
    tiers: &mut TierBlocks,
) -> Option<(Vec<BlockId>, String)> {
    if op.hashes.len() != op.blocks.len() || blocks.len() != op.blocks.len() {
        return Some((op.blocks.clone(), format!("{} keys for {} blocks", op.hashes.len(), op.blocks.len())));
    }
    SCRATCH.with(|s| {
        let (read_buf, tbuf) = &mut *s.borrow_mut();
        for (i, (hash, block)) in op.hashes.iter().zip(blocks).enumerate() {
            // An SSD block is verified by the checksum its scatter takes (the block fails, and
            // is recomputed, where it disagrees).
            let r = cache.load_summed(*hash, read_buf, |bytes, sum| {
                match sum {
                    true => adapter.scatter_summed(mem, *block, bytes, tbuf),
                    false => adapter.scatter(mem, *block, bytes, tbuf).map(|()| 0),
                }
                .map_err(|e| e.to_string())
            });
            match r {
                Ok(Tier::Cpu) => tiers.0 += 1,
                Ok(Tier::Ssd) => tiers.1 += 1,
                Err(e) => {
                    if matches!(e, LoadError::Ssd { .. }) {
                        // The scatter may have copied a corrupt record in: wipe it.
                        if let Err(w) = adapter.clear(mem, *block) {
                            tracing::warn!(
                                "flexkv: could not wipe block {} after a failed SSD load: {w}",
                                block.0
                            );
                        }
                    }
                    return Some((op.blocks[i..].to_vec(), e.to_string()));
                }
            }
        }
        None
    })
}

/// A load job's copy: straight into host regions, or through a host copy scattered back
/// into device regions (only the blocks that loaded).
fn load_into(
    cache: &BlockCache,
    adapter: &BlockAdapter,
    mem: &Kv,
    op: &LoadOp,
    tiers: &mut TierBlocks,
) -> Option<(Vec<BlockId>, String)> {
    match mem {
        Kv::Host(m) => load_blocks(cache, adapter, m, &op.blocks, op, tiers),
        #[cfg(feature = "cuda")]
        Kv::Device(stage) => {
            let copy = match crate::device_kv::host_copy(stage, op.blocks.len()) {
                Ok(c) => c,
                Err(e) => return Some((op.blocks.clone(), e)),
            };
            let failed = load_blocks(cache, adapter, copy.memory(), &copy.block_ids(), op, tiers);
            let loaded = op.blocks.len() - failed.as_ref().map_or(0, |(b, _)| b.len().min(op.blocks.len()));
            if let Err(e) = crate::device_kv::scatter(stage, &copy, &op.blocks, loaded) {
                return Some((op.blocks.clone(), e));
            }
            failed
        }
    }
}

/// Device regions in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn device_regions(_: &[KvRegion], _: &Engine) -> ConnectorResult<Kv> {
    Err(ConnectorError::config(
        NAME,
        "register_kv_caches: the KV regions are in GPU memory (kv_buffer_device=\"cuda\"), but \
            kvconnect-flexkv was built without its `cuda` feature: rebuild with `--features \
            kvconnect-host/cuda` (or kvconnect-flexkv/cuda), or use kv_buffer_device=\"cpu\"",
    ))
}

#[cfg(feature = "cuda")]
fn device_regions(regions: &[KvRegion], engine: &Engine) -> ConnectorResult<Kv> {
    crate::device_kv::open(regions, &engine.ctx.model, &engine.ctx.effective).map(|s| Kv::Device(Arc::new(s)))
}

impl WorkerConnector for FlexkvWorker {
    fn register_kv_caches(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        if regions.iter().any(|r| r.memory() == MemoryKind::Device) {
            self.mem = Some(device_regions(regions, &self.engine)?);
            return Ok(());
        }
        // The regions stay valid until this worker is dropped; `shutdown` (also run on drop)
        // joins the transfer threads, which share `mem`, before that.
        let mem = KvMemory::new(regions, &self.engine.ctx.model, &self.engine.ctx.effective)
            .map_err(|e| ConnectorError::invalid(NAME, format!("register_kv_caches: {e}")))?;
        self.mem = Some(Kv::Host(Arc::new(mem)));
        Ok(())
    }

    fn bind_connector_meta(&mut self, meta: &[u8]) -> ConnectorResult<()> {
        // Saves of the previous step whose wait_for_save never came: that forward pass is
        // over, so they can run now.
        self.submit_saves();
        if meta.is_empty() {
            return Ok(());
        }
        let m: FlexkvMeta = serde_json::from_slice(meta).map_err(|e| {
            ConnectorError::invalid(NAME, format!("step metadata is not flexkv metadata: {e}"))
        })?;
        for s in &m.saves {
            self.saving.entry(s.req.clone()).or_default().outstanding += 1;
        }
        for r in m.finished {
            if let Some(s) = self.saving.get_mut(&r) {
                s.finished = true;
            }
        }
        self.loads.extend(m.loads);
        self.saves.extend(m.saves);
        Ok(())
    }

    // Loads are whole-request and asynchronous (the engine waits for finished_recving), so
    // wait_for_layer_load keeps the trait's default; a local cache has no handshake metadata.
    fn start_load_kv(&mut self) -> ConnectorResult<()> {
        for op in std::mem::take(&mut self.loads) {
            let (cache, adapter, tx) =
                (self.engine.cache.clone(), self.engine.adapter.clone(), self.done_tx.clone());
            let Some(mem) = self.mem.clone() else {
                cache.unpin(&op.hashes);
                let failed = Some((op.blocks.clone(), "no KV caches registered".to_owned()));
                let _ = tx.send(Done::Load { req: op.req, failed, tiers: (0, 0) });
                continue;
            };
            let (req, hashes, blocks) = (op.req.clone(), op.hashes.clone(), op.blocks.clone());
            let job = move || {
                // A panic is a failed load (never a hang, never a leaked reference).
                let mut tiers = (0, 0);
                let failed =
                    catch_unwind(AssertUnwindSafe(|| load_into(&cache, &adapter, &mem, &op, &mut tiers)))
                        .unwrap_or_else(|_| Some((op.blocks.clone(), "the load panicked".to_owned())));
                cache.unpin(&op.hashes);
                let _ = tx.send(Done::Load { req: op.req, failed, tiers });
            };
            if !self.pool.submit(job) {
                self.engine.cache.unpin(&hashes);
                let _ = self.done_tx.send(Done::Load {
                    req,
                    failed: Some((blocks, "worker shut down".into())),
                    tiers: (0, 0),
                });
            }
        }
        Ok(())
    }

    fn save_kv_layer(&mut self, _layer: LayerId, _block_ids: &[BlockId]) -> ConnectorResult<()> {
        // Whole blocks (every layer) are saved after the forward pass, in wait_for_save.
        Ok(())
    }

    fn wait_for_save(&mut self) -> ConnectorResult<()> {
        self.submit_saves();
        Ok(())
    }

    fn get_finished(&mut self, finished_reqs: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        for r in finished_reqs {
            if let Some(s) = self.saving.get_mut(r) {
                s.finished = true;
            }
        }
        let mut out = FinishedTransfers::default();
        let mut done = std::mem::take(&mut self.early);
        done.extend(self.done_rx.try_iter());
        for d in done {
            match d {
                Done::Load { req, failed: None, tiers } => {
                    // Which tier supplied the request's tokens, for the host's report.
                    let bs = self.engine.ctx.effective.block_size as u64;
                    out.add_load(&req, "flexkv", "cpu", tiers.0 * bs);
                    out.add_load(&req, "flexkv", "ssd", tiers.1 * bs);
                    out.finished_recving.push(req);
                }
                Done::Load { req, failed: Some((blocks, why)), .. } => {
                    tracing::warn!(req = %req, "flexkv: load failed: {why}");
                    self.load_errors.extend(blocks);
                    out.failed_recving.push(req);
                }
                Done::Save { req } => {
                    if let Some(s) = self.saving.get_mut(&req) {
                        s.outstanding = s.outstanding.saturating_sub(1);
                    }
                }
            }
        }
        let done: Vec<RequestId> = self
            .saving
            .iter()
            .filter(|(_, s)| s.finished && s.outstanding == 0)
            .map(|(r, _)| r.clone())
            .collect();
        for r in done {
            self.saving.remove(&r);
            out.finished_sending.push(r);
        }
        out.finished_sending.sort();
        Ok(out)
    }

    fn block_ids_with_load_errors(&mut self) -> ConnectorResult<Vec<BlockId>> {
        Ok(std::mem::take(&mut self.load_errors))
    }

    /// A preempted request's blocks are freed and reused by this step's forward: its saves
    /// not yet submitted are dropped (their blocks would be read after the overwrite), and
    /// those in flight, which read the blocks from transfer threads, are waited for.
    fn handle_preemptions(&mut self, preempted: &[RequestId]) -> ConnectorResult<()> {
        let (dropped, kept) =
            std::mem::take(&mut self.saves).into_iter().partition(|s| preempted.contains(&s.req));
        self.saves = kept;
        for s in dropped {
            tracing::debug!(req = %s.req, "flexkv: the save of a preempted request is dropped");
            if let Some(st) = self.saving.get_mut(&s.req) {
                st.outstanding = st.outstanding.saturating_sub(1);
            }
        }
        let in_flight = |saving: &HashMap<RequestId, Saving>| {
            preempted.iter().any(|r| saving.get(r).is_some_and(|s| s.outstanding > 0))
        };
        while in_flight(&self.saving) {
            match self.done_rx.recv_timeout(PREEMPTED_SAVE_WAIT) {
                Ok(Done::Save { req }) => {
                    if let Some(s) = self.saving.get_mut(&req) {
                        s.outstanding = s.outstanding.saturating_sub(1);
                    }
                }
                Ok(other) => self.early.push(other),
                Err(_) => {
                    return Err(ConnectorError::io(
                        NAME,
                        format!(
                            "a save of a preempted request did not finish within {} s, so its blocks cannot \
                                be handed back safely; the transfer threads are stuck (see the log above for \
                                a failing SSD write)",
                            PREEMPTED_SAVE_WAIT.as_secs()
                        ),
                    ))
                }
            }
        }
        Ok(())
    }

    fn shutdown(&mut self) -> ConnectorResult<()> {
        self.submit_saves();
        self.pool.shutdown();
        for op in std::mem::take(&mut self.loads) {
            self.engine.cache.unpin(&op.hashes);
        }
        self.mem = None;
        Ok(())
    }
}

impl Drop for FlexkvWorker {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
