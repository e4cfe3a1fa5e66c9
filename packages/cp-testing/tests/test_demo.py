"""The demo (``python -m cpattn_testing.demo``): a decode loop on context-parallel ranks.

The launches dominate this file's time: every path on 1, 2 and 4 gloo ranks must generate the
one-rank reference's tokens (ragged prompts, verify steps of two query tokens included), a
planted wrong LSE weight must fail its path, and the command line must run and report. They
use a smaller model than the demo's default (one layer, narrower heads, six tokens). The rest
checks the pieces against float64 references without launching ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

from cpattn_testing import demo
from cpattn_testing.demo.generate import Generation, KVShard, draft_token
from cpattn_testing.demo.model import ModelConfig, TinyLM, attention_with_lse
from cpattn_testing.demo.run import DemoConfig, compare, rank_main, summarize
from cpattn_testing.launcher import run_distributed
from cpattn_testing.reference import attention_ref, interleaved_shard_positions

ROOT = pathlib.Path(__file__).resolve().parents[3]
SRC_DIRS = [ROOT / "packages" / p / "src" for p in ("cp-common", "cp-dcp", "cp-pcp", "cp-testing")]
# Ragged prompts, one of a single token; every second decode step verifies a draft.
SMALL = DemoConfig(
    prompt_lens=(1, 5, 13, 9), new_tokens=6, verify_every=2, interleave=2, layers=1, hidden=64,
    vocab=64, heads=4, kv_heads=2, head_dim=16, latent_dim=32, rope_dim=8, progress=False,
)  # fmt: skip
SMALL_ARGS = ["--prompt-lens", "1,5,13,9", "--new-tokens", "6", "--verify-every", "2",
              "--interleave", "2", "--layers", "1", "--hidden", "64", "--vocab", "64", "--heads",
              "4", "--head-dim", "16", "--latent-dim", "32", "--rope-dim", "8", "--quiet"]  # fmt: skip


def _cpu_only(device: torch.device) -> None:
    if device.type != "cpu":
        pytest.skip("CPU/gloo launch; GPUs run test_nccl_demo")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, SRC_DIRS), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_INTERPRET", "1")
    return env


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_path_generates_the_reference_tokens(device: torch.device, world_size: int) -> None:
    _cpu_only(device)
    cfg = dataclasses.replace(SMALL, world_size=world_size)
    per_rank = run_distributed(rank_main, world_size, args=(cfg,), timeout=600)
    results = summarize(cfg, per_rank)
    assert [r.path for r in results] == demo.all_path_names()
    for r in results:
        if r.path.endswith("/direct"):  # the capability gate never allows it on a CPU
            reason = "needs at least two ranks" if world_size == 1 else "not a CUDA device"
            assert r.status == "skipped", r
            assert reason in r.reason, r
            continue
        assert r.status == "pass", r
        assert r.tokens == "24/24 identical", r
        assert r.max_rel_err is not None, r
        assert r.tol is not None, r
        assert r.max_rel_err <= r.tol, r
        accepted, rejected = map(int, r.drafts.split("/"))
        assert accepted + rejected >= 4, r  # two verify steps (two query tokens) of 4 requests
    ref = per_rank[0]["reference"]["gqa"]
    assert len({t for row in ref.tokens for t in row}) > 4  # not a degenerate model
    accepted = [int(r.drafts.split("/")[0]) for r in results if r.drafts]
    assert max(accepted) > 0  # some draft was accepted: its row's logits were checked too


def test_a_wrong_lse_weight_fails_its_path_only(device: torch.device) -> None:
    _cpu_only(device)
    cfg = dataclasses.replace(SMALL, world_size=2, variants=("mla",), paths=("ag_rs", "a2a"),
                              fault=("mla/a2a",))  # fmt: skip
    results = summarize(cfg, run_distributed(rank_main, 2, args=(cfg,), timeout=600))
    status = {r.path: r.status for r in results}
    assert status == {"mla/ag_rs": "pass", "mla/a2a": "FAIL"}, results
    table = demo.format_table(results)
    assert "FAILED: mla/a2a (1 of 2 checked paths)" in table


def test_cli_runs_and_reports(
    device: torch.device, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cpu_only(device)
    out = tmp_path / "result.json"
    status = demo.main(["--world-size", "2", "--variants", "gqa", "--paths", "ag_ar,direct",
                        "--json", str(out), *SMALL_ARGS])  # fmt: skip
    text = capsys.readouterr().out
    assert status == 0, text
    payload = json.loads(out.read_text())
    assert payload["ok"] is True
    assert payload["config"]["world_size"] == 2
    status_of = {r["path"]: r["status"] for r in payload["results"]}
    assert status_of == {"gqa/ag_ar": "pass", "gqa/direct": "skipped"}
    assert "cpattn demo: 2 ranks (gloo, CPU), float32" in text
    assert "skipped: gqa/direct: device cpu is not a CUDA device" in text
    assert "OK: every checked path (1) generated the reference's tokens, 1 skipped" in text


def test_two_torchrun_nodes_generate_the_reference_tokens(
    device: torch.device, tmp_path: pathlib.Path
) -> None:
    """Two ``torchrun --nnodes 2 --nproc-per-node 2`` processes on this host (two "nodes" of
    two ranks) meet through a c10d rendezvous on a port picked free now; global rank 0 writes
    the verdict of the four ranks."""
    _cpu_only(device)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
           f"cpattn-demo-{os.getpid()}", "-m", "cpattn_testing.demo", "--variants", "mla",
           "--paths", "ag_rs,a2a,manager", "--json", str(result), *SMALL_ARGS]  # fmt: skip
    env = {**_env(), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]  # fmt: skip
    try:
        text = "\n".join(node.communicate(timeout=600)[0] for node in nodes)
    finally:
        for node in nodes:  # torchrun passes SIGTERM on to its ranks
            if node.poll() is None:
                node.terminate()
                node.wait(30)
    assert [node.returncode for node in nodes] == [0, 0], text
    payload = json.loads(result.read_text())
    assert payload["ok"] is True, text
    assert payload["config"]["world_size"] == 4
    assert [(r["status"], r["ranks"], r["tokens"]) for r in payload["results"]] == [
        ("pass", 4, "24/24 identical")
    ] * 3, text
    assert "OK: every checked path (3) generated the reference's tokens" in text


@pytest.mark.gpu
def test_one_gpu_generates_the_reference_tokens() -> None:
    cfg = dataclasses.replace(SMALL, world_size=1, backend="nccl")
    for r in summarize(cfg, run_distributed(rank_main, 1, "nccl", args=(cfg,), timeout=600)):
        assert r.status == ("skipped" if r.path.endswith("/direct") else "pass"), r


@pytest.mark.multigpu(2)
def test_nccl_demo() -> None:
    """On two GPUs, bf16 (the direct A2A's dtypes): every path passes or is skipped with the
    gate's reason, and a wrong weight fails the direct path too where it ran."""
    argv = [sys.executable, "-m", "cpattn_testing.demo", "--backend", "nccl", "--world-size",
            "2", "--dtype", "bfloat16", "--json", "-", "--quiet", "--plant-fault", "gqa/direct"]  # fmt: skip
    env = {**_env(), "TRITON_INTERPRET": "0"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    results = json.loads(proc.stdout)["results"]
    for r in results:
        if r["path"] == "gqa/direct" and r["status"] != "skipped":
            assert r["status"] == "FAIL", r
        else:
            assert r["status"] in ("pass", "skipped"), r
            assert r["status"] == "pass" or r["path"].endswith("/direct"), r


def test_list_names_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--list"]) == 0
    assert capsys.readouterr().out.split() == demo.all_path_names()
    assert "mla/manager" in demo.all_path_names()


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--heads", "6", "--world-size", "4"]) == 2
    assert "heads 6 must be divisible by the world size 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--paths", "ag_rs,nope"])
    assert demo.main(["--backend", "nccl", "--world-size", "64"]) == 2
    assert "--backend nccl needs one GPU per rank: 64 ranks" in capsys.readouterr().err


