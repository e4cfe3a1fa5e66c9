"""A failure is sticky on the device: once a wait of a rank timed out on a ubatch, that rank's
publishes on the ubatch store nothing into any peer (no payload, no counter, no signal) and its
later waits fail at once, keeping the first error record.

Why: the host learns of a timeout only later (CUDA: up to ``error_check_interval`` calls), and
the timed-out wait still advances the epoch, so the rank goes on issuing calls. Without the
device-side check its next publishes stored into a merely slow peer's slot while that peer was
still reading it: a finite, wrong result and no error on the peer. Here the host check is
skipped with ``validate=False`` (on CUDA it sees nothing yet), as the rank's launches would run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_dcp.direct import (
    DirectDCPA2AWorkspace,
    DirectDCPKVGatherWorkspace,
    DirectDCPQGatherWorkspace,
    DirectProtocolError,
)
from cpattn_dcp.direct._base import missing_ranks
from cpattn_testing.reference import lse_combine_ref
from cpattn_testing.tolerances import assert_close_to_ref

Build = Callable[..., tuple[Any, list[Any]]]


def _a2a(device: torch.device, **kw: Any) -> Any:
    return lambda g: DirectDCPA2AWorkspace(g, device, 4, 1, 8, torch.bfloat16, **kw)


def _q(device: torch.device, **kw: Any) -> Any:
    return lambda g: DirectDCPQGatherWorkspace(
        g, device, 2, 1, 8, torch.bfloat16, require_multicast=False, **kw
    )


def _kv(device: torch.device, **kw: Any) -> Any:
    return lambda g: DirectDCPKVGatherWorkspace(
        g, device, 8, 8, torch.bfloat16, require_multicast=False, **kw
    )


def _record(ws: Any) -> tuple[int, int, list[int]]:
    """``(flag, epoch, missing sources)`` of ubatch 0's device error record."""
    rec = ws._error[0].tolist()
    return rec[0], rec[1], missing_ranks(rec[2:], ws.world_size)


def _snapshot(wss: list[Any], names: tuple[str, ...]) -> dict[tuple[int, str], torch.Tensor]:
    """Copies of every rank's symmetric buffers ``names`` and its publish counters."""
    snap = {(r, name): getattr(ws, name).clone() for r, ws in enumerate(wss) for name in names}
    snap.update({(r, "_pub_counter"): ws._pub_counter.clone() for r, ws in enumerate(wss)})
    return snap


def _assert_unchanged(wss: list[Any], snap: dict[tuple[int, str], torch.Tensor]) -> None:
    for (r, name), before in snap.items():
        now = getattr(wss[r], name)
        # Bitwise (NaN payloads included): nothing may have been stored.
        same = torch.equal(now.view(torch.uint8), before.view(torch.uint8))
        assert same, f"rank {r} {name} changed"


_A2A_BUFFERS = ("recv_out", "recv_lse", "recv_signal")


def test_a2a_publish_after_a_timeout_writes_nothing_into_any_peer(
    sim_build: Build, device: torch.device
) -> None:
    """Rank 0's wait times out (rank 1 never published); rank 0's next publishes, in both
    parity slots, change no byte of rank 1's (or its own) receive buffers and signal words and
    bump no counter; its next wait fails at once and keeps the first record."""
    n, t = 2, 2
    _, wss = sim_build(n, device, _a2a(device, max_spins=2))
    gen = torch.Generator(device="cpu").manual_seed(3)
    o = torch.randn(3, t, n, 8, generator=gen).to(device, torch.bfloat16)
    lse = torch.randn(3, t, n, generator=gen).to(device)

    wss[0].publish(o[0], lse[0])
    assert torch.isnan(wss[0].wait_and_combine(t)).all()
    assert _record(wss[0]) == (1, 1, [1])
    assert int(wss[1].recv_signal[0, 1, 0]) == 1  # call 1 did reach rank 1 before the failure

    snap = _snapshot(wss, _A2A_BUFFERS)
    wss[0].publish(o[1], lse[1], validate=False)  # call 2: parity 0
    _assert_unchanged(wss, snap)
    out = wss[0].wait_and_combine(t)
    assert torch.isnan(out).all()
    assert _record(wss[0]) == (1, 1, [1])  # the first timeout's record, not overwritten
    assert wss[0].epoch.tolist() == [2]
    wss[0].publish(o[2], lse[2], validate=False)  # call 3: parity 1, call 1's slot
    _assert_unchanged(wss, snap)
    with pytest.raises(DirectProtocolError, match=r"epoch 1 .*source rank\(s\) \[1\]"):
        wss[0].check_error()


