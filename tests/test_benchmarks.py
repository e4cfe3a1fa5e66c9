"""The benchmark harness in ``benchmarks/`` (imported by path): results schema, targets, the
page and the committed per-kind results it is rendered from, the kernel-time comparison, the
host baseline, and the runner's CPU smoke run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_host  # noqa: E402
import bench_report as br  # noqa: E402
import bench_results as rs  # noqa: E402
import bench_targets as bt  # noqa: E402

COPY = 4.27e12  # bytes/s, read + write
ENV = {
    "date": "2026-11-29T08:00:00Z",
    "device": "NVIDIA H200",
    "device_count": "1",
    "driver": "580.00",
    "cuda": "13.0",
    "torch": "2.11.0+cu130",
    "triton": "3.6.0",
    "python": "3.12.3",
    "git_commit": "deadbeef",
}


def _row(kernel: str, h: int, d: int, n: int, b: int, ratio: float) -> rs.KernelRow:
    """A plausible bf16 row at ``ratio`` of the copy (graph timing for decode sizes)."""
    nbytes = max(1, n) * b * h * (max(d, 1) * 2 + 4) + b * h * (max(d, 1) * 2 + 4)
    ms = nbytes / (ratio * COPY) * 1e3
    timing = "cuda_graph" if b <= 64 else "cold"
    row = rs.KernelRow(kernel, "bfloat16", h, d, n, b, nbytes, timing, ms, ms, ms)
    row.bytes_per_s, row.copy_ratio, row.size_copy_ratio = ratio * COPY, ratio, ratio
    row.eager_timing, row.eager_ms, row.eager_speedup = timing, 3 * ms, 3.0
    row.check_rel_err = 1e-3
    return row


def fake_results() -> rs.Results:
    """The merge meets its bandwidth target; correct_attn_out misses one row; no pack rows."""
    res = rs.Results(
        env=dict(ENV),
        mode="full",
        references=rs.References(copy_bytes=2 << 30, copy_bytes_per_s=COPY, empty_graph_us=0.7),
    )
    for kernel in ("merge_attn_states", "correct_attn_out"):
        for h, d in bt.HEAD_SHAPES:
            for n in bt.ALL_N:
                for b in (1, 8, 64, 1024, 4096):
                    ratio = 0.9
                    if kernel == "correct_attn_out" and (h, d, n, b) == (64, 128, 8, 4096):
                        ratio = 0.6
                    res.kernels.append(_row(kernel, h, d, n, b, ratio))
    res.kernels.append(_row("merge_attn_states", 16, 512, 4, 1, 0.9))
    res.kernels[-1].status = "error: RuntimeError: boom"
    res.host = [
        rs.HostRow("merge_attn_states", "bfloat16", 128, 512, 4, 1, 8.0, 10.0, 0.8, 1),
        rs.HostRow("merge_attn_states", "bfloat16", 64, 128, 4, 1, 8.0, 10.0, 0.82, 1),
        rs.HostRow("correct_attn_out", "bfloat16", 128, 512, 4, 1, 9.5, 10.0, 0.95, 1),
    ]
    res.byte_formulas = {"merge_attn_states": "read …; write …"}
    return res


def _outcomes(res: rs.Results) -> dict[str, bt.Outcome]:
    return {t.name: bt.evaluate(t, res) for t in bt.targets()}


def test_results_json_roundtrip_and_schema(tmp_path: Path) -> None:
    res = fake_results()
    res.kernels[0].check_rel_err = float("inf")
    path = rs.save_results(res, tmp_path / "r" / "results.json")
    data = json.loads(path.read_text())
    assert rs.validate_results_dict(data) == []
    assert data["schema"] == rs.SCHEMA
    assert data["kernels"][0]["check_rel_err"] is None  # strict JSON
    back = rs.load_results(path)
    res.kernels[0].check_rel_err = None
    assert back == res


def test_schema_errors_are_reported() -> None:
    data = rs.results_to_dict(fake_results())
    data["schema"] = "other/9"
    data["kernels"][0]["B"] = "4096"
    data["kernels"][1]["ms"] = "fast"
    del data["env"]["torch"]
    joined = "\n".join(rs.validate_results_dict(data))
    for part in ("schema", "kernels[0].B", "kernels[1].ms", "env['torch']"):
        assert part in joined
    with pytest.raises(ValueError, match="invalid results file"):
        rs.results_from_dict(data)


def test_target_statuses() -> None:
    got = _outcomes(fake_results())
    assert got["bw/merge_attn_states"].status == "met"
    assert got["bw/merge_attn_states"].passed == 6
    bad = got["bw/correct_attn_out"]
    assert (bad.status, bad.worst) == ("not met", pytest.approx(0.6))
    assert "N=8" in bad.where
    assert got["bw/a2a_pack"].status == "not measured"
    assert got["decode/merge_attn_states"].status == "met"
    assert got["host/merge_attn_states"].status == "met"  # 0.80x and 0.82x
    assert got["host/correct_attn_out"].status == "not met"  # 0.95x > 0.9x


def test_missing_and_errored_rows_count_as_expected() -> None:
    """A target missing some of its rows is incomplete; a host target (any shape) counts an
    errored or baseline-less row as expected, so it cannot read "met" on the rows that worked."""
    res = fake_results()
    res.kernels = [r for r in res.kernels if not (r.kernel == "merge_attn_states" and r.N == 8)]
    got = _outcomes(res)["bw/merge_attn_states"]
    assert (got.status, got.passed, got.expected) == ("incomplete", 4, 6)
    res.host[1].status = "error: no Triton launch recorded"
    got = _outcomes(res)["host/merge_attn_states"]
    assert (got.status, got.passed, got.expected) == ("incomplete", 1, 2)
    res.host[0].ratio = None
    assert _outcomes(res)["host/merge_attn_states"].status == "not measured"


def _check_tables(md: str) -> None:
    """Every table row has its header's number of cells."""
    for block in md.split("\n\n"):
        rows = [ln for ln in block.splitlines() if ln.startswith("|")]
        assert len({ln.count("|") for ln in rows}) <= 1, rows[:3]


