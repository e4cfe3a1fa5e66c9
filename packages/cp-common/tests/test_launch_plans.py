"""Launch plans: recording through the cached fast path (fake Triton runtime, CPU), native
replay without launching (dry run), refusals, and the real thing on a GPU.

Output poisoning is off here (a poison fill is a torch operation, so it refuses every
recording); ``test_poisoned_outputs_are_not_recorded`` turns it on.
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from cpattn_common import alloc as alloc_mod
from cpattn_common import launch as launch_mod
from cpattn_common import launch_plans as lp
from cpattn_common.alloc import new_output, poison_outputs
from cpattn_common.launch import CachedKernel, clear_launch_cache
from cpattn_common.launch_plans import (
    OpPlans,
    clear_launch_plans,
    launch_plans_info,
    launch_plans_reason,
    set_launch_plans_enabled,
)


def strided_scale_body(x_ptr, y_ptr, n, stride, alpha, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """``y[i] = alpha * x[i * stride]`` for i < n."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride, mask=mask)
    tl.store(y_ptr + offs, x * alpha, mask=mask)


strided_scale = CachedKernel(triton.jit(strided_scale_body))

# Its parameters as Triton 3.6 compiles them with stride == 1: stride specialized (a
# constexpr), two scratch pointers after the runtime parameters in the PTX.
_TYPES = {
    "x_ptr": "*fp32",
    "y_ptr": "*fp32",
    "n": "i32",
    "stride": "constexpr",
    "alpha": "fp32",
    "BLOCK": "constexpr",
}
_PTX = ".visible .entry strided_scale(\n" + ",\n".join(
    f"\t.param .u64 .ptr .global .align 1 strided_scale_param_{i}" for i in range(6)
) + "\n)\n{\n}\n"  # fmt: skip


class _Metadata:
    num_warps = 4
    num_ctas = 1
    shared = 256
    global_scratch_size = 0
    profile_scratch_size = 0


class _FakeSrc:
    def __init__(self, fn: Any):
        self.fn = fn
        self.signature = dict(_TYPES)


class _FakeCompiled:
    """Stands in for a CompiledKernel: logs its launcher's calls, describes itself."""

    def __init__(self, fn: Any, calls: list[tuple[Any, ...]], tag: int):
        self.src = _FakeSrc(fn)
        self.function = 1000 + tag
        self.packed_metadata = ("meta", tag)
        self.metadata = _Metadata()
        self.asm = {"ptx": _PTX}
        self._calls = calls

    @property
    def run(self) -> Any:
        return lambda *args: self._calls.append(args)


@pytest.fixture
def plans_on() -> Iterator[Any]:
    """Launch plans on (skips where the native module cannot be built), off afterwards."""
    if not set_launch_plans_enabled(True):
        pytest.skip(f"launch plans unavailable here: {launch_plans_reason()}")
    ext = lp._native_module()
    clear_launch_plans()
    yield ext
    ext.set_dry_run(None)
    ext.set_runtime(*lp._runtime_getters())
    clear_launch_plans()
    set_launch_plans_enabled(False)


