"""The end-to-end demo (``python -m cpattn_testing.demo``): passes clean, fails on planted faults.

Two real launches (they dominate this file's time): the command-line entry point at the default
world size (4 ranks) must pass every path, and an in-process run at world size 2 with faults
planted in several paths must fail exactly those paths, naming each. The rest checks the
reporting and the argument validation without launching ranks. On machines with two GPUs
(``gpu_tests``) the nccl demo runs too, clean and with planted faults (direct path included).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import pytest

from cpattn_testing import demo

if TYPE_CHECKING:
    import torch

ROOT = pathlib.Path(__file__).resolve().parents[3]
SRC_DIRS = [ROOT / "packages" / p / "src" for p in ("cp-common", "cp-dcp", "cp-pcp", "cp-testing")]
# Small shapes: these run the Triton kernels under TRITON_INTERPRET=1 on the CPU.
SMALL = ["--heads", "4", "--head-dim", "16", "--rope-dim", "8", "--kv-heads", "2",
         "--batch", "4", "--max-seq-len", "12", "--prefill-batch", "3",
         "--max-prompt-len", "10", "--repeats", "1"]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(p) for p in SRC_DIRS]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("TRITON_INTERPRET", "1")
    env.pop(demo.PLANT_FAULT_ENV, None)
    env.pop(demo.PLANT_RAISE_ENV, None)
    return env


def test_cli_default_world_size_passes_every_path(device: object) -> None:
    if str(device) != "cpu":
        pytest.skip(
            "the CPU demo runs on gloo; GPUs run it through `nox -s demo -- --backend nccl`"
        )
    proc = subprocess.run(
        [sys.executable, "-m", "cpattn_testing.demo", "--json", "-", "--quiet", *SMALL],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["ok"] is True
    assert payload["world_size"] == 4
    assert payload["failed"] == []
    results = payload["results"]
    assert [r["path"] for r in results] == demo.all_path_names()
    for r in results:
        if r["status"] == "skipped":
            # Only the direct (symmetric-memory) paths may be skipped, and never silently.
            assert r["path"].endswith("/direct"), r
            assert r["reason"], r
        else:
            assert r["status"] == "pass", r
            assert r["rel_err"] <= r["tol"], r
            assert r["time_per_call_ms"] is not None
    # The table went to stderr (stdout holds the JSON) and names every path.
    for name in demo.all_path_names():
        assert name in proc.stderr
    assert "OK: all" in proc.stderr


def test_planted_faults_fail_naming_each_path(
    device: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
) -> None:  # fmt: skip
    if str(device) != "cpu":
        pytest.skip("CPU/gloo launch")
    planted = ["dcp/gqa/ag_rs", "dcp/gqa/ag_ar", "dcp/mla/a2a", "dcp/gqa/manager", "pcp/prefill",
               "pcp/mla/cache_gather"]  # fmt: skip
    monkeypatch.setenv(demo.PLANT_FAULT_ENV, ",".join(planted))
    out = tmp_path / "result.json"
    status = demo.main(["--world-size", "2", "--json", str(out), "--quiet", *SMALL])
    captured = capsys.readouterr()
    assert status == 1, captured.out + captured.err
    payload = json.loads(out.read_text())
    assert payload["ok"] is False
    assert sorted(payload["failed"]) == sorted(planted)
    by_path = {r["path"]: r for r in payload["results"]}
    for name in demo.all_path_names():
        if name in planted:
            assert by_path[name]["status"] == "fail"
            assert f"MISMATCH in {name}" in captured.out
        elif not name.endswith("/direct") or by_path[name]["status"] != "skipped":
            assert by_path[name]["status"] == "pass", by_path[name]
    assert f"FAILED: {len(planted)} of" in captured.out


def test_a_path_that_raises_on_one_rank_stops_every_rank_at_once(
    device: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
) -> None:  # fmt: skip
    """Rank 1 raises in ``dcp/gqa/ag_ar`` while rank 0 enters that path's collective: the run
    must end within seconds (not at ``--timeout``), exit 1, and show rank 1's exception with
    its traceback, naming the path. (A rank that swallowed the exception and went on left
    rank 0 waiting until the deadline, and the timeout error showed only rank 0's stacks.)"""
    if str(device) != "cpu":
        pytest.skip("CPU/gloo launch")
    monkeypatch.delenv(demo.PLANT_FAULT_ENV, raising=False)
    monkeypatch.setenv(demo.PLANT_RAISE_ENV, "dcp/gqa/ag_ar@1")
    out = tmp_path / "result.json"
    timeout = 60.0
    start = time.monotonic()
    status = demo.main(["--world-size", "2", "--only", "dcp/gqa/ag_*", "--json", str(out),
                        "--timeout", str(timeout), *SMALL])  # fmt: skip
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert status == 1, text
    assert "timed out" not in text
    assert elapsed < timeout / 2, f"took {elapsed:.1f} s to stop (timeout {timeout:g} s)\n{text}"
    # The failing rank's exception: type, message, traceback, and the path it was running.
    assert "rank 1 failed:" in captured.err
    assert "Traceback (most recent call last)" in captured.err
    assert "RuntimeError: planted failure in dcp/gqa/ag_ar on rank 1" in captured.err
    assert "PathFailure: dcp/gqa/ag_ar raised on rank 1: RuntimeError:" in captured.err
    assert "FAILED: dcp/gqa/ag_ar raised on rank 1: RuntimeError: planted failure" in captured.out
    payload = json.loads(out.read_text())
    assert payload["ok"] is False
    assert payload["failed"] == ["dcp/gqa/ag_ar"]
    assert "planted failure" in payload["results"][0]["reason"]


def test_cli_exits_1_when_rank_0_raises(device: object) -> None:
    """The same through the command line, with rank 0 (the progress writer) failing in a PCP
    path while rank 1 waits in its gather."""
    if str(device) != "cpu":
        pytest.skip("CPU/gloo launch")
    env = _env()
    env[demo.PLANT_RAISE_ENV] = "pcp/prefill@0"
    timeout = 60.0
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "cpattn_testing.demo", "--world-size", "2", "--only",
         "pcp/prefill", "--timeout", str(timeout), *SMALL],
        env=env, capture_output=True, text=True, timeout=2 * timeout, check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert elapsed < timeout / 2, f"took {elapsed:.1f} s to stop (timeout {timeout:g} s)"
    assert "rank 0 failed:" in proc.stderr
    assert "RuntimeError: planted failure in pcp/prefill on rank 0" in proc.stderr
    assert "FAILED: pcp/prefill raised on rank 0" in proc.stdout


