//! The worker half: copies chunks between the store and the engine's KV blocks.
//!
//! Loads check every chunk's length before writing anything, so a chunk that is missing,
//! corrupt or of the wrong size loads nothing: its blocks (and every later block of the
//! request, since a prefix with a hole is useless) are reported through
//! `block_ids_with_load_errors` and the engine recomputes them.
//!
//! KV regions in GPU memory need the `cuda` feature: loads and saves then run whole-request,
//! straight between the device blocks and the pinned CPU tier's chunk slots (see
//! `device_kv`); without the feature registering them is an error that says how to rebuild.

use crate::chunk_layout::ChunkLayout;
use crate::meta::{LoadSpec, SaveSpec, StepMeta};
use crate::store::{ChunkBytes, ChunkStore, Tier};
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{
    BlockId, ConnectorError, ConnectorResult, EffectiveLayout, FinishedTransfers, KvRegion, LayerId,
    MemoryKind, ModelSpec, RequestId, WorkerConnector,
};
use std::collections::BTreeSet;
use std::sync::Arc;

/// A load whose chunks were fetched and checked, waiting for its layers to be copied.
struct FetchedLoad {
    spec: LoadSpec,
    /// (chunk index in spec.chunks, bytes) for the chunks that load.
    chunks: Vec<(usize, ChunkBytes)>,
    /// The tier each of `chunks` came from.
    tiers: Vec<Tier>,
}

/// A save in progress: one buffer per chunk, filled layer by layer (host KV), or the
/// finished chunks (device KV, saved whole).
struct PendingSave {
    spec: SaveSpec,
    bufs: Vec<Vec<u8>>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    done: Vec<crate::chunk_buf::ChunkBuf>,
    failed: bool,
}

/// The registered KV regions.
enum Kv {
    /// Host memory, copied in place.
    Host(KvMemory),
    /// GPU memory, copied to and from the pinned CPU tier's chunk slots.
    #[cfg(feature = "cuda")]
    Device(Box<crate::device_kv::DeviceKv>),
}

/// The lmcache worker half.
pub struct LmcacheWorker {
    store: Arc<ChunkStore>,
    layout: ChunkLayout,
    model: ModelSpec,
    eff: EffectiveLayout,
    layerwise: bool,
    mem: Option<Kv>,
    meta: StepMeta,
    fetched: Vec<FetchedLoad>,
    layers_loaded: usize,
    saves: Vec<PendingSave>,
    layers_saved: usize,
    load_errors: BTreeSet<BlockId>,
    /// What the tiers supplied to the loads done since the last `get_finished`, which
    /// answers it.
    loaded: FinishedTransfers,
}

fn no_regions() -> ConnectorError {
    ConnectorError::invalid(
        "lmcache",
        "no KV regions are registered; call register_kv_caches before loading or saving",
    )
}

impl LmcacheWorker {
    /// A worker half over `store`.
    pub fn new(
        store: Arc<ChunkStore>,
        layout: ChunkLayout,
        model: ModelSpec,
        eff: EffectiveLayout,
        layerwise: bool,
    ) -> LmcacheWorker {
        LmcacheWorker {
            store,
            layout,
            model,
            eff,
            layerwise,
            mem: None,
            meta: StepMeta::default(),
            fetched: Vec::new(),
            layers_loaded: 0,
            saves: Vec::new(),
            layers_saved: 0,
            load_errors: BTreeSet::new(),
            loaded: FinishedTransfers::default(),
        }
    }

    fn fail_blocks(&mut self, spec: &LoadSpec, from_token: usize) {
        let before = self.load_errors.len();
        for i in self.layout.block_indices(from_token.max(spec.start), spec.end) {
            if let Some(b) = spec.blocks.get(i) {
                self.load_errors.insert(*b);
            }
        }
        self.store.count_load_error_blocks(self.load_errors.len() - before);
    }

