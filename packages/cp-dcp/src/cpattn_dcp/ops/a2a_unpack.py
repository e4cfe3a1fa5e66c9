"""Unpack-and-combine the all-to-all receive buffer: the N received partials per row (one
launch). Buffer format: ``a2a_pack``'s module docstring."""

from __future__ import annotations

import functools

import torch

from cpattn_common.alloc import new_output
from cpattn_common.checks import check_bool, check_no_neg_bit
from cpattn_common.device import foreign_cuda_device
from cpattn_common.dispatch import must_dispatch
from cpattn_common.launch import CachedKernel, Specialization
from cpattn_dcp.kernels.a2a import _a2a_unpack_combine_fwd_kernel
from cpattn_dcp.ops._common import MIN_PROGRAMS, next_pow2, specialize, tile_config
from cpattn_dcp.ops.a2a_pack import _buffer_shape, _lse_word, _pow2_divisor

__all__ = ["a2a_unpack_combine"]

# About 16 KiB of payload loads in flight per program (N tiles unrolled): beat 32 and 64 KiB
# on H200 at every N (docs/design.md, "Tile rules"); a per-source floor of 2 KiB.
_UNPACK_INFLIGHT_BYTES = 16384
_UNPACK_MIN_BYTES = 2048
# Decode grids (one row per program, < MIN_PROGRAMS programs) are latency-bound: about this
# many head-dim lanes per thread and source (0: off), at most this many warps.
_UNPACK_SMALL_GRID_LANES = 2
_UNPACK_SMALL_GRID_MAX_WARPS = 4
# From N=8 sources on grids of 4096+ programs: one 16-byte vector per thread and source
# (twice the tile rule's warps; 0: off); it lost at N < 8 and on decode grids.
_UNPACK_ONE_VECTOR_MIN_N = 8
_UNPACK_ONE_VECTOR_MIN_PROGRAMS = 4096
# Output stores write back: streaming stores (".cs") measured within the noise.
_UNPACK_OUT_CACHE = ""
# evict_first payload loads on those large grids with N >= 4 and D <= 256, where it gained;
# elsewhere it lost (docs/design.md, "Tile rules").
_UNPACK_PAY_EVICT = "evict_first"
_UNPACK_PAY_EVICT_MIN_N = 4
_UNPACK_PAY_EVICT_MAX_D = 256
_unpack_kernel = CachedKernel(_a2a_unpack_combine_fwd_kernel)


