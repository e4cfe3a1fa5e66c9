"""A failure is sticky on the device: once a wait of a rank timed out on a ubatch, that rank's
publishes on the ubatch store nothing into any peer (no payload, no counter, no signal) and its
later waits fail at once, keeping the first error record.

Why: the host learns of a timeout only later (CUDA: up to ``error_check_interval`` calls), and
the timed-out wait still advances the epoch, so the rank goes on issuing calls. Without the
device-side check its next publishes stored into a merely slow peer's slot while that peer was
still reading it: a finite, wrong result and no error on the peer. Here the host check is
skipped with ``validate=False`` (on CUDA it sees nothing yet), as the rank's launches would run.

The failure is sticky per group as well: a timeout of any direct workspace of a group sets the
rank's group failure word, which stops every publish and fails every wait of all the group's
direct workspaces on that rank (the query gather relies on the combine's rendezvous between its
calls, so a combine timeout must stop it too); another group is not affected.
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


# -- the failure is sticky per group: every direct workspace of the group on the rank stops -----

_GROUP_FAILED = r"another direct workspace of this group timed out first"


def _record_of(ws: Any, u: int) -> tuple[int, int, list[int]]:
    """``(flag, epoch, missing sources)`` of ubatch ``u``'s device error record."""
    rec = ws._error[u].tolist()
    return rec[0], rec[1], missing_ranks(rec[2:], ws.world_size)


def test_query_gather_stops_after_the_a2a_of_its_group_timed_out(
    sim_build: Build, device: torch.device
) -> None:
    """The reviewer's interleaving across workspaces. Rank 0's A2A combine of step 1 times out
    (rank 1 is merely slow); rank 0's host does not know yet and issues step 2's query gather.
    The query gather has one buffer per ubatch, guarded only by the combine's rendezvous: before
    the fix rank 0's (still healthy) query-gather publish stored step 2's heads into rank 1's
    buffer while rank 1 had not read step 1 yet, so rank 1 gathered a finite, wrong query and no
    error. Now the A2A's timeout fails the whole group on rank 0: the publish stores nothing,
    rank 1 reads step 1 intact, its step-2 wait times out (NaN), and both ranks' query gathers
    raise, rank 0's saying that another workspace of its group timed out first."""
    n = 2
    _, wss = sim_build(
        n, device, lambda g: (_a2a(device, max_spins=2)(g), _q(device, max_spins=2)(g))
    )
    (a0, q0), (a1, q1) = wss
    gen = torch.Generator(device="cpu").manual_seed(8)
    q = torch.randn(3, n, 1, 1, 8, generator=gen).to(device, torch.bfloat16)  # [step, rank]
    o = torch.randn(3, n, 1, n, 8, generator=gen).to(device, torch.bfloat16)
    lse = torch.randn(3, n, 1, n, generator=gen).to(device)

    q0.publish(q[1, 0])
    q1.publish(q[1, 1])
    assert torch.equal(q0.wait(1), torch.cat([q[1, 0], q[1, 1]], dim=1))
    a0.publish(o[1, 0], lse[1, 0])
    assert torch.isnan(a0.wait_and_combine(1)).all()  # rank 1 has not published: timeout
    assert _record(a0) == (1, 1, [1])

    snap = _snapshot([q0, q1], ("final_query", "recv_signal"))
    q0.publish(q[2, 0], validate=False)  # step 2, before rank 0's host learns of the timeout
    _assert_unchanged([q0, q1], snap)

    got = q1.wait(1).clone()  # rank 1 reaches step 1's gather: step 1's heads, intact
    q1.check_error()
    assert torch.equal(got, torch.cat([q[1, 0], q[1, 1]], dim=1))
    a1.publish(o[1, 1], lse[1, 1])  # rank 0 published its step-1 partial before the failure
    out1 = a1.wait_and_combine(1)
    assert isinstance(out1, torch.Tensor)
    a1.check_error()
    ref1, _ = lse_combine_ref(o[1], lse[1])
    assert_close_to_ref(out1, ref1[:, 1:2], dtype=torch.bfloat16, name="rank 1 step 1")

    q1.publish(q[2, 1])  # step 2: rank 0's publish stored nothing, so this times out
    assert torch.isnan(q1.wait(1)).all(), "rank 1 must time out, not use queries never sent"
    assert _record(q1) == (1, 2, [0])
    assert torch.isnan(q0.wait(1, validate=False)).all()  # rank 0 fails at once, nothing polled
    assert _record(q0) == (2, 2, [])

    with pytest.raises(DirectProtocolError, match=rf"rank 0, ubatch 0: .*{_GROUP_FAILED}"):
        q0.check_error()
    with pytest.raises(DirectProtocolError, match=rf"rank 0, ubatch 0: .*{_GROUP_FAILED}"):
        q0.publish(q[2, 0])  # the lazy (CPU: next call) path says the same
    with pytest.raises(DirectProtocolError, match=r"rank 0, .*epoch 1 .*source rank\(s\) \[1\]"):
        a0.check_error()
    with pytest.raises(DirectProtocolError, match=r"rank 1, .*epoch 2 .*source rank\(s\) \[0\]"):
        q1.check_error()


