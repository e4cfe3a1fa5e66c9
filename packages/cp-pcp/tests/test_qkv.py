"""Global Q/K/V gather and local output slice: single-rank identity and bad input.

The multi-rank round trip and the end-to-end prefill run in ``distributed/test_pcp_dist.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpattn_common.group import CPGroupLike
from cpattn_pcp import dual_chunk_swap, gather_prefill_qkv_global, slice_prefill_output_local
from cpattn_testing import strategies
from cpattn_testing.pytest_plugin import RunRanks
from cpattn_testing.simulated import SimulatedWorld

MakeGroup = Callable[..., CPGroupLike]


def _qkv(t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    q = torch.randn(t, 4, 8, generator=g).to(device)
    k = torch.randn(t, 2, 8, generator=g).to(device)
    v = torch.randn(t, 2, 5, generator=g).to(device)
    return q, k, v


@pytest.mark.parametrize("mixed_dtypes", [False, True], ids=["packed", "separate"])
def test_single_rank_round_trip(
    fake_group: MakeGroup, device: torch.device, mixed_dtypes: bool
) -> None:
    plan = dual_chunk_swap([3, 1, 6], 1, device=device)
    q, k, v = _qkv(plan.num_tokens, device)
    if mixed_dtypes:
        v = v.double()
    local = [plan.local_rows(x, 0) for x in (q, k, v)]
    group = fake_group(1)
    qg, kg, vg = gather_prefill_qkv_global(plan, *local, pcp_group=group)
    for got, want in ((qg, q), (kg, k), (vg, v)):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    out = slice_prefill_output_local(plan, vg, plan.padded_local_len, pcp_group=group)
    assert torch.equal(out, local[2])
    assert slice_prefill_output_local(plan, vg, 2, pcp_group=group).shape == (2, 2, 5)


def test_fewer_local_rows_are_zero_padded(fake_group: MakeGroup) -> None:
    plan = dual_chunk_swap([3], 1)  # Lp = 4: one trailing padding row
    q, k, v = _qkv(3, torch.device("cpu"))
    qg, kg, vg = gather_prefill_qkv_global(plan, q, k, v, pcp_group=fake_group(1))
    assert torch.equal(qg, q)
    assert torch.equal(kg, k)
    assert torch.equal(vg, v)


def test_bad_input(fake_group: MakeGroup) -> None:
    plan = dual_chunk_swap([3, 5], 2)  # T = 8, P = 6
    q, k, v = _qkv(6, torch.device("cpu"))
    g2 = fake_group(2, 1)
    with pytest.raises(ValueError, match="world size 1 but the plan was built for pcp_size 2"):
        gather_prefill_qkv_global(plan, q, k, v, pcp_group=fake_group(1))
    with pytest.raises(ValueError, match="same number of rows"):
        gather_prefill_qkv_global(plan, q, k[:5], v, pcp_group=g2)
    q9, k9, v9 = _qkv(7, torch.device("cpu"))
    with pytest.raises(ValueError, match="7 rows but the plan has only padded_local_len = 6"):
        gather_prefill_qkv_global(plan, q9, k9, v9, pcp_group=g2)
    with pytest.raises(ValueError, match="pcp_group= is required"):
        gather_prefill_qkv_global(plan, q, k, v, pcp_group=None)  # type: ignore[arg-type]
    # Rank 0 holds 3 real rows, but its last real row is row 3 (row 1, the padded tail of
    # request 0, sits between them): 3 rows would silently drop token 4.
    assert (plan.num_local_tokens[0], plan.local_extent[0]) == (3, 4)
    q3, k3, v3 = _qkv(3, torch.device("cpu"))
    with pytest.raises(ValueError, match="rank 0's last real local row is row 3"):
        gather_prefill_qkv_global(plan, q3, k3, v3, pcp_group=fake_group(2, 0))
    with pytest.raises(ValueError, match="plan's indices are on meta"):
        gather_prefill_qkv_global(plan.to("meta"), q, k, v, pcp_group=g2)

    out = torch.randn(8, 4, 8)
    with pytest.raises(ValueError, match=r"num_actual must be in \[0, padded_local_len = 6\]"):
        slice_prefill_output_local(plan, out, 7, pcp_group=g2)
    with pytest.raises(ValueError, match="got -1"):
        slice_prefill_output_local(plan, out, -1, pcp_group=g2)
    with pytest.raises(TypeError, match="num_actual must be an int"):
        slice_prefill_output_local(plan, out, True, pcp_group=g2)
    with pytest.raises(ValueError, match=r"plan\.num_tokens = 8 rows"):
        slice_prefill_output_local(plan, out[:5], 4, pcp_group=g2)
    with pytest.raises(ValueError, match="world size 3"):
        slice_prefill_output_local(plan, out, 4, pcp_group=fake_group(3))
    # vLLM's plan is a tuple: it failed with "'tuple' object has no attribute 'pcp_size'".
    vllm_plan = (plan.restore_idx, plan.gather_idx, plan.cu_seqlens, plan.padded_local_len)
    with pytest.raises(TypeError, match=r"plan must be a DualChunkSwapPlan .* got tuple"):
        gather_prefill_qkv_global(vllm_plan, q, k, v, pcp_group=g2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"plan must be a DualChunkSwapPlan .* got tuple"):
        slice_prefill_output_local(vllm_plan, out, 4, pcp_group=g2)  # type: ignore[arg-type]


_GRAD_ERROR = (
    r"^gather_prefill_qkv_global: {} requires grad, but gather_prefill_qkv_global exchanges "
    r"data between ranks .*call it under torch.no_grad\(\) / "
    r"torch.inference_mode\(\), or pass detached tensors"
)


@pytest.mark.parametrize("mixed_dtypes", [False, True], ids=["packed", "separate"])
def test_gather_refuses_grad_on_one_rank(fake_group: MakeGroup, mixed_dtypes: bool) -> None:
    """With grad on, a Q/K/V that requires grad raises before the gather, on one rank too (the
    old code returned a result whose grad_fn is right only there). The slice, no collective,
    keeps its gradient; under no_grad nothing changes."""
    plan = dual_chunk_swap([3, 1, 6], 1)
    q, k, v = _qkv(plan.num_tokens, torch.device("cpu"))
    if mixed_dtypes:
        v = v.double()
    local = [plan.local_rows(x, 0) for x in (q, k, v)]
    group = fake_group(1)
    for i, name in enumerate(("query", "key", "value")):
        args = [x.requires_grad_(j == i) for j, x in enumerate(local)]
        with pytest.raises(RuntimeError, match=_GRAD_ERROR.format(name)):
            gather_prefill_qkv_global(plan, *args, pcp_group=group)
        with torch.no_grad():
            qg, kg, vg = gather_prefill_qkv_global(plan, *args, pcp_group=group)
        for got, want in ((qg, q), (kg, k), (vg, v)):
            assert not got.requires_grad
            assert torch.equal(got, want)
    out_global = q.clone().requires_grad_()
    assert slice_prefill_output_local(plan, out_global, 2, pcp_group=group).requires_grad


def _grad_body(rank: int, world_size: int) -> dict[str, object]:
    import torch.distributed as dist

    group = dist.group.WORLD
    assert group is not None
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    plan = dual_chunk_swap([5, 7, 2], world_size, device=dev)
    q, k, v = _qkv(plan.num_tokens, dev)
    results: dict[str, object] = {}
    for mode in ("packed", "separate"):
        vv = v.double() if mode == "separate" else v
        ql, kl, vl = (plan.local_rows(x, rank) for x in (q, k, vv))
        try:
            out = gather_prefill_qkv_global(plan, ql, kl.requires_grad_(), vl, pcp_group=group)
            results[mode] = f"no error: requires_grad={[t.requires_grad for t in out]}"
        except RuntimeError as exc:
            results[mode] = str(exc)
        with torch.no_grad():
            qg, kg, vg = gather_prefill_qkv_global(plan, ql, kl, vl, pcp_group=group)
        results[f"{mode}_no_grad"] = (
            torch.equal(qg, q) and torch.equal(kg, k) and torch.equal(vg, vv),
            qg.requires_grad or kg.requires_grad or vg.requires_grad,
        )
    return results


def test_gather_refuses_grad_multiprocess(run_ranks: RunRanks) -> None:
    """Two real ranks: the old code failed inside gloo's all-gather ("A view was created in
    no_grad mode and is being modified inplace...") or returned Q/K/V requiring grad through
    a grad_fn ignoring the other rank's rows."""
    for res in run_ranks(_grad_body, 2):
        for mode in ("packed", "separate"):
            assert re.search(_GRAD_ERROR.format("key"), str(res[mode])), (mode, res[mode])
            assert res[f"{mode}_no_grad"] == (True, False)


