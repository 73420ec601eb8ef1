//! The worker half: copies blocks between the engine's registered regions and the store.

use crate::meta::{LoadJob, StepMeta};
use crate::store::DirStore;
use crate::{store_dir, NAME};
use kvconnect_api::geometry::BlockShape;
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{
    serde_json, tracing, BlockId, ConnectorContext, ConnectorError, ConnectorResult, FinishedTransfers,
    KvRegion, LayerId, RequestId, WorkerConnector,
};
use std::collections::{BTreeSet, HashMap};

/// The worker half.
pub struct ExampleWorker {
    ctx: ConnectorContext,
    store: DirStore,
    memory: Option<KvMemory>,
    meta: StepMeta,
    saved: HashMap<String, BTreeSet<LayerId>>,
    load_errors: Vec<BlockId>,
}

impl ExampleWorker {
    /// A worker half for `ctx`; needs `dir` in the config.
    pub fn new(ctx: &ConnectorContext) -> ConnectorResult<Self> {
        let dir = store_dir(&ctx.config)?;
        let store = DirStore::open(&dir, BlockShape::of(&ctx.model, &ctx.effective), ctx.effective.layout)
            .map_err(|e| {
                ConnectorError::io(NAME, format!("cannot use store directory {}: {e}", dir.display()))
            })?;
        Ok(ExampleWorker {
            ctx: ctx.clone(),
            store,
            memory: None,
            meta: StepMeta::default(),
            saved: HashMap::new(),
            load_errors: Vec::new(),
        })
    }

    fn memory(&self) -> ConnectorResult<&KvMemory> {
        self.memory
            .as_ref()
            .ok_or_else(|| ConnectorError::invalid(NAME, "no KV regions: call register_kv_caches first"))
    }

    fn kv_layers(&self) -> ConnectorResult<BTreeSet<LayerId>> {
        Ok(self.memory()?.geometry().regions().iter().flat_map(|r| r.layers.iter().copied()).collect())
    }

    fn load(&self, job: &LoadJob) -> ConnectorResult<()> {
        let mem = self.memory()?;
        let io = |e: std::io::Error| ConnectorError::io(NAME, format!("entry {}: {e}", job.key));
        let entry = self.store.meta(&job.key).map_err(io)?;
        let shape = self.store.shape();
        let (blk, parts) = (shape.bytes(), shape.kv_parts as usize);
        if job.first + job.blocks.len() > entry.num_blocks {
            return Err(ConnectorError::invalid(
                NAME,
                format!("entry {} has {} blocks, asked for more", job.key, entry.num_blocks),
            ));
        }
        for layer in self.kv_layers()? {
            let bytes = self.store.read_layer(&job.key, layer).map_err(io)?;
            if bytes.len() != entry.num_blocks * parts * blk {
                return Err(ConnectorError::io(
                    NAME,
                    format!("entry {} layer {layer} is truncated", job.key),
                ));
            }
            for (i, block) in job.blocks.iter().enumerate() {
                for part in 0..parts {
                    let off = ((job.first + i) * parts + part) * blk;
                    let span = mem
                        .span(layer, part as u32, *block)
                        .map_err(|e| ConnectorError::invalid(NAME, e.to_string()))?;
                    mem.write(span, &bytes[off..off + blk])
                        .map_err(|e| ConnectorError::invalid(NAME, e.to_string()))?;
                }
            }
        }
        Ok(())
    }
}

impl WorkerConnector for ExampleWorker {
    fn register_kv_caches(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        let mem = KvMemory::new(regions, &self.ctx.model, &self.ctx.effective)
            .map_err(|e| ConnectorError::invalid(NAME, e.to_string()))?;
        self.memory = Some(mem);
        Ok(())
    }

    fn bind_connector_meta(&mut self, meta: &[u8]) -> ConnectorResult<()> {
        self.meta = if meta.is_empty() {
            StepMeta::default()
        } else {
            serde_json::from_slice(meta)
                .map_err(|e| ConnectorError::invalid(NAME, format!("step metadata does not decode: {e}")))?
        };
        Ok(())
    }

    // Loads complete here, so wait_for_layer_load keeps the trait's default.
    fn start_load_kv(&mut self) -> ConnectorResult<()> {
        let loads = std::mem::take(&mut self.meta.loads);
        for job in &loads {
            if let Err(e) = self.load(job) {
                // The engine recomputes these blocks (kv_load_failure_policy decides).
                tracing::warn!(key = %job.key, "load failed: {e}");
                self.load_errors.extend(job.blocks.iter().copied());
            }
        }
        Ok(())
    }

    fn save_kv_layer(&mut self, layer: LayerId, block_ids: &[BlockId]) -> ConnectorResult<()> {
        let mem = self
            .memory
            .as_ref()
            .ok_or_else(|| ConnectorError::invalid(NAME, "no KV regions: call register_kv_caches first"))?;
        // The engine's blocks must be ones we can address; anything else is a host bug.
        for b in block_ids {
            mem.span(layer, 0, *b).map_err(|e| ConnectorError::invalid(NAME, e.to_string()))?;
        }
        let shape = self.store.shape();
        let (blk, parts) = (shape.bytes(), shape.kv_parts as usize);
        for job in &self.meta.saves {
            let mut buf = vec![0u8; job.blocks.len() * parts * blk];
            for (i, block) in job.blocks.iter().enumerate() {
                for part in 0..parts {
                    let off = (i * parts + part) * blk;
                    let span = mem
                        .span(layer, part as u32, *block)
                        .map_err(|e| ConnectorError::invalid(NAME, e.to_string()))?;
                    mem.read(span, &mut buf[off..off + blk])
                        .map_err(|e| ConnectorError::invalid(NAME, e.to_string()))?;
                }
            }
            self.store
                .write_layer(&job.key, layer, &buf)
                .map_err(|e| ConnectorError::io(NAME, format!("entry {}: {e}", job.key)))?;
            self.saved.entry(job.key.clone()).or_default().insert(layer);
        }
        Ok(())
    }

    fn wait_for_save(&mut self) -> ConnectorResult<()> {
        let all = self.kv_layers()?;
        let saves = std::mem::take(&mut self.meta.saves);
        for job in &saves {
            let done = self.saved.remove(&job.key).unwrap_or_default();
            if done == all {
                self.store
                    .publish(&job.key, &job.tokens, job.blocks.len())
                    .map_err(|e| ConnectorError::io(NAME, format!("entry {}: {e}", job.key)))?;
            } else {
                tracing::warn!(key = %job.key, saved = done.len(), of = all.len(), "not every layer was \
                    saved; entry dropped");
                self.store.discard(&job.key);
            }
        }
        Ok(())
    }

    fn get_finished(&mut self, _finished_reqs: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        // Nothing is asynchronous: loads and saves finish within their step.
        Ok(FinishedTransfers::default())
    }

    fn block_ids_with_load_errors(&mut self) -> ConnectorResult<Vec<BlockId>> {
        Ok(std::mem::take(&mut self.load_errors))
    }

    fn shutdown(&mut self) -> ConnectorResult<()> {
        self.memory = None;
        Ok(())
    }
}
