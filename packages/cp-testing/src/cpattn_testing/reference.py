"""float64 references for context-parallel attention, pure torch, importing nothing from the
implementations. Shapes: ``N`` ranks, ``B`` query rows, ``T`` query / ``S`` key tokens, ``Hq`` /
``Hkv`` heads, ``D`` head dim, ``R`` requests. LSEs are base e (base 2 with
``is_lse_base_on_e=False``); an empty key set has LSE -inf and output 0; in a combine NaN and
+inf LSEs count as -inf and a source of weight 0 contributes exactly 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "LN2",
    "attention_ref",
    "contiguous_shard_positions",
    "correct_attn_out_ref",
    "dual_chunk_swap_positions",
    "interleaved_shard_positions",
    "local_seq_lens",
    "lse_combine_ref",
    "mask_empty_shards_ref",
    "partial_attention_ref",
    "shard_positions",
]

#: ln 2, the factor between base-e and base-2 LSE values (``lse_e = lse_2 * LN2``).
LN2 = math.log(2.0)

_F64 = torch.float64


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_rank(world_size: int, rank: int) -> None:
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


def lse_combine_ref(
    outs: torch.Tensor, lses: torch.Tensor, *, is_lse_base_on_e: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine N partial attention results by their LSEs, in float64.

    For each (row b, head h), with ``l_n`` the sanitised LSEs (NaN/+inf -> -inf) in base e::

        L   = ln(sum_n exp(l_n))                  (-inf when every l_n is -inf)
        w_n = exp(l_n - L)                        (0 when l_n is -inf or w_n is 0 in fp32)
        out = sum_n (w_n * o_n  if w_n != 0 else 0)

    A weight that underflows to 0 in fp32 is 0, as in the ops (``docs/conventions.md``).

    Args:
        outs: partial outputs ``[N, B, H, D]`` (any float dtype).
        lses: partial LSEs ``[N, B, H]`` (any float dtype).
        is_lse_base_on_e: True for natural-log LSEs, False for base 2 (input and output).

    Returns:
        ``(out [B, H, D], lse [B, H])`` in float64; LSE in the input's base.
    """
    if outs.dim() != 4 or lses.dim() != 3 or outs.shape[:3] != lses.shape:
        raise ValueError(
            f"expected outs [N, B, H, D] and lses [N, B, H], got {tuple(outs.shape)} "
            f"and {tuple(lses.shape)}"
        )
    weights, combined = _combine_weights(lses, is_lse_base_on_e)
    o = outs.to(_F64)
    contrib = torch.where(weights[..., None] == 0, 0.0, weights[..., None] * o)
    return contrib.sum(dim=0), combined


