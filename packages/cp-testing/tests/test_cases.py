"""The DCP decode case generator: masked partials combine to the independent reference."""

from __future__ import annotations

import math

import pytest
import torch

from cpattn_testing.cases import GARBAGE_LSE_VALUES, make_dcp_decode_case, random_lses
from cpattn_testing.reference import LN2, local_seq_lens, lse_combine_ref, mask_empty_shards_ref
from cpattn_testing.tolerances import assert_close_to_ref, coarsest


def _masked_combine(case: object) -> tuple[torch.Tensor, torch.Tensor]:
    from cpattn_testing.cases import DCPDecodeCase

    assert isinstance(case, DCPDecodeCase)
    lses = torch.stack(
        [
            mask_empty_shards_ref(case.partial_lse[r], case.local_seq_lens[r], case.query_start_loc)
            for r in range(case.world_size)
        ]
    )
    return lse_combine_ref(case.partial_out, lses, is_lse_base_on_e=case.is_lse_base_on_e)


CASES = [
    # seq_lens, N, H, D, k (queries/request), Hkv, I, padding rows
    pytest.param([16, 0, 16, 0], 4, 2, 32, 1, 1, 1, 0, id="mla-some-empty-requests"),
    pytest.param([7], 4, 3, 24, 1, 1, 4, 2, id="short-request-empty-shards-padding"),
    pytest.param([5, 33, 1], 2, 4, 16, 3, 2, 2, 1, id="gqa-mtp3"),
    pytest.param([0, 0], 2, 2, 8, 2, 2, 1, 2, id="all-empty"),
    pytest.param([40, 3], 3, 6, 20, 2, 6, 8, 0, id="mha-n3-i8"),
]


@pytest.mark.parametrize(("seq_lens", "n", "h", "d", "k", "hkv", "i", "pad"), CASES)
@pytest.mark.parametrize(
    ("dtype", "lse_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.bfloat16),
    ],
    ids=["fp32", "bf16", "fp16-bf16lse"],
)
@pytest.mark.parametrize("base_e", [True, False], ids=["base_e", "base_2"])
def test_masked_partials_combine_to_reference(
    seq_lens: list[int],
    n: int,
    h: int,
    d: int,
    k: int,
    hkv: int,
    i: int,
    pad: int,
    dtype: torch.dtype,
    lse_dtype: torch.dtype,
    base_e: bool,
) -> None:
    case = make_dcp_decode_case(
        seq_lens=seq_lens,
        world_size=n,
        num_heads=h,
        head_dim=d,
        queries_per_request=k,
        num_kv_heads=hkv,
        interleave_size=i,
        padding_rows=pad,
        dtype=dtype,
        lse_dtype=lse_dtype,
        is_lse_base_on_e=base_e,
        device="cpu",
        seed=11,
    )
    b = len(seq_lens) * k + pad
    assert case.partial_out.shape == (n, b, h, d)
    assert case.partial_out.dtype == dtype
    assert case.partial_lse.shape == (n, b, h)
    assert case.partial_lse.dtype == lse_dtype
    assert case.local_seq_lens.shape == (n, len(seq_lens))
    assert case.local_seq_lens.dtype == torch.int32
    assert case.query_start_loc.dtype == torch.int32
    assert case.query_start_loc.tolist() == list(range(0, (len(seq_lens) + 1) * k, k))
    assert torch.equal(case.local_seq_lens.T, local_seq_lens(seq_lens, n, None, i))
    assert case.ref_out.dtype == torch.float64
    assert case.ref_lse.dtype == torch.float64

    # Empty rows hold NaN outputs and garbage LSEs; the others are finite.
    empty = case.empty_rows
    assert torch.isnan(case.partial_out[empty]).all()
    assert torch.isfinite(case.partial_out[~empty]).all()
    garbage = case.partial_lse[empty].double()
    allowed = torch.tensor(
        [g for g in GARBAGE_LSE_VALUES if not math.isnan(g)], dtype=torch.float64
    )
    assert (torch.isnan(garbage) | torch.isin(garbage, allowed)).all()
    # Padding rows: reference 0 / -inf.
    if pad:
        assert torch.equal(case.ref_out[-pad:], torch.zeros(pad, h, d, dtype=torch.float64))
        assert torch.isneginf(case.ref_lse[-pad:]).all()

    out, lse = _masked_combine(case)
    # The output carries the rounding of both the partial outputs and the partial LSEs.
    assert_close_to_ref(out, case.ref_out, dtype=coarsest(dtype, lse_dtype), name="combined out")
    assert_close_to_ref(lse, case.ref_lse, dtype=lse_dtype, name="combined lse")


