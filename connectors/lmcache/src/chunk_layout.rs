//! How a chunk's bytes are arranged, and the copies between a chunk and KV blocks.
//!
//! A chunk is stored in the effective layout's own order, so a save or load of whole blocks
//! is one plain copy per (layer, K|V, block): for each KV layer (ascending), for K then V,
//! for each block of the chunk, that block's bytes. A final block holding fewer tokens (a
//! partial chunk) is stored with its token dimension shortened to those tokens. Chunk keys
//! include the layout, so NHD and HND chunks never meet.

use kvconnect_api::geometry::{GeometryError, Span};
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{BlockId, ConnectorError, EffectiveLayout, KvLayout, LayerId, ModelSpec};
use kvconnect_support::stream_copy::{self, Batch};

/// The arithmetic of one engine's chunks.
#[derive(Debug, Clone)]
pub struct ChunkLayout {
    kv_layers: Vec<LayerId>,
    parts: u32,
    heads: usize,
    /// Bytes of one head's one token (head_dim x element size).
    row: usize,
    block_size: usize,
    chunk_size: usize,
    head_major: bool,
}

/// Why a copy between a chunk and the KV cache failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    /// The request's block table is too short for the tokens.
    #[error("token {token} needs block index {index} but the request has {blocks} blocks")]
    NoBlock {
        /// Absolute token position.
        token: usize,
        /// Index into the block table.
        index: usize,
        /// Blocks in the table.
        blocks: usize,
    },
    /// The regions refused the span.
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    /// A stored chunk of the wrong length.
    #[error("stored chunk is {got} bytes, the layout needs {want} for {tokens} tokens")]
    WrongLength {
        /// Its length.
        got: usize,
        /// The expected length.
        want: usize,
        /// Tokens in the chunk.
        tokens: usize,
    },
}

