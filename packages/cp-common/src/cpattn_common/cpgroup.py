"""``CPGroup``: the collectives serving engines use, over a ``torch.distributed`` process group.

Where a backend lacks a native collective, a portable fallback is used (and remembered per
group). The argument checks here are shared with every ``CPGroupLike`` implementation.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, SupportsIndex, TypeVar

import torch
import torch.distributed as dist

from cpattn_common.checks import check_bool, check_tensors, is_bool_scalar
from cpattn_common.dispatch import refuse_grad

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "CPGroup",
    "check_all_gather_into_tensor_args",
    "check_all_to_all_single_args",
    "normalize_dim",
]


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names
# warn); earlier torch has only the old names.
_all_gather_single: Any = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)
_reduce_scatter_single: Any = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None
)

_T = TypeVar("_T")

# Errors a backend raises for a collective it lacks, recognised by their (lower-cased) text.
_UNSUPPORTED_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, NotImplementedError)
_UNSUPPORTED_PHRASES: tuple[str, ...] = (
    "not supported",
    "unsupported",
    "not implemented",
    "does not support",
)


def normalize_dim(dim: SupportsIndex, ndim: int) -> int:
    """Map ``dim`` in ``[-ndim, ndim)`` to ``[0, ndim)``; ``ValueError`` otherwise.

    ``dim`` is anything ``operator.index`` takes except a bool (``TypeError``, as for a float).
    """
    if isinstance(dim, int) and not isinstance(dim, bool):  # the common case
        index = dim
    else:
        if is_bool_scalar(dim):  # operator.index may take it as 0 / 1
            raise TypeError(f"dim must be an int, got {type(dim).__name__}")
        try:
            index = operator.index(dim)
        except TypeError:
            raise TypeError(f"dim must be an int, got {type(dim).__name__}") from None
    if ndim < 1:
        raise ValueError("collectives along a dim need a tensor with at least 1 dimension")
    if not -ndim <= index < ndim:
        raise ValueError(f"dim {index} is out of range for a tensor with {ndim} dimensions")
    return index % ndim


def _check_same(output: torch.Tensor, input: torch.Tensor, op: str) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"{op}: output dtype {output.dtype} != input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{op}: output device {output.device} != input device {input.device}")


def check_all_gather_into_tensor_args(
    output: torch.Tensor, input: torch.Tensor, world_size: int
) -> None:
    """Validate ``all_gather_into_tensor(output [N*T, ...], input [T, ...])`` arguments
    (``TypeError`` for a dtype mismatch, ``ValueError`` for a device or shape one)."""
    _check_same(output, input, "all_gather_into_tensor")
    if input.dim() < 1:
        raise ValueError("all_gather_into_tensor needs tensors with at least 1 dimension")
    expected = (world_size * input.shape[0], *input.shape[1:])
    if tuple(output.shape) != expected:
        raise ValueError(
            f"all_gather_into_tensor: output shape {tuple(output.shape)} != {expected} "
            f"(world_size {world_size} x input {tuple(input.shape)})"
        )


def check_all_to_all_single_args(
    output: torch.Tensor, input: torch.Tensor, world_size: int
) -> None:
    """Validate equal-split ``all_to_all_single(output [N*C, ...], input [N*C, ...])`` arguments
    (``ValueError`` also when ``output`` overlaps ``input``: gloo would return wrong data)."""
    _check_same(output, input, "all_to_all_single")
    if _may_overlap(output, input):
        raise ValueError("all_to_all_single: output overlaps input; pass separate buffers")
    if output.shape != input.shape:
        raise ValueError(
            f"all_to_all_single: output shape {tuple(output.shape)} != input shape "
            f"{tuple(input.shape)}"
        )
    if input.dim() < 1 or input.shape[0] % world_size != 0:
        raise ValueError(
            f"all_to_all_single: dim 0 of shape {tuple(input.shape)} must be divisible by "
            f"world_size {world_size}"
        )


def _may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share an element (same storage, intersecting byte spans)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:  # torch strides are never negative
        extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        last = t.storage_offset() + extent
        return int(t.storage_offset()) * t.element_size(), int(last + 1) * t.element_size()

    (a_lo, a_hi), (b_lo, b_hi) = span(a), span(b)
    return a_lo < b_hi and b_lo < a_hi


def _resolved_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and without torch's conjugate or negative bit (gloo refuses those)."""
    return t.resolve_conj().resolve_neg().contiguous()


