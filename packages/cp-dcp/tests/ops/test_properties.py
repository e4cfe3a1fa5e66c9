"""Property-based tests (hypothesis) of the DCP combine ops against the float64 references.

The hand-parametrized modules next to this one pin chosen shapes; here every example draws
its own geometry (N ranks, B rows, H heads, D head dim), dtypes, LSE base, memory layout and
adversarial LSE values (NaN, ±inf, ±1e4, exp over/underflow edges; from
``cpattn_testing.strategies``) and checks:

- the result against ``cpattn_testing.reference`` under the project's tolerance policy;
- the LSE numerics exactly: NaN/+inf LSEs count as -inf, a row without any contribution gives
  output 0 and LSE -inf, a source of weight 0 contributes exactly 0 even where its partial
  output holds NaN, and no NaN appears where the reference has a number;
- that every element an op owes is written (fresh outputs are NaN-poisoned by the
  cp-testing plugin, caller buffers are NaN-filled here) and nothing outside the op's view is
  touched (backing storages are compared bit for bit).

Shapes stay small (B <= 9, H <= 16, D <= 128, at most 256 gathered LSEs) so that the module
runs in well under a minute under ``TRITON_INTERPRET=1``; ``max_examples`` is set per test
for that budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpattn_common.alloc import get_output_poison
from cpattn_dcp import correct_attn_out, mask_dcp_empty_shards_
from cpattn_dcp.ops.a2a_combine import (
    a2a_buffer_views,
    a2a_pack,
    a2a_record_width,
    a2a_unpack_combine,
)
from cpattn_testing import strategies as cst
from cpattn_testing.reference import (
    correct_attn_out_ref,
    local_seq_lens,
    lse_combine_ref,
    mask_empty_shards_ref,
)
from cpattn_testing.tolerances import assert_close_to_ref, coarsest, lse_magnitude

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

View = Callable[[torch.Tensor], torch.Tensor]
#: A memory layout: its name, the shape of the backing storage, the view of that storage.
Layout = tuple[str, tuple[int, ...], View]

_OUT_DTYPES = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])
_LSE_DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
_INDEX_DTYPES = st.sampled_from([torch.int32, torch.int64])
# Awkward head dims first (odd, not a power of two), then the shared strategy's, capped.
_HEAD_DIMS = st.one_of(
    st.sampled_from([1, 3, 24, 40, 64, 80, 128]),
    cst.head_dims().filter(lambda d: d <= 128),
)
_MAX_ROWS = 9
_MAX_HEADS = 16
# Gathered LSEs drawn element by element: more than this makes hypothesis' smallest example
# too large (HealthCheck.large_base_example); B is capped to fit.
_MAX_LSE_COUNT = 256
_DEAD_LSE = st.sampled_from([-math.inf, math.inf, math.nan])
_LSE_SHIFTS = st.sampled_from([0.0, 0.0, 0.0, 1.0e3, 1.0e4, -1.0e4])
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        database=None,
    )


# ---- strategies ---------------------------------------------------------------------------


@st.composite
def _shapes(draw: st.DrawFn, *, heads_divisible: bool) -> tuple[int, int, int, int]:
    """``(N, B, H, D)``: N in 1..8, H <= 16 (a multiple of N when ``heads_divisible``),
    B <= 9 with ``N * B * H <= _MAX_LSE_COUNT``, awkward D <= 128."""
    n = draw(cst.world_sizes(8))
    if heads_divisible:
        h = n * draw(st.integers(min_value=1, max_value=_MAX_HEADS // n))
    else:
        h = draw(st.integers(min_value=1, max_value=_MAX_HEADS))
    b = draw(st.integers(min_value=1, max_value=max(1, min(_MAX_ROWS, _MAX_LSE_COUNT // (n * h)))))
    return n, b, h, draw(_HEAD_DIMS)


@st.composite
def _gathered_lses(draw: st.DrawFn, n: int, b: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    """Adversarial ``lses [N, B, H]`` (``cst.lse_tensors``); sometimes the finite ones are
    moved to within +-8 of +-1e3..1e4 (the weights depend only on differences: large, close
    LSEs must keep the output dtype's accuracy); sometimes one (b, h) has every source dead:
    each of its N LSEs -inf, +inf or NaN."""
    lses = draw(cst.lse_tensors((n, b, h), dtype=torch.float64))
    shift = draw(_LSE_SHIFTS)
    if shift:  # close values far from 0: finite LSEs clamped to +-8, then shifted
        lses = torch.where(torch.isfinite(lses), lses.clamp(-8.0, 8.0) + shift, lses)
    if draw(st.booleans()):
        bi = draw(st.integers(min_value=0, max_value=b - 1))
        hi = draw(st.integers(min_value=0, max_value=h - 1))
        dead = draw(st.lists(_DEAD_LSE, min_size=n, max_size=n))
        lses[:, bi, hi] = torch.tensor(dead, dtype=torch.float64)
    return lses.to(dtype)


@st.composite
def _requests(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    """``(seq_lens, query rows per request, padding rows)`` of a decode batch of at most
    ``_MAX_ROWS`` rows (at least one).

    Lengths come from ``cst.seq_lens_lists`` (zeros and short requests: empty shards) or are
    empty (R = 0). Sometimes the list is repeated to R >= 256 requests with a few query rows
    scattered among them (the 16-ary search of the row lookup instead of the direct count).
    Padding rows past ``query_start_loc[R]`` stand for CUDA-graph padding.
    """
    lens: list[int] = draw(st.one_of(cst.seq_lens_lists(max_requests=6, max_len=40), st.just([])))
    many = bool(lens) and draw(st.integers(min_value=0, max_value=3)) == 0
    if many:
        target = 256 + draw(st.integers(min_value=0, max_value=44))
        lens = (lens * (target // len(lens) + 1))[:target]
        counts = [0] * target
        for _ in range(draw(st.integers(min_value=0, max_value=4))):
            i = draw(st.integers(min_value=0, max_value=target - 1))
            counts[i] += draw(st.integers(min_value=1, max_value=2))
    else:
        counts = []
        budget = _MAX_ROWS
        for _ in lens:
            c = draw(st.integers(min_value=0, max_value=min(3, budget)))
            counts.append(c)
            budget -= c
    total = sum(counts)
    padding = draw(st.integers(min_value=1 if total == 0 else 0, max_value=_MAX_ROWS - total))
    return lens, counts, padding


def _query_start_loc(counts: list[int], dtype: torch.dtype) -> torch.Tensor:
    """``[R + 1]`` cumulative offsets of ``counts`` (starting at 0)."""
    qsl = [0]
    for c in counts:
        qsl.append(qsl[-1] + c)
    return torch.tensor(qsl, dtype=dtype)


# ---- memory layouts: (storage shape, view of the storage) ---------------------------------


@st.composite
def _out_layouts(draw: st.DrawFn, b: int, h: int, d: int, *, allow_4d: bool) -> Layout:
    """A ``[B, H, D]`` view of a backing storage: contiguous, a head/lane slice of padded
    storage (unaligned row strides), every other row, a transposed head dim (non-unit
    stride), batch and head axes swapped, or (``allow_4d``) the ``[B, 1, H, D]`` form."""
    kinds = ["contiguous", "slice", "row_step", "transposed_d", "swapped_bh"]
    kind = draw(st.sampled_from([*kinds, "singleton_4d"] if allow_4d else kinds))
    if kind == "slice":
        ph = draw(st.integers(min_value=0, max_value=3))
        pd = draw(st.integers(min_value=0, max_value=5))
        h0 = draw(st.integers(min_value=0, max_value=ph))
        d0 = draw(st.integers(min_value=0, max_value=pd))
        return kind, (b, h + ph, d + pd), lambda s: s[:, h0 : h0 + h, d0 : d0 + d]
    if kind == "row_step":
        return kind, (2 * b, h, d), lambda s: s[::2]
    if kind == "transposed_d":
        return kind, (b, d, h), lambda s: s.transpose(1, 2)
    if kind == "swapped_bh":
        return kind, (h, b, d), lambda s: s.transpose(0, 1)
    if kind == "singleton_4d":
        return kind, (b, 1, h, d), lambda s: s
    return kind, (b, h, d), lambda s: s


@st.composite
def _lses_layouts(draw: st.DrawFn, n: int, b: int, h: int) -> Layout:
    """An ``[N, B, H]`` view: contiguous, a head slice, a permutation of ``[B, H, N]`` or
    ``[H, N, B]`` storage, every other source, or the ``[N, B, H, 1]`` form."""
    kind = draw(st.sampled_from(["contiguous", "slice", "bhn", "hnb", "source_step", "nbh1"]))
    if kind == "slice":
        p = draw(st.integers(min_value=1, max_value=3))
        h0 = draw(st.integers(min_value=0, max_value=p))
        return kind, (n, b, h + p), lambda s: s[:, :, h0 : h0 + h]
    if kind == "bhn":
        return kind, (b, h, n), lambda s: s.permute(2, 0, 1)
    if kind == "hnb":
        return kind, (h, n, b), lambda s: s.permute(1, 2, 0)
    if kind == "source_step":
        return kind, (2 * n, b, h), lambda s: s[::2]
    if kind == "nbh1":
        return kind, (n, b, h, 1), lambda s: s
    return kind, (n, b, h), lambda s: s


@st.composite
def _lse_layouts(draw: st.DrawFn, b: int, h: int) -> Layout:
    """A ``[B, H]`` view: contiguous, a head slice, transposed storage, or every other row."""
    kind = draw(st.sampled_from(["contiguous", "slice", "transposed", "row_step"]))
    if kind == "slice":
        p = draw(st.integers(min_value=1, max_value=3))
        h0 = draw(st.integers(min_value=0, max_value=p))
        return kind, (b, h + p), lambda s: s[:, h0 : h0 + h]
    if kind == "transposed":
        return kind, (h, b), lambda s: s.t()
    if kind == "row_step":
        return kind, (2 * b, h), lambda s: s[::2]
    return kind, (b, h), lambda s: s


# ---- helpers ------------------------------------------------------------------------------


def _require_poisoning() -> None:
    """Fresh outputs must be NaN-filled (the cp-testing plugin's autouse fixture), so that a
    row a kernel forgets to write fails the comparison instead of passing on stale memory."""
    poison = get_output_poison()
    assert poison is not None, "output poisoning is not on"
    assert math.isnan(poison), f"outputs are poisoned with {poison}, not NaN"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern on the CPU (NaN payloads and signed zeros compare exactly)."""
    return t.detach().cpu().contiguous().view(_BITS[t.dtype])


def _storage(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    """Backing storage of random values with a few NaNs (bits compared, never numbers)."""
    s = torch.randn(shape, generator=gen, dtype=torch.float64)
    s = torch.where(torch.rand(shape, generator=gen) < 0.1, math.nan, s)
    return s.to(dtype).to(device)


def _assert_untouched_outside(
    before_bits: torch.Tensor, storage: torch.Tensor, view: View, name: str
) -> None:
    """Every element of ``storage`` outside ``view(storage)`` still has the bits it had
    before the call (``before_bits = _bits(storage)`` then)."""
    inside = torch.zeros(storage.shape, dtype=torch.bool)
    view(inside).fill_(True)
    changed = (_bits(storage) != before_bits) & ~inside
    assert not changed.any(), (
        f"{name}: written outside the view at {changed.nonzero()[:5].tolist()}"
    )


def _assert_no_new_nan(actual: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """NaN only where the reference has NaN."""
    bad = torch.isnan(actual.detach().cpu()) & ~torch.isnan(ref)
    assert not bad.any(), (
        f"{name}: NaN where the reference has none at {bad.nonzero()[:5].tolist()}"
    )


def _partials(
    n: int, b: int, h: int, d: int, lses: torch.Tensor, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """Random partial outputs ``[N, B, H, D]`` in ``dtype``, NaN wherever the source's LSE
    is dead (-inf/+inf/NaN): such a source must contribute exactly 0."""
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, b, h, d, generator=gen, dtype=torch.float64)
    outs[~torch.isfinite(lses.double())] = math.nan
    return outs.to(dtype)


def _fp32_lse_lanes(send: torch.Tensor, d: int) -> torch.Tensor:
    """The fp32 LSE of each row of a send/recv buffer ``[N, B, H_r, D + P]``."""
    lanes = a2a_buffer_views(send.detach().cpu(), d)[1].contiguous()
    if send.dtype == torch.float32:
        return lanes[..., 0]
    words = lanes.view(torch.int16).to(torch.int32) & 0xFFFF
    return (words[..., 0] | (words[..., 1] << 16)).view(torch.float32)


def _exchange(sends: list[torch.Tensor], dst: int) -> torch.Tensor:
    """What rank ``dst`` receives from the all-to-all: block ``dst`` of every rank's send."""
    return torch.stack([s[dst] for s in sends]).contiguous()


# ---- correct_attn_out ---------------------------------------------------------------------


@dataclass(frozen=True)
class _CorrectCase:
    """One ``correct_attn_out`` draw: geometry, dtypes, base, this rank, gathered LSEs."""

    n: int
    b: int
    h: int
    d: int
    dtype: torch.dtype
    lse_dtype: torch.dtype
    base_e: bool
    rank: int
    lses: torch.Tensor
    seed: int


@st.composite
def _correct_cases(draw: st.DrawFn) -> _CorrectCase:
    n, b, h, d = draw(_shapes(heads_divisible=False))
    lse_dtype = draw(_LSE_DTYPES)
    return _CorrectCase(
        n=n,
        b=b,
        h=h,
        d=d,
        dtype=draw(_OUT_DTYPES),
        lse_dtype=lse_dtype,
        base_e=draw(st.booleans()),
        rank=draw(st.integers(min_value=0, max_value=n - 1)),
        lses=draw(_gathered_lses(n, b, h, lse_dtype)),
        seed=draw(cst.seeds()),
    )


def _check_correct(
    got_out: torch.Tensor, got_lse: torch.Tensor, outs: torch.Tensor, case: _CorrectCase
) -> None:
    """``correct_attn_out``'s result against the reference, and its exact LSE numerics."""
    lses, rank = case.lses, case.rank
    ref_out, ref_lse = correct_attn_out_ref(outs[rank], lses, rank, is_lse_base_on_e=case.base_e)
    out_c, lse_c = got_out.detach().cpu(), got_lse.detach().cpu()
    assert got_lse.dtype == case.lse_dtype
    assert got_lse.shape == (case.b, case.h)
    tol = coarsest(case.dtype, case.lse_dtype)
    assert_close_to_ref(out_c, ref_out, dtype=tol, name=f"out (rank {rank})")
    # Judged against |max LSE| + 1: the merged LSE's absolute rounding, whatever its value
    # (hypothesis found 0 and -9.515625 merging to 7.37e-5, off by 2e-8 in fp32).
    lse_scale = lse_magnitude(lses)
    assert_close_to_ref(lse_c, ref_lse, dtype=case.lse_dtype, name="lse", scale=lse_scale)
    _assert_no_new_nan(out_c, ref_out, "out")
    _assert_no_new_nan(lse_c, ref_lse, "lse")
    # Exact: a dead own LSE (-inf, +inf or NaN) is weight 0 -> output 0 although the partial
    # holds NaN there; a row whose every source is dead -> LSE -inf.
    dead = ~torch.isfinite(lses.double())
    assert (out_c[dead[rank]] == 0).all(), "weight-0 rows are not exactly 0"
    assert torch.isneginf(lse_c[dead.all(dim=0)]).all(), "all-dead rows do not have LSE -inf"


@_settings(max_examples=100)
@given(case=_correct_cases())
def test_correct_attn_out_contiguous(device: torch.device, case: _CorrectCase) -> None:
    """Contiguous ``out``/``lses`` (the lean kernel): ``out`` is scaled in place to
    ``w_rank * out`` and the returned LSE (``lses``' dtype, a fresh poisoned buffer) is the
    global one, within tolerance, for fp32/fp16/bf16 outputs and LSEs, base e and base 2;
    dead LSEs count as -inf, weight 0 writes exactly 0 over a NaN partial, all-dead rows
    give 0 / -inf, and no NaN appears where the reference has none."""
    _require_poisoning()
    outs = _partials(case.n, case.b, case.h, case.d, case.lses, case.seed, case.dtype)
    part = outs[case.rank].to(device, copy=True)  # never an alias of the reference's input
    lses = case.lses.to(device, copy=True)
    got_out, got_lse = correct_attn_out(part, lses, case.rank, is_lse_base_on_e=case.base_e)
    assert got_out.data_ptr() == part.data_ptr()
    assert torch.equal(_bits(lses), _bits(case.lses)), "lses modified"
    _check_correct(got_out, got_lse, outs, case)


@st.composite
def _strided_cases(draw: st.DrawFn) -> tuple[_CorrectCase, Layout, Layout]:
    case = draw(_correct_cases())
    out_layout = draw(_out_layouts(case.b, case.h, case.d, allow_4d=True))
    return case, out_layout, draw(_lses_layouts(case.n, case.b, case.h))


@_settings(max_examples=100)
@given(drawn=_strided_cases())
def test_correct_attn_out_strided(
    device: torch.device, drawn: tuple[_CorrectCase, Layout, Layout]
) -> None:
    """Non-contiguous views (the general kernel and its non-unit head-dim fallback): ``out``
    a head/lane slice, strided rows, transposed or ``[B, 1, H, D]``; ``lses`` sliced,
    permuted, strided or ``[N, B, H, 1]``. Same numbers and exact numerics as the
    contiguous path, ``out`` is corrected in place in the caller's storage, and neither
    backing storage changes outside the view (bit for bit; ``lses`` not at all)."""
    _require_poisoning()
    case, (out_kind, out_shape, out_view), (lses_kind, lses_shape, lses_view) = drawn
    b, h, d = case.b, case.h, case.d
    outs = _partials(case.n, case.b, case.h, case.d, case.lses, case.seed, case.dtype)
    gen = torch.Generator().manual_seed(case.seed ^ 0x5EED)
    out_storage = _storage(out_shape, case.dtype, device, gen)
    part = out_view(out_storage)
    part.copy_(outs[case.rank].reshape(part.shape).to(device))
    lses_storage = _storage(lses_shape, case.lse_dtype, device, gen)
    lses_arg = lses_view(lses_storage)
    lses_arg.copy_(case.lses.reshape(lses_arg.shape).to(device))
    out_before, lses_before = _bits(out_storage), _bits(lses_storage)

    got_out, got_lse = correct_attn_out(part, lses_arg, case.rank, is_lse_base_on_e=case.base_e)

    assert got_out.shape == (b, h, d), out_kind
    assert got_out.data_ptr() == part.data_ptr(), out_kind
    # Read the result back from the caller's storage, through the caller's view.
    _check_correct(out_view(out_storage).reshape(b, h, d), got_lse, outs, case)
    _assert_untouched_outside(out_before, out_storage, out_view, f"out storage ({out_kind})")
    assert torch.equal(_bits(lses_storage), lses_before), f"lses modified ({lses_kind})"


# ---- A2A pack -> all-to-all -> unpack-combine ---------------------------------------------


@dataclass(frozen=True)
class _A2ACase:
    """One A2A round-trip draw. ``lens``/``counts`` are the requests of the fused mask
    (``masked``): global KV lengths (sharded by ``interleave``) and query rows per request."""

    n: int
    b: int
    h: int
    d: int
    dtype: torch.dtype
    lse_dtype: torch.dtype
    base_e: bool
    masked: bool
    lens: list[int]
    counts: list[int]
    interleave: int
    index_dtype: torch.dtype
    lses: torch.Tensor
    out_layout: Layout
    lse_layout: Layout
    send_offset: int | None
    return_lse: bool
    seed: int


@st.composite
def _a2a_cases(draw: st.DrawFn) -> _A2ACase:
    n, b, h, d = draw(_shapes(heads_divisible=True))
    masked = draw(st.booleans())
    lens: list[int] = []
    counts: list[int] = []
    if masked:
        lens, counts, padding = draw(_requests())
        b = sum(counts) + padding
        # Keep the gathered LSEs within the element-wise draw's budget (fewer heads first).
        while n * b * h > _MAX_LSE_COUNT:
            if h > n:
                h -= n
            else:
                n -= 1
                h = n
    lse_dtype = draw(_LSE_DTYPES)
    return _A2ACase(
        n=n,
        b=b,
        h=h,
        d=d,
        dtype=draw(_OUT_DTYPES),
        lse_dtype=lse_dtype,
        base_e=draw(st.booleans()),
        masked=masked,
        lens=lens,
        counts=counts,
        interleave=draw(cst.interleave_sizes()),
        index_dtype=draw(_INDEX_DTYPES),
        lses=draw(_gathered_lses(n, b, h, lse_dtype)),
        out_layout=draw(_out_layouts(b, h, d, allow_4d=False)),
        lse_layout=draw(_lse_layouts(b, h)),
        send_offset=draw(st.sampled_from([None, 0, 1])),
        return_lse=draw(st.booleans()),
        seed=draw(cst.seeds()),
    )


def _pack_rank(
    device: torch.device,
    case: _A2ACase,
    rank: int,
    out_r: torch.Tensor,
    lse_r: torch.Tensor,
    masked_lse_r: torch.Tensor,
    seq_lens: torch.Tensor | None,
    qsl: torch.Tensor | None,
    gen: torch.Generator,
) -> torch.Tensor:
    """``a2a_pack`` of one rank from strided copies of its inputs, with every check of the
    send buffer; returns the send buffer."""
    n, b, h, d = case.n, case.b, case.h, case.d
    hr, rec = h // n, a2a_record_width(d, case.dtype)
    out_kind, out_shape, out_view = case.out_layout
    lse_kind, lse_shape, lse_view = case.lse_layout
    out_storage = _storage(out_shape, case.dtype, device, gen)
    out_view(out_storage).copy_(out_r.to(device))
    lse_storage = _storage(lse_shape, case.lse_dtype, device, gen)
    lse_view(lse_storage).copy_(lse_r.to(device))
    inputs_before = (_bits(out_storage), _bits(lse_storage))
    buffer = send = None
    if case.send_offset is not None:
        # A caller's buffer, NaN-filled, with ``send`` a contiguous view at an offset.
        numel = n * b * hr * rec
        buffer = torch.full((case.send_offset + numel + 3,), math.nan, dtype=case.dtype)
        buffer = buffer.to(device)
        send = buffer[case.send_offset : case.send_offset + numel].view(n, b, hr, rec)
    buffer_before = None if buffer is None else _bits(buffer)

    got = a2a_pack(
        out_view(out_storage),
        lse_view(lse_storage),
        n,
        seq_lens=None if seq_lens is None else seq_lens.to(device),
        query_start_loc=None if qsl is None else qsl.to(device),
        send=send,
    )

    assert send is None or got is send
    assert got.shape == (n, b, hr, rec)
    assert torch.equal(_bits(out_storage), inputs_before[0]), f"pack wrote to out ({out_kind})"
    assert torch.equal(_bits(lse_storage), inputs_before[1]), f"pack wrote to lse ({lse_kind})"
    # Every lane written (the views cover the whole buffer): payload bit copies, the
    # (masked) LSE as fp32.
    want = out_r.view(b, n, hr, d).transpose(0, 1)
    payload = a2a_buffer_views(got, d)[0]
    assert torch.equal(_bits(payload), _bits(want)), f"payload rank {rank} ({out_kind})"
    want_lse = masked_lse_r.float().view(b, n, hr).transpose(0, 1)
    torch.testing.assert_close(_fp32_lse_lanes(got, d), want_lse, rtol=0, atol=0, equal_nan=True)
    if buffer is not None and buffer_before is not None and case.send_offset is not None:
        changed = _bits(buffer) != buffer_before
        changed[case.send_offset : case.send_offset + got.numel()] = False
        assert not changed.any(), "pack wrote outside send"
    return got


@_settings(max_examples=40)
@given(case=_a2a_cases())
def test_a2a_round_trip(device: torch.device, case: _A2ACase) -> None:
    """``a2a_pack`` on every rank, the all-to-all by indexing, ``a2a_unpack_combine`` on
    every rank gives that rank's heads of the float64 combine (optionally after the fused
    empty-shard mask: interleaved local lengths with empty shards, R = 0 or R >= 256
    requests, padding rows past ``query_start_loc[R]``) within tolerance, with the exact
    numerics (dead LSEs count as -inf; masked and all-dead rows give 0 / -inf over NaN
    partials; no new NaN). The pack writes every lane of its send buffer (fresh and poisoned,
    or the caller's NaN-filled one): payload bit copies and the masked fp32 LSE;
    nothing outside ``send`` in the caller's buffer; and it never modifies its strided
    inputs. The unpack's outputs are fresh poisoned buffers."""
    _require_poisoning()
    n, hr, d = case.n, case.h // case.n, case.d
    seq_lens: list[torch.Tensor | None] = [None] * n
    qsl: torch.Tensor | None = None
    masked_lses = case.lses
    if case.masked:
        qsl = _query_start_loc(case.counts, case.index_dtype)
        local = local_seq_lens(case.lens, n, None, case.interleave)  # [R, N]
        seq_lens = [local[:, r].to(case.index_dtype) for r in range(n)]
        masked_lses = torch.stack(
            [mask_empty_shards_ref(case.lses[r], local[:, r], qsl) for r in range(n)]
        )
    outs = _partials(n, case.b, case.h, d, masked_lses, case.seed, case.dtype)
    ref_out, ref_lse = lse_combine_ref(outs, masked_lses, is_lse_base_on_e=case.base_e)
    gen = torch.Generator().manual_seed(case.seed ^ 0xA2A)
    sends = [
        _pack_rank(device, case, r, outs[r], case.lses[r], masked_lses[r], seq_lens[r], qsl, gen)
        for r in range(n)
    ]

    tol = coarsest(case.dtype, case.lse_dtype)
    lse_scale = lse_magnitude(masked_lses)  # see _check_correct
    all_dead = (~torch.isfinite(masked_lses.double())).all(dim=0)
    for dst in range(n):
        heads = slice(dst * hr, (dst + 1) * hr)
        got_out, got_lse = a2a_unpack_combine(
            _exchange(sends, dst),
            head_dim=d,
            return_lse=case.return_lse,
            is_lse_base_on_e=case.base_e,
        )
        assert got_out.dtype == case.dtype
        out_c = got_out.cpu()
        assert_close_to_ref(out_c, ref_out[:, heads], dtype=tol, name=f"out rank {dst}")
        _assert_no_new_nan(out_c, ref_out[:, heads], f"out rank {dst}")
        assert (out_c[all_dead[:, heads]] == 0).all(), "rows without contribution are not 0"
        if not case.return_lse:
            assert got_lse is None
            continue
        assert got_lse is not None
        assert got_lse.dtype == torch.float32
        lse_c = got_lse.cpu()
        assert_close_to_ref(
            lse_c, ref_lse[:, heads], dtype=torch.float32, name=f"lse rank {dst}",
            scale=lse_scale[:, heads],
        )  # fmt: skip
        _assert_no_new_nan(lse_c, ref_lse[:, heads], f"lse rank {dst}")
        assert torch.isneginf(lse_c[all_dead[:, heads]]).all(), "all-dead rows: LSE not -inf"


# ---- mask_dcp_empty_shards_ ---------------------------------------------------------------


@dataclass(frozen=True)
class _MaskCase:
    """One ``mask_dcp_empty_shards_`` draw: local lengths, query rows per request, the
    LSE values ``[B, H]`` and the view they are written through."""

    lens: list[int]
    counts: list[int]
    index_dtype: torch.dtype
    lse: torch.Tensor
    layout: Layout
    seed: int


@st.composite
def _mask_cases(draw: st.DrawFn) -> _MaskCase:
    lens, counts, padding = draw(_requests())
    b = sum(counts) + padding
    h = draw(st.integers(min_value=1, max_value=_MAX_HEADS))
    return _MaskCase(
        lens=lens,
        counts=counts,
        index_dtype=draw(_INDEX_DTYPES),
        lse=draw(cst.lse_tensors((b, h), dtype=draw(_LSE_DTYPES))),
        layout=draw(_lse_layouts(b, h)),
        seed=draw(cst.seeds()),
    )


@_settings(max_examples=100)
@given(case=_mask_cases())
def test_mask_dcp_empty_shards(device: torch.device, case: _MaskCase) -> None:
    """``mask_dcp_empty_shards_`` on a (strided) ``lse [B, H]`` view equals
    ``mask_empty_shards_ref`` bit for bit: rows of requests without local KV and padding
    rows past ``query_start_loc[R]`` become -inf, every other element keeps its exact bits
    (NaN and +inf included); it returns ``lse`` itself and changes neither the backing
    storage outside the view nor its index inputs."""
    kind, shape, view = case.layout
    seq_lens = torch.tensor(case.lens, dtype=case.index_dtype)
    qsl = _query_start_loc(case.counts, case.index_dtype)
    expected = mask_empty_shards_ref(case.lse, seq_lens, qsl)
    gen = torch.Generator().manual_seed(case.seed)
    storage = _storage(shape, case.lse.dtype, device, gen)
    lse = view(storage)
    lse.copy_(case.lse.to(device))
    before = _bits(storage)
    sl_dev, qsl_dev = seq_lens.to(device, copy=True), qsl.to(device, copy=True)

    ret = mask_dcp_empty_shards_(lse, sl_dev, qsl_dev)

    assert ret is lse
    assert torch.equal(_bits(view(storage)), _bits(expected)), f"masked lse ({kind})"
    _assert_untouched_outside(before, storage, view, f"lse storage ({kind})")
    assert torch.equal(sl_dev.cpu(), seq_lens)
    assert torch.equal(qsl_dev.cpu(), qsl)
