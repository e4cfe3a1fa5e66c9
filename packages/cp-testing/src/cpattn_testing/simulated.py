"""N virtual ranks inside one process, each a thread: ``SimulatedWorld(world_size, device)``
and ``world.run(fn, *args)`` -> ``fn(group, *args)`` per rank, results in rank order
(docs/packages/testing.md). Mismatched collectives raise ``RuntimeError``, a rank that raises
aborts the others, and a rank that never arrives makes the others raise ``TimeoutError``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from cpattn_common.checks import check_positive_int
from cpattn_common.device import indexed_device
from cpattn_common.dispatch import refuse_grad
from cpattn_common.group import (
    check_all_gather_into_tensor_args,
    check_all_to_all_single_args,
    normalize_dim,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["SimulatedGroup", "SimulatedWorld"]


class _PeerFailed(Exception):
    """Raised in ranks waiting in a collective after another rank failed (not reported)."""


class _Rendezvous:
    """Two-phase exchange between the rank threads: deposit, barrier, read, barrier."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._barrier = threading.Barrier(world_size)
        self._slots: list[tuple[str, Any]] = [("", None)] * world_size
        self.current: list[str | None] = [None] * world_size
        self._failed = False

    def reset(self) -> None:
        self._barrier.reset()
        self._slots = [("", None)] * self.world_size
        self.current = [None] * self.world_size
        self._failed = False

    def abort(self) -> None:
        """Wake every rank waiting in a collective (another rank failed)."""
        self._failed = True
        self._barrier.abort()

    def _wait(self, rank: int, op: str) -> None:
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            if self._failed:
                raise _PeerFailed from None
            raise TimeoutError(
                f"simulated rank {rank} waited more than {self.timeout:g} s in {op}; "
                f"collective each rank is in: {self.current}"
            ) from None

    def exchange(self, rank: int, op: str, value: Any, *, share: bool = False) -> list[Any]:
        """Deposit ``value`` (a tensor: a copy, or itself with ``share``) for ``op``; return
        every rank's, in rank order (``op``, shape and dtype must agree)."""
        call = op
        if isinstance(value, torch.Tensor):
            call = f"{op} of {tuple(value.shape)} {value.dtype}"
            if not share:
                value = value.detach().clone()
        self.current[rank] = op
        self._slots[rank] = (call, value)
        self._wait(rank, op)
        items = list(self._slots)
        self._wait(rank, op)  # nobody overwrites a slot before everyone has read it
        self.current[rank] = None
        calls = [name for name, _ in items]
        if any(name != call for name in calls):
            raise RuntimeError(
                f"collective mismatch on simulated rank {rank}: ranks called {calls} (by rank)"
            )
        return [v for _, v in items]


