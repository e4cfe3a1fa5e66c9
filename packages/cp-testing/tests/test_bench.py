"""CPU tests of the benchmark harness plumbing (cpattn_testing.bench): results JSON schema,
target evaluation, markdown page and PNG from a fake result set, CPU timing fallbacks."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from cpattn_testing import bench as hb

COPY = 4.27e12  # bytes/s, read + write
EMPTY_US = 0.5
ADD_US = 11.6


def _row(
    kernel: str, h: int, d: int, n: int, b: int, ratio: float, *, dtype: str = "bfloat16"
) -> hb.KernelRow:
    """A plausible row: ``ratio`` of the copy ceiling, graph timing for decode sizes."""
    nbytes = max(1, n) * b * h * (max(d, 1) * 2 + 4) + b * h * (max(d, 1) * 2 + 4)
    bps = ratio * COPY
    ms = nbytes / bps * 1e3
    graph = b <= 64
    return hb.KernelRow(
        kernel=kernel,
        dtype=dtype,
        H=h,
        D=d,
        N=n,
        B=b,
        bytes=nbytes,
        byte_formula="read N·B·H·D·s + N·B·H·4; write B·H·D·s + B·H·4",
        timing="cuda_graph" if graph else "do_bench",
        ms=ms,
        ms_p20=ms * 0.98,
        ms_p80=ms * 1.03,
        bytes_per_s=bps,
        copy_ratio=ratio,
        eager_timing="cuda_graph" if graph else "do_bench",
        eager_ms=ms * 3.0,
        eager_speedup=3.0,
        empty_graph_ratio=(ms * 1e3 / EMPTY_US) if graph else None,
        check_rel_err=1e-3,
    )


def fake_results() -> hb.Results:
    """merge meets every bandwidth target; correct_attn_out misses one; a2a_pack is missing."""
    refs = hb.References(
        copy_bytes=2 << 30,
        copy_ms=(2 << 30) / COPY * 1e3,
        copy_bytes_per_s=COPY,
        empty_graph_us=EMPTY_US,
        empty_launch_host_us=11.8,
        add_host_us=ADD_US,
    )
    res = hb.Results(
        env={
            "date": "2026-11-29T08:00:00Z",
            "device": "NVIDIA H200",
            "device_count": "1",
            "driver": "580.00",
            "cuda": "13.0",
            "torch": "2.11.0+cu130",
            "triton": "3.6.0",
            "python": "3.12.3",
            "git_commit": "deadbeef",
        },
        mode="full",
        references=refs,
        kernel_status={
            "merge_attn_states": "ok",
            "correct_attn_out": "ok",
            "a2a_pack": "missing: no module",
        },
    )
    for kernel in ("merge_attn_states", "correct_attn_out"):
        for h, d in ((128, 512), (64, 128)):
            for n in (2, 4, 8):
                for b in (1, 8, 64, 256, 1024, 4096):
                    ratio = 0.9 if b == 4096 else 0.002 * b**0.7
                    if kernel == "correct_attn_out" and (h, d, n, b) == (64, 128, 8, 4096):
                        ratio = 0.6
                    res.kernels.append(_row(kernel, h, d, n, b, ratio))
    res.kernels.append(_row("merge_attn_states", 128, 512, 4, 1, 0.5, dtype="float16"))
    res.kernels[-1].status = "error: RuntimeError: boom"
    res.host += [
        hb.HostRow(
            "merge_attn_states", "bfloat16", 128, 512, 4, 1, 8.0, 60.0, ADD_US, 8.0 / ADD_US
        ),
        hb.HostRow(
            "correct_attn_out", "bfloat16", 128, 512, 4, 1, 15.0, 60.0, ADD_US, 15.0 / ADD_US
        ),
    ]
    res.collectives_status = "not run: needs >= 2 GPUs (this machine has 1)"
    res.byte_formulas = {"merge_attn_states": "read …; write …"}
    return res


def _targets() -> list[hb.Target]:
    shapes = ((128, 512), (64, 128))
    out = [
        hb.Target(
            f"bw/{k}",
            "issue 3",
            f"{k} bw",
            "kernels",
            k,
            "copy_ratio",
            ">=",
            0.85,
            shapes=shapes,
            ns=(2, 4, 8),
            bs=(4096,),
            unit="percent",
        )
        for k in ("merge_attn_states", "correct_attn_out", "a2a_pack")
    ]
    out.append(
        hb.Target(
            "decode/merge",
            "issue 5",
            "merge decode",
            "kernels",
            "merge_attn_states",
            "empty_graph_ratio",
            "<=",
            1.5,
            shapes=shapes,
            ns=(2, 4, 8),
            bs=(1, 8, 64),
            unit="x",
        )
    )
    out += [
        hb.Target(
            f"host/{k}",
            "issue 5",
            f"{k} host",
            "host",
            k,
            "host_us",
            "<=",
            10.0,
            dtypes=(),
            alt_metric="ratio_to_add",
            alt_threshold=1.5,
            unit="us",
        )
        for k in ("merge_attn_states", "correct_attn_out")
    ]
    return out


def test_results_json_roundtrip_and_schema(tmp_path: Path) -> None:
    res = fake_results()
    path = hb.save_results(res, tmp_path / "r" / "results.json")
    data = json.loads(path.read_text())
    assert hb.validate_results_dict(data) == []
    assert data["schema"] == hb.SCHEMA
    for key in ("device", "driver", "cuda", "torch", "triton", "git_commit", "date"):
        assert isinstance(data["env"][key], str)
    back = hb.load_results(path)
    assert back == res


def test_schema_errors_are_reported() -> None:
    data = hb.results_to_dict(fake_results())
    data["schema"] = "other/9"
    data["kernels"][0]["B"] = "4096"
    data["kernels"][1]["ms"] = "fast"
    del data["env"]["torch"]
    errors = hb.validate_results_dict(data)
    joined = "\n".join(errors)
    assert "schema" in joined
    assert "kernels[0].B" in joined
    assert "kernels[1].ms" in joined
    assert "env['torch']" in joined
    with pytest.raises(ValueError, match="invalid results file"):
        hb.results_from_dict(data)


def test_target_statuses() -> None:
    res = fake_results()
    got = {t.name: hb.evaluate_target(t, res) for t in _targets()}
    assert got["bw/merge_attn_states"].status == "met"
    assert got["bw/merge_attn_states"].passed == 6
    bad = got["bw/correct_attn_out"]
    assert bad.status == "not met"
    assert bad.worst == pytest.approx(0.6)
    assert "N=8" in bad.worst_where
    assert got["bw/a2a_pack"].status == "not measured"
    # decode: B=1 rows are ~0.5 us = 1x the empty kernel, B=64 rows are slower
    assert got["decode/merge"].status in ("met", "not met")
    assert got["host/merge_attn_states"].status == "met"  # 8 us <= 10 us
    assert got["host/correct_attn_out"].status == "met"  # 15 us but 1.29x add_


def test_target_incomplete_when_rows_missing() -> None:
    res = fake_results()
    res.kernels = [r for r in res.kernels if not (r.kernel == "merge_attn_states" and r.N == 8)]
    r = hb.evaluate_target(_targets()[0], res)
    assert r.status == "incomplete"
    assert (r.measured, r.expected) == (4, 6)


def test_a_host_target_with_an_errored_row_is_not_met() -> None:
    """Host targets select rows by kernel only (any shape): a row that errored (a call that
    did not replay, say) must still count, or the target reads "met" on the rows that
    worked."""
    res = fake_results()
    res.host[0].status = "error: not replayed (planted)"
    res.host[0].host_us = None
    target = next(t for t in _targets() if t.name == "host/merge_attn_states")
    r = hb.evaluate_target(target, res)
    assert r.status == "not measured"
    res.host.append(dataclasses.replace(res.host[1], kernel="merge_attn_states", H=64, D=128))
    r = hb.evaluate_target(target, res)
    assert r.status == "incomplete"
    assert (r.measured, r.expected) == (1, 2)


def test_an_ok_row_without_a_metric_value_still_counts_as_expected() -> None:
    """A selected "ok" row whose metric is missing is unmeasured, with a wildcard selector
    too (the host target selects by kernel only): the target reads "incomplete", not "met"."""
    res = fake_results()
    target = next(t for t in _targets() if t.name == "host/merge_attn_states")
    res.host.append(dataclasses.replace(res.host[0], H=64, D=128, host_us=None))
    r = hb.evaluate_target(target, res)
    assert r.status == "incomplete"
    assert (r.measured, r.expected) == (1, 2)


def test_markdown_page() -> None:
    res = fake_results()
    md = hb.render_markdown(res, _targets(), png_name="performance.png", regenerate="Run `x`.",
                            kernel_titles={"merge_attn_states": "merge (cp-common)"})  # fmt: skip
    assert md.startswith("# Performance")
    assert "Run `x`." in md
    for text in ("NVIDIA H200", "2.11.0+cu130", "deadbeef", "4.27 TB/s"):
        assert text in md
    for text in ("✅ met", "❌ not met", "– not measured"):
        assert text in md
    assert "`a2a_pack`: missing: no module" in md
    assert "### merge (cp-common)" in md
    assert "error: RuntimeError: boom" in md
    assert "](performance.png)" in md
    assert "not run: needs >= 2 GPUs" in md
    # every table row has the same number of cells as its header
    for block in md.split("\n\n"):
        rows = [ln for ln in block.splitlines() if ln.startswith("|")]
        if rows:
            assert len({ln.count(" | ") for ln in rows[:2]}) == 1, rows[:2]


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = hb.plot_bandwidth(fake_results(), tmp_path / "perf.png")
    assert out is not None
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = fake_results()
    empty.kernels = []
    assert hb.plot_bandwidth(empty, tmp_path / "none.png") is None


def test_rotation_count() -> None:
    l2 = 60_000_000
    assert hb.rotation_count(200_000_000, l2) == 1
    assert hb.rotation_count(40_000_000, l2) == 3
    assert hb.rotation_count(1_000, l2) == 32
    with pytest.raises(ValueError, match="positive"):
        hb.rotation_count(0, l2)


def test_cpu_timing_fallbacks() -> None:
    x = torch.zeros(256)
    t = hb.time_wall(lambda: x.add_(1.0), calls=3, rounds=3)
    assert t.method == "wall"
    assert 0 < t.p20_ms <= t.median_ms <= t.p80_ms
    h = hb.measure_host_overhead(lambda: x.add_(1.0), calls=10, rounds=3)
    assert math.isfinite(h.median_ms)
    assert h.median_ms > 0
    moved, tc = hb.measure_copy_ceiling(torch.device("cpu"), nbytes=1 << 16)
    assert moved == 2 * (1 << 16)
    assert tc.median_ms > 0


def test_host_references() -> None:
    """``add_`` works in place; the second reference allocates a new output per call."""
    dev = torch.device("cpu")
    add_, add = hb.host_reference_add(dev), hb.host_reference_add_out(dev)
    first, second = add(), add()
    assert isinstance(first, torch.Tensor)
    assert isinstance(second, torch.Tensor)
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, torch.ones(1024))
    assert add_() is add_()


def test_copy_graph_counts_read_and_write_and_checks_sets() -> None:
    """CPU fallback of the decode rows' same-size copy: bytes = read + write of whole bf16
    elements; at least one buffer pair."""
    moved, tc = hb.measure_copy_graph(torch.device("cpu"), nbytes=1001, sets=3)
    assert moved == 4 * 500
    assert tc.method == "wall"
    assert tc.median_ms > 0
    with pytest.raises(ValueError, match="sets"):
        hb.measure_copy_graph(torch.device("cpu"), nbytes=64, sets=0)
    with pytest.raises(ValueError, match="calls_per_graph"):
        hb.measure_copy_graph(torch.device("cpu"), nbytes=64, sets=1, calls_per_graph=0)


def test_copy_graph_holds_as_many_calls_as_the_rows_it_is_compared_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row's graph holds ``calls_per_graph`` calls; the copy it is compared with must too
    (fewer calls spread the replay's own cost over fewer copies, flattering the row)."""
    captured: list[int] = []

    def fake_graph(fns: Any, **kwargs: Any) -> hb.Timing:
        captured.append(len(fns))
        return hb.Timing(1.0, 1.0, 1.0, "cuda_graph")

    monkeypatch.setattr(hb, "time_cuda_graph", fake_graph)
    monkeypatch.setattr(torch, "randn", lambda n, device: torch.zeros(n))
    monkeypatch.setattr(torch, "empty", lambda n, device, dtype: torch.zeros(n, dtype=dtype))
    for sets, calls, want in ((1, 64, 64), (4, 64, 64), (32, 16, 32)):
        hb.measure_copy_graph(torch.device("cuda"), nbytes=64, sets=sets, calls_per_graph=calls)
        assert captured[-1] == want


