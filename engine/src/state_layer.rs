//! The reference model's state layer: a small gated linear recurrence shaped like Gated
//! DeltaNet's state (Qwen3-Next's `linear_attention`), read and written only through the
//! pool's state slot of the request.
//!
//! Per token: `x = RMSNorm(h)`, `u = W_in x` (q, k and v channels), a causal depthwise conv
//! over the last `kernel` values of `u` then SiLU; per value head a decay `a = sigmoid(w_a · x + 3)`
//! and the state update `S = a S + k vᵀ`, the output `o = Sᵀ q`, projected back onto the
//! residual, then the layer's MLP. The conv window and `S` are rounded to their dtypes after
//! every token, so a state stored after any token and loaded elsewhere continues exactly as
//! if it had never left: prefill on one engine and decode on another agree bit for bit.

use crate::error::EngineError;
use crate::kv_codec;
use crate::model::{matvec, rms_norm, ReferenceModel};
use crate::pool::KvPool;
use crate::prng::SplitMix64;
use kvconnect_api::{BlockId, Dtype, LayerId, LayerState, Request, StateKind};

/// The state's dimensions, from the model's `LayerState` (the config's `linear_*` fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateDims {
    /// Past inputs the conv keeps (`linear_conv_kernel_dim - 1`).
    pub past: usize,
    /// Conv channels: q and k (`k_heads * k_dim` each), then v (`v_heads * v_dim`).
    pub conv_dim: usize,
    /// Key heads.
    pub k_heads: usize,
    /// Channels per key head.
    pub k_dim: usize,
    /// Value heads (one recurrent state each).
    pub v_heads: usize,
    /// Channels per value head.
    pub v_dim: usize,
    /// Dtype of the conv window.
    pub conv_dtype: Dtype,
    /// Dtype of the recurrent state.
    pub ssm_dtype: Dtype,
}

impl StateDims {
    /// The dimensions of a Gated DeltaNet state; other mixers are refused.
    pub fn of(st: &LayerState) -> Result<StateDims, EngineError> {
        let bad = |m: String| Err(EngineError::ModelConfig(m));
        if st.kind != StateKind::GatedDeltaNet {
            return bad(format!(
                "the reference engine's state layers keep a gated_delta_net state (linear_attention with \
                    linear_* fields), not {}",
                st.kind
            ));
        }
        let (&[past, conv_dim], &[v_heads, k_dim, v_dim]) =
            (st.conv_shape.as_slice(), st.ssm_shape.as_slice())
        else {
            return bad(format!(
                "state shapes conv {:?} and ssm {:?} are not 2- and 3-dimensional",
                st.conv_shape, st.ssm_shape
            ));
        };
        let [past, conv_dim, v_heads, k_dim, v_dim] =
            [past, conv_dim, v_heads, k_dim, v_dim].map(|d| d as usize);
        let qk = conv_dim.checked_sub(v_heads * v_dim).filter(|qk| k_dim > 0 && qk % (2 * k_dim) == 0);
        let k_heads = qk.map_or(0, |qk| qk / (2 * k_dim));
        if k_heads == 0 || v_heads == 0 || v_dim == 0 || !v_heads.is_multiple_of(k_heads) {
            return bad(format!(
                "linear_num_value_heads ({v_heads}) must be a positive multiple of linear_num_key_heads \
                    ({k_heads}), with positive head dims"
            ));
        }
        if !kv_codec::supported(st.conv_dtype) || !kv_codec::supported(st.ssm_dtype) {
            return bad(format!(
                "state dtypes {:?} and {:?}: the reference engine stores bf16 or f32",
                st.conv_dtype, st.ssm_dtype
            ));
        }
        Ok(StateDims {
            past,
            conv_dim,
            k_heads,
            k_dim,
            v_heads,
            v_dim,
            conv_dtype: st.conv_dtype,
            ssm_dtype: st.ssm_dtype,
        })
    }

