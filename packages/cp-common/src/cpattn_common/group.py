"""Group arguments: a ``ProcessGroup``, a ``DeviceMesh``, a ``CPGroupLike`` wrapper or a
``GroupCoordinatorLike``, checked before any collective. ``as_cp_group`` normalises one into a
``CPGroupLike``; ``shared_cp_group`` memoises one weakly held wrapper per process group.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

import torch
import torch.distributed as dist

from cpattn_common.cpgroup import (
    CPGroup,
    check_all_gather_into_tensor_args,
    check_all_to_all_single_args,
    normalize_dim,
)
from cpattn_common.identity_memo import IdentityMemo

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "CPGroup",
    "CPGroupLike",
    "GroupCoordinatorLike",
    "as_cp_group",
    "cache_owner",
    "check_all_gather_into_tensor_args",
    "check_all_to_all_single_args",
    "check_group",
    "normalize_dim",
    "shared_cp_group",
    "trace_time_constant",
    "trace_time_group",
]

_F = TypeVar("_F", bound=Callable[..., Any])


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


class GroupCoordinatorLike(Protocol):
    """An engine's group object shaped like vLLM's ``GroupCoordinator``. Only these three
    members are read: the ops run their own collectives on ``device_group``.

    Attributes:
        world_size: number of ranks N of ``device_group``.
        rank_in_group: this process's rank in ``device_group``, in ``[0, N)``.
        device_group: the ``ProcessGroup`` (nccl on GPUs, gloo on CPUs) the collectives use.
    """

    @property
    def world_size(self) -> int: ...

    @property
    def rank_in_group(self) -> int: ...

    @property
    def device_group(self) -> ProcessGroup: ...


# An object with some of these but not all of the protocol's is a GroupCoordinatorLike.
_COORDINATOR_MEMBERS = ("world_size", "rank_in_group", "device_group")
_PROTOCOL_MEMBERS = (
    *_COORDINATOR_MEMBERS,
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all_single",
    "all_gather_into_tensor",
    "barrier",
)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_ranks(owner: str, world_size: Any, rank_in_group: Any, pg: Any) -> None:
    if not _is_int(world_size):
        raise TypeError(
            f"{owner}.world_size must be an int, got {world_size!r} ({type(world_size).__name__})"
        )
    if not _is_int(rank_in_group):
        raise TypeError(
            f"{owner}.rank_in_group must be an int, got {rank_in_group!r} "
            f"({type(rank_in_group).__name__})"
        )
    if world_size < 1:
        raise ValueError(f"{owner}.world_size must be >= 1, got {world_size}")
    if not 0 <= rank_in_group < world_size:
        raise ValueError(
            f"{owner}.rank_in_group is {rank_in_group}, outside [0, world_size={world_size})"
        )
    if not isinstance(pg, dist.ProcessGroup):
        return
    size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if rank < 0:  # torch answers -1 on a rank outside the group
        raise ValueError(f"this process is not a member of {owner}.device_group")
    if world_size != size:
        raise ValueError(
            f"{owner}.world_size is {world_size}, but its device_group has {size} ranks"
        )
    if rank_in_group != rank:
        raise ValueError(
            f"{owner}.rank_in_group is {rank_in_group}, but this process is rank {rank} of "
            "its device_group"
        )


def check_group(group: CPGroupLike) -> CPGroupLike:
    """Check a group wrapper's ``world_size`` and ``rank_in_group`` (against its
    ``device_group`` where that is a ``ProcessGroup``); return it.

    Raises:
        TypeError: ``world_size`` or ``rank_in_group`` is not an int (a bool is refused).
        ValueError: a size < 1, a rank outside ``[0, world_size)``, or either disagreeing with
            ``device_group`` (also when this process is not a member of it).
    """
    _check_ranks(type(group).__name__, group.world_size, group.rank_in_group, group.device_group)
    return group


def _is_coordinator(x: Any) -> bool:
    return any(hasattr(x, m) for m in _COORDINATOR_MEMBERS) and not all(
        hasattr(x, m) for m in _PROTOCOL_MEMBERS
    )


def _coordinator_group(x: Any) -> ProcessGroup:
    owner = type(x).__name__
    missing = [m for m in _COORDINATOR_MEMBERS if not hasattr(x, m)]
    if missing:
        raise TypeError(
            f"{owner} is taken for a GroupCoordinator-like group (world_size, rank_in_group, "
            f"device_group), but it has no {', '.join(missing)}"
        )
    pg = _unwrap_fake(x.device_group)
    _check_ranks(owner, x.world_size, x.rank_in_group, pg)
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(
            f"{owner}.device_group must be a torch.distributed ProcessGroup, got "
            f"{type(pg).__name__} (a group object without one implements every CPGroupLike "
            "collective itself)"
        )
    return pg


try:  # imported with torch.distributed already; looked up here, not in traced code
    from torch.distributed.device_mesh import DeviceMesh as _DeviceMesh
except ImportError:  # pragma: no cover - torch without distributed

    class _DeviceMesh:  # type: ignore[no-redef]
        pass


def _is_device_mesh(x: Any) -> bool:
    # One class, not a tuple: dynamo answers isinstance on a traced mesh for the class only.
    return isinstance(x, _DeviceMesh)


def _mesh_process_group(x: Any, mesh_dim: int | str | None) -> ProcessGroup | None:
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
        "expected a ProcessGroup, a DeviceMesh, a CPGroupLike group wrapper or a "
        f"GroupCoordinator-like object (world_size, rank_in_group, device_group), got "
        f"{type(x).__name__}"
    )


def _process_group_of(x: Any, mesh_dim: int | str | None) -> ProcessGroup:
    pg = _mesh_process_group(x, mesh_dim)
    if pg is not None:
        return pg
    if not _is_coordinator(x):
        raise _not_a_group(x)
    if mesh_dim is not None:
        raise ValueError("mesh_dim only applies to a DeviceMesh")
    return _coordinator_group(x)


def as_cp_group(x: Any = None, *, mesh_dim: int | str | None = None) -> CPGroupLike:
    """Turn a group argument into a checked ``CPGroupLike`` (a process group is wrapped anew).

    Args:
        x: a ``CPGroupLike`` (checked with ``check_group``, then returned as is), a
            ``ProcessGroup``, a ``DeviceMesh`` (1-D, or pick the dimension with ``mesh_dim``),
            a ``GroupCoordinatorLike`` (checked; a ``CPGroup`` of its ``device_group``), or
            ``None`` for the default world group.
        mesh_dim: the mesh dimension (index or name) when ``x`` is a multi-dimensional mesh.

    Returns:
        A ``CPGroupLike``.

    Raises:
        TypeError: ``x`` is none of those; a group object without ``world_size``,
            ``rank_in_group`` or ``device_group``, or with a member of the wrong type (a
            ``device_group`` that is not a ``ProcessGroup`` where its collectives are ours).
        ValueError: ``rank_in_group`` outside ``[0, world_size)``, or ``world_size`` /
            ``rank_in_group`` disagreeing with ``device_group``; ``mesh_dim`` for a non-mesh.
    """
    if isinstance(x, CPGroupLike):
        if mesh_dim is not None:
            raise ValueError("mesh_dim only applies to a DeviceMesh")
        return check_group(x)
    if x is None or isinstance(x, dist.ProcessGroup):
        if mesh_dim is not None:
            raise ValueError("mesh_dim only applies to a DeviceMesh")
        return CPGroup(x)
    return CPGroup(_process_group_of(x, mesh_dim))


class _SharedCPGroup(CPGroup):
    """The memoised ``CPGroup`` of a ``ProcessGroup``: ``_group`` is a weak reference, so the
    memo never keeps a destroyed group alive."""

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


# Object -> its shared wrapper (None: a CPGroupLike, its own wrapper), for checked objects.
_SHARED: IdentityMemo[CPGroupLike | None] = IdentityMemo(hold_unreferable=False)
_SHARED_ENTRIES = _SHARED.entries  # read directly on the hit path (no method call)
_is_compiling = torch.compiler.is_compiling


def shared_cp_group(x: Any = None, *, mesh_dim: int | str | None = None) -> CPGroupLike:
    """``as_cp_group(x)``, memoised: every caller gets the same wrapper of a process group.

    A lookup is one dict read; nothing here keeps a group alive. Under ``torch.compile`` the
    group is resolved at trace time through the memo, so compiled and eager callers share one
    wrapper. An object is checked when the memo first meets it (and at trace time).

    Args:
        x: a ``CPGroupLike`` (returned as is), a ``ProcessGroup`` (also the fake that
            ``torch.compile`` hands traced code for one), a ``DeviceMesh`` (1-D, or pick the
            dimension with ``mesh_dim``), a ``GroupCoordinatorLike``, or ``None`` for the
            default world group.
        mesh_dim: the mesh dimension (index or name) when ``x`` is a multi-dimensional mesh.

    Returns:
        A ``CPGroupLike``; for a ``ProcessGroup``, a mesh over it, a ``GroupCoordinatorLike``
        or ``None``, the one ``CPGroup`` shared by every caller while the process group lives.

    Raises:
        TypeError, ValueError: as ``as_cp_group``.
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
    """``shared_cp_group`` without its ``torch.compile`` branch (for trace-time code)."""
    if mesh_dim is None:
        entry = _SHARED_ENTRIES.get(id(x))
        if entry is not None and entry[0]() is x:
            return x if entry[1] is None else entry[1]
    return _resolve(x, mesh_dim)


