"""Where does the eager host time of our ops go? (dev tool; GPU only)

Times, per call, on the current machine: ``torch.empty`` (CUDA), a torch ``add_``, a plain
Triton JIT launch and ``launch_cached`` of an empty kernel, then each op at a decode size, and
prints a cProfile of the ops (top functions by own time).

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src python3 benchmarks/host_profile.py
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from cpattn_common import launch_cached, merge_attn_states
from cpattn_dcp import correct_attn_out
from cpattn_dcp.ops.a2a_combine import a2a_pack, a2a_unpack_combine
from cpattn_dcp.ops.mask_empty_shards import mask_dcp_empty_shards_


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass


def per_call_us(fn: Callable[[], object], calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1024, device=dev)
    b, h, d, n = 1, 128, 512, 4
    outs = torch.randn(n, b, h, d, device=dev, dtype=torch.bfloat16)
    lses = torch.randn(n, b, h, device=dev)
    out = torch.randn(b, h, d, device=dev, dtype=torch.bfloat16)
    lse = torch.randn(b, h, device=dev)
    seq_lens = torch.ones(b, device=dev, dtype=torch.int32)
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
    send = a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl)

    cases: dict[str, Callable[[], object]] = {
        "torch.empty(1024)": lambda: torch.empty(1024, device=dev),
        "x.add_(1.0)": lambda: x.add_(1.0),
        "empty kernel plain JIT": lambda: _empty_kernel[(1,)](x, 1024, BLOCK=128),
        "empty kernel launch_cached": lambda: launch_cached(
            _empty_kernel, (1,), x_ptr=x, n=1024, BLOCK=128
        ),
        "merge_attn_states": lambda: merge_attn_states(outs, lses),
        "correct_attn_out": lambda: correct_attn_out(out, lses, 1),
        "mask_dcp_empty_shards_": lambda: mask_dcp_empty_shards_(lse, seq_lens, qsl),
        "a2a_pack": lambda: a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl),
        "a2a_unpack_combine": lambda: a2a_unpack_combine(send, head_dim=d),
    }
    for name, fn in cases.items():
        print(f"{name:32s} {per_call_us(fn):8.2f} us/call")
    for name in ("merge_attn_states", "correct_attn_out", "a2a_pack"):
        prof = cProfile.Profile()
        fn = cases[name]
        prof.enable()
        for _ in range(2000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"---- cProfile {name} (2000 calls) ----")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
