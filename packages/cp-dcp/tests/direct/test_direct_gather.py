"""Direct query / KV gathers on simulated ranks (data path with ``require_multicast=False``),
their protocol, validation, and the rule that they are never created without multicast."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import triton.language as tl

from cpattn_common import capability
from cpattn_common.ubatch import ubatch_context
from cpattn_dcp.direct import (
    DirectDCPKVGatherWorkspace,
    DirectDCPQGatherWorkspace,
    DirectProtocolError,
    get_direct_dcp_kv_gather_workspace,
    get_direct_dcp_q_gather_workspace,
)
from cpattn_dcp.direct import q_gather as q_gather_module
from cpattn_dcp.direct._base import error_record_width, missing_ranks
from cpattn_dcp.direct.kv_gather import _COPY_BLOCK
from cpattn_dcp.gather import reserve_query_head_storage
from cpattn_dcp.kernels.direct_gather import (
    _direct_gather_publish_kernel,
    _direct_gather_wait_kernel,
    nan_bits,
)

Build = Callable[..., tuple[Any, list[Any]]]


def _q(device: torch.device, t_max: int, h_r: int, d: int, dtype: torch.dtype, **kw: Any) -> Any:
    kw.setdefault("require_multicast", False)
    return lambda g: DirectDCPQGatherWorkspace(g, device, t_max, h_r, d, dtype, **kw)


def _kv(device: torch.device, cap: int, d: int, dtype: torch.dtype, **kw: Any) -> Any:
    kw.setdefault("require_multicast", False)
    return lambda g: DirectDCPKVGatherWorkspace(g, device, cap, d, dtype, **kw)


@pytest.mark.parametrize(
    ("n", "dtype", "padded", "strided"),
    [
        pytest.param(2, torch.bfloat16, None, False, id="N2-bf16"),
        pytest.param(3, torch.float8_e4m3fn, 8, True, id="N3-fp8-padded-strided"),
        pytest.param(2, torch.float32, None, True, id="N2-fp32-strided"),
    ],
)
def test_q_gather_matches_all_gather_bitwise(
    sim_build: Build,
    device: torch.device,
    n: int,
    dtype: torch.dtype,
    padded: int | None,
    strided: bool,
) -> None:
    t_max, h_r, d = 5, 2, 16
    _, wss = sim_build(
        n, device, _q(device, t_max, h_r, d, dtype, num_ubatches=2, padded_num_heads=padded)
    )
    gen = torch.Generator(device="cpu").manual_seed(n)
    for ubatch, t in ((1, 5), (0, 3), (1, 1)):
        full = torch.randn(t, n * h_r, d, generator=gen).to(device).to(dtype)
        locals_ = []
        for r in range(n):
            x = full[:, r * h_r : (r + 1) * h_r]
            if strided:  # [T, H_r + 2, D][:, :H_r]: token stride > H_r * D, heads packed
                wide = torch.zeros(t, h_r + 2, d, device=device, dtype=dtype)
                wide[:, :h_r] = x
                x = wide[:, :h_r]
            else:
                x = x.contiguous()
            locals_.append(x)
        with ubatch_context(ubatch):
            for r in range(n):
                wss[r].publish(locals_[r])
            outs = [wss[r].wait(t) for r in range(n)]
        expect = reserve_query_head_storage(full, padded or n * h_r)
        for r in range(n):
            got = outs[r]
            assert got.shape == (t, n * h_r, d)
            assert got.is_contiguous()
            assert got.stride() == expect.stride()
            assert got.data_ptr() == wss[r].final_query[ubatch].data_ptr()
            storage_left = (
                got.untyped_storage().nbytes() - got.storage_offset() * got.element_size()
            )
            assert storage_left >= t * (padded or n * h_r) * d * got.element_size()
            assert torch.equal(got.view(torch.uint8), full.view(torch.uint8))
    for ws in wss:
        assert ws.epoch.tolist() == [1, 2]
        ws.check_error()


def test_kv_gather_matches_all_gather_into_tensor_bitwise(
    sim_build: Build, device: torch.device
) -> None:
    n, cap, d = 2, 8, 16
    _, wss = sim_build(n, device, _kv(device, cap, d, torch.bfloat16, num_ubatches=2))
    gen = torch.Generator(device="cpu").manual_seed(1)
    for k, t in enumerate((4, 1, 3, 4)):
        ubatch = k % 2
        local = [torch.randn(t, d, generator=gen).to(device, torch.bfloat16) for _ in range(n)]
        gathered = [
            torch.full((n * t, d), float("nan"), device=device, dtype=torch.bfloat16)
            for _ in range(n)
        ]
        with ubatch_context(ubatch):
            for r in range(n):
                wss[r].publish(local[r])
            for r in range(n):
                wss[r].wait(gathered[r])
        expect = torch.cat(local, dim=0)
        for r in range(n):
            assert torch.equal(gathered[r].view(torch.int16), expect.view(torch.int16))
    for ws in wss:
        assert ws.epoch.tolist() == [2, 2]


def test_kv_wait_marks_the_gathered_buffer_written(sim_build: Build, device: torch.device) -> None:
    """The wait writes the caller's buffer outside the dispatcher; like
    ``all_gather_into_tensor`` it bumps its version, so a backward that saved the buffer
    before the gather raises instead of computing with the gathered rows."""
    n, cap, d = 2, 8, 16
    dt = torch.bfloat16
    _, wss = sim_build(n, device, _kv(device, cap, d, dt))
    local = [torch.randn(3, d, device=device, dtype=dt) for _ in range(n)]
    gathered = [torch.randn(n * 3, d, device=device, dtype=dt) for _ in range(n)]
    weight = torch.ones(n * 3, d, device=device, dtype=dt, requires_grad=True)
    saved = (weight * gathered[0]).sum()  # saves gathered[0] for backward
    before = [g._version for g in gathered]
    for r in range(n):
        wss[r].publish(local[r])
    for r in range(n):
        wss[r].wait(gathered[r])
    assert all(g._version > v for g, v in zip(gathered, before, strict=True))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def _settle(device: torch.device) -> None:
    """Let every launch and non-blocking copy on ``device`` land (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def test_gather_timeouts_are_reported(sim_build: Build, device: torch.device) -> None:
    """A gather whose peer never calls times out, marks its output NaN and is reported:
    explicitly by ``check_error()``, lazily at a later call (CPU: the next one; CUDA: the first
    after the ``error_check_interval``-th call mirrored the record, here every call), and at
    every call after that."""
    _, qs = sim_build(2, device, _q(device, 2, 1, 8, torch.bfloat16, max_spins=2))
    q = torch.randn(1, 1, 8, device=device).to(torch.bfloat16)
    qs[0].publish(q)
    assert torch.isnan(qs[0].wait(1)).all()
    with pytest.raises(
        DirectProtocolError,
        match=r"Direct DCP q-gather: rank 0, ubatch 0: bounded wait timed out at epoch 1 .*"
        r"source rank\(s\) \[1\]",
    ):
        qs[0].check_error()
    assert qs[0].failed
    with pytest.raises(DirectProtocolError, match="timed out"):
        qs[0].gather(q)
    with pytest.raises(DirectProtocolError, match="timed out"):
        qs[0].publish(q)  # the public launches check the state as gather does
    with pytest.raises(DirectProtocolError, match="timed out"):
        qs[0].wait(1)

    _, kvs = sim_build(
        2, device, _kv(device, 4, 8, torch.bfloat16, max_spins=2, error_check_interval=1)
    )
    local = torch.randn(2, 8, device=device).to(torch.bfloat16)
    out = torch.zeros(4, 8, device=device, dtype=torch.bfloat16)
    kvs[1].publish(local)
    kvs[1].wait(out)
    assert torch.isnan(out).all(), "a timed-out KV gather must mark its output"
    assert not kvs[1].failed  # nothing raised on the host yet: no sync on the hot path
    _settle(device)  # CUDA: the non-blocking copy of the error record has landed
    with pytest.raises(
        DirectProtocolError,
        match=r"Direct DCP kv-gather: rank 1, ubatch 0: bounded wait timed out at epoch 1 .*"
        r"source rank\(s\) \[0\]",
    ):
        kvs[1].gather(out, local)
    assert kvs[1].failed
    with pytest.raises(DirectProtocolError, match="timed out"):
        kvs[1].publish(local)
    with pytest.raises(DirectProtocolError, match="timed out"):
        kvs[1].wait(out)
    assert kvs[1].epoch.tolist() == [1]  # the refused calls launched nothing
    assert torch.isnan(out).all()


def test_gathers_normalise_a_bare_device(sim_build: Build, device: torch.device) -> None:
    """Built with a bare ``torch.device("cuda")``, the gathers hold the indexed current device
    and accept tensors of it (a tensor's ``.device`` is always indexed on CUDA)."""
    bare = torch.device(device.type)
    _, qs = sim_build(2, device, _q(bare, 2, 1, 8, torch.bfloat16))
    _, kvs = sim_build(2, device, _kv(bare, 4, 8, torch.bfloat16))
    q = torch.randn(2, 1, 8, device=device).to(torch.bfloat16)
    local = torch.randn(2, 8, device=device).to(torch.bfloat16)
    for ws in (*qs, *kvs):
        assert ws.device == device
    for r in range(2):
        assert qs[r].unsupported_reason(q) is None
        assert kvs[r].unsupported_reason(torch.empty(4, 8, device=device).to(local), local) is None


def test_q_gather_validation(sim_build: Build, device: torch.device) -> None:
    with pytest.raises(ValueError, match="ubatch"):
        sim_build(2, device, _q(device, 4, 1, 8, torch.bfloat16, num_ubatches=0))
    with pytest.raises(ValueError, match="padded heads"):
        sim_build(4, device, _q(device, 4, 2, 8, torch.bfloat16, padded_num_heads=7))
    with pytest.raises(ValueError, match="16-byte"):
        sim_build(2, device, _q(device, 4, 1, 3, torch.bfloat16))
    with pytest.raises(ValueError, match="at least two ranks"):
        sim_build(1, device, _q(device, 4, 1, 8, torch.bfloat16))
    _, wss = sim_build(2, device, _q(device, 4, 2, 8, torch.bfloat16))
    with pytest.raises(ValueError, match="local_query: expected 2 heads"):
        wss[0].gather(torch.zeros(1, 3, 8, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="exceed the q-gather capacity"):
        wss[0].gather(torch.zeros(5, 2, 8, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="ubatch_id 1 exceeds"):
        wss[0].gather(torch.zeros(1, 2, 8, device=device, dtype=torch.bfloat16), ubatch_id=1)


def test_kv_gather_validation(sim_build: Build, device: torch.device) -> None:
    with pytest.raises(ValueError, match="does not support"):
        sim_build(2, device, _kv(device, 4, 8, torch.float32))
    with pytest.raises(ValueError, match="ubatch"):
        sim_build(2, device, _kv(device, 4, 8, torch.bfloat16, num_ubatches=0))
    with pytest.raises(ValueError, match="16-byte"):
        sim_build(2, device, _kv(device, 4, 4, torch.bfloat16))
    with pytest.raises(ValueError, match=r"divide evenly.*63 % 4"):
        sim_build(4, device, _kv(device, 63, 8, torch.bfloat16))
    with pytest.raises(ValueError, match="at least two ranks"):
        sim_build(1, device, _kv(device, 4, 8, torch.bfloat16))
    _, wss = sim_build(2, device, _kv(device, 4, 8, torch.bfloat16))
    local = torch.zeros(3, 8, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exceed the kv-gather capacity"):
        wss[0].gather(torch.zeros(6, 8, device=device, dtype=torch.bfloat16), local)
    with pytest.raises(ValueError, match="expected N\\*T"):
        wss[0].gather(torch.zeros(5, 8, device=device, dtype=torch.bfloat16), local[:2])


def test_q_publish_and_wait_refuse_what_gather_refuses(
    sim_build: Build, device: torch.device
) -> None:
    """The public ``publish`` / ``wait`` check what ``gather`` checks (as the direct A2A's
    ``publish`` does) and raise the same exceptions, before launching anything. Unchecked, a
    3-row publish into a ``T_max = 2`` workspace stored its third row into every peer's
    ubatch-1 slot (past the allocation with one ubatch), and ``wait(3)`` returned a view
    reaching into the next ubatch's slot."""
    t_max, h_r, d = 2, 1, 8
    _, wss = sim_build(2, device, _q(device, t_max, h_r, d, torch.bfloat16, num_ubatches=2))

    def rows(value: float, t: int, heads: int = h_r, dtype: torch.dtype = torch.bfloat16) -> Any:
        return torch.full((t, heads, d), value, device=device, dtype=dtype)

    with ubatch_context(1):  # ubatch 1 holds a gathered query still in use
        for ws in wss:
            ws.publish(rows(1.0, 2))
        held = [ws.wait(2) for ws in wss]
    held_before = [h.clone() for h in held]
    epochs = [ws.epoch.tolist() for ws in wss]
    with ubatch_context(0):
        with pytest.raises(
            ValueError, match=r"q-gather: local_query: 3 tokens exceed .* capacity 2"
        ):
            wss[0].publish(rows(9.0, 3))
        with pytest.raises(ValueError, match="local_query: expected 1 heads of dim 8, got 2 x 8"):
            wss[0].publish(rows(9.0, 1, heads=2))
        with pytest.raises(ValueError, match=r"dtype torch\.float16 != workspace dtype"):
            wss[0].publish(rows(9.0, 1, dtype=torch.float16))
        with pytest.raises(ValueError, match="heads must be packed"):
            wss[0].publish(
                torch.zeros(1, h_r, 2 * d, device=device, dtype=torch.bfloat16)[..., ::2]
            )
        with pytest.raises(ValueError, match=r"q-gather: num_tokens 3 not in \[0, 2\]"):
            wss[0].wait(3)
        with pytest.raises(ValueError, match=r"num_tokens -1 not in \[0, 2\]"):
            wss[0].wait(-1)
    with pytest.raises(ValueError, match="ubatch_id 2 exceeds the 2 slot"):
        wss[0].publish(rows(9.0, 1), ubatch_id=2)
    for h, before in zip(held, held_before, strict=True):
        assert torch.equal(h, before)
    assert torch.all(wss[1].final_query[0] == 0)  # no row of a refused publish was stored
    assert [ws.epoch.tolist() for ws in wss] == epochs  # no refused wait launched


def test_kv_publish_and_wait_refuse_what_gather_refuses(
    sim_build: Build, device: torch.device
) -> None:
    """The KV ``publish`` checks ``local_kv`` (``N*T`` within the capacity) and ``wait`` the
    output it copies into (``N*T`` rows within the capacity, contiguous, the workspace's row
    type): same exceptions as ``gather``, nothing launched. Unchecked, rank 1 publishing
    ``T = 3`` (``N*T = 6 > 4``) stored two rows into every peer's ubatch-1 slot."""
    n, cap, d = 2, 4, 8
    _, wss = sim_build(n, device, _kv(device, cap, d, torch.bfloat16, num_ubatches=2))

    def kv(t: int, width: int = d, dtype: torch.dtype = torch.bfloat16) -> Any:
        return torch.full((t, width), 5.0, device=device, dtype=dtype)

    with ubatch_context(0):
        with pytest.raises(ValueError, match=r"kv-gather: gathered kv 2\*3 = 6 rows exceed"):
            wss[1].publish(kv(3))
        with pytest.raises(ValueError, match="local_kv token dim 16 != workspace token_dim 8"):
            wss[1].publish(kv(1, width=16))
        with pytest.raises(ValueError, match=r"local_kv dtype torch\.float16 != workspace dtype"):
            wss[1].publish(kv(1, dtype=torch.float16))
        with pytest.raises(ValueError, match="local_kv must be contiguous"):
            wss[1].publish(kv(2, width=2 * d)[:, :d])
        with pytest.raises(ValueError, match=r"gathered_kv has 6 rows, more than .* capacity 4"):
            wss[0].wait(kv(6))
        with pytest.raises(ValueError, match=r"gathered_kv has 3 rows, not N\*T rows for N = 2"):
            wss[0].wait(kv(3))
        with pytest.raises(ValueError, match="gathered_kv must be contiguous"):
            wss[0].wait(kv(4, width=2 * d)[:, :d])
        with pytest.raises(ValueError, match=r"gathered_kv dtype torch\.float16 != workspace"):
            wss[0].wait(kv(4, dtype=torch.float16))
        with pytest.raises(ValueError, match=r"expected gathered_kv \[rows, D\]"):
            wss[0].wait(torch.zeros(4 * d, device=device, dtype=torch.bfloat16))
    for ws in wss:
        assert torch.all(ws.received_kv == 0), "a refused publish stored rows"
        assert ws.epoch.tolist() == [0, 0], "a refused wait launched"

    # Valid public calls still work (the unchecked launches gather makes are the same).
    local = [torch.randn(2, d, device=device).to(torch.bfloat16) for _ in range(n)]
    outs = [torch.zeros(n * 2, d, device=device, dtype=torch.bfloat16) for _ in range(n)]
    for r in range(n):
        wss[r].publish(local[r])
    for r in range(n):
        wss[r].wait(outs[r])
        assert torch.equal(outs[r], torch.cat(local))


def test_closed_gathers_refuse_every_call(sim_build: Build, device: torch.device) -> None:
    """After ``close()`` the public ``publish`` and ``wait`` raise like ``gather`` (the
    ``RuntimeError`` of the direct A2A) instead of storing through the released buffers'
    peer pointers or reading them."""
    n, d = 2, 8
    _, qs = sim_build(n, device, _q(device, 2, 1, d, torch.bfloat16))
    _, kvs = sim_build(n, device, _kv(device, 4, d, torch.bfloat16))
    for ws in (*qs, *kvs):
        ws.close()
        assert ws.closed
    q = torch.ones(2, 1, d, device=device, dtype=torch.bfloat16)
    local = torch.ones(2, d, device=device, dtype=torch.bfloat16)
    out = torch.zeros(n * 2, d, device=device, dtype=torch.bfloat16)
    calls: list[Callable[[], Any]] = [
        lambda: qs[0].publish(q),
        lambda: qs[0].wait(2),
        lambda: qs[0].gather(q),
        lambda: kvs[0].publish(local),
        lambda: kvs[0].wait(out),
        lambda: kvs[0].gather(out, local),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="workspace is closed"):
            call()
    assert torch.all(qs[1].final_query == 0)
    assert torch.all(kvs[1].received_kv == 0)
    assert [ws.epoch.tolist() for ws in (*qs, *kvs)] == [[0]] * (2 * n)


@pytest.mark.no_checks  # one thread drives both ranks: check mode's all-gather would wait
def test_gather_checks_once_and_launches_unchecked(
    sim_build: Build, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hot path does no new host work: ``gather`` checks the state and its arguments once
    and then launches through ``publish`` / ``wait`` with ``validate=False``."""
    n, d = 2, 8
    _, qs = sim_build(n, device, _q(device, 2, 1, d, torch.bfloat16))
    _, kvs = sim_build(n, device, _kv(device, 4, d, torch.bfloat16))
    counts: dict[str, int] = {}

    def count(ws: Any, method: str) -> None:
        original = getattr(ws, method)

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[method] = counts.get(method, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(ws, method, counted)

    for method in ("_before_call", "unsupported_reason"):
        count(qs[0], method)
    for method in ("_before_call", "unsupported_reason", "_kv_reason"):
        count(kvs[0], method)
    q = [torch.full((2, 1, d), float(r), device=device, dtype=torch.bfloat16) for r in range(n)]
    qs[1].publish(q[1])
    qs[0].gather(q[0])
    assert counts == {"_before_call": 1, "unsupported_reason": 1}
    counts.clear()
    local = [torch.full((2, d), float(r), device=device, dtype=torch.bfloat16) for r in range(n)]
    out = torch.zeros(n * 2, d, device=device, dtype=torch.bfloat16)
    kvs[1].publish(local[1])
    kvs[0].gather(out, local[0])
    # unsupported_reason accepts valid arguments in one expression (the per-tensor reasons run
    # only to name what is wrong); nothing checks twice.
    assert counts == {"_before_call": 1, "unsupported_reason": 1}
    assert torch.equal(out, torch.cat(local))


def test_q_gather_result_lives_until_the_layers_combine(
    sim_build: Build, device: torch.device
) -> None:
    """A peer's next gather overwrites this rank's gathered query while this rank makes no call
    at all (the peer may start it as soon as this rank has entered the layer's combine), so the
    result is valid until then, not until this rank's next gather, and the docs say so."""
    n, h_r, d = 2, 1, 8
    _, wss = sim_build(n, device, _q(device, 2, h_r, d, torch.bfloat16))
    for r, ws in enumerate(wss):
        ws.publish(torch.full((2, h_r, d), float(r + 1), device=device, dtype=torch.bfloat16))
    gathered = [ws.wait(2) for ws in wss]
    snapshot = gathered[0].clone()
    # ... attention, then the layer's combine (a rendezvous); rank 1 is faster and starts its
    # next gather, rank 0 has made no further call:
    wss[1].publish(torch.full((2, h_r, d), 7.0, device=device, dtype=torch.bfloat16))
    assert torch.equal(gathered[0][:, :h_r], snapshot[:, :h_r])
    assert torch.all(gathered[0][:, h_r:] == 7.0), "the peer's next gather overwrote it"

    docs = {
        "module": q_gather_module.__doc__,
        "gather": DirectDCPQGatherWorkspace.gather.__doc__,
        "wait": DirectDCPQGatherWorkspace.wait.__doc__,
    }
    for where, doc in docs.items():
        text = " ".join((doc or "").split()).lower()
        assert "valid until this rank enters this layer's combine" in text, where
        assert "valid until this rank's next" not in text, where


def test_gathers_need_multicast_and_never_query_it_when_env_disables_it(
    sim_build: Build, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a multicast query was made although the environment disables it")

    monkeypatch.setattr(capability, "direct_cp_multicast_enabled", forbidden)
    from cpattn_common import workspace

    monkeypatch.setattr(workspace.DirectCPWorkspace, "multicast_ptrs", forbidden)
    world, _ = sim_build(2, device, lambda g: None)
    for use_direct in (None, True):
        q = world.run(
            lambda g, u=use_direct: get_direct_dcp_q_gather_workspace(
                g, device, 4, 1, 8, torch.bfloat16, 1, None, u
            )
        )
        kv = world.run(
            lambda g, u=use_direct: get_direct_dcp_kv_gather_workspace(
                g, device, 4, 8, torch.bfloat16, 1, u
            )
        )
        assert q == [None, None]
        assert kv == [None, None]
    with pytest.raises(RuntimeError, match="multicast"):
        sim_build(2, device, _q(device, 4, 1, 8, torch.bfloat16, require_multicast=True))
    with pytest.raises(RuntimeError, match="multicast"):
        sim_build(2, device, _kv(device, 4, 8, torch.bfloat16, require_multicast=True))


def test_gather_factories_return_none_without_multicast(
    sim_build: Build, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Environment allows multicast but the group has none (simulated / this machine)."""
    for var in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.delenv(var, raising=False)
    world, _ = sim_build(2, device, lambda g: None)
    q = world.run(
        lambda g: get_direct_dcp_q_gather_workspace(
            g, device, 4, 1, 8, torch.bfloat16, 1, None, True
        )
    )
    kv = world.run(
        lambda g: get_direct_dcp_kv_gather_workspace(g, device, 4, 8, torch.bfloat16, 1, True)
    )
    off = world.run(
        lambda g: get_direct_dcp_q_gather_workspace(
            g, device, 4, 1, 8, torch.bfloat16, 1, None, False
        )
    )
    assert q == [None, None]
    assert kv == [None, None]
    assert off == [None, None]


@pytest.mark.parametrize("which", ["q", "kv"])
def test_a_rank_without_a_multicast_address_fails_the_gather_on_every_rank(
    sim_build: Build, device: torch.device, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """Rank 1's handle has no multicast address (``multicast_ptrs`` gives zeros on any
    failure of that rank): it raised alone and its peer kept the direct gather, each then
    waiting in a different collective. The ranks now agree and all raise, naming rank 1, and
    each releases the symmetric buffers it had allocated (they lived on with the traceback)."""
    from cpattn_common.workspace import DirectCPWorkspace
    from cpattn_dcp.direct import DirectPathUnavailable

    for var in capability.MULTICAST_ENV_VARS:
        monkeypatch.delenv(var, raising=False)

    def multicast_ptrs(self: DirectCPWorkspace, storage: torch.Tensor) -> list[int]:
        return [0 if self.rank == 1 else 0x1000] * self.num_ubatches

    monkeypatch.setattr(DirectCPWorkspace, "multicast_ptrs", multicast_ptrs)
    closed: list[int] = []
    real_close = DirectCPWorkspace.close

    def close(self: DirectCPWorkspace) -> None:
        closed.append(self.rank)
        real_close(self)

    monkeypatch.setattr(DirectCPWorkspace, "close", close)
    build = (_q(device, 4, 1, 8, torch.bfloat16, require_multicast=True) if which == "q"
             else _kv(device, 4, 8, torch.bfloat16, require_multicast=True))  # fmt: skip

    def outcome(g: Any) -> str:
        try:
            build(g)
        except DirectPathUnavailable as exc:
            return str(exc)
        return "built"

    world, _ = sim_build(2, device, lambda g: None)
    for message in world.run(outcome):
        assert "requires NVLS symmetric-memory multicast; rank(s) [1] of 2" in message
    assert sorted(closed) == [0, 1]


def test_timeout_names_missing_ranks_of_groups_over_64(
    sim_build: Build, device: torch.device
) -> None:
    """A timed-out wait of a group of more than 64 ranks names exactly the ranks whose signal
    never came: one bitmask word per 64 sources. One int64 word lost the ranks >= 64 (a shift
    by 64 or more) and its host decode carried bit 63 into every rank >= 64."""
    n, missing = 70, [5, 63, 65]
    _, qs = sim_build(n, device, _q(device, 1, 1, 8, torch.bfloat16, max_spins=2))
    # Every other source has signalled call 1 (epoch 1, parity slot 1) to rank 0; publishing
    # from 67 interpreted ranks would take a while and prove nothing more.
    signals = qs[0].recv_signal[0, 1]
    signals.fill_(1)
    signals[missing] = 0
    qs[0].wait(1)
    with pytest.raises(DirectProtocolError, match=r"source rank\(s\) \[5, 63, 65\]\. "):
        qs[0].check_error()


@pytest.mark.parametrize(("n", "missing"), [(4, [3]), (64, [0, 63]), (70, [63, 64, 69])], ids=str)
def test_missing_ranks_decode(n: int, missing: list[int]) -> None:
    """The host decode of the mask words: bit ``r % 64`` of word ``r // 64``, unsigned."""
    words = [0] * (error_record_width(n) - 2)
    for r in missing:
        words[r // 64] |= 1 << (r % 64)
    signed = [w - (1 << 64) if w >= 1 << 63 else w for w in words]  # as int64 holds them
    assert missing_ranks(signed, n) == missing


def test_kv_publish_rank_offset_past_int32(watch_interpreted_accesses: Any) -> None:
    """The KV publish stores rank r's rows at ``parity*G*D + r*T*D + t*D`` in int64: with
    N=4, D=576 and T*D of about 7.5e8 (a slot of 3e9 elements), rank 3's offset passes 2**31
    (``rank * T*D`` in int32 wrapped). Interpreter, one program publishing row 0, its payload
    stores recorded instead of made (no multi-GB slot); the arguments are those of
    ``DirectDCPKVGatherWorkspace.publish``."""
    n, rank, d = 4, 3, 576
    t = 750_000_000 // d + 1
    cap = n * t
    src = torch.randn(1, d).to(torch.bfloat16)
    slot = torch.zeros(64, dtype=torch.bfloat16)  # stands in for every peer's parity slot
    sig = torch.zeros(2, n, dtype=torch.int64)
    stores = watch_interpreted_accesses("store", tl.bfloat16, slot.data_ptr(), 2)
    _direct_gather_publish_kernel[(1, 1)](
        src, d, torch.full((n,), slot.data_ptr()), torch.full((n,), sig.data_ptr()),
        torch.zeros(n, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),  # call 1: parity 1
        torch.zeros(3, dtype=torch.int64),  # error record: clear
        torch.zeros(1, dtype=torch.int64),  # group failure word: clear
        1, rank, cap * d, t * d, d, 1, N=n, W=d, BLOCK_W=1024,
    )  # fmt: skip
    got = np.concatenate(stores)
    np.testing.assert_array_equal(got, 1 * cap * d + rank * t * d + np.arange(d))
    assert sig[1, rank] == 1  # the signal of call 1 was raised


@pytest.mark.parametrize("num_elems", [10 * _COPY_BLOCK, 2**31 + 4096])
def test_timed_out_kv_wait_fills_nan_past_int32(
    watch_interpreted_accesses: Any, num_elems: int
) -> None:
    """A failed KV wait writes the NaN pattern over its output with a grid-stride loop whose
    step, ``num_programs * BLOCK``, passes 2**31 for a gathered KV of that many elements: in
    int32 it wrapped negative and the loop wrote nothing (the output kept the previous call's
    finite data; on a GPU a negative step does not end). Interpreter, program 0 of the wait
    launch with its error record set, its NaN stores recorded instead of made."""
    n = 2
    dst = torch.zeros(64, dtype=torch.bfloat16)  # stands in for gathered_kv
    stores = watch_interpreted_accesses("store", tl.int16, dst.data_ptr(), 2)
    _direct_gather_wait_kernel[(1,)](
        torch.zeros(2, n, dtype=torch.int64),  # signals
        torch.zeros(1, dtype=torch.int64),  # epoch
        torch.zeros(1, dtype=torch.int32),  # done counter
        torch.tensor([1, 1, 0], dtype=torch.int64),  # error record set: fails at once
        torch.zeros(1, dtype=torch.int64),  # group failure word
        torch.zeros(64, dtype=torch.bfloat16), dst, num_elems, 64, 10,
        -(-num_elems // _COPY_BLOCK),  # num_programs, as DirectDCPKVGatherWorkspace.wait
        N=n, N_POW2=2, HAS_COPY=True, BLOCK=_COPY_BLOCK, NAN_BITS=nan_bits(torch.bfloat16),
    )  # fmt: skip
    np.testing.assert_array_equal(np.concatenate(stores), np.arange(_COPY_BLOCK))


def test_gathers_refuse_inputs_that_require_grad(sim_build: Build, device: torch.device) -> None:
    """The kernels have no autograd formula: with grad on, a tensor that requires grad is
    refused before anything is stored into a peer (the result would have dropped the
    gradient); under ``torch.no_grad()`` the same tensors gather."""
    n, d = 2, 8
    _, qs = sim_build(n, device, _q(device, 2, 1, d, torch.bfloat16))
    _, kvs = sim_build(n, device, _kv(device, 4, d, torch.bfloat16))
    q = torch.ones(2, 1, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    local = torch.ones(2, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = torch.zeros(n * 2, d, device=device, dtype=torch.bfloat16)
    calls: dict[str, Callable[[], Any]] = {
        "DirectDCPQGatherWorkspace.publish: local_query": lambda: qs[0].publish(q),
        "DirectDCPQGatherWorkspace.gather: local_query": lambda: qs[0].gather(q),
        "DirectDCPKVGatherWorkspace.publish: local_kv": lambda: kvs[0].publish(local),
        "DirectDCPKVGatherWorkspace.gather: local_kv": lambda: kvs[0].gather(out, local),
        "DirectDCPKVGatherWorkspace.wait: gathered_kv": lambda: kvs[0].wait(
            out.clone().requires_grad_()
        ),
        "DirectDCPKVGatherWorkspace.gather: gathered_kv": lambda: kvs[0].gather(
            out.clone().requires_grad_(), local.detach()
        ),
    }
    for what, call in calls.items():
        with pytest.raises(RuntimeError, match=f"^{re.escape(what)} requires grad"):
            call()
    assert torch.all(qs[1].final_query == 0)
    assert torch.all(kvs[1].received_kv == 0)
    assert [ws.epoch.tolist() for ws in (*qs, *kvs)] == [[0]] * (2 * n)
    with torch.no_grad():
        for ws in qs:
            ws.publish(q)
        gathered = [ws.wait(2) for ws in qs]
        for ws in kvs:
            ws.publish(local)
        for ws in kvs:
            ws.wait(out)
    for g in gathered:
        assert torch.equal(g, torch.ones(2, n, d, device=device, dtype=torch.bfloat16))
    assert torch.equal(out, torch.ones_like(out))
