//! The scheduler half: matches prompts against the shared cache, references what it
//! promises to load, and tells the worker half what to load and save.
//!
//! Lookup: the prompt's full blocks are keyed by the hash chain; the longest cached prefix
//! is matched and referenced, leaving at least one prompt token to compute (the engine needs
//! the last token's logits). Loads are asynchronous (`async_load: true`). Saves: the first
//! step in which a request is in `StepInfo::scheduled` after its blocks were allocated (and
//! after its load, if any, was sent) computes its whole prompt, so that step's metadata asks
//! the worker to save the prompt's full blocks; `request_finished` then holds the blocks
//! (`delay_free`) until the worker reports the save done in `finished_sending`. This assumes
//! the prompt is computed in one step (no chunked prefill), as the reference engine does.
//!
//! KV events: the cache's own carry hashes, parents and the block size; this half notes each
//! prompt block's tokens when its save becomes due and fills them in ([`TokenBook`]).

use crate::factory::{Engine, NAME};
use crate::hash::block_hashes;
use crate::meta::{FlexkvMeta, LoadOp, SaveOp};
use crate::token_book::TokenBook;
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorError, ConnectorMetric, ConnectorResult, KvEvent, MatchResult, Request,
    RequestFinished, RequestId, SchedulerConnector, StepInfo,
};
use kvconnect_support::cache_metrics;
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Save {
    /// Blocks not allocated yet.
    Waiting,
    /// Allocated; save when next scheduled.
    Due,
    /// Sent to the worker.
    Sent,
}

struct ReqState {
    hashes: Vec<u64>,
    /// Blocks [0, pinned) are referenced by this half (not yet handed to a load).
    pinned: usize,
    num_computed: usize,
    blocks: Vec<BlockId>,
    save: Save,
    load_sent_step: Option<u64>,
}

/// The flexkv scheduler half.
pub struct FlexkvScheduler {
    engine: Engine,
    reqs: HashMap<RequestId, ReqState>,
    loads: Vec<LoadOp>,
    finished: Vec<RequestId>,
    step: u64,
    /// The tokens of the blocks saved, for the KV events.
    book: TokenBook,
}

impl FlexkvScheduler {
    /// The scheduler half over an engine's shared cache.
    pub fn new(engine: Engine) -> Self {
        FlexkvScheduler {
            engine,
            reqs: HashMap::new(),
            loads: Vec::new(),
            finished: Vec::new(),
            step: 0,
            book: TokenBook::default(),
        }
    }

    fn block_size(&self) -> usize {
        self.engine.ctx.effective.block_size as usize
    }

    fn release_pins(&mut self, id: &RequestId) {
        if let Some(st) = self.reqs.get_mut(id) {
            if st.pinned > 0 {
                self.engine.cache.unpin(&st.hashes[..st.pinned]);
                st.pinned = 0;
            }
        }
    }
}

