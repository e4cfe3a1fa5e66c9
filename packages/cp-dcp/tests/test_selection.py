"""The selection rules of ``cpattn_dcp.selection`` as pure functions (no group, no device)."""

from __future__ import annotations

import pytest

from cpattn_dcp.selection import (
    DCPConfig,
    DirectProbe,
    select_combine,
    select_kv_gather,
    select_query_gather,
)


def _probe(answer: str | None) -> tuple[list[int], DirectProbe]:
    calls: list[int] = []

    def probe() -> str | None:
        calls.append(1)
        return answer

    return calls, probe


@pytest.mark.parametrize(
    ("config", "n", "direct", "want", "asked"),
    [
        (DCPConfig(), 4, None, "ag_rs", False),
        (DCPConfig(comm_backend="a2a"), 4, None, "direct_a2a", True),
        (DCPConfig(comm_backend="auto"), 4, "no multicast", "a2a", True),
        (DCPConfig(comm_backend="a2a"), 1, None, "a2a", False),
        (DCPConfig(comm_backend="a2a", use_pcp=True), 4, None, "ag_ar", False),
        (
            DCPConfig(comm_backend="a2a", use_pcp=True, pcp_world_size=4),
            4,
            None,
            "direct_a2a",
            True,
        ),
        (DCPConfig(comm_backend="a2a", use_pcp=True, pcp_world_size=2), 4, None, "ag_ar", False),
        (DCPConfig(comm_backend="auto", use_pcp=True), 1, None, "ag_ar", False),
    ],
)
def test_select_combine(
    config: DCPConfig, n: int, direct: str | None, want: str, asked: bool
) -> None:
    calls, probe = _probe(direct)
    path, reason = select_combine(config, n, probe)
    assert path == want
    assert bool(calls) == asked  # the direct path is probed only where a rule asks for it
    if direct is not None and asked:
        assert f"direct A2A off: {direct}" in reason


def test_select_combine_refuses_what_pcp_rules_out() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        select_combine(DCPConfig(use_pcp=True, pcp_world_size=3), 4, lambda: None)
    forced = DCPConfig(comm_backend="a2a", use_pcp=True, pcp_world_size=2, use_direct_a2a=True)
    with pytest.raises(ValueError, match="use_direct_a2a=True cannot apply"):
        select_combine(forced, 4, lambda: None)


def test_select_gathers() -> None:
    assert select_query_gather(DCPConfig(use_pcp=True), 4, lambda: None)[0] == "none"
    assert select_query_gather(DCPConfig(), 1, lambda: None)[0] == "all_gather"
    assert select_query_gather(DCPConfig(), 4, lambda: None)[0] == "direct"
    path, reason = select_query_gather(DCPConfig(), 4, lambda: "off")
    assert (path, reason.endswith("(direct q-gather off: off)")) == ("all_gather", True)
    assert select_kv_gather(4, 64, True, lambda: None) == (
        "direct",
        "direct multicast kv-gather for up to 64 rows",
    )
    for args in ((1, 64, True), (4, 0, True), (4, 64, False)):
        assert select_kv_gather(*args, lambda: None)[0] == "all_gather_into_tensor"
    assert "(direct kv-gather off: off)" in select_kv_gather(4, 64, True, lambda: "off")[1]
