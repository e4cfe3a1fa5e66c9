"""Argument checks shared by every package, so that the same mistake gets the same error.

Sizes (world sizes, group sizes, token budgets) are Python ints: a ``bool`` is refused (it is
an ``int`` to ``isinstance``, but ``True`` as a world size is a bug), as is a float that happens
to be whole. See ``docs/conventions.md``.
"""

from __future__ import annotations

__all__ = ["check_positive_int"]


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