impl SchedulerConnector for FlexkvScheduler {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed: usize,
    ) -> ConnectorResult<MatchResult> {
        self.release_pins(&req.id);
        let bs = self.block_size();
        let hashes = match self.reqs.remove(&req.id) {
            Some(st) => st.hashes,
            None => block_hashes(self.engine.seed, &req.prompt_tokens, bs),
        };
        // At least one prompt token is left to compute.
        let max_blocks = req.prompt_tokens.len().saturating_sub(1) / bs;
        let pinned = self.engine.cache.pin_prefix(&hashes, max_blocks);
        let mut st = ReqState {
            hashes,
            pinned,
            num_computed,
            blocks: Vec::new(),
            save: Save::Waiting,
            load_sent_step: None,
        };
        let matched = pinned * bs;
        let answer = if matched > num_computed {
            MatchResult::Matched { tokens: matched - num_computed, async_load: true }
        } else {
            self.engine.cache.unpin(&st.hashes[..pinned]);
            st.pinned = 0;
            MatchResult::Matched { tokens: 0, async_load: false }
        };
        self.reqs.insert(req.id.clone(), st);
        Ok(answer)
    }

    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
        num_external_tokens: usize,
    ) -> ConnectorResult<()> {
        if blocks.0.len() > 1 {
            return Err(ConnectorError::invalid(
                NAME,
                format!(
                    "request {} got {} block tables; flexkv supports one (hybrid KV cache manager off)",
                    req.id,
                    blocks.0.len()
                ),
            ));
        }
        let bs = self.block_size();
        if !self.reqs.contains_key(&req.id) {
            // No lookup was made (the host skipped it): nothing is promised, saves still work.
            let hashes = block_hashes(self.engine.seed, &req.prompt_tokens, bs);
            let st = ReqState {
                hashes,
                pinned: 0,
                num_computed: 0,
                blocks: Vec::new(),
                save: Save::Waiting,
                load_sent_step: None,
            };
            self.reqs.insert(req.id.clone(), st);
        }
        let Some(st) = self.reqs.get_mut(&req.id) else { return Ok(()) };
        st.blocks = blocks.0.first().cloned().unwrap_or_default();
        if st.save == Save::Waiting {
            st.save = Save::Due;
            for (h, t) in st.hashes.iter().zip(req.prompt_tokens.chunks_exact(bs)) {
                self.book.note(*h, t);
            }
        }
        let first = st.num_computed / bs;
        let end = ((st.num_computed + num_external_tokens) / bs).min(st.pinned);
        if num_external_tokens == 0 || end <= first {
            let pinned = std::mem::take(&mut st.pinned);
            self.engine.cache.unpin(&st.hashes[..pinned]);
            return Ok(());
        }
        if st.blocks.len() < end {
            let pinned = std::mem::take(&mut st.pinned);
            self.engine.cache.unpin(&st.hashes[..pinned]);
            return Err(ConnectorError::invalid(
                NAME,
                format!(
                    "request {}: {num_external_tokens} external tokens need {end} blocks but only {} were \
                        allocated",
                    req.id,
                    st.blocks.len()
                ),
            ));
        }
        // The load takes over the references of [first, end); the rest are not needed.
        self.engine.cache.unpin(&st.hashes[..first]);
        self.engine.cache.unpin(&st.hashes[end..st.pinned]);
        st.pinned = 0;
        self.loads.push(LoadOp {
            req: req.id.clone(),
            hashes: st.hashes[first..end].to_vec(),
            blocks: st.blocks[first..end].to_vec(),
        });
        st.load_sent_step = Some(u64::MAX);
        Ok(())
    }

    fn build_connector_meta(&mut self, step: &StepInfo) -> ConnectorResult<Vec<u8>> {
        self.step = step.step;
        let loads = std::mem::take(&mut self.loads);
        for l in &loads {
            if let Some(st) = self.reqs.get_mut(&l.req) {
                st.load_sent_step = Some(step.step);
            }
        }
        let mut saves = Vec::new();
        for id in &step.scheduled {
            let Some(st) = self.reqs.get_mut(id) else { continue };
            // A request whose load goes out in this very step is computed in a later one.
            if st.save != Save::Due || st.load_sent_step == Some(step.step) {
                continue;
            }
            let n = st.hashes.len().min(st.blocks.len());
            st.save = Save::Sent;
            if n > 0 {
                saves.push(SaveOp {
                    req: id.clone(),
                    hashes: st.hashes[..n].to_vec(),
                    blocks: st.blocks[..n].to_vec(),
                });
            } else {
                // Nothing full to save: nothing to wait for either.
                st.save = Save::Waiting;
            }
        }
        let meta = FlexkvMeta { loads, saves, finished: std::mem::take(&mut self.finished) };
        serde_json::to_vec(&meta)
            .map_err(|e| ConnectorError::invalid(NAME, format!("encoding step metadata: {e}")))
    }

    fn request_finished(
        &mut self,
        req: &Request,
        _blocks: &BlocksPerGroup,
    ) -> ConnectorResult<RequestFinished> {
        self.release_pins(&req.id);
        let Some(st) = self.reqs.remove(&req.id) else { return Ok(RequestFinished::default()) };
        // A load that never went out still holds its references.
        self.loads.retain(|l| {
            if l.req == req.id {
                self.engine.cache.unpin(&l.hashes);
                false
            } else {
                true
            }
        });
        let delay_free = st.save == Save::Sent;
        if delay_free {
            self.finished.push(req.id.clone());
        }
        Ok(RequestFinished { delay_free, transfer_params: None })
    }

    fn take_events(&mut self) -> ConnectorResult<Vec<KvEvent>> {
        let mut events = self.engine.cache.take_events();
        self.book.fill(&mut events);
        Ok(events)
    }

    fn metrics(&mut self) -> ConnectorResult<Vec<ConnectorMetric>> {
        let (s, block) = (self.engine.cache.stats(), self.engine.cache.slot_bytes() as u64);
        let tiers = [("cpu", s.cpu_hits), ("ssd", s.ssd_hits)];
        let mut out: Vec<ConnectorMetric> =
            tiers.iter().map(|&(tier, n)| cache_metrics::hits(NAME, tier, n)).collect();
        out.extend(tiers.iter().map(|&(tier, n)| cache_metrics::loaded_bytes(NAME, tier, n * block)));
        let restored = (s.cpu_hits + s.ssd_hits) * block;
        out.extend(cache_metrics::offload(s.stored * block, restored));
        let ((_, on_cpu, on_ssd), (cpu_slots, ssd_slots)) =
            (self.engine.cache.sizes(), self.engine.cache.capacities());
        for (tier, evicted, held, slots) in
            [("cpu", s.cpu_evictions, on_cpu, cpu_slots), ("ssd", s.ssd_evictions, on_ssd, ssd_slots)]
        {
            if slots > 0 {
                out.push(cache_metrics::evictions(NAME, tier, evicted));
                out.extend(cache_metrics::occupancy(
                    NAME,
                    tier,
                    held as u64 * block,
                    u64::from(slots) * block,
                ));
            }
        }
        Ok(out)
    }

    fn reset_cache(&mut self) -> ConnectorResult<bool> {
        match self.engine.cache.clear() {
            Some(n) => {
                tracing::info!(blocks = n, "flexkv: reset: the cache was emptied");
                Ok(true)
            }
            None => {
                tracing::info!(
                    "flexkv: reset refused: a load or save holds cached blocks; retry once it is done"
                );
                Ok(false)
            }
        }
    }
}

impl Drop for FlexkvScheduler {
    fn drop(&mut self) {
        for l in &self.loads {
            self.engine.cache.unpin(&l.hashes);
        }
        let ids: Vec<RequestId> = self.reqs.keys().cloned().collect();
        for id in ids {
            self.release_pins(&id);
        }
    }
}
