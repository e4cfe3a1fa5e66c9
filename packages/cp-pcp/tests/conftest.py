"""Fixtures of the cp-pcp tests (the cp-testing plugin is enabled by the root conftest)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


class FakeGroup:
    """A ``CPGroupLike`` for single-process tests: rank metadata, no communication.

    ``all_gather`` over a world of one returns the input. With ``replicated=True`` it acts as if
    every rank held the same tensor (``N`` copies concatenated along ``dim``). Anything else
    fails loudly, so a test notices when an op communicates unexpectedly.
    """

    def __init__(self, world_size: int, rank_in_group: int = 0, replicated: bool = False) -> None:
        self._world_size = world_size
        self._rank = rank_in_group
        self._replicated = replicated
        self.calls: list[str] = []

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank_in_group(self) -> int:
        return self._rank

    @property
    def device_group(self) -> None:
        return None

    def _only_solo(self, op: str, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append(op)
        if self._world_size != 1:
            raise AssertionError(f"unexpected {op} on a fake group of {self._world_size} ranks")
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self._replicated:
            self.calls.append("all_gather")
            return torch.cat([tensor] * self._world_size, dim=dim)
        return self._only_solo("all_gather", tensor)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self._only_solo("reduce_scatter", tensor)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._only_solo("all_reduce", tensor)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(self._only_solo("all_to_all_single", input))

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(self._only_solo("all_gather_into_tensor", input))

    def barrier(self) -> None:
        self.calls.append("barrier")


@pytest.fixture
def fake_group() -> Callable[..., FakeGroup]:
    """``fake_group(world_size, rank=0, replicated=False)`` -> a single-process ``CPGroupLike``."""

    def make(world_size: int, rank: int = 0, replicated: bool = False) -> FakeGroup:
        return FakeGroup(world_size, rank, replicated)

    return make
