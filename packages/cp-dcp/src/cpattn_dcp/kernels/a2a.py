"""Packed all-to-all combine: pack kernel (sender) and unpack-and-combine kernel (receiver).

Record format of the send/receive buffers ``[N, B, H_r, D_rec]`` (output dtype), with
``D_rec = round_up(D + P, 16 / s)`` (``s`` the element size; ``P = 2`` for fp16/bf16, 1 for
fp32; see ``a2a_record_width``): for destination n, row b, local head j, lanes ``[0, D)`` are
a bit copy of ``out[b, n*H_r + j, :]``; the LSE ``lse[b, n*H_r + j]`` converted to fp32 (and
set to -inf for empty rows when the mask is fused) sits in lane D (``P = 1``, fp32 output) or
is split into its low 16 bits (lane D) and high 16 bits (lane D + 1), each bit-cast to the
16-bit output dtype (``P = 2``). The LSE lanes are never numbers in the 16-bit case. Lanes
``[D + P, D_rec)`` are padding: written as zeros, never read. Seen as 32-bit words (D even for
16-bit dtypes) the LSE is the word at byte offset ``D * s`` of its record, little endian.

Alignment. ``D_rec * s`` is a multiple of 16 bytes, so every record of a 16-byte-aligned
buffer starts 16-byte aligned and its payload lanes can move as 16-byte vectors. Every index
expression whose alignment matters carries an explicit ``tl.multiple_of`` hint whose value is
true by construction or was checked on the host (``IN_ALIGN``): Triton 3.6's axis analysis
over-states the divisibility of a remainder pattern ``x - (x // m) * m`` (m a runtime int
specialised as a multiple of 16) on a contiguous range ("misaligned address" on the GPU with
the former unpadded records); the hints override that analysis. Pointer alignment itself is
Triton's launch specialisation (16-byte-aligned pointers only get the divisibility flag).

Pack (``_a2a_pack_kernel``): one program per ``BLOCK_R`` consecutive input rows (b, h);
the ``[BLOCK_R, BLOCK_D]`` payload tiles are read along D (16-byte vectors when the head dim
is unit-stride and the row offsets are multiples of 16 bytes, ``IN_ALIGN``; a strided
fallback otherwise) and written to their records with 16-byte vector stores; the record tail
(lanes ``[D, D_rec)``: the LSE lanes, then zeros) goes out as one ``[BLOCK_R, D_rec - D]``
tile (one 16-byte vector per record when ``D`` is a multiple of ``16 / s``). Records are
written whole because a partly written 32-byte sector costs the memory system an extra read
(H200, bf16, B=4096, H=64, D=128: 0.53 -> 0.73 of the copy bandwidth when the padding lanes
were added to the stores). All loads are issued first, then the empty-row search, then the
stores (a warp issues in order: a store waits for its data and would serialise the search
behind the payload's memory latency; 0.65 -> 0.75 with the mask on, same shape).

Unpack-combine: one program per ``BLOCK_R`` consecutive output (b, j) rows (no index
division at all: recv rows and output rows are both the flattened (b, j)). For N <= 8 the N
payload tiles (16-byte vector loads) and the N LSE words are loaded together (no load depends
on a computed value), then the weights (element-wise per row), the fp32 weighted sum
(zero-weight sources contribute exactly 0) and one 16-byte-vector store of the output rows.
"""

from typing import Any  # noqa: F401  (used by type comments in the kernels)

import triton
import triton.language as tl

from cpattn_dcp.kernels.empty_shards import _row_is_empty
from cpattn_dcp.kernels.lse_math import _from_base2, _global_lse2, _to_base2, _weight
from cpattn_dcp.kernels.tiles import _chunk_mask


