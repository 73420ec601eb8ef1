//! The summary every benchmark reports: quartiles of a series, such as the per-pair ratios of
//! interleaved baseline/subject runs.

use serde::Serialize;

/// The quartiles of a series (nearest rank).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Quartiles {
    /// 25th percentile.
    pub q1: f64,
    /// Median.
    pub median: f64,
    /// 75th percentile.
    pub q3: f64,
}

impl Quartiles {
    /// Nearest-rank quartiles; zeros for an empty series.
    pub fn of(v: Vec<f64>) -> Quartiles {
        let [q1, median, q3] = nearest_rank(v, [0.25, 0.50, 0.75]);
        Quartiles { q1, median, q3 }
    }
}

/// The nearest-rank quantiles `qs` of `v`; zeros for an empty series.
pub fn nearest_rank<const N: usize>(mut v: Vec<f64>, qs: [f64; N]) -> [f64; N] {
    if v.is_empty() {
        return [0.0; N];
    }
    v.sort_by(f64::total_cmp);
    qs.map(|q| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quartiles() {
        let q = Quartiles::of(vec![5.0, 1.0, 4.0, 2.0, 3.0]);
        assert_eq!(q, Quartiles { q1: 2.0, median: 3.0, q3: 4.0 });
        assert_eq!(Quartiles::of(vec![]), Quartiles::default());
        assert_eq!(Quartiles::of(vec![7.0]), Quartiles { q1: 7.0, median: 7.0, q3: 7.0 });
    }
}
