"""``fork_while_held``: the child sees the lock held at the fork, and each outcome is reported."""

from __future__ import annotations

import os
import threading

import pytest

from cpattn_testing.forks import fork_while_held

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def test_a_lock_held_at_the_fork_stays_held_in_the_child() -> None:
    lock = threading.Lock()
    assert fork_while_held([lock], lambda: not lock.acquire(timeout=0.2)) == 0
    assert lock.acquire(timeout=1)  # the parent's lock was released after the fork
    lock.release()


def test_false_or_raising_child_exits_1() -> None:
    assert fork_while_held([threading.Lock()], lambda: False) == 1

    def boom() -> bool:
        raise RuntimeError("in the child")

    assert fork_while_held([threading.Lock()], boom) == 1


def test_a_blocked_child_is_killed_and_reported() -> None:
    lock = threading.Lock()

    def wait_forever() -> bool:
        with lock:
            return True

    assert fork_while_held([lock], wait_forever, timeout_s=1.0) is None


def test_locks_the_holder_cannot_take_raise_instead_of_forking() -> None:
    """A fork without the locks held would test nothing: the child would find them free."""
    import contextlib
    from collections.abc import Iterator

    @contextlib.contextmanager
    def broken() -> Iterator[None]:
        raise OSError("cannot take it")
        yield

    lock = threading.Lock()
    with pytest.raises(RuntimeError, match="did not take the locks") as info:
        fork_while_held([broken(), lock], lambda: lock.acquire(timeout=0.2), timeout_s=1.0)
    assert isinstance(info.value.__cause__, OSError)
    taken = threading.Lock()
    taken.acquire()
    try:
        with pytest.raises(RuntimeError, match=r"within 0\.2 s"):
            fork_while_held([taken], lambda: True, timeout_s=0.2)
    finally:
        taken.release()
