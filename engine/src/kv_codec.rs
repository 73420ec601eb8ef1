//! Encoding of KV elements in the cache dtype. The engine computes in f32 and rounds when it
//! writes the cache, so every reader (the engine itself, a peer that received the blocks)
//! sees the same rounded values.

use kvconnect_api::Dtype;

/// f32 to bfloat16 bits, round to nearest even (what torch does); NaN stays NaN.
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let rounding = ((bits >> 16) & 1) + 0x7FFF;
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// bfloat16 bits to f32 (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// True for the cache dtypes the reference engine can store.
pub fn supported(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::Bf16)
}

/// Writes `x` as `dtype` into `out` (little-endian, `dtype.size()` bytes).
#[inline]
pub fn encode(dtype: Dtype, x: f32, out: &mut [u8]) {
    match dtype {
        Dtype::Bf16 => out[..2].copy_from_slice(&f32_to_bf16(x).to_le_bytes()),
        // Only F32 and Bf16 reach here: the engine refuses other dtypes at construction.
        _ => out[..4].copy_from_slice(&x.to_le_bytes()),
    }
}

/// Reads one `dtype` element from `b`.
#[inline]
pub fn decode(dtype: Dtype, b: &[u8]) -> f32 {
    match dtype {
        Dtype::Bf16 => bf16_to_f32(u16::from_le_bytes([b[0], b[1]])),
        _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// `x` rounded through `dtype` (what a reader of the cache will see).
pub fn round(dtype: Dtype, x: f32) -> f32 {
    match dtype {
        Dtype::Bf16 => bf16_to_f32(f32_to_bf16(x)),
        _ => x,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is exactly halfway between 1.0 and the next bf16 (1 + 2^-7): ties to even.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3F80);
        // Just above halfway rounds up.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0 + 1.0 / 65536.0), 0x3F81);
        assert_eq!(bf16_to_f32(0xC000), -2.0);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn encode_decode_round_trip() {
        let mut buf = [0u8; 4];
        for d in [Dtype::F32, Dtype::Bf16] {
            encode(d, 0.3, &mut buf);
            assert_eq!(decode(d, &buf), round(d, 0.3));
        }
        assert_ne!(round(Dtype::Bf16, 0.3), 0.3);
    }
}
