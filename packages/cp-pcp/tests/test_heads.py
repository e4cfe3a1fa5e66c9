"""Query-gather group selection and head reconciliation (single process, fake groups).

Real gathers over a TP x PCP x DCP layout run in ``distributed/test_pcp_dist.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

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
from cpattn_testing.pytest_plugin import RunRanks

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


@pytest.mark.no_checks  # a fake group answers no collective, check mode's included
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
    with pytest.raises(TypeError, match=r"q\[1\] \(pe\) must be a torch.Tensor, got NoneType"):
        maybe_all_gather_q_for_dcp((torch.zeros(3, 2, 4), None), 2, 2)  # type: ignore[arg-type]
    # The layout is checked even when the query is already replicated.
    with pytest.raises(ValueError, match="dcp_world_size"):
        maybe_all_gather_q_for_dcp(torch.zeros(3, 2, 4), 2, 4, already_replicated=True)
    # A group passed positionally landed in already_replicated and skipped the gather.
    with pytest.raises(TypeError, match="already_replicated must be a bool"):
        maybe_all_gather_q_for_dcp(torch.zeros(3, 2, 4), 2, 1, fake_group(2))  # type: ignore[arg-type]


@pytest.mark.no_checks  # a fake group answers no collective, check mode's included
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


_NO_GRAD = r"call it under torch.no_grad\(\) / torch.inference_mode\(\), or pass detached tensors"


def _grad_error(fn: str, arg: str) -> str:
    return (
        rf"^{fn}: {re.escape(arg)} requires grad, but {fn} exchanges data between ranks "
        rf".*{_NO_GRAD}"
    )


@pytest.mark.no_checks  # a fake group answers no collective, check mode's included
def test_gathers_refuse_grad(fake_group: MakeGroup) -> None:
    """With grad on, a tensor that requires grad raises when the layout makes the call gather
    (here over a replicated fake group of two); calls that return their input or slice it
    keep the ordinary gradient; under no_grad the gathers run."""
    q = torch.randn(3, 2, 8, requires_grad=True)
    nope, pe = torch.randn(3, 2, 6), torch.randn(3, 2, 2)
    group = fake_group(2, 0, True)
    fn = "maybe_all_gather_q_for_dcp"
    with pytest.raises(RuntimeError, match=_grad_error(fn, "q")):
        maybe_all_gather_q_for_dcp(q, 2, 1, dcp_group=group)
    with pytest.raises(RuntimeError, match=_grad_error(fn, "q[0] (nope)")):
        maybe_all_gather_q_for_dcp((nope.requires_grad_(), pe), 4, 2, tp_group=group)
    with pytest.raises(RuntimeError, match=_grad_error(fn, "q[1] (pe)")):
        maybe_all_gather_q_for_dcp((nope.detach(), pe.requires_grad_()), 2, 1, dcp_group=group)
    assert group.calls == []  # type: ignore[attr-defined]  # refused before communicating
    # No gather: the input comes back, gradient and all.
    assert maybe_all_gather_q_for_dcp(q, 2, 2) is q
    assert maybe_all_gather_q_for_dcp(q, 2, 1, True, dcp_group=group) is q
    assert maybe_all_gather_q_for_dcp(q, 2, 2, tp_group=fake_group(1)) is q
    with torch.no_grad():
        got = maybe_all_gather_q_for_dcp(q, 2, 1, dcp_group=group)
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, torch.cat([q.detach()] * 2, dim=1))

    out = torch.randn(5, 8, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=_grad_error("finalize_mla_pcp_decode", "output")):
        finalize_mla_pcp_decode(out, 16, pcp_group=group)
    assert finalize_mla_pcp_decode(out, 8) is out
    sliced = finalize_mla_pcp_decode(out, 2, tp_group=fake_group(4, 3))
    (grad,) = torch.autograd.grad(sliced.sum(), out)  # a plain view: its gradient is right
    assert torch.equal(grad[:, 6:8], torch.ones(5, 2, 4))
    assert not grad[:, :6].any()
    with torch.no_grad():
        assert finalize_mla_pcp_decode(out, 16, pcp_group=group).shape == (5, 16, 4)


def _grad_body(rank: int, world_size: int) -> dict[str, object]:
    """DCP = the whole world without PCP (query gathered over DCP), and DCP = PCP (the
    combine split the heads: finalize gathers them back over PCP)."""
    import torch.distributed as dist

    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    pg = dist.group.WORLD
    base = torch.arange(3 * 2 * 8, dtype=torch.float32, device=dev).view(3, 2, 8)
    mine = base + 100 * rank
    pe = torch.ones(3, 2, 2, device=dev) * rank
    calls: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
        "q": lambda m, p: maybe_all_gather_q_for_dcp(m, world_size, 1, dcp_group=pg),
        "pair": lambda m, p: maybe_all_gather_q_for_dcp((m, p), world_size, 1, dcp_group=pg),
        "finalize": lambda m, p: finalize_mla_pcp_decode(m, 2 * world_size, pcp_group=pg),
    }
    results: dict[str, object] = {}
    for name, call in calls.items():
        try:
            out = call(mine.clone().requires_grad_(), pe)
            results[name] = f"no error: requires_grad={out.requires_grad}"
        except RuntimeError as exc:
            results[name] = str(exc)
    with torch.no_grad():
        want_q = torch.cat([base + 100 * r for r in range(world_size)], dim=1)
        pairs = [(base + 100 * r, torch.ones(3, 2, 2, device=dev) * r) for r in range(world_size)]
        want_pair = torch.cat([torch.cat(pair, -1) for pair in pairs], dim=1)
        got = {name: call(mine.clone().requires_grad_(), pe) for name, call in calls.items()}
        results["no_grad"] = (
            torch.equal(got["q"], want_q),
            torch.equal(got["pair"], want_pair),
            torch.equal(got["finalize"], want_q),
        )
    return results


def test_gathers_refuse_grad_multiprocess(run_ranks: RunRanks) -> None:
    """Two real ranks: the old code failed inside gloo's all-gather ("A view was created in
    no_grad mode and is being modified inplace...")."""
    for res in run_ranks(_grad_body, 2):
        for name, fn, arg in [
            ("q", "maybe_all_gather_q_for_dcp", "q"),
            ("pair", "maybe_all_gather_q_for_dcp", "q[0] (nope)"),
            ("finalize", "finalize_mla_pcp_decode", "output"),
        ]:
            assert re.search(_grad_error(fn, arg), str(res[name])), (name, res[name])
        assert res["no_grad"] == (True, True, True)
