//! The composite's worker half: every call fans out to every child in order; finished
//! transfers are aggregated so a request is reported once, when every child involved is
//! done.

use crate::error::{child_err, merged_metrics, PdError};
use crate::meta::MetaEnvelope;
use kvconnect_api::{
    BlockId, ConnectorMetric, ConnectorResult, FinishedTransfers, KvRegion, LayerId, RequestId,
    WorkerConnector,
};
use std::collections::{BTreeSet, HashMap};

/// A request some children still have to report.
#[derive(Debug, Default)]
struct Waiting {
    children: BTreeSet<usize>,
    failed: bool,
}

/// The worker half of the composite.
pub struct PdWorker {
    children: Vec<(String, Box<dyn WorkerConnector>)>,
    sending: HashMap<RequestId, Waiting>,
    /// Children that reported a request as sent before the metadata saying they delayed it.
    sent_early: HashMap<RequestId, BTreeSet<usize>>,
    recving: HashMap<RequestId, Waiting>,
    ready_sending: Vec<RequestId>,
    /// The one child that moves KV between engines, if there is exactly one: a plain
    /// (non-composite) peer's handshake metadata is meant for it.
    transport: Option<usize>,
}

impl PdWorker {
    /// A composite over these children (names unique, in order).
    pub fn new(children: Vec<(String, Box<dyn WorkerConnector>)>) -> Self {
        PdWorker {
            children,
            sending: HashMap::new(),
            sent_early: HashMap::new(),
            recving: HashMap::new(),
            ready_sending: Vec::new(),
            transport: None,
        }
    }

    /// Names the child (by index) that moves KV between engines, so metadata from a plain
    /// peer (e.g. a decode worker running NIXL alone) reaches it.
    pub fn with_transport(mut self, index: Option<usize>) -> Self {
        self.transport = index.filter(|i| *i < self.children.len());
        self
    }

    fn each(
        &mut self,
        mut f: impl FnMut(&mut Box<dyn WorkerConnector>) -> ConnectorResult<()>,
    ) -> ConnectorResult<()> {
        for (name, child) in self.children.iter_mut() {
            f(child).map_err(|e| child_err(name, e))?;
        }
        Ok(())
    }
}

fn push_unique(v: &mut Vec<RequestId>, r: RequestId) {
    if !v.contains(&r) {
        v.push(r);
    }
}

impl WorkerConnector for PdWorker {
    fn register_kv_caches(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        self.each(|c| c.register_kv_caches(regions))
    }

    fn bind_connector_meta(&mut self, meta: &[u8]) -> ConnectorResult<()> {
        let names: Vec<String> = self.children.iter().map(|(n, _)| n.clone()).collect();
        let env = MetaEnvelope::decode(meta, &names)?;
        for (part, (name, child)) in env.parts.iter().zip(self.children.iter_mut()) {
            child.bind_connector_meta(&part.bytes).map_err(|e| child_err(name, e))?;
        }
        for (req, delayers) in env.delayed {
            let early = self.sent_early.remove(&req).unwrap_or_default();
            let left: BTreeSet<usize> = delayers.into_iter().filter(|i| !early.contains(i)).collect();
            if left.is_empty() {
                push_unique(&mut self.ready_sending, req);
            } else {
                self.sending.insert(req, Waiting { children: left, failed: false });
            }
        }
        for (req, loaders) in env.loads {
            self.recving.insert(req, Waiting { children: loaders.into_iter().collect(), failed: false });
        }
        Ok(())
    }

    fn start_load_kv(&mut self) -> ConnectorResult<()> {
        self.each(|c| c.start_load_kv())
    }

    fn wait_for_layer_load(&mut self, layer: LayerId) -> ConnectorResult<()> {
        self.each(|c| c.wait_for_layer_load(layer))
    }

    fn save_kv_layer(&mut self, layer: LayerId, block_ids: &[BlockId]) -> ConnectorResult<()> {
        self.each(|c| c.save_kv_layer(layer, block_ids))
    }

    fn wait_for_save(&mut self) -> ConnectorResult<()> {
        self.each(|c| c.wait_for_save())
    }

    fn handle_preemptions(&mut self, preempted: &[RequestId]) -> ConnectorResult<()> {
        self.each(|c| c.handle_preemptions(preempted))
    }

