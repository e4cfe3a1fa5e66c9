"""API fuzz: a bad argument to any public op raises ``ValueError`` or ``TypeError`` from our
code, with a message that names the argument, before any work; never an error from inside
torch or Triton, and never a result.

Each op has a valid call and, per argument, bad replacements: wrong types (``None``, a number,
a string, a list), wrong ranks and dtypes, another device (``meta``), overlapping memory, out
of range and string numbers (``"4"``), hypothesis drawing the argument, the replacement and
any number in it. One argument is bad per call, so the message must name that one. Every
op's examples are bounded (``EXAMPLES``) and run on the CPU without kernels: each call raises
in its checks. Lives here because it calls every package.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpattn_common
import cpattn_dcp
import cpattn_pcp
from cpattn_dcp.direct.factories import (
    direct_a2a_unavailable_reason,
    direct_gather_unavailable_reason,
)
from cpattn_testing.simulated import SimulatedWorld

#: Examples per op (the run's case count is EXAMPLES times len(OPS)).
EXAMPLES = 100
F32, I32 = torch.float32, torch.int32


@dataclass(frozen=True)
class M:
    """A replacement computed from the valid value and the other arguments."""

    fn: Callable[[Any, dict[str, Any]], Any]


def _rank_changed(t: torch.Tensor, extra: int) -> torch.Tensor:
    """``t`` with one more dim (of size 3) or ``-extra`` dims fewer."""
    if extra > 0:
        return t.unsqueeze(-1).expand(*t.shape, 3).contiguous()
    return t.reshape(-1)[0] if t.dim() <= -extra else t[(0,) * -extra]


NOT_TENSORS = [None, 3, 2.5, "x", [1.0, 2.0]]
RANKS = [M(lambda t, _: _rank_changed(t, 1)), M(lambda t, _: _rank_changed(t, -1))]
META = M(lambda t, _: torch.empty(t.shape, dtype=t.dtype, device="meta"))
FLOAT = [*NOT_TENSORS, *RANKS, M(lambda t, _: t.to(I32)), M(lambda t, _: t.to(torch.bool))]
INDEX = [*NOT_TENSORS[1:], *RANKS, M(lambda t, _: t.float()), M(lambda t, _: t.bool())]
BOOL = [None, "False", 1, 0.0]
DTYPE = ["bf16", None, 1]
DEVICE = ["cdua", "cuda:x", 3]
# A device this process lacks: an error where the device is used, "not available" (None) for
# the automatic direct paths.
MISSING = [] if torch.cuda.is_available() else ["cuda"]


def ints(low_bad: int = 0, high_bad: int | None = None, optional: bool = False) -> list[Any]:
    """Bad values of an int argument valid in ``(low_bad, high_bad)``: string and float
    numbers, bools, ``None`` (unless ``optional``) and out-of-range ints (drawn)."""
    bad: list[Any] = ["4", 4.0, True, st.integers(max_value=low_bad)]
    bad += [] if optional else [None]
    return bad if high_bad is None else [*bad, st.integers(min_value=high_bad)]


def _group() -> Any:
    return SimulatedWorld(1, torch.device("cpu")).groups[0]


def _combine_args() -> dict[str, Any]:
    return {
        "cp_attn_out": torch.randn(4, 2, 8),
        "cp_attn_lse": torch.randn(4, 2),
        "cp_group": _group(),
        "return_lse": False,
        "is_lse_base_on_e": True,
        "seq_lens": torch.tensor([1, 2], dtype=I32),
        "query_start_loc": torch.tensor([0, 1, 3], dtype=I32),
    }


COMBINE_SLOTS: dict[str, Any] = {
    "cp_attn_out": FLOAT,
    "cp_attn_lse": [*FLOAT, META],
    "return_lse": BOOL,
    "is_lse_base_on_e": BOOL,
    "seq_lens": [*INDEX, META],
    "query_start_loc": [*INDEX, META, M(lambda t, a: t[:-1])],
}


def _manager() -> Any:
    return cpattn_dcp.DCPManager(cpattn_dcp.DCPConfig(), _group(), "cpu", 2, 8, F32)


def _plan(*lens: int) -> Any:
    return cpattn_pcp.dual_chunk_swap(list(lens), 1)


def _cache_args(*names: str) -> dict[str, Any]:
    args = {name: torch.randn(4, 3) for name in names}
    extra = {"num_decode_tokens": 1, "use_pcp": True, "shard_decode_requests": False}
    return {**args, "slot_mapping": torch.arange(4), **extra, "pcp_group": _group()}


CACHE_SLOTS = {
    "slot_mapping": [*NOT_TENSORS, *RANKS, M(lambda t, _: t.float())],
    "num_decode_tokens": ints(-1, 5, optional=True),
    "use_pcp": BOOL,
    "shard_decode_requests": BOOL,
}
FACTORY_SLOTS = {"device": [*DEVICE, None], "dtype": DTYPE, "use_direct": [1, "yes"]}
FORCED_SLOTS = {"device": [*DEVICE, *MISSING, None], "dtype": DTYPE}
WS_SIZES = ("max_num_tokens", "heads_per_rank", "head_dim", "num_ubatches")


def _factory_args(*sizes: str) -> dict[str, Any]:
    base = {"group": _group(), "device": "cpu", "dtype": torch.bfloat16, "use_direct": None}
    return {**base, **dict.fromkeys(sizes, 2)}


_DIRECT: dict[str, Any] = {}


def _direct(kind: str) -> Any:
    """Rank 0's direct workspace of a 2-rank simulated world (built once: collective). A bad
    call raises in its checks, before it publishes or compares anything with rank 1."""
    if not _DIRECT:
        cpu = torch.device("cpu")
        kw: dict[str, Any] = {"require_multicast": False}

        def build(group: Any) -> tuple[Any, ...]:
            return (
                cpattn_dcp.DirectDCPA2AWorkspace(group, cpu, 4, 1, 8, torch.bfloat16, 2),
                cpattn_dcp.DirectDCPQGatherWorkspace(group, cpu, 4, 1, 8, torch.bfloat16, **kw),
                cpattn_dcp.DirectDCPKVGatherWorkspace(group, cpu, 8, 8, torch.bfloat16, **kw),
                cpattn_common.DirectCPWorkspace(group, cpu, 2),
            )

        rank0 = SimulatedWorld(2, cpu).run(build)[0]
        _DIRECT.update(zip(("a2a", "q", "kv", "workspace"), rank0, strict=True))
    return _DIRECT[kind]


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


UBATCH = ints(-1, 2, optional=True)


@dataclass(frozen=True)
class Op:
    call: Callable[[dict[str, Any]], Any]
    make: Callable[[], dict[str, Any]]
    slots: dict[str, list[Any]]
    aliases: dict[str, tuple[str, ...]] | None = None


def _kw(fn: Callable[..., Any]) -> Callable[[dict[str, Any]], Any]:
    return lambda a: fn(**a)


OPS: dict[str, Op] = {
    "merge_attn_states": Op(
        _kw(cpattn_common.merge_attn_states),
        lambda: {"partial_outs": torch.randn(2, 3, 2, 8), "partial_lses": torch.randn(2, 3, 2)},
        {"partial_outs": FLOAT, "partial_lses": [*FLOAT, META]},
    ),
    "merge_attn_states_torch": Op(
        _kw(cpattn_common.merge_attn_states_torch),
        lambda: {
            "partial_outs": torch.randn(2, 3, 2, 8),
            "partial_lses": torch.randn(2, 3, 2),
            "is_lse_base_on_e": True,
        },
        {"partial_outs": FLOAT, "partial_lses": [*FLOAT, META], "is_lse_base_on_e": BOOL},
    ),
    "correct_attn_out": Op(
        _kw(cpattn_dcp.correct_attn_out),
        lambda: {
            "out": torch.randn(3, 2, 8),
            "lses": torch.randn(2, 3, 2),
            "cp_rank": 1,
            "is_lse_base_on_e": True,
        },
        {
            "out": FLOAT,
            "lses": [*FLOAT, META, M(lambda t, a: a["out"].view(-1)[1:13].view(2, 3, 2))],
            "cp_rank": ints(-1, 2),
            "is_lse_base_on_e": BOOL,
        },
    ),
    "mask_dcp_empty_shards_": Op(
        _kw(cpattn_dcp.mask_dcp_empty_shards_),
        lambda: {
            "lse": torch.randn(4, 2),
            "seq_lens": torch.tensor([1, 2], dtype=I32),
            "query_start_loc": torch.tensor([0, 1, 3], dtype=I32),
        },
        {
            "lse": [*FLOAT, META],
            "seq_lens": [*INDEX, META, M(lambda t, a: a["lse"].view(I32).view(-1)[:2])],
            "query_start_loc": [*INDEX, META, M(lambda t, a: t[:-1])],
        },
    ),
    "a2a_pack": Op(
        lambda a: cpattn_dcp.a2a_pack(**a),
        lambda: {
            "cp_attn_out": torch.randn(4, 2, 8),
            "cp_attn_lse": torch.randn(4, 2),
            "cp_world_size": 2,
            "seq_lens": torch.tensor([1, 2], dtype=I32),
            "query_start_loc": torch.tensor([0, 1, 3], dtype=I32),
            "send": torch.empty(2, 4, 1, 10),
        },
        {
            **{k: v for k, v in COMBINE_SLOTS.items() if k.startswith(("cp_", "seq", "query"))},
            "cp_world_size": ints(0),
            "send": [3, "x", [1.0], *RANKS, M(lambda t, _: t.to(I32)), M(lambda t, _: t.mT)],
        },
    ),
    "a2a_unpack_combine": Op(
        lambda a: cpattn_dcp.a2a_unpack_combine(a.pop("recv"), **a),
        lambda: {
            "recv": torch.randn(2, 3, 1, 9),
            "head_dim": 8,
            "return_lse": True,
            "is_lse_base_on_e": True,
        },
        {"recv": FLOAT, "head_dim": ints(0), "return_lse": BOOL, "is_lse_base_on_e": BOOL},
    ),
    "a2a_buffer_views": Op(
        lambda a: cpattn_dcp.a2a_buffer_views(a["buf"], a["head_dim"]),
        lambda: {"buf": torch.randn(2, 3, 1, 9), "head_dim": 8},
        {"buf": FLOAT, "head_dim": ints(0)},
    ),
    "a2a_record_width": Op(
        lambda a: cpattn_dcp.a2a_record_width(a["head_dim"], a["dtype"]),
        lambda: {"head_dim": 8, "dtype": torch.bfloat16},
        {"head_dim": ints(0), "dtype": [*DTYPE, torch.int32, torch.float64]},
    ),
    **{
        name: Op(_kw(getattr(cpattn_dcp, name)), _combine_args, COMBINE_SLOTS)
        for name in ("cp_lse_ag_out_rs", "cp_lse_ag_out_ar", "dcp_a2a_lse_reduce")
    },
    "dcp_gather_query": Op(
        _kw(cpattn_dcp.dcp_gather_query),
        lambda: {"query": torch.randn(3, 2, 8), "cp_group": _group(), "padded_num_heads": 4},
        {"query": [*NOT_TENSORS, *RANKS], "padded_num_heads": ints(1, optional=True)},
    ),
    "reserve_query_head_storage": Op(
        _kw(cpattn_dcp.reserve_query_head_storage),
        lambda: {"query": torch.randn(3, 2, 8), "padded_num_heads": 4},
        {"query": [*NOT_TENSORS, *RANKS], "padded_num_heads": ints(1)},
    ),
    "dcp_gather_kv": Op(
        _kw(cpattn_dcp.dcp_gather_kv),
        lambda: {
            "gathered_kv": torch.empty(6, 4),
            "local_kv": torch.randn(3, 4),
            "cp_group": _group(),
        },
        {
            "gathered_kv": [
                *NOT_TENSORS,
                *RANKS,
                META,
                M(lambda t, _: t[:2]),
                M(lambda t, _: t.to(I32)),
                M(lambda t, _: t.view(4, 6).mT),
            ],
            "local_kv": [*NOT_TENSORS, *RANKS, META, M(lambda t, a: a["gathered_kv"][2:5])],
        },
    ),
    "get_direct_dcp_a2a_workspace": Op(
        _kw(cpattn_dcp.get_direct_dcp_a2a_workspace),
        lambda: _factory_args(*WS_SIZES),
        {**FACTORY_SLOTS, **dict.fromkeys(WS_SIZES, ints(0))},
    ),
    "get_direct_dcp_q_gather_workspace": Op(
        _kw(cpattn_dcp.get_direct_dcp_q_gather_workspace),
        lambda: {**_factory_args(*WS_SIZES), "padded_num_heads": None},
        {
            **FACTORY_SLOTS,
            **dict.fromkeys(WS_SIZES, ints(0)),
            "padded_num_heads": ints(0, optional=True),
        },
    ),
    "get_direct_dcp_kv_gather_workspace": Op(
        _kw(cpattn_dcp.get_direct_dcp_kv_gather_workspace),
        lambda: _factory_args("max_gathered_tokens", "token_dim", "num_ubatches"),
        {**FACTORY_SLOTS, **dict.fromkeys(("max_gathered_tokens", "token_dim"), ints(0))},
    ),
    "get_direct_dcp_a2a_workspace(use_direct=True)": Op(
        _kw(cpattn_dcp.get_direct_dcp_a2a_workspace),
        lambda: {**_factory_args(*WS_SIZES), "use_direct": True},
        {**FORCED_SLOTS, **dict.fromkeys(WS_SIZES, ints(0))},
    ),
    "direct_a2a_unavailable_reason": Op(
        _kw(direct_a2a_unavailable_reason),
        lambda: {"group": _group(), "dtype": torch.bfloat16, "use_direct": None, "device": "cpu"},
        {"dtype": DTYPE, "use_direct": [1, "yes"], "device": DEVICE},
    ),
    "direct_gather_unavailable_reason": Op(
        _kw(direct_gather_unavailable_reason),
        lambda: {"group": _group(), "dtype": torch.bfloat16, "use_direct": None, "device": "cpu"},
        {"dtype": DTYPE, "use_direct": [1, "yes"], "device": DEVICE},
    ),
    "DirectDCPA2AWorkspace.lse_reduce": Op(
        lambda a: _direct("a2a").lse_reduce(**a),
        lambda: {
            "partial_output": _bf16(3, 2, 8),
            "partial_lse": torch.randn(3, 2),
            "is_lse_base_on_e": True,
            "seq_lens": torch.tensor([1, 2], dtype=I32),
            "query_start_loc": torch.tensor([0, 1, 3], dtype=I32),
            "return_lse": False,
            "ubatch_id": None,
        },
        {
            "partial_output": [*FLOAT, M(lambda t, _: t[..., :4]), M(lambda t, _: t.half())],
            "partial_lse": [*FLOAT, META],
            "is_lse_base_on_e": BOOL,
            "seq_lens": [*INDEX, META],
            "query_start_loc": [*INDEX, META, M(lambda t, a: t[:-1])],
            "return_lse": BOOL,
            "ubatch_id": UBATCH,
        },
    ),
    "DirectDCPQGatherWorkspace.gather": Op(
        lambda a: _direct("q").gather(**a),
        lambda: {"local_query": _bf16(3, 1, 8), "ubatch_id": None},
        {
            "local_query": [*FLOAT, META, M(lambda t, _: t.half()), M(lambda t, _: t[:, :, :4])],
            "ubatch_id": UBATCH,
        },
    ),
    "DirectDCPKVGatherWorkspace.gather": Op(
        lambda a: _direct("kv").gather(**a),
        lambda: {"gathered_kv": torch.empty(6, 8, dtype=torch.bfloat16), "local_kv": _bf16(3, 8)},
        {
            "gathered_kv": [*FLOAT, META, M(lambda t, _: t[:2]), M(lambda t, _: t.half())],
            "local_kv": [*FLOAT, META, M(lambda t, a: a["gathered_kv"][2:5])],
        },
    ),
    "DirectCPWorkspace.allocate": Op(
        lambda a: _direct("workspace").allocate(**a),
        lambda: {"shape": (2, 3), "dtype": torch.bfloat16},
        {"shape": [None, 3, "2,3", (3, 3), (2, 0), (2, 2.5), (2, "3"), ()], "dtype": DTYPE},
    ),
    "cp_layout": Op(
        lambda a: cpattn_common.cp_layout(a.pop("world_size"), **a),
        lambda: {"world_size": 8, "tp_size": 4, "pcp_size": 2, "dcp_size": 4},
        {
            "world_size": ints(0),
            "tp_size": ints(0),
            "pcp_size": ints(0),
            "dcp_size": ints(0),
        },
    ),
    "CPGroup": Op(
        _kw(cpattn_common.CPGroup),
        lambda: {"group": None, "native_collectives": True},
        {"group": [3, "world", [0, 1], torch.zeros(2)], "native_collectives": BOOL[1:]},
    ),
    "as_cp_group": Op(
        _kw(cpattn_common.as_cp_group),
        lambda: {"x": _group(), "mesh_dim": None},
        {"x": [3, "world", [0, 1], torch.zeros(2)]},
        {"x": ("group", "x")},
    ),
    "direct_cp_disabled_reason": Op(
        _kw(cpattn_common.direct_cp_disabled_reason),
        lambda: {"group": _group(), "dtype": torch.bfloat16, "use_direct": None},
        {"dtype": DTYPE, "use_direct": [1, "yes"], "supported_dtypes": [1, "bf16", [1]]},
    ),
    "empty_output": Op(
        lambda a: cpattn_common.empty_output(a.pop("shape"), **a),
        lambda: {"shape": (2, 3), "dtype": F32, "device": "cpu"},
        {
            "shape": [None, "2,3", 2.0, (2, -1), (2, 2.5), (2, "3")],
            "dtype": DTYPE,
            "device": DEVICE,
        },
    ),
    "new_output": Op(
        _kw(cpattn_common.new_output),
        lambda: {"like": torch.zeros(2), "shape": (2, 3), "dtype": None},
        {"like": NOT_TENSORS, "shape": [None, "2,3", (2, -1), (2, 2.5)], "dtype": DTYPE[::2]},
    ),
    "set_ubatch_id": Op(
        _kw(cpattn_common.set_ubatch_id), lambda: {"ubatch_id": 0}, {"ubatch_id": ints(-1)}
    ),
    "set_check_mode": Op(
        _kw(cpattn_common.set_check_mode), lambda: {"enabled": True}, {"enabled": BOOL}
    ),
    "set_output_poison": Op(
        _kw(cpattn_common.set_output_poison),
        lambda: {"value": None},
        {"value": ["nan", [1.0], torch.zeros(1)]},
    ),
    "a2a_pack_dim": Op(
        _kw(cpattn_dcp.a2a_pack_dim),
        lambda: {"dtype": torch.bfloat16},
        {"dtype": [*DTYPE, torch.int32]},
    ),
    "dcp_q_gather_group": Op(
        lambda a: cpattn_pcp.dcp_q_gather_group(
            a.pop("dcp_world_size"), a.pop("pcp_world_size"), **a
        ),
        lambda: {"dcp_world_size": 1, "pcp_world_size": 1, "dcp_group": _group()},
        {"dcp_world_size": ints(0), "pcp_world_size": ints(0)},
    ),
    "DCPConfig": Op(
        _kw(lambda **a: cpattn_dcp.DCPConfig(**a)),
        lambda: {"comm_backend": "a2a", "max_num_tokens": 4, "num_ubatches": 1},
        {
            "comm_backend": ["nccl", None, 1],
            "max_num_tokens": ints(0),
            "num_ubatches": ints(0),
            "use_direct_a2a": [1, "yes"],
            "use_pcp": [None, "yes", 1],
        },
    ),
    "DCPManager": Op(
        _kw(cpattn_dcp.DCPManager),
        lambda: {
            "config": cpattn_dcp.DCPConfig(),
            "group": _group(),
            "device": "cpu",
            "num_heads": 2,
            "head_dim": 8,
            "dtype": torch.bfloat16,
        },
        {
            "config": [None, {}],
            "num_heads": ints(0),
            "head_dim": ints(0),
            "dtype": DTYPE,
            "padded_num_heads": ints(1, optional=True),
            "max_gathered_kv_tokens": ints(-1),
            "is_lse_base_on_e": BOOL,
        },
    ),
    "DCPManager.combine": Op(
        lambda a: _manager().combine(a.pop("partial_output"), a.pop("partial_lse"), **a),
        lambda: {
            "partial_output": torch.randn(4, 2, 8),
            "partial_lse": torch.randn(4, 2),
            "seq_lens": torch.tensor([1, 2], dtype=I32),
            "query_start_loc": torch.tensor([0, 1, 3], dtype=I32),
            "return_lse": False,
        },
        {
            "partial_output": [*NOT_TENSORS, *RANKS, M(lambda t, _: t[..., :4])],
            "partial_lse": [*NOT_TENSORS, *RANKS, META],
            "seq_lens": [*INDEX, META],
            "query_start_loc": [*INDEX, META],
            "return_lse": BOOL,
        },
    ),
    "DCPManager.query_gather": Op(
        lambda a: _manager().query_gather(a["query"]),
        lambda: {"query": torch.randn(3, 2, 8)},
        {"query": [*NOT_TENSORS, *RANKS, M(lambda t, _: t[:, :1])]},
    ),
    "DCPManager.kv_gather": Op(
        lambda a: _manager().kv_gather(a["gathered_kv"], a["local_kv"]),
        lambda: {"gathered_kv": torch.empty(6, 4), "local_kv": torch.randn(3, 4)},
        {
            "gathered_kv": [*NOT_TENSORS, *RANKS, META, M(lambda t, _: t[:2])],
            "local_kv": [*NOT_TENSORS, *RANKS, M(lambda t, a: a["gathered_kv"][2:5])],
        },
    ),
    "dual_chunk_swap": Op(
        _kw(cpattn_pcp.dual_chunk_swap),
        lambda: {"seq_lens": [5, 3], "pcp_size": 2},
        {
            "seq_lens": [
                None,
                5,
                "53",
                {5: 1},
                [5, "3"],
                [5, -1],
                [5, 3.0],
                [True, 3],
                torch.tensor([5.0, 3.0]),
                torch.ones(2, 2, dtype=I32),
            ],
            "pcp_size": [*ints(0), 2**40],
            "device": [*DEVICE, *MISSING],
        },
    ),
    "DualChunkSwapPlan.local_rows": Op(
        lambda a: _plan(4, 2).local_rows(a["x_global"], a["rank"]),
        lambda: {"x_global": torch.randn(6, 2), "rank": 0},
        {"x_global": [*NOT_TENSORS, M(lambda t, _: t[:5])], "rank": ints(-1, 1)},
    ),
    "DualChunkSwapPlan.restore": Op(
        lambda a: _plan(4, 2).restore(a["gathered"]),
        lambda: {"gathered": torch.randn(6, 2)},
        {"gathered": [*NOT_TENSORS, M(lambda t, _: t[:5])]},
    ),
    "DualChunkSwapPlan.to": Op(
        lambda a: _plan(4, 2).to(a["device"]),
        lambda: {"device": "cpu"},
        {"device": [*DEVICE, *MISSING, None]},
    ),
    "gather_prefill_qkv_global": Op(
        _kw(cpattn_pcp.gather_prefill_qkv_global),
        lambda: {
            "plan": _plan(4, 2),
            "query": torch.randn(6, 2, 4),
            "key": torch.randn(6, 1, 4),
            "value": torch.randn(6, 1, 4),
            "pcp_group": _group(),
        },
        {
            "plan": [None, (1, 2, 3, 4)],
            **{key: [*NOT_TENSORS, META] for key in ("query", "key", "value")},
            "pcp_group": [None],
        },
    ),
    "slice_prefill_output_local": Op(
        _kw(cpattn_pcp.slice_prefill_output_local),
        lambda: {
            "plan": _plan(4, 2),
            "out_global": torch.randn(6, 4),
            "num_actual": 6,
            "pcp_group": _group(),
        },
        {
            "plan": [None],
            "out_global": [*NOT_TENSORS, META, M(lambda t, _: t[:5])],
            "num_actual": ints(-1, 7),
            "pcp_group": [None],
        },
    ),
    "maybe_gather_mla_latent_cache_inputs": Op(
        _kw(cpattn_pcp.maybe_gather_mla_latent_cache_inputs),
        lambda: _cache_args("kv_c_normed", "k_pe"),
        {**CACHE_SLOTS, "kv_c_normed": NOT_TENSORS, "k_pe": [*NOT_TENSORS, META]},
    ),
    "maybe_gather_kv_cache_inputs": Op(
        _kw(cpattn_pcp.maybe_gather_kv_cache_inputs),
        lambda: _cache_args("key", "value"),
        {**CACHE_SLOTS, "key": NOT_TENSORS, "value": [*NOT_TENSORS, M(lambda t, _: t[:3])]},
    ),
    "maybe_gather_indexer_k": Op(
        _kw(cpattn_pcp.maybe_gather_indexer_k),
        lambda: _cache_args("k"),
        {**CACHE_SLOTS, "k": NOT_TENSORS},
    ),
    "build_mixed_decode_subset": Op(
        _kw(cpattn_pcp.build_mixed_decode_subset),
        lambda: {
            "is_prefilling": torch.tensor([False, True]),
            "query_start_loc": torch.tensor([0, 1, 3]),
            "query": torch.randn(3, 2),
            "key": None,
            "value": None,
            "dcp_context_kv_lens": torch.tensor([4, 5]),
            "block_table": torch.zeros(2, 3, dtype=I32),
        },
        {
            "is_prefilling": [*NOT_TENSORS[1:], M(lambda t, _: t.float()), M(lambda t, _: t[:1])],
            "query_start_loc": [*INDEX[1:], M(lambda _, __: torch.tensor([0, 2, 1]))],
            "query": NOT_TENSORS,
            "key": [3, M(lambda _, a: a["query"][:2])],
            "dcp_context_kv_lens": [*NOT_TENSORS, *RANKS],
            "block_table": [*NOT_TENSORS, *RANKS],
        },
    ),
    "dcp_q_gather_size": Op(
        _kw(cpattn_pcp.dcp_q_gather_size),
        lambda: {"dcp_world_size": 4, "pcp_world_size": 2},
        {"dcp_world_size": [*ints(0), 3], "pcp_world_size": [*ints(0), 3]},
        {"dcp_world_size": ("dcp_world_size",), "pcp_world_size": ("pcp_world_size",)},
    ),
    "maybe_all_gather_q_for_dcp": Op(
        _kw(cpattn_pcp.maybe_all_gather_q_for_dcp),
        lambda: {
            "q": torch.randn(2, 2, 4),
            "dcp_world_size": 1,
            "pcp_world_size": 1,
            "already_replicated": False,
        },
        {
            "q": [None, 3, [torch.ones(1)], (torch.ones(2, 2, 4),)],
            "dcp_world_size": ints(0),
            "pcp_world_size": ints(0),
            "already_replicated": BOOL,
        },
    ),
    "finalize_mla_pcp_decode": Op(
        _kw(cpattn_pcp.finalize_mla_pcp_decode),
        lambda: {"output": torch.randn(2, 1, 4), "num_heads": 2, "pcp_group": _group()},
        {"output": [*NOT_TENSORS, M(lambda t, _: t[0, 0])], "num_heads": ints(0)},
    ),
    "resolve_dcp_combine": Op(
        _kw(cpattn_pcp.resolve_dcp_combine),
        lambda: {"dcp_world_size": 2, "pcp_world_size": 1, "comm_backend": "a2a"},
        {"dcp_world_size": ints(0), "pcp_world_size": ints(0), "comm_backend": ["nccl", 1]},
    ),
}
# Messages that name the argument by another word (a list of every accepted word).
ALIASES = {
    "lse": ("lse", "LSE"),
    "partial_output": ("partial_output", "cp_attn_out"),
    "partial_lse": ("partial_lse", "cp_attn_lse"),
    "cp_world_size": ("cp_world_size", "world size"),
    "cp_attn_out": ("cp_attn_out", "cp_attn_lse"),
    "use_direct_a2a": ("use_direct_a2a",),
    "comm_backend": ("comm_backend", "backend"),
    "q": ("q", "query", "tuple"),
    "plan": ("plan",),
}


def _ours(exc: BaseException) -> str | None:
    """The file of the innermost frame of ``exc``'s traceback, unless it is one of ours."""
    frames = traceback.extract_tb(exc.__traceback__)
    name = frames[-1].filename if frames else "?"
    ours = any(f"/src/{pkg}/" in name for pkg in ("cpattn_common", "cpattn_dcp", "cpattn_pcp"))
    return None if ours else name


def _draw_bad(data: st.DataObject, old: Any, args: dict[str, Any], bad: Any) -> Any:
    if isinstance(bad, st.SearchStrategy):
        return data.draw(bad)
    return bad.fn(old, args) if isinstance(bad, M) else bad


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", list(OPS))
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_bad_arguments_raise_clear_errors(name: str, data: st.DataObject) -> None:
    op = OPS[name]
    args = op.make()
    slot = data.draw(st.sampled_from(sorted(op.slots)), label="argument")
    bad = data.draw(st.sampled_from(op.slots[slot]), label="replacement")
    args[slot] = value = _draw_bad(data, args.get(slot), args, bad)
    shown = f"{name}({slot}={value!r})"
    with pytest.raises((ValueError, TypeError)) as info:  # anything else propagates
        op.call(args)
    exc = info.value
    where = _ours(exc)
    assert where is None, f"{shown}: {type(exc).__name__} from {where}: {exc}"
    words = (op.aliases or {}).get(slot) or ALIASES.get(slot) or (slot,)
    assert any(w in str(exc) for w in words), f"{shown}: message does not name it: {exc}"
