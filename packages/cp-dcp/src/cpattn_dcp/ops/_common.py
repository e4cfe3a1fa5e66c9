"""Validation helpers and launch heuristics shared by the DCP combine ops.

Everything here is host-side and cheap: shape/dtype/device checks read tensor metadata only
(no ``.item()``, no device sync) and the tile heuristic is memoised per shape.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from cpattn_common.checks import check_state, host_checkable, is_index_dtype
from cpattn_common.interpret import triton_interpreting
from cpattn_common.launch import CachedKernel, Specialization

__all__ = [
    "LSE_DTYPES",
    "MIN_PROGRAMS",
    "NATIVE_INDEX_DTYPES",
    "OUT_DTYPES",
    "check_lse_dtype",
    "check_mask_args",
    "check_out_dtype",
    "contiguous",
    "mask_args_proven",
    "next_pow2",
    "search_steps",
    "shares_elements",
    "specialize",
    "tile_config",
]

#: Output (partial attention) dtypes every combine kernel supports.
OUT_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16, torch.float32})
#: LSE dtypes every combine kernel reads (converted to fp32 inside the kernels).
LSE_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16, torch.float32})

# Bytes one program moves per direction (read or write); 16 KiB keeps plenty of 16-byte
# vector accesses in flight per SM while the register tile stays small.
_TARGET_BYTES = 16384
# Below this many programs, shrink the row tile so that small (decode) batches still spread
# over the SMs (an H200 has 132); each program then moves at least one head row.
# Under TRITON_INTERPRET=1 (CPU tests) every program is interpreted one by one: use the
# largest tile instead so that tests stay fast.
MIN_PROGRAMS = 1 if triton_interpreting() else 264
_MAX_BLOCK_R = 64


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous (no dispatcher call: a per-call host path), else a
    contiguous copy."""
    return t if t.is_contiguous() else t.contiguous()


@functools.lru_cache(maxsize=1024)
def _specialize(kernel: CachedKernel, consts: tuple[tuple[str, Any], ...]) -> Specialization:
    return kernel.specialize(**dict(consts))


