"""hypothesis strategies: CP shapes and adversarial LSE values (NaN, ±inf, all -inf rows,
magnitudes that overflow a naive ``exp``), mixed with ordinary ones."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

__all__ = [
    "DCPShape",
    "adversarial_lse_values",
    "dcp_decode_case_params",
    "dcp_shapes",
    "head_dims",
    "interleave_sizes",
    "lse_tensors",
    "partial_lses",
    "seeds",
    "seq_lens_lists",
    "world_sizes",
]

#: LSE values every combine must survive.
SPECIAL_LSE_VALUES: tuple[float, ...] = (
    -math.inf,
    math.inf,
    math.nan,
    0.0,
    -0.0,
    1e4,
    -1e4,
    88.0,  # exp overflows float32 just above 88.7
    -104.0,  # exp underflows float32 to 0 around -103.9
    128.0,  # exp2 overflows float32 at 128 (base-2 LSEs)
    -150.0,  # exp2 underflows float32 to 0 below -149
)


def world_sizes(max_size: int = 8) -> st.SearchStrategy[int]:
    """CP group sizes 1..max_size, including non-powers of two (3, 6)."""
    return st.integers(min_value=1, max_value=max_size)


def head_dims() -> st.SearchStrategy[int]:
    """Head dims: small awkward ones (1, 3, 7, 24), powers of two, and the MLA sizes 512/576."""
    return st.one_of(
        st.sampled_from([1, 3, 7, 16, 24, 32, 64, 96, 128, 192, 512, 576]),
        st.integers(min_value=1, max_value=80),
    )


def interleave_sizes() -> st.SearchStrategy[int]:
    """KV interleave sizes I: 1 (round robin), small odd values, and block-like powers of two."""
    return st.sampled_from([1, 2, 3, 4, 8, 16, 64])


def seeds() -> st.SearchStrategy[int]:
    """Seeds for ``torch.Generator().manual_seed``."""
    return st.integers(min_value=0, max_value=2**31 - 1)


def seq_lens_lists(
    *, max_requests: int = 6, max_len: int = 80, allow_zero: bool = True
) -> st.SearchStrategy[list[int]]:
    """Per-request KV lengths, with zeros (empty requests) and short ones (empty shards)."""
    length = st.one_of(
        st.integers(min_value=0 if allow_zero else 1, max_value=4),
        st.integers(min_value=1, max_value=max_len),
    )
    return st.lists(length, min_size=1, max_size=max_requests)


def adversarial_lse_values(
    *, allow_nan: bool = True, allow_posinf: bool = True, magnitude: float = 1e4
) -> st.SearchStrategy[float]:
    """One LSE value: special values (±inf, NaN, ±magnitude, exp over/underflow edges) or
    ordinary finite values in ``[-magnitude, magnitude]``."""
    special = [
        v
        for v in SPECIAL_LSE_VALUES
        if (allow_nan or not math.isnan(v))
        and (allow_posinf or v != math.inf)
        and (math.isinf(v) or math.isnan(v) or abs(v) <= magnitude)
    ]
    special += [magnitude, -magnitude]
    # Most real LSEs are small: a second, dense draw there (within the magnitude too).
    small = min(20.0, magnitude)
    return st.one_of(
        st.sampled_from(special),
        st.floats(min_value=-small, max_value=small),
        st.floats(min_value=-magnitude, max_value=magnitude),
    )


@st.composite
def lse_tensors(
    draw: st.DrawFn,
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    allow_nan: bool = True,
    allow_posinf: bool = True,
    magnitude: float = 1e4,
    empty_row_prob: float = 0.2,
) -> torch.Tensor:
    """A tensor of adversarial LSE values of ``shape`` (last dim = heads), within ``dtype``'s
    range; each row is all -inf (an empty KV shard) with probability about ``empty_row_prob``.
    """
    magnitude = min(magnitude, torch.finfo(dtype).max)
    count = math.prod(shape)
    values = draw(
        st.lists(
            adversarial_lse_values(
                allow_nan=allow_nan, allow_posinf=allow_posinf, magnitude=magnitude
            ),
            min_size=count,
            max_size=count,
        )
    )
    t = torch.tensor(values, dtype=torch.float64).reshape(shape)
    if len(shape) >= 2 and count:
        rows = t.reshape(-1, shape[-1])
        for i in range(rows.shape[0]):
            # An integer percent: hypothesis biases float draws toward the bounds.
            if draw(st.integers(min_value=0, max_value=99)) < round(100 * empty_row_prob):
                rows[i] = -math.inf
    return t.to(dtype)


@st.composite
def partial_lses(
    draw: st.DrawFn,
    *,
    max_world_size: int = 6,
    max_rows: int = 5,
    max_heads: int = 4,
    dtype: torch.dtype = torch.float32,
    allow_nan: bool = True,
    allow_posinf: bool = True,
) -> torch.Tensor:
    """Gathered partial LSEs ``[N, B, H]`` with adversarial values and all-empty rows."""
    n = draw(st.integers(min_value=1, max_value=max_world_size))
    b = draw(st.integers(min_value=1, max_value=max_rows))
    h = draw(st.integers(min_value=1, max_value=max_heads))
    lses = draw(lse_tensors((n, b, h), dtype=dtype, allow_nan=allow_nan, allow_posinf=allow_posinf))
    # Sometimes a (b, h) position is -inf on every rank.
    if draw(st.booleans()):
        bi = draw(st.integers(min_value=0, max_value=b - 1))
        hi = draw(st.integers(min_value=0, max_value=h - 1))
        lses[:, bi, hi] = -math.inf
    return lses


@dataclass(frozen=True)
class DCPShape:
    """A DCP combine geometry: N ranks, B rows, H heads (a multiple of N), D head dim."""

    world_size: int
    num_rows: int
    num_heads: int
    head_dim: int

    @property
    def heads_per_rank(self) -> int:
        """H / N."""
        return self.num_heads // self.world_size


@st.composite
def dcp_shapes(
    draw: st.DrawFn,
    *,
    max_world_size: int = 8,
    max_rows: int = 17,
    max_heads_per_rank: int = 4,
    max_head_dim: int = 80,
) -> DCPShape:
    """Shapes ``(N, B, H, D)`` with ``H % N == 0``: odd row counts, non-power-of-two N and D."""
    n = draw(world_sizes(max_world_size))
    hr = draw(st.integers(min_value=1, max_value=max_heads_per_rank))
    b = draw(st.integers(min_value=1, max_value=max_rows))
    d = draw(head_dims().filter(lambda x: x <= max_head_dim))
    return DCPShape(world_size=n, num_rows=b, num_heads=n * hr, head_dim=d)


@st.composite
def dcp_decode_case_params(
    draw: st.DrawFn,
    *,
    max_world_size: int = 4,
    max_requests: int = 4,
    max_len: int = 40,
    max_queries_per_request: int = 3,
) -> dict[str, Any]:
    """Keyword arguments for :func:`cpattn_testing.cases.make_dcp_decode_case` (add ``dtype``
    and ``device``): short requests with empty shards, GQA/MLA head layouts, MTP rows, padding.
    """
    n = draw(world_sizes(max_world_size))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    num_heads = num_kv_heads * draw(st.integers(min_value=1, max_value=3))
    return {
        "seq_lens": draw(seq_lens_lists(max_requests=max_requests, max_len=max_len)),
        "world_size": n,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": draw(st.integers(min_value=1, max_value=24)),
        "queries_per_request": draw(st.integers(min_value=1, max_value=max_queries_per_request)),
        "interleave_size": draw(interleave_sizes()),
        "padding_rows": draw(st.integers(min_value=0, max_value=3)),
        "is_lse_base_on_e": draw(st.booleans()),
        "seed": draw(seeds()),
    }
