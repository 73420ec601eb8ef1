//! The composite's scheduler half: lookups across children, allocation routed to the child
//! that provides the tokens, one metadata envelope per step, merged finish answers.

use crate::config::LookupMode;
use crate::error::{child_err, merged_metrics, PdError};
use crate::meta::{MetaEnvelope, MetaPart, META_VERSION};
use kvconnect_api::kv_events_merge::EventMerger;
use kvconnect_api::{
    BlocksPerGroup, ConnectorMetric, ConnectorResult, KvEvent, MatchResult, Request, RequestFinished,
    RequestId, SchedulerConnector, StepInfo,
};
use std::collections::{BTreeMap, HashMap};

/// What a lookup found for one request: tokens and async flag per child.
#[derive(Debug, Clone, Default)]
struct Matched {
    tokens: Vec<usize>,
    async_load: Vec<bool>,
}

/// The scheduler half of the composite.
pub struct PdScheduler {
    children: Vec<(String, Box<dyn SchedulerConnector>)>,
    lookup: LookupMode,
    matched: HashMap<RequestId, Matched>,
    delayed: BTreeMap<RequestId, Vec<usize>>,
    loads: BTreeMap<RequestId, Vec<usize>>,
    /// The children's KV events merged into one stream, duplicates dropped.
    events: EventMerger,
}

impl PdScheduler {
    /// A composite over these children (names unique, in order).
    pub fn new(children: Vec<(String, Box<dyn SchedulerConnector>)>, lookup: LookupMode) -> Self {
        PdScheduler {
            children,
            lookup,
            matched: HashMap::new(),
            delayed: BTreeMap::new(),
            loads: BTreeMap::new(),
            events: EventMerger::new(),
        }
    }

    fn names(&self) -> Vec<String> {
        self.children.iter().map(|(n, _)| n.clone()).collect()
    }
}