def _contiguous_target(output: torch.Tensor) -> torch.Tensor:
    """``output`` itself when contiguous and without a negative or conjugate bit, else a
    contiguous scratch to copy back from (traced code skips the bit test)."""
    if output.is_contiguous() and (
        torch.compiler.is_compiling() or not (output.is_neg() or output.is_conj())
    ):
        return output
    return torch.empty_like(output, memory_format=torch.contiguous_format)


class CPGroup:
    """A ``CPGroupLike`` over a ``torch.distributed`` process group.

    Args:
        group: the process group; ``None`` means the default (world) group.
        native_collectives: use the backend's native ``all_gather_into_tensor``,
            ``reduce_scatter_tensor`` and ``all_to_all_single`` when it has them (default).
            ``False`` forces the portable fallbacks (used by tests; slower).

    The collectives are inference only: in grad mode a tensor that requires grad raises
    ``RuntimeError``; a non-tensor argument raises ``TypeError``, also at world size 1.

    Attributes:
        world_size: N, the group size.
        rank_in_group: r, this process's rank inside the group.
        device_group: the wrapped ``ProcessGroup``.
        ranks: the global ranks of the group, in group-rank order.
    """

    def __init__(self, group: ProcessGroup | None = None, *, native_collectives: bool = True):
        native_collectives = check_bool("native_collectives", native_collectives)
        # new_group() hands a non-member its NON_GROUP_MEMBER marker: refused below by name.
        given: object = group  # whatever the caller passed, whatever the annotation says
        if (
            given is not None
            and not isinstance(given, dist.ProcessGroup)
            and given is not getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
        ):
            raise TypeError(
                f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("CPGroup needs torch.distributed to be initialised")
        pg = group if group is not None else dist.group.WORLD
        if pg is None:
            raise RuntimeError("torch.distributed has no default process group")
        self._group: ProcessGroup = pg
        self._world_size = dist.get_world_size(pg)
        self._rank_in_group = dist.get_rank(pg)
        if self._rank_in_group < 0:  # torch answers -1 outside the group
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the group "
                f"with ranks {list(dist.get_process_group_ranks(pg))}"
            )
        self.ranks: list[int] = list(dist.get_process_group_ranks(pg))
        self._native = native_collectives
        self._unsupported: set[str] = set()

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank_in_group(self) -> int:
        return self._rank_in_group

    @property
    def device_group(self) -> ProcessGroup:
        return self._group

    @property
    def group_name(self) -> str:
        """The process group's name (what symmetric-memory rendezvous keys on)."""
        return str(self._group.group_name)

    @property
    def backend(self) -> str:
        """The backend name, e.g. ``"gloo"`` or ``"nccl"``."""
        return str(dist.get_backend(self._group))

    def __repr__(self) -> str:
        return (
            f"CPGroup(world_size={self._world_size}, rank_in_group={self._rank_in_group}, "
            f"ranks={self.ranks}, backend={self.backend!r})"
        )

    def _dispatch(self, name: str, native: Callable[[], _T], fallback: Callable[[], _T]) -> _T:
        if not self._native or name in self._unsupported:
            return fallback()
        try:
            return native()
        except _UNSUPPORTED_ERRORS as exc:
            message = str(exc).lower()
            if not any(phrase in message for phrase in _UNSUPPORTED_PHRASES):
                raise
            self._unsupported.add(name)
            return fallback()

    def _out_of_place(
        self,
        name: str,
        output: torch.Tensor,
        input: torch.Tensor,
        check_args: Callable[[torch.Tensor, torch.Tensor, int], object],
        native: Callable[[torch.Tensor, torch.Tensor], None],
        fallback: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> None:
        """The checks, world size 1 and contiguous staging around a collective from ``input``
        into ``output``; ``native`` / ``fallback`` (``_dispatch``) get the staged
        ``(out, inp)``."""
        op = f"CPGroup.{name}"
        check_tensors(op, output=output, input=input)
        refuse_grad(op, output=output, input=input)
        check_args(output, input, self._world_size)
        if self._world_size == 1:
            output.copy_(input)
            return
        inp = _resolved_contiguous(input)
        out = _contiguous_target(output)
        self._dispatch(name, lambda: native(out, inp), lambda: fallback(out, inp))
        if out is not output:
            output.copy_(out)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Gather ``input [T, ...]`` of every rank into ``output [N*T, ...]`` (rank-major).

        Args:
            output: ``[N*T, *rest]``, same dtype/device as ``input``; any strides.
            input: ``[T, *rest]``; any strides.
        """
        n = self._world_size

        def native(out: torch.Tensor, inp: torch.Tensor) -> None:
            _all_gather_single(out, inp, group=self._group)

        def fallback(out: torch.Tensor, inp: torch.Tensor) -> None:
            dist.all_gather(list(out.chunk(n, dim=0)), inp, group=self._group)

        self._out_of_place(
            "all_gather_into_tensor", output, input, check_all_gather_into_tensor_args,
            native, fallback,
        )  # fmt: skip

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Equal-split all-to-all along dim 0: chunk n of ``input`` goes to rank n.

        Args:
            output: ``[N*C, *rest]``; chunk n (rows ``n*C:(n+1)*C``) is filled from rank n.
            input: ``[N*C, *rest]``, same shape/dtype/device as ``output``; any strides.
        """
        n = self._world_size

        def native(out: torch.Tensor, inp: torch.Tensor) -> None:
            dist.all_to_all_single(out, inp, group=self._group)

        def fallback(out: torch.Tensor, inp: torch.Tensor) -> None:
            gathered = torch.empty((n, *inp.shape), dtype=inp.dtype, device=inp.device)
            dist.all_gather(list(gathered.unbind(0)), inp, group=self._group)
            # Rank p sent its chunk r to us: gathered[p] chunk r -> our chunk p.
            out.copy_(gathered.chunk(n, dim=1)[self._rank_in_group].reshape(out.shape))

        self._out_of_place(
            "all_to_all_single", output, input, check_all_to_all_single_args, native, fallback
        )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks, out of place.

        Args:
            tensor: any shape and strides.

        Returns:
            A new contiguous tensor holding the sum (world size 1: ``tensor`` itself).
        """
        check_tensors("CPGroup.all_reduce", tensor=tensor)
        refuse_grad("CPGroup.all_reduce", tensor=tensor)
        if self._world_size == 1:
            return tensor
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=self._group)
        return out

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` in rank order.

        Args:
            tensor: ``[*pre, S, *post]`` with ``S`` at position ``dim``; any strides.
            dim: the concatenation dim (negative dims count from the end).

        Returns:
            ``[*pre, N*S, *post]`` (world size 1: ``tensor`` itself).
        """
        check_tensors("CPGroup.all_gather", tensor=tensor)
        refuse_grad("CPGroup.all_gather", tensor=tensor)
        d = normalize_dim(dim, tensor.dim())
        n = self._world_size
        if n == 1:
            return tensor
        inp = tensor.contiguous()
        gathered = torch.empty(
            (n * inp.shape[0], *inp.shape[1:]), dtype=inp.dtype, device=inp.device
        )
        self.all_gather_into_tensor(gathered, inp)
        if d == 0:
            return gathered
        shape = list(inp.shape)
        # [N, *shape] -> move the rank axis next to dim d -> merge (rank-major within dim d).
        stacked = gathered.view(n, *shape).movedim(0, d)
        shape[d] *= n
        return stacked.reshape(shape)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over ranks, then keep this rank's equal chunk along ``dim``.

        Args:
            tensor: ``[*pre, S, *post]`` with ``S`` (divisible by N) at position ``dim``.
            dim: the scatter dim (negative dims count from the end).

        Returns:
            ``[*pre, S/N, *post]``, contiguous: rows ``r*S/N:(r+1)*S/N`` of the sum
            (world size 1: ``tensor`` itself).
        """
        check_tensors("CPGroup.reduce_scatter", tensor=tensor)
        refuse_grad("CPGroup.reduce_scatter", tensor=tensor)
        d = normalize_dim(dim, tensor.dim())
        n = self._world_size
        size = tensor.shape[d]
        if size % n != 0:
            raise ValueError(
                f"reduce_scatter: size {size} of dim {dim} (shape {tuple(tensor.shape)}) is not "
                f"divisible by world_size {n}"
            )
        if n == 1:
            return tensor
        moved = _resolved_contiguous(tensor.movedim(d, 0))
        out = torch.empty((size // n, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
        # Reduce a complex tensor's real view (nccl refuses complex reduce_scatter_tensor).
        send, recv = (
            (torch.view_as_real(moved), torch.view_as_real(out))
            if moved.is_complex()
            else (moved, out)
        )

        def native() -> None:
            _reduce_scatter_single(recv, send, group=self._group)

        def fallback() -> None:
            summed = send.clone()
            dist.all_reduce(summed, group=self._group)
            recv.copy_(summed.chunk(n, dim=0)[self._rank_in_group])

        self._dispatch("reduce_scatter_tensor", native, fallback)
        return out.movedim(0, d).contiguous()

    def barrier(self) -> None:
        """Block until every rank reached the barrier (no-op for world size 1)."""
        if self._world_size > 1:
            dist.barrier(group=self._group)