def test_kv_gather_of_another_ubatch_stops_after_the_a2a_of_its_group_timed_out(
    sim_build: Build, device: torch.device
) -> None:
    """Rank 0's A2A times out on ubatch 0; its KV gather (another workspace and geometry, on
    ubatch 1) then publishes nothing into rank 1, rank 1's KV wait times out (NaN output,
    record naming rank 0), and rank 0's own KV wait fails at once with a flag-2 record."""
    n, t, d = 2, 2, 8
    _, wss = sim_build(
        n,
        device,
        lambda g: (_a2a(device, max_spins=2)(g), _kv(device, max_spins=2, num_ubatches=2)(g)),
    )
    (a0, kv0), (_, kv1) = wss
    gen = torch.Generator(device="cpu").manual_seed(9)
    o = torch.randn(t, n, 8, generator=gen).to(device, torch.bfloat16)
    lse = torch.randn(t, n, generator=gen).to(device)
    kv = torch.randn(n, t, d, generator=gen).to(device, torch.bfloat16)

    a0.publish(o, lse)
    assert torch.isnan(a0.wait_and_combine(t)).all()
    snap = _snapshot([kv0, kv1], ("received_kv", "recv_signal"))
    kv0.publish(kv[0], ubatch_id=1, validate=False)
    _assert_unchanged([kv0, kv1], snap)

    out1 = torch.zeros(n * t, d, device=device, dtype=torch.bfloat16)
    kv1.publish(kv[1], ubatch_id=1)
    kv1.wait(out1, ubatch_id=1)
    assert torch.isnan(out1).all(), "rank 1 must time out: rank 0 published nothing"
    assert _record_of(kv1, 1) == (1, 1, [0])
    out0 = torch.zeros_like(out1)
    kv0.wait(out0, ubatch_id=1, validate=False)
    assert torch.isnan(out0).all()
    assert _record_of(kv0, 1) == (2, 1, [])
    assert _record_of(kv0, 0) == (0, 0, [])  # ubatch 0 of the KV gather made no call
    with pytest.raises(DirectProtocolError, match=rf"rank 0, ubatch 1: .*{_GROUP_FAILED}"):
        kv0.check_error()
    with pytest.raises(DirectProtocolError, match=r"rank 1, ubatch 1: .*source rank\(s\) \[0\]"):
        kv1.check_error()


def _three(device: torch.device) -> Callable[[Any], tuple[Any, Any, Any]]:
    return lambda g: (
        _a2a(device, max_spins=2)(g),
        _q(device, max_spins=2)(g),
        _kv(device, max_spins=2)(g),
    )


