"""Decode context parallel (DCP) attention combine ops, Q/KV gathers and manager. The gathers,
the manager and the direct workspaces load on first attribute access (a light import).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cpattn_dcp.__about__ import __version__
from cpattn_dcp.context import CPTritonContext
from cpattn_dcp.ops.a2a_combine import (
    a2a_buffer_views,
    a2a_pack,
    a2a_pack_dim,
    a2a_record_width,
    a2a_unpack_combine,
    dcp_a2a_lse_reduce,
)
from cpattn_dcp.ops.ag_combine import cp_lse_ag_out_ar, cp_lse_ag_out_rs
from cpattn_dcp.ops.correct_attn_out import correct_attn_out
from cpattn_dcp.ops.mask_empty_shards import mask_dcp_empty_shards_

if TYPE_CHECKING:
    from cpattn_dcp.direct import (
        DirectDCPA2AWorkspace,
        DirectDCPKVGatherWorkspace,
        DirectDCPQGatherWorkspace,
        DirectProtocolError,
        get_direct_dcp_a2a_workspace,
        get_direct_dcp_kv_gather_workspace,
        get_direct_dcp_q_gather_workspace,
    )
    from cpattn_dcp.gather import dcp_gather_kv, dcp_gather_query, reserve_query_head_storage
    from cpattn_dcp.manager import DCPManager
    from cpattn_dcp.selection import DCPConfig, DCPSelection

_LAZY: dict[str, str] = {
    "DCPConfig": "cpattn_dcp.selection",
    "DCPManager": "cpattn_dcp.manager",
    "DCPSelection": "cpattn_dcp.selection",
    "DirectProtocolError": "cpattn_dcp.direct",
    "get_direct_dcp_a2a_workspace": "cpattn_dcp.direct",
    "get_direct_dcp_kv_gather_workspace": "cpattn_dcp.direct",
    "get_direct_dcp_q_gather_workspace": "cpattn_dcp.direct",
    "DirectDCPA2AWorkspace": "cpattn_dcp.direct",
    "DirectDCPKVGatherWorkspace": "cpattn_dcp.direct",
    "DirectDCPQGatherWorkspace": "cpattn_dcp.direct",
    "dcp_gather_kv": "cpattn_dcp.gather",
    "dcp_gather_query": "cpattn_dcp.gather",
    "reserve_query_head_storage": "cpattn_dcp.gather",
}

__all__ = [
    "CPTritonContext",
    "DCPConfig",
    "DCPManager",
    "DCPSelection",
    "DirectDCPA2AWorkspace",
    "DirectDCPKVGatherWorkspace",
    "DirectDCPQGatherWorkspace",
    "DirectProtocolError",
    "__version__",
    "a2a_buffer_views",
    "a2a_pack",
    "a2a_pack_dim",
    "a2a_record_width",
    "a2a_unpack_combine",
    "correct_attn_out",
    "cp_lse_ag_out_ar",
    "cp_lse_ag_out_rs",
    "dcp_a2a_lse_reduce",
    "dcp_gather_kv",
    "dcp_gather_query",
    "get_direct_dcp_a2a_workspace",
    "get_direct_dcp_kv_gather_workspace",
    "get_direct_dcp_q_gather_workspace",
    "mask_dcp_empty_shards_",
    "reserve_query_head_storage",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cpattn_dcp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
