"""mask_dcp_empty_shards_: kernel vs cpattn_testing.reference.mask_empty_shards_ref."""

from __future__ import annotations

import pytest
import torch

import cpattn_dcp.ops.mask_empty_shards as mask_mod
from cpattn_common.alloc import get_output_poison
from cpattn_dcp import mask_dcp_empty_shards_
from cpattn_dcp.ops._common import check_mask_args
from cpattn_dcp.ops.mask_empty_shards import (
    _check_lse,
    _check_writable,
    _valid_fast,
    masked_lse_copy,
)
from cpattn_testing.dispatch import assert_dispatches
from cpattn_testing.reference import mask_empty_shards_ref

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _qsl(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def test_vllm_seven_rows(device: torch.device) -> None:
    lse = torch.randn(7, 3, device=device)
    before = lse.clone()
    seq_lens = torch.tensor([0, 2], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1, 5], dtype=torch.int32, device=device)
    ret = mask_dcp_empty_shards_(lse, seq_lens, qsl)
    assert ret is lse
    assert torch.isneginf(lse[[0, 5, 6]]).all()
    assert torch.equal(lse[1:5], before[1:5])


@pytest.mark.parametrize(
    ("lens", "counts", "padding", "lse_dtype"),
    [
        ([16, 0, 16, 0], [1, 1, 1, 1], 0, torch.float32),
        ([0, 0, 0], [2, 3, 1], 2, torch.bfloat16),
        ([5, 0, 7, 1, 0, 3, 0], [3, 0, 2, 1, 1, 0, 2], 3, torch.float16),
        ([7], [1], 0, torch.float32),
        ([4] * 37 + [0] * 3, [1] * 40, 5, torch.float32),
        # R >= 256 takes the binary-search path instead of the direct count.
        ([(7 * i) % 5 for i in range(300)], [(3 * i) % 4 for i in range(300)], 3, torch.float32),
    ],
    ids=["alt", "all-empty", "ragged-zero-queries", "single", "many-seqs", "binary-search"],
)
def test_matches_reference(
    device: torch.device,
    lens: list[int],
    counts: list[int],
    padding: int,
    lse_dtype: torch.dtype,
) -> None:
    qsl = _qsl(counts)
    b = int(qsl[-1]) + padding
    gen = torch.Generator().manual_seed(len(lens) * 7 + padding)
    # Non-contiguous view into padded-head storage.
    host = torch.randn(b, 9, generator=gen).to(lse_dtype)
    storage = host.to(device)
    lse = storage[:, 1:6]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = mask_empty_shards_ref(host[:, 1:6], seq_lens, qsl)
    bits = torch.int16 if lse_dtype != torch.float32 else torch.int32
    # The combines' masked copy first (same kernel, copy mode; a bf16 select with -inf
    # failed in Triton's interpreter up to 3.8), then the in-place mask.
    copied = masked_lse_copy(lse, seq_lens.to(device), qsl.to(device))
    assert torch.equal(copied.cpu().view(bits), expected.contiguous().view(bits))
    mask_dcp_empty_shards_(lse, seq_lens.to(device), qsl.to(device))
    assert torch.equal(lse.cpu().contiguous().view(bits), expected.contiguous().view(bits))
    # Columns outside the view are untouched.
    assert torch.equal(storage[:, 0].cpu(), host[:, 0])
    assert torch.equal(storage[:, 6:].cpu(), host[:, 6:])


def test_int64_inputs_and_zero_seqs(device: torch.device) -> None:
    lse = torch.randn(3, 2, device=device)
    mask_dcp_empty_shards_(
        lse,
        torch.zeros(0, dtype=torch.int64, device=device),
        torch.zeros(1, dtype=torch.int64, device=device),
    )
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("index_dtype", [torch.int8, torch.int16, torch.uint8, torch.int64])
@pytest.mark.parametrize("num_seqs", [2, 300])  # direct count, 16-ary search
def test_narrow_index_dtypes(device: torch.device, index_dtype: torch.dtype, num_seqs: int) -> None:
    """Index tensors of any integer width: the out-of-range lanes of the direct count must not
    wrap (an int16 fill of 2^31 - 1 reads as -1 and once unmasked row 0)."""
    counts = [1 + (i % 2) for i in range(num_seqs)] if num_seqs < 100 else [0] * num_seqs
    if num_seqs >= 100:
        counts[3], counts[200] = 2, 1  # qsl stays <= 3: fits int8 / uint8
    qsl = _qsl(counts)
    lens = torch.tensor([(i * 7) % 3 for i in range(num_seqs)], dtype=torch.int32)
    b = int(qsl[-1]) + 1
    lse = torch.randn(b, 3)
    expected = mask_empty_shards_ref(lse, lens, qsl)
    actual = mask_dcp_empty_shards_(
        lse.to(device), lens.to(index_dtype).to(device), qsl.to(index_dtype).to(device)
    )
    assert torch.equal(actual.cpu(), expected)


