"""Per-call Python overhead of the eager ops, measured on a CPU-only machine (dev tool).

``benchmarks/host_profile.py`` times the ops on a GPU. This script measures the part of that
host time which is pure Python (argument checks, configuration look-ups, output allocation,
building the launch arguments, the launch cache's key and look-up) without a GPU: the ops
run on CPU tensors, Triton's compiled launch is replaced by a no-op, and everything else in
``cpattn_common.launch`` runs for real, including its fast path.

How: the launch cache's JIT launch (``launch._plain``) is replaced by a stub that returns a
placeholder "compiled kernel", ``launch._compiled_parts`` turns that into a no-op launcher,
and the driver look-ups (current device and stream) return constants. The first call of
each op therefore goes through the cache's slow path and stores a no-op entry; every later
call takes the same fast path (key, look-up, launcher call) a warm GPU launch takes, minus
the native launch itself. Must run *without* ``TRITON_INTERPRET=1`` (the interpreter's
kernels bypass the cache).

Differences to the GPU host: CUDA tensors cost more to allocate (caching allocator) and
the native launcher call (a few µs) is missing; the numbers are the Python part only.

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src \
        python benchmarks/host_cpu_profile.py [--calls N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise SystemExit("run host_cpu_profile.py without TRITON_INTERPRET=1")

import torch

from cpattn_common import launch as _launch
from cpattn_common.ops.merge_attn_states import merge_attn_states_fwd
from cpattn_dcp import correct_attn_out
from cpattn_dcp.ops.a2a_combine import a2a_pack, a2a_unpack_combine
from cpattn_dcp.ops.correct_attn_out import launch_correct
from cpattn_dcp.ops.mask_empty_shards import mask_dcp_empty_shards_, masked_lse_copy


class _FakeCompiled:
    """Stands in for the compiled kernel a JIT launch returns."""


def _noop_launch(*args: Any) -> None:
    """The native launcher, stubbed: accepts the full launch argument list, does nothing."""


def _stub_launches() -> None:
    """Route every launch through ``cpattn_common.launch``'s cache with a no-op launcher."""

    def plain(kernel: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> Any:
        _launch._stats["plain"] += 1
        return _FakeCompiled()

    def compiled_parts(info: Any, compiled: Any) -> tuple[Any, Any, Any]:
        info.globals = ()
        return _noop_launch, None, ()

    def resolve_driver(self: Any, rt: Any) -> None:
        self.get_device = lambda: 0
        self.get_stream = lambda device: 0

    _launch._plain = plain
    _launch._compiled_parts = compiled_parts
    _launch._KernelInfo.resolve_driver = resolve_driver  # type: ignore[method-assign]
    _launch.clear_launch_cache()


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Best of five timed loops of ``calls`` calls, in µs per call (after a warm-up)."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per timed loop")
    parser.add_argument("--profile", action="store_true", help="also print cProfile tables")
    args = parser.parse_args()
    _stub_launches()
    torch.set_num_threads(1)

    b, h, d, n = 1, 128, 512, 4  # a decode step (same shapes as host_profile.py)
    x = torch.randn(1024)
    outs = torch.randn(n, b, h, d, dtype=torch.bfloat16)
    lses = torch.randn(n, b, h)
    out = torch.randn(b, h, d, dtype=torch.bfloat16)
    lse = torch.randn(b, h)
    seq_lens = torch.ones(b, dtype=torch.int32)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    buf = torch.empty(b, h, d, dtype=torch.bfloat16)
    lse_out = torch.empty(b, h)
    recv = torch.zeros(n, b, h // n, d + 2, dtype=torch.bfloat16)

    cases: dict[str, Callable[[], object]] = {
        "torch.empty(1024) [cpu]": lambda: torch.empty(1024),
        "x.add_(1.0) [cpu]": lambda: x.add_(1.0),
        # The model the DCP ops follow (on CPU its cheap CUDA check fails: full validation).
        "merge_attn_states_fwd": lambda: merge_attn_states_fwd(outs, lses),
        "correct_attn_out": lambda: correct_attn_out(out, lses, 1),
        "correct_attn_out [B,1,H,D]": lambda: correct_attn_out(out[:, None], lses, 1),
        "launch_correct (AG+AR)": lambda: launch_correct(
            out, buf, (h * d, 0, d, 1), h, lses, lse_out, 0, 1, True
        ),
        "mask_dcp_empty_shards_": lambda: mask_dcp_empty_shards_(lse, seq_lens, qsl),
        "masked_lse_copy": lambda: masked_lse_copy(lse, seq_lens, qsl),
        # The collective ops' cheap checks accept CUDA tensors only: on CPU these two take the
        # full validation (an upper bound of their Python part).
        "a2a_pack (mask)": lambda: a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl),
        "a2a_unpack_combine": lambda: a2a_unpack_combine(recv, head_dim=d, return_lse=True),
    }
    print(f"torch {torch.__version__}; per-call host time, launches stubbed (µs)")
    for name, fn in cases.items():
        print(f"{name:32s} {per_call_us(fn, args.calls):8.2f}")
    info = _launch.launch_cache_info()
    print(f"launch cache: {info['fast']} cached (stubbed) launches, {info['plain']} JIT (stubbed)")
    if args.profile:
        for name in ("correct_attn_out", "mask_dcp_empty_shards_", "a2a_pack (mask)"):
            prof = cProfile.Profile()
            fn = cases[name]
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            print(f"---- cProfile {name} ({args.calls} calls) ----")
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
