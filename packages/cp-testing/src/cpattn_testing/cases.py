"""Complete test cases: per-rank partials plus their float64 reference.

:func:`make_dcp_decode_case`: what N DCP ranks hold after local attention over an interleaved
KV shard; empty-shard and padding rows hold NaN outputs and garbage LSEs the mask must fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cpattn_testing.reference import (
    LN2,
    _check_int,
    attention_ref,
    interleaved_shard_positions,
    local_seq_lens,
    partial_attention_ref,
)

__all__ = ["GARBAGE_LSE_VALUES", "DCPDecodeCase", "make_dcp_decode_case", "random_lses"]

#: LSE values planted on rows that the empty-shard mask must fix (a large finite value would
#: dominate the combine if the mask were skipped).
GARBAGE_LSE_VALUES: tuple[float, ...] = (0.0, math.inf, math.nan, 30.0)


@dataclass
class DCPDecodeCase:
    """One DCP decode combine problem with its float64 answer.

    N ranks, R requests, ``B = R * queries_per_request + padding_rows`` rows, H heads, D head
    dim: per-rank ``partial_out [N, B, H, D]`` / ``partial_lse [N, B, H]`` (NaN / garbage where
    ``empty_rows [N, B]`` is True), ``local_seq_lens [N, R]``, ``query_start_loc [R + 1]``,
    float64 ``ref_out [B, H, D]`` / ``ref_lse [B, H]`` (0 / -inf on empty rows), ``query [B, H,
    D]`` and the unsharded per-request ``keys`` / ``values [S_j, Hkv, D]``.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    local_seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    ref_out: torch.Tensor
    ref_lse: torch.Tensor
    empty_rows: torch.Tensor
    query: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    seq_lens: list[int]
    scale: float
    world_size: int
    interleave_size: int
    queries_per_request: int
    padding_rows: int
    is_lse_base_on_e: bool

    @property
    def num_rows(self) -> int:
        """B, query rows including padding rows."""
        return int(self.partial_out.shape[1])

    def rank_inputs(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, H, D], lse [B, H])`` of one rank, as fresh contiguous copies."""
        return self.partial_out[rank].clone(), self.partial_lse[rank].clone()


def make_dcp_decode_case(
    *,
    seq_lens: list[int],
    world_size: int,
    num_heads: int,
    head_dim: int,
    queries_per_request: int = 1,
    num_kv_heads: int = 1,
    interleave_size: int = 1,
    padding_rows: int = 0,
    dtype: torch.dtype,
    lse_dtype: torch.dtype = torch.float32,
    is_lse_base_on_e: bool = True,
    device: torch.device | str,
    seed: int,
) -> DCPDecodeCase:
    """Build a DCP decode combine case (see the module docstring).

    Query row t of a request with S keys sits at position ``S - k + t`` (``k =
    queries_per_request``) and attends causally. ``num_kv_heads``: 1 (MLA-like), ``num_heads``
    (MHA) or a divisor (GQA). Inputs are seeded by ``seed`` and rounded to ``dtype`` before the
    float64 math, so the reference is exact for the rounded inputs.

    Raises:
        ValueError / TypeError: bad sizes, with the offending values.
    """
    if not isinstance(seq_lens, (list, tuple)) or not seq_lens:
        raise ValueError(f"seq_lens must be a non-empty list of ints, got {seq_lens!r}")
    for s in seq_lens:
        _check_int("every seq_len", s, 0)
    for name, value in (
        ("world_size", world_size), ("num_heads", num_heads), ("head_dim", head_dim),
        ("queries_per_request", queries_per_request), ("num_kv_heads", num_kv_heads),
        ("interleave_size", interleave_size),
    ):  # fmt: skip
        _check_int(name, value, 1)
    _check_int("padding_rows", padding_rows, 0)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    n, k, r_count = world_size, queries_per_request, len(seq_lens)
    b = r_count * k + padding_rows
    h, d = num_heads, head_dim
    scale = d**-0.5

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    query = rand(b, h, d)
    keys = [rand(s, num_kv_heads, d) for s in seq_lens]
    values = [rand(s, num_kv_heads, d) for s in seq_lens]

    lse_scale = 1.0 if is_lse_base_on_e else 1.0 / LN2
    partial_out = torch.zeros(n, b, h, d, dtype=torch.float64)
    partial_lse = torch.full((n, b, h), -math.inf, dtype=torch.float64)
    ref_out = torch.zeros(b, h, d, dtype=torch.float64)
    ref_lse = torch.full((b, h), -math.inf, dtype=torch.float64)
    local = local_seq_lens(seq_lens, n, None, interleave_size).T.contiguous()  # [N, R]
    empty_rows = torch.zeros(n, b, dtype=torch.bool)
    empty_rows[:, r_count * k :] = True

    for j, s in enumerate(seq_lens):
        rows = slice(j * k, (j + 1) * k)
        q_pos = torch.arange(s - k, s)
        q = query[rows]
        out, lse = attention_ref(q, keys[j], values[j], scale=scale, causal=True, q_pos=q_pos)
        ref_out[rows], ref_lse[rows] = out, lse * lse_scale
        for rank in range(n):
            if int(local[rank, j]) == 0:
                empty_rows[rank, rows] = True
                continue
            pos = interleaved_shard_positions(s, n, rank, interleave_size)
            out, lse = partial_attention_ref(
                q, keys[j], values[j], pos, scale=scale, causal=True, q_pos=q_pos
            )
            partial_out[rank, rows], partial_lse[rank, rows] = out, lse * lse_scale

    # What a misbehaving backend leaves on empty rows.
    partial_out[empty_rows] = math.nan
    garbage = torch.tensor(GARBAGE_LSE_VALUES, dtype=torch.float64)
    picks = torch.randint(len(GARBAGE_LSE_VALUES), (n, b, h), generator=gen)
    partial_lse = torch.where(empty_rows[..., None], garbage[picks], partial_lse)

    qsl = torch.arange(0, (r_count + 1) * k, k, dtype=torch.int32)
    return DCPDecodeCase(
        partial_out=partial_out.to(dtype=dtype, device=dev),
        partial_lse=partial_lse.to(dtype=lse_dtype, device=dev),
        local_seq_lens=local.to(device=dev),
        query_start_loc=qsl.to(device=dev),
        ref_out=ref_out.to(device=dev),
        ref_lse=ref_lse.to(device=dev),
        empty_rows=empty_rows.to(device=dev),
        query=query.to(device=dev),
        keys=[x.to(device=dev) for x in keys],
        values=[x.to(device=dev) for x in values],
        seq_lens=list(seq_lens),
        scale=scale,
        world_size=n,
        interleave_size=interleave_size,
        queries_per_request=k,
        padding_rows=padding_rows,
        is_lse_base_on_e=is_lse_base_on_e,
    )


def random_lses(
    shape: tuple[int, ...],
    generator: torch.Generator,
    *,
    dtype: torch.dtype = torch.float32,
    special_fraction: float = 0.06,
) -> torch.Tensor:
    """Random LSEs (normal, standard deviation 4) with NaN, +inf and -inf each at about a third
    of ``special_fraction`` of the entries, made on ``generator``'s device (any size)."""
    dev = generator.device
    lses = torch.randn(shape, generator=generator, device=dev, dtype=torch.float32) * 4.0
    pick = torch.rand(shape, generator=generator, device=dev)
    third = special_fraction / 3
    lses.masked_fill_(pick < third, -math.inf)
    lses.masked_fill_((pick >= third) & (pick < 2 * third), math.nan)
    lses.masked_fill_((pick >= 2 * third) & (pick < special_fraction), math.inf)
    return lses.to(dtype)
