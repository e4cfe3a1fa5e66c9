"""Collective combines without processes: argument validation (before any communication)
and the world-size-1 single-source combine (no communication at all)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_dcp import cp_lse_ag_out_ar, cp_lse_ag_out_rs, dcp_a2a_lse_reduce

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

OPS: list[Callable[..., Any]] = [cp_lse_ag_out_rs, cp_lse_ag_out_ar, dcp_a2a_lse_reduce]


class _FakeGroup:
    """A ``CPGroupLike`` whose collectives must never run (validation fails first, or N=1)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rank_in_group = 0
        self.device_group = None

    def _fail(self, *args: object, **kwargs: object) -> Any:
        raise AssertionError("no collective may run in this test")

    all_gather = reduce_scatter = all_reduce = all_to_all_single = _fail
    all_gather_into_tensor = barrier = _fail


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_bad_inputs(device: torch.device, op: Callable[..., Any]) -> None:
    g = _FakeGroup(2)
    out = torch.randn(3, 4, 16, device=device)
    lse = torch.randn(3, 4, device=device)
    with pytest.raises(ValueError, match=r"expected cp_attn_out \[B, H, D\], got shape \(3, 4\)"):
        op(out[:, :, 0], lse, g)
    with pytest.raises(ValueError, match=r"expected cp_attn_lse \[B, H\], got shape \(3,\)"):
        op(out, lse[:, 0], g)
    with pytest.raises(ValueError, match=r"\(3, 4, 16\) and cp_attn_lse \(2, 4\) disagree"):
        op(out, lse[:2], g)
    with pytest.raises(ValueError, match=r"\(3, 4, 16\) and cp_attn_lse \(3, 3\) disagree"):
        op(out, lse[:, :3], g)
    with pytest.raises(TypeError, match="cp_attn_lse must be a floating"):
        op(out, lse.long(), g)
    with pytest.raises(TypeError, match="cp_attn_out must be a floating"):
        op(out.int(), lse, g)
    with pytest.raises(ValueError, match="float64 is not supported"):
        op(out.double(), lse, g)
    with pytest.raises(TypeError, match="must be tensors"):
        op(out.tolist(), lse, g)
    with pytest.raises(ValueError, match=r"head_dim 0|head_dim must be >= 1"):
        op(out[..., :0], lse, g)
    with pytest.raises(ValueError, match="provided together"):
        op(out, lse, g, seq_lens=torch.tensor([1], device=device))
    with pytest.raises(ValueError, match="one boundary per sequence"):
        op(
            out,
            lse,
            g,
            seq_lens=torch.tensor([1, 2], device=device),
            query_start_loc=torch.tensor([0, 3], device=device),
        )
    if op is not cp_lse_ag_out_ar:
        with pytest.raises(ValueError, match="H=6 must be divisible by DCP world size 4"):
            op(torch.randn(3, 6, 8, device=device), torch.randn(3, 6, device=device), _FakeGroup(4))
    if device.type == "cuda":
        with pytest.raises(ValueError, match="device"):
            op(out, lse.cpu(), g)
    with pytest.raises(TypeError, match="ProcessGroup"):
        op(out, lse, object())


def _neg_bit(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor with torch's negative bit: memory holds ``-t``."""
    view = torch._neg_view(-t)
    assert view.is_neg()
    return view


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_inputs_with_the_negative_bit_raise(device: torch.device, op: Callable[..., Any]) -> None:
    """A lazily negated view keeps ``-t`` in memory, which the kernels read: the eager call
    combined the negated values (or LSEs) without a word. It is refused with its remedy."""
    out = torch.randn(3, 4, 16, device=device)
    lse = torch.randn(3, 4, device=device)
    for name, args in (
        ("cp_attn_out", (_neg_bit(out), lse)),
        ("cp_attn_lse", (out, _neg_bit(lse))),
    ):
        with pytest.raises(ValueError, match=rf"{name} has torch's negative bit set .* "
                           rf"pass {name}\.resolve_neg\(\)"):  # fmt: skip
            op(*args, _FakeGroup(1))


def test_a2a_pack_and_unpack_refuse_buffers_with_the_negative_bit(device: torch.device) -> None:
    from cpattn_dcp.ops.a2a_combine import a2a_pack, a2a_unpack_combine

    out = torch.randn(3, 4, 16, device=device, dtype=torch.bfloat16)
    lse = torch.randn(3, 4, device=device)
    send = a2a_pack(out, lse, 2)
    with pytest.raises(ValueError, match="a2a_pack: send has torch's negative bit"):
        a2a_pack(out, lse, 2, send=_neg_bit(torch.empty_like(send)))
    with pytest.raises(ValueError, match="a2a_unpack_combine: recv has torch's negative bit"):
        a2a_unpack_combine(_neg_bit(send), head_dim=16)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_world_size_1(device: torch.device, op: Callable[..., Any], dtype: torch.dtype) -> None:
    """One source: valid rows pass through, empty/padding/-inf rows become 0 with LSE -inf;
    always the same return type as for N > 1."""
    g = _FakeGroup(1)
    b, h, d = 6, 3, 24
    out = torch.randn(b, h, d).to(dtype).to(device)
    lse = (torch.randn(b, h) * 3).to(device)
    out[1, 2] = math.nan
    lse[1, 2] = -math.inf
    lse[2, 0] = math.nan
    out[2, 0] = math.nan
    seq_lens = torch.tensor([2, 0], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)  # rows 3, 4 empty; 5 pad
    res = op(out, lse, g, return_lse=True, seq_lens=seq_lens, query_start_loc=qsl)
    assert isinstance(res, tuple)
    got, got_lse = res
    assert got.shape == (b, h, d)
    assert got.dtype == dtype
    assert got_lse.shape == (b, h)
    dead = torch.zeros(b, h, dtype=torch.bool)
    dead[3:] = True
    dead[1, 2] = dead[2, 0] = True
    dead = dead.to(device)
    assert (got[dead] == 0).all()
    assert torch.isneginf(got_lse[dead]).all()
    assert torch.equal(got[~dead], out[~dead])
    torch.testing.assert_close(got_lse[~dead], lse[~dead].to(got_lse.dtype))
    plain = op(out, lse, g)
    assert isinstance(plain, torch.Tensor)