def test_run_path_names_the_path_and_rank_of_an_exception() -> None:
    def boom() -> demo.RankRecord:
        raise IndexError("no such slot\nsecond line")

    cfg = demo.DemoConfig(world_size=2)
    with pytest.raises(demo.PathFailure) as info:
        demo._run_path(cfg, "pcp/prefill", 1, boom)
    assert str(info.value) == "pcp/prefill raised on rank 1: IndexError: no such slot"
    assert isinstance(info.value.__cause__, IndexError)
    record = demo.RankRecord("pcp/prefill", "ran")
    assert demo._run_path(cfg, "pcp/prefill", 0, lambda: record) is record


def test_planted_raise_picks_path_and_rank() -> None:
    cfg = demo.DemoConfig(world_size=4, plant_raise="dcp/*/a2a, pcp/prefill@0")
    assert cfg.raises("dcp/mla/a2a", 3)  # no rank: the last one
    assert not cfg.raises("dcp/mla/a2a", 0)
    assert cfg.raises("pcp/prefill", 0)
    assert not cfg.raises("pcp/prefill", 3)
    assert not demo.DemoConfig().raises("dcp/mla/a2a", 3)
    with pytest.raises(demo.PathFailure, match="raised on rank 3: RuntimeError: planted"):
        demo._run_path(cfg, "dcp/gqa/a2a", 3, lambda: demo.RankRecord("dcp/gqa/a2a", "ran"))


