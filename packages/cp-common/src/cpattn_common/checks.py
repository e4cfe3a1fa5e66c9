"""Argument checks shared by every package, so that the same mistake gets the same error.
Sizes are Python ints (a ``bool`` or a whole float is refused); index tensors hold one of
``INDEX_DTYPES``. Check mode (``CPATTN_CHECKS=1``, ``set_check_mode``; process-wide) adds the
checks that cost a host sync or a collective; outside it the ops read ``check_state.enabled``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from cpattn_common.dispatch import must_dispatch

__all__ = [
    "INDEX_DTYPES",
    "check_bool",
    "check_device",
    "check_dtype",
    "check_fits_in_memory",
    "check_mode",
    "check_mode_from_env",
    "check_no_neg_bit",
    "check_no_overlap",
    "check_nonnegative_int",
    "check_positive_int",
    "check_state",
    "check_tensors",
    "checks_enabled",
    "host_checkable",
    "is_bool_scalar",
    "is_index_dtype",
    "overlaps",
    "set_check_mode",
]


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` as a Python ``bool`` if it is a ``bool`` or a numpy bool scalar.

    Raises:
        TypeError: ``value`` is anything else (``None``, an int, a float, a string, a tensor).
    """
    if isinstance(value, bool):
        return value
    cls = type(value)
    if cls.__module__ == "numpy" and cls.__name__ in ("bool", "bool_"):  # numpy 2 / numpy 1
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def is_bool_scalar(value: object) -> bool:
    """Whether ``value`` is a Python ``bool``, a bool tensor or a numpy bool (which
    ``operator.index`` may take as 0 / 1)."""
    if isinstance(value, bool):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is torch.bool or getattr(dtype, "kind", None) == "b"


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1.

    Raises:
        TypeError: ``value`` is not an int (or is a bool).
        ValueError: ``value`` < 1.
    """
    return _check_int(name, value, 1, "a positive int")


def check_nonnegative_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 0 (a count that may be zero, e.g. a capacity).

    Raises:
        TypeError: ``value`` is not an int (or is a bool).
        ValueError: ``value`` < 0.
    """
    return _check_int(name, value, 0, ">= 0")


def _check_int(name: str, value: object, minimum: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def check_device(name: str, value: object, *, available: bool = True) -> torch.device:
    """Return ``value`` (a ``torch.device`` or a string torch parses) as a ``torch.device``.

    Raises:
        TypeError: ``value`` is ``None`` or neither a string nor a ``torch.device``.
        ValueError: a string torch cannot parse; with ``available``, a CUDA device this
            process lacks (a CPU-only torch, no visible GPU, an index past the count).
    """
    if isinstance(value, str):
        try:
            value = torch.device(value)
        except RuntimeError as exc:
            raise ValueError(f"{name}: torch cannot parse device {value!r} ({exc})") from None
    if not isinstance(value, torch.device):
        raise TypeError(f"{name} must be a torch.device or a device string, got {value!r}")
    if available and value.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count <= (value.index or 0):
            why = "torch is built without CUDA" if torch.version.cuda is None else f"{count} GPUs"
            raise ValueError(f"{name} is {str(value)!r}, but this process cannot use it ({why})")
    return value


def check_fits_in_memory(op: str, what: str, nbytes: int, device: torch.device) -> None:
    """Raise ``ValueError`` when ``nbytes`` exceed the free memory of ``device`` (CUDA, or the
    host's free pages for the CPU). Nothing is queried below 256 MiB."""
    if nbytes < 1 << 28 or device.type not in ("cpu", "cuda"):
        return
    if device.type == "cuda":
        free = int(torch.cuda.mem_get_info(device)[0])
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if nbytes > free:
        raise ValueError(
            f"{op}: {what} would need about {nbytes / 2**30:.1f} GiB on {device}, but only "
            f"{free / 2**30:.1f} GiB are free"
        )


def check_dtype(name: str, value: object) -> torch.dtype:
    """Return ``value`` if it is a ``torch.dtype`` (a string such as ``"bf16"`` is not).

    Raises:
        TypeError: ``value`` is not a ``torch.dtype``.
    """
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {value!r}")
    return value


#: The dtypes an index or length tensor may have: int8/16/32/64 and uint8/16/32/64, whose
#: elements read as plain integers (bool, quantized and sub-byte dtypes do not). torch has no
#: CPU subtraction or ``searchsorted`` for uint16/32/64: callers widen to int64 first.
INDEX_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, f"{sign}int{bits}") for sign in ("", "u") for bits in (8, 16, 32, 64)
)


