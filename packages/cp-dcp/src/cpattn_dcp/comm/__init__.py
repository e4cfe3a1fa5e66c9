"""Thin typed wrappers over the group collectives the DCP combines use."""

from cpattn_dcp.comm.collectives import (
    all_gather_lse,
    all_reduce_,
    all_to_all_records,
    reduce_scatter_heads,
)
from cpattn_dcp.comm.groups import (
    group_from_token,
    group_rank,
    group_token,
    group_world_size,
    resolve_group,
)

__all__ = [
    "all_gather_lse",
    "all_reduce_",
    "all_to_all_records",
    "group_from_token",
    "group_rank",
    "group_token",
    "group_world_size",
    "reduce_scatter_heads",
    "resolve_group",
]
