"""Run a function on N ranks in N processes: gloo on the CPU, nccl with one GPU per rank.

``run_distributed(fn, world_size, backend)`` starts ``world_size`` worker processes, initialises
``torch.distributed`` in each (``file://`` rendezvous in a fresh temporary directory, so no port
is ever shared between concurrently running tests), calls ``fn(rank, world_size, *args)`` and
returns every rank's return value in rank order.

Failure handling is the point of this module:

- the first rank that raises (or dies, or exits without a result) stops the run: every rank is
  terminated, then killed, and one :class:`DistributedError` names the rank and carries its
  traceback;
- when the deadline passes, each rank that is still running dumps its Python stacks (through
  :mod:`faulthandler`) before it is killed, and the error shows where it was stuck;
- workers watch the launching process and exit on their own if it dies, so a killed test run
  leaves no orphan behind.

Workers are forked from a ``forkserver`` that has imported ``torch`` once, so a launch costs
milliseconds instead of one ``import torch`` per rank. The fork server never touches CUDA, and
each worker applies the launching process's *current* environment (plus the multicast-off
variables) before it loads ``fn``, so ``TRITON_INTERPRET`` or ``CUDA_VISIBLE_DEVICES`` set by a
test take effect in the workers. ``start_method="spawn"`` is the slower, fully fresh
alternative.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib.util
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
import types
import unittest
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

# Nothing of cpattn_common at import: a rank imports this module (its entry point, _worker)
# before it applies its environment, and cpattn_common's kernels read TRITON_INTERPRET when
# they are decorated. cpattn_testing.interpreter imports it only when called.
from cpattn_testing.interpreter import apply_interpreter_fixes

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

#: Workers turn on ``cpattn_common.alloc`` output poisoning with this value when it is set
#: (the pytest plugin sets it to ``nan`` for every test).
POISON_ENV = "CPATTN_OUTPUT_POISON"

_BACKENDS = ("gloo", "nccl")
_START_METHODS = ("forkserver", "spawn")
_TERMINATE_GRACE_S = 3.0
_STACK_DUMP_WAIT_S = 1.0
_EXIT_WITHOUT_RESULT_GRACE_S = 1.0
_WATCHDOG_PERIOD_S = 0.5
# The process group's own timeout (NCCL watchdog abort) lies beyond the launcher's deadline, so
# a stuck collective is always reported by the launcher, with the stuck ranks' stacks.
_PG_TIMEOUT_MARGIN_S = 60.0
# The longest run a deadline may allow: one week. The selector wait takes no infinite or
# astronomically long timeout (it raises OverflowError).
_MAX_TIMEOUT_S = 7 * 24 * 3600.0
# Imported once by the fork server so workers start warm. None of them initialises CUDA or
# reads TRITON_INTERPRET at import (kernels are decorated when the project's modules are
# imported, in the worker, after its environment is set); missing ones are skipped.
_PRELOAD = ["torch", "torch.distributed", "numpy", "triton", "pytest", "hypothesis"]
_PR_SET_PDEATHSIG = 1


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
        rank: int | None,
        tracebacks: Mapping[int, str],
        pids: Sequence[int],
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.tracebacks = dict(tracebacks)
        self.pids = list(pids)
        self.timed_out = timed_out

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps the error picklable (pytest-xdist ships failures between processes).
        return (
            _rebuild_distributed_error,
            (str(self), self.rank, self.tracebacks, self.pids, self.timed_out),
        )


def _rebuild_distributed_error(
    message: str, rank: int | None, tracebacks: dict[int, str], pids: list[int], timed_out: bool
) -> DistributedError:
    return DistributedError(
        message, rank=rank, tracebacks=tracebacks, pids=pids, timed_out=timed_out
    )


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
        # The fork server imports torch (never initialises CUDA) so each worker starts warm.
        ctx.set_forkserver_preload(_PRELOAD)
        _FORKSERVER_CTX = ctx
    return _FORKSERVER_CTX


def _worker_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(NO_MULTICAST_ENV)
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        # Every rank runs on this host: the loopback interface avoids hostname resolution.
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if extra:
        env.update(extra)
    return env


def _module_files(fn: Callable[..., Any]) -> dict[str, str]:
    """Source files of fn's module, so a worker can load test modules that are not on sys.path.

    pytest's ``--import-mode=importlib`` imports test files under names that ``import`` cannot
    find again in a fresh process; the worker registers them from their files instead.
    """
    name = getattr(fn, "__module__", None)
    module = sys.modules.get(name) if isinstance(name, str) else None
    path = getattr(module, "__file__", None)
    if isinstance(name, str) and isinstance(path, str) and name != "__main__":
        return {name: path}
    return {}


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _ensure_importable(files: Mapping[str, str]) -> None:
    for name, path in files.items():
        if name in sys.modules or _importable(name):
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        # Unpickling imports the parents of a dotted name first (``tests`` of ``tests.test_x``,
        # pytest's importlib-mode name for a test file), which need not exist as packages:
        # register empty ones, as pytest does in the launching process.
        parts = name.split(".")
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if prefix not in sys.modules and not _importable(prefix):
                package = types.ModuleType(prefix)
                package.__path__ = []
                sys.modules[prefix] = package
        sys.modules[name] = module
        if len(parts) > 1:
            setattr(sys.modules[".".join(parts[:-1])], parts[-1], module)
        spec.loader.exec_module(module)


def _set_parent_death_signal() -> None:
    """Linux: get SIGKILL when the process that forked this one exits."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_watchdog(launcher_pid: int) -> None:
    """Exit this worker as soon as the launching process is gone (covers SIGKILL of pytest)."""
    initial_ppid = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(_WATCHDOG_PERIOD_S)
            if os.getppid() != initial_ppid or not _pid_alive(launcher_pid):
                os._exit(3)

    threading.Thread(target=watch, name="cpattn-launcher-watchdog", daemon=True).start()


