"""DualChunkSwap (zigzag) partition of prefill tokens across a PCP group (docs/packages/pcp.md,
"DualChunkSwap").

A request of length ``L`` is padded to ``Lp = ceil(L / 2N) * 2N`` and cut into ``2N`` chunks;
rank ``r`` owns chunks ``r`` and ``2N - 1 - r``. Local order is request-major (head chunk, then
tail chunk), so every rank holds ``P = sum(Lp) / N`` rows; padding may sit between a rank's
real rows, and ``local_extent`` is one past its last real row. The plan is built on the host;
the device ops only index with its tensors (no host synchronisation).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, fields, replace

import torch

from cpattn_common.checks import (
    check_device,
    check_fits_in_memory,
    check_tensors,
    is_bool_scalar,
    is_index_dtype,
)

__all__ = ["DualChunkSwapPlan", "dual_chunk_swap"]


@dataclass(frozen=True, eq=False)
class DualChunkSwapPlan:
    """Where every prefill token of a batch lives under DualChunkSwap (fields: docs/packages/pcp.md).

    ``R`` requests, ``N = pcp_size`` ranks, ``T = num_tokens`` real tokens (global order,
    request-major), ``P = padded_local_len`` local rows per rank; slot ``s = r * P + i`` of the
    rank-major all-gather is local row ``i`` of rank ``r``. Index tensors: ``local_positions``,
    ``local_request_idx``, ``local_token_idx`` (``-1``: padding) and ``local_is_real``, all
    ``[N, P]``; ``restore_idx [T]`` (``gathered[restore_idx]`` is the global order);
    ``gather_idx [N*P]`` (global token of every slot, padding slots the request's first token);
    int32 ``cu_seqlens [R+1]``. Host ints: ``seq_lens``, ``padded_seq_lens`` (``Lp``),
    ``chunk_sizes`` (``Lp / 2N``), ``max_seqlen``, and per rank ``num_local_tokens``,
    ``local_extent`` (one past its last real row) and ``causal_work`` (``sum(p + 1)``).
    """

    pcp_size: int
    seq_lens: tuple[int, ...]
    padded_seq_lens: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    num_tokens: int
    padded_local_len: int
    max_seqlen: int
    num_local_tokens: tuple[int, ...]
    local_extent: tuple[int, ...]
    causal_work: tuple[int, ...]
    local_positions: torch.Tensor
    local_request_idx: torch.Tensor
    local_token_idx: torch.Tensor
    local_is_real: torch.Tensor
    restore_idx: torch.Tensor
    gather_idx: torch.Tensor
    cu_seqlens: torch.Tensor
    device: torch.device

    @property
    def num_requests(self) -> int:
        """``R``, the number of requests."""
        return len(self.seq_lens)

    @property
    def num_padded_tokens(self) -> int:
        """``N * P = sum(padded_seq_lens)``, the rows of a rank-major all-gather."""
        return self.pcp_size * self.padded_local_len

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> DualChunkSwapPlan:
        """A copy of the plan with every index tensor on ``device``.

        Args:
            device: target device.
            non_blocking: forwarded to ``Tensor.to``.

        Returns:
            A new plan (``self`` when already there).
        """
        dev = _canonical_device(check_device("device", device))
        if dev == self.device:
            return self
        moved = {
            f.name: getattr(self, f.name).to(dev, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, device=dev, **moved)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int):  # numpy integers included
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < self.pcp_size:
            raise ValueError(f"rank must be in [0, {self.pcp_size}), got {rank}")

    def local_rows(self, x_global: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s padded local rows of a tensor in global token order.

        Padding rows repeat their request's first token (positions clamped, never another
        request's token), so the result is safe to feed to any per-token op.

        Args:
            x_global: ``[T, ...]`` in global order.
            rank: the PCP rank ``r``.

        Returns:
            ``[P, ...]``: ``x_global[gather_idx.view(N, P)[r]]``.

        Raises:
            TypeError: ``rank`` is not an int (a bool or a numpy integer included).
            ValueError: ``rank`` is not in ``[0, N)``, or ``x_global`` does not have
                ``T = num_tokens`` rows.
        """
        self._check_rank(rank)
        _check_rows(x_global, self.num_tokens, "x_global", "plan.num_tokens")
        idx = self.gather_idx.view(self.pcp_size, self.padded_local_len)[rank]
        return x_global.index_select(0, idx)

    def restore(self, gathered: torch.Tensor) -> torch.Tensor:
        """Global order, real tokens only, from a rank-major all-gather of padded local rows.

        Args:
            gathered: ``[N*P, ...]``, rank ``r``'s padded local rows at ``r*P .. (r+1)*P``.

        Returns:
            ``[T, ...]``: ``gathered[restore_idx]``.
        """
        _check_rows(gathered, self.num_padded_tokens, "gathered", "pcp_size * padded_local_len")
        return gathered.index_select(0, self.restore_idx)


def _check_rows(x: torch.Tensor, expected: int, name: str, what: str) -> None:
    check_tensors("DualChunkSwapPlan", **{name: x})
    if x.dim() < 1 or x.shape[0] != expected:
        raise ValueError(f"{name} must have {what} = {expected} rows, got shape {tuple(x.shape)}")


def _as_int_list(seq_lens: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.dim() != 1:
            raise ValueError(f"seq_lens must be 1-D, got shape {tuple(seq_lens.shape)}")
        if not is_index_dtype(seq_lens.dtype):
            raise TypeError(
                "seq_lens must hold integers (int8/16/32/64 or uint8/16/32/64), got dtype "
                f"{seq_lens.dtype}"
            )
        values: list[int] = [int(v) for v in seq_lens.tolist()]  # the one host sync
    else:
        # No request order (a dict's keys, a set), or no sequence at all (None, a scalar, a
        # string of digits).
        if isinstance(seq_lens, (Mapping, AbstractSet, str, bytes)) or not hasattr(
            seq_lens, "__iter__"
        ):
            raise TypeError(
                "seq_lens must be a sequence (a list, a tuple, a 1-D tensor or array), got "
                f"{type(seq_lens).__name__}"
            )
        values = []
        for v in seq_lens:
            if is_bool_scalar(v):  # operator.index may take it as 0 / 1
                raise TypeError(f"seq_lens must hold ints, got {v!r}")
            try:
                values.append(operator.index(v))  # int, numpy integers
            except TypeError:
                raise TypeError(
                    f"seq_lens must hold ints, got {v!r} ({type(v).__name__})"
                ) from None
    bad = [(i, v) for i, v in enumerate(values) if v < 0]
    if bad:
        raise ValueError(f"seq_lens must be >= 0; (request, length) pairs {bad[:8]}")
    return values


#: The most tokens a plan can describe: ``cu_seqlens`` is int32.
_MAX_TOKENS = 2**31 - 1


def _canonical_device(device: torch.device) -> torch.device:
    """The device a tensor moved to ``device`` reports: ``cuda`` -> ``cuda:<current>``,
    ``cpu:0`` -> ``cpu`` (and so on for other backends), so that the plan's ``device`` equals
    its tensors' and the caller's tensors' devices."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return torch.device("cuda", index)
    if device.type == "cpu":
        return torch.device("cpu")
    return torch.empty(0, device=device).device


def dual_chunk_swap(
    seq_lens: Sequence[int] | torch.Tensor,
    pcp_size: int,
    *,
    device: torch.device | str | None = None,
) -> DualChunkSwapPlan:
    """Plan the DualChunkSwap split of a batch of prefills over ``pcp_size`` ranks.

    Args:
        seq_lens: ``[R]`` prompt lengths (ints ``>= 0``): a list or a 1-D integer tensor
            (a GPU tensor is read once, here).
        pcp_size: ``N >= 1``, the PCP group size.
        device: where the plan's index tensors live; defaults to ``seq_lens``'s device (CPU
            for a list).

    Returns:
        The ``DualChunkSwapPlan``: rank ``r`` owns chunks ``r`` and ``2N-1-r`` of every
        request, head chunk first, requests in order.

    Raises:
        ValueError: ``pcp_size < 1``, negative lengths, a non-1-D tensor, more than
            ``2**31 - 1`` tokens in all (``cu_seqlens`` is int32), a ``device`` torch cannot
            parse or this process lacks, or a plan that would need more memory than is free
            (the message says how much).
        TypeError: ``seq_lens`` is not a sequence or a tensor, non-integer lengths (a
            tensor's dtype must be int8/16/32/64 or uint8/16/32/64:
            ``cpattn_common.checks.INDEX_DTYPES``), a ``device`` that is not a string or a
            ``torch.device``.

    Example:
        >>> plan = dual_chunk_swap([8, 8], pcp_size=2)
        >>> plan.local_token_idx.tolist()
        [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]
    """
    if isinstance(pcp_size, bool) or not isinstance(pcp_size, int):
        raise TypeError(f"pcp_size must be an int, got {type(pcp_size).__name__}")
    if pcp_size < 1:
        raise ValueError(f"pcp_size must be >= 1, got {pcp_size}")
    if device is None:
        device = seq_lens.device if isinstance(seq_lens, torch.Tensor) else torch.device("cpu")
    dev = _canonical_device(check_device("device", device))
    lens_list = _as_int_list(seq_lens)
    if sum(lens_list) > _MAX_TOKENS:
        raise ValueError(
            f"the batch has {sum(lens_list)} tokens; the plan's cu_seqlens is int32 (as varlen "
            f"attention kernels expect), so at most {_MAX_TOKENS}"
        )
    n = pcp_size
    two_n = 2 * n
    cpu = torch.device("cpu")

    lens = torch.tensor(lens_list, dtype=torch.int64, device=cpu)
    chunk = (lens + two_n - 1) // two_n  # c per request
    padded = chunk * two_n  # Lp per request
    per_rank = 2 * chunk  # local rows per rank and request
    num_requests = len(lens_list)
    local_len = int(per_rank.sum())
    # The build's int64 [N, P] temporaries (about nine at its peak) and [T] index, and on
    # another device the plan's five [N, P] and one [T] index tensors.
    num_slots, total = n * local_len, sum(lens_list)
    what = f"the plan for pcp_size={n} and {total} tokens ({num_slots} local slots)"
    check_fits_in_memory("dual_chunk_swap", what, 8 * (9 * num_slots + 2 * total + n), cpu)
    if dev != cpu:
        check_fits_in_memory("dual_chunk_swap", what, 8 * (5 * num_slots + total), dev)
    starts = torch.zeros(num_requests + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=starts[1:])

    req = torch.repeat_interleave(torch.arange(num_requests), per_rank)  # [P]
    local_start = torch.cumsum(per_rank, 0) - per_rank  # first local row of each request
    within = torch.arange(local_len) - local_start[req]  # [P], 0 .. 2c-1
    c_row = chunk[req]
    is_tail = within >= c_row
    offset = within - torch.where(is_tail, c_row, torch.zeros_like(c_row))
    ranks = torch.arange(n).unsqueeze(1)  # [N, 1]
    chunk_id = torch.where(is_tail.unsqueeze(0), two_n - 1 - ranks, ranks)  # [N, P]
    positions = chunk_id * c_row + offset  # [N, P]
    req_2d = req.unsqueeze(0).expand(n, local_len)
    is_real = positions < lens[req].unsqueeze(0)
    first_token = starts[:-1][req].unsqueeze(0)  # [1, P]
    token_idx = torch.where(is_real, first_token + positions, torch.full_like(positions, -1))
    gather_2d = torch.where(is_real, token_idx, first_token.expand(n, local_len))

    num_tokens = int(starts[-1])
    slots = torch.arange(n * local_len).view(n, local_len)
    restore = torch.empty(num_tokens, dtype=torch.int64)
    restore[token_idx[is_real]] = slots[is_real]
    work = torch.where(is_real, positions + 1, torch.zeros_like(positions)).sum(dim=1)
    row_ends = torch.arange(1, local_len + 1).unsqueeze(0)  # [1, P]: one past each row
    extent = (
        torch.where(is_real, row_ends, torch.zeros_like(row_ends)).amax(dim=1)
        if local_len
        else torch.zeros(n, dtype=torch.int64)
    )

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().to(dev)

    return DualChunkSwapPlan(
        pcp_size=n,
        seq_lens=tuple(lens_list),
        padded_seq_lens=tuple(int(v) for v in padded.tolist()),
        chunk_sizes=tuple(int(v) for v in chunk.tolist()),
        num_tokens=num_tokens,
        padded_local_len=local_len,
        max_seqlen=max(lens_list, default=0),
        num_local_tokens=tuple(int(v) for v in is_real.sum(dim=1).tolist()),
        local_extent=tuple(int(v) for v in extent.tolist()),
        causal_work=tuple(int(v) for v in work.tolist()),
        local_positions=put(positions),
        local_request_idx=put(req_2d),
        local_token_idx=put(token_idx),
        local_is_real=put(is_real),
        restore_idx=put(restore),
        gather_idx=put(gather_2d.reshape(-1)),
        cu_seqlens=put(starts.to(torch.int32)),
        device=dev,
    )
