"""launch_cached: keying logic with a fake Triton runtime (CPU) and the real fast path (GPU)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from cpattn_common import launch as launch_mod
from cpattn_common.launch import (
    clear_launch_cache,
    launch_cache_info,
    launch_cached,
    launch_fast_path_reason,
    set_launch_cache_enabled,
)
from cpattn_common.ops.merge_attn_states import triton_usable

# ---- kernels (``@triton.jit`` needs them in a real file) ---------------------------------


def scale_copy_body(
    x_ptr, y_ptr, n, stride_x, alpha, BLOCK: tl.constexpr, FLAG: tl.constexpr = False
):
    """``y[i] = alpha * x[i * stride_x]`` (+1 when FLAG) for i < n."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride_x, mask=mask).to(tl.float32)
    y = x * alpha
    if FLAG:
        y = y + 1.0
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


scale_copy = triton.jit(scale_copy_body)


@triton.jit
def empty_kernel(x_ptr, n):
    """Does nothing; for host-overhead timing."""
    pass


class _FakeSrc:
    def __init__(self, fn: Any):
        self.fn = fn
        self.signature = {name: "?" for name in fn.arg_names}


class _FakeCompiled:
    """Stands in for a CompiledKernel: records the launcher calls."""

    def __init__(self, fn: Any, calls: list[tuple[Any, ...]], tag: int):
        self.src = _FakeSrc(fn)
        self.function = 1000 + tag
        self.packed_metadata = ("meta", tag)
        self.calls = calls
        self.tag = tag

    @property
    def run(self) -> Any:
        def launcher(*args: Any) -> None:
            self.calls.append((self.tag, *args))

        return launcher


class _FakeDriver:
    class active:
        @staticmethod
        def get_current_device() -> int:
            return 0

        @staticmethod
        def get_current_stream(device: int) -> int:
            return 777


