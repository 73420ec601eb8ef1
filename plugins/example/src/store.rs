//! The directory layout: `DIR/<key>/L<layer>.kv` holds, for each stored block in order, its K
//! then V bytes for that layer; `DIR/<key>/meta.json` describes them and is written last, so
//! an entry without it is incomplete and ignored. Entries are built under a temporary name
//! and renamed into place.

use kvconnect_api::geometry::BlockShape;
use kvconnect_api::serde::{Deserialize, Serialize};
use kvconnect_api::{serde_json, KvLayout, LayerId};
use std::path::{Path, PathBuf};

/// What `meta.json` records about an entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(crate = "kvconnect_api::serde")]
pub struct EntryMeta {
    /// The tokens the blocks hold.
    pub tokens: Vec<u32>,
    /// Stored blocks.
    pub num_blocks: usize,
    /// Block shape the bytes follow.
    pub shape: BlockShape,
    /// Layout of the bytes inside each block.
    pub layout: KvLayout,
}

/// A store rooted at one directory, for one block geometry.
#[derive(Debug, Clone)]
pub struct DirStore {
    dir: PathBuf,
    shape: BlockShape,
    layout: KvLayout,
}

impl DirStore {
    /// A store in `dir` (created if missing) for blocks of `shape` in `layout`.
    pub fn open(dir: &Path, shape: BlockShape, layout: KvLayout) -> std::io::Result<DirStore> {
        std::fs::create_dir_all(dir)?;
        Ok(DirStore { dir: dir.to_path_buf(), shape, layout })
    }

    /// The block shape.
    pub fn shape(&self) -> BlockShape {
        self.shape
    }

    /// Tokens of a prompt worth storing: its full blocks, leaving at least one token for the
    /// engine to compute (it needs the last token's logits).
    pub fn cacheable_tokens(&self, prompt_len: usize) -> usize {
        let bs = self.shape.tokens.max(1) as usize;
        (prompt_len.saturating_sub(1) / bs) * bs
    }

    /// The key of these tokens in this geometry (FNV-1a 64; the tokens are stored too and
    /// compared on lookup, so a collision is a miss, never wrong KV).
    pub fn key(&self, tokens: &[u32]) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut feed = |bytes: &[u8]| {
            for b in bytes {
                h ^= u64::from(*b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        let s = self.shape;
        for v in [s.heads, s.tokens, s.head_dim, s.elem_size, s.kv_parts] {
            feed(&v.to_le_bytes());
        }
        feed(self.layout.canonical_name().as_bytes());
        for t in tokens {
            feed(&t.to_le_bytes());
        }
        format!("{h:016x}")
    }

    /// True when a complete entry for exactly these tokens is stored.
    pub fn contains(&self, key: &str, tokens: &[u32]) -> bool {
        match self.meta(key) {
            Ok(m) => m.tokens == tokens && m.shape == self.shape && m.layout == self.layout,
            Err(_) => false,
        }
    }

    /// An entry's description.
    pub fn meta(&self, key: &str) -> std::io::Result<EntryMeta> {
        let bytes = std::fs::read(self.dir.join(key).join("meta.json"))?;
        serde_json::from_slice(&bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    /// One layer's bytes of a complete entry.
    pub fn read_layer(&self, key: &str, layer: LayerId) -> std::io::Result<Vec<u8>> {
        std::fs::read(self.dir.join(key).join(layer_file(layer)))
    }

    fn partial(&self, key: &str) -> PathBuf {
        self.dir.join(format!(".{key}.partial-{}", std::process::id()))
    }

    /// Writes one layer of an entry being built.
    pub fn write_layer(&self, key: &str, layer: LayerId, bytes: &[u8]) -> std::io::Result<()> {
        let p = self.partial(key);
        std::fs::create_dir_all(&p)?;
        std::fs::write(p.join(layer_file(layer)), bytes)
    }

    /// Completes an entry: writes its meta and renames it into place. Another writer that
    /// got there first wins; ours is discarded.
    pub fn publish(&self, key: &str, tokens: &[u32], num_blocks: usize) -> std::io::Result<()> {
        let p = self.partial(key);
        let meta = EntryMeta { tokens: tokens.to_vec(), num_blocks, shape: self.shape, layout: self.layout };
        let bytes =
            serde_json::to_vec(&meta).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        std::fs::write(p.join("meta.json"), bytes)?;
        let dst = self.dir.join(key);
        if dst.exists() {
            return std::fs::remove_dir_all(&p);
        }
        std::fs::rename(&p, &dst)
    }

    /// Drops an entry being built.
    pub fn discard(&self, key: &str) {
        let _ = std::fs::remove_dir_all(self.partial(key));
    }
}

fn layer_file(layer: LayerId) -> String {
    format!("L{}.kv", layer.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> BlockShape {
        BlockShape { heads: 2, tokens: 4, head_dim: 8, elem_size: 2, kv_parts: 2 }
    }

    #[test]
    fn keys_depend_on_tokens_and_geometry() {
        let d = tempfile::tempdir().unwrap();
        let a = DirStore::open(d.path(), shape(), KvLayout::NHD).unwrap();
        let b = DirStore::open(d.path(), shape(), KvLayout::HND).unwrap();
        assert_eq!(a.key(&[1, 2, 3]), a.key(&[1, 2, 3]));
        assert_ne!(a.key(&[1, 2, 3]), a.key(&[1, 2, 4]));
        assert_ne!(a.key(&[1, 2, 3]), b.key(&[1, 2, 3]));
    }

    #[test]
    fn cacheable_tokens_leave_one_to_compute() {
        let d = tempfile::tempdir().unwrap();
        let s = DirStore::open(d.path(), shape(), KvLayout::NHD).unwrap();
        assert_eq!(s.cacheable_tokens(8), 4);
        assert_eq!(s.cacheable_tokens(9), 8);
        assert_eq!(s.cacheable_tokens(3), 0);
        assert_eq!(s.cacheable_tokens(0), 0);
    }

    #[test]
    fn an_entry_is_visible_only_once_published_and_only_for_its_tokens() {
        let d = tempfile::tempdir().unwrap();
        let s = DirStore::open(d.path(), shape(), KvLayout::NHD).unwrap();
        let k = s.key(&[7, 8, 9, 10]);
        s.write_layer(&k, LayerId(0), b"abc").unwrap();
        assert!(!s.contains(&k, &[7, 8, 9, 10]));
        s.publish(&k, &[7, 8, 9, 10], 1).unwrap();
        assert!(s.contains(&k, &[7, 8, 9, 10]));
        assert!(!s.contains(&k, &[7, 8, 9, 11]));
        assert_eq!(s.read_layer(&k, LayerId(0)).unwrap(), b"abc");
    }
}
