"""Forms of the A2A unpack-combine kernel compared on the H200 (dev tool, GPU).

Written for the former record format of the A2A buffers (one 16-byte-padded record per
row): run it at commit ``49cec06``, the last with that format (``benchmarks/README.md``).

The shipped kernel (``cpattn_dcp.kernels.a2a._a2a_unpack_combine_fwd_kernel``) issues every
load of a program first (the N payload tiles and the N LSE words, about 16 KiB), then the
weights, the weighted sum and the store; 2 warps per program at D=128. Families of forms
(``--family``), each next to the shipped op:

* ``forms`` (fourth session): one kernel, ``_unpack_probe_kernel``, with the knobs ``GATED``
  (LSE words, weights, then payload loads masked by ``w != 0``, as ``merge_attn_states``
  does; otherwise every load first and ``acc + (w == 0 ? 0 : w * x)``, the shipped math),
  ``GATHER`` (LSE math once per row in a compact layout), ``BLOCK_R`` / ``num_warps`` and
  ``IDX64`` (int64 or int32 index arithmetic);
* ``persist`` (fifth session): ``_unpack_persist_kernel``, a persistent grid of 4-16
  programs per SM looping over row tiles, either prefetching the next tile's loads into
  registers before the current tile's math (``PREFETCH``) or letting ``tl.range(num_stages=2
  / 3)`` pipeline them (``cp.async`` into shared memory);
* ``cache`` (fifth session): the shipped tile (``_unpack_probe_kernel`` with ``GATHER``)
  with cache modifiers / eviction policies on the payload loads and the output store;
* ``records`` (sixth session): the shipped kernel and tile on narrower records: ``D + 2``
  lanes (no padding, rows 4-byte aligned: 4-byte loads), ``D + 4`` lanes (8-byte aligned),
  and the shipped ``D_rec`` with 4-byte loads forced (which of the two effects is which).
  The receive buffer is repacked to the narrower width once per buffer, outside the timing.
* ``split`` (seventh session): a format the team has not adopted, timed to inform that
  decision: per source, the ``[B, H_r, D]`` payloads as one contiguous block followed by the
  ``B * H_r`` fp32 LSE words (``_unpack_split_kernel``: the shipped math, 16-byte payload
  loads over contiguous rows, the LSEs of a program's rows as one contiguous vector, no
  padding); the buffer is repacked from the records once, outside the timing.

16-bit dtypes, D a multiple of ``BLOCK_D``, N <= 8. Every variant's output and LSE are
compared with the float64 combine of the records (and with the shipped op) before it is
timed (read-flush timing, ``cpattn_testing.bench.time_cold``) next to a device copy of the
same bytes. ``--probe``: one launch each for Nsight Compute (see ``probe``).

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-testing/src \
        python3 benchmarks/unpack_variants.py [--family F] [--rounds R] [--host-guard-us T]
            [--cpu-check] [--probe]
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

import cpattn_testing.bench as hb
from cpattn_dcp.kernels.a2a import _rec_lse
from cpattn_dcp.kernels.lse_math import _lse_f32, _lse_from, _max_sum_rows, _weight
from cpattn_dcp.ops import a2a_combine as a2a_ops
from cpattn_dcp.ops.a2a_combine import a2a_unpack_combine

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eager_baselines as eb


@triton.jit
def _rec_ptrs(recv_ptr, i_rec, i_d, REC: tl.constexpr):
    """``[BLOCK_R, BLOCK_D]`` pointers to payload lanes ``i_d`` of records ``i_rec``."""
    o_rec = tl.multiple_of(i_rec * REC, 8)  # records are whole 16-byte vectors
    return recv_ptr + (o_rec[:, None] + i_d[None, :])


@triton.jit
def _unpack_probe_kernel(
    recv_ptr,
    dst_ptr,
    lse_out_ptr,
    num_rows,
    N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    REC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GATED: tl.constexpr,
    GATHER: tl.constexpr,
    IDX64: tl.constexpr,
    LOAD_CACHE: tl.constexpr = "",
    LOAD_EVICT: tl.constexpr = "",
    STORE_CACHE: tl.constexpr = "",
):
    """Grid ``(cdiv(B * H_r, BLOCK_R),)``; ``recv`` contiguous ``[N, B, H_r, REC]`` 16-bit,
    4-byte aligned (LSE as one word), base-e LSEs. ``GATHER``: the LSE math runs once per
    row in a compact layout and each weight is ``tl.gather``ed to the payload layout (else it
    runs in the payload's row layout, replicated over the threads that hold a row)."""
    r0 = tl.program_id(0) * BLOCK_R
    if IDX64:
        r0 = r0.to(tl.int64)
        rows = tl.program_id(0).to(tl.int64) * 0 + num_rows
    else:
        rows = num_rows
    i_r = r0 + tl.arange(0, BLOCK_R)
    m_r = i_r < rows
    i_d0 = tl.arange(0, BLOCK_D)
    if not GATED:
        # Every payload tile of the first chunk first (independent of the LSEs).
        b_x0s = ()
        for n in tl.static_range(N):
            p_x = _rec_ptrs(recv_ptr, i_r + n * rows, i_d0, REC)
            b_x = tl.load(
                p_x, mask=m_r[:, None], other=0.0, cache_modifier=LOAD_CACHE,
                eviction_policy=LOAD_EVICT,
            )  # fmt: skip
            b_x0s = b_x0s + (b_x,)  # noqa: RUF005
    if GATHER:
        i_l = r0 + tl.arange(0, BLOCK_R)
        m_l = i_l < rows
    else:
        i_l = i_r
        m_l = m_r
    b_ls = ()
    for n in tl.static_range(N):
        b_l = _rec_lse(recv_ptr, i_l + n * rows, m_l, HEAD_DIM, REC, 2, True)
        b_ls = b_ls + (b_l,)  # noqa: RUF005
    b_m, b_s = _max_sum_rows(b_ls, N, True)
    tl.store(lse_out_ptr + i_l, _lse_from(b_m, b_s, True), mask=m_l)
    b_inv_s = 1.0 / tl.maximum(b_s, 1.0)
    b_ws = ()
    for n in tl.static_range(N):
        b_w = _weight(b_ls[n], b_m, b_inv_s, True)
        if GATHER:
            b_w = tl.gather(b_w, (i_r - r0).to(tl.int32), 0)
        b_ws = b_ws + (b_w,)  # noqa: RUF005
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        i_d = d0 + i_d0
        b_acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
        for n in tl.static_range(N):
            p_x = _rec_ptrs(recv_ptr, i_r + n * rows, i_d, REC)
            b_w = b_ws[n][:, None]
            if GATED:
                m_x = (m_r & (b_ws[n] != 0.0))[:, None]
                b_x = tl.load(p_x, mask=m_x, other=0.0)
                b_acc += b_x.to(tl.float32) * b_w
            else:
                if d0 == 0:  # a constexpr branch, not a select
                    b_x = b_x0s[n]
                else:
                    b_x = tl.load(
                        p_x, mask=m_r[:, None], other=0.0, cache_modifier=LOAD_CACHE,
                        eviction_policy=LOAD_EVICT,
                    )  # fmt: skip
                b_acc += tl.where(b_w == 0.0, 0.0, b_x.to(tl.float32) * b_w)
        tl.store(
            dst_ptr + (i_r[:, None] * HEAD_DIM + i_d[None, :]),
            b_acc.to(dst_ptr.dtype.element_ty),
            mask=m_r[:, None],
            cache_modifier=STORE_CACHE,
        )


@triton.jit
def _tile_loads(
    recv_ptr, r0, rows, N: tl.constexpr, HEAD_DIM: tl.constexpr, REC: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """The N payload tiles ``[BLOCK_R, D]`` and the N LSE words (compact row layout) of rows
    ``[r0, r0 + BLOCK_R)``; rows past ``rows`` are masked (no memory traffic)."""
    i_r = r0 + tl.arange(0, BLOCK_R)
    m_r = i_r < rows
    i_l = r0 + tl.arange(0, BLOCK_R)
    m_l = i_l < rows
    i_d = tl.arange(0, HEAD_DIM)
    words = recv_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    b_xs = ()
    for n in tl.static_range(N):
        p_x = _rec_ptrs(recv_ptr, i_r + n * rows, i_d, REC)
        b_xs = b_xs + (tl.load(p_x, mask=m_r[:, None], other=0.0),)  # noqa: RUF005
    b_lw = ()
    for n in tl.static_range(N):
        p_l = words + ((i_l + n * rows) * (REC // 2) + HEAD_DIM // 2)
        b_lw = b_lw + (tl.load(p_l, mask=m_l, other=0),)  # noqa: RUF005
    return b_xs, b_lw


@triton.jit
def _tile_combine(
    dst_ptr, lse_out_ptr, r0, rows, b_xs, b_lw, N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """The shipped math on loaded tiles: compact LSE math, gathered weights, fp32 sum."""
    i_r = r0 + tl.arange(0, BLOCK_R)
    m_r = i_r < rows
    i_l = r0 + tl.arange(0, BLOCK_R)
    m_l = i_l < rows
    i_d = tl.arange(0, HEAD_DIM)
    b_ls = ()
    for n in tl.static_range(N):
        b_l = _lse_f32(tl.where(m_l, b_lw[n].to(tl.float32, bitcast=True), float("-inf")))
        b_ls = b_ls + (b_l,)  # noqa: RUF005
    b_m, b_s = _max_sum_rows(b_ls, N, True)
    tl.store(lse_out_ptr + i_l, _lse_from(b_m, b_s, True), mask=m_l)
    b_inv_s = 1.0 / tl.maximum(b_s, 1.0)
    b_acc = tl.zeros((BLOCK_R, HEAD_DIM), dtype=tl.float32)
    for n in tl.static_range(N):
        b_w = tl.gather(_weight(b_ls[n], b_m, b_inv_s, True), (i_r - r0).to(tl.int32), 0)[:, None]
        b_acc += tl.where(b_w == 0.0, 0.0, b_xs[n].to(tl.float32) * b_w)
    tl.store(
        dst_ptr + (i_r[:, None] * HEAD_DIM + i_d[None, :]),
        b_acc.to(dst_ptr.dtype.element_ty),
        mask=m_r[:, None],
    )


@triton.jit
def _unpack_persist_kernel(
    recv_ptr,
    dst_ptr,
    lse_out_ptr,
    num_rows,
    num_tiles,
    N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    REC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PREFETCH: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Persistent: grid ``(P,)``, program p combines tiles ``p, p + P, ...`` of ``BLOCK_R``
    rows (the tiles in flight at any time are neighbours in memory). ``PREFETCH``: the loads
    of the program's next tile are issued (into registers) before the current tile's math
    and store; else ``tl.range(num_stages=STAGES)`` lets Triton pipeline the loads
    (``cp.async`` into shared memory on sm_90 for ``STAGES > 1``)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if PREFETCH:
        b_xs, b_lw = _tile_loads(recv_ptr, pid * BLOCK_R, num_rows, N, HEAD_DIM, REC, BLOCK_R)
        for t in range(pid, num_tiles, nprog):
            r_next = (t + nprog) * BLOCK_R
            n_xs, n_lw = _tile_loads(recv_ptr, r_next, num_rows, N, HEAD_DIM, REC, BLOCK_R)
            _tile_combine(dst_ptr, lse_out_ptr, t * BLOCK_R, num_rows, b_xs, b_lw, N, HEAD_DIM,
                          BLOCK_R)  # fmt: skip
            b_xs = n_xs
            b_lw = n_lw
    else:
        for t in tl.range(pid, num_tiles, nprog, num_stages=STAGES):
            b_xs, b_lw = _tile_loads(recv_ptr, t * BLOCK_R, num_rows, N, HEAD_DIM, REC, BLOCK_R)
            _tile_combine(dst_ptr, lse_out_ptr, t * BLOCK_R, num_rows, b_xs, b_lw, N, HEAD_DIM,
                          BLOCK_R)  # fmt: skip


def unpack_persist(
    recv: torch.Tensor,
    d: int,
    block_r: int,
    num_warps: int,
    *,
    per_sm: int,
    prefetch: bool,
    stages: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_unpack_persist_kernel`` with ``per_sm`` programs per SM -> ``(out, lse)``."""
    n, b, hr, rec = recv.shape
    if recv.element_size() != 2 or not recv.is_contiguous() or n > 8:
        raise ValueError("unpack variants cover contiguous 16-bit records")
    rows = b * hr
    out = torch.empty(b, hr, d, device=recv.device, dtype=recv.dtype)
    lse = torch.empty(b, hr, device=recv.device, dtype=torch.float32)
    tiles = triton.cdiv(rows, block_r)
    # On the CPU (interpreter check) one program loops over every tile.
    sms = torch.cuda.get_device_properties(recv.device).multi_processor_count if recv.is_cuda else 0
    _unpack_persist_kernel[(max(1, min(tiles, sms * per_sm)),)](
        recv, out, lse, rows, tiles, N=n, HEAD_DIM=d, REC=rec, BLOCK_R=block_r,
        PREFETCH=prefetch, STAGES=stages, num_warps=num_warps,
    )  # fmt: skip
    return out, lse


@triton.jit
def _unpack_split_kernel(
    buf_ptr,
    dst_ptr,
    lse_out_ptr,
    num_rows,
    src_stride,
    N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(cdiv(B * H_r, BLOCK_R),)``; ``buf`` 16-bit, source n's block at element
    ``n * src_stride`` (a multiple of 8): ``num_rows * D`` payload lanes (row-major), then
    ``num_rows`` fp32 LSE words (base e). The shipped kernel's order and math otherwise."""
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    i_r = r0 + tl.arange(0, BLOCK_R)
    m_r = i_r < num_rows
    i_l = r0 + tl.arange(0, BLOCK_R)  # same rows, compact layout
    m_l = i_l < num_rows
    i_loc = (i_r - r0).to(tl.int32)
    words = buf_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    lse0 = (num_rows * HEAD_DIM) // 2  # word offset of the LSE words in a source block
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        i_d = d0 + tl.arange(0, BLOCK_D)
        b_xs = ()
        for n in tl.static_range(N):
            o_x = tl.max_contiguous(tl.multiple_of(n * src_stride + i_r * HEAD_DIM, 8), 1)
            b_x = tl.load(buf_ptr + (o_x[:, None] + i_d[None, :]), mask=m_r[:, None], other=0.0)
            b_xs = b_xs + (b_x,)  # noqa: RUF005
        if d0 == 0:
            b_ls = ()
            for n in tl.static_range(N):
                b_w = tl.load(words + (n * (src_stride // 2) + lse0 + i_l), mask=m_l, other=0)
                b_l = _lse_f32(tl.where(m_l, b_w.to(tl.float32, bitcast=True), float("-inf")))
                b_ls = b_ls + (b_l,)  # noqa: RUF005
            b_m, b_s = _max_sum_rows(b_ls, N, True)
            tl.store(lse_out_ptr + i_l, _lse_from(b_m, b_s, True), mask=m_l)
            b_inv_s = 1.0 / tl.maximum(b_s, 1.0)
            b_ws = ()
            for n in tl.static_range(N):
                b_ws = b_ws + (tl.gather(_weight(b_ls[n], b_m, b_inv_s, True), i_loc, 0),)  # noqa: RUF005
        b_acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
        for n in tl.static_range(N):
            b_w = b_ws[n][:, None]
            b_acc += tl.where(b_w == 0.0, 0.0, b_xs[n].to(tl.float32) * b_w)
        tl.store(
            dst_ptr + (i_r[:, None] * HEAD_DIM + i_d[None, :]),
            b_acc.to(dst_ptr.dtype.element_ty),
            mask=m_r[:, None],
        )


class SplitLse:
    """``_unpack_split_kernel`` with ``block_r`` rows and ``num_warps`` warps a program
    (``None``: the shipped plan's tile) on the split format, repacked from the records the
    first time a receive buffer is seen (untimed: the timer warms up first)."""

    def __init__(self, block_r: int | None = None, num_warps: int | None = None) -> None:
        self.block_r = block_r
        self.num_warps = num_warps
        self._src: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None

    def __call__(self, recv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, b, hr, rec = recv.shape
        rows = b * hr
        stride = -(-(rows * (d + 2)) // 8) * 8  # 16-byte aligned source blocks
        if self._src is not recv:
            packed = torch.zeros(n, stride, device=recv.device, dtype=recv.dtype)
            packed[:, : rows * d] = recv[..., :d].reshape(n, rows * d)
            packed[:, rows * d : rows * (d + 2)] = recv[..., d : d + 2].reshape(n, rows * 2)
            self._src, self._buf = recv, packed
        buf = self._buf
        assert buf is not None
        spec = a2a_ops._unpack_plan(n, rows, d, rec, 2, True, True, True)[1]
        block_r = spec.constexprs["BLOCK_R"] if self.block_r is None else self.block_r
        num_warps = spec.constexprs["num_warps"] if self.num_warps is None else self.num_warps
        block_d = spec.constexprs["BLOCK_D"] if self.block_r is None else d
        out = torch.empty(b, hr, d, device=recv.device, dtype=recv.dtype)
        lse = torch.empty(b, hr, device=recv.device, dtype=torch.float32)
        _unpack_split_kernel[(triton.cdiv(rows, block_r),)](
            buf, out, lse, rows, stride, N=n, HEAD_DIM=d, BLOCK_R=block_r, BLOCK_D=block_d,
            num_warps=num_warps,
        )  # fmt: skip
        return out, lse


def unpack_probe(
    recv: torch.Tensor,
    d: int,
    block_r: int,
    num_warps: int,
    *,
    gated: bool,
    gather: bool = False,
    idx64: bool = False,
    block_d: int | None = None,
    load_cache: str = "",
    load_evict: str = "",
    store_cache: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_unpack_probe_kernel`` over ``recv [N, B, H_r, D_rec]`` -> ``(out, lse)``
    (``block_d``: head-dim chunk, default D; ``load_*`` / ``store_cache``: the payload loads'
    cache modifier and eviction policy, the output store's cache modifier, eager form only)."""
    n, b, hr, rec = recv.shape
    block_d = d if block_d is None else block_d
    if recv.element_size() != 2 or d % block_d or not recv.is_contiguous() or n > 8:
        raise ValueError("unpack variants cover contiguous 16-bit records, D % BLOCK_D == 0")
    if not idx64 and recv.numel() + block_r * rec >= 2**31:
        raise ValueError("int32 indexing needs offsets below 2^31")
    rows = b * hr
    out = torch.empty(b, hr, d, device=recv.device, dtype=recv.dtype)
    lse = torch.empty(b, hr, device=recv.device, dtype=torch.float32)
    _unpack_probe_kernel[(triton.cdiv(rows, block_r),)](
        recv, out, lse, rows, N=n, HEAD_DIM=d, REC=rec, BLOCK_R=block_r, BLOCK_D=block_d,
        GATED=gated, GATHER=gather, IDX64=idx64, LOAD_CACHE=load_cache, LOAD_EVICT=load_evict,
        STORE_CACHE=store_cache, num_warps=num_warps,
    )  # fmt: skip
    return out, lse


def shipped(recv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    got, lse = a2a_unpack_combine(recv, head_dim=d, return_lse=True)
    assert lse is not None
    return got, lse


Variant = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


class NarrowRecords:
    """The shipped unpack kernel and tile on records of ``D + extra`` lanes whose rows are
    ``align``-element aligned (``extra=None``: the shipped width). The receive buffer is
    repacked to that width the first time it is seen (untimed: the timer warms up first)."""

    def __init__(self, extra: int | None, align: int) -> None:
        self.extra = extra
        self.align = align
        self._src: torch.Tensor | None = None
        self._packed: torch.Tensor | None = None

    def __call__(self, recv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._src is not recv:
            width = recv.shape[3] if self.extra is None else d + self.extra
            self._src, self._packed = recv, recv[..., :width].contiguous()
        packed = self._packed
        assert packed is not None
        n, b, hr, rec = packed.shape
        grid, spec = a2a_ops._unpack_plan(n, b * hr, d, rec, 2, True, True, True)
        consts = dict(spec.constexprs, REC_ALIGN=self.align)
        narrow = a2a_ops._unpack_spec(tuple(sorted(consts.items())))
        out = torch.empty(b, hr, d, device=recv.device, dtype=recv.dtype)
        lse = torch.empty(b, hr, device=recv.device, dtype=torch.float32)
        narrow(grid, packed, out, lse, b * hr)
        return out, lse


def _variants(d: int, family: str = "persist") -> dict[str, Variant]:
    """``family``: ``"forms"`` (the fourth session's probe knobs), ``"persist"`` (the
    persistent kernel: register prefetch or ``tl.range`` stages, programs per SM) or
    ``"cache"`` (the shipped tile and int64 indexing with cache modifiers / eviction
    policies; run 3 of the fifth session timed them with int32 indexing) or ``"records"``
    (the shipped kernel on narrower records, ``NarrowRecords``) or ``"split"`` (payloads and
    LSE words in separate regions, ``SplitLse``)."""
    v: dict[str, Variant] = {"shipped": shipped}
    if family == "split":
        v["split, shipped tile"] = SplitLse()
        for r, w in ((16, 4), (32, 4), (32, 8)) if d == 128 else ((4, 4), (8, 8)):
            v[f"split r={r} w={w}"] = SplitLse(r, w)
        return v
    if family == "records":
        v["shipped width, 4-byte loads"] = NarrowRecords(None, 2)
        v["D+4 lanes, 8-byte loads"] = NarrowRecords(4, 4)
        v["D+2 lanes, 4-byte loads"] = NarrowRecords(2, 2)
        return v
    if family == "cache":
        r, w = (8, 2) if d == 128 else (2, 2)
        # (ptxas rejects .cg loads with an L1 evict_first policy.)
        for lc, le, sc in (
            ("", "", ""),
            (".cg", "", ""),
            ("", "evict_first", ""),
            ("", "evict_last", ""),
            ("", "", ".cs"),
            (".cg", "", ".cs"),
            ("", "evict_first", ".cs"),
            ("", "", ".wt"),
        ):
            name = f"r={r} w={w} ld{lc or '-'} {le or '-'} st{sc or '-'}"
            v[name] = functools.partial(
                unpack_probe, block_r=r, num_warps=w, gated=False, gather=True, idx64=True,
                load_cache=lc, load_evict=le, store_cache=sc,
            )  # fmt: skip
        return v
    if family == "persist":
        tiles = ((8, 2), (16, 4), (32, 8)) if d == 128 else ((2, 2), (4, 4))
        for r, w in tiles:
            for per_sm in (4, 8, 16):
                v[f"persist r={r} w={w} x{per_sm} prefetch"] = functools.partial(
                    unpack_persist, block_r=r, num_warps=w, per_sm=per_sm, prefetch=True
                )
                for stages in (2, 3):
                    v[f"persist r={r} w={w} x{per_sm} stages={stages}"] = functools.partial(
                        unpack_persist, block_r=r, num_warps=w, per_sm=per_sm, prefetch=False,
                        stages=stages,
                    )  # fmt: skip
        return v
    if d == 128:
        eager = ((8, 2), (16, 4), (32, 8))
        gated = ((16, 4), (32, 4), (32, 8), (64, 8))
    else:
        eager = ((2, 2), (4, 4))
        gated = ((4, 4), (8, 8))
    for kind, shapes in (("eager", eager), ("gated", gated)):
        for r, w in shapes:
            for gather in (False, True):
                name = f"{kind} r={r} w={w}{' gather' if gather else ''}"
                v[name] = functools.partial(
                    unpack_probe, block_r=r, num_warps=w, gated=kind == "gated", gather=gather
                )
    r, w = eager[0]
    for gather in (False, True):
        v[f"eager r={r} w={w}{' gather' if gather else ''} i64"] = functools.partial(
            unpack_probe, block_r=r, num_warps=w, gated=False, gather=gather, idx64=True
        )
    return v


def _records(
    b: int, h: int, d: int, n: int, dev: torch.device, gen: torch.Generator, empty: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Receive buffer of rank 0 built by the eager pack: ``(recv, outs, lses)``; with
    ``empty``, source 1 is an empty shard for a third of the rows (LSE -inf, NaN payload)."""
    outs = torch.randn(n, b, h, d, device=dev, generator=gen).to(torch.bfloat16)
    lses = torch.randn(n, b, h, device=dev, generator=gen) * 4
    if empty and n > 1:
        outs[1, ::3] = float("nan")
        lses[1, ::3] = float("-inf")
    recv = torch.stack([eb.a2a_pack_eager(outs[r], lses[r], n)[0] for r in range(n)])
    return recv.contiguous(), outs, lses


def _reference(
    outs: torch.Tensor, lses: torch.Tensor, hr: int
) -> tuple[torch.Tensor, torch.Tensor]:
    lse64 = lses[:, :, :hr].double()
    glse = torch.logsumexp(lse64, dim=0)
    w = torch.exp(lse64 - glse).nan_to_num(0.0)
    x = torch.where(w[..., None] == 0, 0.0, outs[:, :, :hr].double())
    return (w[..., None] * x).sum(0), glse


def check(dev: torch.device, small: bool, family: str) -> None:
    """Every variant against float64 (and the shipped op), NaN-poisoned empty shards."""
    gen = torch.Generator(device=dev).manual_seed(0)
    for d in (128,) if small else (128, 512):
        for n in (1, 2, 4, 8):
            b, h = (5, 2 * n) if small else (300, 8 * n)
            recv, outs, lses = _records(b, h, d, n, dev, gen, empty=True)
            ref, ref_lse = _reference(outs, lses, h // n)
            base = shipped(recv, d)[0]
            for name, fn in _variants(d, family).items():
                got, lse = fn(recv, d)
                err = ((got.double() - ref).norm() / ref.norm()).item()
                lse_err = (lse.double() - ref_lse).abs().max().item()
                diff = (got.float() - base.float()).abs().max().item()
                ok = err < 1e-2 and lse_err < 1e-4 and not got.isnan().any().item()
                print(
                    f"check D={d} N={n} [{name}] rel err {err:.1e} lse {lse_err:.1e} "
                    f"vs shipped {diff:.1e}{'' if ok else '  FAIL'}",
                    flush=True,
                )


def probe(dev: torch.device) -> None:
    """One launch each at H=64 D=128 N=8 B=4096 inside the NVTX range ``probe``, to run under
    ``ncu --nvtx --nvtx-include probe/``: the shipped unpack; an elementwise copy kernel
    moving the same bytes (as counted for the page); a read-only reduction over the receive
    buffer (reads what the unpack reads). (The fourth session's ncu run, ``results/h200-2026-11-29-s4``,
    profiled the shipped unpack, forms of ``_unpack_probe_kernel`` and ``correct_attn_out``.)
    """
    b, h, d, n = 4096, 64, 128, 8
    recv = _records(b, h, d, n, dev, torch.Generator(device=dev).manual_seed(0), False)[0]
    nbytes = b * h * (d + 2) * 2 + b * (h // n) * (d * 2 + 4)
    src = torch.ones(nbytes // 4, device=dev, dtype=torch.int16)
    dst = torch.empty_like(src)
    sink = torch.empty((), device=dev, dtype=torch.float32)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("probe")
    shipped(recv, d)
    # A copy as an elementwise kernel (``copy_`` of one dtype is a memcpy ncu does not see).
    torch.mul(src, 1, out=dst)
    torch.sum(recv.view(-1), dim=0, dtype=torch.float32, out=sink)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-check", action="store_true", help="only the check, small, CPU")
    parser.add_argument("--probe", action="store_true", help="one launch each, for ncu")
    parser.add_argument(
        "--family", choices=("forms", "persist", "cache", "records", "split"), default="persist"
    )
    parser.add_argument("--rounds", type=int, default=1, help="timings per variant")
    parser.add_argument(
        "--host-guard-us", type=float, default=0.0, help="time_cold's GPU wait before each call"
    )
    args = parser.parse_args()
    if args.cpu_check:
        check(torch.device("cpu"), small=True, family=args.family)
        return
    dev = torch.device("cuda", torch.cuda.current_device())
    if args.probe:
        probe(dev)
        return
    check(dev, small=False, family=args.family)
    moved, t = hb.measure_copy_ceiling(dev, timer=hb.time_cold)
    copy_bps = moved / (t.median_ms * 1e-3)
    print(f"copy ceiling (read flush) {copy_bps / 1e12:.3f} TB/s", flush=True)
    batch = 4096
    for h, d, n in ((64, 128, 2), (64, 128, 4), (64, 128, 8), (128, 512, 4), (128, 512, 8)):
        gen = torch.Generator(device=dev).manual_seed(n)
        recv = _records(batch, h, d, n, dev, gen, empty=False)[0]
        # Counted as bench_kernels counts the unpack: (D + 2) lanes per record read, the
        # output and its fp32 LSE written.
        nbytes = batch * h * (d + 2) * 2 + batch * (h // n) * (d * 2 + 4)
        # A device copy moving the same number of bytes (half read, half written): the
        # ceiling at this size (the 2 GB copy hides launch and ramp costs).
        src = torch.empty(nbytes // 4, device=dev, dtype=torch.int16)
        dst = torch.empty_like(src)
        same = nbytes / (hb.time_cold(functools.partial(dst.copy_, src)).median_ms * 1e-3)
        line = f"H={h} D={d} N={n} (same-size copy {same / copy_bps:.3f}):"
        del src, dst
        variants = _variants(d, args.family)
        names = list(variants)
        fractions: dict[str, list[float]] = {name: [] for name in names}
        # Rounds in alternating order; --host-guard-us keeps the host time of plain JIT
        # launches out of the samples (see time_cold's host_guard_us).
        for rnd in range(args.rounds):
            for name in names if rnd % 2 == 0 else names[::-1]:
                fn = functools.partial(variants[name], recv, d)
                t = hb.time_cold(fn, host_guard_us=args.host_guard_us)
                fractions[name].append(nbytes / (t.median_ms * 1e-3) / copy_bps)
        for name in names:
            line += f"  [{name}] {' / '.join(f'{f:.3f}' for f in fractions[name])}"
        print(line, flush=True)
        del recv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
