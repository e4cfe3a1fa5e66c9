"""The A2A unpack-combine in other forms, timed next to the shipped op (dev tool, GPU; the
forms with inline PTX do not run under the interpreter).

Written for the one unmet bandwidth target of issue 5, the unpack-combine at H=64 D=128 N=8
B=4096. Register loads in every tile shape, persistent grids, ``cp.async`` pipelines, TMA
boxes, cache modifiers and narrower records were tried before (``docs/performance-notes.md``).
The forms here (``variants()``):

* ``ld.* rR wW``: each thread loads 16-byte chunks through ``tl.inline_asm_elementwise`` (one
  ``ld.global...v4.b32`` per chunk, ``LOADS``: PTX's ``.nc`` read-only path and L2
  prefetch-size hints, which Triton cannot ask for), and the combine runs in that chunk space:
  a word's two bf16 lanes become fp32 by shifts (exact), eight fp32 accumulators per chunk,
  the result rounded to bf16 (round to nearest even, as the shipped kernel's conversion) and
  stored with one ``st.global.v4.b32`` per chunk. ``TILES``: rows per program and warps.
* ``triton rR wW``: the shipped kernel's N <= 8 path in plain Triton, with the weights formed
  before all sums (``eager-w``, the shipped order before commit ``b5d1ed1``) or each just
  before its sum, the LSE math in the payload's row layout (``rows``), ``evict_first``
  payload loads or ``.cs`` stores.
* ``order``: ``ptxas`` issues the LSE loads, starts the LSE math (which waits for them) and
  issues most payload loads only after it, whatever the order in the source (``cuobjdump`` of
  the sm_90 SASS, ``--compile-only``; a ``tl.debug_barrier`` after the loads is dropped). These
  forms bitwise-or into the LSE bits a zero that depends on every payload load (``(x ^ y ...)
  & zero``, ``zero`` a runtime 0 that ``ptxas`` cannot fold), so every load is issued first.
* the op itself under ``_UNPACK_ONE_VECTOR_MIN_N`` settings, and with ``--ref-kernel`` the
  unpack kernel of an earlier ``kernels/a2a.py`` launched with the op's own plans.

Every form is checked against a float64 combine (and said whether it matches the shipped op
bit for bit) before it is timed, as in ``unpack_tma.py`` (``time_cold`` with a host guard,
interleaved rounds), next to a copy of the same bytes and the 2 GB copy ceiling. bf16 only,
D % 8 == 0, 16-byte aligned source blocks. Findings: ``results/h200-2026-12-01-s21/README.md``.

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-testing/src \
        python3 benchmarks/unpack_asm.py [--rounds R] [--host-guard-us T] [--shapes N,H_r,D ...]
            [--only REGEX] [--ref-kernel PATH] [--compile-only]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

import cpattn_dcp.ops.a2a_combine as a2a_mod
import cpattn_testing.bench as hb
from cpattn_common.launch_plans import clear_launch_plans
from cpattn_dcp.kernels.a2a import _wsum
from cpattn_dcp.kernels.lse_math import _lse_f32, _lse_from, _max_sum_rows, _weight

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unpack_tma import check, shipped, time_shape

LOADS = {
    "ld.v4": "ld.global.v4.b32",
    "ld.L2::256B": "ld.global.L2::256B.v4.b32",
    "ld.nc": "ld.global.nc.v4.b32",
    "ld.nc.L2::256B": "ld.global.nc.L2::256B.v4.b32",
    "ld.nc.na.L2::256B": "ld.global.nc.L1::no_allocate.L2::256B.v4.b32",
}
TILES = ((8, 2), (8, 4), (16, 4), (16, 8), (32, 8))


@triton.jit
def _load_chunk(p_addr, LOAD: tl.constexpr):
    """Four int32 words (16 bytes) at each byte address of ``p_addr`` (int64)."""
    return tl.inline_asm_elementwise(
        asm=LOAD + " {$0, $1, $2, $3}, [$4];",
        constraints="=r,=r,=r,=r,l",
        args=[p_addr],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=False,  # kept in program order by LLVM (ptxas still reorders: see above)
        pack=1,
    )


@triton.jit
def _store_chunk(p_addr, w0, w1, w2, w3, m_x):
    """One 16-byte store of four int32 words at each byte address where ``m_x`` holds."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        setp.ne.b32 p, $6, 0;
        @p st.global.v4.b32 [$1], {$2, $3, $4, $5};
        mov.b32 $0, 0;
        }""",
        constraints="=r,l,r,r,r,r,r",
        args=[p_addr, w0, w1, w2, w3, m_x.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _bf16_bits(b_x):
    """fp32 -> bf16 (round to nearest even) -> its 16 bits in the low half of an int32."""
    return b_x.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)


@triton.jit
def _unpack_asm_kernel(
    recv_ptr,
    dst_ptr,
    lse_out_ptr,
    num_rows,
    zero,
    N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    LOAD: tl.constexpr,
    ORDER: tl.constexpr,
    IS_BASE_E: tl.constexpr,
):
    """Grid ``(cdiv(R, BLOCK_R),)``; ``recv`` the bf16 block buffer ``[N, B, H_r, D + 2]`` (the
    block format of ``cpattn_dcp.kernels.a2a``, ``R = B * H_r``), out ``[R, D]`` bf16,
    lse_out ``[R]`` fp32. One program: ``BLOCK_R`` rows, all ``D / 8`` chunks of each."""
    CHUNKS: tl.constexpr = HEAD_DIM // 8
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    i_r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
    m_r = i_r < num_rows
    i_rc = tl.minimum(i_r, num_rows - 1)  # the loads have no mask: clamp to a real row
    i_c = tl.arange(0, CHUNKS).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * 0 + num_rows
    blk = rows * (HEAD_DIM + 2)  # lanes per source block
    base = recv_ptr.to(tl.int64)  # byte address of the buffer
    o_chunk = (i_rc * HEAD_DIM)[:, None] * 2 + (i_c * 16)[None, :]  # bytes within a block
    b_xs = ()  # type: tuple[tl.tensor, ...]
    for n in tl.static_range(N):
        b_xs = b_xs + (_load_chunk(base + n * blk * 2 + o_chunk, LOAD),)  # noqa: RUF005
    words = recv_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    b_bits = ()  # type: tuple[tl.tensor, ...]
    for n in tl.static_range(N):
        p_lse = words + ((n * blk + rows * HEAD_DIM) // 2 + i_r)
        b_bits = b_bits + (tl.load(p_lse, mask=m_r, other=0),)  # noqa: RUF005
    if ORDER:
        # ptxas issues the LSE loads, then the LSE math, which waits for them, and most payload
        # loads only after it (two DRAM round trips per program). A zero that depends on every
        # payload load, or-ed into the LSE bits, makes the LSE math wait for the payloads
        # instead, so every load is issued first. The LSE math then runs per chunk, not per row.
        b_dep = b_xs[0][0] ^ b_xs[0][3]
        for n in tl.static_range(1, N):
            b_dep = b_dep ^ b_xs[n][0] ^ b_xs[n][3]
        b_dep = b_dep & zero  # zero: a runtime 0, which ptxas cannot fold away
        b_ls = ()  # type: tuple[tl.tensor, ...]
        for n in tl.static_range(N):
            b_bits2 = b_bits[n][:, None] | b_dep
            b_l = _lse_f32(
                tl.where(m_r[:, None], b_bits2.to(tl.float32, bitcast=True), float("-inf"))
            )
            b_ls = b_ls + (b_l,)  # noqa: RUF005
    else:
        b_ls = ()  # type: tuple[tl.tensor, ...]
        for n in tl.static_range(N):
            b_l = _lse_f32(tl.where(m_r, b_bits[n].to(tl.float32, bitcast=True), float("-inf")))
            b_ls = b_ls + (b_l,)  # noqa: RUF005
    b_ws = ()  # type: tuple[tl.tensor, ...]
    b_m, b_s = _max_sum_rows(b_ls, N, IS_BASE_E)
    b_inv_s = 1.0 / tl.maximum(b_s, 1.0)
    if ORDER:
        for n in tl.static_range(N):
            b_ws = b_ws + (_weight(b_ls[n], b_m, b_inv_s, IS_BASE_E),)  # noqa: RUF005
        # Every chunk of a row holds the row's LSE: store it from the first chunk's thread.
        p_lse_out = lse_out_ptr + (i_r[:, None] + i_c[None, :] * 0)
        m_lse = m_r[:, None] & (i_c == 0)[None, :]
        tl.store(p_lse_out, _lse_from(b_m, b_s, IS_BASE_E), mask=m_lse)
    else:
        for n in tl.static_range(N):
            b_ws = b_ws + (_weight(b_ls[n], b_m, b_inv_s, IS_BASE_E)[:, None],)  # noqa: RUF005
        tl.store(lse_out_ptr + i_r, _lse_from(b_m, b_s, IS_BASE_E), mask=m_r)
    acc = ()  # type: tuple[tl.tensor, ...]
    for _ in tl.static_range(8):
        acc = acc + (tl.zeros((BLOCK_R, CHUNKS), dtype=tl.float32),)  # noqa: RUF005
    for n in tl.static_range(N):
        b_w = b_ws[n]
        new = ()  # type: tuple[tl.tensor, ...]
        for k in tl.static_range(4):
            b_word = b_xs[n][k]
            b_lo = (b_word << 16).to(tl.float32, bitcast=True)
            b_hi = (b_word & -65536).to(tl.float32, bitcast=True)
            new = new + (  # noqa: RUF005
                acc[2 * k] + tl.where(b_w == 0.0, 0.0, b_lo * b_w),
                acc[2 * k + 1] + tl.where(b_w == 0.0, 0.0, b_hi * b_w),
            )
        acc = new
    p_out = dst_ptr.to(tl.int64) + o_chunk
    m_x = tl.broadcast_to(m_r[:, None], (BLOCK_R, CHUNKS))
    out_words = ()  # type: tuple[tl.tensor, ...]
    for k in tl.static_range(4):
        out_words = out_words + (  # noqa: RUF005
            _bf16_bits(acc[2 * k]) | (_bf16_bits(acc[2 * k + 1]) << 16),
        )
    _store_chunk(p_out, out_words[0], out_words[1], out_words[2], out_words[3], m_x)


@triton.jit
def _unpack_tri_kernel(
    recv_ptr,
    dst_ptr,
    lse_out_ptr,
    num_rows,
    zero,
    N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ORDER: tl.constexpr,
    ROWS: tl.constexpr,
    EAGER_W: tl.constexpr,
    PAY_EVICT: tl.constexpr,
    OUT_CACHE: tl.constexpr,
    IS_BASE_E: tl.constexpr,
):
    """The shipped kernel's N <= 8 path in plain Triton (``BLOCK_D = D``, bf16, LSE words,
    LSE out), with the ``order`` dependency when ``ORDER``: the xor of every payload tile,
    reduced over each row (``tl.xor_sum``: shuffles, which wait for the loads), and-ed with
    the runtime ``zero`` and or-ed into the LSE bits (module docstring). ``ROWS``: the LSE
    math in the payload tile's row layout (each thread of a row repeats it; no layout
    conversion, no ``tl.gather``) instead of the shipped compact layout. ``EAGER_W``: every
    weight before the sums (the order before ``b5d1ed1``), else each just before its sum.
    ``PAY_EVICT`` / ``OUT_CACHE``: eviction policy of the payload loads, cache modifier of the
    output stores."""
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    i_r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
    m_r = i_r < num_rows
    rows = tl.program_id(0).to(tl.int64) * 0 + num_rows
    blk = rows * (HEAD_DIM + 2)
    if ROWS:  # noqa: SIM108  (a constexpr branch, kept as Triton code)
        i_l = i_r
    else:
        i_l = r0 + tl.arange(0, BLOCK_R).to(tl.int64)  # compact layout, as shipped
    m_l = i_l < num_rows
    i_loc = (i_r - r0).to(tl.int32)
    i_d = tl.arange(0, HEAD_DIM)
    m_x = tl.broadcast_to(m_r[:, None], (BLOCK_R, HEAD_DIM))
    b_xs = ()  # type: tuple[tl.tensor, ...]
    for n in tl.static_range(N):
        o_row = tl.max_contiguous(tl.multiple_of(n * blk + i_r * HEAD_DIM, 8), 1)
        p_x = recv_ptr + (o_row[:, None] + i_d[None, :])
        b_x = tl.load(p_x, mask=m_x, other=0.0, eviction_policy=PAY_EVICT)
        b_xs = b_xs + (b_x,)  # noqa: RUF005
    words = recv_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    b_ls = ()  # type: tuple[tl.tensor, ...]
    if ORDER:
        b_t = b_xs[0].to(tl.int16, bitcast=True)
        for n in tl.static_range(1, N):
            b_t = b_t ^ b_xs[n].to(tl.int16, bitcast=True)
        b_dep = tl.xor_sum(b_t.to(tl.int32), axis=1) & zero
    for n in tl.static_range(N):
        b_bits = tl.load(words + ((n * blk + rows * HEAD_DIM) // 2 + i_l), mask=m_l, other=0)
        if ORDER:
            b_bits = b_bits | b_dep
        b_l = _lse_f32(tl.where(m_l, b_bits.to(tl.float32, bitcast=True), float("-inf")))
        b_ls = b_ls + (b_l,)  # noqa: RUF005
    b_m, b_s = _max_sum_rows(b_ls, N, IS_BASE_E)
    tl.store(lse_out_ptr + i_l, _lse_from(b_m, b_s, IS_BASE_E), mask=m_l)
    b_inv_s = 1.0 / tl.maximum(b_s, 1.0)
    b_acc = tl.zeros((BLOCK_R, HEAD_DIM), dtype=tl.float32)
    if EAGER_W:  # every weight first, then the sums (the shipped kernel's order)
        b_ws = ()  # type: tuple[tl.tensor, ...]
        for n in tl.static_range(N):
            b_wn = _weight(b_ls[n], b_m, b_inv_s, IS_BASE_E)
            if not ROWS:
                b_wn = tl.gather(b_wn, i_loc, 0)
            b_ws = b_ws + (b_wn,)  # noqa: RUF005
        for n in tl.static_range(N):
            b_acc = _wsum(b_acc, b_xs[n], b_ws[n])
    else:  # each weight just before its source's sum
        for n in tl.static_range(N):
            b_wn = _weight(b_ls[n], b_m, b_inv_s, IS_BASE_E)
            if not ROWS:
                b_wn = tl.gather(b_wn, i_loc, 0)
            b_acc = _wsum(b_acc, b_xs[n], b_wn)
    p_out = dst_ptr + (i_r[:, None] * HEAD_DIM + i_d[None, :])
    tl.store(p_out, b_acc.to(dst_ptr.dtype.element_ty), mask=m_x, cache_modifier=OUT_CACHE)


class AsmUnpack:
    """One form (module docstring); callable as ``(recv, d) -> (out, lse)``."""

    kernel: Any = _unpack_asm_kernel

    def __init__(self, load: str, block_r: int, num_warps: int, *, order: bool = False) -> None:
        self.load, self.block_r, self.num_warps, self.order = load, block_r, num_warps, order

    def consts(self, n: int, d: int) -> dict[str, object]:
        return {"N": n, "HEAD_DIM": d, "BLOCK_R": self.block_r, "LOAD": self.load,
                "ORDER": self.order,
                "IS_BASE_E": True}  # fmt: skip

    def __call__(self, recv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, b, hr, width = recv.shape
        rows = b * hr
        if recv.dtype != torch.bfloat16 or d % 8 or width != d + 2 or rows * width % 8:
            raise ValueError("asm forms: bf16, D % 8 == 0, 16-byte aligned source blocks")
        out = torch.empty(b, hr, d, dtype=recv.dtype, device=recv.device)
        lse = torch.empty(b, hr, dtype=torch.float32, device=recv.device)
        self.kernel[(triton.cdiv(rows, self.block_r),)](
            recv, out, lse, rows, 0, **self.consts(n, d), num_warps=self.num_warps
        )
        return out, lse


class TriUnpack(AsmUnpack):
    """``_unpack_tri_kernel`` (plain Triton loads); callable as ``(recv, d) -> (out, lse)``."""

    kernel = _unpack_tri_kernel

    def __init__(
        self,
        block_r: int,
        num_warps: int,
        *,
        order: bool = False,
        rows: bool = False,
        eager_w: bool = False,
        pay_evict: str = "",
        out_cache: str = "",
    ) -> None:
        super().__init__("", block_r, num_warps, order=order)
        self.rows, self.eager_w = rows, eager_w
        self.pay_evict, self.out_cache = pay_evict, out_cache

    def consts(self, n: int, d: int) -> dict[str, object]:
        return {"N": n, "HEAD_DIM": d, "BLOCK_R": self.block_r, "ORDER": self.order,
                "ROWS": self.rows, "EAGER_W": self.eager_w, "PAY_EVICT": self.pay_evict,
                "OUT_CACHE": self.out_cache, "IS_BASE_E": True}  # fmt: skip


Unpack = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def _set_one_vector_min_n(min_n: int) -> None:
    """Set ``a2a_combine._UNPACK_ONE_VECTOR_MIN_N``; on a change, clear the memoised plans and
    the recorded launches (a recorded call would replay the former tile)."""
    if min_n != a2a_mod._UNPACK_ONE_VECTOR_MIN_N:
        a2a_mod._UNPACK_ONE_VECTOR_MIN_N = min_n
        a2a_mod._unpack_config.cache_clear()
        a2a_mod._unpack_plan.cache_clear()
        clear_launch_plans()


def _op_with_one_vector_min_n(min_n: int) -> Unpack:
    """The op under ``a2a_combine._UNPACK_ONE_VECTOR_MIN_N = min_n`` (set before each call:
    the forms run one after another)."""

    def call(recv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        _set_one_vector_min_n(min_n)
        return shipped(recv, d)

    return call


class RefKernel:
    """The unpack kernel of another ``cpattn_dcp/kernels/a2a.py`` (e.g. ``git show
    REF:packages/cp-dcp/src/cpattn_dcp/kernels/a2a.py > benchmarks/_ab_ref/a2a.py``, carried:
    git-ignored), launched with the op's own plan (grid and constexprs) under the current
    ``_UNPACK_ONE_VECTOR_MIN_N``; callable as ``(recv, d) -> (out, lse)``."""

    def __init__(self, path: Path, one_vector_min_n: int) -> None:
        import importlib.util

        from cpattn_common.launch import CachedKernel

        spec = importlib.util.spec_from_file_location(f"ab_ref_a2a_{path.stem}", path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.kernel = CachedKernel(module._a2a_unpack_combine_fwd_kernel)
        self.one_vector_min_n = one_vector_min_n

    def __call__(self, recv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        _set_one_vector_min_n(self.one_vector_min_n)
        n, b, hr, _ = recv.shape
        rows = b * hr
        out = torch.empty(b, hr, d, dtype=recv.dtype, device=recv.device)
        lse = torch.empty(b, hr, dtype=torch.float32, device=recv.device)
        lse_word = a2a_mod._lse_word(recv, rows, d)
        grid, plan = a2a_mod._unpack_plan(n, rows, d, recv.element_size(), lse_word, True, True)
        # The plan's constexprs that the earlier kernel takes (later ones add parameters).
        names = set(self.kernel.kernel.arg_names) | {"num_warps", "num_stages"}
        consts = {k: v for k, v in plan.constexprs.items() if k in names}
        self.kernel.specialize(**consts)(grid, recv, out, lse, rows)
        return out, lse


REF_KERNEL: Path | None = None  # --ref-kernel
_SHIPPED_ONE_VECTOR_MIN_N = a2a_mod._UNPACK_ONE_VECTOR_MIN_N


def variants() -> dict[str, Unpack]:
    forms: dict[str, Unpack] = {
        "shipped": _op_with_one_vector_min_n(_SHIPPED_ONE_VECTOR_MIN_N),
        "op one-vector off": _op_with_one_vector_min_n(0),
        "op one-vector N>=5": _op_with_one_vector_min_n(5),
    }
    if REF_KERNEL is not None:
        forms["ref kernel"] = RefKernel(REF_KERNEL, 0)
        forms["ref kernel one-vector N>=8"] = RefKernel(REF_KERNEL, 8)
    for block_r, warps in (*TILES, (4, 2), (32, 16)):
        forms[f"triton r{block_r} w{warps}"] = TriUnpack(block_r, warps)
        forms[f"triton r{block_r} w{warps} order"] = TriUnpack(block_r, warps, order=True)
        forms[f"triton r{block_r} w{warps} eager-w"] = TriUnpack(block_r, warps, eager_w=True)
        forms[f"triton r{block_r} w{warps} evict-first"] = TriUnpack(
            block_r, warps, pay_evict="evict_first"
        )
        forms[f"triton r{block_r} w{warps} .cs"] = TriUnpack(block_r, warps, out_cache=".cs")
        forms[f"triton r{block_r} w{warps} rows"] = TriUnpack(block_r, warps, rows=True)
        forms[f"triton r{block_r} w{warps} rows order"] = TriUnpack(
            block_r, warps, order=True, rows=True
        )
    for label, load in LOADS.items():
        for block_r, warps in TILES:
            forms[f"{label} r{block_r} w{warps}"] = AsmUnpack(load, block_r, warps)
    for label in ("ld.v4", "ld.nc.L2::256B"):
        for block_r, warps in TILES:
            forms[f"{label} r{block_r} w{warps} order"] = AsmUnpack(
                LOADS[label], block_r, warps, order=True
            )
    return forms


def compile_only() -> None:
    """Compile every form for sm_90 (N=8, D=128; no GPU needed): registers, and how many
    16-byte payload loads the SASS issues before its first ``MUFU`` (an ``exp2`` of the LSE
    math, which comes after the wait for the LSE loads)."""
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    args = {"recv_ptr": "*bf16", "dst_ptr": "*bf16", "lse_out_ptr": "*fp32", "num_rows": "i32",
            "zero": "i32"}  # fmt: skip
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    for name, form in variants().items():
        if not isinstance(form, AsmUnpack):
            continue
        consts = form.consts(8, 128)
        sig = {**args, **dict.fromkeys(consts, "constexpr")}
        src = ASTSource(form.kernel, sig, consts, aligned)
        opts = {"num_warps": form.num_warps}
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            dump = [str(cuobjdump), "--dump-resource-usage", f.name]
            usage = subprocess.run(dump, capture_output=True, text=True, check=True).stdout
            dump = [str(cuobjdump), "-sass", f.name]
            sass = subprocess.run(dump, capture_output=True, text=True, check=True).stdout
        regs = re.search(r"REG:(\d+)", usage)
        early = len(re.findall(r"LDG\S*\.128", sass.split("MUFU", 1)[0]))
        total = len(re.findall(r"LDG\S*\.128", sass))
        print(
            f"{name:32s} regs {regs.group(1) if regs else '?':>3s}  "
            f"payload loads before the LSE math {early}/{total}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--host-guard-us", type=float, default=100.0)
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["8,8,128", "4,16,128", "2,32,128"],
        help="N,H_r,D per timed shape (B=4096)",
    )
    parser.add_argument("--compile-only", action="store_true", help="sm_90 PTX, no GPU")
    parser.add_argument("--only", help="regular expression: the forms to check and time")
    parser.add_argument("--ref-kernel", type=Path, help="an earlier kernels/a2a.py (RefKernel)")
    args = parser.parse_args()
    global REF_KERNEL
    REF_KERNEL = args.ref_kernel
    if args.compile_only:
        compile_only()
        return
    dev = torch.device("cuda")
    # The timed (N, D) pairs (one compile each), plus a last row tile cut short (R = 404).
    shapes = [(8, 256, 8, 128), (4, 100, 16, 128), (2, 64, 32, 128), (4, 101, 4, 128)]
    forms = variants()
    passed = check(dev, shapes, forms, args.only)
    moved, ceil = hb.measure_copy_ceiling(dev, timer=hb.time_cold)
    ceiling = moved / (ceil.median_ms * 1e-3)
    print(f"copy ceiling {ceiling / 1e12:.3f} TB/s ({moved / 1e9:.2f} GB moved)")
    for shape in args.shapes:
        n, hr, d = (int(x) for x in shape.split(","))
        time_shape(dev, n, hr, d, passed, ceiling, args.rounds, args.host_guard_us, forms)


if __name__ == "__main__":
    main()
