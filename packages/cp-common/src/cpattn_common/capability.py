"""Gating of the direct (symmetric-memory) CP paths: ``direct_cp_enabled``,
``direct_cp_multicast_enabled`` and ``direct_cp_disabled_reason``. Probes are collective, cached
per group and agreed over it; multicast is never probed where the environment disables it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from cpattn_common.agreement import (
    AgreementError,
    agreed_symmetric_empty,
    agreement_flag,
    gather_rank_values,
)
from cpattn_common.checks import check_dtype
from cpattn_common.group import CPGroupLike, cache_owner, shared_cp_group
from cpattn_common.identity_memo import IdentityMemo

__all__ = [
    "MULTICAST_ENV_VARS",
    "clear_capability_cache",
    "direct_cp_disabled_reason",
    "direct_cp_enabled",
    "direct_cp_multicast_enabled",
    "group_probe",
    "multicast_disabled_by_env",
    "multicast_env_reason",
    "propagate_multicast_off",
    "symm_mem_available",
]

logger = logging.getLogger(__name__)

try:
    import torch.distributed._symmetric_memory as _symm_mem

    symm_mem_available: bool = True
except Exception:  # pragma: no cover - builds without distributed / symmetric memory
    _symm_mem = None  # type: ignore[assignment]
    symm_mem_available = False

# variable -> the value that disables multicast
MULTICAST_ENV_VARS: dict[str, str] = {
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Values that leave multicast on; any other non-empty value turns it off.
_NOT_DISABLED = {"0", "false", "no", "off", "n", "f"}
# strtoll saturates on overflow; past this many digits any base is out of int64 range.
_INT64_MAX, _MAX_DIGITS = (1 << 63) - 1, 24


def _c_integer(text: str) -> int:
    """The integer C's ``strtoll(text, NULL, 0)`` reads, as NCCL reads its integer variables:
    ``00``, ``0x0`` and ``disable`` all mean 0; saturated to the int64 range."""
    text = text.lstrip(" \t\n\r\f\v")
    sign = -1 if text[:1] == "-" else 1
    if text[:1] in ("+", "-"):
        text = text[1:]
    base, digits = 10, "0123456789"
    if text[:2].lower() == "0x" and text[2:3].lower() in set("0123456789abcdef"):
        base, digits, text = 16, "0123456789abcdef", text[2:]
    elif text[:1] == "0":
        base, digits = 8, "01234567"
    end = 0
    while end < len(text) and text[end].lower() in digits:
        end += 1
    significant = text[:end].lstrip("0")
    if not significant:
        return 0
    if len(significant) > _MAX_DIGITS:
        return _INT64_MAX if sign > 0 else -_INT64_MAX - 1
    return max(-_INT64_MAX - 1, min(_INT64_MAX, sign * int(significant, base)))


def _disables(name: str, value: str) -> bool:
    """Whether ``name=value`` disables multicast, read the way its owner reads it."""
    if name == "NVSHMEM_DISABLE_NVLS":
        # NVSHMEM: set (even empty) means true unless the value starts with 0, N, n, F or f.
        if value[:1] not in ("0", "N", "n", "F", "f"):
            return True
    elif value == "":
        return False  # NCCL and torch ignore an empty value
    if name == "NCCL_NVLS_ENABLE":  # NCCL's own integer parse
        return _c_integer(value) == 0
    return value.strip().lower() not in _NOT_DISABLED


def multicast_disabled_by_env() -> bool:
    """Whether the environment disables NVLink multicast (see ``MULTICAST_ENV_VARS``); read
    on each rank, so set the variables the same way on every rank of a group."""
    return multicast_env_reason() is not None


def multicast_env_reason() -> str | None:
    """The setting that disables multicast (e.g. ``"NCCL_NVLS_ENABLE=0"``), or ``None``.

    ``NCCL_NVLS_ENABLE`` disables it when NCCL reads the value as 0 (``0``, ``0x0``, but also
    ``false``: NCCL parses an integer prefix; an empty value is ignored).
    ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` disables it for any non-empty value other than ``0``,
    ``false``, ``no``, ``off``, ``n`` or ``f`` (any case, blanks ignored).
    ``NVSHMEM_DISABLE_NVLS`` disables it where NVSHMEM reads it as true (set, even empty,
    unless it starts with ``0``, ``N``, ``n``, ``F`` or ``f``) and for anything that is no
    clear ``0`` / ``false`` / ``no`` / ``n`` / ``f``.
    """
    for name in MULTICAST_ENV_VARS:
        value = os.environ.get(name)
        if value is not None and _disables(name, value):
            return f"{name}={value}"
    return None


# What torch's CUDA and NVSHMEM symmetric-memory backends read to stay off multicast.
_SYMM_MEM_MULTICAST_OFF = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def propagate_multicast_off() -> None:
    """If any variable disables multicast, also set ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
    ``NVSHMEM_DISABLE_NVLS=1`` (each backend reads only its own). Called before every rendezvous.
    """
    if not multicast_disabled_by_env():
        return
    for name, value in _SYMM_MEM_MULTICAST_OFF.items():
        if os.environ.get(name) != value:
            logger.debug(
                "multicast disabled by %s: setting %s=%s", multicast_env_reason(), name, value
            )
            os.environ[name] = value


@dataclass(frozen=True)
class GroupProbe:
    """What the cached probe found about one group; ``reason``: why a flag is False."""

    same_node: bool
    symm_mem_reaches_group: bool
    multicast: bool
    reason: str | None
    rendezvous_failed: bool = False


# Probes by the process group under a wrapper (``cache_owner``): one per group.
_probes: IdentityMemo[GroupProbe] = IdentityMemo()


def clear_capability_cache() -> None:
    """Forget every cached group probe. Collective in effect: call it on every rank at the
    same point, or on none."""
    _probes.clear()


def _host_key() -> int:
    """A nonzero int64 hash of this host's name (0: unknown)."""
    try:
        digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=8).digest()
    except Exception as exc:  # answered as "not on one node" through the gather, not raised
        logger.debug("host name unavailable: %r", exc)
        return 0
    return int.from_bytes(digest, "little", signed=True) or 1


def _all_same_node(group: CPGroupLike, flag: torch.Tensor | None) -> bool:
    """Whether every rank of ``group`` runs on this host (collective, through ``flag``)."""
    if group.world_size == 1 or group.device_group is None or flag is None:
        return True  # one rank, or simulated ranks in one process
    keys = gather_rank_values(group, flag, _host_key())
    return 0 not in keys and len(set(keys)) == 1


def _device_has_multicast(device: torch.device) -> bool:
    assert _symm_mem is not None
    from torch._C._distributed_c10d import _SymmetricMemory

    index = device.index if device.index is not None else torch.cuda.current_device()
    return bool(_SymmetricMemory.has_multicast_support(torch._C._autograd.DeviceType.CUDA, index))


def _rendezvous_probe(
    group: CPGroupLike, device: torch.device, want_multicast: bool, flag: torch.Tensor
) -> tuple[bool, bool]:
    """Rendezvous an 8-byte symmetric buffer over ``group``: ``(reached, multicast)``."""
    assert _symm_mem is not None
    pg = group.device_group
    if pg is None:
        return False, False
    propagate_multicast_off()
    buf = agreed_symmetric_empty(
        _symm_mem, group, (8,), torch.uint8, device, "the probe's symmetric allocation", flag
    )
    handle: Any = _symm_mem.rendezvous(buf, pg.group_name)
    if handle is None:
        return False, False
    if not want_multicast:
        return True, False
    try:
        multicast = int(handle.multicast_ptr) != 0
    except Exception as exc:  # the rendezvous worked: only multicast is lost (agreed below)
        logger.debug("multicast address read failed: %r", exc)
        multicast = False
    return True, multicast


def _probe_flag(group: CPGroupLike) -> torch.Tensor | None:
    """The probe's agreement scratch; ``None`` without a process group (simulated ranks)."""
    if group.device_group is None:
        return None
    cuda = torch.cuda.is_available()
    return agreement_flag(
        group, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    )


def _probe_group(group: CPGroupLike, flag: torch.Tensor | None) -> GroupProbe:
    reason: str | None = None
    try:
        same_node = _all_same_node(group, flag)
    except AgreementError:
        raise  # the group's collectives failed: no answer can be agreed
    except Exception as exc:
        logger.debug("same-node probe failed: %r", exc)
        same_node, reason = False, f"same-node probe failed: {type(exc).__name__}: {exc}"
    if not symm_mem_available:
        return GroupProbe(
            same_node, False, False, "torch.distributed._symmetric_memory is not importable"
        )
    if not torch.cuda.is_available():
        return GroupProbe(same_node, False, False, "CUDA is not available")
    if group.device_group is None:
        # Only simulated ranks allocate symmetric buffers without a process group.
        can_allocate = getattr(group, "allocate_symmetric", None) is not None
        return GroupProbe(
            same_node,
            False,
            False,
            "the group has no process group to rendezvous on"
            + ("" if can_allocate else " and no allocate_symmetric"),
            rendezvous_failed=not can_allocate,
        )
    assert flag is not None
    device = torch.device("cuda", torch.cuda.current_device())
    env_off = multicast_env_reason()
    want_multicast = env_off is None
    if want_multicast:
        try:
            if not _device_has_multicast(device):
                want_multicast = False
                reason = "the device has no multicast support"
        except Exception as exc:  # the multicast query failed: no multicast, still rendezvous
            logger.debug("multicast support query failed: %r", exc)
            want_multicast = False
            reason = f"multicast support query failed: {type(exc).__name__}: {exc}"
    failed: str | None = None
    try:
        reached, multicast = _rendezvous_probe(group, device, want_multicast, flag)
    except AgreementError:
        raise
    except Exception as exc:
        logger.debug("symmetric-memory probe failed: %r", exc)
        reached, multicast = False, False
        failed = f"symmetric-memory probe failed: {type(exc).__name__}: {exc}"
    # Agree over ranks: 0 not reached, 1 reached, 2 reached with a multicast address.
    codes = gather_rank_values(group, flag, int(reached) + int(reached and multicast))
    unreached = [r for r, code in enumerate(codes) if code == 0]
    if unreached:
        reason = failed or (
            f"symmetric-memory rendezvous failed or returned no handle on rank(s) {unreached} "
            f"of {group.world_size}"
        )
        return GroupProbe(same_node, False, False, reason, rendezvous_failed=True)
    no_multicast = [r for r, code in enumerate(codes) if code == 1]
    if env_off is not None:
        reason = f"multicast disabled by {env_off}"
    elif not multicast and reason is None:
        reason = "the symmetric-memory handle has no multicast address"
    elif no_multicast and reason is None:
        reason = f"no multicast on rank(s) {no_multicast} of {group.world_size}"
    return GroupProbe(same_node, True, not no_multicast, reason)


def group_probe(group: Any) -> GroupProbe:
    """The cached probe of ``group`` (a ``ProcessGroup``, mesh or ``CPGroupLike``); collective.

    A failing probe step reports False with a reason, the same on every rank. Raises what
    allocating the probe's scratch (8 (N + 1) bytes) raises (the peers then wait until the
    group's timeout), and ``AgreementError`` when an all-gather failed on this rank.
    """
    try:
        cp_group = shared_cp_group(group)
        owner = cache_owner(cp_group)  # raises for a wrapper of a released process group
    except Exception as exc:
        return GroupProbe(False, False, False, f"not a group: {type(exc).__name__}: {exc}")
    hit = _probes.get(owner, None)
    if hit is not None:
        return hit
    flag = _probe_flag(cp_group)  # outside the try below: see Raises
    try:
        probe = _probe_group(cp_group, flag)
    except AgreementError:
        raise
    except Exception as exc:  # a probe step that escaped its own catch
        probe = GroupProbe(False, False, False, f"probe failed: {type(exc).__name__}: {exc}")
    return _probes.setdefault(owner, probe)


def _check_use_direct(use_direct: object) -> None:
    if use_direct is not None and use_direct is not True and use_direct is not False:
        raise TypeError(f"use_direct must be True, False or None, got {use_direct!r}")


def _dtypes(supported_dtypes: Any) -> tuple[torch.dtype, ...] | None:
    """``supported_dtypes`` read once into a tuple (``None``: any dtype)."""
    if supported_dtypes is None:
        return None
    try:
        supported = tuple(supported_dtypes)
    except TypeError:
        supported = ()
        supported_dtypes = [supported_dtypes]  # for the message
    if not supported or not all(isinstance(d, torch.dtype) for d in supported):
        raise TypeError(
            f"supported_dtypes must be a non-empty collection of torch.dtype or None, got "
            f"{supported_dtypes!r}"
        )
    return supported


def direct_cp_disabled_reason(
    group: Any,
    dtype: torch.dtype,
    use_direct: bool | None = None,
    supported_dtypes: Any = None,
    *,
    multicast: bool = False,
) -> str | None:
    """Why the direct path (``multicast=True``: the multicast path) is off for ``group`` and
    ``dtype``; ``None`` if on. ``use_direct`` ``True`` / ``False`` forces the unicast decision
    (``None`` decides); ``supported_dtypes`` ``None`` means any. ``TypeError`` for a
    ``use_direct`` other than ``True``, ``False`` or ``None``, a ``dtype`` that is not a
    ``torch.dtype`` or ``supported_dtypes`` that are not."""
    _check_use_direct(use_direct)
    check_dtype("dtype", dtype)
    supported = _dtypes(supported_dtypes)
    if multicast:
        env_off = multicast_env_reason()
        if env_off is not None:
            return f"multicast disabled by {env_off}"
    if use_direct is False:
        return "use_direct=False"
    if use_direct is None:
        if not symm_mem_available:
            return "torch.distributed._symmetric_memory is not importable"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if supported is not None and dtype not in supported:
            return f"dtype {dtype} not in the supported dtypes {supported}"
    if not multicast:
        if use_direct is True:
            return None
        probe = group_probe(group)
        # Simulated ranks (no process group) have nothing to rendezvous on.
        if probe.symm_mem_reaches_group or (probe.same_node and not probe.rendezvous_failed):
            return None
        return probe.reason or "the group spans nodes that symmetric memory does not reach"
    probe = group_probe(group)
    if probe.multicast:
        return None
    return probe.reason or "multicast is not available for this group"


def direct_cp_enabled(
    group: Any,
    dtype: torch.dtype,
    use_direct: bool | None,
    supported_dtypes: Any = None,
) -> bool:
    """May ``group`` use the direct symmetric-memory collectives for ``dtype``? An explicit
    ``use_direct`` is returned as is; ``None`` decides (symmetric memory, CUDA, a supported
    dtype, a working rendezvous: a cached collective probe). ``TypeError`` as above."""
    _check_use_direct(use_direct)
    if use_direct is not None:
        return bool(use_direct)
    return direct_cp_disabled_reason(group, dtype, None, supported_dtypes) is None


def direct_cp_multicast_enabled(
    group: Any,
    dtype: torch.dtype,
    use_direct: bool | None,
    supported_dtypes: Any = None,
) -> bool:
    """``direct_cp_enabled(...)`` and NVLink multicast available for the group: False without
    any multicast call where the environment disables it, and False (not an error) for a forced
    ``use_direct=True`` without multicast. ``TypeError`` as above."""
    _check_use_direct(use_direct)
    if multicast_disabled_by_env():
        return False
    supported = _dtypes(supported_dtypes)  # read once, used twice
    if not direct_cp_enabled(group, dtype, use_direct, supported):
        return False
    return direct_cp_disabled_reason(group, dtype, use_direct, supported, multicast=True) is None
