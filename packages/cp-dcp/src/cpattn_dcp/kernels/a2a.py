"""Packed all-to-all combine: pack kernels (sender) and unpack-and-combine kernel (receiver).

Record format of the send/receive buffers ``[N, B, H_r, D + P]`` (output dtype): for
destination n, row b, local head j, lanes ``[0, D)`` are a bit copy of
``out[b, n*H_r + j, :]``; the LSE ``lse[b, n*H_r + j]`` converted to fp32 (and set to -inf for
empty rows when the mask is fused) sits in lane D (``P = 1``, fp32 output) or is split into
its low 16 bits (lane D) and high 16 bits (lane D + 1), each bit-cast to the 16-bit output
dtype (``P = 2``). The LSE lanes are never numbers in the 16-bit case. Seen as 32-bit words
(D even for 16-bit dtypes) a record is ``D_w = D*s/4`` payload words followed by ONE word that
holds the fp32 LSE bits, little endian.

Alignment. A record is ``(D + P)*s`` bytes, so records are only 4-byte aligned (260 bytes for
bf16, D = 128): a per-record tile cannot use 16-byte vectors. Every index expression whose
alignment matters carries an explicit ``tl.multiple_of`` hint with the value that is true by
construction: Triton 3.6's axis analysis over-states the divisibility of a remainder pattern
``x - (x // m) * m`` (m a runtime int specialised as a multiple of 16) on a contiguous range,
which made it emit 16-byte ``st.global.v4`` for 4-byte-aligned records ("misaligned address"
on the GPU at H=64, D=128, N=2 with 64-row tiles). The hints override that analysis.

Pack (``_a2a_pack_flat_kernel``, the fast path): the (n, b) block of the send buffer,
``H_r`` records = ``H_r * (D + P)`` lanes, is one contiguous range; each program writes a
``[BLOCK_B, BLOCK_W]`` tile of (rows b) x (lanes of that range) with 16-byte vector stores
(whenever ``H_r * (D + P) * s % 16 == 0``: every benchmark shape) and gathers the payload
from the partial output in 4-byte pairs (16-bit dtypes; coalesced within a warp, L1 absorbs
them). The lane -> (head, lane in record) map depends on the column only and is computed once
per column.
``_a2a_pack_fwd_kernel`` is the generic per-record fallback (odd D for 16-bit dtypes,
odd strides or pointers that are not 4-byte aligned).

Unpack-combine: one program per ``BLOCK_R`` consecutive output (b, j) rows (no index
division at all: recv rows and output rows are both the flattened (b, j)). For N <= 8 the N
payload tiles and the N LSE words are loaded together (no load depends on a computed value),
then the weights (element-wise per row), the fp32 weighted sum (zero-weight sources
contribute exactly 0) and one 16-byte-vector store of the output rows. Payload loads are
4-byte (the record alignment); L1 merges them, the output stores are 16-byte vectors.
"""

import triton
import triton.language as tl

from cpattn_dcp.kernels.empty_shards import _row_is_empty
from cpattn_dcp.kernels.lse_math import _from_base2, _global_lse2, _to_base2, _weight