def test_a2a_slow_peer_gets_intact_data_then_a_timeout_never_a_torn_result(
    sim_build: Build, device: torch.device
) -> None:
    """The reviewer's interleaving. Rank 1 is slow: rank 0's calls 1 and 2 time out, and rank
    0 (unaware on the host) issues call 3 into rank 1's parity slot 1 while rank 1 still has to
    read call 1 from it; the window between call 3's payload stores and its signal is emulated
    by a publish counter that keeps the last program from raising the signal. Before the fix
    rank 1's call 1 combined rank 0's call-3 payload (finite, wrong, no error). Now call 3
    stores nothing, rank 1's call 1 is exact, and its call 2 (rank 0 never published it)
    times out: NaN and an error record naming rank 0."""
    n, t, h_r = 2, 2, 1
    _, wss = sim_build(n, device, _a2a(device, max_spins=2))
    gen = torch.Generator(device="cpu").manual_seed(0)

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.randn(n, t, n * h_r, 8, generator=gen).to(device, torch.bfloat16)
        return o, torch.randn(n, t, n * h_r, generator=gen).to(device)

    (o1, l1), (o2, l2), (o3, l3) = data(), data(), data()
    for o, lse in ((o1, l1), (o2, l2)):  # rank 0, calls 1 and 2: rank 1 is slow
        wss[0].publish(o[0], lse[0], validate=False)
        assert torch.isnan(wss[0].wait_and_combine(t)).all()
    wss[1].publish(o1[1], l1[1])  # rank 1 arrives: call 1
    wss[0]._pub_counter[0, 1] = -100  # call 3's signal to rank 1 stays unraised
    wss[0].publish(o3[0], l3[0], validate=False)  # call 3 -> rank 1's parity slot 1

    out1 = wss[1].wait_and_combine(t)
    ref1, _ = lse_combine_ref(o1, l1)
    assert isinstance(out1, torch.Tensor)
    assert_close_to_ref(out1, ref1[:, h_r : 2 * h_r], dtype=torch.bfloat16, name="rank 1 call 1")
    wss[1].check_error()  # call 1 completed

    wss[1].publish(o2[1], l2[1])  # call 2: rank 0's publish of call 2 stored nothing
    out2 = wss[1].wait_and_combine(t)
    assert isinstance(out2, torch.Tensor)
    assert torch.isnan(out2).all(), "rank 1 must time out, not combine data rank 0 never sent"
    with pytest.raises(DirectProtocolError, match=r"rank 1, .*epoch 2 .*source rank\(s\) \[0\]"):
        wss[1].check_error()


def test_q_gather_publish_after_a_timeout_writes_nothing_into_any_peer(
    sim_build: Build, device: torch.device
) -> None:
    """Q gather (one buffer, no parity slot): after rank 0's wait timed out, its publishes do
    not touch rank 1's gathered queries or signals, so rank 1's call 1 still holds rank 0's
    call-1 heads (before the fix, rank 0's call 2 overwrote them), and rank 1's call 2 times
    out."""
    n = 2
    _, qs = sim_build(n, device, _q(device, max_spins=2))
    gen = torch.Generator(device="cpu").manual_seed(4)
    q = torch.randn(4, n, 1, 1, 8, generator=gen).to(device, torch.bfloat16)  # [call, rank]

    qs[0].publish(q[0, 0])
    assert torch.isnan(qs[0].wait(1)).all()
    assert _record(qs[0]) == (1, 1, [1])
    snap = _snapshot(qs, ("final_query", "recv_signal"))
    qs[0].publish(q[1, 0], validate=False)  # call 2
    _assert_unchanged(qs, snap)
    assert torch.isnan(qs[0].wait(1, validate=False)).all()
    assert _record(qs[0]) == (1, 1, [1])
    qs[0].publish(q[2, 0], validate=False)  # call 3 (the other parity's signal word)
    _assert_unchanged(qs, snap)

    qs[1].publish(q[0, 1])  # rank 1, call 1: both ranks' call 1 are in
    got = qs[1].wait(1).clone()
    qs[1].check_error()
    assert torch.equal(got, torch.cat([q[0, 0], q[0, 1]], dim=1))
    qs[1].publish(q[1, 1])  # call 2: rank 0 never signals it
    assert torch.isnan(qs[1].wait(1)).all()
    assert _record(qs[1]) == (1, 2, [0])


def test_kv_gather_publish_after_a_timeout_writes_nothing_into_any_peer(
    sim_build: Build, device: torch.device
) -> None:
    """KV gather: after rank 0's wait timed out, its publishes (both parity slots) do not touch
    rank 1's slots or signals; rank 1's call 1 gathers rank 0's call-1 rows and its call 2
    times out, reading nothing and leaving NaN in its output."""
    n, t, d = 2, 2, 8
    _, kvs = sim_build(n, device, _kv(device, max_spins=2))
    gen = torch.Generator(device="cpu").manual_seed(5)
    kv = torch.randn(4, n, t, d, generator=gen).to(device, torch.bfloat16)  # [call, rank]
    out = torch.zeros(n * t, d, device=device, dtype=torch.bfloat16)

    kvs[0].publish(kv[0, 0])
    kvs[0].wait(out)
    assert torch.isnan(out).all()
    assert _record(kvs[0]) == (1, 1, [1])
    snap = _snapshot(kvs, ("received_kv", "recv_signal"))
    kvs[0].publish(kv[1, 0], validate=False)  # call 2: parity 0
    _assert_unchanged(kvs, snap)
    out.zero_()
    kvs[0].wait(out, validate=False)
    assert torch.isnan(out).all()  # a later wait on the failed ubatch poisons too
    assert _record(kvs[0]) == (1, 1, [1])
    kvs[0].publish(kv[2, 0], validate=False)  # call 3: parity 1, call 1's slot
    _assert_unchanged(kvs, snap)

    kvs[1].publish(kv[0, 1])
    kvs[1].wait(out)
    kvs[1].check_error()
    assert torch.equal(out, kv[0].reshape(n * t, d))
    out2 = torch.zeros_like(out)
    kvs[1].publish(kv[1, 1])
    kvs[1].wait(out2)
    assert torch.isnan(out2).all(), "a timed-out KV gather must mark its output, not copy"
    assert _record(kvs[1]) == (1, 2, [0])
