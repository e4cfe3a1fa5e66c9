"""``cpattn_common.device``: which tensors are off the current CUDA device, and
``merge_attn_states`` on such tensors (it runs on their device, as torch's ops do)."""

from __future__ import annotations

import pytest
import torch

from cpattn_common import merge_attn_states
from cpattn_common.device import foreign_cuda_device


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_non_cuda_tensors_are_never_foreign(device: str) -> None:
    assert foreign_cuda_device(torch.empty(3, device=device)) == -1


@pytest.mark.gpu
def test_tensor_on_the_current_device_is_not_foreign(device: torch.device) -> None:
    with torch.cuda.device(device):
        assert foreign_cuda_device(torch.empty(3, device=device)) == -1


@pytest.mark.multigpu(2)
def test_tensor_on_another_device_is_foreign() -> None:
    with torch.cuda.device(0):
        assert foreign_cuda_device(torch.empty(3, device="cuda:1")) == 1
        assert foreign_cuda_device(torch.empty(3, device="cuda:0")) == -1
    with torch.cuda.device(1):
        assert foreign_cuda_device(torch.empty(3, device="cuda:0")) == 0


@pytest.mark.multigpu(2)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_attn_states_runs_on_its_tensors_device(dtype: torch.dtype) -> None:
    other = torch.device("cuda", 1)
    for seed in range(3):
        gen = torch.Generator(device=other).manual_seed(seed)
        partial_outs = torch.randn(3, 9, 8, 80, generator=gen, device=other).to(dtype)
        partial_lses = torch.randn(3, 9, 8, generator=gen, device=other) * 4
        partial_lses[0, 0, 0] = float("nan")
        partial_lses[:, 1, 1] = float("-inf")
        with torch.cuda.device(other):
            want = merge_attn_states(partial_outs, partial_lses)
        with torch.cuda.device(0):
            got = merge_attn_states(partial_outs, partial_lses)
            assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(other)
        for g, w in zip(got, want, strict=True):
            assert g.device == other
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
