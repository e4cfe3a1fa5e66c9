"""Benchmark every kernel against the copy ceiling and every collective against bare NCCL.

Usage (from the repository root; nothing needs installing beyond torch + triton, plus
matplotlib for the plot and tqdm for the progress bar when present)::

    python3 benchmarks/run.py                    # full run on one GPU (budget 330 s of measuring)
    python3 benchmarks/run.py --quick            # subset (budget 90 s), < 2 min in all
    python3 benchmarks/run.py --out $OUT/bench.json --docs-dir $OUT/docs --commit <sha>
    python3 benchmarks/run.py --skip-kernels     # references + collectives only (>= 2 GPUs)
    python3 benchmarks/run.py --render-only a.json [b.json ...]   # page + PNG, no GPU needed
    TRITON_INTERPRET=1 python3 benchmarks/run.py --smoke          # CPU plumbing check

A run writes the results JSON (``--out``, default ``bench-results/<date>-<mode>.json``; saved
every few cases, so a run killed by a wall-clock limit still leaves its rows) and regenerates
``docs/performance.md`` + ``docs/performance.png`` (``--docs-dir``; a ``--smoke`` run writes
its page next to the JSON instead, so it never overwrites the real page). After
``--time-budget`` seconds no new measurement starts; the rest are recorded as skipped.
``--render-only`` merges several results files (the first wins; later ones add missing kernel
rows and, if the first has none, collectives) and ``--out`` then saves the merged file.
The ``src`` folders of ``packages/*`` are put on ``sys.path`` (and ``PYTHONPATH`` for spawned
ranks), so ``PYTHONPATH`` needs no setting.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_SRCS = [
    ROOT / "packages" / p / "src" for p in ("cp-common", "cp-dcp", "cp-pcp", "cp-testing")
]


def _setup_path() -> None:
    for src in reversed(PACKAGE_SRCS):
        if str(src) not in sys.path:
            sys.path.insert(0, str(src))
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    parts = [str(p) for p in PACKAGE_SRCS] + [here]
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([*parts, *([old] if old else [])])


REGENERATE = (
    "Regenerate on a GPU machine from the repository root with `python3 benchmarks/run.py` "
    "(or `nox -s bench`; `--quick` for a < 2 min subset): it writes the results JSON under "
    "`bench-results/`, this page and `performance.png`. Re-render this page and the plot from a "
    "saved results file without a GPU: `python3 benchmarks/run.py --render-only <results.json>` "
    "(several files are merged: e.g. a one-GPU kernel run plus a multi-GPU collectives run). "
    "Byte counts: each input read once, each output written once."
)


class _WrongResult(Exception):
    """A kernel row's result differs from its eager baseline beyond the tolerance."""


# GPU wait (µs) after each flush when timing an eager baseline cold (``time_cold``).
EAGER_HOST_GUARD_US = 300.0


@dataclass
class Plan:
    """What one mode measures and how long it times each point."""

    mode: str
    shapes: list[tuple[int, int]]
    ns: list[int]
    bs: list[int]
    dtypes: list[str]
    spot_dtype: str | None = None
    spot_shapes: list[tuple[int, int]] = field(default_factory=list)
    spot_ns: list[int] = field(default_factory=list)
    spot_bs: list[int] = field(default_factory=list)
    mask_hs: list[int] = field(default_factory=list)
    mask_bs: list[int] = field(default_factory=list)
    graph_max_b: int = 64
    warmup_ms: float = 10.0
    rep_ms: float = 40.0
    graph_repeats: int = 15
    graph_ms_per_repeat: float = 0.5
    calls_per_graph: int = 64
    # Host loops: the GPU machine's host is shared and noisy (add_ moved 6.5-11.5 µs between
    # runs); 1000 calls per round average more of it out than 200 did.
    host_calls: int = 1000
    host_rounds: int = 7
    copy_bytes: int = 1 << 30
    host_n: int = 4
    coll_shapes: list[tuple[int, int]] = field(default_factory=list)
    coll_bs: list[int] = field(default_factory=list)
    coll_iters: int = 20
    coll_reps: int = 5
    #: Stop starting new measurements after this many seconds (0: no limit); what is left is
    #: recorded as skipped, so a run under a wall-clock limit still writes its results.
    time_budget_s: float = 330.0


