"""Plain PyTorch eager implementations of the benchmarked ops (the "vs eager" baseline).

Readable on purpose: each function is the op written the way someone without a custom kernel
would write it, with the project's numerics (NaN/+inf LSE count as -inf, an all-empty row gives
output 0 and LSE -inf, weight 0 contributes exactly 0, fp32 accumulation). They are timed, and
their outputs are also used to sanity-check our kernels before timing them.

Shapes (project vocabulary): N ranks/partials, B rows, H heads, D head dim, H_r = H / N.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _sanitize_lse(lse: torch.Tensor) -> torch.Tensor:
    """fp32 copy of ``lse`` with NaN and +inf replaced by -inf."""
    lse = lse.float()
    return torch.where(torch.isnan(lse) | (lse == float("inf")), NEG_INF, lse)


def _global_lse(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sanitized lses [N, ...], global lse [...])`` over dim 0, base e."""
    lses = _sanitize_lse(lses)
    m = lses.amax(dim=0)
    m = torch.where(m == NEG_INF, 0.0, m)
    total = torch.exp(lses - m).sum(dim=0)
    return lses, torch.log(total) + m  # log(0) = -inf for all-empty rows


def _weights(lses: torch.Tensor, lse_global: torch.Tensor) -> torch.Tensor:
    """``exp(l_n - L)`` with NaN (from -inf - -inf) mapped to 0."""
    w = torch.exp(lses - lse_global)
    return torch.nan_to_num(w, nan=0.0)


def merge_attn_states_eager(
    partial_outs: torch.Tensor, partial_lses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """N-way merge: ``[N, B, H, D]`` + ``[N, B, H]`` -> ``out [B, H, D]``, ``lse [B, H]`` fp32."""
    lses, lse = _global_lse(partial_lses)
    w = _weights(lses, lse).unsqueeze(-1)  # [N, B, H, 1]
    contrib = torch.where(w == 0, 0.0, partial_outs.float() * w)
    return contrib.sum(dim=0).to(partial_outs.dtype), lse


def correct_attn_out_eager(
    out: torch.Tensor, lses: torch.Tensor, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale ``out [B, H, D]`` in place by ``exp(lses[cp_rank] - L)``; return ``(out, L [B, H])``."""
    lses32, lse = _global_lse(lses)
    factor = _weights(lses32[cp_rank], lse).unsqueeze(-1)  # [B, H, 1]
    out.copy_(torch.where(factor == 0, 0.0, out.float() * factor))
    return out, lse.to(lses.dtype)


def empty_rows(b: int, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Bool ``[B]``: rows past ``query_start_loc[-1]`` or of a request whose local shard is empty."""
    rows = torch.arange(b, device=seq_lens.device, dtype=query_start_loc.dtype)
    num_seqs = seq_lens.numel()
    seq = torch.searchsorted(query_start_loc[1:], rows, right=True).clamp(max=num_seqs - 1)
    return (rows >= query_start_loc[num_seqs]) | (seq_lens[seq] == 0)


def mask_dcp_empty_shards_eager(
    lse: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> torch.Tensor:
    """In place: LSE ``[B, H]`` rows of empty shards / padding rows become -inf."""
    lse.masked_fill_(empty_rows(lse.shape[0], seq_lens, query_start_loc).unsqueeze(-1), NEG_INF)
    return lse


def lse_pack_lanes(dtype: torch.dtype) -> int:
    """P: lanes of ``dtype`` that carry one fp32 LSE (2 for 16-bit dtypes, 1 for fp32)."""
    if dtype in (torch.float16, torch.bfloat16):
        return 2
    if dtype == torch.float32:
        return 1
    raise ValueError(f"Cannot pack fp32 LSE into output dtype {dtype}.")


def a2a_buffer_views(buf: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload [N, B, H_r, D], lse_lanes [N, B, H_r, P])`` views of a block buffer
    ``[N, B, H_r, D + P]``: destination n's rows' payloads, then their fp32 LSE bits."""
    n, b, hr, width = buf.shape
    flat = buf.view(n, -1)
    rows = b * hr
    payload = flat[:, : rows * head_dim].view(n, b, hr, head_dim)
    return payload, flat[:, rows * head_dim :].view(n, b, hr, width - head_dim)


def a2a_pack_eager(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    world_size: int,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Send buffer ``[N, B, H_r, D + P]`` in the block format: destination n's payloads
    ``out[:, n*H_r:(n+1)*H_r]``, then their fp32 LSE bit patterns (low 16 bits first for
    16-bit dtypes), masked to -inf for empty rows when ``seq_lens``/``query_start_loc`` are
    given."""
    b, h, d = cp_attn_out.shape
    n = world_size
    p = lse_pack_lanes(cp_attn_out.dtype)
    lse = cp_attn_lse.float()
    if seq_lens is not None and query_start_loc is not None:
        lse = lse.masked_fill(empty_rows(b, seq_lens, query_start_loc).unsqueeze(-1), NEG_INF)
    send = torch.empty((n, b, h // n, d + p), dtype=cp_attn_out.dtype, device=cp_attn_out.device)
    payload, lanes = a2a_buffer_views(send, d)
    payload.copy_(cp_attn_out.view(b, n, h // n, d).transpose(0, 1))
    # Bit-cast fp32 -> p lanes of the output dtype (little endian: low half first).
    lanes.copy_(lse.contiguous().view(cp_attn_out.dtype).view(b, n, h // n, p).transpose(0, 1))
    return send


def a2a_unpack_combine_eager(
    recv: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive buffer ``[N, B, H_r, D + P]`` (block format) -> ``out [B, H_r, D]`` (recv
    dtype), ``lse [B, H_r]`` fp32."""
    payload, lanes = a2a_buffer_views(recv, head_dim)
    lses = lanes.contiguous().view(torch.float32).squeeze(-1)
    return merge_attn_states_eager(payload, lses)