@pytest.mark.gpu
def test_device_side_ops_do_not_sync(fake_group: MakeGroup) -> None:
    """Once the plan is on the GPU, gather/restore/slice never wait for the device."""
    plan = dual_chunk_swap([5, 1, 12], 1, device="cuda")
    q, k, v = _qkv(plan.num_tokens, torch.device("cuda"))
    group = fake_group(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        local = [plan.local_rows(x, 0) for x in (q, k, v)]
        qg, _, vg = gather_prefill_qkv_global(plan, *local, pcp_group=group)
        gathered = plan.restore(local[0])
        out = slice_prefill_output_local(plan, vg, plan.padded_local_len, pcp_group=group)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(qg, q)
    assert torch.equal(gathered, q)
    assert torch.equal(out, local[2])


@settings(max_examples=40, deadline=None)
@given(
    pcp_size=strategies.world_sizes(max_size=4),
    seq_lens=strategies.seq_lens_lists(max_requests=4, max_len=24),
    drop_padding=st.booleans(),
)
def test_round_trip_on_virtual_ranks(
    pcp_size: int, seq_lens: list[int], drop_padding: bool
) -> None:
    """Gather to global order and slice back on N virtual ranks: identity on real tokens."""
    plan = dual_chunk_swap(seq_lens, pcp_size)
    q, k, v = _qkv(plan.num_tokens, torch.device("cpu"))

    def step(group: CPGroupLike) -> bool:
        r = group.rank_in_group
        real = plan.local_is_real[r]
        rows = int(real.nonzero().max()) + 1 if drop_padding and bool(real.any()) else None
        local = [plan.local_rows(x, r)[:rows] for x in (q, k, v)]
        qg, kg, vg = gather_prefill_qkv_global(plan, *local, pcp_group=group)
        assert torch.equal(qg, q)
        assert torch.equal(kg, k)
        assert torch.equal(vg, v)
        back = slice_prefill_output_local(plan, kg, local[1].shape[0], pcp_group=group)
        return torch.equal(back, local[1])

    assert all(SimulatedWorld(pcp_size).run(step))


def test_row_check_takes_symbolic_sizes(fake_group: MakeGroup) -> None:
    """``torch.export`` with a dynamic token dim makes the row counts ``SymInt``s, which cannot
    be hashed: the row check put them in a ``set`` and raised ``TypeError``."""
    plan = dual_chunk_swap([5, 3], 1)
    g = fake_group(1)

    class Gather(torch.nn.Module):
        def forward(
            self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return gather_prefill_qkv_global(plan, q, k, v, pcp_group=g)

    p = plan.padded_local_len
    args = (torch.randn(p, 2, 4), torch.randn(p, 1, 4), torch.randn(p, 1, 3))
    dim = torch.export.Dim.AUTO
    # strict=False (the default of later torch): torch 2.7's strict export refuses the plan's
    # index tensors, which the module closes over.
    exported = torch.export.export(
        Gather(), args, dynamic_shapes=({0: dim}, {0: dim}, {0: dim}), strict=False
    )
    for got, want in zip(exported.module()(*args), Gather()(*args), strict=True):
        assert torch.equal(got, want)
