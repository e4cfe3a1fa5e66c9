"""DualChunkSwap plan: properties (hypothesis), worked examples, device handling, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpattn_pcp import DualChunkSwapPlan, dual_chunk_swap
from cpattn_testing import strategies
from cpattn_testing.reference import dual_chunk_swap_positions


def _expected_local_positions(seq_lens: list[int], n: int) -> list[list[tuple[int, int]]]:
    """Independent spelled-out rule: per rank, (request, position) in local order."""
    out: list[list[tuple[int, int]]] = []
    for r in range(n):
        rows: list[tuple[int, int]] = []
        for j, length in enumerate(seq_lens):
            c = -(-length // (2 * n))
            for chunk in (r, 2 * n - 1 - r):
                rows += [(j, chunk * c + k) for k in range(c)]
        out.append(rows)
    return out


def _heaviest_chunk_work(plan: DualChunkSwapPlan) -> int:
    """Sum over requests of the causal work of the request's last (heaviest) chunk."""
    n = plan.pcp_size
    return sum(c * (2 * n - 1) * c + c * (c + 1) // 2 for c in plan.chunk_sizes)


def check_plan(seq_lens: list[int], n: int) -> DualChunkSwapPlan:
    plan = dual_chunk_swap(seq_lens, n)
    total = sum(seq_lens)
    p = plan.padded_local_len
    starts = [0]
    for length in seq_lens:
        starts.append(starts[-1] + length)

    # Padding rule and sizes.
    for length, lp, c in zip(seq_lens, plan.padded_seq_lens, plan.chunk_sizes, strict=True):
        assert lp % (2 * n) == 0
        assert 0 <= lp - length < 2 * n
        assert c * 2 * n == lp
    assert p * n == sum(plan.padded_seq_lens)
    assert plan.num_tokens == total
    assert plan.local_positions.shape == (n, p)
    assert plan.gather_idx.shape == (n * p,)
    assert plan.restore_idx.shape == (total,)
    assert plan.cu_seqlens.dtype == torch.int32
    assert plan.cu_seqlens.tolist() == starts
    assert plan.max_seqlen == max(seq_lens, default=0)

    # Chunk assignment as specified (head chunk r, then tail chunk 2N-1-r, request-major).
    expected = _expected_local_positions(seq_lens, n)
    for r in range(n):
        assert plan.local_request_idx[r].tolist() == [j for j, _ in expected[r]]
        assert plan.local_positions[r].tolist() == [pos for _, pos in expected[r]]
        for i, (j, pos) in enumerate(expected[r]):
            real = pos < seq_lens[j]
            assert bool(plan.local_is_real[r, i]) == real
            assert int(plan.local_token_idx[r, i]) == (starts[j] + pos if real else -1)

    # Agrees with cpattn_testing's reference shard positions, request by request.
    for r in range(n):
        for j, length in enumerate(seq_lens):
            sel = plan.local_request_idx[r] == j
            ref = dual_chunk_swap_positions(length, n, r, keep_padding=True)
            assert plan.local_positions[r][sel].tolist() == ref.tolist()
            real_ref = dual_chunk_swap_positions(length, n, r)
            assert (
                plan.local_positions[r][sel & plan.local_is_real[r]].tolist() == real_ref.tolist()
            )

    # Every real token owned exactly once.
    owned = plan.local_token_idx[plan.local_is_real]
    assert sorted(owned.tolist()) == list(range(total))
    assert plan.num_local_tokens == tuple(int(x) for x in plan.local_is_real.sum(1))
    for r in range(n):
        real_rows = plan.local_is_real[r].nonzero().flatten().tolist()
        assert plan.local_extent[r] == (real_rows[-1] + 1 if real_rows else 0)

    # restore_idx / gather_idx are inverse on real tokens; padding points at its request's
    # first token.
    assert torch.equal(plan.gather_idx[plan.restore_idx], torch.arange(total))
    slots = torch.arange(n * p)
    real_slots = slots[plan.local_is_real.reshape(-1)]
    assert torch.equal(plan.restore_idx[plan.gather_idx[real_slots]], real_slots)
    pad = ~plan.local_is_real.reshape(-1)
    first = torch.tensor(starts[:-1], dtype=torch.int64)[plan.local_request_idx.reshape(-1)]
    assert torch.equal(plan.gather_idx[pad], first[pad])

    # Causal work: recomputed independently, and within one chunk's work of the mean.
    work = [sum(pos + 1 for j, pos in expected[r] if pos < seq_lens[j]) for r in range(n)]
    assert list(plan.causal_work) == work
    mean = sum(work) / n
    bound = _heaviest_chunk_work(plan)
    assert all(abs(w - mean) <= bound for w in work), (work, mean, bound)

    # Pure round trip: local rows of every rank -> restore == identity.
    x = torch.randn(total, 3, dtype=torch.float64)
    gathered = torch.cat([plan.local_rows(x, r) for r in range(n)]) if n * p else x[:0]
    assert torch.equal(plan.restore(gathered), x)
    return plan


@settings(max_examples=120, deadline=None)
@given(seq_lens=strategies.seq_lens_lists(), pcp_size=strategies.world_sizes())
def test_plan_properties(seq_lens: list[int], pcp_size: int) -> None:
    check_plan(seq_lens, pcp_size)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), pcp_size=strategies.world_sizes())
