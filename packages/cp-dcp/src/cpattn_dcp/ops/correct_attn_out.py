"""``correct_attn_out``: in-place LSE rescale of this rank's partial output.

``out[b, h, :] *= b^(lses[r, b, h] - L[b, h])`` with the global ``L = log_b sum_n b^lses[n]``
(docs/design.md, "Numerics"). One launch; eager calls check cheaply first.
"""

from __future__ import annotations

import functools

import torch

from cpattn_common.alloc import new_output
from cpattn_common.checks import check_bool, check_no_neg_bit, check_no_overlap, overlaps
from cpattn_common.device import foreign_cuda_device
from cpattn_common.dispatch import mark_written_in_place, must_dispatch, refuse_grad_in_place
from cpattn_common.launch import CachedKernel, Specialization
from cpattn_dcp.context import CPTritonContext
from cpattn_dcp.kernels.correct_attn_out import (
    _correct_attn_out_contig_kernel,
    _correct_attn_out_fwd_kernel,
)
from cpattn_dcp.ops._common import (
    LSE_DTYPES,
    OUT_DTYPES,
    check_lse_dtype,
    check_out_dtype,
    next_pow2,
    shares_elements,
    specialize,
    tile_config,
)

__all__ = ["correct_attn_out", "correct_attn_out_fwd", "launch_correct"]

_Tensor = torch.Tensor
# Up to N=8 the weights come from one compact row vector per source, gathered to the payload
# rows (8 warps): 0.93 against 0.83 of the copy at H=64 D=128 N=8 on H200; beyond it from one
# [N_POW2, BLOCK_R] tile reduced across threads (4 warps) (docs/design.md, "Tile rules").
_LSE_ROWS_MAX_N = 8
# Partial-output bytes one program reads: 16 KiB, the shared tile rule.
_CONTIG_TARGET_BYTES = 16384
_ROWS_MAX_WARPS = 8
_TILE_MAX_WARPS = 4
# Bound once: a launch keys only its runtime arguments (see cpattn_common.launch).
_contig_kernel = CachedKernel(_correct_attn_out_contig_kernel)
_general_kernel = CachedKernel(_correct_attn_out_fwd_kernel)


