"""Argument checks shared by every package, so that the same mistake gets the same error.

Sizes (world sizes, group sizes, token budgets) are Python ints: a ``bool`` is refused (it is
an ``int`` to ``isinstance``, but ``True`` as a world size is a bug), as is a float that happens
to be whole. See ``docs/conventions.md``.

Index and length tensors (``seq_lens``, ``query_start_loc``, ``slot_mapping``, ...) hold one of
the whole-byte integer dtypes of ``INDEX_DTYPES``; ``is_index_dtype`` is the one test of that.

An op that writes a tensor refuses one that overlaps its inputs (``check_no_overlap``;
``overlaps`` is the per-call form). Check mode (``CPATTN_CHECKS=1`` at import, ``check_mode()``,
``set_check_mode``; process-wide) adds what costs a host sync or a collective: the ops read
device-side values (``seq_lens >= 0``, ``query_start_loc`` non-decreasing within the batch) and
the collective ones compare their call across ranks first (``agreement.check_ranks_agree``).
Outside it the ops pay one attribute read (``check_state.enabled``).
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

    For flags such as ``is_lse_base_on_e``, where ``bool(None)`` or ``bool("False")`` would
    quietly select the other behaviour.

    Raises:
        TypeError: ``value`` is anything else (``None``, an int, a float, a string, a tensor).
    """
    # isinstance, not a class identity test: torch 2.11's dynamo evaluates
    # True.__class__ is bool to False while it traces (bool has no subclasses, so the two agree).
    if isinstance(value, bool):
        return value
    cls = type(value)
    if cls.__module__ == "numpy" and cls.__name__ in ("bool", "bool_"):  # numpy 2 / numpy 1
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def is_bool_scalar(value: object) -> bool:
    """Whether ``value`` is a bool in a wrapping that ``operator.index`` may take as 0 / 1: a
    Python ``bool``, a bool tensor, or a numpy bool (older numpy, 2.2 among them, indexes it
    with a deprecation warning). A size or a dim that is one of these is a bug, not 0 or 1."""
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
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_nonnegative_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 0 (a count that may be zero, e.g. a capacity).

    Raises:
        TypeError: ``value`` is not an int (or is a bool).
        ValueError: ``value`` < 0.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
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
    host's free pages for the CPU): for work sized by the caller's numbers (a plan for a huge
    ``pcp_size``) that would otherwise die out of memory. Nothing is queried below 256 MiB."""
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


#: The dtypes an index or length tensor may have: torch's whole-byte integers, int8/16/32/64 and
#: uint8/16/32/64, whose elements read as plain integers (``tolist``, ``.to(torch.int64)``,
#: kernel loads). Torch's own arithmetic is another matter: torch 2.13 implements no
#: subtraction, ``searchsorted`` or ``max`` for uint16/32/64 on the CPU, so callers widen to
#: int64 before they compute with such a tensor.
#: An explicit list rather than "not floating, complex or bool", because torch has other dtypes
#: that are neither floating nor complex and are still no index dtype:
#:
#: * ``bool``: ``True`` / ``False`` as lengths or offsets are a bug, not 1 / 0;
#: * quantized dtypes (``qint8``, ``quint8``, ``qint32``, ``quint4x2``, ``quint2x4``): an element
#:   means ``scale * (q - zero_point)``, not ``q``, and most ops (``tolist``, subtraction)
#:   refuse them with an unrelated error;
#: * sub-byte and raw-bits dtypes (``int1``-``int7``, ``uint1``-``uint7``, ``bits8``,
#:   ``bits16``, ``bits1x8``, ...): storage-only dtypes whose elements torch cannot read
#:   (``tolist``) or compute with (subtraction, ``searchsorted``).
#:
#: A dtype added by a later torch is refused until it is listed here.
INDEX_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    }
)


def is_index_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of ``INDEX_DTYPES`` (int8/16/32/64, uint8/16/32/64).

    The one definition of "integer index dtype" shared by the packages: ``bool``, floating,
    complex, quantized and sub-byte / raw-bits dtypes are refused (see ``INDEX_DTYPES`` for
    why). Callers raise their own ``TypeError`` naming the argument.
    """
    return dtype in INDEX_DTYPES


def check_tensors(op: str, /, **tensors: object) -> None:
    """Raise ``TypeError`` for an argument that is not a ``torch.Tensor``.

    For functions whose next checks read tensor attributes (``.dim()``, ``.dtype``): without
    it a list or ``None`` fails there with an ``AttributeError``, or passes through a
    shortcut (a world size of 1) unchecked.

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
    """Raise ``ValueError`` for a tensor with torch's negative bit set.

    Such a tensor (``z.conj().imag`` of a complex ``z``, ``torch._neg_view``) stores its values
    un-negated and negates them lazily; a kernel that reads or writes its memory would see the
    wrong sign. torch's own ops resolve the bit, a direct launch does not. For the slow path of
    an op's checks: ``tensor.is_neg()`` costs 0.1-0.2 µs of host time.

    Args:
        op: the public function's name, for the message.
        **tensors: the arguments to test, keyed by name; ``None`` and non-tensors are skipped.

    Raises:
        ValueError: a tensor has the negative bit; the message names ``op`` and the argument.
    """
    # dynamo cannot trace is_neg() (a graph break), so traced calls skip the test; they reach
    # the kernels through the registered ops. is_compiling() is a constant while tracing.
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
    """Whether the address range of ``out`` intersects that of one of ``inputs`` (ranges:
    interleaved views of one buffer overlap; a tensor without memory overlaps nothing). The
    ops' per-call form: two data pointers and a contiguity test per input."""
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
