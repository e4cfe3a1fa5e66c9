"""PCP x DCP combine selection by name."""

from __future__ import annotations

import pytest

from cpattn_pcp import DCP_COMM_BACKENDS, dcp_q_gather_size, resolve_dcp_combine


@pytest.mark.parametrize(
    ("dcp", "pcp", "backend", "expected"),
    [
        (1, 1, None, "ag_rs"),
        (1, 1, "ag_rs", "ag_rs"),
        (4, 1, "ag_rs", "ag_rs"),
        (4, 1, "a2a", "a2a"),
        (2, 2, "ag_rs", "ag_ar"),
        (4, 2, None, "ag_ar"),
        (1, 4, "ag_rs", "ag_ar"),
        (2, 2, "a2a", "a2a"),  # DCP group = PCP group: the PCP gather reassembles the split
        (4, 4, "a2a", "a2a"),
        (4, 2, "a2a", "ag_ar"),  # DCP spans TP x PCP: an all-to-all split cannot be gathered
        (8, 2, "a2a", "ag_ar"),
        # "auto" as DCPConfig reads it: the A2A unless PCP (nothing to exchange at N_dcp = 1)
        (4, 1, "auto", "a2a"),
        (1, 1, "auto", "ag_rs"),
        (2, 2, "auto", "ag_ar"),
        (4, 2, "auto", "ag_ar"),
    ],
)
def test_resolve(dcp: int, pcp: int, backend: str | None, expected: str) -> None:
    assert resolve_dcp_combine(dcp, pcp, backend) == expected


def test_default_backend() -> None:
    assert resolve_dcp_combine(4, 1) == "ag_rs"
    assert set(DCP_COMM_BACKENDS) == {"ag_rs", "a2a", "auto"}


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="'a2a' requires dcp_world_size > 1"):
        resolve_dcp_combine(1, 2, "a2a")
    with pytest.raises(ValueError, match="unknown DCP comm_backend 'nccl'"):
        resolve_dcp_combine(2, 1, "nccl")
    with pytest.raises(ValueError, match="dcp_world_size must be >= 1, got 0"):
        resolve_dcp_combine(0, 1)
    with pytest.raises(TypeError, match="pcp_world_size must be an int"):
        resolve_dcp_combine(2, 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("dcp", "pcp"), [(2, 4), (6, 4), (3, 2), (1, 1)])
@pytest.mark.parametrize("backend", ["a2a", "ag_rs"])
def test_layout_is_checked_as_by_the_head_ops(dcp: int, pcp: int, backend: str) -> None:
    # A layout the head gathers refuse must not get a combine name (one that cannot work:
    # an all-to-all leaves H/2 heads per rank that a 4-rank PCP gather turns into 2H).
    try:
        dcp_q_gather_size(dcp, pcp)
    except ValueError as exc:
        with pytest.raises(ValueError, match=str(exc).replace("(", r"\(").replace(")", r"\)")):
            resolve_dcp_combine(dcp, pcp, backend)
        return
    if backend == "a2a" and dcp == 1:
        return
    assert resolve_dcp_combine(dcp, pcp, backend) in ("ag_rs", "ag_ar", "a2a")
