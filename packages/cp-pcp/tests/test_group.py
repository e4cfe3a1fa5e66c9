"""Group arguments (``cpattn_pcp._group``): one shared wrapper per process group, which keeps
no group alive (real gloo process groups in worker processes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch


def _resolve_and_destroy(
    rank: int, world_size: int, rounds: int, device_type: str
) -> dict[str, Any]:
    import gc
    import weakref

    import torch.distributed as dist

    from cpattn_pcp._group import optional_group, resolve_group

    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    refs: list[weakref.ref[Any]] = []
    same: list[bool] = []
    for _ in range(rounds):
        pg = dist.new_group(list(range(world_size)))
        group = resolve_group(pg, "pcp_group", "for the test")
        same.append(optional_group(pg) is group and group.device_group is pg)
        same.append(float(group.all_reduce(torch.ones(1, device=device))[0]) == world_size)
        refs.append(weakref.ref(pg))
        # On torch 2.6 / 2.7, gloo ranks that destroy a subgroup right after a collective on it
        # can hang in the next new_group unless they meet first (reproduced without cpattn).
        dist.barrier()
        dist.destroy_process_group(pg)
        del pg, group
    gc.collect()
    return {"alive": sum(r() is not None for r in refs), "same": all(same)}


def test_wrappers_are_shared_and_keep_no_group_alive(
    run_ranks: Callable[..., list[Any]], device: torch.device
) -> None:
    """The wrapper memo holds no process group: destroyed groups are freed."""
    for res in run_ranks(_resolve_and_destroy, 2, 3, device.type):
        assert res == {"alive": 0, "same": True}


def test_a_missing_required_group_names_the_keyword() -> None:
    from cpattn_pcp._group import optional_group, resolve_group

    with pytest.raises(ValueError, match="pcp_group= is required to gather"):
        resolve_group(None, "pcp_group", "to gather")
    assert optional_group(None) is None