def _combine_weights(
    lses: torch.Tensor, is_lse_base_on_e: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w [N, B, H], L [B, H])`` of :func:`lse_combine_ref`."""
    lse = lses.to(_F64)
    lse = torch.where(torch.isnan(lse) | (lse == math.inf), -math.inf, lse)
    if not is_lse_base_on_e:
        lse = lse * LN2
    # Shifted by the largest LSE m (exp(l_n - logsumexp) loses ln(sum) at |m| > ~1e13).
    m = lse.amax(dim=0)  # [B, H]; -inf when every source is -inf
    m = torch.where(torch.isfinite(m), m, 0.0)
    shifted = torch.exp(lse - m)  # [N, B, H]; 0 for -inf sources
    total = shifted.sum(dim=0)  # [B, H]; 0 when every source is -inf
    weights = torch.where(total > 0, shifted / total.clamp_min(1e-300), 0.0)
    # The ops accumulate in fp32: a weight below its smallest subnormal is 0 there.
    weights = torch.where(weights.to(torch.float32) == 0, 0.0, weights)
    combined = torch.where(total > 0, m + torch.log(total.clamp_min(1e-300)), -math.inf)
    if not is_lse_base_on_e:
        combined = combined / LN2
    return weights, combined


def correct_attn_out_ref(
    out: torch.Tensor, lses: torch.Tensor, cp_rank: int, *, is_lse_base_on_e: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's partial output rescaled by its combine weight, in float64.

    ``out [B, H, D] * w_r`` with ``w_r`` the weight of source ``cp_rank`` in
    :func:`lse_combine_ref` (exactly 0 where ``w_r == 0``) given every rank's ``lses
    [N, B, H]``; returns ``(out [B, H, D], global lse [B, H])`` in float64 (the LSE base as
    ``is_lse_base_on_e``). Summed over the ranks it gives :func:`lse_combine_ref`'s output.
    """
    if out.dim() != 3 or lses.dim() != 3 or out.shape[:2] != lses.shape[1:]:
        raise ValueError(
            f"expected out [B, H, D] and lses [N, B, H], got {tuple(out.shape)} and "
            f"{tuple(lses.shape)}"
        )
    _check_rank(lses.shape[0], cp_rank)
    weights, combined = _combine_weights(lses, is_lse_base_on_e)
    w = weights[cp_rank, :, :, None]
    return torch.where(w == 0, 0.0, w * out.to(_F64)), combined


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    is_lse_base_on_e: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with its LSE, in float64.

    ``score[t, h, s] = scale * q[t, h] . k[s, h // (Hq / Hkv)]``; with ``causal``, query ``t``
    sees key ``s`` only when ``k_pos[s] <= q_pos[t]``. ``out[t, h] = softmax_s(score) @ v`` and
    ``lse[t, h] = ln(sum_s exp(score[t, h, s]))`` (divided by ln 2 for base 2). A query row with
    no visible key gets out 0 and LSE -inf.

    GQA: ``Hq`` must be a multiple of ``Hkv`` (MHA: ``Hq == Hkv``; MLA-style: ``Hkv = 1``).

    Args:
        q / k / v: ``[T, Hq, Dk]`` / ``[S, Hkv, Dk]`` / ``[S, Hkv, Dv]``.
        scale: softmax scale (usually ``Dk ** -0.5``).
        causal: apply the position mask.
        q_pos: ``[T]`` query positions; default the last T of the sequence, ``arange(S - T, S)``.
        k_pos: ``[S]`` key positions; default ``arange(S)``.
        is_lse_base_on_e: LSE base of the result.

    Returns:
        ``(out [T, Hq, Dv], lse [T, Hq])`` in float64.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"expected q [T, Hq, Dk], k [S, Hkv, Dk], v [S, Hkv, Dv]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    t_len, hq, dk = q.shape
    s_len, hkv, dk_k = k.shape
    if k.shape[:2] != v.shape[:2] or dk_k != dk:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must share [S, Hkv] and k must match "
            f"q's head dim {dk}"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads Hq={hq} must be a multiple of KV heads Hkv={hkv}")
    if k_pos is None:
        k_pos = torch.arange(s_len, device=q.device)
    if q_pos is None:
        q_pos = torch.arange(s_len - t_len, s_len, device=q.device)
    if q_pos.shape != (t_len,) or k_pos.shape != (s_len,):
        raise ValueError(
            f"q_pos must be [T={t_len}] and k_pos [S={s_len}], got {tuple(q_pos.shape)} and "
            f"{tuple(k_pos.shape)}"
        )
    group = hq // hkv
    kx = k.to(_F64).repeat_interleave(group, dim=1)  # [S, Hq, Dk]
    vx = v.to(_F64).repeat_interleave(group, dim=1)  # [S, Hq, Dv]
    scores = torch.einsum("thd,shd->ths", q.to(_F64), kx) * scale  # [T, Hq, S]
    if causal:
        visible = k_pos.to(q.device)[None, :] <= q_pos.to(q.device)[:, None]  # [T, S]
        scores = scores.masked_fill(~visible[:, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [T, Hq]; -inf for rows without keys
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0)
    out = torch.einsum("ths,shd->thd", probs, vx)
    if not is_lse_base_on_e:
        lse = lse / LN2
    return out, lse


def partial_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    q_pos: torch.Tensor | None = None,
    is_lse_base_on_e: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` against the shard of the whole request's ``k`` / ``v`` at global key
    ``positions [S_local]`` (one rank's part); arguments and result as :func:`attention_ref`
    (``q_pos`` defaults to the last T positions of the whole request). An empty shard (or a
    query that sees no key of it) gives out 0 and LSE -inf.
    """
    s_len = k.shape[0]
    if q_pos is None:
        q_pos = torch.arange(s_len - q.shape[0], s_len, device=q.device)
    idx = positions.to(device=k.device, dtype=torch.long)
    return attention_ref(
        q,
        k.index_select(0, idx),
        v.index_select(0, idx),
        scale=scale,
        causal=causal,
        q_pos=q_pos,
        k_pos=idx,
        is_lse_base_on_e=is_lse_base_on_e,
    )


def interleaved_shard_positions(
    seq_len: int, world_size: int, rank: int, interleave_size: int = 1
) -> torch.Tensor:
    """Global positions held by ``rank`` under interleaved sharding: ``(t // I) % N == rank``.

    Returns:
        int64 ``[S_local]``, ascending.
    """
    _check_int("seq_len", seq_len, 0)
    _check_rank(world_size, rank)
    _check_int("interleave_size", interleave_size, 1)
    t = torch.arange(seq_len)
    return t[(t // interleave_size) % world_size == rank]


def contiguous_shard_positions(seq_len: int, world_size: int, rank: int) -> torch.Tensor:
    """Global positions of ``rank``'s contiguous block (sizes differ by at most one).

    Returns:
        int64 ``[S_local]``, ascending.
    """
    _check_int("seq_len", seq_len, 0)
    _check_rank(world_size, rank)
    return torch.tensor_split(torch.arange(seq_len), world_size)[rank].clone()


def dual_chunk_swap_positions(
    seq_len: int, world_size: int, rank: int, *, keep_padding: bool = False
) -> torch.Tensor:
    """Global positions of ``rank``'s DualChunkSwap (zigzag) share of a prefill.

    The sequence of ``seq_len = S`` tokens is padded to ``Lp = ceil(S / 2N) * 2N`` and cut
    into ``2N`` chunks; rank r takes chunk r, then chunk ``2N - 1 - r``. Returns int64
    ``[S_local]`` in that local order; ``keep_padding`` keeps the positions ``>= S``.
    """
    _check_int("seq_len", seq_len, 0)
    _check_rank(world_size, rank)
    chunks = 2 * world_size
    chunk = -(-seq_len // chunks)  # ceil(S / 2N)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail_chunk = chunks - 1 - rank
    tail = torch.arange(tail_chunk * chunk, (tail_chunk + 1) * chunk)
    pos = torch.cat([head, tail])
    return pos if keep_padding else pos[pos < seq_len]


def shard_positions(
    layout: str, seq_len: int, world_size: int, rank: int, interleave_size: int = 1
) -> torch.Tensor:
    """Dispatch by name: ``"contiguous"``, ``"interleaved"`` or ``"dual_chunk_swap"``."""
    if layout == "contiguous":
        return contiguous_shard_positions(seq_len, world_size, rank)
    if layout == "interleaved":
        return interleaved_shard_positions(seq_len, world_size, rank, interleave_size)
    if layout == "dual_chunk_swap":
        return dual_chunk_swap_positions(seq_len, world_size, rank)
    raise ValueError(
        f"layout must be 'contiguous', 'interleaved' or 'dual_chunk_swap', got {layout!r}"
    )


def local_seq_lens(
    seq_lens: Sequence[int] | torch.Tensor,
    world_size: int,
    rank: int | None = None,
    interleave_size: int = 1,
) -> torch.Tensor:
    """Local KV length of each of the ``[R]`` requests on ``rank`` under interleaved sharding
    by ``interleave_size`` (by counting): int32 ``[R]``, or ``[R, N]`` for ``rank=None``.
    Summed over ranks it gives ``seq_lens``; a 0 marks an empty shard."""
    lens = [int(s) for s in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    ranks = range(world_size) if rank is None else [rank]
    table = [
        [interleaved_shard_positions(s, world_size, r, interleave_size).numel() for r in ranks]
        for s in lens
    ]
    out = torch.tensor(table, dtype=torch.int32).reshape(len(lens), len(ranks))
    return out if rank is None else out[:, 0].contiguous()


def mask_empty_shards_ref(
    lse: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> torch.Tensor:
    """LSE with empty-shard rows and padding rows set to -inf (a copy; the input is untouched).

    Row i belongs to the first request j with ``query_start_loc[j + 1] > i`` (rows before
    ``query_start_loc[0]`` count as request 0). The row is empty when it is a padding row
    (``i >= query_start_loc[R]``) or when its request has ``seq_lens[j] == 0``.

    ``lse [B, H]``: this rank's partial LSEs; ``seq_lens [R]``: its **local** KV length per
    request; ``query_start_loc [R + 1]``: cumulative query-row offsets.
    """
    if lse.dim() != 2:
        raise ValueError(f"lse must be [B, H], got {tuple(lse.shape)}")
    if seq_lens.dim() != 1 or query_start_loc.dim() != 1:
        raise ValueError(
            f"seq_lens and query_start_loc must be 1-D, got {tuple(seq_lens.shape)} and "
            f"{tuple(query_start_loc.shape)}"
        )
    if query_start_loc.numel() != seq_lens.numel() + 1:
        raise ValueError(
            f"query_start_loc must have one more entry than seq_lens, got "
            f"{query_start_loc.numel()} and {seq_lens.numel()}"
        )
    out = lse.clone()
    qsl = [int(x) for x in query_start_loc.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    num_reqs = len(lens)
    for i in range(lse.shape[0]):
        if num_reqs == 0 or i >= qsl[num_reqs]:
            out[i] = -math.inf
            continue
        req = next(j for j in range(num_reqs) if qsl[j + 1] > i)
        if lens[req] == 0:
            out[i] = -math.inf
    return out
