"""``DCPManager`` / ``DCPConfig`` argument checks: construction arguments (sizes, dtypes,
``padded_num_heads``, forced switches that cannot apply), per-call geometry checks that raise
on every path instead of counting as a fallback, the direct query gather's validity contract,
and the once-per-process fallback log."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_dcp import manager as manager_mod
from cpattn_dcp.direct import (
    clear_direct_workspace_cache,
)
from cpattn_dcp.manager import DCPConfig, DCPManager
from cpattn_testing.forks import fork_while_held
from cpattn_testing.simulated import SimulatedWorld

# Partial outputs of zeros carry LSEs of -inf rows through the interpreter's log2.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

_N, _H_R, _D = 2, 2, 16
_BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh_state() -> Any:
    clear_direct_workspace_cache()
    manager_mod._logged.clear()
    yield
    clear_direct_workspace_cache()
    manager_mod._logged.clear()


def _managers(
    config: DCPConfig, device: torch.device, world_size: int = _N, **kw: Any
) -> tuple[SimulatedWorld, list[DCPManager]]:
    """One manager per simulated rank (H_r = 2, D = 16, bf16 unless overridden)."""
    args = {"num_heads": _H_R, "head_dim": _D, "dtype": _BF16, **kw}
    world = SimulatedWorld(world_size, device)
    return world, list(world.run(lambda g: DCPManager(config, g, device, **args)))


def _nccl_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any NCCL-path collective the manager reaches fails the test."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a caller mistake reached the NCCL path")

    for name in (
        "dcp_a2a_lse_reduce", "cp_lse_ag_out_rs", "cp_lse_ag_out_ar", "dcp_gather_query",
        "dcp_gather_kv",
    ):  # fmt: skip
        monkeypatch.setattr(manager_mod, name, forbidden)


# --- 1. padded_num_heads ---------------------------------------------------------------------


def test_padded_num_heads_below_the_gathered_heads_raises_at_construction(
    device: torch.device,
) -> None:
    """N=2, H_r=4: a capacity of 4 heads cannot hold the 8 gathered heads (every query
    gather raised; the manager was built)."""
    with pytest.raises(
        ValueError, match=re.escape("padded_num_heads 4 < gathered heads N*H_r = 2*4 = 8")
    ):
        _managers(DCPConfig(), device, num_heads=4, padded_num_heads=4)
    for padded in (8, 12):  # exactly N*H_r, and more
        _, ms = _managers(DCPConfig(), device, num_heads=4, padded_num_heads=padded)
        assert ms[0].padded_num_heads == padded


@pytest.mark.parametrize("padded", [8.0, True, "8"], ids=["float", "bool", "str"])
def test_padded_num_heads_must_be_an_int(device: torch.device, padded: Any) -> None:
    with pytest.raises(TypeError, match="padded_num_heads must be an int"):
        _managers(DCPConfig(), device, num_heads=4, padded_num_heads=padded)


def test_padded_num_heads_error_is_not_read_as_an_unavailable_direct_gather(
    device: torch.device, patch_direct_gathers: Callable[[], None]
) -> None:
    """Gate on: the direct q-gather workspace refused the bad padding and the manager chose the
    all-gather ("the workspace refused"), which then failed on every call. Now the
    construction raises, before any workspace is built."""
    patch_direct_gathers()
    with pytest.raises(ValueError, match=re.escape("padded_num_heads 4 < gathered heads")):
        _managers(DCPConfig(), device, num_heads=4, padded_num_heads=4)
    _, ms = _managers(DCPConfig(), device, num_heads=4, padded_num_heads=8)
    assert ms[0].query_gather_path == "direct"


# --- 2. per-call geometry --------------------------------------------------------------------

_COMBINE_CONFIGS = {
    "ag_rs": DCPConfig(),
    "a2a": DCPConfig(comm_backend="a2a", use_direct_a2a=False),
    "ag_ar": DCPConfig(use_pcp=True),
    "direct_a2a": DCPConfig(comm_backend="a2a", use_direct_a2a=True, max_num_tokens=4),
}

# (partial_output shape, partial_lse shape, expected message) for N=2, H_r=2, D=16.
_BAD_COMBINE_INPUTS = {
    "6 heads": (
        (3, 6, _D), (3, 6),
        "partial_output has shape (3, 6, 16), expected [T, N*H_r, D] = [T, 2*2, 16] = [T, 4, 16]",
    ),
    "3 heads": ((3, 3, _D), (3, 3), "partial_output has shape (3, 3, 16)"),
    "head dim 8": ((3, 4, 8), (3, 4), "partial_output has shape (3, 4, 8)"),
    "2-D output": ((3, 4 * _D), (3, 4), "partial_output has shape (3, 64)"),
    "lse heads": ((3, 4, _D), (3, 6), "partial_lse has shape (3, 6), expected [T, N*H_r] = [3, 4]"),
    "lse rows": ((3, 4, _D), (2, 4), "partial_lse has shape (2, 4), expected [T, N*H_r] = [3, 4]"),
    "lse 3-D": ((3, 4, _D), (3, 4, 1), "partial_lse has shape (3, 4, 1)"),
}  # fmt: skip


# With PCP (ag_ar) every rank keeps every head: any head count is valid there
# (test_pcp_combine_takes_any_head_count), and the LSE must be [T, H].
_PCP_VALID = ("6 heads", "3 heads")


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (path, bad)
        for path in _COMBINE_CONFIGS
        for bad in _BAD_COMBINE_INPUTS
        if not (path == "ag_ar" and bad in _PCP_VALID)
    ],
)
def test_combine_refuses_another_geometry_on_every_path(
    device: torch.device, path: str, bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 6-head partial output with N=2, H_r=2 returned [T, 3, D] on the NCCL paths; on the
    direct A2A it was counted and logged as a fallback, then served by NCCL."""
    _, ms = _managers(_COMBINE_CONFIGS[path], device)
    m = ms[0]
    assert m.combine_path == path
    _nccl_forbidden(monkeypatch)
    out_shape, lse_shape, message = _BAD_COMBINE_INPUTS[bad]
    if path == "ag_ar":
        message = message.replace("[T, N*H_r] =", "[T, H] =")
    if path == "direct_a2a" and bad in ("lse heads", "lse rows"):
        # The output fits the workspace, so the manager adds no check of its own (the hot
        # path): lse_reduce's, with its own words, raises before anything is sent.
        message = f"partial_lse {lse_shape} does not match partial_output {out_shape} in [T, H]"
    out = torch.zeros(out_shape, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=re.escape(message)):
        m.combine(out, torch.zeros(lse_shape, device=device))
    assert m.num_fallbacks == 0
    assert m.last_combine_path is None


