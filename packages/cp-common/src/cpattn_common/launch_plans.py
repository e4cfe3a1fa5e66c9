"""Launch plans: an op's repeated eager calls replayed from native code.

An eager call of our ops spends most of its host time in Python: validating its arguments,
allocating its outputs, finding its grid and compiled kernel, and Triton's launcher
(2-3.5x a torch ``add_`` on an H200 host, where the launch alone is about 1x). A *launch plan*
removes all of that from repeated calls. The second eager call with a given *call key* (every
argument's metadata: for a tensor its exact class, dtype, device, sizes, strides, pointer
alignment mod 16 and neg/conj bits; for an int / bool / float its value; ``None``) runs the
op's Python path under a recorder (not the first: a recording costs several Python-path
calls, 63-106 µs against 14-24 µs on an H200 host, so keys met only once, such as one-off
prefill shapes, never pay for one), which notes the outputs the call allocated
(``cpattn_common.alloc``) and the compiled kernels it launched (``cpattn_common.launch``'s
cached fast path), with every launch parameter tied to an argument's pointer, an output's
pointer or a constant. Later calls with the same key go to native code
(``csrc/launch_plans.cpp``): build the key, look the plan up, allocate, ``cuLaunchKernel``
each kernel on the current stream. A call whose key has no plan takes the Python path
unchanged, and a replay computes bit for bit what the Python path computes. Measured on an
H200 host (docs/performance-notes.md, "Host overhead"): a replayed call costs 1.0-1.4x an
eager ``add_`` for the ops that allocate (0.65-0.75x for the in-place mask), against 2.0-3.6x
for their Python paths.

**On by default where they can work** (``CPATTN_LAUNCH_PLANS`` unset or ``auto``). The first
op call of the process checks for a CUDA device and Triton's cached launch path; with both, a
background thread builds the native module (``cpattn_common.native_build``: a C++ compiler,
torch's headers; 15-19 s the first time on an H200 host, then loaded from the on-disk cache
within the first op call) while calls take the Python path; once it is loaded, calls are recorded
and replayed. Without a CUDA device, under ``TRITON_INTERPRET=1`` or when the build fails,
plans stay off (a failed build logs one warning) and ``launch_plans_reason()`` says why.
``CPATTN_LAUNCH_PLANS=1`` (read at import) or ``set_launch_plans_enabled(True)`` builds or
loads the module at once, in the calling thread; ``CPATTN_LAUNCH_PLANS=0`` or
``set_launch_plans_enabled(False)`` turns plans off.

**Which calls are recorded.** An op opts in explicitly, and only for a branch of its eager path
that is a pure function of the call key: it allocates through ``cpattn_common.alloc``,
launches through ``CachedKernel`` / ``Specialization`` / ``launch_cached``, and derives every
grid and scalar kernel argument from the arguments' metadata and scalar values. The recorder
refuses (the call still completes in Python) when anything else happens: a launch that did
not take the cached fast path (the first, compiling call of a configuration), a torch
operation other than an allocation or a view (a copy, a fill: output poisoning is such a fill),
a kernel pointer that is neither an argument, an output nor a view of exactly one of them, two
tensor arguments sharing storage, a compiled kernel needing more than a plain
``cuLaunchKernel`` (clusters, cooperative or PDL launches, scratch memory), a plan the native
module rejects. After ``_MAX_FAILURES`` refusals a key is not recorded again. Allocations and
launches of other threads during a recording are not part of the call and are ignored; one
recording runs at a time, and while it runs no call replays (in any thread), so an opted-in op
called inside the recorded one takes its Python path, which the recording sees. A launch that
bypasses ``cpattn_common.launch`` (a bare ``kernel[grid](...)``) is invisible to the recorder:
a recorded branch must not contain one. Nothing a recording does raises into the op call.

**What a replay does not do.** It does not call Triton's launch hooks (while any is installed,
and while output poisoning is on, calls take the Python path and are not recorded, so
profilers see Python-path launches and poisoned outputs stay poisoned; afterwards plans
resume), does not make a CUDA context current (a thread with none takes the Python path,
whose launcher does), does not re-read module knobs, Triton settings, a kernel's
``pre_run_hooks`` or ``set_launch_cache_enabled`` (call ``clear_launch_plans()`` after
changing them), and launches on the current device's current stream like the Python path
(CUDA-graph capturable). A call with a CUDA tensor on another device than the current one has
no key: it takes the Python path, which makes the tensors' device current before it launches
(``cpattn_common.device``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import struct
import sys
import threading
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cpattn_common import alloc as _alloc
from cpattn_common import launch as _launch
from cpattn_common import native_build as _native_build
from cpattn_common.interpret import triton_interpreting

__all__ = [
    "OpPlans",
    "Recorder",
    "clear_launch_plans",
    "launch_plans_info",
    "launch_plans_reason",
    "set_launch_plans_enabled",
]

_log = logging.getLogger(__name__)

#: Failed recordings of one key after which it is not recorded again.
_MAX_FAILURES = 3
# Bump when the native source changes incompatibly (it is part of the module's build name).
_NATIVE_NAME = "cpattn_launch_plans_v4"
_SOURCE = Path(__file__).resolve().parent / "csrc" / "launch_plans.cpp"

# Parameter kinds of the native plan (csrc/launch_plans.cpp, ParamKind).
_ARG_PTR, _OUT_PTR, _CONST = 0, 1, 2
_INT_TYPES = frozenset({"i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64"})

_WAITING = "auto: waiting for the first op call"
_ext: Any = None
_reason: str | None = _WAITING
# Auto mode's state: "waiting" (for the first op call), "building" (in a background thread),
# None (decided, or plans set explicitly).
_auto: str | None = "waiting"
_auto_thread: threading.Thread | None = None
# Bumped by every explicit set_launch_plans_enabled, so that a background build finishing
# later does not override it.
_generation = 0
_build_lock = threading.Lock()
_ops: dict[str, int] = {}
_handles: weakref.WeakSet[OpPlans] = weakref.WeakSet()
_active: Recorder | None = None
_lock = threading.Lock()
_stats = {"recorded": 0, "refusals": 0}
_last_refusal: dict[str, str] = {}
_describe_cache: dict[int, _KernelDesc | None] = {}


def _off(*args: Any) -> None:
    """``OpPlans.replay`` while plans are off: always a miss."""
    return None


def _auto_start(*args: Any) -> None:
    """``OpPlans.replay`` in auto mode until the first op call: decides whether plans can work
    here and, if so, starts building the native module in the background. Always a miss."""
    global _auto, _auto_thread, _reason
    with _lock:
        if _auto != "waiting":
            return None
        # This runs inside an op call: nothing here may raise into it.
        try:
            blocker = _auto_blocker()
        except Exception as exc:
            blocker = f"the check failed ({type(exc).__name__}: {exc})"
        if blocker is None:
            try:
                thread = threading.Thread(
                    target=_auto_build, args=(_generation,), name="cpattn-launch-plans", daemon=True
                )
                thread.start()
                _auto_thread = thread
            except RuntimeError as exc:  # no thread can be started
                blocker = f"no build thread ({exc})"
        if blocker is None:
            _auto, _reason = "building", "auto: building the native module in the background"
        else:
            _auto, _reason = None, f"auto: {blocker}"
        _rebind()
    return None


def _auto_blocker() -> str | None:
    """Why plans cannot work in this process (``None`` when they can)."""
    if not sys.platform.startswith("linux"):
        return f"launch plans need Linux (this is {sys.platform})"
    if triton_interpreting():
        return "TRITON_INTERPRET=1 (the interpreter launches kernels itself)"
    if getattr(torch.version, "hip", None):
        return "this torch is built for ROCm (plans launch through the CUDA driver)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    why = _launch.launch_fast_path_reason()
    return None if why is None else f"Triton's cached launch path is off ({why})"


def _auto_build(generation: int) -> None:
    """The background thread of auto mode: build or load the native module, then turn plans
    on (unless plans were set explicitly meanwhile)."""
    global _auto
    ext: Any = None
    reason: str | None = None
    try:
        ext = _native_module()
    except Exception as exc:
        reason = f"auto: {_unavailable(exc)}"
    with _lock:
        if generation != _generation:
            return
        _auto = None
        _set(ext, reason)


class OpPlans:
    """The launch plans of one op: ``replay(*args)`` and ``recorder(hit, *args)``.

    Create one per op at import (``_plans = OpPlans("pkg.op")``). In the op's eager path::

        hit = _plans.replay(a, b, n) if _plans.on else None  # tuple (hit), None, False (refused)
        if hit.__class__ is tuple:
            return hit[0]
        ...validation, which raises on bad input...
        rec = _plans.recorder(hit, a, b, n) if _plans.on else None  # None: do not record
        if rec is None:
            return _impl(a, b, n)
        with rec:
            out = _impl(a, b, n)
            rec.returns(out)                     # the allocated outputs the plan returns
        return out

    The arguments given to ``replay`` and ``recorder`` are the call key's: everything the
    op's behaviour depends on, in the same order in both.

    ``replay(*args)`` returns the plan's outputs (a tuple) on a hit, ``None`` on a miss to
    record (the key's second call; also plans off) and ``False`` on a miss not to record (the
    key's first call, a refused key, arguments plans do not key, output poisoning on, a Triton
    launch hook installed, a thread with no current CUDA context yet). With plans on it is the
    native function itself, bound to this op (no Python frame between the op and the native
    look-up).
    """

    __slots__ = ("__weakref__", "name", "on", "op_id", "replay")

    def __init__(self, name: str):
        self.name = name
        #: Whether an op calls ``replay`` / ``recorder``: with plans off its eager path
        #: pays one attribute read. (True also in auto mode until the first op call.)
        self.on = False
        self.replay: Any = _off
        with _lock:
            self.op_id = _ops.setdefault(name, len(_ops))
            self._bind()
            _handles.add(self)

    def _bind(self) -> None:
        """Bind ``replay`` and ``on`` to the module state (the caller holds ``_lock``)."""
        if _ext is not None:
            self.replay = functools.partial(_ext.replay, self.op_id)
        else:
            self.replay = _auto_start if _auto == "waiting" else _off
        self.on = self.replay is not _off

    def __repr__(self) -> str:
        return f"OpPlans({self.name!r})"

    def recorder(self, hit: object, *args: Any) -> Recorder | None:
        """A recorder for this call (use as a context manager), or ``None`` when the call
        should not be recorded: plans off, ``hit`` (what ``replay`` returned) not ``None``,
        a recording already running (in any thread: one records at a time; a recorder that
        loses that race at ``__enter__`` records nothing)."""
        if hit is not None or _ext is None or _active is not None:
            return None
        return Recorder(self, args)


class _KernelDesc:
    """What a native launch of one compiled kernel needs; holds the compiled kernel, so that
    its module (and the function handle plans launch) stays loaded while plans may use it."""

    __slots__ = ("block", "compiled", "scratch", "shared", "types")

    def __init__(
        self, compiled: Any, types: tuple[str, ...], block: int, shared: int, scratch: int
    ):
        self.compiled = compiled
        self.types = types
        self.block = block
        self.shared = shared
        self.scratch = scratch


def _ptx_param_count(ptx: str) -> int | None:
    m = re.search(r"\.entry\s+[\w$]+\s*\((.*?)\)", ptx, re.S)
    return None if m is None else len(re.findall(r"\.param\s", m.group(1)))


#: The most shared memory per block a plain ``cuLaunchKernel`` of a Triton kernel may use.
_MAX_PLAIN_SHARED_BYTES = 228 * 1024


def _describe(function: int) -> _KernelDesc | None:
    """The launch description of the compiled kernel behind ``function`` (``None`` when a
    plain ``cuLaunchKernel`` cannot launch it, or it is unknown)."""
    if function in _describe_cache:
        return _describe_cache[function]
    desc = None
    compiled = _launch._compiled_kernels.get(function)
    if compiled is None:
        # Unknown now, not for good: a clear_launch_cache() in another thread between the
        # recorded launch and this commit drops it, and Triton's JIT cache hands the same
        # function back later. Remembered, the answer would refuse every later recording.
        return None
    try:
        md = compiled.metadata
        plain = (
            # Triton launches a kernel of more shared memory with a launch attribute
            # (oversized shared memory, Triton 3.9's launcher) a plain launch lacks.
            int(md.shared) <= _MAX_PLAIN_SHARED_BYTES
            and getattr(md, "num_ctas", 1) == 1
            and all(d == 1 for d in getattr(md, "cluster_dims", (1, 1, 1)))
            and not getattr(md, "launch_cooperative_grid", False)
            and not getattr(md, "launch_pdl", False)
            and not getattr(md, "global_scratch_size", 0)
            and not getattr(md, "profile_scratch_size", 0)
        )
        types = tuple(str(t) for t in compiled.src.signature.values())
        known = all(
            t == "constexpr" or t.startswith("*") or t in _INT_TYPES or t in ("fp32", "fp64")
            for t in types
        )
        n_ptx = _ptx_param_count(compiled.asm["ptx"])
        n_runtime = sum(t != "constexpr" for t in types)
        if plain and known and n_ptx is not None and 0 <= n_ptx - n_runtime <= 4:
            block = 32 * int(md.num_warps)
            desc = _KernelDesc(compiled, types, block, int(md.shared), n_ptx - n_runtime)
    except Exception:
        desc = None
    _describe_cache[function] = desc
    return desc


class _Refused(Exception):
    pass


# Views and allocations: the only torch operations a recorded call may run.
_ALLOWED_OPS = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "empty",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "view",
        "_unsafe_view",
        "squeeze",
        "unsqueeze",
        "as_strided",
        "expand",
        "select",
        "slice",
        "t",
        "transpose",
        "permute",
        "alias",
        "detach",
        "unflatten",
        "split",
        "chunk",
        "unbind",
    )
)


class _OpGuard(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
    """Refuses the recording on any torch operation other than an allocation or a view."""

    def __init__(self, recorder: Recorder):
        super().__init__()  # type: ignore[no-untyped-call]
        self.recorder = recorder

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.overloadpacket not in _ALLOWED_OPS:
            self.recorder.refuse(f"ran the torch operation {func}")
        elif func.overloadpacket is torch.ops.aten.as_strided and (
            len(args) > 3 or (kwargs or {}).get("storage_offset") is not None
        ):
            # An absolute storage offset: the view's pointer does not follow its base's, which
            # a plan records as an offset from the base's (and the key holds no storage offset).
            self.recorder.refuse("a view with an explicit storage offset")
        return func(*args, **(kwargs or {}))


class Recorder:
    """Notes one eager call's allocations and launches and turns them into a plan on exit.

    Made by ``OpPlans.recorder``; see ``OpPlans`` for the use. Refusing (any reason in the
    module docstring) never changes what the call computes.
    """

    def __init__(self, plans: OpPlans, args: tuple[Any, ...]):
        self.plans = plans
        self.args = args
        self.allocs: list[torch.Tensor] = []
        self.launches: list[tuple[int, tuple[int, ...], int, tuple[Any, ...]]] = []
        self.returned: tuple[torch.Tensor, ...] | None = None
        self.reason: str | None = None
        self._thread = threading.get_ident()
        self._guard: _OpGuard | None = None
        self._inert = False  # another recording was running at __enter__: record nothing

    def refuse(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def returns(self, *outputs: torch.Tensor) -> None:
        """The allocated outputs a replay returns, in this order."""
        self.returned = outputs

    def __enter__(self) -> Recorder:
        global _active
        with _lock:
            if _active is not None:  # another thread started one since recorder() looked
                self._inert = True
                return self
            _active = self
        _alloc._recorder = self._on_alloc
        _launch._launch_recorder = self._on_launch
        self._guard = _OpGuard(self)
        self._guard.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _active
        if self._inert:
            return
        try:
            if self._guard is not None:
                self._guard.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
        finally:
            _alloc._recorder = None
            _launch._launch_recorder = None
            with _lock:
                _active = None
        if exc_type is None:
            self._commit()

    # The hooks are process-wide, but the call being recorded runs in this recorder's thread
    # (its op guard is thread-local too): other threads' allocations and launches are not part
    # of it and are ignored (Triton releases the GIL while it launches, so they do happen).
    def _on_alloc(self, tensor: torch.Tensor) -> None:
        if threading.get_ident() == self._thread:
            self.allocs.append(tensor)

    def _on_launch(
        self, function: int | None, grid: tuple[int, ...], device: int, all_args: tuple[Any, ...]
    ) -> None:
        if threading.get_ident() != self._thread:
            return
        if function is None:
            self.refuse("a launch did not take the cached fast path")
        else:
            self.launches.append((function, grid, device, all_args))

    def _commit(self) -> None:
        """Register the plan, or count a refusal; runs at the end of an op call, so nothing
        may raise out of it (a plan the native module rejects is a refusal too)."""
        ext = _ext
        if ext is None:
            return
        if self.reason is None:
            try:
                device, allocs, launches, returns = self._plan(ext)
                ext.register(self.plans.op_id, device, self.args, allocs, launches, returns)
                _stats["recorded"] += 1
                return
            except _Refused as exc:
                self.reason = str(exc)
            except Exception as exc:  # e.g. a constant a kernel parameter cannot hold
                self.reason = f"the plan could not be built ({type(exc).__name__}: {exc})"
        _stats["refusals"] += 1
        _last_refusal[self.plans.name] = self.reason or "unknown"
        with contextlib.suppress(Exception):
            ext.refuse(self.plans.op_id, self.args, _MAX_FAILURES)

    def _plan(self, ext: Any) -> tuple[int, list[Any], list[Any], list[int]]:
        if self.returned is None:
            raise _Refused("the op did not say what it returns")
        if not self.launches:
            raise _Refused("no kernel launch")
        args = [(i, a) for i, a in enumerate(self.args) if type(a) is torch.Tensor]
        # A kernel reaches host memory only when it is pinned, which a plan key does not tell
        # from pageable memory: a plan of a pinned tensor would replay for a pageable one of
        # the same key (an illegal address), where Triton's launcher raises ValueError.
        if any(a.device.type == "cpu" and a.is_pinned() for _, a in args):
            raise _Refused("a pinned host tensor argument")
        storages = [a.untyped_storage().data_ptr() for _, a in args]
        if len({s for s in storages if s}) != sum(1 for s in storages if s):
            raise _Refused("two tensor arguments share storage")
        allocs = []
        for t in self.allocs:
            like = next((i for i, a in args if a.device == t.device), None)
            if like is None:
                raise _Refused("an allocation on a device no tensor argument is on")
            if not t.is_contiguous():
                raise _Refused("a non-contiguous allocation")
            allocs.append((tuple(t.shape), ext.dtype_code(t), like))
        returns = []
        for r in self.returned:
            j = next((j for j, t in enumerate(self.allocs) if t is r), None)
            if j is None:
                raise _Refused("a returned tensor was not allocated by the call")
            returns.append(j)
        devices = {dev for _, _, dev, _ in self.launches}
        if len(devices) != 1:
            raise _Refused("launches on several devices")
        # What a kernel pointer may be: an argument or an allocation (or a view of one).
        owners = [(_ARG_PTR, i, a) for i, a in args]
        owners += [(_OUT_PTR, j, t) for j, t in enumerate(self.allocs)]
        launches = [
            self._launch(owners, f, grid, args_)
            for f, grid, _, args_ in self.launches
            if 0 not in grid  # Triton launches nothing for an empty grid; nor does a replay
        ]
        return devices.pop(), allocs, launches, returns

    def _launch(
        self,
        owners: list[tuple[int, int, torch.Tensor]],
        function: int,
        grid: tuple[int, ...],
        all_args: tuple[Any, ...],
    ) -> tuple[int, tuple[int, int, int], int, int, list[tuple[int, int, int]]]:
        desc = _describe(function)
        if desc is None:
            raise _Refused("a compiled kernel a plain cuLaunchKernel cannot launch")
        if len(desc.types) != len(all_args):
            raise _Refused("a launch's arguments do not match its compiled signature")
        params: list[tuple[int, int, int]] = []
        for ty, v in zip(desc.types, all_args, strict=True):
            if ty == "constexpr":
                continue
            if ty.startswith("*"):
                if v is None:
                    params.append((_CONST, 0, 0))
                elif isinstance(v, torch.Tensor):
                    params.append(_pointer(v, owners))
                else:
                    raise _Refused(f"a pointer argument of type {type(v).__name__}")
            elif ty in _INT_TYPES:
                if type(v) not in (int, bool):
                    raise _Refused(f"an integer argument of type {type(v).__name__}")
                params.append((_CONST, 0, _as_int64(int(v))))
            elif ty == "fp32":
                params.append((_CONST, 0, struct.unpack("<I", struct.pack("<f", float(v)))[0]))
            else:  # fp64
                params.append((_CONST, 0, struct.unpack("<q", struct.pack("<d", float(v)))[0]))
        params += [(_CONST, 0, 0)] * desc.scratch
        g = (*grid, 1, 1)
        return function, (int(g[0]), int(g[1]), int(g[2])), desc.block, desc.shared, params


def _pointer(t: torch.Tensor, owners: list[tuple[int, int, torch.Tensor]]) -> tuple[int, int, int]:
    """A tensor launch argument as (kind, index, byte offset): one of ``owners`` itself, else
    a view of the only one sharing its storage."""
    for kind, index, a in owners:
        if t is a:
            return (kind, index, 0)
    storage = t.untyped_storage().data_ptr()
    sharing = [o for o in owners if storage and o[2].untyped_storage().data_ptr() == storage]
    if len(sharing) != 1:
        raise _Refused("a kernel pointer that is not a view of exactly one argument or output")
    kind, index, base = sharing[0]
    return (kind, index, t.data_ptr() - base.data_ptr())


def _as_int64(v: int) -> int:
    """``v`` as the int64 with the same low 64 bits (u64 values above 2**63 wrap)."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _runtime_getters() -> tuple[Any, ...]:
    """What the native module reads as the cached Triton launches do: the current-device and
    current-stream getters, ``cpattn_common.alloc``'s namespace (its poison value) and
    Triton's launch-hook knobs with the HookChain type (a replay waits while a hook is on)."""
    rt = _launch._get_runtime()
    knobs = _launch._knobs_rt if rt.reason is None else None
    tail = (vars(_alloc), knobs, _launch._chain_type)
    try:
        from triton.runtime import driver

        active = driver.active
        device = _launch._fast_device_getter(active.get_current_device)
        return (device, active.get_current_stream, *tail)
    except Exception:  # no GPU driver (CPU machines): plans are never recorded there
        return ((lambda: -1), (lambda device: 0), *tail)


