"""correct_attn_out: kernel vs the float64 LSE combine (cpattn_testing.reference)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import triton.language as tl

from cpattn_common.alloc import get_output_poison
from cpattn_dcp import CPTritonContext, correct_attn_out
from cpattn_dcp.ops.correct_attn_out import (
    _contig_plan,
    _squeeze_lses,
    _squeeze_out,
    _valid_fast,
    _validate,
)
from cpattn_testing.dispatch import assert_dispatches
from cpattn_testing.reference import correct_attn_out_ref, lse_combine_ref
from cpattn_testing.tolerances import assert_close_to_ref, coarsest

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def adversarial_partials(
    n: int,
    b: int,
    h: int,
    d: int,
    *,
    seed: int,
    dtype: torch.dtype,
    lse_dtype: torch.dtype,
    shift: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``outs [N, B, H, D]`` / ``lses [N, B, H]`` with NaN/+inf/-inf LSEs, NaN partials on
    non-contributing sources, an all-empty (row 0, head 0) and large LSE spreads; ``shift``
    is added to every finite LSE (overflow of an unstabilised exp)."""
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, b, h, d, generator=gen, dtype=torch.float64)
    lses = torch.randn(n, b, h, generator=gen, dtype=torch.float64) * 6.0 + shift
    pick = torch.rand(n, b, h, generator=gen)
    lses = torch.where(pick < 0.08, -math.inf, lses)
    lses = torch.where((pick >= 0.08) & (pick < 0.12), math.nan, lses)
    lses = torch.where((pick >= 0.12) & (pick < 0.15), math.inf, lses)
    lses[:, 0, 0] = torch.tensor([math.nan, math.inf, -math.inf] * n)[:n]
    if b > 1:
        lses[:, 1, 0] = torch.linspace(-100.0, 0.0, n)
    dead = torch.isnan(lses) | torch.isinf(lses)
    outs[dead] = math.nan
    return outs.to(dtype), lses.to(lse_dtype)


def _check(
    device: torch.device,
    n: int,
    b: int,
    h: int,
    d: int,
    dtype: torch.dtype,
    lse_dtype: torch.dtype,
    base_e: bool,
    seed: int,
    shift: float = 0.0,
) -> None:
    outs, lses = adversarial_partials(
        n, b, h, d, seed=seed, dtype=dtype, lse_dtype=lse_dtype, shift=shift
    )
    ref_out, ref_lse = lse_combine_ref(outs, lses, is_lse_base_on_e=base_e)
    lses_dev = lses.to(device)
    total = torch.zeros(b, h, d, dtype=torch.float64)
    for r in range(n):
        part = outs[r].to(device)
        out, lse = correct_attn_out(part, lses_dev, r, is_lse_base_on_e=base_e)
        assert out.data_ptr() == part.data_ptr()
        assert lse.dtype == lse_dtype
        assert lse.shape == (b, h)
        assert_close_to_ref(lse, ref_lse, dtype=lse_dtype, name=f"lse rank {r}")
        total += out.cpu().double()
    tol = coarsest(dtype, lse_dtype)
    assert_close_to_ref(total, ref_out, dtype=tol, name="sum of corrected outputs", reduction_len=n)


@pytest.mark.parametrize("d", [32, 80, 128, 192, 576])
@pytest.mark.parametrize("base_e", [True, False], ids=["base_e", "base_2"])
def test_head_dims(device: torch.device, d: int, base_e: bool) -> None:
    _check(device, 2, 4, 8, d, torch.float32, torch.float32, base_e, seed=d)


@pytest.mark.parametrize("n", [1, 3, 6, 10])
def test_world_sizes(device: torch.device, n: int) -> None:
    _check(device, n, 3, 4, 64, torch.float32, torch.float32, n % 2 == 0, seed=100 + n)


@pytest.mark.parametrize("form", ["lse-rows", "lse-tile"])
@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_weight_forms(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, form: str, n: int
) -> None:
    """Both ways the lean kernel computes the weights (one row vector per source, or one
    [N_POW2, rows] tile), whatever the tile heuristic would pick for the shape."""
    import cpattn_dcp.ops.correct_attn_out as correct_mod

    monkeypatch.setattr(correct_mod, "_LSE_ROWS_MAX_N", 8 if form == "lse-rows" else 0)
    correct_mod._contig_plan.cache_clear()
    try:
        for base_e in (True, False):
            _check(device, n, 5, 6, 64, torch.bfloat16, torch.float32, base_e, seed=n + 40)
    finally:
        correct_mod._contig_plan.cache_clear()