    fn get_finished(&mut self, finished_reqs: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        let mut out = FinishedTransfers {
            finished_sending: std::mem::take(&mut self.ready_sending),
            ..Default::default()
        };
        for (i, (name, child)) in self.children.iter_mut().enumerate() {
            let ft = child.get_finished(finished_reqs).map_err(|e| child_err(name, e))?;
            // What each child's tiers supplied is its own: every child's rows, in order.
            out.load_sources.extend(ft.load_sources);
            for r in ft.finished_sending {
                match self.sending.get_mut(&r) {
                    Some(w) => {
                        w.children.remove(&i);
                        if w.children.is_empty() {
                            self.sending.remove(&r);
                            push_unique(&mut out.finished_sending, r);
                        }
                    }
                    None => {
                        self.sent_early.entry(r).or_default().insert(i);
                    }
                }
            }
            for r in ft.failed_recving {
                let w = self.recving.entry(r.clone()).or_default();
                w.children.remove(&i);
                if !w.failed {
                    w.failed = true;
                    push_unique(&mut out.failed_recving, r.clone());
                }
                if w.children.is_empty() {
                    self.recving.remove(&r);
                }
            }
            for r in ft.finished_recving {
                match self.recving.get_mut(&r) {
                    Some(w) => {
                        w.children.remove(&i);
                        let done = w.children.is_empty();
                        let failed = w.failed;
                        if done {
                            self.recving.remove(&r);
                            if !failed {
                                push_unique(&mut out.finished_recving, r);
                            }
                        }
                    }
                    // A load the scheduler did not route through the envelope: the child that
                    // loads it is the one reporting it.
                    None => push_unique(&mut out.finished_recving, r),
                }
            }
        }
        Ok(out)
    }

    fn block_ids_with_load_errors(&mut self) -> ConnectorResult<Vec<BlockId>> {
        let mut all = BTreeSet::new();
        for (name, child) in self.children.iter_mut() {
            all.extend(child.block_ids_with_load_errors().map_err(|e| child_err(name, e))?);
        }
        Ok(all.into_iter().collect())
    }

    fn handshake_metadata(&mut self) -> ConnectorResult<Option<serde_json::Value>> {
        let mut map = serde_json::Map::new();
        let mut from = Vec::new();
        for (i, (name, child)) in self.children.iter_mut().enumerate() {
            if let Some(v) = child.handshake_metadata().map_err(|e| child_err(name, e))? {
                map.insert(name.clone(), v);
                from.push(i);
            }
        }
        // When only the transport child has anything to say, its metadata goes out as it is:
        // a plain peer (decode running NIXL alone, the DYN-3545 pairing) reads it unchanged,
        // and a composite peer routes unkeyed metadata to its own transport child.
        if from.len() == 1 && self.transport == from.first().copied() {
            return Ok(map.into_iter().next().map(|(_, v)| v));
        }
        Ok(if map.is_empty() { None } else { Some(serde_json::Value::Object(map)) })
    }

    fn set_peer_handshake_metadata(&mut self, peer: &serde_json::Value) -> ConnectorResult<()> {
        let names: Vec<String> = self.children.iter().map(|(n, _)| n.clone()).collect();
        let Some(obj) = peer.as_object() else {
            if let Some(i) = self.transport {
                let (name, child) = &mut self.children[i];
                return child.set_peer_handshake_metadata(peer).map_err(|e| child_err(name, e));
            }
            return Err(PdError::BadPeer(format!(
                "expected a JSON object keyed by child name ({}), got {}",
                names.join(", "),
                short(peer)
            ))
            .into());
        };
        if !names.iter().any(|n| obj.contains_key(n)) {
            // Not keyed by our children: a plain connector's metadata, meant for our one
            // transport child.
            if let Some(i) = self.transport {
                let (name, child) = &mut self.children[i];
                return child.set_peer_handshake_metadata(peer).map_err(|e| child_err(name, e));
            }
            return Err(PdError::BadPeer(format!(
                "it has keys [{}] but this composite's children are [{}]; and no single transport child to \
                    give a plain connector's metadata to; wrap it as {{\"<child name>\": ...}}",
                obj.keys().cloned().collect::<Vec<_>>().join(", "),
                names.join(", ")
            ))
            .into());
        }
        for k in obj.keys().filter(|k| !names.contains(k)) {
            tracing::debug!(key = %k, "peer handshake metadata for a child this composite does not have; \
                ignored");
        }
        for (name, child) in self.children.iter_mut() {
            // A child with no counterpart on the peer (e.g. a local cache) gets nothing.
            if let Some(v) = obj.get(name.as_str()) {
                child.set_peer_handshake_metadata(v).map_err(|e| child_err(name, e))?;
            }
        }
        Ok(())
    }

    fn metrics(&mut self) -> ConnectorResult<Vec<ConnectorMetric>> {
        Ok(merged_metrics(self.children.iter_mut().map(|(name, c)| (name.as_str(), c.metrics()))))
    }

    fn shutdown(&mut self) -> ConnectorResult<()> {
        // Every child is shut down even when one fails; the first failure is reported.
        let mut first = None;
        for (name, child) in self.children.iter_mut() {
            if let Err(e) = child.shutdown() {
                first.get_or_insert(child_err(name, e));
            }
        }
        first.map_or(Ok(()), Err)
    }
}