def test_gloo_without_the_interpreter_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo.cli, "_interpreted", lambda: False)
    assert demo.main(["--world-size", "1"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


@pytest.mark.parametrize(("n", "inter"), [(1, 1), (2, 1), (4, 2), (3, 4)])
def test_kv_shard_owns_the_interleaved_positions(n: int, inter: int) -> None:
    cfg = ModelConfig(variant="gqa", layers=1, vocab=8, hidden=8, heads=2, kv_heads=1, head_dim=4)
    model = TinyLM(cfg, 0, torch.device("cpu"))
    for rank in range(n):
        shard = KVShard(model, 2, 8, rank, n, inter, torch.device("cpu"))
        mine = interleaved_shard_positions(30, n, rank, inter).tolist()
        assert [p for p in range(30) if shard.owner(p) == rank] == mine
        assert [shard.slot(1, p) for p in mine] == list(range(8, 8 + len(mine)))
        assert [shard.visible(p) for p in range(30)] == [
            sum(q <= p for q in mine) for p in range(30)
        ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 64), (4, 1, 40), (3, 3, 16)])
def test_attention_with_lse_matches_float64(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    """Prefix-visible rows (none visible included) and causal prefill, against float64."""
    from cpattn_testing.tolerances import assert_close_to_ref

    gen = torch.Generator().manual_seed(0)
    b, tq, s = 3, 2, 7
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for shape in
               ((b, heads, tq, dim), (b, kv_heads, s, dim), (b, kv_heads, s, dim)))  # fmt: skip
    visible = torch.tensor([[0, 1], [3, 4], [7, 7]])
    out, lse = attention_with_lse(q, k, v, scale=0.3, visible=visible)
    assert out.dtype == dtype
    assert lse.dtype == torch.float32
    for i in range(b):
        for t in range(tq):
            n = int(visible[i, t])
            want, want_lse = attention_ref(
                q[i, :, t][None].double(), k[i, :, :n].transpose(0, 1).double(),
                v[i, :, :n].transpose(0, 1).double(), scale=0.3,
            )  # fmt: skip
            assert_close_to_ref(out[i, :, t][None], want, dtype=dtype, name=f"out {i},{t}")
            assert_close_to_ref(
                lse[i, :, t][None], want_lse, dtype=torch.float32, scale=torch.tensor(4.0)
            )
    out, lse = attention_with_lse(q[:1, :, :1].expand(1, heads, s, dim), k[:1], v[:1],
                                  scale=0.3, causal=True)  # fmt: skip
    want, _ = attention_ref(q[0, :, :1].expand(heads, s, dim).transpose(0, 1).double(),
                            k[0].transpose(0, 1).double(), v[0].transpose(0, 1).double(),
                            scale=0.3, causal=True)  # fmt: skip
    assert_close_to_ref(out[0].transpose(0, 1), want, dtype=dtype, name="causal")
    empty, empty_lse = attention_with_lse(q, k[:, :, :0], v[:, :, :0], scale=0.3, visible=visible)
    assert torch.all(empty == 0)
    assert torch.all(empty_lse == -math.inf)