def test_combine_refuses_non_tensors(device: torch.device) -> None:
    _, ms = _managers(DCPConfig(), device)
    with pytest.raises(TypeError, match="partial_output and partial_lse must be tensors"):
        ms[0].combine([[0.0]], torch.zeros(1, 4, device=device))  # type: ignore[arg-type]


def test_combine_of_the_manager_geometry_still_runs(device: torch.device) -> None:
    """The checks pass the geometry the manager was built for (NCCL A2A, both ranks)."""
    world, ms = _managers(_COMBINE_CONFIGS["a2a"], device)
    out = torch.randn(3, _N * _H_R, _D).to(torch.bfloat16).to(device)
    lse = torch.randn(3, _N * _H_R).to(device)
    res = world.run(lambda g: ms[g.rank_in_group].combine(out, lse))
    assert [tuple(r.shape) for r in res] == [(3, _H_R, _D)] * _N


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((3, 3, 24), "query has shape (3, 3, 24), expected this rank's heads [T, H_r, D_q] = "
         "[T, 2, 24]"),
        ((3, 2, 16), "query has shape (3, 2, 16)"),  # the output head dim, not D_q
        ((3, 48), "query has shape (3, 48)"),
    ],
    ids=["3 heads", "head dim", "2-D"],
)  # fmt: skip
@pytest.mark.parametrize("direct", [False, True], ids=["all_gather", "direct"])
def test_query_gather_refuses_another_geometry_on_every_path(
    device: torch.device,
    direct: bool,
    shape: tuple[int, ...],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    patch_direct_gathers: Callable[[], None],
) -> None:
    """A 3-head query with H_r=2 was gathered to [T, 6, D]; on the direct path it was
    counted as a fallback first."""
    if direct:
        patch_direct_gathers()
    _, ms = _managers(DCPConfig(max_num_tokens=4), device, query_head_dim=24)
    m = ms[0]
    assert m.query_gather_path == ("direct" if direct else "all_gather")
    _nccl_forbidden(monkeypatch)
    with pytest.raises(ValueError, match=re.escape(message)):
        m.query_gather(torch.zeros(shape, dtype=torch.bfloat16, device=device))
    assert m.num_fallbacks == 0
    assert m.last_query_gather_path is None


