"""Shared LSE math: sanitise, stabiliser and sum of N sources, weights, global LSE
(docs/design.md, "Numerics"; reference ``cpattn_testing.reference.lse_combine_ref``).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _sanitize(b_lse):
    """NaN and +inf count as -inf (no contribution)."""
    return tl.where((b_lse != b_lse) | (b_lse == float("inf")), float("-inf"), b_lse)


@triton.jit
def _lse_f32(b_lse):
    """fp32 LSE in its own base, sanitised."""
    return _sanitize(b_lse.to(tl.float32))


@triton.jit
def _exp_shift(b_l, b_m, IS_BASE_E: tl.constexpr):
    """``b^(l - m)``: the difference in the LSE's base, then ``exp2`` (0 for ``l = -inf``)."""
    b_x = b_l - b_m
    if IS_BASE_E:
        b_x = b_x * LOG2E
    return tl.exp2(b_x)


@triton.jit
def _lse_from(b_m, b_s, IS_BASE_E: tl.constexpr):
    """Global LSE ``m + log_b(s)`` in the LSE's base (-inf for an all-empty row: s = 0)."""
    b_g = tl.log2(b_s)
    if IS_BASE_E:
        b_g = b_g * LN2
    return b_m + b_g


@triton.jit
def _max_sum(b_l, IS_BASE_E: tl.constexpr):
    """``(m, s)`` over axis 0 of a sanitised ``[N_POW2, BLOCK_R]`` LSE tile: ``m`` the largest
    LSE (0 for an all-empty row), ``s = sum_n b^(l_n - m)`` (>= 1 unless the row is empty)."""
    b_m = tl.max(b_l, axis=0)
    b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
    return b_m, tl.sum(_exp_shift(b_l, b_m[None, :], IS_BASE_E), axis=0)


@triton.jit
def _max_sum_rows(b_ls, N: tl.constexpr, IS_BASE_E: tl.constexpr):
    """``_max_sum`` of a tuple of ``N`` sanitised LSE row vectors (element-wise: no reduction
    across threads)."""
    b_m = b_ls[0]
    for n in tl.static_range(1, N):
        b_m = tl.maximum(b_m, b_ls[n])
    b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_s = _exp_shift(b_ls[0], b_m, IS_BASE_E)
    for n in tl.static_range(1, N):
        b_s += _exp_shift(b_ls[n], b_m, IS_BASE_E)
    return b_m, b_s


@triton.jit
def _weight(b_l, b_m, b_inv_s, IS_BASE_E: tl.constexpr):
    """``b^(l - m) / s`` with ``b_inv_s = 1 / max(s, 1)``: exactly 0 for ``l = -inf``, also
    in an all-empty row (``s = 0``)."""
    return _exp_shift(b_l, b_m, IS_BASE_E) * b_inv_s