@pytest.mark.gpu
def test_copy_graph_replays_every_pair() -> None:
    """On the GPU the copies are captured into one graph and timed by replays."""
    moved, tc = hb.measure_copy_graph(torch.device("cuda"), nbytes=1 << 14, sets=4)
    assert moved == 2 * (1 << 14)
    assert tc.method == "cuda_graph"
    assert tc.median_ms > 0


@pytest.mark.gpu
def test_time_cold_with_host_guard_times_the_call_not_the_guard() -> None:
    """The GPU wait of ``host_guard_us`` runs before the start event: a call timed with a 200
    µs guard is not 200 µs slower than without it (a small copy takes a few µs)."""
    src = torch.randn(1 << 16, device="cuda")
    dst = torch.empty_like(src)
    plain = hb.time_cold(lambda: dst.copy_(src), warmup_ms=2.0, rep_ms=5.0)
    guarded = hb.time_cold(lambda: dst.copy_(src), warmup_ms=2.0, rep_ms=5.0, host_guard_us=200.0)
    assert plain.method == guarded.method == "cold"
    assert 0 < guarded.median_ms < plain.median_ms + 0.1
    assert torch.equal(dst, src)


def test_host_ratio_interleaves_and_compares_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds alternate ref, fn; the ratio is the median of per-round ratios."""
    order: list[str] = []
    ticks = iter(range(10_000))
    clock = {"now": 0.0}

    def ref() -> None:
        order.append("r")
        clock["now"] += 1.0  # 1 ms per ref call

    def fn() -> None:
        order.append("f")
        clock["now"] += 3.0 if next(ticks) % 2 else 2.0  # 2 or 3 ms per fn call

    with monkeypatch.context() as m:
        m.setattr(hb.time, "perf_counter", lambda: clock["now"] / 1e3)
        t_fn, t_ref, ratio = hb.measure_host_ratio(fn, ref, calls=4, rounds=3)
    assert order[:6] == ["r", "f"] * 3  # warm-up
    assert order[6:] == (["r"] * 4 + ["f"] * 4) * 3
    assert t_ref.median_ms == pytest.approx(1.0)
    assert t_fn.median_ms == pytest.approx(2.5)
    assert ratio == pytest.approx(2.5)
    x = torch.zeros(8)
    _, _, r = hb.measure_host_ratio(lambda: x.add_(1.0), hb.host_reference_add(x.device))
    assert math.isfinite(r)
    assert r > 0


def test_host_rounds_time_every_function_in_each_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round runs a loop of every function in the mapping's order; ratios are per round."""
    order: list[str] = []
    clock = {"now": 0.0, "round": 0}
    cost = {"a": 1.0, "b": 2.0}

    def make(name: str) -> Callable[[], None]:
        def fn() -> None:
            order.append(name)
            if name == "c":  # 3 ms per call in even rounds, 6 ms in odd ones
                clock["now"] += 6.0 if clock["round"] % 2 else 3.0
            else:
                clock["now"] += cost[name]

        return fn

    fns = {name: make(name) for name in ("a", "b", "c")}
    real_loop = hb._host_loop_ms

    def loop(fn: Callable[[], object], calls: int) -> float:
        t = real_loop(fn, calls)
        if fn is fns["c"]:
            clock["round"] += 1
        return t

    with monkeypatch.context() as m:
        m.setattr(hb.time, "perf_counter", lambda: clock["now"] / 1e3)
        m.setattr(hb, "_host_loop_ms", loop)
        timed = hb.measure_host_rounds(fns, calls=2, rounds=3)
    assert order[:9] == ["a", "b", "c"] * 3  # warm-up
    assert order[9:] == (["a"] * 2 + ["b"] * 2 + ["c"] * 2) * 3
    assert timed.samples_ms == {
        "a": pytest.approx([1.0] * 3),
        "b": pytest.approx([2.0] * 3),
        "c": pytest.approx([3.0, 6.0, 3.0]),
    }
    assert timed.timing("c").median_ms == pytest.approx(3.0)
    assert timed.ratio("c", "a") == pytest.approx(3.0)
    assert timed.ratio("b", "c") == pytest.approx(2.0 / 3.0)
    with pytest.raises(ValueError, match="at least one"):
        hb.measure_host_rounds({})