def test_query_gather_of_the_manager_geometry_still_runs(device: torch.device) -> None:
    world, ms = _managers(DCPConfig(), device, query_head_dim=24, padded_num_heads=6)
    full = torch.randn(3, _N * _H_R, 24).to(torch.bfloat16).to(device)
    res = world.run(
        lambda g: ms[g.rank_in_group].query_gather(
            full[:, g.rank_in_group * _H_R : (g.rank_in_group + 1) * _H_R]
        )
    )
    for q in res:
        assert torch.equal(q, full)


def _kv_managers(
    device: torch.device, direct: bool, patch_direct_gathers: Callable[[], None]
) -> list[DCPManager]:
    if direct:
        patch_direct_gathers()
    _, ms = _managers(DCPConfig(), device, kv_token_dim=8, max_gathered_kv_tokens=8)
    assert ms[0].kv_gather_path == ("direct" if direct else "all_gather_into_tensor")
    return ms


# name: (gathered_kv shape, local_kv shape, gathered_kv dtype, message); N=2, kv_token_dim=8.
_BAD_KV = {
    "5 rows for 2*3": ((5, 8), (3, 8), _BF16, "gathered_kv has 5 rows, needs N*T = 2*3 = 6"),
    "width": (
        (6, 16), (3, 16), _BF16, "local_kv has shape (3, 16), expected [T, kv_token_dim] = [T, 8]"
    ),
    "row shapes": ((6, 16), (3, 8), _BF16, "row shapes differ"),
    "ranks": ((6, 8, 1), (3, 8), _BF16, "of equal rank"),
    "dtypes": ((6, 8), (3, 8), torch.float16, "must share dtype and device"),
    # a column slice of wider rows: the NCCL gather refuses it as well
    "strided buffer": ((6, 16), (3, 8), _BF16, "gathered_kv must be contiguous"),
    # T = 0: the direct path's empty slice of it is contiguous, so it took no check
    "strided buffer, T=0": ((6, 16), (0, 8), _BF16, "gathered_kv must be contiguous"),
    # the direct path sliced it first (IndexError)
    "0-d buffer": ((), (3, 8), _BF16, "of equal rank, got () and (3, 8)"),
}  # fmt: skip


@pytest.mark.parametrize("bad", list(_BAD_KV))
@pytest.mark.parametrize("direct", [False, True], ids=["all_gather_into_tensor", "direct"])
def test_kv_gather_refuses_a_buffer_it_cannot_fill_on_every_path(
    device: torch.device,
    direct: bool,
    bad: str,
    monkeypatch: pytest.MonkeyPatch,
    patch_direct_gathers: Callable[[], None],
) -> None:
    """A too-small buffer on the direct path was logged and counted as a fallback before the
    NCCL gather raised; the error is now the same on both paths, before either."""
    m = _kv_managers(device, direct, patch_direct_gathers)[0]
    _nccl_forbidden(monkeypatch)
    gathered_shape, local_shape, gathered_dtype, message = _BAD_KV[bad]
    gathered = torch.zeros(gathered_shape, dtype=gathered_dtype, device=device)
    if bad.startswith("strided buffer"):
        gathered = gathered[:, :8]
    local = torch.zeros(local_shape, dtype=_BF16, device=device)
    with pytest.raises(ValueError, match=re.escape(message)):
        m.kv_gather(gathered, local)
    assert m.num_fallbacks == 0
    assert m.last_kv_gather_path is None


