"""Run a function on N ranks in N processes: gloo on the CPU, nccl with one GPU per rank
(docs/packages/testing.md, "Real ranks"). The first rank that raises, dies or exits without a
result stops the run with one :class:`DistributedError`; every rank's session is ended with
the run, and rank output is echoed with a ``[rank r]`` prefix.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import unittest
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cpattn_testing._rank import POISON_ENV, worker

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import ForkServerContext, SpawnContext
    from multiprocessing.process import BaseProcess

__all__ = [
    "NO_MULTICAST_ENV",
    "POISON_ENV",
    "DistributedError",
    "NotEnoughDevicesError",
    "available_gpus",
    "run_distributed",
]

#: NVLink multicast stays off in every worker (NCCL NVLS, symmetric-memory multicast, NVSHMEM).
NO_MULTICAST_ENV: Mapping[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_BACKENDS = ("gloo", "nccl")
_START_METHODS = ("forkserver", "spawn")
_TERMINATE_GRACE_S = 2.0
_STACK_DUMP_WAIT_S = 1.0
_EXIT_WITHOUT_RESULT_GRACE_S = 1.0
_SETTLE_S = 0.5
_ECHO_PERIOD_S = 0.2
_STDERR_TAIL_LINES = 20
# The process group's own timeout lies beyond the launcher's deadline, which reports first.
_PG_TIMEOUT_MARGIN_S = 60.0
_MAX_TIMEOUT_S = 7 * 24 * 3600.0
# Imported once by the fork server (none initialises CUDA or reads TRITON_INTERPRET).
_PRELOAD = ["torch", "torch.distributed", "numpy", "triton", "pytest", "hypothesis"]


class DistributedError(RuntimeError):
    """A distributed run failed: a rank raised, died, or the run passed its deadline.

    Attributes:
        rank: the rank that failed first (``None`` for a timeout that no rank caused alone).
        tracebacks: ``{rank: text}`` for every rank that reported something (a traceback, or
            its Python stacks when it was stuck at the deadline).
        pids: process ids of every worker of the run (all of them are gone when this is raised).
        timed_out: True when the run passed its deadline.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        tracebacks: Mapping[int, str] | None = None,
        pids: Sequence[int] = (),
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.tracebacks = dict(tracebacks or {})
        self.pids = list(pids)
        self.timed_out = timed_out

    def __reduce__(self) -> tuple[Any, ...]:  # pytest-xdist pickles failures
        return (type(self), (str(self),), self.__dict__)


class NotEnoughDevicesError(unittest.SkipTest):
    """The run needs more GPUs than are visible. pytest reports it as a skip with this reason."""


def available_gpus() -> int:
    """Number of CUDA devices visible to this process (0 without CUDA); does not initialise CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())


_ENV_LOCK = threading.Lock()
_FORKSERVER_CTX: ForkServerContext | None = None


def _context(start_method: str) -> SpawnContext | ForkServerContext:
    global _FORKSERVER_CTX
    if start_method == "spawn":
        return multiprocessing.get_context("spawn")
    if _FORKSERVER_CTX is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _FORKSERVER_CTX = ctx
    return _FORKSERVER_CTX


def _worker_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(NO_MULTICAST_ENV)
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if extra:
        env.update(extra)
    return env


def _check_main_guard() -> None:
    """Refuse a call from the main script's top level outside ``if __name__ == "__main__":``
    (each rank re-imports the main script and would run the call again)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if not isinstance(path, str) or spec_name.endswith("__main__"):
        return  # no script, or ``python -m package``, whose __main__ is not re-imported
    frame = inspect.currentframe()
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)
    ):
        frame = frame.f_back
    if frame is None:
        return
    line = frame.f_lineno
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.lineno < line <= (node.body[-1].end_lineno or 0):
            names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            values = {n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)}
            if "__name__" in names and "__main__" in values:
                return
    raise RuntimeError(
        f"run_distributed is called at the top level of the main script {path} (line {line}), "
        'outside an `if __name__ == "__main__":` block: every rank re-imports the main script '
        "(multiprocessing's forkserver and spawn start methods do) and would run the call "
        'again. Put the code that starts the run under `if __name__ == "__main__":`.'
    )


