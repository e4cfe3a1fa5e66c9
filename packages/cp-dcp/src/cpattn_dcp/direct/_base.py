"""Shared plumbing of the direct (symmetric-memory) DCP workspaces.

Each workspace owns one ``DirectCPWorkspace`` (symmetric buffers, peer pointers, per-ubatch
``epoch``), the completion counters of its two launches, an int64 error record ``[U, 2 +
cdiv(N, 64)]`` and the group's failure word. No host sync on the hot path: on CUDA the record is
mirrored to pinned memory every ``error_check_interval`` eager calls, so a timeout raises
``DirectProtocolError`` up to that many calls later; ``check_error()`` is the syncing check.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import triton

from cpattn_common.agreement import agree_on_local_step, agreement_flag
from cpattn_common.checks import check_device, check_nonnegative_int, check_positive_int
from cpattn_common.device import foreign_cuda_device, indexed_device
from cpattn_common.group import CPGroupLike, as_cp_group
from cpattn_common.ubatch import current_ubatch_id
from cpattn_common.workspace import DirectCPWorkspace, SymmetricAllocationError
from cpattn_dcp.direct._group_failure import group_failure_word
from cpattn_dcp.ops._common import next_pow2

__all__ = [
    "DEFAULT_MAX_SPINS",
    "MAX_SPINS_LIMIT",
    "MIN_TRITON_VERSION",
    "DirectPathUnavailable",
    "DirectProtocolError",
    "DirectWorkspaceBase",
    "indexed_device",
    "next_pow2",
    "on_workspace_device",
]

#: Bounded wait: polls of the signal words before a wait gives up (≈ seconds on a GPU).
DEFAULT_MAX_SPINS = 1 << 26
#: The largest ``max_spins``: the wait kernels count polls in 32 bits.
MAX_SPINS_LIMIT = 2**31 - 1
#: Eager calls between two non-blocking copies of the error record to the host.
DEFAULT_ERROR_CHECK_INTERVAL = 64
#: Error-record flag of a wait that timed out (2: another workspace of the group had first).
ERROR_FLAG_TIMEOUT = 1
#: Publish programs per destination; rows are strided over them.
MAX_PUBLISH_PROGRAMS = 32


#: The oldest Triton whose direct-path kernels work on a GPU: before 3.5 a vector atomic's
#: result never reached most threads of a block (Triton issue #7402), so every wait spun to
#: its bound. The interpreter is not affected.
MIN_TRITON_VERSION = (3, 5)


def triton_unsupported_reason(version: str | None = None) -> str | None:
    """Why the installed Triton (or ``version``) cannot run the direct paths on a GPU, or
    ``None``. A version string without a leading ``major.minor`` counts as too old."""
    text = triton.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is not None and (int(match[1]), int(match[2])) >= MIN_TRITON_VERSION:
        return None
    need = ".".join(map(str, MIN_TRITON_VERSION))
    return (
        f"the direct paths need Triton >= {need} on a GPU, found {text} (older Triton does not "
        "hand a vector atomic's result to every thread, Triton issue #7402: each wait would "
        "spin to its bound)"
    )


class DirectPathUnavailable(RuntimeError):
    """A direct workspace found at construction that this machine cannot run it (no multicast
    address, an old Triton on a GPU, a symmetric buffer some rank could not allocate: raised
    on every rank together). ``DCPManager`` falls back to NCCL unless the path was forced."""


class DirectProtocolError(RuntimeError):
    """A direct collective's bounded wait timed out: a peer never made the matching call."""


