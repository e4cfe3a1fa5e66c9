"""The TP x PCP x DCP layouts cp-pcp supports, checked in one place so every layout function
raises the same ``ValueError``: with PCP (``N_pcp > 1``) the DCP group is the PCP group or spans
TP x PCP (``N_dcp`` a multiple of ``N_pcp``); ``N_dcp == 1`` is always valid.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["GatherAxis", "check_size", "gather_axis"]

GatherAxis = Literal["dcp", "tp"] | None


def check_size(value: int, name: str) -> None:
    """A group size or head count: an int (not a bool) >= 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def gather_axis(dcp_world_size: int, pcp_world_size: int) -> GatherAxis:
    """Which group the query is gathered over for this layout (validates the layout)."""
    check_size(dcp_world_size, "dcp_world_size")
    check_size(pcp_world_size, "pcp_world_size")
    dcp, pcp = dcp_world_size, pcp_world_size
    if pcp == 1:
        return "dcp" if dcp > 1 else None
    if dcp == 1 or dcp == pcp:
        return None
    if dcp < pcp or dcp % pcp != 0:
        raise ValueError(
            f"unsupported layout dcp_world_size={dcp}, pcp_world_size={pcp}: with PCP the DCP "
            f"group must equal the PCP group (DCP = PCP) or span TP x PCP (DCP a multiple of "
            f"PCP)"
        )
    return "tp"
