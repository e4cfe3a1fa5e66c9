"""GPU tests of the direct paths.

* ``gpu``: simulated peers on one GPU (peer tables point at N buffers of the device), compiled
  Triton kernels with real CUDA atomics; CUDA-graph capture and replay.
* ``multigpu(2)``: real ranks over nccl and torch symmetric memory: equality with the packed
  NCCL A2A, 10 000 back-to-back calls without a mismatch or hang, CUDA-graph replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_common.ubatch import ubatch_context
from cpattn_dcp.direct import (
    DirectDCPA2AWorkspace,
    DirectDCPKVGatherWorkspace,
    DirectDCPQGatherWorkspace,
)
from cpattn_dcp.ops.a2a_combine import dcp_a2a_lse_reduce
from cpattn_testing.cases import make_dcp_decode_case
from cpattn_testing.pytest_plugin import RunRanks
from cpattn_testing.reference import lse_combine_ref
from cpattn_testing.tolerances import assert_close_to_ref


def _input_ref(case: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float64 combine of the case's rounded partials, empty and padding rows masked."""
    lses = case.partial_lse.to(torch.float64).clone()
    lses[case.empty_rows] = float("-inf")
    lses[:, int(case.query_start_loc[-1]) :] = float("-inf")
    return lse_combine_ref(case.partial_out, lses, is_lse_base_on_e=case.is_lse_base_on_e)


