"""The ranks' agreement (``cpattn_common.agreement``): an all-gather that allocates nothing, and
whose own failure propagates instead of being answered. ``agree_on_local_step`` and
``agreed_symmetric_empty`` across ranks are tested with the workspace (``test_workspace.py``)
and the capability probe (``test_capability.py``)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cpattn_common import capability
from cpattn_common.agreement import AgreementError, agreement_flag, gather_rank_values
from cpattn_common.capability import clear_capability_cache, group_probe
from cpattn_common.group import as_cp_group


class _AllocationLog(TorchDispatchMode):
    """Records every aten op that creates a tensor (``empty*``, ``new_*``, ``zeros*`` ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if any(word in name for word in ("empty", "new_", "zeros", "ones", "full", "clone")):
            self.allocations.append(name)
        return func(*args, **(kwargs or {}))


def _gather_ranks(rank: int, world_size: int) -> dict[str, Any]:
    group = as_cp_group(dist.group.WORLD)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    flag = agreement_flag(group, device)
    with _AllocationLog() as log:
        values = gather_rank_values(group, flag, 10 * rank - 3)
        again = gather_rank_values(group, flag, -(2**40) + rank)  # int64 through and through
    return {"values": values, "again": again, "allocations": log.allocations}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_agreement_gathers_every_rank_value_without_allocating(
    run_ranks: Callable[..., list[Any]], world_size: int
) -> None:
    """An allocation inside the agreement could fail on one rank only (out of memory), and that
    rank would leave the all-gather its peers are in: the gather sends from and receives into
    the caller's scratch."""
    for report in run_ranks(_gather_ranks, world_size, timeout=120.0):
        assert report["values"] == [10 * r - 3 for r in range(world_size)]
        assert report["again"] == [-(2**40) + r for r in range(world_size)]
        assert report["allocations"] == []


class _Group:
    """A two-rank ``CPGroupLike`` in one process whose all-gather into a tensor fails."""

    backend = "gloo"
    world_size = 2
    rank_in_group = 0
    device_group: Any = object()

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        raise RuntimeError("planted: the connection to rank 1 was reset")

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        raise NotImplementedError

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        pass


def test_a_bad_scratch_is_refused() -> None:
    group = _Group()
    with pytest.raises(ValueError, match=r"agreement_flag's int64 \[1 \+ N\] = \[3\] scratch"):
        gather_rank_values(group, torch.empty(1, dtype=torch.int32), 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scratch"):
        gather_rank_values(group, torch.empty(5, dtype=torch.int64), 1)  # type: ignore[arg-type]


def test_a_failing_all_gather_is_an_agreement_error() -> None:
    group = _Group()
    flag = agreement_flag(group, torch.device("cpu"))  # type: ignore[arg-type]
    assert (flag.dtype, tuple(flag.shape)) == (torch.int64, (3,))
    with pytest.raises(AgreementError, match="failed on rank 0 of 2: RuntimeError: planted") as e:
        gather_rank_values(group, flag, 1)  # type: ignore[arg-type]
    assert isinstance(e.value.__cause__, RuntimeError)


def test_the_probe_lets_a_failed_agreement_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe whose all-gather failed cannot tell its peers anything: answering "off" would
    put this rank's next collective against its peers' probe, so it raises."""
    clear_capability_cache()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        with pytest.raises(AgreementError, match="planted"):
            group_probe(_Group())
    finally:
        clear_capability_cache()


def _same_node_ranks(rank: int, world_size: int, unknown_rank: int) -> dict[str, Any]:
    """The probe's same-node answer when ``unknown_rank`` cannot read its host name (-1: none),
    then one more collective to show that the group is in step."""
    if rank == unknown_rank:

        def no_name() -> str:
            raise OSError("planted: no host name")

        socket.gethostname = no_name  # type: ignore[assignment]
    probe = group_probe(dist.group.WORLD)
    total = as_cp_group(dist.group.WORLD).all_reduce(torch.full((1,), 1.0 + rank))
    return {"same_node": probe.same_node, "after": float(total.item())}


@pytest.mark.parametrize("unknown_rank", [-1, 1])
def test_the_same_node_check_is_one_allocation_free_gather(
    run_ranks: Callable[..., list[Any]], device: torch.device, unknown_rank: int
) -> None:
    """Every rank on this host: same node. A rank that cannot read its host name answers
    through the gather (0), so every rank reads "not one node" and stays in step (the check
    used ``all_gather_object``, whose rank-local steps between its two all-gathers were not
    agreed)."""
    if device.type != "cpu":
        pytest.skip("replaces socket.gethostname in its rank processes: a CPU (gloo) test")
    reports = run_ranks(_same_node_ranks, 2, unknown_rank, timeout=60.0)
    for report in reports:
        assert report["same_node"] is (unknown_rank < 0)
        assert report["after"] == 3.0


def test_the_host_key_is_stable_and_nonzero() -> None:
    assert capability._host_key() == capability._host_key() != 0
