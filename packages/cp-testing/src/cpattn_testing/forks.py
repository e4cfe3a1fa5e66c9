"""Fork-safety tests: ``fork_while_held`` forks while another thread holds a lock and reports
what the child could do (a module's lock must be renewed in the child, ``os.register_at_fork``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any

__all__ = ["fork_while_held"]


def fork_while_held(
    locks: Sequence[AbstractContextManager[Any]],
    in_child: Callable[[], bool],
    *,
    timeout_s: float = 20.0,
) -> int | None:
    """Fork while another thread holds every one of ``locks``; run ``in_child()`` in the child.

    Returns the child's exit code (0: ``in_child()`` returned ``True``; 1: ``False`` or it
    raised), or ``None`` when the child did not finish within ``timeout_s`` and was killed (it
    blocked, typically on a lock held at the fork). ``RuntimeError`` when the other thread did
    not take every lock within ``timeout_s`` (nothing was forked).
    """
    held, release = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def hold() -> None:
        try:
            with ExitStack() as stack:
                for lock in locks:
                    stack.enter_context(lock)
                held.set()
                release.wait(timeout_s)
        except BaseException as exc:  # reported by the parent
            failure.append(exc)

    holder = threading.Thread(target=hold)
    holder.start()
    deadline = time.monotonic() + timeout_s
    while not held.wait(0.01) and holder.is_alive() and time.monotonic() < deadline:
        pass
    if not held.is_set():
        # A fork now would test nothing: the child would find the locks free.
        release.set()
        holder.join(timeout_s)
        cause = failure[0] if failure else None
        raise RuntimeError(
            f"the holder thread did not take the locks within {timeout_s} s"
        ) from cause
    try:
        with warnings.catch_warnings():  # forking a multi-threaded process: the point here
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child leaves through os._exit only
            try:
                ok = in_child()
            except BaseException:
                ok = False
            os._exit(0 if ok else 1)
        deadline = time.monotonic() + timeout_s
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            time.sleep(0.01)
    finally:
        release.set()
        holder.join(timeout_s)
