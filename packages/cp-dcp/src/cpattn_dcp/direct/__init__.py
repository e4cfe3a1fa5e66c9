"""Direct (symmetric-memory) DCP collectives: A2A LSE-reduce, query gather, KV gather, with
bounded waits (``DirectProtocolError``), capability gating (the ``get_direct_dcp_*`` factories
return ``None`` when it says no) and an NCCL fallback (``cpattn_dcp.DCPManager``).
"""

from cpattn_dcp.direct._base import (
    DEFAULT_MAX_SPINS,
    MAX_SPINS_LIMIT,
    DirectPathUnavailable,
    DirectProtocolError,
)
from cpattn_dcp.direct.a2a import DIRECT_A2A_DTYPES, DirectDCPA2AWorkspace
from cpattn_dcp.direct.factories import (
    clear_direct_workspace_cache,
    direct_a2a_unavailable_reason,
    direct_gather_unavailable_reason,
    get_direct_dcp_a2a_workspace,
    get_direct_dcp_kv_gather_workspace,
    get_direct_dcp_q_gather_workspace,
)
from cpattn_dcp.direct.kv_gather import DIRECT_KV_GATHER_DTYPES, DirectDCPKVGatherWorkspace
from cpattn_dcp.direct.q_gather import DirectDCPQGatherWorkspace

__all__ = [
    "DEFAULT_MAX_SPINS",
    "DIRECT_A2A_DTYPES",
    "DIRECT_KV_GATHER_DTYPES",
    "MAX_SPINS_LIMIT",
    "DirectDCPA2AWorkspace",
    "DirectDCPKVGatherWorkspace",
    "DirectDCPQGatherWorkspace",
    "DirectPathUnavailable",
    "DirectProtocolError",
    "clear_direct_workspace_cache",
    "direct_a2a_unavailable_reason",
    "direct_gather_unavailable_reason",
    "get_direct_dcp_a2a_workspace",
    "get_direct_dcp_kv_gather_workspace",
    "get_direct_dcp_q_gather_workspace",
]
