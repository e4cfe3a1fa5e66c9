"""Cached Triton launch: ``launch_cached(kernel, grid, **kwargs)``.

A plain ``kernel[grid](**kwargs)`` launch re-binds every argument, recomputes Triton's
specialization key, looks the compiled kernel up and builds launch metadata on every call;
on an H200 that costs 12-33 µs of host time. ``launch_cached`` remembers, per kernel and per
*specialization key*, the compiled kernel the first JIT launch returned, and launches it
directly through its launcher afterwards.

The key is at least as fine as Triton's own specialization, so a cached entry is only reused
where Triton would have reused the same binary:

- tensor argument: ``dtype`` and whether ``data_ptr() % 16 == 0``;
- int argument: its integer class (i32 / i64 / u64 by range) and value class
  (``== 1``, ``% 16 == 0``, other);
- float / bool / None runtime argument: its Python type;
- constexpr argument and launch option (``num_warps`` ...): its value;
- the current CUDA device.

Safety: the fast path is used only for a plain ``triton.runtime.jit.JITFunction`` on a
Triton version whose launch convention is known (3.3 - 3.9: the compiled kernel's ``run``
takes ``grid, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
*all_args``), when no launch hooks (profilers) are installed and the kernel reads no global
that changed; otherwise, under ``TRITON_INTERPRET=1``, with an argument type it does not know,
or with ``CPATTN_LAUNCH_CACHE=0`` in the environment at import (or after
``set_launch_cache_enabled(False)``), it launches the plain way. The stream is
the *current* stream, so launches are CUDA-graph capturable.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

__all__ = [
    "clear_launch_cache",
    "launch_cache_info",
    "launch_cached",
    "launch_fast_path_reason",
    "set_launch_cache_enabled",
]

_KNOWN_MINOR = range(3, 10)  # triton 3.3 .. 3.9 share the launch convention used here
_MAX_ENTRIES_PER_KERNEL = 512
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


class _KernelInfo:
    """Per-kernel static data and its cache of compiled kernels."""

    __slots__ = ("by_value", "defaults", "entries", "fn", "names", "usable")

    def __init__(self, fn: Any):
        self.fn = fn
        self.entries: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}
        self.usable = True
        self.names: tuple[str, ...] = ()
        # parameter name -> whether it is keyed by value (constexpr); names not in it are
        # launch options, also keyed by value.
        self.by_value: dict[str, bool] = {}
        self.defaults: dict[str, Any] = {}
        try:
            params = fn.params
            self.names = tuple(p.name for p in params)
            self.by_value = {p.name: bool(p.is_constexpr) for p in params}
            sig = fn.signature.parameters
            self.defaults = {name: p.default for name, p in sig.items() if p.default is not p.empty}
            if len(self.names) != len(sig) or any(
                p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.values()
            ):
                self.usable = False
        except Exception:
            self.usable = False


class _Runtime:
    """Triton-side objects the fast path needs, resolved once; ``reason`` says why not."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.jit_type: type | None = None
        self.knobs: Any = None
        self.driver: Any = None
        try:
            import triton
            from triton.runtime import jit as triton_jit

            parts = triton.__version__.split(".")
            major, minor = int(parts[0]), int(parts[1])
            if major != 3 or minor not in _KNOWN_MINOR:
                self.reason = f"triton {triton.__version__} has an unverified launch convention"
                return
            self.knobs = triton.knobs
            self.jit_type = triton_jit.JITFunction
            from triton.runtime import driver

            self.driver = driver
        except Exception as exc:  # any missing attribute: plain launches only
            self.reason = f"triton runtime not recognised ({type(exc).__name__}: {exc})"


_runtime: _Runtime | None = None
_infos: dict[int, _KernelInfo] = {}
_lock = threading.Lock()
_stats = {"fast": 0, "plain": 0, "compiled": 0}
_enabled = os.environ.get("CPATTN_LAUNCH_CACHE", "1") != "0"


def _get_runtime() -> _Runtime:
    global _runtime
    if _runtime is None:
        _runtime = _Runtime()
    return _runtime