def _apply_output_poison() -> None:
    """Turn on ``cpattn_common.alloc`` output poisoning in a worker when the launcher asks."""
    value = os.environ.get(POISON_ENV)
    if not value:
        return
    try:
        from cpattn_common import alloc
    except ImportError:
        return
    setter = getattr(alloc, "set_output_poison", None)
    if setter is not None:
        setter(float(value))


def _to_cpu(obj: Any) -> Any:
    """Move tensors in (nested) lists, tuples and dicts to the CPU before pickling them home."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, list):
        return [_to_cpu(x) for x in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _worker(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    stack_file: str,
    env: dict[str, str],
    module_files: dict[str, str],
    payload: bytes,
    conn: Connection,
    launcher_pid: int,
    pg_timeout_s: float,
) -> None:
    """Entry point of one rank (runs in the worker process)."""
    _set_parent_death_signal()
    _start_watchdog(launcher_pid)
    os.environ.clear()
    os.environ.update(env)
    stacks = open(stack_file, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        _apply_output_poison()
        apply_interpreter_fixes()
        _ensure_importable(module_files)
        fn, args = pickle.loads(payload)
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device_id: torch.device | None = torch.device("cuda", rank)
        else:
            device_id = None
            if "OMP_NUM_THREADS" not in env:
                # N ranks share this machine's cores: avoid oversubscribing them.
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
            device_id=device_id,
        )
        result = fn(rank, world_size, *args)
        if backend == "nccl":
            torch.cuda.synchronize()
        message = pickle.dumps(("ok", pickle.dumps(_to_cpu(result))))
    except BaseException as exc:  # report everything, including SystemExit/KeyboardInterrupt
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        with contextlib.suppress(Exception):
            # With the time it failed: the launcher names the rank that failed first, not a
            # peer whose collective failed because of it (CLOCK_MONOTONIC is system-wide).
            conn.send_bytes(pickle.dumps(("error", text, time.monotonic())))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    conn.send_bytes(message)
    with contextlib.suppress(Exception):
        # Leave only once every rank is done, so no rank closes its connections while a peer
        # still reads from them. The launcher kills ranks still here once it has all results.
        _exit_handshake(init_method, world_size, pg_timeout_s)
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (slow with torch loaded, and it can block on backend threads).
    os._exit(0)


def _exit_handshake(init_method: str, world_size: int, timeout_s: float) -> None:
    """Wait until every rank has sent its result (or ``timeout_s`` passed).

    A counter in a file store of its own, not a barrier of the process group: a collective of
    the group under test would complete a barrier a peer is still waiting in because its own
    rank skipped one (the bug the test should catch), and the run would pass.
    """
    from torch._C._distributed_c10d import FileStore  # torch.distributed re-exports it

    store = FileStore(init_method.removeprefix("file://") + ".exit", world_size)
    store.add("done", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("done", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.002)


def _stop(procs: Sequence[BaseProcess]) -> None:
    """Terminate, then kill, then reap every worker; returns when all of them are gone."""
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
    for p in procs:
        p.join(_TERMINATE_GRACE_S)


def _dump_stacks(
    procs: Sequence[BaseProcess], ranks: Sequence[int], stack_files: Sequence[str]
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
            with open(stack_files[r]) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        dumps[r] = text or "(no stack dump: the process did not answer SIGUSR1)"
    return dumps


def _format_failure(rank: int, text: str, others: Mapping[int, str]) -> str:
    lines = [f"rank {rank} failed:", text.rstrip()]
    for r, t in sorted(others.items()):
        if r != rank:
            last = t.strip().splitlines()[-1] if t.strip() else "?"
            lines.append(f"(rank {r} also failed afterwards: {last})")
    return "\n".join(lines)


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

    Each rank is a separate process in which ``torch.distributed`` is initialised
    (``torch.distributed.group.WORLD`` is the group; pass it to ``as_cp_group``). With
    ``backend="nccl"`` rank r uses ``cuda:r`` (set before the process group is created).

    Args:
        fn: a module-level function (it is pickled by reference). Its return value is pickled
            back; tensors in (nested) lists/tuples/dicts are moved to the CPU first.
        world_size: number of ranks, >= 1.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        args: extra positional arguments for ``fn`` (picklable).
        timeout: seconds for the whole run, start-up included (at most a week). At the
            deadline every rank that is still running dumps its stacks and is killed.
        env: extra environment variables for the workers (they win over the launching
            process's environment and over :data:`NO_MULTICAST_ENV`).
        start_method: ``"forkserver"`` (default; workers forked from a warm server that imported
            torch) or ``"spawn"`` (a fresh interpreter per rank). ``nccl`` runs always spawn:
            each rank then initialises CUDA in a fresh process, whatever state the long-lived
            fork server picked up from earlier tests (seen on an H200: a server started after
            tests that faked the GPU environment left its workers with no visible GPU).

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        ValueError: bad ``world_size``, ``backend``, ``timeout`` or ``start_method``.
        TypeError: ``world_size`` is not an int; ``fn`` (a lambda, a local function) or
            ``args`` cannot be pickled.
        NotEnoughDevicesError: nccl with more ranks than visible GPUs (a ``unittest.SkipTest``,
            so pytest reports a skip).
        DistributedError: a rank raised or died, or the deadline passed. Every worker has
            exited when it is raised.

    Example:
        >>> def fn(rank, world_size):  # in a module, not a lambda
        ...     t = torch.tensor([rank])
        ...     torch.distributed.all_reduce(t)
        ...     return int(t)
        >>> run_distributed(fn, 4)  # doctest: +SKIP
        [6, 6, 6, 6]
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

    try:
        payload = pickle.dumps((fn, tuple(args)))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"run_distributed needs a module-level function and picklable args; could not "
            f"pickle {getattr(fn, '__qualname__', fn)!r}: {exc}"
        ) from exc
    module_files = _module_files(fn)
    worker_env = _worker_env(env)
    ctx = _context(start_method)
    tmpdir = tempfile.mkdtemp(prefix="cpattn-dist-")
    init_method = "file://" + os.path.join(tmpdir, "rendezvous")
    stack_files = [os.path.join(tmpdir, f"rank{r}.stacks") for r in range(world_size)]
    deadline = time.monotonic() + timeout
    procs: list[BaseProcess] = []
    readers: list[Connection] = []
    try:
        with _ENV_LOCK:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker,
                    name=f"cpattn-rank{rank}",
                    args=(
                        rank,
                        world_size,
                        backend,
                        init_method,
                        stack_files[rank],
                        worker_env,
                        module_files,
                        payload,
                        writer,
                        os.getpid(),
                        timeout + _PG_TIMEOUT_MARGIN_S,
                    ),
                    daemon=True,
                )
                readers.append(reader)
                try:
                    proc.start()
                finally:
                    writer.close()
                procs.append(proc)
        return _collect(procs, readers, stack_files, deadline, timeout)
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _collect(
    procs: Sequence[BaseProcess],
    readers: Sequence[Connection],
    stack_files: Sequence[str],
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
        how = (
            "an exit status not known yet"
            if code is None
            else f"signal {-code}"
            if code < 0
            else f"exit code {code}"
        )
        failures[rank] = (
            f"rank {rank} (pid {pids[rank]}) exited with {how} without reporting a result"
        )
        # Noticed after the fact (the pipe's end, or the process sentinel, which the fork server
        # signals only once it reaped the rank): its peers' errors caused by the death often
        # carry earlier times. A death counts as that much earlier, so the dead rank is named.
        failed_at[rank] = noticed - _EXIT_WITHOUT_RESULT_GRACE_S

    def read(rank: int) -> None:
        try:
            raw = open_readers[rank].recv_bytes()
        except (EOFError, OSError):
            # The pipe ends without a message only when the rank's process is gone (a rank
            # sends its result or its error first): a death, known here before its sentinel.
            del open_readers[rank]
            if rank not in results and rank not in failures:
                died(rank, time.monotonic())
            return
        del open_readers[rank]
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

    def fail() -> DistributedError:
        # Collect what the other ranks have already said, without waiting for them, then
        # name the rank that failed first: when one rank raises, its peers' collectives fail
        # a moment later, and their messages may arrive in the same wait.
        for r in list(open_readers):
            if open_readers[r].poll(0):
                read(r)
        rank = min(failures, key=lambda r: (failed_at.get(r, math.inf), r))
        message = _format_failure(rank, failures[rank], failures)
        return DistributedError(message, rank=rank, tracebacks=failures, pids=pids)

    while len(results) < world_size:
        if failures:
            raise fail()
        now = time.monotonic()
        if now >= deadline:
            stuck = [r for r in range(world_size) if r not in results]
            dumps = _dump_stacks(procs, stuck, stack_files)
            lines = [
                f"timed out after {timeout:g} s: rank(s) {stuck} of {world_size} did not finish "
                f"(finished: {sorted(results)})"
            ]
            for r in stuck:
                lines.append(f"--- rank {r} (pid {pids[r]}) stacks at the deadline ---")
                lines.append(dumps[r])
            raise DistributedError(
                "\n".join(lines),
                rank=stuck[0] if len(stuck) == 1 else None,
                tracebacks=dumps,
                pids=pids,
                timed_out=True,
            )
        waitables: list[Any] = list(open_readers.values())
        waitables += [procs[r].sentinel for r in range(world_size) if r not in exited_at]
        waitables_timeout = deadline - now
        if exited_at:
            waitables_timeout = min(waitables_timeout, _EXIT_WITHOUT_RESULT_GRACE_S / 4)
        ready = multiprocessing.connection.wait(waitables, timeout=waitables_timeout)
        for r, conn in list(open_readers.items()):
            if conn in ready:
                read(r)
        for r in range(world_size):
            if r not in exited_at and procs[r].sentinel in ready:
                exited_at[r] = time.monotonic()
        # A rank that exited without a message (killed, os._exit, crash) is a failure, once
        # anything it wrote just before exiting has had time to arrive.
        for r, t in exited_at.items():
            if r in results or r in failures:
                continue
            if r in open_readers and open_readers[r].poll(0):
                read(r)
                continue
            if r not in open_readers or time.monotonic() - t >= _EXIT_WITHOUT_RESULT_GRACE_S:
                died(r, t)
    return [results[r] for r in range(world_size)]