Build = Callable[..., tuple[Any, list[Any]]]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_direct_a2a_simulated_peers_on_one_gpu(
    sim_build: Build, device: torch.device, n: int
) -> None:
    h_r, d, t_max = 4, 512, 64
    _, wss = sim_build(
        n, device, lambda g: DirectDCPA2AWorkspace(g, device, t_max, h_r, d, torch.bfloat16, 2)
    )
    for it, (qpr, pad) in enumerate([(1, 0), (3, 2), (2, 5)] * 4):
        case = make_dcp_decode_case(
            seq_lens=[1, 33, 7, 2, 64], world_size=n, num_heads=n * h_r, head_dim=d,
            queries_per_request=qpr, padding_rows=pad, dtype=torch.bfloat16,
            lse_dtype=torch.bfloat16 if it % 2 else torch.float32, is_lse_base_on_e=it % 3 != 0,
            device=device, seed=it,
        )  # fmt: skip
        b = case.num_rows
        with ubatch_context(it % 2):
            for r in range(n):
                o, lse = case.rank_inputs(r)
                wss[r].publish(o, lse, case.local_seq_lens[r], case.query_start_loc)
            res = [
                wss[r].wait_and_combine(b, is_lse_base_on_e=case.is_lse_base_on_e) for r in range(n)
            ]
        exact, _ = _input_ref(case)
        for r in range(n):
            assert_close_to_ref(res[r], exact[:, r * h_r : (r + 1) * h_r], dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for ws in wss:
        ws.check_error()
        assert ws.epoch.tolist() == [6, 6]


@pytest.mark.gpu
def test_direct_a2a_cuda_graph_simulated(sim_build: Build, device: torch.device) -> None:
    n, t, h_r, d = 2, 8, 2, 128
    _, wss = sim_build(
        n, device, lambda g: DirectDCPA2AWorkspace(g, device, 16, h_r, d, torch.float16, 2)
    )
    outs = torch.randn(n, t, n * h_r, d, device=device).half()
    lses = torch.randn(n, t, n * h_r, device=device)

    def step() -> list[torch.Tensor]:
        with ubatch_context(1):
            for r in range(n):
                wss[r].publish(outs[r], lses[r])
            return [wss[r].wait_and_combine(t) for r in range(n)]

    step()  # warm up (compile) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for k in range(3):
        outs.copy_(torch.randn_like(outs))
        lses.copy_(torch.randn_like(lses))
        before = wss[0].epoch[1].item()
        graph.replay()
        torch.cuda.synchronize()
        assert wss[0].epoch[1].item() == before + 1
        ref, _ = lse_combine_ref(outs, lses)
        for r in range(n):
            assert_close_to_ref(static[r], ref[:, r * h_r : (r + 1) * h_r], dtype=torch.float16)
        if k == 1:  # an eager call on the same workspace between replays
            eager = step()
            for r in range(n):
                assert_close_to_ref(eager[r], ref[:, r * h_r : (r + 1) * h_r], dtype=torch.float16)
    for ws in wss:
        ws.check_error()


@pytest.mark.gpu
def test_direct_gathers_simulated_peers_on_one_gpu(sim_build: Build, device: torch.device) -> None:
    n, h_r, d = 4, 6, 576
    _, qs = sim_build(n, device, lambda g: DirectDCPQGatherWorkspace(
        g, device, 128, h_r, d, torch.bfloat16, 2, 32, require_multicast=False))  # fmt: skip
    _, kvs = sim_build(n, device, lambda g: DirectDCPKVGatherWorkspace(
        g, device, 256, d, torch.bfloat16, 2, require_multicast=False))  # fmt: skip
    for t in (1, 17, 128):
        full = torch.randn(t, n * h_r, d, device=device).bfloat16()
        for r in range(n):
            qs[r].publish(full[:, r * h_r : (r + 1) * h_r])
        for r in range(n):
            assert torch.equal(qs[r].wait(t), full)
        rows = min(t, 256 // n)
        local = [full[:rows, r].contiguous() for r in range(n)]
        outs = [torch.empty(n * rows, d, device=device, dtype=torch.bfloat16) for _ in range(n)]
        for r in range(n):
            kvs[r].publish(local[r])
        for r in range(n):
            kvs[r].wait(outs[r])
            assert torch.equal(outs[r], torch.cat(local))
    torch.cuda.synchronize()
    for ws in (*qs, *kvs):
        ws.check_error()


@pytest.mark.multigpu(2)
def test_direct_workspaces_run_on_their_device(sim_build: Build) -> None:
    """Workspaces on ``cuda:1`` called with ``cuda:0`` current (``on_workspace_device``):
    the same results as with ``cuda:1`` current, and ``cuda:0`` stays current."""
    other = torch.device("cuda", 1)
    n, t, h_r, d = 2, 8, 2, 128
    _, a2as = sim_build(
        n, other, lambda g: DirectDCPA2AWorkspace(g, other, 16, h_r, d, torch.float16, 1)
    )
    _, qs = sim_build(n, other, lambda g: DirectDCPQGatherWorkspace(
        g, other, 16, h_r, d, torch.bfloat16, 1, require_multicast=False))  # fmt: skip
    _, kvs = sim_build(n, other, lambda g: DirectDCPKVGatherWorkspace(
        g, other, 32, d, torch.bfloat16, 1, require_multicast=False))  # fmt: skip
    gen = torch.Generator(device=other).manual_seed(7)
    outs = torch.randn(n, t, n * h_r, d, generator=gen, device=other).half()
    lses = torch.randn(n, t, n * h_r, generator=gen, device=other)
    query = torch.randn(t, n * h_r, d, generator=gen, device=other).bfloat16()
    kv = [torch.randn(t, d, generator=gen, device=other).bfloat16() for _ in range(n)]

    def step() -> list[torch.Tensor]:
        for r in range(n):
            a2as[r].publish(outs[r], lses[r])
            qs[r].publish(query[:, r * h_r : (r + 1) * h_r])
            kvs[r].publish(kv[r])
        res = [a2as[r].wait_and_combine(t, return_lse=True) for r in range(n)]
        res += [qs[r].wait(t) for r in range(n)]
        for r in range(n):
            gathered = torch.empty(n * t, d, dtype=torch.bfloat16, device=other)
            kvs[r].wait(gathered)
            res.append(gathered)
        return _flat_tensors(res)

    with torch.cuda.device(other):
        want = step()
    with torch.cuda.device(0):
        got = step()
        assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(other)
    for g, w in zip(got, want, strict=True):
        assert g.device == other
        assert torch.equal(g, w)
    for ws in (*a2as, *qs, *kvs):
        ws.check_error()
        assert ws.epoch.tolist() == [2]


def _flat_tensors(items: list[Any]) -> list[torch.Tensor]:
    flat: list[torch.Tensor] = []
    for item in items:
        flat.extend(item if isinstance(item, tuple) else (item,))
    return flat


# --- real ranks ------------------------------------------------------------------------------


def _nccl_equivalence_body(rank: int, world_size: int, iters: int) -> dict[str, Any]:
    import torch.distributed as dist

    group = dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device())
    h_r, d = 6, 512
    ws = DirectDCPA2AWorkspace(group, device, 128, h_r, d, torch.bfloat16, 2)
    report: dict[str, Any] = {}
    sets = []
    for i, (qpr, pad) in enumerate([(1, 0), (3, 2), (2, 3), (1, 60)]):
        case = make_dcp_decode_case(
            seq_lens=[1, 300, 17, 2 * world_size], world_size=world_size,
            num_heads=world_size * h_r, head_dim=d, queries_per_request=qpr, padding_rows=pad,
            dtype=torch.bfloat16, lse_dtype=torch.bfloat16 if i % 2 else torch.float32,
            is_lse_base_on_e=i % 2 == 0, device=device, seed=100 + i,
        )  # fmt: skip
        o, lse = case.rank_inputs(rank)
        # lse_reduce's positional order: out, lse, is_lse_base_on_e, seq_lens, query_start_loc
        args = (o, lse, case.is_lse_base_on_e, case.local_seq_lens[rank], case.query_start_loc)
        ref = dcp_a2a_lse_reduce(
            o.clone(), lse.clone(), group, is_lse_base_on_e=args[2], seq_lens=args[3],
            query_start_loc=args[4],
        )  # fmt: skip
        got = ws.lse_reduce(*args)
        assert isinstance(got, torch.Tensor)
        diff = (got.float() - ref.float()).abs()
        ulp = ref.float().abs().clamp_min(1e-30) * 2.0**-7
        report[f"set{i}_bitwise"] = bool(torch.equal(got, ref))
        report[f"set{i}_within_1ulp"] = bool((diff <= ulp).all())
        assert_close_to_ref(
            got, _input_ref(case)[0][:, rank * h_r : (rank + 1) * h_r], dtype=torch.bfloat16
        )
        sets.append((args, got.clone()))
    # Back-to-back calls, alternating micro-batches, no host sync inside the loop; every result
    # must equal the first direct result of the same inputs (the path is deterministic).
    mismatches = torch.zeros((), dtype=torch.int64, device=device)
    for k in range(iters):
        args, ref = sets[k % len(sets)]
        with ubatch_context(k % 2):
            got = ws.lse_reduce(*args)
        mismatches += (got != ref).sum()
    torch.cuda.synchronize()
    ws.check_error()
    report["mismatches"] = int(mismatches)
    report["epoch"] = ws.epoch.tolist()

    # CUDA graph: capture one call on ubatch 1, replay with new inputs, eager calls between.
    args, _ = sets[1]
    static_o, static_l = args[0].clone(), args[1].clone()
    with ubatch_context(1):
        ws.lse_reduce(static_o, static_l, *args[2:])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = ws.lse_reduce(static_o, static_l, *args[2:])
    ok = True
    for k in range(3):
        gen = torch.Generator(device="cpu").manual_seed(1000 + k)
        static_o.copy_(torch.randn(static_o.shape, generator=gen).to(device, torch.bfloat16))
        static_l.copy_(torch.randn(static_l.shape, generator=gen).to(device, static_l.dtype))
        before = int(ws.epoch[1])
        graph.replay()
        expect = dcp_a2a_lse_reduce(
            static_o.clone(), static_l.clone(), group, is_lse_base_on_e=args[2],
            seq_lens=args[3], query_start_loc=args[4],
        )  # fmt: skip
        torch.cuda.synchronize()
        ok &= int(ws.epoch[1]) == before + 1
        assert isinstance(static_out, torch.Tensor)
        ok &= bool(
            (
                (static_out.float() - expect.float()).abs() <= expect.float().abs() * 2.0**-7 + 1e-6
            ).all()
        )
        with ubatch_context(1):
            ws.lse_reduce(*args)  # eager call between replays
    torch.cuda.synchronize()
    ws.check_error()
    report["graph_ok"] = ok
    return report


@pytest.mark.multigpu(2)
def test_direct_a2a_real_ranks_match_nccl_a2a_10000_iterations_and_graphs(
    run_ranks: RunRanks,
) -> None:
    for rep in run_ranks(_nccl_equivalence_body, 2, 10_000, timeout=600.0):
        for i in range(4):
            assert rep[f"set{i}_within_1ulp"], rep
        assert rep["mismatches"] == 0, rep
        assert rep["graph_ok"], rep


@pytest.mark.multigpu(4)
def test_direct_a2a_real_ranks_4(run_ranks: RunRanks) -> None:
    for rep in run_ranks(_nccl_equivalence_body, 4, 500, timeout=600.0):
        assert rep["mismatches"] == 0, rep
        assert rep["graph_ok"], rep