impl SchedulerConnector for PdScheduler {
    /// Where every child does (transports alone; a cache child matches any request). A
    /// request it is not asked about is allocated as if every child had matched nothing.
    fn matches_only_remote_prefills(&self) -> bool {
        self.children.iter().all(|(_, c)| c.matches_only_remote_prefills())
    }

    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed: usize,
    ) -> ConnectorResult<MatchResult> {
        let n = self.children.len();
        let mut m = Matched { tokens: vec![0; n], async_load: vec![false; n] };
        let mut offset = 0usize;
        for (i, (name, child)) in self.children.iter_mut().enumerate() {
            // Under `sum` each tier is asked for what lies past the earlier tiers' hits.
            let asked_from = match self.lookup {
                LookupMode::FirstHit => num_computed,
                LookupMode::Sum => num_computed + offset,
            };
            match child.get_num_new_matched_tokens(req, asked_from).map_err(|e| child_err(name, e))? {
                // An earlier child outranks later ones, so an undecided child decides the step.
                MatchResult::Pending => {
                    self.matched.remove(&req.id);
                    return Ok(MatchResult::Pending);
                }
                MatchResult::Matched { tokens, async_load } => {
                    m.tokens[i] = tokens;
                    m.async_load[i] = async_load && tokens > 0;
                    offset += tokens;
                    if self.lookup == LookupMode::FirstHit && tokens > 0 {
                        break;
                    }
                }
            }
        }
        let async_load = m.async_load.iter().any(|a| *a);
        self.matched.insert(req.id.clone(), m);
        Ok(MatchResult::Matched { tokens: offset, async_load })
    }

    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
        num_external_tokens: usize,
    ) -> ConnectorResult<()> {
        let n = self.children.len();
        let m = self
            .matched
            .remove(&req.id)
            .unwrap_or(Matched { tokens: vec![0; n], async_load: vec![false; n] });
        // The engine may load fewer tokens than matched (e.g. to keep one to compute); the
        // children in order give up to what each matched.
        let mut left = num_external_tokens;
        let mut give = vec![0usize; n];
        for (i, t) in m.tokens.iter().enumerate() {
            give[i] = (*t).min(left);
            left -= give[i];
        }
        if left > 0 {
            return Err(PdError::BadMeta(format!(
                "request {}: the engine will load {num_external_tokens} external tokens but the children \
                    matched only {} ({})",
                req.id,
                num_external_tokens - left,
                self.children
                    .iter()
                    .zip(&m.tokens)
                    .map(|((c, _), t)| format!("{c}: {t}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
            .into());
        }
        let mut loaders = Vec::new();
        for (i, (name, child)) in self.children.iter_mut().enumerate() {
            // Every child sees the blocks (a cache child saves from them); only the children
            // that provide tokens are told to load.
            child.update_state_after_alloc(req, blocks, give[i]).map_err(|e| child_err(name, e))?;
            if give[i] > 0 && m.async_load[i] {
                loaders.push(i);
            }
        }
        if !loaders.is_empty() {
            self.loads.insert(req.id.clone(), loaders);
        }
        Ok(())
    }

    fn build_connector_meta(&mut self, step: &StepInfo) -> ConnectorResult<Vec<u8>> {
        let mut parts = Vec::with_capacity(self.children.len());
        for (index, (name, child)) in self.children.iter_mut().enumerate() {
            let bytes = child.build_connector_meta(step).map_err(|e| child_err(name, e))?;
            parts.push(MetaPart { index, name: name.clone(), bytes });
        }
        let env = MetaEnvelope {
            version: META_VERSION,
            parts,
            delayed: std::mem::take(&mut self.delayed),
            loads: std::mem::take(&mut self.loads),
        };
        Ok(env.encode())
    }

    fn request_finished(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
    ) -> ConnectorResult<RequestFinished> {
        self.matched.remove(&req.id);
        let mut delayers = Vec::new();
        let mut params: Option<serde_json::Map<String, serde_json::Value>> = None;
        let mut owner: HashMap<String, String> = HashMap::new();
        let mut clash: Option<PdError> = None;
        let names = self.names();
        for (i, (name, child)) in self.children.iter_mut().enumerate() {
            let rf = child.request_finished(req, blocks).map_err(|e| child_err(name, e))?;
            if rf.delay_free {
                delayers.push(i);
            }
            if let Some(p) = rf.transfer_params {
                let merged = params.get_or_insert_with(serde_json::Map::new);
                for (k, v) in p {
                    if let Some(first) = owner.get(&k) {
                        clash.get_or_insert(PdError::ParamClash {
                            key: k.clone(),
                            first: first.clone(),
                            second: names[i].clone(),
                            request: req.id.to_string(),
                        });
                        continue;
                    }
                    owner.insert(k.clone(), name.clone());
                    merged.insert(k, v);
                }
            }
        }
        // Children that delayed will report the request as sent whatever happens here, so the
        // worker must know to wait for them even when the answer is an error.
        let delay_free = !delayers.is_empty();
        if delay_free {
            self.delayed.insert(req.id.clone(), delayers);
        }
        if let Some(e) = clash {
            return Err(e.into());
        }
        Ok(RequestFinished { delay_free, transfer_params: params })
    }

    fn take_events(&mut self) -> ConnectorResult<Vec<KvEvent>> {
        // Every child is asked, so that one child's error loses no other child's events.
        let mut out = Vec::new();
        let mut first_err = None;
        for (i, (name, child)) in self.children.iter_mut().enumerate() {
            match child.take_events() {
                Ok(events) => self.events.push(i, events, &mut out),
                Err(e) => {
                    first_err.get_or_insert(child_err(name, e));
                }
            }
        }
        match first_err {
            Some(e) if out.is_empty() => Err(e),
            Some(e) => {
                tracing::warn!("{e}; the other children's events are published");
                Ok(out)
            }
            None => Ok(out),
        }
    }

    fn metrics(&mut self) -> ConnectorResult<Vec<ConnectorMetric>> {
        Ok(merged_metrics(self.children.iter_mut().map(|(name, c)| (name.as_str(), c.metrics()))))
    }

    fn reset_cache(&mut self) -> ConnectorResult<bool> {
        // Every child is asked, even after one could not reset now.
        let mut all = true;
        for (name, child) in self.children.iter_mut() {
            all &= child.reset_cache().map_err(|e| child_err(name, e))?;
        }
        Ok(all)
    }
}
