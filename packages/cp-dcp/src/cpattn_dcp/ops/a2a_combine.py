"""Packed all-to-all combine: pack (fused empty-shard mask), one ``all_to_all_single``,
unpack-and-combine.

Send and receive buffers ``[N, B, H/N, D + P]`` (output dtype; ``P = 2`` lanes carry the fp32
LSE bits for fp16/bf16, ``P = 1`` for fp32) are allocated per call, so a captured CUDA graph
keeps valid addresses (a shared growable workspace would be freed under it). Exactly two
kernel launches and one collective per call; no host sync.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, overload

import torch

from cpattn_common.alloc import empty_output
from cpattn_common.group import CPGroupLike
from cpattn_common.launch import launch_cached
from cpattn_dcp.comm.collectives import all_to_all_records
from cpattn_dcp.comm.groups import (
    group_from_token,
    group_rank,
    group_token,
    group_world_size,
    resolve_group,
)
from cpattn_dcp.context import CPTritonContext
from cpattn_dcp.kernels.a2a import (
    _a2a_pack_flat_kernel,
    _a2a_pack_fwd_kernel,
    _a2a_unpack_combine_fwd_kernel,
)
from cpattn_dcp.ops._collective_common import validate_combine_args
from cpattn_dcp.ops._common import MIN_PROGRAMS as _MIN_PROGRAMS
from cpattn_dcp.ops._common import next_pow2, search_steps, tile_config

__all__ = ["a2a_pack", "a2a_pack_dim", "a2a_unpack_combine", "dcp_a2a_lse_reduce"]

_PACK_DIM = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 1}
# The unpack kernel keeps N payload tiles in flight (unrolled over N): the tile per source
# shrinks with N so that about 32 KiB of loads are in flight per program.
_UNPACK_INFLIGHT_BYTES = 32768
_UNPACK_MIN_BYTES = 2048
# Bytes one pack program writes: 16 KiB.
_PACK_TILE_BYTES = 16384


def a2a_pack_dim(dtype: torch.dtype) -> int:
    """Lanes of ``dtype`` that carry one fp32 LSE: 2 for fp16/bf16, 1 for fp32.

    Raises:
        ValueError: any other dtype ("Cannot pack fp32 LSE into output dtype ...").
    """
    try:
        return _PACK_DIM[dtype]
    except KeyError:
        raise ValueError(f"Cannot pack fp32 LSE into output dtype {dtype}.") from None


@functools.lru_cache(maxsize=1024)
def _pack_flat_config(
    b: int, n: int, row: int, size: int
) -> tuple[tuple[int, int, int], int, int, int]:
    """``(grid, BLOCK_B, BLOCK_W, num_warps)`` of the flat pack kernel.

    ``BLOCK_W``: the largest power of two (<= 8 KiB of lanes) whose column tiles pad the
    ``row``-lane (n, b) block by at most 1/8; ``BLOCK_B``: rows so that a program writes
    about 16 KiB, shrunk while the grid has fewer than ``_MIN_PROGRAMS`` programs.
    """
    block_w = 8192 // size
    while block_w * size > 256 and (-(-row // block_w) * block_w - row) * 8 > row:
        block_w //= 2
    block_w = min(block_w, next_pow2(row))
    block_b = min(max(1, _PACK_TILE_BYTES // (block_w * size)), next_pow2(b))
    n_w = -(-row // block_w)
    while block_b > 1 and -(-b // block_b) * n * n_w < _MIN_PROGRAMS:
        block_b //= 2
    # Two 16-byte vectors per thread.
    num_warps = min(8, max(1, block_b * block_w * size // 1024))
    return (-(-b // block_b), n, n_w), block_b, block_w, num_warps


@functools.lru_cache(maxsize=1024)
def _pack_flat_launch(
    b: int,
    n: int,
    hr: int,
    d: int,
    p: int,
    size: int,
    num_seqs: int,
    has_mask: bool,
    lse_halves: bool,
) -> tuple[tuple[int, int, int], dict[str, int | bool]]:
    """Grid and constexpr/launch keywords of the flat pack kernel (memoised per shape)."""
    row = hr * (d + p)
    grid, block_b, block_w, num_warps = _pack_flat_config(b, n, row, size)
    consts: dict[str, int | bool] = {
        "HEADS_PER_RANK": hr,
        "HEAD_DIM": d,
        "PACK": p,
        "ROW_ALIGN": min(16 // size, row & -row),
        "LSE_HALVES": lse_halves,
        "HAS_MASK": has_mask,
        "SEARCH_STEPS": search_steps(num_seqs),
        "BLOCK_B": block_b,
        "BLOCK_W": block_w,
        "num_warps": num_warps,
    }
    return grid, consts


def _launch_pack(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    send: torch.Tensor,
    n: int,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> None:
    b, h, d = cp_attn_out.shape
    if b == 0 or h == 0:
        return
    num_seqs = seq_lens.shape[0] if seq_lens is not None else 0
    has_mask = seq_lens is not None
    sl = seq_lens.contiguous() if seq_lens is not None else cp_attn_lse
    qsl = query_start_loc.contiguous() if query_start_loc is not None else cp_attn_lse
    s_out = cp_attn_out.stride()
    s_lse = cp_attn_lse.stride()
    size = cp_attn_out.element_size()
    p = _PACK_DIM[cp_attn_out.dtype]
    hr = h // n
    if s_out[2] == 1 and (
        p == 1
        or (
            d % 2 == 0
            and s_out[0] % 2 == 0
            and s_out[1] % 2 == 0
            and cp_attn_out.data_ptr() % 4 == 0
        )
    ):
        # Fast path: 16-byte vector stores of whole (n, b) blocks of the send buffer.
        lse_halves = p == 2 and cp_attn_lse.dtype == torch.float32
        grid, consts = _pack_flat_launch(b, n, hr, d, p, size, num_seqs, has_mask, lse_halves)
        launch_cached(
            _a2a_pack_flat_kernel,
            grid,
            out_ptr=cp_attn_out,
            stride_out_b=s_out[0],
            stride_out_h=s_out[1],
            lse_ptr=cp_attn_lse,
            stride_lse_b=s_lse[0],
            stride_lse_h=s_lse[1],
            send_ptr=send,
            seq_lens_ptr=sl,
            qsl_ptr=qsl,
            num_seqs=num_seqs,
            num_tokens=b,
            **consts,
        )
        return
    num_rows = b * h
    block_r, block_d, num_warps = tile_config(num_rows, d, size)
    rec = d + _PACK_DIM[cp_attn_out.dtype]
    launch_cached(
        _a2a_pack_fwd_kernel,
        (-(-num_rows // block_r),),
        out_ptr=cp_attn_out,
        stride_out_b=s_out[0],
        stride_out_h=s_out[1],
        stride_out_d=s_out[2],
        lse_ptr=cp_attn_lse,
        stride_lse_b=s_lse[0],
        stride_lse_h=s_lse[1],
        send_ptr=send,
        seq_lens_ptr=sl,
        qsl_ptr=qsl,
        num_seqs=num_seqs,
        num_rows=num_rows,
        num_tokens=b,
        num_heads=h,
        heads_per_rank=hr,
        HEAD_DIM=d,
        PACK=_PACK_DIM[cp_attn_out.dtype],
        REC_ALIGN=min(16 // size, rec & -rec),
        HAS_MASK=has_mask,
        SEARCH_STEPS=search_steps(num_seqs),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )


@functools.lru_cache(maxsize=1024)
def _unpack_config(n: int, num_rows: int, d: int, size: int) -> tuple[int, int, int, int]:
    """``(grid0, BLOCK_R, BLOCK_D, num_warps)``: about 32 KiB of payload loads in flight."""
    target = max(_UNPACK_MIN_BYTES, _UNPACK_INFLIGHT_BYTES // n)
    block_r, block_d, num_warps = tile_config(num_rows, d, size, target)
    return -(-num_rows // block_r), block_r, block_d, num_warps


def _launch_unpack(
    recv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, is_lse_base_on_e: bool
) -> None:
    n, b, hr, rec = recv.shape
    d = out.shape[2]
    num_rows = b * hr
    if num_rows == 0:
        return
    size = recv.element_size()
    grid0, block_r, block_d, num_warps = _unpack_config(n, num_rows, d, size)
    launch_cached(
        _a2a_unpack_combine_fwd_kernel,
        (grid0,),
        recv_ptr=recv,
        dst_ptr=out,
        lse_out_ptr=lse if lse is not None else out,
        num_rows=num_rows,
        N=n,
        N_POW2=next_pow2(n),
        HEAD_DIM=d,
        PACK=rec - d,
        REC_ALIGN=min(16 // size, rec & -rec),
        LSE_WORD=rec - d == 2 and d % 2 == 0 and recv.data_ptr() % 4 == 0,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        IS_BASE_E=is_lse_base_on_e,
        HAS_LSE_OUT=lse is not None,
        num_warps=num_warps,
    )


def a2a_pack(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_world_size: int,
    *,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    send: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack this rank's partial output and LSE into the all-to-all send buffer (one launch).

    Args:
        cp_attn_out: ``[B, H, D]`` partial output (fp16/bf16/fp32, any strides).
        cp_attn_lse: ``[B, H]`` its LSE (fp32/fp16/bf16, any strides), stored as fp32 bits.
        cp_world_size: N; ``H % N == 0``.
        seq_lens: ``[R]`` local KV lengths, with ``query_start_loc`` ``[R + 1]``: the
            empty-shard mask is fused (bit-identical to ``mask_dcp_empty_shards_``).
        query_start_loc: see ``seq_lens``.
        send: optional preallocated contiguous ``[N, B, H/N, D + P]`` buffer to fill.

    Returns:
        ``send [N, B, H/N, D + P]`` in the output dtype: ``send[n, b, j, :D] =
        cp_attn_out[b, n*H/N + j]``, lanes ``D..D+P-1`` hold the (masked) LSE as fp32 bits
        (low half first for 16-bit dtypes).
    """
    has_mask = validate_combine_args(
        "a2a_pack",
        cp_attn_out,
        cp_attn_lse,
        cp_world_size,
        seq_lens,
        query_start_loc,
        heads_divisible=True,
    )
    b, h, d = cp_attn_out.shape
    shape = (cp_world_size, b, h // cp_world_size, d + a2a_pack_dim(cp_attn_out.dtype))
    if send is None:
        send = empty_output(shape, dtype=cp_attn_out.dtype, device=cp_attn_out.device)
    elif (
        tuple(send.shape) != shape
        or send.dtype != cp_attn_out.dtype
        or send.device != cp_attn_out.device
        or not send.is_contiguous()
    ):
        raise ValueError(
            f"send must be a contiguous {cp_attn_out.dtype} tensor of shape {shape} on "
            f"{cp_attn_out.device}, got {send.dtype} {tuple(send.shape)} on {send.device}"
        )
    _launch_pack(
        cp_attn_out,
        cp_attn_lse,
        send,
        cp_world_size,
        seq_lens if has_mask else None,
        query_start_loc if has_mask else None,
    )
    return send


def a2a_unpack_combine(
    recv: torch.Tensor, *, return_lse: bool = False, is_lse_base_on_e: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Combine the N received records per (row, head) (one launch).

    Args:
        recv: contiguous ``[N, B, H_r, D + P]`` receive buffer (records from every rank, in
            the format of :func:`a2a_pack`), fp16/bf16 (``P = 2``) or fp32 (``P = 1``).
        return_lse: also return the global LSE.
        is_lse_base_on_e: natural-log (True) or base-2 (False) LSEs.

    Returns:
        ``(out [B, H_r, D]`` in ``recv.dtype``, ``lse [B, H_r]`` fp32 or ``None)``.
    """
    if not isinstance(recv, torch.Tensor):
        raise TypeError(f"recv must be a torch.Tensor, got {type(recv).__name__}")
    p = a2a_pack_dim(recv.dtype)
    if recv.dim() != 4 or recv.shape[3] <= p:
        raise ValueError(f"expected recv [N, B, H_r, D + {p}], got shape {tuple(recv.shape)}")
    if not recv.is_contiguous():
        raise ValueError(f"recv must be contiguous, got strides {recv.stride()}")
    return _unpack_combine(recv, return_lse, is_lse_base_on_e)


def _unpack_combine(
    recv: torch.Tensor, return_lse: bool, is_lse_base_on_e: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _, b, hr, rec = recv.shape
    d = rec - _PACK_DIM[recv.dtype]
    out = empty_output((b, hr, d), dtype=recv.dtype, device=recv.device)
    lse = empty_output((b, hr), dtype=torch.float32, device=recv.device) if return_lse else None
    _launch_unpack(recv, out, lse, is_lse_base_on_e)
    return out, lse


def a2a_combine_fwd(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    group: CPGroupLike,
    *,
    return_lse: bool,
    is_lse_base_on_e: bool,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pack → all-to-all → unpack-combine (arguments already validated)."""
    n = group.world_size
    b, h, d = cp_attn_out.shape
    shape = (n, b, h // n, d + _PACK_DIM[cp_attn_out.dtype])
    if n == 1:
        send = recv = empty_output(shape, dtype=cp_attn_out.dtype, device=cp_attn_out.device)
    else:
        # One allocation for both staging buffers (fresh per call: CUDA-graph safe).
        staging = empty_output((2, *shape), dtype=cp_attn_out.dtype, device=cp_attn_out.device)
        send, recv = staging[0], staging[1]
    _launch_pack(cp_attn_out, cp_attn_lse, send, n, seq_lens, query_start_loc)
    if n > 1:
        all_to_all_records(group, recv, send)
    return _unpack_combine(recv, return_lse, is_lse_base_on_e)


@torch.library.custom_op("cpattn_dcp::dcp_a2a_lse_reduce", mutates_args=())
def _a2a_op(
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
    out, lse = a2a_combine_fwd(
        cp_attn_out,
        cp_attn_lse,
        group_from_token(group_tok),
        return_lse=return_lse,
        is_lse_base_on_e=is_lse_base_on_e,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )
    if lse is None:
        lse = cp_attn_out.new_empty((0,), dtype=torch.float32)
    return out, lse


@_a2a_op.register_fake
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
    b, h, d = cp_attn_out.shape
    hr = h // world_size
    out = cp_attn_out.new_empty((b, hr, d))
    lse = cp_attn_out.new_empty((b, hr) if return_lse else (0,), dtype=torch.float32)
    return out, lse


@overload
def dcp_a2a_lse_reduce(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_group: Any,
    ctx: CPTritonContext | None = None,
    return_lse: Literal[False] = False,
    is_lse_base_on_e: bool = True,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor: ...
@overload
def dcp_a2a_lse_reduce(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_group: Any,
    ctx: CPTritonContext | None = None,
    *,
    return_lse: Literal[True],
    is_lse_base_on_e: bool = True,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def dcp_a2a_lse_reduce(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_group: Any,
    ctx: CPTritonContext | None = None,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def dcp_a2a_lse_reduce(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_group: Any,
    ctx: CPTritonContext | None = None,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """DCP combine by one packed all-to-all: rank r ends with heads ``[r*H/N, (r+1)*H/N)``.

    Args:
        cp_attn_out: ``[B, H, D]`` this rank's partial output (fp16/bf16/fp32, any strides).
        cp_attn_lse: ``[B, H]`` its LSE (fp32/fp16/bf16, any strides).
        cp_group: a ``torch.distributed.ProcessGroup`` or a ``CPGroupLike``.
        ctx: accepted for compatibility; unused.
        return_lse: also return the global LSE of this rank's heads (fp32).
        is_lse_base_on_e: natural-log (True) or base-2 (False) LSEs.
        seq_lens: ``[R]`` local KV length per request (mask fused into the pack kernel).
        query_start_loc: ``[R + 1]`` query offsets per request.

    Returns:
        ``out [B, H/N, D]`` (output dtype) or ``(out, lse [B, H/N] fp32)``. World size 1
        runs the single-source combine (empty rows → 0 / -inf) without communication.

    Raises:
        ValueError: ``H % N != 0`` ("H=<H> must be divisible by DCP world size <N>."), an
            output dtype other than fp16/bf16/fp32, bad shapes, device mismatch.
        TypeError: non-floating tensors.

    Example:
        >>> out, lse = dcp_a2a_lse_reduce(partial_out, partial_lse, group, return_lse=True,
        ...                               seq_lens=local_lens, query_start_loc=qsl)
    """
    del ctx
    if torch.compiler.is_compiling():
        n = group_world_size(cp_group)
        validate_combine_args(
            "dcp_a2a_lse_reduce",
            cp_attn_out,
            cp_attn_lse,
            n,
            seq_lens,
            query_start_loc,
            heads_divisible=True,
        )
        out, lse_or_empty = torch.ops.cpattn_dcp.dcp_a2a_lse_reduce(
            cp_attn_out,
            cp_attn_lse,
            group_token(cp_group),
            n,
            group_rank(cp_group),
            bool(return_lse),
            bool(is_lse_base_on_e),
            seq_lens,
            query_start_loc,
        )
        return (out, lse_or_empty) if return_lse else out
    group = resolve_group(cp_group)
    has_mask = validate_combine_args(
        "dcp_a2a_lse_reduce",
        cp_attn_out,
        cp_attn_lse,
        group.world_size,
        seq_lens,
        query_start_loc,
        heads_divisible=True,
    )
    out, lse = a2a_combine_fwd(
        cp_attn_out,
        cp_attn_lse,
        group,
        return_lse=bool(return_lse),
        is_lse_base_on_e=bool(is_lse_base_on_e),
        seq_lens=seq_lens if has_mask else None,
        query_start_loc=query_start_loc if has_mask else None,
    )
    if return_lse:
        assert lse is not None
        return out, lse
    return out
