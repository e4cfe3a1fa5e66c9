"""Benchmark harness (dev-only): timing, reference ceilings, results file, targets, report.

Used by ``benchmarks/run.py``; nothing in the runtime packages imports it. The pieces:

- **Timing.** :func:`time_cold` times each call with CUDA events after emptying L2 by a
  read (the bandwidth rows and the copy ceiling); :func:`time_do_bench` is
  ``triton.testing.do_bench`` with quantiles ``[0.5, 0.2, 0.8]`` (its zero-fill flush leaves
  L2 dirty, which slows calls that move only a few L2-sizes: see :func:`time_cold`). Both
  make a warm-up call first (so JIT compilation and autotuning are never timed).
  :func:`time_cuda_graph` captures ``K`` calls into one CUDA graph and times replays with CUDA
  events (used for decode sizes, where launch latency dominates). :func:`time_wall` is the CPU
  fallback used by the smoke mode. All return a :class:`Timing` in milliseconds *per call*.
- **Reference points**, measured in the same run as the kernels: device-to-device copy
  bandwidth (:func:`measure_copy_ceiling`, read + write bytes counted), an empty Triton
  kernel's per-launch time inside a replayed CUDA graph (:func:`measure_empty_kernel_graph`)
  and that of a kernel which only loads and stores one vector (:func:`measure_touch_kernel_graph`),
  the replay time of a device copy moving a decode row's bytes (:func:`measure_copy_graph`),
  host time of an eager ``torch.Tensor.add_`` and of a plain Triton JIT launch
  (:func:`measure_host_overhead`).
- **Results file.** :class:`Results` (and the row dataclasses) serialise to JSON
  (:func:`results_to_dict` / :func:`results_from_dict`); :func:`validate_results_dict` checks a
  loaded file against the schema.
- **Targets.** :class:`Target` declares a threshold over a set of rows; :func:`evaluate_target`
  returns ``met`` / ``not met`` / ``incomplete`` / ``not measured`` with the worst value.
- **Report.** :func:`render_markdown` writes the performance page; :func:`plot_bandwidth` the
  PNG (achieved TB/s against B, one line per kernel, copy ceiling drawn).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = [
    "DEFAULT_L2_BYTES",
    "QUANTILES",
    "SCHEMA",
    "CollectiveRow",
    "HostRounds",
    "HostRow",
    "KernelRow",
    "References",
    "Results",
    "Target",
    "TargetResult",
    "Timing",
    "empty_kernel_launcher",
    "environment_stamp",
    "evaluate_target",
    "format_bytes",
    "host_reference_add",
    "host_reference_add_out",
    "l2_cache_bytes",
    "load_results",
    "measure_copy_ceiling",
    "measure_copy_graph",
    "measure_empty_kernel_graph",
    "measure_host_overhead",
    "measure_host_ratio",
    "measure_host_rounds",
    "measure_touch_kernel_graph",
    "merge_results",
    "plot_bandwidth",
    "render_markdown",
    "results_from_dict",
    "results_to_dict",
    "rotation_count",
    "save_results",
    "time_cold",
    "time_cuda_graph",
    "time_do_bench",
    "time_wall",
    "validate_results_dict",
]

SCHEMA = "cpattn-bench/1"
#: do_bench quantiles: median first, then the 20th and 80th percentiles.
QUANTILES: tuple[float, float, float] = (0.5, 0.2, 0.8)
#: Used when the device does not report its L2 size (H200: about 60 MB).
DEFAULT_L2_BYTES = 60 * 1000 * 1000

TimingMethod = Literal["do_bench", "cold", "cuda_graph", "wall"]


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """One timed quantity, milliseconds per call: median and the 20th/80th percentiles."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    method: TimingMethod


