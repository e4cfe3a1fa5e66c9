"""Gated, memoized factories of the direct DCP workspaces.

Each ``get_direct_dcp_*_workspace`` returns ``None`` when capability gating says no (callers
fall back to NCCL); ``*_unavailable_reason`` says why. Gating and construction are collective
(same arguments, same order on every rank). Workspaces are memoized per (group, device,
geometry, dtype, ubatches) and shared by every layer; a closed one is rebuilt.
``use_direct``: ``None`` (auto: probing decides), ``True`` (force: an unsupported configuration
raises) or ``False`` (off). The Q / KV gathers also need NVLS multicast: where the environment
disables it they return ``None`` before any multicast query, even when forced.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import torch

from cpattn_common import capability
from cpattn_common.checks import check_device, check_dtype, check_positive_int
from cpattn_common.group import cache_owner, shared_cp_group
from cpattn_dcp.direct._base import (
    DirectWorkspaceBase,
    indexed_device,
    triton_unsupported_reason,
)
from cpattn_dcp.direct.a2a import DIRECT_A2A_DTYPES, DirectDCPA2AWorkspace
from cpattn_dcp.direct.kv_gather import DIRECT_KV_GATHER_DTYPES, DirectDCPKVGatherWorkspace
from cpattn_dcp.direct.q_gather import DirectDCPQGatherWorkspace

__all__ = [
    "clear_direct_workspace_cache",
    "direct_a2a_unavailable_reason",
    "direct_gather_unavailable_reason",
    "get_direct_dcp_a2a_workspace",
    "get_direct_dcp_kv_gather_workspace",
    "get_direct_dcp_q_gather_workspace",
]

_lock = threading.Lock()
# key -> (the keyed group, kept alive so that its id() cannot be reused, workspace). Unlike
# the group memo, this holds its groups: a workspace's symmetric memory lives with its group.
_cache: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def _capability_detail(
    group: Any,
    dtype: torch.dtype,
    use_direct: bool | None,
    supported: tuple[torch.dtype, ...] | None,
    *,
    multicast: bool = False,
) -> str:
    try:
        reason = capability.direct_cp_disabled_reason(
            group, dtype, use_direct, supported, multicast=multicast
        )
    except Exception as exc:  # a diagnostics helper must never break the fallback
        return f"capability gating said no ({type(exc).__name__} while asking why)"
    return str(reason) if reason else "capability gating said no"


def _check_args(
    dtype: object, use_direct: object, device: object, **sizes: object
) -> torch.device | None:
    """The argument checks of the reason functions (``device`` may be ``None``) and, with
    ``sizes``, of the factories; return the device."""
    check_dtype("dtype", dtype)
    if use_direct is not None and not isinstance(use_direct, bool):
        raise TypeError(f"use_direct must be True, False or None (auto), got {use_direct!r}")
    for name, value in sizes.items():
        if value is not None or name != "padded_num_heads":
            check_positive_int(name, value)
    if device is None and not sizes:
        return None
    # A forced path must run: a CUDA device this process lacks is an error, not "unavailable".
    return check_device("device", device, available=bool(sizes) and use_direct is True)


def _automatic_reason(
    group: Any, device: torch.device | None, use_direct: bool | None
) -> str | None:
    """What rules out an automatic direct path before any probe: one rank, no CUDA device, or
    Triton older than ``MIN_TRITON_VERSION``."""
    if use_direct is not None:
        return None
    world_size = shared_cp_group(group).world_size
    if world_size < 2:
        return f"needs at least two ranks (world size {world_size})"
    if device is not None and device.type != "cuda":
        return f"device {device} is not a CUDA device"
    reason = triton_unsupported_reason()  # the constructor raises it when a path is forced
    if reason is None and device is not None and not torch.cuda.is_available():
        return f"device {device}: CUDA is not available in this process"
    return reason


def direct_a2a_unavailable_reason(
    group: Any,
    dtype: torch.dtype,
    use_direct: bool | None = None,
    *,
    device: torch.device | str | None = None,
) -> str | None:
    """Why the direct A2A is off for ``group``/``dtype`` (``None``: gating allows it); with
    ``device`` given, automatic use also needs a CUDA device. Collective when it probes
    symmetric memory. Invalid arguments raise (see the module docstring)."""
    dev = _check_args(dtype, use_direct, device)
    if use_direct is False:
        return "disabled by configuration (use_direct_a2a=False)"
    reason = _automatic_reason(group, dev, use_direct)
    if reason is not None:
        return reason
    if capability.direct_cp_enabled(group, dtype, use_direct, DIRECT_A2A_DTYPES):
        return None
    return _capability_detail(group, dtype, use_direct, DIRECT_A2A_DTYPES)


def direct_gather_unavailable_reason(
    group: Any,
    dtype: torch.dtype,
    use_direct: bool | None = None,
    supported_dtypes: tuple[torch.dtype, ...] | None = None,
    *,
    what: str = "direct gather",
    device: torch.device | str | None = None,
) -> str | None:
    """Why a multicast-based direct gather is off (``None``: gating allows it). The local
    reasons of automatic use come first, then the environment (no multicast query where it
    disables multicast). Invalid arguments raise (see the module docstring)."""
    dev = _check_args(dtype, use_direct, device)
    if use_direct is False:
        return f"{what} disabled by configuration"
    reason = _automatic_reason(group, dev, use_direct)
    if reason is not None:
        return reason
    if capability.multicast_disabled_by_env():
        return "NVLS multicast is disabled by the environment"
    if capability.direct_cp_multicast_enabled(group, dtype, use_direct, supported_dtypes):
        return None
    return _capability_detail(group, dtype, use_direct, supported_dtypes, multicast=True)


_W = TypeVar("_W", bound=DirectWorkspaceBase)


def _memo(
    kind: str, group: Any, device: torch.device | str, geometry: tuple[Any, ...], cls: type[_W]
) -> _W:
    """The cached workspace of ``(kind, group, device, geometry)``, or a new (then cached)
    ``cls(group, device, *geometry)``. A closed one is rebuilt: closing is collective, so every
    rank rebuilds together."""
    owner = cache_owner(shared_cp_group(group))  # wrappers of one group share a workspace
    key = (kind, id(owner), str(indexed_device(device)), *geometry)
    with _lock:
        hit = _cache.get(key)
        if hit is not None and hit[1].closed:
            del _cache[key]  # also drops its hold on the group
            hit = None
    if hit is not None:
        ws: _W = hit[1]
        return ws
    ws = cls(group, device, *geometry)
    with _lock:
        _cache[key] = (owner, ws)
    return ws


def get_direct_dcp_a2a_workspace(
    group: Any,
    device: torch.device | str,
    max_num_tokens: int,
    heads_per_rank: int,
    head_dim: int,
    dtype: torch.dtype,
    num_ubatches: int = 1,
    use_direct: bool | None = None,
) -> DirectDCPA2AWorkspace | None:
    """The shared ``DirectDCPA2AWorkspace`` of this geometry, or ``None`` when gated off
    (automatically also for a non-CUDA ``device``; a bare ``"cuda"`` is the current device).

    ``use_direct=True`` skips probing; an unsupported dtype then raises ``ValueError``.
    Invalid arguments raise (see the module docstring).
    """
    _check_args(dtype, use_direct, device, max_num_tokens=max_num_tokens,
                heads_per_rank=heads_per_rank, head_dim=head_dim, num_ubatches=num_ubatches)  # fmt: skip
    if direct_a2a_unavailable_reason(group, dtype, use_direct, device=device) is not None:
        return None
    geometry = (max_num_tokens, heads_per_rank, head_dim, dtype, num_ubatches)
    return _memo("a2a", group, device, geometry, DirectDCPA2AWorkspace)


def get_direct_dcp_q_gather_workspace(
    group: Any,
    device: torch.device | str,
    max_num_tokens: int,
    heads_per_rank: int,
    head_dim: int,
    dtype: torch.dtype,
    num_ubatches: int = 1,
    padded_num_heads: int | None = None,
    use_direct: bool | None = None,
) -> DirectDCPQGatherWorkspace | None:
    """The shared ``DirectDCPQGatherWorkspace``, or ``None`` unless multicast gating says yes
    (invalid arguments raise: see the module docstring)."""
    _check_args(dtype, use_direct, device, max_num_tokens=max_num_tokens,
                heads_per_rank=heads_per_rank, head_dim=head_dim, num_ubatches=num_ubatches,
                padded_num_heads=padded_num_heads)  # fmt: skip
    if (
        direct_gather_unavailable_reason(
            group, dtype, use_direct, what="direct q-gather", device=device
        )
        is not None
    ):
        return None
    geometry = (max_num_tokens, heads_per_rank, head_dim, dtype, num_ubatches, padded_num_heads)
    return _memo("q", group, device, geometry, DirectDCPQGatherWorkspace)


def get_direct_dcp_kv_gather_workspace(
    group: Any,
    device: torch.device | str,
    max_gathered_tokens: int,
    token_dim: int,
    dtype: torch.dtype,
    num_ubatches: int = 1,
    use_direct: bool | None = None,
) -> DirectDCPKVGatherWorkspace | None:
    """The shared ``DirectDCPKVGatherWorkspace``, or ``None`` unless multicast gating says yes
    (invalid arguments raise: see the module docstring)."""
    _check_args(dtype, use_direct, device, max_gathered_tokens=max_gathered_tokens,
                token_dim=token_dim, num_ubatches=num_ubatches)  # fmt: skip
    reason = direct_gather_unavailable_reason(
        group, dtype, use_direct, DIRECT_KV_GATHER_DTYPES, what="direct kv-gather", device=device
    )
    if reason is not None:
        return None
    geometry = (max_gathered_tokens, token_dim, dtype, num_ubatches)
    return _memo("kv", group, device, geometry, DirectDCPKVGatherWorkspace)


def clear_direct_workspace_cache(*, close: bool = False) -> None:
    """Forget the memoized workspaces (``close=True`` also closes them). Collective either
    way: call it on every rank of the groups at the same point of their call sequences, or on
    none (else the ranks' next constructions no longer match)."""
    with _lock:
        items = list(_cache.values())
        _cache.clear()
    if close:
        for _, ws in items:
            ws.close()