def set_launch_cache_enabled(enabled: bool) -> None:
    """Turn the fast path on or off process-wide (initially off iff ``CPATTN_LAUNCH_CACHE=0``)."""
    global _enabled
    _enabled = bool(enabled)


def launch_fast_path_reason(kernel: Any = None) -> str | None:
    """Why the fast path is off (``None`` when it is on) for ``kernel`` (or in general)."""
    if not _enabled:
        return "disabled (CPATTN_LAUNCH_CACHE=0 or set_launch_cache_enabled(False))"
    rt = _get_runtime()
    if rt.reason is not None:
        return rt.reason
    if kernel is not None:
        if type(kernel) is not rt.jit_type:
            if os.environ.get("TRITON_INTERPRET", "0") == "1":
                return "TRITON_INTERPRET=1: the interpreter launches kernels itself"
            return f"{type(kernel).__name__} is not a plain triton JITFunction"
        info = _infos.get(id(kernel))
        if info is not None and info.fn is kernel and not info.usable:
            return "kernel signature or compiled-kernel object not supported"
    return None


def clear_launch_cache() -> None:
    """Forget every cached compiled kernel (the next launch of each goes through the JIT)."""
    with _lock:
        _infos.clear()
        for k in _stats:
            _stats[k] = 0


def launch_cache_info() -> dict[str, int]:
    """Counters: ``fast`` (cached launches), ``plain`` (JIT launches), ``compiled`` (entries)."""
    return dict(_stats)


