//! One step of the reference engine, phase by phase in vLLM's order: the scheduler admits
//! waiting requests and builds the step's metadata; the worker half binds it and starts the
//! loads; the forward pass runs layer by layer (`wait_for_layer_load` → compute →
//! `save_kv_layer`); the worker half finishes its saves and reports finished transfers and
//! failed loads; the engine settles the loads, samples the computed requests and ends those
//! that are done.

use super::{conn_err, Engine, FinishReason, RequestOutput, Seq, State, StepStats};
use crate::error::EngineError;
use crate::forward::forward_layer;
use crate::sampling::{self, TokenLogprobs};
use kvconnect_api::{BlockId, FailurePolicy, FinishedTransfers, LayerId, StepInfo, TierTokens};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// What a step's phases hand on to each other.
#[derive(Default)]
struct StepWork {
    /// What the step returns: admission may end a request, sampling adds tokens.
    outputs: Vec<RequestOutput>,
    /// The requests computed in this step, in order.
    scheduled: Vec<u64>,
    /// Their hidden states: request, first position computed, one row per position.
    hidden: Vec<(u64, usize, Vec<f32>)>,
    /// Requests whose KV load failed in this step, and why.
    load_failed: BTreeMap<u64, String>,
    /// Requests to end once sampled, and why.
    to_finish: Vec<(u64, FinishReason)>,
    prefill_tokens: usize,
    decode_tokens: usize,
    /// Inside the model's math and the pool's reads and writes.
    compute: Duration,
    /// Inside connector calls.
    connector: Duration,
}

/// The scheduled requests whose KV is loaded in this step.
fn loading<'a>(seqs: &'a BTreeMap<u64, Seq>, scheduled: &'a [u64]) -> impl Iterator<Item = u64> + 'a {
    scheduled.iter().copied().filter(|k| seqs.get(k).is_some_and(|s| s.loaded_this_step))
}

