"""Cached Triton launches: ``launch_cached(kernel, grid, **kwargs)`` and ``CachedKernel``.

A plain ``kernel[grid](**kwargs)`` launch re-binds every argument, recomputes Triton's
specialization key, looks the compiled kernel up and builds launch metadata on every call;
on an H200 that costs 12-33 µs of host time. Both entry points here remember, per kernel and
per *specialization key*, the compiled kernel the first JIT launch returned, and launch it
directly through its launcher afterwards:

- ``launch_cached(kernel, grid, **kwargs)``: every argument by keyword (any order; the
  argument-name tuple of a call site selects a generated key/argument builder);
- ``CachedKernel(kernel)`` (create once, at import): ``ck(grid, *runtime_args, **constexprs)``
  with the non-constexpr arguments positionally in signature order and the constexprs and
  launch options (``num_warps`` ...) by keyword. Cheapest: one generated key expression over
  the positional arguments, the constexpr values cached with the entry.

The key is at least as fine as Triton's own specialization, so a cached entry is only reused
where Triton would have reused the same binary:

- tensor argument: ``dtype`` and ``data_ptr() % 16``;
- int argument: its integer class (i32 / i64 / u64 by range) and value class
  (``== 1``, ``% 16 == 0``, other);
- float / bool / None runtime argument: its Python type;
- a parameter whose Triton specialization never depends on the value is left out of the key:
  annotated with a scalar type *and* listed in ``do_not_specialize`` (``H: tl.int64``), or
  annotated as a float / bool (Triton never specializes those);
- constexpr argument: its type and value, exactly: ``1``, ``1.0`` and ``True`` differ, so do
  ``0.0`` and ``-0.0`` (the sign of a zero, also inside a complex number), ``(1,)`` and
  ``(True,)`` (a tuple item by item, each with its type), while every NaN is one constant.
  This is finer than Triton's own JIT cache, which shares one binary between such constants
  (Triton 3.6 on the H200, ``benchmarks/constexpr_cache_probe.py``: ``1.0`` launched after
  ``1`` runs the int binary, and ``-0.0`` compiles as ``+0.0`` even when launched first).
  An entry holds the binary Triton's JIT returned on the key's first launch, so such a
  constexpr gets what a plain launch would have got, no better;
- launch option (``num_warps`` ...): its value (``launch_cached`` also keys its class, which
  only splits entries Triton would share: Triton parses an option into the same setting
  whatever its Python type);
- the current CUDA device.

The key a cache hit is looked up by (the *hit key*) holds a constexpr's type and the value
itself, which is exact for ints, bools, strings, ``None`` and non-zero floats: for those the
hit key *is* the exact key under which the entry was stored, so the hit path pays nothing for
exactness. A zero or NaN float, a tuple or a complex constexpr is stored under an exact key
that no hit key equals: such calls miss the hit path, and the slow path finds their entry by
the exact key and launches it, still without Triton's JIT.

Kernels written for the fast path annotate their int sizes / strides (``stride: tl.int64``)
and list them in ``do_not_specialize``; the key then only looks at the tensors and the
constexprs. (Triton still specializes tensors on 16-byte alignment, and unannotated ints on
``== 1`` and ``% 16``: those stay in the key.)

A cached launcher that raises ``TypeError`` (it checks its arguments before enqueueing
anything) costs only that call: it is launched the plain way instead. If Triton then raises
too, the error was the call's (say, a float for an ``n: tl.int32`` the key does not look at)
and reaches the caller unchanged, the entry staying in place; if Triton's launch works, that
one entry does not fit its key's calls, which launch the plain way from then on. The kernel's
other keys and every other kernel keep their fast path.

Safety: the fast path is used only for a plain ``triton.runtime.jit.JITFunction`` on a Triton
version whose launch convention is known (3.4 - 3.9: the compiled kernel's ``run`` takes
``grid, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
*all_args``), when no launch hooks (profilers) or pre-run hooks are installed and the kernel
reads no global that changed; otherwise, under ``TRITON_INTERPRET=1``, with an argument type it
does not know, or with ``CPATTN_LAUNCH_CACHE=0`` in the environment at import (or after
``set_launch_cache_enabled(False)``), it launches the plain way. The stream is the *current*
stream, so launches are CUDA-graph capturable. Toggling ``TRITON_DEBUG`` / Triton compile knobs
at run time is not seen by cached entries: call ``clear_launch_cache()`` after such a change,
and ``cpattn_common.launch_plans.clear_launch_plans()`` where launch plans are on (a recorded
call replays its compiled kernel until then).
"""

from __future__ import annotations

import ast
import inspect
import math
import numbers
import os
import textwrap
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from cpattn_common.interpret import triton_interpreting

__all__ = [
    "CachedKernel",
    "Specialization",
    "clear_launch_cache",
    "launch_cache_info",
    "launch_cached",
    "launch_fast_path_reason",
    "set_launch_cache_enabled",
]

# Triton 3.4 .. 3.9 share the launch convention used here and keep the launch hooks in
# triton.knobs; 3.3 has no triton.knobs, so its launches take the plain path.
_KNOWN_MINOR = range(4, 10)
_MAX_ENTRIES_PER_KERNEL = 512
_MAX_PLANS_PER_KERNEL = 64
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1

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

# Parameter kinds (how a parameter enters the key).
_FREE = 0  # Triton's specialization does not depend on the value: not in the key
_VALUE = 1  # constexpr / launch option: type and value
_ANY = 2  # runtime argument: tensor -> (dtype, align), int -> class, ... (``_arg_class``)


class _HookChainPlaceholder:  # stands in for triton.knobs.HookChain on versions without it
    calls: ClassVar[list[Any]] = []


