"""NCCL-path query and KV gathers of decode context parallelism (the direct paths' fallback):
query heads ``[T, H_r, D] -> [T, N*H_r, D]`` rank-major (optionally in storage for more heads),
KV rows ``[T, D] -> [N*T, D]`` into a caller buffer. Inference only: an input that requires
grad raises ``RuntimeError`` under grad mode (``cpattn_common.dispatch.refuse_grad``).
"""

from __future__ import annotations

from typing import Any

import torch

from cpattn_common.agreement import check_tensor_agreement
from cpattn_common.alloc import empty_output
from cpattn_common.checks import check_no_overlap, check_positive_int, check_state, check_tensors
from cpattn_common.dispatch import refuse_grad
from cpattn_dcp.comm.groups import resolve_group

__all__ = ["dcp_gather_kv", "dcp_gather_query", "reserve_query_head_storage"]


def reserve_query_head_storage(query: torch.Tensor, padded_num_heads: int) -> torch.Tensor:
    """Copy ``query [T, H, D]`` into a contiguous tensor whose storage holds ``padded_num_heads``.

    Args:
        query: ``[T, H, D]`` (any strides).
        padded_num_heads: head capacity ``>= H``.

    Returns:
        A contiguous ``[T, H, D]`` tensor (strides ``(H*D, D, 1)``) at offset 0 of a storage of
        ``T * padded_num_heads * D`` elements.

    Raises:
        ValueError: ``query`` not 3-D or ``padded_num_heads < H``.
        TypeError: ``query`` is not a tensor; ``padded_num_heads`` is not an int (a bool or a
            float is refused).
    """
    check_tensors("reserve_query_head_storage", query=query)
    check_positive_int("padded_num_heads", padded_num_heads)
    if query.dim() != 3:
        raise ValueError(f"expected query [T, H, D], got shape {tuple(query.shape)}")
    t, h, d = query.shape
    if padded_num_heads < h:
        raise ValueError(f"padded_num_heads {padded_num_heads} < query heads {h}")
    storage = empty_output((t * padded_num_heads * d,), dtype=query.dtype, device=query.device)
    out = storage[: t * h * d].view(t, h, d)
    out.copy_(query)
    return out


def dcp_gather_query(
    query: torch.Tensor, cp_group: Any, padded_num_heads: int | None = None
) -> torch.Tensor:
    """All-gather the query heads over the DCP group (rank-major along the head axis).

    Args:
        query: ``[T, H_r, D]`` this rank's query heads.
        cp_group: ``ProcessGroup`` or ``CPGroupLike`` of the DCP group (N ranks).
        padded_num_heads: optional head capacity ``>= N*H_r`` of the result's storage.

    Returns:
        ``[T, N*H_r, D]`` contiguous; heads ``[s*H_r, (s+1)*H_r)`` come from rank s. With
        N = 1 and no padding, ``query`` itself when it is contiguous, else a contiguous copy.

    Raises:
        ValueError: ``query`` not 3-D or ``padded_num_heads < N*H_r``.
        TypeError: ``query`` is not a tensor; ``padded_num_heads`` is neither ``None`` nor an
            int (a bool or a float is refused).
        RuntimeError: grad mode is on and ``query`` requires grad (no autograd formula; on
            every world size, N = 1 included).

    Example:
        >>> # q_all [T, N*H_r, D]; the second one backed by storage for 128 heads
        >>> q_all = dcp_gather_query(q_local, group)  # doctest: +SKIP
        >>> q_all = dcp_gather_query(q_local, group, padded_num_heads=128)  # doctest: +SKIP
    """
    check_tensors("dcp_gather_query", query=query)
    refuse_grad("dcp_gather_query", query=query)
    if query.dim() != 3:
        raise ValueError(f"expected query [T, H_r, D], got shape {tuple(query.shape)}")
    group = resolve_group(cp_group)
    n = group.world_size
    t, h_r, d = query.shape
    if padded_num_heads is not None:
        check_positive_int("padded_num_heads", padded_num_heads)
        if padded_num_heads < n * h_r:
            raise ValueError(
                f"padded_num_heads {padded_num_heads} < gathered heads N*H_r = "
                f"{n}*{h_r} = {n * h_r}"
            )
    if check_state.enabled:
        check_tensor_agreement("dcp_gather_query", group, "query", query,
                               padded_num_heads=padded_num_heads or 0)  # fmt: skip
    if n == 1:
        if padded_num_heads is not None:
            return reserve_query_head_storage(query, padded_num_heads)
        # Packed rows, as every other path returns (a head slice of a fused QKV projection
        # keeps its token stride otherwise); no copy when they already are.
        return query.contiguous()
    if padded_num_heads is None:
        return group.all_gather(query.contiguous(), dim=1)
    # Gather rank-major along dim 0, then one copy into the padded-capacity layout.
    staged = empty_output((n * t, h_r, d), dtype=query.dtype, device=query.device)
    group.all_gather_into_tensor(staged, query.contiguous())
    storage = empty_output((t * padded_num_heads * d,), dtype=query.dtype, device=query.device)
    out = storage[: t * n * h_r * d].view(t, n * h_r, d)
    out.view(t, n, h_r, d).copy_(staged.view(n, t, h_r, d).transpose(0, 1))
    return out


