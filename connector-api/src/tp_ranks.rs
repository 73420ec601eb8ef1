//! One scheduler answering for an engine whose tensor-parallel ranks each run their own
//! connector, as vLLM's workers do: every rank's scheduler half sees the same calls and keeps
//! its own rank's store and transfer state, and the scheduler combines their answers.
//!
//! - A match is what every rank can load: the fewest tokens any rank matched (`Pending`
//!   while any rank cannot tell yet), loaded asynchronously if any rank loads so.
//! - A finished request keeps its blocks while any rank needs them. Its transfer params are
//!   rank 0's, and, at more than one rank, every rank's own under [`RANK_PARAMS`], so the
//!   consumer's rank `r` is handed what the producer's rank `r` issued (its own side channel,
//!   its own transfer capability).
//! - A consumer hands each rank the params of the producer rank it loads from
//!   ([`params_for_rank`]); between different TP sizes that is not built, and says so.

use crate::connector::{MatchResult, RequestFinished};
use serde_json::{Map, Value};

/// The key under which a producer at TP > 1 lists every rank's own transfer params.
pub const RANK_PARAMS: &str = "kvconnect_rank_params";

/// What every rank can load: the fewest tokens any rank matched; `Pending` while any rank is.
/// No ranks match nothing.
pub fn combine_matches(ranks: &[MatchResult]) -> MatchResult {
    let mut tokens = usize::MAX;
    let mut async_load = false;
    for m in ranks {
        match m {
            MatchResult::Pending => return MatchResult::Pending,
            MatchResult::Matched { tokens: t, async_load: a } => {
                tokens = tokens.min(*t);
                async_load |= *a;
            }
        }
    }
    if ranks.is_empty() {
        tokens = 0;
    }
    MatchResult::Matched { tokens, async_load }
}

/// The request's answer for the engine: blocks kept while any rank keeps them; rank 0's
/// params, with every rank's under [`RANK_PARAMS`] when there are several ranks and each
/// gave params.
pub fn combine_finished(ranks: Vec<RequestFinished>) -> RequestFinished {
    let delay_free = ranks.iter().any(|f| f.delay_free);
    let several = ranks.len() > 1;
    let mut params: Vec<Option<Map<String, Value>>> = ranks.into_iter().map(|f| f.transfer_params).collect();
    let Some(first) = params.first().cloned().flatten() else {
        return RequestFinished { delay_free, transfer_params: None };
    };
    if !several || params.iter().any(Option::is_none) {
        return RequestFinished { delay_free, transfer_params: Some(first) };
    }
    let each: Vec<Value> = params.iter_mut().map(|p| Value::Object(p.take().unwrap_or_default())).collect();
    let mut merged = first;
    merged.insert(RANK_PARAMS.to_owned(), Value::Array(each));
    RequestFinished { delay_free, transfer_params: Some(merged) }
}

/// Why a consumer rank cannot be handed its producer rank's params.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RankParamsError {
    /// The producer ran at another TP size.
    #[error(
        "not implemented: this request's KV comes from a producer at tensor-parallel size {producer} and \
         this engine runs at {consumer}; inside vLLM kvconnect moves KV between equal TP sizes only (each \
         rank loads from the producer's rank of the same index); run both servers with the same \
         --tensor-parallel-size"
    )]
    TpSizes {
        /// The producer's TP size.
        producer: usize,
        /// This engine's.
        consumer: usize,
    },
    /// The list is not a list of objects.
    #[error("kv_transfer_params.{RANK_PARAMS} must be a list of one JSON object per producer rank, got {0}")]
    Malformed(String),
}

