"""``correct_attn_out``: rescale this rank's partial output by its softmax weight.

``dst[b, h, :] = w * src[b, h, :]`` with ``w = b^(l_r - L)`` over the gathered LSEs
(docs/design.md, "Numerics"). Lean kernel: ``BLOCK_R`` consecutive contiguous rows per program.
General kernel (any strides): ``BLOCK_B x BLOCK_H`` row blocks; ``dst`` addresses heads as
``(h // HEADS_PER_GROUP, h % HEADS_PER_GROUP)`` so AG+RS writes the rank-major ``[N, B, H/N, D]``
layout directly. ``src`` and ``dst`` may be the same tensor.
"""

from typing import Any  # noqa: F401  (used by type comments in the kernels)

import triton
import triton.language as tl

from cpattn_dcp.kernels.lse_math import _exp_shift, _lse_f32, _lse_from, _max_sum_rows, _weight
from cpattn_dcp.kernels.tiles import _chunk_mask


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _lse_weight(lses_ptr, stride_n, o_l, m_r, cp_rank, cp_world_size, N_POW2: tl.constexpr,
                IS_BASE_E: tl.constexpr):  # fmt: skip
    """Load the ``[N_POW2, rows]`` LSE tile at ``lses_ptr + n * stride_n + o_l`` (padding
    sources -inf) and return ``(w, L)``: this rank's weight ``b^(l_r - m) / max(s, 1)`` and the
    global LSE of each row, in the tile's compact layout (an all-empty row: ``s = 0``, ``w = 0``,
    ``L = -inf``). The sum and this rank's term share one two-operand reduction."""
    i_n = tl.arange(0, N_POW2)
    m_l = (i_n[:, None] < cp_world_size) & m_r[None, :]
    b_l = tl.load(
        lses_ptr + (i_n[:, None].to(tl.int64) * stride_n + o_l[None, :]),
        mask=m_l,
        other=float("-inf"),
    )
    b_l = _lse_f32(b_l)
    b_m = tl.max(b_l, axis=0)
    b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_e = _exp_shift(b_l, b_m[None, :], IS_BASE_E)
    # One two-operand reduction: the sum and this rank's term (one shared-memory pass).
    b_s, b_own = tl.reduce((b_e, tl.where(i_n[:, None] == cp_rank, b_e, 0.0)), 0, _add2)
    b_w = b_own / tl.maximum(b_s, 1.0)
    return b_w, _lse_from(b_m, b_s, IS_BASE_E)


@triton.jit
def _lse_weight_rows(lses_ptr, stride_n, o_l, m_r, cp_rank, N: tl.constexpr,
                     IS_BASE_E: tl.constexpr):  # fmt: skip
    """``_lse_weight`` for exactly ``N`` sources, one row-vector load per source and
    element-wise math (``lse_math._max_sum_rows``: no reduction across threads, no shared
    memory); this rank's LSE is selected once and weighted like any source."""
    # ``stride_n`` (= B*H) is an i32 launch argument and ``n`` a constexpr: their product must
    # be formed in int64, as it passes 2**31 once (N-1)*B*H does (one widening per program).
    stride_n = tl.cast(stride_n, tl.int64)
    b_ls = ()  # type: tuple[Any, ...]
    for n in tl.static_range(N):
        b_l = tl.load(lses_ptr + (n * stride_n + o_l), mask=m_r, other=float("-inf"))
        b_ls = b_ls + (_lse_f32(b_l),)  # noqa: RUF005
    b_m, b_s = _max_sum_rows(b_ls, N, IS_BASE_E)
    b_own = b_ls[0]
    for n in tl.static_range(1, N):
        b_own = tl.where(cp_rank == n, b_ls[n], b_own)
    b_w = _weight(b_own, b_m, 1.0 / tl.maximum(b_s, 1.0), IS_BASE_E)
    return b_w, _lse_from(b_m, b_s, IS_BASE_E)


