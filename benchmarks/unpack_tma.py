"""The A2A unpack-combine with Hopper TMA loads, timed next to the shipped op (dev tool, GPU).

The one unmet bandwidth target of issue 5 is the unpack-combine at H=64 D=128 N=8 B=4096
(0.79-0.83 of the 2 GB copy across pages, 96% of a copy of the same bytes). Register loads
in every tile shape, persistent grids with register prefetch or ``cp.async`` pipelines,
cache modifiers and narrower records were tried before (``docs/performance-notes.md``);
tensor-memory-accelerator (TMA) loads were not. Here the payloads of the N sources are read
through a host-built ``TensorDescriptor`` over the receive buffer's payload blocks, viewed
as ``[N, R, D]`` with row stride D and source stride ``R * (D + P)`` (the block format of
``cpattn_dcp.kernels.a2a``), so that one TMA box brings a program's ``[N, BLOCK_R,
BLOCK_D]`` payload tile into shared memory with one instruction, or N boxes of ``[1,
BLOCK_R, BLOCK_D]``. Forms:

* ``tma3d``: one box of all N sources per head-dim chunk, weighted sum over axis 0;
* ``tma_per_src``: N boxes, accumulated one source at a time (the shipped math);
* ``persist``: a grid of ``PROGRAMS_PER_SM`` programs per SM looping over row tiles with
  ``tl.range(num_stages=S)``, which Triton pipelines with TMA and mbarriers on Hopper.

The LSE words are plain loads (``[N, BLOCK_R]`` int32, the shipped kernel's N > 8 layout).
Every form's output and LSE are checked against a float64 combine of the buffer (rows of
empty sources included) before it is timed (``cpattn_testing.bench.time_cold`` with a host
guard: these forms launch through Triton's JIT), next to a device copy of the same bytes
and the 2 GB copy ceiling. bf16/fp16, ``R % 4 == 0`` (TMA strides: 16-byte multiples).

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-testing/src \
        python3 benchmarks/unpack_tma.py [--rounds R] [--host-guard-us T] [--shapes N,H_r,D ...]
            [--cpu-check]
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import cpattn_testing.bench as hb
from cpattn_dcp.kernels.lse_math import _lse_f32, _lse_from, _max_sum, _weight
from cpattn_dcp.ops.a2a_combine import a2a_buffer_views, a2a_unpack_combine

Unpack = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@triton.jit
def _tile(
    pay_desc,
    lse_words_ptr,
    dst_ptr,
    lse_out_ptr,
    tile,
    num_rows,
    src_words,
    N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PER_SRC: tl.constexpr,
    IS_BASE_E: tl.constexpr,
):
    """Combine rows ``[tile * BLOCK_R, +BLOCK_R)``: LSE words, weights, TMA payloads, store."""
    r0 = tile * BLOCK_R
    i_n = tl.arange(0, N)
    i_r = r0 + tl.arange(0, BLOCK_R)
    m_r = i_r < num_rows
    m_l = (i_n[:, None] < N) & m_r[None, :]
    o_l = i_n[:, None].to(tl.int64) * src_words + i_r[None, :]
    b_bits = tl.load(lse_words_ptr + o_l, mask=m_l, other=0)
    b_l = _lse_f32(tl.where(m_l, b_bits.to(tl.float32, bitcast=True), float("-inf")))
    b_m, b_s = _max_sum(b_l, IS_BASE_E)
    b_w = _weight(b_l, b_m[None, :], (1.0 / tl.maximum(b_s, 1.0))[None, :], IS_BASE_E)
    tl.store(lse_out_ptr + i_r, _lse_from(b_m, b_s, IS_BASE_E), mask=m_r)
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        i_d = d0 + tl.arange(0, BLOCK_D)
        if PER_SRC:
            b_acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
            for n in tl.static_range(N):
                b_x = pay_desc.load([n, r0, d0]).reshape(BLOCK_R, BLOCK_D)
                b_wn = tl.sum(tl.where(i_n[:, None] == n, b_w, 0.0), axis=0)
                b_acc += tl.where(b_wn[:, None] == 0.0, 0.0, b_x.to(tl.float32) * b_wn[:, None])
        else:
            b_x = pay_desc.load([0, r0, d0])  # [N, BLOCK_R, BLOCK_D]
            b_prod = tl.where(b_w[:, :, None] == 0.0, 0.0, b_x.to(tl.float32) * b_w[:, :, None])
            b_acc = tl.sum(b_prod, axis=0)
        o_dst = i_r[:, None].to(tl.int64) * HEAD_DIM + i_d[None, :]
        tl.store(dst_ptr + o_dst, b_acc.to(dst_ptr.dtype.element_ty), mask=m_r[:, None])


@triton.jit
def _unpack_tma_kernel(
    pay_desc,
    lse_words_ptr,
    dst_ptr,
    lse_out_ptr,
    num_rows,
    src_words,
    N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PER_SRC: tl.constexpr,
    PERSIST: tl.constexpr,
    STAGES: tl.constexpr,
    IS_BASE_E: tl.constexpr,
):
    """Grid ``(cdiv(R, BLOCK_R),)``, or a persistent grid when ``PERSIST``.

    ``pay_desc``: ``[N, R, D]`` payload descriptor, box ``[N or 1, BLOCK_R, BLOCK_D]``;
    ``lse_words_ptr``: int32 view of the buffer at source 0's first LSE word, source n's at
    ``+ n * src_words``; out ``[R, D]``, lse_out ``[R]`` fp32.
    """
    if PERSIST:
        num_tiles = tl.cdiv(num_rows, BLOCK_R)
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), num_stages=STAGES):
            _tile(
                pay_desc, lse_words_ptr, dst_ptr, lse_out_ptr, tile, num_rows, src_words,
                N, HEAD_DIM, BLOCK_R, BLOCK_D, PER_SRC, IS_BASE_E,
            )  # fmt: skip
    else:
        _tile(
            pay_desc, lse_words_ptr, dst_ptr, lse_out_ptr, tl.program_id(0), num_rows,
            src_words, N, HEAD_DIM, BLOCK_R, BLOCK_D, PER_SRC, IS_BASE_E,
        )  # fmt: skip


class TmaUnpack:
    """One TMA form (see the module docstring); callable as ``(recv, d) -> (out, lse)``."""

    def __init__(
        self,
        block_r: int,
        num_warps: int,
        *,
        per_src: bool = False,
        programs_per_sm: int = 0,
        stages: int = 1,
        block_d: int = 128,
    ) -> None:
        self.block_r, self.num_warps, self.per_src = block_r, num_warps, per_src
        self.programs_per_sm, self.stages, self.block_d = programs_per_sm, stages, block_d
        self._desc: dict[tuple[int, tuple[int, ...]], TensorDescriptor] = {}

    def __call__(self, recv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, b, hr, width = recv.shape
        rows = b * hr
        block_d = min(self.block_d, d)
        if recv.element_size() != 2 or rows % 4 or d % block_d:
            raise ValueError("TMA forms: 16-bit dtypes, R % 4 == 0, D % BLOCK_D == 0")
        key = (recv.data_ptr(), tuple(recv.shape))
        desc = self._desc.get(key)
        if desc is None:  # built once per buffer, like a captured graph would
            flat = recv.view(n, rows * width)
            box = [1 if self.per_src else n, self.block_r, block_d]
            desc = TensorDescriptor(flat, [n, rows, d], [rows * width, d, 1], box)
            self._desc[key] = desc
        words = recv.view(-1).view(torch.int32)[rows * d // 2 :]
        out = torch.empty(b, hr, d, dtype=recv.dtype, device=recv.device)
        lse = torch.empty(b, hr, dtype=torch.float32, device=recv.device)
        tiles = triton.cdiv(rows, self.block_r)
        if self.programs_per_sm:
            sms = (
                torch.cuda.get_device_properties(recv.device).multi_processor_count
                if recv.is_cuda
                else 2  # the interpreter: a few programs, each looping over tiles
            )
            grid = (min(tiles, sms * self.programs_per_sm),)
        else:
            grid = (tiles,)
        _unpack_tma_kernel[grid](
            desc, words, out, lse, rows, rows * width // 2,
            N=n, HEAD_DIM=d, BLOCK_R=self.block_r, BLOCK_D=block_d, PER_SRC=self.per_src,
            PERSIST=bool(self.programs_per_sm), STAGES=self.stages, IS_BASE_E=True,
            num_warps=self.num_warps,
        )  # fmt: skip
        return out, lse


def shipped(recv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = a2a_unpack_combine(recv, head_dim=d, return_lse=True)
    assert lse is not None
    return out, lse


def variants() -> dict[str, Unpack]:
    forms: dict[str, Unpack] = {"shipped": shipped}
    for block_r, warps in ((8, 2), (8, 4), (16, 4), (32, 4), (32, 8), (64, 8)):
        forms[f"tma3d r{block_r} w{warps}"] = TmaUnpack(block_r, warps)
    for block_r, warps in ((8, 2), (16, 4), (32, 4)):
        forms[f"tma_per_src r{block_r} w{warps}"] = TmaUnpack(block_r, warps, per_src=True)
    for block_r, warps, per_sm, stages in (
        (8, 4, 8, 2), (8, 4, 8, 3), (16, 4, 4, 2), (16, 4, 4, 3), (16, 4, 8, 3),
        (32, 8, 2, 2), (32, 8, 2, 3), (32, 4, 4, 2),
    ):  # fmt: skip
        forms[f"persist r{block_r} w{warps} {per_sm}/SM s{stages}"] = TmaUnpack(
            block_r, warps, programs_per_sm=per_sm, stages=stages
        )
    return forms


def make_recv(
    n: int, b: int, hr: int, d: int, dtype: torch.dtype, device: torch.device, seed: int
) -> torch.Tensor:
    """A receive buffer ``[N, B, H_r, D + 2]`` of random payloads and LSEs; about one source in
    eight per row is empty (LSE -inf) and one row in 64 is empty on every source."""
    gen = torch.Generator(device=device).manual_seed(seed)
    recv = torch.empty(n, b, hr, d + 2, dtype=dtype, device=device)
    payload, lanes = a2a_buffer_views(recv, d)
    payload.copy_(torch.randn(n, b, hr, d, generator=gen, device=device, dtype=torch.float32))
    lse = torch.randn(n, b, hr, 1, generator=gen, device=device, dtype=torch.float32) * 3
    empty = torch.rand(n, b, hr, 1, generator=gen, device=device) < 0.125
    lse[empty] = float("-inf")
    lse[:, ::64] = float("-inf")
    lanes.copy_(lse.view(dtype))
    return recv


def reference(recv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 combine: ``(out [B, H_r, D], lse [B, H_r])``; rows with no source: 0, -inf."""
    payload, lanes = a2a_buffer_views(recv, d)
    lse = lanes.contiguous().view(torch.float32)[..., 0].double()  # [N, B, H_r]
    m = lse.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    s = w.sum(0)
    out = (payload.double() * (w / s.clamp_min(1.0))[..., None]).sum(0)
    return out, m + torch.log(s)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a64 = a.double()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(a64)) or not torch.equal(ref[~finite], a64[~finite]):
        return float("inf")
    return float((a64[finite] - ref[finite]).norm() / ref[finite].norm().clamp_min(1e-30))