def _load() -> Any:
    ext = _native_build.load_extension(_NATIVE_NAME, _SOURCE)
    ext.set_runtime(*_runtime_getters())
    return ext


def set_launch_plans_enabled(enabled: bool) -> bool:
    """Turn launch plans on or off process-wide; returns whether they are on afterwards.

    Turning them on builds (or loads the cached build of) the native module in the calling
    thread, waiting for a background build of auto mode if one is running; a failed build
    leaves them off, with the reason in ``launch_plans_reason()``. Either call ends auto mode.
    """
    global _auto, _generation
    with _lock:
        _generation += 1
        _auto = None
    ext: Any = None
    reason: str | None = "off (CPATTN_LAUNCH_PLANS=0 or set_launch_plans_enabled(False))"
    if enabled:
        try:
            ext, reason = _native_module(), None
        except Exception as exc:
            reason = _unavailable(exc)
    with _lock:
        _set(ext, reason)
    return ext is not None


def _unavailable(exc: Exception) -> str:
    reason = f"native module unavailable ({type(exc).__name__}: {str(exc)[:300]})"
    _log.warning("launch plans stay off: %s", reason)
    return reason


def _set(ext: Any, reason: str | None) -> None:
    """Plans on (``ext``) or off (``reason``); the caller holds ``_lock``."""
    global _ext, _reason
    _ext, _reason = ext, reason
    _rebind()