    fn conv_bytes(&self) -> usize {
        self.past * self.conv_dim * self.conv_dtype.size()
    }

    fn ssm_len(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }
}

/// One state layer's weights (row-major `[out][in]`).
#[derive(Debug, Clone)]
pub struct StateWeights {
    dims: StateDims,
    norm: Vec<f32>,
    w_in: Vec<f32>,
    /// `[conv_dim][past + 1]`, oldest input first.
    conv: Vec<f32>,
    w_decay: Vec<f32>,
    w_out: Vec<f32>,
}

impl StateWeights {
    /// Weights drawn from `rng` for a residual width `d`.
    pub fn new(dims: StateDims, d: usize, rng: &mut SplitMix64) -> StateWeights {
        let mut u =
            |n: usize, scale: f32| (0..n).map(|_| rng.next_signed_unit() * scale).collect::<Vec<f32>>();
        let a = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        let vd = dims.v_heads * dims.v_dim;
        let norm = u(d, 0.1).into_iter().map(|x| 1.0 + x).collect();
        StateWeights {
            dims,
            norm,
            w_in: u(dims.conv_dim * d, a(d)),
            conv: u(dims.conv_dim * (dims.past + 1), a(dims.past + 1)),
            w_decay: u(dims.v_heads * d, a(d)),
            // A larger gain than the attention output's, so the state layers steer the tokens.
            w_out: u(d * vd, 3.0 * a(vd)),
        }
    }

    /// The state's dimensions.
    pub fn dims(&self) -> StateDims {
        self.dims
    }
}

/// vLLM's `_prefill_backoff` for models with state layers: a prefill for a remote decode
/// (`do_remote_decode`) stops one prompt token short and generates one token, so the state
/// it hands over is the state after all but the last prompt token, which decode computes
/// itself (it needs that token's logits). The prefill's KV then covers the same tokens
/// decode loads. A one-token prompt is left as it is: decode loads nothing from it.
pub fn prefill_backoff(req: &mut Request, max_tokens: &mut usize) {
    if kvconnect_dataplane::params::wants_remote_decode(req) && req.prompt_tokens.len() > 1 {
        req.prompt_tokens.pop();
        *max_tokens = 1;
    }
}