def check(
    device: torch.device,
    shapes: list[tuple[int, int, int, int]],
    forms: dict[str, Unpack] | None = None,
    only: str | None = None,
) -> list[str]:
    """Names of the forms (default: ``variants()``; with ``only``, those matching it and
    ``shipped``) that passed on every shape (bf16; out 2e-2, LSE 1e-5). Prints whether each
    form's output matched the shipped op's bit for bit."""
    forms = variants() if forms is None else forms
    passed = []
    for name, fn in forms.items():
        if only is not None and name != "shipped" and not re.search(only, name):
            continue
        ok = True
        for i, (n, b, hr, d) in enumerate(shapes):
            recv = make_recv(n, b, hr, d, torch.bfloat16, device, seed=1 + i)
            ref_out, ref_lse = reference(recv, d)
            try:
                out, lse = fn(recv, d)
            except Exception as exc:  # report and go on: one form failing is a result
                print(f"  {name}: N={n} B={b} H_r={hr} D={d}: {type(exc).__name__}: {exc}")
                ok = False
                break
            e_out, e_lse = rel_err(out, ref_out), rel_err(lse, ref_lse)
            if not (e_out < 2e-2 and e_lse < 1e-5):
                print(f"  {name}: N={n} B={b} D={d}: out err {e_out:.2e}, lse err {e_lse:.2e}")
                ok = False
                break
            if not torch.equal(out.view(torch.int16), shipped(recv, d)[0].view(torch.int16)):
                print(f"  {name}: N={n} B={b} D={d}: not bit-identical to the shipped op")
        print(f"check {'ok  ' if ok else 'FAIL'} {name}")
        if ok:
            passed.append(name)
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--host-guard-us", type=float, default=100.0)
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["2,32,128", "4,16,128", "8,8,128", "8,16,512"],
        help="N,H_r,D per timed shape (B=4096)",
    )
    parser.add_argument("--cpu-check", action="store_true", help="interpreter check only")
    args = parser.parse_args()
    if args.cpu_check:
        check(torch.device("cpu"), [(2, 4, 2, 32), (4, 3, 4, 64)])
        return
    dev = torch.device("cuda")
    # TMA descriptors need a global scratch allocator only for device-side descriptors; the
    # host-side ones used here do not.
    passed = check(dev, [(8, 256, 8, 128), (4, 100, 16, 128), (2, 64, 4, 512)])
    moved, ceil = hb.measure_copy_ceiling(dev, timer=hb.time_cold)
    ceiling = moved / (ceil.median_ms * 1e-3)
    print(f"copy ceiling {ceiling / 1e12:.3f} TB/s ({moved / 1e9:.2f} GB moved)")
    for shape in args.shapes:
        n, hr, d = (int(x) for x in shape.split(","))
        time_shape(dev, n, hr, d, passed, ceiling, args.rounds, args.host_guard_us)


