"""Cache-input gathers: pass-through rules, paths that need no communication, bad input.

The multi-rank replica check (every rank's cache equals the single-process cache) runs in
``distributed/test_pcp_dist.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

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
from cpattn_testing.pytest_plugin import RunRanks
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


@pytest.mark.parametrize("shard_decode_requests", [False, True])
def test_single_rank_gathers_strided_inputs_into_contiguous_rows(
    fake_group: MakeGroup, shard_decode_requests: bool
) -> None:
    """K and V split from a fused QKV projection are row-strided views: a group of one returns
    its input, so the gathered rows must still come back contiguous (and not alias the
    caller's tensor), as at N > 1."""
    qkv = torch.randn(4, 24, generator=torch.Generator().manual_seed(3))
    key, value = qkv[:, 8:16].view(4, 2, 4), qkv[:, 16:].view(4, 2, 4)
    slots = torch.arange(4)
    k, v, _ = maybe_gather_kv_cache_inputs(
        key, value, slots, 0, True, shard_decode_requests, pcp_group=fake_group(1)
    )
    for got, want in ((k, key), (v, value)):
        assert got.is_contiguous()
        assert got.data_ptr() != want.data_ptr()
        assert torch.equal(got, want)


def test_non_tensor_inputs_are_type_errors(fake_group: MakeGroup) -> None:
    x = _inputs(4, torch.device("cpu"))
    slots = torch.arange(8)
    g2 = fake_group(2)
    with pytest.raises(TypeError, match=r"slot_mapping must be a torch\.Tensor, got list"):
        maybe_gather_kv_cache_inputs(x["key"], x["value"], list(range(8)), 0, True, pcp_group=g2)
    with pytest.raises(TypeError, match=r"value must be a torch\.Tensor, got NoneType"):
        maybe_gather_kv_cache_inputs(x["key"], None, slots, 0, True, pcp_group=g2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"k_pe must be a torch\.Tensor, got ndarray"):
        maybe_gather_mla_latent_cache_inputs(
            x["kv_c"],
            x["k_pe"].numpy(),
            slots,
            0,
            True,
            pcp_group=g2,  # type: ignore[arg-type]
        )


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
    # Flags are checked, not truthy (a string "False" turned the gather on).
    with pytest.raises(TypeError, match="use_pcp must be a bool"):
        maybe_gather_indexer_k(x["k"], slots, 1, "False", pcp_group=g2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shard_decode_requests must be a bool"):
        maybe_gather_indexer_k(x["k"], slots, 1, True, 1, pcp_group=g2)  # type: ignore[arg-type]


_NO_GRAD = r"call it under torch.no_grad\(\) / torch.inference_mode\(\), or pass detached tensors"


def _grad_error(fn: str, arg: str) -> str:
    return rf"^{fn}: {arg} requires grad, but {fn} exchanges data between ranks .*{_NO_GRAD}"


_MLA = "maybe_gather_mla_latent_cache_inputs"
_KV = "maybe_gather_kv_cache_inputs"
_IDX = "maybe_gather_indexer_k"
#: (function, argument, key of ``_inputs``) for every tensor argument of the three gathers.
_GRAD_ARGS = [
    (_MLA, "kv_c_normed", "kv_c"),
    (_MLA, "k_pe", "k_pe"),
    (_KV, "key", "key"),
    (_KV, "value", "value"),
    (_IDX, "k", "k"),
]


def _gather(
    fn: str, x: dict[str, torch.Tensor], slots: torch.Tensor, num_dec: int, group: Any
) -> tuple[torch.Tensor, ...]:
    """Call gather ``fn`` with use_pcp on, on the tensors of ``x``."""
    if fn == _MLA:
        return maybe_gather_mla_latent_cache_inputs(
            x["kv_c"], x["k_pe"], slots, num_dec, True, pcp_group=group
        )
    if fn == _KV:
        return maybe_gather_kv_cache_inputs(
            x["key"], x["value"], slots, num_dec, True, pcp_group=group
        )
    return maybe_gather_indexer_k(x["k"], slots, num_dec, True, pcp_group=group)


def _with_grad(x: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    return x | {key: x[key].clone().requires_grad_()}


@pytest.mark.parametrize("num_decode_tokens", [0, 2, 5], ids=["prefill", "mixed", "decode"])
def test_gathers_refuse_grad_on_one_rank(fake_group: MakeGroup, num_decode_tokens: int) -> None:
    """With use_pcp and grad on, a cache input that requires grad raises before anything runs,
    on one rank and for every batch (all-decode ones too, which need no gather), so whether a
    call raises does not depend on the rank count or the batch. Under no_grad nothing changes;
    the pass-through calls (use_pcp off, D unknown) return the tensors as they are."""
    x = _inputs(5, torch.device("cpu"))
    slots = torch.arange(5)
    group = fake_group(1)
    for fn, arg, key in _GRAD_ARGS:
        xg = _with_grad(x, key)
        with pytest.raises(RuntimeError, match=_grad_error(fn, arg)):
            _gather(fn, xg, slots, num_decode_tokens, group)
        with torch.no_grad():
            got = _gather(fn, xg, slots, num_decode_tokens, group)
        want = _gather(fn, x, slots, num_decode_tokens, group)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (fn, arg)
    kv_c = x["kv_c"].clone().requires_grad_()
    for use_pcp, num_dec in ((False, 2), (True, None)):
        out = maybe_gather_mla_latent_cache_inputs(kv_c, x["k_pe"], slots, num_dec, use_pcp)
        assert out[0] is kv_c


def _grad_body(rank: int, world_size: int) -> dict[str, object]:
    """A mixed batch (1 replicated decode row, 3 prefill rows per rank): each function with
    one argument requiring grad, then under no_grad (prefill rows differ per rank)."""
    import torch.distributed as dist

    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    group = dist.group.WORLD
    base = _inputs(4, dev)

    def on(r: int) -> dict[str, torch.Tensor]:
        """Rank r's rows: decode row 0 replicated, prefill rows shifted by 10 * r."""
        return {name: torch.cat([t[:1], t[1:] + 10 * r]) for name, t in base.items()}

    x = on(rank)
    slots = torch.arange(world_size * 4, device=dev)
    results: dict[str, object] = {}
    for fn, arg, key in _GRAD_ARGS:
        xg = _with_grad(x, key)
        try:
            out = _gather(fn, xg, slots, 1, group)
            results[f"{fn}/{arg}"] = f"no error: {[t.requires_grad for t in out]}"
        except RuntimeError as exc:
            results[f"{fn}/{arg}"] = str(exc)
        with torch.no_grad():
            *rows, got_slots = _gather(fn, xg, slots, 1, group)
        want = [
            torch.cat([x[name][:1]] + [on(r)[name][1:] for r in range(world_size)])
            for name in {_MLA: ("kv_c", "k_pe"), _KV: ("key", "value"), _IDX: ("k",)}[fn]
        ]
        want_slots = torch.cat([slots[:1], slots.view(world_size, 4)[:, 1:].reshape(-1)])
        results[f"{fn}/{arg}/no_grad"] = torch.equal(got_slots, want_slots) and all(
            torch.equal(a, b) and not a.requires_grad for a, b in zip(rows, want, strict=True)
        )
    return results


def test_gathers_refuse_grad_multiprocess(run_ranks: RunRanks) -> None:
    """Two real ranks: the old code failed inside gloo's all-gather ("A view was created in
    no_grad mode and is being modified inplace...")."""
    for res in run_ranks(_grad_body, 2):
        for fn, arg, _ in _GRAD_ARGS:
            got = str(res[f"{fn}/{arg}"])
            assert re.search(_grad_error(fn, arg), got), (fn, arg, got)
            assert res[f"{fn}/{arg}/no_grad"] is True, (fn, arg)


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
