"""``CPTritonContext``: both launch spellings reach the cached launcher with the same arguments."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from cpattn_dcp import CPTritonContext


@triton.jit
def _scaled_copy(src_ptr, dst_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=m) * SCALE, mask=m)


def test_call_kernel_matches_launch(device: torch.device) -> None:
    ctx = CPTritonContext()
    src = torch.randn(100, device=device)
    by_keyword = torch.full_like(src, float("nan"))
    positional = torch.full_like(src, float("nan"))
    ctx.launch(_scaled_copy, (4,), src_ptr=src, dst_ptr=by_keyword, n=100, SCALE=3.0, BLOCK=32)
    ctx.call_kernel(_scaled_copy, (4,), src, positional, 100, SCALE=3.0, BLOCK=32)
    torch.testing.assert_close(positional, src * 3.0, rtol=0, atol=0)
    torch.testing.assert_close(by_keyword, positional, rtol=0, atol=0)


def test_call_kernel_bad_arguments(device: torch.device) -> None:
    ctx = CPTritonContext()
    src = torch.randn(8, device=device)
    with pytest.raises(TypeError, match="takes 5 arguments, 6 given positionally"):
        ctx.call_kernel(_scaled_copy, (1,), src, src, 8, 1.0, 8, 9)
    with pytest.raises(TypeError, match=r"multiple values for \['n'\]"):
        ctx.call_kernel(_scaled_copy, (1,), src, src, 8, n=8, SCALE=1.0, BLOCK=8)