@pytest.fixture
def fake_plan_runtime(
    monkeypatch: pytest.MonkeyPatch, plans_on: Any, fake_triton_driver: Any
) -> Iterator[dict[str, Any]]:
    """The cached fast path on a fake runtime (device 0, stream 777), the native module told
    the same, and its launches logged instead of run."""
    from triton.runtime.jit import JITFunction

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel = JITFunction(strided_scale_body)
    state: dict[str, Any] = {"kernel": kernel, "plain": [], "fast": [], "dry": []}

    def plain(k: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> Any:
        state["plain"].append(dict(kwargs))
        if launch_mod._launch_recorder is not None:  # what the real _plain reports
            launch_mod._launch_recorder(None, grid, -1, ())
        return _FakeCompiled(k, state["fast"], len(state["plain"]))

    runtime = launch_mod._get_runtime()
    if runtime.reason is not None:
        pytest.skip(runtime.reason)
    monkeypatch.setattr(launch_mod, "_plain", plain)
    monkeypatch.setattr(runtime, "driver", fake_triton_driver)
    clear_launch_cache()
    plans_on.set_runtime(lambda: 0, lambda device: 777, *lp._runtime_getters()[2:])
    plans_on.set_dry_run(state["dry"])
    state["spec"] = CachedKernel(kernel).specialize(BLOCK=64, num_warps=4)
    yield state
    clear_launch_cache()


_plans = OpPlans("tests.scale_copy")
pytestmark = pytest.mark.no_output_poison


def _scale_copy(spec: Any, x: torch.Tensor, n: int, alpha: float, *, extra: bool = False) -> Any:
    """A toy op in the opt-in shape of ``OpPlans``' docstring: ``y = alpha * x[:n]``."""
    hit = _plans.replay(x, n, alpha) if _plans.on else None
    if hit.__class__ is tuple:
        return hit[0]

    def body() -> torch.Tensor:
        y = new_output(x, (n,))
        if extra:
            x.add_(0.0)  # a torch operation the plan would not repeat
        spec((-(-n // 64),), x, y, n, 1, alpha)
        return y

    rec = _plans.recorder(hit, x, n, alpha) if _plans.on else None
    if rec is None:
        return body()
    with rec:
        y = body()
        rec.returns(y)
    return y


def _f32_bits(v: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", v))[0])


def test_off_misses_cheaply() -> None:
    set_launch_plans_enabled(False)
    assert launch_plans_reason() is not None
    x = torch.zeros(8)
    assert not _plans.on
    assert _plans.replay(x, 8, 1.0) is None
    assert _plans.recorder(None, x, 8, 1.0) is None


def test_info_has_every_counter_with_plans_off() -> None:
    """``launch_plans_info()["hits"]`` raised ``KeyError`` while the native module was not
    loaded (the docs index it so)."""
    set_launch_plans_enabled(False)
    info = launch_plans_info()
    assert {k: info[k] for k in lp._NATIVE_COUNTERS} == dict.fromkeys(lp._NATIVE_COUNTERS, 0)


def test_info_names_every_native_counter(plans_on: Any) -> None:
    assert set(plans_on.info()) == set(lp._NATIVE_COUNTERS)


def test_record_then_replay(fake_plan_runtime: dict[str, Any]) -> None:
    st = fake_plan_runtime
    spec = st["spec"]
    x = torch.randn(300)
    _scale_copy(spec, x, 200, 0.5)  # the key's first call (it compiles): not recorded
    info = launch_plans_info()
    assert (info["seen_once"], info["recorded"], info["refusals"]) == (1, 0, 0)
    _scale_copy(spec, x, 200, 0.5)  # the second call, on the cached fast path: recorded
    info = launch_plans_info()
    assert (info["plans"], info["seen_once"], info["recorded"]) == (1, 0, 1)
    n_fast = len(st["fast"])
    y = _scale_copy(spec, x, 200, 0.5)  # replayed: no Python launch, one native launch
    assert len(st["fast"]) == n_fast
    assert y.shape == (200,)
    assert y.dtype == torch.float32
    ((function, grid, block, shared, stream, params),) = st["dry"]
    assert (function, grid, block, shared, stream) == (1001, (4, 1, 1), 128, 256, 777)
    # x, y, n, alpha in signature order (stride_x and the constexprs dropped), 2 scratch nulls
    assert params == (x.data_ptr(), y.data_ptr(), 200, _f32_bits(0.5), 0, 0)
    assert launch_plans_info()["hits"] == 1
    # Another tensor of the same key: its own pointer.
    x2 = torch.randn(300)
    y2 = _scale_copy(spec, x2, 200, 0.5)
    assert st["dry"][-1][-1][:2] == (x2.data_ptr(), y2.data_ptr())


def test_a_launch_off_the_cached_fast_path_refuses(fake_plan_runtime: dict[str, Any]) -> None:
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    _scale_copy(spec, x, 200, 0.5)  # the key's first call
    clear_launch_cache()  # so that its second call compiles again
    _scale_copy(spec, x, 200, 0.5)
    info = launch_plans_info()
    assert (info["plans"], info["refusals"]) == (0, 1)
    assert "fast path" in info["last_refusal"]["tests.scale_copy"]
    _scale_copy(spec, x, 200, 0.5)  # recorded at the next call
    assert launch_plans_info()["plans"] == 1


@pytest.mark.parametrize(
    "change",
    ["n", "alpha", "dtype", "alignment", "shape", "stride", "device index"],
)
def test_any_key_change_misses(fake_plan_runtime: dict[str, Any], change: str) -> None:
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    for _ in range(2):
        _scale_copy(spec, x, 200, 0.5)
    assert launch_plans_info()["plans"] == 1
    args: dict[str, tuple[Any, ...]] = {
        "n": (x, 201, 0.5),
        "alpha": (x, 200, 0.25),
        "dtype": (x.double(), 200, 0.5),
        "alignment": (torch.randn(301)[1:], 200, 0.5),
        "shape": (torch.randn(301), 200, 0.5),
        "stride": (torch.randn(600)[::2], 200, 0.5),
        "device index": (x, 200, 0.5),
    }
    if change == "device index":  # the current device is part of the key
        getters = lp._runtime_getters()[2:]
        lp._native_module().set_runtime(lambda: 1, lambda device: 777, *getters)  # device moved
    assert _plans.replay(*args[change]) is False  # a new key: its first call


def test_each_current_device_gets_its_own_plan(plans_on: Any) -> None:
    """The same arguments under two current devices are two keys, each with its own plan (a
    plan of one device was re-recorded at every switch)."""
    ext = plans_on
    getters = lp._runtime_getters()[2:]
    ext.set_dry_run([])
    op = OpPlans("tests.devices").op_id
    for device in (0, 1):
        ext.set_runtime(lambda d=device: d, lambda d: 777, *getters)
        assert ext.replay(op, 5) is False  # a new key on this device
        ext.register(op, device, (5,), [], [], ())
    for device in (0, 1, 0):
        ext.set_runtime(lambda d=device: d, lambda d: 777, *getters)
        assert ext.replay(op, 5) == ()
    assert ext.info()["plans"] == 2


def test_unkeyed_arguments_miss_without_recording(plans_on: Any) -> None:
    """Arguments plans cannot key are a miss not to record (``False``): recording them would
    fail at registration, every call."""
    plans_on.set_runtime(lambda: 0, lambda device: 777, *lp._runtime_getters()[2:])
    x = torch.randn(8)
    assert _plans.replay(torch.nn.Parameter(x), 8, 1.0) is False  # not exactly torch.Tensor
    assert _plans.replay(x, "8", 1.0) is False
    assert _plans.replay(x, 2**70, 1.0) is False
    assert _plans.replay(x, 8, np.float64(1.0)) is False  # a float subclass
    assert _plans.replay(x, 8, np.True_) is False
    assert _plans.replay(x.to_sparse(), 8, 1.0) is False


def test_torch_operations_refuse_and_keys_give_up(fake_plan_runtime: dict[str, Any]) -> None:
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    _scale_copy(spec, x, 100, 2.0)  # compiles (the key's first call: not recorded)
    for _ in range(lp._MAX_FAILURES):
        _scale_copy(spec, x, 100, 2.0, extra=True)
    assert "aten.add_" in launch_plans_info()["last_refusal"]["tests.scale_copy"]
    assert launch_plans_info()["refused"] == 1
    assert _plans.replay(x, 100, 2.0) is False  # refused: no more recording attempts
    assert _plans.recorder(False, x, 100, 2.0) is None


def test_a_view_with_an_explicit_storage_offset_refuses(fake_plan_runtime: dict[str, Any]) -> None:
    """``as_strided`` with a storage offset points at a fixed place of the storage, not at an
    offset from its base: a plan would replay it relative to the argument's pointer (wrong
    for an argument at another storage offset, which the key does not hold)."""
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    _scale_copy(spec, x, 100, 2.0)
    other = OpPlans("tests.absolute_view")
    for offset, refused in ((None, False), (8, True)):
        rec = other.recorder(None, x, 100)
        assert rec is not None
        with rec:
            view = x.as_strided((100,), (1,)) if offset is None else x.as_strided((100,), (1,), 8)
            y = new_output(x, (100,))
            spec((2,), view, y, 100, 1, 2.0)
            rec.returns(y)
        assert (rec.reason == "a view with an explicit storage offset") is refused, rec.reason


def test_poisoned_calls_are_neither_recorded_nor_refused(
    fake_plan_runtime: dict[str, Any],
) -> None:
    """While outputs are poisoned, calls take the Python path without a recording (its fill
    would refuse it, and three such calls refused the key for good); plans resume after."""
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    _scale_copy(spec, x, 100, 2.0)
    with poison_outputs():
        for _ in range(lp._MAX_FAILURES + 1):
            y = _scale_copy(spec, x, 100, 2.0)
            assert y.shape == (100,)
    info = launch_plans_info()
    assert (info["plans"], info["refused"], info["refusals"]) == (0, 0, 0)
    _scale_copy(spec, x, 100, 2.0)  # the key's second call outside poisoning: recorded
    assert launch_plans_info()["plans"] == 1


def test_aliased_arguments_and_foreign_pointers_refuse(fake_plan_runtime: dict[str, Any]) -> None:
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    _scale_copy(spec, x, 100, 2.0)
    other = OpPlans("tests.aliased")
    rec = other.recorder(None, x, x[10:], 3)
    assert rec is not None
    with rec:
        y = new_output(x, (100,))
        spec((2,), x, y, 100, 1, 2.0)
        rec.returns(y)
    assert (
        launch_plans_info()["last_refusal"]["tests.aliased"] == "two tensor arguments share storage"
    )
    rec = other.recorder(None, x, 3)
    assert rec is not None
    with rec:
        y = torch.empty(100)  # not allocated through cpattn_common.alloc
        spec((2,), x, y, 100, 1, 2.0)
        rec.returns(y)
    assert (
        "a returned tensor was not allocated"
        in launch_plans_info()["last_refusal"]["tests.aliased"]
    )


def test_a_pinned_host_argument_refuses(
    fake_plan_runtime: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU kernel can read pinned host memory, so a call with pinned host tensors ran and was
    recorded; the key has no pinned bit, so a pageable tensor of the same key then replayed
    the plan (an illegal address), where Triton's launcher raises ValueError."""
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: self is x)
    for _ in range(3):
        _scale_copy(spec, x, 100, 2.0)
    info = launch_plans_info()
    assert info["plans"] == 0
    assert info["last_refusal"]["tests.scale_copy"] == "a pinned host tensor argument"
    assert fake_plan_runtime["dry"] == []


def test_views_of_arguments_map_with_offsets(fake_plan_runtime: dict[str, Any]) -> None:
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    views = OpPlans("tests.views")

    def op(x: torch.Tensor) -> Any:
        hit = views.replay(x)
        if hit.__class__ is tuple:
            return hit[0]
        rec = views.recorder(hit, x)
        if rec is None:  # the key's first call
            y = new_output(x, (64,))
            spec((1,), x[128:], y[32:], 32, 1, 1.0)
            return y
        with rec:
            y = new_output(x, (64,))
            spec((1,), x[128:], y[32:], 32, 1, 1.0)
            rec.returns(y)
        return y

    op(x)  # compiles (the key's first call)
    op(x)  # records
    x2 = torch.randn(300)
    y2 = op(x2)
    params = fake_plan_runtime["dry"][-1][-1]
    assert params[:2] == (x2.data_ptr() + 128 * 4, y2.data_ptr() + 32 * 4)


def test_register_rejects_malformed_plans(plans_on: Any) -> None:
    x = torch.randn(4)
    with pytest.raises(ValueError, match="refers to nothing"):
        plans_on.register(7, 0, (x, 1), [], [(1, (1, 1, 1), 32, 0, [(0, 1, 0)])], ())
    with pytest.raises(ValueError, match="return index"):
        plans_on.register(7, 0, (x, 1), [], [], (0,))
    with pytest.raises(TypeError):
        plans_on.register(7, 0, [x], [], [], ())
    with pytest.raises(ValueError, match="do not key"):
        plans_on.register(7, 0, (x, "a"), [], [], ())


@pytest.fixture
def small_tables(plans_on: Any) -> Iterator[Any]:
    """The native module with room for 8 plans and 4 keys met once."""
    previous = plans_on.set_limits(8, 4)
    plans_on.set_runtime(lambda: 0, lambda device: 777, *lp._runtime_getters()[2:])
    plans_on.set_dry_run([])
    yield plans_on
    plans_on.set_limits(*previous)


def _register(ext: Any, op: int, n: int) -> None:
    """A plan with no allocation and no launch for the key ``(op, n)``."""
    ext.register(op, 0, (n,), [], [], ())


def test_a_full_plan_table_keeps_the_plans_in_use(small_tables: Any) -> None:
    """A stream of new keys through a full table does not flush the keys that keep being
    replayed (the least recently used quarter goes)."""
    ext = small_tables
    op = OpPlans("tests.evict").op_id
    hot = range(4)
    for n in hot:
        _register(ext, op, n)
    for n in range(100, 160):  # one-off keys, each recorded once and never replayed
        for h in hot:
            assert ext.replay(op, h) == (), (n, h)
        _register(ext, op, n)
        assert ext.info()["plans"] <= 8
    info = ext.info()
    assert info["evicted"] >= 60 - 4
    assert all(ext.replay(op, h) == () for h in hot)
    assert ext.replay(op, 100) is False  # evicted long ago: a new key again


def test_hot_keys_older_than_a_full_table_survive_its_first_eviction(small_tables: Any) -> None:
    """The table filled with newer one-off keys before the hot keys were replayed again (a
    burst of new layouts): the hot keys, replayed since, are the most recently used at the
    eviction and stay. (A second-chance table, where a new key counted as used, dropped a
    quarter in table order here, hot keys among them.)"""
    ext = small_tables
    op = OpPlans("tests.evict_burst").op_id
    hot = range(6)  # three quarters of the table
    for n in hot:
        _register(ext, op, n)
    for n in range(100, 102):  # the burst fills the table
        _register(ext, op, n)
    assert ext.info()["plans"] == 8
    for n in range(200, 220):
        for h in hot:
            assert ext.replay(op, h) == (), (n, h)
        _register(ext, op, n)


def test_a_full_plan_table_evicts_its_least_recently_used_quarter(small_tables: Any) -> None:
    ext = small_tables
    op = OpPlans("tests.evict_lru").op_id
    for n in range(8):
        _register(ext, op, n)
    for n in (0, 1, 3):
        assert ext.replay(op, n) == ()  # now the most recently used
    _register(ext, op, 8)  # full: the two least recently used (2 and 4) go
    info = ext.info()
    assert (info["plans"], info["evicted"]) == (7, 2)
    assert [n for n in range(9) if ext.replay(op, n) == ()] == [0, 1, 3, 5, 6, 7, 8]


def test_refused_keys_take_table_room_and_stay_refused_while_met(small_tables: Any) -> None:
    ext = small_tables
    op = OpPlans("tests.evict_refused").op_id
    for _ in range(3):
        ext.refuse(op, (1,), 3)
    assert ext.info()["refused"] == 1
    for n in range(100, 140):
        assert ext.replay(op, 1) is False  # refused: met, so kept
        _register(ext, op, n)
    assert ext.info()["refused"] == 1


def test_a_full_set_of_keys_met_once_is_cleared(small_tables: Any) -> None:
    ext = small_tables
    op = OpPlans("tests.seen").op_id
    for n in range(4):
        assert ext.replay(op, n) is False
    assert ext.info()["seen_once"] == 4
    assert ext.replay(op, 4) is False  # the set was full: cleared, then this key noted
    assert ext.info()["seen_once"] == 1
    assert ext.replay(op, 0) is False  # forgotten: a first call again
    assert ext.replay(op, 0) is None  # its second call: record it


def test_set_limits_rejects_nonsense(plans_on: Any) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        plans_on.set_limits(0, 4)
    with pytest.raises(TypeError):
        plans_on.set_limits("8", 4)


# ---- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_merge_and_describe_real_kernels(device: torch.device) -> None:
    """A real Triton kernel recorded and replayed through cuLaunchKernel (merge_attn_states'
    plans live in its own tests; this checks the description of a real compiled kernel)."""
    if not set_launch_plans_enabled(True):
        pytest.skip(f"launch plans unavailable here: {launch_plans_reason()}")
    try:
        clear_launch_plans()
        spec = strided_scale.specialize(BLOCK=64, num_warps=4)
        x = torch.randn(300, device=device)
        expect = x[:200] * 0.5
        for i in range(4):
            y = _scale_copy(spec, x, 200, 0.5)
            torch.testing.assert_close(y, expect, rtol=0, atol=0, msg=f"call {i}")
        info = launch_plans_info()
        assert info["plans"] == 1, info
        assert info["hits"] >= 2, info
    finally:
        clear_launch_plans()
        set_launch_plans_enabled(False)


@pytest.mark.gpu
def test_gpu_a_new_thread_gets_the_same_results(device: torch.device) -> None:
    """A thread whose first CUDA work is a recorded call: a replay there needs a current CUDA
    context, which Triton's launcher makes and a replay does not (without one the call takes
    the Python path once)."""
    if not set_launch_plans_enabled(True):
        pytest.skip(f"launch plans unavailable here: {launch_plans_reason()}")
    try:
        clear_launch_plans()
        spec = strided_scale.specialize(BLOCK=64, num_warps=4)
        x = torch.randn(300, device=device)
        for _ in range(3):
            _scale_copy(spec, x, 200, 0.5)
        assert launch_plans_info()["hits"] == 1
        results: list[Any] = []

        def work() -> None:
            try:
                torch.cuda.set_stream(torch.cuda.Stream(device))
                for _ in range(3):
                    results.append(_scale_copy(spec, x, 200, 0.5))
                torch.cuda.current_stream(device).synchronize()
            except Exception as exc:  # reported below
                results.append(exc)

        torch.cuda.synchronize(device)
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        assert len(results) == 3, results
        for y in results:
            torch.testing.assert_close(y, x[:200] * 0.5, rtol=0, atol=0)
    finally:
        clear_launch_plans()
        set_launch_plans_enabled(False)


@pytest.mark.gpu
def test_gpu_failed_allocation_is_a_miss(device: torch.device) -> None:
    """An allocation the native replay cannot make (here: 128 TiB) is caught inside the
    module and reported as a miss, so the Python path runs and raises torch's own error."""
    if not set_launch_plans_enabled(True):
        pytest.skip(f"launch plans unavailable here: {launch_plans_reason()}")
    ext = lp._native_module()
    try:
        clear_launch_plans()
        x = torch.zeros(4, device=device)
        huge = OpPlans("tests.huge")
        ext.register(
            huge.op_id,
            torch.cuda.current_device(),
            (x,),
            [((2**45,), ext.dtype_code(x), 0)],
            [],
            (0,),
        )
        assert huge.replay(x) is None
        assert launch_plans_info()["misses"] >= 1
    finally:
        clear_launch_plans()
        set_launch_plans_enabled(False)


def test_poisoning_turns_replays_off(fake_plan_runtime: dict[str, Any]) -> None:
    """A key recorded with poisoning off is not replayed while it is on (the Python path
    poisons the fresh outputs)."""
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    for _ in range(2):
        _scale_copy(spec, x, 100, 2.0)
    assert launch_plans_info()["plans"] == 1
    with poison_outputs():
        assert _plans.replay(x, 100, 2.0) is False
    assert _plans.replay(x, 100, 2.0).__class__ is tuple


def test_launch_hooks_turn_replays_off(fake_plan_runtime: dict[str, Any]) -> None:
    """While a Triton launch hook is installed (a profiler), calls take the Python path, whose
    launches the hook sees."""
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    for _ in range(2):
        _scale_copy(spec, x, 100, 2.0)
    assert _plans.replay(x, 100, 2.0).__class__ is tuple
    knobs = triton.knobs.runtime
    previous = knobs.launch_enter_hook
    knobs.launch_enter_hook = lambda *args: None
    try:
        assert _plans.replay(x, 100, 2.0) is False
    finally:
        knobs.launch_enter_hook = previous
    assert _plans.replay(x, 100, 2.0).__class__ is tuple


def test_other_threads_work_during_a_recording_is_ignored(
    fake_plan_runtime: dict[str, Any],
) -> None:
    """Another thread's allocations and launches while a call is recorded are not part of
    that call (Triton releases the GIL while it launches, so they happen): the recording
    succeeds (it was refused, and after three such calls the key was refused for good)."""
    spec = fake_plan_runtime["spec"]
    x, other = torch.randn(300), torch.randn(300)
    _scale_copy(spec, x, 200, 0.5)
    rec = _plans.recorder(None, x, 200, 0.5)
    assert rec is not None
    with rec:
        y = new_output(x, (200,))
        worker = threading.Thread(target=lambda: _scale_copy(spec, other, 100, 2.0))
        worker.start()
        worker.join()
        spec((4,), x, y, 200, 1, 0.5)
        rec.returns(y)
    info = launch_plans_info()
    assert (info["recorded"], info["refusals"]) == (1, 0), info
    assert len(rec.allocs) == 1
    assert len(rec.launches) == 1


def test_a_recorder_that_loses_the_race_records_nothing(
    fake_plan_runtime: dict[str, Any],
) -> None:
    """Two threads may both get a recorder before either enters it; the second to enter
    records nothing (it raised into the op call)."""
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    _scale_copy(spec, x, 200, 0.5)
    first = _plans.recorder(None, x, 200, 0.5)
    second = _plans.recorder(None, x, 200, 0.5)
    assert first is not None
    assert second is not None
    with first:
        with second:  # as if from another thread
            y = _scale_copy(spec, x, 200, 0.5)
            second.returns(y)
        first.returns(y)
    assert launch_plans_info()["recorded"] == 1


def test_a_kernel_of_oversized_shared_memory_refuses(
    fake_plan_runtime: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above 228 KiB of shared memory Triton launches with a launch attribute (oversized
    shared memory) that a plan's plain launch does not set: such a kernel is not planned."""
    spec = fake_plan_runtime["spec"]
    monkeypatch.setattr(_Metadata, "shared", 228 * 1024 + 16)
    x = torch.randn(300)
    for _ in range(3):
        _scale_copy(spec, x, 100, 2.0)
    info = launch_plans_info()
    assert info["plans"] == 0
    assert (
        "a compiled kernel a plain cuLaunchKernel cannot launch"
        in (info["last_refusal"]["tests.scale_copy"])
    )
    monkeypatch.setattr(_Metadata, "shared", 228 * 1024)  # the largest a plain launch takes
    lp._describe_cache.clear()
    y = torch.randn(300)
    for _ in range(3):
        _scale_copy(spec, y, 150, 2.0)
    assert launch_plans_info()["plans"] == 1


def test_a_plan_that_cannot_be_built_is_a_refusal(fake_plan_runtime: dict[str, Any]) -> None:
    """A constant the kernel parameter cannot hold (3e39 overflows the fp32 packing) makes a
    refusal, never an exception in the op call."""
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    for _ in range(3):
        y = _scale_copy(spec, x, 200, 3e39)
        assert y.shape == (200,)
    info = launch_plans_info()
    assert (info["plans"], info["refusals"]) == (0, 2)
    assert "could not be built" in info["last_refusal"]["tests.scale_copy"]


def test_empty_grid_launches_are_not_replayed(fake_plan_runtime: dict[str, Any]) -> None:
    """Triton launches nothing for an empty grid; the replay launches nothing either."""
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    for _ in range(3):
        y = _scale_copy(spec, x, 0, 0.5)
    assert y.shape == (0,)
    assert launch_plans_info()["hits"] == 1
    assert fake_plan_runtime["dry"] == []


def test_a_fork_during_a_recording_leaves_the_child_free_to_record(
    fake_plan_runtime: dict[str, Any],
) -> None:
    spec = fake_plan_runtime["spec"]
    x = torch.randn(300)
    _scale_copy(spec, x, 200, 0.5)
    rec = _plans.recorder(None, x, 200, 0.5)
    assert rec is not None
    with rec:
        pid = os.fork()
        if pid == 0:  # the child: no recording of its own is running
            ok = lp._active is None and alloc_mod._recorder is None
            os._exit(0 if ok and launch_mod._launch_recorder is None else 1)
        _, status = os.waitpid(pid, 0)
        y = _scale_copy(spec, x, 200, 0.5)
        rec.returns(y)
    assert os.waitstatus_to_exitcode(status) == 0


def test_plans_cleared_during_a_replay(fake_plan_runtime: dict[str, Any]) -> None:
    """A replay calls back into Python (the stream getter), where another thread may clear or
    replace plans: the replay finishes with the plan it found."""
    spec = fake_plan_runtime["spec"]
    ext = lp._native_module()
    x = torch.randn(300)
    for _ in range(2):
        _scale_copy(spec, x, 200, 0.5)

    def stream_getter_that_clears(device: int) -> int:
        ext.clear()
        return 777

    ext.set_runtime(lambda: 0, stream_getter_that_clears, *lp._runtime_getters()[2:])
    y = _plans.replay(x, 200, 0.5)
    assert y.__class__ is tuple
    assert fake_plan_runtime["dry"][-1][-1][:2] == (x.data_ptr(), y[0].data_ptr())
    assert _plans.replay(x, 200, 0.5) is False  # gone now: a new key again


# Auto mode (the default): decided at the first op call, built in the background.

_inner_plans = OpPlans("tests.scale_in_place")
_outer_plans = OpPlans("tests.scale_in_place_then_copy")


def _scale_in_place(spec: Any, x: torch.Tensor) -> None:
    """An opted-in in-place op (the shape of ``mask_dcp_empty_shards_``): ``x[:64] *= 2``."""
    hit = _inner_plans.replay(x) if _inner_plans.on else None
    if hit.__class__ is tuple:
        return
    rec = _inner_plans.recorder(hit, x) if _inner_plans.on else None
    if rec is None:
        spec((1,), x, x, 64, 1, 2.0)
        return
    with rec:
        spec((1,), x, x, 64, 1, 2.0)
        rec.returns()


def _scale_in_place_then_copy(spec: Any, x: torch.Tensor) -> torch.Tensor:
    """An opted-in op calling another one: ``_scale_in_place(x)``, then ``0.5 * x[:64]``."""
    hit = _outer_plans.replay(x) if _outer_plans.on else None
    if hit.__class__ is tuple:
        return hit[0]  # type: ignore[no-any-return]

    def body() -> torch.Tensor:
        _scale_in_place(spec, x)
        y = new_output(x, (64,))
        spec((1,), x, y, 64, 1, 0.5)
        return y

    rec = _outer_plans.recorder(hit, x) if _outer_plans.on else None
    if rec is None:
        return body()
    with rec:
        y = body()
        rec.returns(y)
    return y


def test_an_op_called_inside_a_recording_is_part_of_the_plan(
    fake_plan_runtime: dict[str, Any],
) -> None:
    """The inner op's key already replays; inside the outer op's recording it used to replay
    natively, unseen by the recorder, and the outer plan launched only its own kernel (1
    launch per replay instead of 2: the in-place scaling was lost)."""
    st = fake_plan_runtime
    spec = st["spec"]
    x = torch.randn(300)
    for _ in range(3):  # the inner key: compile, record, replay
        _scale_in_place(spec, x)
    assert launch_plans_info()["hits"] == 1
    launches = []
    for _ in range(4):  # the outer key: Python path, recording, two replays
        before = len(st["fast"]) + len(st["dry"])
        _scale_in_place_then_copy(spec, x)
        launches.append(len(st["fast"]) + len(st["dry"]) - before)
    assert launches == [2, 2, 2, 2]
    # The inner op replays in the outer op's first (unrecorded) call, not in its recording;
    # then the outer plan replays twice.
    assert launch_plans_info()["hits"] == 1 + 1 + 2


def test_a_launch_cache_clear_during_a_recording_does_not_refuse_the_kernel_for_good(
    fake_plan_runtime: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's ``clear_launch_cache()`` between a recorded launch and the recording's
    commit: the commit could not describe the kernel, and remembered that, so every later
    key of the kernel was refused (0 plans) although Triton hands the same kernel back."""
    st = fake_plan_runtime
    spec = st["spec"]
    fake_plain = launch_mod._plain
    triton_cache: dict[str, Any] = {}

    def plain_like_triton(k: Any, grid: Any, kwargs: dict[str, Any]) -> Any:
        compiled = fake_plain(k, grid, kwargs)
        return triton_cache.setdefault("compiled", compiled)  # Triton's JIT cache: same object

    monkeypatch.setattr(launch_mod, "_plain", plain_like_triton)
    x = torch.randn(300)
    _scale_copy(spec, x, 200, 0.5)  # the key's first call (it compiles)
    rec = _plans.recorder(None, x, 200, 0.5)
    assert rec is not None
    with rec:
        y = new_output(x, (200,))
        spec((4,), x, y, 200, 1, 0.5)
        clear_launch_cache()  # another thread, between the launch and the commit
        rec.returns(y)
    assert launch_plans_info()["plans"] == 0  # this recording could not be described
    for n in (100, 150, 250):
        for _ in range(3):
            _scale_copy(spec, torch.randn(300), n, 0.5)
    info = launch_plans_info()
    assert (info["plans"], info["refused"]) == (3, 0), info


_WAITING = "auto: waiting for the first op call"


@pytest.fixture
def auto_mode() -> Iterator[None]:
    """Plans in auto mode as after import (waiting for the first op call); off afterwards."""
    set_launch_plans_enabled(False)
    with lp._lock:
        lp._auto, lp._reason = "waiting", _WAITING
        lp._rebind()
    yield
    if lp._auto_thread is not None:
        lp._auto_thread.join(300)
    set_launch_plans_enabled(False)


@pytest.fixture
def held_build(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Auto mode's build waits until the returned event is set (then builds or loads); set
    at teardown too, so that a failed test does not leave the build thread waiting."""
    release = threading.Event()
    real = lp._native_module

    def build() -> Any:
        assert release.wait(300)
        return real()

    monkeypatch.setattr(lp, "_native_module", build)
    yield release
    release.set()


@pytest.mark.parametrize(("env", "reason"), [(None, _WAITING), ("0", "off ("), ("auto", _WAITING)])
def test_the_environment_picks_the_mode(env: str | None, reason: str) -> None:
    """Unset (the default) and ``auto`` wait for the first op call; ``0`` is off. Nothing is
    built at import either way."""
    environ = {k: v for k, v in os.environ.items() if k != "CPATTN_LAUNCH_PLANS"}
    if env is not None:
        environ["CPATTN_LAUNCH_PLANS"] = env
    environ["PYTHONPATH"] = os.pathsep.join(sys.path)
    code = (
        "from cpattn_common import launch_plans as lp; "
        "print(lp.launch_plans_reason()); print(lp._built is None)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300
    )
    assert done.returncode == 0, done.stderr
    printed_reason, nothing_built = done.stdout.strip().splitlines()
    assert printed_reason.startswith(reason)
    assert nothing_built == "True"


def test_auto_mode_stays_off_where_plans_cannot_work(
    auto_mode: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lp, "_auto_blocker", lambda: "no CUDA device")
    other = OpPlans("tests.auto_other")
    assert _plans.on
    assert other.on
    assert launch_plans_reason() == _WAITING
    assert _plans.replay(torch.randn(8), 8, 1.0) is None  # the first op call decides
    assert launch_plans_reason() == "auto: no CUDA device"
    assert not _plans.on
    assert not other.on
    assert lp._auto_thread is None or not lp._auto_thread.is_alive()


def test_auto_mode_never_raises_into_the_op_call(
    auto_mode: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_check() -> str | None:
        raise RuntimeError("CUDA driver error")

    monkeypatch.setattr(lp, "_auto_blocker", broken_check)
    assert _plans.replay(torch.randn(8), 8, 1.0) is None
    assert launch_plans_reason() == "auto: the check failed (RuntimeError: CUDA driver error)"
    assert not _plans.on


def test_auto_mode_blockers_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET=1" in str(lp._auto_blocker())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert lp._auto_blocker() == "no CUDA device"
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    assert "ROCm" in str(lp._auto_blocker())


def test_auto_mode_builds_in_the_background_then_turns_plans_on(
    auto_mode: None, held_build: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lp, "_auto_blocker", lambda: None)
    x = torch.randn(8)
    assert _plans.replay(x, 8, 1.0) is None
    # Building: calls take the Python path and pay nothing for plans.
    assert launch_plans_reason() == "auto: building the native module in the background"
    assert not _plans.on
    assert _plans.recorder(None, x, 8, 1.0) is None
    held_build.set()
    assert lp._auto_thread is not None
    lp._auto_thread.join(300)
    if launch_plans_reason() is not None:
        pytest.skip(f"launch plans unavailable here: {launch_plans_reason()}")
    assert _plans.on
    assert _plans.replay.func is lp._built.replay
    assert _plans.replay(x, 8, 1.0) is False  # on: this key's first call, not to record
    assert OpPlans("tests.auto_late").on  # handles made later are on too


def test_an_explicit_setting_during_a_build_wins(
    auto_mode: None, held_build: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lp, "_auto_blocker", lambda: None)
    _plans.replay(torch.randn(8), 8, 1.0)
    set_launch_plans_enabled(False)
    held_build.set()
    assert lp._auto_thread is not None
    lp._auto_thread.join(300)
    assert not _plans.on
    assert str(launch_plans_reason()).startswith("off (")


def test_a_failed_auto_build_leaves_plans_off_with_one_warning(
    auto_mode: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(lp, "_auto_blocker", lambda: None)

    def failing_build() -> Any:
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(lp, "_native_module", failing_build)
    with caplog.at_level(logging.WARNING, logger=lp.__name__):
        _plans.replay(torch.randn(8), 8, 1.0)
        assert lp._auto_thread is not None
        lp._auto_thread.join(300)
        _plans.replay(torch.randn(8), 8, 1.0)
    assert launch_plans_reason() == (
        "auto: native module unavailable (RuntimeError: no C++ compiler found)"
    )
    assert not _plans.on
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
# The child only reads module state and exits: the warning about forking threads is moot.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_starts_its_own_build(auto_mode: None) -> None:
    """A build running in the parent at the fork does not run in the child: the child waits
    for its own first op call (and gets fresh locks)."""
    with lp._lock:
        lp._auto, lp._reason = "building", "auto: building the native module in the background"
        lp._rebind()
    assert not _plans.on
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        ok = lp._auto == "waiting" and _plans.on and lp._lock.acquire(blocking=False)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert lp._auto == "building"  # the parent is unchanged


@pytest.mark.gpu
def test_gpu_auto_mode_builds_and_replays_real_calls(auto_mode: None, device: torch.device) -> None:
    """The default mode on a GPU: the first call starts the build, calls keep their results
    while it runs, and once it is done repeated calls replay."""
    clear_launch_plans()
    spec = strided_scale.specialize(BLOCK=64, num_warps=4)
    x = torch.randn(300, device=device)
    expect = x[:200] * 0.5
    torch.testing.assert_close(_scale_copy(spec, x, 200, 0.5), expect, rtol=0, atol=0)
    assert lp._auto_thread is not None, launch_plans_reason()
    while lp._auto_thread.is_alive():
        torch.testing.assert_close(_scale_copy(spec, x, 200, 0.5), expect, rtol=0, atol=0)
    assert launch_plans_reason() is None
    for i in range(4):
        y = _scale_copy(spec, x, 200, 0.5)
        torch.testing.assert_close(y, expect, rtol=0, atol=0, msg=f"call {i}")
    assert launch_plans_info()["hits"] >= 2, launch_plans_info()
    clear_launch_plans()


@pytest.mark.gpu
def test_gpu_plans_turning_on_during_a_capture(
    auto_mode: None, held_build: threading.Event, device: torch.device
) -> None:
    """The background build may finish while the process captures a CUDA graph (a serving
    engine's start-up): the build thread makes no CUDA call, and the captured calls (Python
    path, then the recording call, then replays) all compute right when the graph replays."""
    clear_launch_plans()
    spec = strided_scale.specialize(BLOCK=64, num_warps=4)
    static_x = torch.randn(300, device=device)
    _scale_copy(spec, static_x, 200, 0.5)  # the first op call: compiles, starts the build
    assert lp._auto_thread is not None
    assert lp._auto_thread.is_alive()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _scale_copy(spec, static_x, 200, 0.5)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    outputs = []
    with torch.cuda.graph(graph):
        outputs.append(_scale_copy(spec, static_x, 200, 0.5))  # the Python path
        held_build.set()
        lp._auto_thread.join(300)  # plans turn on mid-capture
        hits = launch_plans_info()["hits"]
        for _ in range(4):  # the key's first call with plans on, its recording, two replays
            outputs.append(_scale_copy(spec, static_x, 200, 0.5))
    assert launch_plans_reason() is None
    assert launch_plans_info()["hits"] == hits + 2, launch_plans_info()
    for seed in range(3):
        gen = torch.Generator(device=device).manual_seed(seed)
        static_x.copy_(torch.randn(300, device=device, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        for i, y in enumerate(outputs):
            torch.testing.assert_close(y, static_x[:200] * 0.5, rtol=0, atol=0, msg=f"call {i}")
    clear_launch_plans()
