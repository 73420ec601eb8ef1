//! The transfer-only engine behind `kvconnect bench transfer`: the same block pool and
//! connector calls in vLLM's order as the reference engine, but no model. Prefill fills a
//! prompt's blocks with a pattern derived from (block index, layer, K|V) instead of computing
//! them; decode loads them through the connector, times the load, and checks every full
//! block against the pattern. This moves the KV of any model geometry (Qwen3-0.6B at 8192
//! tokens is ~0.9 GiB) without running that model.

use crate::engine_loop::{Driver, PoolStats, StepFailure, SubmitError};
use kvconnect_api::connector_metrics;
use kvconnect_api::{
    BlocksPerGroup, ConnectorError, ConnectorMetric, EffectiveLayout, LayerId, MatchResult, ModelSpec,
    Request, RequestId, SchedulerConnector, StepInfo, TierTokens, WorkerConnector,
};
use kvconnect_engine::{FinishReason, GenRequest, KvPool, RequestOutput};
use kvconnect_support::host_buffer::HostBuffer;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::time::Instant;

type Connector = (Box<dyn SchedulerConnector>, Box<dyn WorkerConnector>);

struct Loading {
    req: Request,
    blocks: BlocksPerGroup,
    external: usize,
    started: Instant,
}

/// The transfer-only engine.
pub struct TransferEngine {
    // Before `pool`: the connector must go before the memory it registered.
    conn: Connector,
    pool: KvPool,
    kv_layers: Vec<(LayerId, usize)>,
    waiting: Vec<Request>,
    loading: BTreeMap<String, Loading>,
    /// A load admitted since the last step is synchronous: the step waits for it.
    sync_loads: bool,
    pending_free: BTreeMap<String, BlocksPerGroup>,
    finished_since_last: Vec<RequestId>,
    step_no: u64,
    idle: bool,
    // Two buffers of the last load's size, for the memcpy baseline (see `memcpy_baseline`).
    baseline: Option<(HostBuffer, HostBuffer)>,
}

