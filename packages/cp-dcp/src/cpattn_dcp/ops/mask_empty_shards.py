"""``mask_dcp_empty_shards_``: set the LSE of empty-shard and padding rows to -inf, in place.

Row i of ``lse [B, H]`` is empty when ``i >= query_start_loc[R]`` (CUDA-graph padding) or its
request ``s = min(#{k in 1..R : query_start_loc[k] <= i}, R - 1)`` has ``seq_lens[s] == 0``
(no local KV on this rank). One kernel launch, no host sync (CUDA-graph safe).
"""

from __future__ import annotations

import functools

import torch

from cpattn_common.alloc import empty_output
from cpattn_common.launch import launch_cached
from cpattn_dcp.kernels.empty_shards import (
    _mask_empty_shards_inplace_kernel,
    _mask_empty_shards_kernel,
)
from cpattn_dcp.ops._common import check_lse_dtype, check_mask_args, next_pow2, search_steps

__all__ = ["mask_dcp_empty_shards_", "masked_lse_copy"]

_BLOCK_B = 64


def _check_lse(lse: torch.Tensor) -> None:
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.dim() != 2:
        raise ValueError(f"expected lse [B, H], got shape {tuple(lse.shape)}")
    check_lse_dtype("lse", lse)


def _launch_mask(
    src: torch.Tensor,
    dst: torch.Tensor,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    *,
    is_copy: bool,
) -> None:
    num_rows, num_heads = src.shape
    if num_rows == 0 or num_heads == 0:
        return
    has_mask = seq_lens is not None and query_start_loc is not None
    num_seqs = seq_lens.shape[0] if seq_lens is not None else 0
    block_b = min(_BLOCK_B, next_pow2(num_rows))
    launch_cached(
        _mask_empty_shards_kernel,
        (-(-num_rows // block_b),),
        src_ptr=src,
        stride_src_b=src.stride(0),
        stride_src_h=src.stride(1),
        dst_ptr=dst,
        stride_dst_b=dst.stride(0),
        stride_dst_h=dst.stride(1),
        seq_lens_ptr=seq_lens.contiguous() if seq_lens is not None else src,
        qsl_ptr=query_start_loc.contiguous() if query_start_loc is not None else src,
        num_seqs=num_seqs,
        num_rows=num_rows,
        num_heads=num_heads,
        HAS_MASK=has_mask,
        IS_COPY=is_copy,
        SEARCH_STEPS=search_steps(num_seqs),
        BLOCK_B=block_b,
        BLOCK_H=min(64, next_pow2(num_heads)),
        num_warps=2,
    )


def mask_dcp_empty_shards_impl(
    lse: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> None:
    """Kernel launch of the in-place mask (arguments already validated)."""
    num_rows, num_heads = lse.shape
    if num_rows == 0 or num_heads == 0:
        return
    num_seqs = seq_lens.shape[0]
    grid0, consts = _inplace_config(num_rows, num_heads, num_seqs)
    s = lse.stride()
    launch_cached(
        _mask_empty_shards_inplace_kernel,
        (grid0,),
        lse_ptr=lse,
        stride_b=s[0],
        stride_h=s[1],
        seq_lens_ptr=seq_lens if seq_lens.is_contiguous() else seq_lens.contiguous(),
        qsl_ptr=query_start_loc
        if query_start_loc.is_contiguous()
        else query_start_loc.contiguous(),
        num_seqs=num_seqs,
        num_rows=num_rows,
        num_heads=num_heads,
        **consts,
    )


@functools.lru_cache(maxsize=1024)
def _inplace_config(num_rows: int, num_heads: int, num_seqs: int) -> tuple[int, dict[str, int]]:
    """Grid size and constexpr/launch keywords of the in-place mask (memoised per shape)."""
    block_b = min(_BLOCK_B, next_pow2(num_rows))
    consts = {
        "SEARCH_STEPS": search_steps(num_seqs),
        "BLOCK_B": block_b,
        "BLOCK_H": min(64, next_pow2(num_heads)),
        "num_warps": 2,
    }
    return -(-num_rows // block_b), consts


def masked_lse_copy(
    lse: torch.Tensor,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> torch.Tensor:
    """A contiguous copy of ``lse [B, H]`` (same dtype) with empty rows set to -inf.

    ``seq_lens``/``query_start_loc`` ``None`` gives a plain contiguous copy. One launch; the
    caller's tensor is never modified. Arguments must already be validated.
    """
    dst = empty_output(lse.shape, dtype=lse.dtype, device=lse.device)
    _launch_mask(lse, dst, seq_lens, query_start_loc, is_copy=True)
    return dst


@torch.library.custom_op("cpattn_dcp::mask_dcp_empty_shards_", mutates_args=("lse",))
def _mask_dcp_empty_shards_op(
    lse: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> None:
    mask_dcp_empty_shards_impl(lse, seq_lens, query_start_loc)


@_mask_dcp_empty_shards_op.register_fake
def _(lse: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    return None


def mask_dcp_empty_shards_(
    lse: torch.Tensor,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> torch.Tensor:
    """Set the LSE of empty rows to -inf, in place.

    Args:
        lse: ``[B, H]`` partial LSE of this rank (fp32/fp16/bf16, any strides); modified.
        seq_lens: ``[R]`` integer, this rank's *local* KV length per request.
        query_start_loc: ``[R + 1]`` integer cumulative query offsets of the requests.

    Returns:
        ``lse`` (the same tensor). Rows past ``query_start_loc[R]`` and rows of requests with
        ``seq_lens == 0`` hold -inf for every head; other rows are untouched. Both ``None``
        is a no-op.

    Raises:
        ValueError: exactly one of ``seq_lens``/``query_start_loc`` is ``None``, they are
            not 1-D, ``len(query_start_loc) != len(seq_lens) + 1``, or devices differ.
        TypeError: non-floating ``lse`` or non-integer ``seq_lens``/``query_start_loc``.

    Example:
        >>> lse = torch.zeros(7, 2)
        >>> mask_dcp_empty_shards_(lse, torch.tensor([0, 2]), torch.tensor([0, 1, 5]))
        ... # rows 0 (empty shard) and 5, 6 (padding) are now -inf
    """
    _check_lse(lse)
    if not check_mask_args(lse, seq_lens, query_start_loc):
        return lse
    assert seq_lens is not None
    assert query_start_loc is not None
    if torch.compiler.is_compiling():
        torch.ops.cpattn_dcp.mask_dcp_empty_shards_(lse, seq_lens, query_start_loc)
    else:
        mask_dcp_empty_shards_impl(lse, seq_lens, query_start_loc)
    return lse
