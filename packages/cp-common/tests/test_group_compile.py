"""``shared_cp_group`` under ``torch.compile(fullgraph=True)`` on a group no eager call resolved.

The ops resolve their group argument through ``shared_cp_group`` on every call. Its memo
miss did not trace (dynamo failed on reading a traced ``ProcessGroup``'s real object and on the
memo's lock), so a graph over a group that no eager call had resolved yet failed to compile; on
torch 2.11 its hit did not trace either (``id()`` of a process group). Traced code no longer
reads the memo.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpattn_common import CPGroup, shared_cp_group
from cpattn_common.group import _SHARED

_MISSING = object()


class _CompileCounter:
    """A ``torch.compile`` backend that runs the graph as is (like ``backend="eager"``) and
    counts the graphs it was given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return gm.forward


def _rank_data(rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    """``[2N, 3]``, different on every rank (integers: sums are exact)."""
    return torch.arange(6.0 * world_size, device=device).reshape(2 * world_size, 3) + 100 * rank


def _device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Coordinator:
    """Shaped like vLLM's ``GroupCoordinator`` (no ``all_to_all_single``): stands for its
    ``device_group``, whose shared wrapper runs the collectives."""

    def __init__(self, pg: Any) -> None:
        self.device_group = self.cpu_group = pg
        self.world_size, self.rank_in_group = dist.get_world_size(pg), dist.get_rank(pg)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        raise AssertionError("the coordinator's own collectives must not run")

    reduce_scatter = all_gather


def _fresh_group(kind: str, world_size: int, device_type: str) -> tuple[Any, dict[str, Any]]:
    """A group argument of ``kind`` that no call resolved yet, and the keywords to pass with it."""
    from torch.distributed.device_mesh import init_device_mesh

    ranks = list(range(world_size))
    if kind == "process_group":
        return dist.new_group(ranks), {}
    if kind == "cpgroup":
        return CPGroup(dist.new_group(ranks)), {}
    if kind == "coordinator":
        return _Coordinator(dist.new_group(ranks)), {}
    if kind == "mesh":
        return init_device_mesh(device_type, (world_size,)), {}
    if kind == "mesh_dim":
        mesh = init_device_mesh(device_type, (world_size, 1), mesh_dim_names=("cp", "tp"))
        return mesh, {"mesh_dim": "cp"}
    raise AssertionError(kind)


def fresh_group_ranks(rank: int, world_size: int, kind: str, device_type: str) -> dict[str, Any]:
    """Runs on every rank: a compiled gather and reduce-scatter over a group no call resolved
    before, against the eager ops and the math; then the same graph for a second such group."""
    device = _device(device_type)
    counter = _CompileCounter()
    if kind == "world":
        group: Any = None
        kwargs: dict[str, Any] = {}
        # Fresh: the world group is not in the memo.
        assert _SHARED.get(dist.group.WORLD, _MISSING) is _MISSING
    else:
        group, kwargs = _fresh_group(kind, world_size, device_type)
        assert _SHARED.get(group, _MISSING) is _MISSING

    def step(t: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        g = shared_cp_group(group, **kwargs)
        return g.all_gather(t, dim=1), g.reduce_scatter(t, dim=0), g

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    mine = _rank_data(rank, world_size, device)
    everyone = [_rank_data(r, world_size, device) for r in range(world_size)]
    total = torch.stack(everyone).sum(0)
    want_gather = torch.cat(everyone, dim=1)
    want_scatter = total.chunk(world_size, dim=0)[rank]

    got_gather, got_scatter, got_group = compiled(mine, group)  # first resolution: traced
    again = compiled(mine, group)
    graphs_for_one_group = counter.graphs
    eager_gather, eager_scatter, eager_group = step(mine, group)
    result: dict[str, Any] = {
        "gather": torch.equal(got_gather, want_gather) and torch.equal(eager_gather, want_gather),
        "scatter": torch.equal(got_scatter, want_scatter)
        and torch.equal(eager_scatter, want_scatter),
        # The graph's wrapper is the one eager callers share (a CPGroup is its own).
        "same_wrapper": got_group is eager_group and again[2] is eager_group,
        "own_wrapper": (got_group is group) == (kind == "cpgroup"),
        "graphs_for_one_group": graphs_for_one_group,
    }
    after_eager = compiled(mine, group)
    result["same_wrapper_after_eager"] = after_eager[2] is eager_group
    if kind != "world":
        # The graph's wrapper is guarded on the group: another group gets its own.
        other, _ = _fresh_group(kind, world_size, device_type)
        other_gather, _, other_group = compiled(mine, other)
        # Dynamo guards a DeviceMesh by equality: on torch 2.7, where an equal mesh gets groups
        # of its own, the graph traced on the first mesh answers an equal one with the first
        # mesh's wrapper (same ranks; docs/packages/common.md). Later torch shares the groups.
        equal_mesh = kind == "mesh_dim" and other == group and other_group is got_group
        result["other_group_wrapper"] = (
            other_group is shared_cp_group(other, **kwargs) or equal_mesh
        )
        result["other_group_gather"] = torch.equal(other_gather, want_gather)
    return result


@pytest.mark.parametrize(
    "kind", ["process_group", "cpgroup", "world", "mesh", "mesh_dim", "coordinator"]
)
def test_compiled_collectives_on_a_group_no_call_resolved(
    run_ranks: Callable[..., list[Any]], device: torch.device, kind: str
) -> None:
    """The first resolution of a process group (a ``FakeScriptObject`` to dynamo), a
    ``CPGroup``, the world (``None``), a mesh (dimension) or a vLLM-style coordinator happens
    in a compiled graph: it compiles, computes what the eager ops do, uses the wrapper eager
    callers get, and a second group is not answered with the first one's wrapper."""
    want: dict[str, Any] = {
        "gather": True,
        "scatter": True,
        "same_wrapper": True,
        "own_wrapper": True,
        "graphs_for_one_group": 1,
        "same_wrapper_after_eager": True,
    }
    if kind != "world":
        want |= {"other_group_wrapper": True, "other_group_gather": True}
    for result in run_ranks(fresh_group_ranks, 2, kind, device.type):
        assert result == want


class _LoopbackGroup:
    """A user ``CPGroupLike`` of ``world_size`` peers that all hold this rank's data."""

    rank_in_group = 0
    device_group = None

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat([tensor] * self.world_size, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return (self.world_size * tensor).chunk(self.world_size, dim)[0].contiguous()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.world_size * tensor

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(torch.cat([input.chunk(self.world_size)[0]] * self.world_size))

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(torch.cat([input] * self.world_size))

    def barrier(self) -> None:
        pass


def test_compiled_gather_on_a_user_group_no_call_resolved(device: torch.device) -> None:
    """A user ``CPGroupLike`` resolves to itself in the graph too (the memo's lock failed the
    trace), guarded on its identity: a second group of another size is not answered with the
    first."""
    torch.compiler.reset()
    counter = _CompileCounter()

    def step(t: torch.Tensor, group: Any) -> tuple[torch.Tensor, Any]:
        g = shared_cp_group(group)
        return g.all_gather(t, dim=0) * 1, g

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    t = torch.arange(6.0, device=device).reshape(2, 3)
    two, three = _LoopbackGroup(2), _LoopbackGroup(3)
    assert _SHARED.get(two, _MISSING) is _MISSING
    got, got_group = compiled(t, two)
    assert got_group is two
    assert torch.equal(got, torch.cat([t, t]))
    assert torch.equal(got, step(t, two)[0])
    got, got_group = compiled(t, three)
    assert got_group is three
    assert torch.equal(got, torch.cat([t, t, t]))
    assert counter.graphs == 2
    torch.compiler.reset()


def trace_time_ranks(rank: int, world_size: int, device_type: str) -> dict[str, bool]:
    """Runs on every rank: a traced miss and a trace-time resolution of one group in one
    graph, in either order."""
    import torch._dynamo

    device = _device(device_type)
    mine = _rank_data(rank, world_size, device)
    result: dict[str, bool] = {}

    @torch._dynamo.assume_constant_result
    def world_size_of(group: Any) -> int:
        return shared_cp_group(group).world_size  # runs at trace time

    def miss_first(t: torch.Tensor, group: Any) -> torch.Tensor:
        gathered = shared_cp_group(group).all_gather(t, dim=0)  # a traced miss...
        return gathered * world_size_of(group)  # ...then the memo is read at trace time

    def constant_first(t: torch.Tensor, group: Any) -> torch.Tensor:
        n = world_size_of(group)
        return shared_cp_group(group).all_gather(t, dim=0) * n

    for fn in (miss_first, constant_first):
        pg = dist.new_group(list(range(world_size)))
        got = torch.compile(fn, backend="eager", fullgraph=True)(mine, pg)
        result[fn.__name__] = torch.equal(got, fn(mine, pg))

    return result


def test_a_group_resolved_at_trace_time_after_a_traced_miss(
    run_ranks: Callable[..., list[Any]], device: torch.device
) -> None:
    """A function dynamo runs at trace time (``assume_constant_result``, as cp-dcp's group
    tokens) may resolve the group after the graph's lookup missed: the memo must not change
    while dynamo traces, or the guard on that miss fails on the very frame it was made for."""
    for result in run_ranks(trace_time_ranks, 2, device.type):
        assert result == {"miss_first": True, "constant_first": True}


def graph_lifetime_ranks(rank: int, world_size: int, device_type: str) -> dict[str, Any]:
    """Runs on every rank: what a compiled graph over a group keeps alive."""
    from cpattn_common.group import _TRACED, _TRACED_NAMES

    mine = _rank_data(rank, world_size, _device(device_type))
    pg = dist.new_group(list(range(world_size)))
    compiled = torch.compile(
        lambda t, g: (shared_cp_group(g).all_gather(t, dim=0) * 1, shared_cp_group(g)),
        backend="eager",
        fullgraph=True,
    )
    refs = [weakref.ref(pg), weakref.ref(compiled(mine, pg)[1])]
    name = str(_TRACED_NAMES.get(pg, None))
    named = hasattr(_TRACED, name)
    dist.destroy_process_group(pg)
    del pg
    torch.compiler.reset()
    gc.collect()
    return {
        "named_for_graphs": named,
        "alive": sum(r() is not None for r in refs),
        "named_after": hasattr(_TRACED, name),
    }


def test_a_wrapper_made_for_graphs_goes_with_its_group(
    run_ranks: Callable[..., list[Any]], device: torch.device
) -> None:
    """The wrapper a graph resolved at trace time refers to its group weakly and goes, with its
    name, when the group dies (once dynamo dropped the compiled code, which holds the group).
    World size 1: dynamo keeps a group whose collectives it traced even after a reset."""
    (result,) = run_ranks(graph_lifetime_ranks, 1, device.type)
    assert result == {"named_for_graphs": True, "alive": 0, "named_after": False}