def test_environment_stamp_keys() -> None:
    stamp = hb.environment_stamp(commit="abc123")
    assert stamp["git_commit"] == "abc123"
    for key in ("date", "device", "driver", "cuda", "torch", "triton", "python"):
        assert stamp[key]


def test_notes_are_deduplicated_and_capped() -> None:
    res = fake_results()
    res.notes = ["same"] * 3 + [f"note {i}" for i in range(50)]
    md = hb.render_markdown(res, [], png_name=None, max_notes=5)
    assert md.count("- same") == 1
    assert "and 46 more" in md


def test_render_only_cli(tmp_path: Path) -> None:
    """``benchmarks/run.py --render-only`` (repository checkout only) regenerates page + PNG."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    script = root / "benchmarks" / "run.py"
    if not script.is_file():
        pytest.skip("benchmarks/run.py is not part of this checkout")
    results = hb.save_results(fake_results(), tmp_path / "results.json")
    docs = tmp_path / "docs"
    proc = subprocess.run(
        [sys.executable, str(script), "--render-only", str(results), "--docs-dir", str(docs)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    page = (docs / "performance.md").read_text()
    assert "NVIDIA H200" in page
    assert "met" in page
    if (docs / "performance.png").exists():
        assert (docs / "performance.png").stat().st_size > 1000


def test_non_finite_numbers_are_saved_as_null(tmp_path: Path) -> None:
    res = fake_results()
    res.kernels[0].check_rel_err = float("inf")
    res.kernels[1].ms = float("nan")
    data = json.loads(hb.save_results(res, tmp_path / "r.json").read_text())
    assert data["kernels"][0]["check_rel_err"] is None
    assert data["kernels"][1]["ms"] is None


def test_merge_results_takes_missing_rows_and_collectives() -> None:
    base = fake_results()
    other = fake_results()
    other.env = dict(other.env, device_count="8", date="2026-11-29T09:00:00Z")
    other.kernels = [_row("a2a_pack", 128, 512, 2, 4096, 0.88)]
    other.kernel_status = {"a2a_pack": "ok"}
    other.collectives = [
        hb.CollectiveRow(
            "nccl: all_to_all_single",
            8,
            "bfloat16",
            128,
            512,
            4096,
            1 << 20,
            "B·H·(D+P)·s",
            50.0,
            2e10,
            1.75e10,
        )
    ]
    other.collectives_status = "ran world sizes [2, 4, 8] on 8 GPUs (nccl)"
    merged = hb.merge_results([base, other])
    assert merged.env == base.env
    assert len(merged.kernels) == len(base.kernels) + 1
    assert merged.kernel_status["a2a_pack"] == "ok"
    assert merged.collectives == other.collectives
    assert "8 GPUs" in merged.collectives_status
    assert "merged rows" in merged.notes[-1]
    assert len(base.kernels) == len(fake_results().kernels)  # inputs untouched
    assert hb.merge_results([base]) == base


def test_merge_results_replaces_a_failed_host_row_by_a_measured_one() -> None:
    base = fake_results()
    failed = dataclasses.replace(base.host[0], host_us=None, status="error: boom")
    base.host = [failed, *base.host[1:]]
    other = fake_results()
    merged = hb.merge_results([base, other])
    rows = [r for r in merged.host if (r.kernel, r.B) == (failed.kernel, failed.B)]
    assert [r.status for r in rows] == ["ok"]


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path: Path) -> None:
    """``benchmarks/run.py --smoke`` on two kernels: measure, save JSON, render page (+ PNG).

    On the CPU the kernels run under TRITON_INTERPRET=1 and are timed by wall clock; on a GPU
    (``gpu_tests``) the same run goes through do_bench / CUDA-graph replay."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    script = root / "benchmarks" / "run.py"
    if not script.is_file():
        pytest.skip("benchmarks/run.py is not part of this checkout")
    out = tmp_path / "smoke.json"
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(script), "--smoke", "--no-collectives", "--out", str(out)]
    cmd += ["--kernels", "a2a_pack,mask_dcp_empty_shards_", "--commit", "test"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = hb.load_results(out)
    assert res.mode == "smoke"
    assert res.env["git_commit"] == "test"
    assert res.references.copy_bytes_per_s
    # Both launch-floor references (empty kernel, one-vector load + store) were measured.
    assert res.references.empty_graph_us
    assert res.references.touch_graph_us
    measured = {r.kernel for r in res.kernels if r.status == "ok"}
    for kernel, status in res.kernel_status.items():
        if status == "ok":
            assert kernel in measured, [r.status for r in res.kernels if r.kernel == kernel]
            assert any(h.kernel == kernel and h.host_us for h in res.host)
    assert all(r.check_rel_err == 0.0 for r in res.kernels if r.status == "ok")
    page = (tmp_path / "smoke-page" / "performance.md").read_text()
    assert "## Targets" in page
    assert "one-vector load + store kernel" in page
