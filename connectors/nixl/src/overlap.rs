//! The proof that a pull's destination runs never share a byte, which lets several threads
//! (or sockets) write them at once. A load across tensor-parallel sizes is tens of thousands
//! of runs (a head slice of each block, layer and part), and it is checked on every pull
//! before the copy starts, on one thread: so it is one pass where it can be, and a sort only
//! where it must be.

use crate::error::TransferError;

/// Refuses destination spans `(region, offset, len)` of which two share a byte, or one that
/// leaves its region (its callers check that first, with the same message); `region(i)` is
/// region `i`'s start address and length.
///
/// - Spans in different regions share no byte unless the regions do: the regions' own
///   address ranges are compared first.
/// - Within a region, when every offset and length is a multiple of a granule (a power of
///   two: a block part, a head slice), each span marks its granules in a bitmap of the
///   region, and a granule marked twice is an overlap.
/// - Otherwise (regions that share bytes, or granules so fine that the bitmap would be far
///   larger than the spans), the spans' addresses are sorted and neighbours compared.
pub fn refuse_overlap(
    spans: impl Iterator<Item = (u32, u64, u64)> + Clone,
    region: impl Fn(usize) -> Option<(usize, usize)>,
) -> Result<(), TransferError> {
    // Empty spans write nothing; the rest are walked twice, never copied.
    let spans = spans.filter(|s| s.2 > 0).map(|(r, o, l)| (r as usize, o, l));
    let (mut regions, mut count, mut bits_of) = (0, 0u64, 0u64);
    for (r, o, l) in spans.clone() {
        let len = region(r).map_or(0, |(_, len)| len as u64);
        if o.checked_add(l).is_none_or(|end| end > len) {
            return Err(TransferError::Plan(format!(
                "{l} bytes at {o} do not fit local region {r} of {len} bytes"
            )));
        }
        regions = regions.max(r + 1);
        count += 1;
        bits_of |= o | l;
    }
    if count == 0 {
        return Ok(());
    }
    // Every index below `regions` names a region (one of them was found above).
    let places: Vec<(usize, usize)> = (0..regions).map(|i| region(i).unwrap_or((0, 0))).collect();
    let mut used = vec![false; regions];
    for (r, _, _) in spans.clone() {
        used[r] = true;
    }
    let granule = 1u64 << bits_of.trailing_zeros().min(62);
    // Bit offsets of each used region's bitmap within one allocation.
    let mut start = vec![0u64; regions];
    let mut bits = 0u64;
    for i in (0..regions).filter(|&i| used[i]) {
        start[i] = bits;
        bits += places[i].1 as u64 / granule;
    }
    let small_enough = bits <= 64 * count + (1 << 20);
    if !small_enough || regions_share_bytes(&places, &used) {
        return by_sorting(spans, &places);
    }
    let mut map = vec![0u64; bits.div_ceil(64) as usize];
    for (r, o, l) in spans {
        let first = start[r] + o / granule;
        for b in first..first + l / granule {
            let (word, bit) = ((b / 64) as usize, 1u64 << (b % 64));
            if map[word] & bit != 0 {
                return Err(overlap());
            }
            map[word] |= bit;
        }
    }
    Ok(())
}

fn overlap() -> TransferError {
    TransferError::Plan("two runs of the plan write the same destination bytes".into())
}

/// Whether two used regions share a byte (registered regions are separate allocations, but
/// nothing forbids one registered twice, or inside another).
fn regions_share_bytes(places: &[(usize, usize)], used: &[bool]) -> bool {
    let mut r: Vec<(usize, usize)> =
        places.iter().zip(used).filter(|(p, u)| **u && p.1 > 0).map(|(&(b, l), _)| (b, b + l)).collect();
    r.sort_unstable();
    r.windows(2).any(|w| w[1].0 < w[0].1)
}