class SimulatedGroup:
    """One virtual rank's view of a :class:`SimulatedWorld` (a ``CPGroupLike`` whose
    ``device_group`` is ``None`` and ``ranks`` are ``[0, ..., N-1]``)."""

    backend = "simulated"
    device_group: ProcessGroup | None = None

    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        self._world = world
        self._rank = rank
        self.world_size = world.world_size
        self.rank_in_group = rank
        self.device = world.device
        self.group_name = f"simulated-{id(world):x}"
        self.ranks = list(range(world.world_size))

    def __repr__(self) -> str:
        return f"SimulatedGroup(world_size={self.world_size}, rank_in_group={self._rank})"

    def _exchange(self, op: str, value: Any, *, share: bool = False) -> list[Any]:
        return self._world._rendezvous.exchange(self._rank, op, value, share=share)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output [N*T, ...]`` = every rank's ``input [T, ...]``, rank-major along dim 0."""
        refuse_grad("SimulatedGroup.all_gather_into_tensor", output=output, input=input)
        check_all_gather_into_tensor_args(output, input, self.world_size)
        parts = self._exchange("all_gather_into_tensor", input)
        output.copy_(torch.cat([p.to(output.device) for p in parts], dim=0))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Equal-split all-to-all along dim 0: chunk n of ``input`` goes to rank n."""
        refuse_grad("SimulatedGroup.all_to_all_single", output=output, input=input)
        n = self.world_size
        check_all_to_all_single_args(output, input, n)
        parts = self._exchange("all_to_all_single", input)
        received = [p.chunk(n, dim=0)[self._rank].to(output.device) for p in parts]
        output.copy_(torch.cat(received, dim=0))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks, out of place (world size 1: ``tensor`` itself)."""
        refuse_grad("SimulatedGroup.all_reduce", tensor=tensor)
        parts = self._exchange("all_reduce", tensor)
        if self.world_size == 1:
            return tensor
        return _sum_in_rank_order(parts, tensor.device)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` in rank order (N = 1: itself)."""
        refuse_grad("SimulatedGroup.all_gather", tensor=tensor)
        d = normalize_dim(dim, tensor.dim())
        parts = self._exchange(f"all_gather(dim={d})", tensor)
        if self.world_size == 1:
            return tensor
        return torch.cat([p.to(tensor.device) for p in parts], dim=d)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over ranks, then keep this rank's equal chunk along ``dim`` (N = 1: itself)."""
        refuse_grad("SimulatedGroup.reduce_scatter", tensor=tensor)
        d = normalize_dim(dim, tensor.dim())
        n = self.world_size
        size = tensor.shape[d]
        if size % n != 0:
            raise ValueError(
                f"reduce_scatter: size {size} of dim {dim} (shape {tuple(tensor.shape)}) is not "
                f"divisible by world_size {n}"
            )
        parts = self._exchange(f"reduce_scatter(dim={d})", tensor)
        if n == 1:
            return tensor
        total = _sum_in_rank_order(parts, tensor.device)
        return total.chunk(n, dim=d)[self._rank].contiguous()

    def barrier(self) -> None:
        """Block until every virtual rank reached the barrier."""
        self._exchange("barrier", None)

    def allocate_symmetric(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Collective: ``(own, peers)``, a zero-filled buffer of ``shape`` and ``dtype`` (the same
        on every rank) on ``device`` (default: the world's) and every rank's (``peers[rank] is
        own``)."""
        dev = torch.device(device) if device is not None else self.device
        own = torch.zeros(tuple(shape), dtype=dtype, device=dev)
        peers = self._exchange(f"allocate_symmetric({tuple(shape)}, {dtype})", own, share=True)
        return own, list(peers)


def _sum_in_rank_order(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = parts[0].to(device).clone(memory_format=torch.contiguous_format)
    for p in parts[1:]:
        total += p.to(device)
    return total


class SimulatedWorld:
    """N virtual ranks in threads of this process.

    Args:
        world_size: N >= 1.
        device: the device the virtual ranks work on (all share it).
        timeout: seconds a rank may wait in one collective before ``TimeoutError``.

    Example:
        >>> world = SimulatedWorld(4, "cpu")
        >>> world.run(lambda g: g.all_reduce(torch.ones(1)).item())
        [4.0, 4.0, 4.0, 4.0]
    """

    def __init__(
        self, world_size: int, device: torch.device | str = "cpu", *, timeout: float = 60.0
    ) -> None:
        check_positive_int("world_size", world_size)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.world_size = world_size
        self.device = indexed_device(device)
        self.timeout = timeout
        self._rendezvous = _Rendezvous(world_size, timeout)
        self._run_lock = threading.Lock()
        # Its ranks are threads: interpreted kernel launches must not interleave.
        from cpattn_testing.interpreter import apply_interpreter_fixes

        apply_interpreter_fixes()
        self.groups: list[SimulatedGroup] = [SimulatedGroup(self, r) for r in range(world_size)]

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Call ``fn(group, *args)`` on every virtual rank (one thread each); results by rank.

        Raises:
            The first exception a rank raised (with a note naming the rank), after every
            other rank was released; ``TimeoutError`` when a rank does not return within
            twice the collective timeout.
        """
        with self._run_lock:
            self._rendezvous.reset()
            n = self.world_size
            results: list[Any] = [None] * n
            errors: list[tuple[float, int, BaseException]] = []

            def body(rank: int) -> None:
                try:
                    if self.device.type == "cuda" and self.device.index is not None:
                        torch.cuda.set_device(self.device)
                    results[rank] = fn(self.groups[rank], *args)
                except _PeerFailed:
                    pass
                except BaseException as exc:
                    errors.append((time.monotonic(), rank, exc))
                    self._rendezvous.abort()

            threads = [
                threading.Thread(target=body, args=(r,), name=f"sim-rank{r}", daemon=True)
                for r in range(n)
            ]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 2 * self.timeout
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if errors:
                _, rank, exc = min(errors, key=lambda e: e[0])
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(f"(raised on simulated rank {rank} of {n})")
                raise exc
            stuck = [r for r, t in enumerate(threads) if t.is_alive()]
            if stuck:
                self._rendezvous.abort()
                raise TimeoutError(
                    f"simulated rank(s) {stuck} did not return within {2 * self.timeout:g} s; "
                    f"collective each rank is in: {self._rendezvous.current}"
                )
            return results
