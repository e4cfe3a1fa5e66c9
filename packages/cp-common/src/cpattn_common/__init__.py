"""Shared layer for context-parallel attention: process-group wrapper, capability gating, symmetric workspaces, LSE merge kernels."""

from cpattn_common.__about__ import __version__
from cpattn_common.agreement import AgreementError, SymmetricAllocationError
from cpattn_common.alloc import (
    empty_output,
    get_output_poison,
    new_output,
    poison_outputs,
    set_output_poison,
)
from cpattn_common.capability import (
    direct_cp_disabled_reason,
    direct_cp_enabled,
    direct_cp_multicast_enabled,
    multicast_disabled_by_env,
    symm_mem_available,
)
from cpattn_common.checks import check_mode, checks_enabled, set_check_mode
from cpattn_common.group import (
    CPGroup,
    CPGroupLike,
    GroupCoordinatorLike,
    as_cp_group,
    check_group,
    shared_cp_group,
)
from cpattn_common.lse import merge_attn_states_torch
from cpattn_common.ops.merge_attn_states import merge_attn_states
from cpattn_common.topology import CPGroups, CPLayout, build_cp_groups, cp_layout
from cpattn_common.ubatch import current_ubatch_id, set_ubatch_id, ubatch_context
from cpattn_common.workspace import DirectCPWorkspace

__all__ = [
    "AgreementError",
    "CPGroup",
    "CPGroupLike",
    "CPGroups",
    "CPLayout",
    "DirectCPWorkspace",
    "GroupCoordinatorLike",
    "SymmetricAllocationError",
    "__version__",
    "as_cp_group",
    "build_cp_groups",
    "check_group",
    "check_mode",
    "checks_enabled",
    "cp_layout",
    "current_ubatch_id",
    "direct_cp_disabled_reason",
    "direct_cp_enabled",
    "direct_cp_multicast_enabled",
    "empty_output",
    "get_output_poison",
    "merge_attn_states",
    "merge_attn_states_torch",
    "multicast_disabled_by_env",
    "new_output",
    "poison_outputs",
    "set_check_mode",
    "set_output_poison",
    "set_ubatch_id",
    "shared_cp_group",
    "symm_mem_available",
    "ubatch_context",
]
