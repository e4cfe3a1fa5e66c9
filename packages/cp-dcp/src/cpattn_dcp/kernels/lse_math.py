"""Shared LSE math (base-2 internally): sanitise, global LSE of N sources.

Base-e inputs are scaled by ``log2(e)`` on load and the global LSE is scaled back by
``ln(2)`` on store, so every kernel uses ``exp2``/``log2`` only.
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
def _to_base2(b_lse, IS_BASE_E: tl.constexpr):
    """fp32 LSE in base 2, sanitised."""
    b_lse = b_lse.to(tl.float32)
    if IS_BASE_E:
        b_lse = b_lse * LOG2E
    return _sanitize(b_lse)


@triton.jit
def _global_lse2(b_lse2):
    """Global base-2 LSE over axis 0 of a sanitised ``[N_POW2, BLOCK_R]`` tile.

    The stabiliser of an all-empty row is 0, so such a row gets ``log2(0) = -inf``.
    """
    b_max = tl.max(b_lse2, axis=0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_sum = tl.sum(tl.exp2(b_lse2 - b_max[None, :]), axis=0)
    return tl.log2(b_sum) + b_max


@triton.jit
def _global_lse2_rows(b_ls, N: tl.constexpr):
    """``_global_lse2`` of a tuple of ``N`` sanitised base-2 LSE row vectors (element-wise:
    no reduction across threads)."""
    b_m = b_ls[0]
    for n in tl.static_range(1, N):
        b_m = tl.maximum(b_m, b_ls[n])
    b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_s = tl.exp2(b_ls[0] - b_m)
    for n in tl.static_range(1, N):
        b_s += tl.exp2(b_ls[n] - b_m)
    return tl.log2(b_s) + b_m


@triton.jit
def _weight(b_lse2, b_glse2):
    """``2^(l - L)`` with the NaN of ``-inf - (-inf)`` mapped to 0."""
    b_w = tl.exp2(b_lse2 - b_glse2)
    return tl.where(b_w == b_w, b_w, 0.0)


@triton.jit
def _from_base2(b_lse2, IS_BASE_E: tl.constexpr):
    if IS_BASE_E:
        return b_lse2 * LN2
    return b_lse2