@triton.jit
def _a2a_pack_kernel(
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
    num_tokens,
    NUM_HEADS: tl.constexpr,
    HEADS_PER_RANK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    REC_WIDTH: tl.constexpr,
    PACK: tl.constexpr,
    UNIT_D: tl.constexpr,
    IN_ALIGN: tl.constexpr,
    REC_ALIGN: tl.constexpr,
    TAIL_POW2: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(cdiv(B * H, BLOCK_R),)``; ``send_ptr`` the contiguous ``[N, B, H_r, D_rec]``.

    ``UNIT_D``: ``stride_out_d == 1`` (payload read as ``row offset + lane``); ``IN_ALIGN``:
    a power of two (elements, <= 16 bytes) that divides both row strides of ``out`` (host
    checked; 1 when ``UNIT_D`` is false). ``REC_ALIGN``: ``16 / s`` (``D_rec`` is a multiple
    of it). ``TAIL_POW2``: ``next_pow2(D_rec - D)``, the lanes of the record tail tile.
    """
    i_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m_r = i_r < num_tokens * NUM_HEADS
    i_b = i_r // NUM_HEADS
    i_h = i_r - i_b * NUM_HEADS
    i_n = i_h // HEADS_PER_RANK
    i_j = i_h - i_n * HEADS_PER_RANK
    i_rec = (i_n * num_tokens + i_b) * HEADS_PER_RANK + i_j
    # Program order = issue order of a warp: every independent load first (the LSE, then all
    # payload chunks), then the empty-row search (a chain of dependent loads that hit L1/L2)
    # while the payload is in flight, then the stores. A store placed before the search would
    # stall the warp until its payload arrives and serialise the search behind it.
    b_lse = tl.load(lse_ptr + i_b * stride_lse_b + i_h * stride_lse_h, mask=m_r, other=0.0)
    # Record starts: multiples of D_rec, itself a multiple of REC_ALIGN (16 bytes).
    o_rec = tl.max_contiguous(tl.multiple_of(i_rec * REC_WIDTH, REC_ALIGN), 1)
    o_src = i_b * stride_out_b + i_h * stride_out_h
    # True alignment only (host-checked strides, see the module docstring).
    o_src = tl.max_contiguous(tl.multiple_of(o_src, IN_ALIGN), 1)
    b_xs = ()  # type: tuple[Any, ...]
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        i_d = d0 + tl.arange(0, BLOCK_D)
        m_x = _chunk_mask(m_r, i_d, HEAD_DIM, BLOCK_R, BLOCK_D)
        if UNIT_D:
            b_x = tl.load(out_ptr + (o_src[:, None] + i_d[None, :]), mask=m_x)
        else:
            b_x = tl.load(out_ptr + (o_src[:, None] + i_d[None, :] * stride_out_d), mask=m_x)
        b_xs = b_xs + (b_x,)  # noqa: RUF005
    b_lse = b_lse.to(tl.float32)
    if HAS_MASK:
        m_empty = _row_is_empty(i_b, seq_lens_ptr, qsl_ptr, num_seqs, SEARCH_STEPS)
        b_lse = tl.where(m_empty, float("-inf"), b_lse)
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        i_d = d0 + tl.arange(0, BLOCK_D)
        m_x = _chunk_mask(m_r, i_d, HEAD_DIM, BLOCK_R, BLOCK_D)
        tl.store(send_ptr + (o_rec[:, None] + i_d[None, :]), b_xs[d0 // BLOCK_D], mask=m_x)
    # Record tail, lanes [D, D_rec): the LSE lanes, then zeros in the padding lanes. Writing
    # the whole record means every 32-byte sector of the send buffer is fully written (no
    # partially written sectors, which the memory system completes with a read); for
    # D % (16 / s) == 0 the tail is one 16-byte vector.
    i_t = tl.arange(0, TAIL_POW2)
    m_t = m_r[:, None] & (i_t[None, :] < REC_WIDTH - HEAD_DIM)
    if PACK == 2:
        # fp32 bits as two 16-bit lanes, low half first (lane D), each bit-cast to the dtype.
        b_bits = b_lse.to(tl.uint32, bitcast=True)
        b_lo = (b_bits & 0xFFFF).to(tl.uint16)
        b_hi = (b_bits >> 16).to(tl.uint16)
        b_zero = tl.zeros((BLOCK_R, TAIL_POW2), dtype=tl.uint16)
        b_tail = tl.where(
            i_t[None, :] == 0, b_lo[:, None], tl.where(i_t[None, :] == 1, b_hi[:, None], b_zero)
        )
        b_tail = b_tail.to(send_ptr.dtype.element_ty, bitcast=True)
    else:
        b_tail = tl.where(i_t[None, :] == 0, b_lse[:, None], 0.0)
    tl.store(send_ptr + (o_rec[:, None] + HEAD_DIM + i_t[None, :]), b_tail, mask=m_t)


@triton.jit
def _rec_lse2(
    recv_ptr,
    i_rec,
    m_r,
    HEAD_DIM: tl.constexpr,
    REC: tl.constexpr,
    PACK: tl.constexpr,
    LSE_WORD: tl.constexpr,
    IS_BASE_E: tl.constexpr,
):
    """Sanitised base-2 LSE of records ``i_rec`` (int64 [BLOCK_R]) of ``REC`` lanes."""
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
    # Records are REC_ALIGN-element (16-byte) multiples: true by construction.
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
    REC_WIDTH: tl.constexpr,
    PACK: tl.constexpr,
    REC_ALIGN: tl.constexpr,
    LSE_WORD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_BASE_E: tl.constexpr,
    HAS_LSE_OUT: tl.constexpr,
):
    """Grid ``(cdiv(B * H_r, BLOCK_R),)``; ``recv`` contiguous ``[N, B, H_r, D_rec]``.

    ``REC_WIDTH``: ``D_rec``; ``REC_ALIGN``: ``16 / s`` (a divisor of ``D_rec``): payload
    rows start 16-byte aligned in a 16-byte-aligned buffer (16-byte vector loads).
    ``LSE_WORD``: the fp32 LSE of every record is one 4-byte-aligned word (16-bit dtype, D
    even, ``recv`` 4-byte aligned): one 32-bit load instead of two 16-bit loads.
    N <= 8: fully unrolled and element-wise per row (no cross-thread reductions); the N
    payload tiles of the first head-dim chunk and the N LSE words are loaded before any math
    (H200, B=4096: a form that loops over the sources with one LSE tile measured no better).
    N > 8: one ``[N_POW2, BLOCK_R]`` LSE pass, then the N payloads one after another.
    """
    REC: tl.constexpr = REC_WIDTH
    i_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m_r = i_r < num_rows
    i_rows = tl.program_id(0).to(tl.int64) * 0 + num_rows  # int64 copy of num_rows
    if N <= 8:
        for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
            i_d = d0 + tl.arange(0, BLOCK_D)
            m_x = _chunk_mask(m_r, i_d, HEAD_DIM, BLOCK_R, BLOCK_D)
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
                b_l0 = _rec_lse2(recv_ptr, i_r, m_r, HEAD_DIM, REC, PACK, LSE_WORD, IS_BASE_E)
                b_m = b_l0
                if N > 1:
                    b_l1 = _rec_lse2(
                        recv_ptr, i_r + i_rows, m_r, HEAD_DIM, REC, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l1)
                if N > 2:
                    b_l2 = _rec_lse2(
                        recv_ptr, i_r + 2 * i_rows, m_r, HEAD_DIM, REC, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l2)
                if N > 3:
                    b_l3 = _rec_lse2(
                        recv_ptr, i_r + 3 * i_rows, m_r, HEAD_DIM, REC, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l3)
                if N > 4:
                    b_l4 = _rec_lse2(
                        recv_ptr, i_r + 4 * i_rows, m_r, HEAD_DIM, REC, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l4)
                if N > 5:
                    b_l5 = _rec_lse2(
                        recv_ptr, i_r + 5 * i_rows, m_r, HEAD_DIM, REC, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l5)
                if N > 6:
                    b_l6 = _rec_lse2(
                        recv_ptr, i_r + 6 * i_rows, m_r, HEAD_DIM, REC, PACK, LSE_WORD, IS_BASE_E
                    )
                    b_m = tl.maximum(b_m, b_l6)
                if N > 7:
                    b_l7 = _rec_lse2(
                        recv_ptr, i_r + 7 * i_rows, m_r, HEAD_DIM, REC, PACK, LSE_WORD, IS_BASE_E
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
            m_x = _chunk_mask(m_r, i_d, HEAD_DIM, BLOCK_R, BLOCK_D)
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
