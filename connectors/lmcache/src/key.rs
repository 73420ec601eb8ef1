//! Chunk keys: a prefix-hash chain over token chunks, rooted in a namespace that names
//! everything the stored bytes depend on (model, effective layout, cache dtype, TP rank and
//! size, chunk size). A cache written under one layout can therefore never be read as
//! another: the keys differ.

use crate::hash::hash_tokens;
use kvconnect_api::{ConnectorContext, ModelSpec};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;

/// Bumped whenever the stored byte format or the key derivation changes.
pub const FORMAT_VERSION: u32 = 3;

/// The key of one chunk: its hash chained over every earlier chunk and the namespace.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkKey(pub [u64; 2]);

impl std::hash::Hash for ChunkKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // Already a uniform hash: one word is plenty for a hash map.
        state.write_u64(self.0[0]);
    }
}

impl ChunkKey {
    /// 32 hex digits (file names, messages).
    pub fn hex(&self) -> String {
        format!("{:016x}{:016x}", self.0[0], self.0[1])
    }

    /// Parses `hex()`'s output.
    pub fn from_hex(s: &str) -> Option<ChunkKey> {
        if s.len() != 32 {
            return None;
        }
        let a = u64::from_str_radix(&s[..16], 16).ok()?;
        let b = u64::from_str_radix(&s[16..], 16).ok()?;
        Some(ChunkKey([a, b]))
    }
}

impl fmt::Debug for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkKey({})", self.hex())
    }
}

/// The root of every key chain of one engine: a digest of what the bytes depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Namespace(pub [u64; 2]);

/// SHA-256 of the model's canonical JSON, as hex.
pub fn model_fingerprint(model: &ModelSpec) -> String {
    let json = serde_json::to_vec(model).unwrap_or_default();
    let d = Sha256::digest(&json);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

impl Namespace {
    /// The namespace of an engine: model fingerprint, effective layout (layout, block size,
    /// dtype, HMA, groups), TP rank and size, chunk size and the store format.
    pub fn of(ctx: &ConnectorContext, chunk_size: u32) -> Namespace {
        let e = &ctx.effective;
        let desc = serde_json::json!({
            "format": FORMAT_VERSION,
            "model": model_fingerprint(&ctx.model),
            "layout": e.layout.canonical_name(),
            "block_size": e.block_size,
            "cache_dtype": e.cache_dtype,
            "hma": e.hma,
            "groups": e.groups,
            "tp_rank": ctx.tp_rank,
            "tp_size": ctx.tp_size,
            "chunk_size": chunk_size,
        });
        let d = Sha256::digest(desc.to_string().as_bytes());
        let word = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&d[i..i + 8]);
            u64::from_le_bytes(a)
        };
        Namespace([word(0), word(8)])
    }
}

/// One chunk of a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// Its key.
    pub key: ChunkKey,
    /// First token.
    pub start: usize,
    /// Tokens in it (`chunk_size`, or fewer for a final partial chunk).
    pub tokens: usize,
}

/// The keys of `tokens`' chunks: every full chunk, plus the final partial one if
/// `with_partial`.
pub fn chunk_keys(ns: Namespace, tokens: &[u32], chunk_size: usize, with_partial: bool) -> Vec<ChunkRef> {
    let mut out = Vec::with_capacity(tokens.len() / chunk_size.max(1) + 1);
    let mut prev = ns.0;
    for (i, c) in tokens.chunks(chunk_size.max(1)).enumerate() {
        if c.len() < chunk_size && !with_partial {
            break;
        }
        prev = hash_tokens(prev, c);
        out.push(ChunkRef { key: ChunkKey(prev), start: i * chunk_size, tokens: c.len() });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::{
        AttentionKind, Dtype, EffectiveLayout, KvLayout, KvRole, KvTransferConfig, MemoryKind,
    };

    fn ctx() -> ConnectorContext {
        ConnectorContext {
            config: KvTransferConfig::named("LMCacheConnectorV1"),
            model: ModelSpec {
                name: "m".into(),
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 8,
                dtype: Some(Dtype::Bf16),
                layers: vec![AttentionKind::Full; 2],
                state: None,
            },
            effective: EffectiveLayout {
                layout: KvLayout::NHD,
                hma: false,
                block_size: 16,
                cache_dtype: Dtype::Bf16,
                memory: MemoryKind::Host,
                transfer_mode: kvconnect_api::TransferMode::None,
                groups: vec![],
                state_groups: vec![],
                opaque_blocks: false,
            },
            role: KvRole::Both,
            engine_id: "e".into(),
            tp_rank: 0,
            tp_size: 2,
        }
    }

    #[test]
    fn namespace_names_everything_the_bytes_depend_on() {
        let base = Namespace::of(&ctx(), 256);
        assert_eq!(base, Namespace::of(&ctx(), 256), "deterministic");
        let mut other = ctx();
        other.engine_id = "another engine".into();
        assert_eq!(base, Namespace::of(&other, 256), "the engine id is not part of it");
        let variants: [fn(&mut ConnectorContext); 6] = [
            |c| c.tp_rank = 1,
            |c| c.tp_size = 4,
            |c| c.effective.layout = KvLayout::HND,
            |c| c.effective.block_size = 32,
            |c| c.effective.cache_dtype = Dtype::Fp8E4m3,
            |c| c.model.num_kv_heads = 4,
        ];
        for v in variants {
            let mut c = ctx();
            v(&mut c);
            assert_ne!(Namespace::of(&c, 256), base);
        }
        assert_ne!(Namespace::of(&ctx(), 128), base, "chunk size");
    }

    #[test]
    fn chain_depends_on_prefix() {
        let ns = Namespace([1, 2]);
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[3] = 999;
        let ka = chunk_keys(ns, &a, 16, false);
        let kb = chunk_keys(ns, &b, 16, false);
        assert_eq!(ka.len(), 2);
        assert_ne!(ka[1].key, kb[1].key, "a change in chunk 0 changes chunk 1's key");
        let kp = chunk_keys(ns, &a, 16, true);
        assert_eq!(kp.len(), 3);
        assert_eq!((kp[2].start, kp[2].tokens), (32, 8));
        assert_eq!(&kp[..2], &ka[..]);
        assert_ne!(chunk_keys(Namespace([1, 3]), &a, 16, false)[0].key, ka[0].key);
        assert_eq!(ChunkKey::from_hex(&ka[0].key.hex()), Some(ka[0].key));
    }
}