    /// Fetches and checks every chunk of this step's loads.
    fn fetch_loads(&mut self) {
        let loads = std::mem::take(&mut self.meta.loads);
        for spec in loads {
            let mut chunks = Vec::with_capacity(spec.chunks.len());
            let mut tiers = Vec::with_capacity(spec.chunks.len());
            let mut failed_at = None;
            for (i, c) in spec.chunks.iter().enumerate() {
                let want = self.layout.chunk_bytes(c.tokens);
                match self.store.get(&c.key) {
                    Some((b, tier)) if b.as_slice().len() == want => {
                        chunks.push((i, b));
                        tiers.push(tier);
                    }
                    Some((b, _)) => {
                        tracing::warn!(
                            req = %spec.req, chunk = ?c.key, got = b.as_slice().len(), want,
                            "lmcache: stored chunk has the wrong length; not loaded"
                        );
                        self.store.count_miss();
                        failed_at = Some(c.start);
                        break;
                    }
                    None => {
                        self.store.count_miss();
                        failed_at = Some(c.start);
                        break;
                    }
                }
            }
            if let Some(t) = failed_at {
                self.fail_blocks(&spec, t);
            }
            self.fetched.push(FetchedLoad { spec, chunks, tiers });
        }
        self.layers_loaded = 0;
    }

    /// Adds, per request, the tokens each tier supplied to the loads that are done to the
    /// next `get_finished` answer; chunks of a failed load were dropped already.
    fn report_loads(&mut self) {
        for f in &self.fetched {
            for ((ci, _), tier) in f.chunks.iter().zip(&f.tiers) {
                let c = f.spec.chunks[*ci];
                let tokens = f.spec.end.min(c.start + c.tokens).saturating_sub(f.spec.start.max(c.start));
                self.loaded.add_load(&f.spec.req, "lmcache", tier.name(), tokens as u64);
            }
        }
    }

    /// Copies layers `[self.layers_loaded, upto)` of every fetched load.
    fn load_layers(&mut self, upto: usize) -> ConnectorResult<()> {
        let mem = match &self.mem {
            Some(Kv::Host(m)) => m,
            #[cfg(feature = "cuda")]
            Some(Kv::Device(_)) => return self.load_device(),
            None => return Err(no_regions()),
        };
        let mut failures: Vec<(usize, usize)> = Vec::new();
        for li in self.layers_loaded..upto {
            for (fi, f) in self.fetched.iter().enumerate() {
                for (ci, bytes) in &f.chunks {
                    let c = f.spec.chunks[*ci];
                    let t0 = f.spec.start.max(c.start) - c.start;
                    let t1 = f.spec.end.min(c.start + c.tokens) - c.start;
                    if let Err(e) = self.layout.load_layer(
                        mem,
                        li,
                        &f.spec.blocks,
                        c.start,
                        c.tokens,
                        t0,
                        t1,
                        bytes.as_slice(),
                    ) {
                        tracing::warn!(req = %f.spec.req, "lmcache: load failed: {e}");
                        failures.push((fi, c.start));
                        break;
                    }
                }
            }
        }
        self.layers_loaded = self.layers_loaded.max(upto);
        for (fi, start) in failures {
            let spec = self.fetched[fi].spec.clone();
            self.fail_blocks(&spec, start);
            // Later layers would write blocks that are already reported.
            self.fetched[fi].chunks.clear();
            self.fetched[fi].tiers.clear();
        }
        Ok(())
    }

    /// Copies layers `[self.layers_saved, upto)` of every pending save out of the KV cache.
    fn save_layers(&mut self, upto: usize) -> ConnectorResult<()> {
        let mem = match &self.mem {
            Some(Kv::Host(m)) => m,
            #[cfg(feature = "cuda")]
            Some(Kv::Device(_)) => return self.save_device(),
            None => return Err(no_regions()),
        };
        for li in self.layers_saved..upto {
            let layer = self.layout.kv_layers()[li];
            for s in self.saves.iter_mut().filter(|s| !s.failed) {
                for (c, buf) in s.spec.chunks.iter().zip(s.bufs.iter_mut()) {
                    if let Err(e) = self.layout.save_layer(mem, layer, &s.spec.blocks, c.start, c.tokens, buf)
                    {
                        tracing::warn!(req = %s.spec.req, "lmcache: save failed, request not stored: {e}");
                        self.store.count_save_error();
                        s.failed = true;
                        break;
                    }
                }
            }
        }
        self.layers_saved = self.layers_saved.max(upto);
        Ok(())
    }