def _quantile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of a non-empty sample (no numpy needed)."""
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


def time_do_bench(
    fn: Callable[[], object], *, warmup_ms: float = 25.0, rep_ms: float = 100.0
) -> Timing:
    """``triton.testing.do_bench`` (L2 flushed before every call) with quantiles [0.5, 0.2, 0.8].

    ``fn`` is called once before (JIT compile / autotune) and do_bench warms up for
    ``warmup_ms`` on top of that.
    """
    import triton.testing

    fn()
    torch.cuda.synchronize()
    q = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES))
    median, p20, p80 = (float(x) for x in q)
    return Timing(median_ms=median, p20_ms=p20, p80_ms=p80, method="do_bench")


_FLUSH_BUFFERS: dict[str, torch.Tensor] = {}


def time_cold(
    fn: Callable[[], object],
    *,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    flush_bytes: int = 256 * 1024 * 1024,
    host_guard_us: float = 0.0,
) -> Timing:
    """Per-call time with L2 emptied by a *read* before every call; otherwise like do_bench.

    ``triton.testing.do_bench`` empties L2 by zero-filling a 256 MB buffer, so the timed call
    starts with L2 full of *dirty* lines whose write-back then competes with it. For a call
    that moves a few L2-sizes of data that is a large distortion (H200, bf16, B=4096, H=64,
    D=128: the A2A unpack-combine measured 0.61 of the copy bandwidth with do_bench, ncu
    timed the same kernel at 23 µs, about 0.87); a 2 GB copy hardly notices. Here a reduction
    reads ``flush_bytes`` instead (the evicted dirty lines are written back during the flush,
    before the start event), then each call is timed with its own pair of CUDA events: warm-up
    for ``warmup_ms``, samples for ``rep_ms``, quantiles ``[0.5, 0.2, 0.8]``.

    ``host_guard_us``: the GPU also waits about this long (``torch.cuda._sleep``, cycles at
    2 GHz) after each flush, before the start event. The host enqueues flush, events and call
    back to back without waiting; if one iteration's host time exceeds the GPU's, the start
    event fires before the call is enqueued and the sample includes host time. A call with a
    slow host path (a plain Triton JIT launch: 12-40 µs on the H200's host) needs the guard;
    the page's ops (cached launches, flush + call >= 80 µs on the GPU) run without it.
    """
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
    """Per-call time of ``fns`` captured back to back into one CUDA graph, timed by replays.

    Each entry of ``fns`` is one call (typically the same op on rotating input buffers). The
    functions are warmed up on a side stream (compilation, autotuning, allocator), captured
    once, then the graph is replayed enough times per repeat to fill ``target_ms_per_repeat``;
    each repeat is one sample of ``elapsed / (replays * len(fns))``.

    Raises whatever capture raises (e.g. an op that synchronises with the host); callers fall
    back to :func:`time_do_bench`.
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
    """Host (CPU) time per eager call of ``fn``, without waiting for the device.

    ``fn`` should launch small work (decode-size tensors) so the device keeps up and the loop
    measures dispatch, validation and launch cost. The device is synchronised between rounds,
    outside the timed region. Returns milliseconds per call (method ``"wall"``).
    """
    for _ in range(3):
        fn()
    samples = [_host_loop_ms(fn, calls) for _ in range(rounds)]
    _sync()
    return _timing_from_samples(samples, "wall")


def _host_loop_ms(fn: Callable[[], object], calls: int) -> float:
    """Milliseconds per call of a loop of ``calls`` calls of ``fn``, timed on the host without
    waiting for the device (which is synchronised first, outside the timed region)."""
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
    """Host time per eager call of each function, all timed in the same rounds.

    Each round times ``calls`` calls of every function in turn, in ``fns``' order (the device
    synchronised before each loop, outside the timed region). A ratio of two functions is
    then taken per round (:meth:`HostRounds.ratio`): each compares loops run a few
    milliseconds apart, so a host whose speed drifts during a run (a shared machine) affects
    both sides alike, where a ratio of two separately measured medians would not. One call
    times an op against several references without timing the op again for each.
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
    """Host time per eager call of ``fn`` and of ``ref`` in alternating rounds, and their ratio.

    :func:`measure_host_rounds` with ``ref`` first: returns ``(fn timing, ref timing, median
    over rounds of fn / ref)``.
    """
    timed = measure_host_rounds({"ref": ref, "fn": fn}, calls=calls, rounds=rounds)
    return timed.timing("fn"), timed.timing("ref"), timed.ratio("fn", "ref")


def host_reference_add(device: torch.device) -> Callable[[], object]:
    """The host-time reference op: an eager ``add_`` of two 1024-element fp32 tensors."""
    x = torch.zeros(1024, device=device, dtype=torch.float32)
    y = torch.ones_like(x)
    return lambda: x.add_(y)


def host_reference_add_out(device: torch.device) -> Callable[[], object]:
    """A second host-time reference: an eager out-of-place ``torch.add`` of two 1024-element
    fp32 tensors, a plain torch op that allocates its output and launches one kernel (as our
    ops do; ``add_`` allocates nothing)."""
    x = torch.zeros(1024, device=device, dtype=torch.float32)
    y = torch.ones_like(x)
    return lambda: torch.add(x, y)


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


# --------------------------------------------------------------------------------------------
# Reference measurements
# --------------------------------------------------------------------------------------------


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
        timing = (timer or time_do_bench)(
            lambda: dst.copy_(src), warmup_ms=warmup_ms, rep_ms=rep_ms
        )
    else:
        timing = time_wall(lambda: dst.copy_(src))
    return moved, timing


def measure_copy_graph(
    device: torch.device, *, nbytes: int, sets: int, calls_per_graph: int = 1
) -> tuple[int, Timing]:
    """Graph-replay time per call of a device copy of ``nbytes`` (``dst.copy_(src)``, bf16)
    over ``sets`` rotating buffer pairs (:func:`time_cuda_graph`, like a decode-size row),
    ``max(calls_per_graph, sets)`` calls per graph: pass the rows' count, since the replay's
    own launch cost is spread over the calls of a graph.

    The floor of a decode-size kernel that moves the same bytes: launch, DRAM latency and
    ramp included. Returns ``(bytes_moved, timing)`` with ``bytes_moved = 2 * nbytes`` rounded
    to whole elements (read + write), as :func:`measure_copy_ceiling`.
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


_EMPTY_LAUNCHERS: dict[str, Callable[[], object]] = {}


def empty_kernel_launcher(device: torch.device, *, cached: bool = False) -> Callable[[], object]:
    """A callable that launches an empty Triton kernel (one unused pointer argument): the
    plain way (``kernel[grid](...)``), or through ``cpattn_common.launch_cached``."""
    key = f"{device}:{cached}"
    if key in _EMPTY_LAUNCHERS:
        return _EMPTY_LAUNCHERS[key]
    import triton

    @triton.jit
    def _cpattn_bench_empty_kernel(x_ptr):  # type: ignore[no-untyped-def]
        pass

    buf = torch.empty(16, device=device, dtype=torch.float32)

    def launch() -> object:
        return _cpattn_bench_empty_kernel[(1,)](buf)

    def launch_cached() -> object:
        from cpattn_common.launch import launch_cached as cached_launch

        cached_launch(_cpattn_bench_empty_kernel, (1,), x_ptr=buf)
        return None

    _EMPTY_LAUNCHERS[key] = launch_cached if cached else launch
    return _EMPTY_LAUNCHERS[key]


_TOUCH_KERNELS: list[Any] = []


def _touch_kernel() -> Any:
    """The Triton kernel of :func:`measure_touch_kernel_graph` (defined once, on first use)."""
    if not _TOUCH_KERNELS:
        import triton
        import triton.language as tl

        @triton.jit
        def _cpattn_bench_touch_kernel(src_ptr, dst_ptr):  # type: ignore[no-untyped-def]
            offs = tl.program_id(0) * 4 + tl.arange(0, 4)
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs))

        _TOUCH_KERNELS.append(_cpattn_bench_touch_kernel)
    return _TOUCH_KERNELS[0]


