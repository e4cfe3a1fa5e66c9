"""CachedKernel: the handle cache's keys with a stand-in kernel (CPU), real launches (GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton
import triton.language as tl

from cpattn_common import launch as launch_mod
from cpattn_common.launch import CachedKernel, _key


def scale_copy_body(x_ptr, y_ptr, n, stride_x, alpha, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    """``y[i] = alpha * x[i * stride_x]`` (+1 when FLAG) for i < n."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride_x, mask=mask).to(tl.float32)
    y = x * alpha
    if FLAG:
        y = y + 1.0
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


scale_copy = triton.jit(scale_copy_body)


class _FakeJit:
    """Stands in for a JIT kernel: ``kernel[grid](...)`` records the call and returns a
    handle whose ``handle[grid](*args)`` records too."""

    def __init__(self, fn: Any):
        self.fn = fn
        self.__name__ = fn.__name__
        self.jit_calls: list[tuple[Any, ...]] = []
        self.handle_calls: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.jit_calls.append((grid, args, kwargs))
            return self._Handle(self)

        return run

    class _Handle:
        def __init__(self, owner: _FakeJit):
            self.owner = owner

        def __getitem__(self, grid: Any) -> Any:
            return lambda *args: self.owner.handle_calls.append((grid, args))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> _FakeJit:
    monkeypatch.setattr(launch_mod, "_handles_supported", lambda kernel: True)
    monkeypatch.setattr(launch_mod, "current_device", lambda: 0)
    return _FakeJit(scale_copy_body)


def test_first_call_of_a_key_is_a_jit_launch_then_the_handle(fake: _FakeJit) -> None:
    spec = CachedKernel(fake).specialize(BLOCK=64, FLAG=True, num_warps=4)
    x, y = torch.zeros(8), torch.zeros(8)
    spec((2,), x, y, 8, 1, 0.5)
    assert fake.jit_calls == [
        ((2,), (x, y, 8, 1, 0.5), {"BLOCK": 64, "FLAG": True, "num_warps": 4})
    ]
    spec((3, 2), x, y, 8, 1, 0.5)
    # the handle takes every parameter in signature order (constexprs last), the grid as 3-D
    assert fake.handle_calls == [((3, 2, 1), (x, y, 8, 1, 0.5, 64, True))]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((torch.zeros(8), 8), (torch.zeros(8, dtype=torch.float16), 8)),  # dtype
        ((torch.zeros(8), 8), (torch.zeros(9)[1:], 8)),  # 16-byte alignment
        ((torch.zeros(8), 8), (torch.zeros(8), 1)),  # an int equal to 1
        ((torch.zeros(8), 8), (torch.zeros(8), 16)),  # a multiple of 16
        ((torch.zeros(8), 8), (torch.zeros(8), 2**31)),  # beyond int32
        ((torch.zeros(8), 8), (torch.zeros(8), 2**63)),  # beyond int64
    ],
    ids=["dtype", "align", "one", "div16", "int64", "uint64"],
)
def test_each_triton_specialization_class_gets_its_own_handle(
    fake: _FakeJit, first: tuple[Any, int], second: tuple[Any, int]
) -> None:
    spec = CachedKernel(fake).specialize(BLOCK=64, FLAG=False)
    y = torch.zeros(8)
    for x, n in (first, second, first, second):
        spec((1,), x, y, n, 1, 1.0)
    assert len(fake.jit_calls) == 2
    assert len(fake.handle_calls) == 2


def test_values_of_one_class_share_a_handle(fake: _FakeJit) -> None:
    spec = CachedKernel(fake).specialize(BLOCK=64, FLAG=False)
    x, y = torch.zeros(64), torch.zeros(64)
    for n in (3, 5, 7, 21):
        spec((1,), x, y, n, 2, 1.5)
    assert len(fake.jit_calls) == 1
    assert len(fake.handle_calls) == 3


def test_constexpr_between_runtime_args_takes_plain_launches(fake: _FakeJit) -> None:
    def body(x_ptr, BLOCK: tl.constexpr, n):  # type: ignore[no-untyped-def]
        pass

    kernel = _FakeJit(body)
    spec = CachedKernel(kernel).specialize(BLOCK=64)
    for _ in range(3):
        spec((1,), torch.zeros(4), 4)
    assert len(kernel.jit_calls) == 3
    assert kernel.handle_calls == []


def test_defaulted_parameter_left_out_takes_plain_launches(fake: _FakeJit) -> None:
    def body(x_ptr, n, m=3, BLOCK: tl.constexpr = 16):  # type: ignore[no-untyped-def]
        pass

    kernel = _FakeJit(body)
    spec = CachedKernel(kernel).specialize(BLOCK=64)
    for _ in range(3):
        spec((1,), torch.zeros(4), 4)  # m not given: its default is the JIT's to apply
    assert len(kernel.jit_calls) == 3


def test_arg_key_classes() -> None:
    def arg_key(arg: Any) -> Any:
        return _key((arg,))[0]

    assert arg_key(7) == arg_key(9) != arg_key(1)
    assert arg_key(32) == arg_key(48) != arg_key(40)
    assert arg_key(0.5) is arg_key(2.0) is float
    assert arg_key(True) is bool
    assert arg_key(None) is type(None)


def test_plain_launch_without_handles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPATTN_LAUNCH_CACHE", "0")
    kernel = _FakeJit(scale_copy_body)
    kernel.__class__ = type("JIT", (_FakeJit, triton.runtime.JITFunction), {})
    spec = CachedKernel(kernel).specialize(BLOCK=64, FLAG=False)
    for _ in range(3):
        spec((1,), torch.zeros(4), torch.zeros(4), 4, 1, 1.0)
    assert len(kernel.jit_calls) == 3


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not isinstance(scale_copy, triton.runtime.JITFunction):  # Triton's interpreter
        return torch.device("cpu")
    pytest.skip("needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_kernel_matches_float64_reference(dtype: torch.dtype) -> None:
    device = _device()
    spec = CachedKernel(scale_copy).specialize(BLOCK=128, FLAG=True, num_warps=4)
    for n, stride, offset in [(100, 1, 0), (100, 1, 1), (257, 2, 0), (1, 1, 0), (64, 3, 5)]:
        base = torch.randn(n * stride + offset + 1, device=device, dtype=dtype)
        x = base[offset : offset + n * stride]
        y = torch.full((n,), float("nan"), device=device, dtype=dtype)
        spec((triton.cdiv(n, 128),), x, y, n, stride, 0.75)
        ref = x[::stride].double() * 0.75 + 1.0
        torch.testing.assert_close(
            y.double(), ref, rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=1e-2
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_handles_are_captured_in_cuda_graphs() -> None:
    spec = CachedKernel(scale_copy).specialize(BLOCK=128, FLAG=False)
    x = torch.randn(300, device="cuda")
    y = torch.empty_like(x)
    spec((3,), x, y, 300, 1, 2.0)  # compiles; the capture then replays the handle
    spec((3,), x, y, 300, 1, 2.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        spec((3,), x, y, 300, 1, 2.0)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(y, 2.0 * x)


def test_a_pointer_triton_refuses_gets_a_clear_error(fake: _FakeJit) -> None:
    class Refusing(_FakeJit):
        def __getitem__(self, grid: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                raise ValueError(
                    "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"
                )

            return run

    spec = CachedKernel(Refusing(scale_copy_body)).specialize(BLOCK=64, FLAG=False)
    with pytest.raises(ValueError, match="every tensor must be on a CUDA device"):
        spec((1,), torch.zeros(4), torch.zeros(4), 4, 1, 1.0)
