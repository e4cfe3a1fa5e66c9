"""Global-order Q/K/V for a PCP prefill (all-gather, then ``plan.restore_idx``), and the local
slice of its output (docs/packages/pcp.md, "Prefill attention: global order and back"). No host
sync; the gather is inference only (a Q/K/V that requires grad raises ``RuntimeError`` under
grad mode).
"""

from __future__ import annotations

import math

import torch

from cpattn_common.agreement import check_ranks_agree, tensor_fields
from cpattn_common.checks import check_state, check_tensors
from cpattn_common.dispatch import refuse_grad
from cpattn_pcp._group import GroupArg, resolve_group
from cpattn_pcp.partition import DualChunkSwapPlan

__all__ = ["gather_prefill_qkv_global", "slice_prefill_output_local"]


def _check_plan(plan: object) -> None:
    if not isinstance(plan, DualChunkSwapPlan):
        raise TypeError(
            f"plan must be a DualChunkSwapPlan (from dual_chunk_swap), got "
            f"{type(plan).__name__}; vLLM's (restore_idx, gather_idx, cu_seqlens, padded_n) "
            "tuple is not one"
        )


def _check_group_size(plan: DualChunkSwapPlan, world_size: int) -> None:
    if world_size != plan.pcp_size:
        raise ValueError(
            f"pcp_group has world size {world_size} but the plan was built for pcp_size "
            f"{plan.pcp_size}"
        )


def _check_device(plan: DualChunkSwapPlan, x: torch.Tensor, name: str) -> None:
    if x.device != plan.device:
        raise ValueError(
            f"{name} is on {x.device} but the plan's indices are on {plan.device}; "
            f"build the plan there or use plan.to({str(x.device)!r}) once"
        )


