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
buffer starts 16-byte aligned and is a whole number of 16-byte vectors. Every index
expression whose alignment matters carries an explicit ``tl.multiple_of`` hint whose value is
true by construction or was checked on the host (``IN_ALIGN``): Triton 3.6's axis analysis
over-states the divisibility of a remainder pattern ``x - (x // m) * m`` (m a runtime int
specialised as a multiple of 16) on a contiguous range ("misaligned address" on the GPU with
the former unpadded records); the hints override that analysis. Pointer alignment itself is
Triton's launch specialisation (16-byte-aligned pointers only get the divisibility flag).

Pack (``_a2a_pack_kernel``): each program writes one contiguous range of ``BLOCK_V``
16-byte vectors of one destination's ``[B, H_r, D_rec]`` block (grid ``(vector blocks, N)``)
and gathers each vector's source: a payload vector of ``out`` (16-byte loads when the head
dim is unit-stride and the row offsets are multiples of 16 bytes, ``IN_ALIGN``; a strided
fallback otherwise) or the record tail built from the LSE. So every store is a whole,
contiguous run of records and no 32-byte sector is written in two parts (H200, bf16,
B=4096, H=64, D=128, no mask: 0.79-0.82 of the copy bandwidth for a [rows, D] payload tile
plus a separate [rows, tail] tile, 0.88-0.90 in this form). The fused empty-row mask runs
once per *token* of the program (a small tile; a program covers a few tokens) with the
16-ary search of ``_row_is_empty``, and is gathered to the vectors: searching per vector
cost 0.50, per token with a binary search 0.80-0.82, 16-ary 0.84-0.86 (same shape, mask on).
All loads are issued first, then the search, then the store. Index arithmetic is int32
unless an offset could overflow it (``IDX64``).

