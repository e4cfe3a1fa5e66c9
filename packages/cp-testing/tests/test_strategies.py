"""Strategies produce what they promise, and drive property tests of the reference combine."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis.errors import NoSuchExample

from cpattn_testing import strategies as cst
from cpattn_testing.cases import make_dcp_decode_case
from cpattn_testing.reference import (
    attention_ref,
    interleaved_shard_positions,
    lse_combine_ref,
    mask_empty_shards_ref,
    partial_attention_ref,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(cst.partial_lses(), cst.seeds())
def test_combine_of_adversarial_lses_is_never_nan(lses: torch.Tensor, seed: int) -> None:
    n, b, h = lses.shape
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, b, h, 3, generator=gen, dtype=torch.float64)
    bad = torch.isnan(lses) | torch.isinf(lses)
    outs[bad] = math.nan  # empty sources carry garbage outputs
    out, lse = lse_combine_ref(outs, lses)
    assert not torch.isnan(out).any()
    assert not torch.isnan(lse).any()
    assert not (lse == math.inf).any()
    # Rows where every source is empty: out 0, lse -inf.
    dead = (torch.isnan(lses) | (lses == math.inf) | (lses == -math.inf)).all(0)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.isneginf(lse[dead]).all()
    # Permuting the sources changes nothing (beyond rounding).
    perm = torch.randperm(n, generator=gen)
    out_p, lse_p = lse_combine_ref(outs[perm], lses[perm])
    torch.testing.assert_close(out_p, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_p, lse, rtol=1e-12, atol=1e-12)


@FAST
@given(cst.dcp_shapes())
def test_dcp_shapes_are_consistent(shape: cst.DCPShape) -> None:
    assert shape.num_heads % shape.world_size == 0
    assert shape.heads_per_rank >= 1
    assert 1 <= shape.head_dim <= 80


@FAST
@given(
    cst.seq_lens_lists(max_requests=3, max_len=30),
    cst.world_sizes(4),
    cst.interleave_sizes(),
    cst.seeds(),
)
def test_interleaved_merge_equals_full_attention(
    seq_lens: list[int], n: int, i: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    for s in seq_lens:
        q = torch.randn(1, 2, 5, generator=gen, dtype=torch.float64)
        k = torch.randn(s, 1, 5, generator=gen, dtype=torch.float64)
        v = torch.randn(s, 1, 5, generator=gen, dtype=torch.float64)
        full = attention_ref(q, k, v, scale=0.5, causal=True)
        parts = [
            partial_attention_ref(
                q, k, v, interleaved_shard_positions(s, n, r, i), scale=0.5, causal=True
            )
            for r in range(n)
        ]
        out, lse = lse_combine_ref(
            torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        )
        torch.testing.assert_close(out, full[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, full[1], rtol=1e-12, atol=1e-12)


def test_adversarial_values_cover_the_special_cases() -> None:
    seen: set[str] = set()

    @settings(max_examples=300, deadline=None, database=None)
    @given(cst.adversarial_lse_values())
    def collect(x: float) -> None:
        if math.isnan(x):
            seen.add("nan")
        elif x == math.inf:
            seen.add("+inf")
        elif x == -math.inf:
            seen.add("-inf")
        elif abs(x) >= 1e4:
            seen.add("huge")

    collect()
    assert seen == {"nan", "+inf", "-inf", "huge"}


@FAST
@given(cst.adversarial_lse_values(allow_nan=False, allow_posinf=False, magnitude=50.0))
def test_value_filters(x: float) -> None:
    assert not math.isnan(x)
    assert x != math.inf
    assert x == -math.inf or abs(x) <= 50.0


def test_finite_values_stay_within_a_magnitude_below_20() -> None:
    # The dense draw of small values was [-20, 20] whatever the magnitude.
    with pytest.raises(NoSuchExample):
        find(
            cst.adversarial_lse_values(magnitude=5.0),
            lambda x: math.isfinite(x) and abs(x) > 5.0,
            settings=settings(database=None),
        )


@FAST
@given(cst.lse_tensors((3, 4), dtype=torch.bfloat16))
def test_lse_tensors_shape_and_dtype(t: torch.Tensor) -> None:
    assert t.shape == (3, 4)
    assert t.dtype == torch.bfloat16


@FAST
@given(cst.dcp_decode_case_params())
def test_random_dcp_cases_combine_to_their_reference(params: dict[str, Any]) -> None:
    case = make_dcp_decode_case(
        dtype=torch.float64, lse_dtype=torch.float64, device="cpu", **params
    )
    lses = torch.stack(
        [
            mask_empty_shards_ref(case.partial_lse[r], case.local_seq_lens[r], case.query_start_loc)
            for r in range(case.world_size)
        ]
    )
    out, lse = lse_combine_ref(case.partial_out, lses, is_lse_base_on_e=case.is_lse_base_on_e)
    torch.testing.assert_close(out, case.ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, case.ref_lse, rtol=1e-10, atol=1e-10)


def test_lse_tensors_blank_rows_at_about_the_asked_for_rate() -> None:
    """Rows of -inf come at about ``empty_row_prob`` (Hypothesis' float draws, used before,
    blanked about half of them for 0.2), so most draws keep finite sources to combine."""
    blank: list[bool] = []

    @settings(max_examples=300, deadline=None, database=None)
    @given(cst.lse_tensors((4, 8, 2), allow_nan=False, allow_posinf=False, magnitude=10.0))
    def draw(t: torch.Tensor) -> None:
        rows = t.reshape(-1, 2)
        # A row counts as blanked when all its heads are -inf (a value draw rarely does that).
        blank.extend(bool(r) for r in torch.isneginf(rows).all(-1))

    draw()
    rate = sum(blank) / len(blank)
    assert 0.1 < rate < 0.32, rate


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_lse_tensors_without_posinf_never_overflow_to_posinf(dtype: torch.dtype) -> None:
    """A ``magnitude`` beyond the dtype's range (1e5 for fp16) gave +inf after the cast,
    although ``allow_posinf=False``."""

    @settings(max_examples=200, deadline=None, database=None)
    @given(cst.lse_tensors((8,), dtype=dtype, allow_posinf=False, magnitude=1e300))
    def draw(t: torch.Tensor) -> None:
        assert not torch.isposinf(t).any(), t

    draw()
