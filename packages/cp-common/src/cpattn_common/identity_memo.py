"""A memo keyed by object identity (``id()`` plus a weak reference) that never keeps its keys
alive: per-group state looked up on every op call."""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

__all__ = ["IdentityMemo"]

_V = TypeVar("_V")
_D = TypeVar("_D")


class IdentityMemo(Generic[_V]):
    """Values memoised by the identity of a key object, without keeping the key alive (a
    value must not refer to its key). Lookups take no lock; writes take a re-entrant one.

    Args:
        hold_unreferable: what ``setdefault`` does with a key that takes no weak reference:
            hold it (and its value) for good (``True``), or store nothing and return the value
            (``False``: for a memo that only saves work).
    """

    def __init__(self, *, hold_unreferable: bool = True) -> None:
        self._hold_unreferable = hold_unreferable
        self._entries: dict[int, tuple[Callable[[], Any], _V]] = {}
        self._lock = threading.RLock()
        _MEMOS.add(self)

    @property
    def entries(self) -> Mapping[int, tuple[Callable[[], Any], _V]]:
        """The live table ``id(key) -> (reference to key, value)``, for a lookup without a call."""
        return self._entries

    def get(self, key: object, default: _D) -> _V | _D:
        """The value stored for ``key`` (this very object), else ``default``."""
        entry = self._entries.get(id(key))
        if entry is not None and entry[0]() is key:
            return entry[1]
        return default

    def setdefault(self, key: object, value: _V) -> _V:
        """Store ``value`` for ``key`` unless an entry for it exists; return the entry's value."""
        ident = id(key)
        with self._lock:
            entry = self._entries.get(ident)
            if entry is not None and entry[0]() is key:
                return entry[1]
            ref: Callable[[], Any]
            try:
                ref = weakref.ref(key, functools.partial(self._drop, ident))
            except TypeError:  # takes no weak reference: held, so its id() is not reused
                if not self._hold_unreferable:
                    return value
                ref = functools.partial(_identity, key)
            self._entries[ident] = (ref, value)
            return value

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, ident: int, ref: object) -> None:
        # The key died: drop its entry unless a new key of the same id() replaced it already.
        with self._lock:
            entry = self._entries.get(ident)
            if entry is not None and entry[0] is ref:
                del self._entries[ident]


def _identity(obj: object) -> object:
    return obj


# Every memo, for the fork handler: a child gets fresh locks.
_MEMOS: weakref.WeakSet[IdentityMemo[Any]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for memo in list(_MEMOS):
        memo._lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)