def is_index_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of ``INDEX_DTYPES`` (int8/16/32/64, uint8/16/32/64)."""
    return dtype in INDEX_DTYPES


def check_tensors(op: str, /, **tensors: object) -> None:
    """Raise ``TypeError`` for an argument that is not a ``torch.Tensor``.

    Args:
        op: the public function's name, for the message.
        **tensors: the arguments to test, keyed by name (optional ones the caller filters).

    Raises:
        TypeError: ``"<op>: <name> must be a torch.Tensor, got <type>"`` for the first
            argument that is not a tensor.
    """
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")


def check_no_neg_bit(op: str, /, **tensors: object) -> None:
    """Raise ``ValueError`` for a tensor with torch's negative bit set (a lazily negated view
    whose memory a kernel would read with the wrong sign). Skipped while tracing.

    Args:
        op: the public function's name, for the message.
        **tensors: the arguments to test, keyed by name; ``None`` and non-tensors are skipped.

    Raises:
        ValueError: a tensor has the negative bit; the message names ``op`` and the argument.
    """
    if torch.compiler.is_compiling():
        return
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_neg():
            raise ValueError(
                f"{op}: {name} has torch's negative bit set (a lazily negated view, e.g. "
                f"z.conj().imag): its memory holds the un-negated values, which the kernel "
                f"would read; pass {name}.resolve_neg()"
            )


def check_mode_from_env(default: bool = False) -> bool:
    """What ``CPATTN_CHECKS`` asks for (``default`` when it is unset): ``0``, ``false``,
    ``no``, ``off`` and the empty string are off, anything else on."""
    value = os.environ.get("CPATTN_CHECKS")
    if value is None:
        return default
    return value.strip().lower() not in ("", "0", "false", "no", "off")


class _CheckState:
    __slots__ = ("enabled",)

    def __init__(self) -> None:
        self.enabled = check_mode_from_env()


#: The check-mode switch; the ops read ``check_state.enabled`` (see the module docstring).
check_state = _CheckState()


def checks_enabled() -> bool:
    """Whether check mode is on."""
    return check_state.enabled


def set_check_mode(enabled: bool) -> bool:
    """Turn check mode on or off for the whole process (every rank of a group alike: the
    collective ops then compare their calls); return the previous setting."""
    previous = check_state.enabled
    check_state.enabled = check_bool("enabled", enabled)
    return previous


@contextlib.contextmanager
def check_mode(enabled: bool = True) -> Iterator[None]:
    """Check mode on (or off) inside the block, the previous setting after it."""
    previous = set_check_mode(enabled)
    try:
        yield
    finally:
        check_state.enabled = previous


def host_checkable() -> bool:
    """Whether a check may read device values on the host: not while tracing, under a
    dispatch mode or a functorch transform, nor during CUDA-graph capture."""
    if must_dispatch():  # first: under torch.compile the capture query is not traceable
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to one past its last element (0 when empty)."""
    if t.is_contiguous():
        return t.nbytes
    extent = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):  # never negative strides
        if size == 0:
            return 0
        extent += (size - 1) * stride
    return extent * t.element_size()


def overlaps(out: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """Whether the address range of ``out`` intersects that of one of ``inputs`` (a tensor
    without memory overlaps nothing)."""
    o0 = out.data_ptr()
    for t in inputs:
        t0 = t.data_ptr()
        if t0 >= o0:
            if o0 and t0 < o0 + (out.nbytes if out.is_contiguous() else _span(out)) and _span(t):
                return True
        elif t0 and o0 < t0 + (t.nbytes if t.is_contiguous() else _span(t)) and _span(out):
            return True
    return False


def check_no_overlap(op: str, written: str, /, **tensors: object) -> None:
    """Raise ``ValueError`` when ``tensors[written]``, which ``op`` writes, overlaps one of the
    other ``tensors`` (keyed by argument name; non-tensors skipped) in memory. Skipped while
    tracing or under a dispatch mode (fake tensors have no memory)."""
    out = tensors[written]
    if not isinstance(out, torch.Tensor) or must_dispatch():
        return
    for name, t in tensors.items():
        if name != written and isinstance(t, torch.Tensor) and overlaps(out, t):
            raise ValueError(
                f"{op}: {written} (shape {tuple(out.shape)}) overlaps {name} (shape "
                f"{tuple(t.shape)}) in memory, and {op} writes {written} while it reads "
                f"{name}; pass separate tensors (e.g. {name}.clone())"
            )
