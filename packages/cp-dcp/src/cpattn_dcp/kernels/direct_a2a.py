"""Direct (symmetric-memory) DCP A2A LSE-reduce kernels: publish, then wait + combine.

Receive layout per ubatch (``P`` parity slot, ``s`` source): ``recv_out [2, N, T_max, H_r, D]``,
fp32 ``recv_lse [2, N, T_max, H_r]`` (masked to -inf on empty rows), int64 ``signal [2, N]``.
Publish copies head slice ``[d*H_r, (d+1)*H_r)`` of each row to destination ``d``; combine waits
for every source's signal, then combines in the LSEs' base (NaN output on failure,
``direct_protocol``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from cpattn_dcp.kernels.direct_protocol import (
    _call_epoch,
    _checked_wait,
    _failed,
    _publish_done,
    _wait_done,
)
from cpattn_dcp.kernels.lse_math import _lse_f32, _lse_from, _max_sum, _weight


@triton.jit
def _direct_a2a_publish_kernel(
    out_ptr, stride_out_t, stride_out_h, stride_out_d, lse_ptr, stride_lse_t, stride_lse_h,
    seq_lens_ptr, qsl_ptr, num_seqs, peer_out_ptrs, peer_lse_ptrs, peer_sig_ptrs, counter_ptr,
    epoch_ptr, err_ptr, grp_err_ptr, T, T_MAX, rank, NUM_PUB,
    N: tl.constexpr, H_R: tl.constexpr, D: tl.constexpr, BLOCK_HD: tl.constexpr,
    BLOCK_H: tl.constexpr, HAS_MASK: tl.constexpr, NUM_SEQS_POW2: tl.constexpr,
):  # fmt: skip
    # Sticky: after a timeout of this workspace or of any of its group's, never write into a
    # peer again.
    if _failed(err_ptr, grp_err_ptr):
        return
    i_d = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    e, parity = _call_epoch(epoch_ptr)

    # Symmetric buffers are at least 16-byte aligned: lets the row copy use 16-byte stores.
    dst_out = tl.multiple_of(tl.load(peer_out_ptrs + i_d).to(out_ptr.dtype), 16)
    dst_lse = tl.multiple_of(tl.load(peer_lse_ptrs + i_d).to(tl.pointer_type(tl.float32)), 16)
    dst_sig = tl.load(peer_sig_ptrs + i_d).to(tl.pointer_type(tl.int64))

    rec_row0 = (parity * N + rank) * T_MAX  # first row of this source's record in the slot
    o_hd = tl.arange(0, BLOCK_HD)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H_R
    if HAS_MASK:
        o_s = tl.arange(0, NUM_SEQS_POW2)
        ends = tl.load(qsl_ptr + 1 + o_s, mask=o_s < num_seqs, other=2147483647)
        total = tl.load(qsl_ptr + num_seqs)

    for t32 in range(i_p, T, NUM_PUB):
        t = tl.cast(t32, tl.int64)
        empty = t < 0  # False, as a tensor
        if HAS_MASK:
            seq = tl.sum((ends <= t).to(tl.int32), axis=0)
            seq = tl.minimum(seq, num_seqs - 1)
            local_len = tl.load(seq_lens_ptr + tl.maximum(seq, 0), mask=num_seqs > 0, other=0)
            empty = (t >= total) | (local_len == 0)
        # Interpreter-safe form of "mask & scalar": a row limit that is 0 for empty rows.
        row_lim = tl.where(empty, 0, H_R * D)
        src_row = out_ptr + t * stride_out_t + (i_d * H_R) * stride_out_h
        dst_row = dst_out + (rec_row0 + t) * (H_R * D)
        for c in range(0, H_R * D, BLOCK_HD):
            idx = c + o_hd
            m = idx < row_lim
            # The head offset in int64: the workspace takes any head stride (a head-major
            # [T, H, D] view has stride_out_h = T_cap * D), so it can pass 2**31 elements.
            x = tl.load(
                src_row + (idx // D).to(tl.int64) * stride_out_h + (idx % D) * stride_out_d,
                mask=m,
            )
            tl.store(dst_row + idx, x, mask=m)
        lse = tl.load(
            lse_ptr + t * stride_lse_t + (i_d * H_R + o_h) * stride_lse_h, mask=m_h, other=0.0
        ).to(tl.float32)
        lse = tl.where(empty, float("-inf"), lse)
        tl.store(dst_lse + (rec_row0 + t) * H_R + o_h, lse, mask=m_h)

    _publish_done(counter_ptr + i_d, dst_sig + parity * N + rank, e, NUM_PUB)


@triton.jit
def _direct_a2a_combine_kernel(
    recv_out_ptr, recv_lse_ptr, sig_ptr, epoch_ptr, done_ptr, err_ptr, grp_err_ptr, res_ptr,
    stride_res_t, stride_res_h, res_lse_ptr, stride_res_lse_t, T_MAX, max_spins, num_programs,
    N: tl.constexpr, N_POW2: tl.constexpr, H_R: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, D_PER_PROG: tl.constexpr,
    IS_BASE_E: tl.constexpr, HAS_LSE_OUT: tl.constexpr,
):  # fmt: skip
    i_t = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1).to(tl.int64)
    i_db = tl.program_id(2)
    e, parity = _call_epoch(epoch_ptr)

    ok = _checked_wait(sig_ptr + parity * N, err_ptr, grp_err_ptr, e, max_spins, N, N_POW2)

    o_n = tl.arange(0, N_POW2)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < tl.where(ok, N, 0)  # nothing is read after a timeout
    m_h = o_h < H_R
    # Row index of (parity, source n, row t) in the [2*N*T_MAX] record axis.
    rec = (parity * N + o_n.to(tl.int64)) * T_MAX + i_t

    lse = tl.load(
        recv_lse_ptr + rec[:, None] * H_R + o_h[None, :],
        mask=m_n[:, None] & m_h[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    lse = _lse_f32(lse)
    mx, s = _max_sum(lse, IS_BASE_E)
    w = _weight(lse, mx[None, :], (1.0 / tl.maximum(s, 1.0))[None, :], IS_BASE_E)

    nan = float("nan")
    for k in range(0, D_PER_PROG, BLOCK_D):  # zero-based: keeps 16-byte vector loads
        dd = i_db * D_PER_PROG + k + o_d
        m_hd = m_h[:, None] & (dd < D)[None, :]
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for n in tl.static_range(N):
            w_n = tl.sum(tl.where(o_n[:, None] == n, w, 0.0), axis=0)
            rec_n = (parity * N + n) * T_MAX + i_t
            x = tl.load(
                recv_out_ptr + (rec_n * H_R + o_h[:, None]) * D + dd[None, :],
                mask=m_hd & (w_n > 0.0)[:, None],  # zero-weight (or timed-out) sources unread
                other=0.0,
                cache_modifier=".cg",
            ).to(tl.float32)
            acc += x * w_n[:, None]
        acc = tl.where(ok, acc, nan)
        tl.store(
            res_ptr + i_t * stride_res_t + o_h[:, None] * stride_res_h + dd[None, :],
            acc.to(res_ptr.dtype.element_ty),
            mask=m_hd,
        )
    if HAS_LSE_OUT and i_db == 0:
        g = tl.where(ok, _lse_from(mx, s, IS_BASE_E), nan)
        tl.store(res_lse_ptr + i_t * stride_res_lse_t + o_h, g, mask=m_h)

    _wait_done(done_ptr, epoch_ptr, e, num_programs)
