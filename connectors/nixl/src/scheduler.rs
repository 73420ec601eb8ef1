//! The scheduler half. Producer: a request finished with `do_remote_decode` keeps its blocks
//! (delay-free) and returns the transfer params. Consumer: a request carrying
//! `do_remote_prefill` matches the remote tokens as an async load, and its blocks go to the
//! worker in the next step's metadata.

use crate::config::{NixlConfig, NAME};
use crate::metadata::{LoadSpec, NixlMeta, SendSpec};
use kvconnect_api::tp_ranks;
use kvconnect_api::{
    BlocksPerGroup, ConnectorContext, ConnectorError, ConnectorResult, MatchResult, Request, RequestFinished,
    RequestId, SchedulerConnector, StepInfo,
};
use kvconnect_dataplane::params::{wants_remote_decode, TransferParams};
use std::collections::{HashMap, HashSet};

/// The nixl scheduler half.
#[derive(Debug)]
pub struct NixlScheduler {
    ctx: ConnectorContext,
    cfg: NixlConfig,
    loads: Vec<LoadSpec>,
    sends: Vec<SendSpec>,
    /// `num_computed` seen when a request matched, so the load starts after it, and whether
    /// its load was matched as a synchronous one.
    computed: HashMap<RequestId, (usize, bool)>,
    /// Requests whose load was already scheduled: never load twice.
    scheduled: HashSet<RequestId>,
}

impl NixlScheduler {
    /// A scheduler half for `ctx`.
    pub fn new(ctx: &ConnectorContext, cfg: NixlConfig) -> NixlScheduler {
        NixlScheduler {
            ctx: ctx.clone(),
            cfg,
            loads: Vec::new(),
            sends: Vec::new(),
            computed: HashMap::new(),
            scheduled: HashSet::new(),
        }
    }
}

impl NixlScheduler {
    /// Whether a load of `tokens` tokens is synchronous: as `load` says for its bytes on this
    /// rank ([`NixlConfig::sync_for`]), with the hybrid KV cache manager off and one KV cache
    /// group, where a failed load is told by its blocks. With HMA on, an engine reports failed
    /// loads by request (block ids may repeat across groups), which only an asynchronous load
    /// can be.
    fn loads_sync(&self, tokens: usize) -> bool {
        let e = &self.ctx.effective;
        let per_token = self.ctx.model.kv_bytes_per_token(e.cache_dtype) / u64::from(self.ctx.tp_size.max(1));
        let bytes = per_token.saturating_mul(tokens as u64);
        !e.hma && e.groups.len() == 1 && e.state_groups.is_empty() && self.cfg.sync_for(bytes)
    }

    /// Whether a load of tokens up to `end`, from a producer holding `held` of a `prompt`-token
    /// prompt, would race the engine if it were synchronous. Such a load runs in the step that
    /// computes the prompt's tokens from `end` on, and vLLM writes each layer's new KV before it
    /// waits for that layer's load; the load copies its last block whole, so it may land on a
    /// slot the step just wrote. That is harmless where the producer holds that position's KV
    /// (the same token's), and wrong past `held`: a decode given more of the prompt than
    /// prefill computed (a proxy that appends prefill's token) would attend to the producer's
    /// stale slot. Such a load is asynchronous: it ends before the request computes anything.
    fn races_the_step(&self, held: usize, end: usize, prompt: usize) -> bool {
        let bs = (self.ctx.effective.block_size as usize).max(1);
        held < (end.div_ceil(bs) * bs).min(prompt)
    }
}