def test_draft_token_looks_up_the_last_token() -> None:
    assert draft_token([5, 7, 1, 5, 9, 5]) == 9
    assert draft_token([3, 4]) == 4
    assert draft_token([2]) == 2


def _gen(tokens: list[list[int]], logits: torch.Tensor) -> Generation:
    return Generation(tokens, logits, [0.01, 0.02])


def test_compare_accepts_near_ties_only() -> None:
    ref_logits = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])  # [R=1, n=2, V=3]
    ref = _gen([[0, 1]], ref_logits)
    assert compare(ref, _gen([[0, 1]], ref_logits.clone()), torch.float32)[:3] == (2, 2, 0.0)
    # A logit 1e-3 off (relative to the largest): over float32's tolerance, within bf16's.
    off = ref_logits.clone()
    off[0, 1, 2] += 1e-3
    assert "logits off by 1.00e-03" in compare(ref, _gen([[0, 1]], off), torch.float32)[3]
    assert compare(ref, _gen([[0, 1]], off), torch.bfloat16)[3] == ""
    # Another token where the reference's margin is tiny: a tie; where it is large: a failure.
    tie = ref_logits.clone()
    tie[0, 1, 2] = 0.99
    ref_tie = _gen([[0, 1]], tie)
    same, total, _, note = compare(ref_tie, _gen([[0, 2]], tie.clone()), torch.bfloat16)
    assert (same, total) == (1, 2)
    assert note.startswith("tie: request 0 diverged at token 1")
    assert "instead of 1" in compare(ref, _gen([[0, 2]], ref_logits.clone()), torch.bfloat16)[3]


def test_summarize_reports_skips_failures_and_rank_disagreement() -> None:
    cfg = dataclasses.replace(SMALL, world_size=2, variants=("gqa",),
                              paths=("ag_rs", "a2a", "direct"))  # fmt: skip
    logits = torch.zeros(1, 1, 3)
    logits[0, 0, 1] = 1.0
    good, bad = _gen([[1]], logits), _gen([[1]], logits)
    bad.tokens = [[2]]
    rank0 = {"reference": {"gqa": good}, "paths": {"gqa/ag_rs": good, "gqa/a2a": good,
                                                     "gqa/direct": "skipped: no symmetric memory"}}  # fmt: skip
    rank1 = {"reference": {}, "paths": {"gqa/ag_rs": good, "gqa/a2a": bad,
                                        "gqa/direct": "skipped: no symmetric memory"}}  # fmt: skip
    results = summarize(cfg, [rank0, rank1])
    assert [r.status for r in results] == ["pass", "FAIL", "skipped"]
    assert "ranks [1] generated other tokens" in results[1].reason
    assert results[0].step_ms == pytest.approx(15.0)
    table = demo.format_table(results)
    assert "skipped: gqa/direct: no symmetric memory" in table
    assert "FAILED: gqa/a2a (1 of 2 checked paths)" in table
