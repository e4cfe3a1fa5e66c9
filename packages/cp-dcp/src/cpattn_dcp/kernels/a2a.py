"""Packed all-to-all combine: pack kernel (sender) and unpack-and-combine kernel (receiver).

Record format of the send/receive buffers ``[N, B, H_r, D + P]`` (output dtype): for
destination n, row b, local head j, lanes ``[0, D)`` are a bit copy of
``out[b, n*H_r + j, :]``; the LSE ``lse[b, n*H_r + j]`` converted to fp32 (and set to -inf for
empty rows when the mask is fused) sits in lane D (``P = 1``, fp32 output) or is split into
its low 16 bits (lane D) and high 16 bits (lane D + 1), each bit-cast to the 16-bit output
dtype (``P = 2``). The LSE lanes are never numbers in the 16-bit case.

Pack: one program per ``BLOCK_R`` consecutive source (b, h) rows times the full head dim.
Unpack-combine: one program per ``BLOCK_R`` consecutive output (b, j) rows; one pass over the
N LSE records (``[N_POW2, BLOCK_R]`` tile: sanitise, global LSE, weights), then one weighted
pass over the N payloads (unrolled, fp32 accumulator, zero-weight sources contribute exactly 0).
The record stride ``D + P`` is a compile-time constant so the compiler knows its alignment.
"""

import triton
import triton.language as tl

from cpattn_dcp.kernels.empty_shards import _row_is_empty
from cpattn_dcp.kernels.lse_math import _from_base2, _global_lse2, _to_base2, _weight


@triton.jit
def _a2a_pack_fwd_kernel(
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
def _a2a_unpack_combine_fwd_kernel(
    recv_ptr,
    dst_ptr,
    lse_out_ptr,
    num_rows,
    N: tl.constexpr,
    N_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PACK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_BASE_E: tl.constexpr,
    HAS_LSE_OUT: tl.constexpr,
):
    REC: tl.constexpr = HEAD_DIM + PACK
    i_pid = tl.program_id(0).to(tl.int64)
    i_r = i_pid * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m_r = i_r < num_rows
    i_rows = i_pid * 0 + num_rows  # int64 copy of num_rows

    # Pass 1: the N LSE records of the BLOCK_R rows.
    i_n = tl.arange(0, N_POW2)
    o_rec = (i_n[:, None].to(tl.int64) * i_rows + i_r[None, :]) * REC
    m_l = (i_n[:, None] < N) & m_r[None, :]
    if PACK == 2:
        b_lo = tl.load(recv_ptr + o_rec + HEAD_DIM, mask=m_l, other=0.0)
        b_hi = tl.load(recv_ptr + o_rec + HEAD_DIM + 1, mask=m_l, other=0.0)
        b_lo = b_lo.to(tl.uint16, bitcast=True).to(tl.uint32)
        b_hi = b_hi.to(tl.uint16, bitcast=True).to(tl.uint32)
        b_lse = (b_lo | (b_hi << 16)).to(tl.float32, bitcast=True)
    else:
        b_lse = tl.load(recv_ptr + o_rec + HEAD_DIM, mask=m_l, other=0.0).to(tl.float32)
    b_lse = tl.where(m_l, b_lse, float("-inf"))
    b_lse2 = _to_base2(b_lse, IS_BASE_E)
    b_glse2 = _global_lse2(b_lse2)
    b_w = _weight(b_lse2, b_glse2[None, :])
    if HAS_LSE_OUT:
        tl.store(lse_out_ptr + i_r, _from_base2(b_glse2, IS_BASE_E), mask=m_r)

    # Pass 2: weighted sum of the N payloads.
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        i_d = d0 + tl.arange(0, BLOCK_D)
        if HEAD_DIM % BLOCK_D == 0:
            m_x = tl.broadcast_to(m_r[:, None], (BLOCK_R, BLOCK_D))  # row mask only
        else:
            m_x = m_r[:, None] & (i_d[None, :] < HEAD_DIM)
        b_acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
        for n in tl.static_range(N):
            b_wn = tl.sum(tl.where(i_n[:, None] == n, b_w, 0.0), axis=0)
            o_x = (i_r + n * i_rows) * REC
            b_x = tl.load(recv_ptr + o_x[:, None] + i_d[None, :], mask=m_x, other=0.0)
            b_acc += tl.where(b_wn[:, None] == 0.0, 0.0, b_x.to(tl.float32) * b_wn[:, None])
        tl.store(
            dst_ptr + i_r[:, None] * HEAD_DIM + i_d[None, :],
            b_acc.to(dst_ptr.dtype.element_ty),
            mask=m_x,
        )