def test_a_timeout_in_one_group_leaves_another_group_working(
    sim_build: Build, device: torch.device
) -> None:
    """The failure word is per (group, device): after rank 0 of one world timed out, every
    workspace of a second world (same geometries, built while the first world's are alive)
    runs three healthy steps with exact results, and no rank of it records an error."""
    n, t, d = 2, 1, 8
    _, bad = sim_build(n, device, _three(device))
    _, good = sim_build(n, device, _three(device))
    assert bad[0][0]._group_failure is bad[0][2]._group_failure  # one word per rank's group
    assert bad[0][0]._group_failure is not bad[1][0]._group_failure  # each rank its own
    assert bad[0][0]._group_failure is not good[0][0]._group_failure
    bad[0][0].publish(*_a2a_inputs(n, t, seed=1, device=device)[0])
    assert torch.isnan(bad[0][0].wait_and_combine(t)).all()

    gen = torch.Generator(device="cpu").manual_seed(10)
    for _step in range(3):
        q = torch.randn(n, t, 1, 8, generator=gen).to(device, torch.bfloat16)
        for r in range(n):
            good[r][1].publish(q[r])
        for r in range(n):
            assert torch.equal(good[r][1].wait(t), torch.cat(list(q), dim=1))
        inputs = _a2a_inputs(n, t, seed=_step, device=device)
        for r in range(n):
            good[r][0].publish(*inputs[r])
        ref, _ = lse_combine_ref(
            torch.stack([i[0] for i in inputs]), torch.stack([i[1] for i in inputs])
        )
        for r in range(n):
            out = good[r][0].wait_and_combine(t)
            assert isinstance(out, torch.Tensor)
            assert_close_to_ref(out, ref[:, r : r + 1], dtype=torch.bfloat16, name="good a2a")
        kv = torch.randn(n, t, d, generator=gen).to(device, torch.bfloat16)
        for r in range(n):
            good[r][2].publish(kv[r])
        for r in range(n):
            out_kv = torch.zeros(n * t, d, device=device, dtype=torch.bfloat16)
            good[r][2].wait(out_kv)
            assert torch.equal(out_kv, kv.reshape(n * t, d))
    for r in range(n):
        for ws in good[r]:
            ws.check_error()
        assert int(good[r][0]._group_failure[0]) == 0
    assert int(bad[0][0]._group_failure[0]) == 1


def _a2a_inputs(
    n: int, t: int, *, seed: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's ``(partial_out [t, n, 8], partial_lse [t, n])`` for a 1-head-per-rank A2A."""
    gen = torch.Generator(device="cpu").manual_seed(100 + seed)
    return [
        (
            torch.randn(t, n, 8, generator=gen).to(device, torch.bfloat16),
            torch.randn(t, n, generator=gen).to(device),
        )
        for _ in range(n)
    ]


def test_group_failure_word_is_shared_per_group_and_device_and_released_with_its_workspaces(
    device: torch.device,
) -> None:
    """One word per (group, device) while some holder lives; forgotten once none does."""
    import gc

    from cpattn_dcp.direct import _group_failure
    from cpattn_testing.simulated import SimulatedWorld

    world = SimulatedWorld(2, device)
    g0, g1 = world.groups
    word = _group_failure.group_failure_word(g0, device)
    assert _group_failure.group_failure_word(g0, device) is word
    assert _group_failure.group_failure_word(g1, device) is not word
    assert word.dtype == torch.int64
    assert tuple(word.shape) == (1,)
    assert int(word[0]) == 0
    key = (id(g0), str(device))
    assert key in _group_failure._words
    del word
    gc.collect()
    assert key not in _group_failure._words  # g0's entry (and its hold on g0) went with it


def test_a_real_timeout_is_reported_before_a_group_failure(
    sim_build: Build, device: torch.device
) -> None:
    """A record with flag 2 on ubatch 0 and flag 1 on ubatch 1 names the missing ranks of
    ubatch 1 (the timeout of this workspace), not the group failure."""
    _, wss = sim_build(2, device, _a2a(device, max_spins=2, num_ubatches=2))
    record = torch.zeros_like(wss[0]._error)
    record[0, :2] = torch.tensor([2, 3])
    record[1, :3] = torch.tensor([1, 4, 0b10])
    with pytest.raises(DirectProtocolError, match=r"ubatch 1: .*epoch 4 .*source rank\(s\) \[1\]"):
        wss[0]._raise_from(record)
