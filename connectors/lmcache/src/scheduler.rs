//! The scheduler half: finds the longest stored prefix and tells the worker half what to
//! load and save.

use crate::config::LmcacheConfig;
use crate::key::{chunk_keys, ChunkRef, Namespace};
use crate::meta::{LoadSpec, SaveSpec, StepMeta};
use crate::store::ChunkStore;
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorError, ConnectorMetric, ConnectorResult, KvEvent, MatchResult, Request,
    RequestFinished, RequestId, SchedulerConnector, StepInfo,
};
use std::collections::HashMap;
use std::sync::Arc;

/// Lookups remembered for `update_state_after_alloc` at most (requests looked up but never
/// allocated must not grow memory without bound).
const MAX_REMEMBERED: usize = 4096;

struct Lookup {
    prompt_len: usize,
    num_computed: usize,
    matched_end: usize,
    chunks: Vec<ChunkRef>,
}

struct Allocated {
    req: RequestId,
    start: usize,
    end: usize,
    chunks: Vec<ChunkRef>,
    blocks: Vec<BlockId>,
}

/// The lmcache scheduler half.
pub struct LmcacheScheduler {
    store: Arc<ChunkStore>,
    ns: Namespace,
    cfg: LmcacheConfig,
    block_size: usize,
    lookups: HashMap<RequestId, Lookup>,
    pending: Vec<Allocated>,
}

impl LmcacheScheduler {
    /// A scheduler half over `store`.
    pub fn new(
        store: Arc<ChunkStore>,
        ns: Namespace,
        cfg: LmcacheConfig,
        block_size: u32,
    ) -> LmcacheScheduler {
        LmcacheScheduler {
            store,
            ns,
            cfg,
            block_size: block_size as usize,
            lookups: HashMap::new(),
            pending: Vec::new(),
        }
    }

    fn keys(&self, tokens: &[u32]) -> Vec<ChunkRef> {
        chunk_keys(self.ns, tokens, self.cfg.chunk_size as usize, self.cfg.save_unfull_chunk)
    }

    /// The end of the longest stored prefix, capped to leave the last prompt token.
    fn matched_end(&self, chunks: &[ChunkRef], prompt_len: usize) -> usize {
        let n = self.store.stored_prefix(chunks.iter().map(|c| c.key));
        let end = n.checked_sub(1).map_or(0, |i| chunks[i].start + chunks[i].tokens);
        end.min(prompt_len.saturating_sub(1))
    }
}

impl SchedulerConnector for LmcacheScheduler {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed: usize,
    ) -> ConnectorResult<MatchResult> {
        let chunks = self.keys(&req.prompt_tokens);
        let mut matched_end = self.matched_end(&chunks, req.prompt_tokens.len());
        let mut tokens = matched_end.saturating_sub(num_computed);
        // LMCache's min_retrieve_tokens: a smaller hit is not worth a load; the chunks stay
        // stored (saves skip them), the engine computes the tokens.
        if tokens > 0 && tokens < self.cfg.min_retrieve_tokens as usize {
            tokens = 0;
            matched_end = num_computed;
        }
        if self.lookups.len() >= MAX_REMEMBERED && !self.lookups.contains_key(&req.id) {
            self.lookups.clear();
        }
        self.lookups.insert(
            req.id.clone(),
            Lookup { prompt_len: req.prompt_tokens.len(), num_computed, matched_end, chunks },
        );
        Ok(MatchResult::Matched { tokens, async_load: false })
    }

    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
        num_external_tokens: usize,
    ) -> ConnectorResult<()> {
        if blocks.0.len() > 1 {
            return Err(ConnectorError::invalid(
                "lmcache",
                format!(
                    "request {} has {} block tables; lmcache supports one (the hybrid KV cache manager must \
                        be off)",
                    req.id,
                    blocks.0.len()
                ),
            ));
        }
        let table = blocks.0.first().cloned().unwrap_or_default();
        let lookup = match self.lookups.remove(&req.id) {
            Some(l) if l.prompt_len == req.prompt_tokens.len() => l,
            _ if num_external_tokens > 0 => {
                return Err(ConnectorError::invalid(
                    "lmcache",
                    format!(
                        "request {} asks to load {num_external_tokens} tokens but get_num_new_matched_tokens \
                            was not called for this prompt",
                        req.id
                    ),
                ));
            }
            _ => Lookup {
                prompt_len: req.prompt_tokens.len(),
                num_computed: 0,
                matched_end: 0,
                chunks: self.keys(&req.prompt_tokens),
            },
        };
        let start = lookup.num_computed;
        let end = start + num_external_tokens;
        if end > lookup.matched_end.max(start) {
            return Err(ConnectorError::invalid(
                "lmcache",
                format!(
                    "request {} asks to load tokens {start}..{end} but only {}..{} were matched",
                    req.id, start, lookup.matched_end
                ),
            ));
        }
        self.store.count_hit_tokens(num_external_tokens);
        // The chunks this request may save: their KV events carry their tokens.
        self.store.describe(&lookup.chunks, &req.prompt_tokens);
        self.pending.push(Allocated {
            req: req.id.clone(),
            start,
            end,
            chunks: lookup.chunks,
            blocks: table,
        });
        Ok(())
    }

    fn build_connector_meta(&mut self, _step: &StepInfo) -> ConnectorResult<Vec<u8>> {
        let mut meta = StepMeta { connector: "lmcache".to_owned(), ..StepMeta::default() };
        for a in self.pending.drain(..) {
            if a.end > a.start {
                let chunks = a
                    .chunks
                    .iter()
                    .filter(|c| c.start < a.end && c.start + c.tokens > a.start)
                    .copied()
                    .collect();
                meta.loads.push(LoadSpec {
                    req: a.req.clone(),
                    start: a.start,
                    end: a.end,
                    chunks,
                    blocks: a.blocks.clone(),
                });
            }
            // The prompt is computed in the step after allocation; save what is not stored yet
            // and what the block table covers.
            let covered = a.blocks.len() * self.block_size;
            let chunks: Vec<ChunkRef> = a
                .chunks
                .iter()
                .filter(|c| c.start + c.tokens <= covered && !self.store.contains(&c.key))
                .copied()
                .collect();
            if !chunks.is_empty() {
                meta.saves.push(SaveSpec { req: a.req, chunks, blocks: a.blocks });
            }
        }
        Ok(meta.encode())
    }

    fn request_finished(
        &mut self,
        req: &Request,
        _blocks: &BlocksPerGroup,
    ) -> ConnectorResult<RequestFinished> {
        self.lookups.remove(&req.id);
        // Saves complete within the step (the copy out of the KV cache is synchronous), so
        // the blocks can be freed at once.
        Ok(RequestFinished { delay_free: false, transfer_params: None })
    }

    fn take_events(&mut self) -> ConnectorResult<Vec<KvEvent>> {
        Ok(self.store.take_events())
    }

    fn metrics(&mut self) -> ConnectorResult<Vec<ConnectorMetric>> {
        Ok(crate::stats::metrics(&self.store.stats()))
    }

    fn reset_cache(&mut self) -> ConnectorResult<bool> {
        let n = self.store.clear();
        tracing::info!(chunks = n, "lmcache: reset: the CPU and disk tiers were emptied");
        Ok(true)
    }
}