@functools.lru_cache(maxsize=1024)
def _unpack_config(n: int, num_rows: int, d: int, size: int) -> tuple[int, int, int, int]:
    """``(grid0, BLOCK_R, BLOCK_D, num_warps)`` by the rules of the constants above."""
    target = max(_UNPACK_MIN_BYTES, _UNPACK_INFLIGHT_BYTES // n)
    block_r, block_d, num_warps = tile_config(num_rows, d, size, target)
    grid0 = -(-num_rows // block_r)
    wide = (
        _UNPACK_ONE_VECTOR_MIN_N
        and _UNPACK_ONE_VECTOR_MIN_N <= n <= 8
        and grid0 >= _UNPACK_ONE_VECTOR_MIN_PROGRAMS
        # two or more 16-byte vectors per thread
        and block_r * block_d >= 2 * num_warps * 32 * (16 // size)
    )
    if wide and num_warps < 8:
        num_warps *= 2
    if _UNPACK_SMALL_GRID_LANES and block_r == 1 and grid0 < MIN_PROGRAMS:
        warps = next_pow2(-(-block_d // (32 * _UNPACK_SMALL_GRID_LANES)))
        num_warps = max(num_warps, min(_UNPACK_SMALL_GRID_MAX_WARPS, warps))
    return grid0, block_r, block_d, num_warps


@functools.lru_cache(maxsize=1024)
def _unpack_plan(
    n: int, num_rows: int, d: int, size: int, lse_word: bool, base_e: bool, has_lse: bool
) -> tuple[tuple[int], Specialization]:
    """Grid and kernel specialization (memoised per shape)."""
    grid0, block_r, block_d, num_warps = _unpack_config(n, num_rows, d, size)
    p = 4 // size
    evict = (
        _UNPACK_PAY_EVICT
        if grid0 >= _UNPACK_ONE_VECTOR_MIN_PROGRAMS
        and n >= _UNPACK_PAY_EVICT_MIN_N
        and d <= _UNPACK_PAY_EVICT_MAX_D
        else ""
    )
    spec = specialize(
        _unpack_kernel,
        N=n,
        N_POW2=next_pow2(n),
        HEAD_DIM=d,
        PACK=p,
        # Payload rows start at n * R * (D + P) + r * D lanes.
        PAY_ALIGN=_pow2_divisor(d, _pow2_divisor(num_rows * (d + p), 16 // size)),
        LSE_WORD=lse_word,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        IS_BASE_E=base_e,
        HAS_LSE_OUT=has_lse,
        OUT_CACHE=_UNPACK_OUT_CACHE,
        PAY_EVICT=evict,
        num_warps=num_warps,
    )
    return (grid0,), spec


def _launch_unpack(
    recv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, is_lse_base_on_e: bool
) -> None:
    if (index := foreign_cuda_device(recv)) >= 0:
        with torch.cuda.device(index):
            return _launch_unpack(recv, out, lse, is_lse_base_on_e)
    n, b, hr, _ = recv.shape
    num_rows = b * hr
    if num_rows == 0:
        return
    d = out.shape[2]
    word = _lse_word(recv, num_rows, d)
    grid, spec = _unpack_plan(
        n, num_rows, d, recv.element_size(), word, is_lse_base_on_e, lse is not None
    )
    spec(grid, recv, out, lse if lse is not None else out, num_rows)


def _unpack_combine(
    recv: torch.Tensor, d: int, return_lse: bool, is_lse_base_on_e: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Allocate the outputs and launch (validated arguments)."""
    _, b, hr, _ = recv.shape
    out = new_output(recv, (b, hr, d))
    lse = new_output(recv, (b, hr), torch.float32) if return_lse else None
    _launch_unpack(recv, out, lse, is_lse_base_on_e)
    return out, lse


@torch.library.custom_op("cpattn_dcp::a2a_unpack_combine", mutates_args=())
def _a2a_unpack_combine_op(
    recv: torch.Tensor, head_dim: int, return_lse: bool, is_lse_base_on_e: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _unpack_combine(recv, head_dim, return_lse, is_lse_base_on_e)
    if lse is None:
        lse = recv.new_empty((0,), dtype=torch.float32)
    return out, lse


@_a2a_unpack_combine_op.register_fake
def _(
    recv: torch.Tensor, head_dim: int, return_lse: bool, is_lse_base_on_e: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    _, b, hr, _ = recv.shape
    out = recv.new_empty((b, hr, head_dim))
    lse = recv.new_empty((b, hr) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def a2a_unpack_combine(
    recv: torch.Tensor,
    *,
    head_dim: int,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Combine the N received partials per (row, head) (one launch).

    Args:
        recv: contiguous ``[N, B, H_r, D + P]`` receive buffer (block n from rank n, in the
            format of :func:`a2a_pack`; see ``a2a_buffer_views``), fp16/bf16 or fp32.
        head_dim: D; ``recv.shape[3]`` must equal ``a2a_record_width(head_dim, recv.dtype)
            = D + P``.
        return_lse: also return the global LSE.
        is_lse_base_on_e: natural-log (True) or base-2 (False) LSEs.

    Returns:
        ``(out [B, H_r, D]`` in ``recv.dtype``, ``lse [B, H_r]`` fp32 or ``None)``.

    Raises:
        TypeError: ``recv`` is not a floating tensor, ``head_dim`` is not an int, a non-bool
            flag.
        ValueError: another float dtype, ``recv`` not 4-D, not contiguous, of last dim other
            than ``D + P``, or negated.

    Inference only (no autograd formula): see ``cpattn_common.dispatch``. Registered as
    ``torch.ops.cpattn_dcp.a2a_unpack_combine`` (its LSE is empty without ``return_lse``).
    """
    is_lse_base_on_e = check_bool("is_lse_base_on_e", is_lse_base_on_e)
    return_lse = check_bool("return_lse", return_lse)
    _buffer_shape(recv, head_dim)
    if must_dispatch(recv):  # tracing, a dispatch mode, autograd
        out: torch.Tensor
        lse_or_empty: torch.Tensor
        out, lse_or_empty = torch.ops.cpattn_dcp.a2a_unpack_combine(
            recv, head_dim, bool(return_lse), is_lse_base_on_e
        )
        return out, (lse_or_empty if return_lse else None)
    check_no_neg_bit("a2a_unpack_combine", recv=recv)
    return _unpack_combine(recv, head_dim, return_lse, is_lse_base_on_e)
