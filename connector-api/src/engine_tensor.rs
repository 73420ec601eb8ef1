//! An engine's KV cache tensors as the engine describes them (address, shape, element
//! strides, dtype, device) and the kvconnect regions they are. Pure checks, so a host that
//! receives tensors it did not allocate (vLLM's `register_kv_caches`) describes each one
//! from its numbers alone and refuses, naming the tensor, one that does not fit the
//! negotiated layout.
//!
//! Two arrangements of a layer's tensor are known:
//! - **Opaque blocks** (`[B][...]`, e.g. vLLM's CPU backend `[B, H, N, 2C]` with K stored
//!   transposed): blocks outermost, each block's bytes (K and V) one dense run, their inside
//!   the engine's own. One region of whole blocks.
//! - **K and V outermost** (vLLM's GPU backends, e.g. FlashAttention's logical
//!   `(2, B, N, H, C)`): kvconnect's per-layer layout `[L][K|V][B][..]`, whose in-block order
//!   of H, N and C is read from the strides. A stride-ordered view (vLLM's HND over the same
//!   logical shape) is dense in its own order and names `HND`. One region: K's blocks, then
//!   V's.
//!
//! Anything else (padded blocks, blocks inside K|V, a shape of other sizes) is refused as not
//! implemented, with its shape and strides.

use crate::caps::MemoryKind;
use crate::ids::LayerId;
use crate::layout::{Dim, KvLayout};
use crate::model::Dtype;

/// One layer's KV cache tensor as the engine describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    /// The engine's name for it.
    pub name: String,
    /// The model layer it holds.
    pub layer: LayerId,
    /// Address of its first element.
    pub addr: u64,
    /// Logical shape.
    pub shape: Vec<u64>,
    /// Strides, in elements, of each logical dimension.
    pub strides: Vec<u64>,
    /// Bytes per element.
    pub elem_size: u64,
    /// The engine's dtype name (`bfloat16`, `torch.float8_e4m3fn`, ...).
    pub dtype: String,
    /// Where it lives: `None` for host memory, else the device ordinal.
    pub device: Option<i32>,
}

/// What the negotiation says each layer's tensor must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expected {
    /// Blocks the engine allocated (all layers have as many).
    pub num_blocks: Option<u64>,
    /// Tokens per block.
    pub block_size: u64,
    /// KV heads in this tensor.
    pub heads: u64,
    /// Channels per head.
    pub head_dim: u64,
    /// 2 for K and V, 1 for MLA's one latent.
    pub kv_parts: u64,
    /// The negotiated cache dtype.
    pub dtype: Dtype,
    /// Where the negotiated KV lives.
    pub memory: MemoryKind,
    /// Blocks are opaque (moved whole, never adapted).
    pub opaque: bool,
    /// The negotiated layout (unused for opaque blocks).
    pub layout: KvLayout,
}

impl Expected {
    /// Bytes of one block of one layer and one of K/V.
    fn part_block_bytes(&self) -> u64 {
        self.heads * self.block_size * self.head_dim * self.dtype.size() as u64
    }
}

/// A tensor as a region: where it starts, how long it is, how its blocks are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Described {
    /// Blocks it holds.
    pub num_blocks: u32,
    /// Its bytes (every block, K and V).
    pub len: u64,
    /// Bytes from one block to the next (within K or V for the K|V-outermost form).
    pub block_stride: u64,
    /// The in-block layout it names; `None` for opaque blocks.
    pub layout: Option<KvLayout>,
    /// Device ordinal, -1 for host memory.
    pub device: i32,
}