def time_shape(
    dev: torch.device,
    n: int,
    hr: int,
    d: int,
    names: list[str],
    ceiling: float,
    rounds: int,
    guard_us: float,
    forms: dict[str, Unpack] | None = None,
) -> None:
    """Time the forms ``names`` (of ``forms``, default ``variants()``) at B=4096 bf16 in
    interleaved rounds; print copy fractions."""
    b = 4096
    forms = variants() if forms is None else forms
    recv = make_recv(n, b, hr, d, torch.bfloat16, dev, seed=7)
    nbytes = recv.numel() * 2 + b * hr * (d * 2 + 4)
    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    print(f"\nH={n * hr} D={d} N={n} B={b}: {nbytes / 1e6:.1f} MB counted")
    calls: dict[str, Callable[[], object]] = {"copy of the same bytes": lambda: dst.copy_(src)}
    for name in names:
        calls[name] = functools.partial(forms[name], recv, d)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in list(calls.items()):
            try:
                times[name].append(hb.time_cold(call, host_guard_us=guard_us).median_ms)
            except triton.runtime.errors.OutOfResources as exc:  # e.g. a box too large at D=512
                print(f"  {name:34s} skipped: {exc}")
                del calls[name], times[name]
    for name, ms in times.items():
        fracs = " / ".join(f"{nbytes / (t * 1e-3) / ceiling:.3f}" for t in ms)
        print(f"  {name:34s} {min(ms) * 1e3:7.2f} us  copy fraction {fracs}")


if __name__ == "__main__":
    main()
