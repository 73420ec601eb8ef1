//! The composite's factory: resolves the children through the host's resolver, derives the
//! capabilities from theirs, and creates the two halves over the children's halves.

use crate::caps::combine;
use crate::children::{resolve_children, Child, ExpandGuard};
use crate::config::PdConfig;
use crate::error::{PdError, PD};
use crate::scheduler::PdScheduler;
use crate::worker::PdWorker;
use kvconnect_api::negotiate::ChildCaps;
use kvconnect_api::{
    Capabilities, ConnectorContext, ConnectorFactory, ConnectorInfo, ConnectorResolver, ConnectorResult,
    KvTransferConfig, ModelSpec, SchedulerConnector, WorkerConnector,
};
use std::sync::Arc;

/// Creates composites. The host registry constructs one with itself as the resolver, so a
/// child can be any connector the host knows, a plugin or another composite.
pub struct PdFactory {
    resolver: Arc<dyn ConnectorResolver>,
}

impl PdFactory {
    /// A factory resolving children through `resolver`.
    pub fn new(resolver: Arc<dyn ConnectorResolver>) -> PdFactory {
        PdFactory { resolver }
    }

    /// The composite's config and its resolved, uniquely named children.
    pub fn children(&self, config: &KvTransferConfig) -> Result<(PdConfig, Vec<Child>), PdError> {
        let cfg = PdConfig::from_config(config)?;
        let children = resolve_children(&cfg, self.resolver.as_ref())?;
        Ok((cfg, children))
    }

    /// Every leaf connector under this composite, in order, nested composites flattened,
    /// with names unique across the whole tree (`nixl`, `nixl#2`).
    pub fn leaf_capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> Result<Vec<ChildCaps>, PdError> {
        let _guard = ExpandGuard::enter(config)?;
        let (_, children) = self.children(config)?;
        let mut out: Vec<ChildCaps> = Vec::new();
        for c in &children {
            let err = |e| PdError::Child { child: c.name.clone(), source: e };
            let leaves = match c.factory.child_capabilities(&c.config, model).map_err(err)? {
                Some(leaves) => leaves,
                None => {
                    let caps = c.factory.capabilities(&c.config, model).map_err(err)?;
                    caps.validate().map_err(|e| {
                        err(kvconnect_api::ConnectorError::config(
                            &c.name,
                            format!("declares contradictory capabilities: {e}"),
                        ))
                    })?;
                    vec![ChildCaps { name: c.name.clone(), version: c.factory.info().version, caps }]
                }
            };
            for mut leaf in leaves {
                let base = leaf.name.clone();
                let mut n = 1;
                while out.iter().any(|o| o.name == leaf.name) {
                    n += 1;
                    leaf.name = format!("{base}#{n}");
                }
                out.push(leaf);
            }
        }
        Ok(out)
    }

    fn child_ctx(ctx: &ConnectorContext, child: &Child) -> ConnectorContext {
        ConnectorContext { config: child.config.clone(), ..ctx.clone() }
    }
}

impl ConnectorFactory for PdFactory {
    fn info(&self) -> ConnectorInfo {
        ConnectorInfo {
            name: PD.to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            description:
                "composite: several children (caches, transports, plugins) behind one connector and \
                one negotiated layout"
                    .to_owned(),
        }
    }

    fn capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Capabilities> {
        let leaves = self.leaf_capabilities(config, model)?;
        let named: Vec<(String, Capabilities)> = leaves.into_iter().map(|c| (c.name, c.caps)).collect();
        Ok(combine(&named)?)
    }

    fn child_capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Option<Vec<ChildCaps>>> {
        Ok(Some(self.leaf_capabilities(config, model)?))
    }

    fn create_scheduler(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
        let _guard = ExpandGuard::enter(&ctx.config)?;
        let (cfg, children) = self.children(&ctx.config)?;
        let mut halves = Vec::with_capacity(children.len());
        for c in &children {
            let s = c
                .factory
                .create_scheduler(&Self::child_ctx(ctx, c))
                .map_err(|e| PdError::Child { child: c.name.clone(), source: e })?;
            halves.push((c.name.clone(), s));
        }
        Ok(Box::new(PdScheduler::new(halves, cfg.lookup)))
    }

    fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
        let _guard = ExpandGuard::enter(&ctx.config)?;
        let (_, children) = self.children(&ctx.config)?;
        let mut halves = Vec::with_capacity(children.len());
        let mut movers = Vec::new();
        for (i, c) in children.iter().enumerate() {
            let caps = c
                .factory
                .capabilities(&c.config, Some(&ctx.model))
                .map_err(|e| PdError::Child { child: c.name.clone(), source: e })?;
            if caps.transfer_mode != kvconnect_api::TransferMode::None {
                movers.push(i);
            }
        }
        let transport = if movers.len() == 1 { movers.first().copied() } else { None };
        for c in &children {
            let w = c
                .factory
                .create_worker(&Self::child_ctx(ctx, c))
                .map_err(|e| PdError::Child { child: c.name.clone(), source: e })?;
            halves.push((c.name.clone(), w));
        }
        Ok(Box::new(PdWorker::new(halves).with_transport(transport)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{caps_any, caps_cache, FakeFactory, FakeResolver, Shared};
    use kvconnect_api::{
        AttentionKind, BlockId, BlocksPerGroup, Dtype, EffectiveLayout, KvLayout, KvRole, LayerId,
        MatchResult, MemoryKind, Request, RequestId, StepInfo, TransferMode,
    };

    fn model() -> ModelSpec {
        ModelSpec {
            name: "tiny".into(),
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 4,
            dtype: Some(Dtype::Bf16),
            layers: vec![AttentionKind::Full; 2],
            state: None,
        }
    }

    fn ctx(json: &str) -> ConnectorContext {
        ConnectorContext {
            config: KvTransferConfig::from_json(json).unwrap(),
            model: model(),
            effective: EffectiveLayout {
                layout: KvLayout::HND,
                hma: false,
                block_size: 16,
                cache_dtype: Dtype::Bf16,
                memory: MemoryKind::Host,
                transfer_mode: TransferMode::Pull,
                groups: vec![],
                state_groups: vec![],
                opaque_blocks: false,
            },
            role: KvRole::Producer,
            engine_id: "e0".into(),
            tp_rank: 0,
            tp_size: 1,
        }
    }

    fn pd(children: &[&str], extra: &str) -> String {
        let list: Vec<String> = children.iter().map(|c| format!("{{\"kv_connector\":\"{c}\"}}")).collect();
        format!(
            r#"{{"kv_connector":"PdConnector","kv_connector_extra_config":{{"connectors":[{}]{extra}}}}}"#,
            list.join(",")
        )
    }

    /// A composite over fake children `a` (a cache) and `b` (a transport).
    fn setup(extra: &str) -> (PdFactory, Shared, Shared, String) {
        let (a, sa) = FakeFactory::new("a", caps_cache());
        let (b, sb) = FakeFactory::new("b", caps_any());
        let r = FakeResolver::default().with(a).with(b);
        (PdFactory::new(Arc::new(r)), sa, sb, pd(&["a", "b"], extra))
    }

    fn req(id: &str) -> Request {
        Request {
            id: RequestId::from(id),
            prompt_tokens: vec![1; 100],
            kv_transfer_params: Default::default(),
        }
    }

    fn blocks() -> BlocksPerGroup {
        BlocksPerGroup(vec![vec![BlockId(1), BlockId(2)]])
    }

    fn calls(s: &Shared) -> Vec<String> {
        s.lock().unwrap().calls.clone()
    }

    /// The composite matches only decodes' requests where every child does: a cache child
    /// matches any request. A request it was not asked about is allocated as one that matched
    /// nothing in every child.
    #[test]
    fn only_remote_prefills_where_every_child_says_so() {
        let (f, sa, sb, cfg) = setup("");
        sb.lock().unwrap().only_remote_prefills = true;
        assert!(!f.create_scheduler(&ctx(&cfg)).unwrap().matches_only_remote_prefills(), "a is a cache");
        sa.lock().unwrap().only_remote_prefills = true;
        let mut s = f.create_scheduler(&ctx(&cfg)).unwrap();
        assert!(s.matches_only_remote_prefills());
        s.update_state_after_alloc(&req("r1"), &blocks(), 0).unwrap();
        for c in [&sa, &sb] {
            assert!(calls(c).contains(&"alloc r1 0 blocks=2".to_owned()), "{:?}", calls(c));
        }
    }

    #[test]
    fn first_hit_lookup_routes_the_load_to_the_winner() {
        let (f, sa, sb, cfg) = setup("");
        let mut s = f.create_scheduler(&ctx(&cfg)).unwrap();
        sa.lock().unwrap().cached.insert("r1".into(), 32);
        sb.lock().unwrap().cached.insert("r1".into(), 64);
        let m = s.get_num_new_matched_tokens(&req("r1"), 0).unwrap();
        assert_eq!(m, MatchResult::Matched { tokens: 32, async_load: false });
        assert!(!calls(&sb).iter().any(|c| c.starts_with("lookup")), "b is not asked after a's hit");
        s.update_state_after_alloc(&req("r1"), &blocks(), 32).unwrap();
        assert!(calls(&sa).contains(&"alloc r1 32 blocks=2".to_owned()));
        assert!(calls(&sb).contains(&"alloc r1 0 blocks=2".to_owned()), "the other child is told 0");

        // A miss in the first child falls through to the second.
        sb.lock().unwrap().cached.insert("r2".into(), 48);
        let m = s.get_num_new_matched_tokens(&req("r2"), 16).unwrap();
        assert_eq!(m, MatchResult::Matched { tokens: 32, async_load: false });
        s.update_state_after_alloc(&req("r2"), &blocks(), 32).unwrap();
        assert!(calls(&sa).contains(&"alloc r2 0 blocks=2".to_owned()));
        assert!(calls(&sb).contains(&"alloc r2 32 blocks=2".to_owned()));

        // An undecided earlier child keeps the answer pending.
        sa.lock().unwrap().pending.push("r3".into());
        assert_eq!(s.get_num_new_matched_tokens(&req("r3"), 0).unwrap(), MatchResult::Pending);
    }

    /// Two cache children holding the same prefix: the composite publishes each block once
    /// per medium, and its removal only when the last holder lets it go.
    #[test]
    fn events_of_the_children_merge_without_duplicates() {
        use kvconnect_api::{KvEvent, Medium};
        let (f, sa, sb, cfg) = setup("");
        let mut s = f.create_scheduler(&ctx(&cfg)).unwrap();
        let st = |h: Vec<u64>, p| {
            KvEvent::stored(h.clone(), p, h.iter().map(|&x| x as u32).collect(), 1, Medium::CpuTier)
        };
        sa.lock().unwrap().events = vec![st(vec![1, 2], None)];
        sb.lock().unwrap().events =
            vec![st(vec![1, 2, 3], None), KvEvent::stored(vec![1], None, vec![1], 1, Medium::Disk)];
        assert_eq!(
            s.take_events().unwrap(),
            vec![
                st(vec![1, 2], None),
                st(vec![3], Some(2)),
                KvEvent::stored(vec![1], None, vec![1], 1, Medium::Disk)
            ]
        );
        // a moves 2 to disk: one removal from its CPU tier (b still holds it there: dropped),
        // one store on disk.
        sa.lock().unwrap().events = vec![
            KvEvent::removed(vec![2], Medium::CpuTier),
            KvEvent::stored(vec![2], Some(1), vec![2], 1, Medium::Disk),
        ];
        assert_eq!(
            s.take_events().unwrap(),
            vec![KvEvent::stored(vec![2], Some(1), vec![2], 1, Medium::Disk)]
        );
        sb.lock().unwrap().events = vec![KvEvent::removed(vec![1, 2, 3], Medium::CpuTier)];
        assert_eq!(
            s.take_events().unwrap(),
            vec![KvEvent::removed(vec![2, 3], Medium::CpuTier)],
            "a still holds 1"
        );
        assert!(s.take_events().unwrap().is_empty());
    }

    #[test]
    fn sum_lookup_stacks_tiers() {
        let (f, sa, sb, cfg) = setup(r#","lookup":"sum""#);
        let mut s = f.create_scheduler(&ctx(&cfg)).unwrap();
        sa.lock().unwrap().cached.insert("r1".into(), 32);
        sb.lock().unwrap().cached.insert("r1".into(), 80);
        sb.lock().unwrap().async_load = true;
        let m = s.get_num_new_matched_tokens(&req("r1"), 0).unwrap();
        assert_eq!(m, MatchResult::Matched { tokens: 80, async_load: true });
        assert!(calls(&sb).contains(&"lookup r1 32".to_owned()), "b is asked past a's 32 tokens");
        s.update_state_after_alloc(&req("r1"), &blocks(), 64).unwrap();
        assert!(calls(&sa).contains(&"alloc r1 32 blocks=2".to_owned()));
        assert!(calls(&sb).contains(&"alloc r1 32 blocks=2".to_owned()), "64 - a's 32");
        // Asking for more than was matched is refused, naming what each child had.
        s.get_num_new_matched_tokens(&req("r2"), 0).unwrap();
        let e = s.update_state_after_alloc(&req("r2"), &blocks(), 8).unwrap_err().to_string();
        assert!(e.contains("matched only 0") && e.contains("a: 0, b: 0"), "{e}");
    }

    #[test]
    fn worker_calls_fan_out_to_every_child_in_order() {
        let (f, sa, sb, cfg) = setup("");
        let mut w = f.create_worker(&ctx(&cfg)).unwrap();
        w.register_kv_caches(&[]).unwrap();
        w.start_load_kv().unwrap();
        w.wait_for_layer_load(LayerId(0)).unwrap();
        w.save_kv_layer(LayerId(3), &[BlockId(1), BlockId(2)]).unwrap();
        w.wait_for_save().unwrap();
        w.shutdown().unwrap();
        let want = ["register 0", "start_load", "wait_layer 0", "save 3 [1, 2]", "wait_save", "shutdown"];
        for s in [&sa, &sb] {
            let got: Vec<String> = calls(s).into_iter().filter(|c| !c.starts_with("create")).collect();
            assert_eq!(got, want);
        }
        sa.lock().unwrap().load_errors = vec![5, 2];
        sb.lock().unwrap().load_errors = vec![2, 9];
        assert_eq!(w.block_ids_with_load_errors().unwrap(), vec![BlockId(2), BlockId(5), BlockId(9)]);
    }

    #[test]
    fn meta_envelope_reaches_each_child() {
        let (f, sa, sb, cfg) = setup("");
        let mut s = f.create_scheduler(&ctx(&cfg)).unwrap();
        let mut w = f.create_worker(&ctx(&cfg)).unwrap();
        let meta = s.build_connector_meta(&StepInfo { step: 7, ..Default::default() }).unwrap();
        w.bind_connector_meta(&meta).unwrap();
        assert_eq!(sa.lock().unwrap().bound, vec![b"a@7".to_vec()]);
        assert_eq!(sb.lock().unwrap().bound, vec![b"b@7".to_vec()]);
        let e = w.bind_connector_meta(b"a@7").unwrap_err().to_string();
        assert!(e.contains("not a composite metadata envelope"), "{e}");
    }

    #[test]
    fn finished_sending_waits_for_every_child_that_delayed() {
        let (f, sa, sb, cfg) = setup("");
        let mut s = f.create_scheduler(&ctx(&cfg)).unwrap();
        let mut w = f.create_worker(&ctx(&cfg)).unwrap();
        sa.lock().unwrap().delay = true;
        sb.lock().unwrap().delay = true;
        assert!(s.request_finished(&req("r1"), &blocks()).unwrap().delay_free);
        w.bind_connector_meta(&s.build_connector_meta(&StepInfo::default()).unwrap()).unwrap();
        sa.lock().unwrap().finished_sending.push("r1".into());
        assert!(w.get_finished(&[]).unwrap().finished_sending.is_empty(), "b has not finished yet");
        sb.lock().unwrap().finished_sending.push("r1".into());
        assert_eq!(w.get_finished(&[]).unwrap().finished_sending, vec![RequestId::from("r1")]);
        assert!(w.get_finished(&[]).unwrap().finished_sending.is_empty(), "reported once");

        // Only b delays r2: b's report alone finishes it, even when it comes before the
        // metadata that says b delayed it.
        sa.lock().unwrap().delay = false;
        assert!(s.request_finished(&req("r2"), &blocks()).unwrap().delay_free);
        sb.lock().unwrap().finished_sending.push("r2".into());
        assert!(w.get_finished(&[]).unwrap().finished_sending.is_empty());
        w.bind_connector_meta(&s.build_connector_meta(&StepInfo::default()).unwrap()).unwrap();
        assert_eq!(w.get_finished(&[]).unwrap().finished_sending, vec![RequestId::from("r2")]);
    }

    #[test]
    fn finished_recving_waits_for_every_loading_child_and_failures_win() {
        let (f, sa, sb, cfg) = setup(r#","lookup":"sum""#);
        let mut s = f.create_scheduler(&ctx(&cfg)).unwrap();
        let mut w = f.create_worker(&ctx(&cfg)).unwrap();
        for (sh, n) in [(&sa, 16), (&sb, 48)] {
            let mut g = sh.lock().unwrap();
            g.async_load = true;
            g.cached.insert("r1".into(), n);
            g.cached.insert("r2".into(), n);
        }
        for r in ["r1", "r2"] {
            s.get_num_new_matched_tokens(&req(r), 0).unwrap();
            s.update_state_after_alloc(&req(r), &blocks(), 48).unwrap();
        }
        w.bind_connector_meta(&s.build_connector_meta(&StepInfo::default()).unwrap()).unwrap();
        sa.lock().unwrap().finished_recving.push("r1".into());
        assert!(w.get_finished(&[]).unwrap().finished_recving.is_empty());
        sb.lock().unwrap().finished_recving.push("r1".into());
        sa.lock().unwrap().failed_recving.push("r2".into());
        let ft = w.get_finished(&[]).unwrap();
        assert_eq!(ft.finished_recving, vec![RequestId::from("r1")]);
        assert_eq!(ft.failed_recving, vec![RequestId::from("r2")]);
        sb.lock().unwrap().finished_recving.push("r2".into());
        assert!(
            w.get_finished(&[]).unwrap().finished_recving.is_empty(),
            "a failed load never counts as done"
        );
    }

    #[test]
    fn transfer_params_merge_and_a_clash_names_both_children() {
        let (f, sa, sb, cfg) = setup("");
        let mut s = f.create_scheduler(&ctx(&cfg)).unwrap();
        let obj = |j: &str| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(j).unwrap();
        sa.lock().unwrap().params = Some(obj(r#"{"cache_key":"k1"}"#));
        sb.lock().unwrap().params = Some(obj(r#"{"remote_engine_id":"p0","remote_block_ids":[1,2]}"#));
        let rf = s.request_finished(&req("r1"), &blocks()).unwrap();
        let p = rf.transfer_params.unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p["remote_engine_id"], "p0");
        sa.lock().unwrap().params = Some(obj(r#"{"remote_engine_id":"x"}"#));
        let e = s.request_finished(&req("r2"), &blocks()).unwrap_err().to_string();
        assert!(
            e.contains("'a'") && e.contains("'b'") && e.contains("'remote_engine_id'") && e.contains("r2"),
            "{e}"
        );
    }

    #[test]
    fn handshake_is_keyed_by_child_name_and_routed_back_by_key() {
        let (a, sa) = FakeFactory::new("nixl", caps_any());
        let (b, sb) = FakeFactory::new("lmcache", caps_cache());
        let r = FakeResolver::default().with(a).with(b);
        let f = PdFactory::new(Arc::new(r));
        let mut w = f.create_worker(&ctx(&pd(&["lmcache", "nixl", "nixl"], ""))).unwrap();
        sa.lock().unwrap().handshake = Some(serde_json::json!({"agent": "p0"}));
        let hs = w.handshake_metadata().unwrap().unwrap();
        // Two nixl children: the second is named nixl#2; lmcache has no metadata.
        assert_eq!(hs, serde_json::json!({"nixl": {"agent": "p0"}, "nixl#2": {"agent": "p0"}}));
        w.set_peer_handshake_metadata(&serde_json::json!({"nixl": {"agent": "d0"}, "flexkv": {}})).unwrap();
        let got: Vec<String> = calls(&sa).into_iter().filter(|c| c.starts_with("peer")).collect();
        assert_eq!(got, vec![r#"peer {"agent":"d0"}"#], "only the first nixl has a counterpart");
        assert!(!calls(&sb).iter().any(|c| c.starts_with("peer")));
        // Two transports: unkeyed metadata has no single recipient.
        let e = w.set_peer_handshake_metadata(&serde_json::json!({"agent": "d0"})).unwrap_err().to_string();
        assert!(e.contains("[agent]") && e.contains("[lmcache, nixl, nixl#2]"), "{e}");

        // One transport: a plain peer's metadata (not keyed by child) goes to it alone, and
        // when only it has metadata, that goes out unwrapped for a plain peer to read.
        let mut w = f.create_worker(&ctx(&pd(&["lmcache", "nixl"], ""))).unwrap();
        assert_eq!(w.handshake_metadata().unwrap().unwrap(), serde_json::json!({"agent": "p0"}));
        sb.lock().unwrap().handshake = Some(serde_json::json!({"tier": "cpu"}));
        assert_eq!(
            w.handshake_metadata().unwrap().unwrap(),
            serde_json::json!({"lmcache": {"tier": "cpu"}, "nixl": {"agent": "p0"}}),
            "two children with metadata: keyed by name"
        );
        w.set_peer_handshake_metadata(&serde_json::json!({"agent": "plain"})).unwrap();
        assert!(calls(&sa).contains(&r#"peer {"agent":"plain"}"#.to_owned()));
        assert!(!calls(&sb).iter().any(|c| c.starts_with("peer")));
    }

    #[test]
    fn capabilities_are_derived_from_the_children_not_the_name() {
        let (a, _) = FakeFactory::new("cache", caps_cache());
        let (b, _) = FakeFactory::new("net", caps_any());
        let f = PdFactory::new(Arc::new(FakeResolver::default().with(a).with(b)));
        let with_cache =
            f.capabilities(&KvTransferConfig::from_json(&pd(&["cache", "net"], "")).unwrap(), None).unwrap();
        let net_only =
            f.capabilities(&KvTransferConfig::from_json(&pd(&["net", "net"], "")).unwrap(), None).unwrap();
        assert!(!with_cache.hma && net_only.hma);
        let mut req = with_cache.layout.required.clone();
        req.sort();
        assert_eq!(req, vec![KvLayout::HND, KvLayout::NHD]);
        assert_eq!(with_cache.transfer_mode, TransferMode::Pull);
        let leaves = f
            .child_capabilities(&KvTransferConfig::from_json(&pd(&["cache", "net"], "")).unwrap(), None)
            .unwrap()
            .unwrap();
        assert_eq!(leaves.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["cache", "net"]);
    }

    #[test]
    fn nested_composites_flatten_into_leaves() {
        let (a, _) = FakeFactory::new("a", caps_cache());
        let (b, _) = FakeFactory::new("b", caps_any());
        let f = PdFactory::new(Arc::new(FakeResolver::default().with(a).with(b)));
        let inner = pd(&["a", "b"], "");
        let outer = format!(
            "{{\"kv_connector\":\"PdConnector\",\"kv_connector_extra_config\":{{\"connectors\":[{inner},\
             {{\"kv_connector\":\"b\"}}]}}}}"
        );
        let leaves = f.leaf_capabilities(&KvTransferConfig::from_json(&outer).unwrap(), None).unwrap();
        assert_eq!(leaves.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["a", "b", "b#2"]);
    }

    #[test]
    fn bad_composites_are_clear_errors() {
        let (a, _) = FakeFactory::new("a", caps_cache());
        let mut r = FakeResolver::default().with(a);
        let f = PdFactory::new(Arc::new(r.clone()));
        let cfg = |j: &str| KvTransferConfig::from_json(j).unwrap();
        let e = f.capabilities(&cfg(&pd(&[], "")), None).unwrap_err().to_string();
        assert!(e.contains("has no children"), "{e}");
        let e = f.capabilities(&cfg(&pd(&["a", "zzz"], "")), None).unwrap_err().to_string();
        assert!(e.contains("'zzz'") && e.contains("known connectors: PdConnector, a"), "{e}");

        // A preset that is a composite containing the preset itself.
        r.presets.insert("loop".into(), cfg(&pd(&["a", "loop"], "")));
        let f = PdFactory::new(Arc::new(r.clone()));
        let e = f.capabilities(&cfg(&pd(&["loop"], "")), None).unwrap_err().to_string();
        assert!(e.contains("contains itself") && e.contains("PdConnector -> PdConnector"), "{e}");
        let e = f.create_worker(&ctx(&pd(&["loop"], ""))).err().unwrap().to_string();
        assert!(e.contains("contains itself"), "{e}");

        // Nesting deeper than the limit.
        let mut j = pd(&["a"], "");
        for _ in 0..MAX_DEPTH_FOR_TEST {
            j = format!(
                r#"{{"kv_connector":"PdConnector","kv_connector_extra_config":{{"connectors":[{j}]}}}}"#
            );
        }
        let e = f.capabilities(&cfg(&j), None).unwrap_err().to_string();
        assert!(e.contains("at most 4 levels"), "{e}");
    }

    const MAX_DEPTH_FOR_TEST: usize = crate::children::MAX_DEPTH;
}
