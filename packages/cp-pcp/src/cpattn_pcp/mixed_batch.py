"""The decode-token subset of a mixed prefill/decode batch under PCP, for decode-only paths
(e.g. a DCP decode kernel and combine). Requests with zero query tokens are never decode
segments: DualChunkSwap gives a rank without prefill rows a 0-token dummy segment, and counting
it would desynchronise the ranks' DCP combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn_common.checks import check_tensors, is_index_dtype

__all__ = ["DecodeSubset", "build_mixed_decode_subset"]


@dataclass(frozen=True, eq=False)
class DecodeSubset:
    """Decode tokens of a mixed batch, with ``R_d`` decode segments and ``T_d`` tokens.

    Attributes:
        token_mask: ``[T]`` bool, ``True`` for the rows of ``query`` in a decode segment.
        q / k / v: ``[T_d, ...]`` decode rows of ``query`` (contiguous), ``key``, ``value``
            (``None`` where not given).
        cu_seqlens: ``[R_d + 1]`` zero-prefixed cumsum of the decode query lengths.
        max_seqlen: longest decode query length (host int).
        ctx_kv_lens / block_table: ``[R_d]`` / ``[R_d, C]`` rows of the decode segments.
        request_idx: ``[R_d]`` int64 indices of the decode segments in the batch.
    """

    token_mask: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    cu_seqlens: torch.Tensor
    max_seqlen: int
    ctx_kv_lens: torch.Tensor
    block_table: torch.Tensor
    request_idx: torch.Tensor

    @property
    def num_decodes(self) -> int:
        """``R_d``, the number of decode segments."""
        return int(self.request_idx.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        """``T_d``, the number of decode tokens."""
        return int(self.q.shape[0])


def build_mixed_decode_subset(
    is_prefilling: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    dcp_context_kv_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> DecodeSubset | None:
    """Select the decode tokens (and their per-request metadata) of a mixed batch.

    A decode segment is a request ``j`` with ``is_prefilling[j] == False`` and
    ``query_start_loc[j+1] - query_start_loc[j] > 0``. Reads counts on the host (``.item()``),
    so it is not CUDA-graph capturable; call it outside captured regions.

    Args:
        is_prefilling: ``[R]`` bool per request, or ``None`` (no information: returns ``None``).
        query_start_loc: ``[R+1]`` integer, zero-prefixed cumsum of the query lengths.
        query / key / value: ``[T, ...]`` (``key`` / ``value`` may be ``None``); rows past
            ``query_start_loc[-1]`` are padding.
        dcp_context_kv_lens / block_table: ``[R]`` context KV lengths, ``[R, C]`` block table.

    Returns:
        The ``DecodeSubset``, or ``None`` when ``is_prefilling`` is ``None`` or the batch has
        no decode segment with tokens.

    Raises:
        ValueError: inconsistent request counts or row counts, ``query_start_loc`` starting
            below row 0 or decreasing; key or value on another device than ``query``. (A
            ``query`` with fewer rows than ``query_start_loc[-1]`` is accepted, as vLLM does:
            the token mask is truncated to its rows, the per-request metadata is not.)
        TypeError: a non-tensor argument; ``query_start_loc`` not an integer tensor
            (``cpattn_common.checks.INDEX_DTYPES``), ``is_prefilling`` a floating tensor.
    """
    if is_prefilling is None:
        return None
    optional = {name: t for name, t in (("key", key), ("value", value)) if t is not None}
    check_tensors(
        "build_mixed_decode_subset",
        is_prefilling=is_prefilling,
        query_start_loc=query_start_loc,
        query=query,
        dcp_context_kv_lens=dcp_context_kv_lens,
        block_table=block_table,
        **optional,
    )
    if not is_index_dtype(query_start_loc.dtype):
        raise TypeError(
            "query_start_loc must be an integer tensor (int8/16/32/64 or uint8/16/32/64), got "
            f"{query_start_loc.dtype}"
        )
    if is_prefilling.dtype.is_floating_point or is_prefilling.dtype.is_complex:
        raise TypeError(f"is_prefilling must be a bool tensor, got {is_prefilling.dtype}")
    num_reqs = query_start_loc.shape[0] - 1 if query_start_loc.dim() == 1 else -1
    if num_reqs < 0:
        raise ValueError(
            f"query_start_loc must be 1-D with R+1 >= 1 entries, got shape "
            f"{tuple(query_start_loc.shape)}"
        )
    checks = {
        "is_prefilling": (is_prefilling, 1),
        "dcp_context_kv_lens": (dcp_context_kv_lens, 1),
        "block_table": (block_table, 2),
    }
    for name, (t, ndim) in checks.items():
        if t.dim() != ndim or t.shape[0] != num_reqs:
            raise ValueError(
                f"{name} must be {ndim}-D with R = {num_reqs} rows (query_start_loc has "
                f"{num_reqs + 1} entries), got shape {tuple(t.shape)}"
            )
    if query.dim() < 1:
        raise ValueError("query must have a token dimension")
    num_rows = query.shape[0]
    for name, other in (("key", key), ("value", value)):
        if other is not None and (other.dim() < 1 or other.shape[0] != num_rows):
            raise ValueError(
                f"{name} must have the same number of rows as query ({num_rows}), got shape "
                f"{tuple(other.shape)}"
            )
        if other is not None and other.device != query.device:
            raise ValueError(f"{name} is on {other.device}, query on {query.device}")

    device = query.device
    # All row arithmetic in int64, whatever query_start_loc's dtype: a narrow dtype would wrap
    # (row numbers of a query longer than int8 / uint8 allow, a decreasing unsigned
    # query_start_loc read as a huge length), and torch cannot subtract or searchsorted
    # uint16/32/64. cu_seqlens comes back in query_start_loc's dtype (its values never exceed
    # query_start_loc[-1], so they fit).
    qsl = query_start_loc.to(device=device, dtype=torch.int64)
    lens = qsl[1:] - qsl[:-1]
    if bool((lens < 0).any()):  # host sync
        raise ValueError(f"query_start_loc must be non-decreasing, got {qsl.tolist()}")
    if int(qsl[0].item()) < 0:  # host sync
        raise ValueError(f"query_start_loc must start at a row >= 0, got {qsl.tolist()}")
    is_decode = (~is_prefilling.to(device=device, dtype=torch.bool)) & (lens > 0)
    request_idx = torch.nonzero(is_decode).flatten()
    if request_idx.numel() == 0:  # host sync
        return None

    # Row t belongs to request j when qsl[j] <= t < qsl[j+1]; rows outside are padding.
    rows = torch.arange(num_rows, device=device, dtype=torch.int64)
    owner = torch.searchsorted(qsl, rows, right=True) - 1
    inside = (owner >= 0) & (owner < num_reqs)
    token_mask = inside & is_decode[owner.clamp(0, max(num_reqs - 1, 0))]
    dec_lens = lens.index_select(0, request_idx)
    cu = torch.zeros(request_idx.numel() + 1, dtype=query_start_loc.dtype, device=device)
    cu[1:] = torch.cumsum(dec_lens, 0).to(cu.dtype)
    return DecodeSubset(
        token_mask=token_mask,
        q=query[token_mask].contiguous(),
        k=None if key is None else key[token_mask].contiguous(),
        v=None if value is None else value[token_mask].contiguous(),
        cu_seqlens=cu,
        max_seqlen=int(dec_lens.max().item()),  # host sync
        ctx_kv_lens=dcp_context_kv_lens.index_select(0, request_idx.to(dcp_context_kv_lens.device)),
        block_table=block_table.index_select(0, request_idx.to(block_table.device)),
        request_idx=request_idx,
    )
