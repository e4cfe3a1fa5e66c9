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
    CachedKernel,
    clear_launch_cache,
    launch_cache_info,
    launch_cached,
    launch_fast_path_reason,
    set_launch_cache_enabled,
)
from cpattn_common.ops.merge_attn_states import triton_usable
from cpattn_testing.forks import fork_while_held

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


def scale_copy_fixed_body(
    x_ptr,
    y_ptr,
    n: tl.int32,
    stride_x: tl.int64,
    alpha: tl.float32,
    BLOCK: tl.constexpr,
    FLAG: tl.constexpr = False,
):
    """``scale_copy`` with its ints annotated and not specialized (the fast-path style)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride_x, mask=mask).to(tl.float32)
    y = x * alpha
    if FLAG:
        y = y + 1.0
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


_FIXED_INTS = ["n", "stride_x"]
scale_copy_fixed = triton.jit(scale_copy_fixed_body, do_not_specialize=_FIXED_INTS)
scale_copy_fixed_ck = CachedKernel(scale_copy_fixed)
scale_copy_ck = CachedKernel(scale_copy)


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


@pytest.fixture
def fake_runtime(monkeypatch: pytest.MonkeyPatch, fake_triton_driver: Any) -> dict[str, Any]:
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
    monkeypatch.setattr(runtime, "driver", fake_triton_driver)
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


def test_keyword_order_is_part_of_the_key(fake_runtime: dict[str, Any]) -> None:
    """Two call sites passing the same names in another order: ``n=1, stride_x=16`` and
    ``stride_x=1, n=16`` classify alike position by position (an int equal to 1, then one
    divisible by 16), but specialise different parameters; each must get its own binary."""
    k = fake_runtime["kernel"]
    x, y = torch.empty(100), torch.empty(100)
    common = dict(x_ptr=x, y_ptr=y, alpha=2.0, BLOCK=64)
    for _ in range(2):
        launch_cached(k, (1,), n=1, stride_x=16, **common)
    for _ in range(2):
        launch_cached(k, (1,), stride_x=1, n=16, **common)
    assert [(kw["n"], kw["stride_x"]) for kw in fake_runtime["plain"]] == [(1, 16), (16, 1)]
    assert [call[0] for call in fake_runtime["fast"]] == [1, 2]


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


def test_launcher_type_error_refuses_that_key_only(
    fake_runtime: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    k = fake_runtime["kernel"]
    x, y = torch.empty(64), torch.empty(64)
    launch_cached(k, (1,), **_kwargs(x, y))
    launch_cached(k, (1,), **_kwargs(x, y, BLOCK=128))

    def bad_launcher(*args: Any) -> None:
        raise TypeError("wrong number of arguments")

    info = launch_mod._infos[id(k)]
    key = next(iter(info.entries))
    entry = info.entries[key]
    assert entry is not None
    info.entries[key] = (bad_launcher, *entry[1:])
    launch_cached(k, (1,), **_kwargs(x, y))  # falls back to the plain launch
    assert len(fake_runtime["plain"]) == 3
    assert launch_fast_path_reason(k) is None
    launch_cached(k, (1,), **_kwargs(x, y))  # that key: plain from now on
    assert len(fake_runtime["plain"]) == 4
    launch_cached(k, (1,), **_kwargs(x, y, BLOCK=128))  # the kernel's other key: cached
    assert len(fake_runtime["plain"]) == 4
    assert len(fake_runtime["fast"]) == 1


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
    runtime_reason = launch_mod._get_runtime().reason
    if runtime_reason is not None:  # a Triton whose launches all go plain says so first
        assert reason == runtime_reason
    else:
        assert "TRITON_INTERPRET" in reason or "not a plain" in reason


@pytest.mark.parametrize(("version", "fast"), [("3.3.1", False), ("3.4.0", True), ("4.0.0", False)])
def test_triton_versions_without_the_known_launch_convention_go_plain(
    monkeypatch: pytest.MonkeyPatch, version: str, fast: bool
) -> None:
    """Triton 3.3 has no ``triton.knobs`` (the fast path reads its launch hooks there): it was
    inside the known range, so its runtime read "not recognised (AttributeError ...)"."""
    monkeypatch.setattr(triton, "__version__", version)
    reason = launch_mod._Runtime().reason
    if fast:  # the installed Triton's own runtime decides (no knobs before 3.4)
        assert reason is None or "unverified" not in reason
    else:
        assert reason == f"triton {version} has an unverified launch convention"


def test_rocm_goes_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's HIP backend specializes a tensor on a storage of at most 2 GiB (buffer ops),
    which the key does not hold (review: Triton's binder gave ``DS`` and ``D`` for two tensors
    of one key)."""
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert "ROCm" in str(launch_mod._Runtime().reason)


