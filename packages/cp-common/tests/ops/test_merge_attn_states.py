"""merge_attn_states: Triton kernel (interpreter on CPU, GPU when present), torch twin, op.

Every case compares against the float64 ``cpattn_testing.reference.lse_combine_ref`` by relative
norm error, with fresh random data and adversarial LSEs (NaN, +-inf, all -inf rows, +-1e4).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from cpattn_common.lse import merge_attn_states_torch
from cpattn_common.ops.merge_attn_states import (
    merge_attn_states,
    merge_attn_states_block_sizes,
    merge_attn_states_fwd,
    triton_usable,
)
from cpattn_testing.dispatch import assert_dispatches
from cpattn_testing.reference import lse_combine_ref
from cpattn_testing.tolerances import assert_close_to_ref

NEG_INF = float("-inf")

# The interpreter evaluates log(0) / -inf - -inf with numpy, which warns; the kernel handles them.
pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


def _needs_triton(device: torch.device) -> None:
    if not triton_usable(device):
        pytest.skip("Triton cannot run here (CPU without TRITON_INTERPRET=1)")


def make_case(
    n: int,
    b: int,
    h: int,
    d: int,
    *,
    dtype: torch.dtype,
    lse_dtype: torch.dtype = torch.float32,
    device: torch.device,
    seed: int,
    adversarial: bool = True,
    layout: str = "contiguous",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random partials ``[N, B, H, D]`` + LSEs ``[N, B, H]`` with adversarial rows planted."""
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, b, h, d, generator=gen)
    lses = torch.randn(n, b, h, generator=gen) * 4
    if adversarial:
        flat = lses.view(n, -1)
        kinds = torch.randint(0, 8, (b * h,), generator=gen)
        for col in range(b * h):
            src = int(torch.randint(0, n, (1,), generator=gen))
            kind = int(kinds[col])
            if kind == 0:  # an empty shard with a NaN partial
                flat[src, col] = NEG_INF
                outs.view(n, -1, d)[src, col] = float("nan")
            elif kind == 1:
                flat[src, col] = float("nan")
                outs.view(n, -1, d)[src, col] = float("nan")
            elif kind == 2:
                flat[src, col] = float("inf")
                outs.view(n, -1, d)[src, col] = 1e30
            elif kind == 3:  # whole row empty: output 0, lse -inf, never NaN
                flat[:, col] = NEG_INF
                outs.view(n, -1, d)[:, col] = float("nan")
            elif kind == 4:
                flat[:, col] = flat[:, col] * 2500  # magnitudes around +-1e4
            elif kind == 5:
                flat[:, col] = 1e4 + flat[:, col]
    outs = outs.to(dtype)
    lses = lses.to(lse_dtype)
    if layout == "strided":  # head-padded storage + head-major LSE
        big = torch.full((n, b, h + 3, d + 16), float("nan"), dtype=dtype)
        big[:, :, :h, :d] = outs
        outs = big[:, :, :h, :d]
        lses = lses.permute(0, 2, 1).contiguous().permute(0, 2, 1)
    elif layout == "transposed":  # B-major source buffer
        outs = outs.transpose(0, 1).contiguous().transpose(0, 1)
        lses = lses.transpose(0, 1).contiguous().transpose(0, 1)
    return outs.to(device), lses.to(device)


def _check(
    out: torch.Tensor,
    lse: torch.Tensor,
    outs: torch.Tensor,
    lses: torch.Tensor,
    base_e: bool = True,
) -> None:
    ref_out, ref_lse = lse_combine_ref(outs.cpu(), lses.cpu(), is_lse_base_on_e=base_e)
    assert out.dtype == outs.dtype
    assert lse.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN in the merged output"
    assert_close_to_ref(out, ref_out, dtype=outs.dtype, name="out")
    # The LSE is fp32 math: finite values close, -inf exactly where the reference is -inf.
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    err = (lse.cpu().double()[finite] - ref_lse[finite]).abs()
    assert (
        err.numel() == 0
        or float(err.max()) <= 1e-6 * max(1.0, float(ref_lse[finite].abs().max())) * 8
    )