@pytest.mark.parametrize("n", [3, 9], ids=["lse-rows", "lse-tile"])
def test_lean_kernel_lse_offsets_past_int32(n: int, watch_interpreted_accesses: Any) -> None:
    """The lean kernel reads source s's LSEs at ``s*B*H + row`` in int64: with 2*B*H > 2**31
    source 2's lie past 2**31 (the row-vector form formed ``s * B*H`` in int32, which wrapped).
    Interpreter, the op's own specialization, first program only, the LSE loads recorded
    instead of made (no 12 GB LSE tensor; ``test_large_offsets.py`` runs the size on a GPU)."""
    h, d = 8, 64
    b = 2**30 // h + 8  # B*H = 2**30 + 64
    rows = b * h
    _, spec = _contig_plan(b, h, d, n, 2, True)
    assert spec.constexprs["LSE_ROWS"] == (n <= 8)
    block_r = spec.constexprs["BLOCK_R"]
    out = torch.randn(block_r, d).to(torch.float16)  # the first program's rows
    lses = torch.zeros(1)  # a base pointer: the LSE loads are recorded, not made
    lse_out = torch.full((block_r,), math.nan)
    loads = watch_interpreted_accesses("load", tl.float32, lses.data_ptr(), 4)
    spec((1,), out, lses, lse_out, rows, 1)
    got = np.sort(np.concatenate(loads))
    np.testing.assert_array_equal(got, (np.arange(n)[:, None] * rows + np.arange(block_r)).ravel())
    assert torch.equal(lse_out, torch.full_like(lse_out, math.log(n)))  # every LSE read as 0


@pytest.mark.parametrize("shift", [0.0, 3.0e4, -3.0e4])
def test_row_tiles_cross_tokens(device: torch.device, shift: float) -> None:
    """Row tiles of flattened (b, h) pairs spanning several tokens with a partial last tile
    (84 rows, H = 12 not a power of two), padded sources (N = 5 -> 8), huge LSEs."""
    _check(device, 5, 7, 12, 512, torch.bfloat16, torch.float32, True, seed=11, shift=shift)


@pytest.mark.parametrize(
    ("dtype", "lse_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
    ids=["bf16", "fp16", "bf16-lse16", "fp32-lsefp16"],
)
def test_dtypes(device: torch.device, dtype: torch.dtype, lse_dtype: torch.dtype) -> None:
    _check(device, 4, 5, 6, 48, dtype, lse_dtype, True, seed=7)


def test_nan_guard(device: torch.device) -> None:
    out = torch.full((1, 2, 16), math.nan, device=device)
    lses = torch.tensor([[[-math.inf, -math.inf]], [[1.0, 1.0]]], device=device)
    out, lse = correct_attn_out(out, lses, 0)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.allclose(lse, torch.ones_like(lse))


@pytest.mark.parametrize("x", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("base_e", [True, False])
def test_empty_partition(device: torch.device, x: float, base_e: bool) -> None:
    lses = torch.tensor([[[0.0, 0.0]], [[x, x]]], device=device)
    out = torch.full((1, 2, 8), math.nan, device=device)
    out, lse = correct_attn_out(out, lses, 1, is_lse_base_on_e=base_e)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.zeros_like(lse))


@pytest.mark.parametrize("base_e", [True, False])
def test_a_weight_that_underflows_in_fp32_is_exactly_zero(
    device: torch.device, base_e: bool
) -> None:
    """A finite LSE 110 (base e) below the row's largest: its fp32 weight is 0, so its NaN
    partial becomes exactly 0 (docs/conventions.md, "Numerics")."""
    gap = 110.0 if base_e else 110.0 / math.log(2)
    lses = torch.tensor([[[0.0, 0.0]], [[-gap, -gap]]], device=device)
    out = torch.full((1, 2, 8), math.nan, device=device)
    out, lse = correct_attn_out(out, lses, 1, is_lse_base_on_e=base_e)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.zeros_like(lse))