class _Runtime:
    """Triton-side objects the fast path needs, resolved once; ``reason`` says why not."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.jit_type: type | None = None
        self.knobs: Any = None
        self.driver: Any = None
        self.chain_type: type = _HookChainPlaceholder
        if getattr(torch.version, "hip", None):
            # Triton's HIP backend also specializes a tensor on whether its storage fits in
            # 2 GiB (buffer ops), which the key does not hold: a binary compiled for a small
            # tensor would be reused for a large one.
            self.reason = "ROCm: Triton specializes tensors on their storage size there"
            return
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
            chain = getattr(triton.knobs, "HookChain", None)
            if isinstance(chain, type):
                self.chain_type = chain
            from triton.runtime import driver

            self.driver = driver
            global _knobs_rt, _chain_type, _constexpr_type
            _knobs_rt = triton.knobs.runtime
            _chain_type = self.chain_type
            constexpr = getattr(triton.language, "constexpr", None)
            _constexpr_type = constexpr if isinstance(constexpr, type) else None
        except Exception as exc:  # any missing attribute: plain launches only
            self.reason = f"triton runtime not recognised ({type(exc).__name__}: {exc})"


_runtime: _Runtime | None = None
_knobs_rt: Any = None
_chain_type: Any = _HookChainPlaceholder
_constexpr_type: Any = None  # triton.language.constexpr (a wrapper a host may pass)
_infos: dict[int, _KernelInfo] = {}
_lock = threading.Lock()
_stats = {"fast": 0, "plain": 0, "compiled": 0}
_enabled = os.environ.get("CPATTN_LAUNCH_CACHE", "1") != "0"
_bound: weakref.WeakSet[CachedKernel] = weakref.WeakSet()
_Tensor = torch.Tensor
_MISSING: Any = object()
# Set by cpattn_common.launch_plans while it records a call: sees every launch as
# (function handle, grid, device, all arguments in signature order), or (None, grid, -1, ())
# for a launch that did not take the fast path. Callers read it once into a local: another
# thread may end the recording between a check and a call.
_launch_recorder: Callable[[int | None, tuple[int, ...], int, tuple[Any, ...]], None] | None = None
# Compiled kernel behind each cached function handle (what a launch plan needs to know).
_compiled_kernels: dict[int, Any] = {}
# Each tuple of keyword names a fast-path call passed, in order -> a small int of the keys.
_NAME_ORDERS: dict[tuple[str, ...], int] = {}


def _get_runtime() -> _Runtime:
    global _runtime
    if _runtime is None:
        _runtime = _Runtime()
    return _runtime


def _reset_bound() -> None:
    with _lock:  # another thread may be binding a CachedKernel (adding to _bound) meanwhile
        bound = list(_bound)
    for ck in bound:
        ck._state = None
        ck._reason = None


def set_launch_cache_enabled(enabled: bool) -> None:
    """Turn the fast path on or off process-wide (initially off iff ``CPATTN_LAUNCH_CACHE=0``)."""
    global _enabled
    _enabled = bool(enabled)
    with _lock:
        for info in _infos.values():
            info.live = _enabled and info.usable
    _reset_bound()


def launch_fast_path_reason(kernel: Any = None) -> str | None:
    """Why the fast path is off (``None`` when it is on) for ``kernel`` (or in general).

    ``kernel`` may be a ``@triton.jit`` kernel or a ``CachedKernel``. Before the kernel's first
    launch through this module, ``None`` means "no reason known yet": its signature and its
    compiled kernel are checked at that launch, which may still turn the fast path off for it.
    """
    if not _enabled:
        return "disabled (CPATTN_LAUNCH_CACHE=0 or set_launch_cache_enabled(False))"
    rt = _get_runtime()
    if rt.reason is not None:
        return rt.reason
    if isinstance(kernel, CachedKernel):
        if kernel._reason is not None:
            return kernel._reason
        kernel = kernel.kernel
    if kernel is not None:
        if type(kernel) is not rt.jit_type:
            if triton_interpreting():
                return "TRITON_INTERPRET=1: the interpreter launches kernels itself"
            return f"{type(kernel).__name__} is not a plain triton JITFunction"
        info = _infos.get(id(kernel))
        if info is not None and info.fn is kernel and not info.usable:
            return info.reason or "kernel signature or compiled-kernel object not supported"
    return None


def clear_launch_cache() -> None:
    """Forget every cached compiled kernel (the next launch of each goes through the JIT).

    Recorded launch plans keep theirs: ``launch_plans.clear_launch_plans()`` forgets those."""
    with _lock:
        for info in _infos.values():
            info.live = False
        _infos.clear()
        _compiled_kernels.clear()
        for k in _stats:
            _stats[k] = 0
    _reset_bound()


def launch_cache_info() -> dict[str, int]:
    """Counters since the last ``clear_launch_cache()``: ``fast`` (cached launches), ``plain``
    (JIT launches), ``compiled`` (compiled kernels stored into the cache). ``compiled`` is
    never decremented, so it is not the number of live entries: entries dropped when their
    table fills up still count, two threads missing on one key count twice, and one binary
    stored by ``launch_cached``, a ``CachedKernel`` and a ``Specialization`` (each keeps its
    own entries) counts once per store."""
    info = dict(_stats)
    with _lock:
        infos = list(_infos.values())
    info["fast"] += sum(i.fast for i in infos)
    return info


def _hooks_idle() -> bool:
    """No launch enter / exit hook is installed (cheap; inlined in the hot paths)."""
    kr = _knobs_rt
    e: Any = kr.launch_enter_hook
    x: Any = kr.launch_exit_hook
    return (e is None or (e.__class__ is _chain_type and not e.calls)) and (
        x is None or (x.__class__ is _chain_type and not x.calls)
    )


# Triton's interpreter (TRITON_INTERPRET=1) keeps the program index and its patching of
# ``triton.language`` in process-global state, so two threads interpreting kernels at once (the
# virtual ranks of ``cpattn_testing.SimulatedWorld``) corrupt each other. Interpreted launches
# are therefore serialised; compiled launches never take this lock.
_interpreter_lock = threading.RLock()


def _after_fork_in_child() -> None:
    """A forked child gets fresh locks: another thread may have held them at the fork (in an
    interpreted launch, say), and that thread does not exist in the child."""
    global _lock, _interpreter_lock
    _lock, _interpreter_lock = threading.Lock(), threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _plain(kernel: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> Any:
    _stats["plain"] += 1
    if (record := _launch_recorder) is not None:
        record(None, grid, -1, ())
    if type(kernel).__name__ == "InterpretedFunction":
        with _interpreter_lock:
            return kernel[grid](**kwargs)
    try:
        return kernel[grid](**kwargs)
    except RuntimeError as exc:
        if "active drivers" not in str(exc):
            raise
        # Triton found no GPU driver: say what to do instead of Triton's internal message.
        raise RuntimeError(
            f"cannot launch the Triton kernel {getattr(kernel, '__name__', kernel)!r}: no GPU "
            "driver is available. Pass CUDA tensors, or set TRITON_INTERPRET=1 (before "
            "importing triton) to run the kernels on CPU tensors through Triton's interpreter."
        ) from exc


def _arg_class(value: Any) -> Any:
    """The specialization class of one runtime argument (``NotImplemented`` if unknown)."""
    t = type(value)
    if t is _Tensor or isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() & 15)
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


class _Mark:
    """A key item no argument value equals (identity equality and hash)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_NAN, _POS_ZERO, _NEG_ZERO = _Mark("nan"), _Mark("+0.0"), _Mark("-0.0")