fn short(v: &serde_json::Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        format!("{}...", s.chars().take(80).collect::<String>())
    } else {
        s
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use crate::fake::{caps_any, FakeFactory, Shared};
    use crate::meta::{MetaEnvelope, MetaPart, META_VERSION};
    use kvconnect_api::ConnectorFactory;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn worker(n: usize) -> (PdWorker, Vec<Shared>) {
        let mut halves = Vec::new();
        let mut scripts = Vec::new();
        for i in 0..n {
            let (f, s) = FakeFactory::new(&format!("c{i}"), caps_any());
            let ctx = kvconnect_api::ConnectorContext {
                config: kvconnect_api::KvTransferConfig::named("x"),
                model: kvconnect_api::ModelSpec {
                    name: "m".into(),
                    num_layers: 1,
                    num_kv_heads: 1,
                    head_dim: 1,
                    dtype: None,
                    layers: vec![kvconnect_api::AttentionKind::Full],
                    state: None,
                },
                effective: kvconnect_api::EffectiveLayout {
                    layout: kvconnect_api::KvLayout::HND,
                    hma: false,
                    block_size: 16,
                    cache_dtype: kvconnect_api::Dtype::Bf16,
                    memory: kvconnect_api::MemoryKind::Host,
                    transfer_mode: kvconnect_api::TransferMode::Pull,
                    groups: vec![],
                    state_groups: vec![],
                    opaque_blocks: false,
                },
                role: kvconnect_api::KvRole::Producer,
                engine_id: "e".into(),
                tp_rank: 0,
                tp_size: 1,
            };
            halves.push((format!("c{i}"), f.create_worker(&ctx).unwrap()));
            scripts.push(s);
        }
        (PdWorker::new(halves), scripts)
    }

    /// Requests 0..m, each delayed by a non-empty set of 3 children (bit mask 1..8), and an
    /// order in which the (request, child) reports and the metadata arrive.
    fn case() -> impl Strategy<Value = (Vec<u8>, Vec<u32>, u32)> {
        proptest::collection::vec(1u8..8, 1..6).prop_flat_map(|masks| {
            let reports: usize = masks.iter().map(|m| m.count_ones() as usize).sum();
            (Just(masks), proptest::collection::vec(any::<u32>(), reports), 0..=reports as u32)
        })
    }

    /// What the children's tiers supplied goes out as they reported it: every child's rows,
    /// in child order, each once.
    #[test]
    fn load_sources_are_every_childs_concatenated() {
        let (mut w, scripts) = worker(3);
        let src = |r: &str, c: &str, t: &str, n: u64| kvconnect_api::LoadSource::new(&r.into(), c, t, n);
        scripts[0].lock().unwrap().load_sources = vec![src("r1", "lmcache", "cpu", 32)];
        scripts[2].lock().unwrap().load_sources =
            vec![src("r1", "flexkv", "ssd", 16), src("r2", "flexkv", "cpu", 64)];
        let fin = w.get_finished(&[]).unwrap();
        assert_eq!(
            fin.load_sources,
            vec![
                src("r1", "lmcache", "cpu", 32),
                src("r1", "flexkv", "ssd", 16),
                src("r2", "flexkv", "cpu", 64)
            ]
        );
        assert!(w.get_finished(&[]).unwrap().load_sources.is_empty(), "reported once");
    }

    proptest! {
        /// Each request is reported finished sending exactly once, and only after every
        /// child that delayed it has reported it and the metadata naming them has arrived,
        /// whatever the order of the children's reports.
        #[test]
        fn finished_sending_once_after_every_delaying_child((masks, keys, bind_at) in case()) {
            let (mut w, scripts) = worker(3);
            let mut reports: Vec<(usize, usize)> = Vec::new();
            for (r, m) in masks.iter().enumerate() {
                for c in 0..3 {
                    if m & (1 << c) != 0 {
                        reports.push((r, c));
                    }
                }
            }
            let mut order: Vec<(u32, (usize, usize))> = keys.into_iter().zip(reports).collect();
            order.sort();
            let env = MetaEnvelope {
                version: META_VERSION,
                parts: (0..3).map(|i| MetaPart { index: i, name: format!("c{i}"), bytes: vec![] }).collect(),
                delayed: masks
                    .iter()
                    .enumerate()
                    .map(|(r, m)| {
                        (RequestId(format!("r{r}")), (0..3).filter(|c| m & (1 << c) != 0).collect())
                    })
                    .collect::<BTreeMap<_, _>>(),
                loads: BTreeMap::new(),
            };
            let mut reported: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); masks.len()];
            let mut bound = false;
            let mut seen: Vec<usize> = vec![0; masks.len()];
            for (step, (_, (r, c))) in order.iter().enumerate() {
                if step as u32 == bind_at {
                    w.bind_connector_meta(&env.encode()).unwrap();
                    bound = true;
                }
                scripts[*c].lock().unwrap().finished_sending.push(format!("r{r}"));
                reported[*r].insert(*c);
                for done in w.get_finished(&[]).unwrap().finished_sending {
                    let i: usize = done.0[1..].parse().unwrap();
                    seen[i] += 1;
                    prop_assert!(bound, "r{} reported before the metadata arrived", i);
                    prop_assert_eq!(reported[i].len() as u32, masks[i].count_ones(), "r{} reported early", i);
                }
            }
            if !bound {
                w.bind_connector_meta(&env.encode()).unwrap();
            }
            for done in w.get_finished(&[]).unwrap().finished_sending {
                let i: usize = done.0[1..].parse().unwrap();
                seen[i] += 1;
            }
            prop_assert!(seen.iter().all(|n| *n == 1), "{:?}", seen);
        }
    }
}