def test_all_empty_row(device: torch.device) -> None:
    lses = torch.tensor([[[math.nan]], [[math.inf]], [[-math.inf]]], device=device)
    out = torch.full((1, 1, 8), math.nan, device=device)
    out, lse = correct_attn_out(out, lses, 2)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_layouts(device: torch.device) -> None:
    """[B, 1, H, D] out, padded-head non-contiguous storage, 4-D lses, shared ctx."""
    n, b, h, d = 3, 4, 5, 40
    outs, lses = adversarial_partials(
        n, b, h, d, seed=3, dtype=torch.float32, lse_dtype=torch.float32
    )
    ref_out, ref_lse = lse_combine_ref(outs, lses)
    ctx = CPTritonContext()
    total = torch.zeros(b, h, d, dtype=torch.float64)
    for r in range(n):
        storage = torch.randn(b, 1, h + 3, d + 8, dtype=torch.float32).to(device)
        view = storage[:, :, 2 : 2 + h, 4 : 4 + d]
        view.copy_(outs[r][:, None].to(device))
        lses4 = lses.to(device)[:, :, :, None] if r % 2 else lses.to(device)[:, None]
        out, lse = correct_attn_out(view, lses4, r, ctx)
        assert out.shape == (b, h, d)
        assert_close_to_ref(lse, ref_lse, dtype=torch.float32, name="lse")
        total += out.cpu().double()
        # Storage outside the view is untouched.
        assert not torch.isnan(storage[:, :, :2]).any()
    assert_close_to_ref(total, ref_out, dtype=torch.float32, name="out", reduction_len=n)


def test_non_unit_head_dim_stride(device: torch.device) -> None:
    """``out`` whose head dim is strided (a transposed view) is still scaled in place."""
    n, b, h, d = 2, 3, 4, 24
    outs, lses = adversarial_partials(
        n, b, h, d, seed=5, dtype=torch.bfloat16, lse_dtype=torch.float32
    )
    ref_out, ref_lse = lse_combine_ref(outs, lses)
    total = torch.zeros(b, h, d, dtype=torch.float64)
    for r in range(n):
        storage = outs[r].transpose(1, 2).contiguous().to(device)  # [B, D, H]
        view = storage.transpose(1, 2)  # [B, H, D], head-dim stride H
        out, lse = correct_attn_out(view, lses.to(device), r)
        assert out.data_ptr() == storage.data_ptr()
        assert_close_to_ref(lse, ref_lse, dtype=torch.float32, name="lse")
        total += storage.transpose(1, 2).cpu().double()
    assert_close_to_ref(total, ref_out, dtype=torch.bfloat16, name="out", reduction_len=n)


def test_empty_batch(device: torch.device) -> None:
    out = torch.randn(0, 4, 16, device=device)
    out2, lse = correct_attn_out(out, torch.randn(2, 0, 4, device=device), 1)
    assert out2.shape == (0, 4, 16)
    assert lse.shape == (0, 4)