def dcp_gather_kv(gathered_kv: torch.Tensor, local_kv: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """``gathered_kv[:N*T]`` = every rank's ``local_kv [T, D]``, rank-major, in place.

    Args:
        gathered_kv: caller buffer ``[G, D]`` (contiguous, same dtype/device, ``G >= N*T``).
        local_kv: ``[T, D]`` this rank's rows (made contiguous if needed).
        cp_group: ``ProcessGroup`` or ``CPGroupLike`` of the DCP group.

    Returns:
        The written view ``gathered_kv[:N*T]``.

    Raises:
        TypeError: an argument that is not a tensor.
        ValueError: rank/shape/dtype/device mismatch, a buffer that is too small or that
            overlaps ``local_kv`` in memory.
        RuntimeError: grad mode is on and ``gathered_kv`` (written in place) or ``local_kv``
            requires grad (no autograd formula; on every world size, N = 1 included).
    """
    refuse_grad("dcp_gather_kv", gathered_kv=gathered_kv, local_kv=local_kv)
    group = resolve_group(cp_group)
    n = group.world_size
    check_kv_buffers(gathered_kv, local_kv, n)
    if check_state.enabled:
        check_tensor_agreement("dcp_gather_kv", group, "local_kv", local_kv)
    out = gathered_kv[: n * local_kv.shape[0]]
    if n == 1:
        out.copy_(local_kv)
    else:
        group.all_gather_into_tensor(out, local_kv.contiguous())
    return out


def check_kv_buffers(gathered_kv: torch.Tensor, local_kv: torch.Tensor, world_size: int) -> None:
    """The KV gather's buffer checks (``dcp_gather_kv``, and ``DCPManager.kv_gather`` on every
    path): tensors of equal rank and row shape, same dtype and device, a contiguous
    ``gathered_kv`` of at least ``N*T`` rows that does not overlap ``local_kv``.

    Raises:
        TypeError: an argument that is not a tensor.
        ValueError: any of these fails (the message names the shapes or the numbers).
    """
    check_tensors("dcp_gather_kv", gathered_kv=gathered_kv, local_kv=local_kv)
    if local_kv.dim() < 1 or gathered_kv.dim() != local_kv.dim():
        raise ValueError(
            f"expected gathered_kv [G, ...] and local_kv [T, ...] of equal rank, got "
            f"{tuple(gathered_kv.shape)} and {tuple(local_kv.shape)}"
        )
    if gathered_kv.shape[1:] != local_kv.shape[1:]:
        raise ValueError(
            f"row shapes differ: gathered_kv {tuple(gathered_kv.shape)} vs local_kv "
            f"{tuple(local_kv.shape)}"
        )
    if gathered_kv.dtype != local_kv.dtype or gathered_kv.device != local_kv.device:
        raise ValueError(
            f"gathered_kv ({gathered_kv.dtype}, {gathered_kv.device}) and local_kv "
            f"({local_kv.dtype}, {local_kv.device}) must share dtype and device"
        )
    if not gathered_kv.is_contiguous():
        raise ValueError("gathered_kv must be contiguous")
    n, t = world_size, local_kv.shape[0]
    if gathered_kv.shape[0] < n * t:
        raise ValueError(
            f"gathered_kv has {gathered_kv.shape[0]} rows, needs N*T = {n}*{t} = {n * t}"
        )
    check_no_overlap("dcp_gather_kv", "gathered_kv", gathered_kv=gathered_kv, local_kv=local_kv)