def _resolve(x: Any, mesh_dim: int | str | None) -> CPGroupLike:
    """``shared_cp_group`` for an ``x`` the memo lacks."""
    if x is None:
        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if world is not None:
            # Memoised under the world group itself, so a re-initialised world is new.
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
        check_group(x)
        _SHARED.setdefault(x, None)
        return x
    group = _lookup(_process_group_of(x, mesh_dim), None)
    if mesh_dim is None:
        _SHARED.setdefault(x, group)
    return group


def _traced_group(x: Any, mesh_dim: int | str | None) -> CPGroupLike:
    """``shared_cp_group`` as dynamo traces it: resolved at trace time, read back by name."""
    if x is None or isinstance(x, dist.ProcessGroup) or _is_device_mesh(x):
        return getattr(_TRACED, _trace_time_name(x, mesh_dim))  # type: ignore[no-any-return]
    if mesh_dim is not None:
        raise ValueError("mesh_dim only applies to a DeviceMesh")
    if _is_coordinator(x):  # the shared wrapper of its device_group
        return getattr(_TRACED, _trace_time_name(x, None))  # type: ignore[no-any-return]
    if _TRACE_TIME_OBJECTS:
        _trace_time_check(x)
    return x  # type: ignore[no-any-return]  # a CPGroupLike: its own wrapper