def test_plan_properties_short_prompts(data: st.DataObject, pcp_size: int) -> None:
    # Every prompt shorter than 2N (so every request is mostly padding), length 1 included.
    seq_lens = data.draw(st.lists(st.integers(1, 2 * pcp_size), min_size=1, max_size=6))
    check_plan(seq_lens, pcp_size)


@pytest.mark.parametrize("pcp_size", [1, 2, 3, 4, 8])
def test_plan_short_and_unit_lengths(pcp_size: int) -> None:
    # Lengths 1 and shorter than 2N: most local rows are padding, ranks may own nothing.
    plan = check_plan([1, 2 * pcp_size - 1, 1, pcp_size + 1], pcp_size)
    assert plan.num_tokens == 2 * pcp_size + pcp_size + 2


def test_worked_examples() -> None:
    plan = dual_chunk_swap([8, 8], 2)
    assert plan.local_token_idx.tolist() == [
        [0, 1, 6, 7, 8, 9, 14, 15],
        [2, 3, 4, 5, 10, 11, 12, 13],
    ]
    plan = dual_chunk_swap([8, 8], 4)
    assert plan.local_token_idx.tolist() == [
        [0, 7, 8, 15],
        [1, 6, 9, 14],
        [2, 5, 10, 13],
        [3, 4, 11, 12],
    ]
    # The picture in the module docstring: L = 14, N = 2.
    plan = dual_chunk_swap([14], 2)
    assert plan.local_token_idx.tolist() == [
        [0, 1, 2, 3, 12, 13, -1, -1],
        [4, 5, 6, 7, 8, 9, 10, 11],
    ]
    assert plan.causal_work == (1 + 2 + 3 + 4 + 13 + 14, sum(range(5, 13)))


def test_empty_batch_and_zero_length_requests() -> None:
    plan = check_plan([], 4)
    assert plan.padded_local_len == 0
    plan = check_plan([0, 3, 0], 2)
    assert plan.padded_seq_lens == (0, 4, 0)


def test_tensor_input_and_to() -> None:
    plan = dual_chunk_swap(torch.tensor([5, 1, 9], dtype=torch.int32), 2)
    ref = dual_chunk_swap([5, 1, 9], 2)
    assert torch.equal(plan.restore_idx, ref.restore_idx)
    np = pytest.importorskip("numpy")
    from_numpy = dual_chunk_swap(list(np.array([5, 1, 9])), 2)
    assert from_numpy.seq_lens == (5, 1, 9)
    assert plan.device == torch.device("cpu")
    assert plan.to("cpu") is plan


def test_plan_device_names_the_device_tensors_report() -> None:
    # "cpu:0" puts tensors on "cpu": the plan must say so, or every device check refuses them.
    from cpattn_pcp import slice_prefill_output_local
    from cpattn_testing.simulated import SimulatedWorld

    plan = dual_chunk_swap([5, 3], 1, device="cpu:0")
    assert plan.device == torch.device("cpu") == plan.restore_idx.device
    assert plan.to("cpu:0") is plan
    assert dual_chunk_swap([5, 3], 2).to(torch.device("cpu", 0)).device == torch.device("cpu")
    out = torch.randn(8, 2)
    (local,) = SimulatedWorld(1).run(
        lambda group: slice_prefill_output_local(plan, out, 8, pcp_group=group)
    )
    assert torch.equal(local, plan.local_rows(out, 0)[:8])


