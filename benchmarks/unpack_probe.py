"""Unpack-combine with other forms of the weighted sum (dev tool, GPU).

Written for the former record format of the A2A buffers (one 16-byte-padded record per
row): run it at commit ``49cec06``, the last with that format (``benchmarks/README.md``).

The shipped ``_wsum`` computes ``acc + (w == 0 ? 0 : w * x)`` in fp32 per element (convert,
multiply, select, add). Variants applied before the first compile (``--wsum``):

* ``sel16``: select on the 16-bit payload (``w == 0 ? 0 : x``), then ``acc + x * w`` (FMA).
* ``and``: clear the payload bits of zero-weight rows with a bitwise AND (one op per packed
  pair), then ``acc + x * w`` (FMA).

Checks every variant against the eager baseline on records where one source is an empty shard
(LSE -inf, payload NaN), then times the unpack at B=4096 (read-flush timing).

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-testing/src \
        python3 benchmarks/unpack_probe.py --wsum and
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

import cpattn_dcp.kernels.a2a as a2a_kernels
import cpattn_testing.bench as hb

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eager_baselines as eb


@triton.jit
def _wsum_sel16(b_acc, b_x, b_w):
    b_x = tl.where(b_w[:, None] == 0.0, 0.0, b_x).to(b_x.dtype)
    return b_acc + b_x.to(tl.float32) * b_w[:, None]


@triton.jit
def _wsum_and(b_acc, b_x, b_w):
    if b_x.dtype.primitive_bitwidth == 16:
        b_keep = tl.where(b_w == 0.0, 0, 0xFFFF).to(tl.uint16)
        b_bits = b_x.to(tl.uint16, bitcast=True) & b_keep[:, None]
    else:
        b_keep = tl.where(b_w == 0.0, 0, 0xFFFFFFFF).to(tl.uint32)
        b_bits = b_x.to(tl.uint32, bitcast=True) & b_keep[:, None]
    return b_acc + b_bits.to(b_x.dtype, bitcast=True).to(tl.float32) * b_w[:, None]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wsum", choices=("shipped", "sel16", "and"), default="shipped")
    parser.add_argument("--cpu-check", action="store_true", help="only the check, small shapes")
    args = parser.parse_args()
    if args.wsum != "shipped":
        a2a_kernels._wsum = {"sel16": _wsum_sel16, "and": _wsum_and}[args.wsum]
    from cpattn_dcp.ops.a2a_combine import a2a_unpack_combine

    cpu = args.cpu_check
    dev = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    # Correctness: source 1 of every row is an empty shard (LSE -inf, NaN payload).
    for dtype in (torch.bfloat16, torch.float32):
        for n in (2, 4, 8, 12):
            b, h, d = (3, n * 2, 16) if cpu else (64, n * 4, 128)
            outs = torch.randn(n, b, h, d, device=dev).to(dtype)
            lses = torch.randn(n, b, h, device=dev)
            outs[1] = float("nan")
            lses[1] = float("-inf")
            # Receiver rank 0: every source's records for heads [0, H/N).
            recv = torch.stack([eb.a2a_pack_eager(outs[r], lses[r], n)[0] for r in range(n)])
            got = a2a_unpack_combine(recv, head_dim=d, return_lse=True)[0]
            hr = h // n
            live = [r for r in range(n) if r != 1]
            glse = torch.logsumexp(lses[live, :, :hr].double(), dim=0)
            ref = sum(
                torch.exp(lses[r, :, :hr].double() - glse)[..., None] * outs[r, :, :hr].double()
                for r in live
            )
            err = ((got.double() - ref).norm() / ref.norm()).item()
            print(
                f"check {args.wsum} {dtype} N={n}: rel err {err:.1e} nan={got.isnan().any().item()}"
            )
    if cpu:
        return
    moved, t = hb.measure_copy_ceiling(dev, timer=hb.time_cold)
    copy_bps = moved / (t.median_ms * 1e-3)
    line = f"unpack wsum={args.wsum}:"
    for h, d, n in ((64, 128, 2), (64, 128, 4), (64, 128, 8), (128, 512, 4), (128, 512, 8)):
        batch = 4096
        out = torch.randn(batch, h, d, device=dev).to(torch.bfloat16)
        lse = torch.randn(batch, h, device=dev)
        recv = eb.a2a_pack_eager(out, lse, n)
        nbytes = batch * h * (d + 2) * 2 + batch * (h // n) * (d * 2 + 4)
        call = functools.partial(a2a_unpack_combine, recv, head_dim=d, return_lse=True)
        bps = nbytes / (hb.time_cold(call).median_ms * 1e-3)
        line += f"  H={h} D={d} N={n} {bps / copy_bps:.3f}"
        del out, recv
    print(line, flush=True)


if __name__ == "__main__":
    main()