/// Why a tensor cannot be a region of the negotiated layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// Its dtype is not the negotiated cache dtype.
    #[error(
        "dtype {given} ({elem_size} bytes per element), but the negotiated cache dtype is {want}: the \
        engine's cache dtype and the negotiation disagree"
    )]
    Dtype {
        /// The engine's name.
        given: String,
        /// Its element size.
        elem_size: u64,
        /// The negotiated one.
        want: Dtype,
    },
    /// It lives in another kind of memory than negotiated.
    #[error(
        "it is in {given} memory, but the negotiation put the KV cache in {want} memory: set \
        kv_buffer_device to where the engine keeps its KV cache"
    )]
    Memory {
        /// Where it is.
        given: MemoryKind,
        /// Where negotiation said.
        want: MemoryKind,
    },
    /// Its data pointer is null.
    #[error("its data pointer is null")]
    Null,
    /// Its strides leave gaps or overlap (padding between blocks, a sliced view).
    #[error(
        "shape {shape:?} with strides {strides:?} is not dense (padded blocks or a sliced view): \
        kvconnect moves each layer's blocks as whole runs of memory"
    )]
    NotDense {
        /// Shape.
        shape: Vec<u64>,
        /// Strides.
        strides: Vec<u64>,
    },
    /// A dense arrangement kvconnect has no layout for.
    #[error(
        "not implemented: a KV cache tensor of shape {shape:?} with strides {strides:?} ({why}); \
        kvconnect knows blocks-outermost opaque blocks and K|V-outermost tensors (2, num_blocks, block_size, \
        heads, head_dim) in any in-block order"
    )]
    NotImplemented {
        /// Shape.
        shape: Vec<u64>,
        /// Strides.
        strides: Vec<u64>,
        /// What does not match.
        why: String,
    },
    /// The tensor's in-block order is not the negotiated layout.
    #[error(
        "its in-block order is {given}, but the negotiation chose {want}: set kv_cache_layout to the \
        engine's layout ({given})"
    )]
    Layout {
        /// The tensor's.
        given: String,
        /// The negotiated one.
        want: String,
    },
}

/// The physical order of `shape`'s dimensions (outermost first), size-1 dimensions left out,
/// when the strides are dense in that order; `None` otherwise.
fn dense_order(shape: &[u64], strides: &[u64]) -> Option<Vec<usize>> {
    if shape.len() != strides.len() {
        return None;
    }
    let mut axes: Vec<usize> = (0..shape.len()).filter(|&i| shape[i] != 1).collect();
    axes.sort_by(|&a, &b| strides[b].cmp(&strides[a]).then(a.cmp(&b)));
    let mut expect = 1u64;
    for &a in axes.iter().rev() {
        if strides[a] != expect {
            return None;
        }
        expect = expect.checked_mul(shape[a])?;
    }
    Some(axes)
}

/// vLLM allocates an fp8 KV cache as raw bytes (`uint8`): such a tensor holds the negotiated
/// fp8 cache dtype (`cache_config.cache_dtype` names which one).
fn fp8_as_bytes(name: &str, want: Dtype) -> Option<Dtype> {
    let fp8 = matches!(want, Dtype::Fp8E4m3 | Dtype::Fp8E5m2);
    (fp8 && name.trim_start_matches("torch.") == "uint8").then_some(want)
}

