"""``DirectCPWorkspace``: symmetric allocations, peer-pointer tables, per-ubatch epochs
(docs/direct-internals.md, "Symmetric allocations")."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from cpattn_common.agreement import (
    SymmetricAllocationError,
    agree_on_local_step,
    agreed_symmetric_empty,
    agreement_flag,
    check_ranks_agree,
)
from cpattn_common.capability import multicast_disabled_by_env, propagate_multicast_off
from cpattn_common.checks import check_dtype, check_state
from cpattn_common.device import indexed_device
from cpattn_common.group import CPGroupLike, as_cp_group

__all__ = ["DirectCPWorkspace", "SymmetricAllocationError"]


@dataclass
class _Allocation:
    storage: torch.Tensor
    peer_views: list[torch.Tensor]  # held: the peer table points into them
    handle: Any = None


class DirectCPWorkspace:
    """Symmetric buffers of one CP group, with per-ubatch slots and epoch counters.

    ``group``: a ``ProcessGroup``, ``DeviceMesh`` or ``CPGroupLike``; ``device``: CUDA for real
    symmetric memory; ``num_ubatches``: ``U >= 1`` slots. Attributes: ``group``, ``world_size``
    (N), ``rank``, ``device``, ``num_ubatches``, ``epoch`` (int64 ``[U]`` zeros) and
    ``agreement_flag`` (the int64 ``[1 + N]`` scratch of the agreements of ``allocate``).
    """

    def __init__(self, group: Any, device: torch.device | str, num_ubatches: int = 1):
        if isinstance(num_ubatches, bool) or not isinstance(num_ubatches, int):
            raise TypeError(f"num_ubatches must be an int, got {type(num_ubatches).__name__}")
        if num_ubatches < 1:
            raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
        self.group: CPGroupLike = as_cp_group(group)
        self.world_size = self.group.world_size
        self.rank = self.group.rank_in_group
        self.device = indexed_device(device)
        self.num_ubatches = num_ubatches
        self.epoch = torch.zeros(num_ubatches, dtype=torch.int64, device=self.device)
        self.agreement_flag = agreement_flag(self.group, self.device)
        self._allocations: list[_Allocation] = []
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def close(self) -> None:
        """Release every buffer (idempotent). The workspace cannot allocate afterwards."""
        self._allocations.clear()
        self._closed = True

    def __enter__(self) -> DirectCPWorkspace:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DirectCPWorkspace(world_size={self.world_size}, rank={self.rank}, "
            f"device={self.device}, num_ubatches={self.num_ubatches}, "
            f"allocations={len(self._allocations)}, closed={self._closed})"
        )

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate a zero-filled symmetric buffer of ``shape = [U, ...]`` and ``dtype``
        (collective): ``(storage`` on ``device``, ``peer_ptrs`` int64 ``[U, N]``: entry
        ``(u, p)`` is the address of peer p's copy at slot u)."""
        if self._closed:
            raise RuntimeError("DirectCPWorkspace is closed")
        if isinstance(shape, (str, bytes, bytearray)) or not isinstance(shape, Sequence):
            raise TypeError(f"shape must be a sequence of ints, got {shape!r}")
        try:  # a float or a string is an error, not a truncated size
            if any(isinstance(s, bool) for s in shape):
                raise TypeError
            shape = tuple(operator.index(s) for s in shape)
        except TypeError:
            raise TypeError(f"workspace shape {tuple(shape)!r} must hold ints") from None
        if len(shape) < 1 or shape[0] != self.num_ubatches:
            raise ValueError(
                f"workspace shape {shape} must start with the ubatch dim num_ubatches="
                f"{self.num_ubatches}"
            )
        if any(s < 1 for s in shape):
            raise ValueError(f"workspace shape {shape} has a non-positive dimension")
        check_dtype("dtype", dtype)
        if check_state.enabled:  # check mode: every rank allocates the same buffer
            sizes = {f"shape[{i}]": size for i, size in enumerate(shape[:6])}
            fields = {"world size": self.world_size, "len(shape)": len(shape), **sizes}
            check_ranks_agree("DirectCPWorkspace.allocate", self.group, self.device,
                              {**fields, "dtype": dtype})  # fmt: skip
        allocate_symmetric = getattr(self.group, "allocate_symmetric", None)
        handle: Any = None
        if allocate_symmetric is not None:
            storage, views = allocate_symmetric(shape, dtype, self.device)
            views = list(views)
            peer_ptrs = self._peer_table(views)
        else:
            storage, views, peer_ptrs, handle = self._allocate_symm_mem(shape, dtype)
        self._allocations.append(_Allocation(storage, views, handle))
        return storage, peer_ptrs

    def _peer_table(self, views: list[torch.Tensor]) -> torch.Tensor:
        """The int64 ``[U, N]`` table of the peers' slot addresses, on ``device``."""
        if len(views) != self.world_size:
            raise RuntimeError(
                f"symmetric allocation returned {len(views)} peer views for world_size "
                f"{self.world_size}"
            )
        table = [
            [views[p][u].data_ptr() for p in range(self.world_size)]
            for u in range(self.num_ubatches)
        ]
        return torch.tensor(table, dtype=torch.int64).to(self.device)

    def _allocate_symm_mem(
        self, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, Any]:
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as exc:
            raise RuntimeError(
                "torch.distributed._symmetric_memory is not importable; use a non-direct path"
            ) from exc
        pg = self.group.device_group
        if pg is None:
            raise RuntimeError("the group has neither a process group nor allocate_symmetric")
        if self.device.type != "cuda":
            raise RuntimeError(f"symmetric memory needs a CUDA device, got {self.device}")
        propagate_multicast_off()
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        what = f"symmetric allocation of {nbytes} bytes ({tuple(shape)}, {dtype})"
        flag = self.agreement_flag
        storage = agreed_symmetric_empty(
            symm_mem, self.group, shape, dtype, self.device, what, flag
        )
        handle: Any = symm_mem.rendezvous(storage, pg.group_name)
        # Rank-local again: agreed before the barrier.
        failure: Exception | None = None
        views: list[torch.Tensor] = []  # bound on every rank for the del below
        try:
            if handle is None:
                raise RuntimeError("the symmetric-memory rendezvous returned no handle")
            views = [handle.get_buffer(p, shape, dtype, 0) for p in range(self.world_size)]
            peer_ptrs = self._peer_table(views)
        except Exception as exc:
            failure = exc
        try:
            agree_on_local_step(self.group, flag, failure, f"rendezvous of the {what}")
        except SymmetricAllocationError:
            del storage, handle, views  # freed now, not with the traceback's frames
            raise
        barrier = getattr(handle, "barrier", None)
        if barrier is not None:
            barrier()
        return storage, views, peer_ptrs, handle

    def multicast_ptrs(self, storage: torch.Tensor) -> list[int]:
        """Per-ubatch multicast addresses of ``storage`` (a buffer from ``allocate``); all zeros
        where multicast is disabled or unavailable, or anything fails."""
        zeros = [0] * self.num_ubatches
        if multicast_disabled_by_env():
            return zeros
        alloc = next((a for a in self._allocations if a.storage is storage), None)
        if alloc is None or alloc.handle is None:
            return zeros
        try:
            base = int(alloc.handle.multicast_ptr)
            if base == 0:
                return zeros
            start = storage.data_ptr()
            return [base + (storage[u].data_ptr() - start) for u in range(self.num_ubatches)]
        except Exception:
            return zeros

    def nbytes(self) -> int:
        """Bytes of local storage held by this workspace."""
        return sum(math.prod(a.storage.shape) * a.storage.element_size() for a in self._allocations)