def test_direct_paths_refuse_an_input_on_another_device(
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    patch_direct_gathers: Callable[[], None],
) -> None:
    """Inputs on another device than the direct workspaces' (``meta`` here) were counted and
    logged as a fallback and sent to NCCL: this rank alone would leave the direct path while
    its peers wait in it. They are the caller's mistake, like another geometry."""
    patch_direct_gathers()
    config = DCPConfig(comm_backend="a2a", use_direct_a2a=True, max_num_tokens=4)
    _, ms = _managers(config, device, kv_token_dim=8, max_gathered_kv_tokens=8)
    m = ms[0]
    assert (m.combine_path, m.query_gather_path, m.kv_gather_path) == (
        "direct_a2a", "direct", "direct",
    )  # fmt: skip
    _nccl_forbidden(monkeypatch)
    meta = torch.device("meta")
    on = f"but this manager's direct path is on {m.device}"
    with pytest.raises(ValueError, match=re.escape(f"partial_output is on meta, {on}")):
        m.combine(torch.zeros(3, _N * _H_R, _D, dtype=_BF16, device=meta),
                  torch.zeros(3, _N * _H_R, device=meta))  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(f"query is on meta, {on}")):
        m.query_gather(torch.zeros(3, _H_R, _D, dtype=_BF16, device=meta))
    with pytest.raises(ValueError, match=re.escape(f"local_kv is on meta, {on}")):
        m.kv_gather(torch.zeros(6, 8, dtype=_BF16, device=meta),
                    torch.zeros(3, 8, dtype=_BF16, device=meta))  # fmt: skip
    assert m.num_fallbacks == 0
    assert (m.last_combine_path, m.last_query_gather_path, m.last_kv_gather_path) == (
        None, None, None,
    )  # fmt: skip


def test_kv_gather_refuses_non_tensors(device: torch.device) -> None:
    _, ms = _managers(DCPConfig(), device)
    with pytest.raises(TypeError, match="gathered_kv and local_kv must be tensors"):
        ms[0].kv_gather(torch.empty(2, 8, device=device), [[0.0] * 8])  # type: ignore[arg-type]


def test_kv_gather_of_the_manager_geometry_still_runs(device: torch.device) -> None:
    """A buffer with room to spare, on the NCCL path (both ranks)."""
    world, ms = _managers(DCPConfig(), device, kv_token_dim=8)
    local = [torch.randn(3, 8).to(_BF16).to(device) for _ in range(_N)]
    bufs = [torch.zeros(7, 8, dtype=_BF16, device=device) for _ in range(_N)]
    res = world.run(
        lambda g: ms[g.rank_in_group].kv_gather(bufs[g.rank_in_group], local[g.rank_in_group])
    )
    for view in res:
        assert torch.equal(view, torch.cat(local))


# --- 3. construction arguments ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"num_heads": 2.7}, TypeError, "num_heads must be an int, got 2.7"),
        ({"num_heads": 2.0}, TypeError, "num_heads must be an int, got 2.0"),
        ({"num_heads": True}, TypeError, "num_heads must be an int, got True"),
        ({"num_heads": 0}, ValueError, "num_heads must be a positive int, got 0"),
        ({"head_dim": 16.9}, TypeError, "head_dim must be an int, got 16.9"),
        ({"head_dim": -1}, ValueError, "head_dim must be a positive int, got -1"),
        ({"query_head_dim": 0}, ValueError, "query_head_dim must be a positive int, got 0"),
        ({"query_head_dim": 24.0}, TypeError, "query_head_dim must be an int, got 24.0"),
        ({"kv_token_dim": -3, "max_gathered_kv_tokens": 4}, ValueError,
         "kv_token_dim must be a positive int, got -3"),
        ({"kv_token_dim": False}, TypeError, "kv_token_dim must be an int, got False"),
        ({"max_gathered_kv_tokens": 4.5, "kv_token_dim": 16}, TypeError,
         "max_gathered_kv_tokens must be an int, got 4.5"),
        ({"max_gathered_kv_tokens": True}, TypeError,
         "max_gathered_kv_tokens must be an int, got True"),
        ({"max_gathered_kv_tokens": -1}, ValueError, "max_gathered_kv_tokens must be >= 0, got -1"),
        ({"dtype": "bf16"}, TypeError, "dtype must be a torch.dtype, got 'bf16'"),
        ({"query_dtype": "fp8"}, TypeError, "query_dtype must be a torch.dtype, got 'fp8'"),
        ({"kv_dtype": torch.zeros(1)}, TypeError, "kv_dtype must be a torch.dtype"),
        # bool() made None base 2 and "False" base e (the ops themselves refused both)
        ({"is_lse_base_on_e": None}, TypeError, "is_lse_base_on_e must be a bool, got None"),
        ({"is_lse_base_on_e": "False"}, TypeError, "is_lse_base_on_e must be a bool, got 'False'"),
    ],
    ids=[
        "num_heads=2.7", "num_heads=2.0", "num_heads=True", "num_heads=0", "head_dim=16.9",
        "head_dim=-1", "query_head_dim=0", "query_head_dim=24.0", "kv_token_dim=-3",
        "kv_token_dim=False", "max_gathered_kv_tokens=4.5", "max_gathered_kv_tokens=True",
        "max_gathered_kv_tokens=-1", "dtype=bf16", "query_dtype=fp8", "kv_dtype=tensor",
        "is_lse_base_on_e=None", "is_lse_base_on_e='False'",
    ],
)  # fmt: skip
def test_construction_refuses_loose_arguments(
    device: torch.device, kwargs: dict[str, Any], exc: type[Exception], message: str
) -> None:
    """Sizes were truncated (2.7 -> 2, True -> 1, 16.9 -> 16, 4.5 -> 4) and negative or zero
    dims or a string dtype were stored."""
    with pytest.raises(exc, match=re.escape(message)):
        _managers(DCPConfig(), device, **kwargs)