def test_only_a_path_failure_of_the_first_failing_rank_counts_as_one() -> None:
    from cpattn_testing.launcher import DistributedError

    def error(rank: int | None, tracebacks: dict[int, str]) -> DistributedError:
        return DistributedError("x", rank=rank, tracebacks=tracebacks, pids=[1, 2])

    line = "cpattn_testing.demo.PathFailure: dcp/mla/a2a raised on rank 1: ValueError: bad"
    raised = "Traceback (most recent call last):\n  ...\nValueError: bad\n\n...\n" + line
    assert demo._path_failure(error(1, {1: raised})) == ("dcp/mla/a2a", 1, "ValueError: bad")
    # A crash, a failure outside the paths, or a timeout is a launcher error (exit 3).
    assert demo._path_failure(error(0, {0: "ValueError: launched with", 1: raised})) is None
    assert demo._path_failure(error(None, {1: raised})) is None


def test_list_paths(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--list"]) == 0
    assert capsys.readouterr().out.split() == demo.all_path_names()


# Bounded so that a demo without the check runs quickly (and returns 0, not 2).
KV_SHORTER_THAN_QUERIES = ["--max-seq-len", "2", "--queries-per-request", "3", "--world-size", "2",
                           "--only", "dcp/gqa/ag_rs", "--quiet"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "4", "--heads", "6"], "--heads 6 must be divisible by --world-size 4"),
        (["--heads", "8", "--kv-heads", "3"], "--heads 8 must be divisible by --kv-heads 3"),
        (["--batch", "0"], "--batch must be >= 1, got 0"),
        (["--only", "nothing/*"], "matches no path"),
        (KV_SHORTER_THAN_QUERIES, "--max-seq-len 2 must be >= --queries-per-request 3"),
    ],
    ids=[
        "heads-vs-ranks",
        "heads-vs-kv-heads",
        "empty-batch",
        "only-matches-nothing",
        "kv-shorter-than-queries",
    ],
)
def test_bad_arguments_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_cpu_run_without_the_interpreter_exits_2_before_starting_ranks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It started every rank and failed each path's first launch (a 71-line traceback, exit
    1 as if a path had failed)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(demo, "rank_main", None)  # a rank started would fail to pickle it
    assert demo.main(["--world-size", "2", "--quiet"]) == 2
    assert "set TRITON_INTERPRET=1" in capsys.readouterr().err


def test_decode_batch_has_empty_shards() -> None:
    from cpattn_testing.reference import interleaved_shard_positions

    cfg = demo.DemoConfig(world_size=4, batch=5, max_seq_len=20)
    lens = demo.decode_seq_lens(cfg)
    empty = {
        (req, rank)
        for req, s in enumerate(lens)
        for rank in range(4)
        if interleaved_shard_positions(s, 4, rank).numel() == 0
    }
    # The short requests leave the last rank empty.
    assert (0, 3) in empty
    assert (1, 3) in empty
    assert all(s >= 1 for s in lens)
    assert min(demo.prompt_lens(cfg)) == 1


def test_empty_shards_get_every_kind_of_garbage_lse() -> None:
    """0, +inf and NaN LSEs of empty shards all reach the combines in the default batch."""
    import math

    import torch

    cfg = demo.DemoConfig(world_size=4)
    kinds = set()
    for rank in range(4):
        prob = demo._make_decode_problem(cfg, "gqa", rank, torch.device("cpu"))
        lens = prob.local_seq_lens.tolist()
        for req, n in enumerate(lens):
            if n == 0:
                v = float(prob.partial_lse[req * prob.queries_per_request, 0])
                kinds.add("nan" if math.isnan(v) else v)
    assert kinds == {0.0, math.inf, "nan"}


# Speculative decoding (``--queries-per-request`` tq > 1): the tq query tokens of a request with
# S KV tokens are its last tq tokens, at positions S - tq .. S - 1, and attend causally.
SPEC = [(2, 2, 1), (4, 2, 1), (4, 3, 2), (3, 5, 1)]  # (world size, tq, interleave size)


