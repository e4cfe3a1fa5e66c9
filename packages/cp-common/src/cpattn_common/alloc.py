"""Output allocation: the one helper every launcher uses, with an optional poison fill.

Tests turn poisoning on (``poison_outputs()`` / ``set_output_poison(nan)``) so that an output
element a kernel forgets to write shows up as NaN; off by default (``torch.empty``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from cpattn_common.checks import check_device, check_dtype

__all__ = [
    "empty_output",
    "get_output_poison",
    "new_output",
    "poison_outputs",
    "set_output_poison",
]

_lock = threading.Lock()
_poison: float | None = None


def set_output_poison(value: float | None) -> None:
    """Set the fill value of every later ``empty_output`` (``None`` turns poisoning off). While
    ``poison_outputs`` contexts are open (of any thread: one process-wide stack) it lasts until
    the newest open one exits, as if that context had been entered with it."""
    global _base
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError(f"value must be a real number or None, got {value!r}")
    with _lock:
        v = None if value is None else float(value)
        if _open:
            _open[-1][1] = v
        else:
            _base = v
        _publish()


def get_output_poison() -> float | None:
    """The current poison value, or ``None`` when poisoning is off."""
    return _poison


# Open poison_outputs contexts [token, value, thread ident] in entry order; _poison is the
# newest one's value, else _base.
_base: float | None = None
_open: list[list[Any]] = []


def _publish() -> None:
    global _poison
    _poison = _open[-1][1] if _open else _base


@contextlib.contextmanager
def poison_outputs(value: float = float("nan")) -> Iterator[None]:
    """Context manager: fill outputs allocated inside it with ``value`` (NaN by default)."""
    token = object()
    with _lock:
        _open.append([token, float(value), threading.get_ident()])
        _publish()
    try:
        yield
    finally:
        with _lock:
            _open[:] = [entry for entry in _open if entry[0] is not token]
            _publish()


def _after_fork_in_child() -> None:
    # A fresh lock (another thread may have held it at the fork), and only the forking thread's
    # contexts: the others' would never exit in the child.
    global _lock
    _lock = threading.Lock()
    me = threading.get_ident()
    _open[:] = [entry for entry in _open if entry[2] == me]
    _publish()


os.register_at_fork(after_in_child=_after_fork_in_child)


def empty_output(
    shape: Sequence[int] | torch.Size,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A contiguous output tensor, uninitialised or filled with the poison value when on
    (integer outputs with the dtype's maximum, bool outputs with True)."""
    if not isinstance(dtype, torch.dtype):  # torch.empty would take None as its default
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    try:
        out = torch.empty(shape, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError):
        _check_allocation(shape, dtype, device)  # names the bad argument
        raise  # the arguments are right: out of memory, say
    return _poisoned(out)


def new_output(
    like: torch.Tensor, shape: Sequence[int] | torch.Size, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``empty_output`` on ``like``'s device (in ``like``'s dtype unless ``dtype`` is given),
    through ``like.new_empty``: the cheapest eager allocation."""
    try:
        out = like.new_empty(shape) if dtype is None else like.new_empty(shape, dtype=dtype)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        if not isinstance(like, torch.Tensor):
            raise TypeError(f"like must be a torch.Tensor, got {type(like).__name__}") from None
        _check_allocation(shape, like.dtype if dtype is None else dtype, None)
        raise
    return _poisoned(out)


def _check_allocation(shape: object, dtype: object, device: object) -> None:
    """``TypeError`` / ``ValueError`` naming the argument of an allocation torch refused."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)  # torch's one-dimension form
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, torch.Size)):
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) for n in shape):
        raise TypeError(f"shape must hold ints, got {tuple(shape)!r}")
    if any(n < 0 for n in shape):
        raise ValueError(f"shape {tuple(shape)} has a negative size")
    check_dtype("dtype", dtype)
    if device is not None:
        check_device("device", device)


def _poisoned(out: torch.Tensor) -> torch.Tensor:
    """``out`` filled with the poison value when poisoning is on (else untouched)."""
    value = _poison
    if value is None:  # the common case: one module-global read, no other work
        return out
    dtype = out.dtype
    if out.numel() > 0:
        if dtype.is_floating_point or dtype.is_complex:
            out.fill_(value)
        elif dtype == torch.bool:
            out.fill_(True)
        else:
            out.fill_(torch.iinfo(dtype).max)
    return out