def measure_touch_kernel_graph(
    device: torch.device, *, calls_per_graph: int = 32, grid: int = 1, num_warps: int = 1
) -> Timing:
    """Per-launch time inside a replayed CUDA graph of the smallest kernel that reads and
    writes memory: each of ``grid`` programs loads one 16-byte vector and stores it (rotating
    over ``calls_per_graph`` buffer pairs, as decode-size rows rotate their inputs; at these
    sizes both stay in L2 across replays, so this is the floor of an L2 round trip, the one
    those rows pay).

    The difference to :func:`measure_empty_kernel_graph` is one memory round trip plus a store
    that must complete before the kernel ends: a floor for every decode-size op, none of which
    can do less.
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
    """Per-launch time of an empty Triton kernel inside a replayed CUDA graph.

    Measured exactly like :func:`time_cuda_graph` measures decode-size ops (same number of
    calls per graph), so the ratio of the two is the decode-latency figure of merit.
    """
    launch = empty_kernel_launcher(device)
    if device.type != "cuda":
        return time_wall(launch)
    return time_cuda_graph([launch] * calls_per_graph)


def measure_reference_host_times(
    device: torch.device, *, calls: int = 200, rounds: int = 7
) -> dict[str, Timing]:
    """Host time per eager call of ``torch.Tensor.add_`` and of a plain Triton JIT launch of an
    empty kernel. (``cpattn_common.launch_cached`` of the same kernel is timed against
    ``add_`` with :func:`measure_host_ratio`, like the ops.)"""
    add = host_reference_add(device)
    launch = empty_kernel_launcher(device)
    return {
        "torch_add_": measure_host_overhead(add, calls=calls, rounds=rounds),
        "triton_jit_launch": measure_host_overhead(launch, calls=calls, rounds=rounds),
    }


# --------------------------------------------------------------------------------------------
# Environment stamp
# --------------------------------------------------------------------------------------------


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
    ``commit`` (or env ``CPATTN_BENCH_COMMIT``) wins over ``git rev-parse`` (a GPU box that
    received a copy of the tree without ``.git`` cannot ask git).
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


# --------------------------------------------------------------------------------------------
# Results (the JSON file)
# --------------------------------------------------------------------------------------------


@dataclass
class KernelRow:
    """One kernel at one shape: our op timed, the eager PyTorch baseline timed, derived ratios.

    ``N``/``D`` are 0 where the op does not depend on them (the empty-shard mask).
    ``bytes`` follows ``byte_formula`` (each input read once, each output written once).
    """

    kernel: str
    dtype: str
    H: int
    D: int
    N: int
    B: int
    bytes: int
    byte_formula: str
    timing: str = "none"
    ms: float | None = None
    ms_p20: float | None = None
    ms_p80: float | None = None
    bytes_per_s: float | None = None
    copy_ratio: float | None = None
    # Fraction of what a device copy moving the same bytes reaches (same timer: cold, or graph
    # replay over as many rotating buffers): the ceiling at this size, where launch and ramp
    # costs are not hidden as in the large copy.
    size_copy_ratio: float | None = None
    eager_timing: str = "none"
    eager_ms: float | None = None
    eager_speedup: float | None = None
    empty_graph_ratio: float | None = None
    floor_ratio: float | None = None
    check_rel_err: float | None = None
    input_sets: int = 1
    status: str = "ok"


@dataclass
class HostRow:
    """Host time of one eager call of ``kernel`` (decode-size input) and of the references."""

    kernel: str
    dtype: str
    H: int
    D: int
    N: int
    B: int
    host_us: float | None = None
    eager_baseline_host_us: float | None = None
    add_us: float | None = None
    ratio_to_add: float | None = None
    # Against an allocating torch op (out-of-place torch.add), timed the same way.
    add_out_us: float | None = None
    ratio_to_add_out: float | None = None
    status: str = "ok"


@dataclass
class CollectiveRow:
    """One collective (ours or bare NCCL) at one shape, max over ranks of the per-rank median."""

    op: str
    world_size: int
    dtype: str
    H: int
    D: int
    B: int
    bytes: int
    byte_formula: str
    latency_us: float | None = None
    algbw_bytes_per_s: float | None = None
    busbw_bytes_per_s: float | None = None
    status: str = "ok"


@dataclass
class References:
    """Reference points measured in the same run."""

    copy_bytes: int = 0
    copy_ms: float | None = None
    copy_bytes_per_s: float | None = None
    empty_graph_us: float | None = None
    touch_graph_us: float | None = None
    empty_launch_host_us: float | None = None
    add_host_us: float | None = None
    calls_per_graph: int = 32
    l2_bytes: int = DEFAULT_L2_BYTES
    copy_timing: str = "do_bench"
    host_calls: int = 200
    host_rounds: int = 7


@dataclass
class Results:
    """Everything one run produced; serialised as the results JSON file."""

    env: dict[str, str]
    mode: str
    references: References
    kernel_status: dict[str, str] = field(default_factory=dict)
    kernels: list[KernelRow] = field(default_factory=list)
    host: list[HostRow] = field(default_factory=list)
    collectives_status: str = "not run"
    collectives: list[CollectiveRow] = field(default_factory=list)
    byte_formulas: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    elapsed_s: float | None = None
    schema: str = SCHEMA


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def results_to_dict(results: Results) -> dict[str, Any]:
    """Plain-JSON form of ``results`` (non-finite numbers become ``null``: strict JSON)."""
    data: dict[str, Any] = _finite_or_none(dataclasses.asdict(results))
    return data


def _build(cls: type[Any], data: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def results_from_dict(data: Mapping[str, Any]) -> Results:
    """Inverse of :func:`results_to_dict` (unknown keys are ignored; raises on schema errors)."""
    errors = validate_results_dict(data)
    if errors:
        raise ValueError("invalid results file: " + "; ".join(errors))
    results: Results = _build(Results, data)
    results.references = _build(References, data["references"])
    results.kernels = [_build(KernelRow, r) for r in data.get("kernels", [])]
    results.host = [_build(HostRow, r) for r in data.get("host", [])]
    results.collectives = [_build(CollectiveRow, r) for r in data.get("collectives", [])]
    return results


_ROW_REQUIRED: dict[str, dict[str, tuple[type, ...]]] = {
    "kernels": {
        "kernel": (str,),
        "dtype": (str,),
        "H": (int,),
        "D": (int,),
        "N": (int,),
        "B": (int,),
        "bytes": (int,),
        "byte_formula": (str,),
        "status": (str,),
    },
    "host": {"kernel": (str,), "dtype": (str,), "B": (int,), "status": (str,)},
    "collectives": {"op": (str,), "world_size": (int,), "B": (int,), "status": (str,)},
}
_OPTIONAL_NUMBERS = {
    "ms",
    "ms_p20",
    "ms_p80",
    "bytes_per_s",
    "copy_ratio",
    "size_copy_ratio",
    "eager_ms",
    "eager_speedup",
    "empty_graph_ratio",
    "floor_ratio",
    "check_rel_err",
    "host_us",
    "eager_baseline_host_us",
    "add_us",
    "ratio_to_add",
    "add_out_us",
    "ratio_to_add_out",
    "latency_us",
    "algbw_bytes_per_s",
    "busbw_bytes_per_s",
}


def validate_results_dict(data: Mapping[str, Any]) -> list[str]:
    """Schema problems of a loaded results file (empty list when it is valid)."""
    errors: list[str] = []
    if data.get("schema") != SCHEMA:
        errors.append(f"schema is {data.get('schema')!r}, expected {SCHEMA!r}")
    for key, kind in (("env", dict), ("mode", str), ("references", dict), ("kernel_status", dict)):
        if not isinstance(data.get(key), kind):
            errors.append(f"{key!r} missing or not a {kind.__name__}")
    env = data.get("env")
    if isinstance(env, dict):
        for key in ("date", "device", "torch", "triton", "cuda", "driver", "git_commit"):
            if not isinstance(env.get(key), str):
                errors.append(f"env[{key!r}] missing")
    for table, required in _ROW_REQUIRED.items():
        rows = data.get(table, [])
        if not isinstance(rows, list):
            errors.append(f"{table!r} is not a list")
            continue
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                errors.append(f"{table}[{i}] is not an object")
                continue
            for key, kinds in required.items():
                value = row.get(key)
                if not isinstance(value, kinds) or isinstance(value, bool):
                    errors.append(f"{table}[{i}].{key} = {value!r} has the wrong type")
            for key in _OPTIONAL_NUMBERS & row.keys():
                value = row[key]
                if value is not None and (
                    not isinstance(value, (int, float)) or isinstance(value, bool)
                ):
                    errors.append(f"{table}[{i}].{key} = {value!r} is not a number or null")
    return errors


def save_results(results: Results, path: str | Path) -> Path:
    """Write ``results`` as indented JSON (parent folders created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results_to_dict(results), indent=1, allow_nan=False) + "\n")
    return out


