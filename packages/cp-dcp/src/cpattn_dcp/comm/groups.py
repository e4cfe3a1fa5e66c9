"""Group resolution (cheap, memoised) and the string tokens the registered ops carry.

``torch.library`` ops cannot take a ``ProcessGroup`` or a Python group wrapper as an
argument, so the public functions pass a token string that names the group in a registry.
Under ``torch.compile`` the token, world size and rank are computed once at trace time
(``assume_constant_result``) and baked into the graph as constants.

Neither the memo nor the token registry keeps a group alive: their entries go with the group
(a graph only runs while its group is alive: the caller passes or holds it).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from cpattn_common.group import CPGroup, CPGroupLike, as_cp_group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = ["group_from_token", "group_rank", "group_token", "group_world_size", "resolve_group"]

# Neither table keeps a group alive: an entry holds its object through a weak reference whose
# callback drops the entry when the object dies (objects that take no weak reference are held,
# so that their id() is not reused while an entry names them).
# id(user object) -> (reference to the user object, resolved group; None: the object itself).
_RESOLVED: dict[int, tuple[Callable[[], Any], CPGroupLike | None]] = {}
# token -> reference to the group it names; id(group) -> (that reference, its token). A token
# is never reused: one for a group that died raises KeyError, even when a new group gets the
# dead one's address.
_TOKENS: dict[str, Callable[[], Any]] = {}
_TOKEN_OF: dict[int, tuple[Callable[[], Any], str]] = {}
_TOKEN_NUMBERS = itertools.count()

_FAKE_TYPES: tuple[type, ...]
try:  # torch >= 2.5: dynamo hands opaque objects (ProcessGroup) to traced code as fakes.
    from torch._library.fake_class_registry import FakeScriptObject

    _FAKE_TYPES = (FakeScriptObject,)
except ImportError:  # pragma: no cover - older torch
    _FAKE_TYPES = ()


def _unwrap_fake(obj: Any) -> Any:
    """The real object behind a dynamo ``FakeScriptObject`` (a traced ``ProcessGroup``)."""
    if _FAKE_TYPES and isinstance(obj, _FAKE_TYPES):
        return object.__getattribute__(obj, "real_obj")
    return obj


def _forget(table: dict[Any, Any], key: Any, ref: Any) -> None:
    """Weak-reference callback: drop ``table[key]`` if it is still the entry of ``ref``."""
    entry = table.get(key)
    if entry is not None and (entry[0] if isinstance(entry, tuple) else entry) is ref:
        del table[key]


def _ref(obj: Any, table: dict[Any, Any], key: Any) -> Callable[[], Any]:
    """A reference to ``obj`` that removes ``table[key]`` when ``obj`` dies (a strong one
    for an object that takes no weak reference)."""
    try:
        return weakref.ref(obj, functools.partial(_forget, table, key))
    except TypeError:
        return lambda: obj


class _ProcessGroupRef(CPGroup):
    """The ``CPGroup`` that ``resolve_group`` memoises for a ``ProcessGroup``: it refers to
    the process group weakly, so the memo (which holds this wrapper while the group lives)
    never keeps a group alive that ``destroy_process_group`` released and the caller dropped.

    ``CPGroup`` reaches its process group only through ``self._group``; here that attribute
    is a property over a weak reference. A collective after the group died raises
    ``RuntimeError`` (as one on a destroyed group does anyway).
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


def resolve_group(cp_group: Any) -> CPGroupLike:
    """``as_cp_group(cp_group)``, memoised per object (a ``ProcessGroup`` is wrapped once).

    The memo keeps no group alive: the entry of an object goes when the object does, and the
    wrapper of a ``ProcessGroup`` refers to it weakly (torch.distributed holds a group until
    ``destroy_process_group``; the caller's references hold it after that).

    Args:
        cp_group: a ``torch.distributed.ProcessGroup``, a ``DeviceMesh`` (1-D), any
            ``CPGroupLike`` (for example ``cpattn_common.CPGroup``) or ``None`` for the
            default (world) group.

    Returns:
        The ``CPGroupLike`` to communicate over.
    """
    hit = _RESOLVED.get(id(cp_group))
    if hit is not None and hit[0]() is cp_group:
        return cp_group if hit[1] is None else hit[1]
    real = _unwrap_fake(cp_group)
    if real is not cp_group:
        return resolve_group(real)
    if cp_group is None and dist.is_available() and dist.is_initialized():
        # Memoised under the world group itself, never under None: a world destroyed and
        # initialised again is never answered with the old one.
        return resolve_group(dist.group.WORLD)
    if cp_group is None:
        return as_cp_group(None)  # raises: no default group
    group = (
        _ProcessGroupRef(cp_group)
        if isinstance(cp_group, dist.ProcessGroup)
        else as_cp_group(cp_group)
    )
    key = id(cp_group)
    _RESOLVED[key] = (_ref(cp_group, _RESOLVED, key), None if group is cp_group else group)
    return group


def _constant_result(fn: _F) -> _F:
    """``torch._dynamo.assume_constant_result`` without importing dynamo (about 1 s).

    Dynamo evaluates a function carrying this mark at trace time and bakes the result into
    the graph as a constant; eager calls are unaffected.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def _token_of(group: CPGroupLike) -> str:
    key = id(group)
    hit = _TOKEN_OF.get(key)
    if hit is not None and hit[0]() is group:
        return hit[1]
    token = f"cpattn_dcp.group.{next(_TOKEN_NUMBERS)}"

    def forget(ref: Any) -> None:
        entry = _TOKEN_OF.get(key)
        if entry is not None and entry[0] is ref:
            del _TOKEN_OF[key]
        if _TOKENS.get(token) is ref:
            del _TOKENS[token]

    ref: Callable[[], Any]
    try:
        ref = weakref.ref(group, forget)
    except TypeError:  # takes no weak reference: held (its id() then is not reused)
        ref = lambda: group  # noqa: E731
    _TOKEN_OF[key] = (ref, token)
    _TOKENS[token] = ref
    return token


@_constant_result
def group_token(cp_group: Any) -> str:
    """A string naming ``cp_group`` for the registered ops (see ``group_from_token``)."""
    return _token_of(resolve_group(cp_group))


@_constant_result
def group_world_size(cp_group: Any) -> int:
    """N of ``cp_group`` (a trace-time constant under ``torch.compile``)."""
    return int(resolve_group(cp_group).world_size)


@_constant_result
def group_rank(cp_group: Any) -> int:
    """This rank's index in ``cp_group`` (a trace-time constant under ``torch.compile``)."""
    return int(resolve_group(cp_group).rank_in_group)


def group_from_token(token: str) -> CPGroupLike:
    """The group a token from ``group_token`` names; ``KeyError`` if unknown (or the group
    is gone: a token lives as long as its group)."""
    ref = _TOKENS.get(token)
    group: CPGroupLike | None = ref() if ref is not None else None
    if group is None:
        raise KeyError(f"unknown group token {token!r} (call group_token first)")
    return group
