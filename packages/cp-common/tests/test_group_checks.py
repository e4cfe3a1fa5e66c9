"""Group objects the ops refuse, and why: ``check_group``, ``as_cp_group`` and ``shared_cp_group``
on wrappers and on objects shaped like vLLM's ``GroupCoordinator`` whose rank metadata is
missing, of the wrong type or out of range (no process group needed; the checks against a real
process group run in cp-dcp's ``tests/distributed/test_coordinator_dist.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpattn_common import as_cp_group, check_group, shared_cp_group
from cpattn_common.group import _SHARED, trace_time_group


class Coordinator:
    """Shaped like vLLM's ``GroupCoordinator``: rank metadata, a device and a CPU group, and
    ``all_gather`` / ``reduce_scatter`` / ``all_reduce``, but no ``all_to_all_single``."""

    def __init__(self, **members: Any) -> None:
        self.calls: list[str] = []
        for name, value in members.items():
            setattr(self, name, value)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls.append("all_gather")
        raise AssertionError("the coordinator's own collectives must not run")

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls.append("reduce_scatter")
        raise AssertionError("the coordinator's own collectives must not run")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce")
        raise AssertionError("the coordinator's own collectives must not run")


class Wrapper(Coordinator):
    """A complete ``CPGroupLike`` (its own collectives), with whatever rank metadata it is given."""

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.calls.append("all_to_all_single")

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.calls.append("all_gather_into_tensor")

    def barrier(self) -> None:
        self.calls.append("barrier")


def _resolvers() -> list[Any]:
    return [as_cp_group, shared_cp_group, trace_time_group]


# (members, exception, message) of coordinator-shaped objects every resolver refuses.
BAD_COORDINATORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"world_size": 2, "rank_in_group": 0}, TypeError, "has no device_group"),
    ({"device_group": object()}, TypeError, "has no world_size, rank_in_group"),
    ({"world_size": 2, "device_group": object()}, TypeError, "has no rank_in_group"),
    (
        {"world_size": 2, "rank_in_group": 2, "device_group": object()},
        ValueError,
        r"Coordinator.rank_in_group is 2, outside \[0, world_size=2\)",
    ),
    (
        {"world_size": 2, "rank_in_group": -1, "device_group": object()},
        ValueError,
        r"rank_in_group is -1, outside \[0, world_size=2\)",
    ),
    (
        {"world_size": 0, "rank_in_group": 0, "device_group": object()},
        ValueError,
        "world_size must be >= 1, got 0",
    ),
    (
        {"world_size": True, "rank_in_group": 0, "device_group": object()},
        TypeError,
        r"world_size must be an int, got True \(bool\)",
    ),
    (
        {"world_size": 2, "rank_in_group": 1.0, "device_group": object()},
        TypeError,
        r"rank_in_group must be an int, got 1.0 \(float\)",
    ),
    (
        {"world_size": 2, "rank_in_group": 1, "device_group": object(), "cpu_group": None},
        TypeError,
        "Coordinator.device_group must be a torch.distributed ProcessGroup, got object",
    ),
    (
        {"world_size": 2, "rank_in_group": 1, "device_group": None},
        TypeError,
        "got NoneType .*implements every CPGroupLike collective itself",
    ),
]


@pytest.mark.parametrize(("members", "error", "message"), BAD_COORDINATORS)
def test_a_bad_coordinator_is_refused(
    members: dict[str, Any], error: type[Exception], message: str
) -> None:
    for resolve in _resolvers():
        coordinator = Coordinator(**members)
        entries = len(_SHARED)
        with pytest.raises(error, match=message):
            resolve(coordinator)
        assert coordinator.calls == []
        assert len(_SHARED) == entries  # nothing memoised for a refused object


# (world_size, rank_in_group, exception, message) of wrappers every resolver refuses.
BAD_WRAPPERS: list[tuple[Any, Any, type[Exception], str]] = [
    (2, 2, ValueError, r"Wrapper.rank_in_group is 2, outside \[0, world_size=2\)"),
    (4, -1, ValueError, r"Wrapper.rank_in_group is -1, outside \[0, world_size=4\)"),
    (0, 0, ValueError, "Wrapper.world_size must be >= 1, got 0"),
    (2.0, 0, TypeError, r"Wrapper.world_size must be an int, got 2.0 \(float\)"),
    (2, False, TypeError, r"Wrapper.rank_in_group must be an int, got False \(bool\)"),
]


@pytest.mark.parametrize(("world_size", "rank", "error", "message"), BAD_WRAPPERS)
def test_a_bad_wrapper_is_refused(
    world_size: Any, rank: Any, error: type[Exception], message: str
) -> None:
    """A wrapper with a rank outside ``[0, world_size)`` read another rank's LSE slot (out of
    bounds for rank >= N) in the combines; now every resolver refuses it."""
    wrapper = Wrapper(world_size=world_size, rank_in_group=rank, device_group=None)
    for check in (check_group, as_cp_group, shared_cp_group):
        with pytest.raises(error, match=message):
            check(wrapper)
    assert wrapper.calls == []


def test_a_good_wrapper_is_returned_as_is() -> None:
    wrapper = Wrapper(world_size=3, rank_in_group=2, device_group=None)
    assert check_group(wrapper) is wrapper  # type: ignore[arg-type]
    assert as_cp_group(wrapper) is wrapper
    assert shared_cp_group(wrapper) is wrapper
    assert trace_time_group(wrapper) is wrapper
    assert wrapper.calls == []


def test_a_wrapper_missing_a_collective_is_named() -> None:
    """A simulated group lacking one collective of the protocol is no coordinator either (it
    has no process group): the message says what a group without one needs."""

    class Incomplete(Coordinator):  # no barrier
        def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
            pass

        def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
            pass

    with pytest.raises(TypeError, match="implements every CPGroupLike collective itself"):
        as_cp_group(Incomplete(world_size=2, rank_in_group=0, device_group=None))


def test_anything_else_is_not_a_group() -> None:
    for other in (42, "world", object(), torch.zeros(1)):
        with pytest.raises(TypeError, match="GroupCoordinator-like object"):
            as_cp_group(other)
        with pytest.raises(TypeError, match="GroupCoordinator-like object"):
            shared_cp_group(other)


@pytest.mark.skipif(
    not torch.torch_version.TorchVersion(torch.__version__) >= "2.13",
    reason="dynamo passes a wrapper object to trace-time functions from torch 2.13 on",
)
def test_a_bad_wrapper_is_refused_in_a_compiled_graph() -> None:
    """A graph that resolves a wrapper no eager call met checks it at trace time too."""

    class Gathering(Wrapper):
        def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
            return torch.cat([tensor] * self.world_size, dim)

    @torch.compile(fullgraph=True, backend="eager")
    def step(x: torch.Tensor, group: Any) -> torch.Tensor:
        return shared_cp_group(group).all_gather(x, 0)

    good = Gathering(world_size=2, rank_in_group=1, device_group=None)
    assert torch.equal(step(torch.ones(1), good), torch.ones(2))
    bad = Gathering(world_size=2, rank_in_group=2, device_group=None)
    with pytest.raises(
        Exception, match=r"Gathering.rank_in_group is 2, outside \[0, world_size=2\)"
    ):
        step(torch.ones(1), bad)
