"""Kernels run on their tensors' CUDA device, as torch's own ops do.

A Triton launch goes to the current CUDA device, so the ops guard a launch on tensors of
another GPU: ``if (index := foreign_cuda_device(t)) >= 0: with torch.cuda.device(index): ...``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpattn_common.checks import check_device

__all__ = ["current_device", "foreign_cuda_device", "indexed_device"]

# torch.cuda.current_device without its Python wrapper (CPU-only builds never call it).
current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` with an explicit index: a bare ``"cuda"`` becomes the current CUDA device, so
    comparisons with a tensor's (always indexed) ``.device`` hold. Refuses (``check_device``)
    ``None``, a string torch cannot parse and a CUDA device this process lacks."""
    dev = check_device("device", device)
    index: int | None = dev.index  # the stubs say int; a bare device has None
    if dev.type == "cuda" and index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def foreign_cuda_device(t: torch.Tensor) -> int:
    """The index of ``t``'s CUDA device when that is not the current device, else -1 (also
    for a tensor that is not on a CUDA device)."""
    if not t.is_cuda:
        return -1
    index = t.get_device()
    return -1 if index == current_device() else index
