"""AG+RS and AG+AR combines: all-gather the LSEs, rescale, reduce-scatter / all-reduce.

Per call: a masked-LSE copy (skipped without a mask for a contiguous LSE), the LSE all-gather,
one correction kernel into a fresh buffer laid out for the output collective, and that
collective; the caller's tensors are never modified. World size 1 combines without
communication.
"""

from __future__ import annotations

from typing import Any

import torch

from cpattn_common.alloc import empty_output
from cpattn_common.group import CPGroupLike
from cpattn_dcp.comm.collectives import all_gather_lse, all_reduce_, reduce_scatter_heads
from cpattn_dcp.context import CPTritonContext
from cpattn_dcp.ops._collective_common import combine_op, register_combine_op, run_combine
from cpattn_dcp.ops.correct_attn_out import launch_correct
from cpattn_dcp.ops.mask_empty_shards import masked_lse_copy

__all__ = ["ag_combine_fwd", "cp_lse_ag_out_ar", "cp_lse_ag_out_rs"]


def ag_combine_fwd(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    group: CPGroupLike,
    *,
    reduce_scatter: bool,
    return_lse: bool,
    is_lse_base_on_e: bool,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AG+RS (``reduce_scatter=True``) or AG+AR combine; arguments already validated.

    Returns:
        ``(out, lse)``: ``out [B, H/N, D]`` (RS) or ``[B, H, D]`` (AR) in the output dtype,
        ``lse`` ``[B, H/N]`` / ``[B, H]`` in ``cp_attn_lse.dtype`` or ``None``.
    """
    n = group.world_size
    rank = group.rank_in_group
    b, h, d = cp_attn_out.shape
    has_mask = seq_lens is not None
    if has_mask or not cp_attn_lse.is_contiguous():
        lse_local = masked_lse_copy(cp_attn_lse, seq_lens, query_start_loc)
    else:
        lse_local = cp_attn_lse
    lses = all_gather_lse(group, lse_local)
    dev = cp_attn_out.device
    if reduce_scatter:
        hr = h // n
        buf = empty_output((n, b, hr, d), dtype=cp_attn_out.dtype, device=dev)
        strides = (hr * d, b * hr * d, d, 1)
        lse_out = empty_output((b, hr), dtype=lses.dtype, device=dev) if return_lse else None
        launch_correct(
            cp_attn_out, buf, strides, hr, lses, lse_out, rank * hr, rank, is_lse_base_on_e
        )
        out = reduce_scatter_heads(group, buf)
    else:
        buf = empty_output((b, h, d), dtype=cp_attn_out.dtype, device=dev)
        strides = (h * d, 0, d, 1)
        lse_out = empty_output((b, h), dtype=lses.dtype, device=dev) if return_lse else None
        launch_correct(cp_attn_out, buf, strides, h, lses, lse_out, 0, rank, is_lse_base_on_e)
        out = all_reduce_(group, buf)
    return out, lse_out


register_combine_op(
    "cp_lse_ag_out_rs", ag_combine_fwd, split_heads=True, fp32_lse=False, reduce_scatter=True
)
register_combine_op(
    "cp_lse_ag_out_ar", ag_combine_fwd, split_heads=False, fp32_lse=False, reduce_scatter=False
)


def _vllm_layouts(out: Any, lse: Any) -> tuple[Any, Any]:
    """As vLLM's AG paths: ``out [B, 1, H, D]`` and ``lse [B, H, 1]`` / ``[B, 1, H]`` are
    squeezed to ``[B, H, D]`` / ``[B, H]`` (views); anything else is validated as given."""
    if isinstance(out, torch.Tensor) and out.dim() == 4 and out.shape[1] == 1:
        out = out.squeeze(1)
    if isinstance(lse, torch.Tensor) and lse.dim() == 3:
        dim = 2 if lse.shape[2] == 1 else 1
        if lse.shape[dim] == 1:
            lse = lse.squeeze(dim)
    return out, lse


@combine_op
def cp_lse_ag_out_rs(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_group: Any,
    ctx: CPTritonContext | None = None,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """DCP combine by LSE all-gather + rescale + reduce-scatter over heads.

    Args:
        cp_attn_out: ``[B, H, D]`` (or vLLM's ``[B, 1, H, D]``) this rank's partial output
            (fp16/bf16/fp32, any strides); not modified.
        cp_attn_lse: ``[B, H]`` (or ``[B, H, 1]`` / ``[B, 1, H]``) its LSE (fp32/fp16/bf16,
            any strides); not modified.
        cp_group: a ``torch.distributed.ProcessGroup`` or a ``CPGroupLike``
            (``cpattn_common.CPGroup``); N ranks, this is rank r.
        ctx: accepted for compatibility (``CPTritonContext``); unused.
        return_lse: also return this rank's slice of the global LSE.
        is_lse_base_on_e: natural-log (True) or base-2 (False) LSEs.
        seq_lens: ``[R]`` local KV length per request (empty-shard mask), or ``None``.
        query_start_loc: ``[R + 1]`` query offsets per request, or ``None``.

    Returns:
        ``out [B, H/N, D]`` (heads ``[r*H/N, (r+1)*H/N)`` of the exact combine, output
        dtype), or ``(out, lse [B, H/N])`` (``cp_attn_lse.dtype``) with ``return_lse``.

    Raises:
        ValueError: bad shapes, ``H % N != 0``, unsupported dtypes, device mismatch,
            inconsistent ``seq_lens``/``query_start_loc`` (one ``None``, not 1-D, lengths),
            an input with torch's negative bit (``cpattn_common.checks.check_no_neg_bit``).
        TypeError: non-floating tensors; ``seq_lens``/``query_start_loc`` not tensors or
            not of an integer dtype (as for ``mask_dcp_empty_shards_``); an
            ``is_lse_base_on_e`` or ``return_lse`` that is not a bool.

    Inference only (no autograd formula): see ``cpattn_common.dispatch``.

    Example:
        >>> out = cp_lse_ag_out_rs(partial_out, partial_lse, dist.group.WORLD)  # doctest: +SKIP
        >>> out, lse = cp_lse_ag_out_rs(partial_out, partial_lse, group, return_lse=True,  # doctest: +SKIP
        ...                             seq_lens=local_lens, query_start_loc=qsl)
    """
    del ctx
    cp_attn_out, cp_attn_lse = _vllm_layouts(cp_attn_out, cp_attn_lse)
    return run_combine(
        "cp_lse_ag_out_rs",
        ag_combine_fwd,
        cp_attn_out,
        cp_attn_lse,
        cp_group,
        return_lse,
        is_lse_base_on_e,
        seq_lens,
        query_start_loc,
        heads_divisible=True,
        reduce_scatter=True,
    )


@combine_op
def cp_lse_ag_out_ar(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_group: Any,
    ctx: CPTritonContext | None = None,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """DCP combine by LSE all-gather + rescale + all-reduce (every rank gets all heads).

    Same arguments as :func:`cp_lse_ag_out_rs`; ``H`` need not be divisible by N.

    Returns:
        ``out [B, H, D]`` (output dtype), or ``(out, lse [B, H])`` (``cp_attn_lse.dtype``)
        with ``return_lse``.

    Example:
        >>> # PCP: replicated heads
        >>> out = cp_lse_ag_out_ar(partial_out, partial_lse, group)  # doctest: +SKIP
    """
    del ctx
    cp_attn_out, cp_attn_lse = _vllm_layouts(cp_attn_out, cp_attn_lse)
    return run_combine(
        "cp_lse_ag_out_ar",
        ag_combine_fwd,
        cp_attn_out,
        cp_attn_lse,
        cp_group,
        return_lse,
        is_lse_base_on_e,
        seq_lens,
        query_start_loc,
        heads_divisible=False,
        reduce_scatter=False,
    )
