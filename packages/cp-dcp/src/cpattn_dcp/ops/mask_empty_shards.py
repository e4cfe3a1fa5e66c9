"""``mask_dcp_empty_shards_``: set the LSE of empty-shard and padding rows to -inf, in place
(docs/design.md, "Empty shards: where they are masked"). One launch, no host sync.
"""

from __future__ import annotations

import functools

import torch

from cpattn_common.alloc import new_output
from cpattn_common.checks import check_no_neg_bit, check_no_overlap, overlaps
from cpattn_common.device import foreign_cuda_device
from cpattn_common.dispatch import mark_written_in_place, must_dispatch, refuse_grad_in_place
from cpattn_common.launch import CachedKernel, Specialization
from cpattn_dcp.kernels.empty_shards import (
    COUNT_MAX_STEPS,
    _mask_empty_shards_inplace_kernel,
    _mask_empty_shards_kernel,
)
from cpattn_dcp.ops._common import (
    LSE_DTYPES,
    MIN_PROGRAMS,
    check_lse_dtype,
    check_mask_args,
    contiguous,
    mask_args_proven,
    next_pow2,
    search_steps,
    shares_elements,
    specialize,
)

__all__ = ["mask_dcp_empty_shards_", "masked_lse_copy"]

# Mask tiles: at most 64 rows and 256 request-count lanes per program, fewer rows until the
# grid has MIN_PROGRAMS programs, one warp, int32 rows where they fit: B=64 3.44 -> 1.34 µs on
# H200 against 64 rows / 2 warps / int64 (docs/design.md, "Empty shards: where they are masked").
_BLOCK_B = 64
_MASK_TILE_LANES = 256
_MASK_NUM_WARPS = 1
_MASK_MIN_PROGRAMS = MIN_PROGRAMS
_MASK_ROW32 = True
_INT32_MAX = 2**31 - 1
_COUNT_MAX_STEPS: int = COUNT_MAX_STEPS.value
_Tensor = torch.Tensor
# Bound once: a launch keys only its runtime arguments (see cpattn_common.launch).
_inplace_kernel = CachedKernel(_mask_empty_shards_inplace_kernel)
_copy_kernel = CachedKernel(_mask_empty_shards_kernel)


def _check_lse(lse: torch.Tensor) -> None:
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.dim() != 2:
        raise ValueError(f"expected lse [B, H], got shape {tuple(lse.shape)}")
    check_lse_dtype("lse", lse)


def _check_writable(lse: torch.Tensor) -> None:
    check_no_neg_bit("mask_dcp_empty_shards_", lse=lse)
    if shares_elements(lse):
        raise ValueError(
            f"lse (shape {tuple(lse.shape)}, strides {lse.stride()}) has elements that share "
            "memory (e.g. an expand): masking one row in place would mask the others; pass "
            "lse.clone()"
        )