/// The params rank `rank` of `ranks` loads with. A request that loads nothing from a producer
/// (no `do_remote_prefill`) keeps its params on every rank; one from a producer at the same
/// TP size gets that producer rank's own params; one from a producer at another TP size is
/// refused.
pub fn params_for_rank(
    params: &Map<String, Value>,
    rank: usize,
    ranks: usize,
) -> Result<Map<String, Value>, RankParamsError> {
    let from_producer = params.get("do_remote_prefill").and_then(Value::as_bool).unwrap_or(false);
    match params.get(RANK_PARAMS) {
        None if !from_producer || ranks <= 1 => Ok(params.clone()),
        None => Err(RankParamsError::TpSizes { producer: 1, consumer: ranks }),
        Some(Value::Array(each)) => {
            if each.len() != ranks.max(1) {
                return Err(RankParamsError::TpSizes { producer: each.len(), consumer: ranks.max(1) });
            }
            match each.get(rank) {
                Some(Value::Object(m)) => Ok(m.clone()),
                Some(other) => Err(RankParamsError::Malformed(truncate(other))),
                None => Err(RankParamsError::TpSizes { producer: each.len(), consumer: ranks }),
            }
        }
        Some(other) => Err(RankParamsError::Malformed(truncate(other))),
    }
}

fn truncate(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn m(tokens: usize, async_load: bool) -> MatchResult {
        MatchResult::Matched { tokens, async_load }
    }

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!("test input is an object"),
        }
    }

    #[test]
    fn a_match_is_what_every_rank_holds() {
        assert_eq!(combine_matches(&[m(64, false), m(32, false)]), m(32, false));
        assert_eq!(combine_matches(&[m(32, true), m(64, false)]), m(32, true));
        assert_eq!(combine_matches(&[m(32, false), MatchResult::Pending]), MatchResult::Pending);
        assert_eq!(combine_matches(&[m(96, true)]), m(96, true));
        assert_eq!(combine_matches(&[]), m(0, false));
    }

    #[test]
    fn one_rank_keeps_its_params_unchanged() {
        let p = obj(json!({"remote_port": 5600, "do_remote_prefill": true}));
        let f =
            combine_finished(vec![RequestFinished { delay_free: true, transfer_params: Some(p.clone()) }]);
        assert_eq!(f, RequestFinished { delay_free: true, transfer_params: Some(p) });
    }

    #[test]
    fn several_ranks_list_each_ranks_params_and_keep_blocks_while_any_does() {
        let p0 = obj(json!({"remote_port": 5600, "remote_capability": "aa", "do_remote_prefill": true}));
        let p1 = obj(json!({"remote_port": 5601, "remote_capability": "bb", "do_remote_prefill": true}));
        let f = combine_finished(vec![
            RequestFinished { delay_free: false, transfer_params: Some(p0.clone()) },
            RequestFinished { delay_free: true, transfer_params: Some(p1.clone()) },
        ]);
        assert!(f.delay_free);
        let merged = f.transfer_params.expect("params");
        assert_eq!(merged["remote_port"], json!(5600));
        assert_eq!(params_for_rank(&merged, 0, 2).unwrap(), p0);
        assert_eq!(params_for_rank(&merged, 1, 2).unwrap(), p1);
        let none = combine_finished(vec![RequestFinished::default(), RequestFinished::default()]);
        assert_eq!(none, RequestFinished::default());
    }

    #[test]
    fn a_load_between_tp_sizes_is_refused_and_other_requests_pass() {
        let single = obj(json!({"do_remote_prefill": true, "remote_port": 5600}));
        assert_eq!(params_for_rank(&single, 0, 1).unwrap(), single);
        assert_eq!(
            params_for_rank(&single, 1, 2),
            Err(RankParamsError::TpSizes { producer: 1, consumer: 2 })
        );
        let two = obj(json!({"do_remote_prefill": true, RANK_PARAMS: [{"a": 1}, {"a": 2}]}));
        let e = params_for_rank(&two, 0, 1).unwrap_err();
        assert_eq!(e, RankParamsError::TpSizes { producer: 2, consumer: 1 });
        assert!(e.to_string().contains("--tensor-parallel-size"), "{e}");
        let local = obj(json!({"do_remote_decode": true}));
        assert_eq!(params_for_rank(&local, 1, 2).unwrap(), local);
        let bad = obj(json!({"do_remote_prefill": true, RANK_PARAMS: "x"}));
        assert!(matches!(params_for_rank(&bad, 0, 1), Err(RankParamsError::Malformed(_))));
        let bad = obj(json!({"do_remote_prefill": true, RANK_PARAMS: [1, 2]}));
        assert!(matches!(params_for_rank(&bad, 1, 2), Err(RankParamsError::Malformed(_))));
    }
}
