"""``correct_attn_out``: rescale this rank's partial output by its softmax weight.

For every (row b, head h), with the gathered LSEs ``l_n = lses[n, b, h]`` (n < N):
``L = log(sum_n b^(l_n - m)) + m`` (``m = max_n l_n``, 0 if all are -inf) and
``dst[b, h, :] = w == 0 ? 0 : w * src[b, h, :]`` with ``w = b^(l_r - L)``, ``r = cp_rank``.
NaN / +inf LSEs count as -inf; math in fp32 and base 2.

Layout: grid ``(cdiv(B, BLOCK_B), cdiv(H, BLOCK_H))``; a program handles a ``BLOCK_B x
BLOCK_H`` block of (b, h) rows times the full head dim (``HEAD_DIM`` in ``BLOCK_D`` chunks),
so a program moves kilobytes even for small ``D`` and no per-row integer division by a
runtime value is needed. The partial-output tile is loaded first, together with the LSEs (no
load depends on a computed value), so one memory latency covers the whole program. The head
dim is unit-stride; the row offsets carry ``tl.multiple_of`` hints with their true alignment
(``SRC_ALIGN`` / ``DST_ALIGN`` elements, computed on the host from the strides), which gives
16-byte vector accesses where they are valid and never where they are not (Triton 3.6's axis
analysis can over-state the divisibility of index expressions; the hints override it). ``src`` and ``dst`` may be the same tensor (in place). ``dst`` addresses the
head axis as ``(h // HEADS_PER_GROUP, h % HEADS_PER_GROUP)`` so the AG+RS path writes the
reduce-scatter's rank-major ``[N, B, H/N, D]`` layout directly. The LSE output stores heads
``[lse_h0, lse_h0 + lse_hn)`` only (this rank's slice for AG+RS).
"""

import triton
import triton.language as tl

from cpattn_dcp.kernels.lse_math import _from_base2, _global_lse2, _to_base2, _weight


@triton.jit
def _lse_src(lses_ptr, n, stride_n, o_l, m_r, cp_world_size, IS_BASE_E: tl.constexpr):
    """Sanitised base-2 LSE of source ``n`` for the rows ``o_l``; -inf where n >= N."""
    m_n = m_r & ((o_l * 0 + n) < cp_world_size)  # a tensor mask (n may be a Python int)
    b_l = tl.load(lses_ptr + (n * stride_n + o_l), mask=m_n, other=float("-inf"))
    return _to_base2(b_l, IS_BASE_E)


