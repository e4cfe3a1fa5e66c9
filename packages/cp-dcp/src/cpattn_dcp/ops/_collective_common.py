"""Shared validation and call type of the collective combine ops (AG+RS, AG+AR, A2A)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol, cast, overload

import torch

from cpattn_common.agreement import check_ranks_agree
from cpattn_common.checks import check_bool, check_no_neg_bit, check_positive_int, check_state
from cpattn_common.dispatch import must_dispatch
from cpattn_common.group import CPGroupLike, trace_time_group
from cpattn_dcp.comm.groups import (
    group_from_token,
    group_rank,
    group_token,
    group_world_size,
    resolve_group,
)
from cpattn_dcp.context import CPTritonContext
from cpattn_dcp.ops._common import (
    LSE_DTYPES,
    OUT_DTYPES,
    check_lse_dtype,
    check_mask_args,
    check_out_dtype,
    mask_args_proven,
)

__all__ = [
    "CombineOp",
    "check_combine_agreement",
    "combine_op",
    "register_combine_op",
    "run_combine",
    "validate_combine_args",
]

_Tensor = torch.Tensor


class CombineOp(Protocol):
    """Call type of ``cp_lse_ag_out_rs``, ``cp_lse_ag_out_ar`` and ``dcp_a2a_lse_reduce``:
    ``return_lse=True`` returns ``(out, lse)``, otherwise ``out`` (vLLM's parameters)."""

    @overload
    def __call__(
        self,
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
    def __call__(
        self,
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
    def __call__(
        self,
        cp_attn_out: torch.Tensor,
        cp_attn_lse: torch.Tensor,
        cp_group: Any,
        ctx: CPTritonContext | None = None,
        return_lse: bool = False,
        is_lse_base_on_e: bool = True,
        seq_lens: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def combine_op(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]) -> CombineOp:
    """Decorator: type a combine entry point as ``CombineOp`` (the function is unchanged; its
    one signature returns the union, the protocol's overloads narrow it by ``return_lse``)."""
    return cast(CombineOp, fn)


_Fwd = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def register_combine_op(
    name: str, fwd: _Fwd, *, split_heads: bool, fp32_lse: bool, **kw: Any
) -> None:
    """Register ``cpattn_dcp::<name>``, running ``fwd(out, lse, group, ..., **kw)``, with its
    fake; the group travels as a string token (custom ops take no ProcessGroup). The op returns
    ``(out, lse)``, the LSE empty without ``return_lse``."""

    def lse_dtype(cp_attn_lse: torch.Tensor) -> torch.dtype:
        return torch.float32 if fp32_lse else cp_attn_lse.dtype

    @torch.library.custom_op(f"cpattn_dcp::{name}", mutates_args=())
    def op(
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
        out, lse = fwd(
            cp_attn_out,
            cp_attn_lse,
            group_from_token(group_tok),
            return_lse=return_lse,
            is_lse_base_on_e=is_lse_base_on_e,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            **kw,
        )
        if lse is None:
            lse = cp_attn_lse.new_empty((0,), dtype=lse_dtype(cp_attn_lse))
        return out, lse

    @op.register_fake
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
        hh = h // world_size if split_heads else h
        lse_shape = (b, hh) if return_lse else (0,)
        return cp_attn_out.new_empty((b, hh, d)), cp_attn_lse.new_empty(
            lse_shape, dtype=lse_dtype(cp_attn_lse)
        )


def run_combine(
    name: str,
    fwd: _Fwd,
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_group: Any,
    return_lse: bool,
    is_lse_base_on_e: bool,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    *,
    heads_divisible: bool,
    **kw: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The body of a combine entry point: check the flags; traced, validate and call the
    registered op ``name`` with the group as (token, world size, rank); eager, resolve the
    group, validate, compare the call across ranks in check mode and run ``fwd``."""
    is_lse_base_on_e = check_bool("is_lse_base_on_e", is_lse_base_on_e)
    return_lse = check_bool("return_lse", return_lse)
    if must_dispatch(cp_attn_out, cp_attn_lse):  # tracing, a dispatch mode, autograd
        group = trace_time_group(cp_group)  # a CPGroup's process group: see trace_time_group
        n = group_world_size(group)
        validate_combine_args(
            name, cp_attn_out, cp_attn_lse, n, seq_lens, query_start_loc,
            heads_divisible=heads_divisible,
        )  # fmt: skip
        out, lse_or_empty = getattr(torch.ops.cpattn_dcp, name)(
            cp_attn_out,
            cp_attn_lse,
            group_token(group),
            n,
            group_rank(group),
            bool(return_lse),
            bool(is_lse_base_on_e),
            seq_lens,
            query_start_loc,
        )
        return (out, lse_or_empty) if return_lse else out
    cp = resolve_group(cp_group)
    validate_combine_args(
        name, cp_attn_out, cp_attn_lse, cp.world_size, seq_lens, query_start_loc,
        heads_divisible=heads_divisible,
    )  # fmt: skip
    if check_state.enabled:  # check mode: the ranks' calls agree
        check_combine_agreement(
            name, cp, cp_attn_out, cp_attn_lse, return_lse, is_lse_base_on_e, seq_lens
        )
    out, lse = fwd(
        cp_attn_out,
        cp_attn_lse,
        cp,
        return_lse=bool(return_lse),
        is_lse_base_on_e=bool(is_lse_base_on_e),
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        **kw,
    )
    if return_lse:
        assert lse is not None
        return out, lse
    return out


def _valid_cuda(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    world_size: int,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    heads_divisible: bool,
) -> bool:
    """Cheap check (the per-call host path): plain CUDA tensors on one device that the
    detailed checks below accept. False means "not proven", never "invalid"."""
    if (
        cp_attn_out.__class__ is not _Tensor
        or cp_attn_lse.__class__ is not _Tensor
        or type(world_size) is not int
        or world_size < 1
        or not cp_attn_out.is_cuda
    ):
        return False
    o = cp_attn_out.shape
    lse_shape = cp_attn_lse.shape
    dev = cp_attn_out.get_device()
    if not (
        len(o) == 3
        and len(lse_shape) == 2
        and lse_shape[0] == o[0]
        and lse_shape[1] == o[1]
        and o[2] > 0
        and (not heads_divisible or o[1] % world_size == 0)
        and cp_attn_out.dtype in OUT_DTYPES
        and cp_attn_lse.dtype in LSE_DTYPES
        and cp_attn_lse.is_cuda
        and cp_attn_lse.get_device() == dev
        and not cp_attn_out.is_neg()
        and not cp_attn_lse.is_neg()
    ):
        return False
    if seq_lens is None or query_start_loc is None:
        return seq_lens is None and query_start_loc is None
    return mask_args_proven(cp_attn_lse, seq_lens, query_start_loc)


def validate_combine_args(
    op: str,
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    world_size: int,
    seq_lens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    *,
    heads_divisible: bool,
) -> bool:
    """Check shapes/dtypes/devices of a combine call; return whether masking is on."""
    # Traced code (torch.compile) takes the detailed checks: they run once, at trace time.
    if not torch.compiler.is_compiling() and _valid_cuda(
        cp_attn_out, cp_attn_lse, world_size, seq_lens, query_start_loc, heads_divisible
    ):
        return seq_lens is not None
    # A group's world size is valid; a2a_pack's cp_world_size is the caller's number.
    check_positive_int("cp_world_size", world_size)
    if not isinstance(cp_attn_out, torch.Tensor) or not isinstance(cp_attn_lse, torch.Tensor):
        raise TypeError(
            f"{op}: cp_attn_out and cp_attn_lse must be tensors, got "
            f"{type(cp_attn_out).__name__} and {type(cp_attn_lse).__name__}"
        )
    check_no_neg_bit(op, cp_attn_out=cp_attn_out, cp_attn_lse=cp_attn_lse)
    if cp_attn_out.dim() != 3:
        raise ValueError(
            f"{op}: expected cp_attn_out [B, H, D], got shape {tuple(cp_attn_out.shape)}"
        )
    if cp_attn_lse.dim() != 2:
        raise ValueError(f"{op}: expected cp_attn_lse [B, H], got shape {tuple(cp_attn_lse.shape)}")
    b, h, d = cp_attn_out.shape
    lse_shape = cp_attn_lse.shape
    if lse_shape[0] != b or lse_shape[1] != h:
        raise ValueError(
            f"{op}: cp_attn_out {tuple(cp_attn_out.shape)} and cp_attn_lse "
            f"{tuple(cp_attn_lse.shape)} disagree on [B, H]"
        )
    if d == 0:
        raise ValueError(f"{op}: cp_attn_out {tuple(cp_attn_out.shape)} has head_dim 0; D >= 1")
    if cp_attn_out.dtype not in OUT_DTYPES:
        check_out_dtype("cp_attn_out", cp_attn_out)
    if cp_attn_lse.dtype not in LSE_DTYPES:
        check_lse_dtype("cp_attn_lse", cp_attn_lse)
    if cp_attn_out.device != cp_attn_lse.device:
        raise ValueError(
            f"{op}: cp_attn_out is on device {cp_attn_out.device} but cp_attn_lse is on "
            f"device {cp_attn_lse.device}"
        )
    if heads_divisible and h % world_size != 0:
        raise ValueError(f"{op}: H={h} must be divisible by DCP world size {world_size}.")
    return check_mask_args(seq_lens, query_start_loc, cp_attn_lse.device, b)


def check_combine_agreement(
    op: str,
    group: CPGroupLike,
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    return_lse: bool,
    is_lse_base_on_e: bool,
    seq_lens: torch.Tensor | None,
) -> None:
    """Check mode (``cpattn_common.checks``): compare a validated combine call across the
    group's ranks (``check_ranks_agree``: every rank raises, naming the rank and the field).
    One attribute read outside check mode."""
    if not check_state.enabled:
        return
    b, h, d = cp_attn_out.shape
    fields = {
        "world size": group.world_size,
        "cp_attn_out.shape[0] (B)": b,
        "cp_attn_out.shape[1] (H)": h,
        "cp_attn_out.shape[2] (D)": d,
        "cp_attn_out.dtype": cp_attn_out.dtype,
        "cp_attn_lse.dtype": cp_attn_lse.dtype,
        "return_lse": return_lse,
        "is_lse_base_on_e": is_lse_base_on_e,
        "mask given (seq_lens)": seq_lens is not None,
        "len(seq_lens)": -1 if seq_lens is None else seq_lens.shape[0],
    }
    check_ranks_agree(op, group, cp_attn_out.device, fields)
