"""Layouts of the A2A pack kernel that were compared on the H200 (dev tool, GPU).

Written for the former record format of the A2A buffers (one 16-byte-padded record per
row): run it at commit ``49cec06``, the last with that format (``benchmarks/README.md``).

Until this study the pack stored each record in two pieces: a ``[BLOCK_R, BLOCK_D]`` payload
tile (a warp wrote two 256-byte payloads at D=128 bf16) and a ``[BLOCK_R, tail]`` tile (a warp
wrote 32 scattered 16-byte tails); 0.79-0.82 of the copy bandwidth at H=64 D=128 without the
mask, 0.73-0.76 with it. The variants here all run one kernel, ``_pack_flat_probe_kernel``,
with the knobs the study turned on one after another:

* ``flat``: each program writes one contiguous range of ``BLOCK_V`` 16-byte vectors of one
  destination's ``[B, H_r, D_rec]`` block (grid ``(cdiv(B * H_r * D_rec / v, BLOCK_V), N)``)
  and gathers every vector's source (a payload vector of ``out``, or the tail built from the
  LSE): contiguous stores of whole records. The mask is searched per vector (binary search,
  int64 index arithmetic).
* ``flat-tok``: the mask searched once per token of the program (a small tile) and gathered
  to the vectors with ``tl.gather``; the LSE loaded by the tail vectors only.
* ``flat32``: ``flat-tok`` with int32 index arithmetic and an int32 search; ``cg``: payload
  loads cached in L2 only; ``kary``: the shipped 16-ary search (``_row_is_empty``, 4 rounds
  at R = 4096) instead of the binary one (13 dependent rounds). ``flat32 v=256 w=2 cg kary``
  is what ships now (``cpattn_dcp.kernels.a2a._a2a_pack_kernel``, ``shipped`` below).

A fourth layout, one ``[BLOCK_R, 32, v]`` tile per program holding whole records, measured
0.30-0.39 (run 1 in ``results/h200-2026-11-29-s3``) and was dropped from this file.

Covers 16-bit dtypes with D % 8 == 0 and unit-stride, 16-byte aligned rows only. Every
variant's send buffer is compared bit for bit with the shipped op's before it is timed
(read-flush timing, ``cpattn_testing.bench.time_cold``).

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-testing/src \
        python3 benchmarks/pack_variants.py [--probe]
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import cpattn_testing.bench as hb
from cpattn_dcp.kernels.empty_shards import _row_is_empty
from cpattn_dcp.ops._common import next_pow2, search_steps
from cpattn_dcp.ops.a2a_combine import a2a_pack, a2a_record_width


@triton.jit
def _tail_bits(b_lse, VEC: tl.constexpr):
    """``[..., VEC]`` uint16 tail vectors: lane 0 the low, lane 1 the high half of fp32 bits."""
    b_bits = b_lse.to(tl.uint32, bitcast=True)
    b_lo = (b_bits & 0xFFFF).to(tl.uint16)
    b_hi = (b_bits >> 16).to(tl.uint16)
    i_e = tl.arange(0, VEC)
    b_zero = tl.zeros((VEC,), dtype=tl.uint16)
    return tl.where(
        i_e[None, :] == 0,
        b_lo[:, None],
        tl.where(i_e[None, :] == 1, b_hi[:, None], b_zero[None, :]),
    )


@triton.jit
def _row_is_empty_narrow(i_row, seq_lens_ptr, qsl_ptr, num_seqs, SEARCH_STEPS: tl.constexpr):
    """``_row_is_empty`` in the index dtype of ``i_row`` (int32 here): the boundaries are
    compared in their own dtype (promoted only where wider), so an int32 ``query_start_loc``
    costs one compare per search step instead of int64 arithmetic."""
    b_total = tl.load(qsl_ptr + num_seqs)
    if SEARCH_STEPS <= 8:
        i_s = tl.arange(0, 1 << SEARCH_STEPS)
        m_s = i_s < num_seqs
        b_bound = tl.load(qsl_ptr + 1 + i_s, mask=m_s, other=0)
        b_le = (b_bound[None, :] <= i_row[:, None]) & m_s[None, :]
        b_zero = tl.load(seq_lens_ptr + i_s, mask=m_s, other=1) == 0
        b_seq = tl.minimum(tl.sum(b_le.to(tl.int32), axis=1), num_seqs - 1)
        m_hit = (i_s[None, :] == b_seq[:, None]) & b_zero[None, :]
        m_len0 = (tl.sum(m_hit.to(tl.int32), axis=1) > 0) | (b_seq < 0)
    else:
        b_pos = tl.zeros_like(i_row)
        for i_step in tl.static_range(SEARCH_STEPS):
            b_cand = b_pos + (1 << (SEARCH_STEPS - 1 - i_step))
            m_cand = b_cand <= num_seqs
            b_bound = tl.load(qsl_ptr + b_cand, mask=m_cand, other=0)
            b_pos = tl.where(m_cand & (b_bound <= i_row), b_cand, b_pos)
        b_seq = tl.minimum(b_pos, num_seqs - 1)
        b_len = tl.load(seq_lens_ptr + b_seq, mask=b_seq >= 0, other=0)
        m_len0 = b_len == 0
    return (i_row >= b_total) | m_len0


@triton.jit
def _pack_flat_probe_kernel(
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
    REC_WIDTH: tl.constexpr,
    VEC: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    TOK_POW2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    IDX64: tl.constexpr,
    PER_VECTOR: tl.constexpr,
    KARY: tl.constexpr,
    PAYLOAD_CG: tl.constexpr,
):
    """The flat layout with the knobs the study compared (see the module docstring):
    ``IDX64`` int64 index arithmetic; ``PER_VECTOR`` the mask searched per vector instead of
    once per token and gathered; ``KARY`` the shipped (16-ary) search instead of the binary
    one; ``PAYLOAD_CG`` payload loads cached in L2 only. All four at the shipped setting
    (False, False, True, True) is the shipped kernel's fast path."""
    DV: tl.constexpr = HEAD_DIM // VEC
    RV: tl.constexpr = REC_WIDTH // VEC
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
    i_rec = i_v // RV
    i_lane = i_v - i_rec * RV
    i_b = i_rec // HEADS_PER_RANK
    i_h = i_n * HEADS_PER_RANK + (i_rec - i_b * HEADS_PER_RANK)
    i_e = tl.arange(0, VEC)
    o_src = tl.multiple_of(i_b * stride_out_b + i_h * stride_out_h + i_lane * VEC, VEC)
    m_pay = m_v & (i_lane < DV)
    if PAYLOAD_CG:
        b_x = tl.load(
            out_ptr + (o_src[:, None] + i_e[None, :]),
            mask=m_pay[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
    else:
        b_x = tl.load(out_ptr + (o_src[:, None] + i_e[None, :]), mask=m_pay[:, None], other=0.0)
    m_tail = m_v & (i_lane == DV)
    b_lse = tl.load(lse_ptr + i_b * stride_lse_b + i_h * stride_lse_h, mask=m_tail, other=0.0)
    b_lse = b_lse.to(tl.float32)
    if HAS_MASK:
        if PER_VECTOR:
            i_t = i_b
        else:
            b_first = (v0 // RV) // HEADS_PER_RANK
            i_t = b_first + tl.arange(0, TOK_POW2)
        if KARY:
            m_tok = _row_is_empty(i_t, seq_lens_ptr, qsl_ptr, num_seqs, SEARCH_STEPS)
        else:
            m_tok = _row_is_empty_narrow(i_t, seq_lens_ptr, qsl_ptr, num_seqs, SEARCH_STEPS)
        if PER_VECTOR:
            m_empty = m_tok
        else:
            i_idx = tl.minimum(i_b - b_first, TOK_POW2 - 1).to(tl.int32)
            m_empty = tl.gather(m_tok.to(tl.int32), i_idx, 0) != 0
        b_lse = tl.where(m_empty, float("-inf"), b_lse)
    b_tail = _tail_bits(b_lse, VEC).to(send_ptr.dtype.element_ty, bitcast=True)
    b_vec = tl.where((i_lane == DV)[:, None], b_tail, b_x)
    o_dst = tl.multiple_of((i_n * total_v + i_v) * VEC, VEC)
    tl.store(send_ptr + (o_dst[:, None] + i_e[None, :]), b_vec, mask=m_v[:, None])


Args = tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None, torch.Tensor | None]


def _mask_args(seq_lens: torch.Tensor | None, qsl: torch.Tensor | None, lse: torch.Tensor):
    if seq_lens is None or qsl is None:
        return lse, lse, 0, False, 0
    return seq_lens, qsl, seq_lens.shape[0], True, search_steps(seq_lens.shape[0])


def _check_layout(out: torch.Tensor) -> tuple[int, int, int, int]:
    b, h, d = out.shape
    vec = 16 // out.element_size()
    if (
        out.element_size() != 2
        or d % vec
        or out.stride(2) != 1
        or (out.stride(0) | out.stride(1)) % vec
    ):
        raise ValueError("pack variants cover 16-bit, unit-stride, 16-byte aligned rows only")
    return b, h, d, vec


def pack_flat(
    args: Args,
    send: torch.Tensor,
    block_v: int,
    num_warps: int,
    *,
    idx64: bool = False,
    per_vector: bool = False,
    kary: bool = False,
    payload_cg: bool = False,
) -> None:
    """``_pack_flat_probe_kernel`` into ``send [N, B, H_r, D_rec]`` with the given knobs."""
    out, lse, n, seq_lens, qsl = args
    b, h, d, vec = _check_layout(out)
    rec = send.shape[-1]
    if rec % vec:
        raise ValueError("records must be whole vectors")
    if not idx64 and (send.numel() + block_v * vec >= 2**31 or out.numel() >= 2**31):
        raise ValueError("int32 indexing needs offsets below 2^31")
    sl, q, r, has_mask, steps = _mask_args(seq_lens, qsl, lse)
    rv = rec // vec
    total_v = b * (h // n) * rv
    # Tokens a range of block_v vectors can touch: floor(cdiv(block_v, rv) / H_r) + 2.
    tok = next_pow2(-(-block_v // rv) // (h // n) + 2)
    _pack_flat_probe_kernel[(triton.cdiv(total_v, block_v), n)](
        out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1), send, sl, q, r, b,
        HEADS_PER_RANK=h // n, HEAD_DIM=d, REC_WIDTH=rec, VEC=vec, HAS_MASK=has_mask,
        SEARCH_STEPS=steps, TOK_POW2=tok, BLOCK_V=block_v, IDX64=idx64,
        PER_VECTOR=per_vector, KARY=kary, PAYLOAD_CG=payload_cg, num_warps=num_warps,
    )  # fmt: skip


def pack_shipped(args: Args, send: torch.Tensor) -> None:
    """The shipped op (``a2a_pack`` into a preallocated send buffer)."""
    out, lse, n, seq_lens, qsl = args
    a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl, send=send)


def _variants() -> dict[str, Callable[[Args, torch.Tensor], None]]:
    v: dict[str, Callable[[Args, torch.Tensor], None]] = {"shipped": pack_shipped}
    v["flat v=1024 w=8"] = functools.partial(
        pack_flat, block_v=1024, num_warps=8, idx64=True, per_vector=True
    )
    v["flat-tok v=512 w=4"] = functools.partial(pack_flat, block_v=512, num_warps=4, idx64=True)
    for bv, w in ((512, 4), (256, 2), (1024, 8)):
        for cg, kary in ((False, False), (True, False), (False, True), (True, True)):
            v[f"flat32 v={bv} w={w}{' cg' if cg else ''}{' kary' if kary else ''}"] = (
                functools.partial(pack_flat, block_v=bv, num_warps=w, payload_cg=cg, kary=kary)
            )
    return v


def probe(dev: torch.device) -> None:
    """One launch each (H=64 D=128 N=8, B=4096), to run under ``ncu``: the shipped pack with
    the mask, ``flat32`` without and with it (plain, ``cg``, ``kary``), then the
    unpack-combine and ``correct_attn_out`` ops of the same shape."""
    from cpattn_dcp import correct_attn_out
    from cpattn_dcp.ops.a2a_combine import a2a_unpack_combine

    b, h, d, n = 4096, 64, 128, 8
    out = torch.randn(b, h, d, device=dev).to(torch.bfloat16)
    lse = torch.randn(b, h, device=dev)
    seq_lens = torch.randint(0, 4, (b,), device=dev, dtype=torch.int32)
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
    send = torch.empty(n, b, h // n, a2a_record_width(d, out.dtype), device=dev, dtype=out.dtype)
    pack_shipped((out, lse, n, seq_lens, qsl), send)
    pack_flat((out, lse, n, None, None), send, 512, 4)
    pack_flat((out, lse, n, seq_lens, qsl), send, 512, 4)
    pack_flat((out, lse, n, seq_lens, qsl), send, 512, 4, payload_cg=True)
    pack_flat((out, lse, n, seq_lens, qsl), send, 512, 4, kary=True)
    a2a_unpack_combine(send, head_dim=d, return_lse=True)
    lses = torch.randn(n, b, h, device=dev)
    correct_attn_out(out, lses, 0)
    torch.cuda.synchronize()


def main() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    if "--probe" in sys.argv:
        probe(dev)
        return
    moved, t = hb.measure_copy_ceiling(dev, timer=hb.time_cold)
    copy_bps = moved / (t.median_ms * 1e-3)
    print(f"copy ceiling (read flush) {copy_bps / 1e12:.3f} TB/s", flush=True)
    batch = 4096
    for h, d, n in ((64, 128, 2), (64, 128, 4), (64, 128, 8), (128, 512, 4)):
        gen = torch.Generator(device=dev).manual_seed(n)
        out = torch.randn(batch, h, d, device=dev, generator=gen).to(torch.bfloat16)
        lse = torch.randn(batch, h, device=dev, generator=gen)
        seq_lens = torch.randint(0, 4, (batch,), device=dev, generator=gen, dtype=torch.int32)
        qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        rec = a2a_record_width(d, torch.bfloat16)
        # Counted as bench_kernels counts the pack: (D + 2) lanes per record written.
        nbytes = batch * h * (d * 2 + 4) + batch * h * (d + 2) * 2
        for masked in (False, True):
            args: Args = (out, lse, n, seq_lens if masked else None, qsl if masked else None)
            ref = a2a_pack(out, lse, n, seq_lens=args[3], query_start_loc=args[4])
            ref = ref.view(n, batch, h // n, rec)
            line = f"H={h} D={d} N={n} mask={'on' if masked else 'off'}:"
            for name, fn in _variants().items():
                send = torch.full_like(ref, float("nan"))
                fn(args, send)
                same = torch.equal(send.view(torch.int16), ref.view(torch.int16))
                bps = nbytes / (hb.time_cold(functools.partial(fn, args, send)).median_ms * 1e-3)
                line += f"  [{name}] {bps / copy_bps:.3f}{'' if same else ' MISMATCH'}"
            print(line, flush=True)
        del out, lse, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