def test_fp64_case_is_exact_and_unmasked_combine_is_wrong() -> None:
    case = make_dcp_decode_case(
        seq_lens=[3, 9],
        world_size=4,
        num_heads=2,
        head_dim=8,
        interleave_size=2,
        padding_rows=1,
        dtype=torch.float64,
        lse_dtype=torch.float64,
        device="cpu",
        seed=5,
    )
    out, lse = _masked_combine(case)
    assert_close_to_ref(out, case.ref_out, dtype=torch.float64, name="out")
    assert_close_to_ref(lse, case.ref_lse, dtype=torch.float64, name="lse")
    # Without the mask the garbage shows (that is the point of the case).
    bad_out, _ = lse_combine_ref(case.partial_out, case.partial_lse)
    with pytest.raises(AssertionError):
        assert_close_to_ref(bad_out, case.ref_out, dtype=torch.float64)


def test_base_2_lses_are_base_e_over_ln2() -> None:
    kwargs = dict(
        seq_lens=[6, 11], world_size=2, num_heads=2, head_dim=4, dtype=torch.float64,
        lse_dtype=torch.float64, device="cpu", seed=3,
    )  # fmt: skip
    e = make_dcp_decode_case(is_lse_base_on_e=True, **kwargs)  # type: ignore[arg-type]
    two = make_dcp_decode_case(is_lse_base_on_e=False, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(two.ref_lse * LN2, e.ref_lse, rtol=1e-14, atol=0)
    torch.testing.assert_close(two.ref_out, e.ref_out, rtol=0, atol=0)


def test_same_seed_same_case() -> None:
    kwargs = dict(
        seq_lens=[6, 11], world_size=2, num_heads=2, head_dim=4, dtype=torch.bfloat16,
        device="cpu", seed=3,
    )  # fmt: skip
    a = make_dcp_decode_case(**kwargs)  # type: ignore[arg-type]
    b = make_dcp_decode_case(**kwargs)  # type: ignore[arg-type]
    assert torch.equal(a.partial_out.nan_to_num(), b.partial_out.nan_to_num())
    assert torch.equal(a.ref_out, b.ref_out)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seq_lens": []}, ValueError, "seq_lens must be a non-empty list"),
        ({"seq_lens": [4, -1]}, ValueError, "every seq_len must be >= 0, got -1"),
        (
            {"num_heads": 6, "num_kv_heads": 4},
            ValueError,
            "num_heads=6 must be a multiple of num_kv_heads=4",
        ),
        ({"world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
        ({"head_dim": 2.5}, TypeError, "head_dim must be an int"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    base: dict[str, object] = dict(
        seq_lens=[4], world_size=2, num_heads=2, head_dim=4, dtype=torch.float32, device="cpu",
        seed=0,
    )  # fmt: skip
    base.update(kwargs)
    with pytest.raises(error, match=match):
        make_dcp_decode_case(**base)  # type: ignore[arg-type]


def test_random_lses_mix_specials_into_normal_values() -> None:
    """About the asked fraction of NaN / +inf / -inf, the rest finite and spread, any dtype."""
    gen = torch.Generator().manual_seed(3)
    lses = random_lses((200, 50), gen, special_fraction=0.3)
    assert lses.shape == (200, 50)
    assert lses.dtype == torch.float32
    for kind in (torch.isnan(lses), lses == math.inf, lses == -math.inf):
        assert 0.07 < float(kind.float().mean()) < 0.13
    finite = lses[torch.isfinite(lses)]
    assert 3.0 < float(finite.std()) < 5.0
    half = random_lses((8,), gen, dtype=torch.bfloat16, special_fraction=0.0)
    assert half.dtype == torch.bfloat16
    assert bool(torch.isfinite(half).all())