_TUPLE, _COMPLEX, _CONSTEXPR = _Mark("tuple"), _Mark("complex"), _Mark("constexpr")
# Classes whose equal values are one constant to Triton: the value is its own exact key item.
_EXACT_CLASSES = frozenset({int, bool, str, bytes, type(None)})


def _exact_value(value: Any) -> Any:
    """The key item of a constexpr value (next to its class): equal for two values iff Triton
    sees the same constant (its key holds their ``repr``).

    The value itself where that is exact (ints, bools, strings, ``None``, non-zero floats, and
    any class this does not know); otherwise an item built on a ``_Mark``, so that no hit key
    (which holds the value itself) equals it: a float zero by its sign, every NaN alike, a
    complex number by its parts, a tuple (or ``tl.constexpr``) by its items with their classes.
    """
    cls = value.__class__
    if cls in _EXACT_CLASSES:
        return value
    if cls is float or (
        isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
    ):  # numpy's float scalars too
        if value != value:
            return _NAN
        if value == 0:
            return _NEG_ZERO if math.copysign(1.0, value) < 0 else _POS_ZERO
        return value
    if isinstance(value, tuple):
        return (_TUPLE, *[(v.__class__, _exact_value(v)) for v in value])
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        re, im = value.real, value.imag
        return (_COMPLEX, re.__class__, _exact_value(re), im.__class__, _exact_value(im))
    if _constexpr_type is not None and isinstance(value, _constexpr_type):
        inner = value.value
        return (_CONSTEXPR, inner.__class__, _exact_value(inner))
    return value


def _globals_ok(triples: tuple[tuple[dict[str, Any], str, Any], ...]) -> bool:
    for scope, name, value in triples:
        current = scope.get(name, _MISSING)
        if current is not value and current != value:
            return False
    return True


def _global_triples(kernel: Any) -> tuple[tuple[dict[str, Any], str, Any], ...]:
    return tuple(
        (scope, name, value) for (name, _), (value, scope) in kernel.used_global_vals.items()
    )


_annotation_probe: bool | None = None


def _probe_body(x_ptr, n, s, f):  # type: ignore[no-untyped-def]  # pragma: no cover - probe
    pass


def _annotations_fix_specialization() -> bool:
    """Whether this Triton's binder ignores the values of annotated, unspecialized scalars.

    Checked once on a probe kernel (``n: tl.int32``, ``s: tl.int64`` in do_not_specialize,
    ``f: tl.float32``) through Triton's own binder: if its specialization differs between
    values, such parameters stay in the key (``_ANY``) like any other.
    """
    global _annotation_probe
    if _annotation_probe is None:
        ok = False
        try:
            import triton.language as tl
            from triton.backends.compiler import GPUTarget
            from triton.compiler import make_backend
            from triton.runtime.jit import JITFunction, create_function_from_signature

            _probe_body.__annotations__ = {"n": tl.int32, "s": tl.int64, "f": tl.float32}
            probe = JITFunction(_probe_body, do_not_specialize=["n", "s"])
            backend = make_backend(GPUTarget("cuda", 90, 32))
            binder = create_function_from_signature(probe.signature, probe.params, backend)
            x = torch.empty(4)
            specs = [
                binder(x, n, s, f)[1]
                for n, s, f in ((1, 1, 1.0), (16, 32, 2.5), (17, 2**40, 3), (2**31 - 1, 3, 0.0))
            ]
            ok = all(spec == specs[0] for spec in specs)
        except Exception:
            ok = False
        _annotation_probe = ok
    return _annotation_probe


def _fast_device_getter(get: Callable[[], int]) -> Callable[[], int]:
    """``torch.cuda.current_device`` without its Python wrapper once CUDA is initialised."""
    if get is torch.cuda.current_device:
        raw = getattr(torch._C, "_cuda_getDevice", None)
        if raw is not None:
            return raw  # type: ignore[no-any-return]
    return get