Unpack-combine: one program per ``BLOCK_R`` consecutive output (b, j) rows (no index
division at all: recv rows and output rows are both the flattened (b, j)). For N <= 8 the N
payload tiles (16-byte vector loads) and the N LSE words are loaded together (no load depends
on a computed value), then the weights (element-wise, once per row in a compact layout, moved
to the payload rows with ``tl.gather``), the fp32 weighted sum (zero-weight sources
contribute exactly 0) and one 16-byte-vector store of the output rows. LSE math in the
LSEs' own base (``lse_math``: weights ``b^(l - m) / s``, large LSEs keep fp32 accuracy).
"""

from typing import Any  # noqa: F401  (used by type comments in the kernel)

import triton
import triton.language as tl

from cpattn_dcp.kernels.empty_shards import _row_is_empty
from cpattn_dcp.kernels.lse_math import _lse_f32, _lse_from, _max_sum, _max_sum_rows, _weight
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
    HEADS_PER_RANK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    REC_WIDTH: tl.constexpr,
    VEC: tl.constexpr,
    PACK: tl.constexpr,
    UNIT_D: tl.constexpr,
    IN_ALIGN: tl.constexpr,
    IDX64: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    TOK_POW2: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Grid ``(cdiv(B * H_r * D_rec / VEC, BLOCK_V), N)``; ``send_ptr`` the contiguous
    ``[N, B, H_r, D_rec]``, seen per destination as ``B * H_r * D_rec / VEC`` vectors.

    ``VEC``: ``16 / s`` (a vector is 16 bytes; ``D_rec`` is a multiple of it). ``UNIT_D``:
    ``stride_out_d == 1``; ``IN_ALIGN``: a power of two ``<= VEC`` dividing both row strides
    of ``out`` (host checked; 1 when ``UNIT_D`` is false). ``IDX64``: index arithmetic in
    int64 (else int32: the host checked that every offset fits). ``TOK_POW2``: a power of
    two >= the number of tokens one program's vectors can touch.
    """
    RV: tl.constexpr = REC_WIDTH // VEC
    TAIL0: tl.constexpr = HEAD_DIM // VEC  # first vector holding an LSE lane
    TAIL1: tl.constexpr = (HEAD_DIM + PACK - 1) // VEC  # last one
    i_n = tl.program_id(1)
    v0 = tl.program_id(0) * BLOCK_V
    n_tok = num_tokens
    if IDX64:
        i_n = i_n.to(tl.int64)
        v0 = v0.to(tl.int64)
        n_tok = n_tok.to(tl.int64)
    total_v = n_tok * (HEADS_PER_RANK * RV)
    i_v = v0 + tl.arange(0, BLOCK_V)
    m_v = i_v < total_v
    # Vector -> (record, lane) -> (token b, head h): divisions by constants.
    i_rec = i_v // RV
    i_lane = i_v - i_rec * RV
    i_b = i_rec // HEADS_PER_RANK
    i_h = i_n * HEADS_PER_RANK + (i_rec - i_b * HEADS_PER_RANK)
    i_e = tl.arange(0, VEC)
    o_row = i_b * stride_out_b + i_h * stride_out_h
    # Payload elements: lanes [0, D) of the record. Every load is issued before the
    # empty-row search (a warp issues in order; the search then runs while they fly).
    if HEAD_DIM % VEC == 0:
        m_pay = (m_v & (i_lane < TAIL0))[:, None]
    else:
        m_pay = m_v[:, None] & ((i_lane[:, None] * VEC + i_e[None, :]) < HEAD_DIM)
    if UNIT_D:
        # True alignment only (host-checked row strides, see the module docstring).
        o_src = tl.multiple_of(o_row + i_lane * VEC, IN_ALIGN)
        p_src = out_ptr + (o_src[:, None] + i_e[None, :])
    else:
        p_src = out_ptr + (o_row[:, None] + (i_lane[:, None] * VEC + i_e[None, :]) * stride_out_d)
    # Read once: cached in L2 only (L1 keeps the search's boundaries).
    b_x = tl.load(p_src, mask=m_pay, other=0.0, cache_modifier=".cg")
    m_lse = m_v & (i_lane >= TAIL0) & (i_lane <= TAIL1)
    b_lse = tl.load(lse_ptr + i_b * stride_lse_b + i_h * stride_lse_h, mask=m_lse, other=0.0)
    b_lse = b_lse.to(tl.float32)
    if HAS_MASK:
        # One search per token of this program (a [TOK_POW2] tile), gathered to the vectors.
        b_first = (v0 // RV) // HEADS_PER_RANK
        i_t = b_first + tl.arange(0, TOK_POW2)
        m_tok = _row_is_empty(i_t, seq_lens_ptr, qsl_ptr, num_seqs, SEARCH_STEPS).to(tl.int32)
        i_idx = tl.minimum(i_b - b_first, TOK_POW2 - 1).to(tl.int32)
        m_empty = tl.gather(m_tok, i_idx, 0) != 0
        b_lse = tl.where(m_empty, float("-inf"), b_lse)
    # The record's lanes [D, D_rec) as bits: the LSE lanes, then zeros (masked loads gave 0).
    if PACK == 2:
        b_bits = b_lse.to(tl.uint32, bitcast=True)
        b_lo = (b_bits & 0xFFFF).to(tl.uint16)[:, None]
        b_hi = (b_bits >> 16).to(tl.uint16)[:, None]
        b_rec = b_x.to(tl.uint16, bitcast=True)
        if HEAD_DIM % VEC == 0:
            # Lanes D, D + 1 are elements 0, 1 of vector TAIL0: a per-vector select.
            b_zero = tl.zeros((BLOCK_V, VEC), dtype=tl.uint16)
            b_tail = tl.where(i_e[None, :] == 0, b_lo, tl.where(i_e[None, :] == 1, b_hi, b_zero))
            b_rec = tl.where((i_lane == TAIL0)[:, None], b_tail, b_rec)
        else:
            i_el = i_lane[:, None] * VEC + i_e[None, :]
            b_rec = tl.where(i_el == HEAD_DIM, b_lo, tl.where(i_el == HEAD_DIM + 1, b_hi, b_rec))
    else:
        b_word = b_lse.to(tl.uint32, bitcast=True)[:, None]
        b_rec = b_x.to(tl.uint32, bitcast=True)
        i_el = i_lane[:, None] * VEC + i_e[None, :]
        b_rec = tl.where(i_el == HEAD_DIM, b_word, b_rec)
    # One contiguous range of whole records per program: every sector fully written.
    o_dst = tl.multiple_of((i_n * total_v + i_v) * VEC, VEC)
    tl.store(
        send_ptr + (o_dst[:, None] + i_e[None, :]),
        b_rec.to(send_ptr.dtype.element_ty, bitcast=True),
        mask=m_v[:, None],
    )


@triton.jit
def _rec_lse(
    recv_ptr,
    i_rec,
    m_r,
    HEAD_DIM: tl.constexpr,
    REC: tl.constexpr,
    PACK: tl.constexpr,
    LSE_WORD: tl.constexpr,
):
    """Sanitised fp32 LSE (its own base) of records ``i_rec`` (int64 [BLOCK_R]) of ``REC``
    lanes; -inf where ``m_r`` is false."""
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
    return _lse_f32(tl.where(m_r, b_lse, float("-inf")))


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
    OUT_CACHE: tl.constexpr = "",
):
    """Grid ``(cdiv(B * H_r, BLOCK_R),)``; ``recv`` contiguous ``[N, B, H_r, D_rec]``.

    ``REC_WIDTH``: ``D_rec``; ``REC_ALIGN``: ``16 / s`` (a divisor of ``D_rec``): payload
    rows start 16-byte aligned in a 16-byte-aligned buffer (16-byte vector loads).
    ``LSE_WORD``: the fp32 LSE of every record is one 4-byte-aligned word (16-bit dtype, D
    even, ``recv`` 4-byte aligned): one 32-bit load instead of two 16-bit loads.
    N <= 8: unrolled over the sources (static loops) and element-wise per row (no
    cross-thread reductions); the N payload tiles of the first head-dim chunk and the N LSE
    words are loaded before any math (H200, B=4096: a form that loops over the sources with
    one LSE tile measured no better). The LSE math runs in a compact layout of the rows
    (once per row instead of once per thread holding a row, 16 per row at D=128); each
    weight moves to the payload layout with ``tl.gather`` (H200, bf16: B=64 H=128 D=512
    graph replay 2.7-2.8 instead of 3.0-3.4 µs; B=4096 within the run-to-run noise;
    ``benchmarks/results/h200-2026-11-29-s4/ab_unpack_gather.txt``).
    N > 8: one ``[N_POW2, BLOCK_R]`` LSE pass, then the N payloads one after another.
    ``OUT_CACHE``: cache modifier of the output and LSE stores (the op passes ``""``, the
    default write-back; see ``ops.a2a_combine._UNPACK_OUT_CACHE``).
    """
    REC: tl.constexpr = REC_WIDTH
    i_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m_r = i_r < num_rows
    i_rows = tl.program_id(0).to(tl.int64) * 0 + num_rows  # int64 copy of num_rows
    if N <= 8:
        # The LSE math runs once per row in a compact layout of its own and the weights move
        # to the payload's row layout with tl.gather (as in correct_attn_out's lean kernel).
        r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
        i_l = r0 + tl.arange(0, BLOCK_R).to(tl.int64)  # same rows, compact layout
        m_l = i_l < num_rows
        i_loc = (i_r - r0).to(tl.int32)
        for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
            i_d = d0 + tl.arange(0, BLOCK_D)
            m_x = _chunk_mask(m_r, i_d, HEAD_DIM, BLOCK_R, BLOCK_D)
            b_xs = ()  # type: tuple[Any, ...]
            for n in tl.static_range(N):
                b_x = _rec_payload(recv_ptr, i_r + n * i_rows, i_d, m_x, REC, REC_ALIGN)
                b_xs = b_xs + (b_x,)  # noqa: RUF005
            if d0 == 0:
                # LSE words (loads issued after the payload loads above), global LSE, weights.
                b_ls = ()  # type: tuple[Any, ...]
                for n in tl.static_range(N):
                    b_l = _rec_lse(recv_ptr, i_l + n * i_rows, m_l, HEAD_DIM, REC, PACK, LSE_WORD)
                    b_ls = b_ls + (b_l,)  # noqa: RUF005
                b_m, b_s = _max_sum_rows(b_ls, N, IS_BASE_E)
                if HAS_LSE_OUT:
                    tl.store(
                        lse_out_ptr + i_l, _lse_from(b_m, b_s, IS_BASE_E), mask=m_l,
                        cache_modifier=OUT_CACHE,
                    )  # fmt: skip
                b_inv_s = 1.0 / tl.maximum(b_s, 1.0)
                b_ws = ()  # type: tuple[Any, ...]
                for n in tl.static_range(N):
                    b_wn = _weight(b_ls[n], b_m, b_inv_s, IS_BASE_E)
                    b_ws = b_ws + (tl.gather(b_wn, i_loc, 0),)  # noqa: RUF005
            b_acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
            for n in tl.static_range(N):
                b_acc = _wsum(b_acc, b_xs[n], b_ws[n])
            tl.store(
                dst_ptr + (i_r[:, None] * HEAD_DIM + i_d[None, :]),
                b_acc.to(dst_ptr.dtype.element_ty),
                mask=m_x,
                cache_modifier=OUT_CACHE,
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
        b_l = _lse_f32(tl.where(m_l, b_lse.to(tl.float32), float("-inf")))
        b_m, b_s = _max_sum(b_l, IS_BASE_E)
        b_w = _weight(b_l, b_m[None, :], (1.0 / tl.maximum(b_s, 1.0))[None, :], IS_BASE_E)
        if HAS_LSE_OUT:
            tl.store(
                lse_out_ptr + i_r, _lse_from(b_m, b_s, IS_BASE_E), mask=m_r,
                cache_modifier=OUT_CACHE,
            )  # fmt: skip
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
                cache_modifier=OUT_CACHE,
            )