def test_sizes_are_stored_as_given(device: torch.device) -> None:
    _, ms = _managers(
        DCPConfig(), device, query_head_dim=24, kv_token_dim=8, max_gathered_kv_tokens=0,
        query_dtype=torch.float16, kv_dtype=torch.float32,
    )  # fmt: skip
    m = ms[0]
    assert (m.num_heads, m.head_dim, m.query_head_dim, m.kv_token_dim) == (_H_R, _D, 24, 8)
    assert m.max_gathered_kv_tokens == 0
    assert (m.dtype, m.query_dtype, m.kv_dtype) == (torch.bfloat16, torch.float16, torch.float32)
    assert m.group_num_heads == _N * _H_R


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"use_direct_a2a": True}, "use_direct_a2a=True cannot apply with comm_backend='ag_rs'"),
        ({"use_direct_a2a": True, "comm_backend": "ag_rs"},
         "use_direct_a2a=True cannot apply with comm_backend='ag_rs'"),
        ({"use_direct_a2a": True, "comm_backend": "a2a", "use_pcp": True},
         "use_direct_a2a=True cannot apply with use_pcp=True"),
        ({"use_direct_a2a": True, "comm_backend": "auto", "use_pcp": True},
         "use_direct_a2a=True cannot apply with use_pcp=True"),
        ({"use_direct_a2a": True, "comm_backend": "auto", "use_pcp": True, "pcp_world_size": 2},
         "use_direct_a2a=True cannot apply with use_pcp=True"),
        ({"use_direct_q_gather": True, "use_pcp": True},
         "use_direct_q_gather=True cannot apply with use_pcp=True"),
    ],
    ids=["default backend", "ag_rs", "pcp a2a", "pcp auto", "pcp auto sized", "q-gather pcp"],
)  # fmt: skip
def test_config_refuses_a_forced_switch_that_cannot_apply(
    kwargs: dict[str, Any], message: str
) -> None:
    """The factories document ``use_direct_*=True`` as "force; an unsupported configuration
    then raises"; these were ignored without a word."""
    with pytest.raises(ValueError, match=re.escape(message)):
        DCPConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"use_direct_a2a": None}, {"use_direct_a2a": False},
        {"use_direct_a2a": False, "use_pcp": True}, {"use_direct_a2a": None, "use_pcp": True},
        {"use_direct_q_gather": None, "use_pcp": True},
        {"use_direct_q_gather": False, "use_pcp": True},
        {"use_direct_a2a": True, "comm_backend": "a2a"},
        {"use_direct_a2a": True, "comm_backend": "auto"},
        {"use_direct_a2a": True, "comm_backend": "a2a", "use_pcp": True, "pcp_world_size": 2},
        {"use_direct_q_gather": True},
    ],
)  # fmt: skip
def test_config_keeps_auto_off_and_applicable_forced_switches(kwargs: dict[str, Any]) -> None:
    DCPConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"kv_token_dim": 8}, {"max_gathered_kv_tokens": 4}],
    ids=["neither", "no capacity", "no token dim"],
)
def test_forced_kv_gather_without_geometry_raises(
    device: torch.device, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match=re.escape("use_direct_kv_gather=True needs a direct")):
        _managers(DCPConfig(use_direct_kv_gather=True), device, **kwargs)
    for auto_or_off in (None, False):  # unchanged: the NCCL gather, no error
        _, ms = _managers(DCPConfig(use_direct_kv_gather=auto_or_off), device, **kwargs)
        assert ms[0].kv_gather_path == "all_gather_into_tensor"


# --- 4. validity of the direct query gather --------------------------------------------------


