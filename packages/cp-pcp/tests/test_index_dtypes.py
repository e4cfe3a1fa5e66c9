"""Index-dtype checks of the three entry points that take index or length tensors.

``dual_chunk_swap`` (``seq_lens``), ``build_mixed_decode_subset`` (``query_start_loc``) and the
cache-input gathers (``slot_mapping``) accept exactly ``cpattn_common.checks.INDEX_DTYPES``
(int8/16/32/64, uint8/16/32/64). Quantized and sub-byte / raw-bits dtypes raise the
``TypeError`` that a floating index tensor gets, up front.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch

from cpattn_common.checks import is_index_dtype
from cpattn_common.group import CPGroupLike
from cpattn_pcp import (
    build_mixed_decode_subset,
    dual_chunk_swap,
    maybe_gather_indexer_k,
    maybe_gather_kv_cache_inputs,
    maybe_gather_mla_latent_cache_inputs,
)

MakeGroup = Callable[..., CPGroupLike]

_ACCEPTED_TEXT = "(int8/16/32/64 or uint8/16/32/64)"
# Written out, not taken from cpattn_common: the expectation the tests check against.
_ACCEPTED: list[torch.dtype] = [
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]
_ALL_TORCH_DTYPES: list[torch.dtype] = sorted(
    {value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str
)
# What the old rule let through and the common one refuses: quantized (qint8, quint4x2, ...)
# and sub-byte / raw-bits (uint1..uint7, int1..int7, bits8, ...) dtypes.
_NEWLY_REFUSED: list[torch.dtype] = [
    dtype
    for dtype in _ALL_TORCH_DTYPES
    if not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    and dtype not in _ACCEPTED
]


def _refused_tensor(dtype: torch.dtype, num_elements: int) -> torch.Tensor:
    """An uninitialised CPU tensor of ``dtype`` (the dtype check comes before any device check
    and before any element is read), or a skip when this torch cannot make one."""
    try:
        with warnings.catch_warnings():  # quantized tensors are deprecated in recent torch
            warnings.simplefilter("ignore", UserWarning)
            return torch.empty(num_elements, dtype=dtype)
    except (RuntimeError, TypeError) as err:  # NotImplementedError is a RuntimeError
        pytest.skip(f"torch cannot make a {dtype} tensor: {err}")


def _index(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(dtype).to(device)


def test_newly_refused_dtypes_are_the_quantized_and_sub_byte_ones() -> None:
    # The parametrizations below must cover both families wherever this torch has them.
    assert torch.quint8 in _NEWLY_REFUSED
    assert torch.qint32 in _NEWLY_REFUSED
    for name in ("uint4", "int4"):  # sub-byte dtypes exist in recent torch only
        if hasattr(torch, name):
            assert getattr(torch, name) in _NEWLY_REFUSED
    for dtype in _NEWLY_REFUSED:
        name = str(dtype).removeprefix("torch.")
        assert re.fullmatch(r"q(u)?int\w*|u?int[1-7]|bits\w*", name), dtype


@pytest.mark.parametrize("dtype", _ALL_TORCH_DTYPES, ids=str)
def test_the_common_rule_accepts_exactly_these(dtype: torch.dtype) -> None:
    assert is_index_dtype(dtype) is (dtype in _ACCEPTED)


# --- dual_chunk_swap: seq_lens ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", _NEWLY_REFUSED, ids=str)
def test_dual_chunk_swap_refuses_quantized_and_sub_byte_lengths(dtype: torch.dtype) -> None:
    seq_lens = _refused_tensor(dtype, 3)
    message = f"seq_lens must hold integers {_ACCEPTED_TEXT}, got dtype {dtype}"
    with pytest.raises(TypeError, match=re.escape(message)):
        dual_chunk_swap(seq_lens, 2)


@pytest.mark.parametrize("dtype", _ACCEPTED, ids=str)
def test_dual_chunk_swap_accepts_every_index_dtype(
    dtype: torch.dtype, device: torch.device
) -> None:
    lengths = [5, 1, 9, 0]
    plan = dual_chunk_swap(_index(lengths, dtype, device), 2)
    expected = dual_chunk_swap(lengths, 2, device=device)
    assert plan.seq_lens == expected.seq_lens
    assert torch.equal(plan.local_token_idx, expected.local_token_idx)
    assert torch.equal(plan.restore_idx, expected.restore_idx)


# --- build_mixed_decode_subset: query_start_loc ---------------------------------------------


def _mixed_batch(query_start_loc: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch of ``test_mixed_batch``: requests 0 and 3 are decodes with tokens (rows 0, 5
    and 6), request 1 a prefill, request 2 a 0-token decode; 2 rows of graph padding."""
    g = torch.Generator().manual_seed(7)
    return {
        "is_prefilling": torch.tensor([False, True, False, False], device=device),
        "query_start_loc": query_start_loc,
        "query": torch.randn(9, 3, 4, generator=g).to(device),
        "key": torch.randn(9, 1, 4, generator=g).to(device),
        "value": torch.randn(9, 1, 2, generator=g).to(device),
        "dcp_context_kv_lens": torch.tensor([10, 20, 30, 40], device=device),
        "block_table": torch.arange(12, device=device).view(4, 3),
    }


