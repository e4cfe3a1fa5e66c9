"""Check mode on real process groups: a collective call that one rank makes with another
signature than its peers raises ``ValueError`` on every rank, naming the field and the rank,
before the collective runs (the ranks stay in step: the next call works).

One launch per world size covers every field of the combines (AG+RS, AG+AR), the DCP gathers
and the PCP gathers; the last rank is the one that differs. Lives here because it calls both
cpattn_dcp and cpattn_pcp.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpattn_common.checks import check_mode
from cpattn_dcp import cp_lse_ag_out_ar, cp_lse_ag_out_rs, dcp_gather_kv, dcp_gather_query
from cpattn_pcp import (
    dual_chunk_swap,
    finalize_mla_pcp_decode,
    gather_prefill_qkv_global,
    maybe_all_gather_q_for_dcp,
    maybe_gather_kv_cache_inputs,
)

B, D = 3, 8
BF16, F32 = torch.bfloat16, torch.float32


def _combine(n: int, last: bool, field: str) -> Callable[[Any], Any]:
    """An AG+RS call (AG+AR for ``"op"`` and ``"swap"`` on the last rank) whose ``field``
    differs on the last rank."""
    b, h, d = B, 2 * n, D
    out_dtype = lse_dtype = F32
    kwargs: dict[str, Any] = {
        "seq_lens": torch.tensor([1, 2]),
        "query_start_loc": torch.tensor([0, 1, 3]),
    }
    op: Callable[..., Any] = cp_lse_ag_out_rs
    if last:
        if field == "B":
            b += 1
        elif field == "H":
            h += n
        elif field == "D":
            d *= 2
        elif field == "out dtype":
            out_dtype = BF16
        elif field == "lse dtype":
            lse_dtype = BF16
        elif field in ("return_lse", "is_lse_base_on_e"):
            kwargs[field] = field == "return_lse"  # the other value than the default
        elif field == "mask":
            kwargs = {}
        elif field == "len(seq_lens)":
            kwargs = {"seq_lens": torch.tensor([1, 1, 1]), "query_start_loc": torch.arange(4)}
        elif field == "op":
            op = cp_lse_ag_out_ar
    if field == "swap":  # the same byte count on every rank: B and H swapped on the last
        op = cp_lse_ag_out_ar
        b, h = (2 * n, B) if last else (B, 2 * n)
    out = torch.randn(b, h, d).to(out_dtype)
    lse = torch.randn(b, h).to(lse_dtype)
    return lambda g: op(out, lse, g, **kwargs)


COMBINE_FIELDS = {
    "B": "cp_attn_out.shape[0] (B) is 3 on rank 0 but 4 on rank {last}",
    "H": "cp_attn_out.shape[1] (H) is {h} on rank 0 but {h2} on rank {last}",
    "D": "cp_attn_out.shape[2] (D) is 8 on rank 0 but 16 on rank {last}",
    "out dtype": "cp_attn_out.dtype is torch.float32 on rank 0 but torch.bfloat16 on rank {last}",
    "lse dtype": "cp_attn_lse.dtype is torch.float32 on rank 0 but torch.bfloat16 on rank {last}",
    "return_lse": "return_lse is False on rank 0 but True on rank {last}",
    "is_lse_base_on_e": "is_lse_base_on_e is True on rank 0 but False on rank {last}",
    "mask": "mask given (seq_lens) is True on rank 0 but False on rank {last}",
    "len(seq_lens)": "len(seq_lens) is 2 on rank 0 but 3 on rank {last}",
    "op": "another op",
    "swap": "cp_attn_out.shape[0] (B) is 3 on rank 0 but {h} on rank {last}",
}


def _gathers(n: int, last: bool) -> dict[str, tuple[Callable[[Any], Any], str]]:
    """The DCP and PCP gathers, each with one field that differs on the last rank, and the
    message part every rank must raise."""
    lens = [5, 3 + last]
    plan = dual_chunk_swap(lens, n)
    p = plan.padded_local_len
    q, k, v = torch.randn(p, 2, 4), torch.randn(p, 1 + last, 4), torch.randn(p, 1, 4)
    kv = torch.randn(4, 3 + last)
    return {
        "query rows": (
            lambda g: dcp_gather_query(torch.randn(2 + last, 2, D), g),
            "query.shape[0] is 2 on rank 0 but 3",
        ),
        "query dtype": (
            lambda g: dcp_gather_query(torch.randn(2, 2, D).to(BF16 if last else F32), g),
            "query.dtype is torch.float32 on rank 0 but torch.bfloat16",
        ),
        "padded_num_heads": (
            lambda g: dcp_gather_query(torch.randn(2, 2, D), g, 2 * n + last),
            f"padded_num_heads is {2 * n} on rank 0 but {2 * n + 1}",
        ),
        "kv width": (
            lambda g: dcp_gather_kv(torch.empty(4 * n, 3 + last), kv, g),
            "local_kv.shape[1] is 3 on rank 0 but 4",
        ),
        "plan": (
            lambda g: gather_prefill_qkv_global(plan, q, k[:, :1], v, pcp_group=g),
            "plan.num_tokens is 8 on rank 0 but 9",
        ),
        "key heads": (
            lambda g: gather_prefill_qkv_global(dual_chunk_swap([5, 3], n), q, k, v, pcp_group=g),
            "key.shape[1] is 1 on rank 0 but 2",
        ),
        "num_decode_tokens": (
            lambda g: maybe_gather_kv_cache_inputs(
                kv, kv, torch.arange(4 * n), 1 + last, True, pcp_group=g
            ),
            "num_decode_tokens is 1 on rank 0 but 2",
        ),
        "q heads": (
            lambda g: maybe_all_gather_q_for_dcp(torch.randn(2, 2 + last, D), n, 1, dcp_group=g),
            "q.shape[1] is 2 on rank 0 but 3",
        ),
        "output dtype": (
            lambda g: finalize_mla_pcp_decode(
                torch.randn(2, 1, D).to(BF16 if last else F32), n, pcp_group=g
            ),
            "output.dtype is torch.float32 on rank 0 but torch.bfloat16",
        ),
    }


def _rank_main(rank: int, n: int) -> int:
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    group = dist.group.WORLD
    last = rank == n - 1
    cases: list[tuple[str, Callable[[Any], Any], str]] = []
    for field, message in COMBINE_FIELDS.items():
        h = 2 * n
        text = message.format(last=n - 1, h=h, h2=h + n)
        cases.append((field, _combine(n, last, field), text))
    for name, (call, text) in _gathers(n, last).items():
        cases.append((name, call, f"{text} on rank {n - 1}"))
    with check_mode():
        for name, call, text in cases:
            with pytest.raises(ValueError, match="the ranks' calls disagree") as info:
                call(group)
            assert text in str(info.value), (name, str(info.value))
            assert f"raised on rank {rank} of {n}" in str(info.value), name
        # Still in step: a call that agrees runs.
        out = cp_lse_ag_out_ar(torch.zeros(B, 2, D), torch.zeros(B, 2), group)
    assert out.shape == (B, 2, D)
    return len(cases)


@pytest.mark.parametrize("world_size", [2, 4])
def test_check_mode_names_the_field_and_rank(
    run_ranks: Callable[..., list[Any]], world_size: int
) -> None:
    results = run_ranks(_rank_main, world_size, timeout=300.0)
    assert results == [len(COMBINE_FIELDS) + 9] * world_size
