"""Empty-shard row test and the LSE mask / masked-copy kernel (docs/design.md, "Empty shards:
where they are masked"). ``_row_is_empty`` is shared with the A2A pack kernel, so the fused mask
is bit-identical to ``mask_dcp_empty_shards_``.
"""

import triton
import triton.language as tl

COUNT_MAX_STEPS = tl.constexpr(8)


@triton.jit
def _row_is_empty(i_row, seq_lens_ptr, qsl_ptr, num_seqs, SEARCH_STEPS: tl.constexpr):
    """Boolean vector: which rows ``i_row`` (int32 or int64) are empty (see module docstring)."""
    b_total = tl.load(qsl_ptr + num_seqs).to(tl.int64)
    if SEARCH_STEPS <= COUNT_MAX_STEPS:
        # One round of independent loads: the boundaries query_start_loc[1..R] and all R
        # lengths (2^SEARCH_STEPS >= R + 1 lanes); the row's request is picked by a one-hot
        # reduction instead of a dependent load.
        i_s = tl.arange(0, 1 << SEARCH_STEPS)
        m_s = i_s < num_seqs
        # Lanes past R count as +inf boundaries; set after widening (an `other` of 2^31 - 1
        # would wrap in a narrow index dtype such as int16).
        b_bound = tl.load(qsl_ptr + 1 + i_s, mask=m_s, other=0).to(tl.int64)
        if i_row.dtype == tl.int32:
            # int32 rows (the host checked that every row index fits): the tile compares in
            # int32, half the instructions of int64. Clamping a boundary to the int32 range
            # leaves its comparison with every such row unchanged.
            b_bound = tl.minimum(tl.maximum(b_bound, -2147483648), 2147483647).to(tl.int32)
            b_bound = tl.where(m_s, b_bound, 2147483647)
        else:
            b_bound = tl.where(m_s, b_bound, 9223372036854775807)
        b_zero = tl.load(seq_lens_ptr + i_s, mask=m_s, other=1) == 0
        b_pos = tl.sum((b_bound[None, :] <= i_row[:, None]).to(tl.int32), axis=1)
        b_seq = tl.minimum(b_pos, num_seqs - 1)
        m_hit = (i_s[None, :] == b_seq[:, None]) & b_zero[None, :]
        m_len0 = (tl.sum(m_hit.to(tl.int32), axis=1) > 0) | (b_seq < 0)
    else:
        # 16-ary search: each round loads the 16 candidates b_pos + k * 16^r (k = 1..16;
        # independent loads) and advances by the number of them <= i_row (a prefix, the
        # boundaries being sorted). Candidates past R are masked, which in the first round
        # also drops those past 2^SEARCH_STEPS > R. Comparisons run in the wider of the row
        # and boundary dtypes (int32 rows and boundaries: int32 throughout).
        b_pos = tl.zeros_like(i_row)
        i_k = tl.arange(0, 16) + 1
        for i_round in tl.static_range((SEARCH_STEPS + 3) // 4):
            shift = 4 * ((SEARCH_STEPS + 3) // 4 - 1 - i_round)
            b_cand = b_pos[:, None] + (i_k[None, :] << shift)
            m_cand = b_cand <= num_seqs
            b_bound = tl.load(qsl_ptr + b_cand, mask=m_cand, other=0)
            b_count = tl.sum((m_cand & (b_bound <= i_row[:, None])).to(tl.int32), axis=1)
            b_pos = b_pos + (b_count << shift)
        b_seq = tl.minimum(b_pos, num_seqs - 1)
        b_len = tl.load(seq_lens_ptr + b_seq, mask=b_seq >= 0, other=0)
        m_len0 = b_len == 0
    return (i_row >= b_total) | m_len0


@triton.jit
def _mask_empty_shards_kernel(
    src_ptr, stride_src_b, stride_src_h, dst_ptr, stride_dst_b, stride_dst_h, seq_lens_ptr,
    qsl_ptr, num_seqs, num_rows, num_heads,
    HAS_MASK: tl.constexpr, IS_COPY: tl.constexpr, SEARCH_STEPS: tl.constexpr, ROW32: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """``dst[b, h] = -inf if row b is empty else src[b, h]`` for ``[B, H]`` LSEs.

    ``IS_COPY=False`` is the in-place mask (``dst is src``; only empty rows are stored).
    ``IS_COPY=True`` writes every element of ``dst`` (``HAS_MASK=False``: a plain copy).
    ``ROW32``: row indices (masked lanes included) fit int32 (host checked): the empty-row
    test runs in int32; element offsets are int64 either way.
    """
    if ROW32:
        i_row = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    else:
        i_row = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    i_b = i_row.to(tl.int64)
    m_b = i_b < num_rows
    if HAS_MASK:
        m_empty = _row_is_empty(i_row, seq_lens_ptr, qsl_ptr, num_seqs, SEARCH_STEPS) & m_b
    else:
        m_empty = i_b < 0
    for h0 in range(0, num_heads, BLOCK_H):
        i_h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
        m_h = i_h < num_heads
        o_dst = i_b[:, None] * stride_dst_b + i_h[None, :] * stride_dst_h
        if IS_COPY:
            o_src = i_b[:, None] * stride_src_b + i_h[None, :] * stride_src_h
            m_all = m_b[:, None] & m_h[None, :]
            # Selected in fp32 (exact for every LSE dtype): Triton's CPU interpreter up to 3.8
            # cannot build a bf16 scalar, so a bf16 select with -inf failed there.
            b_lse = tl.load(src_ptr + o_src, mask=m_all, other=0.0).to(tl.float32)
            b_lse = tl.where(m_empty[:, None], float("-inf"), b_lse)
            tl.store(dst_ptr + o_dst, b_lse.to(dst_ptr.dtype.element_ty), mask=m_all)
        else:
            b_neg = tl.full((BLOCK_B, BLOCK_H), float("-inf"), tl.float32)
            tl.store(
                dst_ptr + o_dst,
                b_neg.to(dst_ptr.dtype.element_ty),
                mask=m_empty[:, None] & m_h[None, :],
            )


@triton.jit
def _mask_empty_shards_inplace_kernel(
    lse_ptr, stride_b, stride_h, seq_lens_ptr, qsl_ptr, num_seqs, num_rows, num_heads,
    SEARCH_STEPS: tl.constexpr, ROW32: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Lean in-place form of ``_mask_empty_shards_kernel`` (fewer launch arguments)."""
    _mask_empty_shards_kernel(
        lse_ptr, stride_b, stride_h, lse_ptr, stride_b, stride_h, seq_lens_ptr, qsl_ptr,
        num_seqs, num_rows, num_heads, True, False, SEARCH_STEPS, ROW32, BLOCK_B, BLOCK_H,
    )  # fmt: skip