def test_page() -> None:
    res = fake_results()
    md = br.render_page([res], png_name="performance.png")
    assert md.startswith("# Performance")
    assert len(md.splitlines()) <= 300
    for text in ("NVIDIA H200", "2.11.0+cu130", "`deadbeef`", "4.27", "](performance.png)"):
        assert text in md
    assert "### `merge_attn_states` (cp-common)" in md
    assert "| MLA H=128 D=512 | 1 | graph |" in md
    assert "error: RuntimeError: boom" in md  # the H=16 D=512 row that failed
    assert "| `merge_attn_states` | MLA H=128 D=512 | 8.00 | 10.00 | 0.80× |" in md
    assert "Not measured (needs at least two GPUs)" in md
    assert "| `correct_attn_out` | B=4096 ≥ 85% of the copy bandwidth | not met | 60% |" in md
    _check_tables(md)


def test_page_without_the_host_baseline_and_with_collectives() -> None:
    res = fake_results()
    for h in res.host:
        h.baseline_us = h.ratio = None
    coll = rs.Results(env=dict(ENV, device_count="4"), mode="full", references=rs.References())
    coll.collectives_status = "ran world sizes [2, 4] on 4 GPUs (nccl)"
    for op in ("ours: A2A (dcp_a2a_lse_reduce) [graph]", "ours: A2A (dcp_a2a_lse_reduce)"):
        row = rs.CollectiveRow(op, 4, "bfloat16", 128, 512, 1, 1000, "B·H·(D+P)·s", 12.5)
        coll.collectives.append(row)
    coll.collectives[1].latency_us = 99.0  # eager loop: the page shows the replay at B=1
    md = br.render_page([res, coll], png_name=None)
    assert "The baseline was not measured in this results file." in md
    assert "| `merge_attn_states` | MLA H=128 D=512 | 8.00 | – | – |" in md
    assert "| 4 | MLA H=128 D=512 | 1 | 12.5 | – | – | – | – |" in md
    assert "| GPU | NVIDIA H200 × 1 | NVIDIA H200 × 4 |" in md
    assert "![" not in md
    _check_tables(md)


def test_committed_page_is_rendered_from_the_committed_results() -> None:
    """``docs/performance.md`` is what ``run.py --render-only`` makes of ``benchmarks/*.json``."""
    files = sorted(BENCH.glob("*.json"))
    assert [p.name for p in files] == ["nvidia-h200-x4.json", "nvidia-h200.json"]
    sources = [rs.load_results(p) for p in files]
    assert rs.first_with(sources, "kernels") is sources[1]
    assert rs.first_with(sources, "collectives") is sources[0]
    page = (ROOT / "docs" / "performance.md").read_text()
    assert page == br.render_page(sources)
    assert len(page.splitlines()) <= 300


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = br.plot_bandwidth(fake_results(), tmp_path / "perf.png")
    assert out is not None
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = fake_results()
    empty.kernels = []
    assert br.plot_bandwidth(empty, tmp_path / "none.png") is None


def test_compare_reports_every_common_row_and_the_worst() -> None:
    old, new = fake_results(), fake_results()
    slow = next(
        r for r in new.kernels if (r.kernel, r.H, r.N, r.B) == ("correct_attn_out", 64, 4, 1)
    )
    slow.ms = (slow.ms or 0) * 1.2
    new.kernels[0].timing = "cold"  # another timing method: not compared
    report = rs.compare_kernels(new, old)
    ok_rows = sum(r.status == "ok" for r in old.kernels)
    assert f"{ok_rows - 1} kernel rows in both runs" in report
    assert "1 rows more than 3% slower" in report
    assert report.splitlines()[-1] == (
        "worst: correct_attn_out bfloat16 H=64 D=128 N=4 B=1 at 1.200x the old time"
    )
    empty = dataclasses.replace(old, kernels=[])
    assert "no kernel row" in rs.compare_kernels(new, empty)


