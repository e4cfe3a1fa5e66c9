"""CUDA-graph capture of the combine ops: capture once, replay with new data, match eager.

The collective ops run on a one-rank group (no communication: the single-source combine);
the A2A kernels also run for N = 4 simulated ranks with the exchange done by indexing inside
the graph. GPU only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from cpattn_dcp import (
    a2a_pack,
    a2a_unpack_combine,
    correct_attn_out,
    cp_lse_ag_out_ar,
    cp_lse_ag_out_rs,
    dcp_a2a_lse_reduce,
)

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


class _SoloGroup:
    """A one-rank ``CPGroupLike``: the ops never communicate at world size 1."""

    world_size = 1
    rank_in_group = 0
    device_group = None

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input)

    def barrier(self) -> None:
        return None


def _fill(tensors: list[torch.Tensor], seed: int) -> None:
    """Fresh random data, plus an all-empty row (row 0, head 0) and a NaN LSE."""
    gen = torch.Generator(device=tensors[0].device).manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device) * 3)
    out, lse = tensors
    out[..., 0, 0, :] = math.nan
    lse[..., 0, 0] = -math.inf
    lse[..., 1, 1] = math.nan


def _capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_correct_attn_out_graph(device: torch.device, dtype: torch.dtype) -> None:
    b, h, d, n = 8, 16, 80, 3
    out = torch.empty(b, h, d, device=device, dtype=dtype)
    lses = torch.empty(n, b, h, device=device)
    work = torch.empty_like(out)

    def step() -> torch.Tensor:
        work.copy_(out)
        return correct_attn_out(work, lses, 1)[1]

    graph, lse_static = _capture(step)
    for seed in range(3):
        _fill([out, lses], seed)
        graph.replay()
        assert isinstance(lse_static, torch.Tensor)
        got_out, got_lse = work.clone(), lse_static.clone()
        eager_out = out.clone()
        _, eager_lse = correct_attn_out(eager_out, lses, 1)
        _same(got_out, eager_out)
        _same(got_lse, eager_lse)


@pytest.mark.parametrize("op", [cp_lse_ag_out_rs, cp_lse_ag_out_ar, dcp_a2a_lse_reduce])
def test_collective_ops_graph_world_size_1(device: torch.device, op: Callable[..., object]) -> None:
    b, h, d = 6, 8, 64
    out = torch.empty(b, h, d, device=device, dtype=torch.bfloat16)
    lse = torch.empty(b, h, device=device)
    seq_lens = torch.zeros(3, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1, 3, 5], dtype=torch.int32, device=device)
    group = _SoloGroup()

    def step() -> object:
        return op(out, lse, group, return_lse=True, seq_lens=seq_lens, query_start_loc=qsl)

    graph, static = _capture(step)
    for seed, lens in enumerate(([3, 0, 2], [0, 4, 4], [1, 1, 0])):
        _fill([out, lse], 10 + seed)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        got = [t.clone() for t in static]  # type: ignore[attr-defined]
        want = op(out, lse, group, return_lse=True, seq_lens=seq_lens, query_start_loc=qsl)
        for g, w in zip(got, want, strict=True):  # type: ignore[call-overload]
            _same(g, w)
        assert torch.isneginf(got[1][5]).all()  # padding row
        assert (got[0][5] == 0).all()


def test_a2a_kernels_graph_four_ranks(device: torch.device) -> None:
    n, b, h, d = 4, 8, 8, 128
    outs = torch.empty(n, b, h, d, device=device, dtype=torch.bfloat16)
    lses = torch.empty(n, b, h, device=device)
    seq_lens = torch.tensor([[3, 0, 2, 5]] * n, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 4, 6, 7], dtype=torch.int32, device=device)

    def step() -> list[torch.Tensor]:
        sends = [
            a2a_pack(outs[r], lses[r], n, seq_lens=seq_lens[r], query_start_loc=qsl)
            for r in range(n)
        ]
        results = []
        for dst in range(n):
            recv = torch.stack([s[dst] for s in sends])
            out, lse = a2a_unpack_combine(recv, head_dim=d, return_lse=True)
            assert lse is not None
            results += [out, lse]
        return results

    graph, static = _capture(step)
    for seed in range(3):
        _fill([outs, lses], 20 + seed)
        seq_lens[seed % n, seed] = 0
        graph.replay()
        got = [t.clone() for t in static]  # type: ignore[attr-defined]
        want = step()
        for g, w in zip(got, want, strict=True):
            _same(g, w)
