"""Group resolution and tokens (``cpattn_dcp.comm.groups``): memoised (through
``cpattn_common.shared_cp_group``), and never keeping a group alive (real gloo process groups
in worker processes; simulated groups in this one)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from cpattn_common import group as common_group
from cpattn_dcp.comm import groups
from cpattn_testing.pytest_plugin import RunRanks
from cpattn_testing.simulated import SimulatedWorld


def _process_groups_body(rank: int, world_size: int, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist

    from cpattn_common.group import CPGroup
    from cpattn_dcp.comm.collectives import all_reduce_

    before = (len(common_group._SHARED), len(groups._TOKENS))
    refs: list[weakref.ref[Any]] = []
    sums: list[float] = []
    tokens: list[str] = []
    for _ in range(rounds):
        pg = dist.new_group(list(range(world_size)), backend="gloo")
        group = groups.resolve_group(pg)
        token = groups.group_token(pg)
        assert groups.resolve_group(pg) is group  # memoised
        assert groups.group_from_token(token) is group
        assert group.device_group is pg
        assert (groups.group_world_size(pg), groups.group_rank(pg)) == (world_size, rank)
        sums.append(float(group.all_reduce(torch.ones(2))[0]))  # the wrapper reaches its group
        buf = torch.ones(2)
        assert all_reduce_(group, buf) is buf  # the combines' in-place all-reduce, no copy
        refs.append(weakref.ref(pg))
        tokens.append(token)
        dist.destroy_process_group(pg)
        del pg, group
    # A wrapper of the caller's own (CPGroupLike) and the default group (None).
    wrapper = CPGroup(dist.group.WORLD)
    assert groups.resolve_group(wrapper) is wrapper
    wrapper_ref = weakref.ref(wrapper)
    tokens.append(groups.group_token(wrapper))
    del wrapper
    assert groups.resolve_group(None) is groups.resolve_group(dist.group.WORLD)
    gc.collect()
    unknown = 0
    for token in tokens:
        try:
            groups.group_from_token(token)
        except KeyError:
            unknown += 1
    return {
        "alive": sum(r() is not None for r in refs) + (wrapper_ref() is not None),
        "unknown_tokens": unknown,
        "sums": sums,
        # What is left: the default group's entry and its wrapper's token, nothing else.
        "entries": (len(common_group._SHARED) - before[0], len(groups._TOKENS) - before[1]),
    }


def test_destroyed_process_groups_leave_no_entries(run_ranks: RunRanks) -> None:
    """Process groups created, resolved, tokenised and destroyed die once the caller drops
    them, and so do their memo entries and tokens (the memo's wrapper held its group)."""
    rounds = 4
    for res in run_ranks(_process_groups_body, 2, rounds):
        assert res == {
            "alive": 0,
            "unknown_tokens": rounds + 1,
            "sums": [2.0] * rounds,
            "entries": (1, 0),
        }


def _overriding_all_reduce_body(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from cpattn_common.group import CPGroup
    from cpattn_dcp import cp_lse_ag_out_ar
    from cpattn_dcp.comm.collectives import all_reduce_

    class CountingGroup(CPGroup):
        """A custom all-reduce (a serving engine's own, say): counts its calls."""

        calls = 0

        def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
            CountingGroup.calls += 1
            return super().all_reduce(tensor)

    group = CountingGroup(dist.group.WORLD)
    buf = torch.ones(2)
    summed = all_reduce_(group, buf)
    out = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(rank))
    cp_lse_ag_out_ar(out, torch.zeros(3, 4), group)
    return {"sum": summed.tolist(), "calls": CountingGroup.calls}


def test_a_cp_group_overriding_all_reduce_gets_its_calls(run_ranks: RunRanks) -> None:
    """The combines' in-place all-reduce took the ProcessGroup under any ``CPGroup``, so a
    subclass's own ``all_reduce`` was never called (0 calls)."""
    for res in run_ranks(_overriding_all_reduce_body, 2):
        assert res == {"sum": [2.0, 2.0], "calls": 2}


def test_wrapper_entries_die_with_the_wrapper(device: torch.device) -> None:
    """A ``CPGroupLike`` resolves to itself, memoised without a reference that keeps it."""
    world = SimulatedWorld(1, device)
    group = world.groups[0]
    token = groups.group_token(group)
    assert groups.resolve_group(group) is group
    assert groups.group_from_token(token) is group
    ref = weakref.ref(group)
    entries = len(common_group._SHARED)
    del group, world
    gc.collect()
    assert ref() is None
    assert len(common_group._SHARED) < entries
    with pytest.raises(KeyError, match="unknown group token"):
        groups.group_from_token(token)


def test_a_token_of_a_dead_group_never_names_another(device: torch.device) -> None:
    """Tokens are numbered, not derived from ``id()``: a new group that gets a dead group's
    address gets a new token, and the dead one's raises ``KeyError`` (a compiled graph that
    still holds it never reaches the new group)."""
    seen: dict[int, str] = {}
    for _ in range(50):
        group = SimulatedWorld(1, device).groups[0]
        token = groups.group_token(group)
        assert groups.group_from_token(token) is group
        assert token not in seen.values()
        old = seen.get(id(group))
        if old is not None:
            with pytest.raises(KeyError, match="unknown group token"):
                groups.group_from_token(old)
        seen[id(group)] = token
        del group
        gc.collect()
    assert len(groups._TOKEN_OF) < 50  # entries go with their groups