@pytest.mark.no_checks  # a request reaching past the batch: what check mode refuses
@pytest.mark.parametrize("num_seqs", [5, 300])  # direct count, 16-ary search
def test_int64_boundaries_past_int32(device: torch.device, num_seqs: int) -> None:
    """int64 boundaries beyond the int32 range (a request that reaches past the batch, and a
    padding start past it): the int32 row test clamps them without changing a comparison."""
    qsl = torch.tensor([0, *range(2, 2 * num_seqs, 2), 2**40], dtype=torch.int64)
    lens = torch.tensor([(i * 5) % 3 for i in range(num_seqs)], dtype=torch.int64)
    lse = torch.randn(2 * num_seqs + 7, 4)
    expected = mask_empty_shards_ref(lse, lens, qsl)
    actual = mask_dcp_empty_shards_(lse.to(device), lens.to(device), qsl.to(device))
    assert torch.equal(actual.cpu(), expected)


@pytest.mark.parametrize("row32", [True, False])
@pytest.mark.parametrize("num_seqs", [40, 300])
def test_row_index_widths_agree(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, row32: bool, num_seqs: int
) -> None:
    """The int32 and int64 row paths (int64 is taken only past 2^31 rows, so forced here),
    in place and as a copy, with small tiles (many programs) and the largest ones."""
    counts = [(3 * i) % 4 for i in range(num_seqs)]
    qsl = _qsl(counts)
    lens = torch.tensor([(i * 7) % 3 for i in range(num_seqs)], dtype=torch.int32)
    lse = torch.randn(int(qsl[-1]) + 3, 5)
    expected = mask_empty_shards_ref(lse, lens, qsl)
    for tile_lanes, min_programs in ((16, 64), (1 << 30, 1)):
        for name, value in (
            ("_MASK_ROW32", row32),
            ("_MASK_TILE_LANES", tile_lanes),
            ("_MASK_MIN_PROGRAMS", min_programs),
        ):
            monkeypatch.setattr(mask_mod, name, value)
        mask_mod._mask_plan.cache_clear()
        args = (lens.to(device), qsl.to(device))
        copied = masked_lse_copy(lse.to(device), *args)
        assert torch.equal(copied.cpu(), expected)
        assert torch.equal(mask_dcp_empty_shards_(lse.to(device), *args).cpu(), expected)
    monkeypatch.undo()
    mask_mod._mask_plan.cache_clear()