@pytest.mark.no_checks  # one thread drives both ranks: check mode's all-gather would wait
def test_direct_query_gather_is_valid_until_the_combine_only(
    device: torch.device, patch_direct_gathers: Callable[[], None]
) -> None:
    """A peer past this layer's combine may start its next gather and overwrite this rank's
    gathered query before this rank calls ``query_gather`` again; the docstring said the
    result stayed valid until this rank's next ``query_gather``."""
    patch_direct_gathers()
    h_r, d = 1, 8
    _, ms = _managers(DCPConfig(max_num_tokens=4), device, num_heads=h_r, head_dim=d)
    ws0, ws1 = ms[0].direct_q_gather, ms[1].direct_q_gather
    assert ws0 is not None
    assert ws1 is not None
    layer1 = torch.ones(2, _N * h_r, d, dtype=_BF16, device=device)
    ws0.publish(layer1[:, :h_r].contiguous())
    ms[1].query_gather(layer1[:, h_r:].contiguous())
    q0 = ws0.wait(2)  # what rank 0's query_gather returns
    assert torch.equal(q0, layer1)
    # ... attention, the layer's combine (a rendezvous); rank 1 starts the next layer first:
    ws1.publish(torch.full((2, h_r, d), 7.0, dtype=_BF16, device=device))
    assert not torch.equal(q0, layer1)  # rank 0 made no query_gather call since

    doc = " ".join((DCPManager.query_gather.__doc__ or "").split())
    assert "valid until this rank enters this layer's combine" in doc
    assert "copy the result if it is needed after the combine" in doc
    assert "valid until the next ``query_gather``" not in doc


# --- 5. fallback log -------------------------------------------------------------------------


