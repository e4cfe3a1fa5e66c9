"""Collectives on >= 2 GPUs: our combine strategies next to bare NCCL calls of the same bytes.

Per world size N in {2, 4, 8} (as many as the machine has GPUs), ranks are started with
``cpattn_testing.launcher.run_distributed(..., backend="nccl")``. Each rank times, for every
(H, D) and B (bf16 output, fp32 LSE):

- ours: ``cp_lse_ag_out_rs`` (AG+RS), ``cp_lse_ag_out_ar`` (AG+AR), ``dcp_a2a_lse_reduce``
  (packed A2A), and a direct (symmetric-memory) A2A when cpattn_dcp provides one;
- bare NCCL: ``all_to_all_single`` of the packed A2A bytes, ``all_gather_into_tensor`` of the
  LSEs, ``reduce_scatter_tensor`` and ``all_reduce`` of the output.

Timing: barrier, then CUDA events around a loop of ``iters`` calls; the median of ``reps`` such
loops per rank; the reported latency is the max over ranks. At decode sizes (B <= 256) that eager
loop measures the host, so ``GRAPH_OPS`` (the A2A paths and AG+RS, with their bare NCCL
counterparts) are also timed as 16 calls captured in one CUDA graph and replayed (rows ending
in ``[graph]``), in a separate launch of the ranks so that a failed capture costs only those
rows. Bus bandwidth follows nccl-tests:
algbw = bytes / time; busbw = algbw x (N-1)/N for all-gather, reduce-scatter, all-to-all, and
x 2(N-1)/N for all-reduce.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch


def _busbw_factor(kind: str, n: int) -> float:
    return 2.0 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def _resolve_ops() -> dict[str, Callable[..., Any] | str]:
    """Our combine ops by report name, or a ``missing: ...`` string."""
    found: dict[str, Callable[..., Any] | str] = {}
    try:
        import cpattn_dcp
    except Exception as exc:
        return {k: f"missing: cpattn_dcp: {exc}" for k in ("ag_rs", "ag_ar", "a2a")}
    for key, attr in (
        ("ag_rs", "cp_lse_ag_out_rs"),
        ("ag_ar", "cp_lse_ag_out_ar"),
        ("a2a", "dcp_a2a_lse_reduce"),
    ):
        fn = getattr(cpattn_dcp, attr, None)
        found[key] = fn if callable(fn) else f"missing: cpattn_dcp has no {attr}"
    return found


def _direct_a2a(
    group: Any,
    device: torch.device,
    max_b: int,
    h_r: int,
    d: int,
    dtype: torch.dtype,
    cache: dict[Any, Any],
) -> Callable[..., Any] | str:
    """``lse_reduce(out, lse)`` of a direct (symmetric-memory) A2A workspace, or why there is none.

    One workspace per ``(H_r, D)`` sized for the largest B, reused across B (construction is
    collective); ``cache`` keeps them so the caller can close them at the end.
    """
    key = (h_r, d)
    if key not in cache:
        try:
            from cpattn_dcp.direct import DirectDCPA2AWorkspace
        except Exception as exc:
            cache[key] = f"missing: cpattn_dcp.direct: {type(exc).__name__}: {exc}".splitlines()[0][
                :160
            ]
        else:
            try:
                cache[key] = DirectDCPA2AWorkspace(
                    group, device, max_b, h_r, d, dtype=dtype, num_ubatches=1
                )
            except Exception as exc:
                cache[key] = f"not available: {type(exc).__name__}: {exc}".splitlines()[0][:160]
    ws = cache[key]
    if isinstance(ws, str):
        return ws
    fn = getattr(ws, "lse_reduce", None)
    return fn if callable(fn) else "missing: DirectDCPA2AWorkspace has no lse_reduce"


def _time_loop(fn: Callable[[], object], iters: int, reps: int) -> float:
    """Median milliseconds per call on this rank (wall clock on the CPU smoke path)."""
    import torch.distributed as dist

    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        samples_cpu: list[float] = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples_cpu.append((time.perf_counter() - t0) * 1e3 / iters)
        return statistics.median(samples_cpu)
    torch.cuda.synchronize()

    def loop() -> None:
        for _ in range(iters):
            fn()

    return _median_event_ms(loop, iters, reps)


def _median_event_ms(run: Callable[[], object], calls: int, reps: int) -> float:
    """Median milliseconds per call of ``run`` (which makes ``calls`` calls), timed ``reps``
    times with CUDA events, each after a barrier of the ranks and a device synchronisation."""
    import torch.distributed as dist

    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    samples: list[float] = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def _time_graph(fn: Callable[[], object], calls: int, reps: int) -> float:
    """Median milliseconds per call of ``calls`` calls captured in one CUDA graph and replayed
    ``reps`` times (a barrier before each replay; the NCCL calls inside the graphs of the
    ranks meet as they would eagerly). Warm-up on a side stream first, as capture needs."""

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = _median_event_ms(graph.replay, calls, reps)
    del graph
    return ms


def _rank_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shape_candidates(
    group: Any,
    n: int,
    h: int,
    d: int,
    b: int,
    ours: dict[str, Any],
    gen: torch.Generator,
    max_b: int,
    direct_cache: dict[Any, Any],
) -> list[tuple[str, str, int, str, Callable[[], object] | str]]:
    """``(label, kind, bytes, formula, call-or-reason)`` for every op at one shape (bf16)."""
    import torch.distributed as dist

    device = _rank_device()
    dtype = torch.bfloat16
    s, p = dtype.itemsize, 2  # fp32 LSE carried in two bf16 lanes
    out = torch.randn((b, h, d), generator=gen, device=device).to(dtype)
    lse = torch.randn((b, h), generator=gen, device=device) * 3.0 + 4.0
    out_bytes = b * h * d * s
    lse_bytes = n * b * h * 4
    a2a_bytes = b * h * (d + p) * s
    send = torch.empty(a2a_bytes // s, device=device, dtype=dtype)
    recv = torch.empty_like(send)
    gathered = torch.empty(n * b * h, device=device, dtype=torch.float32)
    rs_out = torch.empty(b * h * d // n, device=device, dtype=dtype)
    flat = out.reshape(-1)
    ar_buf = flat.clone()

    # The names CPGroup calls (torch 2.13's *_single; the old, deprecated ones before it).
    all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

    def bare_ag_rs() -> None:
        all_gather_single(gathered, lse.reshape(-1))
        reduce_scatter_single(rs_out, flat)

    def ours_call(fn: Callable[..., Any]) -> Callable[[], object]:
        return lambda: fn(out, lse, group)

    cands: list[tuple[str, str, int, str, Callable[[], object] | str]] = []
    rs_formula = "B·H·D·s + N·B·H·4"
    for key, label, kind, nbytes, formula in (
        (
            "ag_rs",
            "ours: AG+RS (cp_lse_ag_out_rs)",
            "reduce_scatter",
            out_bytes + lse_bytes,
            rs_formula,
        ),
        (
            "ag_ar",
            "ours: AG+AR (cp_lse_ag_out_ar)",
            "all_reduce",
            out_bytes + lse_bytes,
            rs_formula,
        ),
        ("a2a", "ours: A2A (dcp_a2a_lse_reduce)", "all_to_all", a2a_bytes, "B·H·(D+P)·s"),
    ):
        fn = ours[key]
        cands.append((label, kind, nbytes, formula, fn if isinstance(fn, str) else ours_call(fn)))
    direct = (
        _direct_a2a(group, device, max_b, h // n, d, dtype, direct_cache)
        if device.type == "cuda"
        else "not run: CPU smoke run"
    )
    direct_call: Callable[[], object] | str = (
        direct if isinstance(direct, str) else (lambda: direct(out, lse))
    )
    cands += [
        ("ours: direct A2A", "all_to_all", a2a_bytes, "B·H·(D+P)·s", direct_call),
        (
            "nccl: all_to_all_single",
            "all_to_all",
            a2a_bytes,
            "B·H·(D+P)·s",
            lambda: dist.all_to_all_single(recv, send),
        ),
        (
            "nccl: all_gather (LSE)",
            "all_gather",
            lse_bytes,
            "N·B·H·4",
            lambda: all_gather_single(gathered, lse.reshape(-1)),
        ),
        (
            "nccl: reduce_scatter (out)",
            "reduce_scatter",
            out_bytes,
            "B·H·D·s",
            lambda: reduce_scatter_single(rs_out, flat),
        ),
        (
            "nccl: all_gather + reduce_scatter",
            "reduce_scatter",
            out_bytes + lse_bytes,
            rs_formula,
            bare_ag_rs,
        ),
        (
            "nccl: all_reduce (out)",
            "all_reduce",
            out_bytes,
            "B·H·D·s",
            lambda: dist.all_reduce(ar_buf),
        ),
    ]
    return cands


#: Ops also timed inside a replayed CUDA graph at decode sizes, where the eager loop above is
#: bound by the host (Python, launches, NCCL call overhead) rather than by the device.
GRAPH_OPS = (
    "ours: A2A (dcp_a2a_lse_reduce)",
    "ours: direct A2A",
    "nccl: all_to_all_single",
    "ours: AG+RS (cp_lse_ag_out_rs)",
    "nccl: all_gather + reduce_scatter",
)
GRAPH_SUFFIX = " [graph]"
GRAPH_MAX_B = 256
_GRAPH_CALLS = 16


def _rank_main(rank: int, world_size: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank: time every op at every shape in eager loops; rank 0 returns the rows (max
    over ranks)."""
    return _rank_rows(rank, world_size, cfg, graph=False)