@triton.jit
def _correct_body(
    src_ptr,
    stride_src_b,
    stride_src_h,
    dst_ptr,
    stride_dst_b,
    stride_dst_g,
    stride_dst_h,
    lses_ptr,
    stride_lses_n,
    stride_lses_b,
    stride_lses_h,
    lse_out_ptr,
    num_tokens,
    num_heads,
    lse_h0,
    lse_hn,
    cp_rank,
    cp_world_size,
    HEAD_DIM: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    N_POW2: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SRC_ALIGN: tl.constexpr,
    DST_ALIGN: tl.constexpr,
    IS_BASE_E: tl.constexpr,
    HAS_LSE_OUT: tl.constexpr,
):
    """``dst[b, h // G, h % G, :] = w * src[b, h, :]`` (``G = HEADS_PER_GROUP``; ``G = 0``:
    ``dst[b, h, :]`` with strides ``(stride_dst_b, stride_dst_h)``); the head dim is
    unit-stride in both; ``lse_out`` contiguous ``[B, lse_hn]`` for heads from ``lse_h0``."""
    BLOCK_R: tl.constexpr = BLOCK_B * BLOCK_H
    i_rr = tl.arange(0, BLOCK_R)
    i_b = tl.program_id(0) * BLOCK_B + i_rr // BLOCK_H
    i_h = tl.program_id(1) * BLOCK_H + i_rr % BLOCK_H
    m_r = (i_b < num_tokens) & (i_h < num_heads)
    i_b = i_b.to(tl.int64)
    i_h = i_h.to(tl.int64)

    # Issue every load first: the first payload chunk, then all N LSEs.
    o_src = tl.max_contiguous(tl.multiple_of(i_b * stride_src_b + i_h * stride_src_h, SRC_ALIGN), 1)
    i_d0 = tl.arange(0, BLOCK_D)
    if HEAD_DIM % BLOCK_D == 0:
        m_x0 = tl.broadcast_to(m_r[:, None], (BLOCK_R, BLOCK_D))  # row mask only
    else:
        m_x0 = m_r[:, None] & (i_d0[None, :] < HEAD_DIM)
    b_x0 = tl.load(src_ptr + (o_src[:, None] + i_d0[None, :]), mask=m_x0, other=0.0)
    o_l = i_b * stride_lses_b + i_h * stride_lses_h
    if N_POW2 <= 8:
        # Unrolled, element-wise per row: no cross-thread reduction, no layout conversion.
        b_l0 = _lse_src(lses_ptr, 0, stride_lses_n, o_l, m_r, cp_world_size, IS_BASE_E)
        b_m = b_l0
        if N_POW2 > 1:
            b_l1 = _lse_src(lses_ptr, 1, stride_lses_n, o_l, m_r, cp_world_size, IS_BASE_E)
            b_m = tl.maximum(b_m, b_l1)
        if N_POW2 > 2:
            b_l2 = _lse_src(lses_ptr, 2, stride_lses_n, o_l, m_r, cp_world_size, IS_BASE_E)
            b_l3 = _lse_src(lses_ptr, 3, stride_lses_n, o_l, m_r, cp_world_size, IS_BASE_E)
            b_m = tl.maximum(b_m, tl.maximum(b_l2, b_l3))
        if N_POW2 > 4:
            b_l4 = _lse_src(lses_ptr, 4, stride_lses_n, o_l, m_r, cp_world_size, IS_BASE_E)
            b_l5 = _lse_src(lses_ptr, 5, stride_lses_n, o_l, m_r, cp_world_size, IS_BASE_E)
            b_l6 = _lse_src(lses_ptr, 6, stride_lses_n, o_l, m_r, cp_world_size, IS_BASE_E)
            b_l7 = _lse_src(lses_ptr, 7, stride_lses_n, o_l, m_r, cp_world_size, IS_BASE_E)
            b_m = tl.maximum(b_m, tl.maximum(tl.maximum(b_l4, b_l5), tl.maximum(b_l6, b_l7)))
        b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
        b_s = tl.exp2(b_l0 - b_m)
        b_own = b_l0
        if N_POW2 > 1:
            b_s += tl.exp2(b_l1 - b_m)
            b_own = tl.where(cp_rank == 1, b_l1, b_own)
        if N_POW2 > 2:
            b_s += tl.exp2(b_l2 - b_m) + tl.exp2(b_l3 - b_m)
            b_own = tl.where(cp_rank == 2, b_l2, b_own)
            b_own = tl.where(cp_rank == 3, b_l3, b_own)
        if N_POW2 > 4:
            b_s += (tl.exp2(b_l4 - b_m) + tl.exp2(b_l5 - b_m)) + (
                tl.exp2(b_l6 - b_m) + tl.exp2(b_l7 - b_m)
            )
            b_own = tl.where(cp_rank == 4, b_l4, b_own)
            b_own = tl.where(cp_rank == 5, b_l5, b_own)
            b_own = tl.where(cp_rank == 6, b_l6, b_own)
            b_own = tl.where(cp_rank == 7, b_l7, b_own)
        b_glse2 = tl.log2(b_s) + b_m
    else:
        i_n = tl.arange(0, N_POW2)
        m_l = (i_n[:, None] < cp_world_size) & m_r[None, :]
        b_lses = tl.load(
            lses_ptr + (i_n[:, None].to(tl.int64) * stride_lses_n + o_l[None, :]),
            mask=m_l,
            other=float("-inf"),
        )
        b_glse2 = _global_lse2(_to_base2(b_lses, IS_BASE_E))
        b_own = _to_base2(
            tl.load(lses_ptr + (cp_rank * stride_lses_n + o_l), mask=m_r, other=float("-inf")),
            IS_BASE_E,
        )
    b_w = _weight(b_own, b_glse2)[:, None]
    if HAS_LSE_OUT:
        i_hl = i_h - lse_h0
        m_lo = m_r & (i_hl >= 0) & (i_hl < lse_hn)
        tl.store(
            lse_out_ptr + (i_b * lse_hn + i_hl),
            _from_base2(b_glse2, IS_BASE_E).to(lse_out_ptr.dtype.element_ty),
            mask=m_lo,
        )

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
            m_x = m_x0 if HEAD_DIM % BLOCK_D == 0 else m_r[:, None] & (i_d[None, :] < HEAD_DIM)
            b_x = tl.load(src_ptr + (o_src[:, None] + i_d[None, :]), mask=m_x, other=0.0)
        b_y = tl.where(b_w == 0.0, 0.0, b_x.to(tl.float32) * b_w)
        tl.store(
            dst_ptr + (o_dst[:, None] + i_d[None, :]),
            b_y.to(dst_ptr.dtype.element_ty),
            mask=m_x,
        )


