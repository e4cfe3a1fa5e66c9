"""N-way LSE-weighted merge of partial attention states, Triton kernel (docs/design.md, "Numerics").

``partial_out [N, B, H, D]`` / ``partial_lse [N, B, H]`` (any strides) merge into contiguous
``out [B, H, D]`` and fp32 ``out_lse [B, H]``; program (pid_b, pid_h) takes one row and
``BLOCK_H`` heads. ``EAGER`` issues every load first (decode grids); otherwise a partial is
loaded only where its weight is nonzero. Local prefixes: ``o_`` offsets, ``m_`` masks, ``p_``
pointers, ``b_`` block values.
"""

from __future__ import annotations

from typing import Any  # noqa: F401  (used by type comments in the kernel)

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


_INT_PARAMS = [
    "H",
    "stride_po_n",
    "stride_po_b",
    "stride_po_h",
    "stride_po_d",
    "stride_pl_n",
    "stride_pl_b",
    "stride_pl_h",
]


@triton.jit(do_not_specialize=_INT_PARAMS)
def _merge_attn_states_fwd_kernel(
    out_ptr, out_lse_ptr, partial_out_ptr, partial_lse_ptr, H: tl.int32, stride_po_n: tl.int64,
    stride_po_b: tl.int64, stride_po_h: tl.int64, stride_po_d: tl.int64, stride_pl_n: tl.int64,
    stride_pl_b: tl.int64, stride_pl_h: tl.int64,
    N: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    VEC: tl.constexpr, D_CONTIG: tl.constexpr, EAGER: tl.constexpr, IS_BASE_E: tl.constexpr,
):  # fmt: skip
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)

    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D).to(tl.int64)
    m_h = o_h < H
    m_d = o_d < D
    m_hd = m_h[:, None] & m_d[None, :]

    # Partial pointers. The n / b / h strides arrive in units of VEC elements, so the compiler
    # knows every row start is VEC-aligned (16-byte vectors) without specializing on values.
    o_pd = o_d if D_CONTIG else o_d * stride_po_d
    p_o0 = (
        partial_out_ptr
        + i_b * (stride_po_b * VEC)
        + (o_h * (stride_po_h * VEC))[:, None]
        + o_pd[None, :]
    )

    p_l0 = partial_lse_ptr + i_b * stride_pl_b + o_h * stride_pl_h
    b_acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if EAGER:
        # Every load first (one DRAM round trip); a zero weight's term is selected away.
        b_os = ()  # type: tuple[Any, ...]
        p_o = p_o0
        for _ in tl.static_range(N):
            b_os = b_os + (tl.load(p_o, mask=m_hd, other=0.0),)  # noqa: RUF005
            p_o += stride_po_n * VEC
        b_ls = ()  # type: tuple[Any, ...]
        p_l = p_l0
        for _ in tl.static_range(N):
            b_l = tl.load(p_l, mask=m_h, other=float("-inf"))
            b_ls = b_ls + (_sanitize_lse(b_l.to(tl.float32)),)  # noqa: RUF005
            p_l += stride_pl_n
        b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        for i in tl.static_range(N):
            b_m = tl.maximum(b_m, b_ls[i])
        b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
        b_s = tl.zeros([BLOCK_H], dtype=tl.float32)
        for i in tl.static_range(N):
            b_s += _pow_b(b_ls[i] - b_m, IS_BASE_E)
        b_lse = _log_b(b_s, IS_BASE_E) + b_m
        b_inv_s = 1.0 / b_s  # inf for an all-empty row, whose weights are all forced to 0
        for i in tl.static_range(N):
            b_w = _pow_b(b_ls[i] - b_m, IS_BASE_E) * b_inv_s
            b_w = tl.where(b_ls[i] == float("-inf"), 0.0, b_w)
            b_c = b_w[:, None] * b_os[i].to(tl.float32)
            b_acc += tl.where(b_w[:, None] == 0.0, 0.0, b_c)
    else:
        # LSE passes (re-reads hit cache), then a weighted pass skipping zero-weight loads.
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
        b_inv_s = 1.0 / b_s
        p_o = p_o0
        p_l = p_l0
        for _ in tl.static_range(N):
            b_l = _sanitize_lse(tl.load(p_l, mask=m_h, other=float("-inf")).to(tl.float32))
            # b^(l - m) / S: l - m is exact for close values, so large LSEs (1e4) lose nothing.
            b_w = _pow_b(b_l - b_m, IS_BASE_E) * b_inv_s
            b_w = tl.where(b_l == float("-inf"), 0.0, b_w)
            b_o = tl.load(p_o, mask=m_hd & (b_w != 0.0)[:, None], other=0.0).to(tl.float32)
            b_acc += b_w[:, None] * b_o
            p_l += stride_pl_n
            p_o += stride_po_n * VEC

    # Outputs are contiguous [B, H, D] / [B, H] (allocated by the launcher).
    o_row = i_b * H + o_h
    p_out = out_ptr + (o_row * D)[:, None] + o_d[None, :]
    tl.store(p_out, b_acc.to(out_ptr.dtype.element_ty), mask=m_hd)
    tl.store(out_lse_ptr + o_row, b_lse, mask=m_h)
