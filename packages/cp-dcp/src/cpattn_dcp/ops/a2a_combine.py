"""Packed all-to-all combine: pack (fused empty-shard mask), one ``all_to_all_single``,
unpack-and-combine; staging buffers are allocated per call (CUDA-graph safe), no host sync.
"""

from __future__ import annotations

from typing import Any

import torch

from cpattn_common.alloc import new_output
from cpattn_common.group import CPGroupLike
from cpattn_dcp.comm.collectives import all_to_all_records
from cpattn_dcp.context import CPTritonContext
from cpattn_dcp.ops._collective_common import combine_op, register_combine_op, run_combine
from cpattn_dcp.ops.a2a_pack import (
    _launch_pack,
    _send_shape,
    a2a_buffer_views,
    a2a_pack,
    a2a_pack_dim,
    a2a_record_width,
)
from cpattn_dcp.ops.a2a_unpack import _unpack_combine, a2a_unpack_combine

__all__ = [
    "a2a_buffer_views",
    "a2a_pack",
    "a2a_pack_dim",
    "a2a_record_width",
    "a2a_unpack_combine",
    "dcp_a2a_lse_reduce",
]


def a2a_combine_fwd(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    group: CPGroupLike,
    *,
    return_lse: bool,
    is_lse_base_on_e: bool,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pack → all-to-all → unpack-combine (arguments already validated)."""
    n = group.world_size
    shape = _send_shape(cp_attn_out, n)
    if n == 1:
        send = recv = new_output(cp_attn_out, shape)
    else:
        # One allocation for both staging buffers; N*B*H_r records of D + P lanes need not end
        # on 16 bytes, so a gap puts the receive half on a 16-byte boundary (vector loads).
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        gap = -numel % (16 // cp_attn_out.element_size())
        staging = new_output(cp_attn_out, (2 * numel + gap,))
        send, recv = staging[:numel].view(shape), staging[numel + gap :].view(shape)
    _launch_pack(cp_attn_out, cp_attn_lse, send, n, seq_lens, query_start_loc)
    if n > 1:
        all_to_all_records(group, recv, send)
    return _unpack_combine(recv, cp_attn_out.shape[2], return_lse, is_lse_base_on_e)


register_combine_op("dcp_a2a_lse_reduce", a2a_combine_fwd, split_heads=True, fp32_lse=True)


@combine_op
def dcp_a2a_lse_reduce(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_group: Any,
    ctx: CPTritonContext | None = None,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """DCP combine by one packed all-to-all: rank r ends with heads ``[r*H/N, (r+1)*H/N)``
    (wire format: ``a2a_pack``).

    Args:
        cp_attn_out: ``[B, H, D]`` this rank's partial output (fp16/bf16/fp32, any strides).
        cp_attn_lse: ``[B, H]`` its LSE (fp32/fp16/bf16, any strides).
        cp_group: a ``torch.distributed.ProcessGroup`` or a ``CPGroupLike``.
        ctx: accepted for compatibility; unused.
        return_lse: also return the global LSE of this rank's heads (fp32).
        is_lse_base_on_e: natural-log (True) or base-2 (False) LSEs.
        seq_lens: ``[R]`` local KV length per request (mask fused into the pack kernel).
        query_start_loc: ``[R + 1]`` query offsets per request.

    Returns:
        ``out [B, H/N, D]`` (output dtype) or ``(out, lse [B, H/N] fp32)``. World size 1
        runs the single-source combine (empty rows → 0 / -inf) without communication.

    Raises:
        ValueError: ``H % N != 0``, an output dtype other than fp16/bf16/fp32, bad shapes,
            device mismatch, inconsistent ``seq_lens``/``query_start_loc``, an input with
            torch's negative bit.
        TypeError: non-floating tensors; ``seq_lens``/``query_start_loc`` not integer
            tensors; a non-bool flag.

    Inference only (no autograd formula): see ``cpattn_common.dispatch``.

    Example:
        >>> out, lse = dcp_a2a_lse_reduce(partial_out, partial_lse, group, return_lse=True,  # doctest: +SKIP
        ...                               seq_lens=local_lens, query_start_loc=qsl)
    """
    del ctx
    return run_combine(
        "dcp_a2a_lse_reduce",
        a2a_combine_fwd,
        cp_attn_out,
        cp_attn_lse,
        cp_group,
        return_lse,
        is_lse_base_on_e,
        seq_lens,
        query_start_loc,
        heads_divisible=True,
    )