def _rebind() -> None:
    """Bind every op's handle to the current state; the caller holds ``_lock``."""
    for handle in list(_handles):
        handle._bind()


_built: Any = None


def _native_module() -> Any:
    global _built
    with _build_lock:
        if _built is None:
            _built = _load()
        return _built


def launch_plans_reason() -> str | None:
    """Why launch plans are off (``None`` when they are on)."""
    return _reason


#: The counters the native module's ``info()`` returns.
_NATIVE_COUNTERS = ("plans", "refused", "seen_once", "hits", "misses", "evicted")


def launch_plans_info() -> dict[str, Any]:
    """Counters: ``plans`` (recorded keys), ``refused`` (keys no longer recorded),
    ``seen_once`` (keys met once, to be recorded at their next call), ``hits``, ``misses``
    (native look-ups), ``evicted`` (plans and refused keys dropped to make room: the table
    holds 8192 keys; a full one drops its least recently used quarter), ``recorded`` /
    ``refusals`` (recordings this process), and
    ``last_refusal`` (op name -> reason of its latest refused recording). Every key is there
    also while the native module is not loaded (its counters then read 0)."""
    info: dict[str, Any] = dict.fromkeys(_NATIVE_COUNTERS, 0)
    if _ext is not None:
        info.update(_ext.info())
    info.update(_stats)
    info["last_refusal"] = dict(_last_refusal)
    return info


def clear_launch_plans() -> None:
    """Forget every plan (later calls record again)."""
    if _built is not None:
        _built.clear()
    _describe_cache.clear()
    _last_refusal.clear()
    for k in _stats:
        _stats[k] = 0


def _after_fork_in_child() -> None:
    """A forked child gets fresh locks (another thread may have held them at the fork) and,
    if a background build was running, waits for its own first op call to start one."""
    global _lock, _build_lock, _auto, _reason, _active
    _lock, _build_lock = threading.Lock(), threading.Lock()
    # A recording another thread was running at the fork never ends in the child.
    _active = None
    _alloc._recorder = None
    _launch._launch_recorder = None
    if _auto == "building":
        _auto, _reason = "waiting", _WAITING
        _rebind()


os.register_at_fork(after_in_child=_after_fork_in_child)

_mode = os.environ.get("CPATTN_LAUNCH_PLANS", "auto").strip().lower()
if _mode in ("1", "on", "true"):
    set_launch_plans_enabled(True)
elif _mode in ("0", "off", "false"):
    set_launch_plans_enabled(False)
elif _mode not in ("", "auto"):
    _log.warning("CPATTN_LAUNCH_PLANS=%r is not 0, 1 or auto; using auto", _mode)