impl ChunkLayout {
    /// The layout for a model and effective layout; refuses what this connector does not
    /// support (HMA, layouts other than NHD and HND, a block size that does not divide the
    /// chunk size).
    pub fn new(
        model: &ModelSpec,
        eff: &EffectiveLayout,
        chunk_size: u32,
    ) -> Result<ChunkLayout, ConnectorError> {
        if eff.hma {
            return Err(ConnectorError::config(
                "lmcache",
                "the effective layout has the hybrid KV cache manager on; lmcache supports one block table \
                    only: run with hybrid_kv_cache_manager off",
            ));
        }
        if eff.layout != KvLayout::NHD && eff.layout != KvLayout::HND {
            return Err(ConnectorError::config(
                "lmcache",
                format!(
                    "the effective layout is {}; lmcache stores NHD (LBNHC) or HND (LBHNC) caches only",
                    eff.layout.display_name()
                ),
            ));
        }
        if chunk_size.checked_rem(eff.block_size) != Some(0) {
            return Err(ConnectorError::config(
                "lmcache",
                format!(
                    "chunk_size {chunk_size} is not a multiple of the block size {}; set chunk_size to a \
                        multiple of it (e.g. {}) or change the block size",
                    eff.block_size,
                    eff.block_size.max(1) * (chunk_size / eff.block_size.max(1)).max(1)
                ),
            ));
        }
        let shape = kvconnect_api::geometry::BlockShape::of(model, eff);
        let kv_layers = model
            .layers
            .iter()
            .enumerate()
            .filter(|(_, k)| k.has_kv_blocks())
            .map(|(i, _)| LayerId(i as u32))
            .collect();
        Ok(ChunkLayout {
            kv_layers,
            parts: shape.kv_parts,
            heads: shape.heads as usize,
            row: shape.head_dim as usize * shape.elem_size as usize,
            block_size: eff.block_size as usize,
            chunk_size: chunk_size as usize,
            head_major: eff.layout.is_head_major(),
        })
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Tokens of a full chunk.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    /// The KV layers, in chunk order.
    pub fn kv_layers(&self) -> &[LayerId] {
        &self.kv_layers
    }

    /// K/V parts per layer (1 for MLA).
    pub fn parts(&self) -> u32 {
        self.parts
    }

    /// Bytes of one token of one (layer, K|V part): heads x head_dim x dtype size.
    pub fn token_bytes(&self) -> usize {
        self.heads * self.row
    }

    /// Bytes of one whole block of one (layer, K|V part).
    pub fn block_bytes(&self) -> usize {
        self.block_size * self.token_bytes()
    }

    /// Bytes of one (layer, K|V) segment of a chunk of `tokens` tokens.
    fn segment_bytes(&self, tokens: usize) -> usize {
        tokens * self.heads * self.row
    }

    /// Bytes of a chunk of `tokens` tokens.
    pub fn chunk_bytes(&self, tokens: usize) -> usize {
        self.kv_layers.len() * self.parts as usize * self.segment_bytes(tokens)
    }

    /// Bytes of one layer's part of a chunk (K and V).
    pub fn layer_bytes(&self, tokens: usize) -> usize {
        self.parts as usize * self.segment_bytes(tokens)
    }

    /// The runs (offset in the segment, span in the regions) that hold tokens `[t0, t1)`
    /// (chunk-relative) of a chunk of `tokens` tokens starting at absolute token `start`.
    #[allow(clippy::too_many_arguments)]
    fn runs(
        &self,
        mem: &KvMemory,
        layer: LayerId,
        part: u32,
        blocks: &[BlockId],
        start: usize,
        tokens: usize,
        t0: usize,
        t1: usize,
        mut f: impl FnMut(usize, Span) -> Result<(), CopyError>,
    ) -> Result<(), CopyError> {
        let bs = self.block_size;
        let tok_bytes = self.heads * self.row;
        let mut t = t0;
        while t < t1 {
            let j = t / bs; // block within the chunk
            let sub_start = j * bs;
            let bt = bs.min(tokens - sub_start); // tokens this block holds in the chunk
            let u0 = t - sub_start;
            let u1 = (t1 - sub_start).min(bt);
            let abs = start + sub_start;
            let index = abs / bs;
            let block =
                *blocks.get(index).ok_or(CopyError::NoBlock { token: abs, index, blocks: blocks.len() })?;
            let span = mem.span(layer, part, block)?;
            let sub_off = sub_start * tok_bytes;
            if !self.head_major || (u0 == 0 && u1 == bs && bt == bs) {
                // Token-major, or a whole head-major block: one run.
                let len = (u1 - u0) * tok_bytes;
                f(
                    sub_off + u0 * tok_bytes,
                    Span { region: span.region, offset: span.offset + u0 * tok_bytes, len },
                )?;
            } else {
                for h in 0..self.heads {
                    let len = (u1 - u0) * self.row;
                    let seg = sub_off + (h * bt + u0) * self.row;
                    let blk = span.offset + (h * bs + u0) * self.row;
                    f(seg, Span { region: span.region, offset: blk, len })?;
                }
            }
            t = sub_start + u1;
        }
        Ok(())
    }

    /// Appends one layer's K (and V) bytes of a chunk to `out` (which is built layer by layer
    /// in `kv_layers` order).
    pub fn save_layer(
        &self,
        mem: &KvMemory,
        layer: LayerId,
        blocks: &[BlockId],
        start: usize,
        tokens: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CopyError> {
        // Streaming stores: a stored chunk is not read again soon (a load, or the disk
        // writer, comes later), so its lines need not displace the cache on the way in.
        let mut batch = Batch::new();
        for part in 0..self.parts {
            self.runs(mem, layer, part, blocks, start, tokens, 0, tokens, |_, span| {
                batch.extend(out, mem.slice(span)?);
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Copies tokens `[t0, t1)` (chunk-relative) of one layer from a stored chunk into the
    /// request's blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn load_layer(
        &self,
        mem: &KvMemory,
        layer_idx: usize,
        blocks: &[BlockId],
        start: usize,
        tokens: usize,
        t0: usize,
        t1: usize,
        chunk: &[u8],
    ) -> Result<(), CopyError> {
        let want = self.chunk_bytes(tokens);
        if chunk.len() != want {
            return Err(CopyError::WrongLength { got: chunk.len(), want, tokens });
        }
        let layer = self.kv_layers[layer_idx];
        let seg_bytes = self.segment_bytes(tokens);
        let mut batch = Batch::new();
        for part in 0..self.parts {
            let seg_start = (layer_idx * self.parts as usize + part as usize) * seg_bytes;
            let seg = &chunk[seg_start..seg_start + seg_bytes];
            self.runs(mem, layer, part, blocks, start, tokens, t0, t1, |off, span| {
                stream_copy::write_in(mem, &mut batch, span, &seg[off..off + span.len])?;
                Ok(())
            })?;
        }
        Ok(())
    }

    /// The block-table indices holding tokens `[from, to)`.
    pub fn block_indices(&self, from: usize, to: usize) -> std::ops::Range<usize> {
        if to <= from {
            return 0..0;
        }
        from / self.block_size..to.div_ceil(self.block_size)
    }
}
