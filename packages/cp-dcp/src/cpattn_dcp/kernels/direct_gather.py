"""Direct (symmetric-memory) DCP query / KV gather kernels: publish rows, then wait (+ copy out).

Publish copies row ``src[t, 0:W]`` into destination ``d`` at element offset ``parity *
dst_parity_stride + rank * dst_rank_stride + t * dst_row_stride`` (query: the final ``[T, N*H_r,
D]`` layout; KV: rank-major ``[N*T, D]`` in the parity slot). Wait polls the signals
(``direct_protocol``) and with ``HAS_COPY`` copies the slot into ``dst``; on failure it fills
``dst`` with the dtype's NaN bits ``NAN_BITS`` (docs/direct-internals.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpattn_dcp.kernels.direct_protocol import (
    _call_epoch,
    _checked_wait,
    _failed,
    _publish_done,
    _wait_done,
)

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def same_size_int(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype of ``dtype``'s size (1, 2 or 4 bytes): what a bit-exact
    ``tensor.view`` of ``dtype`` data takes.

    Raises:
        ValueError: ``dtype`` is of another size.
    """
    size = torch.empty((), dtype=dtype).element_size()
    if size not in _INT_OF_SIZE:
        raise ValueError(f"{dtype} is not a 1-, 2- or 4-byte dtype")
    return _INT_OF_SIZE[size]


def nan_bits(dtype: torch.dtype) -> int:
    """The NaN bit pattern of the floating ``dtype`` (1, 2 or 4 bytes) as the signed integer
    of its width: ``NAN_BITS`` of ``_direct_gather_wait_kernel``.

    Raises:
        ValueError: ``dtype`` is not a 1-, 2- or 4-byte type with a NaN encoding (e.g.
            ``float4_e2m1fn_x2``).
    """
    if not dtype.is_floating_point:
        raise ValueError(f"{dtype} is not a floating dtype")
    int_dtype = same_size_int(dtype)
    try:
        nan = torch.tensor(float("nan"), dtype=dtype)
    except (RuntimeError, TypeError) as exc:  # a format torch cannot convert a float into
        raise ValueError(f"{dtype} has no NaN encoding torch can produce") from exc
    if not bool(nan.float().isnan()):
        raise ValueError(f"{dtype} has no NaN encoding")
    return int(nan.view(int_dtype).item())


@triton.jit
def _store_nan_bits(ptr, offs, mask, NAN_BITS: tl.constexpr):
    """``ptr[offs] = NaN`` where ``mask``: the bit pattern ``NAN_BITS`` (``nan_bits``) stored
    through ``ptr`` reinterpreted as a pointer to the signed integer of its element's width
    (a no-op cast where ``ptr`` points at integers already)."""
    bits: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth
    if bits == 8:
        int_ptr = ptr.to(tl.pointer_type(tl.int8), bitcast=True)
        tl.store(int_ptr + offs, tl.full(offs.shape, NAN_BITS, tl.int8), mask=mask)
    elif bits == 16:
        int_ptr = ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        tl.store(int_ptr + offs, tl.full(offs.shape, NAN_BITS, tl.int16), mask=mask)
    else:
        tl.static_assert(bits == 32, "NaN stores take 1-, 2- or 4-byte elements")
        int_ptr = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        tl.store(int_ptr + offs, tl.full(offs.shape, NAN_BITS, tl.int32), mask=mask)


@triton.jit
def _direct_gather_publish_kernel(
    src_ptr, stride_src_t, peer_dst_ptrs, peer_sig_ptrs, counter_ptr, epoch_ptr, err_ptr,
    grp_err_ptr, T, rank, dst_parity_stride, dst_rank_stride, dst_row_stride, NUM_PUB,
    N: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    # Sticky: after a timeout of this workspace or of any of its group's, never write into a
    # peer again.
    if _failed(err_ptr, grp_err_ptr):
        return
    i_d = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    e, parity = _call_epoch(epoch_ptr)

    dst = tl.multiple_of(tl.load(peer_dst_ptrs + i_d).to(src_ptr.dtype), 16)  # 16-byte aligned
    dst_sig = tl.load(peer_sig_ptrs + i_d).to(tl.pointer_type(tl.int64))
    # ``rank`` and ``dst_rank_stride`` (T*D for the KV gather) arrive as i32: widen before the
    # product, which passes 2**31 for a slot of more than 2**31 elements (``parity`` is int64).
    base = parity * dst_parity_stride + tl.cast(rank, tl.int64) * dst_rank_stride
    o_w = tl.arange(0, BLOCK_W)
    for t32 in range(i_p, T, NUM_PUB):
        t = tl.cast(t32, tl.int64)
        for c in range(0, W, BLOCK_W):
            idx = c + o_w
            m = idx < W
            x = tl.load(src_ptr + t * stride_src_t + idx, mask=m)
            tl.store(dst + base + t * dst_row_stride + idx, x, mask=m)

    _publish_done(counter_ptr + i_d, dst_sig + parity * N + rank, e, NUM_PUB)


@triton.jit
def _direct_gather_wait_kernel(
    sig_ptr, epoch_ptr, done_ptr, err_ptr, grp_err_ptr, slot_ptr, dst_ptr, num_elems,
    slot_parity_stride, max_spins, num_programs,
    N: tl.constexpr, N_POW2: tl.constexpr, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr,
    NAN_BITS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    e, parity = _call_epoch(epoch_ptr)
    ok = _checked_wait(sig_ptr + parity * N, err_ptr, grp_err_ptr, e, max_spins, N, N_POW2)
    if HAS_COPY:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < tl.where(ok, num_elems, 0)  # nothing is read after a timeout
        x = tl.load(slot_ptr + parity * slot_parity_stride + offs, mask=m, cache_modifier=".cg")
        tl.store(dst_ptr + offs, x, mask=m)
    if ok == 0:
        # Mark the output instead of leaving the previous call's finite data in it: the host
        # learns of the failure only later. Only here does a lone program (query gather) loop.
        # The step in int64: num_programs * BLOCK passes 2**31 for a slot of that many
        # elements, and a wrapped (negative) step would end the loop at once (or never).
        for start in range(pid * BLOCK, num_elems, tl.cast(num_programs, tl.int64) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            _store_nan_bits(dst_ptr, offs, offs < num_elems, NAN_BITS)
    _wait_done(done_ptr, epoch_ptr, e, num_programs)
