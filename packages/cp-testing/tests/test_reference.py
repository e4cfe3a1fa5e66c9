"""The float64 references are themselves right: hand-computed values, an independent
attention, and 'merging every shard's partial reproduces full attention' for every layout."""

from __future__ import annotations

import math

import pytest
import torch

from cpattn_testing.reference import (
    LN2,
    attention_ref,
    contiguous_shard_positions,
    correct_attn_out_ref,
    dual_chunk_swap_positions,
    interleaved_shard_positions,
    local_seq_lens,
    lse_combine_ref,
    mask_empty_shards_ref,
    partial_attention_ref,
    shard_positions,
)

INF = math.inf
NAN = math.nan


def _t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# lse_combine_ref: the situations of the combine table


def test_combine_single_source_is_identity() -> None:
    out = torch.randn(1, 3, 2, 5, dtype=torch.float64)
    lse = torch.randn(1, 3, 2, dtype=torch.float64)
    got_out, got_lse = lse_combine_ref(out, lse)
    torch.testing.assert_close(got_out, out[0], rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(got_lse, lse[0], rtol=1e-15, atol=1e-15)


def test_combine_equal_lses_is_mean() -> None:
    out = torch.randn(4, 2, 3, 8, dtype=torch.float64)
    lse = torch.full((4, 2, 3), 1.5, dtype=torch.float64)
    got_out, got_lse = lse_combine_ref(out, lse)
    torch.testing.assert_close(got_out, out.mean(0), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(got_lse, torch.full((2, 3), 1.5 + math.log(4), dtype=torch.float64))


def test_combine_hand_computed_weights_base_e_and_2() -> None:
    out = _t([[[[1.0, 0.0]]], [[[0.0, 1.0]]]])  # [2, 1, 1, 2]
    lse = _t([[[1.0]], [[2.0]]])
    got_out, got_lse = lse_combine_ref(out, lse)
    e1, e2 = math.e, math.e**2
    torch.testing.assert_close(got_out[0, 0], _t([e1 / (e1 + e2), e2 / (e1 + e2)]))
    assert got_lse.item() == pytest.approx(math.log(e1 + e2), abs=1e-14)
    got_out2, got_lse2 = lse_combine_ref(out, lse, is_lse_base_on_e=False)
    torch.testing.assert_close(got_out2[0, 0], _t([2 / 6, 4 / 6]))
    assert got_lse2.item() == pytest.approx(math.log2(2 + 4), abs=1e-14)


def test_combine_dominant_source() -> None:
    out = _t([[[[1.0, 2.0]]], [[[5.0, 7.0]]]])
    lse = _t([[[-100.0]], [[0.0]]])
    got_out, got_lse = lse_combine_ref(out, lse)
    torch.testing.assert_close(got_out[0, 0], _t([5.0, 7.0]), rtol=0, atol=1e-30)
    assert abs(got_lse.item()) < 1e-30


@pytest.mark.parametrize("bad", [-INF, NAN, INF], ids=["neginf", "nan", "posinf"])
def test_combine_empty_source_with_nan_output_is_ignored(bad: float) -> None:
    out = _t([[[[NAN, NAN]]], [[[3.0, -4.0]]]])
    lse = _t([[[bad]], [[0.25]]])
    got_out, got_lse = lse_combine_ref(out, lse)
    assert torch.equal(got_out[0, 0], _t([3.0, -4.0]))
    assert got_lse.item() == 0.25


@pytest.mark.parametrize("base_e", [True, False])
def test_a_source_whose_fp32_weight_underflows_adds_exactly_zero(base_e: bool) -> None:
    """A finite LSE 110 (base e) below the row's largest has a float64 weight of about 1e-48
    but 0 in fp32: its NaN partial adds nothing, in both references (the ops' convention).
    """
    gap = 110.0 if base_e else 110.0 / math.log(2)
    out = _t([[[[3.0, -4.0]]], [[[NAN, NAN]]], [[[1.0, 2.0]]]])
    lse = _t([[[0.5]], [[0.5 - gap]], [[-INF]]])
    got_out, got_lse = lse_combine_ref(out, lse, is_lse_base_on_e=base_e)
    assert torch.equal(got_out[0, 0], _t([3.0, -4.0]))
    assert got_lse.item() == 0.5
    for rank in range(3):
        rescaled, _ = correct_attn_out_ref(out[rank], lse, rank, is_lse_base_on_e=base_e)
        assert not rescaled.isnan().any()


@pytest.mark.parametrize("base_e", [True, False])
def test_combine_all_sources_empty_gives_zero_and_neginf(base_e: bool) -> None:
    out = torch.full((3, 2, 1, 4), NAN, dtype=torch.float64)
    lse = _t([[[-INF], [NAN]], [[INF], [-INF]], [[NAN], [INF]]])
    got_out, got_lse = lse_combine_ref(out, lse, is_lse_base_on_e=base_e)
    assert torch.equal(got_out, torch.zeros(2, 1, 4, dtype=torch.float64))
    assert torch.equal(got_lse, torch.full((2, 1), -INF, dtype=torch.float64))


def test_combine_shape_errors() -> None:
    with pytest.raises(ValueError, match=r"\[N, B, H, D\]"):
        lse_combine_ref(torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 5))


@pytest.mark.parametrize("base_e", [True, False])
def test_correct_ref_sums_to_the_combine(base_e: bool) -> None:
    """The rescaled partials of every rank sum to the combine, and each carries its LSE."""
    outs = torch.randn(3, 4, 2, 5, dtype=torch.float64)
    lses = torch.randn(3, 4, 2, dtype=torch.float64) * 4
    lses[0, 0, 0] = NAN
    lses[:, 1, 1] = -INF
    outs[0, 0, 0] = NAN
    want_out, want_lse = lse_combine_ref(outs, lses, is_lse_base_on_e=base_e)
    total = torch.zeros_like(want_out)
    for r in range(3):
        out_r, lse_r = correct_attn_out_ref(outs[r], lses, r, is_lse_base_on_e=base_e)
        assert torch.equal(lse_r, want_lse)
        assert not out_r.isnan().any()
        total += out_r
    torch.testing.assert_close(total, want_out, rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=3\)"):
        correct_attn_out_ref(outs[0], lses, 3)
    with pytest.raises(ValueError, match=r"\[B, H, D\]"):
        correct_attn_out_ref(outs[0, :, :1], lses, 0)


# ---------------------------------------------------------------------------------------------
# attention_ref


def _attention_loops(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The most literal attention: a loop per (query, head)."""
    t_len, hq, _ = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(t_len, hq, v.shape[2], dtype=torch.float64)
    lse = torch.full((t_len, hq), -INF, dtype=torch.float64)
    for t in range(t_len):
        for h in range(hq):
            keys = [s for s in range(k.shape[0]) if visible[t, s]]
            if not keys:
                continue
            scores = [scale * float(q[t, h] @ k[s, h // group]) for s in keys]
            m = max(scores)
            z = sum(math.exp(x - m) for x in scores)
            lse[t, h] = m + math.log(z)
            for s, x in zip(keys, scores, strict=True):
                out[t, h] += math.exp(x - m) / z * v[s, h // group]
    return out, lse


@pytest.mark.parametrize(
    ("hq", "hkv", "dk", "dv"),
    [(4, 4, 8, 8), (6, 2, 5, 7), (3, 1, 9, 4)],
    ids=["mha", "gqa", "mla-like"],
)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_loops(hq: int, hkv: int, dk: int, dv: int, causal: bool) -> None:
    gen = torch.Generator().manual_seed(hq * 100 + dk)
    t_len, s_len = 3, 7
    q = torch.randn(t_len, hq, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(s_len, hkv, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(s_len, hkv, dv, generator=gen, dtype=torch.float64)
    scale = dk**-0.5
    out, lse = attention_ref(q, k, v, scale=scale, causal=causal)
    q_pos = torch.arange(s_len - t_len, s_len)
    visible = (
        torch.arange(s_len)[None, :] <= q_pos[:, None]
        if causal
        else torch.ones(t_len, s_len, dtype=torch.bool)
    )
    exp_out, exp_lse = _attention_loops(q, k, v, scale, visible)
    torch.testing.assert_close(out, exp_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, exp_lse, rtol=1e-12, atol=1e-12)
    out2, lse2 = attention_ref(q, k, v, scale=scale, causal=causal, is_lse_base_on_e=False)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(lse2 * LN2, lse, rtol=1e-14, atol=1e-14)


def test_attention_matches_sdpa() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(5, 4, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(5, 4, 16, generator=gen, dtype=torch.float64)
    out, _ = attention_ref(q, k, v, scale=0.3, causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.3
    ).transpose(0, 1)
    torch.testing.assert_close(out, sdpa, rtol=1e-12, atol=1e-12)


def test_attention_without_keys_is_zero_and_neginf() -> None:
    q = torch.randn(2, 3, 4, dtype=torch.float64)
    out, lse = attention_ref(q, torch.zeros(0, 1, 4), torch.zeros(0, 1, 6), scale=1.0)
    assert torch.equal(out, torch.zeros(2, 3, 6, dtype=torch.float64))
    assert torch.equal(lse, torch.full((2, 3), -INF, dtype=torch.float64))
    # Causal rows that see no key: positions before every key.
    k = torch.randn(3, 1, 4, dtype=torch.float64)
    out, lse = attention_ref(
        q, k, k, scale=1.0, causal=True, q_pos=torch.tensor([-1, 0]), k_pos=torch.tensor([0, 1, 2])
    )
    assert torch.equal(out[0], torch.zeros(3, 4, dtype=torch.float64))
    assert torch.isneginf(lse[0]).all()
    assert torch.isfinite(lse[1]).all()


def test_attention_shape_errors() -> None:
    q = torch.zeros(2, 6, 4)
    with pytest.raises(ValueError, match=r"Hq=6 must be a multiple of KV heads Hkv=4"):
        attention_ref(q, torch.zeros(3, 4, 4), torch.zeros(3, 4, 4), scale=1.0)
    with pytest.raises(ValueError, match="head dim 4"):
        attention_ref(q, torch.zeros(3, 2, 5), torch.zeros(3, 2, 4), scale=1.0)


# ---------------------------------------------------------------------------------------------
# sharding layouts


@pytest.mark.parametrize("layout", ["contiguous", "interleaved", "dual_chunk_swap"])
@pytest.mark.parametrize("seq_len", [0, 1, 7, 16, 33])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_layouts_partition_every_position_once(layout: str, seq_len: int, world_size: int) -> None:
    for interleave in [1, 3] if layout == "interleaved" else [1]:
        parts = [
            shard_positions(layout, seq_len, world_size, r, interleave) for r in range(world_size)
        ]
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq_len))


def test_interleaved_rule() -> None:
    for n, i, s in [(2, 1, 9), (4, 2, 21), (3, 5, 40)]:
        for r in range(n):
            pos = interleaved_shard_positions(s, n, r, i)
            assert all((p // i) % n == r for p in pos.tolist())
            assert torch.equal(pos, pos.sort().values)
    assert interleaved_shard_positions(10, 2, 1, 2).tolist() == [2, 3, 6, 7]


def test_contiguous_blocks() -> None:
    assert [contiguous_shard_positions(7, 3, r).tolist() for r in range(3)] == [
        [0, 1, 2],
        [3, 4],
        [5, 6],
    ]


def test_dual_chunk_swap_matches_the_documented_examples() -> None:
    assert dual_chunk_swap_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert dual_chunk_swap_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert [dual_chunk_swap_positions(8, 4, r).tolist() for r in range(4)] == [
        [0, 7],
        [1, 6],
        [2, 5],
        [3, 4],
    ]
    # 5 tokens on 2 ranks: padded to 8, chunk 2; padding positions >= 5 dropped or kept.
    assert dual_chunk_swap_positions(5, 2, 0).tolist() == [0, 1]
    assert dual_chunk_swap_positions(5, 2, 0, keep_padding=True).tolist() == [0, 1, 6, 7]
    assert dual_chunk_swap_positions(5, 2, 1).tolist() == [2, 3, 4]


def test_local_seq_lens_matches_closed_form() -> None:
    seq_lens = [0, 1, 5, 16, 17, 33, 64]
    for n in [1, 2, 3, 4, 8]:
        for i in [1, 2, 4, 16]:
            table = local_seq_lens(seq_lens, n, None, i)
            assert table.dtype == torch.int32
            assert table.shape == (len(seq_lens), n)
            assert table.sum(1).tolist() == seq_lens
            for r in range(n):
                base = [(s // (n * i)) * i for s in seq_lens]
                closed = [
                    b + min(max(s - b * n - r * i, 0), i)
                    for s, b in zip(seq_lens, base, strict=True)
                ]
                assert local_seq_lens(seq_lens, n, r, i).tolist() == closed


def test_sharding_argument_errors() -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        interleaved_shard_positions(4, 2, 2)
    with pytest.raises(ValueError, match="interleave_size must be >= 1, got 0"):
        interleaved_shard_positions(4, 2, 0, 0)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        contiguous_shard_positions(4.0, 2, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout must be"):
        shard_positions("zigzag", 4, 2, 0)


# ---------------------------------------------------------------------------------------------
# merging every shard's partial reproduces full attention


@pytest.mark.parametrize("layout", ["contiguous", "interleaved", "dual_chunk_swap"])
@pytest.mark.parametrize(
    ("hq", "hkv", "d"), [(4, 4, 8), (8, 2, 12), (5, 1, 9)], ids=["mha", "gqa", "mla-like"]
)
@pytest.mark.parametrize(
    ("t_len", "causal"),
    [(1, True), (3, True), (6, True), (4, False)],
    ids=["decode", "mtp3", "prefill-with-prefix", "bidirectional"],
)
@pytest.mark.parametrize("base_e", [True, False], ids=["base_e", "base_2"])
def test_merging_shard_partials_reproduces_full_attention(
    layout: str, hq: int, hkv: int, d: int, t_len: int, causal: bool, base_e: bool
) -> None:
    seed = ["contiguous", "interleaved", "dual_chunk_swap"].index(layout) * 1000 + hq * 10 + t_len
    gen = torch.Generator().manual_seed(seed)
    s_len = 19  # odd, not a multiple of 2N or of N*I
    q = torch.randn(t_len, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(s_len, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(s_len, hkv, d, generator=gen, dtype=torch.float64) * 3
    scale = d**-0.5
    full_out, full_lse = attention_ref(q, k, v, scale=scale, causal=causal, is_lse_base_on_e=base_e)
    for world_size in [1, 2, 3, 4, 8]:
        outs, lses = [], []
        for r in range(world_size):
            pos = shard_positions(layout, s_len, world_size, r, 2)
            o, lse = partial_attention_ref(
                q, k, v, pos, scale=scale, causal=causal, is_lse_base_on_e=base_e
            )
            outs.append(o)
            lses.append(lse)
        out, lse = lse_combine_ref(torch.stack(outs), torch.stack(lses), is_lse_base_on_e=base_e)
        torch.testing.assert_close(out, full_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)


def test_empty_shard_partial_is_zero_and_neginf() -> None:
    q = torch.randn(2, 2, 4, dtype=torch.float64)
    k = torch.randn(3, 1, 4, dtype=torch.float64)
    # 3 tokens on 4 ranks, interleave 1: rank 3 holds nothing.
    pos = interleaved_shard_positions(3, 4, 3)
    assert pos.numel() == 0
    out, lse = partial_attention_ref(q, k, k, pos, scale=1.0, causal=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


# ---------------------------------------------------------------------------------------------
# mask_empty_shards_ref


def test_mask_matches_the_documented_example() -> None:
    lse = torch.arange(14, dtype=torch.float32).reshape(7, 2)
    masked = mask_empty_shards_ref(lse, torch.tensor([0, 2]), torch.tensor([0, 1, 5]))
    assert torch.isneginf(masked[[0, 5, 6]]).all()
    assert torch.equal(masked[1:5], lse[1:5])
    assert torch.equal(lse, torch.arange(14, dtype=torch.float32).reshape(7, 2))  # a copy


def test_mask_zero_length_query_requests_and_errors() -> None:
    lse = torch.zeros(4, 1)
    # request 1 has no query rows; request 2 (rows 2-3) is empty on this rank.
    masked = mask_empty_shards_ref(lse, torch.tensor([3, 0, 0]), torch.tensor([0, 2, 2, 4]))
    assert masked.flatten().tolist() == [0.0, 0.0, -INF, -INF]
    with pytest.raises(ValueError, match="one more entry"):
        mask_empty_shards_ref(lse, torch.tensor([1, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"lse must be \[B, H\]"):
        mask_empty_shards_ref(torch.zeros(4), torch.tensor([1]), torch.tensor([0, 1]))


@pytest.mark.parametrize("magnitude", [1e4, 1e15, 1e30, -1e30])
def test_combine_is_exact_at_huge_lses(magnitude: float) -> None:
    """Two equal sources weigh one half each whatever their LSE (``exp(l - logsumexp)``
    lost the ``ln 2`` to rounding past about 1e13 and weighed each as one)."""
    outs = torch.tensor([1.0, 1.0], dtype=torch.float64).view(2, 1, 1, 1)
    lses = torch.full((2, 1, 1), magnitude, dtype=torch.float64)
    out, lse = lse_combine_ref(outs, lses)
    assert out.item() == 1.0
    assert lse.item() >= magnitude
