"""Process-group wrapper with the collective semantics serving engines use.

``CPGroup`` wraps a ``torch.distributed.ProcessGroup`` (gloo or nccl) and offers
``all_gather`` / ``reduce_scatter`` along any dim, an out-of-place ``all_reduce``,
``all_to_all_single`` and ``all_gather_into_tensor``. A world size of 1 never communicates.
Where a backend lacks a native collective, an equivalent built from ops every backend has
(``all_gather`` into a list, ``all_reduce``) is used instead, and remembered per group.

Every op accepts the protocol ``CPGroupLike``, so in-process simulated groups (cpattn_testing)
and user wrappers plug in wherever a ``CPGroup`` is expected; ``as_cp_group`` normalises a
``ProcessGroup``, a ``DeviceMesh`` (one dimension) or an existing wrapper into one, and
``shared_cp_group`` does the same through a memo, so that the ops (which resolve their group
argument on every call) share one weakly held wrapper per process group.
"""

from __future__ import annotations

import itertools
import operator
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, SupportsIndex, TypeVar, cast, runtime_checkable

import torch
import torch.distributed as dist

from cpattn_common.checks import check_tensors, is_bool_scalar
from cpattn_common.dispatch import refuse_grad
from cpattn_common.identity_memo import IdentityMemo

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "CPGroup",
    "CPGroupLike",
    "as_cp_group",
    "cache_owner",
    "check_all_gather_into_tensor_args",
    "check_all_to_all_single_args",
    "normalize_dim",
    "shared_cp_group",
    "trace_time_constant",
    "trace_time_group",
]

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names
# still work, with a FutureWarning per call site); earlier torch has only the old names. Dynamo
# traces both under either name. (None without torch.distributed, where no CPGroup is made.)
_all_gather_single: Any = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)
_reduce_scatter_single: Any = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None
)

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])

# Errors a backend raises when it does not implement a collective (or a dtype of it).
_UNSUPPORTED_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, NotImplementedError)
# What such an error's (lower-cased) text says; any other error of those types is re-raised.
# torch's c10d Backend base class words a missing op "Backend <name> does not support
# _allgather_base" (also _reduce_scatter_base, alltoall_base), as older gloo did for
# reduce_scatter ("ProcessGroupGloo does not support reduce_scatter").
_UNSUPPORTED_PHRASES: tuple[str, ...] = (
    "not supported",
    "unsupported",
    "not implemented",
    "does not support",
)