impl Engine {
    /// One scheduler + worker step.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>, EngineError> {
        let t0 = Instant::now();
        self.step_no += 1;
        let mut w = StepWork::default();
        // Set again by `admit` for loads of this step (a failed earlier step may have left it).
        self.clear_loaded_this_step();
        self.admit_waiting(&mut w)?;
        let info = self.step_info(&mut w);
        self.start_loads(&info, &mut w)?;
        self.embed_scheduled(&mut w);
        for layer in 0..self.spec.layers.len() {
            self.run_layer(layer, &mut w)?;
        }
        let (fin, err_blocks) = self.finish_transfers(&info, &mut w)?;
        self.note_load_results(&fin, &err_blocks, &mut w);
        self.keep_load_sources(&fin);
        self.apply_failure_policy(&mut w);
        self.resume_received(&fin);
        self.sample_computed(&mut w);
        self.free_out_of_window_blocks();
        self.end_finished(&fin, &mut w);
        self.clear_loaded_this_step();
        self.stats = Some(StepStats {
            step: self.step_no,
            scheduled: w.hidden.len(),
            prefill_tokens: w.prefill_tokens,
            decode_tokens: w.decode_tokens,
            waiting_for_remote_kv: self
                .seqs
                .values()
                .filter(|s| s.state == State::WaitingForRemoteKv)
                .count(),
            elapsed: t0.elapsed(),
            compute: w.compute,
            connector: w.connector,
        });
        Ok(w.outputs)
    }

    fn clear_loaded_this_step(&mut self) {
        for s in self.seqs.values_mut() {
            s.loaded_this_step = false;
        }
    }

    /// Scheduler: admits waiting requests in arrival order, until the pool is out of blocks
    /// (later requests wait too: first come, first served).
    fn admit_waiting(&mut self, w: &mut StepWork) -> Result<(), EngineError> {
        let waiting: Vec<u64> =
            self.seqs.iter().filter(|(_, s)| s.state == State::Waiting).map(|(k, _)| *k).collect();
        for key in waiting {
            let t = Instant::now();
            let admitted = self.admit(key, &mut w.outputs);
            w.connector += t.elapsed();
            if !admitted? {
                break;
            }
        }
        Ok(())
    }

    /// The running requests become the step's scheduled ones; the requests finished since
    /// the last step go with them to the connector.
    fn step_info(&mut self, w: &mut StepWork) -> StepInfo {
        w.scheduled = self.seqs.iter().filter(|(_, s)| s.state == State::Running).map(|(k, _)| *k).collect();
        StepInfo {
            step: self.step_no,
            scheduled: w
                .scheduled
                .iter()
                .filter_map(|k| self.seqs.get(k))
                .map(|s| s.req.id.clone())
                .collect(),
            finished: std::mem::take(&mut self.finished_since_last),
        }
    }

    /// Worker: binds the step's metadata and starts the loads. A failed start fails every
    /// load of this step.
    fn start_loads(&mut self, info: &StepInfo, w: &mut StepWork) -> Result<(), EngineError> {
        let t = Instant::now();
        if let Some((sched, worker)) = self.connector.as_mut() {
            let meta = sched.build_connector_meta(info).map_err(conn_err("build_connector_meta"))?;
            worker.bind_connector_meta(&meta).map_err(conn_err("bind_connector_meta"))?;
            if let Err(e) = worker.start_load_kv() {
                for k in loading(&self.seqs, &w.scheduled) {
                    w.load_failed.insert(k, format!("start_load_kv failed: {e}"));
                }
            }
        }
        // Synchronous loads into device regions (lmcache) are complete when start_load_kv
        // returns: bring them into the working copy before the forward reads it.
        if let Some(dm) = &self.device {
            if loading(&self.seqs, &w.scheduled).next().is_some() {
                dm.download_all(&self.pool)?;
            }
        }
        w.connector += t.elapsed();
        Ok(())
    }

    /// The embeddings of every position each scheduled request computes in this step.
    fn embed_scheduled(&self, w: &mut StepWork) {
        let d = self.model.hidden();
        w.hidden = Vec::with_capacity(w.scheduled.len());
        for k in &w.scheduled {
            let Some(s) = self.seqs.get(k) else { continue };
            let (start, end) = (s.num_computed, s.seq_len());
            let mut h = vec![0.0f32; (end - start) * d];
            for (i, pos) in (start..end).enumerate() {
                self.model.embed(s.token(pos), &mut h[i * d..(i + 1) * d]);
            }
            if s.output.is_empty() {
                w.prefill_tokens += end - start;
            } else {
                w.decode_tokens += end - start;
            }
            w.hidden.push((*k, start, h));
        }
    }

    /// One layer across the scheduled requests: waits for its loads, computes it and hands
    /// what it wrote to the connector to save.
    fn run_layer(&mut self, layer: usize, w: &mut StepWork) -> Result<(), EngineError> {
        let lid = LayerId(layer as u32);
        let t = Instant::now();
        if let Some((_, worker)) = self.connector.as_mut() {
            if let Err(e) = worker.wait_for_layer_load(lid) {
                for k in loading(&self.seqs, &w.scheduled) {
                    w.load_failed
                        .entry(k)
                        .or_insert_with(|| format!("wait_for_layer_load({layer}) failed: {e}"));
                }
            }
        }
        w.connector += t.elapsed();
        let t = Instant::now();
        if let Some(sg) = self.pool.state_group_of(lid) {
            let slots = self.forward_state(layer, sg, &mut w.hidden)?;
            w.compute += t.elapsed();
            if let Some((_, worker)) = self.connector.as_mut() {
                worker.save_kv_layer(lid, &slots).map_err(conn_err("save_kv_layer"))?;
            }
            return Ok(());
        }
        let ids = self.forward_kv_layer(layer, &mut w.hidden)?;
        w.compute += t.elapsed();
        let t = Instant::now();
        if let Some(dm) = &self.device {
            dm.upload_blocks(&self.pool, lid, &ids)?;
        }
        if let Some((_, worker)) = self.connector.as_mut() {
            worker.save_kv_layer(lid, &ids).map_err(conn_err("save_kv_layer"))?;
        }
        w.connector += t.elapsed();
        Ok(())
    }

    /// Runs attention layer `layer` for every scheduled request; returns the blocks written.
    fn forward_kv_layer(
        &mut self,
        layer: usize,
        hidden: &mut [(u64, usize, Vec<f32>)],
    ) -> Result<Vec<BlockId>, EngineError> {
        let group = self
            .pool
            .group_of(LayerId(layer as u32))
            .ok_or_else(|| EngineError::Layout(format!("layer {layer} is in no KV cache group")))?;
        let mut written: BTreeSet<BlockId> = BTreeSet::new();
        for (k, start, h) in hidden.iter_mut() {
            let Some(blocks) = self.seqs.get(k).and_then(|s| s.blocks.as_ref()) else { continue };
            let table = blocks.0.get(group).map(Vec::as_slice).unwrap_or(&[]);
            let w = forward_layer(&self.model, &self.pool, layer, table, *start, h, &mut self.scratch)?;
            written.extend(w);
        }
        Ok(written.into_iter().collect())
    }

    /// Worker: finishes the saves and collects the finished transfers and the blocks whose
    /// load failed. Finished loads into device regions come down into the working copy.
    fn finish_transfers(
        &mut self,
        info: &StepInfo,
        w: &mut StepWork,
    ) -> Result<(FinishedTransfers, BTreeSet<BlockId>), EngineError> {
        let t = Instant::now();
        let mut fin = FinishedTransfers::default();
        let mut err_blocks: BTreeSet<BlockId> = BTreeSet::new();
        if let Some((_, worker)) = self.connector.as_mut() {
            worker.wait_for_save().map_err(conn_err("wait_for_save"))?;
            fin = worker.get_finished(&info.finished).map_err(conn_err("get_finished"))?;
            err_blocks = worker
                .block_ids_with_load_errors()
                .map_err(conn_err("block_ids_with_load_errors"))?
                .into_iter()
                .collect();
        }
        if !fin.finished_recving.is_empty() {
            if let Some(dm) = &self.device {
                dm.download_all(&self.pool)?;
            }
        }
        w.connector += t.elapsed();
        Ok((fin, err_blocks))
    }

    /// The loads that completed or failed: a failed block or an async load reported failed
    /// marks its request in `load_failed`.
    fn note_load_results(
        &mut self,
        fin: &FinishedTransfers,
        err_blocks: &BTreeSet<BlockId>,
        w: &mut StepWork,
    ) {
        let recvd: BTreeSet<&str> = fin.finished_recving.iter().map(|r| r.0.as_str()).collect();
        let failed_recv: BTreeSet<&str> = fin.failed_recving.iter().map(|r| r.0.as_str()).collect();
        let bs = self.pool.effective().block_size as usize;
        for (k, s) in self.seqs.iter_mut() {
            let id = s.req.id.0.as_str();
            let waiting = s.state == State::WaitingForRemoteKv;
            // A bad block of a load still in flight is remembered and acted on once the
            // connector is done with the request: recomputing into blocks a connector may
            // still be writing would race with it.
            if (s.loaded_this_step || waiting) && !err_blocks.is_empty() && s.load_error.is_none() {
                // The blocks the load wrote: past the cached prefix, up to its last token.
                let (first, end) = (s.cached / bs, (s.cached + s.external).div_ceil(bs));
                s.load_error = s.blocks.as_ref().and_then(|bl| {
                    bl.0.iter()
                        .flat_map(|g| g.iter().skip(first).take(end.saturating_sub(first)))
                        .find(|b| err_blocks.contains(b))
                        .map(|b| format!("the connector could not load block {b}"))
                });
            }
            if waiting && failed_recv.contains(id) {
                w.load_failed
                    .entry(*k)
                    .or_insert_with(|| "the connector reported the async KV load as failed".into());
            } else if s.loaded_this_step || (waiting && recvd.contains(id)) {
                if let Some(why) = s.load_error.take() {
                    w.load_failed.entry(*k).or_insert(why);
                }
            }
        }
    }

    /// What the connector's tiers supplied, kept per request until it ends.
    fn keep_load_sources(&mut self, fin: &FinishedTransfers) {
        for l in &fin.load_sources {
            let Some(k) = self.by_id.get(&l.request.0) else { continue };
            if let Some(s) = self.seqs.get_mut(k) {
                TierTokens::add_to(&mut s.load_sources, l.source.clone());
            }
        }
    }

    /// `kv_load_failure_policy` on the failed loads: `recompute` computes the prompt past
    /// the cached prefix, `fail` ends the request saying why.
    fn apply_failure_policy(&mut self, w: &mut StepWork) {
        for (k, why) in &w.load_failed {
            let Some(s) = self.seqs.get_mut(k) else { continue };
            match self.policy {
                FailurePolicy::Recompute => {
                    tracing::warn!(request = %s.req.id, reason = %why, "KV load failed; recomputing the \
                        prompt");
                    s.kv_load_failure = Some(why.clone());
                    s.num_computed = s.cached;
                    s.external = 0;
                    s.state = State::Running;
                }
                FailurePolicy::Fail => w.to_finish.push((
                    *k,
                    FinishReason::Error(format!(
                        "KV load of {} external tokens failed ({why}) and kv_load_failure_policy is 'fail'",
                        s.external
                    )),
                )),
            }
        }
    }

    /// Requests whose async load arrived run from the next step on.
    fn resume_received(&mut self, fin: &FinishedTransfers) {
        let recvd: BTreeSet<&str> = fin.finished_recving.iter().map(|r| r.0.as_str()).collect();
        for s in self.seqs.values_mut() {
            if s.state == State::WaitingForRemoteKv && recvd.contains(s.req.id.0.as_str()) {
                s.state = State::Running;
                s.num_computed = s.cached + s.external;
            }
        }
    }

    /// Samples one token for every computed request whose load did not fail, and marks the
    /// requests that reached a stop sequence or `max_tokens`.
    fn sample_computed(&mut self, w: &mut StepWork) {
        let t = Instant::now();
        let d = self.model.hidden();
        for (k, _, h) in &w.hidden {
            if w.load_failed.contains_key(k) {
                continue;
            }
            let Some(s) = self.seqs.get_mut(k) else { continue };
            // Every scheduled request has at least one token to compute (admission leaves one).
            let Some(last) = h.len().checked_sub(d).map(|i| &h[i..]) else { continue };
            let logits = self.model.logits(last);
            let tok = sampling::sample(&logits, &s.sampling, &mut s.rng);
            let logprobs: Vec<TokenLogprobs> =
                s.sampling.logprobs.map(|n| sampling::token_logprobs(&logits, tok, n)).into_iter().collect();
            s.num_computed = s.seq_len();
            s.output.push(tok);
            let first = s.output.len() == 1;
            w.outputs.push(RequestOutput {
                id: s.req.id.0.clone(),
                new_tokens: vec![tok],
                logprobs,
                finished: None,
                kv_transfer_params: None,
                first_token_latency: first.then(|| s.added.elapsed()),
                num_external_tokens: if first { s.external } else { 0 },
                num_cached_tokens: if first { s.cached } else { 0 },
                kv_load_failure: if first { s.kv_load_failure.clone() } else { None },
                load_sources: Vec::new(),
            });
            // A stop sequence that completes on the last allowed token still says "stop".
            if let Some(matched_tokens) = sampling::stop_match(&s.output, &s.sampling) {
                w.to_finish.push((*k, FinishReason::Stop { matched_tokens }));
            } else if s.output.len() >= s.max_tokens {
                w.to_finish.push((*k, FinishReason::Length));
            }
        }
        w.compute += t.elapsed();
    }

    /// Ends the requests that are done, and frees the blocks the connector reports sent
    /// (or remembers that they were, for a request not ended yet).
    fn end_finished(&mut self, fin: &FinishedTransfers, w: &mut StepWork) {
        let t = Instant::now();
        for (k, why) in std::mem::take(&mut w.to_finish) {
            self.end(k, why, &mut w.outputs, true);
        }
        for r in &fin.finished_sending {
            match self.pending_free.remove(&r.0) {
                Some(b) => self.pool.release(&b),
                None if self.by_id.contains_key(&r.0) => {
                    self.sent_early.insert(r.0.clone());
                }
                None => {
                    tracing::debug!(request = %r, "finished_sending for a request without delayed blocks")
                }
            }
        }
        w.connector += t.elapsed();
    }
}