def _hook_active(hook: Any) -> bool:
    """A launch hook is installed (triton <= 3.6: a callable or None; later: a HookChain)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return not isinstance(calls, list) or bool(calls)


def _plain(kernel: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> Any:
    _stats["plain"] += 1
    return kernel[grid](**kwargs)


def _info_for(kernel: Any) -> _KernelInfo:
    info = _KernelInfo(kernel)
    rt = _get_runtime()
    if rt.reason is not None or type(kernel) is not rt.jit_type:
        info.usable = False
    with _lock:
        _infos[id(kernel)] = info
    return info


_Tensor = torch.Tensor
_MISSING = object()


def _arg_key(value: Any, by_value: bool) -> Any:
    """The specialization class of one argument (``NotImplemented`` if unknown).

    The hot loop in ``launch_cached`` inlines the tensor and runtime-int cases.
    """
    t = type(value)
    if isinstance(value, torch.Tensor):
        return NotImplemented if by_value else (value.dtype, value.data_ptr() & 15)
    if by_value:  # constexprs and launch options: by value
        try:
            hash(value)
        except TypeError:
            return NotImplemented
        return (t, value)
    if t is int:
        if _I32_MIN <= value <= _I32_MAX:
            width = 0
        elif _I64_MIN <= value <= _I64_MAX:
            width = 1
        else:
            width = 2
        return (width, 0 if value == 1 else 1 if value % 16 == 0 else 2)
    if t is float or t is bool or value is None:
        return t
    return NotImplemented


def launch_cached(kernel: Any, grid: tuple[int, ...], **kwargs: Any) -> None:
    """Launch the ``@triton.jit`` ``kernel`` on ``grid`` with every argument by keyword.

    The first launch of each specialization goes through Triton's JIT (compiling if needed);
    later launches with the same specialization call the compiled kernel's launcher directly.

    Args:
        kernel: a ``triton.JITFunction`` (the object ``@triton.jit`` returns); other kernel
            objects (autotuners, the interpreter) are launched the plain way.
        grid: the launch grid, 1 to 3 positive ints.
        **kwargs: every kernel argument by name, constexprs and launch options
            (``num_warps``, ``num_stages``) included.
    """
    info = _infos.get(id(kernel))
    if info is None or info.fn is not kernel:
        info = _info_for(kernel)
    if not (_enabled and info.usable):
        _plain(kernel, grid, kwargs)
        return
    rt = _runtime
    assert rt is not None
    knobs_rt = rt.knobs.runtime
    if _hook_active(knobs_rt.launch_enter_hook) or _hook_active(knobs_rt.launch_exit_hook):
        _plain(kernel, grid, kwargs)
        return

    # Specialization key, at least as fine as Triton's (see the module docstring).
    by_value = info.by_value
    active = rt.driver.active
    device = active.get_current_device()
    parts: list[Any] = [device, tuple(kwargs)]
    append = parts.append
    for name, v in kwargs.items():
        t = type(v)
        if t is _Tensor:
            append(v.dtype)
            append(v.data_ptr() & 15)
        elif by_value.get(name, True):  # constexpr or launch option: by value
            append(v if t is int else (t, v))
        elif t is int:
            if -0x80000000 <= v <= 0x7FFFFFFF:
                append(1 if v == 1 else (16 if v & 15 == 0 else 0))
            elif -0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF:
                append(65 if v == 1 else (80 if v & 15 == 0 else 64))
            else:
                append(128 if v & 15 == 0 else 129)
        else:
            k = _arg_key(v, False)
            if k is NotImplemented:
                _plain(kernel, grid, kwargs)
                return
            append(k)
    key = tuple(parts)
    try:
        entry = info.entries.get(key)
    except TypeError:  # an unhashable constexpr value
        _plain(kernel, grid, kwargs)
        return
    if entry is None:
        compiled = _plain(kernel, grid, kwargs)
        _remember(info, key, compiled, kwargs)
        return
    launcher, function, packed_metadata = entry
    if kernel.used_global_vals and not _globals_unchanged(kernel):
        _plain(kernel, grid, kwargs)  # Triton raises its own error about the changed global
        return
    names = info.names
    try:
        args = [kwargs[n] for n in names]
    except KeyError:  # a parameter left to its default
        defaults = info.defaults
        args = [kwargs.get(n, defaults.get(n, _MISSING)) for n in names]
    n = len(grid)
    try:
        launcher(
            grid[0],
            grid[1] if n > 1 else 1,
            grid[2] if n > 2 else 1,
            active.get_current_stream(device),
            function,
            packed_metadata,
            None,
            None,
            None,
            *args,
        )
    except TypeError:
        # The launcher rejected the argument list before enqueueing anything: this Triton
        # does not follow the convention after all. Stop using the fast path for the kernel.
        info.usable = False
        info.entries.clear()
        _plain(kernel, grid, kwargs)
        return
    _stats["fast"] += 1


def _globals_unchanged(kernel: Any) -> bool:
    missing = object()
    for (name, _), (value, scope) in kernel.used_global_vals.items():
        current = scope.get(name, missing)
        if current is not value and current != value:
            return False
    return True


def _remember(
    info: _KernelInfo, key: tuple[Any, ...], compiled: Any, kwargs: dict[str, Any]
) -> None:
    """Cache ``compiled`` under ``key`` if it looks like a CompiledKernel we can launch."""
    try:
        launcher = compiled.run  # property: builds the launcher / loads the module if needed
        function = compiled.function
        packed_metadata = compiled.packed_metadata
        src_fn = getattr(compiled.src, "fn", None)
        n_signature = len(getattr(compiled.src, "signature", ()))
    except Exception:
        info.usable = False
        return
    # The launcher takes every parameter (constexprs included) iff the compiled signature lists
    # them all (triton >= 3.3); anything else: plain launches for this kernel.
    if (
        function is None
        or not callable(launcher)
        or src_fn is not info.fn
        or n_signature != len(info.names)
    ):
        info.usable = False
        return
    unknown = [n for n in kwargs if n not in info.names and n not in _OPTION_NAMES]
    if unknown or any(n not in kwargs and n not in info.defaults for n in info.names):
        return  # the JIT accepted it, but we do not reproduce it: keep launching plainly
    with _lock:
        if len(info.entries) >= _MAX_ENTRIES_PER_KERNEL:
            info.entries.clear()
        info.entries[key] = (launcher, function, packed_metadata)
        _stats["compiled"] += 1


# Launch options Triton accepts as keywords next to the kernel's own parameters; they are part
# of the cache key by value and are not passed to the launcher.
_OPTION_NAMES = frozenset(
    {
        "num_warps",
        "num_stages",
        "num_ctas",
        "maxnreg",
        "enable_fp_fusion",
        "launch_cooperative_grid",
        "launch_pdl",
        "debug",
    }
)
