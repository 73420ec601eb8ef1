//! The connector metadata envelope: each child's bytes for one step, keyed by the child's
//! index and name, plus what the worker half needs to aggregate `get_finished` (which
//! children delay freeing a request, which children load it).

use crate::error::PdError;
use kvconnect_api::RequestId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Version of the envelope format; a worker refuses any other.
pub const META_VERSION: u32 = 1;

/// One child's part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaPart {
    /// The child's position.
    pub index: usize,
    /// The child's unique name.
    pub name: String,
    /// The child's own metadata, opaque to the composite.
    pub bytes: Vec<u8>,
}

/// A step's metadata for the whole composite.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaEnvelope {
    /// `META_VERSION`.
    pub version: u32,
    /// One part per child, in child order.
    pub parts: Vec<MetaPart>,
    /// Requests finished since the last step whose freeing some children delay, with those
    /// children's indices: the worker reports the request as finished sending once all of
    /// them have.
    #[serde(default)]
    pub delayed: BTreeMap<RequestId, Vec<usize>>,
    /// Requests with an external load this step, with the indices of the children that load
    /// a part: the worker reports the request as finished receiving once all of them have.
    #[serde(default)]
    pub loads: BTreeMap<RequestId, Vec<usize>>,
}

impl MetaEnvelope {
    /// Encodes the envelope.
    pub fn encode(&self) -> Vec<u8> {
        // Serialising plain owned data with string keys cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes and checks an envelope against this composite's children (names in order).
    pub fn decode(bytes: &[u8], names: &[String]) -> Result<MetaEnvelope, PdError> {
        let env: MetaEnvelope = serde_json::from_slice(bytes)
            .map_err(|e| PdError::BadMeta(format!("not a composite metadata envelope ({e})")))?;
        if env.version != META_VERSION {
            return Err(PdError::BadMeta(format!(
                "envelope version {} but this worker reads version {META_VERSION}; run the same kvconnect on the scheduler and the workers",
                env.version
            )));
        }
        let got: Vec<&str> = env.parts.iter().map(|p| p.name.as_str()).collect();
        let want: Vec<&str> = names.iter().map(String::as_str).collect();
        let indices_ok = env.parts.iter().enumerate().all(|(i, p)| p.index == i);
        if got != want || !indices_ok {
            return Err(PdError::BadMeta(format!(
                "the scheduler's composite has children [{}] but this worker's has [{}]; give both halves the same kv-transfer-config",
                got.join(", "),
                want.join(", ")
            )));
        }
        let n = names.len();
        for (what, map) in [("delayed", &env.delayed), ("loads", &env.loads)] {
            if let Some((req, bad)) =
                map.iter().find_map(|(r, v)| v.iter().find(|i| **i >= n).map(|i| (r, i)))
            {
                return Err(PdError::BadMeta(format!(
                    "{what} entry for request {req} names child {bad}, but the composite has {n} children"
                )));
            }
        }
        Ok(env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["lmcache".into(), "nixl".into()]
    }

    fn env() -> MetaEnvelope {
        MetaEnvelope {
            version: META_VERSION,
            parts: vec![
                MetaPart { index: 0, name: "lmcache".into(), bytes: vec![1, 2] },
                MetaPart { index: 1, name: "nixl".into(), bytes: vec![] },
            ],
            delayed: BTreeMap::from([(RequestId::from("r1"), vec![1])]),
            loads: BTreeMap::new(),
        }
    }

    #[test]
    fn round_trips() {
        let e = env();
        assert_eq!(MetaEnvelope::decode(&e.encode(), &names()).unwrap(), e);
    }

    #[test]
    fn mismatched_children_garbage_and_bad_indices_are_errors() {
        let e = MetaEnvelope::decode(&env().encode(), &["nixl".into(), "lmcache".into()]).unwrap_err();
        assert!(
            e.to_string().contains("[lmcache, nixl]") && e.to_string().contains("[nixl, lmcache]"),
            "{e}"
        );
        assert!(MetaEnvelope::decode(b"\x00\x01garbage", &names()).is_err());
        let mut bad = env();
        bad.delayed.insert(RequestId::from("r2"), vec![7]);
        let e = MetaEnvelope::decode(&bad.encode(), &names()).unwrap_err();
        assert!(e.to_string().contains("child 7"), "{e}");
        let mut v = env();
        v.version = 9;
        assert!(MetaEnvelope::decode(&v.encode(), &names()).unwrap_err().to_string().contains("version 9"));
    }
}