def test_bad_inputs(device: torch.device) -> None:
    out = torch.randn(3, 4, 8, device=device)
    lses = torch.randn(2, 3, 4, device=device)
    with pytest.raises(
        ValueError, match=r"expected out \[B, H, D\] or \[B, 1, H, D\], got shape \(3, 4\)"
    ):
        correct_attn_out(out[:, :, 0], lses, 0)
    with pytest.raises(ValueError, match=r"got shape \(3, 2, 4, 8\)"):
        correct_attn_out(out[:, None].expand(3, 2, 4, 8), lses, 0)
    with pytest.raises(ValueError, match=r"expected lses \[N,? ?B,? ?H\]"):
        correct_attn_out(out, lses[0], 0)
    with pytest.raises(ValueError, match=r"disagree.*B=3, H=5"):
        correct_attn_out(out, torch.randn(2, 3, 5, device=device), 0)
    with pytest.raises(ValueError, match=r"disagree.*B=2"):
        correct_attn_out(out, torch.randn(2, 2, 4, device=device), 0)
    with pytest.raises(ValueError, match="cp_rank 2 is out of range for 2"):
        correct_attn_out(out, lses, 2)
    with pytest.raises(TypeError, match="cp_rank must be an int"):
        correct_attn_out(out, lses, 0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lses must be a floating"):
        correct_attn_out(out, lses.long(), 0)
    with pytest.raises(TypeError, match="out must be a floating"):
        correct_attn_out(out.int(), lses, 0)
    with pytest.raises(ValueError, match="float64 is not supported"):
        correct_attn_out(out.double(), lses, 0)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="device"):
            correct_attn_out(out, lses.cpu(), 0)
    # D = 0: the global LSE would be returned unwritten.
    with pytest.raises(ValueError, match="head_dim 0"):
        correct_attn_out(torch.empty(3, 4, 0, device=device), lses, 0)
    # Rows sharing memory: an in-place correction would let the last row's weight win.
    shared = torch.ones(1, 4, 8, device=device).expand(3, 4, 8)
    with pytest.raises(ValueError, match="share memory"):
        correct_attn_out(shared, lses, 0)
    assert correct_attn_out(torch.ones(3, 1, 8, device=device).expand(3, 4, 8).clone(), lses, 0)
    # torch's negative bit (memory holds the negated values): the LSEs were read negated.
    for name, args in (
        ("out", (torch._neg_view(-out), lses)),
        ("lses", (out, torch._neg_view(-lses))),
    ):
        with pytest.raises(ValueError, match=rf"{name} has torch's negative bit set"):
            correct_attn_out(*args, 0)


def test_singleton_lse_dims_follow_out(device: torch.device) -> None:
    """With H = 1 both ``[N, B, 1, 1]`` forms squeeze to the ``[N, B, H]`` that ``out``
    has: ``[N, B, H, 1]`` and ``[N, 1, B, H]``."""
    lses = torch.randn(2, 3, 1, device=device)
    for lses4 in (lses[..., None], lses[:, None]):
        out = torch.randn(3, 1, 8, device=device)
        expect = out.clone()
        expect_lse = torch.logsumexp(lses, dim=0)
        expect *= torch.exp(lses[1] - expect_lse)[..., None]
        got, lse = correct_attn_out(out, lses4, 1)
        torch.testing.assert_close(lse, expect_lse)
        torch.testing.assert_close(got, expect)


def test_opcheck(device: torch.device) -> None:
    out = torch.randn(3, 4, 24, device=device)
    lses = torch.randn(2, 3, 4, device=device)
    for base_e in (True, False):
        torch.library.opcheck(
            torch.ops.cpattn_dcp.correct_attn_out.default, (out.clone(), lses, 1, base_e)
        )


