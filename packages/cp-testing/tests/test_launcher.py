"""The launcher: results in rank order, env propagation, failures and hangs end cleanly."""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpattn_testing.launcher import (
    NO_MULTICAST_ENV,
    DistributedError,
    NotEnoughDevicesError,
    available_gpus,
    run_distributed,
)


def collective_checks(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    """all_reduce / all_gather / broadcast on WORLD; returns what this rank saw (on the CPU).

    The tensors live where the backend needs them: the CPU for gloo, this rank's GPU (set by
    the launcher) for nccl."""
    nccl = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    gen = torch.Generator().manual_seed(seed + rank)
    mine = torch.randn(3, generator=gen, dtype=torch.float64)
    summed = mine.to(dev, copy=True)
    dist.all_reduce(summed)
    gathered = [torch.empty_like(summed) for _ in range(world_size)]
    dist.all_gather(gathered, mine.to(dev))
    token = torch.tensor([rank * 10 + 7], device=dev)
    dist.broadcast(token, src=world_size - 1)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "pid": os.getpid(),
        "mine": mine,
        "summed": summed.cpu(),
        "gathered": torch.stack(gathered).cpu(),
        "token": int(token.cpu()),
        "env": {
            k: os.environ.get(k)
            for k in (
                "NCCL_NVLS_ENABLE",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                "NVSHMEM_DISABLE_NVLS",
                "TRITON_INTERPRET",
                "CPATTN_TEST_MARKER",
                "CPATTN_OUTPUT_POISON",
            )
        },
        "poison": _worker_poison(),
    }


def _worker_poison() -> float | None:
    try:
        from cpattn_common import alloc
    except ImportError:
        return None
    return alloc.get_output_poison()


def fail_on(rank: int, world_size: int, bad_rank: int) -> int:
    """Rank ``bad_rank`` raises; the others wait in a barrier that never completes."""
    if rank == bad_rank:
        raise ValueError(f"planted failure on rank {rank}")
    dist.barrier()
    return rank


def hang_on(rank: int, world_size: int, bad_rank: int, pid_dir: str) -> int:
    """Rank ``bad_rank`` sleeps forever; the others finish."""
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == bad_rank:
        while True:
            time.sleep(0.05)
    return rank


def barrier_skipped_on(rank: int, world_size: int, bad_rank: int) -> int:
    """Every rank but ``bad_rank`` enters a barrier (a rank-dependent branch's bug)."""
    if rank != bad_rank:
        dist.barrier()
    return rank


def die_on(rank: int, world_size: int, bad_rank: int) -> int:
    """Rank ``bad_rank`` exits abruptly (no exception, no result)."""
    if rank == bad_rank:
        os._exit(17)
    dist.barrier()
    return rank


def fail_first_then_peer(rank: int, world_size: int, launcher_pid: int) -> int:
    """Rank 1 raises while the launcher is stopped for a moment; rank 0's collective then
    fails because of it, so both messages are waiting when the launcher resumes."""
    if rank == 1:
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import os, signal, sys, time; pid = int(sys.argv[1]); "
                "os.kill(pid, signal.SIGSTOP); time.sleep(1.5); os.kill(pid, signal.SIGCONT)",
                str(launcher_pid),
            ],
            start_new_session=True,
        )
        time.sleep(0.3)
        raise RuntimeError("the first failure, on rank 1")
    dist.all_reduce(torch.ones(4))  # fails once rank 1 has gone
    return 0


def record_pid_and_hang(rank: int, world_size: int, pid_dir: str) -> None:
    """Every rank writes its pid and hangs (used to kill the launching process under it)."""
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.05)


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("this object refuses to be pickled")


def unpicklable_result(rank: int, world_size: int) -> object:
    return _Unpicklable()


# ---------------------------------------------------------------------------------------------
# helpers


