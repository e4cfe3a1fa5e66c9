"""``merge_attn_states``: exact N-way merge of partial attention states (validation, launcher, op).

Chain: ``_merge_attn_states_fwd_kernel`` (kernels/) -> ``merge_attn_states_fwd`` (typed
launcher) -> ``cpattn_common::merge_attn_states`` (``torch.library`` op with a fake impl) ->
``merge_attn_states`` (public functional). ``cpattn_common.lse.merge_attn_states_torch`` is the
pure-torch twin, used where Triton cannot run (CPU without ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from cpattn_common.alloc import empty_output
from cpattn_common.kernels.merge_attn_states import _merge_attn_states_fwd_kernel
from cpattn_common.launch import launch_cached

__all__ = [
    "merge_attn_states",
    "merge_attn_states_block_sizes",
    "merge_attn_states_fwd",
    "triton_usable",
]

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements of one (heads x D) tile: enough bytes in flight per program that D=128 is not
# tiny-program-bound, small enough to keep the fp32 accumulator in registers.
_TILE_ELEMS = 4096


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can run for tensors on ``device`` (CUDA, or the interpreter)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=256)
def merge_attn_states_block_sizes(num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """Autotune-free tile choice: ``(BLOCK_H, BLOCK_D, num_warps)``.

    ``BLOCK_D`` is the next power of two >= ``head_dim`` (masked); ``BLOCK_H`` heads share one
    program so a tile holds about 4096 elements; 8 warps for 4096-element tiles, else 4.
    """
    block_d = triton.next_power_of_2(max(head_dim, 1))
    block_h = max(1, min(triton.next_power_of_2(max(num_heads, 1)), _TILE_ELEMS // block_d))
    tile = block_h * block_d
    num_warps = 8 if tile >= 4096 else (4 if tile >= 1024 else 2)
    return block_h, block_d, num_warps


def _validate(partial_outs: torch.Tensor, partial_lses: torch.Tensor) -> None:
    if not isinstance(partial_outs, torch.Tensor) or not isinstance(partial_lses, torch.Tensor):
        raise TypeError("partial_outs and partial_lses must be torch.Tensor")
    if partial_outs.dim() != 4:
        raise ValueError(
            f"partial_outs must be [N, B, H, D], got shape {tuple(partial_outs.shape)}"
        )
    if partial_lses.dim() != 3:
        raise ValueError(f"partial_lses must be [N, B, H], got shape {tuple(partial_lses.shape)}")
    if tuple(partial_outs.shape[:3]) != tuple(partial_lses.shape):
        raise ValueError(
            f"partial_outs {tuple(partial_outs.shape)} and partial_lses "
            f"{tuple(partial_lses.shape)} disagree on [N, B, H]"
        )
    if partial_outs.shape[0] < 1:
        raise ValueError("merge_attn_states needs N >= 1 partial states, got N = 0")
    if partial_outs.dtype not in OUT_DTYPES:
        raise TypeError(f"partial_outs dtype {partial_outs.dtype} not in {OUT_DTYPES}")
    if partial_lses.dtype not in LSE_DTYPES:
        raise TypeError(f"partial_lses dtype {partial_lses.dtype} not in {LSE_DTYPES}")
    if partial_outs.device != partial_lses.device:
        raise ValueError(
            f"partial_outs on {partial_outs.device} but partial_lses on {partial_lses.device}"
        )


def merge_attn_states_fwd(
    partial_outs: torch.Tensor,
    partial_lses: torch.Tensor,
    *,
    is_lse_base_on_e: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed launcher of the Triton merge kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``).

    Args:
        partial_outs: ``[N, B, H, D]`` fp16/bf16/fp32, any strides.
        partial_lses: ``[N, B, H]`` fp32/fp16/bf16, any strides.
        is_lse_base_on_e: LSE base e (True) or 2 (False).

    Returns:
        ``(out [B, H, D]`` in ``partial_outs.dtype``, ``lse [B, H]`` fp32), both contiguous.
    """
    _validate(partial_outs, partial_lses)
    n, b, h, d = partial_outs.shape
    device = partial_outs.device
    out = empty_output((b, h, d), dtype=partial_outs.dtype, device=device)
    out_lse = empty_output((b, h), dtype=torch.float32, device=device)
    if b == 0 or h == 0:
        return out, out_lse
    block_h, block_d, num_warps = merge_attn_states_block_sizes(h, d)
    grid = (b, triton.cdiv(h, block_h))
    po, pl = partial_outs, partial_lses
    launch_cached(
        _merge_attn_states_fwd_kernel,
        grid,
        out_ptr=out,
        out_lse_ptr=out_lse,
        partial_out_ptr=po,
        partial_lse_ptr=pl,
        H=h,
        stride_po_n=po.stride(0),
        stride_po_b=po.stride(1),
        stride_po_h=po.stride(2),
        stride_po_d=po.stride(3),
        stride_pl_n=pl.stride(0),
        stride_pl_b=pl.stride(1),
        stride_pl_h=pl.stride(2),
        stride_o_b=out.stride(0),
        stride_o_h=out.stride(1),
        stride_o_d=out.stride(2),
        stride_ol_b=out_lse.stride(0),
        stride_ol_h=out_lse.stride(1),
        N=n,
        D=d,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        IS_BASE_E=bool(is_lse_base_on_e),
        num_warps=num_warps,
    )
    return out, out_lse