def _squeeze_out(out: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() == 3:
        return out
    if out.dim() == 4 and out.shape[1] == 1:
        return out.squeeze(1)
    raise ValueError(f"expected out [B, H, D] or [B, 1, H, D], got shape {tuple(out.shape)}")


def _squeeze_lses(lses: torch.Tensor, out_bh: tuple[int, ...]) -> torch.Tensor:
    """``lses`` as ``[N, B, H]``: ``[N, B, H, 1]`` and ``[N, 1, B, H]`` are squeezed; when
    both dims are 1 (``H == 1``), the one whose squeeze matches ``out``'s ``[B, H]``."""
    if not isinstance(lses, torch.Tensor):
        raise TypeError(f"lses must be a torch.Tensor, got {type(lses).__name__}")
    if lses.dim() == 3:
        return lses
    if lses.dim() == 4:
        dims = [dim for dim in (3, 1) if lses.shape[dim] == 1]
        for dim in dims:
            squeezed = lses.squeeze(dim)
            if tuple(squeezed.shape[1:]) == out_bh:
                return squeezed
        if dims:
            return lses.squeeze(dims[0])  # a mismatch _validate reports with both shapes
    raise ValueError(
        "expected lses [N, B, H] (optionally with a 1-sized extra dim), got shape "
        f"{tuple(lses.shape)}"
    )


def _validate(out: torch.Tensor, lses: torch.Tensor, cp_rank: int) -> None:
    if out.dtype not in OUT_DTYPES:
        check_out_dtype("out", out)
    if lses.dtype not in LSE_DTYPES:
        check_lse_dtype("lses", lses)
    n, b, h = lses.shape
    out_shape = out.shape
    if out_shape[0] != b or out_shape[1] != h:
        raise ValueError(
            f"out {tuple(out.shape)} and lses {tuple(lses.shape)} disagree: expected out "
            f"[B={b}, H={h}, D]"
        )
    if out_shape[2] == 0:
        raise ValueError(f"out {tuple(out.shape)} has head_dim 0; D must be >= 1")
    check_no_neg_bit("correct_attn_out", out=out, lses=lses)
    check_no_overlap("correct_attn_out", "out", out=out, lses=lses)
    if shares_elements(out):
        raise ValueError(
            f"out (shape {tuple(out.shape)}, strides {out.stride()}) has elements that share "
            "memory (e.g. an expand): an in-place correction would write them together; "
            "pass out.clone()"
        )
    if out.device != lses.device:
        raise ValueError(f"out is on device {out.device} but lses is on device {lses.device}")
    if type(cp_rank) is not int:
        raise TypeError(f"cp_rank must be an int, got {type(cp_rank).__name__}")
    if not 0 <= cp_rank < n:
        raise ValueError(f"cp_rank {cp_rank} is out of range for {n} gathered LSEs")


def _valid_fast(out: torch.Tensor, lses: torch.Tensor, cp_rank: int) -> bool:
    """Cheap proof that ``_validate`` accepts ``out [B, H, D]`` / ``lses [N, B, H]`` unsqueezed
    (False: not proven; the caller runs ``_validate``, which raises)."""
    if out.__class__ is not _Tensor or lses.__class__ is not _Tensor or type(cp_rank) is not int:
        return False
    o = out.shape
    s = lses.shape
    return (
        len(o) == 3
        and len(s) == 3
        and s[1] == o[0]
        and s[2] == o[1]
        and o[2] > 0
        and 0 not in out.stride()  # possibly shared elements: _validate decides
        and 0 <= cp_rank < s[0]
        and out.dtype in OUT_DTYPES
        and lses.dtype in LSE_DTYPES
        and out.device == lses.device
        and not out.is_neg()
        and not lses.is_neg()
        and not overlaps(out, lses)
    )


def _align(vec: int, *strides: int) -> int:
    """Largest power of two <= ``vec`` dividing every nonzero stride (elements)."""
    a = vec
    for s in strides:
        if s:
            a = min(a, abs(s) & -abs(s))
    return a


@functools.lru_cache(maxsize=4096)
def _general_plan(
    n: int,
    b: int,
    h: int,
    d: int,
    size: int,
    src_strides: tuple[int, ...],
    dst_strides: tuple[int, int, int, int],
    heads_per_group: int,
    is_base_e: bool,
    has_lse_out: bool,
) -> tuple[tuple[int, int], Specialization]:
    """Grid and specialization of the general kernel (memoised per call shape) over the
    ``[B, H]`` rows: about 16 KiB of partial output per program, at least ``MIN_PROGRAMS``
    programs where the batch allows it, heads first within a program."""
    block_r, block_d, num_warps = tile_config(b * h, d, size)
    block_h = min(next_pow2(h), block_r)
    block_b = max(1, block_r // block_h)
    grid = (-(-b // block_b), -(-h // block_h))
    vec = 16 // size
    grouped = heads_per_group != h
    dst_align = (
        _align(vec, *dst_strides[:3]) if grouped else _align(vec, dst_strides[0], dst_strides[2])
    )
    spec = specialize(
        _general_kernel,
        HEAD_DIM=d,
        HEADS_PER_GROUP=heads_per_group if grouped else 0,
        N_POW2=next_pow2(n),
        BLOCK_B=block_b,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        SRC_ALIGN=_align(vec, src_strides[0], src_strides[1]),
        DST_ALIGN=dst_align,
        IS_BASE_E=is_base_e,
        HAS_LSE_OUT=has_lse_out,
        num_warps=num_warps,
    )
    return grid, spec


@functools.lru_cache(maxsize=4096)
def _contig_plan(
    b: int, h: int, d: int, n: int, size: int, is_base_e: bool
) -> tuple[tuple[int], Specialization]:
    """Grid and specialization of the lean kernel (memoised per shape): ``BLOCK_R`` rows of
    about 16 KiB per program, at least ``MIN_PROGRAMS`` programs where the batch allows it."""
    block_r, block_d, num_warps = tile_config(b * h, d, size, _CONTIG_TARGET_BYTES)
    num_warps = min(num_warps, _ROWS_MAX_WARPS if n <= _LSE_ROWS_MAX_N else _TILE_MAX_WARPS)
    spec = specialize(
        _contig_kernel,
        HEAD_DIM=d,
        N=n,
        N_POW2=next_pow2(n),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        ALIGN=_align(16 // size, d),
        IS_BASE_E=is_base_e,
        LSE_ROWS=n <= _LSE_ROWS_MAX_N,
        num_warps=num_warps,
    )
    return (-(-(b * h) // block_r),), spec


def launch_correct(
    src: torch.Tensor,
    dst: torch.Tensor,
    dst_strides: tuple[int, int, int, int],
    heads_per_group: int,
    lses: torch.Tensor,
    lse_out: torch.Tensor | None,
    lse_h0: int,
    cp_rank: int,
    is_lse_base_on_e: bool,
) -> None:
    """Launch the general correction kernel (arguments already validated).

    Args:
        src: ``[B, H, D]`` partial output (row strides any, head dim unit-stride).
        dst: destination storage (may be ``src`` itself).
        dst_strides: ``(b, group, head-in-group, d)`` element strides of ``dst``, which is
            addressed as ``[B, H / heads_per_group, heads_per_group, D]``; ``d`` must be 1.
        heads_per_group: head-group size of ``dst`` (``H`` for a plain ``[B, H, D]``).
        lses: ``[N, B, H]`` gathered LSEs (any strides).
        lse_out: contiguous ``[B, hn]`` global-LSE output for heads ``[lse_h0, lse_h0 + hn)``
            or ``None``.
        lse_h0: first head stored in ``lse_out``.
        cp_rank: which of the N LSEs belongs to ``src``.
        is_lse_base_on_e: LSE base e (True) or 2 (False).
    """
    if (index := foreign_cuda_device(src)) >= 0:
        with torch.cuda.device(index):
            return launch_correct(src, dst, dst_strides, heads_per_group, lses, lse_out,
                                  lse_h0, cp_rank, is_lse_base_on_e)  # fmt: skip
    n, b, h = lses.shape
    d = src.shape[2]
    if b * h == 0 or d == 0:
        return
    s_src = src.stride()
    if s_src[2] != 1 or dst_strides[3] != 1:
        # Rare layout: work on a unit-stride copy (in place: write the result back).
        tmp = src.contiguous() if s_src[2] != 1 else src
        if dst_strides[3] != 1 or dst.data_ptr() == src.data_ptr():
            out = new_output(tmp, (b, h, d))
            launch_correct(tmp, out, (h * d, 0, d, 1), h, lses, lse_out, lse_h0, cp_rank,
                           is_lse_base_on_e)  # fmt: skip
            full = dst.as_strided(
                (b, h // heads_per_group, heads_per_group, d), dst_strides, dst.storage_offset()
            )
            full.copy_(out.view(b, h // heads_per_group, heads_per_group, d))
            return
        src = tmp
        s_src = src.stride()
    s_l = lses.stride()
    grid, spec = _general_plan(
        n,
        b,
        h,
        d,
        src.element_size(),
        s_src,
        dst_strides,
        heads_per_group,
        is_lse_base_on_e,
        lse_out is not None,
    )
    # Runtime arguments positionally, in the kernel's signature order.
    spec(
        grid,
        src,
        s_src[0],
        s_src[1],
        dst,
        dst_strides[0],
        dst_strides[1],
        dst_strides[2],
        lses,
        s_l[0],
        s_l[1],
        s_l[2],
        lse_out if lse_out is not None else lses,
        b,
        h,
        lse_h0,
        lse_out.shape[1] if lse_out is not None else 0,
        cp_rank,
        n,
    )


def correct_attn_out_fwd(
    out: torch.Tensor, lses: torch.Tensor, cp_rank: int, is_lse_base_on_e: bool
) -> torch.Tensor:
    """Rescale ``out [B, H, D]`` in place; return the global LSE ``[B, H]`` (lses' dtype)."""
    if (index := foreign_cuda_device(out)) >= 0:
        with torch.cuda.device(index):
            return correct_attn_out_fwd(out, lses, cp_rank, is_lse_base_on_e)
    n, b, h = lses.shape
    lse = new_output(lses, (b, h))
    d = out.shape[2]
    if b * h == 0 or d == 0:
        return lse
    if out.is_contiguous() and lses.is_contiguous():
        grid, spec = _contig_plan(b, h, d, n, out.element_size(), is_lse_base_on_e)
        spec(grid, out, lses, lse, b * h, cp_rank)
    else:
        s = out.stride()
        launch_correct(out, out, (s[0], 0, s[1], s[2]), h, lses, lse, 0, cp_rank, is_lse_base_on_e)
    return lse


@torch.library.custom_op("cpattn_dcp::correct_attn_out", mutates_args=("out",))
def _correct_attn_out_op(
    out: torch.Tensor, lses: torch.Tensor, cp_rank: int, is_lse_base_on_e: bool
) -> torch.Tensor:
    return correct_attn_out_fwd(out, lses, cp_rank, is_lse_base_on_e)


@_correct_attn_out_op.register_fake
def _(out: torch.Tensor, lses: torch.Tensor, cp_rank: int, is_lse_base_on_e: bool) -> torch.Tensor:
    return lses.new_empty((lses.shape[1], lses.shape[2]))


def correct_attn_out(
    out: torch.Tensor,
    lses: torch.Tensor,
    cp_rank: int,
    ctx: CPTritonContext | None = None,
    is_lse_base_on_e: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale this rank's partial output by its softmax weight; return the global LSE.

    For every row b and head h: ``L = log_b(sum_n b^lses[n, b, h])`` and
    ``out[b, h, :] = w == 0 ? 0 : w * out[b, h, :]`` with ``w = b^(lses[cp_rank, b, h] - L)``.
    NaN and +inf LSEs count as -inf; a row whose LSEs are all -inf gets output 0 and
    ``L = -inf``; weight 0 writes exactly 0 even where the partial holds NaN. Math in fp32.

    Args:
        out: ``[B, H, D]`` or ``[B, 1, H, D]`` partial output of this rank (fp16/bf16/fp32,
            any strides without elements that share memory, any ``D >= 1``); modified in
            place.
        lses: ``[N, B, H]`` all-gathered LSEs (also ``[N, B, H, 1]`` or ``[N, 1, B, H]``),
            fp32/fp16/bf16, any strides, any N.
        cp_rank: index of this rank's LSE in ``lses``.
        ctx: accepted for compatibility (``CPTritonContext``); unused.
        is_lse_base_on_e: LSEs are natural logs (True) or base-2 logs (False).

    Returns:
        ``(out, lse)``: ``out`` as the ``[B, H, D]`` view that was scaled in place and the
        global ``lse [B, H]`` (contiguous, ``lses.dtype``).

    Raises:
        ValueError: shapes that disagree, ``D == 0``, an ``out`` whose elements share memory
            (an expanded view) or that overlaps ``lses`` in memory, tensors on different devices, ``cp_rank`` out of range, a
            floating dtype other than fp16/bf16/fp32, an argument with torch's negative bit
            (a lazily negated view, ``cpattn_common.checks.check_no_neg_bit``).
        TypeError: non-tensor or non-floating arguments, a ``cp_rank`` that is not an int, an
            ``is_lse_base_on_e`` that is not a bool.

    Inference only (no autograd formula): see ``cpattn_common.dispatch``. With grad on, an
    ``out`` that requires grad raises ``RuntimeError`` (its gradient would ignore the scaling).

    Example:
        >>> # lses [2, B, H]: rank 0's and rank 1's LSEs
        >>> lses = torch.stack([lse_rank0, lse_rank1])  # doctest: +SKIP
        >>> out, lse = correct_attn_out(out_rank1, lses, cp_rank=1)  # doctest: +SKIP
    """
    del ctx
    is_lse_base_on_e = check_bool("is_lse_base_on_e", is_lse_base_on_e)
    if must_dispatch(out, lses):  # tracing, a dispatch mode, autograd
        out3 = _squeeze_out(out)
        lses3 = _squeeze_lses(lses, tuple(out3.shape[:2]))
        _validate(out3, lses3, cp_rank)
        refuse_grad_in_place("correct_attn_out", "out", out3)
        lse: torch.Tensor = torch.ops.cpattn_dcp.correct_attn_out(
            out3, lses3, cp_rank, bool(is_lse_base_on_e)
        )
        return out3, lse
    # Eager: skip the dispatcher, and validate in full only what the cheap check cannot
    # prove. ``out`` is marked written, as the dispatcher would.
    if not _valid_fast(out, lses, cp_rank):
        out = _squeeze_out(out)
        lses = _squeeze_lses(lses, tuple(out.shape[:2]))
        _validate(out, lses, cp_rank)
    lse = correct_attn_out_fwd(out, lses, cp_rank, bool(is_lse_base_on_e))
    mark_written_in_place(out)
    return out, lse