@triton.jit
def _a2a_pack_flat_kernel(
    out_ptr,
    stride_out_b,
    stride_out_h,
    lse_ptr,
    stride_lse_b,
    stride_lse_h,
    send_ptr,
    seq_lens_ptr,
    qsl_ptr,
    num_seqs,
    num_tokens,
    HEADS_PER_RANK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PACK: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    LSE_HALVES: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Grid ``(cdiv(B, BLOCK_B), N, cdiv(H_r * (D + P), BLOCK_W))``.

    ``out_ptr`` ``[B, H, D]`` (head dim unit-stride; for 16-bit dtypes D and the row strides
    even and the pointer 4-byte aligned), ``send_ptr`` the contiguous ``[N, B, H_r, D + P]``
    buffer. ``ROW_ALIGN``: largest power of two (<= 16 bytes / element) dividing
    ``H_r * (D + P)``. ``LSE_HALVES``: 16-bit output and fp32 LSE (any strides, 4-byte
    aligned): the LSE is copied as its two 16-bit halves (no conversion).
    """
    REC: tl.constexpr = HEAD_DIM + PACK
    ROW: tl.constexpr = HEADS_PER_RANK * REC
    i_n = tl.program_id(1)
    i_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    i_c = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    m_b = i_b < num_tokens
    m_c = i_c < ROW
    # Column -> (local head j, lane l of the record); lanes >= D hold the LSE.
    i_j = i_c // REC
    i_l = i_c - i_j * REC
    # PACK == 2 (16-bit, D even): lanes come in aligned pairs that are either both payload
    # (adjacent, 4-byte aligned in the source) or both LSE. These hints are true by
    # construction; they keep the pair loads 4 bytes wide and the columns the fastest axis.
    m_lse = tl.max_constancy(i_l >= HEAD_DIM, PACK)
    i_h = (i_n * HEADS_PER_RANK + i_j).to(tl.int64)
    o_xc = tl.max_contiguous(tl.multiple_of(i_h * stride_out_h + i_l, PACK), PACK)
    # Row offsets: even for PACK == 2 (host-checked strides); hint overrides the analysis.
    o_xb = tl.max_contiguous(tl.multiple_of(i_b.to(tl.int64) * stride_out_b, PACK), 1)
    m_bc = m_b[:, None] & m_c[None, :]
    b_x = tl.load(out_ptr + (o_xb[:, None] + o_xc[None, :]), mask=m_bc & (~m_lse)[None, :])
    if LSE_HALVES:
        # fp32 LSE read as its two 16-bit halves (little endian: low half first), straight
        # into lanes D and D + 1: aligned 4-byte pairs, like the payload.
        lse_halves = lse_ptr.to(tl.pointer_type(send_ptr.dtype.element_ty), bitcast=True)
        o_lc = 2 * (i_h * stride_lse_h) + (i_l - HEAD_DIM)
        o_lc = tl.max_contiguous(tl.multiple_of(o_lc, 2), 2)
        o_lb = tl.max_contiguous(tl.multiple_of(i_b.to(tl.int64) * (2 * stride_lse_b), 2), 1)
        o_l = o_lb[:, None] + o_lc[None, :]
        b_v = tl.load(lse_halves + o_l, mask=m_bc & m_lse[None, :])
        if HAS_MASK:
            m_empty = _row_is_empty(i_b.to(tl.int64), seq_lens_ptr, qsl_ptr, num_seqs, SEARCH_STEPS)
            # -inf = 0xFF800000: low half 0x0000, high half 0xFF80.
            b_neg = tl.where(i_l == HEAD_DIM, 0, 0xFF80).to(tl.uint16)
            b_neg = b_neg.to(send_ptr.dtype.element_ty, bitcast=True)
            b_v = tl.where(m_empty[:, None], b_neg[None, :], b_v)
    else:
        o_lc = tl.multiple_of(i_h * stride_lse_h, 1)
        o_l = i_b.to(tl.int64)[:, None] * stride_lse_b + o_lc[None, :]
        b_l = tl.load(lse_ptr + o_l, mask=m_bc & m_lse[None, :], other=0.0).to(tl.float32)
        if HAS_MASK:
            m_empty = _row_is_empty(i_b.to(tl.int64), seq_lens_ptr, qsl_ptr, num_seqs, SEARCH_STEPS)
            b_l = tl.where(m_empty[:, None], float("-inf"), b_l)
        if PACK == 2:
            # fp32 bits: low half in lane D, high half in lane D + 1.
            b_bits = b_l.to(tl.uint32, bitcast=True)
            b_half = tl.where((i_l == HEAD_DIM)[None, :], b_bits & 0xFFFF, b_bits >> 16)
            b_v = b_half.to(tl.uint16).to(send_ptr.dtype.element_ty, bitcast=True)
        else:
            b_v = b_l.to(send_ptr.dtype.element_ty)
    b_y = tl.where(m_lse[None, :], b_v, b_x)
    # Start of each (n, b) block: a multiple of ROW_ALIGN by construction.
    o_y = (i_n.to(tl.int64) * num_tokens + i_b) * ROW
    o_y = tl.max_contiguous(tl.multiple_of(o_y, ROW_ALIGN), 1)
    tl.store(send_ptr + (o_y[:, None] + i_c[None, :]), b_y, mask=m_bc)


@triton.jit
def _a2a_pack_fwd_kernel(  # generic fallback
    out_ptr,
    stride_out_b,
    stride_out_h,
    stride_out_d,
    lse_ptr,
    stride_lse_b,
    stride_lse_h,
    send_ptr,
    seq_lens_ptr,
    qsl_ptr,
    num_seqs,
    num_rows,
    num_tokens,
    num_heads,
    heads_per_rank,
    HEAD_DIM: tl.constexpr,
    PACK: tl.constexpr,
    REC_ALIGN: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    REC: tl.constexpr = HEAD_DIM + PACK
    i_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m_r = i_r < num_rows
    i_b = i_r // num_heads
    i_h = i_r - i_b * num_heads
    i_n = i_h // heads_per_rank
    i_j = i_h - i_n * heads_per_rank
    o_rec = ((i_n * num_tokens + i_b) * heads_per_rank + i_j) * REC
    # True alignment only (REC_ALIGN = largest power of two dividing REC): see module doc.
    o_rec = tl.max_contiguous(tl.multiple_of(o_rec, REC_ALIGN), 1)
    o_src = i_b * stride_out_b + i_h * stride_out_h

    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        i_d = d0 + tl.arange(0, BLOCK_D)
        if HEAD_DIM % BLOCK_D == 0:
            m_x = tl.broadcast_to(m_r[:, None], (BLOCK_R, BLOCK_D))  # row mask only
        else:
            m_x = m_r[:, None] & (i_d[None, :] < HEAD_DIM)
        b_x = tl.load(out_ptr + o_src[:, None] + i_d[None, :] * stride_out_d, mask=m_x)
        tl.store(send_ptr + o_rec[:, None] + i_d[None, :], b_x, mask=m_x)

    b_lse = tl.load(lse_ptr + i_b * stride_lse_b + i_h * stride_lse_h, mask=m_r, other=0.0)
    b_lse = b_lse.to(tl.float32)
    if HAS_MASK:
        m_empty = _row_is_empty(i_b, seq_lens_ptr, qsl_ptr, num_seqs, SEARCH_STEPS)
        b_lse = tl.where(m_empty, float("-inf"), b_lse)
    if PACK == 2:
        b_bits = b_lse.to(tl.uint32, bitcast=True)
        b_lo = (b_bits & 0xFFFF).to(tl.uint16)
        b_hi = (b_bits >> 16).to(tl.uint16)
        i_p = tl.arange(0, 2)
        b_half = tl.where(i_p[None, :] == 0, b_lo[:, None], b_hi[:, None])
        tl.store(
            send_ptr + o_rec[:, None] + HEAD_DIM + i_p[None, :],
            b_half.to(send_ptr.dtype.element_ty, bitcast=True),
            mask=m_r[:, None],
        )
    else:
        tl.store(send_ptr + o_rec + HEAD_DIM, b_lse, mask=m_r)


@triton.jit
def _rec_lse2(
    recv_ptr,
    i_rec,
    m_r,
    HEAD_DIM: tl.constexpr,
    PACK: tl.constexpr,
    LSE_WORD: tl.constexpr,
    IS_BASE_E: tl.constexpr,
):
    """Sanitised base-2 LSE of records ``i_rec`` (int64 [BLOCK_R]); masked rows -> -inf."""
    REC: tl.constexpr = HEAD_DIM + PACK
    if LSE_WORD:
        # One aligned 32-bit word: word index rec * REC/2 + D/2.
        words = recv_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        b_bits = tl.load(words + (i_rec * (REC // 2) + HEAD_DIM // 2), mask=m_r, other=0)
        b_lse = b_bits.to(tl.float32, bitcast=True)
    elif PACK == 2:
        b_lo = tl.load(recv_ptr + (i_rec * REC + HEAD_DIM), mask=m_r, other=0.0)
        b_hi = tl.load(recv_ptr + (i_rec * REC + HEAD_DIM + 1), mask=m_r, other=0.0)
        b_lo = b_lo.to(tl.uint16, bitcast=True).to(tl.uint32)
        b_hi = b_hi.to(tl.uint16, bitcast=True).to(tl.uint32)
        b_lse = (b_lo | (b_hi << 16)).to(tl.float32, bitcast=True)
    else:
        b_lse = tl.load(recv_ptr + (i_rec * REC + HEAD_DIM), mask=m_r, other=0.0).to(tl.float32)
    return _to_base2(tl.where(m_r, b_lse, float("-inf")), IS_BASE_E)


@triton.jit
def _rec_payload(recv_ptr, i_rec, i_d, m_x, REC: tl.constexpr, REC_ALIGN: tl.constexpr):
    """``[BLOCK_R, BLOCK_D]`` payload lanes ``i_d`` of records ``i_rec``."""
    # Only REC_ALIGN-element alignment is true (see the module docstring).
    o_rec = tl.max_contiguous(tl.multiple_of(i_rec * REC, REC_ALIGN), 1)
    return tl.load(recv_ptr + (o_rec[:, None] + i_d[None, :]), mask=m_x, other=0.0)


@triton.jit
def _wsum(b_acc, b_x, b_w):
    """``acc + (w == 0 ? 0 : w * x)`` in fp32 (``b_w`` [BLOCK_R])."""
    return b_acc + tl.where(b_w[:, None] == 0.0, 0.0, b_x.to(tl.float32) * b_w[:, None])


@triton.jit
def _a2a_unpack_combine_fwd_kernel(
    recv_ptr,
    dst_ptr,
    lse_out_ptr,
    num_rows,
    N: tl.constexpr,
    N_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PACK: tl.constexpr,
    REC_ALIGN: tl.constexpr,
    LSE_WORD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_BASE_E: tl.constexpr,
    HAS_LSE_OUT: tl.constexpr,
):
    """Grid ``(cdiv(B * H_r, BLOCK_R),)``; ``recv`` contiguous ``[N, B, H_r, D + P]``.

    ``REC_ALIGN``: largest power of two (<= 16 bytes / element size) dividing ``D + P``.
    ``LSE_WORD``: the fp32 LSE of every record is one 4-byte-aligned word (16-bit dtype, D
    even, ``recv`` 4-byte aligned): one 32-bit load instead of two 16-bit loads.
    N <= 8: fully unrolled and element-wise per row (no cross-thread reductions); the N
    payload tiles of the first head-dim chunk and the N LSE words are loaded before any math.
    N > 8: one ``[N_POW2, BLOCK_R]`` LSE pass, then the N payloads one after another.
    """
    REC: tl.constexpr = HEAD_DIM + PACK
    i_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m_r = i_r < num_rows
    i_rows = tl.program_id(0).to(tl.int64) * 0 + num_rows  # int64 copy of num_rows
    if N <= 8:
        for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
            i_d = d0 + tl.arange(0, BLOCK_D)
            if HEAD_DIM % BLOCK_D == 0:
                m_x = tl.broadcast_to(m_r[:, None], (BLOCK_R, BLOCK_D))  # row mask only
            else:
                m_x = m_r[:, None] & (i_d[None, :] < HEAD_DIM)
            b_x0 = _rec_payload(recv_ptr, i_r, i_d, m_x, REC, REC_ALIGN)
            if N > 1:
                b_x1 = _rec_payload(recv_ptr, i_r + i_rows, i_d, m_x, REC, REC_ALIGN)
            if N > 2:
                b_x2 = _rec_payload(recv_ptr, i_r + 2 * i_rows, i_d, m_x, REC, REC_ALIGN)
            if N > 3:
                b_x3 = _rec_payload(recv_ptr, i_r + 3 * i_rows, i_d, m_x, REC, REC_ALIGN)
            if N > 4:
                b_x4 = _rec_payload(recv_ptr, i_r + 4 * i_rows, i_d, m_x, REC, REC_ALIGN)
            if N > 5:
                b_x5 = _rec_payload(recv_ptr, i_r + 5 * i_rows, i_d, m_x, REC, REC_ALIGN)
            if N > 6:
                b_x6 = _rec_payload(recv_ptr, i_r + 6 * i_rows, i_d, m_x, REC, REC_ALIGN)
            if N > 7:
                b_x7 = _rec_payload(recv_ptr, i_r + 7 * i_rows, i_d, m_x, REC, REC_ALIGN)
            if d0 == 0:
                # LSE words (loads issued together with the payload loads above), weights.
                b_l0 = _rec_lse2(recv_ptr, i_r, m_r, HEAD_DIM, PACK, LSE_WORD, IS_BASE_E)
                b_m = b_l0
                if N > 1:
                    b_l1 = _rec_lse2(
                        recv_ptr, i_r + i_rows, m_r, HEAD_DIM, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l1)
                if N > 2:
                    b_l2 = _rec_lse2(
                        recv_ptr, i_r + 2 * i_rows, m_r, HEAD_DIM, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l2)
                if N > 3:
                    b_l3 = _rec_lse2(
                        recv_ptr, i_r + 3 * i_rows, m_r, HEAD_DIM, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l3)
                if N > 4:
                    b_l4 = _rec_lse2(
                        recv_ptr, i_r + 4 * i_rows, m_r, HEAD_DIM, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l4)
                if N > 5:
                    b_l5 = _rec_lse2(
                        recv_ptr, i_r + 5 * i_rows, m_r, HEAD_DIM, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l5)
                if N > 6:
                    b_l6 = _rec_lse2(
                        recv_ptr, i_r + 6 * i_rows, m_r, HEAD_DIM, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l6)
                if N > 7:
                    b_l7 = _rec_lse2(
                        recv_ptr, i_r + 7 * i_rows, m_r, HEAD_DIM, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l7)
                # Global LSE (stabiliser 0 for an all -inf row -> log2(0) = -inf).
                b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
                b_s = tl.exp2(b_l0 - b_m)
                if N > 1:
                    b_s += tl.exp2(b_l1 - b_m)
                if N > 2:
                    b_s += tl.exp2(b_l2 - b_m)
                if N > 3:
                    b_s += tl.exp2(b_l3 - b_m)
                if N > 4:
                    b_s += tl.exp2(b_l4 - b_m)
                if N > 5:
                    b_s += tl.exp2(b_l5 - b_m)
                if N > 6:
                    b_s += tl.exp2(b_l6 - b_m)
                if N > 7:
                    b_s += tl.exp2(b_l7 - b_m)
                b_g = tl.log2(b_s) + b_m
                if HAS_LSE_OUT:
                    tl.store(lse_out_ptr + i_r, _from_base2(b_g, IS_BASE_E), mask=m_r)
                b_w0 = _weight(b_l0, b_g)
                if N > 1:
                    b_w1 = _weight(b_l1, b_g)
                if N > 2:
                    b_w2 = _weight(b_l2, b_g)
                if N > 3:
                    b_w3 = _weight(b_l3, b_g)
                if N > 4:
                    b_w4 = _weight(b_l4, b_g)
                if N > 5:
                    b_w5 = _weight(b_l5, b_g)
                if N > 6:
                    b_w6 = _weight(b_l6, b_g)
                if N > 7:
                    b_w7 = _weight(b_l7, b_g)
            b_acc = _wsum(tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32), b_x0, b_w0)
            if N > 1:
                b_acc = _wsum(b_acc, b_x1, b_w1)
            if N > 2:
                b_acc = _wsum(b_acc, b_x2, b_w2)
            if N > 3:
                b_acc = _wsum(b_acc, b_x3, b_w3)
            if N > 4:
                b_acc = _wsum(b_acc, b_x4, b_w4)
            if N > 5:
                b_acc = _wsum(b_acc, b_x5, b_w5)
            if N > 6:
                b_acc = _wsum(b_acc, b_x6, b_w6)
            if N > 7:
                b_acc = _wsum(b_acc, b_x7, b_w7)
            tl.store(
                dst_ptr + (i_r[:, None] * HEAD_DIM + i_d[None, :]),
                b_acc.to(dst_ptr.dtype.element_ty),
                mask=m_x,
            )
    else:
        i_n = tl.arange(0, N_POW2)
        m_l = (i_n[:, None] < N) & m_r[None, :]
        i_rec = i_n[:, None].to(tl.int64) * i_rows + i_r[None, :]
        if LSE_WORD:
            words = recv_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            b_bits = tl.load(words + (i_rec * (REC // 2) + HEAD_DIM // 2), mask=m_l, other=0)
            b_lse = b_bits.to(tl.float32, bitcast=True)
        elif PACK == 2:
            b_lo = tl.load(recv_ptr + (i_rec * REC + HEAD_DIM), mask=m_l, other=0.0)
            b_hi = tl.load(recv_ptr + (i_rec * REC + HEAD_DIM + 1), mask=m_l, other=0.0)
            b_lo = b_lo.to(tl.uint16, bitcast=True).to(tl.uint32)
            b_hi = b_hi.to(tl.uint16, bitcast=True).to(tl.uint32)
            b_lse = (b_lo | (b_hi << 16)).to(tl.float32, bitcast=True)
        else:
            b_lse = tl.load(recv_ptr + (i_rec * REC + HEAD_DIM), mask=m_l, other=0.0)
        b_lse2 = _to_base2(tl.where(m_l, b_lse.to(tl.float32), float("-inf")), IS_BASE_E)
        b_glse2 = _global_lse2(b_lse2)
        b_w = _weight(b_lse2, b_glse2[None, :])
        if HAS_LSE_OUT:
            tl.store(lse_out_ptr + i_r, _from_base2(b_glse2, IS_BASE_E), mask=m_r)
        for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
            i_d = d0 + tl.arange(0, BLOCK_D)
            if HEAD_DIM % BLOCK_D == 0:
                m_x = tl.broadcast_to(m_r[:, None], (BLOCK_R, BLOCK_D))
            else:
                m_x = m_r[:, None] & (i_d[None, :] < HEAD_DIM)
            b_acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
            for n in tl.static_range(N):
                b_wn = tl.sum(tl.where(i_n[:, None] == n, b_w, 0.0), axis=0)
                b_x = _rec_payload(recv_ptr, i_r + n * i_rows, i_d, m_x, REC, REC_ALIGN)
                b_acc = _wsum(b_acc, b_x, b_wn)
            tl.store(
                dst_ptr + (i_r[:, None] * HEAD_DIM + i_d[None, :]),
                b_acc.to(dst_ptr.dtype.element_ty),
                mask=m_x,
            )
