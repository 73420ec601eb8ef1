//! Integer helpers the crates share, so each is written once.

use std::ops::Rem;

/// The unsigned integer types [`gcd`] takes.
pub trait Unsigned: Copy + PartialEq + Rem<Output = Self> {
    /// Zero.
    const ZERO: Self;
}

macro_rules! unsigned {
    ($($t:ty),*) => {$(
        impl Unsigned for $t {
            const ZERO: $t = 0;
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
