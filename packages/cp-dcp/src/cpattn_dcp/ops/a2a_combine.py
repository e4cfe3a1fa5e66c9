"""Packed all-to-all combine: pack (fused empty-shard mask), one ``all_to_all_single``,
unpack-and-combine.

Send and receive buffers ``[N, B, H/N, D + P]`` (output dtype; ``P = a2a_pack_dim(dtype)``:
2 lanes carry one fp32 LSE for fp16/bf16, 1 for fp32), in the block format of
``kernels/a2a.py``: destination n's ``B * H/N * (D + P)`` lanes are the payloads of its rows,
then their fp32 LSE words (``a2a_buffer_views`` gives both as views). The buffers are
allocated per call, so a captured CUDA graph keeps valid addresses (a shared growable
workspace would be freed under it). Exactly two kernel launches and one collective per call;
no host sync.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from cpattn_common.alloc import new_output
from cpattn_common.checks import check_bool, check_no_neg_bit
from cpattn_common.device import foreign_cuda_device
from cpattn_common.dispatch import mark_written_in_place, must_dispatch, refuse_grad_in_place
from cpattn_common.group import CPGroupLike
from cpattn_common.launch import CachedKernel, Specialization
from cpattn_dcp.comm.collectives import all_to_all_records
from cpattn_dcp.comm.groups import (
    group_from_token,
    resolve_group,
)
from cpattn_dcp.context import CPTritonContext
from cpattn_dcp.kernels.a2a import _a2a_pack_kernel, _a2a_unpack_combine_fwd_kernel
from cpattn_dcp.ops._collective_common import combine_op, traced_combine, validate_combine_args
from cpattn_dcp.ops._common import MIN_PROGRAMS, contiguous, next_pow2, search_steps, tile_config

__all__ = [
    "a2a_buffer_views",
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
# Decode-size unpack grids (one row per program, fewer than MIN_PROGRAMS programs) are
# latency-bound: about this many head-dim lanes per thread and source (0: off), at most
# _UNPACK_SMALL_GRID_MAX_WARPS warps. H200, bf16, graph replay, B=1 / B=8 (variants.py --ab
# unpack-decode, results/h200-2026-11-29-s7/ab_unpack_decode.txt): H=128 D=512 N=8 1.41 /
# 1.57 us with 2 lanes, 1.79 / 1.89 us with one warp per row (the tile rule alone); H=64
# D=256 N=8 1.33 / 1.39 against 1.61 / 1.64 us; D=128 within 0.07 us (N=8: 1.35 against
# 1.42 at B=1); 4 lanes in between. B >= 64 grids and B=4096 are unaffected.
_UNPACK_SMALL_GRID_LANES = 2
_UNPACK_SMALL_GRID_MAX_WARPS = 4
# From _UNPACK_ONE_VECTOR_MIN_N sources on (up to the unrolled path's 8), on grids of at least
# _UNPACK_ONE_VECTOR_MIN_PROGRAMS programs, an unpack program gets twice tile_config's warps
# where its tile holds two or more 16-byte payload vectors per thread: one vector per thread
# and source (0: off). H200, bf16, B=4096, fraction of the copy bandwidth, with the kernel that
# computes each weight just before its source's sum (benchmarks/unpack_asm.py --ref-kernel,
# results/h200-2026-12-01-s21/unpack_ab_*.txt): N=8 H=64 D=128 0.844-0.849 against 0.785-0.797
# with two vectors per thread (0.817-0.820 for the kernel before), D=256 0.949-0.951 against
# 0.913-0.915 (0.926-0.927), H=128 D=512 unchanged. One vector per thread cost 0.03 at N=5 and
# 0.02 at N=6 and changed nothing at N=7, hence 8 (N = 2 to 7 keep the tile rule; the new
# kernel reads as the one before there). A decode grid lost: B=64 H=128 D=512 N=8 (512
# programs) replayed in 2.93 against 2.63 us (ab_unpack_onevec-1f95d16.txt), hence the grid
# floor (B=4096 grids: 4096 programs and more).
_UNPACK_ONE_VECTOR_MIN_N = 8
_UNPACK_ONE_VECTOR_MIN_PROGRAMS = 4096
# Cache modifier of the unpack's output stores: "" (write-back). Streaming stores (".cs")
# measured within the noise of it (+-0.03 of the copy bandwidth, same A/B).
_UNPACK_OUT_CACHE = ""
# Eviction policy of the unpack's payload loads ("" everywhere: Triton's default), used only
# on grids of at least _UNPACK_ONE_VECTOR_MIN_PROGRAMS programs with N >= _UNPACK_PAY_EVICT_MIN_N
# sources and D <= _UNPACK_PAY_EVICT_MAX_D. "evict_first" on every shape, A/B through the op
# against "" (H200, bf16, B=4096, one vector per thread at N=8, fraction of the copy;
# results/h200-2026-12-01-s21/unpack_ab_evict-6c7da66.txt): H=64 D=128 N=8 / 4 / 2
# +0.009 / +0.010 / -0.005, D=256 +0.035 / +0.015 / -0.067, H=128 D=512 -0.007 / -0.030 /
# -0.089; graph replay at B=64: D=512 N=8 2.98 against 2.64 us, D=256 N=4 2.00 against 1.77.
# Hence the rule: the shapes that gained, decode grids left alone. The rule against "" and
# against evict_first on every large grid, two interleaved rounds (variants.py --ab
# unpack-evict, results/h200-2026-12-01-s24/ab_unpack_evict-8de9e21.txt): H=64 D=128 N=8
# 0.863 / 0.842 against 0.831 / 0.855 (""), D=256 N=8 0.986 / 0.970 against 0.940 / 0.955,
# D=256 N=2 1.007 / 0.992 against 0.935 / 0.922 (everywhere); decode replay within 0.04 us.
_UNPACK_PAY_EVICT = "evict_first"
_UNPACK_PAY_EVICT_MIN_N = 4
_UNPACK_PAY_EVICT_MAX_D = 256
# Pack: 16-byte vectors of the payload region one program copies, and its warps (the same
# tile as the former record pack, H200, bf16, B=4096, fused mask: 256 vectors / 2 warps
# 0.84-0.86 of the copy bandwidth at H=64 D=128, 0.96 at H=128 D=512; 512 / 4 and 1024 / 8
# were within 0.03 below; benchmarks/pack_variants.py). An LSE program takes about as many
# LSEs as a payload program takes vectors.
_PACK_BLOCK_V = 256
_PACK_NUM_WARPS = 2
# Grids under MIN_PROGRAMS programs (decode sizes, latency-bound): smaller blocks of one warp,
# so that the few vectors spread over more programs.
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
    """Last dim of the all-to-all send/recv buffers ``[N, B, H/N, D + P]``: ``D + P`` with
    ``P = a2a_pack_dim(dtype)`` (D payload lanes and P LSE lanes per row).

    The buffers are in the block format (``a2a_buffer_views``), so ``buf[n, b, j]`` is *not*
    row (b, j)'s payload and LSE; the shape only sizes the buffer.

    Raises:
        ValueError: ``head_dim < 1`` or a dtype other than fp16/bf16/fp32.
        TypeError: ``head_dim`` is not an int.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    return head_dim + a2a_pack_dim(dtype)