class _KernelInfo:
    """Per-kernel static data, generated key builders and the cache of compiled kernels."""

    def __init__(self, fn: Any):
        self.fn = fn
        # exact key -> (launcher, function, prefix); None: that key launches the plain way
        self.entries: dict[Any, tuple[Any, Any, Any] | None] = {}
        # names passed -> generated plan (hit key), xplan (exact key); None: plain launches
        self.plans: dict[tuple[str, ...], Callable[..., Any] | None] = {}
        self.xplans: dict[tuple[str, ...], Callable[..., Any] | None] = {}
        self.usable = True
        self.live = False
        self.reason: str | None = None
        self.fast = 0
        self.names: tuple[str, ...] = ()
        self.kinds: dict[str, int] = {}
        self.defaults: dict[str, Any] = {}
        self.globals: tuple[tuple[dict[str, Any], str, Any], ...] = ()
        self.get_device: Callable[[], int] = lambda: 0
        self.get_stream: Callable[[int], Any] = lambda device: 0
        try:
            params = fn.params
            self.names = tuple(p.name for p in params)
            for p in params:
                if p.is_constexpr:
                    kind = _VALUE
                else:
                    ann = p.annotation_type
                    fixed = (
                        bool(ann)
                        and (bool(p.do_not_specialize) or ann == "u1" or ann[:2] in ("fp", "bf"))
                        and _annotations_fix_specialization()
                    )
                    kind = _FREE if fixed else _ANY
                self.kinds[p.name] = kind
            sig = fn.signature.parameters
            self.defaults = {name: p.default for name, p in sig.items() if p.default is not p.empty}
            if len(self.names) != len(sig) or any(
                p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.values()
            ):
                self.usable = False
                self.reason = "variadic kernel signature"
            if not isinstance(getattr(fn, "pre_run_hooks", None), list):
                self.usable = False
                self.reason = "JITFunction without pre_run_hooks list"
        except Exception as exc:
            self.usable = False
            self.reason = f"kernel parameters not understood ({type(exc).__name__})"

    def resolve_driver(self, rt: _Runtime) -> None:
        try:
            active = rt.driver.active
            self.get_device = _fast_device_getter(active.get_current_device)
            self.get_stream = active.get_current_stream
        except Exception as exc:
            self.usable = False
            self.reason = f"triton driver not usable ({type(exc).__name__})"


def _info_for(kernel: Any) -> _KernelInfo:
    info = _KernelInfo(kernel)
    rt = _get_runtime()
    if rt.reason is not None or type(kernel) is not rt.jit_type:
        info.usable = False
    if info.usable:
        info.resolve_driver(rt)
    info.live = _enabled and info.usable
    with _lock:
        _infos[id(kernel)] = info
    return info


def _key_expr(var: str, kind: int, exact: bool = False) -> str:
    """Source of the key items of one argument held in local ``var`` (empty when free).

    A constexpr's items are its class and its value in the hit key, its class and
    ``_exact_value`` (``_xv``) in the ``exact`` key: the same items for the values where the
    value is exact (see the module docstring).
    """
    if kind == _FREE:
        return ""
    if kind == _VALUE:
        return f"{var}.__class__, _xv({var}), " if exact else f"{var}.__class__, {var}, "
    # An int32 int (the common case) is classified inline: a function call per int argument
    # costs about 0.3 µs of host time per launch. The classes match ``_arg_class``'s
    # (int32: ``== 1``, ``% 16 == 0``, other), in a form no other class produces.
    return (
        f"(({var}.dtype, {var}.data_ptr() & 15) if {var}.__class__ is _T else "
        f"(0 if {var} == 1 else 1 if {var} & 15 == 0 else 2) if {var}.__class__ is int "
        f"and -2147483648 <= {var} <= 2147483647 else _cls({var})), "
    )


def _make_plans(
    info: _KernelInfo, names: tuple[str, ...]
) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """Generated ``plan(kwargs, device) -> (key, args)`` for calls passing exactly ``names``,
    and ``xplan``, the same with the exact key (``plan``'s is the hit key).

    ``None`` when such calls cannot take the fast path (unknown names, a parameter without a
    default missing). ``args`` lists every parameter in signature order.
    """
    known = info.kinds
    if not names or any(n not in known and n not in _OPTION_NAMES for n in names):
        return None
    if any(n not in names and n not in info.defaults for n in info.names):
        return None
    local = {n: f"v{i}" for i, n in enumerate(names)}
    # The key holds which names were passed, in which order (a small int for the tuple): two
    # call sites passing different defaulted constexprs, or the same ones in another order,
    # would otherwise build equal keys from different arguments and share a binary.
    with _lock:
        order = _NAME_ORDERS.setdefault(names, len(_NAME_ORDERS))
    ns: dict[str, Any] = {"_T": _Tensor, "_cls": _arg_class, "_xv": _exact_value, "_order": order}
    key = "".join(_key_expr(local[n], known.get(n, _VALUE)) for n in names)
    xkey = "".join(_key_expr(local[n], known.get(n, _VALUE), exact=True) for n in names)
    args = []
    for j, n in enumerate(info.names):
        if n in local:
            args.append(local[n])
        else:
            ns[f"d{j}"] = info.defaults[n]
            args.append(f"d{j}")
    unpack = ", ".join(local[n] for n in names) + ","
    src = "".join(
        f"def {fn}(kw, dev):\n"
        f"    {unpack} = _get(kw)\n"
        f"    return (dev, _order, {k}), ({', '.join(args)},)\n"
        for fn, k in (("plan", key), ("xplan", xkey))
    )
    if len(names) == 1:
        ns["_get"] = lambda kw, _n=names[0]: (kw[_n],)
    else:
        import operator

        ns["_get"] = operator.itemgetter(*names)
    exec(src, ns)
    return ns["plan"], ns["xplan"]


def _compiled_parts(info: _KernelInfo, compiled: Any) -> tuple[Any, Any, Any] | None:
    """``(launch, function, prefix)`` of a CompiledKernel we can launch, else ``None``.

    A launch is ``launch(gx, gy, gz, stream, function, *prefix, *all_args)``: the compiled
    kernel's ``run`` with ``prefix = (packed_metadata, None, None, None)`` (no launch metadata,
    no hooks), or, where ``_direct_launch`` recognises the driver's launcher, its native
    ``launch`` with the same constant arguments the launcher's ``__call__`` would add.
    Marks the kernel unusable when the object does not follow the known convention.
    """
    try:
        launcher = compiled.run  # property: builds the launcher / loads the module if needed
        function = compiled.function
        packed_metadata = compiled.packed_metadata
        src_fn = getattr(compiled.src, "fn", None)
        n_signature = len(getattr(compiled.src, "signature", ()))
    except Exception:
        info.usable = info.live = False
        info.reason = "compiled-kernel object not supported"
        return None
    # The launcher takes every parameter (constexprs included) iff the compiled signature lists
    # them all (triton >= 3.3); anything else: plain launches for this kernel.
    if (
        function is None
        or not callable(launcher)
        or src_fn is not info.fn
        or n_signature != len(info.names)
    ):
        info.usable = info.live = False
        info.reason = "compiled kernel does not follow the known launch convention"
        return None
    try:
        info.globals = _global_triples(info.fn)
    except Exception:
        info.usable = info.live = False
        info.reason = "used_global_vals not understood"
        return None
    _compiled_kernels[function] = compiled
    direct = _direct_launch(launcher, packed_metadata)
    if direct is not None:
        return direct[0], function, direct[1]
    return launcher, function, (packed_metadata, None, None, None)