def specialize(kernel: CachedKernel, **consts: Any) -> Specialization:
    """``kernel.specialize(**consts)``, memoised on ``consts``: one specialization (and its
    compiled handles) per configuration, shared by every batch size that maps to it."""
    return _specialize(kernel, tuple(consts.items()))


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)``."""
    return 1 << (max(n, 1) - 1).bit_length()


def search_steps(num_seqs: int) -> int:
    """Binary-search steps over ``num_seqs`` sorted boundaries: ``log2(next_pow2(R + 1))``."""
    return num_seqs.bit_length()


def _block_d(head_dim: int) -> int:
    """Power-of-two head-dim chunk: all of ``D``, else its largest power-of-two divisor if
    >= 64 (576 -> 64), else the largest power of two padding ``D`` by at most 1/8."""
    divisor = head_dim & -head_dim
    if divisor == head_dim or divisor >= 64:
        return min(divisor, 1024)
    block = next_pow2(head_dim)
    while block > 16:
        padded = -(-head_dim // block) * block
        if (padded - head_dim) * 8 <= head_dim:
            return block
        block //= 2
    return 16


@functools.lru_cache(maxsize=4096)
def tile_config(
    num_rows: int, head_dim: int, elem_size: int, target_bytes: int = _TARGET_BYTES
) -> tuple[int, int, int]:
    """Pick ``(BLOCK_R, BLOCK_D, num_warps)`` for a row-tiled kernel over ``[rows, D]``.

    Args:
        num_rows: rows (flattened (token, head) pairs) the grid covers.
        head_dim: D.
        elem_size: bytes per element of the payload.
        target_bytes: bytes one program should read (per source).

    Returns:
        ``BLOCK_R`` rows per program (power of two), ``BLOCK_D`` head-dim chunk (power of
        two) and ``num_warps`` (about two 16-byte vectors per thread per chunk).
    """
    block_d = _block_d(head_dim)
    padded = -(-head_dim // block_d) * block_d
    block_r = 1
    while block_r * 2 * padded * elem_size <= target_bytes and block_r < _MAX_BLOCK_R:
        block_r *= 2
    # A chunked head dim (576 = 9 x 64) gets taller tiles so that each chunk still spans
    # about 2048 elements (several warps) instead of one warp looping over many chunks.
    while padded > block_d and block_r * block_d < 2048 and block_r < _MAX_BLOCK_R:
        block_r *= 2
    while block_r > 1 and -(-num_rows // block_r) < MIN_PROGRAMS:
        block_r //= 2
    vec = max(1, 16 // elem_size)
    per_warp = vec * 32 * 2
    num_warps = 1
    while num_warps < 8 and num_warps * per_warp < block_r * block_d:
        num_warps *= 2
    return block_r, block_d, num_warps


def _check_float_dtype(name: str, t: torch.Tensor, allowed: frozenset[torch.dtype]) -> None:
    dtype = t.dtype
    if dtype not in allowed:
        if not dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32), got {dtype}")
        raise ValueError(f"{name} dtype {dtype} is not supported (fp16, bf16 or fp32)")


def check_out_dtype(name: str, t: torch.Tensor) -> None:
    """``TypeError`` for a non-floating ``t``, ``ValueError`` for an unsupported float dtype."""
    _check_float_dtype(name, t, OUT_DTYPES)


def check_lse_dtype(name: str, t: torch.Tensor) -> None:
    """``TypeError`` for a non-floating LSE, ``ValueError`` for an unsupported float dtype."""
    _check_float_dtype(name, t, LSE_DTYPES)


def shares_elements(t: torch.Tensor) -> bool:
    """Whether a dim of size > 1 has stride 0 (an expanded view): then an in-place kernel
    would write several logical elements to one address. torch's in-place ops refuse the
    same case (``has_internal_overlap`` says YES); plain shapes and strides, so traceable."""
    return any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride(), strict=True))


_Tensor = torch.Tensor

#: The index dtypes of the cheap eager checks (``mask_args_proven``) and those the direct A2A's
#: kernel reads as they are (it widens the others to int32 on the device); the ops' kernels
#: read every ``INDEX_DTYPES`` member as it is.
NATIVE_INDEX_DTYPES: frozenset[torch.dtype] = frozenset({torch.int32, torch.int64})


def mask_args_proven(
    lse: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> bool:
    """Cheap form of ``check_mask_args`` with both index tensors given (the per-call host
    path): plain 1-D int32/int64 tensors, ``len(query_start_loc) == len(seq_lens) + 1``, on
    ``lse``'s device. True means ``check_mask_args`` accepts them; False means "not proven"
    (run it: the other ``INDEX_DTYPES`` are accepted there too, and check mode reads the
    values there)."""
    dev = lse.device
    return (
        not check_state.enabled
        and seq_lens.__class__ is _Tensor
        and query_start_loc.__class__ is _Tensor
        and seq_lens.dim() == 1
        and query_start_loc.dim() == 1
        and query_start_loc.shape[0] == seq_lens.shape[0] + 1
        and seq_lens.dtype in NATIVE_INDEX_DTYPES
        and query_start_loc.dtype in NATIVE_INDEX_DTYPES
        and seq_lens.device == dev
        and query_start_loc.device == dev
    )


def check_mask_args(
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    device: torch.device,
    num_rows: int | None = None,
) -> bool:
    """Validate the empty-shard mask arguments; return whether masking is on.

    The one check of ``seq_lens`` / ``query_start_loc`` that every op taking them applies
    (``mask_dcp_empty_shards_``, the AG+RS / AG+AR / A2A combines, ``a2a_pack`` and the direct
    A2A), so that a bad argument gets the same error on every path.

    Args:
        seq_lens: ``[R]`` local KV lengths, or ``None``.
        query_start_loc: ``[R + 1]`` query offsets, or ``None``.
        device: the device both must be on (the LSE's).
        num_rows: ``B``, the LSE's rows (check mode: ``query_start_loc[R] <= B``).

    Returns:
        False when both are ``None`` (masking off), True when both are valid.

    Raises:
        ValueError: exactly one is ``None``; they are not 1-D;
            ``len(query_start_loc) != len(seq_lens) + 1``; one is not on ``device``.
        TypeError: one is not a tensor, or its dtype is not an integer dtype
            (``INDEX_DTYPES``: bool, floating, complex, quantized and sub-byte dtypes are not).
        ValueError: (check mode, ``cpattn_common.checks``) a negative ``seq_lens`` entry, a
            negative or decreasing ``query_start_loc``, or ``query_start_loc[R] > num_rows``.

    Metadata only (any strides are fine: the launchers make them contiguous): no device work,
    CUDA-graph safe, except in check mode (one host read of both tensors). The eager ops prove the common case with ``mask_args_proven`` first and
    run this only when that fails (other index dtypes, bad input, tracing).
    """
    if seq_lens is None and query_start_loc is None:
        return False
    if seq_lens is None or query_start_loc is None:
        raise ValueError("seq_lens and query_start_loc must be provided together")
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if seq_lens.dim() != 1 or query_start_loc.dim() != 1:
        raise ValueError(
            f"seq_lens and query_start_loc must be 1-D, got shapes {tuple(seq_lens.shape)} and "
            f"{tuple(query_start_loc.shape)}"
        )
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            "query_start_loc must contain one boundary per sequence: got "
            f"{query_start_loc.shape[0]} boundaries for {seq_lens.shape[0]} sequences "
            f"(len(seq_lens) + 1 = {seq_lens.shape[0] + 1} expected)"
        )
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if not is_index_dtype(t.dtype):
            raise TypeError(
                f"{name} must be an integer tensor (int8/16/32/64 or uint8/16/32/64), got {t.dtype}"
            )
    if seq_lens.device != device or query_start_loc.device != device:
        raise ValueError(
            f"seq_lens ({seq_lens.device}) and query_start_loc ({query_start_loc.device}) must "
            f"be on the LSE's device {device}"
        )
    if check_state.enabled and host_checkable():
        _check_mask_values(seq_lens, query_start_loc, num_rows)
    return True


def _check_mask_values(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_rows: int | None
) -> None:
    """Check mode: the values of the mask arguments, read on the host."""
    lens = seq_lens.to(torch.int64).tolist()
    qsl = query_start_loc.to(torch.int64).tolist()
    if (i := next((i for i, v in enumerate(lens) if v < 0), -1)) >= 0:
        raise ValueError(f"seq_lens[{i}] = {lens[i]}: lengths must be >= 0 (check mode)")
    if qsl[0] < 0:
        raise ValueError(f"query_start_loc[0] = {qsl[0]}: offsets must be >= 0 (check mode)")
    if (i := next((i for i in range(1, len(qsl)) if qsl[i] < qsl[i - 1]), -1)) >= 0:
        raise ValueError(
            f"query_start_loc decreases at index {i} ({qsl[i - 1]} -> {qsl[i]}): it must be "
            "non-decreasing (check mode)"
        )
    if num_rows is not None and qsl[-1] > num_rows:
        raise ValueError(
            f"query_start_loc[{len(qsl) - 1}] = {qsl[-1]} is beyond the batch of {num_rows} "
            "rows (check mode)"
        )
