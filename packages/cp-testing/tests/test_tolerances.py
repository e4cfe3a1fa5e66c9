"""The tolerance checker passes close results and fails with a message that says why."""

from __future__ import annotations

import math

import pytest
import torch

from cpattn_testing.tolerances import (
    TOLERANCES,
    ChunkedAgreement,
    assert_close_by_row_chunks,
    assert_close_to_ref,
    coarsest,
    lse_magnitude,
    tolerance,
)


def test_table_and_lookup() -> None:
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        atol, rtol, rel = tolerance(dtype)
        assert (atol, rtol, rel) == TOLERANCES[dtype]
        assert 0 < atol < 1
        assert 0 < rel < 1
    assert tolerance(torch.float32)[0] < tolerance(torch.bfloat16)[0]
    assert tolerance(torch.float8_e4m3fn)[0] > tolerance(torch.bfloat16)[0]
    with pytest.raises(TypeError, match="floating-point"):
        tolerance(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rounded_reference_passes(dtype: torch.dtype) -> None:
    ref = torch.randn(64, 8, dtype=torch.float64)
    assert_close_to_ref(ref.to(dtype), ref, dtype=dtype)


def test_infinities_must_match_and_nan_always_fails() -> None:
    ref = torch.tensor([1.0, -math.inf, 2.0], dtype=torch.float64)
    assert_close_to_ref(ref.float(), ref, dtype=torch.float32)
    with pytest.raises(AssertionError, match=r"non-finite mismatches .*: 1"):
        assert_close_to_ref(torch.tensor([1.0, 0.0, 2.0]), ref, dtype=torch.float32)
    with pytest.raises(AssertionError, match=r"non-finite mismatches .*: 1"):
        assert_close_to_ref(torch.tensor([1.0, -math.inf, math.nan]), ref, dtype=torch.bfloat16)


def test_message_reports_norm_max_abs_and_mismatches() -> None:
    ref = torch.zeros(4, 5, dtype=torch.float64) + 1.0
    actual = ref.clone()
    actual[2, 3] = 1.5
    with pytest.raises(AssertionError) as info:
        assert_close_to_ref(actual, ref, dtype=torch.float32, name="out")
    text = str(info.value)
    assert text.startswith("out: not close")
    assert "relative norm error: 1.118e-01" in text
    assert "max abs error: 5.000e-01 at (2, 3)" in text
    assert "elementwise mismatches: 1 / 20" in text
    assert "at (2, 3): actual 1.5, ref 1.0" in text


def test_relative_norm_bound_catches_many_small_errors() -> None:
    ref = torch.ones(1000, dtype=torch.float64)
    actual = ref + 1.5e-2  # within bf16 atol+rtol elementwise, but a 1.5% bias everywhere
    with pytest.raises(AssertionError, match=r"relative norm error: 1\.500e-02"):
        assert_close_to_ref(actual, ref, dtype=torch.bfloat16)


def test_a_small_reference_is_still_held_to_the_norm_bound() -> None:
    """An attention output averaged over a long context (rms 5e-3, below bf16's atol): an
    all-zero result or one with heads rotated fails; one within bf16 rounding passes (the
    norm criterion stays on below an rms of atol)."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 8, 32, generator=gen, dtype=torch.float64) * 5e-3
    for bad in (torch.zeros_like(ref), ref.roll(1, dims=1)):
        with pytest.raises(AssertionError, match="relative norm error"):
            assert_close_to_ref(bad.bfloat16(), ref, dtype=torch.bfloat16)
    assert_close_to_ref(ref.bfloat16(), ref, dtype=torch.bfloat16)
    tiny = ref * 1e-9  # essentially zero: atol governs
    assert_close_to_ref(torch.zeros_like(tiny).bfloat16(), tiny, dtype=torch.bfloat16)


def test_results_in_the_subnormal_range_are_held_to_their_spacing() -> None:
    """fp16 outputs of about 6e-6 (a weight of exp(-12)): subnormal, 2**-24 apart, so their
    rounding alone reads as a 0.3% relative norm error (hypothesis found it); they pass. An
    error of several spacings per entry still fails."""
    ref = torch.tensor([6.1e-6, -5.3e-6, 4.87e-6], dtype=torch.float64)
    stored = ref.half()
    assert (stored.double() - ref).abs().max() > 0  # the rounding is visible
    assert_close_to_ref(stored, ref, dtype=torch.float16)
    with pytest.raises(AssertionError, match="relative norm error"):
        assert_close_to_ref((ref + 4 * 2.0**-24).half(), ref, dtype=torch.float16)


def test_shape_mismatch_and_reduction_scaling() -> None:
    with pytest.raises(AssertionError, match=r"shape \(3,\) != reference shape \(4,\)"):
        assert_close_to_ref(torch.zeros(3), torch.zeros(4), dtype=torch.float32)
    ref = torch.zeros(10, dtype=torch.float64)
    actual = ref + 5e-5
    with pytest.raises(AssertionError):
        assert_close_to_ref(actual, ref, dtype=torch.float32)
    assert_close_to_ref(actual, ref, dtype=torch.float32, reduction_len=10000)


def test_scale_judges_a_merged_lse_by_its_terms() -> None:
    """The case hypothesis found in the A2A round trip: fp16 LSEs 0 and -9.515625 merge to
    log(1 + e^-9.515625) = 7.369e-5; fp32 (``m + log(s)``, ``s`` rounded near 1) gives
    7.367e-5, an absolute error of 2e-8 but a relative one of 2.7e-4 (bound 1e-5). Judged
    against ``|m| + 1`` it passes; a real error is still caught."""
    lses = torch.tensor([[[0.0]], [[-9.515625]]]).to(torch.float16)  # [N=2, B=1, H=1]
    exact = torch.logsumexp(lses.double(), dim=0)
    m = lses.float().amax(dim=0)
    got = m + torch.log(torch.exp(lses.float() - m).sum(dim=0))
    assert 1e-8 < float((got.double() - exact).abs().max()) < 3e-8
    with pytest.raises(AssertionError, match="relative norm error"):
        assert_close_to_ref(got, exact, dtype=torch.float32, name="lse")
    scale = lse_magnitude(lses)
    assert scale.tolist() == [[1.0]]
    assert_close_to_ref(got, exact, dtype=torch.float32, name="lse", scale=scale)
    with pytest.raises(AssertionError, match="elementwise mismatches: 1 / 1"):
        assert_close_to_ref(got + 1e-4, exact, dtype=torch.float32, name="lse", scale=scale)
    with pytest.raises(ValueError, match="scale"):
        assert_close_to_ref(got, exact, dtype=torch.float32, scale=-scale)


def test_lse_magnitude_is_the_largest_finite_lse_plus_one() -> None:
    inf, nan = float("inf"), float("nan")
    lses = torch.tensor([[1.0, nan, -inf, -7.0], [-3.0, 2.0, inf, -inf]])
    assert lse_magnitude(lses).tolist() == [2.0, 3.0, 1.0, 8.0]
    assert lse_magnitude(lses, dim=1).tolist() == [2.0, 3.0]


def test_coarsest() -> None:
    assert coarsest(torch.float16, torch.bfloat16) == torch.bfloat16
    assert coarsest(torch.float32, torch.float16) == torch.float16
    assert coarsest(torch.float64) == torch.float64
    with pytest.raises(ValueError, match="at least one"):
        coarsest()


def test_chunked_agreement_matches_the_whole_check() -> None:
    """Chunk by chunk: a rounded result passes; the relative norm error is the whole
    result's (a bias spread over chunks fails as it does in one piece); NaN and inf
    mismatches are counted with where the first one is."""
    ref = torch.randn(300, 7, dtype=torch.float64)
    agree = ChunkedAgreement(torch.bfloat16, name="out")
    for s in range(0, 300, 64):
        agree.add(ref[s : s + 64].to(torch.bfloat16), ref[s : s + 64])
    agree.check()

    ones = torch.ones(1000, dtype=torch.float64)
    biased = ChunkedAgreement(torch.bfloat16)
    for s in range(0, 1000, 100):
        biased.add(ones[s : s + 100] + 1.5e-2, ones[s : s + 100])
    with pytest.raises(AssertionError, match=r"relative norm error: 1\.500e-02"):
        biased.check()

    ref2 = torch.tensor([[1.0, -math.inf], [2.0, 3.0]], dtype=torch.float64)
    bad = ChunkedAgreement(torch.float32, name="lse")
    bad.add(ref2[:1].float(), ref2[:1])
    bad.add(torch.tensor([[2.0, math.nan]]), ref2[1:])
    with pytest.raises(AssertionError) as info:
        bad.check()
    text = str(info.value)
    assert text.startswith("lse: not close")
    assert "non-finite mismatches (NaN/inf where the reference differs): 1" in text
    assert "first mismatch: chunk 1 at (0, 1): actual nan, ref 3.0" in text
    with pytest.raises(AssertionError, match=r"shape \(2,\) != reference shape \(3,\)"):
        bad.add(torch.zeros(2), torch.zeros(3))


def test_row_chunks_check_every_result() -> None:
    """Every row of every result is compared (a bad row in the last, short chunk fails, with
    its result's name); malformed arguments are rejected."""
    ref_out = torch.randn(130, 3, dtype=torch.float64)
    ref_lse = torch.randn(130, dtype=torch.float64)
    out, lse = ref_out.to(torch.bfloat16), ref_lse.float()
    calls: list[tuple[int, int]] = []

    def reference(s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((s, e))
        return ref_out[s:e], ref_lse[s:e]

    def checks() -> list[ChunkedAgreement]:
        return [
            ChunkedAgreement(torch.bfloat16, name="out"),
            ChunkedAgreement(torch.float32, name="lse"),
        ]

    assert_close_by_row_chunks([out, lse], reference, checks(), chunk_rows=64)
    assert calls == [(0, 64), (64, 128), (128, 130)]
    lse[129] = math.nan
    with pytest.raises(AssertionError, match="lse: not close"):
        assert_close_by_row_chunks([out, lse], reference, checks(), chunk_rows=64)
    with pytest.raises(ValueError, match="2 results for 1 checks"):
        assert_close_by_row_chunks([out, lse], reference, checks()[:1], chunk_rows=64)
    with pytest.raises(ValueError, match="row count"):
        assert_close_by_row_chunks([out, lse[:5]], reference, checks(), chunk_rows=64)
    with pytest.raises(ValueError, match="chunk_rows"):
        assert_close_by_row_chunks([out, lse], reference, checks(), chunk_rows=0)
