"""Query-gather group selection and head reconciliation (single process, fake groups).

Real gathers over a TP x PCP x DCP layout run in ``distributed/test_pcp_dist.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from cpattn_common.group import CPGroupLike
from cpattn_pcp import (
    cp_reconcile_heads,
    dcp_q_gather_group,
    dcp_q_gather_size,
    finalize_mla_pcp_decode,
    maybe_all_gather_q_for_dcp,
)

MakeGroup = Callable[..., CPGroupLike]


@pytest.mark.parametrize(
    ("dcp", "pcp", "which", "size"),
    [
        (1, 1, None, 1),
        (2, 1, "dcp", 2),
        (8, 1, "dcp", 8),
        (4, 2, "tp", 2),
        (8, 2, "tp", 4),
        (2, 2, None, 1),
        (4, 4, None, 1),
        (1, 2, None, 1),
    ],
    ids=lambda v: str(v),
)
def test_gather_group_selection(
    fake_group: MakeGroup, dcp: int, pcp: int, which: str | None, size: int
) -> None:
    tp = fake_group(dcp // pcp if dcp > pcp else 2)
    dcp_g = fake_group(dcp)
    got = dcp_q_gather_group(dcp, pcp, tp_group=tp, dcp_group=dcp_g)
    assert got is {"tp": tp, "dcp": dcp_g, None: None}[which]
    assert dcp_q_gather_size(dcp, pcp) == size
    assert dcp_q_gather_size(dcp, pcp, tp_group=tp, dcp_group=dcp_g) == size


def test_gather_group_bad_layouts(fake_group: MakeGroup) -> None:
    with pytest.raises(ValueError, match="unsupported layout dcp_world_size=2, pcp_world_size=4"):
        dcp_q_gather_group(2, 4, tp_group=fake_group(1), dcp_group=fake_group(2))
    with pytest.raises(ValueError, match="dcp_world_size=6, pcp_world_size=4"):
        dcp_q_gather_size(6, 4)
    with pytest.raises(ValueError, match="dcp_world_size must be >= 1, got 0"):
        dcp_q_gather_size(0, 1)
    with pytest.raises(TypeError, match="pcp_world_size must be an int"):
        dcp_q_gather_size(2, True)
    with pytest.raises(ValueError, match="tp_group= is required"):
        dcp_q_gather_group(4, 2, dcp_group=fake_group(4))
    with pytest.raises(ValueError, match="dcp_group= is required"):
        dcp_q_gather_group(2, 1)
    with pytest.raises(ValueError, match=r"tp_group has world size 4, but .* needs 2"):
        dcp_q_gather_group(4, 2, tp_group=fake_group(4))
    with pytest.raises(ValueError, match=r"dcp_group has world size 2, but .* needs 4"):
        dcp_q_gather_size(4, 1, dcp_group=fake_group(2))


def test_maybe_all_gather_q(fake_group: MakeGroup) -> None:
    q = torch.randn(3, 2, 8)
    nope, pe = torch.randn(3, 2, 6), torch.randn(3, 2, 2)
    # No gather: the input object comes back, a tuple stays a tuple.
    assert maybe_all_gather_q_for_dcp(q, 2, 2) is q
    pair = (nope, pe)
    assert maybe_all_gather_q_for_dcp(pair, 1, 1) is pair
    assert maybe_all_gather_q_for_dcp(pair, 4, 2, tp_group=fake_group(2, 1, True)) is not pair
    # Already replicated: untouched even though the layout would gather.
    assert maybe_all_gather_q_for_dcp(q, 2, 1, True, dcp_group=fake_group(2)) is q
    assert maybe_all_gather_q_for_dcp(q, 4, 1, True) is q  # and needs no group
    assert maybe_all_gather_q_for_dcp(pair, 4, 2, already_replicated=True) is pair
    with pytest.raises(TypeError, match="q must be a tensor or a"):
        maybe_all_gather_q_for_dcp(list(pair), 4, 2, already_replicated=True)  # type: ignore[arg-type]
    # A gather concatenates (nope, pe) first and gathers along dim 1 (heads).
    group = fake_group(2, 0, True)
    out = maybe_all_gather_q_for_dcp(pair, 2, 1, dcp_group=group)
    assert isinstance(out, torch.Tensor)
    assert out.shape == (3, 4, 8)
    assert torch.equal(out, torch.cat([torch.cat(pair, -1)] * 2, dim=1))
    # A gather group of one rank does not communicate.
    solo = fake_group(1)
    assert maybe_all_gather_q_for_dcp(q, 2, 2, tp_group=solo) is q


def test_maybe_all_gather_q_bad_input(fake_group: MakeGroup) -> None:
    with pytest.raises(ValueError, match=r"\(nope, pe\) must be"):
        maybe_all_gather_q_for_dcp((torch.zeros(3, 2, 4), torch.zeros(3, 1, 4)), 2, 2)
    with pytest.raises(ValueError, match="q must be"):
        maybe_all_gather_q_for_dcp(torch.zeros(3), 2, 2)
    with pytest.raises(ValueError, match="dtype"):
        maybe_all_gather_q_for_dcp((torch.zeros(3, 2, 4), torch.zeros(3, 2, 2).half()), 2, 2)
    # The layout is checked even when the query is already replicated.
    with pytest.raises(ValueError, match="dcp_world_size"):
        maybe_all_gather_q_for_dcp(torch.zeros(3, 2, 4), 2, 4, already_replicated=True)


def test_finalize(fake_group: MakeGroup) -> None:
    out = torch.randn(5, 8, 4)
    assert finalize_mla_pcp_decode(out, 8) is out
    # Over: keep this TP rank's heads.
    got = finalize_mla_pcp_decode(out, 2, tp_group=fake_group(4, 3))
    assert torch.equal(got, out[:, 6:8])
    # Short: gather over PCP along the head dim.
    got = finalize_mla_pcp_decode(out, 16, pcp_group=fake_group(2, 1, True))
    assert got.shape == (5, 16, 4)


def test_cp_reconcile_heads_is_vllms_other_name() -> None:
    assert cp_reconcile_heads is finalize_mla_pcp_decode


def test_finalize_bad_input(fake_group: MakeGroup) -> None:
    out = torch.randn(5, 8, 4)
    with pytest.raises(ValueError, match="gives 16, not num_heads = 12"):
        finalize_mla_pcp_decode(out, 12, pcp_group=fake_group(2))
    with pytest.raises(ValueError, match="pcp_group= is required"):
        finalize_mla_pcp_decode(out, 16)
    with pytest.raises(ValueError, match="tp_group= is required"):
        finalize_mla_pcp_decode(out, 4)
    with pytest.raises(ValueError, match=r"expected num_heads \* tp world size = 3 \* 2 = 6"):
        finalize_mla_pcp_decode(out, 3, tp_group=fake_group(2))
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        finalize_mla_pcp_decode(out, 0)
    with pytest.raises(ValueError, match="output must be"):
        finalize_mla_pcp_decode(torch.zeros(4), 2)