def _ratio_note(value: float | None, base: float | None) -> str:
    """`` (1.49x the empty kernel)`` or nothing when either figure is missing."""
    if value is None or not base:
        return ""
    return f" ({value / base:.2f}x the empty kernel)"


def load_results(path: str | Path) -> Results:
    """Read and validate a results JSON file."""
    return results_from_dict(json.loads(Path(path).read_text()))


def merge_results(parts: Sequence[Results]) -> Results:
    """One result set from several runs: the first is the base (environment, references); each
    later one adds the kernel / host rows whose key the base lacks and, when the base has no
    collective rows, its collectives (e.g. a one-GPU kernel run plus a multi-GPU collectives
    run). A note names every contributing run."""
    if not parts:
        raise ValueError("merge_results needs at least one result set")
    base = dataclasses.replace(
        parts[0],
        kernels=list(parts[0].kernels),
        host=list(parts[0].host),
        collectives=list(parts[0].collectives),
        kernel_status=dict(parts[0].kernel_status),
        byte_formulas=dict(parts[0].byte_formulas),
        notes=list(parts[0].notes),
    )

    def kkey(r: KernelRow) -> tuple[Any, ...]:
        return (r.kernel, r.dtype, r.H, r.D, r.N, r.B)

    def hkey(r: HostRow) -> tuple[Any, ...]:
        return (r.kernel, r.dtype, r.H, r.D, r.N, r.B)

    for extra in parts[1:]:
        have_k = {kkey(r) for r in base.kernels if r.status == "ok"}
        added = [r for r in extra.kernels if kkey(r) not in have_k and r.status == "ok"]
        base.kernels = [r for r in base.kernels if kkey(r) not in {kkey(a) for a in added}] + added
        have_h = {hkey(r) for r in base.host if r.status == "ok"}
        added_h = [r for r in extra.host if hkey(r) not in have_h and r.status == "ok"]
        base.host = [r for r in base.host if hkey(r) not in {hkey(a) for a in added_h}] + added_h
        for name, status in extra.kernel_status.items():
            if base.kernel_status.get(name) != "ok":
                base.kernel_status[name] = status
        for name, formula in extra.byte_formulas.items():
            base.byte_formulas.setdefault(name, formula)
        took_collectives = not base.collectives and bool(extra.collectives)
        if took_collectives:
            base.collectives = list(extra.collectives)
            base.collectives_status = extra.collectives_status
        env = extra.env
        base.notes.append(
            f"merged rows from a run on {env.get('device_count', '?')} × {env.get('device', '?')} "
            f"({env.get('date', '?')}, commit {env.get('git_commit', '?')}): {len(added)} kernel rows"
            + (f", {len(extra.collectives)} collective rows" if took_collectives else "")
        )
    return base


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------

