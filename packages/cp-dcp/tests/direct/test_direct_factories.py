"""The memo of the direct-workspace factories: one workspace per geometry, and never a closed one.

A workspace's ``close()`` is public and collective (a layer or engine teardown releasing its
buffers); the next factory call for its geometry builds a new one, so a manager never selects
a closed workspace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import triton

import cpattn_dcp.direct.factories as factories_mod
import cpattn_dcp.direct.kv_gather as kv_gather_mod
import cpattn_dcp.direct.q_gather as q_gather_mod
from cpattn_dcp.direct import (
    DirectDCPA2AWorkspace,
    DirectDCPKVGatherWorkspace,
    DirectDCPQGatherWorkspace,
    DirectPathUnavailable,
    clear_direct_workspace_cache,
    direct_a2a_unavailable_reason,
    get_direct_dcp_a2a_workspace,
    get_direct_dcp_kv_gather_workspace,
    get_direct_dcp_q_gather_workspace,
)
from cpattn_dcp.direct._base import triton_unsupported_reason
from cpattn_dcp.manager import DCPConfig, DCPManager
from cpattn_testing.simulated import SimulatedWorld

N, T, H_R, D = 2, 2, 1, 8
DTYPE = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh_workspaces() -> Iterator[None]:
    clear_direct_workspace_cache()
    yield
    clear_direct_workspace_cache()


@pytest.fixture
def gathers_without_multicast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the Q / KV gather factories build on simulated ranks: gating says yes and the
    constructors skip the multicast requirement (no multicast address exists here)."""
    monkeypatch.setattr(factories_mod, "direct_gather_unavailable_reason", lambda *a, **k: None)
    for module in (q_gather_mod, kv_gather_mod):
        monkeypatch.setattr(module, "_require_multicast", lambda *a, **k: None)


def _factory(kind: str, device: torch.device) -> Callable[[Any], Any]:
    """``group -> the factory's workspace`` of one fixed geometry per kind (forced on)."""
    if kind == "a2a":
        return lambda g: get_direct_dcp_a2a_workspace(g, device, T, H_R, D, DTYPE, 1, True)
    if kind == "q":
        return lambda g: get_direct_dcp_q_gather_workspace(
            g, device, T, H_R, D, DTYPE, 1, None, True
        )
    return lambda g: get_direct_dcp_kv_gather_workspace(g, device, N * T, D, DTYPE, 1, True)


def _exchange(kind: str, wss: list[Any], device: torch.device) -> None:
    """One call of every rank (all publishes, then all waits) with known results."""
    values = [float(r + 1) for r in range(N)]
    if kind == "a2a":
        lse = torch.zeros(T, N * H_R, device=device)
        for r, ws in enumerate(wss):
            ws.publish(torch.full((T, N * H_R, D), values[r], device=device, dtype=DTYPE), lse)
        for ws in wss:  # equal LSEs: the mean of the partials, 1.5 (exact in bf16)
            assert torch.all(ws.wait_and_combine(T) == sum(values) / N)
    elif kind == "q":
        for r, ws in enumerate(wss):
            ws.publish(torch.full((T, H_R, D), values[r], device=device, dtype=DTYPE))
        for ws in wss:
            got = ws.wait(T)
            for r in range(N):
                assert torch.all(got[:, r * H_R : (r + 1) * H_R] == values[r])
    else:
        for r, ws in enumerate(wss):
            ws.publish(torch.full((T, D), values[r], device=device, dtype=DTYPE))
        for ws in wss:
            out = torch.zeros(N * T, D, device=device, dtype=DTYPE)
            ws.wait(out)
            for r in range(N):
                assert torch.all(out[r * T : (r + 1) * T] == values[r])


@pytest.mark.usefixtures("gathers_without_multicast")
@pytest.mark.parametrize("kind", ["a2a", "q", "kv"])
def test_factory_rebuilds_a_workspace_that_every_rank_closed(
    kind: str, device: torch.device
) -> None:
    """Every rank closes its memoized workspace at the same point (concurrently, as the rank
    threads do); the next factory call of that geometry builds a new, working workspace on
    every rank, which the memo then hands out again."""
    world = SimulatedWorld(N, device)
    factory = _factory(kind, device)
    first = world.run(factory)
    assert all(ws is not None and not ws.closed for ws in first)
    assert all(a is b for a, b in zip(world.run(factory), first, strict=True))

    world.run(lambda g: first[g.rank_in_group].close())
    assert all(ws.closed for ws in first)
    rebuilt = world.run(factory)
    for old, new in zip(first, rebuilt, strict=True):
        assert new is not old
        assert not new.closed
    assert all(a is b for a, b in zip(world.run(factory), rebuilt, strict=True))
    _exchange(kind, rebuilt, device)
    for ws in rebuilt:
        ws.check_error()


