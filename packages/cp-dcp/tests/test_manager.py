"""DCPConfig validation, DCPManager selection / fallbacks / logging, and the manager's
collectives end to end on real process groups (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_common import capability
from cpattn_dcp import manager as manager_mod
from cpattn_dcp.direct import DIRECT_A2A_DTYPES, DirectDCPA2AWorkspace
from cpattn_dcp.manager import DCPConfig, DCPManager
from cpattn_testing.cases import make_dcp_decode_case
from cpattn_testing.pytest_plugin import RunRanks
from cpattn_testing.simulated import SimulatedGroup, SimulatedWorld
from cpattn_testing.tolerances import assert_close_to_ref


@pytest.fixture(autouse=True)
def _fresh_workspaces() -> Any:
    from cpattn_dcp.direct import clear_direct_workspace_cache

    clear_direct_workspace_cache()
    yield
    clear_direct_workspace_cache()


def _managers(
    world: SimulatedWorld, config: DCPConfig, device: Any = None, **kw: Any
) -> list[DCPManager]:
    args = {"num_heads": 1, "head_dim": 8, "dtype": torch.bfloat16, **kw}
    dev = world.device if device is None else device
    return list(world.run(lambda g: DCPManager(config, g, dev, **args)))


def _auto_direct_a2a_off_reason(
    group: Any, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> str | None:
    """Why the automatic choice (``use_direct_a2a=None``) must not take the direct A2A for
    ``group`` / ``dtype`` on ``device`` (``None``: it must take it), from the capability gate.

    The gate is on wherever symmetric memory is importable, CUDA is available and the group is
    on one node (e.g. simulated ranks on a GPU machine); it is always off on the CPU.
    """
    if device.type != "cuda":
        return "not a CUDA device"
    if capability.direct_cp_enabled(group, dtype, None, DIRECT_A2A_DTYPES):
        return None
    reason = capability.direct_cp_disabled_reason(group, dtype, None, DIRECT_A2A_DTYPES)
    assert reason, "the gate said no without a reason"
    return reason


def _expected_auto_combine(group: Any, device: torch.device) -> str:
    """``"direct_a2a"`` where the gate is on, else ``"a2a"`` (always ``"a2a"`` on the CPU)."""
    off = _auto_direct_a2a_off_reason(group, device)
    assert off is not None or device.type == "cuda"
    return "a2a" if off is not None else "direct_a2a"


def test_config_validation() -> None:
    assert DCPConfig().comm_backend == "ag_rs"
    with pytest.raises(ValueError, match="comm_backend"):
        DCPConfig(comm_backend="nccl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_num_tokens"):
        DCPConfig(max_num_tokens=0)
    with pytest.raises(ValueError, match="num_ubatches"):
        DCPConfig(num_ubatches=0)
    with pytest.raises(TypeError, match="max_num_tokens must be an int, got '64'"):
        DCPConfig(max_num_tokens="64")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="use_direct_a2a"):
        DCPConfig(use_direct_a2a=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="use_pcp"):
        DCPConfig(use_pcp="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pcp_world_size must be an int"):
        DCPConfig(use_pcp=True, pcp_world_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pcp_world_size"):
        DCPConfig(use_pcp=True, pcp_world_size=0)
    with pytest.raises(ValueError, match="pcp_world_size=2 is given but use_pcp is False"):
        DCPConfig(pcp_world_size=2)


_AUTO = "a2a, or direct_a2a where the capability gate is on"


@pytest.mark.parametrize(
    ("config", "combine", "query"),
    [
        (DCPConfig(), "ag_rs", "all_gather"),
        (DCPConfig(comm_backend="a2a"), _AUTO, "all_gather"),
        (DCPConfig(comm_backend="auto"), _AUTO, "all_gather"),
        (DCPConfig(comm_backend="a2a", use_direct_a2a=False), "a2a", "all_gather"),
        (DCPConfig(use_pcp=True), "ag_ar", "none"),
        (DCPConfig(comm_backend="a2a", use_pcp=True), "ag_ar", "none"),
        (DCPConfig(comm_backend="a2a", use_pcp=True, pcp_world_size=2), _AUTO, "none"),
        (DCPConfig(comm_backend="auto", use_pcp=True, pcp_world_size=2), "ag_ar", "none"),
        (DCPConfig(use_pcp=True, pcp_world_size=2), "ag_ar", "none"),
        (DCPConfig(comm_backend="a2a", use_direct_a2a=True), "direct_a2a", "all_gather"),
    ],
    ids=[
        "default", "a2a", "auto", "a2a-direct-off", "pcp", "pcp-a2a", "pcp-a2a-dcp-is-pcp",
        "pcp-auto-dcp-is-pcp", "pcp-ag_rs-dcp-is-pcp", "a2a-direct-forced",
    ],
)  # fmt: skip
def test_selection(device: torch.device, config: DCPConfig, combine: str, query: str) -> None:
    world = SimulatedWorld(2, device)
    auto = combine == _AUTO
    if auto:
        combine = _expected_auto_combine(world.groups[0], device)
    # Simulated groups have no process group, hence never multicast: no direct q-gather.
    assert not capability.direct_cp_multicast_enabled(world.groups[0], torch.bfloat16, None)
    for m in _managers(world, config):
        assert m.combine_path == combine
        assert m.query_gather_path == query
        assert m.kv_gather_path == "all_gather_into_tensor"
        sel = m.selection
        assert sel.combine_reason
        assert sel.query_gather_reason
        assert sel.kv_gather_reason
        assert (m.direct_a2a is not None) == (combine == "direct_a2a")
        assert m.has_query_gather == (query != "none")
    if config.use_pcp and config.comm_backend == "a2a":
        assert ("overrides" in sel.combine_reason) == (config.pcp_world_size != 2)
        if config.pcp_world_size is None:
            assert "pass pcp_world_size" in sel.combine_reason
    if combine == "a2a" and config.use_direct_a2a is False:
        assert "use_direct_a2a=False" in sel.combine_reason
    if auto and combine == "a2a":  # the gate's reason is in the selection
        reason = _auto_direct_a2a_off_reason(world.groups[0], device)
        assert reason is not None
        assert reason in sel.combine_reason, (reason, sel.combine_reason)
    if combine == "direct_a2a":
        assert "direct symmetric-memory A2A" in sel.combine_reason


def test_auto_never_takes_a_direct_path_on_a_cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even where the capability gate is on (a GPU machine), a CPU-device layer keeps the NCCL
    paths automatically; forcing still builds the direct workspace (interpreter tests)."""
    from cpattn_dcp.direct import get_direct_dcp_a2a_workspace

    for var in capability.MULTICAST_ENV_VARS:  # scripts/gpu_tests.sh turns multicast off
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(capability, "direct_cp_enabled", lambda *a, **k: True)
    monkeypatch.setattr(capability, "direct_cp_disabled_reason", lambda *a, **k: None)
    monkeypatch.setattr(capability, "direct_cp_multicast_enabled", lambda *a, **k: True)
    world = SimulatedWorld(2, "cpu")
    cfg = DCPConfig(comm_backend="a2a")
    ms = _managers(world, cfg, kv_token_dim=8, max_gathered_kv_tokens=4)
    for m in ms:
        assert m.combine_path == "a2a"
        assert m.direct_a2a is None
        assert "device cpu is not a CUDA device" in m.selection.combine_reason
        assert m.query_gather_path == "all_gather"
        assert "not a CUDA device" in m.selection.query_gather_reason
        assert m.kv_gather_path == "all_gather_into_tensor"
        assert "not a CUDA device" in m.selection.kv_gather_reason
    auto = world.run(
        lambda g: get_direct_dcp_a2a_workspace(g, "cpu", 2, 1, 8, torch.bfloat16, 1, None)
    )
    assert auto == [None, None]
    forced = world.run(
        lambda g: get_direct_dcp_a2a_workspace(g, "cpu", 2, 1, 8, torch.bfloat16, 1, True)
    )
    assert all(isinstance(ws, DirectDCPA2AWorkspace) for ws in forced)


