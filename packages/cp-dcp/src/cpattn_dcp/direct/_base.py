"""Shared plumbing of the direct (symmetric-memory) DCP workspaces.

Each direct workspace owns one ``cpattn_common.workspace.DirectCPWorkspace`` (symmetric
allocations, per-ubatch peer-pointer tables, a per-ubatch int64 ``epoch`` on the device) plus
three small local tensors of its own:

* ``_pub_counter [U, N]`` int32 — per-destination completion counter of the publish launch;
* ``_wait_done [U]`` int32 — completion counter of the wait launch (its last program advances
  ``epoch[u]``);
* ``_error [U, 2 + W]`` int64 — ``(flag, epoch, missing-source bitmask)`` written by a wait that
  timed out (flag 1); the mask is ``W = cdiv(N, 64)`` words, source ``n`` at bit ``n % 64`` of
  word ``n // 64`` (``error_record_width``). Flag 2 (``(2, epoch)``, empty mask): the wait
  failed at once because another direct workspace of the group timed out first.

and a reference to ``_group_failure`` ``[1]`` int64, the failure word every direct workspace of
the group on this device shares (``cpattn_dcp.direct._group_failure``): any timeout sets it,
and every publish and wait program of every such workspace checks it at its start.

Error reporting never syncs the host on the hot path. On CUDA the error record is mirrored into
pinned host memory with a non-blocking copy every ``error_check_interval`` eager calls (never
during CUDA-graph capture) and the mirror is inspected at the start of every call, so a timeout
surfaces as ``DirectProtocolError`` at the first call that starts after such a copy landed:
between 1 and ``error_check_interval`` calls later, not necessarily at the next one. On the CPU
the record is host memory and the next call sees it. ``check_error()`` is the explicit, syncing
check (use it where a timeout must be known at once).
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
from cpattn_common.checks import check_nonnegative_int, check_positive_int
from cpattn_common.device import foreign_cuda_device
from cpattn_common.group import CPGroupLike, as_cp_group
from cpattn_common.ubatch import current_ubatch_id
from cpattn_common.workspace import DirectCPWorkspace, SymmetricAllocationError
from cpattn_dcp.direct._group_failure import group_failure_word

__all__ = [
    "DEFAULT_MAX_SPINS",
    "MAX_SPINS_LIMIT",
    "MIN_TRITON_VERSION",
    "DirectPathUnavailable",
    "DirectProtocolError",
    "DirectWorkspaceBase",
    "indexed_device",
    "on_workspace_device",
]

#: Bounded wait: polls of the signal words before a wait gives up (≈ seconds on a GPU).
DEFAULT_MAX_SPINS = 1 << 26
#: The largest ``max_spins``: the wait kernels count polls in 32 bits, so a larger bound would
#: never be reached (the counter wraps negative) and a wait for a dead peer would never end.
MAX_SPINS_LIMIT = 2**31 - 1
#: Eager calls between two non-blocking copies of the error record to the host.
DEFAULT_ERROR_CHECK_INTERVAL = 64
#: Error-record flags: this workspace's wait timed out (names the missing sources) / it failed
#: because another direct workspace of the group had timed out first.
ERROR_FLAG_TIMEOUT = 1
ERROR_FLAG_GROUP = 2


#: The oldest Triton whose direct-path kernels work on a GPU. Before 3.5 a vector atomic ran in
#: a few threads of a block and its result never reached the others (Triton issue #7402, fixed
#: in 3.5): the waits poll all N signal words with one, so most threads never saw a signal and
#: every wait spun to its bound. Found by compiling the wait for sm_90 with Triton 3.4.0 (no
#: shared-memory broadcast after the atom; 3.5.0 has it). The interpreter is not affected.
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
    """A direct workspace found at construction that this machine cannot run it (no
    multicast address for its buffers; a Triton older than ``MIN_TRITON_VERSION`` on a GPU; a
    symmetric buffer that some rank could not allocate, raised on every rank together).
    ``DCPManager`` falls back to NCCL on it unless the path was forced
    (``use_direct_*=True``)."""


class DirectProtocolError(RuntimeError):
    """A direct collective's bounded wait timed out: a peer never made the matching call."""


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` with an explicit index: a bare ``"cuda"`` becomes the calling thread's current
    CUDA device (where a tensor created with ``device="cuda"`` lands), so comparisons with a
    tensor's ``.device`` (always indexed on CUDA) hold. Other devices are returned unchanged."""
    dev = torch.device(device)
    index: int | None = dev.index  # the stubs say int; a bare device has None
    if dev.type == "cuda" and index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def error_record_width(world_size: int) -> int:
    """int64 words of one ubatch's error record: flag, epoch and ``cdiv(N, 64)`` mask words."""
    return 2 + -(-world_size // 64)


def missing_ranks(mask_words: Sequence[int], world_size: int) -> list[int]:
    """The sources a timed-out wait names: bit ``r % 64`` of word ``r // 64`` for ``r < N``.

    Each word is read as 64 unsigned bits: a Python shift of a negative int64 (bit 63 set)
    would otherwise carry the sign into every higher rank.

    Args:
        mask_words: the ``cdiv(N, 64)`` int64 mask words of an error record.
        world_size: N.

    Returns:
        The missing source ranks, ascending.
    """
    words = [int(w) & 0xFFFF_FFFF_FFFF_FFFF for w in mask_words]
    return [r for r in range(world_size) if words[r // 64] >> (r % 64) & 1]


def next_pow2(x: int) -> int:
    """Smallest power of two >= max(x, 1)."""
    return 1 << max(int(x) - 1, 0).bit_length()


def as_int(what: str, value: object) -> int:
    """``value`` as an int (anything with ``__index__``, a numpy int say), else ``TypeError``:
    ``int()`` turned 2.7 into 2 and ``True`` into 1 without a word."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got a bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None


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
    """Run a workspace method with the workspace's CUDA device current.

    Its launches (and ``torch.cuda.is_current_stream_capturing``) otherwise go to the calling
    thread's current device and stream, which need not be the workspace's: see
    ``cpattn_common.device``. Costs one check where the devices agree.
    """

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
        group: the DCP group (``ProcessGroup`` or ``CPGroupLike``; simulated groups need
            ``allocate_symmetric``). Construction is collective over the group.
        device: the device the buffers live on (a bare ``"cuda"`` means the current CUDA
            device; ``self.device`` is always indexed on CUDA).
        num_ubatches: micro-batch slots U (validated by the subclass).
        max_spins: polls before a wait gives up and records an error, 1 to
            ``MAX_SPINS_LIMIT`` (2**31 - 1).
        error_check_interval: eager CUDA calls between non-blocking error-record copies (0:
            only ``check_error()`` reports on CUDA; the CPU always reports at the next call).
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
        if torch.device(device).type == "cuda" and (reason := triton_unsupported_reason()):
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
        self._closed = False
        self._failure: str | None = None
        self._calls_since_check = 0
        self._symm: DirectCPWorkspace | None = None

    # -- allocation ---------------------------------------------------------------------------
    def _init_buffers(self) -> None:
        """Create the symmetric workspace and the local counters (collective).

        The local tensors come first, and the ranks agree on them before any symmetric
        allocation: one that fails on some rank only (out of device or pinned host memory)
        raises ``DirectPathUnavailable`` on every rank together, as a failed symmetric
        allocation does, instead of leaving the peers waiting in the next collective.
        """
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
        except SymmetricAllocationError as exc:
            # Raised on every rank together (the ranks agree before the rendezvous), so all of
            # them take the NCCL path, or all raise where the path is forced.
            self._symm.close()  # drop the buffers this workspace allocated before
            raise DirectPathUnavailable(f"{self.name}: {exc}") from exc
        if tuple(storage.shape) != full or tuple(peer_ptrs.shape) != (
            self.num_ubatches,
            self.world_size,
        ):
            raise RuntimeError(
                f"{self.name}: symmetric allocation returned storage {tuple(storage.shape)} and "
                f"peer table {tuple(peer_ptrs.shape)}, expected {full} and "
                f"{(self.num_ubatches, self.world_size)}"
            )
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

    # -- per call -----------------------------------------------------------------------------
    def _resolve_ubatch(self, ubatch_id: int | None) -> int:
        u = current_ubatch_id() if ubatch_id is None else ubatch_id
        if isinstance(u, bool) or not isinstance(u, int):
            raise TypeError(f"{self.name}: ubatch id must be an int, got {type(u).__name__}")
        if not 0 <= u < self.num_ubatches:
            raise ValueError(
                f"{self.name}: ubatch {u} exceeds the {self.num_ubatches} slot(s) of this workspace"
            )
        return u

    def _before_call(self) -> None:
        """Refuse calls on a closed or failed workspace; inspect the lazily mirrored error."""
        if self._closed:
            raise RuntimeError(f"{self.name}: workspace is closed")
        if self._failure is not None:
            raise DirectProtocolError(self._failure)
        if self._error_view[:, 0].any():
            record = torch.from_numpy(self._error_view.copy())
            if self._error_host is not None and not torch.cuda.is_current_stream_capturing():
                # Error path only: read the device record itself (the flag of the mirror may
                # have landed before the rest of a still-running non-blocking copy).
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
        # A real timeout of this workspace names the missing peers: report it before a wait
        # that only followed another workspace's failure.
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
        """True once ``close()`` was called: the workspace must not be used any more (its
        checked calls raise ``RuntimeError``) and the factories no longer hand it out."""
        return self._closed

    def close(self) -> None:
        """Release the symmetric workspace (collective where the backend needs it; idempotent).

        Every rank of the group must close its workspace at the same point of its call
        sequence. The ``get_direct_dcp_*`` factories treat a closed workspace as absent and
        build a new one at their next call for its geometry (collectively, as construction is).
        """
        if self._closed:
            return
        self._closed = True
        if self._symm is not None:
            self._symm.close()

    def __enter__(self) -> DirectWorkspaceBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
