"""Cache-input gathers: pass-through rules, paths that need no communication, bad input.

The multi-rank replica check (every rank's cache equals the single-process cache) runs in
``distributed/test_pcp_dist.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpattn_common.group import CPGroupLike
from cpattn_pcp import (
    dual_chunk_swap,
    maybe_gather_indexer_k,
    maybe_gather_kv_cache_inputs,
    maybe_gather_mla_latent_cache_inputs,
)
from cpattn_testing import strategies
from cpattn_testing.simulated import SimulatedWorld

MakeGroup = Callable[..., CPGroupLike]


def _inputs(t: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return {
        "kv_c": torch.randn(t, 6, generator=g).to(device),
        "k_pe": torch.randn(t, 1, 3, generator=g).to(device),
        "key": torch.randn(t, 2, 4, generator=g).to(device),
        "value": torch.randn(t, 2, 3, generator=g).to(device),
        "k": torch.randn(t, 5, generator=g).to(device),
    }


@pytest.mark.parametrize(
    ("use_pcp", "num_decode_tokens"), [(False, 2), (True, None), (False, None)]
)
def test_disabled_returns_inputs_unchanged(
    use_pcp: bool, num_decode_tokens: int | None, device: torch.device
) -> None:
    x = _inputs(5, device)
    slots = torch.arange(5, device=device)
    out = maybe_gather_mla_latent_cache_inputs(
        x["kv_c"], x["k_pe"], slots, num_decode_tokens, use_pcp
    )
    assert all(a is b for a, b in zip(out, (x["kv_c"], x["k_pe"], slots), strict=True))
    out = maybe_gather_kv_cache_inputs(x["key"], x["value"], slots, num_decode_tokens, use_pcp)
    assert all(a is b for a, b in zip(out, (x["key"], x["value"], slots), strict=True))
    out2 = maybe_gather_indexer_k(x["k"], slots, num_decode_tokens, use_pcp)
    assert out2[0] is x["k"]
    assert out2[1] is slots


@pytest.mark.parametrize("num_decode_tokens", [0, 2, 5])
@pytest.mark.parametrize("shard_decode_requests", [False, True])
def test_single_rank_is_identity(
    fake_group: MakeGroup,
    device: torch.device,
    num_decode_tokens: int,
    shard_decode_requests: bool,
) -> None:
    x = _inputs(5, device)
    slots = torch.tensor([7, 3, 9, -1, 0, -1, -1], device=device)  # 2 entries of graph padding
    group = fake_group(1)
    kv_c, k_pe, s = maybe_gather_mla_latent_cache_inputs(
        x["kv_c"], x["k_pe"], slots, num_decode_tokens, True, shard_decode_requests,
        pcp_group=group,
    )  # fmt: skip
    assert torch.equal(kv_c, x["kv_c"])
    assert torch.equal(k_pe, x["k_pe"])
    assert k_pe.shape == (5, 1, 3)
    assert torch.equal(s, slots[:5])
    key, value, s = maybe_gather_kv_cache_inputs(
        x["key"], x["value"], slots, num_decode_tokens, True, pcp_group=group
    )
    assert torch.equal(key, x["key"])
    assert torch.equal(value, x["value"])
    assert key.is_contiguous()
    assert value.is_contiguous()
    k, s = maybe_gather_indexer_k(x["k"], slots, num_decode_tokens, True, pcp_group=group)
    assert torch.equal(k, x["k"])
    assert torch.equal(s, slots[:5])


def test_unexpanded_decode_slot_mapping_keeps_decode_rows(fake_group: MakeGroup) -> None:
    # Replicated draft decodes: 3 decode rows, 2 rows of DP padding, unexpanded mapping of 4.
    x = _inputs(5, torch.device("cpu"))
    slots = torch.tensor([11, 12, 13, -1])
    group = fake_group(4, 2)  # would fail on any communication
    kv_c, k_pe, s = maybe_gather_mla_latent_cache_inputs(
        x["kv_c"], x["k_pe"], slots, 3, True, pcp_group=group
    )
    assert torch.equal(kv_c, x["kv_c"][:3])
    assert torch.equal(k_pe, x["k_pe"][:3])
    assert s.tolist() == [11, 12, 13]


def test_all_decode_rows_stay_local(fake_group: MakeGroup) -> None:
    x = _inputs(3, torch.device("cpu"))
    slots = torch.tensor([5, 6, 7] * 2)  # expanded: rank-major, decode slots replicated
    k, s = maybe_gather_indexer_k(x["k"], slots, 3, True, pcp_group=fake_group(2, 1))
    assert k is x["k"]
    assert s.tolist() == [5, 6, 7]


def test_bad_input(fake_group: MakeGroup) -> None:
    x = _inputs(4, torch.device("cpu"))
    slots = torch.arange(8)
    g2 = fake_group(2)
    with pytest.raises(ValueError, match="same number of rows"):
        maybe_gather_mla_latent_cache_inputs(x["kv_c"], x["k_pe"][:3], slots, 1, True, pcp_group=g2)
    with pytest.raises(ValueError, match="same number of rows"):
        maybe_gather_kv_cache_inputs(x["key"], x["value"][:2], slots, 1, True, pcp_group=g2)
    with pytest.raises(ValueError, match=r"num_decode_tokens must be in \[0, 4\].*got 5"):
        maybe_gather_indexer_k(x["k"], slots, 5, True, pcp_group=g2)
    with pytest.raises(ValueError, match="got -1"):
        maybe_gather_indexer_k(x["k"], slots, -1, True, pcp_group=g2)
    with pytest.raises(TypeError, match="num_decode_tokens must be an int"):
        maybe_gather_indexer_k(x["k"], slots, True, True, pcp_group=g2)
    with pytest.raises(ValueError, match="slot_mapping must be 1-D"):
        maybe_gather_indexer_k(x["k"], slots.view(2, 4), 1, True, pcp_group=g2)
    with pytest.raises(TypeError, match="slot_mapping must hold integers"):
        maybe_gather_indexer_k(x["k"], slots.float(), 1, True, pcp_group=g2)
    with pytest.raises(TypeError, match="slot_mapping must hold integers"):
        maybe_gather_indexer_k(x["k"], slots.to(torch.complex64), 1, True, pcp_group=g2)
    with pytest.raises(ValueError, match="must share one device"):
        maybe_gather_indexer_k(x["k"], slots.to("meta"), 1, True, pcp_group=g2)
    with pytest.raises(ValueError, match=r"expanded rank-major mapping of .* = 2 \* 4 = 8"):
        maybe_gather_indexer_k(x["k"], slots[:6], 1, True, pcp_group=g2)
    with pytest.raises(ValueError, match="fewer than num_decode_tokens = 3"):
        maybe_gather_indexer_k(x["k"], slots[:2], 3, True, pcp_group=g2)
    with pytest.raises(ValueError, match="pcp_group= is required when use_pcp=True"):
        maybe_gather_indexer_k(x["k"], slots, 1, True)


@settings(max_examples=40, deadline=None)
@given(
    pcp_size=st.integers(1, 4),
    seq_lens=strategies.seq_lens_lists(max_requests=4, max_len=20),
    num_decodes=st.integers(0, 3),
    shard_decode_requests=st.booleans(),
    graph_padding=st.integers(0, 3),
)
def test_replica_equals_single_process_cache(
    pcp_size: int,
    seq_lens: list[int],
    num_decodes: int,
    shard_decode_requests: bool,
    graph_padding: int,
) -> None:
    """Virtual ranks (threads) write the returned rows at the returned slots: every rank's
    cache equals the cache one process writes for the whole batch."""
    n, d = pcp_size, num_decodes
    plan = dual_chunk_swap(seq_lens, n)
    num_dec_global = d * n if shard_decode_requests else d
    total = num_dec_global + plan.num_tokens
    g = torch.Generator().manual_seed(total * 31 + n)
    slots = torch.randperm(total + 5, generator=g)[:total]
    kv_c, k_pe = torch.randn(total, 6, generator=g), torch.randn(total, 1, 2, generator=g)

    def rows_of(r: int) -> torch.Tensor:
        """Token id of each local row of rank r (-1 = padding): decodes, then prefill rows."""
        first = r * d if shard_decode_requests else 0
        pre = torch.where(plan.local_is_real[r], plan.local_token_idx[r] + num_dec_global, -1)
        return torch.cat([torch.arange(first, first + d), pre])

    expanded = torch.cat(
        [torch.where(rows_of(r) >= 0, slots[rows_of(r)], -1) for r in range(n)]
        + [torch.zeros(graph_padding, dtype=torch.int64)]
    )

    def write(group: CPGroupLike) -> torch.Tensor:
        ids = rows_of(group.rank_in_group).clamp(min=0)
        c, pe, s = maybe_gather_mla_latent_cache_inputs(
            kv_c[ids], k_pe[ids], expanded, d, True, shard_decode_requests, pcp_group=group
        )
        cache = torch.zeros(total + 5, 8)
        keep = s >= 0
        cache[s[keep]] = torch.cat([c, pe.flatten(1)], dim=1)[keep]
        return cache

    expected = torch.zeros(total + 5, 8)
    expected[slots] = torch.cat([kv_c, k_pe.flatten(1)], dim=1)
    for cache in SimulatedWorld(n).run(write):
        assert torch.equal(cache, expected)


def test_row_checks_take_symbolic_sizes(fake_group: MakeGroup) -> None:
    """Under symbolic tracing the row counts are ``SymInt``s, which cannot be hashed: the row
    check put them in a ``set`` and raised ``TypeError`` (``make_fx`` symbolic, or
    ``torch.export`` with a dynamic token dim)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = _inputs(4, torch.device("cpu"))
    slots = torch.arange(4)
    g = fake_group(1)
    calls = {
        "kv": (lambda k, v, s: maybe_gather_kv_cache_inputs(k, v, s, 2, True, pcp_group=g),
               (x["key"], x["value"], slots)),
        "mla": (lambda c, p, s: maybe_gather_mla_latent_cache_inputs(c, p, s, 2, True, pcp_group=g),
                (x["kv_c"], x["k_pe"], slots)),
        "indexer": (lambda k, s: maybe_gather_indexer_k(k, s, 2, True, pcp_group=g),
                    (x["k"], slots)),
    }  # fmt: skip
    for name, (fn, args) in calls.items():
        traced = make_fx(fn, tracing_mode="symbolic")(*args)
        for got, want in zip(_flat(traced(*args)), _flat(fn(*args)), strict=True):
            assert torch.equal(got, want), name


def _flat(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    assert isinstance(x, tuple | list)
    return [t for item in x for t in _flat(item)]