def a2a_buffer_views(buf: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The payloads and LSE lanes of an all-to-all send/recv buffer, as views.

    Args:
        buf: contiguous ``[N, B, H_r, D + P]`` buffer (``a2a_pack``'s output or a receive
            buffer), fp16/bf16/fp32.
        head_dim: D.

    Returns:
        ``(payload [N, B, H_r, D], lse_lanes [N, B, H_r, P])``: ``payload[n, b, j]`` is the
        partial output of token b, head ``n * H_r + j`` of the rank that packed block n;
        ``lse_lanes[n, b, j]`` its fp32 LSE bits (``.view(torch.float32)`` of a contiguous
        copy gives ``[N, B, H_r, 1]`` fp32 LSEs; for 16-bit dtypes the two lanes are the low
        and high halves and are not numbers).

    Raises:
        ValueError: ``buf`` is not a contiguous 4-D buffer whose last dim is ``D + P``, or
            its dtype is a float other than fp16/bf16/fp32.
        TypeError: ``buf`` is not a floating tensor, ``head_dim`` is not an int.
    """
    n, b, hr, width = _buffer_shape(buf, head_dim, "buf")
    p = width - head_dim
    flat = buf.view(n, b * hr * width)
    payload = flat[:, : b * hr * head_dim].view(n, b, hr, head_dim)
    return payload, flat[:, b * hr * head_dim :].view(n, b, hr, p)


def _buffer_shape(
    buf: torch.Tensor, head_dim: int, name: str = "recv"
) -> tuple[int, int, int, int]:
    """``buf``'s shape after checking it is a contiguous ``[N, B, H_r, D + P]`` buffer."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if not buf.dtype.is_floating_point:  # as every op's check_out_dtype
        raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32), got {buf.dtype}")
    width = a2a_record_width(head_dim, buf.dtype)
    if buf.dim() != 4 or buf.shape[3] != width:
        raise ValueError(
            f"expected {name} [N, B, H_r, {width}] (D + P for head_dim={head_dim} and "
            f"{buf.dtype}), got shape {tuple(buf.shape)}"
        )
    if not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {buf.stride()}")
    n, b, hr, _ = buf.shape
    if n < 1:
        raise ValueError(
            f"{name} must hold N >= 1 blocks (one per rank), got shape {tuple(buf.shape)}"
        )
    return n, b, hr, width


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
    lse_word: bool,
) -> tuple[tuple[int, int], int, Specialization]:
    """Grid, number of payload programs and kernel specialization of the pack kernel
    (memoised per shape and strides, so a repeated call costs one look-up)."""
    vec = 16 // size
    p = 4 // size
    hr = h // n
    rows = b * hr
    pay_v = -(-(rows * d) // vec)
    block_v, num_warps = _PACK_BLOCK_V, _PACK_NUM_WARPS
    if -(-pay_v // block_v) * n < MIN_PROGRAMS:
        block_v, num_warps = _PACK_SMALL_BLOCK_V, _PACK_SMALL_NUM_WARPS
    pay_programs = -(-pay_v // block_v)
    # LSE programs: [BLOCK_T, next_pow2(H_r)] tiles of about BLOCK_V LSEs.
    hr_pow2 = next_pow2(hr)
    block_t = max(1, block_v // hr_pow2)
    lse_programs = -(-b // block_t)
    # Unit-stride head dim: the payload is read as row offset + lane, 16-byte vectors when
    # both row strides are multiples of 16 bytes (and the pointer is 16-byte aligned, which
    # Triton's launch specialisation sees by itself). Else the strided fallback.
    unit_d = s_out[2] == 1 or d == 1
    in_align = _pow2_divisor(s_out[1], _pow2_divisor(s_out[0], vec)) if unit_d else 1
    # int32 index arithmetic unless an offset the kernel may form could overflow it (masked
    # lanes past the last row included).
    tok = b + block_v * vec // max(1, hr * d) + block_v + 2
    max_offset = max(
        n * rows * (d + p) + (pay_programs + 1) * block_v * vec,
        tok * s_out[0] + h * s_out[1] + (d + 2 * vec) * s_out[2],
        tok * s_lse[0] + h * s_lse[1],
    )
    consts = (
        ("HEADS_PER_RANK", hr),
        ("HEAD_DIM", d),
        ("VEC", vec),
        ("PACK", p),
        ("UNIT_D", unit_d),
        ("IN_ALIGN", in_align),
        ("DST_ALIGN", _pow2_divisor(rows * (d + p), vec)),
        ("LSE_WORD", lse_word),
        ("IDX64", max_offset >= _INT32_LIMIT),
        ("HAS_MASK", has_mask),
        ("SEARCH_STEPS", search_steps(num_seqs)),
        ("BLOCK_V", block_v),
        ("HR_POW2", hr_pow2),
        ("BLOCK_T", block_t),
        ("num_warps", num_warps),
    )
    return (pay_programs + lse_programs, n), pay_programs, _pack_spec(consts)


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two <= ``cap`` dividing ``x`` (``cap`` for 0)."""
    return cap if x == 0 else min(cap, abs(x) & -abs(x))


def _lse_word(buf: torch.Tensor, rows: int, d: int) -> bool:
    """The LSEs of ``buf`` are aligned 32-bit words: 16-bit dtype, ``rows * D`` even (the
    LSE region starts on a word) and ``buf`` 4-byte aligned (a caller's view may not be)."""
    return buf.element_size() == 2 and (rows * d) % 2 == 0 and buf.data_ptr() % 4 == 0


def _launch_pack(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    send: torch.Tensor,
    n: int,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> None:
    if (index := foreign_cuda_device(cp_attn_out)) >= 0:
        with torch.cuda.device(index):
            return _launch_pack(cp_attn_out, cp_attn_lse, send, n, seq_lens, query_start_loc)
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
    grid, pay_programs, spec = _pack_plan(
        b,
        h,
        n,
        d,
        cp_attn_out.element_size(),
        num_seqs,
        seq_lens is not None,
        s_out,
        s_lse,
        _lse_word(send, b * (h // n), d),
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
        pay_programs,
    )


@functools.lru_cache(maxsize=1024)
def _unpack_config(n: int, num_rows: int, d: int, size: int) -> tuple[int, int, int, int]:
    """``(grid0, BLOCK_R, BLOCK_D, num_warps)``: about 16 KiB of payload loads in flight;
    large grids at N=8 load one vector per thread and source (``_UNPACK_ONE_VECTOR_MIN_N``);
    one-row programs of a grid below ``MIN_PROGRAMS`` (decode) get more warps (see
    ``_UNPACK_SMALL_GRID_LANES``)."""
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


@functools.lru_cache(maxsize=256)
def _unpack_spec(consts: tuple[tuple[str, int | bool], ...]) -> Specialization:
    """The unpack-combine kernel specialized on ``consts`` (see ``_pack_spec``)."""
    return _unpack_kernel.specialize(**dict(consts))


@functools.lru_cache(maxsize=1024)
def _unpack_plan(
    n: int, num_rows: int, d: int, size: int, lse_word: bool, base_e: bool, has_lse: bool
) -> tuple[tuple[int], Specialization]:
    """Grid and kernel specialization of the unpack-combine kernel (memoised per shape)."""
    grid0, block_r, block_d, num_warps = _unpack_config(n, num_rows, d, size)
    p = 4 // size
    evict = (
        _UNPACK_PAY_EVICT
        if grid0 >= _UNPACK_ONE_VECTOR_MIN_PROGRAMS
        and n >= _UNPACK_PAY_EVICT_MIN_N
        and d <= _UNPACK_PAY_EVICT_MAX_D
        else ""
    )
    consts = (
        ("N", n),
        ("N_POW2", next_pow2(n)),
        ("HEAD_DIM", d),
        ("PACK", p),
        # Payload rows start at n * R * (D + P) + r * D lanes.
        ("PAY_ALIGN", _pow2_divisor(d, _pow2_divisor(num_rows * (d + p), 16 // size))),
        ("LSE_WORD", lse_word),
        ("BLOCK_R", block_r),
        ("BLOCK_D", block_d),
        ("IS_BASE_E", base_e),
        ("HAS_LSE_OUT", has_lse),
        ("OUT_CACHE", _UNPACK_OUT_CACHE),
        ("PAY_EVICT", evict),
        ("num_warps", num_warps),
    )
    return (grid0,), _unpack_spec(consts)


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
    grid, spec = _unpack_plan(
        n,
        num_rows,
        d,
        recv.element_size(),
        _lse_word(recv, num_rows, d),
        is_lse_base_on_e,
        lse is not None,
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
        send: optional preallocated contiguous ``[N, B, H/N, D + P]`` buffer to fill.

    Returns:
        ``send [N, B, H/N, D + P]`` in the output dtype (``P = a2a_pack_dim(dtype)``), in the
        block format: with ``payload, lse_lanes = a2a_buffer_views(send, D)``,
        ``payload[n, b, j] = cp_attn_out[b, n*H/N + j]`` and ``lse_lanes[n, b, j]`` the
        (masked) LSE as fp32 bits (low 16 bits first for 16-bit dtypes). Every lane is
        written.

    Raises:
        ValueError / TypeError: as :func:`dcp_a2a_lse_reduce` for the same arguments; a
            ``send`` of another shape, dtype or device, not contiguous or with torch's
            negative bit (``ValueError``).
        RuntimeError: grad mode is on and ``send`` requires grad (the op writes it in place
            and has no autograd formula).

    Inference only (no autograd formula): see ``cpattn_common.dispatch``. Registered as
    ``torch.ops.cpattn_dcp.a2a_pack`` and, with ``send``, ``a2a_pack_into``.
    """
    if must_dispatch(cp_attn_out, cp_attn_lse, send):  # tracing, a dispatch mode, autograd
        has_mask = validate_combine_args(
            "a2a_pack", cp_attn_out, cp_attn_lse, cp_world_size, seq_lens, query_start_loc,
            heads_divisible=True,
        )  # fmt: skip
        masks = (seq_lens, query_start_loc) if has_mask else (None, None)
        if send is None:
            packed: torch.Tensor = torch.ops.cpattn_dcp.a2a_pack(
                cp_attn_out, cp_attn_lse, cp_world_size, *masks
            )
            return packed
        _check_send(send, cp_attn_out, cp_world_size)
        refuse_grad_in_place("a2a_pack", "send", send)
        torch.ops.cpattn_dcp.a2a_pack_into(cp_attn_out, cp_attn_lse, cp_world_size, *masks, send)
        return send
    # Eager: skip the dispatcher. A given send is written in place: mark it, as the
    # dispatcher would.
    has_mask = validate_combine_args(
        "a2a_pack",
        cp_attn_out,
        cp_attn_lse,
        cp_world_size,
        seq_lens,
        query_start_loc,
        heads_divisible=True,
    )
    filled = _pack(cp_attn_out, cp_attn_lse, cp_world_size, seq_lens, query_start_loc, send,
                   has_mask)  # fmt: skip
    if send is not None:
        mark_written_in_place(send)
    return filled


def _send_shape(cp_attn_out: torch.Tensor, cp_world_size: int) -> tuple[int, int, int, int]:
    """``[N, B, H/N, D + P]``: the send buffer of a validated ``a2a_pack`` call (sizes may be
    symbolic under tracing, so ``D + P`` is not ``a2a_record_width``, which wants an int)."""
    b, h, d = cp_attn_out.shape
    return (cp_world_size, b, h // cp_world_size, d + a2a_pack_dim(cp_attn_out.dtype))


def _check_send(send: torch.Tensor, cp_attn_out: torch.Tensor, cp_world_size: int) -> None:
    shape = _send_shape(cp_attn_out, cp_world_size)
    if not isinstance(send, torch.Tensor):
        raise TypeError(f"send must be a torch.Tensor or None, got {type(send).__name__}")
    if (
        tuple(send.shape) != shape
        or send.dtype != cp_attn_out.dtype
        or send.device != cp_attn_out.device
        or not send.is_contiguous()
    ):
        raise ValueError(
            f"send must be a contiguous {cp_attn_out.dtype} tensor of shape {shape} on "
            f"{cp_attn_out.device}, got {send.dtype} {tuple(send.shape)} on {send.device}"
        )
    check_no_neg_bit("a2a_pack", send=send)


def _pack(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_world_size: int,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    send: torch.Tensor | None,
    has_mask: bool,
) -> torch.Tensor:
    """``a2a_pack`` after validation: allocate ``send`` unless given (checked), launch."""
    if send is None:
        send = new_output(cp_attn_out, _send_shape(cp_attn_out, cp_world_size))
    else:
        _check_send(send, cp_attn_out, cp_world_size)
    _launch_pack(
        cp_attn_out,
        cp_attn_lse,
        send,
        cp_world_size,
        seq_lens if has_mask else None,
        query_start_loc if has_mask else None,
    )
    return send


@torch.library.custom_op("cpattn_dcp::a2a_pack", mutates_args=())
def _a2a_pack_op(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_world_size: int,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> torch.Tensor:
    # Validated by a2a_pack; masking is on when the masks are passed.
    return _pack(cp_attn_out, cp_attn_lse, cp_world_size, seq_lens, query_start_loc, None,
                 seq_lens is not None)  # fmt: skip


@_a2a_pack_op.register_fake
def _(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_world_size: int,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
) -> torch.Tensor:
    return cp_attn_out.new_empty(_send_shape(cp_attn_out, cp_world_size))


@torch.library.custom_op("cpattn_dcp::a2a_pack_into", mutates_args=("send",))
def _a2a_pack_into_op(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_world_size: int,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    send: torch.Tensor,
) -> None:
    _pack(cp_attn_out, cp_attn_lse, cp_world_size, seq_lens, query_start_loc, send,
          seq_lens is not None)  # fmt: skip


@_a2a_pack_into_op.register_fake
def _(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_world_size: int,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    send: torch.Tensor,
) -> None:
    return None


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
        TypeError: ``recv`` is not a floating tensor, ``head_dim`` is not an int, an
            ``is_lse_base_on_e`` or ``return_lse`` that is not a bool.
        ValueError: a float dtype other than fp16/bf16/fp32, ``recv`` not 4-D or not
            contiguous, its last dim not ``D + P`` for ``head_dim``, or torch's negative bit
            on it.

    Inference only (no autograd formula): see ``cpattn_common.dispatch``. Registered as
    ``torch.ops.cpattn_dcp.a2a_unpack_combine`` (its LSE is empty without ``return_lse``).
    """
    is_lse_base_on_e = check_bool("is_lse_base_on_e", is_lse_base_on_e)
    return_lse = check_bool("return_lse", return_lse)
    if must_dispatch(recv):  # tracing, a dispatch mode, autograd
        _buffer_shape(recv, head_dim)
        out: torch.Tensor
        lse_or_empty: torch.Tensor
        out, lse_or_empty = torch.ops.cpattn_dcp.a2a_unpack_combine(
            recv, head_dim, bool(return_lse), is_lse_base_on_e
        )
        return out, (lse_or_empty if return_lse else None)
    _buffer_shape(recv, head_dim)
    check_no_neg_bit("a2a_unpack_combine", recv=recv)
    return _unpack_combine(recv, head_dim, return_lse, is_lse_base_on_e)


def _unpack_combine(
    recv: torch.Tensor, d: int, return_lse: bool, is_lse_base_on_e: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    shape = _send_shape(cp_attn_out, n)
    if n == 1:
        send = recv = new_output(cp_attn_out, shape)
    else:
        # One allocation for both staging buffers (fresh per call: CUDA-graph safe).
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        gap = -numel % (16 // cp_attn_out.element_size())
        if gap == 0:
            staging = new_output(cp_attn_out, (2, *shape))
            send, recv = staging[0], staging[1]
        else:
            # Records are D + P lanes, so N*B*H_r of them need not end on a 16-byte boundary:
            # a gap puts the receive half on one, for the unpack kernel's vector loads (a
            # misaligned base compiles the kernel without them).
            staging = new_output(cp_attn_out, (2 * numel + gap,))
            send, recv = staging[:numel].view(shape), staging[numel + gap :].view(shape)
    _launch_pack(cp_attn_out, cp_attn_lse, send, n, seq_lens, query_start_loc)
    if n > 1:
        all_to_all_records(group, recv, send)
    return _unpack_combine(recv, cp_attn_out.shape[2], return_lse, is_lse_base_on_e)


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


@combine_op
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

    Wire format: per-call send/recv buffers ``[N, B, H/N, D + P]`` of the output dtype
    (``P = 2`` 16-bit lanes per fp32 LSE for fp16/bf16, 1 for fp32), one contiguous block
    per destination: the ``B * H/N`` payload rows, then their fp32 LSE bits
    (``a2a_buffer_views``).

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
            output dtype other than fp16/bf16/fp32, bad shapes, device mismatch, inconsistent
            ``seq_lens``/``query_start_loc`` (one ``None``, not 1-D, lengths), an input with
            torch's negative bit (a lazily negated view, ``checks.check_no_neg_bit``).
        TypeError: non-floating tensors; ``seq_lens``/``query_start_loc`` not tensors or
            not of an integer dtype (as for ``mask_dcp_empty_shards_``); an
            ``is_lse_base_on_e`` or ``return_lse`` that is not a bool.

    Inference only (no autograd formula): see ``cpattn_common.dispatch``.

    Example:
        >>> out, lse = dcp_a2a_lse_reduce(partial_out, partial_lse, group, return_lse=True,  # doctest: +SKIP
        ...                               seq_lens=local_lens, query_start_loc=qsl)
    """
    del ctx
    is_lse_base_on_e = check_bool("is_lse_base_on_e", is_lse_base_on_e)
    return_lse = check_bool("return_lse", return_lse)
    if must_dispatch(cp_attn_out, cp_attn_lse):  # tracing, a dispatch mode, autograd
        return traced_combine(
            torch.ops.cpattn_dcp.dcp_a2a_lse_reduce, "dcp_a2a_lse_reduce", cp_attn_out,
            cp_attn_lse, cp_group, return_lse, is_lse_base_on_e, seq_lens, query_start_loc,
            heads_divisible=True,
        )  # fmt: skip
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
