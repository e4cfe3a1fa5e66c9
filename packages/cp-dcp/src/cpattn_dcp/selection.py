"""Which implementation serves each DCP collective of a layer: ``DCPConfig`` and the pure rules
``select_combine``, ``select_query_gather`` and ``select_kv_gather`` (a path and its reason),
which ``DCPManager`` applies once per layer (docs/packages/dcp.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from cpattn_common.checks import check_bool, check_positive_int

__all__ = [
    "CombineBackend",
    "CombinePath",
    "DCPConfig",
    "DCPSelection",
    "DirectProbe",
    "KVGatherPath",
    "QueryGatherPath",
    "select_combine",
    "select_kv_gather",
    "select_query_gather",
]

CombineBackend = Literal["ag_rs", "a2a", "auto"]
CombinePath = Literal["direct_a2a", "a2a", "ag_rs", "ag_ar"]
QueryGatherPath = Literal["direct", "all_gather", "none"]
KVGatherPath = Literal["direct", "all_gather_into_tensor"]
#: Called only where a rule asks for the direct path: ``None`` when the direct path is
#: available (``DCPManager`` has built it), else why not.
DirectProbe = Callable[[], "str | None"]

_BACKENDS = ("ag_rs", "a2a", "auto")


def _check_tristate(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None (auto), got {value!r}")


@dataclasses.dataclass(frozen=True)
class DCPConfig:
    """Plain configuration of the DCP collectives of a model (shared by all its layers).

    Attributes:
        comm_backend: combine family: ``"ag_rs"`` (all-gather LSE + reduce-scatter, the
            default), ``"a2a"`` (one packed all-to-all, or the direct symmetric-memory A2A), or
            ``"auto"`` (``"a2a"`` unless PCP is on).
        use_pcp: prefill context parallelism is on; the manager then does no query gather, and
            the combine all-reduces (every rank keeps all heads), except for ``"a2a"`` when
            ``pcp_world_size`` says that the DCP group is the PCP group.
        pcp_world_size: the PCP group's size ``N_pcp`` (only with ``use_pcp``; default
            unknown). When it equals the DCP group's size, the DCP group is the PCP group and
            ``comm_backend="a2a"`` keeps the A2A (as ``cpattn_pcp.resolve_dcp_combine``;
            ``finalize_mla_pcp_decode`` gathers the heads back); otherwise the combine
            all-reduces. The DCP size must be a multiple of it.
        max_num_tokens: row capacity T_max of the direct A2A and direct Q-gather workspaces
            (decode batch incl. speculative tokens and CUDA-graph padding).
        num_ubatches: micro-batch slots (dual-batch overlap: 2).
        use_direct_a2a: switch of the direct A2A combine (only a combine of the ``"a2a"``
            family, so not with ``comm_backend="ag_rs"``, nor with PCP unless
            ``pcp_world_size`` is given).
        use_direct_q_gather: switch of the direct (multicast) query gather (not with PCP).
        use_direct_kv_gather: switch of the direct (multicast) KV gather (needs the manager's
            ``kv_token_dim`` and ``max_gathered_kv_tokens``).

    Each ``use_direct_*`` switch is ``None`` (auto: capability probing decides, never on a
    non-CUDA device), ``True`` (force: a configuration the direct path cannot serve raises) or
    ``False`` (off). Where the environment disables NVLS multicast the direct gathers stay off
    even when forced; a single-rank group exchanges nothing, so no switch applies there.

    Raises:
        ValueError: an unknown ``comm_backend``, a count < 1, ``pcp_world_size`` without
            ``use_pcp`` or equal to 1, or a forced path the configuration never uses
            (``use_direct_a2a=True`` with ``"ag_rs"``, or with PCP unless ``"a2a"`` and
            ``pcp_world_size``; ``use_direct_q_gather=True`` with PCP).
        TypeError: a count that is not an int, a switch that is not a bool (or ``None``).
    """

    comm_backend: CombineBackend = "ag_rs"
    use_pcp: bool = False
    pcp_world_size: int | None = None
    max_num_tokens: int = 256
    num_ubatches: int = 1
    use_direct_a2a: bool | None = None
    use_direct_q_gather: bool | None = None
    use_direct_kv_gather: bool | None = None

    def __post_init__(self) -> None:
        if self.comm_backend not in _BACKENDS:
            raise ValueError(f"comm_backend must be one of {_BACKENDS}, got {self.comm_backend!r}")
        check_bool("use_pcp", self.use_pcp)
        for name in ("max_num_tokens", "num_ubatches"):
            check_positive_int(name, getattr(self, name))
        if self.pcp_world_size is not None:
            check_positive_int("pcp_world_size", self.pcp_world_size)
            if not self.use_pcp:
                raise ValueError(
                    f"pcp_world_size={self.pcp_world_size} is given but use_pcp is False; set "
                    "use_pcp=True, or leave pcp_world_size None"
                )
            if self.pcp_world_size == 1:
                # cpattn_pcp's layouts read N_pcp = 1 as no PCP; the manager would all-reduce.
                raise ValueError(
                    "use_pcp=True with pcp_world_size=1: a PCP group of one is no PCP; set "
                    "use_pcp=False (and leave pcp_world_size None)"
                )
        _check_tristate("use_direct_a2a", self.use_direct_a2a)
        _check_tristate("use_direct_q_gather", self.use_direct_q_gather)
        _check_tristate("use_direct_kv_gather", self.use_direct_kv_gather)
        # "Force" promises that the path is used or the construction raises.
        if (
            self.use_direct_a2a is True
            and self.use_pcp
            and (self.pcp_world_size is None or self.comm_backend != "a2a")
        ):
            raise ValueError(
                "use_direct_a2a=True cannot apply with use_pcp=True unless comm_backend='a2a' "
                "and pcp_world_size is given (it must equal the DCP size): otherwise the "
                "combine all-reduces (every rank keeps all heads), it is no A2A; leave "
                "use_direct_a2a None or False"
            )
        if self.use_direct_a2a is True and self.comm_backend == "ag_rs":
            raise ValueError(
                "use_direct_a2a=True cannot apply with comm_backend='ag_rs' (the default): the "
                "direct A2A replaces the 'a2a' combine; set comm_backend='a2a' or 'auto'"
            )
        if self.use_direct_q_gather is True and self.use_pcp:
            raise ValueError(
                "use_direct_q_gather=True cannot apply with use_pcp=True: the manager then does "
                "no query gather (cpattn_pcp gathers the query over its own groups); leave "
                "use_direct_q_gather None or False"
            )


@dataclasses.dataclass(frozen=True)
class DCPSelection:
    """Which implementation the manager chose for each collective, and why."""

    combine: CombinePath
    combine_reason: str
    query_gather: QueryGatherPath
    query_gather_reason: str
    kv_gather: KVGatherPath
    kv_gather_reason: str

    def describe(self) -> str:
        """One line: ``combine=... (why); query_gather=... (why); kv_gather=... (why)``."""
        return (
            f"combine={self.combine} ({self.combine_reason}); "
            f"query_gather={self.query_gather} ({self.query_gather_reason}); "
            f"kv_gather={self.kv_gather} ({self.kv_gather_reason})"
        )


def select_combine(
    config: DCPConfig, world_size: int, direct_a2a: DirectProbe
) -> tuple[CombinePath, str]:
    """The combine of a DCP group of ``world_size`` ranks, and why.

    Raises:
        ValueError: ``pcp_world_size`` does not divide ``world_size``; ``use_direct_a2a=True``
            where PCP makes the combine an all-reduce.
    """
    cfg = config
    if cfg.use_pcp:
        pcp = cfg.pcp_world_size
        if world_size < 2:  # a DCP group of one fits every PCP layout
            return "ag_ar", "PCP is on; world size 1 (no communication)"
        if pcp is not None and world_size % pcp:
            raise ValueError(
                f"pcp_world_size={pcp} does not divide the DCP group's size {world_size}: "
                "with PCP the DCP group is the PCP group or spans TP x PCP"
            )
        if cfg.comm_backend != "a2a" or pcp != world_size:
            if cfg.comm_backend != "a2a":
                extra = ""
            elif pcp is None:
                extra = (
                    "; overrides comm_backend='a2a' (pass pcp_world_size: the A2A applies "
                    "when the DCP group is the PCP group)"
                )
            else:
                extra = (
                    f"; overrides comm_backend='a2a' (the DCP group spans TP x PCP: "
                    f"{world_size} ranks, PCP {pcp})"
                )
            if cfg.use_direct_a2a is True:
                raise ValueError(
                    "use_direct_a2a=True cannot apply: with PCP the combine all-reduces" + extra
                )
            return (
                "ag_ar",
                "PCP is on: every rank keeps all heads, so the outputs are all-reduced" + extra,
            )
        why = "comm_backend='a2a' with PCP, the DCP group being the PCP group"
    elif cfg.comm_backend == "ag_rs":
        return "ag_rs", "comm_backend='ag_rs'"
    else:
        why = (
            "comm_backend='a2a'" if cfg.comm_backend == "a2a" else "comm_backend='auto' without PCP"
        )
    if world_size < 2:
        return "a2a", f"{why}; world size 1 (no communication)"
    reason = direct_a2a()
    if reason is None:
        return "direct_a2a", (
            f"{why}; direct symmetric-memory A2A for up to {cfg.max_num_tokens} rows, "
            "packed NCCL A2A beyond"
        )
    return "a2a", f"{why}; packed NCCL A2A (direct A2A off: {reason})"


def select_query_gather(
    config: DCPConfig, world_size: int, direct_q_gather: DirectProbe
) -> tuple[QueryGatherPath, str]:
    """The query gather of a DCP group of ``world_size`` ranks, and why."""
    if config.use_pcp:
        return "none", "PCP is on: the query is gathered over the PCP/DCP groups by cpattn_pcp"
    if world_size < 2:
        return "all_gather", "world size 1 (no communication)"
    reason = direct_q_gather()
    if reason is None:
        return "direct", f"direct multicast q-gather for up to {config.max_num_tokens} rows"
    return "all_gather", f"all-gather along heads (direct q-gather off: {reason})"


def select_kv_gather(
    world_size: int, max_gathered_kv_tokens: int, has_kv_token_dim: bool, direct: DirectProbe
) -> tuple[KVGatherPath, str]:
    """The KV gather of a DCP group of ``world_size`` ranks, and why: the direct one needs a
    capacity (``max_gathered_kv_tokens >= 1``) and a row width."""
    if world_size < 2:
        return "all_gather_into_tensor", "world size 1 (no communication)"
    if max_gathered_kv_tokens == 0 or not has_kv_token_dim:
        return "all_gather_into_tensor", "no direct KV-gather geometry configured"
    reason = direct()
    if reason is None:
        return "direct", f"direct multicast kv-gather for up to {max_gathered_kv_tokens} rows"
    return (
        "all_gather_into_tensor",
        f"NCCL all_gather_into_tensor (direct kv-gather off: {reason})",
    )