@pytest.fixture
def fake_runtime(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A plain JITFunction with the JIT launch replaced by a recorder of compilations."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel = JITFunction(scale_copy_body)
    state: dict[str, Any] = {"kernel": kernel, "plain": [], "fast": []}

    def plain(k: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> Any:
        state["plain"].append(dict(kwargs))
        return _FakeCompiled(k, state["fast"], len(state["plain"]))

    runtime = launch_mod._get_runtime()
    if runtime.reason is not None:
        pytest.skip(runtime.reason)
    monkeypatch.setattr(launch_mod, "_plain", plain)
    monkeypatch.setattr(runtime, "driver", _FakeDriver)
    clear_launch_cache()
    yield state
    clear_launch_cache()


def _kwargs(x: torch.Tensor, y: torch.Tensor, **over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        x_ptr=x, y_ptr=y, n=x.numel(), stride_x=1, alpha=2.0, BLOCK=64, num_warps=4
    )
    kw.update(over)
    return kw


def test_cache_hits_and_misses(fake_runtime: dict[str, Any]) -> None:
    k = fake_runtime["kernel"]
    x = torch.empty(100)
    y = torch.empty(100)
    launch_cached(k, (2,), **_kwargs(x, y))
    assert len(fake_runtime["plain"]) == 1
    launch_cached(k, (3,), **_kwargs(x, y, alpha=3.0, n=50))  # same classes -> fast
    assert len(fake_runtime["plain"]) == 1
    ((tag, *call),) = fake_runtime["fast"]
    assert tag == 1
    assert call[:4] == [3, 1, 1, 777]
    assert call[4:7] == [1001, ("meta", 1), None]
    # All parameters in signature order, constexprs and defaults included.
    assert call[9:] == [x, y, 50, 1, 3.0, 64, False]
    misses = [
        _kwargs(x.bfloat16(), y),  # dtype
        _kwargs(x[1:], y),  # alignment of data_ptr
        _kwargs(x, y, stride_x=2),  # int class 1 -> other
        _kwargs(x, y, n=64),  # % 16 class
        _kwargs(x, y, n=2**33),  # i64
        _kwargs(x, y, BLOCK=128),  # constexpr value
        _kwargs(x, y, num_warps=8),  # launch option value
        _kwargs(x, y, FLAG=True),  # explicit constexpr default
    ]
    for i, kw in enumerate(misses):
        launch_cached(k, (1,), **kw)
        assert len(fake_runtime["plain"]) == 2 + i, kw
        launch_cached(k, (1,), **kw)  # now cached
        assert len(fake_runtime["plain"]) == 2 + i, kw
    assert launch_cache_info()["compiled"] == 1 + len(misses)


def test_same_class_ints_share_entry(fake_runtime: dict[str, Any]) -> None:
    k = fake_runtime["kernel"]
    x, y = torch.empty(64), torch.empty(64)
    launch_cached(k, (1,), **_kwargs(x, y, n=17))
    launch_cached(k, (1,), **_kwargs(x, y, n=33))
    launch_cached(k, (1,), **_kwargs(x, y, n=48))  # %16 == 0: another class
    assert len(fake_runtime["plain"]) == 2
    assert len(fake_runtime["fast"]) == 1


def test_hooks_or_env_force_plain(
    fake_runtime: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    k = fake_runtime["kernel"]
    x, y = torch.empty(64), torch.empty(64)
    launch_cached(k, (1,), **_kwargs(x, y))
    hook = triton.knobs.runtime.launch_enter_hook

    def enter(*args: Any) -> None:
        pass

    if hasattr(hook, "add"):  # triton >= 3.7: a HookChain
        hook.add(enter)
        try:
            launch_cached(k, (1,), **_kwargs(x, y))
        finally:
            hook.remove(enter)
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", enter)
        launch_cached(k, (1,), **_kwargs(x, y))
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hook)
    assert len(fake_runtime["plain"]) == 2
    set_launch_cache_enabled(False)
    try:
        assert "disabled" in str(launch_fast_path_reason(k))
        launch_cached(k, (1,), **_kwargs(x, y))
    finally:
        set_launch_cache_enabled(True)
    assert len(fake_runtime["plain"]) == 3
    assert not fake_runtime["fast"]


def test_launcher_type_error_disables_fast_path(
    fake_runtime: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    k = fake_runtime["kernel"]
    x, y = torch.empty(64), torch.empty(64)
    launch_cached(k, (1,), **_kwargs(x, y))

    def bad_launcher(*args: Any) -> None:
        raise TypeError("wrong number of arguments")

    info = launch_mod._infos[id(k)]
    key = next(iter(info.entries))
    info.entries[key] = (bad_launcher, *info.entries[key][1:])
    launch_cached(k, (1,), **_kwargs(x, y))  # falls back to the plain launch
    assert len(fake_runtime["plain"]) == 2
    assert launch_fast_path_reason(k) is not None
    launch_cached(k, (1,), **_kwargs(x, y))
    assert len(fake_runtime["plain"]) == 3


def test_signature_without_constexprs_is_not_cached(
    fake_runtime: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older launch convention (launcher takes only non-constexpr args) is never cached."""
    monkeypatch.setattr(
        _FakeSrc,
        "__init__",
        lambda self, fn: (setattr(self, "fn", fn), setattr(self, "signature", {"x_ptr": "*fp32"}))[
            0
        ],
    )
    k = fake_runtime["kernel"]
    x, y = torch.empty(64), torch.empty(64)
    for _ in range(3):
        launch_cached(k, (1,), **_kwargs(x, y))
    assert len(fake_runtime["plain"]) == 3
    assert not fake_runtime["fast"]


def test_unknown_argument_types_go_plain(fake_runtime: dict[str, Any]) -> None:
    k = fake_runtime["kernel"]
    x, y = torch.empty(64), torch.empty(64)
    for _ in range(2):
        launch_cached(k, (1,), **_kwargs(x, y, alpha=object()))
    assert len(fake_runtime["plain"]) == 2
    assert not fake_runtime["fast"]


def test_interpreted_kernels_go_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reason = launch_fast_path_reason(object())
    assert reason is not None
    assert "TRITON_INTERPRET" in reason or "not a plain" in reason


def test_non_jit_objects_go_plain() -> None:
    calls = []

    class Fake:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            return lambda **kw: calls.append((grid, kw))

    launch_cached(Fake(), (4,), a=1)
    assert calls == [((4,), {"a": 1})]


def test_interpreter_launch_runs(device: torch.device) -> None:
    """The plain path really launches (interpreter on CPU, JIT + cache on GPU)."""
    if not triton_usable(device):
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    x = torch.randn(100, device=device)
    y = torch.empty(100, device=device)
    launch_cached(scale_copy, (2,), **_kwargs(x, y, alpha=0.5))
    torch.testing.assert_close(y, x * 0.5)


@pytest.mark.gpu
def test_gpu_cached_path_correct_when_args_change(device: torch.device) -> None:
    """dtype / shape / strides / alignment / constexprs change between calls: results exact."""
    clear_launch_cache()
    k = scale_copy
    for _round in range(2):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for n, stride, offset, flag in (
                (100, 1, 0, False),
                (64, 2, 0, True),
                (33, 3, 1, False),
                (1, 1, 1, True),
            ):
                base = torch.randn(n * stride + offset + 4, device=device).to(dtype)
                x = base[offset : offset + n * stride : stride]
                y = torch.full((n,), float("nan"), device=device, dtype=dtype)
                y_plain = torch.full((n,), float("nan"), device=device, dtype=dtype)
                grid = (triton.cdiv(n, 32),)
                kw = dict(n=n, stride_x=stride, alpha=1.5, BLOCK=32, FLAG=flag)
                launch_cached(k, grid, x_ptr=x, y_ptr=y, **kw)
                k[grid](x_ptr=x, y_ptr=y_plain, **kw)  # the plain JIT launch, same binary
                assert torch.equal(y, y_plain), (dtype, n, stride, offset, flag)
                want = (x.float() * 1.5 + (1.0 if flag else 0.0)).to(dtype)
                torch.testing.assert_close(y, want)
    info = launch_cache_info()
    assert info["fast"] > 0, info
    print(f"\nlaunch cache: {info}, reason: {launch_fast_path_reason(k)}")


@pytest.mark.gpu
def test_gpu_cached_launch_under_cuda_graph(device: torch.device) -> None:
    k = scale_copy
    x = torch.randn(256, device=device)
    y = torch.zeros(256, device=device)
    kw = dict(x_ptr=x, y_ptr=y, n=256, stride_x=1, alpha=2.0, BLOCK=64)
    launch_cached(k, (4,), **kw)  # compile + cache outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_cached(k, (4,), **kw)
    y.zero_()
    x.copy_(torch.randn(256, device=device))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 2.0)


@pytest.mark.gpu
def test_gpu_launch_overhead_report(device: torch.device) -> None:
    """Prints host µs per launch: plain JIT vs launch_cached vs a plain torch op (no assert)."""
    x = torch.empty(16, device=device)
    iters = 2000

    def per_call(fn: Any) -> float:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / iters * 1e6

    plain = per_call(lambda: empty_kernel[(1,)](x_ptr=x, n=16))
    cached = per_call(lambda: launch_cached(empty_kernel, (1,), x_ptr=x, n=16))
    torch_op = per_call(lambda: x.add_(1))
    from cpattn_common.ops.merge_attn_states import merge_attn_states

    outs = torch.randn(4, 8, 16, 128, device=device, dtype=torch.bfloat16)
    lses = torch.randn(4, 8, 16, device=device)
    merge = per_call(lambda: merge_attn_states(outs, lses))
    print(
        f"\nhost us/launch: triton plain {plain:.1f}, launch_cached {cached:.1f}, "
        f"torch add_ {torch_op:.1f}, merge_attn_states {merge:.1f} "
        f"(fast path: {launch_fast_path_reason(empty_kernel) or 'on'}, {launch_cache_info()})"
    )
