"""``DCPManager``: selects and owns the per-layer DCP collectives from a plain ``DCPConfig``.

The query gather, output combine and KV gather are picked at construction (collectively, by
``cpattn_dcp.selection``), logged once and exposed as ``selection``. A call of another geometry
raises ``ValueError`` on every path; what is the same on every rank (too many rows, another
dtype) falls back to NCCL (logged at INFO once per reason); a layout only this rank has is
packed and stays direct (``_packed``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from cpattn_common.capability import multicast_disabled_by_env
from cpattn_common.checks import (
    check_bool,
    check_dtype,
    check_nonnegative_int,
    check_positive_int,
)
from cpattn_common.dispatch import refuse_grad
from cpattn_common.group import as_cp_group
from cpattn_dcp.direct._base import DirectPathUnavailable, indexed_device
from cpattn_dcp.direct.a2a import DirectDCPA2AWorkspace
from cpattn_dcp.direct.factories import (
    direct_a2a_unavailable_reason,
    direct_gather_unavailable_reason,
    get_direct_dcp_a2a_workspace,
    get_direct_dcp_kv_gather_workspace,
    get_direct_dcp_q_gather_workspace,
)
from cpattn_dcp.direct.kv_gather import DIRECT_KV_GATHER_DTYPES, DirectDCPKVGatherWorkspace
from cpattn_dcp.direct.q_gather import DirectDCPQGatherWorkspace
from cpattn_dcp.gather import check_kv_buffers, dcp_gather_kv, dcp_gather_query
from cpattn_dcp.ops.a2a_combine import dcp_a2a_lse_reduce
from cpattn_dcp.ops.ag_combine import cp_lse_ag_out_ar, cp_lse_ag_out_rs
from cpattn_dcp.selection import (
    CombineBackend,
    CombinePath,
    DCPConfig,
    DCPSelection,
    KVGatherPath,
    QueryGatherPath,
    select_combine,
    select_kv_gather,
    select_query_gather,
)

__all__ = [
    "CombineBackend",
    "CombinePath",
    "DCPConfig",
    "DCPManager",
    "DCPSelection",
    "KVGatherPath",
    "QueryGatherPath",
]

logger = logging.getLogger(__name__)

# Keys of the messages this process has logged once (the selection line, fallback reasons):
# shared by every manager, so a 61-layer model logs a reason once, not once per layer.
_logged: set[str] = set()
_logged_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child logs each message once itself, with a lock no parent thread holds."""
    global _logged_lock
    _logged_lock = threading.Lock()
    _logged.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)

# Row counts and other numbers differ from call to call; a reason is "the same" without them.
_NUMBERS = re.compile(r"\b\d+\b")  # whole numbers only: "float16" and "float32" stay apart


def _first_time(key: str) -> bool:
    """Whether ``key`` is new to this process (and mark it seen)."""
    with _logged_lock:
        if key in _logged:
            return False
        _logged.add(key)
        return True