class _Spec:
    """Stands in for a ``Specialization``: ``kernel[grid](*args, **constexprs)``."""

    def __init__(self, calls: list[Any]) -> None:
        self.kernel = self
        self.constexprs = {"BLOCK": 16}
        self.calls = calls

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kw: self.calls.append((grid, args, kw))


def test_launch_baseline_allocates_new_outputs_and_launches_each_recorded_kernel() -> None:
    """In-place results (an input tensor) allocate nothing; every launch is replayed plainly."""
    inp = {"out": torch.zeros(3, 4), "lses": torch.zeros(2, 3, 4), "rank": 1}
    result = (inp["out"], torch.zeros(3, 4, dtype=torch.float64))
    calls: list[Any] = []
    launches = [(_Spec(calls), (3,), (inp["out"], 7)), (_Spec(calls), (1, 2), ())]
    allocated = bench_host.launch_baseline(result, inp, launches)()
    assert isinstance(allocated, list)
    assert [(tuple(t.shape), t.dtype) for t in allocated] == [((3, 4), torch.float64)]
    assert calls == [((3,), (inp["out"], 7), {"BLOCK": 16}), ((1, 2), (), {"BLOCK": 16})]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="runs the ops: needs a GPU or TRITON_INTERPRET=1",
)
def test_host_rows_time_each_op_against_its_recorded_launches() -> None:
    """Every op's call is recorded (one launch or more, the wrapper removed afterwards) and
    timed against its baseline."""
    import bench_kernels as bk
    import run

    from cpattn_common.launch import Specialization

    original = Specialization.__call__
    plan = run.make_plan("smoke")
    res = rs.Results(env=dict(ENV), mode="smoke", references=rs.References())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bench_host.host_rows(plan, bk.all_specs(), device, res)
    assert Specialization.__call__ is original
    assert [h.kernel for h in res.host] == bk.ORDER
    for h in res.host:
        assert h.status == "ok", h
        assert h.launches >= 1
        assert h.host_us
        assert h.baseline_us
        assert h.ratio
        assert h.checks_on_us
        assert h.checks_off_ns is not None
    reads = {h.kernel: h.check_reads for h in res.host}
    assert reads["mask_dcp_empty_shards_"] >= 1  # the ops that take seq_lens read the switch
    assert reads["a2a_pack"] >= 1


def test_check_reads_are_counted_and_the_switch_restored() -> None:
    from cpattn_common.checks import check_state, checks_enabled

    slot = type(check_state).__dict__["enabled"]
    assert bench_host.count_check_reads(lambda: (checks_enabled(), checks_enabled())) == 2
    assert type(check_state).__dict__["enabled"] is slot
    assert bench_host.check_read_ns(10_000) >= 0.0


def test_render_only_cli(tmp_path: Path) -> None:
    results = rs.save_results(fake_results(), tmp_path / "results.json")
    old = rs.save_results(fake_results(), tmp_path / "old.json")
    cmd = [sys.executable, str(BENCH / "run.py"), "--render-only", str(results)]
    cmd += ["--docs-dir", str(tmp_path / "docs"), "--compare", str(old)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "new / old time per call: median 1.000" in proc.stdout
    page = (tmp_path / "docs" / "performance.md").read_text()
    png = "performance.png" if (tmp_path / "docs" / "performance.png").exists() else None
    assert page == br.render_page([rs.load_results(results)], png_name=png)


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path: Path) -> None:
    """``run.py --smoke`` on two ops: references, host rows, kernel rows checked against the
    eager baseline, JSON saved, page written next to it (CPU: under TRITON_INTERPRET=1)."""
    out = tmp_path / "smoke.json"
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(BENCH / "run.py"), "--smoke", "--no-collectives", "--out", str(out)]
    cmd += ["--kernels", "a2a_pack,mask_dcp_empty_shards_", "--commit", "test"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = rs.load_results(out)
    assert (res.mode, res.env["git_commit"]) == ("smoke", "test")
    refs = res.references
    assert refs.copy_bytes_per_s
    assert refs.empty_graph_us
    assert refs.touch_graph_us
    assert {r.kernel for r in res.kernels} == {"a2a_pack", "mask_dcp_empty_shards_"}
    assert all(r.status == "ok" and r.check_rel_err == 0.0 for r in res.kernels)
    assert all(h.status == "ok" and h.ratio for h in res.host)
    page = (tmp_path / "smoke-page" / "performance.md").read_text()
    assert "## Targets" in page
