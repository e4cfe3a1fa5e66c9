"""Argument checks shared by cp-pcp's public functions."""

from __future__ import annotations

import torch

__all__ = ["require_tensors"]


def require_tensors(**values: object) -> None:
    """``TypeError`` naming the first of ``values`` (keyed by argument name) that is not a
    ``torch.Tensor``: without it such an argument fails later with an ``AttributeError``
    from inside the function."""
    for name, value in values.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
