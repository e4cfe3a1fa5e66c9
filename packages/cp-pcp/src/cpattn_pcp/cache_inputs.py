"""Cache-input gathers: every PCP rank writes a complete replica of the KV cache.

Each rank all-gathers the prefill rows of its cache inputs; decode rows stay local. Layout
contract (``T`` local rows, the first ``D = num_decode_tokens`` decodes; ``slot_mapping`` the
expanded rank-major ``[>= N*T]`` mapping, or an unexpanded one of at most ``T`` entries): see
docs/packages/pcp.md, "Cache-input gathers". The gathers only select and reorder slots, so an
unsigned mapping passes through and marks no row as skipped. Inference only: with
``use_pcp=True`` and ``num_decode_tokens`` given, an input that requires grad raises
``RuntimeError`` under grad mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from cpattn_common.agreement import check_ranks_agree, tensor_fields
from cpattn_common.checks import check_bool, check_state, check_tensors, is_index_dtype
from cpattn_common.dispatch import refuse_grad
from cpattn_common.group import CPGroupLike
from cpattn_pcp._group import GroupArg, resolve_group

__all__ = [
    "maybe_gather_indexer_k",
    "maybe_gather_kv_cache_inputs",
    "maybe_gather_mla_latent_cache_inputs",
]


def _all_gather_rows(group: CPGroupLike, x: torch.Tensor) -> torch.Tensor:
    """``[T, *rest]`` on every rank -> ``[N*T, *rest]`` rank-major (contiguous)."""
    rows = x.shape[0]
    gathered = group.all_gather(x.reshape(rows, math.prod(x.shape[1:])), dim=0)
    # A group of one returns its input: a strided one (K split from a fused QKV projection)
    # would come back strided and aliased. For N > 1 the gather's output is contiguous.
    return gathered.reshape(group.world_size * rows, *x.shape[1:]).contiguous()


def _validate(
    op: str,
    tensors: Sequence[tuple[str, torch.Tensor]],
    slot_mapping: torch.Tensor,
    num_decode_tokens: int,
) -> int:
    check_tensors(op, **dict(tensors), slot_mapping=slot_mapping)
    rows = {name: (t.shape[0] if t.dim() > 0 else None) for name, t in tensors}
    first = tensors[0][1].shape[0] if tensors[0][1].dim() > 0 else None
    # Compared, not hashed (no set()): under symbolic tracing a size is an unhashable SymInt.
    if first is None or any(r is None or r != first for r in rows.values()):
        raise ValueError(f"cache inputs must all have the same number of rows, got {rows}")
    num_rows = tensors[0][1].shape[0]
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
    if not is_index_dtype(slot_mapping.dtype):
        raise TypeError(
            "slot_mapping must hold integers (int8/16/32/64 or uint8/16/32/64), got dtype "
            f"{slot_mapping.dtype}"
        )
    devices = {name: t.device for name, t in tensors} | {"slot_mapping": slot_mapping.device}
    if len(set(devices.values())) != 1:
        # One collective moves them all: a backend error would be far less clear than this.
        raise ValueError(f"cache inputs and slot_mapping must share one device, got {devices}")
    if isinstance(num_decode_tokens, bool) or not isinstance(num_decode_tokens, int):
        raise TypeError(
            f"num_decode_tokens must be an int or None, got {type(num_decode_tokens).__name__}"
        )
    if not 0 <= num_decode_tokens <= num_rows:
        raise ValueError(
            f"num_decode_tokens must be in [0, {num_rows}] (the local row count), "
            f"got {num_decode_tokens}"
        )
    return num_rows


def _gather_prefill_cache_inputs(
    op: str,
    tensors: Sequence[tuple[str, torch.Tensor]],
    slot_mapping: torch.Tensor,
    num_decode_tokens: int,
    shard_decode_requests: bool,
    group: CPGroupLike,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The shared rule behind the three public gathers (see the module docstring); ``op``
    names the public one in messages."""
    shard_decode_requests = check_bool("shard_decode_requests", shard_decode_requests)
    num_rows = _validate(op, tensors, slot_mapping, num_decode_tokens)
    n = group.world_size
    num_dec = num_decode_tokens
    full = n * num_rows
    num_slots = slot_mapping.shape[0]
    values = [t for _, t in tensors]

    if num_slots < full:
        if num_slots > num_rows:
            raise ValueError(
                f"slot_mapping has {num_slots} entries: expected the expanded rank-major "
                f"mapping of pcp_size * local rows = {n} * {num_rows} = {full} entries (or an "
                f"unexpanded decode-only mapping of at most {num_rows})"
            )
        if num_slots < num_dec:
            raise ValueError(
                f"unexpanded slot_mapping has {num_slots} entries, fewer than "
                f"num_decode_tokens = {num_dec}"
            )
        return [t[:num_dec] for t in values], slot_mapping[:num_dec]

    expanded = slot_mapping[:full]
    if check_state.enabled and (shard_decode_requests or num_dec < num_rows):  # a gather
        fields = {"world size": n, "num_decode_tokens": num_dec,
                  "shard_decode_requests": shard_decode_requests}  # fmt: skip
        for name, t in tensors:
            fields.update(tensor_fields(name, t))
        check_ranks_agree(op, group, values[0].device, fields)
    if shard_decode_requests:
        return [_all_gather_rows(group, t) for t in values], expanded
    if num_dec == num_rows:
        return list(values), slot_mapping[:num_dec]
    gathered = [_all_gather_rows(group, t[num_dec:]) for t in values]
    if num_dec == 0:
        return gathered, expanded
    out = [torch.cat([t[:num_dec], g], dim=0) for t, g in zip(values, gathered, strict=True)]
    prefill_slots = expanded.view(n, num_rows)[:, num_dec:].reshape(-1)
    return out, torch.cat([slot_mapping[:num_dec], prefill_slots])


