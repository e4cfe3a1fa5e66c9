"""What a decode-size kernel costs under CUDA-graph replay, piece by piece (dev tool, GPU).

Issue 5 asks for decode sizes within 1.5x of an *empty* kernel's replay time. This probe
measures, in one run and with the same timer (``cpattn_testing.bench.time_cuda_graph``, 32
calls per graph):

* ``floor``: an empty kernel at several grid sizes and warp counts (what launching and
  retiring that many programs costs), a kernel whose programs load one 16-byte vector and
  store it (one memory round trip plus a store that must drain before the kernel ends), the
  same with two dependent loads, and ``torch.Tensor.copy_`` of decode-sized buffers (inputs
  rotate over 32 sets, so they come from DRAM as in a real decode step).
* ``grid``: the ops at B in {1, 8, 64} under other minimum-grid rules (``MIN_PROGRAMS`` of
  ``cpattn_dcp.ops._common`` and ``_MIN_PROGRAMS`` of the merge), first value = shipped.

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-testing/src \
        python3 benchmarks/decode_floor.py [--skip-grid]
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

import cpattn_common.ops.merge_attn_states as merge_mod
import cpattn_dcp.ops._common as dcp_common
import cpattn_dcp.ops.a2a_combine as a2a_mod
import cpattn_dcp.ops.correct_attn_out as correct_mod
import cpattn_testing.bench as hb

sys.path.insert(0, str(Path(__file__).resolve().parent))
import variants

_SETS = 32


@triton.jit
def _nop_kernel(x_ptr):
    pass


@triton.jit
def _chain_kernel(idx_ptr, src_ptr, dst_ptr):
    """Two dependent loads per program (an index, then the vector it names), one store."""
    pid = tl.program_id(0)
    j = tl.load(idx_ptr + pid)
    i = j * 4 + tl.arange(0, 4)
    tl.store(dst_ptr + pid * 4 + tl.arange(0, 4), tl.load(src_ptr + i))


def _us(fns: list[Callable[[], object]]) -> float:
    return hb.time_cuda_graph(fns).median_ms * 1e3


def floor(dev: torch.device) -> None:
    buf = torch.empty(16, device=dev)
    line = "empty kernel (grid x warps):"
    for grid in (1, 132, 264, 528):
        for warps in (1, 4, 8):
            fn = functools.partial(_nop_kernel[(grid,)], buf, num_warps=warps)
            line += f"  {grid}x{warps} {_us([fn] * _SETS):.2f}"
    print(line + " us", flush=True)
    line = "load+store one vector per program (grid x warps):"
    for grid in (1, 132, 264):
        for warps in (1, 4):
            t = hb.measure_touch_kernel_graph(
                dev, calls_per_graph=_SETS, grid=grid, num_warps=warps
            )
            line += f"  {grid}x{warps} {t.median_ms * 1e3:.2f}"
    print(line + " us", flush=True)
    line = "two dependent loads + store per program (grid, 1 warp):"
    for grid in (1, 132):
        idx = [torch.randperm(grid, device=dev, dtype=torch.int32) for _ in range(_SETS)]
        srcs = [torch.randn(grid * 4, device=dev) for _ in range(_SETS)]
        dsts = [torch.empty_like(s) for s in srcs]
        fns = [
            functools.partial(_chain_kernel[(grid,)], i, s, d, num_warps=1)
            for i, s, d in zip(idx, srcs, dsts, strict=True)
        ]
        line += f"  {grid} {_us(fns):.2f}"
    print(line + " us", flush=True)
    line = "torch copy_ (bytes read):"
    for kib in (16, 128, 1024, 4096, 16384):
        n = kib * 1024 // 2
        sets = 8 if kib >= 4096 else _SETS
        srcs = [torch.randn(n, device=dev).to(torch.bfloat16) for _ in range(sets)]
        dsts = [torch.empty_like(s) for s in srcs]
        fns = [functools.partial(d.copy_, s) for s, d in zip(srcs, dsts, strict=True)]
        line += f"  {kib} KiB {_us(fns * (_SETS // sets)):.2f}"
    print(line + " us", flush=True)


def _set_min_programs(dcp: int, merge: int) -> None:
    dcp_common.MIN_PROGRAMS = dcp
    a2a_mod.MIN_PROGRAMS = dcp
    merge_mod._MIN_PROGRAMS = merge
    for fn in (
        dcp_common.tile_config,
        correct_mod._correct_config,
        correct_mod._general_plan,
        correct_mod._contig_plan,
        a2a_mod._pack_plan,
        a2a_mod._unpack_config,
        a2a_mod._unpack_plan,
        merge_mod.merge_attn_states_config,
        merge_mod.merge_attn_states_block_sizes,
    ):
        fn.cache_clear()


def grid(dev: torch.device) -> None:
    shipped = (dcp_common.MIN_PROGRAMS, merge_mod._MIN_PROGRAMS)
    rules = [shipped, (132, 132), (66, 66), (16, 16)]
    for h, d, n in ((128, 512, 8), (128, 512, 2), (64, 128, 4)):
        for b in (1, 8, 64):
            sets = [variants._inputs(dev, b, h, d, n, i) for i in range(_SETS)]
            line = f"H={h} D={d} N={n} B={b}:"
            for name, op in variants._ops(n, d).items():
                if name == "pack":
                    continue
                line += f"  {name}"
                for rule in rules:
                    _set_min_programs(*rule)
                    fns = [functools.partial(op, t) for t in sets]
                    line += f" {_us(fns):.2f}"
            _set_min_programs(*shipped)
            print(line + f"  (us; min programs {rules})", flush=True)
            del sets
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-grid", action="store_true")
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    floor(dev)
    if not args.skip_grid:
        grid(dev)


if __name__ == "__main__":
    main()