def _gate_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capability gate says yes, as on a one-node GPU machine, also for a CPU device."""
    from cpattn_dcp.direct import factories

    for var in capability.MULTICAST_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(capability, "direct_cp_enabled", lambda *a, **k: True)
    monkeypatch.setattr(capability, "direct_cp_multicast_enabled", lambda *a, **k: True)
    monkeypatch.setattr(factories, "_automatic_reason", lambda *a, **k: None)


def test_auto_falls_back_when_a_direct_workspace_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gate on, but the direct A2A cannot take the geometry (rows of 24 bytes, not 16-byte
    aligned) and the multicast gathers get no multicast address: the automatic choice keeps
    the NCCL paths (it raised instead); forcing still raises."""
    from cpattn_dcp.direct import DirectPathUnavailable

    _gate_on(monkeypatch)

    def no_multicast(*args: Any, **kwargs: Any) -> Any:
        raise DirectPathUnavailable("requires NVLS symmetric-memory multicast.")

    monkeypatch.setattr(manager_mod, "get_direct_dcp_q_gather_workspace", no_multicast)
    monkeypatch.setattr(manager_mod, "get_direct_dcp_kv_gather_workspace", no_multicast)
    world = SimulatedWorld(2, "cpu")
    kw = {"head_dim": 12, "kv_token_dim": 8, "max_gathered_kv_tokens": 4}
    for m in _managers(world, DCPConfig(comm_backend="a2a"), **kw):
        assert m.combine_path == "a2a"
        assert "16-byte" in m.selection.combine_reason
        assert m.query_gather_path == "all_gather"
        assert "multicast" in m.selection.query_gather_reason
        assert m.kv_gather_path == "all_gather_into_tensor"
        assert "multicast" in m.selection.kv_gather_reason
    with pytest.raises(ValueError, match="16-byte"):
        _managers(world, DCPConfig(comm_backend="a2a", use_direct_a2a=True), **kw)
    with pytest.raises(DirectPathUnavailable):
        _managers(world, DCPConfig(comm_backend="a2a", use_direct_q_gather=True), **kw)