def test_fallback_is_logged_once_per_process_and_reason(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One oversized step through four layers logged a fallback line per layer and rank (8);
    now one line per reason, whatever the row count, and every manager still counts."""
    cfg = DCPConfig(comm_backend="a2a", use_direct_a2a=True, max_num_tokens=2)
    layers = [_managers(cfg, device, num_heads=1, head_dim=8)[1] for _ in range(4)]
    nccl_calls: list[int] = []

    def fake_nccl_a2a(out: torch.Tensor, lse: torch.Tensor, group: Any, **kw: Any) -> Any:
        nccl_calls.append(out.shape[0])
        return out[:, :1]

    monkeypatch.setattr(manager_mod, "dcp_a2a_lse_reduce", fake_nccl_a2a)
    with caplog.at_level(logging.DEBUG, logger="cpattn_dcp.manager"):
        for rows in (3, 5):  # two oversized steps of different sizes: one reason
            for ms in layers:
                for m in ms:
                    out = torch.zeros(rows, 2, 8, dtype=_BF16, device=device)
                    m.combine(out, torch.zeros(rows, 2, device=device))
        fallback_infos = [
            r for r in caplog.records
            if r.levelno == logging.INFO and "cannot take a call" in r.getMessage()
        ]  # fmt: skip
        assert len(fallback_infos) == 1, [r.getMessage() for r in fallback_infos]
        assert "3 rows" in fallback_infos[0].getMessage()
        debug = [
            r for r in caplog.records if r.levelno == logging.DEBUG and "fallback" in r.getMessage()
        ]
        assert len(debug) == 2 * 4 * 2 - 1
        # Another reason (a dtype the workspace was not built for) is logged once more.
        for ms in layers:
            out16 = torch.zeros(1, 2, 8, dtype=torch.float16, device=device)
            ms[0].combine(out16, torch.zeros(1, 2, device=device))
    infos = [
        r for r in caplog.records
        if r.levelno == logging.INFO and "cannot take a call" in r.getMessage()
    ]  # fmt: skip
    assert len(infos) == 2
    assert "float16" in infos[1].getMessage()
    assert len(nccl_calls) == 2 * 4 * 2 + 4
    for ms in layers:
        assert [m.num_fallbacks for m in ms] == [3, 2]
        assert all(m.last_combine_path == "a2a" for m in ms)


def test_fallback_log_is_shared_by_threads(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Simulated ranks are threads: four ranks falling back at once log the reason once."""
    cfg = DCPConfig(comm_backend="a2a", use_direct_a2a=True, max_num_tokens=2)
    world, ms = _managers(cfg, device, world_size=4, num_heads=1, head_dim=8)
    monkeypatch.setattr(manager_mod, "dcp_a2a_lse_reduce", lambda out, lse, g, **kw: out[:, :1])
    with caplog.at_level(logging.INFO, logger="cpattn_dcp.manager"):
        world.run(
            lambda g: ms[g.rank_in_group].combine(
                torch.zeros(3, 4, 8, dtype=_BF16, device=device), torch.zeros(3, 4, device=device)
            )
        )
    assert sum("cannot take a call" in r.getMessage() for r in caplog.records) == 1
    assert [m.num_fallbacks for m in ms] == [1, 1, 1, 1]


def test_fallback_reasons_differing_in_a_dtype_are_two_reasons(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Row counts are left out of a reason's key, the digits of a dtype name are not."""
    cfg = DCPConfig(comm_backend="a2a", use_direct_a2a=True, max_num_tokens=2)
    m = _managers(cfg, device, num_heads=1, head_dim=8)[1][1]
    monkeypatch.setattr(manager_mod, "dcp_a2a_lse_reduce", lambda out, lse, g, **kw: out[:, :1])
    with caplog.at_level(logging.INFO, logger="cpattn_dcp.manager"):
        for dtype in (torch.float16, torch.float32):
            m.combine(
                torch.zeros(1, 2, 8, dtype=dtype, device=device), torch.zeros(1, 2, device=device)
            )
    infos = [r.getMessage() for r in caplog.records if "cannot take a call" in r.getMessage()]
    assert len(infos) == 2, infos
    assert "float16" in infos[0]
    assert "float32" in infos[1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_logs_for_itself() -> None:
    """The set of logged messages is the parent's until the fork; a child starts empty, with a
    lock of its own (a fork while another thread held the parent's would leave it locked)."""
    manager_mod._first_time("parent line")
    code = fork_while_held(
        [manager_mod._logged_lock],
        lambda: (
            manager_mod._logged_lock.acquire(timeout=5) and "parent line" not in manager_mod._logged
        ),
    )
    assert code == 0
    assert "parent line" in manager_mod._logged  # the parent's set is untouched


# --- 6. PCP, one rank, and the direct paths' checks ------------------------------------------


def test_pcp_combine_takes_any_head_count(device: torch.device) -> None:
    """With PCP every rank keeps every head (all-reduce), so H need not be N*H_r nor divisible
    by N: DCP = PCP = 3 with 8 heads."""
    from cpattn_dcp import cp_lse_ag_out_ar

    world, ms = _managers(DCPConfig(use_pcp=True), device, world_size=3, num_heads=3)
    assert ms[0].combine_path == "ag_ar"
    gen = torch.Generator().manual_seed(3)
    outs = [torch.randn(2, 8, _D, generator=gen).to(_BF16).to(device) for _ in range(3)]
    lses = [torch.randn(2, 8, generator=gen).to(device) for _ in range(3)]
    got = world.run(
        lambda g: ms[g.rank_in_group].combine(outs[g.rank_in_group], lses[g.rank_in_group])
    )
    ref = world.run(
        lambda g: cp_lse_ag_out_ar(outs[g.rank_in_group].clone(), lses[g.rank_in_group], g)
    )
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=re.escape("expected [T, H] = [2, 8]")):
        ms[0].combine(outs[0], lses[0][:, :7])
    with pytest.raises(ValueError, match=re.escape(f"expected [T, H, D] = [T, H, {_D}]")):
        ms[0].combine(outs[0][..., :8], lses[0])


def test_forced_kv_gather_on_one_rank_is_no_error(device: torch.device) -> None:
    """One rank exchanges nothing, so no switch applies (DCPConfig's docstring)."""
    _, (m,) = _managers(DCPConfig(use_direct_kv_gather=True), device, world_size=1)
    assert m.kv_gather_path == "all_gather_into_tensor"


@pytest.mark.no_checks  # one thread drives both ranks: check mode's all-gather would wait
def test_direct_gathers_check_each_call_once(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, patch_direct_gathers: Callable[[], None]
) -> None:
    """The manager's path choice runs the workspace's check; the gather does not run it again."""
    from cpattn_dcp.direct import DirectDCPKVGatherWorkspace, DirectDCPQGatherWorkspace

    patch_direct_gathers()
    _, ms = _managers(DCPConfig(max_num_tokens=4), device, kv_token_dim=8, max_gathered_kv_tokens=8)
    counts = {"q": 0, "kv": 0}
    for kind, cls in (("q", DirectDCPQGatherWorkspace), ("kv", DirectDCPKVGatherWorkspace)):
        original = cls.unsupported_reason

        def counting(
            self: Any, *args: Any, _kind: str = kind, _f: Any = original, **kw: Any
        ) -> Any:
            counts[_kind] += 1
            return _f(self, *args, **kw)

        monkeypatch.setattr(cls, "unsupported_reason", counting)
    ws0_q, ws0_kv = ms[0].direct_q_gather, ms[0].direct_kv_gather
    assert ws0_q is not None
    assert ws0_kv is not None
    full = torch.randn(2, _N * _H_R, _D).to(_BF16).to(device)
    ws0_q.publish(full[:, :_H_R].contiguous(), validate=False)
    assert torch.equal(ms[1].query_gather(full[:, _H_R:].contiguous()), full)
    local = [torch.randn(2, 8).to(_BF16).to(device) for _ in range(_N)]
    ws0_kv.publish(local[0], validate=False)
    assert torch.equal(
        ms[1].kv_gather(torch.zeros(4, 8, dtype=_BF16, device=device), local[1]), torch.cat(local)
    )
    assert counts == {"q": 1, "kv": 1}


@pytest.mark.no_checks  # one thread drives both ranks: check mode's all-gather would wait
def test_an_empty_kv_gather_stays_on_the_direct_path(
    device: torch.device, patch_direct_gathers: Callable[[], None]
) -> None:
    """T = 0 into a contiguous buffer takes the checks of the slow path, then the direct
    gather (every rank takes part in it), never a fallback."""
    patch_direct_gathers()
    _, ms = _managers(DCPConfig(max_num_tokens=4), device, kv_token_dim=8, max_gathered_kv_tokens=8)
    empty = torch.zeros(0, 8, dtype=_BF16, device=device)
    ws0 = ms[0].direct_kv_gather
    assert ws0 is not None
    ws0.publish(empty, validate=False)
    buf = torch.zeros(4, 8, dtype=_BF16, device=device)
    out = ms[1].kv_gather(buf, empty)
    assert out.shape == (0, 8)
    assert ms[1].last_kv_gather_path == "direct"
    assert ms[1].num_fallbacks == 0


@pytest.mark.no_checks  # one thread drives both ranks: check mode's all-gather would wait
@pytest.mark.parametrize("bad", ["local_kv", "gathered_kv", "both"])
def test_kv_gather_mends_only_the_rank_local_layout_that_is_off(
    device: torch.device,
    bad: str,
    monkeypatch: pytest.MonkeyPatch,
    patch_direct_gathers: Callable[[], None],
) -> None:
    """A misaligned ``local_kv`` is packed and gathered straight into the caller's buffer; only
    a misaligned buffer is staged and copied back."""
    from cpattn_dcp.direct import DirectDCPKVGatherWorkspace

    patch_direct_gathers()
    _, ms = _managers(DCPConfig(max_num_tokens=4), device, kv_token_dim=8, max_gathered_kv_tokens=8)
    targets: list[int] = []
    original = DirectDCPKVGatherWorkspace.gather

    def spy(self: Any, gathered_kv: torch.Tensor, local_kv: torch.Tensor, **kw: Any) -> None:
        targets.append(gathered_kv.data_ptr())
        original(self, gathered_kv, local_kv, **kw)

    monkeypatch.setattr(DirectDCPKVGatherWorkspace, "gather", spy)

    def misaligned(t: torch.Tensor) -> torch.Tensor:
        store = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        return store[1:].view(t.shape).copy_(t)

    local = [torch.randn(2, 8).to(_BF16).to(device) for _ in range(_N)]
    buf = torch.zeros(4, 8, dtype=_BF16, device=device)
    if bad in ("gathered_kv", "both"):
        buf = misaligned(buf)
    mine = misaligned(local[1]) if bad in ("local_kv", "both") else local[1]
    ws0 = ms[0].direct_kv_gather
    assert ws0 is not None
    ws0.publish(local[0], validate=False)
    out = ms[1].kv_gather(buf, mine)
    assert torch.equal(out, torch.cat(local))
    assert out.data_ptr() == buf.data_ptr()
    assert ms[1].last_kv_gather_path == "direct"
    assert ms[1].num_fallbacks == 0
    assert (targets == [buf.data_ptr()]) == (bad == "local_kv")