def error_record_width(world_size: int) -> int:
    """int64 words of one ubatch's error record: flag, epoch and ``cdiv(N, 64)`` mask words."""
    return 2 + -(-world_size // 64)


def missing_ranks(mask_words: Sequence[int], world_size: int) -> list[int]:
    """The sources a timed-out wait names, ascending: bit ``r % 64`` of word ``r // 64`` of
    the ``cdiv(N, 64)`` int64 mask words, read as unsigned (bit 63 is no sign)."""
    words = [int(w) & 0xFFFF_FFFF_FFFF_FFFF for w in mask_words]
    return [r for r in range(world_size) if words[r // 64] >> (r % 64) & 1]


def as_int(what: str, value: object) -> int:
    """``value`` as an int (anything with ``__index__``), else ``TypeError`` (bools, floats)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got a bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None


def checked_sizes(name: str, **sizes: object) -> list[int]:
    """``sizes`` as ints (``TypeError`` otherwise), each >= 1 (``ValueError``)."""
    values = [as_int(f"{name}: {key}", value) for key, value in sizes.items()]
    small = [f"{key}={v}" for key, v in zip(sizes, values, strict=True) if v < 1]
    if small:
        raise ValueError(f"{name} sizes must be positive, got {', '.join(small)}")
    return values


def check_16b_rows(name: str, dtype: torch.dtype, **rows: int) -> None:
    """``ValueError`` unless every row of ``rows[key]`` elements of ``dtype`` is a multiple of
    16 bytes (the kernels move 16-byte vectors)."""
    for key, n in rows.items():
        if n * dtype.itemsize % 16:
            raise ValueError(
                f"{name} requires 16-byte-aligned rows: {key} = {n} elements * "
                f"{dtype.itemsize} bytes is not a multiple of 16"
            )


def check_16b_aligned(t: torch.Tensor, what: str, row_strides: tuple[int, ...]) -> str | None:
    """Reason string when ``t``'s base pointer or any of ``row_strides`` (in elements) is not a
    multiple of 16 bytes, else ``None``."""
    elem = t.element_size()
    if t.data_ptr() % 16 != 0:
        return f"{what} data pointer {t.data_ptr():#x} is not 16-byte aligned"
    for s in row_strides:
        if (s * elem) % 16 != 0:
            return f"{what} stride {s} elements * {elem} bytes is not a multiple of 16 bytes"
    return None


_Method = TypeVar("_Method", bound=Callable[..., Any])


def on_workspace_device(method: _Method) -> _Method:
    """Run a workspace method with the workspace's CUDA device current (its launches go to
    the current device and stream: ``cpattn_common.device``)."""

    @functools.wraps(method)
    def guarded(self: DirectWorkspaceBase, *args: Any, **kwargs: Any) -> Any:
        if (index := foreign_cuda_device(self._wait_done)) >= 0:
            with torch.cuda.device(index):
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return guarded  # type: ignore[return-value]


class DirectWorkspaceBase:
    """Symmetric buffers, epochs, counters and lazy error reporting of one direct workspace.

    Args:
        name: human name used in messages ("Direct DCP A2A", ...).
        group: the DCP group (a ``ProcessGroup`` or ``CPGroupLike``; construction is collective).
        device: the buffers' device (a bare ``"cuda"``: the current CUDA device).
        num_ubatches: micro-batch slots U (validated by the subclass).
        max_spins: polls before a wait gives up and records an error, 1 to ``MAX_SPINS_LIMIT``.
        error_check_interval: eager CUDA calls between non-blocking error-record copies (0:
            only ``check_error()`` reports on CUDA).
    """

    def __init__(
        self,
        name: str,
        group: Any,
        device: torch.device | str,
        num_ubatches: int,
        *,
        max_spins: int = DEFAULT_MAX_SPINS,
        error_check_interval: int = DEFAULT_ERROR_CHECK_INTERVAL,
    ) -> None:
        if check_device("device", device, available=False).type == "cuda" and (
            reason := triton_unsupported_reason()
        ):
            raise DirectPathUnavailable(f"{name}: {reason}")
        # Checked, never converted: int(2.5) or int(True) would set another bound than meant.
        check_positive_int(f"{name}: max_spins", max_spins)
        if max_spins > MAX_SPINS_LIMIT:
            raise ValueError(
                f"{name}: max_spins must be <= {MAX_SPINS_LIMIT} (the wait kernels count polls "
                f"in 32 bits), got {max_spins}"
            )
        check_nonnegative_int(f"{name}: error_check_interval", error_check_interval)
        self.name = name
        self.device = indexed_device(device)
        self.num_ubatches = num_ubatches
        self.max_spins = int(max_spins)
        self.error_check_interval = int(error_check_interval)
        cp: CPGroupLike = as_cp_group(group)
        self.group = group
        self.cp_group = cp
        self.world_size = cp.world_size
        self.rank = cp.rank_in_group
        if self.world_size < 2:
            raise ValueError(
                f"{name} requires at least two ranks, got world size {self.world_size}"
            )
        self._closed = False
        self._failure: str | None = None
        self._calls_since_check = 0
        self._symm: DirectCPWorkspace | None = None

    def _init_buffers(self) -> None:
        """Create the symmetric workspace and the local counters (collective: a failure on any
        rank raises ``DirectPathUnavailable`` on every rank)."""
        u, n = self.num_ubatches, self.world_size
        flag = agreement_flag(self.cp_group, self.device)
        failure: BaseException | None = None
        try:
            self._symm = DirectCPWorkspace(self.group, self.device, u)
            self._pub_counter = torch.zeros((u, n), dtype=torch.int32, device=self.device)
            self._wait_done = torch.zeros((u,), dtype=torch.int32, device=self.device)
            width = error_record_width(n)
            self._error = torch.zeros((u, width), dtype=torch.int64, device=self.device)
            self._group_failure = group_failure_word(self.group, self.device)
            self._error_host: torch.Tensor | None = None
            if self.device.type == "cuda":
                self._error_host = torch.zeros((u, width), dtype=torch.int64, pin_memory=True)
                self._error_view = self._error_host.numpy()
            else:
                self._error_view = self._error.numpy()  # shares memory: no copy, no sync
        except RuntimeError as exc:  # torch.OutOfMemoryError and CUDA errors among them
            failure = exc
        try:
            agree_on_local_step(self.cp_group, flag, failure, f"{self.name}: local buffers")
        except SymmetricAllocationError as exc:
            raise DirectPathUnavailable(f"{self.name}: {exc}") from exc

    def _allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective symmetric allocation ``[U, *shape]`` -> ``(storage, peer_ptrs [U, N])``."""
        assert self._symm is not None
        full = (self.num_ubatches, *shape)
        try:
            storage, peer_ptrs = self._symm.allocate(full, dtype)
        except SymmetricAllocationError as exc:  # raised on every rank together
            self._symm.close()  # drop the buffers this workspace allocated before
            raise DirectPathUnavailable(f"{self.name}: {exc}") from exc
        return storage, peer_ptrs

    @property
    def epoch(self) -> torch.Tensor:
        """Per-ubatch int64 call counter ``[U]`` on the device (advanced on the device)."""
        assert self._symm is not None
        return self._symm.epoch

    @property
    def symmetric_workspace(self) -> DirectCPWorkspace:
        """The underlying ``DirectCPWorkspace``."""
        assert self._symm is not None
        return self._symm

    def _resolve_ubatch(self, ubatch_id: int | None) -> int:
        u = current_ubatch_id() if ubatch_id is None else ubatch_id
        if isinstance(u, bool) or not isinstance(u, int):
            raise TypeError(f"{self.name}: ubatch_id must be an int, got {type(u).__name__}")
        if not 0 <= u < self.num_ubatches:
            raise ValueError(
                f"{self.name}: ubatch_id {u} exceeds the {self.num_ubatches} slot(s) of this workspace"
            )
        return u

    def _refuse(self, reason: str | None) -> None:
        """``ValueError`` naming the workspace for a ``*_reason`` that is not ``None``."""
        if reason is not None:
            raise ValueError(f"{self.name}: {reason}")

    def _before_call(self) -> None:
        """Refuse calls on a closed or failed workspace; inspect the lazily mirrored error."""
        if self._closed:
            raise RuntimeError(f"{self.name}: workspace is closed")
        if self._failure is not None:
            raise DirectProtocolError(self._failure)
        if self._error_view[:, 0].any():
            record = torch.from_numpy(self._error_view.copy())
            if self._error_host is not None and not torch.cuda.is_current_stream_capturing():
                # Error path only: the device record itself (the copy may still be running).
                record = self._error.cpu()
            self._raise_from(record)

    def _after_call(self) -> None:
        """Every ``error_check_interval`` eager CUDA calls, mirror the error record (no sync)."""
        if self._error_host is None or self.error_check_interval == 0:
            return
        if torch.cuda.is_current_stream_capturing():
            return
        self._calls_since_check += 1
        if self._calls_since_check >= self.error_check_interval:
            self._calls_since_check = 0
            self._error_host.copy_(self._error, non_blocking=True)

    def _raise_from(self, record: torch.Tensor) -> None:
        flags = record[:, 0]
        if not bool(flags.any()):
            return
        # A timeout of this workspace names the missing peers: report it first.
        timeouts = torch.nonzero(flags == ERROR_FLAG_TIMEOUT)
        u = int(timeouts[0, 0]) if timeouts.numel() else int(torch.nonzero(flags)[0, 0])
        epoch = int(record[u, 1])
        if int(flags[u]) == ERROR_FLAG_TIMEOUT:
            missing = missing_ranks(record[u, 2:].tolist(), self.world_size)
            self._failure = (
                f"{self.name}: rank {self.rank}, ubatch {u}: bounded wait timed out at epoch "
                f"{epoch} after {self.max_spins} polls; no signal from source rank(s) {missing}. "
                "Every rank must make the same calls, in the same order, on each ubatch. The "
                "workspace and every direct workspace of its group are unusable after this "
                "error: rebuild the group."
            )
        else:
            self._failure = (
                f"{self.name}: rank {self.rank}, ubatch {u}: call at epoch {epoch} failed "
                "without waiting because another direct workspace of this group timed out "
                "first on this rank (its own DirectProtocolError names the missing ranks). "
                "Every direct workspace of the group is unusable after this: rebuild the group."
            )
        raise DirectProtocolError(self._failure)

    def check_error(self) -> None:
        """Synchronize with the device and raise ``DirectProtocolError`` if a wait timed out."""
        if self._failure is not None:
            raise DirectProtocolError(self._failure)
        self._raise_from(self._error.cpu())

    @property
    def failed(self) -> bool:
        """True once a timeout has been reported to the host."""
        return self._failure is not None

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called: its checked calls raise ``RuntimeError`` and the
        factories no longer hand it out."""
        return self._closed

    def close(self) -> None:
        """Release the symmetric workspace (idempotent). Collective: every rank closes at the
        same point of its call sequence."""
        if self._closed:
            return
        self._closed = True
        if self._symm is not None:
            self._symm.close()

    def __enter__(self) -> DirectWorkspaceBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