@runtime_checkable
class CPGroupLike(Protocol):
    """What every op needs from a context-parallel group.

    Attributes:
        world_size: number of ranks N in the group.
        rank_in_group: this rank's index r in ``[0, N)``.
        device_group: the underlying ``ProcessGroup`` (``None`` for simulated groups).
    """

    @property
    def world_size(self) -> int: ...

    @property
    def rank_in_group(self) -> int: ...

    @property
    def device_group(self) -> ProcessGroup | None: ...

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` in rank order."""
        ...

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over ranks, then return rank r's r-th equal chunk along ``dim``."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks (use the return value)."""
        ...

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Chunk n of ``input`` (dim 0) goes to rank n; chunk n of ``output`` comes from rank n."""
        ...

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output [N*T, ...]`` = every rank's ``input [T, ...]``, rank-major along dim 0."""
        ...

    def barrier(self) -> None:
        """Block until every rank of the group reached the barrier."""
        ...


def normalize_dim(dim: SupportsIndex, ndim: int) -> int:
    """Map ``dim`` in ``[-ndim, ndim)`` to ``[0, ndim)``; ``ValueError`` otherwise.

    ``dim`` is anything ``operator.index`` takes (an int, a numpy integer, a one-element integer
    tensor) except a bool: ``True`` as a dim is a bug, not 1. A float is refused too (it would
    be truncated).
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
    """Validate ``all_gather_into_tensor(output [N*T, ...], input [T, ...])`` arguments.

    Shared by every ``CPGroupLike`` implementation so that they reject the same inputs with the
    same messages.
    """
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
    """Validate equal-split ``all_to_all_single(output [N*C, ...], input [N*C, ...])`` arguments.

    ``output`` must not overlap ``input``: a backend writing received chunks while it still
    sends from the same memory returns wrong data (gloo's native all-to-all does).
    """
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
    """Whether ``a`` and ``b`` may share an element: the same storage and intersecting byte
    spans (conservative for interleaved strided views)."""
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
    """``t`` contiguous and without torch's conjugate or negative bit: the input of a
    collective. ``contiguous()`` keeps either bit, and gloo refuses a conjugated input
    (``view_as_real``); each ``resolve_*`` returns ``t`` itself when its bit is not set."""
    return t.resolve_conj().resolve_neg().contiguous()


def _contiguous_target(output: torch.Tensor) -> torch.Tensor:
    """``output`` itself when contiguous, else a contiguous scratch to copy back from.

    A lazily negated or conjugated view (torch's negative / conjugate bit) also gets a
    scratch: gloo wrote a negated view's values into a resolved copy, never into its memory
    (the caller's buffer was left as it was), and refused a conjugated one; ``copy_`` back
    honours either bit. Traced code skips that test: dynamo cannot trace ``is_neg()`` (such an
    output under ``torch.compile`` is untested).
    """
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

    The collectives are inference only: with grad mode on, a tensor argument that requires
    grad raises ``RuntimeError`` (``cpattn_common.dispatch.refuse_grad``), on every world size.
    Without that, the all-gathers failed with an obscure view error, and the others returned
    results without a gradient or with one that ignored the other ranks. A non-tensor argument
    raises ``TypeError``, also at world size 1. Inputs may carry torch's conjugate or negative
    bit (``z.conj()``, ``torch._neg_view``): a resolved copy is what travels.

    Attributes:
        world_size: N, the group size.
        rank_in_group: r, this process's rank inside the group.
        device_group: the wrapped ``ProcessGroup``.
        ranks: the global ranks of the group, in group-rank order.
    """

    def __init__(self, group: ProcessGroup | None = None, *, native_collectives: bool = True):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("CPGroup needs torch.distributed to be initialised")
        pg = group if group is not None else dist.group.WORLD
        if pg is None:
            raise RuntimeError("torch.distributed has no default process group")
        self._group: ProcessGroup = pg
        self._world_size = dist.get_world_size(pg)
        self._rank_in_group = dist.get_rank(pg)
        if self._rank_in_group < 0:
            # torch answers -1 on a rank outside the group; every collective would then be
            # wrong or fail obscurely (an all_reduce returned the input unreduced).
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the group "
                f"with ranks {list(dist.get_process_group_ranks(pg))}"
            )
        self.ranks: list[int] = list(dist.get_process_group_ranks(pg))
        self._native = native_collectives
        self._unsupported: set[str] = set()

    # -- attributes -------------------------------------------------------------------------
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

    # -- dispatch between native and fallback --------------------------------------------------
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

    # -- primitive collectives ----------------------------------------------------------------
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Gather ``input [T, ...]`` of every rank into ``output [N*T, ...]`` (rank-major).

        Args:
            output: ``[N*T, *rest]``, same dtype/device as ``input``; any strides.
            input: ``[T, *rest]``; any strides.
        """
        check_tensors("CPGroup.all_gather_into_tensor", output=output, input=input)
        refuse_grad("CPGroup.all_gather_into_tensor", output=output, input=input)
        n = self._world_size
        check_all_gather_into_tensor_args(output, input, n)
        if n == 1:
            output.copy_(input)
            return
        inp = _resolved_contiguous(input)
        out = _contiguous_target(output)

        def native() -> None:
            _all_gather_single(out, inp, group=self._group)

        def fallback() -> None:
            dist.all_gather(list(out.chunk(n, dim=0)), inp, group=self._group)

        self._dispatch("all_gather_into_tensor", native, fallback)
        if out is not output:
            output.copy_(out)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Equal-split all-to-all along dim 0: chunk n of ``input`` goes to rank n.

        Args:
            output: ``[N*C, *rest]``; chunk n (rows ``n*C:(n+1)*C``) is filled from rank n.
            input: ``[N*C, *rest]``, same shape/dtype/device as ``output``; any strides.
        """
        check_tensors("CPGroup.all_to_all_single", output=output, input=input)
        refuse_grad("CPGroup.all_to_all_single", output=output, input=input)
        n = self._world_size
        check_all_to_all_single_args(output, input, n)
        if n == 1:
            output.copy_(input)
            return
        inp = _resolved_contiguous(input)
        out = _contiguous_target(output)

        def native() -> None:
            dist.all_to_all_single(out, inp, group=self._group)

        def fallback() -> None:
            gathered = torch.empty((n, *inp.shape), dtype=inp.dtype, device=inp.device)
            dist.all_gather(list(gathered.unbind(0)), inp, group=self._group)
            # Rank p sent its chunk r to us: gathered[p] chunk r -> our chunk p.
            out.copy_(gathered.chunk(n, dim=1)[self._rank_in_group].reshape(out.shape))

        self._dispatch("all_to_all_single", native, fallback)
        if out is not output:
            output.copy_(out)

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
        # A complex sum is the sum of the real and imaginary parts: reduce the real view, as
        # torch does for the other collectives (its reduce_scatter_tensor does not, and nccl
        # refuses complex dtypes there).
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


try:  # imported with torch.distributed already; looked up here, not in traced code
    from torch.distributed.device_mesh import DeviceMesh as _DeviceMesh
except ImportError:  # pragma: no cover - torch without distributed

    class _DeviceMesh:  # type: ignore[no-redef]
        """Stands for the mesh class where torch has none: nothing is an instance."""


def _is_device_mesh(x: Any) -> bool:
    # One class, not a tuple: dynamo answers isinstance on a traced mesh for the class only.
    return isinstance(x, _DeviceMesh)


def _mesh_process_group(x: Any, mesh_dim: int | str | None) -> ProcessGroup | None:
    """The process group of dimension ``mesh_dim`` of ``x`` if ``x`` is a ``DeviceMesh``,
    else ``None``."""
    if not _is_device_mesh(x):
        return None
    if mesh_dim is None and x.ndim != 1:
        raise ValueError(
            f"a {x.ndim}-D DeviceMesh needs mesh_dim to pick the group dimension "
            f"(mesh_dim_names={x.mesh_dim_names})"
        )
    pg: ProcessGroup = x.get_group(mesh_dim if mesh_dim is not None else 0)
    return pg


def _not_a_group(x: Any) -> TypeError:
    return TypeError(
        "expected a ProcessGroup, a DeviceMesh or a CPGroupLike group wrapper, got "
        f"{type(x).__name__}"
    )


def as_cp_group(x: Any = None, *, mesh_dim: int | str | None = None) -> CPGroupLike:
    """Turn a ``ProcessGroup``, a ``DeviceMesh`` (dimension) or a group wrapper into a group.

    Every call wraps a process group anew (``shared_cp_group`` memoises one wrapper per
    group).

    Args:
        x: a ``CPGroupLike`` (returned as is), a ``ProcessGroup``, a ``DeviceMesh`` (1-D, or
            pick the dimension with ``mesh_dim``), or ``None`` for the default world group.
        mesh_dim: the mesh dimension (index or name) when ``x`` is a multi-dimensional mesh.

    Returns:
        A ``CPGroupLike``.
    """
    if isinstance(x, CPGroupLike):
        if mesh_dim is not None:
            raise ValueError("mesh_dim only applies to a DeviceMesh")
        return x
    if x is None or isinstance(x, dist.ProcessGroup):
        if mesh_dim is not None:
            raise ValueError("mesh_dim only applies to a DeviceMesh")
        return CPGroup(x)
    pg = _mesh_process_group(x, mesh_dim)
    if pg is None:
        raise _not_a_group(x)
    return CPGroup(pg)


class _SharedCPGroup(CPGroup):
    """The ``CPGroup`` that ``shared_cp_group`` memoises for a ``ProcessGroup``: it refers to
    the process group weakly, so that the memo (which holds this wrapper while the group
    lives) never keeps alive a group that ``destroy_process_group`` released and the caller
    dropped. A collective after that raises ``RuntimeError``, as one on a destroyed group
    does anyway.

    ``CPGroup`` reaches its process group only through ``self._group``; here that attribute
    is a property over a weak reference.
    """

    _group_ref: Callable[[], ProcessGroup | None]

    @property
    def _group(self) -> ProcessGroup:
        pg = self._group_ref()
        if pg is None:
            raise RuntimeError("the process group of this CPGroup was destroyed and released")
        return pg

    @_group.setter
    def _group(self, pg: ProcessGroup) -> None:
        self._group_ref = weakref.ref(pg)


_FAKE_TYPES: tuple[type, ...]
try:  # torch >= 2.5: dynamo hands opaque objects (a ProcessGroup) to traced code as fakes.
    from torch._library.fake_class_registry import FakeScriptObject

    _FAKE_TYPES = (FakeScriptObject,)
except ImportError:  # pragma: no cover - older torch
    _FAKE_TYPES = ()


def _unwrap_fake(obj: Any) -> Any:
    """The real object behind a dynamo ``FakeScriptObject`` (a traced ``ProcessGroup``)."""
    if _FAKE_TYPES and isinstance(obj, _FAKE_TYPES):
        return object.__getattribute__(obj, "real_obj")
    return obj


# Object -> its shared wrapper (None: the object is a CPGroupLike, its own wrapper). An object
# that takes no weak reference is not memoised: the memo would hold it for good.
_SHARED: IdentityMemo[CPGroupLike | None] = IdentityMemo(hold_unreferable=False)
_SHARED_ENTRIES = _SHARED.entries  # read directly on the hit path (no method call)
_is_compiling = torch.compiler.is_compiling


def shared_cp_group(x: Any = None, *, mesh_dim: int | str | None = None) -> CPGroupLike:
    """``as_cp_group(x)``, memoised: every caller gets the same wrapper of a process group.

    The ops resolve their group argument through this on every call, so a lookup is one dict
    read. A shared wrapper learns once which collectives its backend lacks, for every caller.
    Nothing here keeps a group alive: the memo forgets an object when it dies, and the
    wrapper of a ``ProcessGroup`` refers to it weakly (torch.distributed holds a group until
    ``destroy_process_group``; the caller's references hold it after that).

    Under ``torch.compile`` the memo is not traced (dynamo cannot trace ``id()`` of a process
    group on every torch we allow, nor the memo's lock): a ``ProcessGroup``, a mesh or ``None``
    is resolved at trace time, through the memo, and the graph uses that wrapper, guarded on
    the group's identity; a ``CPGroupLike`` is its own wrapper. So ``fullgraph=True`` works on
    a group no eager call resolved, and the graph shares the wrapper of eager callers.

    Args:
        x: a ``CPGroupLike`` (returned as is), a ``ProcessGroup`` (also the fake that
            ``torch.compile`` hands traced code for one), a ``DeviceMesh`` (1-D, or pick the
            dimension with ``mesh_dim``), or ``None`` for the default world group.
        mesh_dim: the mesh dimension (index or name) when ``x`` is a multi-dimensional mesh.

    Returns:
        A ``CPGroupLike``; for a ``ProcessGroup``, a mesh over it or ``None``, the one
        ``CPGroup`` shared by every caller while the process group lives.
    """
    if _is_compiling():
        return _traced_group(x, mesh_dim)
    if mesh_dim is None:  # the hit path: every op call resolves its group here
        entry = _SHARED_ENTRIES.get(id(x))
        if entry is not None and entry[0]() is x:
            shared = entry[1]
            if shared is None:
                return x  # type: ignore[no-any-return]  # a CPGroupLike: its own wrapper
            return shared
    return _resolve(x, mesh_dim)


def _lookup(x: Any, mesh_dim: int | str | None) -> CPGroupLike:
    """``shared_cp_group`` without its ``torch.compile`` branch (for code that runs at trace
    time, where ``is_compiling()`` may already be true)."""
    if mesh_dim is None:
        entry = _SHARED_ENTRIES.get(id(x))
        if entry is not None and entry[0]() is x:
            return x if entry[1] is None else entry[1]
    return _resolve(x, mesh_dim)


def _resolve(x: Any, mesh_dim: int | str | None) -> CPGroupLike:
    """``shared_cp_group(x, mesh_dim=mesh_dim)`` for an ``x`` the memo lacks (eager, or at
    trace time)."""
    if x is None:
        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if world is not None:
            # Memoised under the world group itself, never under None: a world destroyed and
            # initialised again is never answered with the old one.
            return _lookup(world, None)
        return as_cp_group(None)  # raises: no default group
    real = _unwrap_fake(x)
    if real is not x:
        return _lookup(real, mesh_dim)
    if isinstance(x, dist.ProcessGroup):
        if mesh_dim is not None:
            raise ValueError("mesh_dim only applies to a DeviceMesh")
        return cast(CPGroupLike, _SHARED.setdefault(x, _SharedCPGroup(x)))
    if isinstance(x, CPGroupLike):
        if mesh_dim is not None:
            raise ValueError("mesh_dim only applies to a DeviceMesh")
        _SHARED.setdefault(x, None)
        return x
    pg = _mesh_process_group(x, mesh_dim)
    if pg is None:
        raise _not_a_group(x)
    group = _lookup(pg, None)
    if mesh_dim is None:
        _SHARED.setdefault(x, group)
    return group


def _traced_group(x: Any, mesh_dim: int | str | None) -> CPGroupLike:
    """``shared_cp_group`` as dynamo traces it: what only the memo can answer is resolved at
    trace time (``_trace_time_name``), and the graph reads the wrapper back by name."""
    if x is None or isinstance(x, dist.ProcessGroup) or _is_device_mesh(x):
        return getattr(_TRACED, _trace_time_name(x, mesh_dim))  # type: ignore[no-any-return]
    if mesh_dim is not None:
        raise ValueError("mesh_dim only applies to a DeviceMesh")
    return x  # type: ignore[no-any-return]  # a CPGroupLike: its own wrapper


# The shared wrappers that compiled graphs use, one attribute each (a graph reads its wrapper
# as an attribute of a global, which dynamo looks up afresh for every name), and the name of
# each process group's. An attribute goes with its group.
_TRACED = types.ModuleType(f"{__name__}._traced")
_TRACED_NAMES: IdentityMemo[str] = IdentityMemo()
_TRACED_NUMBERS = itertools.count()


def _traced_name(pg: ProcessGroup, wrapper: CPGroupLike) -> str:
    """The attribute of ``_TRACED`` that holds the shared wrapper of ``pg``: ``wrapper``, unless
    ``pg`` has one there already. The attribute goes when ``pg`` dies."""
    name = _TRACED_NAMES.get(pg, None)
    if name is not None:
        return name
    new = f"group_{next(_TRACED_NUMBERS)}"
    setattr(_TRACED, new, wrapper)  # before the name is published
    name = _TRACED_NAMES.setdefault(pg, new)
    if name == new:
        weakref.finalize(pg, _TRACED.__dict__.pop, name, None)
    else:  # another thread named one first
        delattr(_TRACED, new)
    return name


def trace_time_constant(fn: _F) -> _F:
    """``torch._dynamo.assume_constant_result`` without importing dynamo (about 1 s).

    Dynamo runs a function carrying this mark at trace time on the real arguments (guarding on
    the identity of an object argument) and bakes its result into the graph as a constant;
    eager calls are unaffected. The result should be a constant (a str, an int): dynamo makes
    an object result a constant whose methods traced code cannot call. Pass process groups,
    meshes and constants: torch before 2.13 cannot pass other objects (a ``CPGroup``).
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def trace_time_group(x: Any) -> Any:
    """What stands for the group ``x`` in a call to a ``trace_time_constant`` function: the
    process group of a ``CPGroup``, ``x`` itself otherwise.

    torch 2.11's dynamo cannot pass a ``CPGroup`` object to such a function (it raises
    ``AsPythonConstantNotImplementedError``), but it can pass a process group. A ``CPGroup``
    runs the same collectives on the same process group as that group's shared wrapper, so
    code resolved from its process group at trace time behaves the same (a graph does not
    honour ``native_collectives=False``: the results are equal, the fallbacks are only
    slower). Subclasses and other ``CPGroupLike`` objects, which may run their collectives
    their own way, stand for themselves (under ``torch.compile`` they need a torch whose
    dynamo passes objects, 2.13 does).
    """
    if type(x) is CPGroup or type(x) is _SharedCPGroup:
        return x.device_group
    return x


@trace_time_constant
def _trace_time_name(x: Any, mesh_dim: int | str | None) -> str:
    """The attribute of ``_TRACED`` holding the shared wrapper of ``x`` (a ``ProcessGroup``, a
    mesh or ``None``), resolved through the memo at trace time."""
    group = _lookup(x, mesh_dim)
    pg = group.device_group
    if pg is None:  # pragma: no cover - the wrappers of groups and meshes have one
        raise TypeError(f"{type(x).__name__} resolved to {type(group).__name__} without a group")
    return _traced_name(pg, group)


def cache_owner(group: CPGroupLike) -> object:
    """What per-group caches key by: the process group under ``group``, so that several
    wrappers of one process group (a ``CPGroup`` made per layer, say) share one entry;
    ``group`` itself when it has none (simulated groups).

    Raises:
        RuntimeError: ``group`` is a ``shared_cp_group`` wrapper whose process group was
            destroyed and released.
    """
    return getattr(group, "device_group", None) or group
