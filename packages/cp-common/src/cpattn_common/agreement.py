"""Agreement of a group's ranks on a rank-local step before the next collective step:
``agree_on_local_step`` all-gathers a flag per rank (through ``agreement_flag``'s scratch,
allocating nothing) so a step that failed on one rank raises ``SymmetricAllocationError`` on
every rank together. ``check_ranks_agree`` compares a call's signature across ranks (check mode).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch

from cpattn_common.checks import check_state, host_checkable
from cpattn_common.group import CPGroupLike

__all__ = [
    "AgreementError",
    "SymmetricAllocationError",
    "agree_on_local_step",
    "agreed_symmetric_empty",
    "agreement_flag",
    "check_ranks_agree",
    "check_tensor_agreement",
    "gather_rank_values",
    "tensor_fields",
]


class SymmetricAllocationError(RuntimeError):
    """A symmetric allocation (or a rank-local step after its rendezvous) failed on at least one
    rank; raised on every rank (``failed_ranks``, in group ranks). On a rank that failed,
    ``__cause__`` is its own error."""

    def __init__(self, message: str, failed_ranks: list[int]):
        super().__init__(message)
        self.failed_ranks = failed_ranks


class AgreementError(RuntimeError):
    """The all-gather of an agreement failed on this rank (``__cause__``): the ranks may be out
    of step, so the group is broken; this is no agreed failure."""


def agreement_flag(group: CPGroupLike, device: torch.device) -> torch.Tensor:
    """The int64 ``[1 + N]`` scratch that ``gather_rank_values`` and ``agree_on_local_step``
    gather through (element 0: this rank's value; 1..N: every rank's), on ``device`` (host for
    gloo). Allocate it before the local step it is meant to agree."""
    on_host = getattr(group, "backend", None) == "gloo"
    return torch.empty(1 + group.world_size, dtype=torch.int64, device="cpu" if on_host else device)


def gather_rank_values(group: CPGroupLike, flag: torch.Tensor, value: int) -> list[int]:
    """Collective: every rank's ``value`` (an int64), in group rank order.

    One all-gather from ``flag[:1]`` into ``flag[1:]`` (``agreement_flag``'s scratch).

    Raises:
        ValueError: ``flag`` is not such a scratch for this group.
        AgreementError: the all-gather failed on this rank.
    """
    n = group.world_size
    if flag.dtype != torch.int64 or tuple(flag.shape) != (1 + n,):
        raise ValueError(
            f"flag must be agreement_flag's int64 [1 + N] = [{1 + n}] scratch, got "
            f"{flag.dtype} {tuple(flag.shape)}"
        )
    flag[:1].fill_(value)
    try:
        group.all_gather_into_tensor(flag[1:], flag[:1])
        return [int(v) for v in flag[1:].tolist()]
    except Exception as exc:
        raise AgreementError(
            f"the ranks' agreement all-gather failed on rank {group.rank_in_group} of {n}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def agree_on_local_step(
    group: CPGroupLike, flag: torch.Tensor, failure: BaseException | None, what: str
) -> None:
    """Collective: raise ``SymmetricAllocationError`` on every rank if ``failure`` (this rank's
    error of the step ``what``, or ``None``) is set on any; ``flag``: ``agreement_flag``'s.

    Raises:
        SymmetricAllocationError: on every rank, when the step failed on any.
        AgreementError: the all-gather itself failed on this rank.
    """
    flags = gather_rank_values(group, flag, 0 if failure is not None else 1)
    failed_ranks = [r for r, ok in enumerate(flags) if not ok]
    if not failed_ranks:
        return
    rank = group.rank_in_group
    local = (
        f"; here (rank {rank}): {type(failure).__name__}: {failure}" if failure is not None else ""
    )
    raise SymmetricAllocationError(
        f"{what} failed on rank(s) {failed_ranks} of {group.world_size}{local}", failed_ranks
    ) from failure


def agreed_symmetric_empty(
    symm_mem: Any,
    group: CPGroupLike,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    what: str,
    flag: torch.Tensor | None = None,
) -> torch.Tensor:
    """A zero-filled, synchronized ``symm_mem.empty(shape)`` (``symm_mem``:
    ``torch.distributed._symmetric_memory``) on every rank of ``group``, or
    ``SymmetricAllocationError`` naming ``what`` on every rank (collective: the ranks agree
    before the caller's rendezvous). ``flag``: ``agreement_flag``'s scratch (``None``:
    allocated here, outside the agreement).

    Raises:
        SymmetricAllocationError: on every rank, when the allocation failed on any.
        AgreementError: the agreement's all-gather failed on this rank.
    """
    if flag is None:
        flag = agreement_flag(group, device)
    buf: torch.Tensor | None = None
    failure: Exception | None = None
    try:  # rank-local: may fail on some ranks only (out of memory)
        buf = symm_mem.empty(shape, dtype=dtype, device=device)
        buf.zero_()
        torch.cuda.synchronize(device)
    except Exception as exc:
        failure = exc
    try:
        agree_on_local_step(group, flag, failure, what)
    except SymmetricAllocationError:
        buf = None  # freed now on the ranks that allocated, not with the traceback's frames
        raise
    assert buf is not None
    return buf


#: int64 words every rank sends in ``check_ranks_agree`` (the op's code, its fields, zeros),
#: so that ranks calling different ops still meet in one all-gather of one size.
_SIGNATURE_WORDS = 32
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def tensor_fields(name: str, t: torch.Tensor, first_dim: int = 0) -> dict[str, Any]:
    """``check_ranks_agree`` fields of tensor ``name``: rank, sizes from ``first_dim`` on (at
    most six; earlier ones may differ between ranks) and dtype."""
    fields: dict[str, Any] = {f"{name}.ndim": t.dim()}
    for i in range(first_dim, min(t.dim(), first_dim + 6)):
        fields[f"{name}.shape[{i}]"] = t.shape[i]
    return {**fields, f"{name}.dtype": t.dtype}


def check_ranks_agree(
    op: str, group: CPGroupLike, device: torch.device, fields: Mapping[str, Any]
) -> None:
    """Collective (check mode): raise ``ValueError`` on every rank when the ranks' ``fields``
    (at most 31 ints, bools or dtypes, keyed by what the message calls them) differ. One
    all-gather on ``device`` (the host for gloo); nothing for one rank, while tracing or
    during CUDA-graph capture.

    Raises:
        ValueError: the message names each field that differs, rank 0's value and the
            first rank with another (or that the ranks call different ops).
        AgreementError: the all-gather failed on this rank.
    """
    n = group.world_size
    if n == 1 or not host_checkable():
        return
    kinds = [op, *fields.values()]
    values = [zlib.crc32(op.encode())]
    values += [_DTYPES.index(v) if isinstance(v, torch.dtype) else int(v) for v in kinds[1:]]
    values += [0] * (_SIGNATURE_WORDS - len(values))  # callers pass at most 31 fields
    dev = torch.device("cpu") if getattr(group, "backend", None) == "gloo" else device
    table = torch.empty(n * _SIGNATURE_WORDS, dtype=torch.int64, device=dev)
    try:
        group.all_gather_into_tensor(table, torch.tensor(values, dtype=torch.int64, device=dev))
        rows = table.view(n, _SIGNATURE_WORDS).tolist()
    except Exception as exc:
        raise AgreementError(f"{op}: the check-mode all-gather failed: {exc}") from exc
    diffs = []
    for i, name in enumerate(["op", *fields]):
        r = next((r for r in range(1, n) if rows[r][i] != rows[0][i]), None)
        if r is None:
            continue
        if i == 0:  # another op: its fields mean other things
            ops = [op if rows[k][0] == values[0] else "another op" for k in (0, r)]
            diffs = [f"rank 0 calls {ops[0]}, rank {r} {ops[1]}"]
            break
        shown: list[Any] = [rows[0][i], rows[r][i]]
        if isinstance(kinds[i], torch.dtype):
            shown = [_DTYPES[v] if 0 <= v < len(_DTYPES) else v for v in shown]
        elif isinstance(kinds[i], bool):
            shown = [bool(v) for v in shown]
        diffs.append(f"{name} is {shown[0]} on rank 0 but {shown[1]} on rank {r}")
    if diffs:
        raise ValueError(
            f"{op}: the ranks' calls disagree (check mode; raised on rank "
            f"{group.rank_in_group} of {n}): " + "; ".join(diffs)
        )


def check_tensor_agreement(
    op: str, group: CPGroupLike, name: str, t: torch.Tensor, first_dim: int = 0, **extra: Any
) -> None:
    """Check mode: ``check_ranks_agree`` on the group's size, tensor ``name``'s fields
    (``tensor_fields``) and ``extra``, before a collective of ``t``; one attribute read
    outside check mode."""
    if check_state.enabled:
        fields = {"world size": group.world_size, **tensor_fields(name, t, first_dim), **extra}
        check_ranks_agree(op, group, t.device, fields)
