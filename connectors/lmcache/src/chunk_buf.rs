//! The bytes of one stored chunk: a heap buffer, or (feature `cuda`) a slot of the pinned
//! slab that device saves gather into directly.
//!
//! The CPU tier, the disk writer and loads only read bytes ([`ChunkBuf::as_slice`]), so they
//! do not care where a chunk lives; a device load asks [`ChunkBuf::pinned`] whether it can
//! scatter straight out of the slot.

/// A chunk's bytes.
pub enum ChunkBuf {
    /// Heap memory (host KV regions, the disk tier, saves the slab had no room for).
    Heap(Vec<u8>),
    /// A checked record read from the remote tier, kept whole (no copy of its bytes).
    Record(crate::disk_tier::DiskChunk),
    /// A slot of a pinned slab, written by the GPU.
    #[cfg(feature = "cuda")]
    Pinned(crate::pinned_slab::PinnedSlot),
}

impl ChunkBuf {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            ChunkBuf::Heap(v) => v,
            ChunkBuf::Record(r) => r.data(),
            #[cfg(feature = "cuda")]
            ChunkBuf::Pinned(s) => s.as_slice(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pinned slot holding the chunk, if it is one.
    #[cfg(feature = "cuda")]
    pub fn pinned(&self) -> Option<&crate::pinned_slab::PinnedSlot> {
        match self {
            ChunkBuf::Heap(_) | ChunkBuf::Record(_) => None,
            ChunkBuf::Pinned(s) => Some(s),
        }
    }
}

impl std::ops::Deref for ChunkBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl From<Vec<u8>> for ChunkBuf {
    fn from(v: Vec<u8>) -> ChunkBuf {
        ChunkBuf::Heap(v)
    }
}

impl std::fmt::Debug for ChunkBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChunkBuf::Heap(v) => write!(f, "ChunkBuf::Heap({} bytes)", v.len()),
            ChunkBuf::Record(r) => write!(f, "ChunkBuf::Record({} bytes)", r.data().len()),
            #[cfg(feature = "cuda")]
            ChunkBuf::Pinned(s) => write!(f, "ChunkBuf::Pinned(slot {}, {} bytes)", s.index(), s.len()),
        }
    }
}
