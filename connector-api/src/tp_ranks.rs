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
//! - A consumer hands each rank the params of the producer ranks it loads from
//!   ([`params_for_rank`]): at equal TP sizes the rank of the same index; at a smaller TP
//!   size every producer rank whose heads it holds, listed under [`RANK_PARAMS`]; at a
//!   larger one the producer rank holding its heads, with [`READER`] saying which of that
//!   rank's readers it is. TP sizes that do not divide one another are not built, and say
//!   so.

use crate::connector::{MatchResult, RequestFinished};
use serde_json::{Map, Value};

/// The key under which a producer at TP > 1 lists every rank's own transfer params (and a
/// consumer rank's params list the producer ranks it loads from).
pub const RANK_PARAMS: &str = "kvconnect_rank_params";

/// The key of a consumer rank's params saying `[index, count]`: it is one of `count`
/// consumer ranks that read the same producer rank's blocks (a consumer at a larger TP
/// size), so the producer frees them once every one of them is done.
pub const READER: &str = "kvconnect_reader";

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
    /// The producer ran at a TP size that does not divide this engine's, nor it the other.
    #[error(
        "not implemented: this request's KV comes from a producer at tensor-parallel size {producer} and \
         this engine runs at {consumer}; inside vLLM kvconnect moves KV between TP sizes that divide one \
         another (each decode rank reads its KV heads from the prefill ranks holding them); run the servers \
         with --tensor-parallel-size values that divide one another (1, 2, 4, 8)"
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
/// (no `do_remote_prefill`) keeps its params on every rank. From a producer of `P` ranks
/// (`P` entries under [`RANK_PARAMS`], or none for one rank) into `C` ranks:
/// - `P == C`: that producer rank's own params;
/// - `P > C` (a multiple): the params of the `P / C` producer ranks holding this rank's
///   heads, the first's at the top and all of them under [`RANK_PARAMS`];
/// - `C > P` (a multiple): the params of the producer rank holding this rank's heads, with
///   [`READER`] `[rank % (C / P), C / P]`;
/// - otherwise refused as not implemented.
pub fn params_for_rank(
    params: &Map<String, Value>,
    rank: usize,
    ranks: usize,
) -> Result<Map<String, Value>, RankParamsError> {
    let from_producer = params.get("do_remote_prefill").and_then(Value::as_bool).unwrap_or(false);
    let consumer = ranks.max(1);
    let each: Vec<Map<String, Value>> = match params.get(RANK_PARAMS) {
        _ if !from_producer => return Ok(params.clone()),
        None => vec![params.clone()],
        Some(Value::Array(each)) => each
            .iter()
            .map(|v| match v {
                Value::Object(m) => Ok(m.clone()),
                other => Err(RankParamsError::Malformed(truncate(other))),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(RankParamsError::Malformed(truncate(other))),
    };
    let producer = each.len();
    if producer == 0 {
        return Err(RankParamsError::Malformed("[]".into()));
    }
    let refused = RankParamsError::TpSizes { producer, consumer };
    if rank >= consumer {
        return Err(refused);
    }
    if producer == consumer {
        return Ok(each[rank].clone());
    }
    if producer > consumer && producer.is_multiple_of(consumer) {
        let k = producer / consumer;
        let mine = &each[rank * k..(rank + 1) * k];
        let mut out = mine[0].clone();
        out.insert(RANK_PARAMS.to_owned(), Value::Array(mine.iter().cloned().map(Value::Object).collect()));
        return Ok(out);
    }
    if consumer > producer && consumer.is_multiple_of(producer) {
        let k = consumer / producer;
        let mut out = each[rank / k].clone();
        out.remove(RANK_PARAMS);
        out.insert(READER.to_owned(), Value::from(vec![rank % k, k]));
        return Ok(out);
    }
    Err(refused)
}

/// The producer ranks' params a consumer rank's params (from [`params_for_rank`]) load
/// from: those under [`RANK_PARAMS`], else the params themselves.
pub fn sources(params: &Map<String, Value>) -> Vec<Map<String, Value>> {
    match params.get(RANK_PARAMS) {
        Some(Value::Array(each)) => each.iter().filter_map(|v| v.as_object().cloned()).collect(),
        _ => vec![params.clone()],
    }
}

/// `(index, count)` of a consumer rank's params that say it is one of several readers of
/// its producer rank's blocks ([`READER`]); `None` otherwise or when malformed.
pub fn reader(params: &Map<String, Value>) -> Option<(u32, u32)> {
    let v = params.get(READER)?.as_array()?;
    let n = |i: usize| v.get(i)?.as_u64().and_then(|x| u32::try_from(x).ok());
    let (i, k) = (n(0)?, n(1)?);
    (v.len() == 2 && i < k).then_some((i, k))
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
    fn a_smaller_consumer_reads_several_producer_ranks_a_larger_one_shares_one() {
        let p = |port: u16| json!({"do_remote_prefill": true, "remote_port": port});
        let single = obj(p(5600));
        assert_eq!(params_for_rank(&single, 0, 1).unwrap(), single);
        // TP 1 -> 2: both decode ranks read the one producer rank, as reader 0 and 1 of 2.
        for r in 0..2 {
            let got = params_for_rank(&single, r, 2).unwrap();
            assert_eq!(got["remote_port"], json!(5600));
            assert_eq!(reader(&got), Some((r as u32, 2)));
            assert_eq!(sources(&got).len(), 1);
        }
        // TP 2 -> 1: the one decode rank reads both producer ranks.
        let two = obj(json!({"do_remote_prefill": true, RANK_PARAMS: [p(5600), p(5601)]}));
        let got = params_for_rank(&two, 0, 1).unwrap();
        assert_eq!(reader(&got), None);
        let ports: Vec<Value> = sources(&got).iter().map(|s| s["remote_port"].clone()).collect();
        assert_eq!(ports, vec![json!(5600), json!(5601)]);
        // TP 4 -> 2: each decode rank reads two producer ranks; TP 2 -> 4: two readers each.
        let four = obj(json!({"do_remote_prefill": true, RANK_PARAMS: [p(1), p(2), p(3), p(4)]}));
        let ports =
            |m: &Map<String, Value>| sources(m).iter().map(|s| s["remote_port"].clone()).collect::<Vec<_>>();
        assert_eq!(ports(&params_for_rank(&four, 1, 2).unwrap()), vec![json!(3), json!(4)]);
        let got = params_for_rank(&two, 3, 4).unwrap();
        assert_eq!((got["remote_port"].clone(), reader(&got)), (json!(5601), Some((1, 2))));
    }

    #[test]
    fn tp_sizes_that_do_not_divide_are_refused_and_other_requests_pass() {
        let three = obj(json!({"do_remote_prefill": true, RANK_PARAMS: [{"a": 1}, {"a": 2}, {"a": 3}]}));
        let e = params_for_rank(&three, 0, 2).unwrap_err();
        assert_eq!(e, RankParamsError::TpSizes { producer: 3, consumer: 2 });
        assert!(
            e.to_string().contains("not implemented") && e.to_string().contains("--tensor-parallel-size"),
            "{e}"
        );
        let local = obj(json!({"do_remote_decode": true}));
        assert_eq!(params_for_rank(&local, 1, 2).unwrap(), local);
        let bad = obj(json!({"do_remote_prefill": true, RANK_PARAMS: "x"}));
        assert!(matches!(params_for_rank(&bad, 0, 1), Err(RankParamsError::Malformed(_))));
        let bad = obj(json!({"do_remote_prefill": true, RANK_PARAMS: [1, 2]}));
        assert!(matches!(params_for_rank(&bad, 1, 2), Err(RankParamsError::Malformed(_))));
    }
}
