"""Decode subset of a mixed batch: selection, 0-token segments, padding rows, bad input."""

from __future__ import annotations

import pytest
import torch

from cpattn_pcp import build_mixed_decode_subset


def _batch(device: torch.device, dtype: torch.dtype = torch.int32) -> dict[str, torch.Tensor]:
    # Requests: 0 decode (1 token), 1 prefill (4), 2 decode with 0 tokens (DualChunkSwap dummy),
    # 3 decode (2 tokens, speculative); query has 2 rows of graph padding past qsl[-1] = 7.
    g = torch.Generator().manual_seed(7)
    return {
        "is_prefilling": torch.tensor([False, True, False, False], device=device),
        "query_start_loc": torch.tensor([0, 1, 5, 5, 7], dtype=dtype, device=device),
        "query": torch.randn(9, 3, 4, generator=g).to(device),
        "key": torch.randn(9, 1, 4, generator=g).to(device),
        "value": torch.randn(9, 1, 2, generator=g).to(device),
        "dcp_context_kv_lens": torch.tensor([10, 20, 30, 40], dtype=dtype, device=device),
        "block_table": torch.arange(12, dtype=dtype, device=device).view(4, 3),
    }


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_decode_subset(device: torch.device, dtype: torch.dtype) -> None:
    b = _batch(device, dtype)
    sub = build_mixed_decode_subset(**b)
    assert sub is not None
    rows = [0, 5, 6]
    assert sub.token_mask.tolist() == [i in rows for i in range(9)]
    assert torch.equal(sub.q, b["query"][rows])
    assert sub.k is not None
    assert torch.equal(sub.k, b["key"][rows])
    assert sub.v is not None
    assert torch.equal(sub.v, b["value"][rows])
    assert sub.q.is_contiguous()
    assert sub.cu_seqlens.dtype == dtype
    assert sub.cu_seqlens.tolist() == [0, 1, 3]
    assert sub.max_seqlen == 2
    assert sub.ctx_kv_lens.tolist() == [10, 40]
    assert sub.block_table.tolist() == [[0, 1, 2], [9, 10, 11]]
    assert sub.request_idx.tolist() == [0, 3]
    assert (sub.num_decodes, sub.num_decode_tokens) == (2, 3)


def test_zero_token_segments_and_no_decodes_give_none(device: torch.device) -> None:
    b = _batch(device)
    assert build_mixed_decode_subset(None, *list(b.values())[1:]) is None
    # Only the 0-token dummy segment is a decode: it must not count.
    b["is_prefilling"] = torch.tensor([True, True, False, True], device=device)
    assert build_mixed_decode_subset(**b) is None
    b["is_prefilling"] = torch.ones(4, dtype=torch.bool, device=device)
    assert build_mixed_decode_subset(**b) is None


def test_optional_kv_and_truncated_query(device: torch.device) -> None:
    b = _batch(device)
    b["query"] = b["query"][:6]  # fewer rows than qsl[-1]: the mask is truncated
    sub = build_mixed_decode_subset(
        b["is_prefilling"], b["query_start_loc"], b["query"], None, None,
        b["dcp_context_kv_lens"], b["block_table"],
    )  # fmt: skip
    assert sub is not None
    assert sub.k is None
    assert sub.v is None
    assert sub.token_mask.tolist() == [True, False, False, False, False, True]
    assert sub.cu_seqlens.tolist() == [0, 1, 3]  # per-request metadata is not truncated


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16])
def test_row_numbers_past_a_narrow_dtype(device: torch.device, dtype: torch.dtype) -> None:
    # 300 query rows (graph padding past qsl[-1] = 7): row numbers computed in int8 / uint8
    # wrapped, so padding rows 256 and 257 were read as rows 0 and 1 and selected.
    b = _batch(device, dtype)
    b["query"] = torch.randn(300, 3, 4, device=device)
    b["key"] = b["value"] = None  # type: ignore[assignment]
    sub = build_mixed_decode_subset(**b)
    assert sub is not None
    assert torch.nonzero(sub.token_mask).flatten().tolist() == [0, 5, 6]
    assert sub.q.shape[0] == 3
    assert sub.cu_seqlens.dtype == dtype
    assert sub.cu_seqlens.tolist() == [0, 1, 3]


def test_decreasing_unsigned_offsets_raise(device: torch.device) -> None:
    # uint8 5 - 3 wrapped to a length of 254 and passed the ordering check.
    b = _batch(device)
    b["query_start_loc"] = torch.tensor([0, 1, 5, 3, 7], dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="non-decreasing"):
        build_mixed_decode_subset(**b)


def test_bad_input(device: torch.device) -> None:
    b = _batch(device)
    bad = dict(b, is_prefilling=b["is_prefilling"][:3])
    with pytest.raises(ValueError, match=r"is_prefilling must be 1-D with R = 4 rows"):
        build_mixed_decode_subset(**bad)
    bad = dict(b, block_table=b["block_table"].flatten())
    with pytest.raises(ValueError, match="block_table must be 2-D"):
        build_mixed_decode_subset(**bad)
    bad = dict(b, dcp_context_kv_lens=b["dcp_context_kv_lens"][:2])
    with pytest.raises(ValueError, match="dcp_context_kv_lens"):
        build_mixed_decode_subset(**bad)
    bad = dict(b, key=b["key"][:8])
    with pytest.raises(ValueError, match=r"key must have the same number of rows as query \(9\)"):
        build_mixed_decode_subset(**bad)
    bad = dict(b, query_start_loc=torch.tensor([0, 3, 2, 5, 7], device=device))
    with pytest.raises(ValueError, match="non-decreasing"):
        build_mixed_decode_subset(**bad)
    bad = dict(b, query_start_loc=b["query_start_loc"].view(1, 5))
    with pytest.raises(ValueError, match="query_start_loc must be 1-D"):
        build_mixed_decode_subset(**bad)
    bad = dict(b, query_start_loc=b["query_start_loc"].float())  # cu_seqlens came back float
    with pytest.raises(TypeError, match="query_start_loc must be an integer tensor"):
        build_mixed_decode_subset(**bad)
    bad = dict(b, is_prefilling=torch.full((4,), 0.5, device=device))  # 0.5 counted as True
    with pytest.raises(TypeError, match="is_prefilling must be a bool tensor"):
        build_mixed_decode_subset(**bad)
    bad = dict(b, query_start_loc=torch.tensor([-1, 1, 5, 5, 7], device=device))
    with pytest.raises(ValueError, match="start at a row >= 0"):
        build_mixed_decode_subset(**bad)
    bad = dict(b, key=b["key"].to("meta"))
    with pytest.raises(ValueError, match="key is on meta"):
        build_mixed_decode_subset(**bad)
    for name in ("query_start_loc", "is_prefilling", "query", "key", "block_table"):
        bad = dict(b, **{name: b[name].tolist()})
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got list"):
            build_mixed_decode_subset(**bad)
