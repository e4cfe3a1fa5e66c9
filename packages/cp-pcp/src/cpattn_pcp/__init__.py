"""Prefill context parallel (PCP) helpers for LLM inference.

DualChunkSwap plans, the Q/K/V round trip to global order, cache-input gathers for a
replicated KV cache, the decode subset of a mixed batch, and query / output heads across
TP x PCP x DCP (docs/packages/pcp.md).

Every group argument is keyword-only and takes a ``torch.distributed.ProcessGroup`` or a
``cpattn_common.group.CPGroupLike``.
"""

from cpattn_pcp.__about__ import __version__
from cpattn_pcp.cache_inputs import (
    maybe_gather_indexer_k,
    maybe_gather_kv_cache_inputs,
    maybe_gather_mla_latent_cache_inputs,
)
from cpattn_pcp.combine_select import DCP_COMM_BACKENDS, DCPCombineName, resolve_dcp_combine
from cpattn_pcp.heads import (
    cp_reconcile_heads,
    dcp_q_gather_group,
    dcp_q_gather_size,
    finalize_mla_pcp_decode,
    maybe_all_gather_q_for_dcp,
)
from cpattn_pcp.mixed_batch import DecodeSubset, build_mixed_decode_subset
from cpattn_pcp.partition import DualChunkSwapPlan, dual_chunk_swap
from cpattn_pcp.qkv import gather_prefill_qkv_global, slice_prefill_output_local

__all__ = [
    "DCP_COMM_BACKENDS",
    "DCPCombineName",
    "DecodeSubset",
    "DualChunkSwapPlan",
    "__version__",
    "build_mixed_decode_subset",
    "cp_reconcile_heads",
    "dcp_q_gather_group",
    "dcp_q_gather_size",
    "dual_chunk_swap",
    "finalize_mla_pcp_decode",
    "gather_prefill_qkv_global",
    "maybe_all_gather_q_for_dcp",
    "maybe_gather_indexer_k",
    "maybe_gather_kv_cache_inputs",
    "maybe_gather_mla_latent_cache_inputs",
    "resolve_dcp_combine",
    "slice_prefill_output_local",
]
