"""Kernels run on their tensors' CUDA device, as torch's own ops do.

A Triton launch goes to the calling thread's *current* CUDA device and stream. Given tensors on
another GPU, Triton refuses their pointers (no peer access) or runs on the wrong GPU, unordered
with the stream that produced them. torch's ops avoid this with a device guard; ours do the
same where they launch:

    if (index := foreign_cuda_device(t)) >= 0:
        with torch.cuda.device(index):
            return launcher(t, ...)

``torch.cuda.device`` also selects that device's current stream (so a CUDA graph captured on
it captures the launch). The check costs about 0.4 µs of host time per call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpattn_common.checks import check_device

__all__ = ["current_device", "foreign_cuda_device", "indexed_device"]

# torch.cuda.current_device without its Python wrapper (called only once CUDA is initialised:
# for a CUDA tensor). CPU-only builds lack the binding and never reach the call.
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
