"""Pack a rank's partial output and LSE into the all-to-all send buffer (one launch); the
``[N, B, H/N, D + P]`` block format: docs/design.md, "The A2A buffer format".
"""

from __future__ import annotations

import functools

import torch

from cpattn_common.alloc import new_output
from cpattn_common.checks import check_no_neg_bit, check_no_overlap
from cpattn_common.device import foreign_cuda_device
from cpattn_common.dispatch import mark_written_in_place, must_dispatch, refuse_grad_in_place
from cpattn_common.launch import CachedKernel, Specialization
from cpattn_dcp.kernels.a2a import _a2a_pack_kernel
from cpattn_dcp.ops._collective_common import validate_combine_args
from cpattn_dcp.ops._common import (
    MIN_PROGRAMS,
    contiguous,
    next_pow2,
    search_steps,
    specialize,
)

__all__ = ["a2a_buffer_views", "a2a_pack", "a2a_pack_dim", "a2a_record_width"]

_PACK_DIM = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 1}
# 256 16-byte vectors per payload program, 2 warps: 0.84-0.86 of the copy on H200 at D=128,
# larger blocks no better (docs/design.md, "Tile rules").
_PACK_BLOCK_V = 256
_PACK_NUM_WARPS = 2
# Grids under MIN_PROGRAMS programs (decode sizes, latency-bound): 64 vectors of one warp,
# so that the few vectors spread over more programs.
_PACK_SMALL_BLOCK_V = 64
_PACK_SMALL_NUM_WARPS = 1
# Offsets at or past this bound switch the pack kernel to int64 index arithmetic.
_INT32_LIMIT = 2**31
_pack_kernel = CachedKernel(_a2a_pack_kernel)


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
    """Last dim ``D + P`` (``P = a2a_pack_dim(dtype)``) of the all-to-all buffers ``[N, B, H/N,
    D + P]``, which only sizes them (block format: ``a2a_buffer_views``). ``ValueError`` for
    ``head_dim < 1`` or another dtype, ``TypeError`` for a non-int ``head_dim``."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    return head_dim + a2a_pack_dim(dtype)


def a2a_buffer_views(buf: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The payloads and LSE lanes of an all-to-all send/recv buffer, as views.

    ``buf``: a contiguous fp16/bf16/fp32 ``[N, B, H_r, D + P]`` buffer; ``head_dim``: D.

    Returns:
        ``(payload [N, B, H_r, D], lse_lanes [N, B, H_r, P])``: ``payload[n, b, j]`` is the
        partial output of token b, head ``n * H_r + j`` of the rank that packed block n;
        ``lse_lanes[n, b, j]`` its fp32 LSE bits (``.view(torch.float32)`` of a contiguous
        copy gives the LSEs; 16-bit lanes hold the low and high halves).

    Raises:
        ValueError: not a contiguous 4-D buffer of last dim ``D + P``; another float dtype.
        TypeError: ``buf`` is not a floating tensor, ``head_dim`` is not an int.
    """
    n, b, hr, width = _buffer_shape(buf, head_dim, "buf")
    flat = buf.view(n, b * hr * width)
    payload = flat[:, : b * hr * head_dim].view(n, b, hr, head_dim)
    return payload, flat[:, b * hr * head_dim :].view(n, b, hr, width - head_dim)


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


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two <= ``cap`` dividing ``x`` (``cap`` for 0)."""
    return cap if x == 0 else min(cap, abs(x) & -abs(x))


def _lse_word(buf: torch.Tensor, rows: int, d: int) -> bool:
    """The LSEs of ``buf`` are aligned 32-bit words: 16-bit dtype, ``rows * D`` even (the
    LSE region starts on a word) and ``buf`` 4-byte aligned (a caller's view may not be)."""
    return buf.element_size() == 2 and (rows * d) % 2 == 0 and buf.data_ptr() % 4 == 0


@functools.lru_cache(maxsize=1024)
def _pack_plan(
    b: int, h: int, n: int, d: int, size: int, num_seqs: int, has_mask: bool,
    s_out: tuple[int, int, int], s_lse: tuple[int, int], lse_word: bool,
) -> tuple[tuple[int, int], int, Specialization]:  # fmt: skip
    """Grid, number of payload programs and kernel specialization (memoised per shape)."""
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
    # Unit-stride head dim: 16-byte vector loads when both row strides allow.
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
    spec = specialize(
        _pack_kernel,
        HEADS_PER_RANK=hr,
        HEAD_DIM=d,
        VEC=vec,
        PACK=p,
        UNIT_D=unit_d,
        IN_ALIGN=in_align,
        DST_ALIGN=_pow2_divisor(rows * (d + p), vec),
        LSE_WORD=lse_word,
        IDX64=max_offset >= _INT32_LIMIT,
        HAS_MASK=has_mask,
        SEARCH_STEPS=search_steps(num_seqs),
        BLOCK_V=block_v,
        HR_POW2=hr_pow2,
        BLOCK_T=block_t,
        num_warps=num_warps,
    )
    return (pay_programs + lse_programs, n), pay_programs, spec


def _launch_pack(
    cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, send: torch.Tensor, n: int,
    seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor | None,
) -> None:  # fmt: skip
    """Fill ``send`` (validated arguments; the mask is fused when ``seq_lens`` is given)."""
    if (index := foreign_cuda_device(cp_attn_out)) >= 0:
        with torch.cuda.device(index):
            return _launch_pack(cp_attn_out, cp_attn_lse, send, n, seq_lens, query_start_loc)
    b, h, d = cp_attn_out.shape
    if b == 0 or h == 0:
        return
    num_seqs = seq_lens.shape[0] if seq_lens is not None else 0
    # Without a mask the index tensors are never read (the LSE stands in).
    sl = cp_attn_lse if seq_lens is None else contiguous(seq_lens)
    qsl = cp_attn_lse if query_start_loc is None else contiguous(query_start_loc)
    s_out = cp_attn_out.stride()
    s_lse = cp_attn_lse.stride()
    word = _lse_word(send, b * (h // n), d)
    grid, pay_programs, spec = _pack_plan(
        b, h, n, d, cp_attn_out.element_size(), num_seqs, seq_lens is not None, s_out, s_lse, word
    )
    spec(grid, cp_attn_out, *s_out, cp_attn_lse, *s_lse, send, sl, qsl, num_seqs, b, pay_programs)


def _send_shape(cp_attn_out: torch.Tensor, cp_world_size: int) -> tuple[int, int, int, int]:
    """``[N, B, H/N, D + P]`` for a validated call (sizes may be symbolic under tracing)."""
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
    cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_world_size: int,
    seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor | None, send: torch.Tensor | None,
    has_mask: bool,
) -> torch.Tensor:  # fmt: skip
    """``a2a_pack`` after validation: allocate ``send`` unless given (checked), launch."""
    if send is None:
        send = new_output(cp_attn_out, _send_shape(cp_attn_out, cp_world_size))
    else:
        _check_send(send, cp_attn_out, cp_world_size)
        check_no_overlap("a2a_pack", "send", send=send, cp_attn_out=cp_attn_out,
                         cp_attn_lse=cp_attn_lse, seq_lens=seq_lens,
                         query_start_loc=query_start_loc)  # fmt: skip
    masks = (seq_lens, query_start_loc) if has_mask else (None, None)
    _launch_pack(cp_attn_out, cp_attn_lse, send, cp_world_size, *masks)
    return send


@torch.library.custom_op("cpattn_dcp::a2a_pack", mutates_args=())
def _a2a_pack_op(
    cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_world_size: int,
    seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    # Validated by a2a_pack; masking is on when the masks are passed.
    return _pack(cp_attn_out, cp_attn_lse, cp_world_size, seq_lens, query_start_loc, None,
                 seq_lens is not None)  # fmt: skip


@_a2a_pack_op.register_fake
def _(
    cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_world_size: int,
    seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    return cp_attn_out.new_empty(_send_shape(cp_attn_out, cp_world_size))


@torch.library.custom_op("cpattn_dcp::a2a_pack_into", mutates_args=("send",))
def _a2a_pack_into_op(
    cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_world_size: int,
    seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor | None, send: torch.Tensor,
) -> None:  # fmt: skip
    _pack(cp_attn_out, cp_attn_lse, cp_world_size, seq_lens, query_start_loc, send,
          seq_lens is not None)  # fmt: skip


@_a2a_pack_into_op.register_fake
def _(
    cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_world_size: int,
    seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor | None, send: torch.Tensor,
) -> None:  # fmt: skip
    return None


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
        seq_lens / query_start_loc: ``[R]`` local KV lengths and ``[R + 1]`` query offsets: the
            empty-shard mask is fused (bit-identical to ``mask_dcp_empty_shards_``).
        send: optional preallocated contiguous ``[N, B, H/N, D + P]`` buffer to fill.

    Returns:
        ``send [N, B, H/N, D + P]`` in the output dtype, every lane written: with ``payload,
        lse_lanes = a2a_buffer_views(send, D)``, ``payload[n, b, j] = cp_attn_out[b, n*H/N +
        j]`` and ``lse_lanes[n, b, j]`` the (masked) LSE as fp32 bits.

    Raises:
        ValueError / TypeError: as :func:`dcp_a2a_lse_reduce` for the same arguments; a
            ``send`` of another shape, dtype or device, not contiguous or negated.
        RuntimeError: grad mode is on and ``send`` requires grad (written in place).

    Inference only (no autograd formula): see ``cpattn_common.dispatch``. Registered as
    ``torch.ops.cpattn_dcp.a2a_pack`` and, with ``send``, ``a2a_pack_into``.
    """
    has_mask = validate_combine_args(
        "a2a_pack", cp_attn_out, cp_attn_lse, cp_world_size, seq_lens, query_start_loc,
        heads_divisible=True,
    )  # fmt: skip
    if must_dispatch(cp_attn_out, cp_attn_lse, send):  # tracing, a dispatch mode, autograd
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
    # Eager: skip the dispatcher; a given send is written in place: mark it, as it would.
    filled = _pack(cp_attn_out, cp_attn_lse, cp_world_size, seq_lens, query_start_loc, send,
                   has_mask)  # fmt: skip
    if send is not None:
        mark_written_in_place(send)
    return filled