impl SchedulerConnector for NixlScheduler {
    /// A transport: it matches only a decode's request, from the params prefill returned.
    fn matches_only_remote_prefills(&self) -> bool {
        true
    }

    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed: usize,
    ) -> ConnectorResult<MatchResult> {
        let none = MatchResult::Matched { tokens: 0, async_load: false };
        let Some(p) = TransferParams::from_request(NAME, req)? else { return Ok(none) };
        if self.scheduled.contains(&req.id) {
            return Ok(none);
        }
        // Leave at least one prompt token for the engine to compute (it needs its logits).
        let loadable = p.remote_num_tokens.min(req.prompt_tokens.len().saturating_sub(1));
        let tokens = loadable.saturating_sub(num_computed);
        if tokens == 0 {
            return Ok(none);
        }
        let sync = self.loads_sync(tokens)
            && !self.races_the_step(p.remote_num_tokens, loadable, req.prompt_tokens.len());
        self.computed.insert(req.id.clone(), (num_computed, sync));
        Ok(MatchResult::Matched { tokens, async_load: !sync })
    }

    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
        num_external_tokens: usize,
    ) -> ConnectorResult<()> {
        let Some(p) = TransferParams::from_request(NAME, req)? else { return Ok(()) };
        // The load is as it was matched (the engine scheduled it so).
        let (first, sync) =
            self.computed.remove(&req.id).unwrap_or_else(|| (0, self.loads_sync(num_external_tokens)));
        if self.scheduled.contains(&req.id) {
            return Ok(());
        }
        // The producer ranks this rank reads (several at a smaller TP size than prefill's),
        // and which of a producer rank's readers it is (at a larger one).
        let sources = tp_ranks::sources(&req.kv_transfer_params)
            .into_iter()
            .map(|m| {
                let r = Request { kv_transfer_params: m, ..req.clone() };
                TransferParams::from_request(NAME, &r)?.ok_or_else(|| {
                    ConnectorError::invalid(
                        NAME,
                        format!(
                            "request {}: a producer rank's kv_transfer_params lack do_remote_prefill; \
                            forward the params prefill returned unchanged",
                            req.id
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let reader = tp_ranks::reader(&req.kv_transfer_params);
        let n = u32::try_from(sources.len()).unwrap_or(u32::MAX);
        if num_external_tokens == 0 {
            // Computed locally after all: free the producer's blocks now, not at lease expiry.
            self.scheduled.insert(req.id.clone());
            for p in &sources {
                let mut release = LoadSpec::release(
                    req.id.clone(),
                    p.remote_engine_id.clone(),
                    p.remote_capability.clone(),
                );
                release.remote_side_channel = p.side_channel();
                release.remote_request = p.remote_request_id.clone().map(RequestId);
                release.reader = reader;
                self.loads.push(release);
            }
            return Ok(());
        }
        // Negotiation and the handshake already refuse TP sizes that do not divide each other
        // (decode's ranks read head slices from prefill's, or the reverse); params from
        // elsewhere stop here.
        let (a, b) = (p.tp_size.max(1), self.ctx.tp_size.max(1));
        if !a.is_multiple_of(b) && !b.is_multiple_of(a) {
            return Err(ConnectorError::invalid(
                NAME,
                format!(
                    "request {} comes from a prefill with tp_size {a} but this decode has tp_size {b}: the \
                        sizes must divide one another (D = P/2, P, 2P, ...); run decode with tp_size {a}",
                    req.id
                ),
            ));
        }
        self.scheduled.insert(req.id.clone());
        for p in &sources {
            self.loads.push(LoadSpec {
                request: req.id.clone(),
                remote_request: p.remote_request_id.clone().map(RequestId),
                remote_engine_id: p.remote_engine_id.clone(),
                remote_capability: p.remote_capability.clone(),
                remote_side_channel: p.side_channel(),
                remote_blocks: p.blocks(),
                local_blocks: blocks.clone(),
                first_token: first,
                num_tokens: first + num_external_tokens,
                reader,
                sources: n,
                sync,
            });
        }
        Ok(())
    }

    fn build_connector_meta(&mut self, _step: &StepInfo) -> ConnectorResult<Vec<u8>> {
        let meta =
            NixlMeta { loads: std::mem::take(&mut self.loads), sends: std::mem::take(&mut self.sends) };
        serde_json::to_vec(&meta)
            .map_err(|e| ConnectorError::io(NAME, format!("cannot encode step metadata: {e}")))
    }

    fn request_finished(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
    ) -> ConnectorResult<RequestFinished> {
        self.scheduled.remove(&req.id);
        self.computed.remove(&req.id);
        if !wants_remote_decode(req) {
            return Ok(RequestFinished::default());
        }
        let (host, port) = self.cfg.side_channel.clone().ok_or_else(|| {
            ConnectorError::config(
                NAME,
                format!(
                    "request {} asks for remote decode but kv_connector_extra_config has no \
                        side_channel_host/side_channel_port: the host sets them to its side-channel address \
                        before creating the connector",
                    req.id
                ),
            )
        })?;
        let params = TransferParams {
            remote_engine_id: self.ctx.engine_id.clone(),
            remote_host: host,
            remote_port: port,
            remote_block_ids: blocks.0.iter().map(|g| g.iter().map(|b| b.0).collect()).collect(),
            remote_num_tokens: req.prompt_tokens.len(),
            tp_size: self.ctx.tp_size,
            remote_request_id: Some(req.id.0.clone()),
            remote_capability: kvconnect_dataplane::auth::capability().map_err(|e| {
                ConnectorError::io(
                    NAME,
                    format!("request {}: cannot make its transfer capability: {e}", req.id),
                )
            })?,
        };
        let has_blocks = blocks.0.iter().any(|g| !g.is_empty());
        if has_blocks {
            self.sends.push(SendSpec {
                request: req.id.clone(),
                capability: params.remote_capability.clone(),
                blocks: blocks.clone(),
            });
        }
        Ok(RequestFinished { delay_free: has_blocks, transfer_params: Some(params.to_map()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LoadMode;
    use kvconnect_api::tp_ranks::{params_for_rank, RANK_PARAMS};
    use kvconnect_api::{BlockId, KvLayout, KvRole};
    use kvconnect_bench::harness::{context, effective, model};
    use serde_json::{json, Value};

    /// Prefill rank `rank`'s params for a 70-token request held in blocks 4 and 5.
    fn producer_rank(rank: u16, tp_size: u32) -> Value {
        let p = TransferParams {
            remote_engine_id: "prefill".into(),
            remote_host: "127.0.0.1".into(),
            remote_port: 5600 + rank,
            remote_block_ids: vec![vec![4, 5]],
            remote_num_tokens: 70,
            tp_size,
            remote_request_id: Some("r".into()),
            remote_capability: format!("cap{rank}"),
        };
        Value::Object(p.to_map())
    }

    /// The loads decode rank `rank` of `tp` schedules for a request from prefill's `ranks`.
    fn loads(rank: u32, tp: u32, params: Value) -> Vec<LoadSpec> {
        loads_with(rank, tp, params, NixlConfig::default(), 1)
    }

    /// As `loads`, with `cfg` over a model of `groups` KV cache groups (HMA on with more than
    /// one).
    fn loads_with(rank: u32, tp: u32, params: Value, cfg: NixlConfig, groups: usize) -> Vec<LoadSpec> {
        loads_in(rank, tp, params, cfg, groups, groups > 1)
    }

    /// Whether the 69 loaded tokens' bytes on rank 0 of `tp` make a synchronous load under `cfg`.
    fn sync_expected(cfg: &NixlConfig, tp: u32, groups: usize, hma: bool) -> bool {
        let m = model(2, 2, 8);
        let eff = effective(&m, KvLayout::HND, 32);
        let bytes = m.kv_bytes_per_token(eff.cache_dtype) / u64::from(tp) * 69;
        groups == 1 && !hma && cfg.sync_for(bytes)
    }

    /// As `loads_with`, with HMA on or off.
    fn loads_in(
        rank: u32,
        tp: u32,
        params: Value,
        cfg: NixlConfig,
        groups: usize,
        hma: bool,
    ) -> Vec<LoadSpec> {
        let m = model(2, 2, 8);
        let mut eff = effective(&m, KvLayout::HND, 32);
        eff.hma = hma;
        while eff.groups.len() < groups {
            eff.groups.push(eff.groups[0].clone());
        }
        let mut ctx = context(&m, &eff, KvRole::Consumer, "decode", json!({}));
        (ctx.tp_rank, ctx.tp_size) = (rank, tp);
        let sync = sync_expected(&cfg, tp, groups, hma);
        let mut s = NixlScheduler::new(&ctx, cfg);
        let Value::Object(params) = params else { unreachable!("params are an object") };
        let mine = params_for_rank(&params, rank as usize, tp as usize).unwrap();
        let req = Request { id: "r".into(), prompt_tokens: vec![1; 70], kv_transfer_params: mine };
        assert_eq!(
            s.get_num_new_matched_tokens(&req, 0).unwrap(),
            MatchResult::Matched { tokens: 69, async_load: !sync }
        );
        s.update_state_after_alloc(&req, &BlocksPerGroup(vec![vec![BlockId(1), BlockId(2), BlockId(3)]]), 64)
            .unwrap();
        let meta: NixlMeta =
            serde_json::from_slice(&s.build_connector_meta(&StepInfo::default()).unwrap()).unwrap();
        // The load is as it was matched.
        assert!(meta.loads.iter().all(|l| l.sync == sync), "{:?}", meta.loads);
        meta.loads
    }

    /// What `matches_only_remote_prefills` declares, and hosts act on: a request that is not a
    /// decode's matches nothing and changes nothing, so a step is the same whether the
    /// scheduler asked about it or not.
    #[test]
    fn only_a_decodes_request_matches_so_the_others_need_not_be_asked() {
        let m = model(2, 2, 8);
        let eff = effective(&m, KvLayout::HND, 32);
        let ctx = context(&m, &eff, KvRole::Both, "both", json!({}));
        let mut asked = NixlScheduler::new(&ctx, NixlConfig::default());
        let mut not_asked = NixlScheduler::new(&ctx, NixlConfig::default());
        assert!(asked.matches_only_remote_prefills());
        let blocks = BlocksPerGroup(vec![vec![BlockId(1), BlockId(2)]]);
        let params = [json!({}), json!({"do_remote_decode": true}), json!({"do_remote_prefill": false})];
        for (i, p) in params.into_iter().enumerate() {
            let Value::Object(p) = p else { unreachable!("params are an object") };
            let req =
                Request { id: RequestId(format!("r{i}")), prompt_tokens: vec![1; 70], kv_transfer_params: p };
            assert_eq!(
                asked.get_num_new_matched_tokens(&req, 0).unwrap(),
                MatchResult::Matched { tokens: 0, async_load: false }
            );
            asked.update_state_after_alloc(&req, &blocks, 0).unwrap();
            not_asked.update_state_after_alloc(&req, &blocks, 0).unwrap();
        }
        let step = |s: &mut NixlScheduler| s.build_connector_meta(&StepInfo::default()).unwrap();
        assert_eq!(step(&mut asked), step(&mut not_asked));
    }

    #[test]
    fn a_decode_at_a_smaller_tp_loads_from_every_producer_rank_a_larger_one_shares_one() {
        // TP 2 -> 1: one load per prefill rank, each naming its own side channel and capability.
        let two = json!({"do_remote_prefill": true, RANK_PARAMS: [producer_rank(0, 2), producer_rank(1, 2)]});
        let l = loads(0, 1, two);
        let from: Vec<_> =
            l.iter().map(|l| (l.remote_side_channel.as_str(), l.remote_capability.as_str())).collect();
        assert_eq!(from, [("127.0.0.1:5600", "cap0"), ("127.0.0.1:5601", "cap1")]);
        assert!(l.iter().all(|l| l.sources == 2 && l.reader.is_none() && l.num_tokens == 64));
        // TP 1 -> 2: each decode rank one load from the one prefill rank, as reader r of 2.
        for r in 0..2 {
            let l = loads(r, 2, producer_rank(0, 1));
            assert_eq!(l.len(), 1);
            assert_eq!(
                (l[0].remote_capability.as_str(), l[0].sources, l[0].reader),
                ("cap0", 1, Some((r, 2)))
            );
        }
    }

    #[test]
    fn a_load_that_would_copy_over_a_slot_the_step_writes_past_the_producers_tokens_is_asynchronous() {
        let m = model(2, 2, 8);
        let eff = effective(&m, KvLayout::HND, 32);
        let ctx = context(&m, &eff, KvRole::Consumer, "decode", json!({}));
        let sync = NixlConfig { load: LoadMode::Sync, ..NixlConfig::default() };
        let matched = |held: usize, prompt: usize| {
            let mut s = NixlScheduler::new(&ctx, sync.clone());
            let Value::Object(mut params) = producer_rank(0, 1) else { unreachable!("params are an object") };
            params.insert("remote_num_tokens".into(), json!(held));
            let req = Request { id: "r".into(), prompt_tokens: vec![1; prompt], kv_transfer_params: params };
            s.get_num_new_matched_tokens(&req, 0).unwrap()
        };
        // vLLM's protocol: every prompt token but the last, the last computed in the load's
        // step at a position the producer holds too.
        assert_eq!(matched(70, 70), MatchResult::Matched { tokens: 69, async_load: false });
        // Prefill's token appended: all 70 loaded, the 71st computed in the last loaded block,
        // whose slot 70 the producer never wrote: asynchronous.
        assert_eq!(matched(70, 71), MatchResult::Matched { tokens: 70, async_load: true });
        // The same on a block boundary: the copy ends where the step's writes begin.
        assert_eq!(matched(64, 65), MatchResult::Matched { tokens: 64, async_load: false });
    }

    #[test]
    fn load_sync_is_a_synchronous_match_and_load_with_one_kv_cache_group_and_hma_off_only() {
        let sync = NixlConfig { load: LoadMode::Sync, ..NixlConfig::default() };
        let l = loads_with(0, 1, producer_rank(0, 1), sync.clone(), 1);
        assert!(l.len() == 1 && l[0].sync, "{l:?}");
        // HMA's groups repeat block ids, so a failed load must be told by request: async.
        let l = loads_with(0, 1, producer_rank(0, 1), sync.clone(), 2);
        assert!(l.len() == 1 && !l[0].sync, "{l:?}");
        // HMA on with one group (vLLM's HMA class on a model of one attention kind): failed
        // loads go by request there too.
        let l = loads_in(0, 1, producer_rank(0, 1), sync, 1, true);
        assert!(l.len() == 1 && !l[0].sync, "{l:?}");
        let not = NixlConfig { load: LoadMode::Async, ..NixlConfig::default() };
        assert!(!loads_with(0, 1, producer_rank(0, 1), not, 1)[0].sync);
    }

    #[test]
    fn load_auto_is_synchronous_over_shm_for_a_load_within_the_limit_only() {
        // The default: shm, auto, 64 MiB; the test model's 69 tokens are a few KiB.
        assert!(loads(0, 1, producer_rank(0, 1))[0].sync);
        let per_token = {
            let m = model(2, 2, 8);
            m.kv_bytes_per_token(effective(&m, KvLayout::HND, 32).cache_dtype)
        };
        // The limit counts this rank's bytes: at TP 2 half of each token's.
        for (tp, limit, sync) in
            [(1, per_token * 69, true), (1, per_token * 69 - 1, false), (2, per_token * 69 / 2, true)]
        {
            let cfg = NixlConfig { sync_max_bytes: limit, ..NixlConfig::default() };
            let l = loads_with(0, tp, producer_rank(0, 1), cfg, 1);
            assert!(l.iter().all(|l| l.sync == sync), "tp {tp} limit {limit}: {l:?}");
        }
        // Over tcp, auto is asynchronous.
        let tcp =
            NixlConfig { backend: crate::config::Backend::parse("tcp").unwrap(), ..NixlConfig::default() };
        assert!(!loads_with(0, 1, producer_rank(0, 1), tcp, 1)[0].sync);
    }
}
