"""AG+RS and AG+AR combines: all-gather the LSEs, rescale, reduce-scatter / all-reduce.

Per call: one masked-LSE copy kernel (skipped without a mask for a contiguous LSE), one LSE
all-gather, one correction kernel writing a fresh buffer laid out for the collective
(``[N, B, H/N, D]`` for the reduce-scatter, ``[B, H, D]`` for the all-reduce), and the output
collective; the caller's tensors are never modified. World size 1 runs the single-source
combine without communication.
"""

from __future__ import annotations

from typing import Any

import torch

from cpattn_common.alloc import empty_output
from cpattn_common.checks import check_bool, check_state
from cpattn_common.dispatch import must_dispatch
from cpattn_common.group import CPGroupLike
from cpattn_dcp.comm.collectives import all_gather_lse, all_reduce_, reduce_scatter_heads
from cpattn_dcp.comm.groups import (
    group_from_token,
    resolve_group,
)
from cpattn_dcp.context import CPTritonContext
from cpattn_dcp.ops._collective_common import (
    check_combine_agreement,
    combine_op,
    traced_combine,
    validate_combine_args,
)
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


def _fake_ag(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    world_size: int,
    return_lse: bool,
    reduce_scatter: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, d = cp_attn_out.shape
    hh = h // world_size if reduce_scatter else h
    out = cp_attn_out.new_empty((b, hh, d))
    lse = cp_attn_lse.new_empty((b, hh) if return_lse else (0,))
    return out, lse


def _register_ag_op(name: str, reduce_scatter: bool) -> Any:
    """Register ``cpattn_dcp::<name>`` (the AG+RS or AG+AR combine) with its fake; the group
    travels as a string token (custom ops take no ProcessGroup)."""

    @torch.library.custom_op(f"cpattn_dcp::{name}", mutates_args=())
    def op(
        cp_attn_out: torch.Tensor,
        cp_attn_lse: torch.Tensor,
        group_tok: str,
        world_size: int,
        rank: int,
        return_lse: bool,
        is_lse_base_on_e: bool,
        seq_lens: torch.Tensor | None,
        query_start_loc: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = ag_combine_fwd(
            cp_attn_out,
            cp_attn_lse,
            group_from_token(group_tok),
            reduce_scatter=reduce_scatter,
            return_lse=return_lse,
            is_lse_base_on_e=is_lse_base_on_e,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
        )
        return out, lse if lse is not None else cp_attn_lse.new_empty((0,))

    @op.register_fake
    def _(
        cp_attn_out: torch.Tensor,
        cp_attn_lse: torch.Tensor,
        group_tok: str,
        world_size: int,
        rank: int,
        return_lse: bool,
        is_lse_base_on_e: bool,
        seq_lens: torch.Tensor | None,
        query_start_loc: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _fake_ag(cp_attn_out, cp_attn_lse, world_size, return_lse, reduce_scatter)

    return op


_ag_rs_op = _register_ag_op("cp_lse_ag_out_rs", reduce_scatter=True)
_ag_ar_op = _register_ag_op("cp_lse_ag_out_ar", reduce_scatter=False)


def _ag_entry(
    name: str,
    reduce_scatter: bool,
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_group: Any,
    return_lse: bool,
    is_lse_base_on_e: bool,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    is_lse_base_on_e = check_bool("is_lse_base_on_e", is_lse_base_on_e)
    return_lse = check_bool("return_lse", return_lse)
    if must_dispatch(cp_attn_out, cp_attn_lse):  # tracing, a dispatch mode, autograd
        op = (
            torch.ops.cpattn_dcp.cp_lse_ag_out_rs
            if reduce_scatter
            else torch.ops.cpattn_dcp.cp_lse_ag_out_ar
        )
        return traced_combine(
            op, name, cp_attn_out, cp_attn_lse, cp_group, return_lse, is_lse_base_on_e,
            seq_lens, query_start_loc, heads_divisible=reduce_scatter,
        )  # fmt: skip
    group = resolve_group(cp_group)
    validate_combine_args(
        name,
        cp_attn_out,
        cp_attn_lse,
        group.world_size,
        seq_lens,
        query_start_loc,
        heads_divisible=reduce_scatter,
    )
    if check_state.enabled:  # check mode: the ranks' calls agree
        check_combine_agreement(
            name, group, cp_attn_out, cp_attn_lse, return_lse, is_lse_base_on_e, seq_lens
        )
    out, lse = ag_combine_fwd(
        cp_attn_out,
        cp_attn_lse,
        group,
        reduce_scatter=reduce_scatter,
        return_lse=bool(return_lse),
        is_lse_base_on_e=bool(is_lse_base_on_e),
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )
    if return_lse:
        assert lse is not None
        return out, lse
    return out


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
        cp_attn_out: ``[B, H, D]`` this rank's partial output (fp16/bf16/fp32, any strides);
            not modified.
        cp_attn_lse: ``[B, H]`` its LSE (fp32/fp16/bf16, any strides); not modified.
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
    return _ag_entry(
        "cp_lse_ag_out_rs",
        True,
        cp_attn_out,
        cp_attn_lse,
        cp_group,
        return_lse,
        is_lse_base_on_e,
        seq_lens,
        query_start_loc,
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
    return _ag_entry(
        "cp_lse_ag_out_ar",
        False,
        cp_attn_out,
        cp_attn_lse,
        cp_group,
        return_lse,
        is_lse_base_on_e,
        seq_lens,
        query_start_loc,
    )