/// Runs state layer `layer` for tokens at `start..start + n` (residuals in `h`, `n` rows of
/// `hidden`) of the request whose state is `slot`: reads the state (zeros at `start == 0`,
/// whatever the slot held), advances it token by token and writes it back.
pub fn forward_state_layer(
    model: &ReferenceModel,
    pool: &KvPool,
    layer: usize,
    slot: BlockId,
    start: usize,
    h: &mut [f32],
    buf: &mut Vec<u8>,
) -> Result<(), EngineError> {
    let w = model.state_weights(layer).ok_or_else(|| {
        EngineError::Layout(format!(
            "layer {layer} is in a state group but the model has no state weights for it"
        ))
    })?;
    let dm = w.dims;
    let d = model.hidden();
    let lid = LayerId(layer as u32);
    let conv_bytes = dm.conv_bytes();
    let (ce, se) = (dm.conv_dtype.size(), dm.ssm_dtype.size());
    let mut window = vec![0.0f32; dm.past * dm.conv_dim];
    let mut s = vec![0.0f32; dm.ssm_len()];
    pool.read_state(lid, slot, buf)?;
    if buf.len() != conv_bytes + dm.ssm_len() * se {
        return Err(EngineError::Access(format!(
            "state slot of layer {layer} is {} bytes; the model's state needs {}",
            buf.len(),
            conv_bytes + dm.ssm_len() * se
        )));
    }
    if start > 0 {
        for (i, x) in window.iter_mut().enumerate() {
            *x = kv_codec::decode(dm.conv_dtype, &buf[i * ce..]);
        }
        for (i, x) in s.iter_mut().enumerate() {
            *x = kv_codec::decode(dm.ssm_dtype, &buf[conv_bytes + i * se..]);
        }
    }
    let eps = model.cfg.rms_norm_eps;
    let qk = dm.k_heads * dm.k_dim;
    let group = dm.v_heads / dm.k_heads;
    let k_scale = 1.0 / (dm.k_dim as f32).sqrt();
    let (mut x, mut uu, mut y) = (vec![0.0f32; d], vec![0.0f32; dm.conv_dim], vec![0.0f32; dm.conv_dim]);
    let mut o = vec![0.0f32; dm.v_heads * dm.v_dim];
    let mut proj = vec![0.0f32; d];
    for row in h.chunks_exact_mut(d) {
        rms_norm(row, &w.norm, eps, &mut x);
        matvec(&w.w_in, &x, &mut uu);
        for v in uu.iter_mut() {
            *v = kv_codec::round(dm.conv_dtype, *v);
        }
        for c in 0..dm.conv_dim {
            let taps = &w.conv[c * (dm.past + 1)..(c + 1) * (dm.past + 1)];
            let mut acc = taps[dm.past] * uu[c];
            for j in 0..dm.past {
                acc += taps[j] * window[j * dm.conv_dim + c];
            }
            y[c] = acc / (1.0 + (-acc).exp());
        }
        if dm.past > 0 {
            window.copy_within(dm.conv_dim.., 0);
            window[(dm.past - 1) * dm.conv_dim..].copy_from_slice(&uu);
        }
        let (q, rest) = y.split_at(qk);
        let (k, v) = rest.split_at(qk);
        for vh in 0..dm.v_heads {
            let kh = vh / group;
            let decay_in: f32 = w.w_decay[vh * d..(vh + 1) * d].iter().zip(&x).map(|(a, b)| a * b).sum();
            // Biased towards 1 (about 0.95): the state remembers far back, so what it holds
            // moves the output visibly.
            let a = 1.0 / (1.0 + (-(decay_in + 3.0)).exp());
            let (qh, kh_) = (&q[kh * dm.k_dim..(kh + 1) * dm.k_dim], &k[kh * dm.k_dim..(kh + 1) * dm.k_dim]);
            let vv = &v[vh * dm.v_dim..(vh + 1) * dm.v_dim];
            let sh = &mut s[vh * dm.k_dim * dm.v_dim..(vh + 1) * dm.k_dim * dm.v_dim];
            let oh = &mut o[vh * dm.v_dim..(vh + 1) * dm.v_dim];
            oh.fill(0.0);
            for i in 0..dm.k_dim {
                let srow = &mut sh[i * dm.v_dim..(i + 1) * dm.v_dim];
                for (j, sv) in srow.iter_mut().enumerate() {
                    *sv = kv_codec::round(dm.ssm_dtype, a * *sv + kh_[i] * k_scale * vv[j]);
                    oh[j] += qh[i] * *sv;
                }
            }
        }
        matvec(&w.w_out, &o, &mut proj);
        for (hi, pi) in row.iter_mut().zip(&proj) {
            *hi += pi;
        }
        model.mlp(layer, row);
    }
    for (i, x) in window.iter().enumerate() {
        kv_codec::encode(dm.conv_dtype, *x, &mut buf[i * ce..(i + 1) * ce]);
    }
    for (i, x) in s.iter().enumerate() {
        kv_codec::encode(dm.ssm_dtype, *x, &mut buf[conv_bytes + i * se..conv_bytes + (i + 1) * se]);
    }
    pool.write_state(lid, slot, buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ReferenceConfig;
    use crate::pool::local_effective_layout;
    use kvconnect_api::KvLayout;

    fn setup() -> (ReferenceModel, KvPool) {
        let cfg = ReferenceConfig::builtin_hybrid().unwrap();
        let spec = cfg.model_spec().unwrap();
        let eff = local_effective_layout(&spec, KvLayout::HND, true, 16, Dtype::Bf16);
        (ReferenceModel::new(&cfg, 5).unwrap(), KvPool::new(&spec, &eff, 4, None).unwrap())
    }

    /// Residuals of `n` tokens (their embeddings).
    fn rows(m: &ReferenceModel, n: usize) -> Vec<f32> {
        let d = m.hidden();
        let mut h = vec![0.0f32; n * d];
        for (i, row) in h.chunks_exact_mut(d).enumerate() {
            m.embed((i * 37 + 11) as u32 % 256, row);
        }
        h
    }

    #[test]
    fn the_hybrid_config_has_state_layers_with_the_configs_dims() {
        let cfg = ReferenceConfig::builtin_hybrid().unwrap();
        let spec = cfg.model_spec().unwrap();
        assert_eq!(spec.layers.iter().filter(|k| **k == kvconnect_api::AttentionKind::Linear).count(), 2);
        let dims = cfg.state_dims(&spec).unwrap().unwrap();
        assert_eq!(
            (dims.past, dims.conv_dim, dims.k_heads, dims.k_dim, dims.v_heads, dims.v_dim),
            (3, 32, 1, 8, 2, 8)
        );
        assert_eq!(spec.state.unwrap().bytes(), 3 * 32 * 2 + 2 * 8 * 8 * 2);
    }

    #[test]
    fn a_stored_state_continues_exactly_and_a_lost_one_does_not() {
        let (m, pool) = setup();
        let d = m.hidden();
        let n = 20;
        let mut buf = Vec::new();
        // All tokens at once.
        let mut whole = rows(&m, n);
        forward_state_layer(&m, &pool, 1, BlockId(0), 0, &mut whole, &mut buf).unwrap();
        // All but the last, then the last from the stored state (in another slot's history).
        let mut split = rows(&m, n);
        let (head, last) = split.split_at_mut((n - 1) * d);
        forward_state_layer(&m, &pool, 1, BlockId(1), 0, head, &mut buf).unwrap();
        forward_state_layer(&m, &pool, 1, BlockId(1), n - 1, last, &mut buf).unwrap();
        assert_eq!(whole, split, "a stored state continues bit for bit");
        // The same last token with the state lost (zeros, as a decode that never received it
        // would hold) gives another residual.
        pool.read_state(LayerId(1), BlockId(1), &mut buf).unwrap();
        buf.fill(0);
        pool.write_state(LayerId(1), BlockId(1), &buf).unwrap();
        let mut lost = rows(&m, n)[(n - 1) * d..].to_vec();
        forward_state_layer(&m, &pool, 1, BlockId(1), n - 1, &mut lost, &mut buf).unwrap();
        assert_ne!(&whole[(n - 1) * d..], &lost[..]);
        // A request starting at token 0 ignores whatever its slot held before.
        let mut again = rows(&m, n);
        forward_state_layer(&m, &pool, 1, BlockId(0), 0, &mut again, &mut buf).unwrap();
        assert_eq!(whole, again);
    }

    #[test]
    fn prefill_for_a_remote_decode_stops_one_token_short() {
        let mut params = serde_json::Map::new();
        params.insert("do_remote_decode".into(), true.into());
        let mut r = Request { id: "r".into(), prompt_tokens: vec![1, 2, 3], kv_transfer_params: params };
        let mut max = 8;
        prefill_backoff(&mut r, &mut max);
        assert_eq!((r.prompt_tokens, max), (vec![1, 2], 1));
        let mut one =
            Request { id: "o".into(), prompt_tokens: vec![1], kv_transfer_params: r.kv_transfer_params };
        prefill_backoff(&mut one, &mut max);
        assert_eq!(one.prompt_tokens, vec![1]);
        let mut local =
            Request { id: "l".into(), prompt_tokens: vec![1, 2], kv_transfer_params: Default::default() };
        prefill_backoff(&mut local, &mut max);
        assert_eq!(local.prompt_tokens, vec![1, 2]);
    }
}
