"""``merge_attn_states``: exact N-way merge of partial attention states: the typed launcher
``merge_attn_states_fwd``, the ``cpattn_common::merge_attn_states`` op and the public function
(``lse.merge_attn_states_torch`` where Triton cannot run).
"""

from __future__ import annotations

import functools

import torch
import triton

from cpattn_common.alloc import new_output
from cpattn_common.checks import check_bool
from cpattn_common.device import foreign_cuda_device
from cpattn_common.dispatch import must_dispatch
from cpattn_common.kernels.merge_attn_states import _merge_attn_states_fwd_kernel
from cpattn_common.launch import CachedKernel, Specialization
from cpattn_common.lse import LSE_DTYPES, OUT_DTYPES, merge_attn_states_torch
from cpattn_common.lse import validate_merge_inputs as _validate

__all__ = [
    "merge_attn_states",
    "merge_attn_states_block_sizes",
    "merge_attn_states_config",
    "merge_attn_states_fwd",
    "triton_usable",
]

_OUT_SET = frozenset(OUT_DTYPES)
_LSE_SET = frozenset(LSE_DTYPES)
_Tensor = torch.Tensor
# Grids under this many programs (4 per H200 SM) are latency-bound: tiles shrink.
_MIN_PROGRAMS = 4 * 132
# One-head decode grids up to this size use EAGER loads and 2 lanes per thread at D >= 512
# (docs/design.md, "Tile rules").
_EAGER_MAX_PROGRAMS = 8 * 132
_EAGER_BY_DEFAULT = True
_SMALL_GRID_LANES = 2
_SMALL_GRID_MAX_WARPS = 4
_SMALL_GRID_MIN_D = 512
# Shrunk decode tiles of several heads use EAGER up to 1 KiB per source, 8 bytes per thread.
_MULTI_EAGER_MAX_BYTES = 1024
_MULTI_EAGER_THREAD_BYTES = 8
_MULTI_EAGER_MAX_WARPS = 4
# Elements per program of large grids (two 16-byte vectors per thread) at D >= 128, half below.
_BIG_TILE = 4096
_BIG_TILE_MIN_D = 128

_merge_kernel = CachedKernel(_merge_attn_states_fwd_kernel)


# Whether @triton.jit gave the merge kernel to Triton's interpreter.
_INTERPRETED = not isinstance(_merge_attn_states_fwd_kernel, triton.runtime.JITFunction)


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernel can run for tensors on ``device``: CUDA, or the CPU where the
    kernel was decorated under Triton's interpreter (``cpattn_common.interpret``)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and _INTERPRETED