TargetTable = Literal["kernels", "host"]
TargetStatus = Literal["met", "not met", "incomplete", "not measured"]


@dataclass(frozen=True)
class Target:
    """A performance target: every selected row must satisfy ``metric op threshold``.

    Rows are selected from ``table`` by kernel, dtype, ``(H, D)`` shape, ``N`` and ``B``; an
    empty selector tuple means "any". When ``alt_metric`` is set a row also passes if
    ``alt_metric alt_op alt_threshold`` holds (e.g. host time ≤ 10 µs *or* ≤ 1.5× ``add_``).
    The expected rows are the product of the non-empty selectors (with an empty selector: the
    selected rows present, measured or not: an errored row counts); a target whose expected
    rows are not all measured is ``incomplete`` (when every measured row passes) or ``not met``.
    """

    name: str
    source: str
    description: str
    table: TargetTable
    kernel: str
    metric: str
    op: Literal[">=", "<="]
    threshold: float
    dtypes: tuple[str, ...] = ("bfloat16",)
    shapes: tuple[tuple[int, int], ...] = ()
    ns: tuple[int, ...] = ()
    bs: tuple[int, ...] = ()
    alt_metric: str | None = None
    alt_op: Literal[">=", "<="] = "<="
    alt_threshold: float = 0.0
    unit: Literal["ratio", "percent", "us", "x"] = "ratio"


@dataclass(frozen=True)
class TargetResult:
    """Outcome of one target."""

    target: Target
    status: TargetStatus
    measured: int
    expected: int
    passed: int
    worst: float | None
    worst_where: str


def _passes(value: float, op: str, threshold: float) -> bool:
    return value >= threshold if op == ">=" else value <= threshold


def _row_value(row: KernelRow | HostRow, name: str) -> float | None:
    value = getattr(row, name, None)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def evaluate_target(target: Target, results: Results) -> TargetResult:
    """Check ``target`` against the rows of ``results`` (see :class:`Target`)."""
    rows: Sequence[KernelRow | HostRow] = (
        results.kernels if target.table == "kernels" else results.host
    )

    def selected(row: KernelRow | HostRow) -> bool:
        return (
            row.kernel == target.kernel
            and (not target.dtypes or row.dtype in target.dtypes)
            and (not target.shapes or (row.H, row.D) in target.shapes)
            and (not target.ns or row.N in target.ns)
            and (not target.bs or row.B in target.bs)
        )

    expected_keys: set[tuple[Any, ...]] = set()
    for dtype in target.dtypes or ("*",):
        for shape in target.shapes or (("*", "*"),):
            for n in target.ns or ("*",):
                for b in target.bs or ("*",):
                    expected_keys.add((dtype, *shape, n, b))
    has_wildcard = not (target.dtypes and target.shapes and target.ns and target.bs)

    measured: dict[tuple[Any, ...], tuple[float, bool]] = {}
    # Selected rows that were not measured (an error, a time budget, a refused replay, no finite
    # metric value): with a wildcard selector they still count as expected, so the target
    # cannot read "met" on the rows that happened to work.
    unmeasured: set[tuple[Any, ...]] = set()
    worst: float | None = None
    worst_where = ""
    for row in rows:
        if not selected(row):
            continue
        if row.status != "ok":
            unmeasured.add((row.dtype, row.H, row.D, row.N, row.B))
            continue
        value = _row_value(row, target.metric)
        if value is None:  # ok, yet no finite metric: expected all the same
            unmeasured.add((row.dtype, row.H, row.D, row.N, row.B))
            continue
        ok = _passes(value, target.op, target.threshold)
        if not ok and target.alt_metric is not None:
            alt = _row_value(row, target.alt_metric)
            ok = alt is not None and _passes(alt, target.alt_op, target.alt_threshold)
        key = (row.dtype, row.H, row.D, row.N, row.B)
        measured[key] = (value, ok)
        worse = worst is None or (value < worst if target.op == ">=" else value > worst)
        if worse:
            worst = value
            worst_where = f"{row.dtype} H={row.H} D={row.D} N={row.N} B={row.B}"
    passed = sum(ok for _, ok in measured.values())
    expected = len(measured.keys() | unmeasured) if has_wildcard else len(expected_keys)
    status: TargetStatus
    if not measured:
        status = "not measured"
    elif passed < len(measured):
        status = "not met"
    elif len(measured) < expected:
        status = "incomplete"
    else:
        status = "met"
    return TargetResult(
        target, status, len(measured), max(expected, len(measured)), passed, worst, worst_where
    )


