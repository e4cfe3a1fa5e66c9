"""The entry point of one rank of :func:`cpattn_testing.launcher.run_distributed`: imported
before the launcher's environment is applied, so it imports ``cpattn_common`` only when called.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from cpattn_testing.interpreter import apply_interpreter_fixes

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = ["POISON_ENV", "worker"]

#: Workers turn on ``cpattn_common.alloc`` output poisoning with this value when it is set.
POISON_ENV = "CPATTN_OUTPUT_POISON"

_WATCHDOG_PERIOD_S = 0.5
_PR_SET_PDEATHSIG = 1


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
        # Unpickling imports the parents of a dotted name first: register empty ones.
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_watchdogs(launcher_pid: int) -> None:
    """Exit this worker as soon as the process that forked it, or the launcher, is gone."""
    with contextlib.suppress(Exception):  # Linux: SIGKILL when the parent exits
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    initial_ppid = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(_WATCHDOG_PERIOD_S)
            if os.getppid() != initial_ppid or not _pid_alive(launcher_pid):
                if os.getpgid(0) == os.getpid():  # the rank's own group: its children too
                    os.killpg(0, signal.SIGKILL)
                os._exit(3)

    threading.Thread(target=watch, name="cpattn-launcher-watchdog", daemon=True).start()


def _apply_output_poison() -> None:
    value = os.environ.get(POISON_ENV)
    if value:
        from cpattn_common.alloc import set_output_poison

        set_output_poison(float(value))


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


def worker(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    files_prefix: str,
    env: dict[str, str],
    module_files: dict[str, str],
    payload: bytes,
    conn: Connection,
    launcher_pid: int,
    pg_timeout_s: float,
) -> None:
    """Entry point of one rank (runs in the worker process)."""
    with contextlib.suppress(OSError):
        os.setsid()  # a process group of its own: the launcher ends it, children included
    for fd, kind in ((1, "out"), (2, "err")):
        target = os.open(f"{files_prefix}.{kind}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    with contextlib.suppress(Exception):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    _start_watchdogs(launcher_pid)
    os.environ.clear()
    os.environ.update(env)
    stacks = open(f"{files_prefix}.stacks", "w")  # noqa: SIM115 - must stay open for faulthandler
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
            if "OMP_NUM_THREADS" not in env:  # N ranks share the cores
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
        with contextlib.suppress(Exception):  # with the time: the first failure is named
            conn.send_bytes(pickle.dumps(("error", text, time.monotonic())))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    conn.send_bytes(message)
    with contextlib.suppress(Exception):  # no rank closes connections a peer still reads
        _exit_handshake(init_method, world_size, pg_timeout_s)
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (slow, and it can block on backend threads)


def _exit_handshake(init_method: str, world_size: int, timeout_s: float) -> None:
    """Wait until every rank has sent its result (or ``timeout_s`` passed): a counter in a
    file store of its own, since a barrier of the group under test could hide a skipped one."""
    from torch._C._distributed_c10d import FileStore  # torch.distributed re-exports it

    store = FileStore(init_method.removeprefix("file://") + ".exit", world_size)
    store.add("done", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("done", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.002)