@triton.jit
def _correct_attn_out_fwd_kernel(
    src_ptr,
    stride_src_b,
    stride_src_h,
    dst_ptr,
    stride_dst_b,
    stride_dst_g,
    stride_dst_h,
    lses_ptr,
    stride_lses_n,
    stride_lses_b,
    stride_lses_h,
    lse_out_ptr,
    num_tokens,
    num_heads,
    lse_h0,
    lse_hn,
    cp_rank,
    cp_world_size,
    HEAD_DIM: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    N_POW2: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SRC_ALIGN: tl.constexpr,
    DST_ALIGN: tl.constexpr,
    IS_BASE_E: tl.constexpr,
    HAS_LSE_OUT: tl.constexpr,
):
    """General form (any row strides, grouped destination): the AG+RS / AG+AR paths."""
    _correct_body(
        src_ptr, stride_src_b, stride_src_h,
        dst_ptr, stride_dst_b, stride_dst_g, stride_dst_h,
        lses_ptr, stride_lses_n, stride_lses_b, stride_lses_h,
        lse_out_ptr, num_tokens, num_heads, lse_h0, lse_hn, cp_rank, cp_world_size,
        HEAD_DIM, HEADS_PER_GROUP, N_POW2, BLOCK_B, BLOCK_H, BLOCK_D,
        SRC_ALIGN, DST_ALIGN, IS_BASE_E, HAS_LSE_OUT,
    )  # fmt: skip


@triton.jit
def _correct_attn_out_contig_kernel(
    out_ptr,
    lses_ptr,
    lse_out_ptr,
    num_tokens,
    cp_rank,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    N: tl.constexpr,
    N_POW2: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
    IS_BASE_E: tl.constexpr,
):
    """Lean form for ``correct_attn_out``: contiguous ``out [B, H, D]`` scaled in place,
    contiguous ``lses [N, B, H]``, ``lse_out [B, H]``; few arguments = little launch work."""
    _correct_body(
        out_ptr, NUM_HEADS * HEAD_DIM, HEAD_DIM,
        out_ptr, NUM_HEADS * HEAD_DIM, 0, HEAD_DIM,
        lses_ptr, num_tokens * NUM_HEADS, NUM_HEADS, 1,
        lse_out_ptr, num_tokens, NUM_HEADS, 0, NUM_HEADS, cp_rank, N,
        HEAD_DIM, 0, N_POW2, BLOCK_B, BLOCK_H, BLOCK_D,
        ALIGN, ALIGN, IS_BASE_E, True,
    )  # fmt: skip
