"""TP x PCP x DCP end to end: the groups of ``cpattn_common.build_cp_groups``, the query gather
and combine choice of ``cpattn_pcp``, the combine ops of ``cpattn_dcp`` and
``finalize_mla_pcp_decode`` leave every TP rank with exactly its own heads, merged as a float64
reference merges them, for both configured backends.

This is where the packages meet, so it lives in the package that may import all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# (tp, pcp, dcp) on a world of 4: DCP inside TP, DCP = PCP, DCP = TP x PCP.
LAYOUTS = ((4, 1, 2), (4, 1, 4), (2, 2, 2), (2, 2, 4), (1, 4, 4))
HEADS_PER_TP_RANK = 4


def _expected_gathered_heads(tp: int, pcp: int, dcp: int, tp_rank: int, dcp_rank: int) -> list[int]:
    """Global head ids of the gathered query, in order (heads ``t * nh ..`` on TP rank t)."""
    nh = HEADS_PER_TP_RANK
    if pcp == 1 and dcp > 1:  # gathered over the DCP group: consecutive TP ranks
        first = tp_rank - dcp_rank
        return list(range(first * nh, (first + dcp) * nh))
    if dcp > pcp > 1:  # gathered over the TP group (here all of TP)
        return list(range(tp * nh))
    return list(range(tp_rank * nh, (tp_rank + 1) * nh))  # DCP = PCP: nothing gathered


def _check_layouts(rank: int, world_size: int, seed: int) -> list[str]:
    from cpattn_common import build_cp_groups
    from cpattn_dcp import cp_lse_ag_out_ar, cp_lse_ag_out_rs, dcp_a2a_lse_reduce
    from cpattn_pcp import finalize_mla_pcp_decode, maybe_all_gather_q_for_dcp, resolve_dcp_combine

    ops: dict[str, Callable[..., Any]] = {
        "ag_rs": cp_lse_ag_out_rs,
        "ag_ar": cp_lse_ag_out_ar,
        "a2a": dcp_a2a_lse_reduce,
    }
    nh, b, d = HEADS_PER_TP_RANK, 3, 8
    done = []
    for index, (tp, pcp, dcp) in enumerate(LAYOUTS):
        groups = build_cp_groups(tp_size=tp, pcp_size=pcp, dcp_size=dcp, device_type="cpu")
        tp_rank, dcp_rank = groups.tp.rank_in_group, groups.dcp.rank_in_group
        gen = torch.Generator().manual_seed(seed + index)
        q_all = torch.randn(b, tp * nh, 16, generator=gen)  # every TP rank's query heads
        q = maybe_all_gather_q_for_dcp(
            q_all[:, tp_rank * nh : (tp_rank + 1) * nh].contiguous(), dcp, pcp,
            tp_group=groups.tp, dcp_group=groups.dcp,
        )  # fmt: skip
        ids = _expected_gathered_heads(tp, pcp, dcp, tp_rank, dcp_rank)
        assert isinstance(q, torch.Tensor)
        assert torch.equal(q, q_all[:, ids]), (tp, pcp, dcp)

        # Partials of every DCP group member over the gathered heads, the same on each member
        # (seeded by the group), with a shard that is empty for one token.
        gen = torch.Generator().manual_seed(seed + 100 * index + min(groups.dcp.ranks))
        outs = torch.randn(dcp, b, len(ids), d, generator=gen, dtype=torch.float64)
        lses = 3 * torch.randn(dcp, b, len(ids), generator=gen, dtype=torch.float64)
        lses[dcp - 1, 0] = float("-inf")
        outs[dcp - 1, 0] = float("nan")  # an empty shard's output is garbage
        weights = torch.softmax(lses, dim=0).nan_to_num(0.0)
        merged = (weights.unsqueeze(-1) * outs.nan_to_num(0.0)).sum(dim=0)
        mine = [ids.index(h) for h in range(tp_rank * nh, (tp_rank + 1) * nh)]

        for backend in ("ag_rs", "a2a"):
            name = resolve_dcp_combine(dcp, pcp, backend)
            combined = ops[name](outs[dcp_rank].float(), lses[dcp_rank].float(), groups.dcp)
            final = finalize_mla_pcp_decode(combined, nh, pcp_group=groups.pcp, tp_group=groups.tp)
            torch.testing.assert_close(
                final.double(), merged[:, mine], rtol=1e-5, atol=1e-5,
                msg=lambda m, n=name, layout=(tp, pcp, dcp): f"{layout} {n}: {m}",
            )  # fmt: skip
            done.append(f"tp{tp}_pcp{pcp}_dcp{dcp}_{backend}_{name}")
    return done


def test_each_tp_rank_gets_its_heads(run_ranks: Callable[..., list[Any]]) -> None:
    results = run_ranks(_check_layouts, 4, 2026, timeout=300.0)
    expected = [
        f"tp{tp}_pcp{pcp}_dcp{dcp}_{backend}_{name}"
        for tp, pcp, dcp in LAYOUTS
        for backend, name in (
            ("ag_rs", "ag_ar" if pcp > 1 else "ag_rs"),
            ("a2a", "ag_ar" if dcp > pcp > 1 else "a2a"),
        )
    ]
    assert results == [expected] * 4