def _has_alloc() -> bool:
    try:
        from cpattn_common import alloc  # noqa: F401
    except ImportError:
        return False
    return True


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _assert_all_gone(pids: list[int], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return
        time.sleep(0.05)
    alive = [p for p in pids if not _gone(p)]
    raise AssertionError(f"worker processes still alive: {alive}")


def _read_pids(pid_dir: pathlib.Path, world_size: int) -> list[int]:
    return [int((pid_dir / f"rank{r}.pid").read_text()) for r in range(world_size)]


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda n: f"ws{n}")
def test_collectives_on_gloo(world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPATTN_TEST_MARKER", f"marker-{world_size}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    results = run_distributed(collective_checks, world_size, "gloo", args=(1234,), timeout=60)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world_size"] == world_size for r in results)
    assert len({r["pid"] for r in results}) == world_size
    expected = torch.stack([r["mine"] for r in results])
    for r in results:
        torch.testing.assert_close(r["gathered"], expected, rtol=0, atol=0)
        torch.testing.assert_close(r["summed"], expected.sum(0), rtol=1e-12, atol=1e-12)
        assert r["token"] == (world_size - 1) * 10 + 7
        for key, value in NO_MULTICAST_ENV.items():
            assert r["env"][key] == value
        assert r["env"]["TRITON_INTERPRET"] == "1"
        assert r["env"]["CPATTN_TEST_MARKER"] == f"marker-{world_size}"
        # The plugin's autouse fixture asks the ranks to poison outputs too.
        assert r["env"]["CPATTN_OUTPUT_POISON"] == "nan"
        if r["poison"] is not None or _has_alloc():
            assert math.isnan(r["poison"])
    _assert_all_gone([r["pid"] for r in results])


def test_run_ranks_fixture(run_ranks: Any, dist_backend: str) -> None:
    """The fixture starts ranks on the session's backend (nccl on GPUs: needs 2)."""
    results = run_ranks(collective_checks, 2, 7, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert dist_backend in ("gloo", "nccl")
    want = results[0]["mine"] + results[1]["mine"]
    for r in results:
        torch.testing.assert_close(r["summed"], want)
        assert r["token"] == 17


@pytest.mark.parametrize("bad_rank", [0, 3])
def test_failing_rank_raises_with_traceback(bad_rank: int) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(fail_on, 4, "gloo", args=(bad_rank,), timeout=30)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == bad_rank
    assert not err.timed_out
    text = str(err)
    assert f"rank {bad_rank} failed" in text
    assert f"planted failure on rank {bad_rank}" in text
    assert "Traceback" in text
    assert "fail_on" in text
    assert elapsed < 20, f"a failing rank took {elapsed:.1f} s to be reported"
    assert len(err.pids) == 4
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), copy.rank, copy.pids) == (str(err), err.rank, err.pids)
    _assert_all_gone(err.pids)
    assert not [p for p in __import__("multiprocessing").active_children() if p.pid in err.pids]


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP / SIGCONT")
def test_the_rank_that_failed_first_is_named() -> None:
    """Messages read in one wait used to name the lowest rank: here rank 0, whose collective
    failed only because rank 1 had raised."""
    with pytest.raises(DistributedError) as info:
        run_distributed(fail_first_then_peer, 2, "gloo", args=(os.getpid(),), timeout=60.0)
    assert info.value.rank == 1
    assert "the first failure, on rank 1" in str(info.value)
    assert 0 in info.value.tracebacks  # the peer's failure was read in the same wait


def test_hanging_rank_times_out_with_stacks(tmp_path: pathlib.Path) -> None:
    timeout = 4.0
    start = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(hang_on, 2, "gloo", args=(1, str(tmp_path)), timeout=timeout)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.timed_out
    assert err.rank == 1
    text = str(err)
    assert "timed out after 4 s" in text
    assert "rank(s) [1]" in text
    # The stuck rank's Python stack at the deadline names the function it was stuck in.
    assert "hang_on" in err.tracebacks[1]
    assert elapsed < timeout + 8, f"hang took {elapsed:.1f} s to end (timeout {timeout})"
    _assert_all_gone(_read_pids(tmp_path, 2))


def test_a_barrier_one_rank_skips_is_caught() -> None:
    """The workers' exit handshake was a barrier of the process group under test: it completed
    the barrier rank 1 was waiting in, and the run passed. The handshake is a file-store
    counter now, so rank 1 waits until the deadline."""
    with pytest.raises(DistributedError) as info:
        run_distributed(barrier_skipped_on, 2, "gloo", args=(0,), timeout=4.0)
    assert info.value.timed_out
    assert info.value.rank == 1


class _UnreapedRank:
    """A rank process whose exit the launcher has not been told of (the fork server reaps
    it later): its sentinel never becomes ready, its exit code is not known."""

    def __init__(self, pid: int) -> None:
        import multiprocessing

        self.pid = pid
        self._never, self._keep = multiprocessing.Pipe(duplex=False)
        self.sentinel = self._never.fileno()
        self.exitcode = None

    def join(self, timeout: float | None = None) -> None:
        return None


