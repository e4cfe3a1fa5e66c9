"""Written tensors that overlap the inputs are refused, and check mode reads the device-side
mask values (``seq_lens >= 0``, a non-decreasing ``query_start_loc`` within the batch) on every
op that takes them, which plain calls never do (no host sync)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_common.checks import check_mode
from cpattn_dcp import (
    a2a_pack,
    correct_attn_out,
    cp_lse_ag_out_ar,
    cp_lse_ag_out_rs,
    dcp_a2a_lse_reduce,
    dcp_gather_kv,
    mask_dcp_empty_shards_,
)
from cpattn_testing.simulated import SimulatedWorld

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

B, H, D, N = 4, 2, 8, 3


def test_correct_attn_out_refuses_out_overlapping_lses(device: torch.device) -> None:
    buf = torch.zeros(B * H * D + N * B * H, device=device)
    out = buf[: B * H * D].view(B, H, D)
    lses = buf[B * H * D :].view(N, B, H)
    correct_attn_out(out, lses, 0)  # adjacent, not overlapping
    shifted = buf[B * H * D - 1 : -1].view(N, B, H)
    with pytest.raises(ValueError, match=r"correct_attn_out: out .* overlaps lses"):
        correct_attn_out(out, shifted, 0)
    with pytest.raises(ValueError, match="overlaps lses"):  # the [B, 1, H, D] form too
        correct_attn_out(out.unsqueeze(1), shifted, 0)


def test_mask_refuses_lse_overlapping_the_index_tensors(device: torch.device) -> None:
    lse = torch.zeros(B, H, device=device)
    words = lse.view(torch.int32).view(-1)
    qsl = torch.tensor([0, 2, B], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"mask_dcp_empty_shards_: lse .* overlaps seq_lens"):
        mask_dcp_empty_shards_(lse, words[:2], qsl)
    with pytest.raises(ValueError, match="overlaps query_start_loc"):
        mask_dcp_empty_shards_(lse, qsl[1:], words[:3])


def test_gather_kv_refuses_a_buffer_overlapping_local_kv(device: torch.device) -> None:
    group = SimulatedWorld(1, device).groups[0]
    buf = torch.zeros(6, 4, device=device)
    dcp_gather_kv(buf, torch.ones(3, 4, device=device), group)
    with pytest.raises(ValueError, match=r"dcp_gather_kv: gathered_kv .* overlaps local_kv"):
        dcp_gather_kv(buf, buf[2:5], group)


def test_a2a_pack_refuses_send_overlapping_its_inputs(device: torch.device) -> None:
    send = torch.zeros(1, B, H, D + 1, device=device)
    with pytest.raises(ValueError, match=r"a2a_pack: send .* overlaps cp_attn_out"):
        a2a_pack(send.view(-1)[: B * H * D].view(B, H, D), torch.zeros(B, H, device=device), 1,
                 send=send)  # fmt: skip


def _mask_op(lse: torch.Tensor, sl: torch.Tensor, qsl: torch.Tensor) -> Any:
    return mask_dcp_empty_shards_(lse.clone(), sl, qsl)


def _combine(op: Callable[..., Any]) -> Callable[..., Any]:
    def call(lse: torch.Tensor, sl: torch.Tensor, qsl: torch.Tensor) -> Any:
        out = torch.linspace(-1, 1, B * H * D, device=lse.device).view(B, H, D)
        group = SimulatedWorld(1, lse.device).groups[0]  # one rank: no communication
        return op(out, lse, group, seq_lens=sl, query_start_loc=qsl)

    return call


def _pack(lse: torch.Tensor, sl: torch.Tensor, qsl: torch.Tensor) -> Any:
    out = torch.linspace(-1, 1, B * H * D, device=lse.device).view(B, H, D)
    return a2a_pack(out, lse, 1, seq_lens=sl, query_start_loc=qsl)


MASKED_OPS = {
    "mask_dcp_empty_shards_": _mask_op,
    "cp_lse_ag_out_rs": _combine(cp_lse_ag_out_rs),
    "cp_lse_ag_out_ar": _combine(cp_lse_ag_out_ar),
    "dcp_a2a_lse_reduce": _combine(dcp_a2a_lse_reduce),
    "a2a_pack": _pack,
}
BAD_VALUES = [
    ([1, -2], [0, 1, 3], r"seq_lens\[1\] = -2: lengths must be >= 0"),
    ([1, 2], [-1, 1, 3], r"query_start_loc\[0\] = -1: offsets must be >= 0"),
    ([1, 2], [0, 3, 2], r"query_start_loc decreases at index 2 \(3 -> 2\)"),
    ([1, 2], [0, 1, B + 1], rf"query_start_loc\[2\] = {B + 1} is beyond the batch of {B} rows"),
]


@pytest.mark.no_checks  # turns check mode on itself, around the calls that need it
@pytest.mark.parametrize("name", list(MASKED_OPS))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_check_mode_reads_the_mask_values(
    device: torch.device, name: str, dtype: torch.dtype
) -> None:
    op = MASKED_OPS[name]
    lse = torch.randn(B, H, device=device)
    for lens, offsets, message in BAD_VALUES:
        if dtype == torch.uint8 and min(lens + offsets) < 0:
            continue  # not representable
        sl = torch.tensor(lens, dtype=dtype, device=device)
        qsl = torch.tensor(offsets, dtype=dtype, device=device)
        op(lse, sl, qsl)  # outside check mode: no host read, no error
        with check_mode(), pytest.raises(ValueError, match=message + r".*\(check mode\)"):
            op(lse, sl, qsl)
    good = (torch.tensor([1, 0], device=device), torch.tensor([0, 1, 3], device=device))
    with check_mode():
        checked = op(lse, *good)
    plain = op(lse, *good)
    torch.testing.assert_close(checked, plain, equal_nan=True)


@pytest.mark.parametrize("bad", ["cdua", *([] if torch.cuda.is_available() else ["cuda"])])
def test_manager_refuses_a_device_torch_cannot_use(bad: Any) -> None:
    from cpattn_dcp import DCPConfig, DCPManager

    group = SimulatedWorld(1, torch.device("cpu")).groups[0]
    with pytest.raises((ValueError, TypeError), match="device"):
        DCPManager(DCPConfig(), group, bad, 2, 8, torch.float32)


@pytest.mark.parametrize("op", [cp_lse_ag_out_rs, cp_lse_ag_out_ar, dcp_a2a_lse_reduce])
def test_check_mode_accepts_ranks_whose_tensors_differ_only_in_strides(
    device: torch.device, op: Callable[..., Any]
) -> None:
    """Strides are not part of the ranks' signature: each rank stages or packs its own tensors
    into the collective's layout, so rank 0 passing a strided view of ``out`` and a transposed
    ``lse`` while rank 1 passes contiguous tensors is a valid call (check mode is on in every
    test), and the result is the float64 combine."""
    from cpattn_testing.reference import lse_combine_ref
    from cpattn_testing.tolerances import assert_close_to_ref

    n, h = 2, 4
    outs = torch.randn(n, B, h, D, device=device)
    lses = torch.randn(n, B, h, device=device)

    def call(group: Any) -> torch.Tensor:
        r = group.rank_in_group
        out, lse = outs[r], lses[r]
        if r == 0:
            out = torch.randn(B, h, 2 * D, device=device)[..., ::2].copy_(out)  # strided rows
            lse = lse.t().contiguous().t()  # [B, H] with strides (1, B)
        return op(out, lse, group)

    results = SimulatedWorld(n, device).run(call)
    ref, _ = lse_combine_ref(outs.double(), lses.double())
    if op is cp_lse_ag_out_ar:
        ref = ref.expand(n, -1, -1, -1)
    else:  # each rank holds its own heads
        ref = ref.view(B, n, h // n, D).transpose(0, 1)
    for r in range(n):
        assert_close_to_ref(results[r], ref[r], dtype=torch.float32)


@pytest.mark.no_checks  # compares the op with check mode off and on
@pytest.mark.parametrize(
    "name", ["cp_lse_ag_out_rs", "cp_lse_ag_out_ar", "dcp_a2a_lse_reduce", "dcp_gather_kv"]
)
def test_check_mode_adds_one_collective_and_off_adds_none(
    device: torch.device, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off, a collective op makes exactly its own collectives; on, one all-gather more (the
    signature) and the same result."""
    from cpattn_testing.simulated import SimulatedGroup

    n, h = 2, 4
    outs = torch.randn(n, B, h, D, device=device)
    lses = torch.randn(n, B, h, device=device)
    calls: list[str] = []
    exchange = SimulatedGroup._exchange

    def counted(self: Any, op: str, value: Any, **kwargs: Any) -> Any:
        if self.rank_in_group == 0:
            calls.append(op)
        return exchange(self, op, value, **kwargs)

    monkeypatch.setattr(SimulatedGroup, "_exchange", counted)
    ops = {
        "cp_lse_ag_out_rs": cp_lse_ag_out_rs,
        "cp_lse_ag_out_ar": cp_lse_ag_out_ar,
        "dcp_a2a_lse_reduce": dcp_a2a_lse_reduce,
    }

    def call(group: Any) -> torch.Tensor:
        r = group.rank_in_group
        if name == "dcp_gather_kv":
            return dcp_gather_kv(torch.empty(n * B, D, device=device), outs[r, :, 0], group)
        return ops[name](outs[r], lses[r], group)

    world = SimulatedWorld(n, device)
    off = world.run(call)
    plain = list(calls)
    calls.clear()
    with check_mode():
        on = world.run(call)
    assert calls == ["all_gather_into_tensor", *plain]
    for a, b in zip(off, on, strict=True):
        torch.testing.assert_close(a, b)