@functools.lru_cache(maxsize=256)
def merge_attn_states_block_sizes(num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """Large-batch tile choice for 16-bit partials: ``(BLOCK_H, BLOCK_D, num_warps)``."""
    block_h, block_d, num_warps, _ = merge_attn_states_config(_MIN_PROGRAMS, num_heads, head_dim, 2)
    return block_h, block_d, num_warps


@functools.lru_cache(maxsize=4096)
def merge_attn_states_config(
    batch: int, num_heads: int, head_dim: int, elem_size: int
) -> tuple[int, int, int, bool]:
    """Autotune-free launch configuration: ``(BLOCK_H, BLOCK_D, num_warps, EAGER)``.

    ``BLOCK_D`` is the next power of two >= ``head_dim`` (masked); large grids take tiles of
    ``_BIG_TILE`` elements, decode grids shrink them and may use ``EAGER`` (every load issued
    up front) by the rules of the constants above; every other grid uses weight-gated loads.
    """
    block_d = triton.next_power_of_2(max(head_dim, 1))
    vec = max(1, 16 // max(elem_size, 1))
    tile = _BIG_TILE if block_d >= _BIG_TILE_MIN_D else _BIG_TILE // 2
    block_h = max(1, min(triton.next_power_of_2(max(num_heads, 1)), tile // block_d))
    per_thread = 2 * vec
    shrunk = False
    while block_h > 1 and batch * triton.cdiv(num_heads, block_h) < _MIN_PROGRAMS:
        block_h //= 2
        per_thread = vec
        shrunk = True
    vectors = max(1, block_h * block_d // per_thread)
    num_warps = max(1, min(8, triton.next_power_of_2(triton.cdiv(vectors, 32))))
    one_head_decode = block_h == 1 and batch * num_heads <= _EAGER_MAX_PROGRAMS
    if one_head_decode and _SMALL_GRID_LANES and block_d >= _SMALL_GRID_MIN_D:
        warps = triton.next_power_of_2(triton.cdiv(block_d, 32 * _SMALL_GRID_LANES))
        num_warps = max(num_warps, min(_SMALL_GRID_MAX_WARPS, warps))
    tile_bytes = block_h * block_d * elem_size  # per source
    multi_head_eager = (
        _EAGER_BY_DEFAULT and shrunk and block_h > 1 and tile_bytes <= _MULTI_EAGER_MAX_BYTES
    )
    if multi_head_eager:
        warps = triton.next_power_of_2(triton.cdiv(tile_bytes, 32 * _MULTI_EAGER_THREAD_BYTES))
        num_warps = max(1, min(_MULTI_EAGER_MAX_WARPS, warps))
    eager = _EAGER_BY_DEFAULT and (one_head_decode or multi_head_eager)
    return block_h, block_d, num_warps, eager


# The kernel's tile holds BLOCK_D = next_pow2(D) lanes of a row, and Triton caps a tile at 2**20
# elements: wider heads take the torch twin (the cp-dcp kernels loop over D instead).
_MAX_KERNEL_D = triton.language.TRITON_MAX_TENSOR_NUMEL


def _valid_cuda(partial_outs: torch.Tensor, partial_lses: torch.Tensor) -> bool:
    """Cheap check: plain CUDA tensors on one device that ``_validate`` would accept, without
    the negative bit. False means "not proven": the caller runs ``_validate``."""
    if partial_outs.__class__ is not _Tensor or partial_lses.__class__ is not _Tensor:
        return False
    shape = partial_outs.shape
    return (
        partial_outs.is_cuda
        and len(shape) == 4
        and partial_lses.shape == shape[:3]
        and shape[0] >= 1
        and 1 <= shape[3] <= _MAX_KERNEL_D
        and partial_outs.dtype in _OUT_SET
        and partial_lses.dtype in _LSE_SET
        and partial_lses.get_device() == partial_outs.get_device()
        and not partial_outs.is_neg()
        and not partial_lses.is_neg()
    )


def _resolved(
    partial_outs: torch.Tensor, partial_lses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs with their values in memory: a negated copy of a tensor with torch's
    negative bit (the kernel reads memory; the dispatcher would resolve it too)."""
    if partial_outs.is_neg():
        partial_outs = partial_outs.resolve_neg()
    if partial_lses.is_neg():
        partial_lses = partial_lses.resolve_neg()
    return partial_outs, partial_lses


def merge_attn_states_fwd(
    partial_outs: torch.Tensor,
    partial_lses: torch.Tensor,
    *,
    is_lse_base_on_e: bool = True,
    eager: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed launcher of the Triton merge kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``).

    Args:
        partial_outs: ``[N, B, H, D]`` fp16/bf16/fp32, any strides.
        partial_lses: ``[N, B, H]`` fp32/fp16/bf16, any strides.
        is_lse_base_on_e: LSE base e (True) or 2 (False).
        eager: load every partial unconditionally (True) or only where its weight is nonzero
            (False); ``None``: ``merge_attn_states_config``'s choice. Same results either way.

    Returns:
        ``(out [B, H, D]`` in ``partial_outs.dtype``, ``lse [B, H]`` fp32), both contiguous.

    Raises:
        ValueError: as ``merge_attn_states``; ``D`` past the kernel's tile limit (2**20).
    """
    if not _valid_cuda(partial_outs, partial_lses):
        _validate(partial_outs, partial_lses)
        if partial_outs.shape[3] > _MAX_KERNEL_D:
            raise ValueError(
                f"merge_attn_states_fwd: partial_outs has head_dim {partial_outs.shape[3]} > "
                f"{_MAX_KERNEL_D}, the kernel's tile limit (merge_attn_states takes it)"
            )
        partial_outs, partial_lses = _resolved(partial_outs, partial_lses)
    return _launch(partial_outs, partial_lses, bool(is_lse_base_on_e), eager)


@functools.lru_cache(maxsize=1024)
def _specialization(
    n: int, d: int, cfg: tuple[int, int, int, bool], vec: int, d_contig: bool, base_e: bool,
    eager: bool | None,
) -> Specialization:  # fmt: skip
    """The merge kernel specialized for one configuration (shared by batch sizes)."""
    block_h, block_d, num_warps, eager_cfg = cfg
    return _merge_kernel.specialize(
        N=n,
        D=d,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        VEC=vec,
        D_CONTIG=d_contig,
        EAGER=eager_cfg if eager is None else bool(eager),
        IS_BASE_E=base_e,
        num_warps=num_warps,
    )


def _launch(
    po: torch.Tensor, pl: torch.Tensor, base_e: bool, eager: bool | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the outputs and launch; inputs already validated."""
    if (index := foreign_cuda_device(po)) >= 0:
        with torch.cuda.device(index):
            return _launch(po, pl, base_e, eager)
    n, b, h, d = po.shape
    out = new_output(po, (b, h, d))
    out_lse = new_output(pl, (b, h), torch.float32)
    if b == 0 or h == 0:
        return out, out_lse
    es = po.element_size()
    s_n, s_b, s_h, s_d = po.stride()
    # Strides of size-1 dims are never used: 0 keeps them from limiting the vector width.
    if n == 1:
        s_n = 0
    if b == 1:
        s_b = 0
    if h == 1:
        s_h = 0
    # Widest power-of-two element count (<= 16 bytes) dividing the row strides, the kernel's
    # stride unit: 16-byte loads whenever possible.
    vec = 16 // es
    bits = s_n | s_b | s_h
    if bits & (vec - 1):
        vec = bits & -bits
    l_n, l_b, l_h = pl.stride()
    cfg = merge_attn_states_config(
        b if b <= _EAGER_MAX_PROGRAMS else _EAGER_MAX_PROGRAMS + 1, h, d, es
    )  # b only matters up to there: fewer cache entries
    block_h = cfg[0]
    spec = _specialization(n, d, cfg, vec, s_d == 1 or d == 1, base_e, eager)
    spec(
        (b, (h + block_h - 1) // block_h),
        out,
        out_lse,
        po,
        pl,
        h,
        s_n // vec,
        s_b // vec,
        s_h // vec,
        s_d,
        l_n,
        l_b,
        l_h,
    )
    return out, out_lse


def _merge_any_backend(
    partial_outs: torch.Tensor, partial_lses: torch.Tensor, is_lse_base_on_e: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if _valid_cuda(partial_outs, partial_lses):  # the hot path: validated once, cheaply
        return _launch(partial_outs, partial_lses, is_lse_base_on_e, None)
    _validate(partial_outs, partial_lses)
    if triton_usable(partial_outs.device) and partial_outs.shape[3] <= _MAX_KERNEL_D:
        partial_outs, partial_lses = _resolved(partial_outs, partial_lses)
        return _launch(partial_outs, partial_lses, is_lse_base_on_e, None)
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
        partial_outs: ``[N, B, H, D]`` partial outputs, fp16/bf16/fp32, any strides, N >= 1,
            D >= 1 (past 2**20, the kernel's tile limit, the torch twin computes it).
        partial_lses: ``[N, B, H]`` LSEs of the partials, fp32/fp16/bf16, any strides.
        is_lse_base_on_e: True for natural-log LSEs, False for base-2 LSEs.
        return_lse: also return the merged LSE.

    Returns:
        ``out [B, H, D]`` in ``partial_outs.dtype``; with ``return_lse`` also
        ``lse [B, H]`` fp32 (same base as the input).

    Raises:
        TypeError: non-tensor inputs, dtypes other than the ones above, an
            ``is_lse_base_on_e`` or ``return_lse`` that is not a bool.
        ValueError: shapes that are not ``[N, B, H, D]`` / ``[N, B, H]`` or disagree, N = 0,
            D = 0 (the message names the shape), tensors on different devices.

    Inference only (no autograd formula): see ``cpattn_common.dispatch``.

    Example:
        >>> outs = torch.randn(4, 2, 8, 64)          # N=4 shards, B=2 rows, H=8, D=64
        >>> lses = torch.randn(4, 2, 8)
        >>> out, lse = merge_attn_states(outs, lses, return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([2, 8, 64]), torch.Size([2, 8]))
    """
    is_lse_base_on_e = check_bool("is_lse_base_on_e", is_lse_base_on_e)
    return_lse = check_bool("return_lse", return_lse)
    if must_dispatch(partial_outs, partial_lses):  # tracing, a dispatch mode, autograd
        # Our TypeError for non-tensors, not the dispatcher's schema RuntimeError.
        if not all(isinstance(t, torch.Tensor) for t in (partial_outs, partial_lses)):
            _validate(partial_outs, partial_lses)
        out, lse = torch.ops.cpattn_common.merge_attn_states(
            partial_outs, partial_lses, is_lse_base_on_e
        )
    else:  # plain eager: nothing listens to the dispatcher, so skip it
        out, lse = _merge_any_backend(partial_outs, partial_lses, is_lse_base_on_e)
    return (out, lse) if return_lse else out