def _rank_graph_main(rank: int, world_size: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank: the ``GRAPH_OPS`` at every shape and every B <= ``GRAPH_MAX_B``, each timed
    as ``_GRAPH_CALLS`` calls in one replayed CUDA graph (labels end in ``GRAPH_SUFFIX``)."""
    return _rank_rows(rank, world_size, cfg, graph=True)


def _rank_rows(
    rank: int, world_size: int, cfg: dict[str, Any], *, graph: bool
) -> list[dict[str, Any]]:
    """The body of ``_rank_main`` (eager loops, every op and B) and ``_rank_graph_main``
    (graph replay, ``GRAPH_OPS`` at B <= ``GRAPH_MAX_B``)."""
    import warnings

    import torch.distributed as dist

    # Newer torch renames all_gather_into_tensor / reduce_scatter_tensor; the old names are
    # the ones every supported torch has.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

    from bench_results import CollectiveRow

    device = _rank_device()
    group = dist.group.WORLD
    n = world_size
    ours = _resolve_ops()
    rows: list[CollectiveRow] = []
    kinds: list[str] = []
    times: list[float] = []
    gen = torch.Generator(device=device).manual_seed((2000 if graph else 1000) + rank)
    direct_cache: dict[Any, Any] = {}
    bs = [b for b in cfg["bs"] if b <= GRAPH_MAX_B] if graph else cfg["bs"]
    for (h, d), b in ((shape, b) for shape in cfg["shapes"] for b in bs):
        if h % n:
            continue
        iters = cfg["iters"] if b < 1024 else max(2, cfg["iters"] // 4)
        for label, kind, nbytes, formula, call in _shape_candidates(
            group, n, h, d, b, ours, gen, max(bs), direct_cache
        ):
            if graph and label not in GRAPH_OPS:
                continue
            row = CollectiveRow(
                op=label + (GRAPH_SUFFIX if graph else ""), world_size=n, dtype="bfloat16",
                H=h, D=d, B=b, bytes=nbytes, byte_formula=formula,
            )  # fmt: skip
            kinds.append(kind)
            if isinstance(call, str):
                row.status = call
                times.append(float("nan"))
            else:
                try:
                    times.append(
                        _time_graph(call, _GRAPH_CALLS, cfg["reps"] * 4)
                        if graph
                        else _time_loop(call, iters, cfg["reps"])
                    )
                except Exception as exc:  # the same failure happens on every rank
                    row.status = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:160]
                    times.append(float("nan"))
            rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for ws in direct_cache.values():
        close = getattr(ws, "close", None)
        if callable(close):
            close()
    return _finish_rows(rows, kinds, times, device, rank, n)


def _finish_rows(
    rows: list[Any], kinds: list[str], times: list[float], device: torch.device, rank: int, n: int
) -> list[dict[str, Any]]:
    """Latency = the slowest rank's time of each row (an all-reduce MAX); rank 0 returns the
    rows with their bandwidths, the other ranks nothing."""
    import torch.distributed as dist

    t = torch.nan_to_num(torch.tensor(times, device=device, dtype=torch.float64), nan=-1.0)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank != 0:
        return []
    for row, kind, ms in zip(rows, kinds, t.tolist(), strict=True):
        if row.status == "ok" and ms > 0:
            row.latency_us = ms * 1e3
            row.algbw_bytes_per_s = row.bytes / (ms * 1e-3)
            row.busbw_bytes_per_s = row.algbw_bytes_per_s * _busbw_factor(kind, n)
    return [asdict(r) for r in rows]


def _graph_rows(
    run_distributed: Callable[..., Any], n: int, cfg: dict[str, Any], timeout: float, row_type: Any
) -> list[Any]:
    """The CUDA-graph rows of world size ``n`` (``_rank_graph_main``), or one row saying why
    there are none."""
    print(f"collectives: world size {n} (nccl), CUDA-graph replay", file=sys.stderr, flush=True)
    try:
        per_rank = run_distributed(_rank_graph_main, n, "nccl", args=(cfg,), timeout=timeout)
    except Exception as exc:
        return [_failure_row(row_type, "(all)" + GRAPH_SUFFIX, n, exc)]
    return [row_type(**r) for r in per_rank[0]]


def _failure_row(row_type: Any, op: str, n: int, exc: Exception) -> Any:
    """One row standing for every op of world size ``n`` whose ranks failed with ``exc``."""
    reason = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:200]
    return row_type(
        op=op, world_size=n, dtype="bfloat16", H=0, D=0, B=0, bytes=0, byte_formula="",
        status=reason,
    )  # fmt: skip


def run_collectives(
    plan: Any, device: torch.device, *, deadline: float | None = None
) -> tuple[str, list[Any]]:
    """``(status, rows)``: rows of every world size that fits on this machine.

    No new world size starts after ``deadline`` (a ``time.perf_counter()`` value); a started one
    gets at most the time left (and at least 60 s) before its ranks are killed."""
    from bench_results import CollectiveRow

    smoke_cpu = device.type != "cuda" and plan.mode == "smoke"
    if device.type != "cuda" and not smoke_cpu:
        return "not run: needs >= 2 GPUs (CPU run)", []
    ngpu = torch.cuda.device_count() if device.type == "cuda" else 0
    if ngpu < 2 and not smoke_cpu:
        return f"not run: needs >= 2 GPUs (this machine has {ngpu})", []
    try:
        from cpattn_testing.launcher import run_distributed
    except Exception as exc:
        return f"not run: cpattn_testing.launcher unavailable ({exc})", []
    cfg = {
        "shapes": plan.coll_shapes,
        "bs": plan.coll_bs,
        "iters": plan.coll_iters,
        "reps": plan.coll_reps,
    }
    rows: list[Any] = []
    sizes = [2] if smoke_cpu else [n for n in (2, 4, 8) if n <= ngpu]
    backend = "gloo" if smoke_cpu else "nccl"
    done: list[int] = []
    for n in sizes:
        if deadline is not None and time.perf_counter() > deadline:
            break
        timeout = (
            300.0 if deadline is None else max(60.0, min(300.0, deadline - time.perf_counter()))
        )
        print(f"collectives: world size {n} ({backend})", file=sys.stderr, flush=True)
        try:
            per_rank = run_distributed(_rank_main, n, backend, args=(cfg,), timeout=timeout)
            rows += [CollectiveRow(**r) for r in per_rank[0]]
            if backend == "nccl":
                # Its own launch: a capture that fails or hangs loses only the graph rows.
                rows += _graph_rows(run_distributed, n, cfg, timeout, CollectiveRow)
        except Exception as exc:
            rows.append(_failure_row(CollectiveRow, "(all)", n, exc))
        done.append(n)
    sizes = done
    if smoke_cpu:
        return (
            "smoke run: 2 CPU ranks on gloo, wall clock (plumbing check, not a measurement)",
            rows,
        )
    return f"ran world sizes {sizes} on {ngpu} GPUs (nccl)", rows
