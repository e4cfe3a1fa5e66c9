"""TP x PCP x DCP end to end: the groups of ``cpattn_common.build_cp_groups``, the query gather
and combine choice of ``cpattn_pcp``, the combine ops of ``cpattn_dcp`` and
``finalize_mla_pcp_decode`` leave every TP rank with exactly its own heads, merged as a float64
reference merges them, for both configured backends.

This is where the packages meet, so it lives in the package that may import all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

# (tp, pcp, dcp) per world size: DCP inside TP, DCP = PCP, DCP = TP x PCP (all of TP, or a
# part of it: TP 4 x PCP 2 with DCP 4 gathers over 2 TP ranks), with replicas.
LAYOUTS = {
    4: ((4, 1, 2), (4, 1, 4), (2, 2, 2), (2, 2, 4), (1, 4, 4)),
    8: ((4, 2, 4), (4, 2, 8), (2, 4, 8), (2, 2, 4)),
}
HEADS_PER_TP_RANK = 4


def _expected_gathered_heads(
    pcp: int, dcp: int, tp_rank: int, inner_rank: int, inner_size: int
) -> list[int]:
    """Global head ids of the gathered query, in order (heads ``t * nh ..`` on TP rank t):
    gathered over the TP-inner group (consecutive TP ranks) unless DCP = PCP or DCP = 1."""
    nh = HEADS_PER_TP_RANK
    if dcp > 1 and dcp != pcp:
        first = tp_rank - inner_rank
        return list(range(first * nh, (first + inner_size) * nh))
    return list(range(tp_rank * nh, (tp_rank + 1) * nh))


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
    for index, (tp, pcp, dcp) in enumerate(LAYOUTS[world_size]):
        groups = build_cp_groups(tp_size=tp, pcp_size=pcp, dcp_size=dcp, device_type="cpu")
        tp_rank, dcp_rank = groups.tp.rank_in_group, groups.dcp.rank_in_group
        inner = groups.tp_inner
        gen = torch.Generator().manual_seed(seed + index)
        q_all = torch.randn(b, tp * nh, 16, generator=gen)  # every TP rank's query heads
        q = maybe_all_gather_q_for_dcp(
            q_all[:, tp_rank * nh : (tp_rank + 1) * nh].contiguous(), dcp, pcp,
            tp_group=inner, dcp_group=groups.dcp,
        )  # fmt: skip
        ids = _expected_gathered_heads(pcp, dcp, tp_rank, inner.rank_in_group, inner.world_size)
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
            final = finalize_mla_pcp_decode(combined, nh, pcp_group=groups.pcp, tp_group=inner)
            torch.testing.assert_close(
                final.double(), merged[:, mine], rtol=1e-5, atol=1e-5,
                msg=lambda m, n=name, layout=(tp, pcp, dcp): f"{layout} {n}: {m}",
            )  # fmt: skip
            done.append(f"tp{tp}_pcp{pcp}_dcp{dcp}_{backend}_{name}")
    return done


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_each_tp_rank_gets_its_heads(run_ranks: Callable[..., list[Any]], world_size: int) -> None:
    results = run_ranks(_check_layouts, world_size, 2026, timeout=300.0)
    expected = [
        f"tp{tp}_pcp{pcp}_dcp{dcp}_{backend}_{name}"
        for tp, pcp, dcp in LAYOUTS[world_size]
        for backend, name in (
            ("ag_rs", "ag_ar" if pcp > 1 else "ag_rs"),
            ("a2a", "ag_ar" if dcp > pcp > 1 else "a2a"),
        )
    ]
    assert results == [expected] * world_size
