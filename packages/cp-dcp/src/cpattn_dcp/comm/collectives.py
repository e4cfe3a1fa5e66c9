"""The four collectives of the DCP combines, over a ``CPGroupLike``.

Buffers are laid out by the kernels so that every collective runs on a contiguous tensor
along dim 0 (no transposes or copies around the collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpattn_common.group import CPGroup, CPGroupLike

__all__ = ["all_gather_lse", "all_reduce_", "all_to_all_records", "reduce_scatter_heads"]


def all_gather_lse(group: CPGroupLike, lse: torch.Tensor) -> torch.Tensor:
    """All-gather ``lse [B, H]`` (contiguous) into ``[N, B, H]`` (rank-major)."""
    n = group.world_size
    if n == 1:
        return lse.unsqueeze(0)
    gathered = group.all_gather(lse, dim=0)
    return gathered.view(n, lse.shape[0], lse.shape[1])


def reduce_scatter_heads(group: CPGroupLike, buf: torch.Tensor) -> torch.Tensor:
    """Sum ``buf [N, B, H_r, D]`` (contiguous, head-group major) over ranks; keep chunk r.

    Returns:
        ``[B, H_r, D]``: this rank's heads ``[r*H_r, (r+1)*H_r)`` of the summed output.
    """
    n, b, hr, d = buf.shape
    if group.world_size == 1:
        return buf.view(b, hr, d)
    out = group.reduce_scatter(buf.view(n * b, hr, d), dim=0)
    return out.view(b, hr, d)


def all_reduce_(group: CPGroupLike, buf: torch.Tensor) -> torch.Tensor:
    """Sum ``buf`` over ranks; in place (a fresh buffer we own) on a ``CPGroup`` whose
    ``all_reduce`` is ``CPGroup``'s own, else the group's out-of-place ``all_reduce``. Use the
    return value."""
    if group.world_size == 1:
        return buf
    # The in-place shortcut only where the group's all_reduce is CPGroup's own (shared_cp_group
    # wraps a ProcessGroup in a CPGroup subclass): a subclass overriding it (a custom
    # all-reduce) gets its call.
    if type(group).all_reduce is _CPGROUP_ALL_REDUCE and buf.is_contiguous():
        dist.all_reduce(buf, group=group.device_group)
        return buf
    return group.all_reduce(buf)


_CPGROUP_ALL_REDUCE = CPGroup.all_reduce


def all_to_all_records(group: CPGroupLike, recv: torch.Tensor, send: torch.Tensor) -> None:
    """Exchange the packed blocks: ``send[n]`` goes to rank n, ``recv[n]`` comes from rank n."""
    group.all_to_all_single(recv, send)