def _merge_any_backend(
    partial_outs: torch.Tensor, partial_lses: torch.Tensor, is_lse_base_on_e: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(partial_outs, partial_lses)
    if triton_usable(partial_outs.device):
        return merge_attn_states_fwd(partial_outs, partial_lses, is_lse_base_on_e=is_lse_base_on_e)
    from cpattn_common.lse import merge_attn_states_torch  # lse re-exports this module

    out, lse = merge_attn_states_torch(
        partial_outs, partial_lses, is_lse_base_on_e=is_lse_base_on_e
    )
    return out, lse.to(torch.float32)


@torch.library.custom_op("cpattn_common::merge_attn_states", mutates_args=())
def _merge_attn_states_op(
    partial_outs: torch.Tensor, partial_lses: torch.Tensor, is_lse_base_on_e: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _merge_any_backend(partial_outs, partial_lses, is_lse_base_on_e)


@_merge_attn_states_op.register_fake
def _merge_attn_states_fake(
    partial_outs: torch.Tensor, partial_lses: torch.Tensor, is_lse_base_on_e: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(partial_outs, partial_lses)
    _, b, h, d = partial_outs.shape
    out = partial_outs.new_empty((b, h, d))
    lse = partial_lses.new_empty((b, h), dtype=torch.float32)
    return out, lse


def merge_attn_states(
    partial_outs: torch.Tensor,
    partial_lses: torch.Tensor,
    *,
    is_lse_base_on_e: bool = True,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact N-way merge of partial attention states by their log-sum-exps.

    ``O = sum_n w_n o_n`` with ``w_n = b^(l_n - L)``, ``L = log_b sum_n b^(l_n)``; NaN / +inf
    LSEs count as -inf, a source of weight 0 contributes exactly 0 (even a NaN partial), and a
    row whose LSEs are all -inf gets output 0 and LSE -inf. Math in fp32.

    Args:
        partial_outs: ``[N, B, H, D]`` partial outputs, fp16/bf16/fp32, any strides, N >= 1.
        partial_lses: ``[N, B, H]`` LSEs of the partials, fp32/fp16/bf16, any strides.
        is_lse_base_on_e: True for natural-log LSEs, False for base-2 LSEs.
        return_lse: also return the merged LSE.

    Returns:
        ``out [B, H, D]`` in ``partial_outs.dtype``; with ``return_lse`` also
        ``lse [B, H]`` fp32 (same base as the input).

    Example:
        >>> outs = torch.randn(4, 2, 8, 64)          # N=4 shards, B=2 rows, H=8, D=64
        >>> lses = torch.randn(4, 2, 8)
        >>> out, lse = merge_attn_states(outs, lses, return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([2, 8, 64]), torch.Size([2, 8]))
    """
    if torch.compiler.is_compiling():
        out, lse = torch.ops.cpattn_common.merge_attn_states(
            partial_outs, partial_lses, bool(is_lse_base_on_e)
        )
    else:  # eager: skip the dispatcher (both paths are tested)
        out, lse = _merge_any_backend(partial_outs, partial_lses, bool(is_lse_base_on_e))
    return (out, lse) if return_lse else out