# inductor also lowers the mutation of a [B, 1, H, D] view (auto_functionalized) around the op.
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(device: torch.device, backend: str) -> None:
    outs, lses = adversarial_partials(
        2, 3, 4, 32, seed=11, dtype=torch.float32, lse_dtype=torch.float32
    )

    def fn(o: torch.Tensor, ls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = o * 1.0
        out, lse = correct_attn_out(o[:, None], ls, 1)
        return out + 0.0, lse

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    o, ls = outs[1].to(device), lses.to(device)
    got_out, got_lse = compiled(o, ls)
    want_out, want_lse = fn(o, ls)
    torch.testing.assert_close(got_out, want_out, equal_nan=True)
    torch.testing.assert_close(got_lse, want_lse, equal_nan=True)


def test_dispatch_modes_see_the_registered_op(device: torch.device) -> None:
    """FakeTensorMode, make_fx and any TorchDispatchMode go through the registered op (the
    eager shortcut launched the kernel under them); the [B, 1, H, D] form too."""
    outs, lses = adversarial_partials(
        2, 3, 4, 16, seed=12, dtype=torch.float32, lse_dtype=torch.float32
    )
    for out in (outs[1], outs[1][:, None]):
        assert_dispatches(
            lambda o, ls: correct_attn_out(o, ls, 1),
            (out.to(device), lses.to(device)),
            "cpattn_dcp.correct_attn_out.default",
        )


def test_inputs_that_require_grad_go_through_autograd(device: torch.device) -> None:
    """No autograd formula: with grad on, an input that requires grad takes the registered op,
    whose in-place use torch refuses or whose backward raises; never a result that drops the
    gradient without a word."""
    outs, lses = adversarial_partials(
        2, 3, 4, 16, seed=13, dtype=torch.float32, lse_dtype=torch.float32
    )
    lses = lses.to(device).requires_grad_()
    out = outs[1].to(device)
    _, lse = correct_attn_out(out, lses, 1)
    assert lse.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        lse.sum().backward()


@pytest.mark.parametrize("flag", [None, "False", 0.0, 1])
def test_is_lse_base_on_e_must_be_a_bool(device: torch.device, flag: object) -> None:
    # bool(None) / bool(0.0) silently meant base 2, bool("False") base e.
    out = torch.randn(3, 4, 8, device=device)
    lses = torch.randn(2, 3, 4, device=device)
    with pytest.raises(TypeError, match="is_lse_base_on_e must be a bool, got"):
        correct_attn_out(out, lses, 1, is_lse_base_on_e=flag)  # type: ignore[arg-type]


def _accepted(out: object, lses: object, cp_rank: object) -> bool:
    """Whether the full squeeze + validation accepts the arguments."""
    try:
        out3 = _squeeze_out(out)  # type: ignore[arg-type]
        _validate(out3, _squeeze_lses(lses, tuple(out3.shape[:2])), cp_rank)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


def test_fast_check_implies_validation(device: torch.device) -> None:
    """The eager hot path skips the full validation only for arguments it would accept
    unchanged (3-D ``out`` and ``lses``, no squeeze); anything else takes the full path."""
    out = torch.randn(3, 4, 8, device=device)
    lses = torch.randn(2, 3, 4, device=device)
    assert _valid_fast(out, lses, 1)  # plain tensors: the CPU suite covers the hot path
    variants: list[tuple[object, object, object]] = [
        (out, lses, 0),
        (out.to(torch.bfloat16), lses.half(), 1),
        (out[:, :, ::2], lses.transpose(1, 2).contiguous().transpose(1, 2), 1),
        (out, lses, 2),
        (out[..., :0], lses, 0),
        (out[:1].expand(3, 4, 8), lses, 0),
        (out, lses, -1),
        (out, lses, True),
        (out, lses, 1.0),
        (out[:, None], lses, 0),
        (out, lses[:, :, :, None], 0),
        (out, lses[:, None], 0),
        (out[:, :, 0], lses, 0),
        (out, lses[0], 0),
        (out, torch.randn(2, 3, 5, device=device), 0),
        (out, torch.randn(2, 2, 4, device=device), 0),
        (out.double(), lses, 0),
        (out, lses.long(), 0),
        (out.int(), lses, 0),
        (torch.nn.Parameter(out), lses, 0),
        (out, None, 0),
        (None, lses, 0),
    ]
    for o, ls, r in variants:
        if _valid_fast(o, ls, r):  # type: ignore[arg-type]
            assert _accepted(o, ls, r), (o, ls, r)


def test_subclass_and_4d_inputs_take_full_path(device: torch.device) -> None:
    """A tensor subclass and a ``[B, 1, H, D]`` output fail the cheap check and still give
    the same result through the validated path."""
    outs, lses = adversarial_partials(
        2, 3, 4, 16, seed=21, dtype=torch.float32, lse_dtype=torch.float32
    )
    want_out, want_lse = correct_attn_out(outs[0].to(device), lses.to(device), 0)
    param = torch.nn.Parameter(outs[0].to(device), requires_grad=False)
    assert not _valid_fast(param, lses.to(device), 0)
    got_out, got_lse = correct_attn_out(param, lses.to(device), 0)
    torch.testing.assert_close(got_out, want_out, equal_nan=True)
    torch.testing.assert_close(got_lse, want_lse, equal_nan=True)
    got4, got_lse4 = correct_attn_out(outs[0].to(device)[:, None], lses.to(device), 0)
    torch.testing.assert_close(got4, want_out, equal_nan=True)
    torch.testing.assert_close(got_lse4, want_lse, equal_nan=True)


@pytest.mark.no_output_poison
def test_without_output_poisoning(device: torch.device) -> None:
    """With poisoning off (production) the global LSE is a plain ``new_empty`` allocation:
    contiguous, ``lses.dtype``, on ``lses``' device, fully written by the kernel."""
    assert get_output_poison() is None
    n, b, h, d = 3, 5, 6, 32
    outs, lses = adversarial_partials(
        n, b, h, d, seed=31, dtype=torch.bfloat16, lse_dtype=torch.bfloat16
    )
    ref_out, ref_lse = lse_combine_ref(outs, lses)
    total = torch.zeros(b, h, d, dtype=torch.float64)
    for r in range(n):
        out, lse = correct_attn_out(outs[r].to(device), lses.to(device), r)
        assert lse.is_contiguous()
        assert lse.dtype == torch.bfloat16
        assert lse.device == out.device
        assert_close_to_ref(lse, ref_lse, dtype=torch.bfloat16, name="lse")
        total += out.cpu().double()
    assert_close_to_ref(total, ref_out, dtype=torch.bfloat16, name="out", reduction_len=n)


@pytest.mark.parametrize("shift", [1.0e3, 1.0e4, -1.0e4])
@pytest.mark.parametrize("n", [2, 9], ids=["rows", "tile"])
@pytest.mark.parametrize("base_e", [True, False], ids=["base_e", "base_2"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_large_close_lses_keep_fp32_accuracy(
    device: torch.device, shift: float, n: int, base_e: bool, layout: str
) -> None:
    """LSEs around +-1e3..1e4 within a few units of each other: the weights depend only on
    the differences, which fp32 holds exactly, so fp32 outputs keep fp32 accuracy (the
    difference is taken before any scaling to base 2: scaling first rounds each LSE by up to
    half an ulp of 1.4e4, about 5e-4, before the subtraction)."""
    gen = torch.Generator().manual_seed(int(abs(shift)) + n)
    b, h, d = 6, 4, 24
    lses = shift + torch.randn(n, b, h, generator=gen) * 2.0
    lses[:, 0, 0] = shift  # equal LSEs: weight exactly 1 / n
    out_cpu = torch.randn(b, h, d, generator=gen)
    want_out, want_lse = correct_attn_out_ref(out_cpu, lses, n - 1, is_lse_base_on_e=base_e)
    if layout == "strided":  # a head slice: the general kernel
        storage = torch.randn(b, h + 1, d, generator=gen).to(device)
        storage[:, 1:] = out_cpu.to(device)
        out = storage[:, 1:]
    else:
        out = out_cpu.to(device, copy=True)
    got_out, got_lse = correct_attn_out(out, lses.to(device), n - 1, is_lse_base_on_e=base_e)
    assert_close_to_ref(got_out, want_out, dtype=torch.float32, name="out")
    assert_close_to_ref(got_lse, want_lse, dtype=torch.float32, name="lse")


@pytest.mark.parametrize("form", ["contiguous", "4d", "strided"])
def test_every_eager_call_marks_out_written(device: torch.device, form: str) -> None:
    """The eager path writes out outside the dispatcher; it bumps out's version like the
    registered op (and torch's in-place ops) do, on every call: the fast path, the validated
    path and the repeated calls of one key (the cached launch handle). A backward that
    saved out before the call then raises instead of using the scaled values."""
    lses = torch.randn(2, 3, 4, device=device)
    base = torch.randn(3, 4, 2, 8, device=device)
    out = {
        "contiguous": base[:, :, 0].contiguous(),
        "4d": base[:, :, 0].contiguous()[:, None],
        "strided": base[:, :, 0],
    }[form]
    weight = torch.ones(out.shape, device=device, requires_grad=True)
    saved = (weight * out).sum()  # saves out for backward
    for _ in range(4):  # the first call of the key is a JIT launch, later ones the handle
        before = out._version
        correct_attn_out(out, lses, 1)
        assert out._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_an_out_that_requires_grad_is_refused_with_grad_on(device: torch.device) -> None:
    """The registered op writes out in place and has no autograd formula: out kept its old
    grad_fn, so backward ran and its gradient ignored the scaling (silently wrong)."""
    out = torch.randn(3, 4, 8, device=device, requires_grad=True) * 1.0  # non-leaf
    lses = torch.randn(2, 3, 4, device=device)
    with pytest.raises(RuntimeError, match="correct_attn_out: out requires grad"):
        correct_attn_out(out, lses, 1)
    with torch.no_grad():
        correct_attn_out(out, lses, 1)
