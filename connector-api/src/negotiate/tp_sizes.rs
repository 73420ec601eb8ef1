//! Which tensor-parallel sizes can exchange KV, and the remedy when two cannot.

use crate::math::divisible_ratio;

/// Why two workers with TP sizes `a` and `b` (each named by its role) cannot exchange KV,
/// with the remedy, or `None` when they can: equal sizes, or sizes where one divides the
/// other with a transport on both sides that declares `heterogeneous_tp`.
pub(crate) fn tp_refusal(a: (&str, u32), b: (&str, u32), heterogeneous: bool) -> Option<String> {
    let ((ar, at), (br, bt)) = (a, b);
    if tp_exchangeable(at, bt, heterogeneous) {
        return None;
    }
    if !heterogeneous {
        return Some(format!(
            "the KV transport moves KV only between equal tensor-parallel sizes (it does not declare \
                heterogeneous_tp), and {at} != {bt}: run {br} with tp_size={at} like {ar}, or {ar} with \
                tp_size={bt}"
        ));
    }
    Some(format!("TP sizes {at} and {bt} do not divide each other: use TP sizes where one divides the other"))
}

/// Whether KV can move between TP sizes `a` and `b`.
pub(crate) fn tp_exchangeable(a: u32, b: u32, heterogeneous: bool) -> bool {
    a == b || (heterogeneous && divisible_ratio(a, b).is_some())
}
