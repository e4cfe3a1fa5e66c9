"""Triton launches with a cached handle of the compiled kernel.

``CachedKernel(kernel).specialize(**constexprs)`` fixes a kernel's compile-time arguments
(constexprs and launch options such as ``num_warps``); ``spec(grid, *args)`` launches it with
the runtime arguments, positionally in the kernel's order. The first call for each *key* is a
plain JIT launch, which returns Triton's compiled kernel; later calls with the same key launch
that handle directly (``compiled[grid](*args)``): about 0.6x of a plain launch's host time.

The key is at least as fine as Triton's own specialization (current CUDA device; per tensor
its dtype and 16-byte alignment; per int whether it equals 1, is a multiple of 16 and fits in
32 / 64 bits; else the type). The handle is used on CUDA with Triton 3.4 or newer; elsewhere
(Triton 3.3, ROCm, the interpreter) and with ``CPATTN_LAUNCH_CACHE=0`` every call is a plain
JIT launch. Launches run on the current stream (CUDA-graph capturable).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton

from cpattn_common.device import current_device

__all__ = ["CachedKernel", "Specialization"]

_Tensor = torch.Tensor
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_I64_MAX = 2**63 - 1


def _handles_supported(kernel: Any) -> bool:
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (
        (major, minor) >= (3, 4)
        and not getattr(torch.version, "hip", None)
        and isinstance(kernel, triton.runtime.JITFunction)
        and os.environ.get("CPATTN_LAUNCH_CACHE", "1") != "0"
    )


def _key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What Triton's specialization can depend on, per runtime argument (one comprehension,
    no call per argument: this runs on every launch)."""
    return tuple(
        [
            (a == 1, a & 15 == 0, _I32_MIN <= a <= _I32_MAX, a <= _I64_MAX)
            if a.__class__ is int
            else (a.dtype, a.data_ptr() & 15 == 0)
            if isinstance(a, _Tensor)
            else a.__class__
            for a in args
        ]
    )


class CachedKernel:
    """A ``@triton.jit`` kernel whose compiled handles are reused (see the module docstring):
    ``CachedKernel(k).specialize(BLOCK_D=128, num_warps=4)((batch, heads), out, lse, ...)``."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        fn = getattr(kernel, "fn", kernel)
        self._params: tuple[str, ...] = tuple(fn.__code__.co_varnames[: fn.__code__.co_argcount])

    def __repr__(self) -> str:
        return f"CachedKernel({getattr(self.kernel, '__name__', self.kernel)!r})"

    def specialize(self, **constexprs: Any) -> Specialization:
        """Fix the constexprs and launch options; returns a launcher of the runtime args."""
        return Specialization(self, constexprs)


class Specialization:
    """``CachedKernel.specialize(...)``: call as ``spec(grid, *runtime_args)``. ``kernel``: the
    ``@triton.jit`` kernel; ``constexprs``: the fixed keyword arguments."""

    def __init__(self, cached: CachedKernel, constexprs: dict[str, Any]):
        self.kernel = cached.kernel
        self.constexprs = constexprs
        self._handles: dict[Any, Any] = {}
        self._fast = _handles_supported(cached.kernel)
        # The compiled launcher takes every parameter in signature order: the runtime
        # arguments come first in every kernel of ours, then the constexprs.
        params = cached._params
        runtime = [p for p in params if p not in constexprs]
        if params[: len(runtime)] != tuple(runtime):
            self._fast = False  # a constexpr between runtime arguments: plain launches
        self._tail = tuple(constexprs.get(p) for p in params[len(runtime) :])
        self._nargs = len(runtime)

    def __repr__(self) -> str:
        return f"Specialization({getattr(self.kernel, '__name__', self.kernel)!r}, {self.constexprs!r})"

    def __call__(self, grid: tuple[int, ...], *args: Any) -> None:
        try:
            if not self._fast:
                self.kernel[grid](*args, **self.constexprs)
                return
            key = (current_device(), _key(args))
            handle = self._handles.get(key)
            if handle is None:
                handle = self.kernel[grid](*args, **self.constexprs)
                if len(args) == self._nargs:  # else a defaulted parameter: no tail for it
                    self._handles[key] = handle
                return
            handle[(*grid, 1, 1)[:3]](*args, *self._tail)
        except ValueError as exc:  # Triton's launcher refuses a pointer it cannot use
            if "cannot be accessed from Triton" not in str(exc):
                raise
            raise ValueError(
                f"{getattr(self.kernel, '__name__', 'kernel')}: every tensor must be on a CUDA "
                "device: the Triton kernels are compiled for the GPU in this process (on the "
                "CPU, set TRITON_INTERPRET=1 before importing triton)"
            ) from exc
