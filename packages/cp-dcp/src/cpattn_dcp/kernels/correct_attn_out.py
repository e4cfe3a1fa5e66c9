"""``correct_attn_out``: rescale this rank's partial output by its softmax weight.

For every (row b, head h), with the gathered LSEs ``l_n = lses[n, b, h]`` (n < N):
``L = log(sum_n b^(l_n - m)) + m`` (``m = max_n l_n``, 0 if all are -inf) and
``dst[b, h, :] = w == 0 ? 0 : w * src[b, h, :]`` with ``w = b^(l_r - L)``, ``r = cp_rank``.
NaN / +inf LSEs count as -inf; math in fp32 and base 2.

Layout: one program handles ``BLOCK_R`` consecutive (b, h) pairs of the flattened ``[B*H]``
row space times the full head dim (``HEAD_DIM`` in ``BLOCK_D`` chunks), so a program moves
kilobytes even for small ``D``; the inner dim is unit-stride in practice, giving 16-byte
vector accesses. ``src`` and ``dst`` may be the same tensor (in place). ``dst`` addresses the
head axis as ``(h // HEADS_PER_GROUP, h % HEADS_PER_GROUP)`` so the AG+RS path writes the
reduce-scatter's rank-major ``[N, B, H/N, D]`` layout directly. The LSE output stores heads
``[lse_h0, lse_h0 + lse_hn)`` only (this rank's slice for AG+RS).
"""

import triton
import triton.language as tl

from cpattn_dcp.kernels.lse_math import _from_base2, _global_lse2, _to_base2, _weight


@triton.jit
def _correct_attn_out_fwd_kernel(
    src_ptr,
    stride_src_b,
    stride_src_h,
    stride_src_d,
    dst_ptr,
    stride_dst_b,
    stride_dst_g,
    stride_dst_h,
    stride_dst_d,
    lses_ptr,
    stride_lses_n,
    stride_lses_b,
    stride_lses_h,
    lse_out_ptr,
    stride_lse_out_b,
    stride_lse_out_h,
    num_rows,
    num_heads,
    heads_per_group,
    lse_h0,
    lse_hn,
    cp_rank,
    cp_world_size,
    HEAD_DIM: tl.constexpr,
    N_POW2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_BASE_E: tl.constexpr,
    HAS_LSE_OUT: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m_r = i_r < num_rows
    i_b = i_r // num_heads
    i_h = i_r - i_b * num_heads

    # All N LSEs of the BLOCK_R rows: [N_POW2, BLOCK_R] (padding sources are -inf).
    i_n = tl.arange(0, N_POW2)
    o_l = i_b * stride_lses_b + i_h * stride_lses_h
    m_l = (i_n[:, None] < cp_world_size) & m_r[None, :]
    b_lses = tl.load(
        lses_ptr + i_n[:, None].to(tl.int64) * stride_lses_n + o_l[None, :],
        mask=m_l,
        other=float("-inf"),
    )
    b_lses2 = _to_base2(b_lses, IS_BASE_E)
    b_glse2 = _global_lse2(b_lses2)
    b_own2 = _to_base2(
        tl.load(lses_ptr + cp_rank * stride_lses_n + o_l, mask=m_r, other=float("-inf")),
        IS_BASE_E,
    )
    b_w = _weight(b_own2, b_glse2)

    if HAS_LSE_OUT:
        i_hl = i_h - lse_h0
        m_lo = m_r & (i_hl >= 0) & (i_hl < lse_hn)
        tl.store(
            lse_out_ptr + i_b * stride_lse_out_b + i_hl * stride_lse_out_h,
            _from_base2(b_glse2, IS_BASE_E).to(lse_out_ptr.dtype.element_ty),
            mask=m_lo,
        )

    i_g = i_h // heads_per_group
    i_j = i_h - i_g * heads_per_group
    o_src = i_b * stride_src_b + i_h * stride_src_h
    o_dst = i_b * stride_dst_b + i_g * stride_dst_g + i_j * stride_dst_h
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        i_d = d0 + tl.arange(0, BLOCK_D)
        if HEAD_DIM % BLOCK_D == 0:
            m_x = tl.broadcast_to(m_r[:, None], (BLOCK_R, BLOCK_D))  # row mask only
        else:
            m_x = m_r[:, None] & (i_d[None, :] < HEAD_DIM)
        b_x = tl.load(
            src_ptr + o_src[:, None] + i_d[None, :] * stride_src_d, mask=m_x, other=0.0
        ).to(tl.float32)
        b_y = tl.where(b_w[:, None] == 0.0, 0.0, b_x * b_w[:, None])
        tl.store(
            dst_ptr + o_dst[:, None] + i_d[None, :] * stride_dst_d,
            b_y.to(dst_ptr.dtype.element_ty),
            mask=m_x,
        )