    fn layer_index(&self, layer: LayerId) -> Option<usize> {
        self.layout.kv_layers().iter().position(|l| *l == layer)
    }

    /// True when the regions are in GPU memory (loads and saves are whole-request then).
    fn on_device(&self) -> bool {
        match &self.mem {
            Some(Kv::Host(_)) | None => false,
            #[cfg(feature = "cuda")]
            Some(Kv::Device(_)) => true,
        }
    }

    /// Every fetched load, whole: straight from pinned slots, the rest through a host copy.
    #[cfg(feature = "cuda")]
    fn load_device(&mut self) -> ConnectorResult<()> {
        let Some(Kv::Device(dkv)) = &self.mem else { return Err(no_regions()) };
        let mut failures = Vec::new();
        for f in &self.fetched {
            let (loaded_to, why) = crate::device_kv::load(dkv, &self.layout, &f.spec, &f.chunks);
            if let Some(why) = why {
                tracing::warn!(
                    req = %f.spec.req,
                    "lmcache: device load failed from token {loaded_to}: {why}"
                );
                failures.push((f.spec.clone(), loaded_to));
            }
        }
        for (spec, from) in failures {
            self.fail_blocks(&spec, from);
            if let Some(f) = self.fetched.iter_mut().find(|f| f.spec.req == spec.req) {
                f.chunks.clear();
                f.tiers.clear();
            }
        }
        self.layers_loaded = self.layout.kv_layers().len();
        self.report_loads();
        self.fetched.clear();
        Ok(())
    }

    /// Every pending save, whole: one gather per request into pinned slots (plus one for
    /// the chunks that go to the heap).
    #[cfg(feature = "cuda")]
    fn save_device(&mut self) -> ConnectorResult<()> {
        let Some(Kv::Device(dkv)) = &self.mem else { return Err(no_regions()) };
        for s in self.saves.iter_mut().filter(|s| !s.failed && s.done.is_empty()) {
            match crate::device_kv::save(dkv, &self.store, &self.layout, &s.spec) {
                Ok(done) => s.done = done,
                Err(e) => {
                    tracing::warn!(req = %s.spec.req, "lmcache: device save failed, request not stored: {e}");
                    self.store.count_save_error();
                    s.failed = true;
                }
            }
        }
        self.layers_saved = self.layout.kv_layers().len();
        Ok(())
    }
}

/// Device regions in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn device_regions(
    _: &[KvRegion],
    _: &ModelSpec,
    _: &EffectiveLayout,
    _: &ChunkLayout,
    _: &ChunkStore,
) -> ConnectorResult<Kv> {
    Err(ConnectorError::config(
        "lmcache",
        "the KV regions are in GPU memory (kv_buffer_device=\"cuda\"), but kvconnect-lmcache was built \
            without its `cuda` feature: rebuild with `--features kvconnect-host/cuda` (or \
            kvconnect-lmcache/cuda), or use kv_buffer_device=\"cpu\"",
    ))
}

#[cfg(feature = "cuda")]
fn device_regions(
    regions: &[KvRegion],
    model: &ModelSpec,
    eff: &EffectiveLayout,
    layout: &ChunkLayout,
    store: &ChunkStore,
) -> ConnectorResult<Kv> {
    crate::device_kv::open(regions, model, eff, layout, layout.chunk_size(), store)
        .map(|d| Kv::Device(Box::new(d)))
}

