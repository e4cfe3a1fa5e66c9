"""The cached launchers' keys tell apart every constexpr value Triton tells apart, and a launcher
that rejects an argument list costs only that call (or that key), never the kernel or others.

A fake Triton runtime on the CPU: the JIT launch is replaced by a recorder whose "compiled
kernel" tags its launches with the number of the JIT launch that made it, so a test sees which
compilation each cached launch used.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from cpattn_common import launch as launch_mod
from cpattn_common.launch import (
    CachedKernel,
    clear_launch_cache,
    launch_cached,
    launch_fast_path_reason,
)


def flag_body(x_ptr, n, C: tl.constexpr, D: tl.constexpr = 0):  # type: ignore[no-untyped-def]
    """A kernel with two constexprs (never run: the JIT launch is faked)."""
    pass


def other_body(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    pass


class _Src:
    def __init__(self, fn: Any):
        self.fn = fn
        self.signature = {name: "?" for name in fn.arg_names}


class _Compiled:
    """Stands in for a CompiledKernel; its launcher records ``(tag, *launch args)``."""

    def __init__(self, fn: Any, state: dict[str, Any], tag: int):
        self.src = _Src(fn)
        self.function = 1000 + tag
        self.packed_metadata = ("meta", tag)
        self.state = state
        self.tag = tag

    @property
    def run(self) -> Any:
        def launcher(*args: Any) -> None:
            reject = self.state["reject"]
            if reject is not None and reject(args):
                raise TypeError("the launcher rejects this argument list")
            self.state["fast"].append((self.tag, *args))

        return launcher


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch, fake_triton_driver: Any) -> dict[str, Any]:
    """``plain``: the JIT launches' kwargs; ``fast``: the cached launches; ``reject``: a
    predicate on a cached launch's arguments making its launcher raise ``TypeError``;
    ``plain_error``: a predicate on a JIT launch's kwargs making Triton raise ``TypeError``."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    runtime = launch_mod._get_runtime()
    if runtime.reason is not None:
        pytest.skip(runtime.reason)
    state: dict[str, Any] = {
        "kernel": JITFunction(flag_body),
        "other": JITFunction(other_body),
        "plain": [],
        "fast": [],
        "reject": None,
        "plain_error": None,
    }

    def plain(k: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> Any:
        if state["plain_error"] is not None and state["plain_error"](kwargs):
            raise TypeError("Triton rejects this call too")
        state["plain"].append(dict(kwargs))
        return _Compiled(k, state, len(state["plain"]))

    monkeypatch.setattr(launch_mod, "_plain", plain)
    monkeypatch.setattr(runtime, "driver", fake_triton_driver)
    clear_launch_cache()
    yield state
    clear_launch_cache()


def _same(a: Any, b: Any) -> bool:
    """Identical constants as Triton sees them (its cache key holds their repr)."""
    return type(a) is type(b) and repr(a) == repr(b)


# Values no two of which Triton compiles to the same kernel (its key holds each one's repr),
# though many of them compare (and hash) equal.
_DISTINCT = [
    0.0,
    -0.0,
    1,
    True,
    1.0,
    (1,),
    (True,),
    (1.0,),
    (0.0,),
    (-0.0,),
    ((1, 0.0),),
    ((True, -0.0),),
    ((1, -0.0),),
    np.float64(0.0),
    np.float64(-0.0),
    complex(1.0, 0.0),
    complex(1.0, -0.0),
    tl.constexpr(0.0),
    tl.constexpr(-0.0),
    tl.constexpr(1),
    tl.constexpr(True),
    0,
    False,
]


def _check_one_compilation_each(state: dict[str, Any], values: list[Any], launch: Any) -> None:
    for i, value in enumerate(values):
        for _ in range(3):
            launch(value)
        assert len(state["plain"]) == i + 1, f"{value!r} reused another value's kernel"
        assert _same(state["plain"][i]["C"], value)
        # Both later launches were cached, each with the kernel compiled for this value.
        tags = [call[0] for call in state["fast"][2 * i :]]
        assert tags == [i + 1, i + 1], (value, tags)


def test_launch_cached_keeps_equal_but_distinct_constexprs_apart(rt: dict[str, Any]) -> None:
    k, x = rt["kernel"], torch.empty(16)
    _check_one_compilation_each(rt, _DISTINCT, lambda c: launch_cached(k, (1,), x_ptr=x, n=5, C=c))
    # The launches passed this call's constexpr value, with its sign and type.
    for (_tag, *call), value in zip(rt["fast"][::2], _DISTINCT, strict=True):
        assert _same(call[-2], value)


def test_cached_kernel_keeps_equal_but_distinct_constexprs_apart(rt: dict[str, Any]) -> None:
    ck, x = CachedKernel(rt["kernel"]), torch.empty(16)
    _check_one_compilation_each(rt, _DISTINCT, lambda c: ck((1,), x, 5, C=c))
    for (_tag, *call), value in zip(rt["fast"][::2], _DISTINCT, strict=True):
        assert _same(call[-2], value)


def test_a_defaulted_constexpr_keeps_its_type(rt: dict[str, Any]) -> None:
    """``D`` defaults to ``0``: passing ``D=False`` or ``D=0.0`` is another kernel."""
    k, x = rt["kernel"], torch.empty(16)
    ck = CachedKernel(k)
    for d in (0, False, 0.0, -0.0):
        for _ in range(2):
            ck((1,), x, 5, C=3, D=d)
    assert [kw["D"] for kw in rt["plain"]] == [0, False, 0.0, -0.0]
    assert math.copysign(1.0, rt["plain"][3]["D"]) < 0


def test_nan_constexprs_share_one_kernel(rt: dict[str, Any]) -> None:
    """Every NaN is one constant to Triton (its key holds ``nan``): one compilation, then
    cached launches, however many distinct NaN objects the calls pass."""
    k, x = rt["kernel"], torch.empty(16)
    ck = CachedKernel(k)
    for _ in range(4):
        launch_cached(k, (1,), x_ptr=x, n=5, C=float("nan"))
        ck((1,), x, 5, C=float("nan"))
        launch_cached(k, (1,), x_ptr=x, n=5, C=(1, float("nan")))
    assert len(rt["plain"]) == 3
    assert len(rt["fast"]) == 9
    assert launch_mod._stats["compiled"] == 3


def test_plain_values_keep_their_type(rt: dict[str, Any]) -> None:
    """``1``, ``1.0``, ``True`` (and ``0``, ``0.0``, ``False``) are six kernels, in either order."""
    k, x = rt["kernel"], torch.empty(16)
    ck = CachedKernel(k)
    values = [True, 1.0, 1, False, 0, 0.0]
    for v in values:
        for _ in range(2):
            launch_cached(k, (1,), x_ptr=x, n=5, C=v)
    for v in reversed(values):
        for _ in range(2):
            ck((1,), x, 5, C=v)
    assert [type(kw["C"]) for kw in rt["plain"]] == [type(v) for v in values + values[::-1]]
    assert len(rt["fast"]) == 2 * len(values)


def test_ordinary_constexprs_still_hit_the_fast_path(rt: dict[str, Any]) -> None:
    """Ints, bools, strings, ``None`` and non-zero floats are looked up by the hit path's key;
    zeros, NaNs and tuples take a longer look-up, and still launch the cached kernel."""
    k, x = rt["kernel"], torch.empty(16)
    ck = CachedKernel(k)
    for c in (64, True, "name", None, 2.5, -0.5):
        for _ in range(3):
            ck((1,), x, 5, C=c)
        st = ck._state
        assert st is not None
        # The hit path's key is the exact key: found without the slower look-up.
        assert st.keyfn(0, x, 5, C=c) in st.entries
    assert len(rt["plain"]) == 6
    assert len(rt["fast"]) == 12


# ---- a launcher rejecting an argument list -----------------------------------------------


def test_launcher_type_error_where_triton_accepts_the_call_refuses_only_that_key(
    rt: dict[str, Any],
) -> None:
    """The cached launcher raises TypeError but Triton's own launch of the call works: that key
    launches the plain way from then on; the kernel's other keys and other kernels' cached
    entries (CachedKernel, Specialization) keep their fast path."""
    k, other, x = rt["kernel"], rt["other"], torch.empty(16)
    ck, ck_other = CachedKernel(k), CachedKernel(other)
    spec_other = ck_other.specialize(BLOCK=32)
    for _ in range(2):
        launch_cached(k, (1,), x_ptr=x, n=5, C=1)
        launch_cached(k, (1,), x_ptr=x, n=5, C=2)
        ck((1,), x, 5, C=1)
        spec_other((1,), x, 7)
    assert len(rt["plain"]) == 4
    rt["reject"] = lambda args: args[-2] == 1 and type(args[-2]) is int  # C == 1
    plain_before = len(rt["plain"])
    launch_cached(k, (1,), x_ptr=x, n=5, C=1)  # rejected: plain launch instead
    assert len(rt["plain"]) == plain_before + 1
    assert launch_fast_path_reason(k) is None
    rt["reject"] = None
    fast_before = len(rt["fast"])
    launch_cached(k, (1,), x_ptr=x, n=5, C=1)  # that key: plain from now on
    assert len(rt["plain"]) == plain_before + 2
    launch_cached(k, (1,), x_ptr=x, n=5, C=2)  # another key of the same kernel: still cached
    ck((1,), x, 5, C=1)  # the CachedKernel's own entry: still cached
    spec_other((1,), x, 7)  # another kernel's specialization: still cached, not flushed
    assert len(rt["plain"]) == plain_before + 2
    assert len(rt["fast"]) == fast_before + 3
    assert launch_fast_path_reason(ck) is None
    assert launch_fast_path_reason(ck_other) is None


def test_cached_kernel_launcher_type_error_refuses_only_that_key(rt: dict[str, Any]) -> None:
    k, other, x = rt["kernel"], rt["other"], torch.empty(16)
    ck = CachedKernel(k)
    spec = ck.specialize(C=4)
    spec_other = CachedKernel(other).specialize(BLOCK=32)
    for _ in range(2):
        ck((1,), x, 5, C=1)
        ck((1,), x, 5, C=2)
        spec((1,), x, 5)
        spec_other((1,), x, 7)
    assert len(rt["plain"]) == 4
    rt["reject"] = lambda args: args[-2] in (1, 4)
    ck((1,), x, 5, C=1)
    spec((1,), x, 5)
    assert len(rt["plain"]) == 6
    rt["reject"] = None
    ck((1,), x, 5, C=1)  # refused keys: plain
    spec((1,), x, 5)
    assert len(rt["plain"]) == 8
    fast_before = len(rt["fast"])
    ck((1,), x, 5, C=2)
    spec((1,), x, 16)  # another key of the specialization (another int class of ``n``)
    spec((1,), x, 16)
    spec_other((1,), x, 7)
    assert len(rt["plain"]) == 9
    assert len(rt["fast"]) == fast_before + 3
    assert launch_fast_path_reason(ck) is None


def test_a_call_triton_rejects_too_raises_its_error_and_changes_nothing(rt: dict[str, Any]) -> None:
    """A bad argument of a parameter the key does not look at (here: any ``n``) reaches the
    cached launcher, which raises TypeError; Triton's launch raises too. The caller gets
    Triton's error (not chained to the launcher's), and the entry keeps its fast path."""
    k, x = rt["kernel"], torch.empty(16)
    ck = CachedKernel(k)
    spec = ck.specialize(C=4)
    for _ in range(2):
        launch_cached(k, (1,), x_ptr=x, n=5, C=1)
        ck((1,), x, 5, C=1)
        spec((1,), x, 5)
    compiled = len(rt["plain"])
    rt["reject"] = lambda args: args[-3] == 5  # the launcher rejects n == 5 ...
    rt["plain_error"] = lambda kw: kw["n"] == 5  # ... and so does Triton
    for call in (
        lambda: launch_cached(k, (1,), x_ptr=x, n=5, C=1),
        lambda: ck((1,), x, 5, C=1),
        lambda: spec((1,), x, 5),
    ):
        with pytest.raises(TypeError, match="Triton rejects this call too") as info:
            call()
        assert info.value.__context__ is None
    rt["reject"] = rt["plain_error"] = None
    fast_before = len(rt["fast"])
    launch_cached(k, (1,), x_ptr=x, n=5, C=1)
    ck((1,), x, 5, C=1)
    spec((1,), x, 5)
    assert len(rt["plain"]) == compiled
    assert len(rt["fast"]) == fast_before + 3
    for kernel in (k, ck):
        assert launch_fast_path_reason(kernel) is None


def test_refused_exact_key_of_a_zero_constexpr(rt: dict[str, Any]) -> None:
    """The longer look-up (a float zero constexpr) handles a rejecting launcher the same way."""
    k, x = rt["kernel"], torch.empty(16)
    ck = CachedKernel(k)
    for _ in range(2):
        launch_cached(k, (1,), x_ptr=x, n=5, C=-0.0)
        ck((1,), x, 5, C=-0.0)
        launch_cached(k, (1,), x_ptr=x, n=5, C=0.0)
    assert len(rt["plain"]) == 3
    rt["reject"] = lambda args: math.copysign(1.0, args[-2]) < 0
    launch_cached(k, (1,), x_ptr=x, n=5, C=-0.0)
    ck((1,), x, 5, C=-0.0)
    rt["reject"] = None
    launch_cached(k, (1,), x_ptr=x, n=5, C=-0.0)
    ck((1,), x, 5, C=-0.0)
    assert len(rt["plain"]) == 7
    fast_before = len(rt["fast"])
    launch_cached(k, (1,), x_ptr=x, n=5, C=0.0)
    assert len(rt["fast"]) == fast_before + 1
    assert rt["fast"][-1][0] == 3  # +0.0's own kernel


def test_a_callable_grid_always_launches_the_plain_way(rt: dict[str, Any]) -> None:
    """Triton accepts ``grid(meta)``; the cached paths only take ints. Such a call used to
    work once and then raise ``TypeError`` (``len(grid)``) on the cache hit a tuple-grid call
    had stored; now it goes the plain way every time, and tuple-grid calls keep their entry."""
    k, x = rt["kernel"], torch.empty(16)
    ck = CachedKernel(k)
    spec = ck.specialize(C=3)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (1,)

    launches = [
        lambda g: launch_cached(k, g, x_ptr=x, n=5, C=3),
        lambda g: ck(g, x, 5, C=3),
        lambda g: spec(g, x, 5),
    ]
    for launch in launches:
        rt["plain"].clear()
        rt["fast"].clear()
        launch((1,))  # stores the entry a later call hits
        launch((1,))
        for _ in range(3):
            launch(grid)
        launch((1,))
        assert len(rt["plain"]) == 4  # the first tuple-grid call and the three callable ones
        assert len(rt["fast"]) == 2  # the tuple-grid calls after the first
