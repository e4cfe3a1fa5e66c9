"""Kernels run on their tensors' CUDA device, as torch's own ops do.

A Triton launch (Triton's JIT and a cached compiled handle alike) goes to the calling
thread's *current* CUDA device and that device's current stream. Given tensors on another GPU,
Triton's launcher refuses their pointers where the devices have no peer access (``ValueError:
Pointer argument ... cannot be accessed from Triton``, seen on two H200s), and with peer access
the kernel would run on the wrong GPU, unordered with the stream that produced the tensors.
torch's ops avoid this with a device guard; ours do the same where they launch:

    if (index := foreign_cuda_device(t)) >= 0:
        with torch.cuda.device(index):
            return launcher(t, ...)

``torch.cuda.device`` makes the tensors' device current for the call, which also selects
that device's current stream (so a CUDA graph captured on that device's stream captures the
launch). The check costs about 0.4 µs of host time per call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["current_device", "foreign_cuda_device"]

# torch.cuda.current_device without its Python wrapper (called only once CUDA is initialised:
# for a CUDA tensor). CPU-only builds lack the binding and never reach the call.
current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def foreign_cuda_device(t: torch.Tensor) -> int:
    """The index of ``t``'s CUDA device when that is not the current device, else -1.

    -1 also for a tensor that is not on a CUDA device (the CPU interpreter path).
    """
    if not t.is_cuda:
        return -1
    index = t.get_device()
    return -1 if index == current_device() else index
