"""Group resolution (cheap, memoised) and the string tokens the registered ops carry instead of
a group object (trace-time constants under ``torch.compile``). Nothing here keeps a group alive.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any

from cpattn_common.group import CPGroupLike, shared_cp_group, trace_time_constant
from cpattn_common.identity_memo import IdentityMemo

__all__ = ["group_from_token", "group_rank", "group_token", "group_world_size", "resolve_group"]

# A token is never reused: one for a group that died raises KeyError.
_TOKEN_OF: IdentityMemo[str] = IdentityMemo()  # group -> its token
# token -> a reference to the group (weak, dropping the entry when the group dies; strong
# for a group that takes no weak reference, as _TOKEN_OF holds it too).
_TOKENS: dict[str, Callable[[], Any]] = {}
_TOKEN_NUMBERS = itertools.count()


# ``cpattn_common.shared_cp_group``: an alias, not a wrapper (the ops' host path).
resolve_group = shared_cp_group


def _forget_token(token: str, ref: Any) -> None:
    if _TOKENS.get(token) is ref:
        del _TOKENS[token]


def _token_of(group: CPGroupLike) -> str:
    token = _TOKEN_OF.get(group, None)
    if token is not None:
        return token
    token = _TOKEN_OF.setdefault(group, f"cpattn_dcp.group.{next(_TOKEN_NUMBERS)}")
    ref: Callable[[], Any]
    try:
        ref = weakref.ref(group, functools.partial(_forget_token, token))
    except TypeError:
        ref = functools.partial(_identity, group)
    _TOKENS[token] = ref
    return token


def _identity(obj: Any) -> Any:
    return obj


@trace_time_constant
def group_token(cp_group: Any) -> str:
    """A string naming ``cp_group`` for the registered ops (see ``group_from_token``)."""
    return _token_of(resolve_group(cp_group))


@trace_time_constant
def group_world_size(cp_group: Any) -> int:
    """N of ``cp_group`` (a trace-time constant under ``torch.compile``)."""
    return int(resolve_group(cp_group).world_size)


@trace_time_constant
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