def test_more_tokens_than_int32_cu_seqlens_raises() -> None:
    # Refused from the lengths alone, before any [N, P] tensor is built.
    with pytest.raises(ValueError, match=r"2147483648 tokens; .* at most 2147483647"):
        dual_chunk_swap([2**30, 2**30], 4)
    with pytest.raises(ValueError, match="at most 2147483647"):
        dual_chunk_swap(torch.tensor([2**31]), 1)


def test_plan_on_device(device: torch.device) -> None:
    lens = torch.tensor([7, 1, 12], device=device)
    plan = dual_chunk_swap(lens, 2)
    assert plan.device == lens.device
    for t in (plan.restore_idx, plan.gather_idx, plan.local_token_idx, plan.cu_seqlens):
        assert t.device == lens.device
    x = torch.randn(20, 4, device=device)
    gathered = torch.cat([plan.local_rows(x, r) for r in range(2)])
    assert torch.equal(plan.restore(gathered), x)
    cpu_plan = plan.to("cpu")
    assert cpu_plan.restore_idx.device.type == "cpu"
    assert torch.equal(cpu_plan.restore_idx, dual_chunk_swap([7, 1, 12], 2).restore_idx)


@pytest.mark.parametrize(
    ("seq_lens", "pcp_size", "error", "match"),
    [
        ([4], 0, ValueError, "pcp_size must be >= 1, got 0"),
        ([4], -2, ValueError, "got -2"),
        ([4], True, TypeError, "pcp_size must be an int"),
        ([4], 2.0, TypeError, "pcp_size must be an int"),
        ([4, -1], 2, ValueError, r"\(1, -1\)"),
        ([4, 2.5], 2, TypeError, "must hold ints"),
        (torch.ones(2, 2, dtype=torch.int64), 2, ValueError, "1-D"),
        (torch.ones(3), 2, TypeError, "integers"),
        (torch.tensor([True, False]), 2, TypeError, "integers"),
        # operator.index takes a 0-d bool tensor as 0 / 1.
        (list(torch.tensor([True, False, True])), 2, TypeError, "must hold ints"),
        # No request order: a dict was planned by its keys, a set in hash order.
        ({0: 5, 1: 7}, 2, TypeError, r"must be a sequence .* got dict"),
        ({5, 7}, 2, TypeError, r"must be a sequence .* got set"),
    ],
    ids=[
        "zero",
        "negative",
        "bool",
        "float",
        "neg-len",
        "float-len",
        "2d",
        "float-tensor",
        "bool-tensor",
        "bool-tensor-elements",
        "dict",
        "set",
    ],
)
def test_bad_input(seq_lens: object, pcp_size: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        dual_chunk_swap(seq_lens, pcp_size)  # type: ignore[arg-type]


def test_plan_method_bad_input() -> None:
    plan = dual_chunk_swap([5, 3], 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        plan.local_rows(torch.zeros(8), 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got -1"):
        plan.local_rows(torch.zeros(8), -1)
    with pytest.raises(ValueError, match="num_tokens = 8 rows"):
        plan.local_rows(torch.zeros(7), 0)
    with pytest.raises(ValueError, match="= 12 rows"):
        plan.restore(torch.zeros(15))


@pytest.mark.parametrize(
    ("rank", "type_name"),
    [(1.0, "float"), (True, "bool"), (False, "bool"), ("0", "str"), (None, "NoneType")],
    ids=["float", "true", "false", "str", "none"],
)
def test_local_rows_rank_not_an_int(rank: object, type_name: str) -> None:
    """A rank that is not an int (a bool included) is a TypeError, as for every size and rank
    of the package (``dual_chunk_swap``'s ``pcp_size``, ``check_size``); only an int out of
    range is a ValueError."""
    plan = dual_chunk_swap([5, 3], 2)
    with pytest.raises(TypeError, match=f"rank must be an int, got {type_name}$"):
        plan.local_rows(torch.zeros(8), rank)  # type: ignore[arg-type]


def test_local_rows_rank_numpy_int() -> None:
    """A numpy integer is not an int here, as in ``check_size``: TypeError, not ValueError."""
    np = pytest.importorskip("numpy")
    plan = dual_chunk_swap([5, 3], 2)
    with pytest.raises(TypeError, match="rank must be an int, got int64"):
        plan.local_rows(torch.zeros(8), np.int64(1))  # type: ignore[arg-type]