/// Describes `t` as a region of the negotiated layout `e`, or says why it is not one.
pub fn describe(t: &TensorDesc, e: &Expected) -> Result<Described, TensorError> {
    let dtype = Dtype::from_hf_name(&t.dtype).or_else(|| fp8_as_bytes(&t.dtype, e.dtype));
    if dtype != Some(e.dtype) || t.elem_size != e.dtype.size() as u64 {
        return Err(TensorError::Dtype { given: t.dtype.clone(), elem_size: t.elem_size, want: e.dtype });
    }
    let memory = if t.device.is_some() { MemoryKind::Device } else { MemoryKind::Host };
    if memory != e.memory {
        return Err(TensorError::Memory { given: memory, want: e.memory });
    }
    if t.addr == 0 {
        return Err(TensorError::Null);
    }
    let order = dense_order(&t.shape, &t.strides)
        .ok_or_else(|| TensorError::NotDense { shape: t.shape.clone(), strides: t.strides.clone() })?;
    let elems: u64 = t.shape.iter().product();
    let len = elems * t.elem_size;
    let unknown =
        |why: String| TensorError::NotImplemented { shape: t.shape.clone(), strides: t.strides.clone(), why };
    let blocks = |n: u64| -> Result<u32, TensorError> {
        if e.num_blocks.is_some_and(|want| want != n) {
            return Err(unknown(format!(
                "{n} blocks where the engine allocated {}",
                e.num_blocks.unwrap_or(0)
            )));
        }
        u32::try_from(n).map_err(|_| unknown(format!("{n} blocks do not fit 32 bits")))
    };
    let device = t.device.unwrap_or(-1);
    let block_bytes = e.part_block_bytes() * e.kv_parts;
    if e.opaque {
        // Whole blocks, outermost: dimension 0 is the blocks and the rest is one block.
        let n = *t.shape.first().ok_or_else(|| unknown("no dimensions".into()))?;
        if order.first() != Some(&0) && n != 1 {
            return Err(unknown("its first dimension (the blocks) is not its outermost".into()));
        }
        if len != n * block_bytes {
            return Err(unknown(format!(
                "{len} bytes for {n} blocks, but a block of the negotiated layout is {block_bytes} bytes"
            )));
        }
        return Ok(Described {
            num_blocks: blocks(n)?,
            len,
            block_stride: block_bytes,
            layout: None,
            device,
        });
    }
    // K|V outermost: logical (kv_parts, B, N, H, C), or (B, N, C) for one latent (MLA).
    let names: &[Option<Dim>] = if e.kv_parts == 2 {
        &[None, Some(Dim::B), Some(Dim::N), Some(Dim::H), Some(Dim::C)]
    } else {
        &[Some(Dim::B), Some(Dim::N), Some(Dim::C)]
    };
    let n = t.shape.get(names.iter().position(|d| *d == Some(Dim::B)).unwrap_or(0)).copied().unwrap_or(0);
    let want: Vec<u64> = names
        .iter()
        .map(|d| match d {
            None => e.kv_parts,
            Some(Dim::B) => n,
            Some(Dim::N) => e.block_size,
            Some(Dim::H) => e.heads,
            Some(Dim::C) => e.head_dim,
            Some(Dim::L) => 1,
        })
        .collect();
    if t.shape != want {
        return Err(unknown(format!(
            "expected {} = {want:?}",
            if e.kv_parts == 2 {
                "(2, num_blocks, block_size, heads, head_dim)"
            } else {
                "(num_blocks, block_size, head_dim)"
            }
        )));
    }
    // Physical order: K|V (if any), then the blocks, then H, N and C in some order.
    let dims: Vec<Option<Dim>> = order.iter().map(|&a| names[a]).collect();
    let outer: Vec<Option<Dim>> = if e.kv_parts == 2 { vec![None, Some(Dim::B)] } else { vec![Some(Dim::B)] };
    let outer: Vec<Option<Dim>> = outer.into_iter().filter(|d| dims.contains(d)).collect();
    if dims[..outer.len().min(dims.len())] != outer[..] {
        return Err(unknown("K|V and the blocks are not its outermost dimensions, in that order".into()));
    }
    let mut inner: Vec<Dim> = dims.iter().skip(outer.len()).filter_map(|d| *d).collect();
    for d in [Dim::H, Dim::N, Dim::C] {
        if !inner.contains(&d) {
            // A size-1 dimension has no stride to order it by: innermost adds nothing.
            inner.push(d);
        }
    }
    let layout = KvLayout::from_order([Dim::L, Dim::B, inner[0], inner[1], inner[2]])
        .ok_or_else(|| unknown("its in-block dimensions are not H, N and C".into()))?;
    if !layout.same_bytes(e.layout, e.heads as u32) {
        return Err(TensorError::Layout { given: layout.display_name(), want: e.layout.display_name() });
    }
    Ok(Described {
        num_blocks: blocks(n)?,
        len,
        block_stride: e.part_block_bytes(),
        layout: Some(layout),
        device,
    })
}

/// One placement of same-shaped layers in an engine's single KV cache allocation (vLLM's
/// `KVCacheTensor`): layer `l`'s block `b` starts at `offset + l * layer_stride + b *
/// block_stride` bytes into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Byte offset of its first layer's block 0.
    pub offset: u64,
    /// Bytes from one layer to the next.
    pub layer_stride: u64,
    /// Bytes from one block to the next.
    pub block_stride: u64,
    /// Its layers.
    pub num_layers: u64,
    /// Blocks each layer has.
    pub num_blocks: u64,
}