/// The general check: absolute address ranges, sorted, neighbours compared.
fn by_sorting(
    spans: impl Iterator<Item = (usize, u64, u64)>,
    places: &[(usize, usize)],
) -> Result<(), TransferError> {
    let mut abs: Vec<(usize, usize)> = spans
        .map(|(r, o, l)| {
            let a = places[r].0 + o as usize;
            (a, a + l as usize)
        })
        .collect();
    abs.sort_unstable();
    if abs.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(overlap());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two regions of 1 MiB, far apart.
    fn apart(i: usize) -> Option<(usize, usize)> {
        [(0x10_0000, 1 << 20), (0x90_0000, 1 << 20)].get(i).copied()
    }

    fn both_ways(spans: &[(u32, u64, u64)], region: impl Fn(usize) -> Option<(usize, usize)> + Copy) -> bool {
        let fast = refuse_overlap(spans.iter().copied(), region).is_ok();
        let places: Vec<_> = (0..4).map(|i| region(i).unwrap_or((0, 0))).collect();
        let wide = spans.iter().filter(|s| s.2 > 0).map(|&(r, o, l)| (r as usize, o, l));
        let sorted = by_sorting(wide, &places).is_ok();
        assert_eq!(fast, sorted, "{spans:?}");
        fast
    }

    #[test]
    fn aligned_spans_pass_and_any_shared_granule_is_refused() {
        // Head slices of 16 KiB, two ranks interleaved through the blocks of two regions.
        let mut spans = Vec::new();
        for r in 0..2u32 {
            for b in 0..32u64 {
                spans.push((r, b * 32768, 16384));
                spans.push((r, b * 32768 + 16384, 16384));
            }
        }
        assert!(both_ways(&spans, apart));
        // One more span over any byte already written.
        for extra in [(0, 0, 16384), (1, 32768 * 31 + 16384, 16384), (0, 16384, 32768)] {
            let mut s = spans.clone();
            s.insert(17, extra);
            assert!(!both_ways(&s, apart), "{extra:?}");
            let e = refuse_overlap(s.iter().copied(), apart).unwrap_err().to_string();
            assert!(e.contains("write the same destination bytes"), "{e}");
        }
        // The same offsets in the other region: no overlap.
        let mut s = spans.clone();
        s.retain(|x| x.0 == 0);
        s.extend(spans.iter().filter(|x| x.0 == 0).map(|&(_, o, l)| (1, o, l)));
        assert!(both_ways(&s, apart));
    }

    #[test]
    fn unaligned_and_touching_spans_are_judged_by_their_bytes() {
        // Neighbours that touch (end == start) are fine; one byte over is not.
        assert!(both_ways(&[(0, 0, 100), (0, 100, 28), (0, 128, 1)], apart));
        assert!(!both_ways(&[(0, 0, 101), (0, 100, 28)], apart));
        assert!(!both_ways(&[(0, 5, 1), (0, 0, 7)], apart));
        // Empty spans write nothing, wherever they are.
        assert!(both_ways(&[(0, 0, 64), (0, 32, 0)], apart));
        assert!(refuse_overlap([].into_iter(), apart).is_ok());
    }

    #[test]
    fn random_spans_are_judged_as_sorting_judges_them() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let (mut refused, mut passed) = (0, 0);
        for _ in 0..3000 {
            // A granule from 1 byte to 64 KiB, a few spans of a few granules in two regions.
            let g = 1u64 << rnd(17);
            let spans: Vec<(u32, u64, u64)> = (0..1 + rnd(12))
                .map(|_| {
                    let len = g * rnd(4);
                    let room = (1u64 << 20) - len;
                    (rnd(2) as u32, (rnd(room / g + 1) * g).min(room), len)
                })
                .collect();
            if both_ways(&spans, apart) {
                passed += 1;
            } else {
                refused += 1;
            }
        }
        assert!(refused > 100 && passed > 100, "both answers are exercised: {refused} / {passed}");
    }

    #[test]
    fn a_span_past_its_region_is_refused_not_marked() {
        let e = refuse_overlap([(0, 0, 4096), (1, (1 << 20) - 4096, 8192)].into_iter(), apart).unwrap_err();
        assert!(e.to_string().contains("do not fit local region 1"), "{e}");
        let e = refuse_overlap([(3, 0, 4096)].into_iter(), apart).unwrap_err();
        assert!(e.to_string().contains("do not fit local region 3 of 0 bytes"), "{e}");
        // A region index far past the regions is refused before anything is sized by it.
        let e = refuse_overlap([(u32::MAX, 0, 1)].into_iter(), apart).unwrap_err();
        assert!(e.to_string().contains("local region 4294967295 of 0 bytes"), "{e}");
    }

    #[test]
    fn regions_that_share_bytes_are_checked_by_address() {
        // Region 1 starts half-way into region 0: offset 0 of region 1 is byte 4096 of region 0.
        let aliased = |i: usize| [(0x10_0000, 8192), (0x10_1000, 8192)].get(i).copied();
        assert!(!both_ways(&[(0, 4096, 4096), (1, 0, 4096)], aliased));
        assert!(both_ways(&[(0, 0, 4096), (1, 0, 4096)], aliased));
    }

    #[test]
    fn fine_granules_over_large_regions_fall_back_to_sorting() {
        // Byte-aligned spans in a 1 TiB region: a bitmap would be 2^40 bits.
        let huge = |i: usize| (i == 0).then_some((0x1000_0000, 1usize << 40));
        assert!(refuse_overlap([(0, 1, 1), (0, (1 << 40) - 1, 1)].into_iter(), huge).is_ok());
        assert!(refuse_overlap([(0, 1, 3), (0, 3, 1)].into_iter(), huge).is_err());
    }
}
