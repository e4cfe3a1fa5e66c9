"""Timing helpers for CP code on a GPU: per-call times (:func:`time_cold`,
:func:`time_cuda_graph`, :func:`time_wall`), host times (:func:`measure_host_rounds`), reference
points (copy bandwidth, empty and one-vector kernels) and :func:`environment_stamp`. Every
:class:`Timing` is in milliseconds per call; warm-up calls are never timed.
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = [
    "DEFAULT_L2_BYTES",
    "QUANTILES",
    "HostRounds",
    "Timing",
    "empty_kernel_launcher",
    "environment_stamp",
    "host_reference_add",
    "l2_cache_bytes",
    "measure_copy_ceiling",
    "measure_copy_graph",
    "measure_empty_kernel_graph",
    "measure_host_overhead",
    "measure_host_ratio",
    "measure_host_rounds",
    "measure_reference_host_times",
    "measure_touch_kernel_graph",
    "rotation_count",
    "time_cold",
    "time_cuda_graph",
    "time_wall",
]

#: Reported quantiles: median first, then the 20th and 80th percentiles.
QUANTILES: tuple[float, float, float] = (0.5, 0.2, 0.8)
#: Used when the device does not report its L2 size (H200: about 60 MB).
DEFAULT_L2_BYTES = 60 * 1000 * 1000

TimingMethod = Literal["cold", "cuda_graph", "wall"]


@dataclass(frozen=True)
class Timing:
    """One timed quantity, milliseconds per call: median and the 20th/80th percentiles."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    method: TimingMethod