CASES = [
    # (N, B, H, D, dtype)
    (1, 3, 5, 64, torch.float32),
    (2, 4, 6, 80, torch.bfloat16),
    (3, 3, 5, 96, torch.float16),
    (5, 2, 3, 128, torch.bfloat16),
    (8, 2, 4, 192, torch.float32),
    (4, 2, 3, 576, torch.bfloat16),
    (7, 1, 2, 512, torch.float16),
]


@pytest.mark.parametrize(
    ("n", "b", "h", "d", "dtype"),
    CASES,
    ids=[f"N{c[0]}-B{c[1]}-H{c[2]}-D{c[3]}-{str(c[4])[6:]}" for c in CASES],
)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed"])
def test_triton_kernel_matches_reference(
    device: torch.device, n: int, b: int, h: int, d: int, dtype: torch.dtype, layout: str
) -> None:
    _needs_triton(device)
    outs, lses = make_case(n, b, h, d, dtype=dtype, device=device, seed=n * 100 + d, layout=layout)
    out, lse = merge_attn_states_fwd(outs, lses)
    _check(out, lse, outs, lses)


@pytest.mark.parametrize("lse_dtype", [torch.float16, torch.bfloat16], ids=["lse-fp16", "lse-bf16"])
@pytest.mark.parametrize("base_e", [True, False], ids=["base-e", "base-2"])
def test_lse_dtypes_and_bases(device: torch.device, lse_dtype: torch.dtype, base_e: bool) -> None:
    outs, lses = make_case(
        3, 3, 5, 64, dtype=torch.bfloat16, lse_dtype=lse_dtype, device=device, seed=7
    )
    paths = [merge_attn_states_torch]
    if triton_usable(device):
        paths.append(merge_attn_states_fwd)
    for fn in paths:
        out, lse = fn(outs, lses, is_lse_base_on_e=base_e)
        _check(out, lse.float(), outs, lses, base_e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_torch_twin_matches_reference(device: torch.device, dtype: torch.dtype) -> None:
    for layout in ("contiguous", "strided", "transposed"):
        outs, lses = make_case(4, 5, 6, 80, dtype=dtype, device=device, seed=11, layout=layout)
        out, lse = merge_attn_states_torch(outs, lses)
        _check(out, lse, outs, lses)


def test_torch_twin_keeps_fp64_lses_in_fp64(device: torch.device) -> None:
    """fp64 LSEs with fp32 partials: the twin rounded the LSEs to fp32 before ``l - m``, so
    close LSEs of magnitude 1e5 got a weight difference 2x off, and an LSE beyond fp32's
    range became +inf, which counts as empty (the dominant source was dropped)."""
    outs = torch.tensor([1.0, -1.0], device=device).view(2, 1, 1, 1)
    for pair in ([1e5 + 0.004, 1e5], [1e39, 0.0]):
        lses = torch.tensor(pair, dtype=torch.float64, device=device).view(2, 1, 1)
        out, lse = merge_attn_states_torch(outs, lses)
        ref_out, ref_lse = lse_combine_ref(outs, lses)
        assert out.dtype == torch.float32
        assert lse.dtype == torch.float64
        torch.testing.assert_close(out.double(), ref_out.to(device), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(lse, ref_lse.to(device), rtol=1e-12, atol=0)


def test_numerics_table(device: torch.device) -> None:
    """The consequences table of the combine (single source, equal LSEs, empty sources)."""
    o = torch.randn(3, 1, 4, 8, device=device)
    for fn in _paths(device):
        # one source: its output and its LSE
        out, lse = fn(o[:1], torch.full((1, 1, 4), 2.5, device=device))
        torch.testing.assert_close(out, o[0])
        torch.testing.assert_close(lse, torch.full((1, 4), 2.5, device=device))
        # equal LSEs: arithmetic mean, lse + ln(N)
        out, lse = fn(o, torch.full((3, 1, 4), 1.0, device=device))
        torch.testing.assert_close(out, o.mean(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, torch.full((1, 4), 1.0 + math.log(3), device=device))
        # all sources empty (-inf / NaN / +inf): exactly 0 output, -inf LSE
        bad = (
            torch.tensor([NEG_INF, float("nan"), float("inf")], device=device)
            .view(3, 1, 1)
            .expand(3, 1, 4)
        )
        out, lse = fn(torch.full_like(o, float("nan")), bad.contiguous())
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.isneginf(lse).all()
        # a -100 source vs a 0 source: essentially the dominant one
        out, lse = fn(
            o[:2],
            torch.tensor([0.0, -100.0], device=device).view(2, 1, 1).expand(2, 1, 4).contiguous(),
        )
        torch.testing.assert_close(out, o[0], rtol=1e-5, atol=1e-6)
        # a NaN partial 110 below: its fp32 weight underflows to 0, so it adds exactly 0
        out, lse = fn(
            torch.stack([o[0], torch.full_like(o[0], float("nan"))]),
            torch.tensor([0.0, -110.0], device=device).view(2, 1, 1).expand(2, 1, 4).contiguous(),
        )
        torch.testing.assert_close(out, o[0], rtol=1e-5, atol=1e-6)


def _paths(device: torch.device) -> list:
    paths = [merge_attn_states_torch]
    if triton_usable(device):
        paths.append(merge_attn_states_fwd)
    return paths


def test_public_functional_and_registered_op(device: torch.device) -> None:
    outs, lses = make_case(3, 2, 4, 64, dtype=torch.bfloat16, device=device, seed=5)
    out = merge_attn_states(outs, lses)
    out2, lse2 = merge_attn_states(outs, lses, return_lse=True)
    op_out, op_lse = torch.ops.cpattn_common.merge_attn_states(outs, lses, True)
    assert torch.equal(out, out2)
    assert torch.equal(out, op_out)
    assert torch.equal(lse2, op_lse)
    _check(out2, lse2, outs, lses)


def test_opcheck(device: torch.device) -> None:
    outs, lses = make_case(
        2, 2, 3, 64, dtype=torch.float32, device=device, seed=3, adversarial=False
    )
    torch.library.opcheck(
        torch.ops.cpattn_common.merge_attn_states.default,
        (outs, lses, True),
        # Not the test_aot_dispatch_* utils: they need an autograd formula, and the op is
        # inference only (test_inputs_that_require_grad_go_through_autograd).
        test_utils=("test_schema", "test_faketensor"),
    )


def test_empty_batch(device: torch.device) -> None:
    outs = torch.randn(2, 0, 4, 64, device=device)
    out, lse = merge_attn_states(outs, torch.randn(2, 0, 4, device=device), return_lse=True)
    assert out.shape == (0, 4, 64)
    assert lse.shape == (0, 4)


@pytest.mark.parametrize(
    ("outs_shape", "lses_shape", "match"),
    [
        ((2, 3, 4), (2, 3), "N, B, H, D"),
        ((2, 3, 4, 8), (2, 3, 4, 1), "N, B, H"),
        ((2, 3, 4, 8), (2, 3, 5), "disagree"),
        ((0, 3, 4, 8), (0, 3, 4), "N >= 1"),
    ],
)
def test_bad_shapes(outs_shape: tuple[int, ...], lses_shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        merge_attn_states(torch.randn(outs_shape), torch.randn(lses_shape))
    with pytest.raises(ValueError, match=match):  # the twin checks the same (no broadcasting)
        merge_attn_states_torch(torch.randn(outs_shape), torch.randn(lses_shape))


@pytest.mark.parametrize("batch", [3, 0])
def test_head_dim_zero_raises(device: torch.device, batch: int) -> None:
    """D = 0 raises as in the cp-dcp ops (``correct_attn_out``), naming the shape, on every
    path: the functional, the typed launcher, the registered op, its fake impl (what
    ``torch.compile`` traces) and the torch twin."""
    outs = torch.randn(2, batch, 4, 0, device=device)
    lses = torch.randn(2, batch, 4, device=device)
    match = rf"partial_outs \(2, {batch}, 4, 0\) has head_dim 0; D must be >= 1"
    for call in (
        lambda: merge_attn_states(outs, lses),
        lambda: merge_attn_states_fwd(outs, lses),
        lambda: torch.ops.cpattn_common.merge_attn_states(outs, lses, True),
        lambda: merge_attn_states_torch(outs, lses),
    ):
        with pytest.raises(ValueError, match=match):
            call()
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=match):
        merge_attn_states(mode.from_tensor(outs), mode.from_tensor(lses))


def test_torch_twin_bad_input() -> None:
    """The twin takes any floating dtype (fp64 for references) but not integers."""
    with pytest.raises(ValueError, match="disagree"):
        merge_attn_states_torch(torch.randn(2, 3, 4, 5), torch.randn(2, 1, 4))
    with pytest.raises(TypeError, match="floating"):
        merge_attn_states_torch(torch.ones(2, 1, 1, 4, dtype=torch.int64), torch.randn(2, 1, 1))
    with pytest.raises(TypeError, match=r"must be torch\.Tensor"):
        merge_attn_states_torch([[1.0]], torch.randn(2, 1, 1))  # type: ignore[arg-type]
    out, lse = merge_attn_states_torch(
        torch.randn(2, 1, 1, 4, dtype=torch.float64), torch.randn(2, 1, 1, dtype=torch.float64)
    )
    assert (out.dtype, lse.dtype) == (torch.float64, torch.float64)


def test_bad_dtypes() -> None:
    with pytest.raises(TypeError, match="partial_outs dtype"):
        merge_attn_states(torch.randn(2, 1, 1, 4, dtype=torch.float64), torch.randn(2, 1, 1))
    with pytest.raises(TypeError, match="partial_lses dtype"):
        merge_attn_states(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, dtype=torch.float64))


def test_block_size_heuristic() -> None:
    assert merge_attn_states_block_sizes(64, 128) == (32, 128, 8)
    assert merge_attn_states_block_sizes(128, 512) == (8, 512, 8)
    bh, bd, _ = merge_attn_states_block_sizes(128, 576)
    assert bd == 1024
    assert bh * bd <= 4096
    assert merge_attn_states_block_sizes(3, 80)[0] == 4


# ---- properties (hypothesis), on the dispatching public functional -------------------------

_SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def _states(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    n = draw(st.integers(1, 5))
    b = draw(st.integers(1, 3))
    h = draw(st.integers(1, 4))
    d = draw(st.sampled_from([16, 48, 64]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, b, h, d, generator=gen, dtype=torch.float32)
    scale = draw(st.sampled_from([1.0, 30.0, 1e3]))
    lses = torch.randn(n, b, h, generator=gen) * scale
    empty = torch.rand(n, b, h, generator=gen) < draw(st.sampled_from([0.0, 0.3]))
    lses = lses.masked_fill(empty, NEG_INF)
    return outs, lses


@_SETTINGS
@given(_states())
def test_property_empty_state_changes_nothing(
    device: torch.device, state: tuple[torch.Tensor, torch.Tensor]
) -> None:
    outs, lses = (t.to(device) for t in state)
    out, lse = merge_attn_states(outs, lses, return_lse=True)
    garbage = torch.full_like(outs[:1], float("nan"))
    out2, lse2 = merge_attn_states(
        torch.cat([outs, garbage]),
        torch.cat([lses, torch.full_like(lses[:1], NEG_INF)]),
        return_lse=True,
    )
    torch.testing.assert_close(out2, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse2, lse, rtol=1e-6, atol=1e-6)


@_SETTINGS
@given(_states(), st.randoms(use_true_random=False))
def test_property_order_independent(
    device: torch.device, state: tuple[torch.Tensor, torch.Tensor], rnd
) -> None:  # type: ignore[no-untyped-def]
    outs, lses = (t.to(device) for t in state)
    perm = list(range(outs.shape[0]))
    rnd.shuffle(perm)
    out, lse = merge_attn_states(outs, lses, return_lse=True)
    out_p, lse_p = merge_attn_states(outs[perm], lses[perm], return_lse=True)
    torch.testing.assert_close(out_p, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_p, lse, rtol=1e-6, atol=1e-5)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.sampled_from([True, False]))
def test_property_sharded_attention_merges_to_full(
    device: torch.device, seed: int, base_e: bool
) -> None:
    """The same attention split into 1..8 key shards merges to the unsharded result."""
    gen = torch.Generator().manual_seed(seed)
    b, h, s, d = 2, 3, 24, 32
    q = torch.randn(b, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(s, h, d, generator=gen, dtype=torch.float64)
    v = torch.randn(s, h, d, generator=gen, dtype=torch.float64)
    scores = torch.einsum("bhd,shd->bhs", q, k) / math.sqrt(d)
    full = torch.einsum("bhs,shd->bhd", scores.softmax(-1), v)
    results = []
    for shards in range(1, 9):
        bounds = torch.linspace(0, s, shards + 1).round().long().tolist()
        outs, lses = [], []
        for lo, hi in itertools.pairwise(bounds):
            part = scores[..., lo:hi]
            outs.append(torch.einsum("bhs,shd->bhd", part.softmax(-1), v[lo:hi]))
            lse = torch.logsumexp(part, -1)
            lses.append(lse if base_e else lse / math.log(2))
        merged = merge_attn_states(
            torch.stack(outs).float().to(device),
            torch.stack(lses).float().to(device),
            is_lse_base_on_e=base_e,
        )
        torch.testing.assert_close(merged.double().cpu(), full, rtol=2e-5, atol=2e-5)
        results.append(merged)
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
def test_gpu_large_shapes_match_torch_twin(device: torch.device) -> None:
    """The benchmark shapes (reduced B) on the GPU: kernel == torch twin within bf16 rounding."""
    for h, d in ((128, 512), (64, 128), (16, 576)):
        for n in (2, 4, 8):
            outs, lses = make_case(n, 64, h, d, dtype=torch.bfloat16, device=device, seed=n + d)
            out, lse = merge_attn_states_fwd(outs, lses)
            _check(out, lse, outs, lses)


def test_compiled_fullgraph_uses_registered_op(device: torch.device) -> None:
    """Under torch.compile the functional goes through the registered op (fake impl traced)."""
    outs, lses = make_case(2, 2, 3, 64, dtype=torch.float32, device=device, seed=9)
    compiled = torch.compile(
        lambda o, s: merge_attn_states(o, s, return_lse=True), backend="eager", fullgraph=True
    )
    out, lse = compiled(outs, lses)
    _check(out, lse, outs, lses)


def _bandwidth_line(h: int, d: int, n: int, b: int, device: torch.device) -> str:
    from triton.testing import do_bench

    outs = torch.randn(n, b, h, d, device=device, dtype=torch.bfloat16)
    lses = torch.randn(n, b, h, device=device)
    nbytes = (n + 1) * b * h * d * 2 + (n + 1) * b * h * 4
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_merge = do_bench(lambda: merge_attn_states_fwd(outs, lses), quantiles=[0.5])
    t_copy = do_bench(lambda: dst.copy_(src), quantiles=[0.5])
    merge_bw = nbytes / (t_merge * 1e-3) / 1e9
    copy_bw = 2 * src.numel() / (t_copy * 1e-3) / 1e9
    return (
        f"H={h} D={d} N={n}: merge {merge_bw:7.0f} GB/s, copy {copy_bw:7.0f} GB/s, "
        f"ratio {merge_bw / copy_bw:5.1%} ({t_merge * 1e3:.1f} us)"
    )


@pytest.mark.gpu
def test_gpu_merge_bandwidth_report(device: torch.device) -> None:
    """Prints merge GB/s vs a device-to-device copy of the same bytes (no assert; issue 3 target:
    >= 85% of copy bandwidth at B=4096, bf16). Bytes = read N partials + N LSEs (fp32), write
    the output + LSE (fp32)."""
    lines = [
        _bandwidth_line(h, d, n, 4096, device)
        for h, d in ((128, 512), (64, 128))
        for n in (2, 4, 8)
    ]
    print("\n" + "\n".join(lines))


@pytest.mark.parametrize("shift", [1.0e3, 1.0e4, -1.0e4])
@pytest.mark.parametrize("n", [2, 9])
@pytest.mark.parametrize("base_e", [True, False], ids=["base_e", "base_2"])
def test_large_close_lses_keep_fp32_accuracy(
    device: torch.device, shift: float, n: int, base_e: bool
) -> None:
    """LSEs around +-1e3..1e4 within a few units of each other: weights from the differences
    (exact in fp32), so fp32 outputs keep fp32 accuracy at any LSE magnitude."""
    gen = torch.Generator().manual_seed(int(abs(shift)) + n)
    outs = torch.randn(n, 5, 4, 24, generator=gen)
    lses = shift + torch.randn(n, 5, 4, generator=gen) * 2.0
    lses[:, 0, 0] = shift
    want_out, want_lse = lse_combine_ref(outs, lses, is_lse_base_on_e=base_e)
    got_out, got_lse = merge_attn_states(
        outs.to(device), lses.to(device), is_lse_base_on_e=base_e, return_lse=True
    )
    assert_close_to_ref(got_out, want_out, dtype=torch.float32, name="out")
    assert_close_to_ref(got_lse, want_lse, dtype=torch.float32, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n", "b", "h", "d", "dtype"),
    [
        (4, 1, 64, 128, torch.bfloat16),
        (3, 40, 16, 512, torch.float16),
        (8, 64, 64, 128, torch.float32),
    ],
)
def test_gpu_cached_handle_equals_first_launch(
    device: torch.device, n: int, b: int, h: int, d: int, dtype: torch.dtype
) -> None:
    """The first eager call of a key is a JIT launch, later ones launch the cached compiled
    handle (``cpattn_common.launch``): bit-equal results, on fresh data per call."""
    for i in range(3):
        gen = torch.Generator(device=device).manual_seed(i)
        outs = torch.randn(n, b, h, d, device=device, generator=gen).to(dtype)
        lses = torch.randn(n, b, h, device=device, generator=gen) * 5
        lses[0, 0, 0] = NEG_INF
        results = [merge_attn_states(outs, lses, return_lse=True) for _ in range(3)]
        for got_out, got_lse in results[1:]:
            torch.testing.assert_close(got_out, results[0][0], rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(got_lse, results[0][1], rtol=0, atol=0, equal_nan=True)
        ref_out, _ = merge_attn_states_torch(outs.double(), lses.double())
        assert_close_to_ref(results[0][0], ref_out, dtype=dtype, name="out")


def test_dispatch_modes_see_the_registered_op(device: torch.device) -> None:
    """FakeTensorMode, make_fx (fake, symbolic, real) and any TorchDispatchMode go through
    the registered op: the eager shortcut launched the kernel under them (fake tensors have
    no memory; a real-mode trace recorded only the output allocation)."""
    outs, lses = make_case(2, 3, 4, 8, dtype=torch.float32, device=device, seed=21)
    assert_dispatches(
        lambda o, s: merge_attn_states(o, s, return_lse=True),
        (outs, lses),
        "cpattn_common.merge_attn_states.default",
    )


def test_inputs_that_require_grad_go_through_autograd(device: torch.device) -> None:
    """The op has no autograd formula: with grad on, the output requires grad and backward
    raises (torch's rule for custom ops), instead of an output that drops the gradient."""
    outs, lses = make_case(2, 3, 4, 8, dtype=torch.float32, device=device, seed=22)
    outs.requires_grad_()
    out = merge_attn_states(outs, lses)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()
    with torch.no_grad():
        out2, lse2 = merge_attn_states(outs, lses, return_lse=True)
    assert not out2.requires_grad
    _check(out2, lse2, outs.detach(), lses)


@pytest.mark.parametrize("flag", [None, "False", 0.0, 1])
def test_is_lse_base_on_e_must_be_a_bool(device: torch.device, flag: object) -> None:
    # bool(None) / bool(0.0) silently meant base 2, bool("False") base e.
    outs, lses = make_case(2, 3, 4, 8, dtype=torch.float32, device=device, seed=23)
    with pytest.raises(TypeError, match="is_lse_base_on_e must be a bool, got"):
        merge_attn_states(outs, lses, is_lse_base_on_e=flag)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", [None, "False", 0, 1.0])
def test_return_lse_must_be_a_bool(device: torch.device, flag: object) -> None:
    """As in the cp-dcp ops: return_lse="False" returned the tuple, None the output alone."""
    outs, lses = make_case(2, 3, 4, 8, dtype=torch.float32, device=device, seed=24)
    with pytest.raises(TypeError, match="return_lse must be a bool, got"):
        merge_attn_states(outs, lses, return_lse=flag)  # type: ignore[arg-type]


def test_vmap_goes_through_the_registered_op(device: torch.device) -> None:
    """Under ``torch.vmap`` the inputs are batched wrappers without storage: the eager
    shortcut raised "Cannot access storage of BatchedTensorImpl"; through the registered op,
    vmap runs the merge per batch element."""
    cases = [
        make_case(2, 3, 4, 8, dtype=torch.float32, device=device, seed=30 + i) for i in range(3)
    ]
    outs = torch.stack([c[0] for c in cases])
    lses = torch.stack([c[1] for c in cases])
    got, got_lse = torch.vmap(lambda o, s: merge_attn_states(o, s, return_lse=True))(outs, lses)
    for i, (o, s) in enumerate(cases):
        want, want_lse = merge_attn_states(o, s, return_lse=True)
        torch.testing.assert_close(got[i], want, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got_lse[i], want_lse, rtol=0, atol=0, equal_nan=True)


def test_inputs_with_the_negative_bit_merge_their_values(device: torch.device) -> None:
    """A tensor with torch's negative bit (``z.conj().imag``, ``torch._neg_view``) keeps its
    values un-negated in memory. The kernel read that memory: the eager call returned the
    negated merge, while the registered op (the dispatcher resolves the bit) was right."""
    _needs_triton(device)
    outs, lses = make_case(3, 4, 5, 32, dtype=torch.bfloat16, device=device, seed=21)
    neg_outs, neg_lses = torch._neg_view(-outs), torch._neg_view(-lses)
    assert neg_outs.is_neg()
    torch.testing.assert_close(neg_outs, outs, rtol=0, atol=0, equal_nan=True)
    want_out, want_lse = merge_attn_states(outs, lses, return_lse=True)
    _check(want_out, want_lse, outs, lses)
    for po, pl in ((neg_outs, lses), (outs, neg_lses), (neg_outs, neg_lses)):
        for got_out, got_lse in (
            merge_attn_states(po, pl, return_lse=True),
            merge_attn_states_fwd(po, pl),
            torch.ops.cpattn_common.merge_attn_states(po, pl, True),
        ):
            torch.testing.assert_close(got_out, want_out, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0, equal_nan=True)
