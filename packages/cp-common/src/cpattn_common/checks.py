"""Argument checks shared by every package, so that the same mistake gets the same error.

Sizes (world sizes, group sizes, token budgets) are Python ints: a ``bool`` is refused (it is
an ``int`` to ``isinstance``, but ``True`` as a world size is a bug), as is a float that happens
to be whole. See ``docs/conventions.md``.

Index and length tensors (``seq_lens``, ``query_start_loc``, ``slot_mapping``, ...) hold one of
the whole-byte integer dtypes of ``INDEX_DTYPES``; ``is_index_dtype`` is the one test of that.
"""

from __future__ import annotations

import torch

__all__ = [
    "INDEX_DTYPES",
    "check_bool",
    "check_dtype",
    "check_no_neg_bit",
    "check_nonnegative_int",
    "check_positive_int",
    "check_tensors",
    "is_bool_scalar",
    "is_index_dtype",
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
