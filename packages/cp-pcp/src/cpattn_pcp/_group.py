"""Group arguments: a torch ``ProcessGroup`` or any ``CPGroupLike`` wrapper.

Every public op takes its groups as keyword arguments (``pcp_group=``, ``tp_group=``,
``dcp_group=``) and normalises them here; no op reads a group from a global.
"""

from __future__ import annotations

from typing import TypeAlias

from torch.distributed import ProcessGroup

from cpattn_common.group import CPGroupLike, shared_cp_group

GroupArg: TypeAlias = ProcessGroup | CPGroupLike
"""A ``torch.distributed.ProcessGroup`` or a ``cpattn_common.group.CPGroupLike``."""


def resolve_group(group: GroupArg | None, name: str, why: str) -> CPGroupLike:
    """The required group argument ``name`` (e.g. ``"pcp_group"``) as a ``CPGroupLike``;
    ``ValueError`` naming ``why`` for ``None`` (never the world group)."""
    if group is None:
        raise ValueError(f"{name}= is required {why}; pass a ProcessGroup or a CPGroupLike")
    # One shared wrapper per ProcessGroup (building a CPGroup queries the rank table, and
    # the wrapper learns which collectives the backend lacks); the memo keeps no group alive.
    return shared_cp_group(group)


def optional_group(group: GroupArg | None) -> CPGroupLike | None:
    """Normalise an optional group argument (``None`` stays ``None``)."""
    return None if group is None else shared_cp_group(group)