@triton.jit
def _correct_attn_out_fwd_kernel(
    src_ptr, stride_src_b, stride_src_h, dst_ptr, stride_dst_b, stride_dst_g, stride_dst_h,
    lses_ptr, stride_lses_n, stride_lses_b, stride_lses_h, lse_out_ptr, num_tokens, num_heads,
    lse_h0, lse_hn, cp_rank, cp_world_size,
    HEAD_DIM: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, N_POW2: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SRC_ALIGN: tl.constexpr,
    DST_ALIGN: tl.constexpr, IS_BASE_E: tl.constexpr, HAS_LSE_OUT: tl.constexpr,
):  # fmt: skip
    """General form (any row strides, grouped destination: the AG+RS / AG+AR paths):
    ``dst[b, h // G, h % G, :] = w * src[b, h, :]`` (``G = HEADS_PER_GROUP``; ``G = 0``:
    ``dst[b, h, :]`` with strides ``(stride_dst_b, stride_dst_h)``); the head dim is
    unit-stride in both; ``lse_out`` contiguous ``[B, lse_hn]`` for heads from ``lse_h0``."""
    BLOCK_R: tl.constexpr = BLOCK_B * BLOCK_H
    i_rr = tl.arange(0, BLOCK_R)
    i_b = tl.program_id(0) * BLOCK_B + i_rr // BLOCK_H
    i_h = tl.program_id(1) * BLOCK_H + i_rr % BLOCK_H
    m_r = (i_b < num_tokens) & (i_h < num_heads)
    i_b = i_b.to(tl.int64)
    i_h = i_h.to(tl.int64)

    # Issue every load first: the first payload chunk, then all N LSEs (one 2-D load).
    o_src = tl.max_contiguous(tl.multiple_of(i_b * stride_src_b + i_h * stride_src_h, SRC_ALIGN), 1)
    i_d0 = tl.arange(0, BLOCK_D)
    m_x0 = _chunk_mask(m_r, i_d0, HEAD_DIM, BLOCK_R, BLOCK_D)
    b_x0 = tl.load(src_ptr + (o_src[:, None] + i_d0[None, :]), mask=m_x0, other=0.0)
    o_l = i_b * stride_lses_b + i_h * stride_lses_h
    b_w, b_glse = _lse_weight(
        lses_ptr, stride_lses_n, o_l, m_r, cp_rank, cp_world_size, N_POW2, IS_BASE_E
    )
    b_w = b_w[:, None]

    if HEADS_PER_GROUP == 0:
        o_dst = i_b * stride_dst_b + i_h * stride_dst_h
    else:
        i_g = i_h // HEADS_PER_GROUP
        o_dst = (
            i_b * stride_dst_b + i_g * stride_dst_g + (i_h - i_g * HEADS_PER_GROUP) * stride_dst_h
        )
    o_dst = tl.max_contiguous(tl.multiple_of(o_dst, DST_ALIGN), 1)
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        i_d = d0 + i_d0
        if d0 == 0:
            m_x = m_x0
            b_x = b_x0
        else:
            m_x = _chunk_mask(m_r, i_d, HEAD_DIM, BLOCK_R, BLOCK_D)
            b_x = tl.load(src_ptr + (o_src[:, None] + i_d[None, :]), mask=m_x, other=0.0)
        b_y = tl.where(b_w == 0.0, 0.0, b_x.to(tl.float32) * b_w)
        tl.store(
            dst_ptr + (o_dst[:, None] + i_d[None, :]),
            b_y.to(dst_ptr.dtype.element_ty),
            mask=m_x,
        )
    if HAS_LSE_OUT:
        i_hl = i_h - lse_h0
        m_lo = m_r & (i_hl >= 0) & (i_hl < lse_hn)
        tl.store(
            lse_out_ptr + (i_b * lse_hn + i_hl),
            b_glse.to(lse_out_ptr.dtype.element_ty),
            mask=m_lo,
        )


@triton.jit
def _correct_attn_out_contig_kernel(
    out_ptr, lses_ptr, lse_out_ptr, num_rows, cp_rank,
    HEAD_DIM: tl.constexpr, N: tl.constexpr, N_POW2: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, ALIGN: tl.constexpr, IS_BASE_E: tl.constexpr, LSE_ROWS: tl.constexpr,
):  # fmt: skip
    """Lean form for ``correct_attn_out``: contiguous ``out [B, H, D]`` scaled in place,
    contiguous ``lses [N, B, H]``, ``lse_out [B, H]``; ``num_rows = B * H``.

    A program takes ``BLOCK_R`` consecutive flattened (b, h) rows (row offset ``row * D``, the
    LSEs of source n at ``lses[n * B * H + row]``); every load is issued before any math or
    store. ``LSE_ROWS`` (N <= 8): the LSEs as N row vectors, the math once per row in a compact
    layout, the weight moved to the payload rows with ``tl.gather`` (in the payload layout
    every thread holding a row would repeat it). Otherwise one ``[N_POW2, BLOCK_R]`` tile
    reduced across threads (``_lse_weight``).
    """
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    i_r = r0 + tl.arange(0, BLOCK_R)
    m_r = i_r < num_rows
    o_x = tl.max_contiguous(tl.multiple_of(i_r * HEAD_DIM, ALIGN), 1)
    i_d0 = tl.arange(0, BLOCK_D)
    m_x0 = _chunk_mask(m_r, i_d0, HEAD_DIM, BLOCK_R, BLOCK_D)
    b_x0 = tl.load(out_ptr + (o_x[:, None] + i_d0[None, :]), mask=m_x0, other=0.0)
    if LSE_ROWS:
        i_l = r0 + tl.arange(0, BLOCK_R)  # same rows, the compact layout's own index
        m_l = i_l < num_rows
        b_wl, b_glse = _lse_weight_rows(lses_ptr, num_rows, i_l, m_l, cp_rank, N, IS_BASE_E)
        b_w = tl.gather(b_wl, (i_r - r0).to(tl.int32), 0)
    else:
        i_l = i_r
        m_l = m_r
        b_w, b_glse = _lse_weight(lses_ptr, num_rows, i_r, m_r, cp_rank, N, N_POW2, IS_BASE_E)
    b_w = b_w[:, None]
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        i_d = d0 + i_d0
        if d0 == 0:
            m_x = m_x0
            b_x = b_x0
        else:
            m_x = _chunk_mask(m_r, i_d, HEAD_DIM, BLOCK_R, BLOCK_D)
            b_x = tl.load(out_ptr + (o_x[:, None] + i_d[None, :]), mask=m_x, other=0.0)
        b_y = tl.where(b_w == 0.0, 0.0, b_x.to(tl.float32) * b_w)
        tl.store(
            out_ptr + (o_x[:, None] + i_d[None, :]), b_y.to(out_ptr.dtype.element_ty), mask=m_x
        )
    tl.store(
        lse_out_ptr + i_l,
        b_glse.to(lse_out_ptr.dtype.element_ty),
        mask=m_l,
    )