def _packed(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of ``t``: mends a layout only this rank has, which must not send
    it alone to NCCL while its peers wait in the direct path."""
    return t.clone(memory_format=torch.contiguous_format)


_W = TypeVar("_W")


def _try_direct(
    gate: Callable[[], str | None],
    build: Callable[[], _W | None],
    forced: bool | None,
    switch: str | None = None,
) -> tuple[_W | None, str | None]:
    """``(workspace, None)`` or ``(None, why not)`` from ``gate`` and ``build``; a forced path
    raises instead (a gather's ``switch`` unless the environment disables multicast)."""
    reason = gate()
    if reason is not None:
        if switch is not None and forced is True and not multicast_disabled_by_env():
            raise DirectPathUnavailable(f"{switch}=True, but the direct path cannot run: {reason}")
        return None, reason
    try:
        ws = build()
    except (ValueError, DirectPathUnavailable) as exc:
        if forced:
            raise
        return None, f"the workspace refused: {exc}"
    return ws, None if ws is not None else "capability gating said no"


def _check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """``ValueError`` for a call on another device than the direct workspace's: this rank's
    mistake, not a fallback (it alone would take NCCL while its peers wait in the direct path)."""
    for name, tensor in tensors.items():
        if tensor.device != device:
            raise ValueError(
                f"{name} is on {tensor.device}, but this manager's direct path is on {device}"
            )


class DCPManager:
    """Selects and owns the query gather, output combine and KV gather of one DCP layer.

    Construction is collective over ``group`` when a direct path is probed or built (same
    arguments, order and ``MULTICAST_ENV_VARS`` on every rank). A per-call error on one rank
    only leaves its peers waiting until a direct wait's bound or the group's timeout.

    Args:
        config / group: the ``DCPConfig`` and the DCP group (N ranks).
        device: device of the layer (a bare ``"cuda"``: the current CUDA device).
        num_heads: H_r, the attention heads each rank owns (the combine input has N*H_r).
        head_dim / dtype: D and dtype of the attention output (MLA: the latent dim, 512).
        query_head_dim / query_dtype: of the query (MLA: 576; e.g. fp8); default the output's.
        padded_num_heads: head capacity ``>= N*H_r`` of the gathered query's storage
            (fixed-head kernels); default: no padding.
        is_lse_base_on_e: LSE base of the attention backend (FlashInfer: base 2 → False).
        kv_token_dim / kv_dtype: row width (MLA: 576) and dtype of the KV gather; with a
            width, ``kv_gather`` takes ``[T, kv_token_dim]`` rows only.
        max_gathered_kv_tokens: capacity of the direct KV gather (0: none).

    Raises:
        TypeError: ``config`` not a ``DCPConfig``; a size that is not an int (bools and floats
            included); a dtype that is not a ``torch.dtype``; a non-bool ``is_lse_base_on_e``.
        ValueError: a size < 1 (``max_gathered_kv_tokens`` < 0); ``padded_num_heads < N*H_r``;
            ``use_direct_kv_gather=True`` without ``kv_token_dim`` and
            ``max_gathered_kv_tokens >= 1``; a forced direct path that refuses this setup.
        DirectPathUnavailable: a forced direct gather that cannot run here, unless the
            environment disables multicast (then the gather stays off).
    """

    def __init__(
        self,
        config: DCPConfig,
        group: Any,
        device: torch.device | str,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        query_head_dim: int | None = None,
        query_dtype: torch.dtype | None = None,
        padded_num_heads: int | None = None,
        is_lse_base_on_e: bool = True,
        kv_token_dim: int | None = None,
        kv_dtype: torch.dtype | None = None,
        max_gathered_kv_tokens: int = 0,
    ) -> None:
        if not isinstance(config, DCPConfig):
            raise TypeError(f"config must be a DCPConfig, got {type(config).__name__}")
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.query_head_dim = (
            self.head_dim
            if query_head_dim is None
            else check_positive_int("query_head_dim", query_head_dim)
        )
        self.kv_token_dim = (
            None if kv_token_dim is None else check_positive_int("kv_token_dim", kv_token_dim)
        )
        self.max_gathered_kv_tokens = check_nonnegative_int(
            "max_gathered_kv_tokens", max_gathered_kv_tokens
        )
        self.dtype = check_dtype("dtype", dtype)
        self.query_dtype = (
            self.dtype if query_dtype is None else check_dtype("query_dtype", query_dtype)
        )
        self.kv_dtype = self.dtype if kv_dtype is None else check_dtype("kv_dtype", kv_dtype)
        self.config = config
        self.group = group
        self.cp_group = as_cp_group(group)
        self.world_size, self.rank = self.cp_group.world_size, self.cp_group.rank_in_group
        # A single-rank group exchanges nothing: no switch applies there (DCPConfig docstring).
        if (
            config.use_direct_kv_gather is True
            and self.world_size > 1
            and (self.kv_token_dim is None or self.max_gathered_kv_tokens == 0)
        ):
            raise ValueError(
                "use_direct_kv_gather=True needs a direct KV-gather geometry: kv_token_dim "
                f"(got {self.kv_token_dim}) and max_gathered_kv_tokens >= 1 (got "
                f"{self.max_gathered_kv_tokens}); without them the NCCL gather is the only path"
            )
        self.device = indexed_device(device)
        #: N*H_r: the heads of the combine input and of the gathered query
        self.group_num_heads = self.world_size * self.num_heads
        # Row shapes of the per-call checks: combine input [T, N*H_r, D], query [T, H_r, D_q].
        self._combine_row_shape = (self.group_num_heads, self.head_dim)
        self._query_row_shape = (self.num_heads, self.query_head_dim)
        if padded_num_heads is not None:
            check_positive_int("padded_num_heads", padded_num_heads)
            if padded_num_heads < self.group_num_heads:
                raise ValueError(
                    f"padded_num_heads {padded_num_heads} < gathered heads N*H_r = "
                    f"{self.world_size}*{self.num_heads} = {self.group_num_heads}"
                )
        self.padded_num_heads = padded_num_heads
        self.is_lse_base_on_e = check_bool("is_lse_base_on_e", is_lse_base_on_e)

        self.direct_a2a: DirectDCPA2AWorkspace | None = None
        self.direct_q_gather: DirectDCPQGatherWorkspace | None = None
        self.direct_kv_gather: DirectDCPKVGatherWorkspace | None = None
        n = self.world_size
        combine, combine_reason = select_combine(config, n, self._direct_a2a)
        q_path, q_reason = select_query_gather(config, n, self._direct_q_gather)
        kv_path, kv_reason = select_kv_gather(
            n, self.max_gathered_kv_tokens, self.kv_token_dim is not None, self._direct_kv_gather
        )
        self.selection = DCPSelection(combine, combine_reason, q_path, q_reason, kv_path, kv_reason)
        #: path of the latest call of each collective that returned (fallbacks show here)
        self.last_combine_path: CombinePath | None = None
        self.last_query_gather_path: QueryGatherPath | None = None
        self.last_kv_gather_path: KVGatherPath | None = None
        #: number of calls of this manager that fell back from a direct path to the NCCL path
        self.num_fallbacks = 0
        line = (
            f"DCP collectives (N={n}, H_r={self.num_heads}, D={self.head_dim}, {self.dtype}, "
            f"backend={config.comm_backend}, pcp={config.use_pcp}): {self.selection.describe()}"
        )
        if _first_time(line):
            logger.info(line)

    # -- direct paths (collective: every rank in the same order) -----------------------------
    def _direct_a2a(self) -> str | None:
        """Build the direct A2A unless gating says no (``selection.DirectProbe``)."""
        cfg, g, dev, use = self.config, self.group, self.device, self.config.use_direct_a2a
        self.direct_a2a, why = _try_direct(
            lambda: direct_a2a_unavailable_reason(g, self.dtype, use, device=dev),
            lambda: get_direct_dcp_a2a_workspace(
                g, dev, cfg.max_num_tokens, self.num_heads, self.head_dim, self.dtype,
                cfg.num_ubatches, use,
            ),
            use,
        )  # fmt: skip
        return why

    def _direct_q_gather(self) -> str | None:  # see _direct_a2a
        cfg, g, dev, use = self.config, self.group, self.device, self.config.use_direct_q_gather
        self.direct_q_gather, why = _try_direct(
            lambda: direct_gather_unavailable_reason(
                g, self.query_dtype, use, what="direct q-gather", device=dev
            ),
            lambda: get_direct_dcp_q_gather_workspace(
                g, dev, cfg.max_num_tokens, self.num_heads, self.query_head_dim,
                self.query_dtype, cfg.num_ubatches, self.padded_num_heads, use,
            ),
            use,
            "use_direct_q_gather",
        )  # fmt: skip
        return why

    def _direct_kv_gather(self) -> str | None:  # see _direct_a2a; asked with a kv_token_dim
        cfg, g, dev, use = self.config, self.group, self.device, self.config.use_direct_kv_gather
        self.direct_kv_gather, why = _try_direct(
            lambda: direct_gather_unavailable_reason(
                g, self.kv_dtype, use, DIRECT_KV_GATHER_DTYPES, what="direct kv-gather", device=dev
            ),
            lambda: get_direct_dcp_kv_gather_workspace(
                g, dev, self.max_gathered_kv_tokens, self.kv_token_dim or 0, self.kv_dtype,
                cfg.num_ubatches, use,
            ),
            use,
            "use_direct_kv_gather",
        )  # fmt: skip
        return why

    @property
    def combine_path(self) -> CombinePath:
        """The combine chosen at construction."""
        return self.selection.combine

    @property
    def query_gather_path(self) -> QueryGatherPath:
        """The query gather chosen at construction (``"none"`` with PCP)."""
        return self.selection.query_gather

    @property
    def kv_gather_path(self) -> KVGatherPath:
        """The KV gather chosen at construction."""
        return self.selection.kv_gather

    def _fallback(self, what: str, reason: str) -> None:
        """Count a per-call fallback; log it at INFO the first time this process sees its
        reason, numbers aside."""
        self.num_fallbacks += 1
        if _first_time(f"fallback|{what}|{_NUMBERS.sub('#', reason)}"):
            logger.info(
                "DCP %s: the direct path cannot take a call (%s); using NCCL for it (logged "
                "once per process for this reason, later ones at DEBUG)",
                what,
                reason,
            )
        else:
            logger.debug("DCP %s: NCCL fallback (%s)", what, reason)

    # -- call checks: the caller's mistakes, on every path, before any fallback ---------------
    def _check_combine_inputs(
        self, partial_output: torch.Tensor, partial_lse: torch.Tensor
    ) -> None:
        # One shape read per tensor, compared as tuples: the cheapest check per call.
        if not (isinstance(partial_output, torch.Tensor) and isinstance(partial_lse, torch.Tensor)):
            raise TypeError(
                "partial_output and partial_lse must be tensors, got "
                f"{type(partial_output).__name__} and {type(partial_lse).__name__}"
            )
        out_shape = partial_output.shape
        if self.selection.combine == "ag_ar":
            # PCP: every rank keeps every head, H need not be N*H_r (nor divisible by N).
            if len(out_shape) != 3 or out_shape[2] != self.head_dim:
                raise ValueError(
                    f"partial_output has shape {tuple(out_shape)}, expected [T, H, D] = "
                    f"[T, H, {self.head_dim}]"
                )
        elif len(out_shape) != 3 or out_shape[1:] != self._combine_row_shape:
            heads, d = self._combine_row_shape
            raise ValueError(
                f"partial_output has shape {tuple(out_shape)}, expected [T, N*H_r, D]"
                f" = [T, {self.world_size}*{self.num_heads}, {d}] = [T, {heads}, {d}]"
            )
        if partial_lse.shape != out_shape[:2]:
            head_count = "H" if self.selection.combine == "ag_ar" else "N*H_r"
            raise ValueError(
                f"partial_lse has shape {tuple(partial_lse.shape)}, expected [T, {head_count}] = "
                f"[{out_shape[0]}, {out_shape[1]}]"
            )

    def _check_query(self, query: torch.Tensor) -> None:
        if not isinstance(query, torch.Tensor):
            raise TypeError(f"query must be a tensor, got {type(query).__name__}")
        shape = query.shape
        if len(shape) != 3 or shape[1:] != self._query_row_shape:
            h_r, d_q = self._query_row_shape
            raise ValueError(
                f"query has shape {tuple(shape)}, expected this rank's heads [T, H_r, D_q]"
                f" = [T, {h_r}, {d_q}]"
            )

    def _check_kv(self, gathered_kv: torch.Tensor, local_kv: torch.Tensor) -> None:
        if not isinstance(gathered_kv, torch.Tensor) or not isinstance(local_kv, torch.Tensor):
            raise TypeError(
                "gathered_kv and local_kv must be tensors, got "
                f"{type(gathered_kv).__name__} and {type(local_kv).__name__}"
            )
        width = self.kv_token_dim
        if width is not None and (local_kv.dim() != 2 or local_kv.shape[1] != width):
            raise ValueError(
                f"local_kv has shape {tuple(local_kv.shape)}, expected [T, kv_token_dim] = "
                f"[T, {width}]"
            )
        # The NCCL gather's own checks: a buffer it refuses is no fallback either.
        check_kv_buffers(gathered_kv, local_kv, self.world_size)

    def combine(
        self,
        partial_output: torch.Tensor,
        partial_lse: torch.Tensor,
        *,
        seq_lens: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Combine this rank's partial attention with the group's.

        Args:
            partial_output: ``[T, N*H_r, D]`` partial output of this rank's KV shard.
            partial_lse: ``[T, N*H_r]`` its LSE (base as configured).
            seq_lens: ``[R]`` this rank's local KV length per request (optional, with
                ``query_start_loc [R+1]``: empty-shard and padding rows contribute nothing).
            query_start_loc: see ``seq_lens``.
            return_lse: also return the combined LSE.

        Returns:
            ``[T, H_r, D]`` (``ag_ar``: ``[T, N*H_r, D]``), plus the LSE with ``return_lse``.

        Raises:
            TypeError: a non-tensor input (and what the combine ops raise).
            ValueError: ``partial_output`` not ``[T, N*H_r, D]`` (with PCP: ``[T, H, D]``, any
                H) or ``partial_lse`` not its ``[T, H]``, whichever path is selected; an input
                on another device than the direct path's (and what the combine ops raise).
            RuntimeError: grad mode is on and an input requires grad, on every path.
        """
        refuse_grad("DCPManager.combine", partial_output=partial_output, partial_lse=partial_lse)
        path = self.selection.combine
        base = self.is_lse_base_on_e
        if path == "direct_a2a":
            ws = self.direct_a2a
            assert ws is not None
            # What the workspace takes as it is needs no other check (the hot path); anything
            # else is checked as a caller mistake first, then mended or sent to NCCL.
            reason = (
                ws.unsupported_reason(partial_output, partial_lse)
                if isinstance(partial_output, torch.Tensor)
                and isinstance(partial_lse, torch.Tensor)
                else "not tensors"
            )
            if reason is not None:
                self._check_combine_inputs(partial_output, partial_lse)
                _check_device(ws.device, partial_output=partial_output, partial_lse=partial_lse)
                if ws.unsupported_reason(partial_output, partial_lse, layout=False) is None:
                    partial_output, reason = _packed(partial_output), None  # see _packed
                    if partial_lse.is_neg():  # a copy holds the values (see _packed)
                        partial_lse = _packed(partial_lse)
            if reason is None:
                direct = ws.lse_reduce(
                    partial_output, partial_lse, base, seq_lens, query_start_loc,
                    return_lse=return_lse,
                )  # fmt: skip
                self.last_combine_path = "direct_a2a"  # after lse_reduce's own checks passed
                return direct
            self._fallback("combine", reason)
            path = "a2a"
        else:
            self._check_combine_inputs(partial_output, partial_lse)
        if not torch.compiler.is_compiling():  # dynamo cannot trace is_neg()
            # The NCCL ops refuse torch's negative bit; a copy holds the values (as direct).
            if partial_output.is_neg():
                partial_output = partial_output.resolve_neg()
            if partial_lse.is_neg():
                partial_lse = partial_lse.resolve_neg()
        op = {"a2a": dcp_a2a_lse_reduce, "ag_rs": cp_lse_ag_out_rs, "ag_ar": cp_lse_ag_out_ar}[path]
        result: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = op(
            partial_output,
            partial_lse,
            self.group,
            return_lse=return_lse,
            is_lse_base_on_e=base,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
        )
        self.last_combine_path = path  # after the call: a call that raised took no path
        return result

    @property
    def has_query_gather(self) -> bool:
        """False when PCP is on (the query gather then belongs to cpattn_pcp)."""
        return self.selection.query_gather != "none"

    def query_gather(self, query: torch.Tensor) -> torch.Tensor:
        """All heads of the group's query: ``[T, H_r, D_q]`` -> ``[T, N*H_r, D_q]`` (rank-major).

        With the direct gather the result is a view of a persistent buffer that the peers
        write into, valid until this rank enters this layer's combine (a faster peer may then
        start its next gather): copy the result if it is needed after the combine.

        Raises:
            RuntimeError: PCP is on (``has_query_gather`` is False); grad mode is on and
                ``query`` requires grad.
            TypeError: ``query`` is not a tensor.
            ValueError: ``query`` is not ``[T, H_r, D_q]`` for this manager, whichever path is
                selected; ``query`` on another device than the direct path's.
        """
        path = self.selection.query_gather
        if path == "none":
            raise RuntimeError(
                "DCPManager.query_gather is disabled with use_pcp=True: gather the query with "
                "cpattn_pcp over the PCP/DCP groups"
            )
        if path == "direct":
            ws = self.direct_q_gather
            assert ws is not None
            reason = (  # as in combine: the hot path first
                ws.unsupported_reason(query) if isinstance(query, torch.Tensor) else "not a tensor"
            )
            if reason is not None:
                self._check_query(query)
                _check_device(ws.device, query=query)
                if ws.unsupported_reason(query, layout=False) is None:
                    query, reason = _packed(query), None  # see _packed
            if reason is None:
                gathered = ws.gather(query, checked=True)
                self.last_query_gather_path = "direct"
                return gathered
            self._fallback("query gather", reason)
        else:
            self._check_query(query)
        gathered = dcp_gather_query(query, self.group, self.padded_num_heads)
        self.last_query_gather_path = "all_gather"
        return gathered

    def kv_gather(self, gathered_kv: torch.Tensor, local_kv: torch.Tensor) -> torch.Tensor:
        """``gathered_kv[:N*T]`` = every rank's ``local_kv [T, D]`` rank-major; returns that view.

        Args:
            gathered_kv: caller buffer ``[G, D]``, ``G >= N*T``, contiguous, same dtype and
                device as ``local_kv``.
            local_kv: ``[T, D]`` this rank's rows (``D = kv_token_dim`` where one is given).

        Raises:
            TypeError: a non-tensor argument.
            ValueError: a buffer with fewer than N*T rows, row shapes that differ, a row width
                other than ``kv_token_dim``, a dtype / device mismatch or a non-contiguous
                buffer, whichever path is selected.
            RuntimeError: grad mode is on and either tensor requires grad.
        """
        if self.selection.kv_gather == "direct":
            ws = self.direct_kv_gather
            assert ws is not None
            if (  # as in combine: the hot path first
                isinstance(gathered_kv, torch.Tensor)
                and isinstance(local_kv, torch.Tensor)
                and local_kv.dim() >= 1
                and gathered_kv.dim() >= 1
            ):
                target = gathered_kv[: self.world_size * local_kv.shape[0]]
                # T = 0 takes the checks below: an empty slice is contiguous whatever the
                # buffer, which the NCCL path would refuse.
                if local_kv.shape[0] and ws.unsupported_reason(target, local_kv) is None:
                    ws.gather(target, local_kv, checked=True)
                    self.last_kv_gather_path = "direct"
                    return target
            self._check_kv(gathered_kv, local_kv)
            _check_device(ws.device, local_kv=local_kv)  # gathered_kv: same (_check_kv)
            target = gathered_kv[: self.world_size * local_kv.shape[0]]  # 2-D: kv_token_dim
            reason = ws.unsupported_reason(target, local_kv, layout=False)
            if reason is None:
                # At most this rank's layouts stand in the way (see _packed): mend what is off,
                # a packed copy of the rows and / or a fresh buffer copied into the caller's.
                local = local_kv if ws.layout_ok(local_kv) else _packed(local_kv)
                if ws.layout_ok(target):
                    ws.gather(target, local, checked=True)
                    self.last_kv_gather_path = "direct"
                    return target
                staged = torch.empty_like(target, memory_format=torch.contiguous_format)
                ws.gather(staged, local, checked=True)
                self.last_kv_gather_path = "direct"
                return target.copy_(staged)
            self._fallback("kv gather", reason)
        else:
            self._check_kv(gathered_kv, local_kv)
        written = dcp_gather_kv(gathered_kv, local_kv, self.group)
        self.last_kv_gather_path = "all_gather_into_tensor"
        return written
