"""The simulated group agrees with a real gloo group on every op, and fails loudly on misuse."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpattn_common.group import CPGroupLike, as_cp_group
from cpattn_testing.launcher import run_distributed
from cpattn_testing.simulated import SimulatedGroup, SimulatedWorld

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64]


def _inputs(rank: int, seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank-specific integer-valued data: sums are exact in every dtype and any order."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-8, 9, shape, generator=gen).to(dtype)


def all_ops(group: CPGroupLike, seed: int) -> dict[str, Any]:
    """Every op of the group interface, on awkward shapes and dims; returns what this rank got."""
    n, r = group.world_size, group.rank_in_group
    got: dict[str, Any] = {"rank": r, "world_size": n}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        x = _inputs(r, seed, (2, 3, 5), dtype)
        for dim in (0, 1, 2, -1, -3):
            got[f"all_gather/{name}/dim{dim}"] = group.all_gather(x, dim=dim)
        # A non-contiguous input (a transposed view).
        got[f"all_gather/{name}/noncontig"] = group.all_gather(x.transpose(0, 2), dim=1)
        y = _inputs(r, seed + 1, (2 * n, n, 3 * n), dtype)
        for dim in (0, 1, 2, -1):
            got[f"reduce_scatter/{name}/dim{dim}"] = group.reduce_scatter(y, dim=dim)
        got[f"all_reduce/{name}"] = group.all_reduce(_inputs(r, seed + 2, (4, 3), dtype))
        a2a_in = _inputs(r, seed + 3, (2 * n, 5), dtype)
        a2a_out = torch.full_like(a2a_in, -99)
        group.all_to_all_single(a2a_out, a2a_in)
        got[f"all_to_all_single/{name}"] = a2a_out
        # Strided output: a column slice of a wider buffer.
        wide = torch.full((2 * n, 7), -99).to(dtype)
        group.all_to_all_single(wide[:, 1:6], a2a_in)
        got[f"all_to_all_single/{name}/strided_out"] = wide
        ag_in = _inputs(r, seed + 4, (3, 4), dtype)
        ag_out = torch.full((3 * n, 4), -99).to(dtype)
        group.all_gather_into_tensor(ag_out, ag_in)
        got[f"all_gather_into_tensor/{name}"] = ag_out
    group.barrier()
    one = torch.ones(3 * n)
    got["identity_when_n1"] = [
        group.all_gather(one, 0) is one,
        group.reduce_scatter(one, 0) is one,
        group.all_reduce(one) is one,
    ]
    return got


def gloo_all_ops(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    return all_ops(as_cp_group(dist.group.WORLD), seed)


@pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda n: f"ws{n}")
def test_simulated_matches_gloo_on_every_op(world_size: int) -> None:
    seed = 17 + world_size
    real = run_distributed(gloo_all_ops, world_size, "gloo", args=(seed,), timeout=120)
    sim = SimulatedWorld(world_size, "cpu").run(all_ops, seed)
    for r in range(world_size):
        assert real[r].keys() == sim[r].keys()
        for key in real[r]:
            a, b = real[r][key], sim[r][key]
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype, key
                assert a.shape == b.shape, key
                assert torch.equal(a, b), f"{key} differs on rank {r}:\n{a}\n{b}"
            else:
                assert a == b, key
    if world_size == 1:
        assert sim[0]["identity_when_n1"] == [True, True, True]
    # Spot-check the semantics themselves (not just agreement).
    n = world_size
    xs = [_inputs(r, seed, (2, 3, 5), torch.float32) for r in range(n)]
    assert torch.equal(sim[0]["all_gather/float32/dim1"], torch.cat(xs, dim=1))
    ys = [_inputs(r, seed + 1, (2 * n, n, 3 * n), torch.float32) for r in range(n)]
    total = torch.stack(ys).sum(0)
    for r in range(n):
        assert torch.equal(sim[r]["reduce_scatter/float32/dim2"], total.chunk(n, 2)[r])
        a2a = [_inputs(p, seed + 3, (2 * n, 5), torch.float32) for p in range(n)]
        assert torch.equal(
            sim[r]["all_to_all_single/float32"], torch.cat([a.chunk(n)[r] for a in a2a])
        )


def test_simulated_group_is_a_cp_group_like() -> None:
    world = SimulatedWorld(2)
    assert isinstance(world.groups[0], CPGroupLike)
    assert as_cp_group(world.groups[1]) is world.groups[1]
    assert world.groups[1].rank_in_group == 1
    assert world.groups[1].device_group is None


def _alloc_and_write(group: SimulatedGroup) -> tuple[list[float], list[int]]:
    own, peers = group.allocate_symmetric((group.world_size,), torch.float32)
    assert peers[group.rank_in_group] is own
    assert torch.equal(own, torch.zeros(group.world_size))
    group.barrier()
    # Write my rank into slot r of every peer's buffer.
    for peer in peers:
        peer[group.rank_in_group] = float(group.rank_in_group + 1)
    group.barrier()
    return own.tolist(), [p.data_ptr() for p in peers]


def test_allocate_symmetric_peers_see_each_others_writes() -> None:
    results = SimulatedWorld(4).run(_alloc_and_write)
    for values, ptrs in results:
        assert values == [1.0, 2.0, 3.0, 4.0]
        assert ptrs == results[0][1]  # one peer-pointer table for everyone
    assert len(set(results[0][1])) == 4


def _mismatch(group: SimulatedGroup) -> None:
    if group.rank_in_group == 0:
        group.all_reduce(torch.ones(2))
    else:
        group.barrier()


def test_mismatched_collectives_raise() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"collective mismatch .* \['all_reduce of \(2,\) torch.float32', 'barrier'\]",
    ):
        SimulatedWorld(2, timeout=10).run(_mismatch)


def _ragged(group: SimulatedGroup, op: str, mismatch: str) -> None:
    rank = group.rank_in_group
    shape = (2 + rank, 4) if mismatch == "shape" else (2, 4)
    dtype = torch.bfloat16 if mismatch == "dtype" and rank == 1 else torch.float32
    x = torch.ones(shape, dtype=dtype)
    if op == "all_gather_into_tensor":
        group.all_gather_into_tensor(torch.empty((4 * shape[0], 4), dtype=dtype), x)
    else:
        getattr(group, op)(x)


@pytest.mark.parametrize("mismatch", ["shape", "dtype"])
@pytest.mark.parametrize(
    "op", ["all_reduce", "all_gather", "reduce_scatter", "all_gather_into_tensor"]
)
def test_ranks_disagreeing_on_shape_or_dtype_raise(op: str, mismatch: str) -> None:
    """gloo and NCCL reject such calls; the simulated group must not broadcast or concatenate
    them into a plausible result."""
    with pytest.raises(RuntimeError, match="collective mismatch"):
        SimulatedWorld(4, timeout=10).run(_ragged, op, mismatch)


def _reuse_input_at_once(group: SimulatedGroup, op: str) -> list[float]:
    """Each rank overwrites its input right after the collective, as a caller reusing a
    buffer does; a slow rank 0 must still receive the values as they were at the call."""
    rank = group.rank_in_group
    x = torch.full((4,), float(rank + 1))
    if op == "all_to_all_single":
        out = torch.empty(4)
        group.all_to_all_single(out, x)
    else:
        out = getattr(group, op)(x) if op != "all_gather" else group.all_gather(x, 0)
    x.fill_(-100.0)
    if rank == 0:
        time.sleep(0.05)
    return out.tolist()


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all_single"])
def test_collectives_see_inputs_as_they_were_at_the_call(op: str) -> None:
    results = SimulatedWorld(4, timeout=10).run(_reuse_input_at_once, op)
    expected = {
        "all_reduce": [[10.0] * 4] * 4,
        "all_gather": [[float(r) for r in (1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4)]] * 4,
        "reduce_scatter": [[10.0]] * 4,
        "all_to_all_single": [[1.0, 2.0, 3.0, 4.0]] * 4,
    }[op]
    assert results == expected


def _raise_on_one(group: SimulatedGroup) -> None:
    if group.rank_in_group == 1:
        raise KeyError("planted")
    group.barrier()


def test_rank_exception_releases_the_others_and_propagates() -> None:
    world = SimulatedWorld(3, timeout=30)
    with pytest.raises(KeyError, match="planted") as info:
        world.run(_raise_on_one)
    assert "simulated rank 1 of 3" in "".join(getattr(info.value, "__notes__", []))
    # The world is usable again afterwards.
    assert world.run(lambda g: g.all_reduce(torch.ones(1)).item()) == [3.0, 3.0, 3.0]


def _skip_barrier(group: SimulatedGroup) -> None:
    if group.rank_in_group == 0:
        group.barrier()


def test_missing_rank_times_out() -> None:
    with pytest.raises(TimeoutError, match=r"waited more than 0\.5 s in barrier"):
        SimulatedWorld(2, timeout=0.5).run(_skip_barrier)
    assert threading.active_count() < 20


@pytest.mark.parametrize(
    ("op", "error", "match"),
    [
        (lambda g: g.reduce_scatter(torch.ones(3), 0), ValueError, "not divisible by world_size 2"),
        (lambda g: g.all_gather(torch.ones(3), 1), ValueError, "dim 1 is out of range"),
        (
            lambda g: g.all_to_all_single(torch.ones(4), torch.ones(4, dtype=torch.float64)),
            TypeError,
            "output dtype",
        ),
        (
            lambda g: g.all_gather_into_tensor(torch.ones(3), torch.ones(2)),
            ValueError,
            r"output shape \(3,\) != \(4,\)",
        ),
        (lambda g: g.all_to_all_single(torch.ones(3), torch.ones(3)), ValueError, "divisible"),
    ],
)
def test_argument_errors(op: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        SimulatedWorld(2, timeout=10).run(op)


_GRAD_CALLS: dict[str, Any] = {
    "all_gather": lambda g, t: g.all_gather(t, 0),
    "reduce_scatter": lambda g, t: g.reduce_scatter(t, 0),
    "all_reduce": lambda g, t: g.all_reduce(t),
    "all_gather_into_tensor": lambda g, t: g.all_gather_into_tensor(
        torch.empty(2 * g.world_size, 4), t
    ),
    "all_to_all_single": lambda g, t: g.all_to_all_single(torch.empty(2, 4), t),
}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("op", list(_GRAD_CALLS))
def test_collectives_refuse_tensors_that_require_grad_like_cpgroup(
    op: str, world_size: int
) -> None:
    """The exchange detached its inputs, so a result came back without a gradient where
    ``CPGroup`` raises: an op that relied on its group to refuse passed only here."""

    def body(g: SimulatedGroup) -> None:
        t = torch.ones(2, 4, requires_grad=True)
        with pytest.raises(RuntimeError, match=f"^SimulatedGroup.{op}: .* requires grad"):
            _GRAD_CALLS[op](g, t)
        with torch.no_grad():
            _GRAD_CALLS[op](g, t)

    SimulatedWorld(world_size, timeout=10).run(body)


def test_world_arguments() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        SimulatedWorld(0)
    with pytest.raises(TypeError, match="world_size must be an int, got '2'"):
        SimulatedWorld("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be > 0"):
        SimulatedWorld(2, timeout=0)


def _gpu_ops(group: SimulatedGroup) -> dict[str, torch.Tensor]:
    n, r = group.world_size, group.rank_in_group
    dev = group.device
    x = torch.full((2, 3), float(r), device=dev, dtype=torch.bfloat16)
    own, peers = group.allocate_symmetric((n,), torch.int64)
    group.barrier()
    for peer in peers:
        peer[r] = r + 1
    group.barrier()
    return {
        "gather": group.all_gather(x, dim=0),
        "sum": group.all_reduce(x),
        "rs": group.reduce_scatter(torch.ones(2 * n, device=dev), dim=0),
        "own": own.clone(),
        "ptrs": torch.tensor([p.data_ptr() for p in peers]),
    }


@pytest.mark.gpu
def test_simulated_world_on_one_gpu(device: torch.device) -> None:
    dev = torch.device("cuda") if device.type != "cuda" else device
    results = SimulatedWorld(4, dev).run(_gpu_ops)
    for r, got in enumerate(results):
        assert got["gather"].device.type == "cuda"
        assert got["gather"][:, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
        assert got["sum"].float().unique().tolist() == [6.0]
        assert got["rs"].tolist() == [4.0, 4.0]
        assert got["own"].tolist() == [1, 2, 3, 4]
        assert torch.equal(got["ptrs"], results[0]["ptrs"]), r