def test_a_rank_whose_pipe_ends_is_named_before_the_peer_errors_it_causes(
    tmp_path: pathlib.Path,
) -> None:
    """Rank 0's result pipe ended (it died without a result) before rank 1 reported the
    collective error its death caused, but the launcher only counted a death at the process
    sentinel: it named rank 1 and dropped rank 0 (9 of 25 runs of a segfault at 4 ranks)."""
    import multiprocessing

    from cpattn_testing import launcher

    readers, writers = zip(*(multiprocessing.Pipe(duplex=False) for _ in range(2)), strict=True)
    writers[0].close()  # rank 0 is gone: its pipe ends without a message
    peer_error = "RuntimeError: Connection closed by peer (a remote worker crashed)"
    writers[1].send_bytes(pickle.dumps(("error", peer_error, time.monotonic())))
    procs = [_UnreapedRank(100), _UnreapedRank(101)]
    files = launcher._RankFiles(str(tmp_path), 2)
    with pytest.raises(DistributedError) as info:
        launcher._collect(procs, list(readers), files, time.monotonic() + 30, 30.0)  # type: ignore[arg-type]
    assert info.value.rank == 0
    assert "rank 0 (pid 100) exited with an exit status not known yet" in str(info.value)
    assert set(info.value.tracebacks) == {0, 1}


def test_rank_that_dies_without_exception() -> None:
    with pytest.raises(DistributedError, match=r"exit code 17 without reporting a result") as info:
        run_distributed(die_on, 2, "gloo", args=(0,), timeout=30)
    assert info.value.rank == 0
    _assert_all_gone(info.value.pids)


def test_unpicklable_result_is_reported() -> None:
    with pytest.raises(DistributedError, match="refuses to be pickled"):
        run_distributed(unpicklable_result, 1, "gloo", timeout=30)


def test_spawn_start_method() -> None:
    results = run_distributed(
        collective_checks, 2, "gloo", args=(5,), start_method="spawn", timeout=60
    )
    assert [r["rank"] for r in results] == [0, 1]


def interpreter_as_decorated(rank: int, world_size: int) -> dict[str, Any]:
    """What this rank's environment asks for, and what cp-common's kernel was decorated as."""
    from cpattn_common.interpret import triton_interpreting
    from cpattn_common.kernels.merge_attn_states import _merge_attn_states_fwd_kernel

    return {
        "env": os.environ.get("TRITON_INTERPRET"),
        "interpreting": triton_interpreting(),
        "kernel": type(_merge_attn_states_fwd_kernel).__name__,
    }


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_rank_decorates_the_kernels_under_its_own_environment(start_method: str) -> None:
    """``env={"TRITON_INTERPRET": ...}`` is applied before cp-common's kernels are decorated:
    importing the rank's entry point (``cpattn_testing._rank``) must not import cp-common, or
    the kernels would follow the launching process's setting while ``triton_interpreting()``
    read the rank's."""
    from cpattn_common.interpret import triton_interpreting

    flipped = "0" if triton_interpreting() else "1"
    (result,) = run_distributed(
        interpreter_as_decorated,
        1,
        "gloo",
        env={"TRITON_INTERPRET": flipped},
        start_method=start_method,
        timeout=90,
    )
    assert result["env"] == flipped
    assert result["interpreting"] is (flipped == "1")
    assert result["kernel"] == ("InterpretedFunction" if flipped == "1" else "JITFunction")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size must be a positive int, got 0"),
        ({"world_size": 2, "backend": "mpi"}, "backend must be one of"),
        ({"world_size": 2, "timeout": 0}, r"timeout must be a finite number of seconds in \(0, "),
        # These passed the check and raised OverflowError in the selector wait.
        ({"world_size": 2, "timeout": math.inf}, "timeout must be a finite number"),
        ({"world_size": 2, "timeout": 1e12}, "timeout must be a finite number"),
        ({"world_size": 2, "timeout": math.nan}, "timeout must be a finite number"),
        ({"world_size": 2, "start_method": "fork"}, "start_method must be one of"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_distributed(collective_checks, **kwargs)


def test_a_world_size_that_is_not_an_int_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="world_size must be an int, got '2'"):
        run_distributed(collective_checks, "2")  # type: ignore[arg-type]


def test_unpicklable_function_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="needs a module-level function"):
        run_distributed(lambda rank, world_size: rank, 2)


def test_too_many_gpus_is_a_skip_exception() -> None:
    world_size = available_gpus() + 1
    with pytest.raises(
        NotEnoughDevicesError, match=f"world_size {world_size} needs {world_size} GPUs"
    ):
        run_distributed(collective_checks, world_size, "nccl")