# --------------------------------------------------------------------------------------------
# Report: markdown page and PNG plot
# --------------------------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    """Human-readable byte count (decimal units: kB, MB, GB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _us(ms: float | None) -> str:
    if ms is None:
        return "–"
    us = ms * 1e3
    return f"{us:.3g}" if us < 100 else f"{us:.0f}"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _tbps(x: float | None) -> str:
    return "–" if x is None else f"{x / 1e12:.2f}"


def _dim(x: int) -> str:
    return "–" if x == 0 else str(x)


def _format_metric(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    if unit == "percent":
        return f"{100 * value:.1f}%"
    if unit == "us":
        return f"{value:.2f} µs"
    if unit == "x":
        return f"{value:.2f}×"
    return f"{value:.3g}"


def _threshold_text(t: Target) -> str:
    main = f"{t.metric} {t.op} {_format_metric(t.threshold, t.unit)}"
    if t.alt_metric is not None:
        main += f" or {t.alt_metric} {t.alt_op} {t.alt_threshold:g}"
    return main


_STATUS_MARK = {
    "met": "✅ met",
    "not met": "❌ not met",
    "incomplete": "⚠️ incomplete",
    "not measured": "– not measured",
}


def _kernel_order(results: Results, rows: Iterable[KernelRow]) -> list[str]:
    """Kernels present in ``rows``, in the order of ``results.kernel_status`` (the spec order)."""
    present = list(dict.fromkeys(r.kernel for r in rows))
    ordered = [k for k in results.kernel_status if k in present]
    return ordered + [k for k in present if k not in ordered]


def _glance(results: Results, titles: Mapping[str, str]) -> list[str]:
    """Compact table: per kernel and (H, D, N), % of copy at the largest B (bf16) and the worst
    decode-size graph-replay ratio to the empty kernel."""
    rows = [r for r in results.kernels if r.status == "ok" and r.dtype in ("bfloat16", "float32")]
    if not rows:
        return []
    cols = sorted({(r.H, r.D, r.N) for r in rows if r.D > 0}, key=lambda c: (-c[0], -c[1], c[2]))
    if not cols:
        return []
    big_b = max(r.B for r in rows)
    header = " | ".join(f"H={h} D={d} N={n}" for h, d, n in cols)
    out = [
        f"### At a glance: % of copy bandwidth at B={big_b} (× vs eager), and worst decode-size "
        "replay time / empty kernel",
        "",
        f"| kernel | {header} | decode (B ≤ 64) vs empty |",
        "| --- | " + " | ".join("---:" for _ in cols) + " | ---: |",
    ]
    for kernel in _kernel_order(results, rows):
        mine = [r for r in rows if r.kernel == kernel]
        cells = []
        for h, d, n in cols:
            hit = [r for r in mine if big_b == r.B and h == r.H and (r.D, r.N) in ((d, n), (0, 0))]
            if hit and hit[0].copy_ratio is not None:
                speed = hit[0].eager_speedup
                cells.append(
                    _pct(hit[0].copy_ratio) + ("" if speed is None else f" ({speed:.1f}×)")
                )
            else:
                cells.append("–")
        decode = [r.empty_graph_ratio for r in mine if r.empty_graph_ratio is not None]
        worst = f"{max(decode):.2f}×" if decode else "–"
        out.append(f"| {titles.get(kernel, kernel)} | " + " | ".join(cells) + f" | {worst} |")
    out.append("")
    return out


def render_markdown(
    results: Results,
    targets: Sequence[Target],
    *,
    png_name: str | None = "performance.png",
    regenerate: str = "",
    kernel_titles: Mapping[str, str] | None = None,
    max_notes: int = 40,
) -> str:
    """The performance page (markdown) for ``results`` with the status of every target."""
    env = results.env
    refs = results.references
    titles = dict(kernel_titles or {})
    lines: list[str] = ["# Performance", ""]
    lines += [
        "<!-- Generated by benchmarks/run.py from a results JSON file: do not edit by hand. -->",
        "",
        "> **Generated page.** " + (regenerate or "Regenerate with `python3 benchmarks/run.py`."),
        "",
        "## Run",
        "",
        "| | |",
        "| --- | --- |",
    ]
    for key in (
        "date",
        "device",
        "device_count",
        "driver",
        "cuda",
        "torch",
        "triton",
        "python",
        "git_commit",
    ):
        lines.append(f"| {key} | `{env.get(key, 'unknown')}` |")
    lines.append(f"| mode | `{results.mode}` |")
    if results.elapsed_s is not None:
        lines.append(f"| wall time | {results.elapsed_s:.0f} s |")
    lines += ["", "## Reference points (same run)", ""]
    lines += [
        "| reference | value | how |",
        "| --- | --- | --- |",
        f"| device-to-device copy | **{_tbps(refs.copy_bytes_per_s)} TB/s** | `dst.copy_(src)` of "
        f"{format_bytes(refs.copy_bytes / 2)}, bytes = read + write = {format_bytes(refs.copy_bytes)}; "
        f"{refs.copy_timing} median |",
        f"| empty Triton kernel, CUDA-graph replay | **{_num(refs.empty_graph_us)} µs** per launch | "
        f"{refs.calls_per_graph} launches captured in one graph, replays timed with CUDA events |",
        f"| one-vector load + store kernel, CUDA-graph replay | **{_num(refs.touch_graph_us)} µs** "
        f"per launch{_ratio_note(refs.touch_graph_us, refs.empty_graph_us)} | one program loads "
        f"16 bytes and stores them ({refs.calls_per_graph} rotating buffer pairs, in L2): the "
        "floor of any kernel that reads and writes memory, measured like the empty kernel |",
        f"| eager `torch.Tensor.add_` host time | **{_num(refs.add_host_us)} µs** per call | "
        f"1024-element fp32 tensor, host loop of {refs.host_calls} calls, median of {refs.host_rounds} rounds |",
        f"| plain Triton JIT launch host time | **{_num(refs.empty_launch_host_us)} µs** per call | "
        "empty kernel, `kernel[grid](...)`, same loop |",
        "",
    ]

    lines += ["## Targets", ""]
    lines += [
        "| target | source | rule | worst measured | where | rows passing | status |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for target in targets:
        res = evaluate_target(target, results)
        lines.append(
            f"| {target.description} | {target.source} | `{_threshold_text(target)}` | "
            f"{_format_metric(res.worst, target.unit)} | {res.worst_where or '–'} | "
            f"{res.passed}/{res.expected} | {_STATUS_MARK[res.status]} |"
        )
    lines += [
        "",
        "Statuses: *met* — every expected row measured and passing; *not met* — at least one "
        "measured row fails; *incomplete* — every measured row passes but some expected rows were "
        "not measured (e.g. a `--quick` run); *not measured* — no row (kernel missing or failed).",
        "",
    ]

    lines += _glance(results, titles)
    missing = {k: v for k, v in results.kernel_status.items() if v != "ok"}
    if missing:
        lines += ["### Kernels not measured", ""]
        lines += [f"- `{k}`: {v}" for k, v in sorted(missing.items())]
        lines.append("")

    if png_name:
        lines += [
            "## Achieved bandwidth",
            "",
            f"![achieved TB/s against B, one line per kernel, copy ceiling dashed]({png_name})",
            "",
        ]

    lines += [
        "## Kernels",
        "",
        "Columns: *µs* = median time per call (p20–p80), *timing* = `cuda_graph` (per call inside "
        "a replayed CUDA graph, decode sizes) or `cold` (CUDA events around each call, L2 "
        "emptied before it by reading a 256 MB buffer; see Performance notes for why not "
        "`triton.testing.do_bench`'s zero-fill flush), "
        "*TB/s* = bytes / median time, *% copy* = achieved / copy ceiling, *% same-size copy* = "
        "achieved / bandwidth of a device copy moving the same bytes, timed the same way (cold "
        "for bandwidth rows; graph replay over as many rotating buffers for decode rows, where "
        "it equals the copy's time / our time), *vs eager* = eager "
        "PyTorch baseline time / our time (> 1: we are faster), *vs empty* = our graph-replay time "
        "/ empty-kernel graph-replay time, *sets* = rotating input sets (enough to cover twice "
        "the L2, at most 32: the inputs of small decode rows stay in L2 across replays, like "
        "the load + store floor's), "
        "*check* = relative norm error against the eager baseline.",
        "",
    ]
    by_kernel: dict[str, list[KernelRow]] = {}
    for row in results.kernels:
        by_kernel.setdefault(row.kernel, []).append(row)
    for kernel in _kernel_order(results, results.kernels):
        rows = by_kernel[kernel]
        lines += [f"### {titles.get(kernel, kernel)}", ""]
        formula = results.byte_formulas.get(kernel) or rows[0].byte_formula
        lines += [f"Bytes: `{formula}`", ""]
        lines += [
            "| dtype | H | D | N | B | bytes | timing | µs (p20–p80) | TB/s | % copy | % same-size copy | eager µs | vs eager | vs empty | vs floor | sets | check |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in sorted(rows, key=lambda r: (r.dtype != "bfloat16", r.dtype, -r.H, r.D, r.N, r.B)):
            if r.status != "ok":
                lines.append(
                    f"| {r.dtype} | {r.H} | {_dim(r.D)} | {_dim(r.N)} | {r.B} | {format_bytes(r.bytes)} | "
                    f"{r.timing} | {r.status} | | | | | | | | | |"
                )
                continue
            spread = f"{_us(r.ms)} ({_us(r.ms_p20)}–{_us(r.ms_p80)})"
            check = "–" if r.check_rel_err is None else f"{r.check_rel_err:.1e}"
            lines.append(
                f"| {r.dtype} | {r.H} | {_dim(r.D)} | {_dim(r.N)} | {r.B} | {format_bytes(r.bytes)} | {r.timing} | "
                f"{spread} | {_tbps(r.bytes_per_s)} | {_pct(r.copy_ratio)} | "
                f"{_pct(r.size_copy_ratio)} | {_us(r.eager_ms)} | "
                f"{_num(r.eager_speedup, '{:.2f}×')} | {_num(r.empty_graph_ratio, '{:.2f}×')} | "
                f"{_num(r.floor_ratio, '{:.2f}×')} | {r.input_sets} | {check} |"
            )
        lines.append("")

    lines += ["## Host overhead of an eager call", ""]
    if results.host:
        lines += [
            f"Decode-size inputs; host loop of {refs.host_calls} calls without synchronisation, median of "
            f"{refs.host_rounds} rounds. "
            "Each round times a loop of `add_`, one of an out-of-place `torch.add` (a torch op "
            "that allocates its output, as ours do) and one of our op; *vs add_* is the median "
            "over rounds of our loop's time over `add_`'s (so a drift of the shared host's "
            "speed during the run cancels), `add_ µs` the median of its loops; *vs add* is the "
            "same against `torch.add`.",
            "",
            "| kernel | dtype | H | D | N | B | ours µs | eager baseline µs | `add_` µs | vs add_ "
            "| `add` µs | vs add |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for h in results.host:
            if h.status != "ok":
                lines.append(
                    f"| {titles.get(h.kernel, h.kernel)} | {h.dtype} | {h.H} | {_dim(h.D)} | "
                    f"{_dim(h.N)} | {h.B} | {h.status} | | | | | |"
                )
                continue
            lines.append(
                f"| {titles.get(h.kernel, h.kernel)} | {h.dtype} | {h.H} | {_dim(h.D)} | {_dim(h.N)} | {h.B} | "
                f"{_num(h.host_us)} | {_num(h.eager_baseline_host_us)} | {_num(h.add_us)} | "
                f"{_num(h.ratio_to_add, '{:.2f}×')} | {_num(h.add_out_us)} | "
                f"{_num(h.ratio_to_add_out, '{:.2f}×')} |"
            )
        lines.append("")
    else:
        lines += ["Not measured.", ""]

    lines += ["## Collectives", ""]
    if results.collectives:
        lines += [
            f"Status: {results.collectives_status}. Latency = max over ranks of each rank's median "
            "(CUDA events around a loop of eager calls, after a barrier; rows marked `[graph]`: "
            "calls captured in one CUDA graph and replayed, the decode-time setting, where the eager "
            "loop measures the host); algbw = bytes / latency; busbw "
            "follows nccl-tests: all-gather, reduce-scatter, all-to-all ×(N-1)/N, all-reduce ×2(N-1)/N.",
            "",
            "| op | N | dtype | H | D | B | bytes | µs | algbw GB/s | busbw GB/s | bytes formula |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for c in sorted(
            results.collectives,
            key=lambda c: (c.world_size, -c.H, c.D, c.B, not c.op.startswith("ours"), c.op),
        ):
            if c.status != "ok":
                lines.append(
                    f"| {c.op} | {c.world_size} | {c.dtype} | {c.H} | {c.D} | {c.B} | "
                    f"{format_bytes(c.bytes)} | {c.status} | | | |"
                )
                continue
            lines.append(
                f"| {c.op} | {c.world_size} | {c.dtype} | {c.H} | {c.D} | {c.B} | {format_bytes(c.bytes)} | "
                f"{_num(c.latency_us, '{:.1f}')} | {_num(None if c.algbw_bytes_per_s is None else c.algbw_bytes_per_s / 1e9, '{:.1f}')} | "
                f"{_num(None if c.busbw_bytes_per_s is None else c.busbw_bytes_per_s / 1e9, '{:.1f}')} | `{c.byte_formula}` |"
            )
        lines.append("")
    else:
        lines += [f"{results.collectives_status}.", ""]

    if results.notes:
        notes = list(dict.fromkeys(results.notes))
        lines += ["## Notes", ""]
        lines += [f"- {n}" for n in notes[:max_notes]]
        if len(notes) > max_notes:
            lines.append(f"- … and {len(notes) - max_notes} more (see the results JSON)")
        lines.append("")
    return "\n".join(lines)


def _pick_n(rows: Iterable[KernelRow]) -> int:
    ns = sorted({r.N for r in rows if r.N > 0})
    if not ns:
        return 0
    return 4 if 4 in ns else ns[len(ns) // 2]


def plot_bandwidth(
    results: Results,
    path: str | Path,
    *,
    dtype: str = "bfloat16",
    kernel_titles: Mapping[str, str] | None = None,
) -> Path | None:
    """PNG: achieved TB/s against B, one panel per (H, D), one line per kernel (ours solid,
    eager baseline dotted in the same colour), the copy ceiling dashed. ``None`` when there is
    nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = dict(kernel_titles or {})
    rows = [r for r in results.kernels if r.status == "ok" and r.dtype == dtype and r.bytes_per_s]
    shapes = sorted({(r.H, r.D) for r in rows if r.D > 0}, key=lambda s: (-s[0], -s[1]))
    if not shapes:
        return None
    n_pick = _pick_n(rows)
    width = max(5.2 * len(shapes), 10.0)
    fig, axes = plt.subplots(1, len(shapes), figsize=(width, 4.6), squeeze=False, sharey=True)
    kernels = _kernel_order(results, rows)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ceiling = results.references.copy_bytes_per_s
    for ax, (h, d) in zip(axes[0], shapes, strict=True):
        for i, kernel in enumerate(kernels):
            sel = [
                r
                for r in rows
                if r.kernel == kernel and h == r.H and (d == r.D or r.D == 0) and r.N in (n_pick, 0)
            ]
            if not sel:
                continue
            sel.sort(key=lambda r: r.B)
            color = colors[i % len(colors)]
            bs = [r.B for r in sel]
            ax.plot(
                bs,
                [(r.bytes_per_s or 0) / 1e12 for r in sel],
                marker="o",
                color=color,
                label=titles.get(kernel, kernel),
            )
            eager = [(r.B, r.bytes / (r.eager_ms * 1e-3) / 1e12) for r in sel if r.eager_ms]
            if eager:
                ax.plot(
                    [b for b, _ in eager],
                    [t for _, t in eager],
                    linestyle=":",
                    color=color,
                    alpha=0.7,
                )
        if ceiling:
            ax.axhline(
                ceiling / 1e12,
                color="black",
                linestyle="--",
                linewidth=1,
                label=f"copy ceiling {ceiling / 1e12:.2f} TB/s",
            )
            ax.axhline(
                0.85 * ceiling / 1e12,
                color="gray",
                linestyle="-.",
                linewidth=0.8,
                label="85% of copy",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("B (rows)")
        ax.set_title(f"H={h}, D={d}, N={n_pick} ({dtype})")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("achieved TB/s (read + write)")
    legend: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    handles, labels = list(legend.values()), list(legend.keys())
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize="small")
    fig.suptitle(
        f"{results.env.get('device', '?')} — dotted: eager PyTorch baseline", fontsize="medium"
    )
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