def test_new_manager_gets_a_working_direct_a2a_after_close(device: torch.device) -> None:
    """The reported symptom: after a teardown closed the managers' direct A2A workspaces, a new
    manager of the same geometry was handed the closed one (selection ``direct_a2a``, every
    combine raising "workspace is closed"); it now gets a new workspace."""
    world = SimulatedWorld(N, device)
    config = DCPConfig(comm_backend="a2a", use_direct_a2a=True, max_num_tokens=T)

    def make(group: Any) -> DCPManager:
        return DCPManager(config, group, device, H_R, D, DTYPE)

    managers = world.run(make)
    closed = [m.direct_a2a for m in managers]
    world.run(lambda g: closed[g.rank_in_group].close())
    fresh = world.run(make)
    for old_ws, manager in zip(closed, fresh, strict=True):
        assert manager.direct_a2a is not None
        assert manager.direct_a2a is not old_ws
        assert not manager.direct_a2a.closed
    _exchange("a2a", [m.direct_a2a for m in fresh], device)


# Triton before 3.5 ran the waits' vector atomic in a few threads of a block without handing
# its result to the others (Triton issue #7402): on a GPU every wait spun to its bound.
@pytest.mark.parametrize(
    ("version", "supported"),
    [("3.4.0", False), ("3.2.0", False), ("2.3.1", False), ("dev", False),
     ("3.5.0", True), ("3.6.0+git1a2b3c", True), ("3.10.0", True), ("4.0", True)],
)  # fmt: skip
def test_triton_version_rule(version: str, supported: bool) -> None:
    reason = triton_unsupported_reason(version)
    assert (reason is None) is supported
    if reason is not None:
        assert f"Triton >= 3.5 on a GPU, found {version}" in reason


def test_old_triton_keeps_the_direct_paths_off_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Automatic gating says no before any probe, a forced construction raises
    ``DirectPathUnavailable`` (which the manager turns into the NCCL path unless forced); the
    interpreter on the CPU is not affected."""
    monkeypatch.setattr(triton, "__version__", "3.4.0")
    world = SimulatedWorld(N, torch.device("cpu"))
    group = world.groups[0]
    reason = direct_a2a_unavailable_reason(group, DTYPE, None, device="cuda")
    assert reason is not None
    assert "Triton >= 3.5" in reason
    for build in (
        lambda: DirectDCPA2AWorkspace(group, "cuda", T, H_R, D, DTYPE),
        lambda: DirectDCPQGatherWorkspace(group, "cuda", T, H_R, D, DTYPE),
        lambda: DirectDCPKVGatherWorkspace(group, "cuda", N * T, D, DTYPE),
    ):
        with pytest.raises(DirectPathUnavailable, match=r"Triton >= 3\.5 on a GPU, found 3\.4\.0"):
            build()
    built = world.run(lambda g: get_direct_dcp_a2a_workspace(g, "cpu", T, H_R, D, DTYPE, 1, True))
    assert all(ws is not None for ws in built)  # the CPU interpreter runs on any Triton


def test_a_gather_off_for_a_basic_reason_says_so_before_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU device (or a single rank) the reason names that, not the multicast variables,
    which said "NVLS multicast is disabled by the environment" first; with neither, the
    environment's reason stays, and no multicast query is made either way."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    world = SimulatedWorld(2, torch.device("cpu"))
    reason = factories_mod.direct_gather_unavailable_reason(
        world.groups[0], torch.bfloat16, None, device="cpu"
    )
    assert reason == "device cpu is not a CUDA device"
    single = SimulatedWorld(1, torch.device("cpu")).groups[0]
    assert "needs at least two ranks" in str(
        factories_mod.direct_gather_unavailable_reason(single, torch.bfloat16, None)
    )
    forced = factories_mod.direct_gather_unavailable_reason(
        world.groups[0], torch.bfloat16, True, device="cpu"
    )
    assert forced == "NVLS multicast is disabled by the environment"