_ORPHAN_SCRIPT = """
import sys
sys.path[:0] = {paths!r}
import importlib.util
spec = importlib.util.spec_from_file_location("launcher_test_mod", {test_file!r})
mod = importlib.util.module_from_spec(spec)
sys.modules["launcher_test_mod"] = mod
spec.loader.exec_module(mod)
from cpattn_testing.launcher import run_distributed
if __name__ == "__main__":
    run_distributed(mod.record_pid_and_hang, 2, "gloo", args=({pid_dir!r},), timeout=300)
"""


def test_test_module_with_a_dotted_name_loads_in_the_workers(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest's importlib mode names a test file after its path (``tests.test_x``), with no
    importable ``tests`` package; the workers register the missing parent before unpickling
    (plain ``pytest`` in a downstream project failed with "No module named 'tests'")."""
    package, name = "cpattn_no_such_package", "cpattn_no_such_package.test_dotted"
    path = tmp_path / "test_dotted.py"
    path.write_text("def body(rank, world_size):\n    return 10 * rank + world_size\n")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    parent = types.ModuleType(package)  # what pytest registers in the launching process
    parent.__path__ = []
    monkeypatch.setitem(sys.modules, package, parent)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    assert run_distributed(module.body, 2, "gloo", timeout=120) == [2, 12]


def test_workers_die_with_the_launching_process(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "launch.py"
    script.write_text(
        _ORPHAN_SCRIPT.format(paths=sys.path, test_file=__file__, pid_dir=str(tmp_path))
    )
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert proc.poll() is None, "the launching process ended early"
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.1)
        pids = _read_pids(tmp_path, 2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        _assert_all_gone(pids, within_s=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def nccl_body(rank: int, world_size: int) -> dict[str, Any]:
    dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.full((4,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    gathered = torch.empty(world_size * 2, device=dev)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank), device=dev))
    return {
        "device": str(dev),
        "sum": t,
        "gathered": gathered,
        "nvls": os.environ["NCCL_NVLS_ENABLE"],
    }


@pytest.mark.multigpu(2)
@pytest.mark.parametrize("world_size", [2, 4])
def test_nccl_one_gpu_per_rank(run_ranks: Any, dist_backend: str, world_size: int) -> None:
    if dist_backend != "nccl":
        pytest.skip("nccl runs only with CPATTN_TEST_DEVICE=cuda")
    results = run_ranks(nccl_body, world_size, timeout=120)
    for r, got in enumerate(results):
        assert got["device"] == f"cuda:{r}"
        assert got["sum"].device.type == "cpu"  # results come home on the CPU
        assert got["sum"].tolist() == [world_size * (world_size + 1) / 2] * 4
        assert got["gathered"].tolist() == [float(p) for p in range(world_size) for _ in range(2)]
        assert got["nvls"] == "0"


def hang_in_collective(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)
    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()


@pytest.mark.multigpu(2)
def test_nccl_hang_is_killed(dist_backend: str) -> None:
    if dist_backend != "nccl":
        pytest.skip("nccl runs only with CPATTN_TEST_DEVICE=cuda")
    start = time.monotonic()
    with pytest.raises(DistributedError, match="timed out after 20 s") as info:
        run_distributed(hang_in_collective, 2, "nccl", timeout=20)
    assert time.monotonic() - start < 40
    _assert_all_gone(info.value.pids)


_KERNEL_MODULE = """
import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)
"""


def triton_mode(rank: int, world_size: int, kernel_file: str) -> tuple[str, list[float] | None]:
    """Import a kernel module in the worker; run it when interpreting (CPU tensors)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"kernel_mod_{os.getpid()}", kernel_file)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kind = type(module.add_one).__name__
    if os.environ.get("TRITON_INTERPRET") != "1":
        return kind, None
    x = torch.arange(5, dtype=torch.float32)
    y = torch.full_like(x, math.nan)
    module.add_one[(1,)](x, y, 5, BLOCK=8)
    return kind, y.tolist()


def test_triton_interpret_follows_the_launching_environment(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers come from a fork server that imported triton earlier, under whatever
    environment it started with; TRITON_INTERPRET must still follow the test's setting."""
    pytest.importorskip("triton")
    kernel_file = tmp_path / "kernel_mod.py"
    kernel_file.write_text(_KERNEL_MODULE)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kind, _ = run_distributed(triton_mode, 1, args=(str(kernel_file),), timeout=60)[0]
    assert kind == "JITFunction"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kind, values = run_distributed(triton_mode, 1, args=(str(kernel_file),), timeout=60)[0]
    assert kind == "InterpretedFunction"
    assert values == [1.0, 2.0, 3.0, 4.0, 5.0]
