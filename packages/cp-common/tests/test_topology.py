"""Topology: pure rank layout, and the groups built through DeviceMesh on a real world."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpattn_common.topology import build_cp_groups, cp_layout


def test_layout_tp_only() -> None:
    layout = cp_layout(4, tp_size=2)
    assert layout.tp_groups == [[0, 1], [2, 3]]
    assert layout.pcp_groups == [[0], [1], [2], [3]]
    assert layout.dcp_groups == [[0], [1], [2], [3]]


def test_layout_dcp_is_tp_subgroup_without_pcp() -> None:
    layout = cp_layout(8, tp_size=8, dcp_size=4)
    assert layout.dcp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.tp_inner_groups == layout.dcp_groups
    assert all(set(g) <= set(layout.group_of("tp", g[0])) for g in layout.dcp_groups)
    with pytest.raises(ValueError, match="kind must be one of"):
        layout.group_of("cp", 0)


def test_layout_dcp_spans_pcp_before_tp() -> None:
    layout = cp_layout(8, tp_size=4, pcp_size=2, dcp_size=2)  # DCP == PCP
    assert layout.dcp_groups == layout.pcp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.tp_inner_groups == [[r] for r in range(8)]
    layout = cp_layout(8, tp_size=4, pcp_size=2, dcp_size=4)
    assert layout.dcp_groups == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # The TP ranks of a DCP group within one PCP slice: the query-gather group.
    assert layout.tp_inner_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_of("tp_inner", 5) == [4, 5]
    layout = cp_layout(8, tp_size=4, pcp_size=2, dcp_size=8)  # DCP == TP x PCP
    assert layout.dcp_groups == [list(range(8))]
    assert layout.tp_inner_groups == layout.tp_groups


@pytest.mark.parametrize(
    ("world", "tp", "pcp", "dcp"), [(16, 4, 2, 4), (12, 2, 3, 3), (8, 2, 1, 2), (8, 1, 2, 1)]
)
def test_layout_partitions_the_world(world: int, tp: int, pcp: int, dcp: int) -> None:
    layout = cp_layout(world, tp_size=tp, pcp_size=pcp, dcp_size=dcp)
    for groups, size in (
        (layout.tp_groups, tp),
        (layout.pcp_groups, pcp),
        (layout.dcp_groups, dcp),
        (layout.tp_inner_groups, dcp // pcp if dcp > 1 else 1),
    ):
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
    # a TP group and a PCP group meet in exactly one rank
    for t in layout.tp_groups[:pcp]:
        for p in layout.pcp_groups[:tp]:
            assert len(set(t) & set(p)) <= 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 6, "tp_size": 4}, "not a multiple"),
        ({"world_size": 8, "tp_size": 4, "dcp_size": 3}, "must divide"),
        ({"world_size": 8, "tp_size": 4, "pcp_size": 2, "dcp_size": 3}, "pcp_size times"),
        ({"world_size": 8, "tp_size": 0}, "positive"),
    ],
)
def test_layout_rejects(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cp_layout(**kwargs)


def test_layout_sizes_must_be_ints() -> None:
    with pytest.raises(TypeError, match="tp_size must be an int, got '4'"):
        cp_layout(8, tp_size="4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="world_size must be an int, got True"):
        cp_layout(True, tp_size=1)  # type: ignore[arg-type]


CONFIGS = [(4, 1, 1), (2, 1, 2), (2, 2, 1), (2, 2, 2), (2, 2, 4), (1, 4, 4), (1, 1, 1)]


def topology_ranks(rank: int, world_size: int, device_type: str) -> list[str]:
    failures: list[str] = []
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    for (tp, pcp, dcp), use_mesh in [(c, m) for c in CONFIGS for m in (True, False)]:
        if world_size % (tp * pcp):
            continue
        groups = build_cp_groups(
            tp_size=tp,
            pcp_size=pcp,
            dcp_size=dcp,
            device_type=device_type,
            use_device_mesh=use_mesh,
        )
        if use_mesh and groups.mesh is None:
            failures.append(f"{(tp, pcp, dcp)}: DeviceMesh path not taken")
        layout = cp_layout(world_size, tp_size=tp, pcp_size=pcp, dcp_size=dcp)
        for kind, g in (
            ("tp", groups.tp),
            ("pcp", groups.pcp),
            ("dcp", groups.dcp),
            ("tp_inner", groups.tp_inner),
        ):
            want = layout.group_of(kind, rank)
            if g.ranks != want or g.rank_in_group != want.index(rank):
                failures.append(f"{(tp, pcp, dcp)} {kind}: {g.ranks} vs {want}")
            got = g.all_gather(torch.tensor([float(rank)], device=device), 0).tolist()
            if got != [float(r) for r in want]:
                failures.append(f"{(tp, pcp, dcp)} {kind} all_gather {got} vs {want}")
    dist.barrier()
    return failures


def test_build_groups_on_world(run_ranks: Callable[..., list[Any]], device: torch.device) -> None:
    results = run_ranks(topology_ranks, 4, device.type, timeout=240.0)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)
