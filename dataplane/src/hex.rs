//! Lowercase hex: metadata bytes inside JSON, nonces, proofs and random names.

/// `b` as lowercase hex, two digits a byte.
pub fn to_hex(b: &[u8]) -> String {
    const H: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(H[(x >> 4) as usize] as char);
        s.push(H[(x & 15) as usize] as char);
    }
    s
}

/// Inverse of [`to_hex`]; `None` on anything else.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    let s = s.as_bytes();
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let d = |c: u8| (c as char).to_digit(16).map(|v| v as u8);
    s.chunks(2).map(|p| Some(d(p[0])? << 4 | d(p[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let b: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&b)).unwrap(), b);
        assert!(from_hex("abc").is_none());
        assert!(from_hex("zz").is_none());
    }
}
