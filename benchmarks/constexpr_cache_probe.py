"""Does Triton's JIT share one binary between equal-comparing constexprs? (dev tool)

Triton 3.9's ``compute_cache_key`` was seen (on the CPU, by reading it) to key ``0.0`` and
``-0.0`` alike, and ``1`` / ``True`` / ``1.0``: a launch with one of them after the other
reuses the other's binary. ``cpattn_common.launch.launch_cached`` keys them apart, but it
caches whatever Triton's JIT returned on the first launch of a key, so it inherits the JIT's
answer. This probe launches a kernel that stores its constexpr, once per value, in a fresh
process per order (plain ``kernel[grid]`` launches, then the same through ``launch_cached``),
and prints what each launch stored: the sign of zero, and the value's integer / float / bool
reading. Run it on the device's Triton (3.6) and the development machine's (3.9, under the
interpreter, where every launch interprets the source and nothing is shared).

    PYTHONPATH=packages/cp-common/src python3 benchmarks/constexpr_cache_probe.py
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _store_constexpr(out_ptr, X: tl.constexpr):
    """out[0] = X as fp32 (the sign of a zero survives); out[1] = the bits of ``int32 0 + X``
    read as fp32: 1.0 when X is a float (the sum is fp32), 1.4e-45 when X is an int or bool
    (the sum is int32)."""
    tl.store(out_ptr, X)
    b_sum = tl.zeros([1], dtype=tl.int32) + X
    tl.store(out_ptr + 1 + tl.arange(0, 1), b_sum.to(tl.float32, bitcast=True))


def _one_order(values: list[object], cached: bool) -> None:
    from cpattn_common.launch import launch_cached

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for value in values:
        out = torch.full((2,), float("nan"), device=device)
        if cached:
            launch_cached(_store_constexpr, (1,), out_ptr=out, X=value)
        else:
            _store_constexpr[(1,)](out, X=value)
        stored = out.tolist()
        sign = "-" if math.copysign(1.0, stored[0]) < 0 else "+"
        kind = {1.0: "float", 0.0: "either (a zero's bits)"}.get(stored[1], "int/bool")
        print(f"    X={value!r:6} stored {stored[0]!r:6} (sign {sign}), compiled as {kind}")


def main() -> None:
    if len(sys.argv) > 1:  # child: one order of values
        cached = sys.argv[1] == "cached"
        values = [ast.literal_eval(v) for v in sys.argv[2:]]
        _one_order(values, cached)
        return
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    for mode in ("plain", "cached"):
        for order in (["0.0", "-0.0"], ["-0.0", "0.0"], ["1", "True", "1.0"], ["1.0", "1"]):
            print(f"  {mode} launches, order {' then '.join(order)}:")
            proc = subprocess.run(
                [sys.executable, __file__, mode, *order], capture_output=True, text=True
            )
            print(proc.stdout.rstrip() or proc.stderr.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
