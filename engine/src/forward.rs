//! One layer of the reference model over one request's new tokens, with the KV read and
//! written only through the block pool (so what the engine attends to is exactly what a
//! connector saved or loaded).

use crate::error::EngineError;
use crate::kv_codec;
use crate::model::ReferenceModel;
use crate::pool::KvPool;
use kvconnect_api::{AttentionKind, BlockId, LayerId};

/// Reusable buffers, so the hot loop does not allocate per token.
#[derive(Debug, Default)]
pub struct Scratch {
    kbuf: Vec<u8>,
    vbuf: Vec<u8>,
    keys: Vec<f32>,
    vals: Vec<f32>,
}

/// Runs layer `layer` for tokens at positions `start..start + n` (residuals in `h`, `n`
/// rows of `hidden`), writing their K/V into `blocks` (the request's block table for the
/// layer's group) and attending over the cache. Returns the blocks written.
pub fn forward_layer(
    model: &ReferenceModel,
    pool: &KvPool,
    layer: usize,
    blocks: &[BlockId],
    start: usize,
    h: &mut [f32],
    s: &mut Scratch,
) -> Result<Vec<BlockId>, EngineError> {
    let c = &model.cfg;
    let d = c.hidden_size;
    let hd = c.head_dim;
    let nkv = c.num_key_value_heads;
    let kvd = nkv * hd;
    let n = h.len() / d;
    if n == 0 {
        return Ok(Vec::new());
    }
    let bs = pool.effective().block_size as usize;
    let dtype = pool.effective().cache_dtype;
    let es = dtype.size();
    let st = pool.strides();
    let lid = LayerId(layer as u32);
    let end = start + n;
    let block_at = |pos: usize| {
        blocks.get(pos / bs).copied().ok_or_else(|| {
            EngineError::Access(format!(
                "position {pos} needs block {} of the request but only {} are allocated",
                pos / bs,
                blocks.len()
            ))
        })
    };

    // Project every new token, then store its K/V (rounded to the cache dtype) block by block.
    let mut q = vec![0.0f32; n * c.num_attention_heads * hd];
    let mut k = vec![0.0f32; n * kvd];
    let mut v = vec![0.0f32; n * kvd];
    let qd = c.num_attention_heads * hd;
    for i in 0..n {
        model.qkv(
            layer,
            &h[i * d..(i + 1) * d],
            start + i,
            &mut q[i * qd..(i + 1) * qd],
            &mut k[i * kvd..(i + 1) * kvd],
            &mut v[i * kvd..(i + 1) * kvd],
        );
    }
    let mut written = Vec::new();
    let mut pos = start;
    while pos < end {
        let b = block_at(pos)?;
        let block_end = ((pos / bs) + 1) * bs;
        pool.read_block(lid, 0, b, &mut s.kbuf)?;
        pool.read_block(lid, 1, b, &mut s.vbuf)?;
        for p in pos..end.min(block_end) {
            let (i, slot) = (p - start, p % bs);
            for kvh in 0..nkv {
                for ch in 0..hd {
                    let off = (kvh * st.head + slot * st.token + ch * st.channel) * es;
                    kv_codec::encode(dtype, k[i * kvd + kvh * hd + ch], &mut s.kbuf[off..off + es]);
                    kv_codec::encode(dtype, v[i * kvd + kvh * hd + ch], &mut s.vbuf[off..off + es]);
                }
            }
        }
        pool.write_block(lid, 0, b, &s.kbuf)?;
        pool.write_block(lid, 1, b, &s.vbuf)?;
        written.push(b);
        pos = block_end;
    }

    // Gather the cached K/V every new token can see, oldest first.
    let window = match model.layers[layer].kind {
        AttentionKind::SlidingWindow { window } => Some(window as usize),
        _ => None,
    };
    let lo_of = |p: usize| window.map_or(0, |w| (p + 1).saturating_sub(w));
    let lo = lo_of(start);
    let npos = end - lo;
    s.keys.clear();
    s.keys.resize(npos * kvd, 0.0);
    s.vals.clear();
    s.vals.resize(npos * kvd, 0.0);
    let mut pos = lo;
    while pos < end {
        let b = block_at(pos)?;
        let block_end = ((pos / bs) + 1) * bs;
        pool.read_block(lid, 0, b, &mut s.kbuf)?;
        pool.read_block(lid, 1, b, &mut s.vbuf)?;
        for p in pos..end.min(block_end) {
            let (row, slot) = (p - lo, p % bs);
            for kvh in 0..nkv {
                for ch in 0..hd {
                    let off = (kvh * st.head + slot * st.token + ch * st.channel) * es;
                    s.keys[row * kvd + kvh * hd + ch] = kv_codec::decode(dtype, &s.kbuf[off..off + es]);
                    s.vals[row * kvd + kvh * hd + ch] = kv_codec::decode(dtype, &s.vbuf[off..off + es]);
                }
            }
        }
        pos = block_end;
    }

    for i in 0..n {
        let p = start + i;
        let (a, z) = (lo_of(p) - lo, p - lo + 1);
        model.attend_and_mlp(
            layer,
            &q[i * qd..(i + 1) * qd],
            &s.keys[a * kvd..z * kvd],
            &s.vals[a * kvd..z * kvd],
            z - a,
            &mut h[i * d..(i + 1) * d],
        );
    }
    Ok(written)
}
