"""``correct_attn_out``: in-place LSE rescale of this rank's partial output.

``out[b, h, :] *= b^(lses[r, b, h] - L[b, h])`` with the global ``L = log_b sum_n b^lses[n]``
(sanitised: NaN/+inf count as -inf; weight 0 writes exactly 0). One kernel launch.
"""

from __future__ import annotations

import torch

from cpattn_common.alloc import empty_output
from cpattn_common.launch import launch_cached
from cpattn_dcp.context import CPTritonContext
from cpattn_dcp.kernels.correct_attn_out import _correct_attn_out_fwd_kernel
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
        raise ValueError(f"out is on {out.device} but lses is on {lses.device}")
    if type(cp_rank) is not int:
        raise TypeError(f"cp_rank must be an int, got {type(cp_rank).__name__}")
    if not 0 <= cp_rank < n:
        raise ValueError(f"cp_rank {cp_rank} is out of range for {n} gathered LSEs")


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
    """Launch the correction kernel (arguments already validated).

    Args:
        src: ``[B, H, D]`` partial output (any strides).
        dst: destination storage (may be ``src`` itself).
        dst_strides: ``(b, group, head-in-group, d)`` element strides of ``dst``, which is
            addressed as ``[B, H / heads_per_group, heads_per_group, D]``.
        heads_per_group: head-group size of ``dst`` (``H`` for a plain ``[B, H, D]``).
        lses: ``[N, B, H]`` gathered LSEs (any strides).
        lse_out: ``[B, hn]`` global-LSE output for heads ``[lse_h0, lse_h0 + hn)`` or ``None``.
        lse_h0: first head stored in ``lse_out``.
        cp_rank: which of the N LSEs belongs to ``src``.
        is_lse_base_on_e: LSE base e (True) or 2 (False).
    """
    n, b, h = lses.shape
    d = src.shape[2]
    num_rows = b * h
    if num_rows == 0 or d == 0:
        return
    block_r, block_d, num_warps = tile_config(num_rows, d, src.element_size())
    s_src = src.stride()
    s_lses = lses.stride()
    s_lo: tuple[int, ...]
    if lse_out is None:
        lse_ptr, s_lo, lse_hn = lses, (0, 0), 0
    else:
        lse_ptr, s_lo, lse_hn = lse_out, lse_out.stride(), lse_out.shape[1]
    launch_cached(
        _correct_attn_out_fwd_kernel,
        (-(-num_rows // block_r),),
        src_ptr=src,
        stride_src_b=s_src[0],
        stride_src_h=s_src[1],
        stride_src_d=s_src[2],
        dst_ptr=dst,
        stride_dst_b=dst_strides[0],
        stride_dst_g=dst_strides[1],
        stride_dst_h=dst_strides[2],
        stride_dst_d=dst_strides[3],
        lses_ptr=lses,
        stride_lses_n=s_lses[0],
        stride_lses_b=s_lses[1],
        stride_lses_h=s_lses[2],
        lse_out_ptr=lse_ptr,
        stride_lse_out_b=s_lo[0],
        stride_lse_out_h=s_lo[1],
        num_rows=num_rows,
        num_heads=h,
        heads_per_group=heads_per_group,
        lse_h0=lse_h0,
        lse_hn=lse_hn,
        cp_rank=cp_rank,
        cp_world_size=n,
        HEAD_DIM=d,
        N_POW2=next_pow2(n),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        IS_BASE_E=is_lse_base_on_e,
        HAS_LSE_OUT=lse_out is not None,
        num_warps=num_warps,
    )


def correct_attn_out_fwd(
    out: torch.Tensor, lses: torch.Tensor, cp_rank: int, is_lse_base_on_e: bool
) -> torch.Tensor:
    """Rescale ``out [B, H, D]`` in place; return the global LSE ``[B, H]`` (lses' dtype)."""
    _, b, h = lses.shape
    lse = empty_output((b, h), dtype=lses.dtype, device=lses.device)
    s = out.stride()
    strides = (s[0], 0, s[1], s[2])
    launch_correct(out, out, strides, h, lses, lse, 0, cp_rank, is_lse_base_on_e)
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