# The shared wrappers compiled graphs read, one attribute per process group (gone with it).
_TRACED = types.ModuleType(f"{__name__}._traced")
_TRACED_NAMES: IdentityMemo[str] = IdentityMemo()
_TRACED_NUMBERS = itertools.count()


def _traced_name(pg: ProcessGroup, wrapper: CPGroupLike) -> str:
    """The attribute of ``_TRACED`` holding the shared wrapper of ``pg`` (set on first use)."""
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
    """``torch._dynamo.assume_constant_result`` without importing dynamo (about 1 s): dynamo
    runs the function at trace time and bakes its result (a str, an int) into the graph. Pass
    process groups, meshes and constants (torch before 2.13 cannot pass other objects).
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def trace_time_group(x: Any) -> Any:
    """What stands for the group ``x`` in a call to a ``trace_time_constant`` function: the
    process group of a plain ``CPGroup`` or a ``GroupCoordinatorLike`` (checked), ``x`` itself
    otherwise (older dynamo cannot pass a ``CPGroup`` object; other wrappers run their own
    collectives).
    """
    if type(x) is CPGroup or type(x) is _SharedCPGroup:
        return x.device_group
    if x is None or isinstance(x, dist.ProcessGroup) or _is_device_mesh(x):
        return x  # (dynamo cannot ask a traced process group for an attribute it lacks)
    if _is_coordinator(x):
        _trace_time_name(x, None)  # checks it (at trace time under torch.compile)
        return x.device_group
    return x


@trace_time_constant
def _trace_time_name(x: Any, mesh_dim: int | str | None) -> str:
    """The ``_TRACED`` attribute of ``x``'s shared wrapper, resolved at trace time."""
    group = _lookup(x, mesh_dim)
    pg = group.device_group
    if pg is None:  # pragma: no cover - the wrappers of groups and meshes have one
        raise TypeError(f"{type(x).__name__} resolved to {type(group).__name__} without a group")
    return _traced_name(pg, group)


# Whether dynamo passes any object to a trace_time_constant function.
_TRACE_TIME_OBJECTS = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


@trace_time_constant
def _trace_time_check(group: Any) -> bool:
    """``check_group(group)`` at trace time (a wrapper no eager call resolved)."""
    check_group(group)
    return True


def cache_owner(group: CPGroupLike) -> object:
    """What per-group caches key by: the process group under ``group`` (wrappers of one
    process group share an entry), else ``group`` itself.

    Raises:
        RuntimeError: ``group`` is a ``shared_cp_group`` wrapper whose process group was
            destroyed and released.
    """
    return getattr(group, "device_group", None) or group
