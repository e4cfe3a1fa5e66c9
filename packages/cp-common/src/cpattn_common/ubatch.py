"""Micro-batch (ubatch) id: which workspace slot the current micro-batch uses, so overlapped
micro-batches never share a direct collective's slot or signal epoch. Per thread and asyncio
task (a ``contextvars.ContextVar``); 0 by default.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["current_ubatch_id", "set_ubatch_id", "ubatch_context"]

_UBATCH_ID: contextvars.ContextVar[int] = contextvars.ContextVar("cpattn_ubatch_id", default=0)


def current_ubatch_id() -> int:
    """The id of the running micro-batch (0 when no ``ubatch_context`` is active)."""
    return _UBATCH_ID.get()


def _check(ubatch_id: int) -> int:
    if isinstance(ubatch_id, bool) or not isinstance(ubatch_id, int):
        raise TypeError(f"ubatch_id must be an int, got {type(ubatch_id).__name__}")
    if ubatch_id < 0:
        raise ValueError(f"ubatch_id must be >= 0, got {ubatch_id}")
    return ubatch_id


def set_ubatch_id(ubatch_id: int) -> contextvars.Token[int]:
    """Set the micro-batch id; returns a token for ``contextvars`` reset (prefer the context manager)."""
    return _UBATCH_ID.set(_check(ubatch_id))


@contextlib.contextmanager
def ubatch_context(ubatch_id: int) -> Iterator[int]:
    """Run the body with ``current_ubatch_id() == ubatch_id``; restores the previous id on exit.

    Example:
        >>> with ubatch_context(1):
        ...     current_ubatch_id()
        1
    """
    token = _UBATCH_ID.set(_check(ubatch_id))
    try:
        yield ubatch_id
    finally:
        _UBATCH_ID.reset(token)
