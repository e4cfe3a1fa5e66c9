"""``cpattn_testing.interpreter``: under Triton's interpreter, bf16 -> fp32 widening is exact
and fp32 -> bf16 narrowing rounds to nearest-even, as on the GPU (where these tests run too)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from cpattn_testing.interpreter import (
    apply_interpreter_fixes,
    exact_bf16_widening,
    rtne_bf16_narrowing,
)


@triton.jit
def _widen_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n).to(tl.float32), mask=i < n)


@triton.jit
def _narrow_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, HOW: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(src_ptr + i, mask=i < n)
    if HOW == "to":
        x = x.to(tl.bfloat16)
    elif HOW == "rtne":
        x = x.to(tl.bfloat16, fp_downcast_rounding="rtne")
    elif HOW == "rtz":
        x = x.to(tl.bfloat16, fp_downcast_rounding="rtz")
    tl.store(dst_ptr + i, x, mask=i < n)  # "store": the store's implicit cast


def _narrowing_inputs() -> torch.Tensor:
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0xBF80C000, 0x7F7FFFFF, 0xFF7FFFFF,
         0x00008000, 0x00018000, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
         0x80000000, 0x3F7FFFFF],
        dtype=torch.int64,
    )  # fmt: skip
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return torch.cat([bits.view(torch.float32), torch.randn(48)])


@pytest.mark.parametrize("how", ["to", "rtne", "store"])
def test_bf16_narrowing_rounds_to_nearest_even(device: torch.device, how: str) -> None:
    """Ties (both parities), just above a tie, overflow to +-inf, subnormals, +-inf, NaN, -0
    and random values narrow to what torch gives (round to nearest, ties to even)."""
    src = _narrowing_inputs().to(device)
    dst = torch.full(src.shape, 7.0, dtype=torch.bfloat16, device=device)
    _narrow_kernel[(1,)](src, dst, src.numel(), BLOCK=64, HOW=how)
    want = src.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(dst.isnan(), nan)
    assert torch.equal(dst[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_bf16_narrowing_rtz_truncates(device: torch.device) -> None:
    src = _narrowing_inputs()[torch.arange(64) != 12].to(device)  # the finite and inf inputs
    src = src[~src.isnan()]
    dst = torch.empty(src.shape, dtype=torch.bfloat16, device=device)
    _narrow_kernel[(1,)](src, dst, src.numel(), BLOCK=64, HOW="rtz")
    want = (src.view(torch.int32) >> 16).to(torch.int16)
    assert torch.equal(dst.view(torch.int16), want)


def test_bf16_widening_is_exact(device: torch.device) -> None:
    """Subnormals (smallest, largest, negative), normals, zeros, +-inf and NaN widen to the
    float32 value torch gives (a 16-bit shift of the bits)."""
    bits = torch.tensor(
        [0x0001, 0x0003, 0x007F, 0x8001, 0x807F, 0x0080, 0x3F80, 0xC2F7, 0x0000, 0x8000,
         0x7F80, 0xFF80, 0x7FC0],
        dtype=torch.int32,
    ).to(torch.int16)  # fmt: skip
    src = bits.view(torch.bfloat16).to(device)
    dst = torch.full(src.shape, 7.0, device=device)
    _widen_kernel[(1,)](src, dst, src.numel(), BLOCK=16)
    want = src.float()
    assert torch.equal(dst.cpu().view(torch.int32), want.cpu().view(torch.int32))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="interpreter runs only")
def test_fix_is_installed_once_under_the_interpreter() -> None:
    apply_interpreter_fixes()
    assert exact_bf16_widening()
    assert exact_bf16_widening()
    assert rtne_bf16_narrowing()
    assert rtne_bf16_narrowing()