@pytest.mark.parametrize("dtype", _NEWLY_REFUSED, ids=str)
def test_mixed_decode_subset_refuses_quantized_and_sub_byte_offsets(dtype: torch.dtype) -> None:
    batch = _mixed_batch(_refused_tensor(dtype, 5), torch.device("cpu"))
    message = f"query_start_loc must be an integer tensor {_ACCEPTED_TEXT}, got {dtype}"
    with pytest.raises(TypeError, match=re.escape(message)):
        build_mixed_decode_subset(**batch)


# uint16/32/64 included: torch cannot subtract them, so the function widens them to int64.
@pytest.mark.parametrize("dtype", _ACCEPTED, ids=str)
def test_mixed_decode_subset_accepts_every_index_dtype(
    dtype: torch.dtype, device: torch.device
) -> None:
    batch = _mixed_batch(_index([0, 1, 5, 5, 7], dtype, device), device)
    subset = build_mixed_decode_subset(**batch)
    assert subset is not None
    assert subset.token_mask.tolist() == [i in (0, 5, 6) for i in range(9)]
    assert subset.cu_seqlens.dtype == dtype
    assert subset.cu_seqlens.tolist() == [0, 1, 3]
    assert subset.request_idx.tolist() == [0, 3]


# --- the cache-input gathers: slot_mapping ---------------------------------------------------

_Gather = Callable[[dict[str, torch.Tensor], torch.Tensor, CPGroupLike], tuple[torch.Tensor, ...]]
# The three public gathers, each with the inputs of ``test_cache_inputs`` it takes; 2 decode
# rows of 4 local rows.
_GATHERS: dict[str, _Gather] = {
    "mla_latent": lambda x, slots, group: maybe_gather_mla_latent_cache_inputs(
        x["kv_c"], x["k_pe"], slots, 2, True, pcp_group=group
    ),
    "kv": lambda x, slots, group: maybe_gather_kv_cache_inputs(
        x["key"], x["value"], slots, 2, True, pcp_group=group
    ),
    "indexer_k": lambda x, slots, group: maybe_gather_indexer_k(
        x["k"], slots, 2, True, pcp_group=group
    ),
}


def _cache_inputs(num_rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + num_rows)
    return {
        "kv_c": torch.randn(num_rows, 6, generator=g).to(device),
        "k_pe": torch.randn(num_rows, 1, 3, generator=g).to(device),
        "key": torch.randn(num_rows, 2, 4, generator=g).to(device),
        "value": torch.randn(num_rows, 2, 3, generator=g).to(device),
        "k": torch.randn(num_rows, 5, generator=g).to(device),
    }


@pytest.mark.parametrize("gather", list(_GATHERS))
@pytest.mark.parametrize("dtype", _NEWLY_REFUSED, ids=str)
def test_cache_gathers_refuse_quantized_and_sub_byte_slots(
    fake_group: MakeGroup, dtype: torch.dtype, gather: str
) -> None:
    slots = _refused_tensor(dtype, 8)  # expanded mapping: 2 ranks x 4 rows
    message = f"slot_mapping must hold integers {_ACCEPTED_TEXT}, got dtype {dtype}"
    with pytest.raises(TypeError, match=re.escape(message)):
        _GATHERS[gather](_cache_inputs(4, torch.device("cpu")), slots, fake_group(2))


@pytest.mark.parametrize("gather", list(_GATHERS))
@pytest.mark.parametrize("dtype", _ACCEPTED, ids=str)
def test_cache_gathers_accept_every_index_dtype(
    fake_group: MakeGroup, device: torch.device, dtype: torch.dtype, gather: str
) -> None:
    # One rank: the gather is the identity. Slots are >= 0 so that unsigned dtypes hold them.
    slots = _index([7, 3, 9, 0, 11, 12], dtype, device)  # 2 entries of graph padding
    x = _cache_inputs(4, device)
    out = _GATHERS[gather](x, slots, fake_group(1))
    assert out[-1].dtype == dtype
    assert out[-1].tolist() == [7, 3, 9, 0]