impl WorkerConnector for LmcacheWorker {
    fn register_kv_caches(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        if regions.iter().any(|r| r.memory() == MemoryKind::Device) {
            // Drop the previous registration (and its slab) before pinning a new one.
            self.mem = None;
            self.mem = Some(device_regions(regions, &self.model, &self.eff, &self.layout, &self.store)?);
            return Ok(());
        }
        let mem = KvMemory::new(regions, &self.model, &self.eff).map_err(|e| {
            ConnectorError::invalid(
                "lmcache",
                format!("registered KV regions do not match the effective layout: {e}"),
            )
        })?;
        self.mem = Some(Kv::Host(mem));
        Ok(())
    }

    fn bind_connector_meta(&mut self, meta: &[u8]) -> ConnectorResult<()> {
        self.meta = StepMeta::decode(meta)?;
        self.fetched.clear();
        self.layers_loaded = 0;
        let saves = std::mem::take(&mut self.meta.saves);
        // Device saves build their chunks whole at wait_for_save.
        let device = self.on_device();
        self.saves = saves
            .into_iter()
            .map(|spec| {
                let bufs = if device {
                    Vec::new()
                } else {
                    spec.chunks
                        .iter()
                        .map(|c| self.store.take_buffer(self.layout.chunk_bytes(c.tokens)))
                        .collect()
                };
                PendingSave { spec, bufs, done: Vec::new(), failed: false }
            })
            .collect();
        self.layers_saved = 0;
        Ok(())
    }

    fn start_load_kv(&mut self) -> ConnectorResult<()> {
        if self.meta.loads.is_empty() {
            return Ok(());
        }
        if self.mem.is_none() {
            return Err(no_regions());
        }
        self.fetch_loads();
        if !self.layerwise || self.on_device() {
            self.load_layers(self.layout.kv_layers().len())?;
            self.report_loads();
            self.fetched.clear();
        }
        Ok(())
    }

    fn wait_for_layer_load(&mut self, layer: LayerId) -> ConnectorResult<()> {
        if !self.layerwise || self.fetched.is_empty() {
            return Ok(());
        }
        match self.layer_index(layer) {
            Some(li) => self.load_layers(li + 1),
            None => Ok(()),
        }
    }

    fn save_kv_layer(&mut self, layer: LayerId, _block_ids: &[BlockId]) -> ConnectorResult<()> {
        // Device KV saves whole requests at wait_for_save.
        if !self.layerwise || self.saves.is_empty() || self.on_device() {
            return Ok(());
        }
        match self.layer_index(layer) {
            Some(li) => self.save_layers(li + 1),
            None => Ok(()),
        }
    }

    fn wait_for_save(&mut self) -> ConnectorResult<()> {
        // Layers a layer-wise engine never waited for are loaded now, late but complete.
        if !self.fetched.is_empty() {
            self.load_layers(self.layout.kv_layers().len())?;
            self.report_loads();
            self.fetched.clear();
        }
        if self.saves.is_empty() {
            return Ok(());
        }
        self.save_layers(self.layout.kv_layers().len())?;
        for s in std::mem::take(&mut self.saves) {
            if s.failed {
                continue;
            }
            if !s.done.is_empty() {
                for (c, buf) in s.spec.chunks.iter().zip(s.done) {
                    self.store.put(c.key, buf);
                }
                continue;
            }
            for (c, buf) in s.spec.chunks.iter().zip(s.bufs) {
                self.store.put(c.key, buf);
            }
        }
        Ok(())
    }

    fn get_finished(&mut self, _finished_reqs: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        // Loads and saves complete inside the step, so nothing is ever outstanding; the
        // answer says only which tiers supplied this step's loads.
        Ok(std::mem::take(&mut self.loaded))
    }

    fn block_ids_with_load_errors(&mut self) -> ConnectorResult<Vec<BlockId>> {
        Ok(std::mem::take(&mut self.load_errors).into_iter().collect())
    }

    fn shutdown(&mut self) -> ConnectorResult<()> {
        self.mem = None;
        self.saves.clear();
        self.fetched.clear();
        self.store.flush();
        Ok(())
    }
}
