//! The scheduler half: looks prompts up in the store and tells the worker half which blocks
//! to load before the forward pass and which to store after it.

use crate::meta::{LoadJob, SaveJob, StepMeta};
use crate::store::DirStore;
use crate::{store_dir, NAME};
use kvconnect_api::geometry::BlockShape;
use kvconnect_api::{
    serde_json, BlocksPerGroup, ConnectorContext, ConnectorError, ConnectorResult, MatchResult, Request,
    RequestFinished, RequestId, SchedulerConnector, StepInfo,
};
use std::collections::HashMap;

struct Lookup {
    key: String,
    tokens: Vec<u32>,
    num_computed: usize,
    hit: bool,
}

/// The scheduler half.
pub struct ExampleScheduler {
    store: DirStore,
    lookups: HashMap<RequestId, Lookup>,
    pending: StepMeta,
}

impl ExampleScheduler {
    /// A scheduler half for `ctx`; needs `dir` in the config.
    pub fn new(ctx: &ConnectorContext) -> ConnectorResult<Self> {
        let dir = store_dir(&ctx.config)?;
        let store = DirStore::open(&dir, BlockShape::of(&ctx.model, &ctx.effective), ctx.effective.layout)
            .map_err(|e| {
                ConnectorError::io(NAME, format!("cannot use store directory {}: {e}", dir.display()))
            })?;
        Ok(ExampleScheduler { store, lookups: HashMap::new(), pending: StepMeta::default() })
    }
}

impl SchedulerConnector for ExampleScheduler {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed: usize,
    ) -> ConnectorResult<MatchResult> {
        let n = self.store.cacheable_tokens(req.prompt_tokens.len());
        let tokens = req.prompt_tokens[..n].to_vec();
        let key = self.store.key(&tokens);
        let hit = n > 0 && self.store.contains(&key, &tokens);
        let matched = if hit { n.saturating_sub(num_computed) } else { 0 };
        self.lookups.insert(req.id.clone(), Lookup { key, tokens, num_computed, hit });
        Ok(MatchResult::Matched { tokens: matched, async_load: false })
    }

    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
        num_external_tokens: usize,
    ) -> ConnectorResult<()> {
        let Some(l) = self.lookups.remove(&req.id) else { return Ok(()) };
        let Some(table) = blocks.0.first() else { return Ok(()) };
        let bs = self.store.shape().tokens.max(1) as usize;
        let stored_blocks = l.tokens.len() / bs;
        if table.len() < stored_blocks {
            return Err(ConnectorError::invalid(
                NAME,
                format!(
                    "request {} has {} blocks allocated but its {} cacheable tokens need {stored_blocks}",
                    req.id,
                    table.len(),
                    l.tokens.len()
                ),
            ));
        }
        if l.hit && num_external_tokens > 0 {
            let first = l.num_computed / bs;
            self.pending.loads.push(LoadJob {
                key: l.key,
                first,
                blocks: table[first..stored_blocks].to_vec(),
            });
        } else if !l.hit && stored_blocks > 0 {
            self.pending.saves.push(SaveJob {
                key: l.key,
                tokens: l.tokens,
                blocks: table[..stored_blocks].to_vec(),
            });
        }
        Ok(())
    }

    fn build_connector_meta(&mut self, _step: &StepInfo) -> ConnectorResult<Vec<u8>> {
        let meta = std::mem::take(&mut self.pending);
        serde_json::to_vec(&meta)
            .map_err(|e| ConnectorError::Other { connector: NAME.into(), message: e.to_string() })
    }

    fn request_finished(
        &mut self,
        req: &Request,
        _blocks: &BlocksPerGroup,
    ) -> ConnectorResult<RequestFinished> {
        // Saves finish inside the step (wait_for_save), so blocks never need to outlive it.
        self.lookups.remove(&req.id);
        Ok(RequestFinished::default())
    }
}
