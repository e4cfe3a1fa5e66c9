"""Packed all-to-all combine: pack (fused empty-shard mask), one ``all_to_all_single``,
unpack-and-combine.

Send and receive buffers ``[N, B, H/N, D_rec]`` (output dtype, ``D_rec =
a2a_record_width(D, dtype) = round_up(D + P, 16 / element size)``): each record is the ``D``
payload lanes, then ``P`` lanes carrying the fp32 LSE bits (``P = 2`` for fp16/bf16, ``P = 1``
for fp32), then zero padding to a multiple of 16 bytes, so that every record starts
16-byte aligned (the pack kernel writes whole records: see ``kernels/a2a.py``). The buffers
are allocated per call, so a captured CUDA graph keeps valid addresses (a shared growable
workspace would be freed under it). Exactly two kernel launches and one collective per call;
no host sync.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, overload

import torch

from cpattn_common.alloc import new_output
from cpattn_common.group import CPGroupLike
from cpattn_common.launch import CachedKernel, Specialization
from cpattn_dcp.comm.collectives import all_to_all_records
from cpattn_dcp.comm.groups import (
    group_from_token,
    group_rank,
    group_token,
    group_world_size,
    resolve_group,
)
from cpattn_dcp.context import CPTritonContext
from cpattn_dcp.kernels.a2a import _a2a_pack_kernel, _a2a_unpack_combine_fwd_kernel
from cpattn_dcp.ops._collective_common import validate_combine_args
from cpattn_dcp.ops._common import MIN_PROGRAMS, contiguous, next_pow2, search_steps, tile_config

__all__ = [
    "a2a_pack",
    "a2a_pack_dim",
    "a2a_record_width",
    "a2a_unpack_combine",
    "dcp_a2a_lse_reduce",
]

_PACK_DIM = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 1}
# The unpack kernel keeps N payload tiles in flight (unrolled over N): the tile per source
# shrinks with N so that about 16 KiB of loads are in flight per program (H200, bf16,
# B=4096, benchmarks/variants.py: 16 KiB beat 32 and 64 KiB at every N and both head shapes,
# e.g. H=64 D=128 N=8 0.80 / 0.72 / 0.75 of the copy bandwidth; 8 KiB was within the noise
# of 16 KiB, +-0.03 either way, results/h200-2026-11-29-s5/ab_unpack.txt).
_UNPACK_INFLIGHT_BYTES = 16384
_UNPACK_MIN_BYTES = 2048
# Cache modifier of the unpack's output stores: "" (write-back). Streaming stores (".cs")
# measured within the noise of it (+-0.03 of the copy bandwidth, same A/B).
_UNPACK_OUT_CACHE = ""
# Pack: 16-byte vectors of the send buffer one program writes, and its warps (H200, bf16,
# B=4096, fused mask: 256 vectors / 2 warps 0.84-0.86 of the copy bandwidth at H=64 D=128,
# 0.96 at H=128 D=512; 512 / 4 and 1024 / 8 were within 0.03 below; benchmarks/
# pack_variants.py).
_PACK_BLOCK_V = 256
_PACK_NUM_WARPS = 2
# Grids under MIN_PROGRAMS programs (decode sizes, latency-bound): smaller blocks of one warp,
# so that the few records spread over more programs.
_PACK_SMALL_BLOCK_V = 64
_PACK_SMALL_NUM_WARPS = 1
# Offsets at or past this bound switch the pack kernel to int64 index arithmetic.
_INT32_LIMIT = 2**31
# Bound once: a launch keys only its runtime arguments (see cpattn_common.launch).
_pack_kernel = CachedKernel(_a2a_pack_kernel)
_unpack_kernel = CachedKernel(_a2a_unpack_combine_fwd_kernel)


def a2a_pack_dim(dtype: torch.dtype) -> int:
    """Lanes of ``dtype`` that carry one fp32 LSE: 2 for fp16/bf16, 1 for fp32.

    Raises:
        ValueError: any other dtype ("Cannot pack fp32 LSE into output dtype ...").
    """
    try:
        return _PACK_DIM[dtype]
    except KeyError:
        raise ValueError(f"Cannot pack fp32 LSE into output dtype {dtype}.") from None


def a2a_record_width(head_dim: int, dtype: torch.dtype) -> int:
    """Lanes ``D_rec`` of one all-to-all record: ``round_up(D + P, 16 / element size)``.

    A record holds the ``D`` payload lanes, then ``P = a2a_pack_dim(dtype)`` lanes with the
    fp32 LSE bits, then zero padding up to a multiple of 16 bytes (written, never read), so that
    every record of a 16-byte-aligned buffer starts 16-byte aligned: multiples of 8 lanes for
    fp16/bf16 (D = 128 -> 136), of 4 lanes for fp32 (D = 128 -> 132).

    Raises:
        ValueError: ``head_dim < 1`` or a dtype other than fp16/bf16/fp32.
        TypeError: ``head_dim`` is not an int.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    p = a2a_pack_dim(dtype)
    vec = 16 // (4 // p)  # elements per 16 bytes: 8 for 16-bit dtypes, 4 for fp32
    return -(-(head_dim + p) // vec) * vec


@functools.lru_cache(maxsize=256)
def _pack_spec(consts: tuple[tuple[str, int | bool], ...]) -> Specialization:
    """The pack kernel specialized on ``consts`` (constexprs and ``num_warps``): one per
    configuration, shared by every batch size that maps to it."""
    return _pack_kernel.specialize(**dict(consts))


@functools.lru_cache(maxsize=1024)
def _pack_plan(
    b: int,
    h: int,
    n: int,
    d: int,
    size: int,
    num_seqs: int,
    has_mask: bool,
    s_out: tuple[int, int, int],
    s_lse: tuple[int, int],
) -> tuple[tuple[int, int], Specialization]:
    """Grid and kernel specialization of the pack kernel (memoised per shape and strides,
    so a repeated call costs one look-up)."""
    vec = 16 // size
    p = 4 // size
    hr = h // n
    rec = -(-(d + p) // vec) * vec
    rv = rec // vec
    total_v = b * hr * rv
    block_v, num_warps = _PACK_BLOCK_V, _PACK_NUM_WARPS
    if -(-total_v // block_v) * n < MIN_PROGRAMS:
        block_v, num_warps = _PACK_SMALL_BLOCK_V, _PACK_SMALL_NUM_WARPS
    # Tokens one program's vectors can touch: floor(cdiv(BLOCK_V, rv) / H_r) + 2.
    tok = next_pow2(-(-block_v // rv) // hr + 2)
    # Unit-stride head dim: the payload is read as row offset + lane, 16-byte vectors when
    # both row strides are multiples of 16 bytes (and the pointer is 16-byte aligned, which
    # Triton's launch specialisation sees by itself). Else the strided fallback.
    unit_d = s_out[2] == 1 or d == 1
    in_align = _pow2_divisor(s_out[1], _pow2_divisor(s_out[0], vec)) if unit_d else 1
    # int32 index arithmetic unless an offset the kernel may form could overflow it (masked
    # lanes past the last token and past D included).
    rows = b + block_v
    max_offset = max(
        n * total_v * vec + block_v * vec,
        rows * s_out[0] + h * s_out[1] + (d + 2 * vec) * s_out[2],
        rows * s_lse[0] + h * s_lse[1],
    )
    consts = (
        ("HEADS_PER_RANK", hr),
        ("HEAD_DIM", d),
        ("REC_WIDTH", rec),
        ("VEC", vec),
        ("PACK", p),
        ("UNIT_D", unit_d),
        ("IN_ALIGN", in_align),
        ("IDX64", max_offset >= _INT32_LIMIT),
        ("HAS_MASK", has_mask),
        ("SEARCH_STEPS", search_steps(num_seqs)),
        ("TOK_POW2", tok),
        ("BLOCK_V", block_v),
        ("num_warps", num_warps),
    )
    return (-(-total_v // block_v), n), _pack_spec(consts)


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two <= ``cap`` dividing ``x`` (``cap`` for 0)."""
    return cap if x == 0 else min(cap, abs(x) & -abs(x))


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
    # Index tensors as they are when contiguous (a ``.contiguous()`` call costs a dispatcher
    # round trip even then); without a mask they are never read (the LSE stands in).
    sl = cp_attn_lse if seq_lens is None else contiguous(seq_lens)
    qsl = cp_attn_lse if query_start_loc is None else contiguous(query_start_loc)
    s_out = cp_attn_out.stride()
    s_lse = cp_attn_lse.stride()
    grid, spec = _pack_plan(
        b, h, n, d, cp_attn_out.element_size(), num_seqs, seq_lens is not None, s_out, s_lse
    )
    spec(
        grid,
        cp_attn_out,
        s_out[0],
        s_out[1],
        s_out[2],
        cp_attn_lse,
        s_lse[0],
        s_lse[1],
        send,
        sl,
        qsl,
        num_seqs,
        b,
    )


@functools.lru_cache(maxsize=1024)
def _unpack_config(n: int, num_rows: int, d: int, size: int) -> tuple[int, int, int, int]:
    """``(grid0, BLOCK_R, BLOCK_D, num_warps)``: about 16 KiB of payload loads in flight."""
    target = max(_UNPACK_MIN_BYTES, _UNPACK_INFLIGHT_BYTES // n)
    block_r, block_d, num_warps = tile_config(num_rows, d, size, target)
    return -(-num_rows // block_r), block_r, block_d, num_warps


@functools.lru_cache(maxsize=256)
def _unpack_spec(consts: tuple[tuple[str, int | bool], ...]) -> Specialization:
    """The unpack-combine kernel specialized on ``consts`` (see ``_pack_spec``)."""
    return _unpack_kernel.specialize(**dict(consts))


@functools.lru_cache(maxsize=1024)
def _unpack_plan(
    n: int, num_rows: int, d: int, rec: int, size: int, lse_word: bool, base_e: bool, has_lse: bool
) -> tuple[tuple[int], Specialization]:
    """Grid and kernel specialization of the unpack-combine kernel (memoised per shape)."""
    grid0, block_r, block_d, num_warps = _unpack_config(n, num_rows, d, size)
    consts = (
        ("N", n),
        ("N_POW2", next_pow2(n)),
        ("HEAD_DIM", d),
        ("REC_WIDTH", rec),
        ("PACK", 4 // size),
        ("REC_ALIGN", 16 // size),
        ("LSE_WORD", lse_word),
        ("BLOCK_R", block_r),
        ("BLOCK_D", block_d),
        ("IS_BASE_E", base_e),
        ("HAS_LSE_OUT", has_lse),
        ("OUT_CACHE", _UNPACK_OUT_CACHE),
        ("num_warps", num_warps),
    )
    return (grid0,), _unpack_spec(consts)


def _launch_unpack(
    recv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, is_lse_base_on_e: bool
) -> None:
    n, b, hr, rec = recv.shape
    num_rows = b * hr
    if num_rows == 0:
        return
    size = recv.element_size()
    d = out.shape[2]
    # The LSE as one 32-bit word: 16-bit dtype, D even, recv 4-byte aligned (a view may not be).
    lse_word = size == 2 and d % 2 == 0 and recv.data_ptr() % 4 == 0
    grid, spec = _unpack_plan(
        n, num_rows, d, rec, size, lse_word, is_lse_base_on_e, lse is not None
    )
    spec(grid, recv, out, lse if lse is not None else out, num_rows)


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
        send: optional preallocated contiguous ``[N, B, H/N, D_rec]`` buffer to fill.

    Returns:
        ``send [N, B, H/N, D_rec]`` in the output dtype, ``D_rec = a2a_record_width(D,
        dtype) = round_up(D + P, 16 / element size)`` (``P = a2a_pack_dim(dtype)``):
        ``send[n, b, j, :D] = cp_attn_out[b, n*H/N + j]``, lanes ``D..D+P-1`` hold the
        (masked) LSE as fp32 bits (low 16 bits in lane D, high 16 bits in lane D + 1 for
        16-bit dtypes), lanes ``D+P..D_rec-1`` are padding, written as zeros.
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
    shape = (cp_world_size, b, h // cp_world_size, a2a_record_width(d, cp_attn_out.dtype))
    if send is None:
        send = new_output(cp_attn_out, shape)
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
    recv: torch.Tensor,
    *,
    head_dim: int,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Combine the N received records per (row, head) (one launch).

    Args:
        recv: contiguous ``[N, B, H_r, D_rec]`` receive buffer (records from every rank, in
            the format of :func:`a2a_pack`), fp16/bf16 or fp32: per record the ``D`` payload
            lanes, the fp32 LSE bits in lanes ``D..D+P-1`` (``P = 2``: low 16 bits first;
            ``P = 1`` for fp32), padding lanes up to ``D_rec = a2a_record_width(D, dtype)``
            (never read).
        head_dim: D (not recoverable from ``D_rec``); ``recv.shape[3]`` must equal
            ``a2a_record_width(head_dim, recv.dtype)``.
        return_lse: also return the global LSE.
        is_lse_base_on_e: natural-log (True) or base-2 (False) LSEs.

    Returns:
        ``(out [B, H_r, D]`` in ``recv.dtype``, ``lse [B, H_r]`` fp32 or ``None)``.

    Raises:
        TypeError: ``recv`` is not a tensor, ``head_dim`` is not an int.
        ValueError: unsupported dtype, ``recv`` not 4-D or not contiguous, or its last dim is
            not the record width of ``head_dim``.
    """
    if not isinstance(recv, torch.Tensor):
        raise TypeError(f"recv must be a torch.Tensor, got {type(recv).__name__}")
    rec = a2a_record_width(head_dim, recv.dtype)
    if recv.dim() != 4 or recv.shape[3] != rec:
        raise ValueError(
            f"expected recv [N, B, H_r, {rec}] (record width of head_dim={head_dim} for "
            f"{recv.dtype}), got shape {tuple(recv.shape)}"
        )
    if not recv.is_contiguous():
        raise ValueError(f"recv must be contiguous, got strides {recv.stride()}")
    return _unpack_combine(recv, head_dim, return_lse, is_lse_base_on_e)


def _unpack_combine(
    recv: torch.Tensor, d: int, return_lse: bool, is_lse_base_on_e: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _, b, hr, _ = recv.shape
    out = new_output(recv, (b, hr, d))
    lse = new_output(recv, (b, hr), torch.float32) if return_lse else None
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
    shape = (n, b, h // n, a2a_record_width(d, cp_attn_out.dtype))
    if n == 1:
        send = recv = new_output(cp_attn_out, shape)
    else:
        # One allocation for both staging buffers (fresh per call: CUDA-graph safe).
        staging = new_output(cp_attn_out, (2, *shape))
        send, recv = staging[0], staging[1]
    _launch_pack(cp_attn_out, cp_attn_lse, send, n, seq_lens, query_start_loc)
    if n > 1:
        all_to_all_records(group, recv, send)
    return _unpack_combine(recv, d, return_lse, is_lse_base_on_e)


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

    Wire format: one record per (destination n, row b, local head j) in per-call send/recv
    buffers ``[N, B, H/N, D_rec]`` of the output dtype, ``D_rec = a2a_record_width(D, dtype)
    = round_up(D + P, 16 / element size)``: lanes ``[0, D)`` the payload, lanes
    ``D..D+P-1`` the fp32 LSE bits (``P = 2`` 16-bit halves, low first, for fp16/bf16;
    ``P = 1`` for fp32), the rest zero padding (never read). Every record starts
    16-byte aligned.

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
