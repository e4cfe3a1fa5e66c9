"""Benchmark the ops on one GPU (and the combine collectives on several); write the results JSON
and the performance page.

Usage, from the repository root (needs torch and triton, matplotlib for the plot; nothing to
install, no network; the ``src`` folders of ``packages/*`` are put on the path)::

    python3 benchmarks/run.py                          # full run (about 3 min on one H200)
    python3 benchmarks/run.py --out benchmarks/nvidia-h200.json
    python3 benchmarks/run.py --quick                  # the page's shapes only (< 2 min)
    python3 benchmarks/run.py --quick --compare benchmarks/nvidia-h200.json
    python3 benchmarks/run.py --render-only            # page + plot from benchmarks/*.json
    python3 benchmarks/run.py --render-only new.json --compare old.json --no-docs
    python3 benchmarks/run.py --probe                  # each op 3x at B=4096, for ncu
    TRITON_INTERPRET=1 python3 benchmarks/run.py --smoke   # CPU plumbing check

A full run writes ``benchmarks/<kind>.json`` (``nvidia-h200``, ``nvidia-h200-x4``, ...: the
device name and GPU count) unless ``--out`` says otherwise, then ``docs/performance.md`` and
``docs/performance.png``; ``--quick`` / ``--smoke`` write under ``bench-results/`` and put
their page next to the JSON. The page takes the ops' rows from the first results holding
kernel rows and the collectives from the first holding collective rows: this run first, then
the other ``benchmarks/*.json``. After ``--time-budget`` seconds no new measurement starts (the
rest are recorded as skipped); the JSON is saved every few rows. ``--compare OLD.json``
prints, for every kernel row in both, new / old time per call and the worst row.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
PACKAGES = ("cp-common", "cp-dcp", "cp-pcp", "cp-testing")
PACKAGE_SRCS = [ROOT / "packages" / p / "src" for p in PACKAGES]
#: NVLink multicast stays off in this process and in every rank it starts (project rule).
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
#: GPU wait (µs) after each flush when timing cold, ours and the eager baseline alike: a call's
#: host work can take longer than flush + kernel on the GPU, which would leak host time into it.
HOST_GUARD_US = 300.0


def _setup_path() -> None:
    paths = [str(p) for p in (*PACKAGE_SRCS, BENCH_DIR)]
    sys.path[:0] = [p for p in paths if p not in sys.path]
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])
    for key, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(key, value)


@dataclass
class Plan:
    """What one mode measures and how long it times each point."""

    mode: str
    shapes: list[tuple[int, int]]
    ns: list[int]
    bs: list[int]
    mask_hs: list[int]
    dtypes: list[str] = field(default_factory=lambda: ["bfloat16"])
    spot_dtype: str | None = None
    spot_shapes: list[tuple[int, int]] = field(default_factory=list)
    spot_ns: list[int] = field(default_factory=list)
    spot_bs: list[int] = field(default_factory=list)
    graph_max_b: int = 64
    warmup_ms: float = 10.0
    rep_ms: float = 40.0
    graph_repeats: int = 15
    graph_ms_per_repeat: float = 0.5
    calls_per_graph: int = 64
    # The GPU machine's host is shared and noisy: 1000 calls per round average more out.
    host_calls: int = 1000
    host_rounds: int = 7
    host_shapes: list[tuple[int, int]] = field(default_factory=lambda: [(128, 512), (64, 128)])
    host_n: int = 4
    copy_bytes: int = 1 << 30
    coll_shapes: list[tuple[int, int]] = field(default_factory=list)
    coll_bs: list[int] = field(default_factory=list)
    coll_iters: int = 20
    coll_reps: int = 5
    time_budget_s: float = 300.0


ALL_B = [1, 8, 64, 256, 1024, 4096]


def make_plan(mode: str) -> Plan:
    """The shapes and timing budget of ``mode`` (``full``, ``quick`` or ``smoke``)."""
    if mode == "full":
        return Plan(
            mode=mode,
            shapes=[(128, 512), (64, 128), (16, 512), (64, 256)],
            ns=[2, 4, 8],
            bs=ALL_B,
            mask_hs=[128, 64, 16],
            spot_dtype="float16",
            spot_shapes=[(128, 512), (64, 128)],
            spot_ns=[4],
            spot_bs=[1, 4096],
            coll_shapes=[(128, 512), (64, 128), (64, 256)],
            coll_bs=ALL_B,
        )
    if mode == "quick":
        return Plan(
            mode=mode,
            shapes=[(128, 512), (64, 128), (16, 512)],
            ns=[4],
            bs=[1, 64, 1024, 4096],
            mask_hs=[128, 64, 16],
            warmup_ms=5.0,
            rep_ms=20.0,
            graph_repeats=8,
            graph_ms_per_repeat=0.3,
            host_calls=200,
            host_rounds=5,
            coll_shapes=[(128, 512), (64, 128)],
            coll_bs=[1, 64, 4096],
            coll_iters=10,
            coll_reps=3,
            time_budget_s=90.0,
        )
    if mode == "smoke":
        return Plan(
            mode=mode,
            shapes=[(4, 16)],
            ns=[2],
            bs=[1, 8],
            mask_hs=[4],
            graph_repeats=3,
            calls_per_graph=4,
            host_calls=3,
            host_rounds=2,
            host_shapes=[(4, 16)],
            host_n=2,
            copy_bytes=1 << 22,
            coll_shapes=[(4, 16)],
            coll_bs=[1, 8],
            coll_iters=2,
            coll_reps=2,
            time_budget_s=0.0,
        )
    raise ValueError(f"unknown mode {mode!r}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="the page's shapes only, shorter timing")
    g.add_argument("--smoke", action="store_true", help="tiny shapes; CPU with TRITON_INTERPRET=1")
    g.add_argument("--probe", action="store_true", help="launch each op 3x at B=4096 (for ncu)")
    g.add_argument(
        "--render-only",
        metavar="RESULTS_JSON",
        nargs="*",
        help="page + plot from results files (default: benchmarks/*.json), no GPU needed",
    )
    p.add_argument("--out", help="results JSON (default: benchmarks/<kind>.json for a full run)")
    p.add_argument("--docs-dir", help="where performance.md/.png go (default: docs/, full run)")
    p.add_argument("--no-docs", action="store_true", help="write no page")
    p.add_argument("--compare", metavar="OLD_JSON", help="print kernel times against OLD_JSON")
    p.add_argument("--kernels", help="comma-separated subset of op names")
    p.add_argument("--no-collectives", action="store_true", help="skip the multi-GPU collectives")
    p.add_argument("--skip-kernels", action="store_true", help="only references + collectives")
    p.add_argument("--time-budget", type=float, help="seconds of measuring (0: no limit)")
    p.add_argument("--commit", help="git commit to stamp (default: CPATTN_BENCH_COMMIT or git)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------


def machine_kind() -> str:
    """``nvidia-h200`` for one H200, ``nvidia-h200-x4`` for four; ``cpu`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = "-".join(torch.cuda.get_device_name(0).lower().split())
    count = torch.cuda.device_count()
    return name if count == 1 else f"{name}-x{count}"


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    return text[:160].replace("|", "/")


def _cycle(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    it: Iterator[Callable[[], object]] = itertools.cycle(fns)
    return lambda: next(it)()


def _time_fns(
    fns: Sequence[Callable[[], object]],
    use_graph: bool,
    plan: Plan,
    device: Any,
    notes: list[str],
    what: str,
    *,
    host_guard_us: float = 0.0,
) -> Any:
    """Timing of one callable rotated over its input sets: graph replay, or ``time_cold`` (a
    capture that fails, e.g. an op that synchronises with the host, is noted and timed cold)."""
    import cpattn_testing.bench as hb

    if device.type != "cuda":
        return hb.time_wall(_cycle(fns), calls=2, rounds=2)
    if use_graph:
        calls = [fns[i % len(fns)] for i in range(max(plan.calls_per_graph, len(fns)))]
        try:
            return hb.time_cuda_graph(
                calls, repeats=plan.graph_repeats, target_ms_per_repeat=plan.graph_ms_per_repeat
            )
        except Exception as exc:
            import torch

            torch.cuda.synchronize()
            notes.append(f"{what}: CUDA-graph capture failed ({_short(exc)}); timed cold")
    return hb.time_cold(
        _cycle(fns), warmup_ms=plan.warmup_ms, rep_ms=plan.rep_ms, host_guard_us=host_guard_us
    )


def _cases(plan: Plan, spec: Any) -> list[Any]:
    import bench_kernels as bk
    import torch

    if not spec.uses_n:  # the LSE mask: depends on H and B only; LSE is fp32
        return [
            bk.Case(spec.name, torch.float32, h, 0, 0, b) for h in plan.mask_hs for b in plan.bs
        ]
    grids = [(plan.dtypes, plan.shapes, plan.ns, plan.bs)]
    if plan.spot_dtype:
        grids.append(([plan.spot_dtype], plan.spot_shapes, plan.spot_ns, plan.spot_bs))
    out = []
    for dtypes, shapes, ns, bs in grids:
        for dtype, (h, d), n, b in itertools.product(dtypes, shapes, ns, bs):
            if h % n == 0:
                out.append(bk.Case(spec.name, getattr(torch, dtype), h, d, n, b))
    return out


def _priority(case: Any) -> int:
    """0: the page's rows, 1: the targets' rows, 2: the rest (measured in that order)."""
    import bench_report as br
    import bench_targets as bt

    main_dtype = str(case.dtype) in ("torch.bfloat16", "torch.float32")
    page_shape = any(h == case.H and case.D in (d, 0) for h, d, _ in br.PAGE_SHAPES)
    if main_dtype and page_shape and case.N in (br.PAGE_N, 0) and case.B in br.PAGE_B:
        return 0
    target_shape = (case.H, case.D) in bt.HEAD_SHAPES or case.D == 0
    return 1 if main_dtype and target_shape and case.B in (*bt.DECODE_B, 4096) else 2


def run_kernels(
    plan: Plan,
    specs: list[Any],
    device: Any,
    results: Any,
    *,
    deadline: float | None,
    checkpoint: Callable[[], None],
) -> None:
    """Every op at every shape of the plan: ours, the eager baseline, a same-size copy."""
    import torch
    from bench_results import KernelRow

    import cpattn_testing.bench as hb
    from cpattn_testing.tolerances import tolerance

    refs = results.references
    work = sorted(((s, c) for s in specs for c in _cases(plan, s)), key=lambda sc: _priority(sc[1]))
    cold_copy: dict[int, float] = {}  # bytes moved -> same-size copy bandwidth (cold)
    graph_copy: dict[tuple[int, int], float] = {}  # (bytes, sets) -> same under graph replay
    for i, (spec, case) in enumerate(work):
        nbytes = spec.nbytes(case)
        row = KernelRow(spec.name, case.dtype_name, case.H, case.D, case.N, case.B, nbytes)
        results.kernels.append(row)
        if deadline is not None and time.perf_counter() > deadline:
            row.status = "skipped: time budget"
            continue
        where = f"`{spec.name}` {case.dtype_name} H={case.H} D={case.D} N={case.N} B={case.B}"
        try:
            gen = torch.Generator(device=device).manual_seed(zlib.crc32(where.encode()))
            n_sets = hb.rotation_count(row.bytes, refs.l2_bytes) if device.type == "cuda" else 2
            sets = [spec.make_inputs(case, device, gen) for _ in range(n_sets)]
            row.input_sets = n_sets
            row.check_rel_err = spec.check(case, sets[0])
            tol = 2 * tolerance(case.dtype)[2]  # two results, each within the dtype's tolerance
            if not row.check_rel_err <= tol:  # a wrong result is not timed
                err = f"{row.check_rel_err:.2e} > {tol:.0e}"
                row.status = f"error: differs from the eager baseline ({err})"
                results.notes.append(f"{where}: {row.status}")
                continue
            use_graph = device.type == "cuda" and plan.graph_max_b >= case.B
            ours = [spec.bind_ours(case, s) for s in sets]
            t = _time_fns(
                ours, use_graph, plan, device, results.notes, where, host_guard_us=HOST_GUARD_US
            )
            row.timing, row.ms, row.ms_p20, row.ms_p80 = t.method, t.median_ms, t.p20_ms, t.p80_ms
            row.bytes_per_s = row.bytes / (t.median_ms * 1e-3)
            if refs.copy_bytes_per_s:
                row.copy_ratio = row.bytes_per_s / refs.copy_bytes_per_s
            if t.method == "cold":
                if row.bytes not in cold_copy:
                    moved, tc = hb.measure_copy_ceiling(
                        device, nbytes=row.bytes // 2, warmup_ms=plan.warmup_ms, rep_ms=plan.rep_ms
                    )
                    cold_copy[row.bytes] = moved / (tc.median_ms * 1e-3)
                row.size_copy_ratio = row.bytes_per_s / cold_copy[row.bytes]
            elif t.method == "cuda_graph":
                key = (row.bytes, n_sets)
                if key not in graph_copy:
                    moved, tc = hb.measure_copy_graph(
                        device,
                        nbytes=row.bytes // 2,
                        sets=n_sets,
                        calls_per_graph=plan.calls_per_graph,
                    )
                    graph_copy[key] = moved / (tc.median_ms * 1e-3)
                row.size_copy_ratio = row.bytes_per_s / graph_copy[key]
            try:
                eager = [spec.bind_eager(case, s) for s in sets]
                what = f"eager baseline of {where}"
                te = _time_fns(
                    eager,
                    use_graph,
                    plan,
                    device,
                    results.notes,
                    what,
                    host_guard_us=HOST_GUARD_US,
                )
                row.eager_timing, row.eager_ms = te.method, te.median_ms
                row.eager_speedup = te.median_ms / t.median_ms
            except Exception as exc:
                results.notes.append(f"eager baseline of {where} failed: {_short(exc)}")
            del sets
        except Exception as exc:
            row.status = f"error: {_short(exc)}"
        if device.type == "cuda" and case.B >= 1024:
            torch.cuda.empty_cache()
        if i % 20 == 19:
            print(f"kernels: {i + 1}/{len(work)}", file=sys.stderr, flush=True)
            checkpoint()


def measure_references(plan: Plan, device: Any, results: Any) -> None:
    """Copy ceiling, empty and load + store kernels in graph replay, host time of ``add_`` and
    of a plain Triton launch (same run as the rows)."""
    import cpattn_testing.bench as hb

    refs = results.references
    refs.l2_bytes = hb.l2_cache_bytes(device)
    refs.calls_per_graph = plan.calls_per_graph
    refs.host_calls, refs.host_rounds = plan.host_calls, plan.host_rounds
    moved, t = hb.measure_copy_ceiling(
        device, nbytes=plan.copy_bytes, warmup_ms=plan.warmup_ms, rep_ms=plan.rep_ms
    )
    refs.copy_bytes, refs.copy_ms = moved, t.median_ms
    refs.copy_bytes_per_s = moved / (t.median_ms * 1e-3)
    graphs = (
        ("empty_graph_us", hb.measure_empty_kernel_graph, "empty-kernel graph replay"),
        ("touch_graph_us", hb.measure_touch_kernel_graph, "load + store kernel graph replay"),
    )
    for attr, measure, what in graphs:
        try:
            timing = measure(device, calls_per_graph=plan.calls_per_graph)
            setattr(refs, attr, timing.median_ms * 1e3)
        except Exception as exc:
            results.notes.append(f"{what} not measured: {_short(exc)}")
    try:
        host = hb.measure_reference_host_times(
            device, calls=plan.host_calls, rounds=plan.host_rounds
        )
        refs.add_host_us = host["torch_add_"].median_ms * 1e3
        refs.empty_launch_host_us = host["triton_jit_launch"].median_ms * 1e3
    except Exception as exc:
        results.notes.append(f"reference host times not measured: {_short(exc)}")


def write_page(sources: Sequence[Any], docs_dir: Path) -> Path:
    """``performance.md`` (+ ``performance.png`` when matplotlib is present) from ``sources``."""
    import bench_report as br
    from bench_results import first_with

    docs_dir.mkdir(parents=True, exist_ok=True)
    png: Path | None = None
    ops = first_with(sources, "kernels")
    if ops is not None:
        try:
            png = br.plot_bandwidth(ops, docs_dir / "performance.png")
        except ImportError as exc:
            print(f"no plot: {exc}", file=sys.stderr)
    page = docs_dir / "performance.md"
    page.write_text(br.render_page(sources, png_name=png.name if png else None))
    print(f"wrote {page}" + (f" and {png}" if png else ""), file=sys.stderr)
    return page


def _kind_files(exclude: Path | None = None) -> list[Path]:
    skip = None if exclude is None else exclude.resolve()
    return [p for p in sorted(BENCH_DIR.glob("*.json")) if p.resolve() != skip]


def probe(specs: list[Any], device: Any) -> int:
    """Each op three times at B=4096 (bf16, H=64 D=128 N=4), for a profiler such as ``ncu -k
    'regex:_a2a|_correct|_merge|_mask'``."""
    import bench_kernels as bk
    import torch

    for spec in specs:
        dtype = torch.bfloat16 if spec.uses_n else torch.float32
        d, n = (128, 4) if spec.uses_n else (0, 0)
        case = bk.Case(spec.name, dtype, 64, d, n, 4096)
        call = spec.bind_ours(case, spec.make_inputs(case, device, torch.Generator(device=device)))
        for _ in range(3):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"probed {spec.name}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _setup_path()
    import bench_results as rs

    if args.render_only is not None:
        files = [Path(p) for p in args.render_only] or _kind_files()
        sources = [rs.load_results(p) for p in files]
        if args.compare:
            ops = rs.first_with(sources, "kernels")
            if ops is not None:
                print(rs.compare_kernels(ops, rs.load_results(args.compare)))
        if not args.no_docs:
            write_page(sources, Path(args.docs_dir) if args.docs_dir else ROOT / "docs")
        return 0

    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    import torch

    if not torch.cuda.is_available() and mode != "smoke":
        print("no CUDA device: use --smoke (TRITON_INTERPRET=1) or --render-only", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        print("--smoke on the CPU needs TRITON_INTERPRET=1 set before starting", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    import bench_collectives as bc
    import bench_host
    import bench_kernels as bk

    import cpattn_testing.bench as hb
    from cpattn_common import set_output_poison

    set_output_poison(None)
    specs = bk.all_specs()
    if args.kernels:
        wanted = {k.strip() for k in args.kernels.split(",") if k.strip()}
        if unknown := wanted - set(bk.ORDER):
            print(f"unknown ops {sorted(unknown)}; known: {bk.ORDER}", file=sys.stderr)
            return 2
        specs = [s for s in specs if s.name in wanted]
    if args.skip_kernels:
        specs = []
    if args.probe:
        return probe(specs, device)

    t_start = time.perf_counter()
    plan = make_plan(mode)
    budget = plan.time_budget_s if args.time_budget is None else args.time_budget
    deadline = t_start + budget if budget > 0 else None
    env = hb.environment_stamp(commit=args.commit, repo_root=ROOT)
    results = rs.Results(env=env, mode=mode, references=rs.References())
    results.byte_formulas = {s.name: s.byte_formula for s in specs}
    kind = machine_kind()
    if args.out:
        out = Path(args.out)
    elif mode == "full":
        out = BENCH_DIR / f"{kind}.json"
    else:
        out = ROOT / "bench-results" / f"{kind}-{mode}.json"

    def checkpoint() -> None:
        results.elapsed_s = time.perf_counter() - t_start
        rs.save_results(results, out)

    stamp = f"{env['device']} | torch {env['torch']} | triton {env['triton']} | {mode}"
    print(f"{stamp} | budget {budget:.0f} s | -> {out}", file=sys.stderr)
    measure_references(plan, device, results)
    checkpoint()
    if specs:
        bench_host.host_rows(plan, specs, device, results)
        checkpoint()
    run_kernels(plan, specs, device, results, deadline=deadline, checkpoint=checkpoint)
    checkpoint()
    if args.no_collectives:
        results.collectives_status = "not run: --no-collectives"
    elif deadline is not None and time.perf_counter() > deadline:
        results.collectives_status = "not run: time budget spent"
    else:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # rank 0 of the collectives shares this GPU
        results.collectives_status, rows = bc.run_collectives(plan, device, deadline=deadline)
        results.collectives.extend(rows)
    if skipped := sum(r.status.startswith("skipped") for r in results.kernels):
        results.notes.append(f"{skipped} kernel rows skipped: time budget of {budget:.0f} s spent")
    checkpoint()
    print(f"wrote {out} ({results.elapsed_s:.0f} s)", file=sys.stderr)
    if args.compare:
        print(rs.compare_kernels(results, rs.load_results(args.compare)))
    if not args.no_docs:
        if args.docs_dir:
            docs_dir = Path(args.docs_dir)
        else:
            docs_dir = ROOT / "docs" if mode == "full" else out.parent / f"{out.stem}-page"
        others = []
        for path in _kind_files(exclude=out):
            try:
                others.append(rs.load_results(path))
            except ValueError as exc:
                print(f"{path} not used for the page: {exc}", file=sys.stderr)
        write_page([results, *others], docs_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
