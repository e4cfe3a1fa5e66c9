"""``correct_attn_out``: in-place LSE rescale of this rank's partial output.

``out[b, h, :] *= b^(lses[r, b, h] - L[b, h])`` with the global ``L = log_b sum_n b^lses[n]``
(sanitised: NaN/+inf count as -inf; weight 0 writes exactly 0). One kernel launch.
"""

from __future__ import annotations

import functools

import torch

from cpattn_common.alloc import empty_output
from cpattn_common.launch import launch_cached
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
    tile_config,
)

__all__ = ["correct_attn_out", "correct_attn_out_fwd", "launch_correct"]


def _squeeze_out(out: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() == 3:
        return out
    if out.dim() == 4 and out.shape[1] == 1:
        return out.squeeze(1)
    raise ValueError(f"expected out [B, H, D] or [B, 1, H, D], got shape {tuple(out.shape)}")


def _squeeze_lses(lses: torch.Tensor) -> torch.Tensor:
    if not isinstance(lses, torch.Tensor):
        raise TypeError(f"lses must be a torch.Tensor, got {type(lses).__name__}")
    if lses.dim() == 3:
        return lses
    if lses.dim() == 4:
        if lses.shape[3] == 1:
            return lses.squeeze(3)
        if lses.shape[1] == 1:
            return lses.squeeze(1)
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
    if out.device != lses.device:
        raise ValueError(f"out is on device {out.device} but lses is on device {lses.device}")
    if type(cp_rank) is not int:
        raise TypeError(f"cp_rank must be an int, got {type(cp_rank).__name__}")
    if not 0 <= cp_rank < n:
        raise ValueError(f"cp_rank {cp_rank} is out of range for {n} gathered LSEs")


def _align(vec: int, *strides: int) -> int:
    """Largest power of two <= ``vec`` dividing every nonzero stride (elements)."""
    a = vec
    for s in strides:
        if s:
            a = min(a, abs(s) & -abs(s))
    return a


@functools.lru_cache(maxsize=4096)
def _correct_config(
    b: int, h: int, d: int, size: int
) -> tuple[tuple[int, int], int, int, int, int]:
    """``(grid, BLOCK_B, BLOCK_H, BLOCK_D, num_warps)`` over the ``[B, H]`` rows.

    About 16 KiB of partial output per program (e.g. 64 heads x 128 or 16 heads x 512 bf16),
    at least ``MIN_PROGRAMS`` programs where the batch allows it (decode: one or a few rows
    per program), heads first within a program.
    """
    block_r, block_d, num_warps = tile_config(b * h, d, size)
    block_h = min(next_pow2(h), block_r)
    block_b = max(1, block_r // block_h)
    return (-(-b // block_b), -(-h // block_h)), block_b, block_h, block_d, num_warps


@functools.lru_cache(maxsize=4096)
def _contig_launch_config(
    b: int, h: int, d: int, n: int, size: int, is_base_e: bool
) -> tuple[tuple[int], dict[str, int | bool]]:
    """Grid and constexpr/launch keywords of the lean kernel (memoised per shape).

    One program per ``BLOCK_R`` consecutive flattened (b, h) rows times the full head dim:
    about 16 KiB of partial output per program (64 heads x 128 or 16 heads x 512 bf16, 8
    warps), at least ``MIN_PROGRAMS`` programs where the batch allows it (decode: one row
    per program); consecutive programs read consecutive memory.
    """
    block_r, block_d, num_warps = tile_config(b * h, d, size)
    consts: dict[str, int | bool] = {
        "HEAD_DIM": d,
        "N": n,
        "N_POW2": next_pow2(n),
        "BLOCK_R": block_r,
        "BLOCK_D": block_d,
        "ALIGN": _align(16 // size, d),
        "IS_BASE_E": is_base_e,
        "num_warps": num_warps,
    }
    return (-(-(b * h) // block_r),), consts


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
    n, b, h = lses.shape
    d = src.shape[2]
    if b * h == 0 or d == 0:
        return
    s_src = src.stride()
    if s_src[2] != 1 or dst_strides[3] != 1:
        # Rare layout: work on a unit-stride copy (in place: write the result back).
        tmp = src.contiguous() if s_src[2] != 1 else src
        if dst_strides[3] != 1 or dst.data_ptr() == src.data_ptr():
            out = empty_output((b, h, d), dtype=tmp.dtype, device=tmp.device)
            launch_correct(tmp, out, (h * d, 0, d, 1), h, lses, lse_out, lse_h0, cp_rank,
                           is_lse_base_on_e)  # fmt: skip
            full = dst.as_strided(
                (b, h // heads_per_group, heads_per_group, d), dst_strides, dst.storage_offset()
            )
            full.copy_(out.view(b, h // heads_per_group, heads_per_group, d))
            return
        src = tmp
        s_src = src.stride()
    size = src.element_size()
    vec = 16 // size
    grid, block_b, block_h, block_d, num_warps = _correct_config(b, h, d, size)
    s_l = lses.stride()
    grouped = heads_per_group != h
    launch_cached(
        _correct_attn_out_fwd_kernel,
        grid,
        src_ptr=src,
        stride_src_b=s_src[0],
        stride_src_h=s_src[1],
        dst_ptr=dst,
        stride_dst_b=dst_strides[0],
        stride_dst_g=dst_strides[1],
        stride_dst_h=dst_strides[2],
        lses_ptr=lses,
        stride_lses_n=s_l[0],
        stride_lses_b=s_l[1],
        stride_lses_h=s_l[2],
        lse_out_ptr=lse_out if lse_out is not None else lses,
        num_tokens=b,
        num_heads=h,
        lse_h0=lse_h0,
        lse_hn=lse_out.shape[1] if lse_out is not None else 0,
        cp_rank=cp_rank,
        cp_world_size=n,
        HEAD_DIM=d,
        HEADS_PER_GROUP=heads_per_group if grouped else 0,
        N_POW2=next_pow2(n),
        BLOCK_B=block_b,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        SRC_ALIGN=_align(vec, s_src[0], s_src[1]),
        DST_ALIGN=_align(vec, *dst_strides[:3])
        if grouped
        else _align(vec, dst_strides[0], dst_strides[2]),
        IS_BASE_E=is_lse_base_on_e,
        HAS_LSE_OUT=lse_out is not None,
        num_warps=num_warps,
    )


def correct_attn_out_fwd(
    out: torch.Tensor, lses: torch.Tensor, cp_rank: int, is_lse_base_on_e: bool
) -> torch.Tensor:
    """Rescale ``out [B, H, D]`` in place; return the global LSE ``[B, H]`` (lses' dtype)."""
    n, b, h = lses.shape
    lse = empty_output((b, h), dtype=lses.dtype, device=lses.device)
    d = out.shape[2]
    if b * h == 0 or d == 0:
        return lse
    if out.is_contiguous() and lses.is_contiguous():
        grid, consts = _contig_launch_config(b, h, d, n, out.element_size(), is_lse_base_on_e)
        launch_cached(
            _correct_attn_out_contig_kernel,
            grid,
            out_ptr=out,
            lses_ptr=lses,
            lse_out_ptr=lse,
            num_rows=b * h,
            cp_rank=cp_rank,
            **consts,
        )
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
            any strides, any D); modified in place.
        lses: ``[N, B, H]`` all-gathered LSEs (also ``[N, B, H, 1]`` or ``[N, 1, B, H]``),
            fp32/fp16/bf16, any strides, any N.
        cp_rank: index of this rank's LSE in ``lses``.
        ctx: accepted for compatibility (``CPTritonContext``); unused.
        is_lse_base_on_e: LSEs are natural logs (True) or base-2 logs (False).

    Returns:
        ``(out, lse)``: ``out`` as the ``[B, H, D]`` view that was scaled in place and the
        global ``lse [B, H]`` (contiguous, ``lses.dtype``).

    Example:
        >>> lses = torch.stack([lse_rank0, lse_rank1])         # [2, B, H]
        >>> out, lse = correct_attn_out(out_rank1, lses, cp_rank=1)
    """
    del ctx
    out3 = _squeeze_out(out)
    lses3 = _squeeze_lses(lses)
    _validate(out3, lses3, cp_rank)
    if torch.compiler.is_compiling():
        lse: torch.Tensor = torch.ops.cpattn_dcp.correct_attn_out(
            out3, lses3, cp_rank, bool(is_lse_base_on_e)
        )
    else:
        lse = correct_attn_out_fwd(out3, lses3, cp_rank, bool(is_lse_base_on_e))
    return out3, lse
