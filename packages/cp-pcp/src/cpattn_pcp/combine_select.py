"""Which DCP output combine a TP x PCP x DCP layout needs, by name (``"a2a"``, ``"ag_ar"`` or
``"ag_rs"``; this package never imports ``cpattn_dcp``). No all-to-all when the DCP group spans
TP x PCP (``N_dcp > N_pcp > 1``), unlike vLLM: docs/packages/pcp.md, "Heads across TP x PCP x
DCP".
"""

from __future__ import annotations

from typing import Literal

from cpattn_pcp._layout import gather_axis

__all__ = ["DCP_COMM_BACKENDS", "DCPCombineName", "resolve_dcp_combine"]

DCPCombineName = Literal["ag_rs", "ag_ar", "a2a"]
"""The name of a DCP output combine."""

DCP_COMM_BACKENDS: tuple[str, ...] = ("ag_rs", "a2a", "auto")
"""Accepted ``comm_backend`` values, those of ``cpattn_dcp.DCPConfig`` (``None`` means the
default, ``"ag_rs"``)."""


def resolve_dcp_combine(
    dcp_world_size: int,
    pcp_world_size: int,
    comm_backend: str | None = "ag_rs",
) -> DCPCombineName:
    """Name the DCP combine for a layout and the configured DCP communication backend.

    Rules, in order: ``comm_backend == "a2a"`` (needs ``N_dcp > 1``) -> ``"a2a"``, except
    when the DCP group spans TP x PCP (``N_dcp > N_pcp > 1``, module docstring: the split it
    leaves cannot be gathered back over PCP) -> ``"ag_ar"``; ``N_pcp > 1`` -> ``"ag_ar"``;
    ``"auto"`` without PCP -> ``"a2a"`` (``"ag_rs"`` for ``N_dcp == 1``: nothing to
    exchange), as ``cpattn_dcp.DCPManager`` reads ``DCPConfig(comm_backend="auto")``;
    otherwise ``"ag_rs"``.

    ``comm_backend``: ``"ag_rs"`` (default; also ``None``), ``"a2a"`` or ``"auto"``.

    Raises:
        ValueError: sizes below 1, a layout the package does not support (as
            ``dcp_q_gather_size``), an unknown backend, or ``"a2a"`` with ``N_dcp == 1``.
        TypeError: sizes that are not ints.

    Example:
        >>> resolve_dcp_combine(4, 2, "ag_rs")
        'ag_ar'
        >>> resolve_dcp_combine(2, 2, "a2a"), resolve_dcp_combine(4, 2, "a2a")
        ('a2a', 'ag_ar')
    """
    gather_axis(dcp_world_size, pcp_world_size)  # sizes and layout, as the other layout ops
    backend = "ag_rs" if comm_backend is None else comm_backend
    if backend not in DCP_COMM_BACKENDS:
        raise ValueError(
            f"unknown DCP comm_backend {comm_backend!r}; expected one of {DCP_COMM_BACKENDS}"
        )
    if backend == "a2a":
        if dcp_world_size == 1:
            raise ValueError("comm_backend 'a2a' requires dcp_world_size > 1, got 1")
        if not 1 < pcp_world_size < dcp_world_size:
            return "a2a"
    if pcp_world_size > 1:
        return "ag_ar"
    if backend == "auto" and dcp_world_size > 1:
        return "a2a"
    return "ag_rs"
