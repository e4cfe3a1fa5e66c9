"""N-way merge of partial attention states (LSE-weighted combine), Triton kernel.

For one (row b, head h) and sources n = 0..N-1 with partial outputs ``o_n [D]`` and LSEs
``l_n`` (base e, or base 2 when ``IS_BASE_E`` is false, written ``b^x`` below):

    l_n  <- -inf where l_n is NaN or +inf          (empty / undefined shards)
    m     = max_n l_n, or 0 when every l_n is -inf  (stabiliser)
    L     = log_b(sum_n b^(l_n - m)) + m            (-inf when every l_n is -inf)
    w_n   = b^(l_n - m) / sum_k b^(l_k - m)  (= b^(l_n - L)), exactly 0 where l_n is -inf
    O     = sum_n w_n * o_n, where a source with w_n == 0 contributes exactly 0
            (its partial is not even loaded, so NaN / garbage in empty shards never leaks)

Layout: ``partial_out [N, B, H, D]`` and ``partial_lse [N, B, H]`` with arbitrary strides,
``out [B, H, D]`` and ``out_lse [B, H]`` (fp32) with arbitrary strides. Math in fp32.

Tiling: program (pid_b, pid_h) handles row ``pid_b`` and heads
``[pid_h * BLOCK_H, (pid_h + 1) * BLOCK_H)`` with ``BLOCK_D >= D`` (power of two, masked),
so each partial element is read exactly once: the LSE passes (tiny) come first, then one
weighted accumulation pass over the N partials. ``N`` and ``D`` are constexpr: the source loop
is unrolled (all loads can be in flight together) and the D mask folds away when
``D == BLOCK_D``. Offsets are int64; per-source pointers advance by addition so ``n * stride``
never overflows 32 bits.

Local-name prefixes: ``o_`` offsets, ``m_`` masks, ``p_`` pointers, ``b_`` block values.
Written for this project (no adapted code).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sanitize_lse(b_l):
    """NaN and +inf LSE count as -inf (no contribution)."""
    return tl.where((b_l != b_l) | (b_l == float("inf")), float("-inf"), b_l)


@triton.jit
def _pow_b(x, IS_BASE_E: tl.constexpr):
    """``e^x`` or ``2^x``."""
    y = tl.exp(x) if IS_BASE_E else tl.exp2(x)
    return y


@triton.jit
def _log_b(x, IS_BASE_E: tl.constexpr):
    """``ln x`` or ``log2 x``."""
    y = tl.log(x) if IS_BASE_E else tl.log2(x)
    return y


@triton.jit
def _merge_attn_states_fwd_kernel(
    out_ptr,
    out_lse_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    H,
    stride_po_n,
    stride_po_b,
    stride_po_h,
    stride_po_d,
    stride_pl_n,
    stride_pl_b,
    stride_pl_h,
    stride_o_b,
    stride_o_h,
    stride_o_d,
    stride_ol_b,
    stride_ol_h,
    N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_BASE_E: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)

    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D).to(tl.int64)
    m_h = o_h < H
    m_d = o_d < D

    # ---- LSE passes: stabiliser m, then the global LSE L. LSEs are tiny (re-reads hit cache).
    p_l0 = partial_lse_ptr + i_b * stride_pl_b + o_h * stride_pl_h
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    p_l = p_l0
    for _ in tl.static_range(N):
        b_l = _sanitize_lse(tl.load(p_l, mask=m_h, other=float("-inf")).to(tl.float32))
        b_m = tl.maximum(b_m, b_l)
        p_l += stride_pl_n
    b_m = tl.where(b_m == float("-inf"), 0.0, b_m)

    b_s = tl.zeros([BLOCK_H], dtype=tl.float32)
    p_l = p_l0
    for _ in tl.static_range(N):
        b_l = _sanitize_lse(tl.load(p_l, mask=m_h, other=float("-inf")).to(tl.float32))
        b_s += _pow_b(b_l - b_m, IS_BASE_E)
        p_l += stride_pl_n
    b_lse = _log_b(b_s, IS_BASE_E) + b_m
    b_inv_s = 1.0 / b_s  # inf for an all-empty row, whose weights are all forced to 0

    # ---- One weighted pass over the partials; a zero weight skips the load entirely.
    b_acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    p_o = (
        partial_out_ptr
        + i_b * stride_po_b
        + o_h[:, None] * stride_po_h
        + o_d[None, :] * stride_po_d
    )
    m_hd = m_h[:, None] & m_d[None, :]
    p_l = p_l0
    for _ in tl.static_range(N):
        b_l = _sanitize_lse(tl.load(p_l, mask=m_h, other=float("-inf")).to(tl.float32))
        # b^(l - m) / S: l - m is exact for close values, so large LSEs (1e4) lose nothing.
        b_w = _pow_b(b_l - b_m, IS_BASE_E) * b_inv_s
        b_w = tl.where(b_l == float("-inf"), 0.0, b_w)
        b_o = tl.load(p_o, mask=m_hd & (b_w != 0.0)[:, None], other=0.0).to(tl.float32)
        b_acc += b_w[:, None] * b_o
        p_l += stride_pl_n
        p_o += stride_po_n

    p_out = out_ptr + i_b * stride_o_b + o_h[:, None] * stride_o_h + o_d[None, :] * stride_o_d
    tl.store(p_out, b_acc.to(out_ptr.dtype.element_ty), mask=m_hd)
    tl.store(out_lse_ptr + i_b * stride_ol_b + o_h * stride_ol_h, b_lse, mask=m_h)