def test_mask_tile_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows per program: at most _BLOCK_B, a count tile of at most _MASK_TILE_LANES lanes,
    then halved until the grid has _MASK_MIN_PROGRAMS programs; int32 rows where they fit."""
    monkeypatch.setattr(mask_mod, "_MASK_TILE_LANES", 256)
    monkeypatch.setattr(mask_mod, "_MASK_MIN_PROGRAMS", 1)
    assert mask_mod._mask_tile(4096, 4, True) == (16, True)  # direct count: 16 lanes
    assert mask_mod._mask_tile(4096, 7, True) == (2, True)  # 128 lanes
    assert mask_mod._mask_tile(4096, 13, True) == (16, True)  # 16-ary search: 16 lanes
    assert mask_mod._mask_tile(4096, 7, False) == (64, True)  # no mask: no count tile
    assert mask_mod._mask_tile(5, 1, True) == (8, True)
    assert mask_mod._mask_tile(2**31 - 8, 1, True) == (64, False)
    monkeypatch.setattr(mask_mod, "_MASK_MIN_PROGRAMS", 264)
    assert mask_mod._mask_tile(64, 7, True) == (1, True)
    assert mask_mod._mask_tile(4096, 13, True) == (8, True)


def test_none_is_noop(device: torch.device) -> None:
    lse = torch.randn(4, 2, device=device)
    before = lse.clone()
    mask_dcp_empty_shards_(lse, None, None)
    assert torch.equal(lse, before)
    # The no-op still checks lse, as its docstring says.
    with pytest.raises(ValueError, match="float64"):
        mask_dcp_empty_shards_(lse.double(), None, None)
    with pytest.raises(ValueError, match=r"expected lse \[B, H\]"):
        mask_dcp_empty_shards_(lse[0], None, None)


def test_bad_inputs(device: torch.device) -> None:
    lse = torch.randn(4, 2, device=device)
    sl = torch.tensor([1, 2], device=device)
    qsl = torch.tensor([0, 1, 3], device=device)
    with pytest.raises(ValueError, match="provided together"):
        mask_dcp_empty_shards_(lse, sl, None)
    with pytest.raises(ValueError, match="provided together"):
        mask_dcp_empty_shards_(lse, None, qsl)
    with pytest.raises(ValueError, match=r"one boundary per sequence.*2 boundaries for 2"):
        mask_dcp_empty_shards_(lse, sl, qsl[:2])
    with pytest.raises(ValueError, match="1-D"):
        mask_dcp_empty_shards_(lse, sl[None], qsl)
    with pytest.raises(ValueError, match=r"expected lse \[B, H\]"):
        mask_dcp_empty_shards_(lse[0], sl, qsl)
    with pytest.raises(TypeError, match="floating"):
        mask_dcp_empty_shards_(lse.long(), sl, qsl)
    with pytest.raises(TypeError, match="integer"):
        mask_dcp_empty_shards_(lse, sl.float(), qsl)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="device"):
            mask_dcp_empty_shards_(lse, sl.cpu(), qsl.cpu())
    # Rows sharing memory: masking row 0 in place would mask every row. Without masking
    # nothing is written, so the same view is accepted.
    shared = torch.randn(1, 2, device=device).expand(4, 2)
    with pytest.raises(ValueError, match="share memory"):
        mask_dcp_empty_shards_(shared, sl, qsl)
    assert mask_dcp_empty_shards_(shared, None, None) is shared
    # torch's negative bit (memory holds -lse): the -inf stored in place read as +inf.
    negated = torch._neg_view(-lse)
    with pytest.raises(ValueError, match=r"lse has torch's negative bit set .* lse\.resolve_neg"):
        mask_dcp_empty_shards_(negated, sl, qsl)


def test_opcheck(device: torch.device) -> None:
    lse = torch.randn(6, 3, device=device)
    sl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.cpattn_dcp.mask_dcp_empty_shards_.default, (lse, sl, qsl))


def test_compile_fullgraph(device: torch.device) -> None:
    sl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)

    def fn(lse: torch.Tensor) -> torch.Tensor:
        lse = lse * 1.0
        mask_dcp_empty_shards_(lse, sl, qsl)
        return lse + 0.0

    x = torch.randn(7, 3, device=device)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, fn(x))
    assert torch.isneginf(got[[0, 1, 5, 6]]).all()
    assert torch.isfinite(got[2:5]).all()


def test_dispatch_modes_see_the_registered_op(device: torch.device) -> None:
    """FakeTensorMode, make_fx and any TorchDispatchMode go through the registered op (the
    eager shortcut launched the kernel under them)."""
    sl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    assert_dispatches(
        mask_dcp_empty_shards_,
        (torch.randn(7, 3, device=device), sl, qsl),
        "cpattn_dcp.mask_dcp_empty_shards_.default",
    )


def _accepted(lse: object, sl: object, qsl: object) -> bool:
    """Whether the full validation accepts the arguments with masking on."""
    try:
        _check_lse(lse)  # type: ignore[arg-type]
        assert isinstance(lse, torch.Tensor)
        on = check_mask_args(sl, qsl, lse.device)  # type: ignore[arg-type]
        _check_writable(lse)
        return on
    except (TypeError, ValueError):
        return False


@pytest.mark.no_checks  # check mode sends every call through the full validation
def test_fast_check_implies_validation(device: torch.device) -> None:
    """The eager hot path skips the full validation only for arguments it accepts; anything
    else (``None``, other index dtypes, subclasses) takes the full path."""
    lse = torch.randn(4, 2, device=device)
    sl = torch.tensor([1, 2], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    assert _valid_fast(lse, sl, qsl)  # plain tensors: the CPU suite covers the hot path
    variants: list[tuple[object, object, object]] = [
        (lse, sl.long(), qsl.long()),
        (lse.t(), sl, qsl),
        (lse.half(), sl[:0], qsl[:1]),
        (lse, sl, qsl[:2]),
        (lse[:1].expand(4, 2), sl, qsl),
        (lse, sl[None], qsl),
        (lse, sl, qsl[None]),
        (lse[0], sl, qsl),
        (lse[None], sl, qsl),
        (lse.long(), sl, qsl),
        (lse.double(), sl, qsl),
        (lse, sl.float(), qsl),
        (lse, sl, qsl.bool()),
        (lse, sl.short(), qsl),
        (torch.nn.Parameter(lse, requires_grad=False), sl, qsl),
    ]
    for a, s, q in variants:
        if _valid_fast(a, s, q):  # type: ignore[arg-type]
            assert _accepted(a, s, q), (a, s, q)


def test_other_index_dtype_takes_full_path(device: torch.device) -> None:
    """Index dtypes outside int32/int64 fail the cheap check and are still accepted
    (through the validated path)."""
    lse = torch.randn(7, 3, device=device)
    sl = torch.tensor([0, 2], dtype=torch.uint8, device=device)
    qsl = torch.tensor([0, 1, 5], dtype=torch.uint8, device=device)
    assert not _valid_fast(lse, sl, qsl)
    assert _accepted(lse, sl.short(), qsl.short())
    before = lse.clone()
    mask_dcp_empty_shards_(lse, sl, qsl)
    assert torch.isneginf(lse[[0, 5, 6]]).all()
    assert torch.equal(lse[1:5], before[1:5])


@pytest.mark.no_output_poison
def test_masked_copy_without_output_poisoning(device: torch.device) -> None:
    """With poisoning off (production) the copy is a plain ``new_empty`` allocation: fully
    written by the kernel, contiguous even for a strided source."""
    assert get_output_poison() is None
    host = torch.randn(9, 7)
    lse = host.to(device)[:, 1:6]
    sl = torch.tensor([0, 3], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    got = masked_lse_copy(lse, sl.to(device), qsl.to(device))
    assert got.is_contiguous()
    assert torch.equal(got.cpu(), mask_empty_shards_ref(host[:, 1:6], sl, qsl))
    plain = masked_lse_copy(lse, None, None)
    assert plain.is_contiguous()
    assert torch.equal(plain.cpu(), host[:, 1:6])


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int16])
def test_every_eager_call_marks_lse_written(device: torch.device, index_dtype: torch.dtype) -> None:
    """The eager path masks lse outside the dispatcher; it bumps lse's version like the
    registered op does, on every call (int32 indices: the fast path, through the cached
    launch handle after the first call; int16: the validated path). A backward that saved lse before
    the call then raises instead of using the masked rows."""
    lse = torch.randn(7, 3, device=device)
    sl = torch.tensor([0, 3], dtype=index_dtype, device=device)
    qsl = torch.tensor([0, 2, 5], dtype=index_dtype, device=device)
    weight = torch.ones(7, 3, device=device, requires_grad=True)
    saved = (weight * lse).sum()  # saves lse for backward
    for _ in range(4):  # the first call of the key is a JIT launch, later ones the handle
        before = lse._version
        mask_dcp_empty_shards_(lse, sl, qsl)
        assert lse._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_an_lse_that_requires_grad_is_refused_with_grad_on(device: torch.device) -> None:
    """The registered op masks lse in place without an autograd formula: backward ran and its
    gradient flowed through the masked rows as if they were untouched."""
    lse = torch.randn(7, 3, device=device, requires_grad=True) * 1.0  # non-leaf
    sl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="mask_dcp_empty_shards_: lse requires grad"):
        mask_dcp_empty_shards_(lse, sl, qsl)
    with torch.no_grad():
        mask_dcp_empty_shards_(lse, sl, qsl)
    assert torch.isneginf(lse[[0, 1, 5, 6]]).all()
