//! The connector metadata envelope: each child's bytes for one step, keyed by the child's
//! index and name, plus what the worker half needs to aggregate `get_finished` (which
//! children delay freeing a request, which children load it). ARCHITECTURE.md §8.

use crate::error::PdError;
use kvconnect_api::protocol::VersionMismatch;
use kvconnect_api::RequestId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Version of the envelope format; a worker refuses any other.
pub const META_VERSION: u32 = 1;

/// The envelope's name in a version mismatch.
const PROTOCOL: &str = "pd metadata envelope";

/// First bytes of every envelope.
const MAGIC: &[u8; 4] = b"KVPD";

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
///
/// On the wire: `KVPD`, a little-endian u32 header length, the header as JSON (version,
/// each part's index, name and length, `delayed`, `loads`), then the parts' bytes back to
/// back. The children's bytes stay raw: spelling them out in JSON costs hundreds of times a
/// copy (see `benches/composite.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaEnvelope {
    /// `META_VERSION`.
    pub version: u32,
    /// One part per child, in child order.
    pub parts: Vec<MetaPart>,
    /// Requests finished since the last step whose freeing some children delay, with those
    /// children's indices: the worker reports the request as finished sending once all of
    /// them have.
    pub delayed: BTreeMap<RequestId, Vec<usize>>,
    /// Requests with an external load this step, with the indices of the children that load
    /// a part: the worker reports the request as finished receiving once all of them have.
    pub loads: BTreeMap<RequestId, Vec<usize>>,
}

#[derive(Serialize, Deserialize)]
struct PartHeader {
    index: usize,
    name: String,
    len: usize,
}

#[derive(Serialize, Deserialize)]
struct Header {
    version: u32,
    parts: Vec<PartHeader>,
    #[serde(default)]
    delayed: BTreeMap<RequestId, Vec<usize>>,
    #[serde(default)]
    loads: BTreeMap<RequestId, Vec<usize>>,
}

impl MetaEnvelope {
    /// Encodes the envelope.
    pub fn encode(&self) -> Vec<u8> {
        let header = Header {
            version: self.version,
            parts: self
                .parts
                .iter()
                .map(|p| PartHeader { index: p.index, name: p.name.clone(), len: p.bytes.len() })
                .collect(),
            delayed: self.delayed.clone(),
            loads: self.loads.clone(),
        };
        // Serialising plain owned data with string keys cannot fail.
        let h = serde_json::to_vec(&header).unwrap_or_default();
        let body: usize = self.parts.iter().map(|p| p.bytes.len()).sum();
        let mut out = Vec::with_capacity(8 + h.len() + body);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(h.len() as u32).to_le_bytes());
        out.extend_from_slice(&h);
        for p in &self.parts {
            out.extend_from_slice(&p.bytes);
        }
        out
    }

    /// Decodes and checks an envelope against this composite's children (names in order).
    pub fn decode(bytes: &[u8], names: &[String]) -> Result<MetaEnvelope, PdError> {
        let not_env = |why: &str| PdError::BadMeta(format!("not a composite metadata envelope ({why})"));
        if bytes.len() < 8 || &bytes[..4] != MAGIC {
            return Err(not_env("it does not start with the KVPD header"));
        }
        let mut len4 = [0u8; 4];
        len4.copy_from_slice(&bytes[4..8]);
        let hlen = u32::from_le_bytes(len4) as usize;
        let rest = &bytes[8..];
        if hlen > rest.len() {
            return Err(not_env(&format!("header of {hlen} bytes but only {} follow", rest.len())));
        }
        let header: Header =
            serde_json::from_slice(&rest[..hlen]).map_err(|e| not_env(&format!("header: {e}")))?;
        VersionMismatch::check(PROTOCOL, "worker", META_VERSION, "scheduler", Some(header.version))
            .map_err(|e| PdError::BadMeta(e.to_string()))?;
        let mut body = &rest[hlen..];
        let want_body: usize = header.parts.iter().map(|p| p.len).fold(0usize, |a, b| a.saturating_add(b));
        if want_body != body.len() {
            return Err(not_env(&format!(
                "the parts add up to {want_body} bytes but {} follow the header",
                body.len()
            )));
        }
        let mut parts = Vec::with_capacity(header.parts.len());
        for p in header.parts {
            let (mine, tail) = body.split_at(p.len);
            parts.push(MetaPart { index: p.index, name: p.name, bytes: mine.to_vec() });
            body = tail;
        }
        let env =
            MetaEnvelope { version: header.version, parts, delayed: header.delayed, loads: header.loads };
        let got: Vec<&str> = env.parts.iter().map(|p| p.name.as_str()).collect();
        let want: Vec<&str> = names.iter().map(String::as_str).collect();
        let indices_ok = env.parts.iter().enumerate().all(|(i, p)| p.index == i);
        if got != want || !indices_ok {
            return Err(PdError::BadMeta(format!(
                "the scheduler's composite has children [{}] but this worker's has [{}]; give both halves \
                    the same kv-transfer-config",
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
        // Truncated anywhere: an error, never a panic.
        let full = env().encode();
        for cut in 0..full.len() {
            assert!(MetaEnvelope::decode(&full[..cut], &names()).is_err(), "cut at {cut}");
        }
        let mut long = full.clone();
        long.push(0);
        assert!(MetaEnvelope::decode(&long, &names()).unwrap_err().to_string().contains("add up to"));
        let mut bad = env();
        bad.delayed.insert(RequestId::from("r2"), vec![7]);
        let e = MetaEnvelope::decode(&bad.encode(), &names()).unwrap_err();
        assert!(e.to_string().contains("child 7"), "{e}");
        // Part lengths a peer chose to overflow a sum, or to split past the end.
        for lens in [vec![usize::MAX, 2], vec![usize::MAX / 2 + 1, usize::MAX / 2 + 1], vec![3, usize::MAX]] {
            let parts: Vec<String> = lens
                .iter()
                .enumerate()
                .map(|(i, l)| format!(r#"{{"index":{i},"name":"p{i}","len":{l}}}"#))
                .collect();
            let h = format!(r#"{{"version":1,"parts":[{}]}}"#, parts.join(","));
            let mut b = b"KVPD".to_vec();
            b.extend_from_slice(&(h.len() as u32).to_le_bytes());
            b.extend_from_slice(h.as_bytes());
            b.extend_from_slice(&[0u8; 1]);
            let e = MetaEnvelope::decode(&b, &names()).unwrap_err().to_string();
            assert!(e.contains("add up to"), "{lens:?}: {e}");
        }
        let mut v = env();
        v.version = 9;
        assert_eq!(
            MetaEnvelope::decode(&v.encode(), &names()).unwrap_err().to_string(),
            format!(
                "connector metadata does not fit this composite: pd metadata envelope version \
                 mismatch: this worker speaks version {META_VERSION}, the scheduler speaks version 9 — \
                 run the same kvconnect release on both"
            )
        );
    }
}
