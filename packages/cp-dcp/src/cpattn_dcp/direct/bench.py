"""Latency of the direct A2A LSE-reduce versus the packed NCCL A2A (multi-GPU machines).

Call ``direct_a2a_latency`` on every rank of an initialised nccl process group, e.g. through
``cpattn_testing.launcher.run_distributed(direct_a2a_latency_entry, world_size, "nccl")``.
Both paths are captured in CUDA graphs (``graph_calls`` calls per graph, so launch overhead
is out of the picture, as in a decoding engine) and timed with CUDA events after a barrier;
the reported latency per call is the maximum over ranks of each rank's median.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cpattn_dcp.direct.a2a import DirectDCPA2AWorkspace
from cpattn_dcp.ops.a2a_combine import dcp_a2a_lse_reduce

__all__ = ["direct_a2a_latency", "direct_a2a_latency_entry"]


def _time_graph(fn: Callable[[], Any], graph_calls: int, repeats: int) -> float:
    """Median µs per call of ``fn`` replayed from a CUDA graph of ``graph_calls`` calls."""
    fn()  # warm up / compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples: list[float] = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(float(start.elapsed_time(end)) * 1000.0 / graph_calls)
    return statistics.median(samples)


def direct_a2a_latency(
    batch_sizes: Sequence[int] = (1, 8, 64, 256),
    *,
    heads_per_rank: int = 16,
    head_dim: int = 512,
    dtype: torch.dtype = torch.bfloat16,
    graph_calls: int = 20,
    repeats: int = 20,
    group: Any = None,
) -> list[dict[str, Any]]:
    """Per-call latency (µs) of direct vs packed-NCCL A2A at each batch size (collective).

    Args:
        batch_sizes: rows B per call.
        heads_per_rank: H_r (the input has N*H_r heads).
        head_dim: D.
        dtype: output dtype (fp16/bf16).
        graph_calls: calls captured per CUDA graph.
        repeats: timed graph replays (median taken).
        group: process group (default: the world group).

    Returns:
        One dict per batch size: ``B, N, H_r, D, dtype, direct_us, nccl_a2a_us, speedup``
        (latencies are the maximum over ranks), on every rank.
    """
    group = group if group is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    device = torch.device("cuda", torch.cuda.current_device())
    ws = DirectDCPA2AWorkspace(group, device, max(batch_sizes), heads_per_rank, head_dim, dtype)
    rows = []
    for b in batch_sizes:
        gen = torch.Generator(device="cpu").manual_seed(rank * 1000 + b)
        out = torch.randn(b, n * heads_per_rank, head_dim, generator=gen).to(device, dtype)
        lse = torch.randn(b, n * heads_per_rank, generator=gen).to(device)

        def run_direct(o: torch.Tensor = out, l_: torch.Tensor = lse) -> Any:
            return ws.lse_reduce(o, l_)

        def run_nccl(o: torch.Tensor = out, l_: torch.Tensor = lse) -> Any:
            return dcp_a2a_lse_reduce(o, l_, group)

        t_direct = _time_graph(run_direct, graph_calls, repeats)
        t_nccl = _time_graph(run_nccl, graph_calls, repeats)
        times = torch.tensor([t_direct, t_nccl], device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        td, tn = (float(x) for x in times.tolist())
        rows.append(
            {
                "B": b,
                "N": n,
                "H_r": heads_per_rank,
                "D": head_dim,
                "dtype": str(dtype),
                "direct_us": td,
                "nccl_a2a_us": tn,
                "speedup": tn / td if td > 0 else float("nan"),
            }
        )
    torch.cuda.synchronize()
    ws.check_error()
    return rows


def direct_a2a_latency_entry(rank: int, world_size: int, **kwargs: Any) -> list[dict[str, Any]]:
    """``run_distributed``-style entry point: ``fn(rank, world_size)`` -> ``direct_a2a_latency``."""
    del rank, world_size
    return direct_a2a_latency(**kwargs)