/// Each layer's blocks as one `(offset, len)` range of a `size`-byte allocation, for a
/// layer-outermost layout (each layer's blocks back to back); placements that alias give the
/// same range twice. A block-outermost layout interleaves layers inside each block, so no
/// layer is one range: not implemented.
pub fn layer_ranges(size: u64, placements: &[Placement]) -> Result<Vec<(u64, u64)>, TensorError> {
    let mut out = Vec::new();
    for p in placements {
        let bad = |why: String| TensorError::NotImplemented {
            shape: vec![p.num_layers, p.num_blocks],
            strides: vec![p.layer_stride, p.block_stride],
            why,
        };
        let layer_bytes = p.block_stride.checked_mul(p.num_blocks).ok_or_else(|| bad("overflow".into()))?;
        if p.num_layers > 1 && p.layer_stride < layer_bytes {
            return Err(bad(
                "a block-outermost allocation: each block holds every layer's part, so no layer's blocks are \
                    one range".into(),
            ));
        }
        for l in 0..p.num_layers {
            let start = l.checked_mul(p.layer_stride).and_then(|o| o.checked_add(p.offset));
            match start.and_then(|s| s.checked_add(layer_bytes).map(|e| (s, e))) {
                Some((s, end)) if end <= size => out.push((s, layer_bytes)),
                _ => return Err(bad(format!("layer {l} reaches past the {size}-byte allocation"))),
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: u64 = 10;

    fn expected(opaque: bool, layout: KvLayout) -> Expected {
        Expected {
            num_blocks: Some(B),
            block_size: 16,
            heads: 2,
            head_dim: 8,
            kv_parts: 2,
            dtype: Dtype::Bf16,
            memory: MemoryKind::Device,
            opaque,
            layout,
        }
    }

    fn dense(shape: &[u64], order: &[usize]) -> Vec<u64> {
        let mut strides = vec![0; shape.len()];
        let mut s = 1;
        for &a in order.iter().rev() {
            strides[a] = s;
            s *= shape[a];
        }
        strides
    }

    fn tensor(shape: &[u64], strides: Vec<u64>, device: Option<i32>) -> TensorDesc {
        TensorDesc {
            name: "model.layers.0.self_attn.attn".into(),
            layer: LayerId(0),
            addr: 0x1000,
            shape: shape.to_vec(),
            strides,
            elem_size: 2,
            dtype: "bfloat16".into(),
            device,
        }
    }

    #[test]
    fn flash_attention_nhd_is_one_region_of_k_then_v() {
        let shape = [2, B, 16, 2, 8];
        let d = describe(
            &tensor(&shape, dense(&shape, &[0, 1, 2, 3, 4]), Some(3)),
            &expected(false, KvLayout::NHD),
        )
        .unwrap();
        assert_eq!(d.num_blocks, B as u32, "blocks are dimension 1, not 0 (which is K|V)");
        assert_eq!(d.len, 2 * B * 16 * 2 * 8 * 2);
        assert_eq!(d.block_stride, 16 * 2 * 8 * 2);
        assert_eq!(d.layout, Some(KvLayout::NHD));
        assert_eq!(d.device, 3, "the tensor's own device, not 0");
    }

    #[test]
    fn a_stride_ordered_hnd_view_names_hnd() {
        // vLLM's HND: logical (2, B, N, H, C), physical (2, B, H, N, C).
        let shape = [2, B, 16, 2, 8];
        let t = tensor(&shape, dense(&shape, &[0, 1, 3, 2, 4]), Some(0));
        assert_eq!(describe(&t, &expected(false, KvLayout::HND)).unwrap().layout, Some(KvLayout::HND));
        let e = describe(&t, &expected(false, KvLayout::NHD)).unwrap_err().to_string();
        assert!(e.contains("in-block order is HND (LBHNC), but the negotiation chose NHD"), "{e}");
    }

    #[test]
    fn cpu_opaque_blocks_are_whole_blocks() {
        let shape = [B, 2, 16, 16];
        let mut e = expected(true, KvLayout::HND);
        e.memory = MemoryKind::Host;
        let d = describe(&tensor(&shape, dense(&shape, &[0, 1, 2, 3]), None), &e).unwrap();
        assert_eq!((d.num_blocks, d.layout, d.device), (B as u32, None, -1));
        assert_eq!(d.block_stride, 2 * 16 * 16 * 2);
    }

    #[test]
    fn padded_strided_wrong_dtype_and_wrong_device_are_refused_by_name() {
        let shape = [2, B, 16, 2, 8];
        let e = expected(false, KvLayout::NHD);
        let mut padded = dense(&shape, &[0, 1, 2, 3, 4]);
        padded[1] += 64;
        padded[0] = padded[1] * B;
        let err = describe(&tensor(&shape, padded, Some(0)), &e).unwrap_err().to_string();
        assert!(err.contains("is not dense"), "{err}");
        let blocks_inside =
            describe(&tensor(&shape, dense(&shape, &[1, 0, 2, 3, 4]), Some(0)), &e).unwrap_err();
        assert!(blocks_inside.to_string().contains("not implemented"), "{blocks_inside}");
        let mut t = tensor(&shape, dense(&shape, &[0, 1, 2, 3, 4]), Some(0));
        t.dtype = "float16".into();
        assert!(describe(&t, &e).unwrap_err().to_string().contains("negotiated cache dtype is bf16"));
        t.dtype = "uint8".into();
        assert!(describe(&t, &e).unwrap_err().to_string().contains("negotiated cache dtype is bf16"));
        t.dtype = "bfloat16".into();
        t.device = None;
        assert!(matches!(describe(&t, &e), Err(TensorError::Memory { .. })));
        let other = [2, B, 32, 2, 8];
        let err = describe(&tensor(&other, dense(&other, &[0, 1, 2, 3, 4]), Some(0)), &e).unwrap_err();
        assert!(err.to_string().contains("expected (2, num_blocks, block_size, heads, head_dim)"), "{err}");
    }

    #[test]
    fn an_fp8_cache_allocated_as_bytes_is_the_negotiated_fp8() {
        let shape = [2, B, 16, 2, 8];
        let mut t = tensor(&shape, dense(&shape, &[0, 1, 2, 3, 4]), Some(0));
        (t.dtype, t.elem_size) = ("uint8".into(), 1);
        for fp8 in [Dtype::Fp8E4m3, Dtype::Fp8E5m2] {
            let e = Expected { dtype: fp8, ..expected(false, KvLayout::NHD) };
            assert_eq!(describe(&t, &e).unwrap().block_stride, 16 * 2 * 8);
        }
        t.dtype = "int8".into();
        let e = Expected { dtype: Dtype::Fp8E4m3, ..expected(false, KvLayout::NHD) };
        assert!(describe(&t, &e).unwrap_err().to_string().contains("negotiated cache dtype is fp8_e4m3"));
    }

    #[test]
    fn one_kv_head_may_sit_anywhere() {
        let mut e = expected(false, KvLayout::HND);
        e.heads = 1;
        let shape = [2, B, 16, 1, 8];
        let d = describe(&tensor(&shape, dense(&shape, &[0, 1, 2, 3, 4]), Some(0)), &e).unwrap();
        assert!(d.layout.is_some_and(|l| l.same_bytes(KvLayout::HND, 1)));
    }

    #[test]
    fn layer_outermost_placements_give_one_range_per_layer() {
        let page = 16 << 10;
        let p = |offset, layer_stride, block_stride, num_layers| Placement {
            offset,
            layer_stride,
            block_stride,
            num_layers,
            num_blocks: 4,
        };
        // Two layers, then a second KV cache group aliasing the first layer's bytes.
        let r = layer_ranges(8 * page, &[p(0, 4 * page, page, 2), p(0, 4 * page, page, 1)]).unwrap();
        assert_eq!(r, [(0, 4 * page), (4 * page, 4 * page), (0, 4 * page)]);
        let e = layer_ranges(8 * page, &[p(0, page, 2 * page, 2)]).unwrap_err().to_string();
        assert!(e.contains("not implemented") && e.contains("block-outermost"), "{e}");
        let e = layer_ranges(4 * page, &[p(0, 4 * page, page, 2)]).unwrap_err().to_string();
        assert!(e.contains("reaches past"), "{e}");
    }
}
