"""Group resolution (cheap, memoised) and the string tokens the registered ops carry.

``torch.library`` ops cannot take a ``ProcessGroup`` or a Python group wrapper as an
argument, so the public functions pass a token string that names the group in a registry.
Under ``torch.compile`` the token, world size and rank are computed once at trace time
(``assume_constant_result``) and baked into the graph as constants.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from cpattn_common.group import CPGroupLike, as_cp_group

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = ["group_from_token", "group_rank", "group_token", "group_world_size", "resolve_group"]

# id(user object) -> (weak or strong reference to the user object, resolved group).
_RESOLVED: dict[int, tuple[Any, CPGroupLike]] = {}
_TOKENS: dict[str, CPGroupLike] = {}

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


def _ref(obj: Any) -> Any:
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def resolve_group(cp_group: Any) -> CPGroupLike:
    """``as_cp_group(cp_group)``, memoised per object (a ``ProcessGroup`` is wrapped once).

    Args:
        cp_group: a ``torch.distributed.ProcessGroup``, a ``DeviceMesh`` (1-D) or any
            ``CPGroupLike`` (for example ``cpattn_common.CPGroup``).

    Returns:
        The ``CPGroupLike`` to communicate over.
    """
    hit = _RESOLVED.get(id(cp_group))
    if hit is not None and hit[0]() is cp_group:
        return hit[1]
    real = _unwrap_fake(cp_group)
    if real is not cp_group:
        return resolve_group(real)
    group = as_cp_group(cp_group)
    _RESOLVED[id(cp_group)] = (_ref(cp_group), group)
    return group


def _constant_result(fn: _F) -> _F:
    """``torch._dynamo.assume_constant_result`` without importing dynamo (about 1 s).

    Dynamo evaluates a function carrying this mark at trace time and bakes the result into
    the graph as a constant; eager calls are unaffected.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def _token_of(group: CPGroupLike) -> str:
    token = f"cpattn_dcp.group.{id(group):x}"
    if _TOKENS.get(token) is not group:
        _TOKENS[token] = group
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
    """The group a token from ``group_token`` names; ``KeyError`` if unknown."""
    try:
        return _TOKENS[token]
    except KeyError:
        raise KeyError(f"unknown group token {token!r} (call group_token first)") from None