def _spec_cfg(n: int, tq: int, inter: int) -> demo.DemoConfig:
    return demo.DemoConfig(
        world_size=n, num_heads=2 * n, kv_heads=2, head_dim=8, rope_dim=4, batch=4,
        queries_per_request=tq, interleave_size=inter, max_seq_len=12, dtype="float32",
    )  # fmt: skip


def _whole_kv(
    cfg: demo.DemoConfig, probs: list[demo._DecodeProblem]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every request's whole K/V (float64), put back together from the shards of all ranks."""
    import torch

    from cpattn_testing.reference import interleaved_shard_positions

    kv = []
    for req, s in enumerate(demo.decode_seq_lens(cfg)):
        k0, v0 = probs[0].shards[req]
        k = torch.full((s, *k0.shape[1:]), float("nan"), dtype=torch.float64)
        v = torch.full((s, *v0.shape[1:]), float("nan"), dtype=torch.float64)
        for rank, prob in enumerate(probs):
            pos = interleaved_shard_positions(s, cfg.world_size, rank, cfg.interleave_size)
            k[pos], v[pos] = prob.shards[req]
        assert not k.isnan().any()
        assert not v.isnan().any()
        kv.append((k, v))
    return kv


@pytest.mark.parametrize(("n", "tq", "inter"), SPEC)
def test_every_decode_request_holds_its_query_tokens(n: int, tq: int, inter: int) -> None:
    """S >= tq for every request (the generator gave S = 1 to requests with 2 query tokens)."""
    cfg = _spec_cfg(n, tq, inter)
    lens = demo.decode_seq_lens(cfg)
    assert len(lens) == cfg.batch
    assert all(tq <= s <= max(cfg.max_seq_len, tq) for s in lens), lens
    assert lens[0] == tq  # the shortest request possible: its first query row sees key 0 only


@pytest.mark.parametrize("layer", demo.LAYERS)
@pytest.mark.parametrize(("n", "tq", "inter"), SPEC)
def test_speculative_reference_is_causal(layer: str, n: int, tq: int, inter: int) -> None:
    """The float64 reference of a speculative request is causal attention with the query
    tokens at positions S - tq .. S - 1, not attention of every query token to every key."""
    import torch

    from cpattn_testing.reference import attention_ref

    cfg = _spec_cfg(n, tq, inter)
    probs = [demo._make_decode_problem(cfg, layer, r, torch.device("cpu")) for r in range(n)]
    prob = probs[0]
    for req, (k, v) in enumerate(_whole_kv(cfg, probs)):
        s = k.shape[0]
        rows = slice(req * tq, (req + 1) * tq)
        q = prob.query[rows].to(torch.float64)
        causal, causal_lse = attention_ref(
            q, k, v, scale=prob.scale, causal=True, q_pos=torch.arange(s - tq, s)
        )
        full, _ = attention_ref(q, k, v, scale=prob.scale)
        torch.testing.assert_close(prob.ref_out[rows], causal, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(prob.ref_lse[rows], causal_lse, rtol=1e-12, atol=1e-12)
        # Row 0 sees S - tq + 1 of the S keys: the non-causal answer is a different one.
        assert not torch.allclose(prob.ref_out[rows][0], full[0], rtol=1e-3, atol=1e-3)
    for p in probs[1:]:
        assert torch.equal(p.ref_out, prob.ref_out)


@pytest.mark.parametrize("layer", demo.LAYERS)
@pytest.mark.parametrize(("n", "tq", "inter"), SPEC)
def test_speculative_partials_are_causal_over_global_key_positions(
    layer: str, n: int, tq: int, inter: int
) -> None:
    """Each rank's partial is causal attention to its shard's keys at their global positions;
    an early speculative row whose shard keys all lie in its future (a non-empty shard) gets
    LSE -inf and output 0, and such rows occur in the batch."""
    import torch

    from cpattn_testing.reference import attention_ref, interleaved_shard_positions

    cfg = _spec_cfg(n, tq, inter)
    lens = demo.decode_seq_lens(cfg)
    future_only = 0
    for rank in range(n):
        prob = demo._make_decode_problem(cfg, layer, rank, torch.device("cpu"))
        for req, s in enumerate(lens):
            k, v = prob.shards[req]
            if k.shape[0] == 0:
                continue
            rows = slice(req * tq, (req + 1) * tq)
            pos = interleaved_shard_positions(s, n, rank, inter)
            out, lse = attention_ref(
                prob.query[rows].to(torch.float64), k, v, scale=prob.scale, causal=True,
                q_pos=torch.arange(s - tq, s), k_pos=pos,
            )  # fmt: skip
            torch.testing.assert_close(prob.partial_out[rows], out.to(prob.dtype))
            torch.testing.assert_close(prob.partial_lse[rows], lse.to(torch.float32))
            dead = torch.isneginf(prob.partial_lse[rows]).all(dim=1)
            assert bool((prob.partial_out[rows][dead] == 0).all())
            future_only += int(dead.sum())
    assert future_only > 0, "no speculative row saw only future keys of a non-empty shard"


def test_speculative_decode_demo_passes(
    device: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every DCP combine gives causal speculative attention, with the rows of non-empty
    shards that see no key (LSE -inf) among the partials."""
    if str(device) != "cpu":
        pytest.skip("CPU/gloo launch")
    monkeypatch.delenv(demo.PLANT_FAULT_ENV, raising=False)
    monkeypatch.delenv(demo.PLANT_RAISE_ENV, raising=False)
    status = demo.main(["--world-size", "2", "--queries-per-request", "2", "--only", "dcp/*",
                        "--quiet", *SMALL])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    assert "OK: all 8 checked paths passed" in out


def test_max_prompt_len_1_gives_one_token_prompts_and_runs(
    device: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--max-prompt-len 1`` passes validation, so the prompts must be generated (they raised
    inside the path: exit 1, reported as a library failure), all of one token."""
    for top in (1, 2, 3, 24):
        for n in (1, 2, 4):
            cfg = demo.DemoConfig(world_size=n, prefill_batch=6, max_prompt_len=top)
            lens = demo.prompt_lens(cfg)
            assert len(lens) == 6
            assert min(lens) == 1
            assert max(lens) <= top, (top, n, lens)
    if str(device) != "cpu":
        pytest.skip("CPU/gloo launch")
    monkeypatch.delenv(demo.PLANT_FAULT_ENV, raising=False)
    monkeypatch.delenv(demo.PLANT_RAISE_ENV, raising=False)
    status = demo.main(["--world-size", "2", "--only", "pcp/*", "--max-prompt-len", "1",
                        "--prefill-batch", "3", "--quiet"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    assert "OK: all 3 checked paths passed" in out


def test_a_repeat_that_differs_from_the_checked_call_fails() -> None:
    """A path correct on its first call and wrong later (a stale epoch of a direct path, say)
    must not pass on the strength of the first call."""
    import torch

    calls = iter([torch.ones(3), torch.ones(3), torch.full((3,), float("nan"))])
    with pytest.raises(RuntimeError, match="call 3 returned other values"):
        demo._timed(lambda: next(calls), 2, torch.device("cpu"))
    same = (torch.tensor([float("nan"), 1.0]), 7)
    result, times = demo._timed(lambda: same, 3, torch.device("cpu"))
    assert result is same
    assert len(times) == 3


def test_a_run_that_checks_nothing_fails(
    device: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every selected path skipped (the direct paths on the CPU): no evidence, exit 1."""
    if getattr(device, "type", "cpu") != "cpu":
        pytest.skip("the direct paths are skipped on the CPU only")
    assert demo.main(["--world-size", "2", "--only", "dcp/*/direct", "--quiet"]) == 1
    assert "NOTHING CHECKED: all 2 selected paths were skipped" in capsys.readouterr().out


def _record(path: str, status: str = "ran", **kw: object) -> dict[str, object]:
    rec = demo.RankRecord(path, status, **kw)  # type: ignore[arg-type]
    return {k: getattr(rec, k) for k in rec.__dataclass_fields__}


def test_aggregate_and_table_report_failures_and_skips() -> None:
    cfg = demo.DemoConfig(world_size=2, dtype="float32")
    per_rank = [
        [
            _record("dcp/mla/ag_rs", diff_sq=1e-12, ref_sq=1.0, times_s=[1e-3, 2e-3]),
            _record("dcp/mla/a2a", diff_sq=0.25, ref_sq=1.0, times_s=[1e-3]),
            _record("dcp/mla/direct", "skipped", reason="no symmetric memory"),
            _record("pcp/prefill", nonfinite=3, ref_sq=1.0, times_s=[1e-3]),
            _record("pcp/gqa/cache_gather", "error", reason="ValueError: boom"),
        ]
    ] * 2
    results = {r.path: r for r in demo.aggregate(cfg, per_rank)}
    assert results["dcp/mla/ag_rs"].status == "pass"
    assert results["dcp/mla/ag_rs"].time_per_call_ms == pytest.approx(1.5)
    assert results["dcp/mla/a2a"].status == "fail"
    assert results["dcp/mla/a2a"].rel_err == pytest.approx(0.5)
    assert results["dcp/mla/direct"].status == "skipped"
    assert results["pcp/prefill"].status == "fail"
    assert results["pcp/gqa/cache_gather"].status == "fail"
    table = demo.format_table(cfg, list(results.values()))
    assert "MISMATCH in dcp/mla/a2a: relative error 5.0e-01 > tolerance" in table
    assert "MISMATCH in pcp/prefill: 6 non-finite values" in table
    assert "MISMATCH in pcp/gqa/cache_gather: ValueError: boom" in table
    assert "skipped: dcp/mla/direct: no symmetric memory" in table
    assert "FAILED: 3 of 4 checked paths" in table
    json.dumps([r.to_json() for r in results.values()])  # inf/nan are stringified


def test_fault_patterns_match_by_fnmatch() -> None:
    cfg = demo.DemoConfig(plant_fault="dcp/*/a2a,pcp/prefill")
    assert cfg.faulty("dcp/mla/a2a")
    assert cfg.faulty("dcp/gqa/a2a")
    assert cfg.faulty("pcp/prefill")
    assert not cfg.faulty("dcp/mla/ag_rs")
    assert not demo.DemoConfig().faulty("dcp/mla/a2a")


def test_ranks_that_disagree_on_a_skip_fail_the_path() -> None:
    cfg = demo.DemoConfig(world_size=2)
    per_rank = [
        [_record("dcp/mla/direct", "skipped", reason="no symmetric memory")],
        [_record("dcp/mla/direct", ref_sq=1.0, times_s=[1e-3])],
    ]
    (result,) = demo.aggregate(cfg, per_rank)
    assert result.status == "fail"
    assert "ranks disagree" in result.reason


def _gpu_env() -> dict[str, str]:
    env = _env()
    env.pop("TRITON_INTERPRET", None)
    return env


@pytest.mark.multigpu(2)
def test_nccl_demo_passes_and_catches_planted_faults() -> None:
    """On GPUs: every path passes (direct too, where symmetric memory spans the ranks), and a
    planted wrong weight fails exactly the planted paths, the direct one included if it ran."""
    argv = [sys.executable, "-m", "cpattn_testing.demo", "--backend", "nccl", "--world-size",
            "2", "--json", "-", "--quiet", "--repeats", "3"]  # fmt: skip
    clean = subprocess.run(
        argv, env=_gpu_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert clean.returncode == 0, clean.stdout + clean.stderr
    payload = json.loads(clean.stdout)
    ran = {r["path"] for r in payload["results"] if r["status"] == "pass"}
    assert ran | set(payload["skipped"]) == set(demo.all_path_names())

    env = _gpu_env()
    env[demo.PLANT_FAULT_ENV] = "dcp/*/direct,dcp/mla/a2a"
    faulty = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert faulty.returncode == 1, faulty.stdout + faulty.stderr
    failed = set(json.loads(faulty.stdout)["failed"])
    expected = {"dcp/mla/a2a"} | {p for p in ran if p.endswith("/direct")}
    assert failed == expected
    for name in expected:
        assert f"MISMATCH in {name}" in faulty.stderr