# triton 3.6's CudaLauncher.__call__ (compared as an AST, so formatting and comments do not
# matter). ``_direct_launch`` reproduces it when both scratch sizes are 0 (``allocate_scratch``
# then returns None): only a launcher class whose ``__call__`` parses to this takes that path.
_CUDA_LAUNCHER_36_CALL = """
def __call__(self, gridX, gridY, gridZ, stream, function, *args):
    def allocate_scratch(size, align, allocator):
        if size > 0:
            grid_size = gridX * gridY * gridZ
            alloc_size = grid_size * self.num_ctas * size
            alloc_fn = allocator.get()
            return alloc_fn(alloc_size, align, stream)
        return None

    global_scratch = allocate_scratch(
        self.global_scratch_size, self.global_scratch_align, _allocation._allocator
    )
    profile_scratch = allocate_scratch(
        self.profile_scratch_size, self.profile_scratch_align, _allocation._profile_allocator
    )
    self.launch(
        gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
        global_scratch, profile_scratch, *args
    )
"""


def _ast_dump(src: str) -> str:
    return ast.dump(ast.parse(textwrap.dedent(src)))


_direct_ok: dict[type, bool] = {}


def _direct_launch(launcher: Any, packed_metadata: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """``(native_launch, prefix)`` skipping the Python ``__call__`` of a known launcher.

    Only for a launcher class whose ``__call__`` source is exactly the recognised one (triton
    3.6's ``CudaLauncher``) and which needs no scratch buffers; anything else: ``None``.
    """
    cls = type(launcher)
    ok = _direct_ok.get(cls)
    if ok is None:
        ok = False
        try:
            if cls.__name__ == "CudaLauncher":
                ok = _ast_dump(inspect.getsource(cls.__call__)) == _ast_dump(_CUDA_LAUNCHER_36_CALL)
        except Exception:
            ok = False
        _direct_ok[cls] = ok
    if not ok:
        return None
    try:
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
        native = launcher.launch
        prefix = (
            launcher.launch_cooperative_grid,
            launcher.launch_pdl,
            None,
            None,
            packed_metadata,
            None,
            None,
            None,
        )
    except Exception:
        return None
    if not callable(native):
        return None
    return native, prefix


def _store(info: _KernelInfo, table: dict[Any, Any], key: Any, entry: Any) -> None:
    with _lock:
        if len(table) >= _MAX_ENTRIES_PER_KERNEL:
            table.clear()
        table[key] = entry
        _stats["compiled"] += 1


def _refuse(table: dict[Any, Any], key: Any) -> None:
    """Calls with ``key`` launch the plain way from now on (until the cache is cleared)."""
    with _lock:
        if key not in table and len(table) >= _MAX_ENTRIES_PER_KERNEL:
            table.clear()
        table[key] = None


def _launcher_rejected(
    table: dict[Any, Any], key: Any, kernel: Any, grid: tuple[int, ...], kwargs: dict[str, Any]
) -> None:
    """The cached launcher of the entry under ``key`` raised ``TypeError`` for this call (a
    launcher checks its arguments before enqueueing anything): launch it the plain way.

    Where Triton rejects the call too, the error is the call's (an argument the key does not
    look at, such as a float for an ``n: tl.int32`` in ``do_not_specialize``): it propagates,
    and the entry stays for the calls that fit it. Where Triton launches it, the entry does not
    fit its key's calls: only that key launches the plain way from then on; the kernel's other
    keys and other kernels keep their fast path. Called outside the ``except`` block, so the
    caller sees Triton's error as Triton raised it.
    """
    _plain(kernel, grid, kwargs)
    _refuse(table, key)


def _fast_launch(
    info: _KernelInfo,
    entry: tuple[Any, ...],
    grid: tuple[int, ...],
    dev: int,
    all_args: tuple[Any, ...],
) -> bool:
    """Launch a cached entry a slow path found by the call's exact key (a key no hit key
    equals: a zero or NaN float constexpr, a tuple ...) like the hit paths do; the caller
    checked the hooks and the globals. ``False``: its launcher raised ``TypeError``."""
    launcher, function, prefix = entry[0], entry[1], entry[2]
    n = len(grid)
    try:
        launcher(
            grid[0],
            grid[1] if n > 1 else 1,
            grid[2] if n > 2 else 1,
            info.get_stream(dev),
            function,
            *prefix,
            *all_args,
        )
    except TypeError:
        return False
    info.fast += 1
    if (record := _launch_recorder) is not None:
        record(function, grid, dev, all_args)
    return True


def launch_cached(kernel: Any, grid: tuple[int, ...], **kwargs: Any) -> None:
    """Launch the ``@triton.jit`` ``kernel`` on ``grid`` with every argument by keyword.

    The first launch of each specialization goes through Triton's JIT (compiling if needed);
    later launches with the same specialization call the compiled kernel's launcher directly.

    Args:
        kernel: a ``triton.JITFunction`` (the object ``@triton.jit`` returns); other kernel
            objects (autotuners, the interpreter) are launched the plain way.
        grid: the launch grid, 1 to 3 positive ints. A callable grid (Triton's
            ``grid(meta)`` form) is accepted and always launched the plain way.
        **kwargs: every kernel argument by name, constexprs and launch options
            (``num_warps``, ``num_stages``) included.
    """
    info = _infos.get(id(kernel))
    if info is None or info.fn is not kernel:
        info = _info_for(kernel)
    if info.live:
        plan = info.plans.get(tuple(kwargs))
        if plan is not None:
            dev = info.get_device()
            try:
                key, args = plan(kwargs, dev)
                entry = info.entries.get(key)
            except TypeError:  # an unhashable constexpr value
                entry = None
            if (
                entry is not None
                and not kernel.pre_run_hooks
                and _hooks_idle()
                and (not info.globals or _globals_ok(info.globals))
            ):
                launcher, function, prefix = entry
                try:
                    n = len(grid)
                except TypeError:  # a callable grid (Triton's other form): the plain way
                    _plain(kernel, grid, kwargs)
                    return
                try:
                    launcher(
                        grid[0],
                        grid[1] if n > 1 else 1,
                        grid[2] if n > 2 else 1,
                        info.get_stream(dev),
                        function,
                        *prefix,
                        *args,
                    )
                except TypeError:
                    pass  # rejected before enqueueing anything: below, outside this block
                else:
                    info.fast += 1
                    if (record := _launch_recorder) is not None:
                        record(function, grid, dev, args)
                    return
                # An entry is found by its hit key only where that is its exact key.
                _launcher_rejected(info.entries, key, kernel, grid, kwargs)
                return
    _launch_cached_slow(info, kernel, grid, kwargs)


def _launch_cached_slow(
    info: _KernelInfo, kernel: Any, grid: tuple[int, ...], kwargs: dict[str, Any]
) -> None:
    if not info.live or callable(grid) or kernel.pre_run_hooks or not _hooks_idle():
        _plain(kernel, grid, kwargs)
        return
    names = tuple(kwargs)
    xplan = info.xplans.get(names, _MISSING)
    if xplan is _MISSING:
        plans = _make_plans(info, names)
        with _lock:
            if len(info.plans) >= _MAX_PLANS_PER_KERNEL:
                info.plans.clear()
                info.xplans.clear()
            info.plans[names], info.xplans[names] = plans if plans is not None else (None, None)
        xplan = None if plans is None else plans[1]
    if xplan is None:
        _plain(kernel, grid, kwargs)
        return
    dev = info.get_device()
    try:
        key, args = xplan(kwargs, dev)
        entry = info.entries.get(key, _MISSING)
    except TypeError:  # an unhashable constexpr value
        _plain(kernel, grid, kwargs)
        return
    if entry is not None and entry is not _MISSING:  # a key no hit key equals (or a race)
        if info.globals and not _globals_ok(info.globals):
            _plain(kernel, grid, kwargs)  # a changed global: Triton raises its own error
        elif not _fast_launch(info, entry, grid, dev, args):
            _launcher_rejected(info.entries, key, kernel, grid, kwargs)
        return
    if entry is None or any(k is NotImplemented for k in key):
        # A key whose cached launcher was rejected, or an argument type we do not key:
        # Triton decides (and raises its own error where it should).
        _plain(kernel, grid, kwargs)
        return
    compiled = _plain(kernel, grid, kwargs)
    parts = _compiled_parts(info, compiled)
    if parts is not None and info.live:
        _store(info, info.entries, key, parts)


def _stale(st: _BoundState, kernel: Any) -> bool:
    """``st`` is bound to a ``_KernelInfo`` that ``clear_launch_cache()`` dropped after
    ``_setup`` read it and before ``_setup`` stored the state (another thread's clear): such a
    state would keep the kernel on the plain path until the next clear."""
    return not st.info.live and _infos.get(id(kernel)) is not st.info


class _BoundState:
    """What a ``CachedKernel`` needs per call, built on its first launch."""

    __slots__ = (
        "entries",
        "get_device",
        "get_stream",
        "info",
        "keyfn",
        "n_runtime",
        "rkeyfn",
        "xkeyfn",
    )

    def __init__(
        self,
        info: _KernelInfo,
        keyfn: Callable[..., Any],
        xkeyfn: Callable[..., Any],
        rkeyfn: Callable[..., Any],
        n_runtime: int,
    ):
        self.info = info
        # exact key -> (launcher, function, prefix, constexpr tail); None: plain launches
        self.entries: dict[Any, tuple[Any, Any, Any, tuple[Any, ...]] | None] = {}
        self.keyfn = keyfn  # (device, *runtime_args, **constexprs) -> hit key
        self.xkeyfn = xkeyfn  # the same -> exact key
        self.rkeyfn = rkeyfn  # (device, *runtime_args) -> key of the runtime arguments only
        self.get_device = info.get_device
        self.get_stream = info.get_stream
        self.n_runtime = n_runtime


class CachedKernel:
    """A ``@triton.jit`` kernel bound once (at import) for cheap repeated launches.

    ``ck(grid, *runtime_args, **constexprs)``: the kernel's non-constexpr parameters
    positionally, in signature order (all of them), then its constexprs and launch options
    (``num_warps`` ...) by keyword (constexprs with a default may be left out). Requires a
    signature whose constexprs all come after the runtime parameters; otherwise (and wherever
    ``launch_cached`` would) it launches the plain way, with the same results.

    The per-call work on a cache hit is one generated key expression (tensor dtypes and
    alignments, int classes of the parameters Triton specializes on, the constexpr items), a
    dict lookup and the native launcher call.

    Example:
        >>> # at module level
        >>> _merge = CachedKernel(_merge_kernel)  # doctest: +SKIP
        >>> _merge((b, h), out, x, n, stride, BLOCK=128, num_warps=4)  # doctest: +SKIP
    """

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self._state: _BoundState | None = None
        self._reason: str | None = None
        try:
            params = kernel.params
            self.runtime_names: tuple[str, ...] = tuple(
                p.name for p in params if not p.is_constexpr
            )
            self.constexpr_names: tuple[str, ...] = tuple(p.name for p in params if p.is_constexpr)
            self._trailing = all(
                p.is_constexpr for p in params[len(self.runtime_names) :]
            ) and not any(p.is_constexpr for p in params[: len(self.runtime_names)])
        except Exception:  # the interpreter's objects, autotuners, ...: plain launches
            names = inspect.signature(getattr(kernel, "fn", kernel)).parameters
            self.runtime_names = tuple(names)
            self.constexpr_names = ()
            self._trailing = False
        with _lock:
            _bound.add(self)

    def __repr__(self) -> str:
        return f"CachedKernel({getattr(self.kernel, '__name__', self.kernel)!r})"

    def __call__(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        """Launch on ``grid``; see the class docstring for the argument convention."""
        st = self._state
        if st is not None:
            dev = st.get_device()
            try:
                entry = st.entries.get(st.keyfn(dev, *args, **constexprs))
            except TypeError:  # wrong arguments, or an unhashable constexpr
                entry = None
            if (
                entry is not None
                and st.info.live
                and not self.kernel.pre_run_hooks
                and _hooks_idle()
                and (not st.info.globals or _globals_ok(st.info.globals))
            ):
                launcher, function, prefix, tail = entry
                try:
                    n = len(grid)
                except TypeError:  # a callable grid (Triton's other form): the plain way
                    _plain(self.kernel, grid, self._kwargs(args, constexprs))
                    return
                try:
                    launcher(
                        grid[0],
                        grid[1] if n > 1 else 1,
                        grid[2] if n > 2 else 1,
                        st.get_stream(dev),
                        function,
                        *prefix,
                        *args,
                        *tail,
                    )
                except TypeError:
                    pass  # rejected before enqueueing anything: below, outside this block
                else:
                    st.info.fast += 1
                    if (record := _launch_recorder) is not None:
                        record(function, grid, dev, (*args, *tail))
                    return
                key = st.keyfn(dev, *args, **constexprs)
                _launcher_rejected(
                    st.entries, key, self.kernel, grid, self._kwargs(args, constexprs)
                )
                return
        self._slow(grid, args, constexprs)

    def _kwargs(self, args: tuple[Any, ...], constexprs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > len(self.runtime_names):
            raise TypeError(
                f"{self!r} takes {len(self.runtime_names)} runtime arguments "
                f"{self.runtime_names}, got {len(args)}"
            )
        kwargs = dict(zip(self.runtime_names, args, strict=False))
        kwargs.update(constexprs)
        return kwargs

    def _setup(self) -> _BoundState | None:
        """Build the per-call state (``None`` with ``_reason`` set when plain launches only)."""
        if not _enabled:
            return None
        info = _infos.get(id(self.kernel))
        if info is None or info.fn is not self.kernel:
            info = _info_for(self.kernel)
        if not info.usable:
            self._reason = info.reason or launch_fast_path_reason(self.kernel)
            return None
        if not self._trailing:
            self._reason = "constexpr parameters must all follow the runtime parameters"
            return None
        ns: dict[str, Any] = {"_T": _Tensor, "_cls": _arg_class, "_xv": _exact_value}
        kw_names = self.constexpr_names
        for i, n in enumerate(kw_names):
            ns[f"_cpattn_d{i}"] = info.defaults.get(n, _MISSING)
        local = [f"_cpattn_a{i}" for i in range(len(self.runtime_names))]
        # Runtime arguments by class, constexprs by type and value, launch options by value
        # (Triton parses them into the same options whatever their Python type).
        key = "".join(
            _key_expr(v, info.kinds[n]) for v, n in zip(local, self.runtime_names, strict=True)
        )
        key += "".join(_key_expr(n, _VALUE) for n in kw_names)
        params = ", ".join(
            [
                "_cpattn_dev",
                *local,
                *(["*"] if kw_names else []),
                *(f"{n}=_cpattn_d{i}" for i, n in enumerate(kw_names)),
                "**_cpattn_opts",
            ]
        )
        xkey = "".join(
            _key_expr(v, info.kinds[n], exact=True)
            for v, n in zip(local, self.runtime_names, strict=True)
        )
        xkey += "".join(_key_expr(n, _VALUE, exact=True) for n in kw_names)
        src = f"def keyfn({params}):\n    return (_cpattn_dev, {key}*_cpattn_opts.items())\n"
        src += f"def xkeyfn({params}):\n    return (_cpattn_dev, {xkey}*_cpattn_opts.items())\n"
        rkey = "".join(
            _key_expr(v, info.kinds[n]) for v, n in zip(local, self.runtime_names, strict=True)
        )
        rparams = ", ".join(["_cpattn_dev", *local])
        src += f"def rkeyfn({rparams}):\n    return (_cpattn_dev, {rkey})\n"
        exec(src, ns)
        st = _BoundState(info, ns["keyfn"], ns["xkeyfn"], ns["rkeyfn"], len(self.runtime_names))
        self._state = st
        return st

    def specialize(self, **constexprs: Any) -> Specialization:
        """The kernel with its constexprs and launch options fixed: ``spec(grid, *runtime_args)``.

        Create one per configuration and keep it (e.g. in an ``lru_cache``): a launch then keys
        only the runtime arguments (tensor dtypes / alignments, specialized ints).
        """
        return Specialization(self, constexprs)

    def _prepare(
        self, st: _BoundState | None, args: tuple[Any, ...], constexprs: dict[str, Any]
    ) -> tuple[Any, ...] | None:
        """The constexpr values in signature order (the launcher's tail) if this call may take
        the fast path once compiled, else ``None``."""
        if (
            st is None
            or not st.info.live
            or len(args) != st.n_runtime
            or self.kernel.pre_run_hooks
            or not _hooks_idle()
        ):
            return None
        kinds = st.info.kinds
        if any(
            (n in kinds and kinds[n] != _VALUE) or (n not in kinds and n not in _OPTION_NAMES)
            for n in constexprs
        ):
            return None  # a runtime parameter by keyword, an unknown name
        defaults = st.info.defaults
        tail = tuple(constexprs.get(n, defaults.get(n, _MISSING)) for n in self.constexpr_names)
        if any(v is _MISSING or isinstance(v, torch.Tensor) for v in tail):
            return None
        return tail

    def _compile_into(
        self,
        st: _BoundState,
        table: dict[Any, Any],
        key: Any,
        dev: int,
        args: tuple[Any, ...],
        tail: tuple[Any, ...],
        grid: tuple[int, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Launch the entry under the exact ``key`` if there is one; else plain launch
        (compiling if needed), then cache its compiled kernel under ``key``."""
        try:
            entry = table.get(key, _MISSING)
        except TypeError:  # an unhashable constexpr value
            entry = key = NotImplemented
        if entry is not None and entry is not _MISSING and entry is not NotImplemented:
            # A key no hit key equals (or a race): the hooks were checked by _prepare.
            info = st.info
            if info.globals and not _globals_ok(info.globals):
                _plain(self.kernel, grid, kwargs)  # a changed global: Triton raises its error
            elif not _fast_launch(info, entry, grid, dev, (*args, *tail)):
                _launcher_rejected(table, key, self.kernel, grid, kwargs)
            return
        if entry is None or key is NotImplemented or any(k is NotImplemented for k in key):
            # A key whose cached launcher was rejected, an argument we do not key: Triton
            # decides (and raises its own error where it should).
            _plain(self.kernel, grid, kwargs)
            return
        compiled = _plain(self.kernel, grid, kwargs)
        parts = _compiled_parts(st.info, compiled)
        if parts is not None and st.info.live:
            _store(st.info, table, key, (*parts, tail))

    def _slow(
        self, grid: tuple[int, ...], args: tuple[Any, ...], constexprs: dict[str, Any]
    ) -> None:
        if callable(grid):  # Triton's other form of grid: always the plain way
            _plain(self.kernel, grid, self._kwargs(args, constexprs))
            return
        st = self._state
        if (
            st is not None
            and st.info.live
            and not self.kernel.pre_run_hooks
            and _hooks_idle()
            and (not st.info.globals or _globals_ok(st.info.globals))
        ):
            # A call whose hit key is not its exact key (a zero or NaN float constexpr, a
            # tuple ...): its entry by the exact key, under the hit path's own checks.
            dev = st.get_device()
            try:
                key = st.xkeyfn(dev, *args, **constexprs)
                entry = st.entries.get(key)
            except TypeError:  # wrong arguments, or an unhashable constexpr
                entry = None
            if entry is not None:
                if not _fast_launch(st.info, entry, grid, dev, (*args, *entry[3])):
                    kwargs = self._kwargs(args, constexprs)
                    _launcher_rejected(st.entries, key, self.kernel, grid, kwargs)
                return
        kwargs = self._kwargs(args, constexprs)
        if (st is None or _stale(st, self.kernel)) and self._reason is None and _enabled:
            st = self._setup()
        tail = self._prepare(st, args, constexprs)
        if st is None or tail is None:
            _plain(self.kernel, grid, kwargs)
            return
        dev = st.get_device()
        try:
            key = st.xkeyfn(dev, *args, **constexprs)
        except TypeError:
            key = NotImplemented
        self._compile_into(st, st.entries, key, dev, args, tail, grid, kwargs)


class Specialization:
    """``CachedKernel.specialize(**constexprs)``: launch with ``spec(grid, *runtime_args)``."""

    __slots__ = ("_st", "constexprs", "entries", "kernel")

    def __init__(self, kernel: CachedKernel, constexprs: dict[str, Any]):
        self.kernel = kernel
        self.constexprs = dict(constexprs)
        # runtime-argument key -> (launcher, function, prefix, constexpr tail); None: plain
        self.entries: dict[Any, tuple[Any, Any, Any, tuple[Any, ...]] | None] = {}
        self._st: _BoundState | None = None

    def __repr__(self) -> str:
        return f"{self.kernel!r}.specialize(**{self.constexprs!r})"

    def __call__(self, grid: tuple[int, ...], *args: Any) -> None:
        """Launch on ``grid`` with the runtime arguments positionally, in signature order."""
        st = self._st
        if st is not None and st is self.kernel._state:
            dev = st.get_device()
            try:
                entry = self.entries.get(st.rkeyfn(dev, *args))
            except TypeError:  # wrong argument count
                entry = None
            if (
                entry is not None
                and st.info.live
                and not self.kernel.kernel.pre_run_hooks
                and _hooks_idle()
                and (not st.info.globals or _globals_ok(st.info.globals))
            ):
                launcher, function, prefix, tail = entry
                try:
                    n = len(grid)
                except TypeError:  # a callable grid (Triton's other form): the plain way
                    _plain(self.kernel.kernel, grid, self.kernel._kwargs(args, self.constexprs))
                    return
                try:
                    launcher(
                        grid[0],
                        grid[1] if n > 1 else 1,
                        grid[2] if n > 2 else 1,
                        st.get_stream(dev),
                        function,
                        *prefix,
                        *args,
                        *tail,
                    )
                except TypeError:
                    pass  # rejected before enqueueing anything: below, outside this block
                else:
                    st.info.fast += 1
                    if (record := _launch_recorder) is not None:
                        record(function, grid, dev, (*args, *tail))
                    return
                ck = self.kernel
                kwargs = ck._kwargs(args, self.constexprs)
                _launcher_rejected(self.entries, st.rkeyfn(dev, *args), ck.kernel, grid, kwargs)
                return
        self._slow(grid, args)

    def _slow(self, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
        ck = self.kernel
        kwargs = ck._kwargs(args, self.constexprs)
        if callable(grid):  # Triton's other form of grid: always the plain way
            _plain(ck.kernel, grid, kwargs)
            return
        st = ck._state
        if (st is None or _stale(st, ck.kernel)) and ck._reason is None and _enabled:
            st = ck._setup()
        if st is not self._st:  # first call, or the cache was cleared: forget old entries
            self.entries.clear()
            self._st = st
        tail = ck._prepare(st, args, self.constexprs)
        if st is None or tail is None:
            _plain(ck.kernel, grid, kwargs)
            return
        dev = st.get_device()
        try:
            key = st.rkeyfn(dev, *args)  # no constexpr in it: the hit key is the exact key
        except TypeError:
            key = NotImplemented
        ck._compile_into(st, self.entries, key, dev, args, tail, grid, kwargs)