def gather_prefill_qkv_global(
    plan: DualChunkSwapPlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pcp_group: GroupArg,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather this rank's local prefill Q/K/V and put them in global token order.

    Local rows beyond ``T_local`` (up to ``P``) are zero-padded before the gather; they must
    be padding rows of the plan (``T_local >= plan.local_extent[rank]``, checked), which
    ``restore_idx`` drops. When the three tensors share dtype and device they travel in one
    all-gather.

    Args:
        plan: the batch's ``DualChunkSwapPlan`` (index tensors on the tensors' device).
        query: ``[T_local, Hq, Dk]`` (any trailing shape), this rank's local rows in plan
            order, ``plan.local_extent[rank] <= T_local <= P = plan.padded_local_len``.
        key: ``[T_local, Hkv, Dk]``.
        value: ``[T_local, Hkv, Dv]``.
        pcp_group: the PCP group (``ProcessGroup`` or ``CPGroupLike``) of size
            ``plan.pcp_size``.

    Returns:
        ``(q, k, v)``, each ``[T, ...]`` in global order (``T = plan.num_tokens``), real
        tokens only; request ``j`` occupies rows ``cu_seqlens[j] .. cu_seqlens[j+1]``.
        When the inputs travelled packed the results are row-strided views of one buffer
        (last dim contiguous); call ``.contiguous()`` if a kernel needs dense rows.

    Raises:
        TypeError: ``plan`` is not a ``DualChunkSwapPlan``; ``query``, ``key`` or ``value``
            is not a tensor.
        ValueError: row counts differ, exceed ``P`` or stop before this rank's last real
            row, the group size or device does not match the plan. These checks run on each
            rank before the all-gather: a rank whose check fails raises while its peers wait
            in the collective, as with any collective that some ranks skip. In check mode
            (``cpattn_common.checks``), on every rank: the ranks' plans, trailing shapes or
            dtypes differ.
        RuntimeError: grad mode is on and ``query``, ``key`` or ``value`` requires grad (the
            all-gather has no autograd formula; on every PCP size, 1 included).
    """
    _check_plan(plan)
    check_tensors("gather_prefill_qkv_global", query=query, key=key, value=value)
    refuse_grad("gather_prefill_qkv_global", query=query, key=key, value=value)
    group = resolve_group(pcp_group, "pcp_group", "to gather prefill Q/K/V")
    _check_group_size(plan, group.world_size)
    tensors = (query, key, value)
    names = ("query", "key", "value")
    rows = {
        name: (t.shape[0] if t.dim() > 0 else None) for name, t in zip(names, tensors, strict=True)
    }
    first = rows["query"]
    # Compared, not hashed (no set()): under symbolic tracing a size is an unhashable SymInt.
    if first is None or any(r is None or r != first for r in rows.values()):
        raise ValueError(f"query, key and value must have the same number of rows, got {rows}")
    num_rows = query.shape[0]
    if num_rows > plan.padded_local_len:
        raise ValueError(
            f"local Q/K/V have {num_rows} rows but the plan has only padded_local_len = "
            f"{plan.padded_local_len} local rows per rank"
        )
    needed = plan.local_extent[group.rank_in_group]
    if num_rows < needed:
        raise ValueError(
            f"local Q/K/V have {num_rows} rows but rank {group.rank_in_group}'s last real "
            f"local row is row {needed - 1} (plan.local_extent): pass at least {needed} rows "
            "(padding rows sit between real ones)"
        )
    for name, t in zip(names, tensors, strict=True):
        _check_device(plan, t, name)
    if check_state.enabled:  # the local row counts may differ; the rest may not
        fields = {"world size": group.world_size, "plan.num_tokens": plan.num_tokens,
                  "plan.padded_local_len": plan.padded_local_len,
                  "hash(plan.seq_lens)": hash(plan.seq_lens) & (2**62 - 1)}  # fmt: skip
        for name, t in zip(names, tensors, strict=True):
            fields.update(tensor_fields(name, t, first_dim=1))
        check_ranks_agree("gather_prefill_qkv_global", group, query.device, fields)

    # Tensors of one dtype travel packed in one all-gather.
    parts = [list(tensors)] if query.dtype == key.dtype == value.dtype else [[t] for t in tensors]
    out: list[torch.Tensor] = []
    for part in parts:
        widths = [math.prod(t.shape[1:]) for t in part]
        flats = [t.reshape(num_rows, w) for t, w in zip(part, widths, strict=True)]
        flat = torch.cat(flats, dim=1) if len(flats) > 1 else flats[0]
        if num_rows < plan.padded_local_len:
            flat = torch.nn.functional.pad(flat, (0, 0, 0, plan.padded_local_len - num_rows))
        restored = plan.restore(group.all_gather(flat, dim=0))
        for t, col in zip(part, torch.split(restored, widths, dim=1), strict=True):
            out.append(col.reshape(plan.num_tokens, *t.shape[1:]))
    return out[0], out[1], out[2]


def slice_prefill_output_local(
    plan: DualChunkSwapPlan,
    out_global: torch.Tensor,
    num_actual: int,
    *,
    pcp_group: GroupArg,
) -> torch.Tensor:
    """This rank's local rows of a prefill output computed in global order.

    The inverse of ``gather_prefill_qkv_global`` on real tokens: row ``i`` of the result is the
    output of the token at local row ``i`` of this rank. Padding rows get the output of their
    request's first token (a defined, finite value; callers ignore them).

    Args:
        plan: the batch's ``DualChunkSwapPlan``.
        out_global: ``[T, ...]`` in global token order (``T = plan.num_tokens``).
        num_actual: how many local rows to return, ``0 <= num_actual <= P``.
        pcp_group: the PCP group of size ``plan.pcp_size`` (only its rank is used: no
            communication).

    Returns:
        ``[num_actual, ...]``, a new tensor.

    Raises:
        TypeError: ``plan`` is not a ``DualChunkSwapPlan``; ``out_global`` is not a tensor;
            ``num_actual`` is not an int.
        ValueError: wrong row count, ``num_actual`` out of range, group size or device
            mismatch.
    """
    _check_plan(plan)
    check_tensors("slice_prefill_output_local", out_global=out_global)
    group = resolve_group(pcp_group, "pcp_group", "to slice the local prefill output")
    _check_group_size(plan, group.world_size)
    if out_global.dim() < 1 or out_global.shape[0] != plan.num_tokens:
        raise ValueError(
            f"out_global must have plan.num_tokens = {plan.num_tokens} rows, got shape "
            f"{tuple(out_global.shape)}"
        )
    if isinstance(num_actual, bool) or not isinstance(num_actual, int):
        raise TypeError(f"num_actual must be an int, got {type(num_actual).__name__}")
    if not 0 <= num_actual <= plan.padded_local_len:
        raise ValueError(
            f"num_actual must be in [0, padded_local_len = {plan.padded_local_len}], "
            f"got {num_actual}"
        )
    _check_device(plan, out_global, "out_global")
    rank = group.rank_in_group
    idx = plan.gather_idx.view(plan.pcp_size, plan.padded_local_len)[rank, :num_actual]
    return out_global.index_select(0, idx)
