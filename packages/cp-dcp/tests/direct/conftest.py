"""Fixtures of the direct-path tests: N simulated ranks whose symmetric buffers live on one device.

``SimulatedWorld.allocate_symmetric`` gives every virtual rank its own buffer plus views of the
peers' buffers, so the peer-pointer tables of ``DirectCPWorkspace`` point at N buffers of one
device. The Triton interpreter runs the programs of a launch one after another, so tests call
``publish`` on every rank before any rank's wait (the split the workspaces expose for that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_testing.simulated import SimulatedWorld


@pytest.fixture
def sim_build() -> Callable[..., tuple[Any, list[Any]]]:
    """``sim_build(world_size, device, ctor) -> (world, [ctor(group_r) for each rank r])``.

    The constructors run concurrently on the world's threads (construction is collective).
    """

    def build(
        world_size: int, device: torch.device, ctor: Callable[[Any], Any]
    ) -> tuple[Any, list[Any]]:
        world = SimulatedWorld(world_size, device)
        return world, list(world.run(ctor))

    return build


def _input_ref(case: Any) -> tuple[torch.Tensor, torch.Tensor]:
    from cpattn_testing.reference import lse_combine_ref

    lses = case.partial_lse.to(torch.float64).clone()
    lses[case.empty_rows] = float("-inf")
    lses[:, int(case.query_start_loc[-1]) :] = float("-inf")  # padding rows
    return lse_combine_ref(case.partial_out, lses, is_lse_base_on_e=case.is_lse_base_on_e)


@pytest.fixture
def input_ref() -> Callable[[Any], tuple[torch.Tensor, torch.Tensor]]:
    """``input_ref(case) -> (out [B, H, D], lse [B, H])`` float64: the exact combine of the
    case's *rounded* partials with empty-shard and padding rows masked, so a comparison
    measures only the combine's own rounding (the case's ``ref_out`` also carries the rounding
    of the partial LSEs to ``lse_dtype``)."""
    return _input_ref