def test_a_clear_while_a_kernel_binds_does_not_leave_it_plain(
    fake_runtime: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's ``clear_launch_cache()`` between ``_setup``'s read of the kernel's info
    and its store of the state bound the kernel to a dropped info: every later launch went
    plain (10 of 10 before the fix), until the next clear."""
    ck = CachedKernel(fake_runtime["kernel"])
    real = launch_mod._info_for
    cleared: list[bool] = []

    def info_for_then_another_thread_clears(kernel: Any) -> Any:
        info = real(kernel)
        if not cleared:
            cleared.append(True)
            clear_launch_cache()
        return info

    monkeypatch.setattr(launch_mod, "_info_for", info_for_then_another_thread_clears)
    x, y = torch.empty(64), torch.empty(64)
    for _ in range(10):
        ck((1,), x, y, 64, 1, 2.0, BLOCK=64)
    # The first call's binding was dropped; the second binds again and compiles once more.
    assert len(fake_runtime["plain"]) == 2
    assert len(fake_runtime["fast"]) == 8


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


# ---- CachedKernel / Specialization (fake runtime) ----------------------------------------


def _rt_args(x: torch.Tensor, y: torch.Tensor, **over: Any) -> tuple[Any, ...]:
    kw = _kwargs(x, y, **over)
    return (kw["x_ptr"], kw["y_ptr"], kw["n"], kw["stride_x"], kw["alpha"])


def test_cached_kernel_hits_misses_and_call_layout(fake_runtime: dict[str, Any]) -> None:
    ck = CachedKernel(fake_runtime["kernel"])
    x, y = torch.empty(100), torch.empty(100)
    ck((2,), *_rt_args(x, y), BLOCK=64, num_warps=4)
    assert len(fake_runtime["plain"]) == 1
    assert fake_runtime["plain"][0] == _kwargs(x, y)
    ck((3, 2), *_rt_args(x, y, alpha=3.0, n=50), BLOCK=64, num_warps=4)  # same classes
    assert len(fake_runtime["plain"]) == 1
    ((_tag, *call),) = fake_runtime["fast"]
    assert call[:4] == [3, 2, 1, 777]
    assert call[4:9] == [1001, ("meta", 1), None, None, None]
    assert call[9:] == [x, y, 50, 1, 3.0, 64, False]  # runtime args, then the constexpr tail
    misses: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (_rt_args(x.bfloat16(), y), {"BLOCK": 64}),  # dtype
        (_rt_args(x[1:], y), {"BLOCK": 64}),  # alignment of data_ptr
        (_rt_args(x, y, stride_x=2), {"BLOCK": 64}),  # int class 1 -> other
        (_rt_args(x, y, n=64), {"BLOCK": 64}),  # % 16 class
        (_rt_args(x, y, n=2**33), {"BLOCK": 64}),  # i64
        (_rt_args(x, y), {"BLOCK": 128}),  # constexpr value
        (_rt_args(x, y), {"BLOCK": 64, "num_warps": 8}),  # launch option
        (_rt_args(x, y), {"BLOCK": 64, "FLAG": True}),  # explicit constexpr default
        (_rt_args(x, y), {"BLOCK": 64, "FLAG": 1}),  # same value, other type
    ]
    for i, (args, cx) in enumerate(misses):
        ck((1,), *args, **cx)
        assert len(fake_runtime["plain"]) == 2 + i, cx
        ck((1,), *args, **cx)  # now cached
        assert len(fake_runtime["plain"]) == 2 + i, cx
    assert launch_fast_path_reason(ck) is None


def test_specialization_keys_only_runtime_args(fake_runtime: dict[str, Any]) -> None:
    ck = CachedKernel(fake_runtime["kernel"])
    spec = ck.specialize(BLOCK=64, FLAG=True, num_warps=2)
    x, y = torch.empty(100), torch.empty(100)
    spec((1,), *_rt_args(x, y))
    spec((1,), *_rt_args(x, y, n=33, alpha=0.5))
    assert len(fake_runtime["plain"]) == 1
    assert fake_runtime["plain"][0]["FLAG"] is True
    assert list(fake_runtime["fast"][-1][10:]) == [x, y, 33, 1, 0.5, 64, True]
    spec((1,), *_rt_args(x.half(), y))  # dtype: a new entry
    spec((1,), *_rt_args(x.half(), y))
    assert len(fake_runtime["plain"]) == 2
    other = ck.specialize(BLOCK=64, FLAG=False, num_warps=2)  # its own entries
    other((1,), *_rt_args(x, y))
    assert len(fake_runtime["plain"]) == 3
    clear_launch_cache()  # forgets the specializations' entries too
    spec((1,), *_rt_args(x, y))
    assert len(fake_runtime["plain"]) == 4
    spec((1,), *_rt_args(x, y))
    assert len(fake_runtime["plain"]) == 4


def test_annotated_unspecialized_ints_are_not_keyed(
    monkeypatch: pytest.MonkeyPatch, fake_triton_driver: Any
) -> None:
    """``n: tl.int32`` / ``stride_x: tl.int64`` in do_not_specialize: one entry for all values."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel = JITFunction(scale_copy_fixed_body, do_not_specialize=_FIXED_INTS)
    runtime = launch_mod._get_runtime()
    if runtime.reason is not None:
        pytest.skip(runtime.reason)
    plain: list[dict[str, Any]] = []
    fast: list[tuple[Any, ...]] = []

    def fake_plain(k: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> Any:
        plain.append(dict(kwargs))
        return _FakeCompiled(k, fast, len(plain))

    monkeypatch.setattr(launch_mod, "_plain", fake_plain)
    monkeypatch.setattr(runtime, "driver", fake_triton_driver)
    clear_launch_cache()
    try:
        info = launch_mod._info_for(kernel)
        assert info.kinds == {
            "x_ptr": launch_mod._ANY,
            "y_ptr": launch_mod._ANY,
            "n": launch_mod._FREE,
            "stride_x": launch_mod._FREE,
            "alpha": launch_mod._FREE,  # Triton never specializes annotated floats
            "BLOCK": launch_mod._VALUE,
            "FLAG": launch_mod._VALUE,
        }
        ck = CachedKernel(kernel)
        x, y = torch.empty(64), torch.empty(64)
        for n, stride in ((1, 1), (16, 2), (17, 2**40), (2**31 - 1, 48)):
            ck((1,), x, y, n, stride, 2.0, BLOCK=32)
            launch_cached(kernel, (1,), x_ptr=x, y_ptr=y, n=n, stride_x=stride, alpha=1.0, BLOCK=32)
        assert len(plain) == 2  # one per entry point
        assert len(fast) == 6
    finally:
        clear_launch_cache()


def test_cached_kernel_plain_fallbacks(
    fake_runtime: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    k = fake_runtime["kernel"]
    ck = CachedKernel(k)
    x, y = torch.empty(64), torch.empty(64)
    args = _rt_args(x, y)
    # a runtime parameter by keyword, an unknown keyword, an unhashable constexpr, a tensor
    # constexpr, a missing constexpr: all plain (Triton decides), nothing cached
    for _ in range(2):
        ck((1,), *args[:4], alpha=2.0, BLOCK=64)
        ck((1,), *args, BLOCK=64, bogus=1)
        ck((1,), *args, BLOCK=[64])
        ck((1,), *args, BLOCK=x)
        ck((1,), *args)
    assert len(fake_runtime["plain"]) == 10
    assert not fake_runtime["fast"]
    with pytest.raises(TypeError, match="runtime arguments"):
        ck((1,), *args, *args, BLOCK=64)
    set_launch_cache_enabled(False)
    try:
        assert "disabled" in str(launch_fast_path_reason(ck))
        ck((1,), *args, BLOCK=64)
        ck((1,), *args, BLOCK=64)
        ck.specialize(BLOCK=64)((1,), *args)
    finally:
        set_launch_cache_enabled(True)
    assert len(fake_runtime["plain"]) == 13
    assert not fake_runtime["fast"]
    ck((1,), *args, BLOCK=64)
    ck((1,), *args, BLOCK=64)
    assert len(fake_runtime["fast"]) == 1


def test_cached_kernel_hooks_and_launcher_errors(fake_runtime: dict[str, Any]) -> None:
    k = fake_runtime["kernel"]
    ck = CachedKernel(k)
    spec = ck.specialize(BLOCK=64)
    x, y = torch.empty(64), torch.empty(64)
    args = _rt_args(x, y)
    spec((1,), *args)
    ck((1,), *args, BLOCK=64)
    hook = triton.knobs.runtime.launch_enter_hook

    def enter(*a: Any) -> None:
        pass

    if not hasattr(hook, "add"):
        pytest.skip("this triton has no HookChain")
    hook.add(enter)
    try:
        spec((1,), *args)
        ck((1,), *args, BLOCK=64)
    finally:
        hook.remove(enter)
    k.pre_run_hooks.append(enter)
    try:
        spec((1,), *args)
    finally:
        k.pre_run_hooks.remove(enter)
    assert len(fake_runtime["plain"]) == 5
    assert not fake_runtime["fast"]
    spec((1,), *args)
    assert len(fake_runtime["fast"]) == 1
    # A launcher that rejects the argument list: plain launch now, and for that key (of that
    # specialization) from then on; the kernel's other entries stay cached.
    st = ck._state
    assert st is not None
    key = next(iter(spec.entries))
    entry = spec.entries[key]
    assert entry is not None
    spec.entries[key] = (_raise_type_error, *entry[1:])
    spec((1,), *args)
    assert len(fake_runtime["plain"]) == 6
    assert launch_fast_path_reason(ck) is None
    spec((1,), *args)
    assert len(fake_runtime["plain"]) == 7
    ck((1,), *args, BLOCK=64)
    ck((1,), *args, BLOCK=64)
    assert len(fake_runtime["plain"]) == 7
    assert len(fake_runtime["fast"]) == 3


def _raise_type_error(*args: Any) -> None:
    raise TypeError("wrong number of arguments")


def test_cached_kernel_needs_trailing_constexprs(fake_runtime: dict[str, Any]) -> None:
    def body(BLOCK: tl.constexpr, x_ptr, n):  # type: ignore[no-untyped-def]
        pass

    ck = CachedKernel(JITFunction(body))
    x = torch.empty(4)
    for _ in range(2):
        ck((1,), x, 4, BLOCK=4)
    assert "follow the runtime parameters" in str(launch_fast_path_reason(ck))
    assert not fake_runtime["fast"]


def test_kernels_without_runtime_args_or_constexprs(fake_runtime: dict[str, Any]) -> None:
    def only_constexpr(BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        pass

    def only_runtime(x_ptr, n):  # type: ignore[no-untyped-def]
        pass

    def nothing():  # type: ignore[no-untyped-def]
        pass

    x = torch.empty(4)
    calls = [
        (JITFunction(only_constexpr), (), {"BLOCK": 4}),
        (JITFunction(only_runtime), (x, 4), {}),
        (JITFunction(nothing), (), {}),
    ]
    for kernel, args, cx in calls:
        ck = CachedKernel(kernel)
        spec = ck.specialize(**cx)
        for _ in range(2):
            ck((1,), *args, **cx)
            spec((1,), *args)
            launch_cached(kernel, (1,), **dict(zip(ck.runtime_names, args, strict=True)), **cx)
    assert len(fake_runtime["plain"]) == 3 * 3 + 1  # launch_cached(nothing) stays plain
    assert len(fake_runtime["fast"]) == 3 * 3 - 1


def test_interpreted_cached_kernel_runs(device: torch.device) -> None:
    """CachedKernel / Specialization really launch (interpreter on CPU, fast path on GPU)."""
    if not triton_usable(device):
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    x = torch.randn(100, device=device)
    y = torch.empty(100, device=device)
    scale_copy_fixed_ck((2,), x, y, 100, 1, 0.5, BLOCK=64)
    torch.testing.assert_close(y, x * 0.5)
    y2 = torch.empty(50, device=device)
    scale_copy_fixed_ck.specialize(BLOCK=32, FLAG=True)((2,), x, y2, 50, 2, 2.0)
    torch.testing.assert_close(y2, x[::2] * 2.0 + 1.0)


class CudaLauncher:
    """Stands in for triton 3.6's launcher class: same name, same ``__call__`` source."""

    def __init__(self) -> None:
        self.global_scratch_size = 0
        self.global_scratch_align = 1
        self.profile_scratch_size = 0
        self.profile_scratch_align = 1
        self.num_ctas = 1
        self.launch_cooperative_grid = False
        self.launch_pdl = True
        self.calls: list[tuple[Any, ...]] = []
        self.launch = lambda *a: self.calls.append(a)

    # fmt: off
    def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # type: ignore[no-untyped-def]

        def allocate_scratch(size, align, allocator):  # type: ignore[no-untyped-def]
            if size > 0:
                grid_size = gridX * gridY * gridZ
                alloc_size = grid_size * self.num_ctas * size
                alloc_fn = allocator.get()
                return alloc_fn(alloc_size, align, stream)
            return None

        global_scratch = allocate_scratch(self.global_scratch_size, self.global_scratch_align, _allocation._allocator)
        profile_scratch = allocate_scratch(self.profile_scratch_size, self.profile_scratch_align,
                                           _allocation._profile_allocator)
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)
    # fmt: on


class _allocation:  # the name the copied __call__ refers to
    _allocator = None
    _profile_allocator = None


def test_direct_native_launch_matches_launcher_call() -> None:
    """The 3.6 direct path passes the native launch exactly what ``__call__`` would."""
    launcher = CudaLauncher()
    direct = launch_mod._direct_launch(launcher, ("meta",))
    assert direct is not None
    native, prefix = direct
    native(1, 2, 3, 7, 99, *prefix, "a0", "a1")
    launcher(1, 2, 3, 7, 99, ("meta",), None, None, None, "a0", "a1")
    assert launcher.calls[0] == launcher.calls[1]
    launcher.global_scratch_size = 128  # needs a scratch buffer: keep the Python launcher
    assert launch_mod._direct_launch(launcher, ("meta",)) is None

    class Other(CudaLauncher):
        def __call__(self, *args: Any) -> None:  # a different launcher source: no direct path
            pass

    Other.__name__ = "CudaLauncher"
    assert launch_mod._direct_launch(Other(), ("meta",)) is None


@pytest.mark.gpu
def test_gpu_cached_kernel_matches_plain_when_args_change(device: torch.device) -> None:
    """CachedKernel / Specialization vs the plain JIT launch while dtypes, sizes, strides,
    alignments and constexprs change between calls: bit-identical results."""
    clear_launch_cache()
    for _round in range(2):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for n, stride, offset, flag in (
                (100, 1, 0, False),
                (64, 2, 0, True),
                (33, 3, 1, False),
                (1, 1, 1, True),
                (4096, 1, 3, False),
            ):
                base = torch.randn(n * stride + offset + 4, device=device).to(dtype)
                x = base[offset : offset + n * stride : stride]
                grid = (triton.cdiv(n, 32),)
                want = torch.full((n,), float("nan"), device=device, dtype=dtype)
                scale_copy_fixed[grid](x, want, n, stride, 1.5, BLOCK=32, FLAG=flag)
                for ck in (scale_copy_fixed_ck, scale_copy_ck):
                    y = torch.full((n,), float("nan"), device=device, dtype=dtype)
                    ck(grid, x, y, n, stride, 1.5, BLOCK=32, FLAG=flag)
                    assert torch.equal(y, want), (ck, dtype, n, stride, offset, flag)
                    y.fill_(float("nan"))
                    ck.specialize(BLOCK=32, FLAG=flag)(grid, x, y, n, stride, 1.5)
                    assert torch.equal(y, want), (ck, dtype, n, stride, offset, flag)
    info = launch_cache_info()
    assert info["fast"] > 0, info
    print(f"\nlaunch cache: {info}, reason: {launch_fast_path_reason(scale_copy_fixed_ck)}")


@pytest.mark.gpu
def test_gpu_specialization_under_cuda_graph(device: torch.device) -> None:
    spec = scale_copy_fixed_ck.specialize(BLOCK=64)
    x = torch.randn(256, device=device)
    y = torch.zeros(256, device=device)
    spec((4,), x, y, 256, 1, 2.0)  # compile + cache outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        spec((4,), x, y, 256, 1, 2.0)
    y.zero_()
    x.copy_(torch.randn(256, device=device))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 2.0)


@pytest.mark.gpu
def test_gpu_host_overhead_vs_add(device: torch.device) -> None:
    """Host µs per call, as ratios to a torch ``add_`` timed in the same run (printed; loose
    bounds only, so a busy host does not fail the suite)."""
    from cpattn_common.ops.merge_attn_states import merge_attn_states

    x = torch.empty(1024, device=device)
    outs = torch.randn(4, 1, 128, 512, device=device, dtype=torch.bfloat16)
    lses = torch.randn(4, 1, 128, device=device)
    spec = scale_copy_fixed_ck.specialize(BLOCK=128)

    def per_call(fn: Any, iters: int = 2000) -> float:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            best = min(best, (time.perf_counter() - t0) / iters * 1e6)
            torch.cuda.synchronize()
        return best

    add = per_call(lambda: x.add_(1.0))
    rows = {
        "triton plain": per_call(lambda: scale_copy_fixed[(1,)](x, x, 16, 1, 1.0, BLOCK=128)),
        "launch_cached": per_call(
            lambda: launch_cached(
                scale_copy_fixed,
                (1,),
                x_ptr=x,
                y_ptr=x,
                n=16,
                stride_x=1,
                alpha=1.0,
                BLOCK=128,
            )
        ),
        "CachedKernel": per_call(lambda: scale_copy_fixed_ck((1,), x, x, 16, 1, 1.0, BLOCK=128)),
        "Specialization": per_call(lambda: spec((1,), x, x, 16, 1, 1.0)),
        "merge_attn_states": per_call(lambda: merge_attn_states(outs, lses)),
    }
    print(f"\nhost us/call: torch add_ {add:.1f}")
    for name, us in rows.items():
        print(f"  {name:18s} {us:6.1f} us  = {us / add:4.2f} x add_")
    print(f"  fast path: {launch_fast_path_reason(scale_copy_fixed_ck) or 'on'}")
    assert rows["Specialization"] < rows["triton plain"]


def test_a_fork_while_another_thread_holds_the_launch_locks_leaves_the_child_free() -> None:
    """The child of a fork taken while another thread was inside an interpreted launch (or
    held the cache lock) must not wait forever on a lock no thread of its own will release."""
    code = fork_while_held(
        (launch_mod._interpreter_lock, launch_mod._lock),
        # The child's module state, read after the fork (the hook replaces the locks).
        lambda: (
            launch_mod._interpreter_lock.acquire(timeout=5) and launch_mod._lock.acquire(timeout=5)
        ),
    )
    assert code == 0