def _quantile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of a non-empty sample."""
    if not samples:
        raise ValueError("quantile of an empty sample")
    ordered = sorted(samples)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _timing_from_samples(samples: Sequence[float], method: TimingMethod) -> Timing:
    return Timing(
        median_ms=_quantile(samples, QUANTILES[0]),
        p20_ms=_quantile(samples, QUANTILES[1]),
        p80_ms=_quantile(samples, QUANTILES[2]),
        method=method,
    )


_FLUSH_BUFFERS: dict[str, torch.Tensor] = {}


def time_cold(
    fn: Callable[[], object],
    *,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    flush_bytes: int = 256 * 1024 * 1024,
    host_guard_us: float = 0.0,
) -> Timing:
    """Per-call time with L2 emptied by a *read* of ``flush_bytes`` before every call (no dirty
    write-back competes, unlike ``do_bench``'s zero-fill), each call timed by its own CUDA
    events: warm-up for ``warmup_ms``, samples for ``rep_ms``. ``host_guard_us``: the GPU sleeps
    this long after each flush so that a slow host path is enqueued before its start event."""
    dev = torch.cuda.current_device()
    key = f"{dev}:{flush_bytes}"
    buf = _FLUSH_BUFFERS.get(key)
    if buf is None:
        buf = torch.zeros(flush_bytes // 4, dtype=torch.float32, device=dev)
        _FLUSH_BUFFERS[key] = buf
    sink = torch.empty((), dtype=torch.float32, device=dev)

    def flush() -> None:
        torch.sum(buf, dim=0, out=sink)

    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    end.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)  # includes the flush: conservative
    for _ in range(max(1, int(warmup_ms / estimate))):
        flush()
        fn()
    reps = max(1, int(rep_ms / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]  # type: ignore[no-untyped-call]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]  # type: ignore[no-untyped-call]
    guard_cycles = int(host_guard_us * 2000)
    for i in range(reps):
        flush()
        if guard_cycles:
            torch.cuda._sleep(guard_cycles)  # type: ignore[no-untyped-call]
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    samples = [a.elapsed_time(b) for a, b in zip(starts, ends, strict=True)]
    return _timing_from_samples(samples, "cold")


def time_cuda_graph(
    fns: Sequence[Callable[[], object]],
    *,
    repeats: int = 20,
    target_ms_per_repeat: float = 1.0,
    warmup_calls: int = 3,
) -> Timing:
    """Per-call time of ``fns`` (one call each) captured back to back into one CUDA graph:
    warmed up on a side stream, then replayed to fill ``target_ms_per_repeat`` per sample.
    Raises whatever capture raises (callers fall back to :func:`time_cold`).
    """
    if not fns:
        raise ValueError("time_cuda_graph needs at least one function")
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_calls):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    # Warm replays, and an estimate of one replay's duration.
    for _ in range(3):
        graph.replay()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    per_replay_ms = max(start.elapsed_time(end), 1e-4)
    replays = max(1, min(10_000, math.ceil(target_ms_per_repeat / per_replay_ms)))
    samples: list[float] = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / (replays * len(fns)))
    del graph
    return _timing_from_samples(samples, "cuda_graph")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_wall(fn: Callable[[], object], *, calls: int = 5, rounds: int = 3) -> Timing:
    """Wall-clock time per call (CPU smoke mode; synchronises CUDA if it is in use)."""
    fn()
    _sync()
    samples: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return _timing_from_samples(samples, "wall")


def measure_host_overhead(fn: Callable[[], object], *, calls: int = 200, rounds: int = 7) -> Timing:
    """Host (CPU) time per eager call of ``fn`` (small work, so the device keeps up), the
    device synchronised between rounds outside the timed region (method ``"wall"``)."""
    return measure_host_rounds({"fn": fn}, calls=calls, rounds=rounds).timing("fn")


def _host_loop_ms(fn: Callable[[], object], calls: int) -> float:
    """Host milliseconds per call of a loop of ``calls`` calls of ``fn``."""
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3 / calls


@dataclass(frozen=True)
class HostRounds:
    """Host times of several functions measured in the same rounds (:func:`measure_host_rounds`).

    ``samples_ms[name]`` holds one figure per round: milliseconds per call of ``name``.
    """

    samples_ms: dict[str, list[float]]

    def timing(self, name: str) -> Timing:
        """Median and 20th/80th percentiles over the rounds of ``name``."""
        return _timing_from_samples(self.samples_ms[name], "wall")

    def ratio(self, name: str, ref: str) -> float:
        """Median over rounds of ``name``'s time over ``ref``'s in the same round."""
        pairs = zip(self.samples_ms[name], self.samples_ms[ref], strict=True)
        return _quantile([t / max(r, 1e-9) for t, r in pairs], 0.5)


def measure_host_rounds(
    fns: Mapping[str, Callable[[], object]], *, calls: int = 200, rounds: int = 7
) -> HostRounds:
    """Host time per eager call of each function, all timed in the same rounds (``calls``
    calls of each in turn), so that a per-round ratio (:meth:`HostRounds.ratio`) survives a
    host whose speed drifts.
    """
    if not fns:
        raise ValueError("measure_host_rounds needs at least one function")
    for _ in range(3):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(_host_loop_ms(fn, calls))
    _sync()
    return HostRounds(samples)


def measure_host_ratio(
    fn: Callable[[], object], ref: Callable[[], object], *, calls: int = 200, rounds: int = 7
) -> tuple[Timing, Timing, float]:
    """``(fn timing, ref timing, median over rounds of fn / ref)`` of
    :func:`measure_host_rounds` with ``ref`` first."""
    timed = measure_host_rounds({"ref": ref, "fn": fn}, calls=calls, rounds=rounds)
    return timed.timing("fn"), timed.timing("ref"), timed.ratio("fn", "ref")


def host_reference_add(device: torch.device) -> Callable[[], object]:
    """The host-time reference op: an eager ``add_`` of two 1024-element fp32 tensors."""
    x = torch.zeros(1024, device=device, dtype=torch.float32)
    y = torch.ones_like(x)
    return lambda: x.add_(y)


def l2_cache_bytes(device: torch.device) -> int:
    """The device's L2 size in bytes (``DEFAULT_L2_BYTES`` when unknown or on the CPU)."""
    if device.type == "cuda":
        size = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
        if size > 0:
            return size
    return DEFAULT_L2_BYTES


def rotation_count(bytes_per_set: int, l2_bytes: int, *, max_sets: int = 32) -> int:
    """How many distinct input sets to rotate through so a timed loop does not sit in L2.

    Enough sets to cover twice the L2 size, at most ``max_sets``; 1 when one set already does.
    """
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be positive, got {bytes_per_set}")
    if bytes_per_set >= 2 * l2_bytes:
        return 1
    return max(1, min(max_sets, math.ceil(2 * l2_bytes / bytes_per_set)))


def measure_copy_ceiling(
    device: torch.device,
    *,
    nbytes: int = 1 << 30,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    timer: Callable[..., Timing] | None = None,
) -> tuple[int, Timing]:
    """Device-to-device copy of ``nbytes`` (``dst.copy_(src)``).

    Returns ``(bytes_moved, timing)`` with ``bytes_moved = 2 * nbytes`` (read + write), so
    ``bytes_moved / time`` is directly comparable with a kernel's read + write bytes.
    """
    numel = nbytes // 2
    src = torch.randn(numel, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * src.element_size()
    if device.type == "cuda":
        timing = (timer or time_cold)(lambda: dst.copy_(src), warmup_ms=warmup_ms, rep_ms=rep_ms)
    else:
        timing = time_wall(lambda: dst.copy_(src))
    return moved, timing


def measure_copy_graph(
    device: torch.device, *, nbytes: int, sets: int, calls_per_graph: int = 1
) -> tuple[int, Timing]:
    """Graph-replay time per call of a bf16 device copy of ``nbytes`` over ``sets`` rotating
    buffer pairs, ``max(calls_per_graph, sets)`` calls per graph: the floor of a decode-size
    kernel moving the same bytes. Returns ``(bytes_moved, timing)`` as
    :func:`measure_copy_ceiling`.
    """
    if sets < 1 or calls_per_graph < 1:
        raise ValueError(f"sets and calls_per_graph must be >= 1, got {sets}, {calls_per_graph}")
    numel = max(1, nbytes // 2)
    pairs = [
        (
            torch.randn(numel, device=device).to(torch.bfloat16),
            torch.empty(numel, device=device, dtype=torch.bfloat16),
        )
        for _ in range(sets)
    ]
    fns = [functools.partial(dst.copy_, src) for src, dst in pairs]
    calls = [fns[i % sets] for i in range(max(calls_per_graph, sets))]
    timing = time_cuda_graph(calls) if device.type == "cuda" else time_wall(fns[0])
    return 4 * numel, timing


@functools.cache
def empty_kernel_launcher(device: torch.device) -> Callable[[], object]:
    """A callable that launches an empty Triton kernel (one unused pointer argument) the plain
    way, ``kernel[grid](...)``."""
    import triton

    @triton.jit
    def _cpattn_bench_empty_kernel(x_ptr):  # type: ignore[no-untyped-def]
        pass

    buf = torch.empty(16, device=device, dtype=torch.float32)

    return lambda: _cpattn_bench_empty_kernel[(1,)](buf)


@functools.cache
def _touch_kernel() -> Any:
    """The Triton kernel of :func:`measure_touch_kernel_graph`."""
    import triton
    import triton.language as tl

    @triton.jit
    def _cpattn_bench_touch_kernel(src_ptr, dst_ptr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * 4 + tl.arange(0, 4)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs))

    return _cpattn_bench_touch_kernel


def measure_touch_kernel_graph(
    device: torch.device, *, calls_per_graph: int = 32, grid: int = 1, num_warps: int = 1
) -> Timing:
    """Per-launch time inside a replayed CUDA graph of the smallest kernel that reads and
    writes memory (each of ``grid`` programs loads and stores one 16-byte vector, rotating over
    ``calls_per_graph`` buffer pairs that stay in L2): the floor of every decode-size op.
    """
    kernel = _touch_kernel()[(grid,)]
    pairs = [
        (torch.randn(4 * grid, device=device), torch.empty(4 * grid, device=device))
        for _ in range(calls_per_graph)
    ]
    fns = [functools.partial(kernel, src, dst, num_warps=num_warps) for src, dst in pairs]
    if device.type != "cuda":
        return time_wall(fns[0])
    return time_cuda_graph(fns)


def measure_empty_kernel_graph(device: torch.device, *, calls_per_graph: int = 32) -> Timing:
    """Per-launch time of an empty Triton kernel inside a replayed CUDA graph (as
    :func:`time_cuda_graph` measures decode-size ops)."""
    launch = empty_kernel_launcher(device)
    if device.type != "cuda":
        return time_wall(launch)
    return time_cuda_graph([launch] * calls_per_graph)


def measure_reference_host_times(
    device: torch.device, *, calls: int = 200, rounds: int = 7
) -> dict[str, Timing]:
    """Host time per eager call of ``torch.Tensor.add_`` and of a plain Triton JIT launch of an
    empty kernel, keys ``"torch_add_"`` and ``"triton_jit_launch"``."""
    add = host_reference_add(device)
    launch = empty_kernel_launcher(device)
    return {
        "torch_add_": measure_host_overhead(add, calls=calls, rounds=rounds),
        "triton_jit_launch": measure_host_overhead(launch, calls=calls, rounds=rounds),
    }


def _run_quiet(cmd: Sequence[str], cwd: str | None = None) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def environment_stamp(
    *, commit: str | None = None, repo_root: str | Path | None = None
) -> dict[str, str]:
    """Hardware and software stamp of this run (all values strings; "unknown" when absent).

    Keys: ``date`` (UTC, ISO 8601), ``device``, ``device_count``, ``driver``, ``cuda``,
    ``torch``, ``triton``, ``python``, ``platform``, ``git_commit``, ``l2_cache_bytes``.
    ``commit`` (or env ``CPATTN_BENCH_COMMIT``) wins over ``git rev-parse``.
    """
    stamp: dict[str, str] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": str(torch.version.cuda or "none"),
    }
    try:
        import triton

        stamp["triton"] = str(triton.__version__)
    except ImportError:
        stamp["triton"] = "not installed"
    if torch.cuda.is_available():
        stamp["device"] = torch.cuda.get_device_name(0)
        stamp["device_count"] = str(torch.cuda.device_count())
        props = torch.cuda.get_device_properties(0)
        stamp["sm_count"] = str(props.multi_processor_count)
        stamp["memory_gib"] = f"{props.total_memory / 2**30:.1f}"
        stamp["l2_cache_bytes"] = str(l2_cache_bytes(torch.device("cuda", 0)))
        driver = _run_quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        stamp["driver"] = driver.splitlines()[0] if driver else "unknown"
    else:
        stamp["device"] = f"cpu ({platform.processor() or platform.machine()})"
        stamp["device_count"] = "0"
        stamp["driver"] = "none"
        stamp["l2_cache_bytes"] = str(DEFAULT_L2_BYTES)
    sha = commit or os.environ.get("CPATTN_BENCH_COMMIT")
    if not sha:
        root = str(repo_root) if repo_root is not None else None
        sha = _run_quiet(["git", "rev-parse", "HEAD"], cwd=root)
        if sha and _run_quiet(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root):
            sha += "+dirty"
    stamp["git_commit"] = sha or "unknown"
    return stamp
