"""Group arguments: the ``CPGroupLike`` protocol and its normalisation.

``CPGroup`` (in ``cpattn_common.cpgroup``, re-exported here) wraps a
``torch.distributed.ProcessGroup``. Every op accepts the protocol ``CPGroupLike``, so
in-process simulated groups (cpattn_testing) and user wrappers plug in wherever a ``CPGroup``
is expected; ``as_cp_group`` normalises a ``ProcessGroup``, a ``DeviceMesh`` (one dimension)
or an existing wrapper into one, and ``shared_cp_group`` does the same through a memo, so that
the ops (which resolve their group argument on every call) share one weakly held wrapper per
process group.
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
    "as_cp_group",
    "cache_owner",
    "check_all_gather_into_tensor_args",
    "check_all_to_all_single_args",
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
