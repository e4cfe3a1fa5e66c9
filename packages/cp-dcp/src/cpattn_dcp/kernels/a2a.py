"""Packed all-to-all combine: pack kernel (sender) and unpack-and-combine kernel (receiver).

Buffers ``[N, B, H_r, D + P]`` (docs/design.md, "The A2A buffer format"): block n holds the
payload rows ``r = b * H_r + j`` at lane ``r * D``, then their fp32 LSE words at lanes ``R * D +
r * P`` (``R = B * H_r``). Offset alignment hints (``PAY_ALIGN`` / ``DST_ALIGN``) come from the host.
"""

from typing import Any  # noqa: F401  (used by type comments in the kernel)

import triton
import triton.language as tl

from cpattn_dcp.kernels.empty_shards import _row_is_empty
from cpattn_dcp.kernels.lse_math import _lse_f32, _lse_from, _max_sum, _max_sum_rows, _weight
from cpattn_dcp.kernels.tiles import _chunk_mask


@triton.jit
def _a2a_pack_kernel(
    out_ptr, stride_out_b, stride_out_h, stride_out_d, lse_ptr, stride_lse_b, stride_lse_h,
    send_ptr, seq_lens_ptr, qsl_ptr, num_seqs, num_tokens, num_pay_programs,
    HEADS_PER_RANK: tl.constexpr, HEAD_DIM: tl.constexpr, VEC: tl.constexpr, PACK: tl.constexpr,
    UNIT_D: tl.constexpr, IN_ALIGN: tl.constexpr, DST_ALIGN: tl.constexpr, LSE_WORD: tl.constexpr,
    IDX64: tl.constexpr, HAS_MASK: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_V: tl.constexpr,
    HR_POW2: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Grid ``(num_pay_programs + cdiv(B, BLOCK_T), N)``; ``send_ptr`` the contiguous block
    buffer (module docstring), ``R = num_tokens * HEADS_PER_RANK``. An LSE program takes the
    ``[BLOCK_T, HR_POW2]`` tile of ``BLOCK_T`` tokens' LSEs (one empty-row search per token).

    ``VEC``: lanes per 16 bytes. ``UNIT_D``: ``stride_out_d == 1``; ``IN_ALIGN``: a power of
    two ``<= VEC`` dividing both row strides of ``out`` and D (host checked; 1 when
    ``UNIT_D`` is false); ``DST_ALIGN``: a power of two ``<= VEC`` dividing the block size.
    ``IDX64``: index arithmetic in int64 (else int32: the host checked that every offset
    fits).
    """
    ROW: tl.constexpr = HEADS_PER_RANK * HEAD_DIM  # payload lanes of one token
    pid = tl.program_id(0)
    i_n = tl.program_id(1)
    n_tok = num_tokens
    if IDX64:
        i_n = i_n.to(tl.int64)
        n_tok = n_tok.to(tl.int64)
    rows = n_tok * HEADS_PER_RANK
    o_blk = i_n * (rows * (HEAD_DIM + PACK))  # first lane of destination n's block
    if pid < num_pay_programs:
        # In int64 mode the program id is widened first: pid * BLOCK_V passes 2**31 there.
        v0 = pid.to(tl.int64) * BLOCK_V if IDX64 else pid * BLOCK_V
        i_v = v0 + tl.arange(0, BLOCK_V)
        i_e = tl.arange(0, VEC)
        n_pay = rows * HEAD_DIM
        if HEAD_DIM % VEC == 0:
            # D % VEC == 0: a vector never straddles two rows, one (token, head, lane) each.
            i_l = i_v * VEC
            i_b = i_l // ROW
            i_in = i_l - i_b * ROW
            i_j = i_in // HEAD_DIM
            i_d = i_in - i_j * HEAD_DIM
            o_row = i_b * stride_out_b + (i_n * HEADS_PER_RANK + i_j) * stride_out_h
            m_x = (i_l < n_pay)[:, None]
            if UNIT_D:
                o_src = tl.multiple_of(o_row + i_d, IN_ALIGN)
                p_src = out_ptr + (o_src[:, None] + i_e[None, :])
            else:
                p_src = out_ptr + (o_row[:, None] + (i_d[:, None] + i_e[None, :]) * stride_out_d)
        else:
            i_l2 = i_v[:, None] * VEC + i_e[None, :]
            i_b2 = i_l2 // ROW
            i_in2 = i_l2 - i_b2 * ROW
            i_j2 = i_in2 // HEAD_DIM
            p_src = out_ptr + (
                i_b2 * stride_out_b
                + (i_n * HEADS_PER_RANK + i_j2) * stride_out_h
                + (i_in2 - i_j2 * HEAD_DIM) * stride_out_d
            )
            m_x = i_l2 < n_pay
        # Read once: cached in L2 only.
        b_x = tl.load(p_src, mask=m_x, other=0.0, cache_modifier=".cg")
        o_dst = tl.multiple_of(o_blk + i_v * VEC, DST_ALIGN)
        tl.store(send_ptr + (o_dst[:, None] + i_e[None, :]), b_x, mask=m_x)
    else:
        t0 = (pid - num_pay_programs) * BLOCK_T
        if IDX64:
            t0 = t0.to(tl.int64)
        i_t = t0 + tl.arange(0, BLOCK_T)
        i_k = tl.arange(0, HR_POW2)
        m_r = (i_t < n_tok)[:, None] & (i_k < HEADS_PER_RANK)[None, :]
        o_l = i_t[:, None] * stride_lse_b + (i_n * HEADS_PER_RANK + i_k)[None, :] * stride_lse_h
        b_lse = tl.load(lse_ptr + o_l, mask=m_r, other=0.0).to(tl.float32)
        if HAS_MASK:
            m_empty = _row_is_empty(i_t, seq_lens_ptr, qsl_ptr, num_seqs, SEARCH_STEPS)
            b_lse = tl.where(m_empty[:, None], float("-inf"), b_lse)
        i_r = i_t[:, None] * HEADS_PER_RANK + i_k[None, :]
        o_lse = o_blk + rows * HEAD_DIM  # first lane of the LSE region
        if PACK == 1:
            tl.store(send_ptr + (o_lse + i_r), b_lse, mask=m_r)
        elif LSE_WORD:
            words = send_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
            tl.store(words + (o_lse // 2 + i_r), b_lse, mask=m_r)
        else:
            b_bits = b_lse.to(tl.uint32, bitcast=True)
            b_lo = (b_bits & 0xFFFF).to(tl.uint16).to(send_ptr.dtype.element_ty, bitcast=True)
            b_hi = (b_bits >> 16).to(tl.uint16).to(send_ptr.dtype.element_ty, bitcast=True)
            tl.store(send_ptr + (o_lse + 2 * i_r), b_lo, mask=m_r)
            tl.store(send_ptr + (o_lse + 2 * i_r + 1), b_hi, mask=m_r)


@triton.jit
def _blk_lse(recv_ptr, o_lse, i_r, m_r, PACK: tl.constexpr, LSE_WORD: tl.constexpr):
    """Sanitised fp32 LSE (its own base) of rows ``i_r`` (int64) of the LSE region starting
    at lane ``o_lse``; -inf where ``m_r`` is false."""
    if PACK == 1:
        b_lse = tl.load(recv_ptr + (o_lse + i_r), mask=m_r, other=0.0).to(tl.float32)
    elif LSE_WORD:
        words = recv_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        b_bits = tl.load(words + (o_lse // 2 + i_r), mask=m_r, other=0)
        b_lse = b_bits.to(tl.float32, bitcast=True)
    else:
        b_lo = tl.load(recv_ptr + (o_lse + 2 * i_r), mask=m_r, other=0.0)
        b_hi = tl.load(recv_ptr + (o_lse + 2 * i_r + 1), mask=m_r, other=0.0)
        b_lo = b_lo.to(tl.uint16, bitcast=True).to(tl.uint32)
        b_hi = b_hi.to(tl.uint16, bitcast=True).to(tl.uint32)
        b_lse = (b_lo | (b_hi << 16)).to(tl.float32, bitcast=True)
    return _lse_f32(tl.where(m_r, b_lse, float("-inf")))


@triton.jit
def _blk_payload(
    recv_ptr, o_blk, i_r, i_d, m_x, HEAD_DIM: tl.constexpr, PAY_ALIGN: tl.constexpr,
    EVICT: tl.constexpr = "",
):  # fmt: skip
    """``[BLOCK_R, BLOCK_D]`` payload lanes ``i_d`` of rows ``i_r`` of the block at ``o_blk``
    (``EVICT``: the loads' eviction policy)."""
    # True alignment of both terms (host-checked, see the module docstring).
    o_row = tl.max_contiguous(tl.multiple_of(o_blk + i_r * HEAD_DIM, PAY_ALIGN), 1)
    p_x = recv_ptr + (o_row[:, None] + i_d[None, :])
    return tl.load(p_x, mask=m_x, other=0.0, eviction_policy=EVICT)


@triton.jit
def _wsum(b_acc, b_x, b_w):
    """``acc + (w == 0 ? 0 : w * x)`` in fp32 (``b_w`` [BLOCK_R])."""
    return b_acc + tl.where(b_w[:, None] == 0.0, 0.0, b_x.to(tl.float32) * b_w[:, None])


@triton.jit
def _a2a_unpack_combine_fwd_kernel(
    recv_ptr, dst_ptr, lse_out_ptr, num_rows,
    N: tl.constexpr, N_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, PACK: tl.constexpr,
    PAY_ALIGN: tl.constexpr, LSE_WORD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_BASE_E: tl.constexpr, HAS_LSE_OUT: tl.constexpr, OUT_CACHE: tl.constexpr = "",
    PAY_EVICT: tl.constexpr = "",
):  # fmt: skip
    """Grid ``(cdiv(R, BLOCK_R),)``; ``recv`` the contiguous block buffer of N sources
    (module docstring), ``R = num_rows = B * H_r``.

    ``PAY_ALIGN``: a power of two <= 16 bytes' lanes dividing D and the block size (payload
    rows start that aligned in a 16-byte-aligned buffer). ``LSE_WORD``: 16-bit dtype and
    ``R * D`` even (``recv`` 4-byte aligned): each LSE is one aligned 32-bit word.
    N <= 8: unrolled over the sources, element-wise per row (no cross-thread reductions).
    N > 8: one ``[N_POW2, BLOCK_R]`` LSE pass, then the N payloads one after another.
    ``OUT_CACHE``: cache modifier of the output and LSE stores; ``PAY_EVICT``: eviction
    policy of the payload loads (``ops.a2a_unpack`` picks both).
    """
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    i_r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
    m_r = i_r < num_rows
    i_rows = tl.program_id(0).to(tl.int64) * 0 + num_rows  # int64 copy of num_rows
    blk = i_rows * (HEAD_DIM + PACK)  # lanes per source block
    lse0 = i_rows * HEAD_DIM  # first lane of a block's LSE region
    if N <= 8:
        # The LSE math runs once per row in a compact layout of its own and the weights move
        # to the payload's row layout with tl.gather (as in correct_attn_out's lean kernel).
        i_l = r0 + tl.arange(0, BLOCK_R).to(tl.int64)  # same rows, compact layout
        m_l = i_l < num_rows
        i_loc = (i_r - r0).to(tl.int32)
        for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
            i_d = d0 + tl.arange(0, BLOCK_D)
            m_x = _chunk_mask(m_r, i_d, HEAD_DIM, BLOCK_R, BLOCK_D)
            b_xs = ()  # type: tuple[Any, ...]
            for n in tl.static_range(N):
                b_x = _blk_payload(recv_ptr, n * blk, i_r, i_d, m_x, HEAD_DIM, PAY_ALIGN, PAY_EVICT)
                b_xs = b_xs + (b_x,)  # noqa: RUF005
            if d0 == 0:
                # LSE vectors (loads issued after the payload loads above), global LSE, weights.
                b_ls = ()  # type: tuple[Any, ...]
                for n in tl.static_range(N):
                    b_l = _blk_lse(recv_ptr, n * blk + lse0, i_l, m_l, PACK, LSE_WORD)
                    b_ls = b_ls + (b_l,)  # noqa: RUF005
                b_m, b_s = _max_sum_rows(b_ls, N, IS_BASE_E)
                if HAS_LSE_OUT:
                    tl.store(
                        lse_out_ptr + i_l, _lse_from(b_m, b_s, IS_BASE_E), mask=m_l,
                        cache_modifier=OUT_CACHE,
                    )  # fmt: skip
                b_inv_s = 1.0 / tl.maximum(b_s, 1.0)
                b_ws = ()  # type: tuple[Any, ...]
            b_acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
            for n in tl.static_range(N):
                if d0 == 0:
                    # Each weight just before its source's sum, not all weights first:
                    # ptxas then issues more payload loads before the wait for the LSE
                    # loads (module docstring, "Load order").
                    b_wn = _weight(b_ls[n], b_m, b_inv_s, IS_BASE_E)
                    b_ws = b_ws + (tl.gather(b_wn, i_loc, 0),)  # noqa: RUF005
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
        o_lse = i_n[:, None].to(tl.int64) * blk + lse0
        b_l = _blk_lse(recv_ptr, o_lse, i_r[None, :], m_l, PACK, LSE_WORD)
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
                b_x = _blk_payload(recv_ptr, n * blk, i_r, i_d, m_x, HEAD_DIM, PAY_ALIGN, PAY_EVICT)
                b_acc = _wsum(b_acc, b_x, b_wn)
            tl.store(
                dst_ptr + (i_r[:, None] * HEAD_DIM + i_d[None, :]),
                b_acc.to(dst_ptr.dtype.element_ty),
                mask=m_x,
                cache_modifier=OUT_CACHE,
            )