def _valid_fast(lse: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> bool:
    """Cheap proof that ``_check_lse`` and ``check_mask_args`` accept these arguments with
    masking on (False: not proven; the caller runs the full validation, which raises)."""
    return (
        lse.__class__ is _Tensor
        and lse.dim() == 2
        and lse.dtype in LSE_DTYPES
        and 0 not in lse.stride()  # possibly shared elements: _check_writable decides
        and not lse.is_neg()
        and mask_args_proven(lse, seq_lens, query_start_loc)
        and not overlaps(lse, seq_lens, query_start_loc)
    )


def _mask_tile(num_rows: int, steps: int, has_mask: bool) -> tuple[int, bool]:
    """``(BLOCK_B, ROW32)`` of the mask kernels for ``num_rows`` rows and ``steps``
    search steps (see ``_BLOCK_B``)."""
    lanes = 1 << steps if steps <= _COUNT_MAX_STEPS else 16
    block_b = min(_BLOCK_B, next_pow2(num_rows))
    if has_mask:
        block_b = max(1, min(block_b, _MASK_TILE_LANES // lanes))
    while block_b > 1 and -(-num_rows // block_b) < _MASK_MIN_PROGRAMS:
        block_b //= 2
    return block_b, _MASK_ROW32 and num_rows + block_b <= _INT32_MAX


@functools.lru_cache(maxsize=1024)
def _mask_plan(
    num_rows: int, num_heads: int, num_seqs: int, has_mask: bool, in_place: bool
) -> tuple[tuple[int], Specialization]:
    """Grid and specialization (memoised per shape) of the in-place mask or the masked copy."""
    steps = search_steps(num_seqs)
    block_b, row32 = _mask_tile(num_rows, steps, has_mask)
    block_h = min(64, next_pow2(num_heads))
    tile = dict(SEARCH_STEPS=steps, ROW32=row32, BLOCK_B=block_b, BLOCK_H=block_h)
    if in_place:
        spec = specialize(_inplace_kernel, **tile, num_warps=_MASK_NUM_WARPS)
    else:
        spec = specialize(
            _copy_kernel, HAS_MASK=has_mask, IS_COPY=True, **tile, num_warps=_MASK_NUM_WARPS
        )
    return (-(-num_rows // block_b),), spec


def _launch_mask(
    lse: torch.Tensor,
    dst: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> None:
    """Mask ``lse`` in place (``dst`` None) or copy it, masked, into ``dst`` (validated
    arguments; ``seq_lens`` None: no mask)."""
    if (index := foreign_cuda_device(lse)) >= 0:
        with torch.cuda.device(index):
            return _launch_mask(lse, dst, seq_lens, query_start_loc)
    num_rows, num_heads = lse.shape
    if num_rows == 0 or num_heads == 0:
        return
    num_seqs = seq_lens.shape[0] if seq_lens is not None else 0
    grid, spec = _mask_plan(num_rows, num_heads, num_seqs, seq_lens is not None, dst is None)
    copy_to = () if dst is None else (dst, *dst.stride())
    # Runtime arguments positionally, in the kernel's signature order; without a mask the
    # index pointers are never read (``lse`` stands in).
    spec(
        grid,
        lse,
        *lse.stride(),
        *copy_to,
        contiguous(seq_lens) if seq_lens is not None else lse,
        contiguous(query_start_loc) if query_start_loc is not None else lse,
        num_seqs,
        num_rows,
        num_heads,
    )


def masked_lse_copy(
    lse: torch.Tensor,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> torch.Tensor:
    """A contiguous copy of ``lse [B, H]`` (same dtype) with empty rows set to -inf.

    ``seq_lens``/``query_start_loc`` ``None`` gives a plain contiguous copy. One launch; the
    caller's tensor is never modified. Arguments must already be validated.
    """
    dst = new_output(lse, lse.shape)
    _launch_mask(lse, dst, seq_lens, query_start_loc)
    return dst


@torch.library.custom_op("cpattn_dcp::mask_dcp_empty_shards_", mutates_args=("lse",))
def _mask_dcp_empty_shards_op(
    lse: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> None:
    _launch_mask(lse, None, seq_lens, query_start_loc)


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
        lse: ``[B, H]`` partial LSE of this rank (fp32/fp16/bf16, any strides without
            elements that share memory); modified.
        seq_lens: ``[R]`` integer, this rank's *local* KV length per request.
        query_start_loc: ``[R + 1]`` integer cumulative query offsets of the requests.

    Returns:
        ``lse`` (the same tensor). Rows past ``query_start_loc[R]`` and rows of requests with
        ``seq_lens == 0`` hold -inf for every head; other rows are untouched. Both ``None``
        is a no-op (``lse`` is still checked: a 2-D tensor of a supported dtype).

    Raises:
        ValueError: ``lse`` not 2-D or of a floating dtype other than fp32/fp16/bf16; exactly
            one of ``seq_lens``/``query_start_loc`` is ``None``, they are not 1-D,
            ``len(query_start_loc) != len(seq_lens) + 1``, devices differ, or (masking on)
            ``lse`` has elements that share memory (an expanded view), overlaps ``seq_lens`` or
            ``query_start_loc`` in memory or has torch's negative bit
            (``checks.check_no_neg_bit``); in check mode (``cpattn_common.checks``), negative
            ``seq_lens``, a decreasing ``query_start_loc`` or one past the B rows.
        TypeError: ``lse`` not a floating tensor; ``seq_lens``/``query_start_loc`` not
            tensors or not of an integer dtype (bool, floating and complex are not).
        RuntimeError: (masking on) grad mode is on and ``lse`` requires grad: the op has no
            autograd formula, so the gradient would ignore the masking.

    Example:
        >>> lse = torch.zeros(7, 2)
        >>> _ = mask_dcp_empty_shards_(lse, torch.tensor([0, 2]), torch.tensor([0, 1, 5]))
        >>> lse[:, 0].tolist()  # rows 0 (empty shard) and 5, 6 (padding) are now -inf
        [-inf, 0.0, 0.0, 0.0, 0.0, -inf, -inf]
    """
    dispatch = must_dispatch(lse)  # tracing, a dispatch mode, autograd
    # Eager hot path: a call proven valid cheaply skips the full checks and the dispatcher;
    # ``lse`` is marked written, as the dispatcher would.
    if (
        seq_lens is not None
        and query_start_loc is not None
        and not dispatch
        and _valid_fast(lse, seq_lens, query_start_loc)
    ):
        _launch_mask(lse, None, seq_lens, query_start_loc)
        mark_written_in_place(lse)
        return lse
    _check_lse(lse)
    if not check_mask_args(seq_lens, query_start_loc, lse.device, lse.shape[0]):
        return lse
    _check_writable(lse)
    check_no_overlap("mask_dcp_empty_shards_", "lse", lse=lse, seq_lens=seq_lens,
                     query_start_loc=query_start_loc)  # fmt: skip
    assert seq_lens is not None
    assert query_start_loc is not None
    if dispatch:
        refuse_grad_in_place("mask_dcp_empty_shards_", "lse", lse)
        torch.ops.cpattn_dcp.mask_dcp_empty_shards_(lse, seq_lens, query_start_loc)
    else:
        _launch_mask(lse, None, seq_lens, query_start_loc)
        mark_written_in_place(lse)
    return lse