def maybe_gather_mla_latent_cache_inputs(
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_decode_tokens: int | None,
    use_pcp: bool,
    shard_decode_requests: bool = False,
    *,
    pcp_group: GroupArg | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the MLA cache inputs (latent and rope key) so every rank writes the full cache.

    Args:
        kv_c_normed: ``[T, D_latent]`` normalised latent KV of this rank's local rows.
        k_pe: ``[T, D_rope]`` or ``[T, 1, D_rope]`` rope key (gathered flat, trailing shape kept).
        slot_mapping: ``[N*T]`` (or longer) rank-major expanded slot mapping, or an unexpanded
            decode-only one (see the module docstring). Integer dtype (int8/16/32/64 or
            uint8/16/32/64), ``-1`` = skip.
        num_decode_tokens: ``D``, decode rows at the front, ``0 <= D <= T``; ``None`` = not
            known (inputs returned unchanged).
        use_pcp: ``False`` returns the inputs unchanged.
        shard_decode_requests: decodes are sharded across ranks too (gather every row).
        pcp_group: the PCP group; required when a gather can happen.

    Returns:
        ``(kv_c_normed, k_pe, slot_mapping)`` lined up row for row: ``[D + N*(T-D), ...]`` rows
        (``[N*T, ...]`` with ``shard_decode_requests`` or ``D = 0``; ``[T, ...]`` when every
        row is a decode). Decode rows stay local and first, then every rank's prefill rows in
        rank order.

    Raises:
        ValueError: row counts differ, ``D`` out of range, slot mapping too short, inputs on
            several devices, or a gather is needed without ``pcp_group``.
        TypeError: a cache input or ``slot_mapping`` that is not a tensor; ``slot_mapping``'s
            dtype is not one of ``cpattn_common.checks.INDEX_DTYPES``
            (bool, floating, complex, quantized and sub-byte dtypes are refused),
            ``num_decode_tokens`` is not an int, or ``use_pcp`` / ``shard_decode_requests`` is
            not a bool.
        RuntimeError: ``use_pcp`` and ``num_decode_tokens`` given, grad mode is on and
            ``kv_c_normed`` or ``k_pe`` requires grad (the all-gather has no autograd formula;
            raised on every PCP size and for every batch, see the module docstring).
    """
    if not check_bool("use_pcp", use_pcp) or num_decode_tokens is None:
        return kv_c_normed, k_pe, slot_mapping
    # Before the row checks, so that whether it raises does not depend on the batch.
    refuse_grad("maybe_gather_mla_latent_cache_inputs", kv_c_normed=kv_c_normed, k_pe=k_pe)
    group = resolve_group(pcp_group, "pcp_group", "when use_pcp=True")
    (kv_c, pe), slots = _gather_prefill_cache_inputs(
        "maybe_gather_mla_latent_cache_inputs",
        [("kv_c_normed", kv_c_normed), ("k_pe", k_pe)],
        slot_mapping,
        num_decode_tokens,
        shard_decode_requests,
        group,
    )
    return kv_c, pe, slots


def maybe_gather_kv_cache_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_decode_tokens: int | None,
    use_pcp: bool,
    shard_decode_requests: bool = False,
    *,
    pcp_group: GroupArg | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather GQA/MHA key and value cache inputs so every rank writes the full cache.

    Key and value travel in separate gathers, so each gathered result is contiguous with the
    head stride equal to the head size (what paged-cache writers expect); rows that need no
    gather (decode rows, an unexpanded mapping) are returned as views of the inputs.

    Args:
        key: ``[T, Hkv, Dk]``.
        value: ``[T, Hkv, Dv]``.
        slot_mapping: as in ``maybe_gather_mla_latent_cache_inputs``.
        num_decode_tokens: ``D`` or ``None`` (unchanged).
        use_pcp: ``False`` returns the inputs unchanged.
        shard_decode_requests: gather decode rows too.
        pcp_group: the PCP group; required when a gather can happen.

    Returns:
        ``(key, value, slot_mapping)`` lined up row for row (row counts as in
        ``maybe_gather_mla_latent_cache_inputs``).

    Raises:
        ValueError: as in ``maybe_gather_mla_latent_cache_inputs``.
        TypeError: as in ``maybe_gather_mla_latent_cache_inputs``.
        RuntimeError: as in ``maybe_gather_mla_latent_cache_inputs``, for ``key`` or
            ``value``.
    """
    if not check_bool("use_pcp", use_pcp) or num_decode_tokens is None:
        return key, value, slot_mapping
    refuse_grad("maybe_gather_kv_cache_inputs", key=key, value=value)  # see the MLA twin
    group = resolve_group(pcp_group, "pcp_group", "when use_pcp=True")
    (k, v), slots = _gather_prefill_cache_inputs(
        "maybe_gather_kv_cache_inputs",
        [("key", key), ("value", value)],
        slot_mapping,
        num_decode_tokens,
        shard_decode_requests,
        group,
    )
    return k, v, slots


def maybe_gather_indexer_k(
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_decode_tokens: int | None,
    use_pcp: bool,
    shard_decode_requests: bool = False,
    *,
    pcp_group: GroupArg | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the sparse-attention indexer key so every rank writes the full indexer cache.

    Args:
        k: ``[T, D_index]`` (any trailing shape) indexer key of this rank's local rows.
        slot_mapping: as in ``maybe_gather_mla_latent_cache_inputs``.
        num_decode_tokens: ``D`` or ``None`` (unchanged).
        use_pcp: ``False`` returns the inputs unchanged.
        shard_decode_requests: gather decode rows too.
        pcp_group: the PCP group; required when a gather can happen.

    Returns:
        ``(k, slot_mapping)`` lined up row for row.

    Raises:
        ValueError: as in ``maybe_gather_mla_latent_cache_inputs``.
        TypeError: as in ``maybe_gather_mla_latent_cache_inputs``.
        RuntimeError: as in ``maybe_gather_mla_latent_cache_inputs``, for ``k``.
    """
    if not check_bool("use_pcp", use_pcp) or num_decode_tokens is None:
        return k, slot_mapping
    refuse_grad("maybe_gather_indexer_k", k=k)  # see the MLA twin
    group = resolve_group(pcp_group, "pcp_group", "when use_pcp=True")
    (out,), slots = _gather_prefill_cache_inputs(
        "maybe_gather_indexer_k",
        [("k", k)],
        slot_mapping,
        num_decode_tokens,
        shard_decode_requests,
        group,
    )
    return out, slots