def _module_files(fn: Callable[..., Any]) -> dict[str, str]:
    """Source file of fn's module, so a worker can load a module not on sys.path (pytest's
    ``--import-mode=importlib``)."""
    name = getattr(fn, "__module__", None)
    module = sys.modules.get(name) if isinstance(name, str) else None
    path = getattr(module, "__file__", None)
    if isinstance(name, str) and isinstance(path, str) and name != "__main__":
        return {name: path}
    return {}


class _RankFiles:
    """Each rank's ``out``, ``err`` and ``stacks`` files; :meth:`echo` copies new lines."""

    def __init__(self, tmpdir: str, world_size: int) -> None:
        self.tmpdir = tmpdir
        self.world_size = world_size
        self._echoed: dict[str, int] = {}  # path -> bytes echoed so far

    def path(self, rank: int, kind: str) -> str:
        return os.path.join(self.tmpdir, f"rank{rank}.{kind}")

    def echo(self, final: bool = False) -> None:
        for rank in range(self.world_size):
            for kind, stream in (("out", sys.stdout), ("err", sys.stderr)):
                path = self.path(rank, kind)
                try:
                    with open(path, "rb") as f:
                        f.seek(self._echoed.get(path, 0))
                        data = f.read()
                except OSError:
                    continue
                if not final:
                    data = data[: data.rfind(b"\n") + 1]  # complete lines only
                if not data:
                    continue
                self._echoed[path] = self._echoed.get(path, 0) + len(data)
                lines = data.decode(errors="replace").splitlines()
                with contextlib.suppress(OSError, ValueError):
                    stream.write("".join(f"[rank {rank}] {line}\n" for line in lines))
                    stream.flush()

    def stderr_tail(self, rank: int) -> str:
        try:
            with open(self.path(rank, "err"), "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-_STDERR_TAIL_LINES:])


def _group_alive(pgids: set[int]) -> bool:
    """Whether a process that is not a zombie belongs to one of the process groups (/proc)."""
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/stat") as f:
                    state, _, pgid = f.read().rpartition(")")[2].split()[:3]
            except (OSError, ValueError):
                continue
            if state != "Z" and int(pgid) in pgids:
                return True
    return False


def _signal_ranks(procs: Sequence[BaseProcess], sig: int) -> None:
    for p in procs:
        if p.pid is None:
            continue
        try:
            os.killpg(p.pid, sig)  # the rank's process group: the rank and what it started
        except ProcessLookupError:  # the rank has not called setsid yet
            if p.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(p.pid, sig)
        except PermissionError:
            pass


def _stop(procs: Sequence[BaseProcess]) -> None:
    """End every rank's process group: SIGTERM, then SIGKILL after a grace; reap the ranks."""
    _signal_ranks(procs, signal.SIGTERM)
    groups = {p.pid for p in procs if p.pid is not None}
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    while time.monotonic() < deadline and _group_alive(groups):
        time.sleep(0.02)
    _signal_ranks(procs, signal.SIGKILL)
    for p in procs:
        p.join(_TERMINATE_GRACE_S)


def _dump_stacks(
    procs: Sequence[BaseProcess], ranks: Sequence[int], files: _RankFiles
) -> dict[int, str]:
    for r in ranks:
        pid = procs[r].pid
        if pid is not None and procs[r].is_alive():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
    time.sleep(_STACK_DUMP_WAIT_S)
    dumps: dict[int, str] = {}
    for r in ranks:
        try:
            with open(files.path(r, "stacks")) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        dumps[r] = text or "(no stack dump: the process did not answer SIGUSR1)"
    return dumps


def _with_stderr(lines: list[str], rank: int, files: _RankFiles) -> list[str]:
    tail = files.stderr_tail(rank)
    return [*lines, f"--- last lines of rank {rank}'s stderr ---", tail] if tail else lines


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    backend: str = "gloo",
    *,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and return their results.

    ``torch.distributed`` is initialised in each rank (``file://`` rendezvous in a fresh
    temporary directory); with ``backend="nccl"`` rank r uses ``cuda:r``.

    Args:
        fn: a module-level function (it is pickled by reference). Its return value is pickled
            back; tensors in (nested) lists/tuples/dicts are moved to the CPU first.
        world_size: number of ranks, >= 1.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        args: extra positional arguments for ``fn`` (picklable).
        timeout: seconds for the whole run, start-up included (at most a week).
        env: extra environment variables for the workers (they win over the launching
            process's environment and over :data:`NO_MULTICAST_ENV`).
        start_method: ``"forkserver"`` (default; a warm server that imported torch) or
            ``"spawn"`` (a fresh interpreter per rank; ``nccl`` runs always spawn).

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        ValueError: bad ``world_size``, ``backend``, ``timeout`` or ``start_method``.
        TypeError: ``world_size`` is not an int; ``fn`` (a lambda, a local function) or
            ``args`` cannot be pickled.
        RuntimeError: called from the main script's top level outside an
            ``if __name__ == "__main__":`` block (every rank would run the call again).
        NotEnoughDevicesError: nccl with more ranks than visible GPUs (a ``unittest.SkipTest``,
            so pytest reports a skip).
        DistributedError: a rank raised or died, or the deadline passed. Every process of
            every rank has been ended when it is raised.
    """
    from cpattn_common.checks import check_positive_int

    check_positive_int("world_size", world_size)
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if not 0 < timeout <= _MAX_TIMEOUT_S:
        raise ValueError(
            f"timeout must be a finite number of seconds in (0, {_MAX_TIMEOUT_S:g}], "
            f"got {timeout!r}"
        )
    if start_method not in _START_METHODS:
        raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}")
    if backend == "nccl":
        start_method = "spawn"
        gpus = available_gpus()
        if world_size > gpus:
            raise NotEnoughDevicesError(
                f"world_size {world_size} needs {world_size} GPUs (one per rank on nccl), "
                f"but {gpus} {'is' if gpus == 1 else 'are'} visible"
            )
    _check_main_guard()
    try:
        payload = pickle.dumps((fn, tuple(args)))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"run_distributed needs a module-level function and picklable args; could not "
            f"pickle {getattr(fn, '__qualname__', fn)!r}: {exc}"
        ) from exc
    ctx = _context(start_method)
    tmpdir = tempfile.mkdtemp(prefix="cpattn-dist-")
    files = _RankFiles(tmpdir, world_size)
    init_method = "file://" + os.path.join(tmpdir, "rendezvous")
    common = (_worker_env(env), _module_files(fn), payload)
    deadline = time.monotonic() + timeout
    procs: list[BaseProcess] = []
    readers: list[Connection] = []
    try:
        with _ENV_LOCK:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                prefix = os.path.join(tmpdir, f"rank{rank}")
                rank_args = (rank, world_size, backend, init_method, prefix, *common, writer)
                proc = ctx.Process(
                    target=worker,
                    name=f"cpattn-rank{rank}",
                    args=(*rank_args, os.getpid(), timeout + _PG_TIMEOUT_MARGIN_S),
                    daemon=True,
                )
                readers.append(reader)
                try:
                    proc.start()
                finally:
                    writer.close()
                procs.append(proc)
        return _collect(procs, readers, files, deadline, timeout)
    finally:
        _stop(procs)
        files.echo(final=True)
        for reader in readers:
            reader.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _collect(
    procs: Sequence[BaseProcess],
    readers: Sequence[Connection],
    files: _RankFiles,
    deadline: float,
    timeout: float,
) -> list[Any]:
    """Wait for every rank's message; raise on the first failure or at the deadline."""
    world_size = len(procs)
    pids = [p.pid or -1 for p in procs]
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    failed_at: dict[int, float] = {}  # when a rank failed, by the monotonic clock
    exited_at: dict[int, float] = {}
    open_readers = {r: readers[r] for r in range(world_size)}

    def died(rank: int, noticed: float) -> None:
        procs[rank].join(0.1)
        code = procs[rank].exitcode
        how = "an exit status not known yet" if code is None else f"exit code {code}"
        if code is not None and code < 0:
            how = f"signal {-code}"
        failures[rank] = (
            f"rank {rank} (pid {pids[rank]}) exited with {how} without reporting a result"
        )
        if not os.path.exists(files.path(rank, "err")):
            failures[rank] += (
                ", before it reached its entry point (while multiprocessing started it, e.g."
                " re-importing the main module: any traceback is on the launching process's"
                " stderr)"
            )
        # Noticed late (its peers' resulting errors often carry earlier times): counted earlier.
        failed_at[rank] = noticed - _EXIT_WITHOUT_RESULT_GRACE_S

    def read(rank: int) -> None:
        try:
            raw = open_readers.pop(rank).recv_bytes()
        except (EOFError, OSError):
            # The pipe ends without a message only when the rank's process is gone.
            if rank not in results and rank not in failures:
                died(rank, time.monotonic())
            return
        kind, body, *when = pickle.loads(raw)
        if kind == "ok":
            try:
                results[rank] = pickle.loads(body)
            except Exception:
                failures[rank] = "could not unpickle the result:\n" + traceback.format_exc()
                failed_at[rank] = time.monotonic()
        else:
            failures[rank] = body
            failed_at[rank] = when[0] if when else time.monotonic()

    while len(results) < world_size:
        if failures:
            # Name the rank that failed first, once the others had a moment to report.
            settle = time.monotonic() + _SETTLE_S
            while open_readers and (now := time.monotonic()) < settle:
                ready = multiprocessing.connection.wait(list(open_readers.values()), settle - now)
                for r in [r for r, conn in open_readers.items() if conn in ready]:
                    read(r)
            rank = min(failures, key=lambda r: (failed_at.get(r, math.inf), r))
            lines = _with_stderr([f"rank {rank} failed:", failures[rank].rstrip()], rank, files)
            for r, text in sorted(failures.items()):
                if r != rank:
                    last = text.strip().splitlines()[-1] if text.strip() else "?"
                    lines.append(f"(rank {r} also failed afterwards: {last})")
            raise DistributedError("\n".join(lines), rank=rank, tracebacks=failures, pids=pids)
        now = time.monotonic()
        if now >= deadline:
            stuck = [r for r in range(world_size) if r not in results]
            dumps = _dump_stacks(procs, stuck, files)
            lines = [
                f"timed out after {timeout:g} s: rank(s) {stuck} of {world_size} did not finish "
                f"(finished: {sorted(results)})"
            ]
            for r in stuck:
                lines += [f"--- rank {r} (pid {pids[r]}) stacks at the deadline ---", dumps[r]]
                lines = _with_stderr(lines, r, files)
            raise DistributedError(
                "\n".join(lines),
                rank=stuck[0] if len(stuck) == 1 else None,
                tracebacks=dumps,
                pids=pids,
                timed_out=True,
            )
        waitables: list[Any] = list(open_readers.values())
        waitables += [procs[r].sentinel for r in range(world_size) if r not in exited_at]
        ready = multiprocessing.connection.wait(waitables, min(deadline - now, _ECHO_PERIOD_S))
        files.echo()
        for r, conn in list(open_readers.items()):
            if conn in ready:
                read(r)
        for r in range(world_size):
            if r not in exited_at and procs[r].sentinel in ready:
                exited_at[r] = time.monotonic()
        # A rank that exited without a message fails, once its last writes had time to arrive.
        for r, t in exited_at.items():
            if r in results or r in failures:
                continue
            if r in open_readers and open_readers[r].poll(0):
                read(r)
            elif r not in open_readers or time.monotonic() - t >= _EXIT_WITHOUT_RESULT_GRACE_S:
                died(r, t)
    return [results[r] for r in range(world_size)]
