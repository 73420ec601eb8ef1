//! Integer helpers the crates share, so each is written once.

use std::ops::{Div, Rem};

/// The unsigned integer types [`gcd`] and [`lcm`] take.
pub trait Unsigned: Copy + PartialEq + Rem<Output = Self> + Div<Output = Self> {
    /// Zero.
    const ZERO: Self;
    /// `self * other`, or `None` past the type's range.
    fn checked_mul(self, other: Self) -> Option<Self>;
}

macro_rules! unsigned {
    ($($t:ty),*) => {$(
        impl Unsigned for $t {
            const ZERO: $t = 0;
            fn checked_mul(self, other: $t) -> Option<$t> {
                <$t>::checked_mul(self, other)
            }
        }
    )*};
}

unsigned!(u8, u16, u32, u64, u128, usize);

/// The greatest common divisor (Euclid's algorithm); `gcd(a, 0) == a`, `gcd(0, 0) == 0`.
pub fn gcd<T: Unsigned>(mut a: T, mut b: T) -> T {
    while b != T::ZERO {
        (a, b) = (b, a % b);
    }
    a
}

/// The least common multiple of two positive numbers, or `None` when it does not fit the type
/// (or either is zero).
pub fn lcm<T: Unsigned>(a: T, b: T) -> Option<T> {
    if a == T::ZERO || b == T::ZERO {
        return None;
    }
    (a / gcd(a, b)).checked_mul(b)
}

/// `(a, b)` reduced when one divides the other; `None` otherwise.
pub fn divisible_ratio(a: u32, b: u32) -> Option<(u32, u32)> {
    if a == 0 || b == 0 || (!a.is_multiple_of(b) && !b.is_multiple_of(a)) {
        return None;
    }
    let g = gcd(a, b);
    Some((a / g, b / g))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_values() {
        assert_eq!(gcd(12u32, 18), 6);
        assert_eq!(gcd(18u64, 12), 6);
        assert_eq!(gcd(7usize, 0), 7);
        assert_eq!(gcd(0u32, 5), 5);
        assert_eq!(gcd(0u32, 0), 0);
        assert_eq!(gcd(17u32, 5), 1);
        assert_eq!(lcm(4u32, 6), Some(12));
        assert_eq!(lcm(16u32, 16), Some(16));
        assert_eq!(lcm(0u32, 6), None);
        assert_eq!(lcm(u32::MAX, u32::MAX - 1), None);
    }

    proptest! {
        #[test]
        fn divides_both_and_is_the_largest(a in 1u64..100_000, b in 1u64..100_000) {
            let g = gcd(a, b);
            prop_assert_eq!(a % g, 0);
            prop_assert_eq!(b % g, 0);
            prop_assert_eq!(gcd(a / g, b / g), 1);
        }
    }
}