fn pattern_word(salt: u64, block_index: usize, layer: u32, part: u32) -> u64 {
    // SplitMix64 of the coordinates: different for every request, block, layer and K|V, so
    // a block left over from an earlier transfer never passes for a new one.
    let mut z = salt ^ (block_index as u64) << 20 ^ (layer as u64) << 2 ^ part as u64;
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A per-request salt both sides derive from the request id (decode uses prefill's id).
fn salt(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// The id prefill salted a load's pattern with: its own request id, which nixl's transfer
/// params carry as `remote_request_id` (decode's id differs unless a proxy sent both sides one
/// X-Request-Id).
fn producer_id(req: &Request) -> &str {
    req.kv_transfer_params.get("remote_request_id").and_then(serde_json::Value::as_str).unwrap_or(&req.id.0)
}

fn fill(buf: &mut [u8], seed: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let w = (seed ^ i as u64).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

impl TransferEngine {
    /// A pool of `num_blocks` blocks per group (in shared memory named for `shm_engine_id`
    /// when given), its KV heads split across `tp_size` ranks, registered with the connector.
    pub fn new(
        model: &ModelSpec,
        eff: &EffectiveLayout,
        num_blocks: u32,
        shm_engine_id: Option<&str>,
        tp_size: u32,
        mut conn: Connector,
    ) -> Result<TransferEngine, String> {
        if !eff.state_groups.is_empty() {
            return Err(format!(
                "not implemented: synthetic KV for model '{}', whose state layers keep a per-request state; \
                    run the hybrid reference model (fixtures/models/kvconnect--reference-hybrid) without \
                    --synthetic-kv",
                model.name
            ));
        }
        let pool = KvPool::with_tp_ranks(model, eff, num_blocks, shm_engine_id, tp_size)
            .map_err(|e| e.to_string())?;
        conn.1.register_kv_caches(pool.regions()).map_err(|e| format!("register_kv_caches failed: {e}"))?;
        let kv_layers = (0..model.layers.len() as u32)
            .filter_map(|l| pool.group_of(LayerId(l)).map(|g| (LayerId(l), g)))
            .collect();
        Ok(TransferEngine {
            conn,
            pool,
            kv_layers,
            waiting: Vec::new(),
            loading: BTreeMap::new(),
            sync_loads: false,
            pending_free: BTreeMap::new(),
            finished_since_last: Vec::new(),
            step_no: 0,
            idle: true,
            baseline: None,
        })
    }

    /// The connector's handshake metadata.
    pub fn handshake_metadata(&mut self) -> Result<Option<Value>, String> {
        self.conn.1.handshake_metadata().map_err(|e| format!("handshake_metadata failed: {e}"))
    }

    fn block_size(&self) -> usize {
        self.pool.effective().block_size as usize
    }

    fn kv_bytes(&self, tokens: usize) -> u64 {
        let blocks = tokens.div_ceil(self.block_size());
        (blocks * self.kv_layers.len() * self.pool.shape().layer_block_bytes()) as u64
    }

    /// Writes the request's pattern (or zeros, with `salt = None`) into its first blocks.
    fn write_pattern(&self, blocks: &BlocksPerGroup, tokens: usize, salt: Option<u64>) -> Result<(), String> {
        let n = tokens.div_ceil(self.block_size());
        let mut buf = vec![0u8; self.pool.shape().bytes()];
        for &(layer, g) in &self.kv_layers {
            for (i, b) in blocks.0[g].iter().take(n).enumerate() {
                for part in 0..self.pool.shape().kv_parts {
                    if let Some(s) = salt {
                        fill(&mut buf, pattern_word(s, i, layer.0, part));
                    }
                    self.pool.write_block(layer, part, *b, &buf).map_err(|e| e.to_string())?;
                }
            }
        }
        Ok(())
    }

    /// The first full block that does not hold the pattern, if any.
    fn check_pattern(
        &self,
        blocks: &BlocksPerGroup,
        tokens: usize,
        salt: u64,
    ) -> Result<Option<String>, String> {
        let n = tokens / self.block_size();
        let mut want = vec![0u8; self.pool.shape().bytes()];
        let mut got = Vec::new();
        for &(layer, g) in &self.kv_layers {
            for (i, b) in blocks.0[g].iter().take(n).enumerate() {
                for part in 0..self.pool.shape().kv_parts {
                    fill(&mut want, pattern_word(salt, i, layer.0, part));
                    self.pool.read_block(layer, part, *b, &mut got).map_err(|e| e.to_string())?;
                    if got != want {
                        return Ok(Some(format!(
                            "block {i} of layer {} part {part} differs from what prefill wrote",
                            layer.0
                        )));
                    }
                }
            }
        }
        Ok(None)
    }

    /// The memcpy baseline's ways for `bytes` bytes in this process
    /// (`kvconnect_bench::memcpy::time_memcpy_ways`: glibc's and the streaming copy, one
    /// thread and as many as the connector copies a large shm pull with), each timed once
    /// between two faulted-in buffers right after a load: the benchmark's baseline sees the
    /// same process, core and moment as the transfer (on a shared machine a baseline measured
    /// elsewhere or later sees other load). The benchmark takes the way with the lowest
    /// median over its pairs. Empty where the buffers cannot be allocated.
    fn memcpy_baseline(&mut self, bytes: usize) -> Vec<(kvconnect_bench::memcpy::Way, std::time::Duration)> {
        let fits = self.baseline.as_ref().is_some_and(|(s, _)| s.bytes().len() == bytes);
        if !fits {
            // Allocated as the KV regions are (huge pages where the kernel gives them).
            let (mut src, mut dst) = match (HostBuffer::zeroed(bytes), HostBuffer::zeroed(bytes)) {
                (Ok(s), Ok(d)) => (s, d),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::warn!("no memcpy baseline for this load (none reported): {e}");
                    return Vec::new();
                }
            };
            for (i, b) in src.bytes_mut().iter_mut().enumerate() {
                *b = (i as u8) ^ 0x5a;
            }
            dst.bytes_mut().copy_from_slice(src.bytes()); // fault every page in before timing
            self.baseline = Some((src, dst));
        }
        let Some((src, dst)) = self.baseline.as_mut() else { return Vec::new() };
        kvconnect_bench::memcpy::time_memcpy_ways(
            dst.bytes_mut(),
            src.bytes(),
            kvconnect_nixl::copy_plan::default_copy_threads(),
        )
    }

    fn finish_output(id: &str, finished: FinishReason, params: Option<Map<String, Value>>) -> RequestOutput {
        RequestOutput {
            id: id.to_owned(),
            new_tokens: vec![0],
            logprobs: Vec::new(),
            finished: Some(finished),
            kv_transfer_params: params,
            ..RequestOutput::default()
        }
    }

    fn admit(&mut self, req: Request, outputs: &mut Vec<RequestOutput>) -> Result<bool, String> {
        let id = req.id.0.clone();
        let prompt = req.prompt_tokens.len();
        let (ext, async_load) = match self.conn.0.get_num_new_matched_tokens(&req, 0) {
            Ok(MatchResult::Pending) => {
                self.waiting.push(req);
                return Ok(false);
            }
            Ok(MatchResult::Matched { tokens, async_load }) => {
                (tokens.min(prompt.saturating_sub(1)), async_load)
            }
            Err(e) => {
                outputs.push(Self::finish_output(
                    &id,
                    FinishReason::Error(format!("lookup failed: {e}")),
                    None,
                ));
                return Ok(true);
            }
        };
        let need = prompt.div_ceil(self.block_size());
        let Some(blocks) = self.pool.allocate(need) else {
            outputs.push(Self::finish_output(
                &id,
                FinishReason::Error(format!(
                    "{need} blocks per group do not fit the pool; raise --num-blocks"
                )),
                None,
            ));
            return Ok(true);
        };
        self.conn
            .0
            .update_state_after_alloc(&req, &blocks, ext)
            .map_err(|e| format!("update_state_after_alloc failed: {e}"))?;
        if ext > 0 {
            // Zero the destination first so only this transfer can make the check pass.
            self.write_pattern(&blocks, ext, None)?;
            // A synchronous load is whole once this step's first layer has waited for it.
            self.sync_loads |= !async_load;
            self.loading.insert(id, Loading { req, blocks, external: ext, started: Instant::now() });
            return Ok(true);
        }
        // A producer: the "computed" KV is the pattern, then the request finishes at once.
        self.write_pattern(&blocks, prompt, Some(salt(&id)))?;
        for &(layer, g) in &self.kv_layers {
            self.conn
                .1
                .save_kv_layer(layer, &blocks.0[g])
                .map_err(|e| format!("save_kv_layer failed: {e}"))?;
        }
        self.conn.1.wait_for_save().map_err(|e| format!("wait_for_save failed: {e}"))?;
        let rf = self
            .conn
            .0
            .request_finished(&req, &blocks)
            .map_err(|e| format!("request_finished failed: {e}"))?;
        if rf.delay_free {
            self.pending_free.insert(id.clone(), blocks);
        } else {
            self.pool.release(&blocks);
        }
        self.finished_since_last.push(req.id.clone());
        outputs.push(Self::finish_output(&id, FinishReason::Length, rf.transfer_params));
        Ok(true)
    }

    fn end_load(
        &mut self,
        id: &str,
        failed: Option<String>,
        outputs: &mut Vec<RequestOutput>,
    ) -> Result<(), String> {
        let Some(l) = self.loading.remove(id) else { return Ok(()) };
        let elapsed = l.started.elapsed();
        let outcome = match failed {
            Some(why) => FinishReason::Error(format!("KV load failed: {why}")),
            None => match self.check_pattern(&l.blocks, l.external, salt(producer_id(&l.req)))? {
                Some(bad) => FinishReason::Error(format!("transferred KV is wrong: {bad}")),
                None => FinishReason::Length,
            },
        };
        let bytes = self.kv_bytes(l.external);
        let verified = matches!(outcome, FinishReason::Length);
        let memcpy = if verified { self.memcpy_baseline(bytes as usize) } else { Vec::new() };
        let params = json!({
            "transfer_us": elapsed.as_micros() as u64,
            "bytes": bytes,
            "external_tokens": l.external,
            "verified": verified,
            "memcpy_ways_us": memcpy.iter().map(|(_, d)| d.as_secs_f64() * 1e6).collect::<Vec<f64>>(),
            "memcpy_ways": memcpy.iter().map(|(w, _)| w.to_string()).collect::<Vec<String>>(),
        });
        let _ = self.conn.0.request_finished(&l.req, &l.blocks);
        self.pool.release(&l.blocks);
        self.finished_since_last.push(l.req.id.clone());
        let mut o = Self::finish_output(id, outcome, params.as_object().cloned());
        o.first_token_latency = Some(elapsed);
        o.num_external_tokens = l.external;
        outputs.push(o);
        Ok(())
    }
}

impl Driver for TransferEngine {
    fn add(&mut self, r: GenRequest) -> Result<(), SubmitError> {
        if r.prompt.is_empty() {
            return Err(SubmitError::Rejected(format!("request '{}': the prompt is empty", r.id)));
        }
        if !r.sampling.is_plain_greedy() {
            return Err(SubmitError::Rejected(format!(
                "request '{}': the transfer-only engine computes no logits, so it cannot sample, report \
                    logprobs or stop at a stop sequence; send this request to a worker running the reference \
                    engine",
                r.id
            )));
        }
        self.waiting.push(Request {
            id: RequestId(r.id),
            prompt_tokens: r.prompt,
            kv_transfer_params: r.kv_transfer_params,
        });
        Ok(())
    }

    fn step(&mut self) -> Result<Vec<RequestOutput>, StepFailure> {
        self.step_no += 1;
        let mut outputs = Vec::new();
        let mut progressed = false;
        for req in std::mem::take(&mut self.waiting) {
            progressed |= self.admit(req, &mut outputs).map_err(StepFailure::recoverable)?;
        }
        let info = StepInfo {
            step: self.step_no,
            scheduled: Vec::new(),
            finished: std::mem::take(&mut self.finished_since_last),
        };
        let call = |what: &'static str| {
            move |e: ConnectorError| StepFailure::from_connector(format!("{what} failed: {e}"), &e)
        };
        let meta = self.conn.0.build_connector_meta(&info).map_err(call("build_connector_meta"))?;
        self.conn.1.bind_connector_meta(&meta).map_err(call("bind_connector_meta"))?;
        self.conn.1.start_load_kv().map_err(call("start_load_kv"))?;
        if std::mem::take(&mut self.sync_loads) {
            // As an engine computing this step would: its first KV layer waits for the
            // synchronous loads; they are then reported by this step's `get_finished`.
            if let Some(&(layer, _)) = self.kv_layers.first() {
                self.conn.1.wait_for_layer_load(layer).map_err(call("wait_for_layer_load"))?;
            }
        }
        let fin = self.conn.1.get_finished(&info.finished).map_err(call("get_finished"))?;
        for r in &fin.finished_recving {
            progressed = true;
            self.end_load(&r.0, None, &mut outputs).map_err(StepFailure::recoverable)?;
        }
        for r in &fin.failed_recving {
            progressed = true;
            self.end_load(&r.0, Some("the connector reported the load as failed".into()), &mut outputs)
                .map_err(StepFailure::recoverable)?;
        }
        // Every output ends its request: it carries what the connector's tiers supplied.
        for o in &mut outputs {
            for l in fin.load_sources.iter().filter(|l| l.request.0 == o.id) {
                TierTokens::add_to(&mut o.load_sources, l.source.clone());
            }
        }
        for r in &fin.finished_sending {
            if let Some(b) = self.pending_free.remove(&r.0) {
                progressed = true;
                self.pool.release(&b);
            }
        }
        if !outputs.is_empty() {
            tracing::debug!(step = self.step_no, outputs = outputs.len(), "transfer engine step");
        }
        self.idle = !progressed;
        Ok(outputs)
    }

    fn cancel(&mut self, _id: &str, _why: &str) -> kvconnect_engine::Cancel {
        // Transfer benchmark requests have no client to lose mid-way worth the bookkeeping:
        // they run to their end and free their blocks then.
        kvconnect_engine::Cancel::NotSupported
    }

    fn abort_all(&mut self, _why: &str, connector_dead: bool) -> usize {
        // Requests still waiting hold no blocks. A live connector may still be writing the
        // blocks of loads in flight, so those end when it reports them; a dead one never
        // will, so its loads and parked blocks are freed now.
        let mut ended = self.waiting.len();
        self.waiting.clear();
        if connector_dead {
            ended += self.loading.len();
            for (_, l) in std::mem::take(&mut self.loading) {
                self.pool.release(&l.blocks);
            }
            for (_, b) in std::mem::take(&mut self.pending_free) {
                self.pool.release(&b);
            }
        }
        ended
    }

    fn busy(&self) -> bool {
        !self.waiting.is_empty() || !self.loading.is_empty() || !self.pending_free.is_empty()
    }

    fn idle_step(&self) -> bool {
        self.idle
    }

    fn set_peer(&mut self, envelope: &Value) -> Result<(), String> {
        self.conn.1.set_peer_handshake_metadata(envelope).map_err(|e| e.to_string())
    }

    fn stats(&self) -> PoolStats {
        PoolStats {
            total_blocks: self.pool.total_blocks(),
            free_blocks: self.pool.free_blocks(),
            unfinished: self.waiting.len() + self.loading.len(),
            pending_frees: self.pending_free.len(),
            ..PoolStats::default()
        }
    }

    fn connector_metrics(&mut self) -> Result<Vec<ConnectorMetric>, String> {
        connector_metrics::of_connector(self.conn.0.as_mut(), self.conn.1.as_mut()).map_err(|e| e.to_string())
    }

    fn shutdown(&mut self) {
        if let Err(e) = self.conn.1.shutdown() {
            tracing::warn!(error = %e, "connector shutdown failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_differs_per_block_layer_and_part() {
        let a = pattern_word(1, 0, 0, 0);
        assert_ne!(a, pattern_word(1, 1, 0, 0));
        assert_ne!(a, pattern_word(1, 0, 1, 0));
        assert_ne!(a, pattern_word(1, 0, 0, 1));
        assert_ne!(a, pattern_word(salt("a"), 0, 0, 0));
        assert_ne!(salt("cmpl-1"), salt("cmpl-2"));
        let mut buf = [0u8; 20];
        fill(&mut buf, 7);
        assert_eq!(&buf[..8], &7u64.to_le_bytes());
        assert_eq!(&buf[8..16], &6u64.to_le_bytes());
    }
}