def test_a_forced_direct_gather_that_gating_turns_off_raises(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``use_direct_*_gather=True`` on a group without multicast (simulated ranks have none)
    silently took the NCCL gather; only the environment may keep a forced gather off (see
    ``test_direct_gathers_fall_back_without_any_multicast_call``)."""
    from cpattn_dcp.direct import DirectPathUnavailable

    for var in capability.MULTICAST_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    world = SimulatedWorld(2, device)
    kw = {"kv_token_dim": 8, "max_gathered_kv_tokens": 4}
    for switch in ("use_direct_q_gather", "use_direct_kv_gather"):
        config = DCPConfig(**{switch: True})
        with pytest.raises(
            DirectPathUnavailable, match=f"^{switch}=True, but the direct path cannot run: "
        ):
            _managers(world, config, **kw)


def test_auto_falls_back_together_when_a_rank_cannot_allocate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A symmetric allocation that failed on one rank (out of memory) raises
    ``SymmetricAllocationError`` on every rank (``DirectCPWorkspace`` agrees first): every
    manager then keeps the NCCL paths, with the failing rank in the reason; forcing raises
    ``DirectPathUnavailable`` (it let the allocation error through, which the manager did not
    catch)."""
    from cpattn_common.workspace import DirectCPWorkspace, SymmetricAllocationError
    from cpattn_dcp.direct import DirectPathUnavailable

    _gate_on(monkeypatch)
    monkeypatch.setattr(manager_mod, "direct_gather_unavailable_reason", lambda *a, **k: None)

    def rank_1_is_full(self: DirectCPWorkspace, shape: Any, dtype: torch.dtype) -> Any:
        raise SymmetricAllocationError("allocation failed on rank(s) [1] of 2", [1])

    monkeypatch.setattr(DirectCPWorkspace, "allocate", rank_1_is_full)
    world = SimulatedWorld(2, "cpu")
    kw = {"kv_token_dim": 8, "max_gathered_kv_tokens": 4}
    for m in _managers(world, DCPConfig(comm_backend="a2a"), **kw):
        assert (m.combine_path, m.query_gather_path, m.kv_gather_path) == (
            "a2a", "all_gather", "all_gather_into_tensor",
        )  # fmt: skip
        for reason in (
            m.selection.combine_reason,
            m.selection.query_gather_reason,
            m.selection.kv_gather_reason,
        ):
            assert "the workspace refused" in reason
            assert "allocation failed on rank(s) [1] of 2" in reason
    with pytest.raises(DirectPathUnavailable, match=r"Direct DCP A2A: allocation failed") as info:
        _managers(world, DCPConfig(comm_backend="a2a", use_direct_a2a=True), **kw)
    assert isinstance(info.value.__cause__, SymmetricAllocationError)


def test_wrappers_of_one_group_share_a_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer that wraps the group anew (``as_cp_group(pg)`` per layer) gets the workspace
    the first wrapper built, not one more set of symmetric buffers."""
    from cpattn_dcp.direct import factories

    class Wrapper(SimulatedGroup):
        @property
        def device_group(self) -> Any:  # the process group both wrappers stand for
            return shared

    shared = object()
    world = SimulatedWorld(1, "cpu")
    built: list[int] = []

    class Built:
        closed = False

        def __init__(self, group: Any, device: str, *geometry: int) -> None:
            built.append(1)
            self.number = len(built)

    def memo(group: Any, geometry: tuple[int, ...]) -> int:
        ws: Any = factories._memo("t", group, "cpu", geometry, Built)  # type: ignore[type-var]
        return int(ws.number)

    first, second = (Wrapper(world, 0) for _ in range(2))
    assert memo(first, (1,)) == 1
    assert memo(second, (1,)) == 1
    assert memo(second, (2,)) == 2  # another geometry
    assert memo(world.groups[0], (1,)) == 3  # no process group: its own
    assert len(built) == 3


def test_bare_device_is_normalised(device: torch.device) -> None:
    """``DCPManager(..., device="cuda")`` holds the indexed current device, and so does its
    direct workspace: inputs on ``cuda:<i>`` take the direct path."""
    bare = torch.device(device.type)
    world = SimulatedWorld(2, device)
    cfg = DCPConfig(comm_backend="a2a", use_direct_a2a=True)
    for m in _managers(world, cfg, device=bare):
        assert m.device == device
        ws = m.direct_a2a
        assert ws is not None
        assert ws.device == device
        out = torch.randn(1, 2, 8, device=device).to(torch.bfloat16)
        assert ws.unsupported_reason(out, torch.randn(1, 2, device=device)) is None


def test_forced_direct_a2a_with_unsupported_dtype_raises(device: torch.device) -> None:
    world = SimulatedWorld(2, device)
    with pytest.raises(ValueError, match="does not support"):
        _managers(world, DCPConfig(comm_backend="a2a", use_direct_a2a=True), dtype=torch.float32)


def test_pcp_a2a_when_the_dcp_group_is_the_pcp_group(device: torch.device) -> None:
    """With PCP, ``comm_backend="a2a"`` and ``pcp_world_size == N`` (the DCP group is the PCP
    group: vLLM's choice, and ``cpattn_pcp.resolve_dcp_combine``'s) the combine is the A2A:
    rank r gets heads ``[r*H_r, (r+1)*H_r)`` of the float64 reference, which a PCP all-gather
    of the heads (``finalize_mla_pcp_decode``) puts back in order. Before, PCP always meant
    AG+AR."""
    n, h_r, d = 2, 2, 16
    case = make_dcp_decode_case(
        seq_lens=[1, 5, 9], world_size=n, num_heads=n * h_r, head_dim=d, padding_rows=1,
        dtype=torch.bfloat16, device=device, seed=7,
    )  # fmt: skip
    config = DCPConfig(comm_backend="a2a", use_pcp=True, pcp_world_size=n, use_direct_a2a=False)
    world = SimulatedWorld(n, device)

    def step(g: Any) -> torch.Tensor:
        m = DCPManager(config, g, device, num_heads=h_r, head_dim=d, dtype=torch.bfloat16)
        assert m.combine_path == "a2a"
        assert not m.has_query_gather
        out, lse = case.rank_inputs(g.rank_in_group)
        return m.combine(
            out, lse, seq_lens=case.local_seq_lens[g.rank_in_group],
            query_start_loc=case.query_start_loc,
        )  # fmt: skip

    results = list(world.run(step))
    for got in results:
        assert got.shape == (case.ref_out.shape[0], h_r, d)
    assert_close_to_ref(
        torch.cat(results, dim=1), case.ref_out, dtype=torch.bfloat16, name="pcp a2a"
    )


def test_a_dcp_group_spanning_tp_x_pcp_all_reduces(device: torch.device) -> None:
    config = DCPConfig(comm_backend="a2a", use_pcp=True, pcp_world_size=2)
    for m in _managers(SimulatedWorld(4, device), config):
        assert m.combine_path == "ag_ar"
        assert "the DCP group spans TP x PCP: 4 ranks, PCP 2" in m.selection.combine_reason


def test_pcp_of_size_one_is_refused_and_a_dcp_group_of_one_communicates_nothing(
    device: torch.device,
) -> None:
    """``pcp_world_size=1`` is no PCP (cpattn_pcp.resolve_dcp_combine reads it so): the
    manager all-reduced every head there and named the group "TP x PCP". A DCP group of one
    fits every PCP size, and its reason says it exchanges nothing."""
    with pytest.raises(ValueError, match="pcp_world_size=1: a PCP group of one is no PCP"):
        DCPConfig(comm_backend="a2a", use_pcp=True, pcp_world_size=1)
    config = DCPConfig(comm_backend="a2a", use_pcp=True, pcp_world_size=2)
    (m,) = _managers(SimulatedWorld(1, device), config)
    assert m.combine_path == "ag_ar"
    assert m.selection.combine_reason == "PCP is on; world size 1 (no communication)"


def test_pcp_world_size_must_divide_the_dcp_size(device: torch.device) -> None:
    with pytest.raises(ValueError, match="pcp_world_size=3 does not divide the DCP group's size 2"):
        _managers(SimulatedWorld(2, device), DCPConfig(use_pcp=True, pcp_world_size=3))


def test_forced_direct_a2a_with_pcp_spanning_tp_raises(device: torch.device) -> None:
    config = DCPConfig(comm_backend="a2a", use_pcp=True, pcp_world_size=2, use_direct_a2a=True)
    with pytest.raises(ValueError, match=r"use_direct_a2a=True cannot apply: with PCP.*spans TP"):
        _managers(SimulatedWorld(4, device), config)


def test_pcp_has_no_query_gather(device: torch.device) -> None:
    m = _managers(SimulatedWorld(2, device), DCPConfig(use_pcp=True))[0]
    with pytest.raises(RuntimeError, match="use_pcp=True"):
        m.query_gather(torch.zeros(1, 1, 8, device=device))


@pytest.mark.parametrize(
    "config",
    [DCPConfig(comm_backend="a2a"), DCPConfig(comm_backend="ag_rs"), DCPConfig(use_pcp=True)],
    ids=["a2a", "ag_rs", "pcp-ag_ar"],
)
def test_inputs_that_require_grad_are_refused_on_every_path(
    device: torch.device, config: DCPConfig
) -> None:
    """Inference only, whichever path runs: the direct paths and the gathers refuse an input
    that requires grad, so the combine does too (its NCCL ops would only fail in
    ``backward``); under ``torch.no_grad()`` the same tensors go through."""
    n, h_r, d = 1, 2, 8
    m = _managers(SimulatedWorld(n, device), config, num_heads=h_r, head_dim=d)[0]
    out = torch.randn(3, n * h_r, d, device=device).to(torch.bfloat16).requires_grad_()
    lse = torch.randn(3, n * h_r, device=device).requires_grad_()
    query = torch.randn(3, h_r, d, device=device).to(torch.bfloat16).requires_grad_()
    local_kv = torch.randn(3, d, device=device).to(torch.bfloat16).requires_grad_()
    gathered_kv = torch.empty(n * 3, d, device=device, dtype=torch.bfloat16)
    calls: dict[str, Callable[[], Any]] = {
        "DCPManager.combine: partial_output": lambda: m.combine(out, lse.detach()),
        "DCPManager.combine: partial_lse": lambda: m.combine(out.detach(), lse),
        "dcp_gather_kv: local_kv": lambda: m.kv_gather(gathered_kv, local_kv),
    }
    if m.has_query_gather:
        calls["dcp_gather_query: query"] = lambda: m.query_gather(query)
    for what, call in calls.items():
        with pytest.raises(RuntimeError, match=f"^{what} requires grad"):
            call()
        with torch.no_grad():
            call()


def test_direct_gathers_fall_back_without_any_multicast_call(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("multicast probed although the environment disables it")

    monkeypatch.setattr(capability, "direct_cp_multicast_enabled", forbidden)
    cfg = DCPConfig(comm_backend="a2a", use_direct_q_gather=True, use_direct_kv_gather=True)
    ms = _managers(
        SimulatedWorld(2, device),
        cfg,
        kv_token_dim=16,
        max_gathered_kv_tokens=8,
        padded_num_heads=4,
    )
    for m in ms:
        assert m.query_gather_path == "all_gather"
        assert m.direct_q_gather is None
        assert m.kv_gather_path == "all_gather_into_tensor"
        assert m.direct_kv_gather is None
        assert "environment" in m.selection.query_gather_reason
        assert "environment" in m.selection.kv_gather_reason


def test_choice_is_logged_once(device: torch.device, caplog: pytest.LogCaptureFixture) -> None:
    manager_mod._logged.clear()
    world = SimulatedWorld(2, device)
    with caplog.at_level(logging.INFO, logger="cpattn_dcp.manager"):
        for _ in range(3):  # three layers, same configuration
            _managers(world, DCPConfig(comm_backend="a2a"), head_dim=16)
    records = [r for r in caplog.records if "DCP collectives" in r.getMessage()]
    assert len(records) == 1
    combine = _expected_auto_combine(world.groups[0], device)
    assert f"combine={combine} (" in records[0].getMessage()


@pytest.mark.no_checks  # one thread drives both ranks: check mode's all-gather would wait
def test_direct_combine_dispatch_and_row_fallback(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Direct A2A for rows <= max_num_tokens (arguments forwarded), NCCL A2A beyond."""
    n, h_r, d = 2, 1, 8
    world = SimulatedWorld(n, device)
    cfg = DCPConfig(comm_backend="a2a", use_direct_a2a=True, max_num_tokens=3)
    ms = _managers(world, cfg, num_heads=h_r, head_dim=d, is_lse_base_on_e=False)
    calls: list[tuple[str, dict[str, Any]]] = []

    def fake_a2a(out: torch.Tensor, lse: torch.Tensor, group: Any, **kw: Any) -> torch.Tensor:
        calls.append(("a2a", {"group": group, **kw}))
        return out[:, :h_r]

    monkeypatch.setattr(manager_mod, "dcp_a2a_lse_reduce", fake_a2a)
    orig = DirectDCPA2AWorkspace.lse_reduce

    def spy(self: Any, *args: Any, **kw: Any) -> Any:
        calls.append(("direct", {"args": args, **kw}))
        return orig(self, *args, **kw)

    monkeypatch.setattr(DirectDCPA2AWorkspace, "lse_reduce", spy)

    case = make_dcp_decode_case(
        seq_lens=[1, 5], world_size=n, num_heads=n * h_r, head_dim=d, padding_rows=1,
        dtype=torch.bfloat16, is_lse_base_on_e=False, device=device, seed=4,
    )  # fmt: skip
    b = case.num_rows
    assert b <= 3
    qsl = case.query_start_loc
    # Rank 0 publishes through its workspace first (the interpreter runs one launch at a time),
    # then rank 1 runs the whole manager call, then rank 0 finishes its wait.
    o0, l0 = case.rank_inputs(0)
    ws0 = ms[0].direct_a2a
    assert ws0 is not None
    ws0.publish(o0, l0, case.local_seq_lens[0], qsl)
    o1, l1 = case.rank_inputs(1)
    out1 = ms[1].combine(o1, l1, seq_lens=case.local_seq_lens[1], query_start_loc=qsl)
    out0 = ws0.wait_and_combine(b, is_lse_base_on_e=False)
    assert isinstance(out0, torch.Tensor)
    assert isinstance(out1, torch.Tensor)
    assert_close_to_ref(out0, case.ref_out[:, 0:1], dtype=torch.bfloat16)
    assert_close_to_ref(out1, case.ref_out[:, 1:2], dtype=torch.bfloat16)
    kind, kw = calls[-1]
    # lse_reduce(partial_output, partial_lse, is_lse_base_on_e, seq_lens, query_start_loc)
    assert kind == "direct"
    assert kw["args"][2] is False
    assert torch.equal(kw["args"][3], case.local_seq_lens[1])
    assert kw["args"][4] is qsl
    assert ms[1].last_combine_path == "direct_a2a"
    assert ms[1].num_fallbacks == 0

    big = torch.zeros(4, n * h_r, d, device=device, dtype=torch.bfloat16)
    ms[1].combine(big, torch.zeros(4, n * h_r, device=device), return_lse=False)
    kind, kw = calls[-1]
    assert kind == "a2a"
    assert kw["group"] is world.groups[1]
    assert kw["is_lse_base_on_e"] is False
    assert ms[1].last_combine_path == "a2a"
    assert ms[1].num_fallbacks == 1


def test_a_call_that_raises_leaves_the_last_path(device: torch.device) -> None:
    """``last_*_path`` names the path of the last call that returned: a combine whose op
    raised (here on ``seq_lens`` without ``query_start_loc``) took no path."""
    (m,) = _managers(SimulatedWorld(1, device), DCPConfig())
    out = torch.randn(3, 1, 8, device=device, dtype=torch.bfloat16)
    lse = torch.randn(3, 1, device=device)
    with pytest.raises(ValueError, match="together"):
        m.combine(out, lse, seq_lens=torch.ones(3, dtype=torch.int32, device=device))
    assert m.last_combine_path is None
    m.combine(out, lse)
    assert m.last_combine_path == "ag_rs"
    query = torch.randn(3, 1, 8, device=device, dtype=torch.bfloat16)
    m.query_gather(query)
    assert m.last_query_gather_path == "all_gather"
    kv = torch.randn(3, 8, device=device, dtype=torch.bfloat16)
    m.kv_gather(torch.empty(3, 8, device=device, dtype=torch.bfloat16), kv)
    assert m.last_kv_gather_path == "all_gather_into_tensor"


# --- real process groups ---------------------------------------------------------------------


def _manager_body(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    group = dist.group.WORLD
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    h_r, d = 2, 16
    case = make_dcp_decode_case(
        seq_lens=[1, 6, 3], world_size=world_size, num_heads=world_size * h_r, head_dim=d,
        queries_per_request=2, padding_rows=1, dtype=torch.bfloat16, device=device, seed=21,
    )  # fmt: skip
    heads = slice(rank * h_r, (rank + 1) * h_r)
    report: dict[str, Any] = {}
    # The automatic combine choice follows the capability gate (collective probe, cached).
    report["a2a_auto_expected"] = _expected_auto_combine(group, device)
    configs = {
        "ag_rs": DCPConfig(),
        "a2a": DCPConfig(comm_backend="a2a", use_direct_a2a=False),
        "auto": DCPConfig(comm_backend="auto", use_direct_a2a=False),
        "pcp": DCPConfig(use_pcp=True),
        "a2a_auto": DCPConfig(comm_backend="a2a"),
        # The DCP group is the PCP group: the A2A, direct where the gate is on.
        "pcp_a2a": DCPConfig(comm_backend="a2a", use_pcp=True, pcp_world_size=world_size),
    }
    for name, cfg in configs.items():
        m = DCPManager(cfg, group, device, h_r, d, torch.bfloat16)
        out, lse = case.rank_inputs(rank)
        res = m.combine(
            out, lse, seq_lens=case.local_seq_lens[rank], query_start_loc=case.query_start_loc,
            return_lse=True,
        )  # fmt: skip
        assert isinstance(res, tuple)
        o, l_ = res
        ref_o = case.ref_out if name == "pcp" else case.ref_out[:, heads]
        ref_l = case.ref_lse if name == "pcp" else case.ref_lse[:, heads]
        assert_close_to_ref(o, ref_o, dtype=torch.bfloat16, name=f"{name} out")
        assert_close_to_ref(l_, ref_l, dtype=torch.float32, name=f"{name} lse")
        report[name] = (m.combine_path, m.last_combine_path)
    # Query and KV gathers through the manager (NCCL paths: the direct ones forced off).
    cfg = DCPConfig(use_direct_q_gather=False, use_direct_kv_gather=False)
    m = DCPManager(cfg, group, device, h_r, d, torch.bfloat16, padded_num_heads=8)
    q_full = case.query.to(torch.bfloat16)
    q = m.query_gather(q_full[:, heads])
    assert torch.equal(q, q_full)
    assert q.untyped_storage().nbytes() >= q.shape[0] * 8 * d * 2
    local = q_full[:, rank] + 0
    buf = torch.empty(world_size * local.shape[0] + 1, d, device=device, dtype=torch.bfloat16)
    view = m.kv_gather(buf, local)
    expect = torch.cat([q_full[:, s] for s in range(world_size)], dim=0)
    assert torch.equal(view, expect)
    report["gathers"] = (m.query_gather_path, m.kv_gather_path)
    return report


def test_manager_multiprocess(run_ranks: RunRanks, dist_backend: str) -> None:
    """One launch of real ranks checks every NCCL-path combine, the automatic a2a choice
    (direct A2A where the gate is on: nccl on one node) and both gathers."""
    for rep in run_ranks(_manager_body, 2):
        assert rep["ag_rs"] == ("ag_rs", "ag_rs")
        assert rep["a2a"] == ("a2a", "a2a")
        assert rep["auto"] == ("a2a", "a2a")
        assert rep["pcp"] == ("ag_ar", "ag_ar")
        expected = rep["a2a_auto_expected"]
        if dist_backend == "gloo":
            assert expected == "a2a"
        assert rep["a2a_auto"] == (expected, expected)
        assert rep["pcp_a2a"] == (expected, expected)
        assert rep["gathers"] == ("all_gather", "all_gather_into_tensor")


def _compiled_combine_body(rank: int, world_size: int) -> dict[str, bool]:
    """Runs on every rank: ``combine`` of managers built on a ``ProcessGroup`` and on a
    ``CPGroup``, compiled with ``fullgraph=True``, against the eager call."""
    import torch.distributed as dist

    from cpattn_common.group import CPGroup

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    h_r, d = 2, 16
    gen = torch.Generator().manual_seed(30 + rank)
    out = torch.randn(3, world_size * h_r, d, generator=gen).to(device)
    lse = torch.randn(3, world_size * h_r, generator=gen).to(device)
    report: dict[str, bool] = {}
    for group_name, group in (("process_group", dist.group.WORLD), ("cpgroup", CPGroup())):
        for backend in ("a2a", "ag_rs"):
            cfg = DCPConfig(comm_backend=backend, use_direct_a2a=False)
            m = DCPManager(cfg, group, device, h_r, d, torch.float32)

            def step(o: torch.Tensor, s: torch.Tensor, m: DCPManager = m) -> Any:
                return m.combine(o, s)

            compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
            report[f"{group_name}/{backend}"] = torch.equal(compiled(out, lse), step(out, lse))
    return report


def test_compiled_combine_on_a_process_group_and_a_cpgroup(run_ranks: RunRanks) -> None:
    """``DCPManager.combine`` compiles with ``fullgraph=True`` on either group (a ``CPGroup``
    failed under torch 2.11's dynamo: ``AsPythonConstantNotImplementedError``)."""
    for report in run_ranks(_compiled_combine_body, 2):
        assert report == {
            f"{g}/{b}": True for g in ("process_group", "cpgroup") for b in ("a2a", "ag_rs")
        }


def _rank_1_out_of_memory_body(rank: int, world_size: int) -> dict[str, Any]:
    """Real ranks: symmetric memory runs out on rank 1 only (stubbed ``empty``); every rank's
    manager must take the same path and the combine must work on it."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device())
    expected = _expected_auto_combine(group, device)
    real_empty = symm_mem.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (stubbed on rank 1)")
        return real_empty(*args, **kwargs)

    symm_mem.empty = empty  # type: ignore[assignment]
    try:
        m = DCPManager(DCPConfig(comm_backend="a2a"), group, device, 2, 16, torch.bfloat16)
    finally:
        symm_mem.empty = real_empty  # type: ignore[assignment]
    case = make_dcp_decode_case(
        seq_lens=[1, 6, 3], world_size=world_size, num_heads=world_size * 2, head_dim=16,
        dtype=torch.bfloat16, device=device, seed=5,
    )  # fmt: skip
    out, lse = case.rank_inputs(rank)
    got = m.combine(
        out, lse, seq_lens=case.local_seq_lens[rank], query_start_loc=case.query_start_loc
    )
    assert isinstance(got, torch.Tensor)
    assert_close_to_ref(got, case.ref_out[:, rank * 2 : rank * 2 + 2], dtype=torch.bfloat16)
    return {"expected": expected, "path": m.combine_path, "reason": m.selection.combine_reason}


@pytest.mark.multigpu(2)
def test_gpu_one_rank_out_of_memory_every_manager_keeps_nccl(run_ranks: RunRanks) -> None:
    """Before the ranks agreed on the allocation, rank 1 raised while rank 0 waited in the
    rendezvous for good."""
    for rep in run_ranks(_rank_1_out_of_memory_body, 2, timeout=240.0):
        assert rep["path"] == "a2a", rep
        if rep["expected"] == "direct_a2a":  # the gate was on: the workspace refused
            assert "failed on rank(s) [1] of 2" in rep["reason"], rep


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose data pointer is one element past a 16-byte boundary."""
    store = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = store[1:].view(t.shape).copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


def _negated(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor with torch's negative bit (memory holds ``-t``)."""
    out = torch._neg_view(-t)
    assert out.is_neg()
    return out


@pytest.mark.parametrize("backend", ["ag_rs", "a2a", "ag_ar"])
def test_inputs_with_the_negative_bit_combine_on_the_nccl_paths(
    device: torch.device, backend: str
) -> None:
    """The NCCL combine ops refuse torch's negative bit, so the manager raised on one rank
    (its peers then waited in the collective), where its direct path takes such an input."""
    n, h_r, d = 2, 2, 8
    cfg = (
        DCPConfig(use_pcp=True)
        if backend == "ag_ar"
        else DCPConfig(comm_backend=backend, use_direct_a2a=False)
    )
    world = SimulatedWorld(n, device)
    ms = _managers(world, cfg, num_heads=h_r, head_dim=d)
    heads = n * h_r
    case = make_dcp_decode_case(
        seq_lens=[1, 5], world_size=n, num_heads=heads, head_dim=d, padding_rows=1,
        dtype=torch.bfloat16, device=device, seed=7,
    )  # fmt: skip
    qsl = case.query_start_loc

    def body(g: Any) -> torch.Tensor:
        r = g.rank_in_group
        out, lse = case.rank_inputs(r)
        if r == 1:
            out, lse = _negated(out), _negated(lse)
        got = ms[r].combine(out, lse, seq_lens=case.local_seq_lens[r], query_start_loc=qsl)
        assert isinstance(got, torch.Tensor)
        return got

    results = world.run(body)
    for r, got in enumerate(results):
        want = case.ref_out if backend == "ag_ar" else case.ref_out[:, r * h_r : (r + 1) * h_r]
        assert_close_to_ref(got, want, dtype=torch.bfloat16)
    assert ms[1].last_combine_path == backend


@pytest.mark.no_checks  # one thread drives both ranks: check mode's all-gather would wait
@pytest.mark.parametrize("form", ["layout", "negative bit"])
def test_rank_local_layouts_stay_on_the_direct_path(
    device: torch.device, patch_direct_gathers: Callable[[], None], form: str
) -> None:
    """A misaligned or strided input on one rank, or one with torch's negative bit (whose
    memory the kernels copied as it is: negated values), is packed there, not sent to NCCL:
    its peers take the direct path (their inputs are fine) and would wait for it until the
    timeout."""
    neg = form == "negative bit"
    n, h_r, d = 2, 2, 8
    patch_direct_gathers()
    world = SimulatedWorld(n, device)
    cfg = DCPConfig(comm_backend="a2a", use_direct_a2a=True, max_num_tokens=3)
    ms = _managers(world, cfg, num_heads=h_r, head_dim=d, kv_token_dim=d, max_gathered_kv_tokens=4)

    case = make_dcp_decode_case(
        seq_lens=[1, 5], world_size=n, num_heads=n * h_r, head_dim=d, padding_rows=1,
        dtype=torch.bfloat16, device=device, seed=5,
    )  # fmt: skip
    ws0 = ms[0].direct_a2a
    assert ws0 is not None
    o0, l0 = case.rank_inputs(0)
    qsl = case.query_start_loc
    ws0.publish(o0, l0, case.local_seq_lens[0], qsl)
    o1, l1 = case.rank_inputs(1)
    o1, l1 = (_negated(o1), _negated(l1)) if neg else (_misaligned(o1), l1)
    assert ws0.unsupported_reason(o1, l1) is not None  # the workspace refuses it
    out1 = ms[1].combine(o1, l1, seq_lens=case.local_seq_lens[1], query_start_loc=qsl)
    out0 = ws0.wait_and_combine(case.num_rows)
    assert isinstance(out1, torch.Tensor)
    assert isinstance(out0, torch.Tensor)
    assert ms[1].last_combine_path == "direct_a2a"
    assert_close_to_ref(out0, case.ref_out[:, 0:h_r], dtype=torch.bfloat16)
    assert_close_to_ref(out1, case.ref_out[:, h_r:], dtype=torch.bfloat16)

    full = torch.randn(2, n * h_r, d, device=device).to(torch.bfloat16)
    qws = ms[0].direct_q_gather
    assert qws is not None
    qws.publish(full[:, :h_r])
    strided = (
        _negated(full[:, h_r:])
        if neg
        else full[:, h_r:].transpose(0, 1).contiguous().transpose(0, 1)  # heads not packed
    )
    assert qws.unsupported_reason(strided) is not None
    got1 = ms[1].query_gather(strided)
    assert torch.equal(qws.wait(2), full)
    assert torch.equal(got1, full)
    assert ms[1].last_query_gather_path == "direct"

    local = [torch.randn(2, d, device=device).to(torch.bfloat16) for _ in range(n)]
    kws = ms[0].direct_kv_gather
    assert kws is not None
    kws.publish(local[0])
    buf1 = torch.zeros(n * 2, d, device=device, dtype=torch.bfloat16)
    buf1 = _negated(buf1) if neg else _misaligned(buf1)
    view1 = ms[1].kv_gather(buf1, _negated(local[1]) if neg else _misaligned(local[1]))
    buf0 = torch.zeros(n * 2, d, device=device, dtype=torch.bfloat16)
    kws.wait(buf0)
    assert torch.equal(buf0, torch.cat(local))
    assert torch.equal(view1, torch.cat(local))
    assert view1.data_ptr() == buf1.data_ptr()
    assert ms[1].last_kv_gather_path == "direct"
    assert ms[1].num_fallbacks == 0


@pytest.mark.no_checks  # one thread drives both ranks: check mode's all-gather would wait
def test_direct_gathers_dispatch_and_fallback(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, patch_direct_gathers: Callable[[], None]
) -> None:
    """With direct gather workspaces available (simulated peers; no multicast here, so the
    gating is patched), the manager uses them and falls back per call to the NCCL gathers."""
    n, h_r, d, t_max = 2, 2, 8, 3
    patch_direct_gathers()
    calls: list[str] = []
    monkeypatch.setattr(
        manager_mod, "dcp_gather_query", lambda q, g, p: calls.append("q_nccl") or q
    )
    monkeypatch.setattr(
        manager_mod, "dcp_gather_kv", lambda buf, loc, g: calls.append("kv_nccl") or buf
    )
    cfg = DCPConfig(max_num_tokens=t_max)
    ms = _managers(
        SimulatedWorld(n, device), cfg, num_heads=h_r, head_dim=d, kv_token_dim=d,
        max_gathered_kv_tokens=4,
    )  # fmt: skip
    for m in ms:
        assert m.query_gather_path == "direct"
        assert m.kv_gather_path == "direct"
    full = torch.randn(2, n * h_r, d, device=device).to(torch.bfloat16)
    qws = ms[0].direct_q_gather
    assert qws is not None
    qws.publish(full[:, :h_r])
    got1 = ms[1].query_gather(full[:, h_r:])
    got0 = qws.wait(2)
    assert torch.equal(got0, full)
    assert torch.equal(got1, full)
    assert ms[1].last_query_gather_path == "direct"
    ms[1].query_gather(torch.zeros(t_max + 1, h_r, d, device=device, dtype=torch.bfloat16))
    assert calls == ["q_nccl"]
    assert ms[1].last_query_gather_path == "all_gather"

    local = [torch.randn(2, d, device=device).to(torch.bfloat16) for _ in range(n)]
    bufs = [torch.zeros(n * 2 + 1, d, device=device, dtype=torch.bfloat16) for _ in range(n)]
    kws = ms[0].direct_kv_gather
    assert kws is not None
    kws.publish(local[0])
    view1 = ms[1].kv_gather(bufs[1], local[1])
    kws.wait(bufs[0][: n * 2])
    expect = torch.cat(local)
    assert torch.equal(bufs[0][: n * 2], expect)
    assert torch.equal(view1, expect)
    assert ms[1].last_kv_gather_path == "direct"
    # 2*3 = 6 rows exceed the direct capacity 4 (the buffer holds them: no caller mistake)
    roomy = torch.zeros(n * 3, d, device=device, dtype=torch.bfloat16)
    ms[1].kv_gather(roomy, torch.zeros(3, d, device=device, dtype=torch.bfloat16))
    assert calls == ["q_nccl", "kv_nccl"]
    assert ms[1].num_fallbacks == 2
