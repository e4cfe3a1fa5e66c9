"""The cp-dcp ops given tensors on another GPU than the current one (``cpattn_common.device``).

Each op runs with ``cuda:1`` current (the home call) and then, on a fresh copy of the same
inputs, with ``cuda:0`` current (the foreign call). The foreign call must return bit for bit
what the home call returns, write its in-place outputs the same, and leave ``cuda:0`` current.
Without the guard a Triton launch goes to ``cuda:0`` with pointers into ``cuda:1``. The home
calls' own correctness is covered by the ops' test files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_dcp import (
    a2a_pack,
    a2a_unpack_combine,
    correct_attn_out,
    cp_lse_ag_out_ar,
    cp_lse_ag_out_rs,
    dcp_a2a_lse_reduce,
    mask_dcp_empty_shards_,
)
from cpattn_testing.simulated import SimulatedWorld

pytestmark = [pytest.mark.multigpu(2), pytest.mark.filterwarnings("ignore::RuntimeWarning")]

_OTHER = torch.device("cuda", 1)


def _clone(x: Any) -> Any:
    """A copy with the same strides (``clone`` makes a gappy view contiguous)."""
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _flat(x: Any) -> list[Any]:
    if isinstance(x, tuple | list):
        return [y for item in x for y in _flat(item)]
    return [x]


def _same(got: Any, want: Any) -> None:
    for g, w in zip(_flat(got), _flat(want), strict=True):
        if isinstance(w, torch.Tensor):
            assert g.device == w.device
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        else:
            assert g == w


def _lse(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random LSEs with a NaN, a +inf and an all--inf entry among them."""
    x = torch.randn(shape, generator=gen, device=_OTHER) * 4
    x.view(-1)[0] = float("nan")
    x.view(-1)[1] = float("inf")
    x.view(-1)[-1] = float("-inf")
    return x.to(dtype)


def _out(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=_OTHER).to(dtype)


def _masks(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two requests, the second with an empty local shard, and one padding row."""
    seq_lens = torch.tensor([5, 0], dtype=torch.int32, device=_OTHER)
    query_start_loc = torch.tensor([0, (b - 1) // 2, b - 1], dtype=torch.int32, device=_OTHER)
    return seq_lens, query_start_loc


def _both(make: Callable[[torch.Generator], tuple[Any, ...]], call: Callable[..., Any]) -> None:
    """Three home calls and three foreign calls on fresh inputs each; every foreign call
    equals the home call on the same inputs, in-place arguments included."""
    for i in range(3):
        gen = torch.Generator(device=_OTHER).manual_seed(10 + i)
        args = make(gen)
        foreign_args = tuple(_clone(a) for a in args)
        with torch.cuda.device(_OTHER):
            want = call(*args)
        with torch.cuda.device(0):
            got = call(*foreign_args)
            assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(_OTHER)
        _same(got, want)
        _same(foreign_args, args)


_B, _H, _D, _N = 9, 8, 128, 2

_CASES: dict[str, tuple[Callable[[torch.Generator], tuple[Any, ...]], Callable[..., Any]]] = {
    "correct_attn_out": (
        lambda g: (_out(g, _B, _H, _D), _lse(g, _N, _B, _H)),
        lambda out, lses: correct_attn_out(out, lses, 1),
    ),
    # A strided output and fp16 LSEs: the general kernel (launch_correct).
    "correct_attn_out_strided": (
        lambda g: (_out(g, _B, 2 * _H, _D)[:, ::2], _lse(g, _N, _B, _H, dtype=torch.float16)),
        lambda out, lses: correct_attn_out(out, lses, 0, is_lse_base_on_e=False),
    ),
    "mask_dcp_empty_shards_": (
        lambda g: (_lse(g, _B, _H), *_masks(_B)),
        lambda lse, s, q: mask_dcp_empty_shards_(lse, s, q),
    ),
    "a2a_pack_unpack": (
        lambda g: (_out(g, _B, _H, _D), _lse(g, _B, _H), *_masks(_B)),
        lambda out, lse, s, q: a2a_unpack_combine(
            a2a_pack(out, lse, _N, seq_lens=s, query_start_loc=q), head_dim=_D, return_lse=True
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_op_runs_on_its_tensors_device(name: str) -> None:
    _both(*_CASES[name])


def _world_call(op: Callable[..., Any], *, current: int | None) -> Callable[..., Any]:
    """``call(out, lse, s, q)`` running ``op`` on two simulated ranks of ``cuda:1`` (rank r
    takes ``out[r]``, ``lse[r]``), each rank thread with ``current`` current (None: cuda:1,
    the world's device)."""
    world = SimulatedWorld(_N, _OTHER)

    def call(out: torch.Tensor, lse: torch.Tensor, s: torch.Tensor, q: torch.Tensor) -> Any:
        def rank(group: Any) -> Any:
            if current is not None:
                torch.cuda.set_device(current)
            r = group.rank_in_group
            res = op(out[r], lse[r], group, return_lse=True, seq_lens=s, query_start_loc=q)
            assert torch.cuda.current_device() == (1 if current is None else current)
            return res

        return world.run(rank)

    return call


@pytest.mark.parametrize("op", [dcp_a2a_lse_reduce, cp_lse_ag_out_rs, cp_lse_ag_out_ar])
def test_collective_runs_on_its_tensors_device(op: Callable[..., Any]) -> None:
    home, foreign = _world_call(op, current=None), _world_call(op, current=0)
    for i in range(3):
        gen = torch.Generator(device=_OTHER).manual_seed(20 + i)
        args = (_out(gen, _N, _B, _H, _D), _lse(gen, _N, _B, _H), *_masks(_B))
        want = home(*args)
        got = foreign(*(_clone(a) for a in args))
        torch.cuda.synchronize(_OTHER)
        _same(got, want)
