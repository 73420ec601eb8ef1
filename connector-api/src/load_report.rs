//! Which connector and which of its tiers supplied a request's external tokens.
//!
//! A cache connector's worker half records, as a load completes, how many of a request's
//! tokens each of its tiers served ([`record`]); the host takes the record when the request
//! ends ([`take`]) and reports it (a worker's answer carries it in its `kvconnect` block). The
//! table is per process, keyed by engine id and request id, so it serves connectors built into
//! the host; it holds at most [`MAX_RECORDS`] requests, dropping the oldest, so records nobody
//! takes cannot grow without bound.

use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Requests remembered at most.
pub const MAX_RECORDS: usize = 16_384;

/// Tokens of one request one tier of one connector supplied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierTokens {
    /// The connector (`lmcache`, `flexkv`).
    pub connector: String,
    /// Its tier (`cpu`, `disk`, `remote`, `ssd`).
    pub tier: String,
    /// Tokens loaded from it.
    pub tokens: u64,
}

#[derive(Default)]
struct Table {
    map: HashMap<(String, String), Vec<TierTokens>>,
    order: VecDeque<(String, String)>,
}

fn table() -> MutexGuard<'static, Table> {
    static T: OnceLock<Mutex<Table>> = OnceLock::new();
    match T.get_or_init(|| Mutex::new(Table::default())).lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Adds `tokens` supplied by `connector`'s `tier` to request `request` of engine `engine`.
pub fn record(engine: &str, request: &str, connector: &str, tier: &str, tokens: u64) {
    if tokens == 0 {
        return;
    }
    let mut t = table();
    let key = (engine.to_owned(), request.to_owned());
    if !t.map.contains_key(&key) {
        if t.order.len() >= MAX_RECORDS {
            if let Some(old) = t.order.pop_front() {
                t.map.remove(&old);
            }
        }
        t.order.push_back(key.clone());
    }
    let rows = t.map.entry(key).or_default();
    match rows.iter_mut().find(|r| r.connector == connector && r.tier == tier) {
        Some(r) => r.tokens += tokens,
        None => rows.push(TierTokens { connector: connector.to_owned(), tier: tier.to_owned(), tokens }),
    }
}

/// The record of a request, removed from the table (empty when nothing was loaded from a
/// cache tier).
pub fn take(engine: &str, request: &str) -> Vec<TierTokens> {
    let mut t = table();
    let key = (engine.to_owned(), request.to_owned());
    match t.map.remove(&key) {
        Some(rows) => {
            t.order.retain(|k| *k != key);
            rows
        }
        None => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_add_up_per_tier_are_taken_once_and_are_bounded() {
        record("e-lr", "r1", "lmcache", "cpu", 256);
        record("e-lr", "r1", "lmcache", "remote", 512);
        record("e-lr", "r1", "lmcache", "cpu", 256);
        record("e-lr", "r1", "lmcache", "disk", 0);
        record("other", "r1", "flexkv", "ssd", 16);
        let rows = take("e-lr", "r1");
        assert_eq!(
            rows,
            vec![
                TierTokens { connector: "lmcache".into(), tier: "cpu".into(), tokens: 512 },
                TierTokens { connector: "lmcache".into(), tier: "remote".into(), tokens: 512 },
            ]
        );
        assert!(take("e-lr", "r1").is_empty());
        assert_eq!(take("other", "r1").len(), 1);

        // Bounded (in the same test: the table is one per process).
        for i in 0..MAX_RECORDS + 10 {
            record("e-bound", &format!("r{i}"), "lmcache", "cpu", 1);
        }
        assert!(take("e-bound", "r0").is_empty(), "the oldest records were dropped");
        assert_eq!(take("e-bound", &format!("r{}", MAX_RECORDS + 9)).len(), 1);
    }
}
