//! Tensor parallelism in the reference engine: the KV heads are split across `tp_size`
//! ranks, each rank holding its share of every layer in its own regions, registered rank by
//! rank (ARCHITECTURE.md §4). The ranks live in one process and share one block table; the
//! forward pass gathers a layer's heads from every rank's regions, so its arithmetic (and
//! every output token) is exactly TP 1's.

use crate::engine::EngineConfig;
use crate::error::EngineError;
use crate::pool::KvPool;
use kvconnect_api::{MemoryKind, ModelSpec};

/// The engine's block pool for `cfg.tp_size` ranks. Refused: a size that does not divide
/// the model's KV heads, and several ranks over device memory (not built).
pub fn pool(spec: &ModelSpec, cfg: &EngineConfig) -> Result<KvPool, EngineError> {
    let tp = cfg.tp_size;
    if tp == 0 || !spec.num_kv_heads.is_multiple_of(tp) {
        return Err(EngineError::TpSize { tp_size: tp, kv_heads: spec.num_kv_heads });
    }
    if tp > 1 && cfg.effective.memory == MemoryKind::Device {
        return Err(EngineError::Layout(format!(
            "tp_size {tp} with KV in device memory is not implemented: run tp_size 1 with kv_buffer_device \
                \"cuda\", or keep KV in host memory"
        )));
    }
    KvPool::with_tp_ranks(spec, &cfg.effective, cfg.num_blocks, cfg.shm.as_deref(), tp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, GenRequest};
    use crate::model::ReferenceConfig;
    use crate::pool::local_effective_layout;
    use kvconnect_api::{Dtype, FailurePolicy, KvLayout};

    fn engine(tp_size: u32, layout: KvLayout) -> Result<Engine, EngineError> {
        let model = ReferenceConfig::builtin()?;
        let spec = model.model_spec()?;
        let effective = local_effective_layout(&spec, layout, true, 16, Dtype::Bf16);
        let cfg = EngineConfig { model, effective, num_blocks: 64, seed: 5, shm: None, tp_size };
        Engine::new(cfg, None, FailurePolicy::Recompute)
    }

    fn run(tp_size: u32, layout: KvLayout) -> Vec<Vec<u32>> {
        let mut e = engine(tp_size, layout).unwrap();
        for (i, len) in [1usize, 15, 40, 130].into_iter().enumerate() {
            let prompt = (0..len as u32).map(|t| (t * 31 + i as u32 * 7) % 256).collect();
            e.add_request(GenRequest::new(format!("r{i}"), prompt, 12)).unwrap();
        }
        e.run_to_completion(100).unwrap().into_iter().map(|c| c.tokens).collect()
    }

    #[test]
    fn every_tp_size_that_divides_the_heads_gives_tp_1_tokens() {
        for layout in [KvLayout::HND, KvLayout::NHD, "BLHNC".parse().unwrap()] {
            let tp1 = run(1, layout);
            assert_eq!(run(2, layout), tp1, "{layout:?}");
        }
    }

    #[test]
    fn each_rank_has_its_own_regions_with_its_share_of_the_heads() {
        let e = engine(2, KvLayout::HND).unwrap();
        let one = engine(1, KvLayout::HND).unwrap();
        assert_eq!(e.regions().len(), 2 * one.regions().len());
        assert!(
            e.regions()[0].name().starts_with("rank0.")
                && e.regions().last().unwrap().name().starts_with("rank1.")
        );
        assert_eq!(e.regions()[0].len() * 2, one.regions()[0].len());
        assert_eq!(e.pool().memory().geometry().tp_ranks(), 2);
    }

    #[test]
    fn a_tp_size_that_does_not_divide_the_kv_heads_is_refused() {
        for tp in [0, 3, 4] {
            let err = engine(tp, KvLayout::HND).unwrap_err().to_string();
            assert_eq!(
                err,
                format!(
                    "tp_size {tp} does not divide the model's 2 KV heads: each rank holds an equal share of \
                     them; use a tp_size that divides 2"
                )
            );
        }
    }
}