def make_plan(mode: str) -> Plan:
    """The shape grid and timing budget of ``mode`` (``full``, ``quick`` or ``smoke``)."""
    all_b = [1, 8, 64, 256, 1024, 4096]
    if mode == "full":
        return Plan(
            mode=mode,
            shapes=[(128, 512), (64, 128), (64, 256)],
            ns=[2, 4, 8],
            bs=all_b,
            dtypes=["bfloat16"],
            spot_dtype="float16",
            spot_shapes=[(128, 512), (64, 128)],
            spot_ns=[4],
            spot_bs=[1, 4096],
            mask_hs=[128, 64],
            mask_bs=all_b,
            coll_shapes=[(128, 512), (64, 128), (64, 256)],
            coll_bs=all_b,
        )
    if mode == "quick":
        return Plan(
            mode=mode,
            shapes=[(128, 512), (64, 128)],
            ns=[2, 4, 8],
            bs=[1, 8, 64, 4096],
            dtypes=["bfloat16"],
            mask_hs=[128, 64],
            mask_bs=[1, 8, 64, 4096],
            warmup_ms=5.0,
            rep_ms=20.0,
            graph_repeats=8,
            graph_ms_per_repeat=0.3,
            host_calls=100,
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
            dtypes=["bfloat16"],
            mask_hs=[4],
            mask_bs=[1, 8],
            graph_repeats=3,
            calls_per_graph=4,
            host_calls=3,
            host_rounds=2,
            copy_bytes=1 << 22,
            host_n=2,
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
    g.add_argument(
        "--quick", action="store_true", help="subset of shapes, shorter timing (< 2 min)"
    )
    g.add_argument(
        "--smoke", action="store_true", help="tiny shapes; runs on the CPU (TRITON_INTERPRET=1)"
    )
    g.add_argument(
        "--render-only",
        metavar="RESULTS_JSON",
        nargs="+",
        help="regenerate page + PNG from results file(s); later files add the rows the first lacks "
        "(e.g. a one-GPU kernel run + a multi-GPU --skip-kernels collectives run); --out saves "
        "the merged file",
    )
    p.add_argument("--out", help="results JSON path (default bench-results/<date>-<mode>.json)")
    p.add_argument(
        "--docs-dir", help="where performance.md/.png go (default docs/; smoke: next to --out)"
    )
    p.add_argument("--no-docs", action="store_true", help="write only the results JSON")
    p.add_argument("--kernels", help="comma-separated subset of kernel names")
    p.add_argument("--no-collectives", action="store_true", help="skip the multi-GPU collectives")
    p.add_argument(
        "--skip-kernels", action="store_true", help="only references + collectives (multi-GPU run)"
    )
    p.add_argument(
        "--time-budget",
        type=float,
        help="seconds after which no new measurement starts (default: full 330, quick 90; 0: none)",
    )
    p.add_argument("--commit", help="git commit to stamp (default: env CPATTN_BENCH_COMMIT or git)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm

        # Not a terminal (a batch job's log): redraw rarely so the log stays readable.
        interval = 0.1 if sys.stderr.isatty() else 15.0
        return tqdm(
            total=total, desc=desc, dynamic_ncols=True, file=sys.stderr, mininterval=interval
        )
    except ImportError:

        class _Plain:
            def __init__(self) -> None:
                self.n = 0

            def update(self, k: int = 1) -> None:
                self.n += k
                if self.n % 10 == 0 or self.n == total:
                    print(f"{desc}: {self.n}/{total}", file=sys.stderr, flush=True)

            def set_postfix_str(self, s: str) -> None:
                pass

            def close(self) -> None:
                pass

        return _Plain()


def _cycle(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    it: Iterator[Callable[[], object]] = itertools.cycle(fns)
    return lambda: next(it)()


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    return text[:160].replace("|", "/")


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
    """Timing of one provider rotated over its input sets (graph replay, or ``time_cold``:
    per-call CUDA events with L2 emptied by a read before each call, the GPU waiting
    ``host_guard_us`` after each flush for a provider whose host path is slower than flush
    plus call on the GPU).

    A graph capture that fails (an op that synchronises with the host, ...) is noted in
    ``notes`` and the provider is timed with ``time_cold`` instead."""
    import cpattn_testing.bench as hb

    if device.type != "cuda":
        return hb.time_wall(_cycle(fns), calls=2, rounds=2)
    if use_graph:
        calls = [fns[i % len(fns)] for i in range(max(plan.calls_per_graph, len(fns)))]
        try:
            return hb.time_cuda_graph(
                calls, repeats=plan.graph_repeats, target_ms_per_repeat=plan.graph_ms_per_repeat
            )
        except Exception as exc:  # capture refused (host sync, ...): time eagerly instead
            import torch

            torch.cuda.synchronize()
            t = hb.time_cold(
                _cycle(fns),
                warmup_ms=plan.warmup_ms,
                rep_ms=plan.rep_ms,
                host_guard_us=host_guard_us,
            )
            notes.append(f"{what}: CUDA-graph capture failed ({_short(exc)}); timed cold")
            return t
    return hb.time_cold(
        _cycle(fns), warmup_ms=plan.warmup_ms, rep_ms=plan.rep_ms, host_guard_us=host_guard_us
    )


def _cases(plan: Plan, spec: Any, case_cls: Any, torch: Any) -> list[Any]:
    out: list[Any] = []
    if not spec.uses_n:  # the LSE mask: depends on H and B only; LSE is fp32
        for h, b in itertools.product(plan.mask_hs, plan.mask_bs):
            out.append(case_cls(spec.name, torch.float32, h, 0, 0, b))
        return out
    grids = [(plan.dtypes, plan.shapes, plan.ns, plan.bs)]
    if plan.spot_dtype:
        grids.append(([plan.spot_dtype], plan.spot_shapes, plan.spot_ns, plan.spot_bs))
    for dtypes, shapes, ns, bs in grids:
        for dtype, (h, d), n, b in itertools.product(dtypes, shapes, ns, bs):
            if h % n == 0:
                out.append(case_cls(spec.name, getattr(torch, dtype), h, d, n, b))
    return out


def _priority(case: Any) -> int:
    """0 for the shapes the targets are judged on (measured first), 1 for the rest."""
    import bench_targets as bt

    on_target_shape = (case.H, case.D) in bt.HEAD_SHAPES or case.D == 0
    on_target_b = case.B in (*bt.DECODE_B, 4096)
    main_dtype = str(case.dtype) in ("torch.bfloat16", "torch.float32")
    return 0 if (on_target_shape and on_target_b and main_dtype) else 1


def _host_rows(plan: Plan, specs: list[Any], device: Any, results: Any, *, plans_on: bool) -> None:
    """Host rows of every spec at decode size: the Python path (launch plans off), or with
    ``plans_on`` the default path of a GPU process (launch plans on), rows named
    ``<kernel> [plans]`` (after a compiling and a recording call; a row whose call does not
    replay says why), on a GPU only. Plans are off afterwards."""
    import bench_kernels as bk
    import torch

    import cpattn_testing.bench as hb
    from cpattn_common import launch_plans as lp

    if plans_on:
        if device.type != "cuda":
            return
        if not lp.set_launch_plans_enabled(True):
            results.notes.append(f"launch plans not measured: {lp.launch_plans_reason()}")
            return
        lp.clear_launch_plans()
    else:
        lp.set_launch_plans_enabled(False)
    add = hb.host_reference_add(device)
    add_out = hb.host_reference_add_out(device)
    try:
        for spec in specs:
            if spec.uses_n:
                n = min(plan.host_n, max(plan.ns))
                dtype = getattr(torch, plan.dtypes[0])
                cases = [bk.Case(spec.name, dtype, h, d, n, 1) for h, d in plan.shapes[:2]]
            else:
                cases = [bk.Case(spec.name, torch.float32, h, 0, 0, 1) for h in plan.mask_hs]
            for case in cases:
                name = f"{spec.name} [plans]" if plans_on else spec.name
                hrow = hb.HostRow(
                    kernel=name, dtype=case.dtype_name, H=case.H, D=case.D, N=case.N, B=1
                )
                results.host.append(hrow)
                try:
                    gen = torch.Generator(device=device).manual_seed(1234)
                    inp = spec.make_inputs(case, device, gen)
                    ours = spec.bind_ours(case, inp)
                    if plans_on:
                        for _ in range(3):  # the key's first call (compiles), record, replay
                            ours()
                        hits = lp.launch_plans_info()["hits"]
                        ours()
                        if lp.launch_plans_info()["hits"] != hits + 1:
                            reason = lp.launch_plans_info()["last_refusal"]
                            hrow.status = f"error: not replayed ({reason})"
                            continue
                    # Our op in the same rounds as add_ and torch.add (the ratios are per
                    # round, see measure_host_rounds), then the eager baseline.
                    timed = hb.measure_host_rounds(
                        {"add_": add, "torch.add": add_out, "ours": ours},
                        calls=plan.host_calls,
                        rounds=plan.host_rounds,
                    )
                    if not plans_on:
                        te = hb.measure_host_overhead(
                            spec.bind_eager(case, inp),
                            calls=plan.host_calls,
                            rounds=plan.host_rounds,
                        )
                        hrow.eager_baseline_host_us = te.median_ms * 1e3
                    hrow.host_us = timed.timing("ours").median_ms * 1e3
                    hrow.add_us = timed.timing("add_").median_ms * 1e3
                    hrow.ratio_to_add = timed.ratio("ours", "add_")
                    hrow.add_out_us = timed.timing("torch.add").median_ms * 1e3
                    hrow.ratio_to_add_out = timed.ratio("ours", "torch.add")
                except Exception as exc:
                    hrow.status = f"error: {_short(exc)}"
    finally:
        if plans_on:
            lp.clear_launch_plans()
            lp.set_launch_plans_enabled(False)


def run_kernels(
    plan: Plan,
    specs: list[Any],
    device: Any,
    results: Any,
    *,
    deadline: float | None,
    checkpoint: Callable[[], None],
) -> None:
    """Time every case of every available spec; fills ``results.kernels`` and ``.host``.

    Host overhead first (cheap), then the cases the targets are judged on, then the rest.
    After ``deadline`` (``time.perf_counter()`` value) no new case starts: the rest get
    ``status = "skipped: time budget"``. ``checkpoint()`` saves partial results now and then.
    """
    import bench_kernels as bk
    import torch

    import cpattn_testing.bench as hb

    refs = results.references
    ok_specs = [s for s in specs if s.status == "ok"]
    work = [(s, c) for s in ok_specs for c in _cases(plan, s, bk.Case, torch)]
    work.sort(key=lambda sc: _priority(sc[1]))  # stable: keeps kernel / shape order within
    bar = _progress(len(work) + len(ok_specs), f"kernels ({plan.mode})")

    # Host overhead of one eager call at decode size, next to torch add_ and torch.add: the
    # Python path (launch plans off), then the default path (launch plans on).
    bar.set_postfix_str("host")
    for plans_on in (False, True):
        _host_rows(plan, ok_specs, device, results, plans_on=plans_on)
    bar.update(len(ok_specs))

    from cpattn_testing.tolerances import tolerance

    size_copy_bps: dict[int, float] = {}  # bytes moved -> same-size copy bandwidth (cold)
    # (bytes moved, rotating sets) -> same-size copy bandwidth under graph replay
    graph_copy_bps: dict[tuple[int, int], float] = {}
    for i, (spec, case) in enumerate(work):
        bar.set_postfix_str(f"{spec.name} H={case.H} D={case.D} N={case.N} B={case.B}")
        row = hb.KernelRow(
            kernel=spec.name,
            dtype=case.dtype_name,
            H=case.H,
            D=case.D,
            N=case.N,
            B=case.B,
            bytes=spec.nbytes(case),
            byte_formula=spec.byte_formula,
        )
        results.kernels.append(row)
        if deadline is not None and time.perf_counter() > deadline:
            row.status = "skipped: time budget"
            bar.update(1)
            continue
        where = f"`{spec.name}` {case.dtype_name} H={case.H} D={case.D} N={case.N} B={case.B}"
        try:
            seed = zlib.crc32(where.encode())
            gen = torch.Generator(device=device).manual_seed(seed)
            n_sets = hb.rotation_count(row.bytes, refs.l2_bytes) if device.type == "cuda" else 2
            sets = [spec.make_inputs(case, device, gen) for _ in range(n_sets)]
            row.input_sets = n_sets
            row.check_rel_err = spec.check(case, sets[0])
            # Two results of the dtype, each within the dtype's tolerance of the exact one.
            tol = 2 * tolerance(case.dtype)[2]
            if not row.check_rel_err <= tol:
                # A wrong result is no result: the row is not timed and fails its targets.
                raise _WrongResult(
                    f"differs from the eager baseline (relative error "
                    f"{row.check_rel_err:.2e} > {tol:.0e})"
                )
            use_graph = device.type == "cuda" and plan.graph_max_b >= case.B
            ours_fns = [spec.bind_ours(case, s) for s in sets]
            t = _time_fns(ours_fns, use_graph, plan, device, results.notes, where)
            row.timing, row.ms, row.ms_p20, row.ms_p80 = t.method, t.median_ms, t.p20_ms, t.p80_ms
            row.bytes_per_s = row.bytes / (t.median_ms * 1e-3)
            if refs.copy_bytes_per_s:
                row.copy_ratio = row.bytes_per_s / refs.copy_bytes_per_s
            if t.method == "cold":
                if row.bytes not in size_copy_bps:
                    moved, tc = hb.measure_copy_ceiling(
                        device,
                        nbytes=row.bytes // 2,
                        warmup_ms=plan.warmup_ms,
                        rep_ms=plan.rep_ms,
                        timer=hb.time_cold,
                    )
                    size_copy_bps[row.bytes] = moved / (tc.median_ms * 1e-3)
                row.size_copy_ratio = row.bytes_per_s / size_copy_bps[row.bytes]
            if t.method == "cuda_graph":
                key = (row.bytes, n_sets)
                if key not in graph_copy_bps:
                    moved, tc = hb.measure_copy_graph(
                        device,
                        nbytes=row.bytes // 2,
                        sets=n_sets,
                        calls_per_graph=plan.calls_per_graph,
                    )
                    graph_copy_bps[key] = moved / (tc.median_ms * 1e-3)
                row.size_copy_ratio = row.bytes_per_s / graph_copy_bps[key]
            if t.method == "cuda_graph" and refs.empty_graph_us:
                row.empty_graph_ratio = t.median_ms * 1e3 / refs.empty_graph_us
                if refs.copy_bytes_per_s:
                    # The decode floor: launch latency (an empty kernel) or, for payloads too
                    # big for that (B=64 of an MLA layer moves tens of MB), the bytes at the
                    # copy bandwidth, whichever is larger.
                    floor_us = max(refs.empty_graph_us, row.bytes / refs.copy_bytes_per_s * 1e6)
                    row.floor_ratio = t.median_ms * 1e3 / floor_us
            try:
                eager_fns = [spec.bind_eager(case, s) for s in sets]
                # The eager baselines run several torch ops per call (71-245 µs of host time at
                # B=256-1024 on the H200's host): without the guard their samples took host time
                # in, which made the "vs eager" column flatter us.
                te = _time_fns(
                    eager_fns,
                    use_graph,
                    plan,
                    device,
                    results.notes,
                    f"eager baseline of {where}",
                    host_guard_us=EAGER_HOST_GUARD_US,
                )
                row.eager_timing, row.eager_ms = te.method, te.median_ms
                row.eager_speedup = te.median_ms / t.median_ms
            except Exception as exc:
                results.notes.append(f"eager baseline of {where} failed: {_short(exc)}")
            del sets
        except _WrongResult as exc:
            row.status = f"error: {exc}"
            results.notes.append(f"{where}: {row.status}")
        except Exception as exc:
            row.status = f"error: {_short(exc)}"
        if device.type == "cuda" and case.B >= 1024:
            torch.cuda.empty_cache()
        if i % 10 == 9:
            checkpoint()
        bar.update(1)
    bar.close()


def measure_references(plan: Plan, device: Any, results: Any) -> None:
    """Copy ceiling, empty-kernel graph replay, add_ and JIT-launch host time (same run)."""
    import cpattn_testing.bench as hb

    refs = results.references
    refs.l2_bytes = hb.l2_cache_bytes(device)
    refs.calls_per_graph = plan.calls_per_graph
    moved, t = hb.measure_copy_ceiling(
        device,
        nbytes=plan.copy_bytes,
        warmup_ms=plan.warmup_ms,
        rep_ms=plan.rep_ms,
        timer=hb.time_cold,  # the kernels' bandwidth rows are timed the same way
    )
    refs.copy_bytes, refs.copy_ms, refs.copy_timing = moved, t.median_ms, t.method
    refs.host_calls, refs.host_rounds = plan.host_calls, plan.host_rounds
    refs.copy_bytes_per_s = moved / (t.median_ms * 1e-3)
    try:
        refs.empty_graph_us = (
            hb.measure_empty_kernel_graph(device, calls_per_graph=plan.calls_per_graph).median_ms
            * 1e3
        )
    except Exception as exc:
        results.notes.append(f"empty-kernel graph replay not measured: {_short(exc)}")
    try:
        refs.touch_graph_us = (
            hb.measure_touch_kernel_graph(device, calls_per_graph=plan.calls_per_graph).median_ms
            * 1e3
        )
    except Exception as exc:
        results.notes.append(f"load+store kernel graph replay not measured: {_short(exc)}")
    try:
        host = hb.measure_reference_host_times(
            device, calls=plan.host_calls, rounds=plan.host_rounds
        )
        refs.add_host_us = host["torch_add_"].median_ms * 1e3
        refs.empty_launch_host_us = host["triton_jit_launch"].median_ms * 1e3
        # The cached launch path (issue 3) as a host row: same empty kernel, plain JIT launch
        # as its baseline, in rounds alternating with add_ like the ops' rows.
        launch_row = hb.HostRow(kernel="launch_cached", dtype="float32", H=0, D=0, N=0, B=1)
        t, ta, ratio = hb.measure_host_ratio(
            hb.empty_kernel_launcher(device, cached=True),
            hb.host_reference_add(device),
            calls=plan.host_calls,
            rounds=plan.host_rounds,
        )
        launch_row.host_us = t.median_ms * 1e3
        launch_row.eager_baseline_host_us = refs.empty_launch_host_us
        launch_row.add_us = ta.median_ms * 1e3
        launch_row.ratio_to_add = ratio
        results.host.append(launch_row)
    except Exception as exc:
        results.notes.append(f"reference host times not measured: {_short(exc)}")


def render(results: Any, docs_dir: Path) -> tuple[Path, Path | None]:
    """Write ``performance.md`` (+ ``performance.png`` when matplotlib is present)."""
    import bench_kernels as bk
    import bench_targets as bt

    import cpattn_testing.bench as hb

    titles = {s.name: s.title for s in bk.all_specs()}
    titles.update(
        {f"{s.name} [plans]": f"{s.title}, launch plans on (the default)" for s in bk.all_specs()}
    )
    titles["launch_cached"] = (
        "cp-common `launch_cached` of an empty kernel (baseline: plain `kernel[grid](...)`)"
    )
    docs_dir.mkdir(parents=True, exist_ok=True)
    png: Path | None = None
    try:
        png = hb.plot_bandwidth(
            results, docs_dir / "performance.png", kernel_titles={k: k for k in titles}
        )
    except ImportError as exc:
        print(f"no plot: {exc}", file=sys.stderr)
    md = hb.render_markdown(
        results,
        bt.targets(),
        png_name="performance.png" if png is not None else None,
        regenerate=REGENERATE,
        kernel_titles=titles,
    )
    page = docs_dir / "performance.md"
    page.write_text(md + "\n")
    return page, png


def summarize(results: Any) -> None:
    import bench_targets as bt

    import cpattn_testing.bench as hb

    print("\nTargets:", file=sys.stderr)
    for target in bt.targets():
        r = hb.evaluate_target(target, results)
        worst = "–" if r.worst is None else f"{r.worst:.3g}"
        print(
            f"  {r.status:>12}  {target.name:<36} worst {worst} ({r.worst_where})", file=sys.stderr
        )


#: NVLink multicast stays off in this process and in every rank it starts (project rule).
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _setup_path()
    for key, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(key, value)

    if args.render_only:
        import cpattn_testing.bench as hb

        results = hb.merge_results([hb.load_results(p) for p in args.render_only])
        if args.out:
            print(f"wrote {hb.save_results(results, args.out)}")
        docs_dir = Path(args.docs_dir) if args.docs_dir else ROOT / "docs"
        page, png = render(results, docs_dir)
        print(f"wrote {page}" + (f" and {png}" if png else ""))
        summarize(results)
        return 0

    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    import torch

    if mode == "smoke" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before our Triton kernels are defined

    if not torch.cuda.is_available() and mode != "smoke":
        print("no CUDA device: use --smoke (CPU plumbing check) or --render-only", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print(
            "--smoke on the CPU needs TRITON_INTERPRET=1 (set it before starting)", file=sys.stderr
        )
        return 2

    import bench_collectives as bc
    import bench_kernels as bk

    import cpattn_testing.bench as hb

    try:
        from cpattn_common import set_output_poison

        set_output_poison(None)
    except ImportError:
        pass

    t_start = time.perf_counter()
    plan = make_plan(mode)
    budget = plan.time_budget_s if args.time_budget is None else args.time_budget
    deadline = t_start + budget if budget > 0 else None
    env = hb.environment_stamp(commit=args.commit, repo_root=ROOT)
    results = hb.Results(env=env, mode=mode, references=hb.References())
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "bench-results" / f"{stamp}-{mode}.json"

    def checkpoint() -> None:
        results.elapsed_s = time.perf_counter() - t_start
        hb.save_results(results, out)

    specs = bk.all_specs()
    if args.kernels:
        wanted = {k.strip() for k in args.kernels.split(",") if k.strip()}
        unknown = wanted - {s.name for s in specs}
        if unknown:
            print(
                f"unknown kernels {sorted(unknown)}; known: {[s.name for s in specs]}",
                file=sys.stderr,
            )
            return 2
        specs = [s for s in specs if s.name in wanted]
    if args.skip_kernels:
        specs = []
    for spec in specs:
        results.kernel_status[spec.name] = spec.resolve()
        results.byte_formulas[spec.name] = spec.byte_formula
        if spec.status != "ok":
            print(f"{spec.name}: {spec.status}", file=sys.stderr)

    print(
        f"{env['device']} | torch {env['torch']} | triton {env['triton']} | mode {mode} | "
        f"budget {budget:.0f} s | results -> {out}",
        file=sys.stderr,
    )
    measure_references(plan, device, results)
    refs = results.references
    print(
        f"copy ceiling {(refs.copy_bytes_per_s or 0) / 1e12:.3f} TB/s, "
        f"empty kernel in graph {refs.empty_graph_us} us, add_ host {refs.add_host_us} us",
        file=sys.stderr,
    )
    checkpoint()
    run_kernels(plan, specs, device, results, deadline=deadline, checkpoint=checkpoint)
    checkpoint()

    if args.no_collectives:
        results.collectives_status = "not run: --no-collectives"
    elif deadline is not None and time.perf_counter() > deadline:
        results.collectives_status = "not run: time budget exhausted"
    else:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # rank 0 of the collectives shares this GPU
        results.collectives_status, rows = bc.run_collectives(plan, device, deadline=deadline)
        results.collectives.extend(rows)
    skipped = sum(r.status.startswith("skipped") for r in results.kernels)
    if skipped:
        results.notes.append(f"{skipped} kernel rows skipped: time budget of {budget:.0f} s spent")
    checkpoint()
    print(f"wrote {out}", file=sys.stderr)
    if not args.no_docs:
        if args.docs_dir:
            docs_dir = Path(args.docs_dir)
        elif mode == "smoke":
            docs_dir = out.parent / f"{out.stem}-page"
        else:
            docs_dir = ROOT / "docs"
        page, png = render(results, docs_dir)
        print(f"wrote {page}" + (f" and {png}" if png else ""), file=sys.stderr)
    summarize(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
