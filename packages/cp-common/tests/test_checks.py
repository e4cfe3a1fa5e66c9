"""``check_positive_int``: the one size check of every package."""

from __future__ import annotations

import re

import pytest

from cpattn_common.checks import check_positive_int


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
