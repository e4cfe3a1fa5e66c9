"""Fault injection into run_distributed: a failing or stuck rank ends every process of every
rank (the children they started included), an aborting backend's reason reaches the error, and
a script without a main guard is told so."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from cpattn_testing import launcher
from cpattn_testing.launcher import DistributedError, run_distributed

# A child that ignores SIGTERM: only the SIGKILL that follows the grace period ends it.
_STUBBORN_CHILD = (
    "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "pathlib.Path(sys.argv[1]).write_text('ready'); time.sleep(600)"
)


def _start_children(rank: int, pid_dir: str) -> None:
    """Start a plain ``sleep 600`` and a SIGTERM-ignoring Python sleeper; record their pids."""
    ready = os.path.join(pid_dir, f"rank{rank}.ready")
    children = [
        subprocess.Popen(["sleep", "600"]),
        subprocess.Popen([sys.executable, "-c", _STUBBORN_CHILD, ready]),
    ]
    with open(os.path.join(pid_dir, f"rank{rank}.pids"), "w") as f:
        f.write(" ".join(str(p) for p in [os.getpid(), *(c.pid for c in children)]))
    deadline = time.monotonic() + 30
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)


def fail_after_starting_children(rank: int, world_size: int, pid_dir: str) -> None:
    """Rank 1 starts children and raises; rank 0 waits in a barrier that never completes."""
    if rank == 1:
        _start_children(rank, pid_dir)
        raise RuntimeError("planted failure after starting children")
    dist.barrier()


def hang_after_starting_children(rank: int, world_size: int, pid_dir: str) -> None:
    _start_children(rank, pid_dir)
    while True:
        time.sleep(0.05)


def mismatched_all_gather(rank: int, world_size: int) -> None:
    """Rank 0 all-gathers 4 elements, rank 1 8: gloo aborts the process on the size check."""
    n = 4 if rank == 0 else 8
    out = [torch.empty(n) for _ in range(world_size)]
    dist.all_gather(out, torch.ones(n))


def print_on_both_streams(rank: int, world_size: int) -> int:
    print(f"stdout of rank {rank}")
    print(f"stderr of rank {rank}", file=sys.stderr)
    return rank


def _gone(pid: int) -> bool:
    """No such process, or a zombie waiting for its new parent (init) to reap it."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


def _assert_gone(pids: list[int], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if not _gone(p)] == [], "processes of the run are still alive"


def _recorded_pids(pid_dir: pathlib.Path) -> list[int]:
    return [int(p) for path in pid_dir.glob("rank*.pids") for p in path.read_text().split()]


def test_the_children_of_a_failing_rank_are_ended(tmp_path: pathlib.Path) -> None:
    with pytest.raises(DistributedError, match="planted failure after starting children") as info:
        run_distributed(fail_after_starting_children, 2, args=(str(tmp_path),), timeout=60)
    assert info.value.rank == 1
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 3  # rank 1 and its two children
    _assert_gone(pids + info.value.pids)


def test_a_timeout_ends_every_rank_and_its_children(tmp_path: pathlib.Path) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedError, match="timed out after 3 s") as info:
        run_distributed(hang_after_starting_children, 2, args=(str(tmp_path),), timeout=3)
    assert time.monotonic() - start < 15
    assert info.value.timed_out
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 6  # two ranks, two children each
    _assert_gone(pids + info.value.pids)


def test_a_size_mismatch_carries_the_backends_reason() -> None:
    """gloo aborts the process (no Python exception, no traceback): its reason is only on the
    rank's stderr, whose last lines the error carries."""
    with pytest.raises(DistributedError) as info:
        run_distributed(mismatched_all_gather, 2, timeout=60)
    text = str(info.value)
    assert "stderr ---" in text
    assert "doesn't match expected size" in text, text


def test_rank_output_is_echoed_with_the_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_distributed(print_on_both_streams, 2, timeout=60) == [0, 1]
    out, err = capsys.readouterr()
    assert "[rank 0] stdout of rank 0" in out
    assert "[rank 1] stdout of rank 1" in out
    assert "[rank 1] stderr of rank 1" in err


_UNGUARDED_SCRIPT = """
from cpattn_testing.launcher import run_distributed


def body(rank, world_size):
    return rank


print(run_distributed(body, 2, timeout=60))
"""


def test_a_script_without_a_main_guard_is_told_so(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(_UNGUARDED_SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode != 0
    assert f"top level of the main script {script} (line 9)" in done.stderr, done.stderr
    assert 'under `if __name__ == "__main__":`' in done.stderr
    assert "DistributedError" not in done.stderr  # refused before any rank started


class _ExitedRank:
    """A rank process that exited with its status not known yet (its sentinel never fires)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._never, self._keep = multiprocessing.Pipe(duplex=False)
        self.sentinel = self._never.fileno()
        self.exitcode = None

    def join(self, timeout: float | None = None) -> None:
        return None


def test_a_death_seen_after_the_peer_error_it_caused_is_named(tmp_path: pathlib.Path) -> None:
    """A dying rank closes its files in descriptor order: its sockets (the peer's collective
    fails at once) can close before its result pipe, whose end then arrives after the peer's
    error. Under load the launcher named the peer (rank 1) instead of the rank that died."""
    readers, writers = zip(*(multiprocessing.Pipe(duplex=False) for _ in range(2)), strict=True)
    peer_error = "RuntimeError: Connection closed by peer"
    writers[1].send_bytes(pickle.dumps(("error", peer_error, time.monotonic())))
    closing = threading.Timer(0.1, writers[0].close)  # rank 0's pipe ends a moment later
    closing.start()
    procs = [_ExitedRank(100), _ExitedRank(101)]
    files = launcher._RankFiles(str(tmp_path), 2)
    with pytest.raises(DistributedError) as info:
        launcher._collect(procs, list(readers), files, time.monotonic() + 30, 30.0)  # type: ignore[arg-type]
    closing.join()
    assert info.value.rank == 0
    assert "(rank 1 also failed afterwards: RuntimeError: Connection closed by peer)" in str(
        info.value
    )
