"""``cpattn_testing.interpreter``: under Triton's interpreter, bf16 -> fp32 widening is exact
(as on the GPU), bf16 subnormals included."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from cpattn_testing.interpreter import apply_interpreter_fixes, exact_bf16_widening


@triton.jit
def _widen_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n).to(tl.float32), mask=i < n)


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
