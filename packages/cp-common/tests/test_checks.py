"""``check_positive_int`` / ``check_nonnegative_int``, ``check_dtype``, ``check_bool`` and
``is_index_dtype``: the size, dtype, flag and index-dtype checks of every package."""

from __future__ import annotations

import re

import pytest
import torch

from cpattn_common import checks
from cpattn_common.checks import (
    INDEX_DTYPES,
    check_bool,
    check_dtype,
    check_nonnegative_int,
    check_positive_int,
    check_tensors,
    is_bool_scalar,
    is_index_dtype,
)


def test_accepts_positive_ints() -> None:
    assert check_positive_int("world_size", 1) == 1
    assert check_positive_int("world_size", 2**40) == 2**40


@pytest.mark.parametrize("value", [True, False, 2.0, "2", None, 1 + 0j])
def test_rejects_non_ints_with_type_error(value: object) -> None:
    with pytest.raises(TypeError, match=re.escape(f"world_size must be an int, got {value!r}")):
        check_positive_int("world_size", value)


@pytest.mark.parametrize("value", [0, -1])
def test_rejects_non_positive_ints_with_value_error(value: int) -> None:
    with pytest.raises(ValueError, match=f"world_size must be a positive int, got {value}"):
        check_positive_int("world_size", value)


# Every dtype this torch defines (aliases such as torch.long collapse into one entry), so a
# dtype added by a later torch is classified too.
_ALL_TORCH_DTYPES: list[torch.dtype] = sorted(
    {value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str
)
# Written out by name, not taken from INDEX_DTYPES: the expectation the tests check against.
_WHOLE_BYTE_INTEGERS: frozenset[torch.dtype] = frozenset(
    getattr(torch, name)
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
)


def _refusal_reason(dtype: torch.dtype) -> str | None:
    """Why ``dtype`` is no index dtype (``None`` for the whole-byte integers), or ``"unknown"``
    for a dtype none of the known families covers."""
    if dtype in _WHOLE_BYTE_INTEGERS:
        return None
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.bool:
        return "bool"
    if dtype.is_floating_point:
        return "floating"
    if dtype.is_complex:
        return "complex"
    if name.startswith(("qint", "quint")):
        return "quantized"
    if re.fullmatch(r"u?int[1-7]", name) or name.startswith("bits"):
        return "sub-byte or raw bits"
    return "unknown"


def test_dtype_list_covers_this_torch() -> None:
    # The parametrization below must see the dtypes the rule exists for.
    present = set(_ALL_TORCH_DTYPES)
    assert present >= _WHOLE_BYTE_INTEGERS
    assert present >= {torch.bool, torch.float32, torch.complex64, torch.quint8}
    if hasattr(torch, "uint4"):  # sub-byte dtypes exist in recent torch only
        assert torch.uint4 in _ALL_TORCH_DTYPES


def test_index_dtypes_are_the_whole_byte_integers() -> None:
    assert isinstance(INDEX_DTYPES, frozenset)
    assert INDEX_DTYPES == _WHOLE_BYTE_INTEGERS
    for dtype in INDEX_DTYPES:
        # Whole-byte integers: every bit of an element is part of its value.
        assert torch.iinfo(dtype).bits == dtype.itemsize * 8


@pytest.mark.parametrize("dtype", _ALL_TORCH_DTYPES, ids=str)
def test_every_torch_dtype_is_classified(dtype: torch.dtype) -> None:
    reason = _refusal_reason(dtype)
    assert reason != "unknown", (
        f"{dtype} is new in this torch: decide whether it is an index dtype "
        "(cpattn_common.checks.INDEX_DTYPES) and teach this test its family"
    )
    assert is_index_dtype(dtype) is (reason is None), f"{dtype} ({reason or 'integer'})"


def test_nonnegative_int_accepts_zero_and_refuses_what_sizes_refuse() -> None:
    assert check_nonnegative_int("capacity", 0) == 0
    assert check_nonnegative_int("capacity", 7) == 7
    with pytest.raises(ValueError, match=re.escape("capacity must be >= 0, got -1")):
        check_nonnegative_int("capacity", -1)
    for value in (True, 4.0, "4", None):
        with pytest.raises(TypeError, match=re.escape(f"capacity must be an int, got {value!r}")):
            check_nonnegative_int("capacity", value)


def test_check_dtype() -> None:
    assert check_dtype("dtype", torch.bfloat16) is torch.bfloat16
    for value in ("bf16", torch.float16.itemsize, None, torch.empty(0)):
        with pytest.raises(
            TypeError, match=re.escape(f"dtype must be a torch.dtype, got {value!r}")
        ):
            check_dtype("dtype", value)


def test_check_bool() -> None:
    np = pytest.importorskip("numpy")
    for value in (True, False, np.True_, np.False_):
        got = check_bool("flag", value)
        assert got.__class__ is bool
        assert got is bool(value)
    for value in (None, 0, 1, 0.0, "False", torch.tensor(True), np.int64(1)):
        with pytest.raises(TypeError, match=re.escape(f"flag must be a bool, got {value!r}")):
            check_bool("flag", value)


def test_is_bool_scalar() -> None:
    """Every wrapping of a bool that operator.index may take as 0 / 1 (numpy 2.2 indexes
    np.True_), and nothing else."""
    np = pytest.importorskip("numpy")
    for value in (True, np.True_, np.bool_(False), torch.tensor(True), torch.tensor([False])):
        assert is_bool_scalar(value)
    for value in (1, np.int64(1), torch.tensor(1), 1.0, None, "True", np.float32(1.0)):
        assert not is_bool_scalar(value)


def test_exported() -> None:
    assert {"INDEX_DTYPES", "is_index_dtype", "check_positive_int"} <= set(checks.__all__)
    assert {"check_nonnegative_int", "check_dtype", "check_bool"} <= set(checks.__all__)
    assert "is_bool_scalar" in checks.__all__
    assert "check_tensors" in checks.__all__


def test_check_tensors_names_the_op_and_the_first_non_tensor() -> None:
    t = torch.zeros(2)
    check_tensors("op", a=t, b=t[0])
    with pytest.raises(TypeError, match=re.escape("op: b must be a torch.Tensor, got list")):
        check_tensors("op", a=t, b=[1.0], c=None)
    with pytest.raises(TypeError, match=re.escape("op: a must be a torch.Tensor, got NoneType")):
        check_tensors("op", a=None)
