"""A2A pack / unpack-combine kernels on one process (the all-to-all done by indexing)."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
import torch

import cpattn_dcp.ops.a2a_combine as a2a_mod
import cpattn_dcp.ops.a2a_pack as pack_mod
import cpattn_dcp.ops.a2a_unpack as unpack_mod
from cpattn_dcp import dcp_a2a_lse_reduce, mask_dcp_empty_shards_
from cpattn_dcp.ops.a2a_combine import (
    a2a_buffer_views,
    a2a_pack,
    a2a_pack_dim,
    a2a_record_width,
    a2a_unpack_combine,
)
from cpattn_testing.dispatch import assert_dispatches
from cpattn_testing.reference import lse_combine_ref, mask_empty_shards_ref
from cpattn_testing.simulated import SimulatedWorld
from cpattn_testing.tolerances import assert_close_to_ref, coarsest

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _partials(
    n: int, b: int, h: int, d: int, seed: int, dtype: torch.dtype, lse_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, b, h, d, generator=gen, dtype=torch.float64)
    lses = torch.randn(n, b, h, generator=gen, dtype=torch.float64) * 5.0
    pick = torch.rand(n, b, h, generator=gen)
    lses = torch.where(pick < 0.1, -math.inf, lses)
    lses = torch.where((pick >= 0.1) & (pick < 0.15), math.nan, lses)
    lses = torch.where((pick >= 0.15) & (pick < 0.2), math.inf, lses)
    lses[:, 0, 0] = -math.inf
    outs[torch.isnan(lses) | torch.isinf(lses)] = math.nan
    return outs.to(dtype), lses.to(lse_dtype)


def _exchange(sends: list[torch.Tensor], dst: int) -> torch.Tensor:
    return torch.stack([s[dst] for s in sends]).contiguous()


@pytest.mark.parametrize(
    ("n", "h", "d", "dtype", "lse_dtype", "base_e"),
    [
        (2, 4, 32, torch.bfloat16, torch.float32, True),
        (4, 8, 32, torch.float16, torch.float32, False),
        (4, 4, 64, torch.float32, torch.float32, True),
        (3, 6, 80, torch.bfloat16, torch.bfloat16, False),
        (6, 6, 192, torch.float32, torch.float16, True),
        (2, 2, 576, torch.bfloat16, torch.float32, True),
        (1, 3, 48, torch.float16, torch.float16, True),
    ],
    ids=["n2-bf16", "n4-fp16-base2", "n4-fp32", "n3-d80-lse16", "n6-d192", "n2-d576", "n1"],
)
def test_pack_unpack_combine(
    device: torch.device,
    n: int,
    h: int,
    d: int,
    dtype: torch.dtype,
    lse_dtype: torch.dtype,
    base_e: bool,
) -> None:
    b = 5
    outs, lses = _partials(n, b, h, d, seed=n * d, dtype=dtype, lse_dtype=lse_dtype)
    ref_out, ref_lse = lse_combine_ref(outs, lses, is_lse_base_on_e=base_e)
    hr = h // n
    sends = []
    for r in range(n):
        # Padded-head, non-contiguous inputs.
        big = torch.randn(b, h + 2, d, dtype=torch.float64).to(dtype).to(device)
        big[:, 1 : 1 + h] = outs[r].to(device)
        lbig = torch.zeros(b, h + 3, dtype=lse_dtype, device=device)
        lbig[:, 2 : 2 + h] = lses[r].to(device)
        send = a2a_pack(big[:, 1 : 1 + h], lbig[:, 2 : 2 + h], n)
        assert send.shape == (n, b, hr, a2a_record_width(d, dtype))
        # Payload lanes are bit copies.
        bits = _BITS[dtype]
        want = outs[r].view(b, n, hr, d).permute(1, 0, 2, 3).contiguous()
        payload = a2a_buffer_views(send, d)[0]
        assert torch.equal(payload.cpu().view(bits), want.view(bits))
        sends.append(send)
    for dst in range(n):
        out, lse = a2a_unpack_combine(
            _exchange(sends, dst), head_dim=d, return_lse=True, is_lse_base_on_e=base_e
        )
        assert out.dtype == dtype
        assert lse is not None
        assert lse.dtype == torch.float32
        heads = slice(dst * hr, (dst + 1) * hr)
        assert_close_to_ref(
            out, ref_out[:, heads], dtype=coarsest(dtype, lse_dtype), name=f"out rank {dst}"
        )
        assert_close_to_ref(lse, ref_lse[:, heads], dtype=lse_dtype, name=f"lse rank {dst}")
        out2, none = a2a_unpack_combine(_exchange(sends, dst), head_dim=d, is_lse_base_on_e=base_e)
        assert none is None
        assert torch.equal(out2, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lse_lanes_hold_fp32_bits(device: torch.device, dtype: torch.dtype) -> None:
    lse = torch.tensor([[1.5, -math.inf, 3.25e-3, 7.0e4]], device=device)
    out = torch.randn(1, 4, 8, device=device).to(dtype)
    send = a2a_pack(out, lse, 2)
    assert send.shape[-1] == a2a_record_width(8, dtype) == 8 + a2a_pack_dim(dtype)
    lanes = a2a_buffer_views(send, 8)[1].cpu().contiguous()
    if dtype == torch.float32:
        assert torch.equal(lanes.reshape(-1), lse.cpu().reshape(-1))
    else:
        words = lanes.view(torch.int16).to(torch.int32) & 0xFFFF
        fp32 = (words[..., 0] | (words[..., 1] << 16)).view(torch.float32)
        assert torch.equal(fp32.reshape(-1), lse.cpu().reshape(-1))


@pytest.mark.parametrize("shift", [1.0e3, 1.0e4, -1.0e4])
@pytest.mark.parametrize("n", [2, 9], ids=["rows", "tile"])
@pytest.mark.parametrize("base_e", [True, False], ids=["base_e", "base_2"])
def test_unpack_large_close_lses_keep_fp32_accuracy(
    device: torch.device, shift: float, n: int, base_e: bool
) -> None:
    """fp32 records whose LSEs sit around +-1e3..1e4 within a few units of each other: the
    combine keeps fp32 accuracy (weights from the differences, taken before any scaling)."""
    gen = torch.Generator().manual_seed(int(abs(shift)) + n)
    b, hr, d = 5, 2, 24
    outs = torch.randn(n, b, n * hr, d, generator=gen)
    lses = shift + torch.randn(n, b, n * hr, generator=gen) * 2.0
    lses[:, 0, 0] = shift  # equal LSEs: weights exactly 1 / n
    want_out, want_lse = lse_combine_ref(outs, lses, is_lse_base_on_e=base_e)
    sends = [a2a_pack(outs[r].to(device), lses[r].to(device), n) for r in range(n)]
    for dst in range(n):
        got_out, got_lse = a2a_unpack_combine(
            _exchange(sends, dst), head_dim=d, return_lse=True, is_lse_base_on_e=base_e
        )
        heads = slice(dst * hr, (dst + 1) * hr)
        assert got_lse is not None
        assert_close_to_ref(got_out, want_out[:, heads], dtype=torch.float32, name="out")
        assert_close_to_ref(got_lse, want_lse[:, heads], dtype=torch.float32, name="lse")


# (N, H_r) x queries per request x padding x seq_lens: the fused mask is bit-identical to the
# eager mask followed by an unmasked pack. Grid pruned to keep the interpreter run short.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "hr"), [(8, 2), (4, 4), (2, 1)])
@pytest.mark.parametrize(
    ("lens", "qpr", "padding"),
    [
        ([16, 0, 16, 0], 1, 0),
        ([0, 0, 0, 0], 2, 2),
        ([0, 16, 16, 16], 3, 2),
        ([16] * 52, 1, 2),
        ([7], 2, 0),
        ([16, 0, 3, 0, 0] * 60, 1, 1),  # R = 300: binary-search path
    ],
    ids=["alt", "all-empty", "first-empty-mtp3", "many-seqs", "one", "300-seqs"],
)
def test_fused_mask_bit_exact(
    device: torch.device,
    dtype: torch.dtype,
    n: int,
    hr: int,
    lens: list[int],
    qpr: int,
    padding: int,
) -> None:
    d = 32
    r = len(lens)
    b = r * qpr + padding
    h = n * hr
    gen = torch.Generator().manual_seed(r * 31 + qpr)
    out = torch.randn(b, h, d, generator=gen).to(dtype).to(device)
    lse = torch.randn(b, h, generator=gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    qsl = torch.arange(0, (r + 1) * qpr, qpr, dtype=torch.int32, device=device)
    masked = mask_dcp_empty_shards_(lse.clone(), seq_lens, qsl)
    assert torch.equal(masked.cpu(), mask_empty_shards_ref(lse.cpu(), seq_lens.cpu(), qsl.cpu()))
    expected = a2a_pack(out, masked, n)
    actual = a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl)
    assert actual.shape == expected.shape == (n, b, hr, a2a_record_width(d, dtype))
    assert torch.equal(actual.cpu().view(torch.int16), expected.cpu().view(torch.int16))
    # Without a mask every payload lane and every reassembled fp32 LSE is finite (the 16-bit
    # LSE halves themselves may look like inf/NaN and are not numbers).
    payload, lanes = a2a_buffer_views(a2a_pack(out, lse, n).cpu(), d)
    assert torch.isfinite(payload.float()).all()
    words = lanes.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.isfinite((words[..., 0] | (words[..., 1] << 16)).view(torch.float32)).all()


@pytest.mark.parametrize(
    "num_seqs", [255, 256, 300, 4096, 65535, 65536, 70000], ids=lambda r: f"R{r}"
)
def test_fused_mask_lookup_regimes(device: torch.device, num_seqs: int) -> None:
    """Both regimes of the request lookup (direct count R < 256, 16-ary search beyond) up to
    R > 2^16, on a short batch: most requests have no query row, so the rows map to
    requests scattered over the whole range, power-of-two edges included."""
    gen = torch.Generator().manual_seed(num_seqs)
    counts = torch.zeros(num_seqs, dtype=torch.int64)
    picks = torch.randperm(num_seqs, generator=gen)[:24]
    picks = torch.cat([picks, torch.tensor([0, 127, 128, 255, 256, num_seqs - 1])]) % num_seqs
    counts[picks] = torch.randint(1, 3, (picks.numel(),), generator=gen)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    seq_lens = torch.randint(0, 3, (num_seqs,), generator=gen, dtype=torch.int32)
    b = int(qsl[-1]) + 2  # two CUDA-graph padding rows
    n, hr, d = 2, 2, 16
    out = torch.randn(b, n * hr, d, generator=gen).to(torch.bfloat16)
    lse = torch.randn(b, n * hr, generator=gen)
    expected = mask_empty_shards_ref(lse, seq_lens, qsl)
    masked = mask_dcp_empty_shards_(lse.clone().to(device), seq_lens.to(device), qsl.to(device))
    assert torch.equal(masked.cpu(), expected)
    send = a2a_pack(
        out.to(device),
        lse.to(device),
        n,
        seq_lens=seq_lens.to(device),
        query_start_loc=qsl.to(device),
    )
    lse_lanes = a2a_buffer_views(send, d)[1].cpu().contiguous().view(torch.float32)[..., 0]
    assert torch.equal(lse_lanes, expected.view(b, n, hr).transpose(0, 1))


def test_preallocated_send(device: torch.device) -> None:
    out = torch.randn(3, 4, 16, device=device)
    lse = torch.randn(3, 4, device=device)
    send = torch.empty(2, 3, 2, 17, device=device)  # fp32, D = 16: 17 lanes
    assert a2a_pack(out, lse, 2, send=send) is send
    payload, lanes = a2a_buffer_views(send, 16)
    assert torch.equal(payload.cpu(), out.cpu().view(3, 2, 2, 16).transpose(0, 1))
    assert torch.equal(lanes[..., 0].cpu(), lse.cpu().view(3, 2, 2).transpose(0, 1))
    with pytest.raises(ValueError, match=r"send must be a contiguous"):
        a2a_pack(out, lse, 2, send=torch.empty(2, 3, 2, 20, device=device))
    # A 16-bit send view 2 bytes past a 4-byte boundary: the LSE goes out as two 16-bit lanes.
    out16, lse16 = out.bfloat16(), lse * 3.0
    flat = torch.full((2 * 3 * 2 * 18 + 1,), math.nan, dtype=torch.bfloat16, device=device)
    shifted = flat[1:].view(2, 3, 2, 18)
    assert a2a_pack(out16, lse16, 2, send=shifted) is shifted
    want = a2a_pack(out16, lse16, 2)
    assert torch.equal(shifted.cpu().view(torch.int16), want.cpu().view(torch.int16))


def _pack_case(device: torch.device) -> tuple[torch.Tensor, ...]:
    out, lse = _partials(1, 7, 4, 16, seed=41, dtype=torch.bfloat16, lse_dtype=torch.float32)
    seq_lens = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=device)
    return out[0].to(device), lse[0].to(device), seq_lens, qsl


def test_pack_and_unpack_are_registered_ops(device: torch.device) -> None:
    """``a2a_pack`` (also into a given ``send``) and ``a2a_unpack_combine`` go through their
    ``torch.library`` ops under tracing and dispatch modes: they launched their kernels
    directly there, so torch.compile, export, make_fx and FakeTensorMode failed."""
    out, lse, sl, qsl = _pack_case(device)
    send = torch.empty(2, 7, 2, 18, dtype=torch.bfloat16, device=device)
    # opcheck compares without equal_nan: finite fp32 data (bf16 lanes holding LSE bits can
    # read as NaN).
    out32 = torch.randn(7, 4, 16, device=device)
    lse32 = torch.randn(7, 4, device=device)
    torch.library.opcheck(torch.ops.cpattn_dcp.a2a_pack.default, (out32, lse32, 2, sl, qsl))
    torch.library.opcheck(
        torch.ops.cpattn_dcp.a2a_pack_into.default,
        (out32, lse32, 2, sl, qsl, torch.empty(2, 7, 2, 17, device=device)),
    )
    recv32 = a2a_pack(out32, lse32, 2)
    for return_lse in (False, True):
        torch.library.opcheck(
            torch.ops.cpattn_dcp.a2a_unpack_combine.default, (recv32, 16, return_lse, True)
        )
    recv = a2a_pack(out, lse, 2, seq_lens=sl, query_start_loc=qsl)
    assert_dispatches(
        lambda o, s, a, b: a2a_pack(o, s, 2, seq_lens=a, query_start_loc=b),
        (out, lse, sl, qsl),
        "cpattn_dcp.a2a_pack.default",
    )
    assert_dispatches(
        lambda o, s, b: a2a_pack(o, s, 2, send=b),
        (out, lse, send),
        "cpattn_dcp.a2a_pack_into.default",
    )
    assert_dispatches(
        lambda r: a2a_unpack_combine(r, head_dim=16, return_lse=True),
        (recv,),
        "cpattn_dcp.a2a_unpack_combine.default",
    )


def test_pack_and_unpack_compile(device: torch.device) -> None:
    """``torch.compile(fullgraph=True)`` of a pack (into a given ``send`` too) and an
    unpack-combine gives the eager results."""
    out, lse, sl, qsl = _pack_case(device)

    def step(o: torch.Tensor, s: torch.Tensor, send: torch.Tensor) -> Any:
        fresh = a2a_pack(o, s, 2, seq_lens=sl, query_start_loc=qsl)
        a2a_pack(o, s, 2, seq_lens=sl, query_start_loc=qsl, send=send)
        return fresh, send, a2a_unpack_combine(fresh, head_dim=16, return_lse=True)

    def run(fn: Any) -> list[torch.Tensor]:
        send = torch.full((2, 7, 2, 18), math.nan, dtype=torch.bfloat16, device=device)
        fresh, filled, (unpacked, unpacked_lse) = fn(out, lse, send)
        return [fresh, filled, unpacked, unpacked_lse]

    want = run(step)
    torch._dynamo.reset()
    got = run(torch.compile(step, fullgraph=True, backend="eager"))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.int16) if g.dtype == torch.bfloat16 else g,
                           w.view(torch.int16) if w.dtype == torch.bfloat16 else w)  # fmt: skip


def test_pack_and_unpack_have_no_gradient(device: torch.device) -> None:
    """Inputs that require grad go through the registered ops, whose outputs' ``backward``
    raises (no autograd formula). The direct launch returned outputs that silently dropped
    the gradient; a ``send`` that requires grad was overwritten with its ``grad_fn`` kept."""
    out, lse, _, _ = _pack_case(device)
    x = out.float().requires_grad_()
    packed = a2a_pack(x, lse, 2)
    assert packed.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        packed.sum().backward()
    recv = a2a_pack(out.float(), lse, 2).requires_grad_()
    unpacked, _ = a2a_unpack_combine(recv, head_dim=16)
    assert unpacked.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        unpacked.sum().backward()
    send = torch.zeros(2, 7, 2, 17, device=device, requires_grad=True) * 1.0
    with pytest.raises(RuntimeError, match="a2a_pack: send requires grad"):
        a2a_pack(out.float(), lse, 2, send=send)


def test_pack_marks_a_given_send_written(device: torch.device) -> None:
    """The eager pack writes a given ``send`` outside the dispatcher: it bumps its version
    on every call, so a ``backward`` that saved ``send`` before raises."""
    out, lse, _, _ = _pack_case(device)
    send = torch.randn(2, 7, 2, 17, device=device)  # fp32, D = 16: 17 lanes
    weight = torch.ones(send.shape, device=device, requires_grad=True)
    saved = (weight * send).sum()  # saves send for backward
    for _ in range(3):
        before = send._version
        a2a_pack(out.float(), lse, 2, send=send)
        assert send._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_unpack_base_flag_must_be_a_bool(device: torch.device) -> None:
    out, lse, _, _ = _pack_case(device)
    recv = a2a_pack(out, lse, 2)
    with pytest.raises(TypeError, match="is_lse_base_on_e must be a bool, got"):
        a2a_unpack_combine(recv, head_dim=16, is_lse_base_on_e=None)  # type: ignore[arg-type]
    # return_lse was taken by truthiness ("no" returned the LSE); a numpy bool is a bool.
    for flag in (1, "no", None):
        with pytest.raises(TypeError, match="return_lse must be a bool, got"):
            a2a_unpack_combine(recv, head_dim=16, return_lse=flag)  # type: ignore[arg-type]
    assert a2a_unpack_combine(recv, head_dim=16, return_lse=np.bool_(False))[1] is None


def test_pack_int64_indexing(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack kernel's int64 index path (taken when an offset could overflow int32) writes
    the same records as the int32 path: forced here by a tiny int32 bound."""
    gen = torch.Generator().manual_seed(7)
    b, h, d, n = 37, 8, 40, 4
    out = torch.randn(b, h, d, generator=gen).to(torch.bfloat16).to(device)
    lse = torch.randn(b, h, generator=gen).to(device)
    seq_lens = torch.tensor([0, 3, 1, 0, 2], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 5, 9, 20, 30, 35], dtype=torch.int32, device=device)
    want = a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl)
    plan_args = (b, h, n, d, 2, 5, True, out.stride(), lse.stride(), True)
    assert not pack_mod._pack_plan(*plan_args)[2].constexprs["IDX64"]
    pack_mod._pack_plan.cache_clear()
    monkeypatch.setattr(pack_mod, "_INT32_LIMIT", 1)
    try:
        assert pack_mod._pack_plan(*plan_args)[2].constexprs["IDX64"]
        got = a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl)
    finally:
        pack_mod._pack_plan.cache_clear()
    assert torch.equal(got.cpu().view(torch.int16), want.cpu().view(torch.int16))


def test_pack_small_grid_blocks(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode-size grids use the smaller pack blocks (``_PACK_SMALL_BLOCK_V``): same records."""
    gen = torch.Generator().manual_seed(11)
    b, h, d, n = 9, 8, 48, 2
    out = torch.randn(b, h, d, generator=gen).to(torch.float16).to(device)
    lse = torch.randn(b, h, generator=gen).to(device)
    seq_lens = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 3, 4, 8], dtype=torch.int32, device=device)
    want = a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl)
    pack_mod._pack_plan.cache_clear()
    monkeypatch.setattr(pack_mod, "MIN_PROGRAMS", 10**9)
    monkeypatch.setattr(pack_mod, "_PACK_SMALL_BLOCK_V", 16)
    try:
        _, _, spec = pack_mod._pack_plan(b, h, n, d, 2, 3, True, out.stride(), lse.stride(), True)
        assert spec.constexprs["BLOCK_V"] == 16
        got = a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl)
    finally:
        pack_mod._pack_plan.cache_clear()
    assert torch.equal(got.cpu().view(torch.int16), want.cpu().view(torch.int16))


def test_unpack_decode_grids_get_more_warps(monkeypatch: pytest.MonkeyPatch) -> None:
    """One-row programs of a grid below MIN_PROGRAMS get about _UNPACK_SMALL_GRID_LANES
    head-dim lanes per thread (at most 4 warps); larger grids keep the tile rule."""
    import cpattn_dcp.ops._common as common_mod

    # The GPU value (1 in the interpreter), in both modules that read it.
    monkeypatch.setattr(common_mod, "MIN_PROGRAMS", 264)
    monkeypatch.setattr(unpack_mod, "MIN_PROGRAMS", 264)
    common_mod.tile_config.cache_clear()
    unpack_mod._unpack_config.cache_clear()
    try:
        # B=1, H_r=16, D=512: 16 programs of one row; 512 / (32 * 2) = 8 warps, capped at 4.
        assert unpack_mod._unpack_config(8, 16, 512, 2) == (16, 1, 512, 4)
        assert unpack_mod._unpack_config(8, 8, 128, 2) == (8, 1, 128, 2)
        big = unpack_mod._unpack_config(8, 4096 * 8, 128, 2)
        monkeypatch.setattr(unpack_mod, "_UNPACK_SMALL_GRID_LANES", 0)
        unpack_mod._unpack_config.cache_clear()
        assert unpack_mod._unpack_config(8, 4096 * 8, 128, 2) == big
        assert unpack_mod._unpack_config(8, 16, 512, 2) == (16, 1, 512, 1)
    finally:
        common_mod.tile_config.cache_clear()
        unpack_mod._unpack_config.cache_clear()


def test_unpack_large_grids_one_vector_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """At N=8, grids of _UNPACK_ONE_VECTOR_MIN_PROGRAMS programs or more get twice the tile
    rule's warps (one 16-byte vector per thread and source); N=4, decode grids and the knob
    off keep the tile rule."""
    import cpattn_dcp.ops._common as common_mod

    monkeypatch.setattr(common_mod, "MIN_PROGRAMS", 264)  # the GPU value
    monkeypatch.setattr(unpack_mod, "MIN_PROGRAMS", 264)
    common_mod.tile_config.cache_clear()
    unpack_mod._unpack_config.cache_clear()
    try:
        # B=4096, bf16: H=64 D=128 (8 rows of 128 lanes: 2 warps by the tile rule), D=256,
        # H=128 D=512 (2 rows of 512 lanes).
        assert unpack_mod._unpack_config(8, 4096 * 8, 128, 2) == (4096, 8, 128, 4)
        assert unpack_mod._unpack_config(8, 4096 * 8, 256, 2) == (8192, 4, 256, 4)
        assert unpack_mod._unpack_config(8, 4096 * 16, 512, 2) == (32768, 2, 512, 4)
        assert unpack_mod._unpack_config(4, 4096 * 16, 128, 2) == (4096, 16, 128, 4)
        # B=64 H=128 D=512: 512 programs, below the grid floor.
        assert unpack_mod._unpack_config(8, 64 * 16, 512, 2) == (512, 2, 512, 2)
        monkeypatch.setattr(unpack_mod, "_UNPACK_ONE_VECTOR_MIN_N", 0)
        unpack_mod._unpack_config.cache_clear()
        assert unpack_mod._unpack_config(8, 4096 * 8, 128, 2) == (4096, 8, 128, 2)
    finally:
        common_mod.tile_config.cache_clear()
        unpack_mod._unpack_config.cache_clear()


def test_unpack_payload_eviction_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """``evict_first`` payload loads only on grids of _UNPACK_ONE_VECTOR_MIN_PROGRAMS programs
    or more with N >= 4 and D <= 256 (the shapes where it measured faster); N=2, D=512,
    decode grids and the knob off keep Triton's default."""
    import cpattn_dcp.ops._common as common_mod

    monkeypatch.setattr(common_mod, "MIN_PROGRAMS", 264)  # the GPU value
    monkeypatch.setattr(unpack_mod, "MIN_PROGRAMS", 264)

    def evict(n: int, num_rows: int, d: int) -> object:
        common_mod.tile_config.cache_clear()
        unpack_mod._unpack_config.cache_clear()
        unpack_mod._unpack_plan.cache_clear()
        _, spec = unpack_mod._unpack_plan(n, num_rows, d, 2, False, True, False)
        return spec.constexprs["PAY_EVICT"]

    try:
        # B=4096, bf16, H=64 (H_r = 64 / N) and H=128 D=512.
        assert evict(8, 4096 * 8, 128) == "evict_first"
        assert evict(4, 4096 * 16, 128) == "evict_first"
        assert evict(8, 4096 * 8, 256) == "evict_first"
        assert evict(2, 4096 * 32, 128) == ""
        assert evict(8, 4096 * 16, 512) == ""
        # B=64, H=64 D=128 N=8: 64 programs, a decode grid.
        assert evict(8, 64 * 8, 128) == ""
        monkeypatch.setattr(unpack_mod, "_UNPACK_PAY_EVICT", "")
        assert evict(8, 4096 * 8, 128) == ""
    finally:
        common_mod.tile_config.cache_clear()
        unpack_mod._unpack_config.cache_clear()
        unpack_mod._unpack_plan.cache_clear()


@pytest.mark.parametrize(
    ("b", "hr", "d", "dtype"),
    [
        (300, 8, 128, torch.bfloat16),
        (140, 8, 256, torch.float16),
        (40, 16, 512, torch.bfloat16),
        (150, 8, 128, torch.float32),
    ],
    ids=["d128-bf16", "d256-fp16", "d512-bf16", "d128-fp32"],
)
def test_unpack_one_vector_tiles_match(
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    b: int,
    hr: int,
    d: int,
    dtype: torch.dtype,
) -> None:
    """N=8 with one vector per thread (the grid floor lowered so that a small batch takes it;
    on a GPU these batches keep tiles of two or more vectors per thread): the float64
    combine, and bit for bit what the tile rule's warps give. The interpreter ignores warps:
    there a small batch checks the plumbing only."""
    n = 8
    if device.type != "cuda":
        b = 3
    outs, lses = _partials(n, b, hr, d, seed=d + b, dtype=dtype, lse_dtype=torch.float32)
    recv = torch.empty(n, b, hr, a2a_record_width(d, dtype), dtype=dtype, device=device)
    payload, lanes = a2a_buffer_views(recv, d)
    payload.copy_(outs.to(device))
    lanes.copy_(lses.to(device)[..., None].contiguous().view(dtype))
    ref_out, ref_lse = lse_combine_ref(outs, lses)

    def unpack(min_programs: int) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(unpack_mod, "_UNPACK_ONE_VECTOR_MIN_PROGRAMS", min_programs)
        unpack_mod._unpack_config.cache_clear()
        unpack_mod._unpack_plan.cache_clear()
        config = unpack_mod._unpack_config(n, b * hr, d, recv.element_size())
        out, lse = a2a_unpack_combine(recv, head_dim=d, return_lse=True)
        assert lse is not None
        return config, out, lse

    try:
        tile_rule, want, want_lse = unpack(2**62)
        one_vector, got, got_lse = unpack(1)
    finally:
        unpack_mod._unpack_config.cache_clear()
        unpack_mod._unpack_plan.cache_clear()
    if device.type == "cuda":  # the interpreter's MIN_PROGRAMS = 1 gives other tiles
        assert one_vector[3] == 2 * tile_rule[3], (tile_rule, one_vector)
    assert_close_to_ref(got, ref_out, dtype=dtype, name="out")
    assert_close_to_ref(got_lse, ref_lse, dtype=torch.float32, name="lse")
    bits = _BITS[dtype]
    assert torch.equal(got.cpu().view(bits), want.cpu().view(bits))
    assert torch.equal(got_lse.cpu(), want_lse.cpu())


def test_pack_dim() -> None:
    assert a2a_pack_dim(torch.bfloat16) == 2
    assert a2a_pack_dim(torch.float16) == 2
    assert a2a_pack_dim(torch.float32) == 1
    with pytest.raises(ValueError, match=r"Cannot pack fp32 LSE into output dtype torch\.float64"):
        a2a_pack_dim(torch.float64)


def test_record_width() -> None:
    # D + P: D payload lanes and P LSE lanes per row, no padding.
    for dtype in (torch.bfloat16, torch.float16):
        assert [a2a_record_width(d, dtype) for d in (1, 7, 128, 576)] == [3, 9, 130, 578]
    assert [a2a_record_width(d, torch.float32) for d in (1, 3, 128)] == [2, 4, 129]
    with pytest.raises(ValueError, match="head_dim must be >= 1, got 0"):
        a2a_record_width(0, torch.bfloat16)
    with pytest.raises(TypeError, match="head_dim must be an int"):
        a2a_record_width(8.0, torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Cannot pack"):
        a2a_record_width(8, torch.float64)


def test_bad_inputs(device: torch.device) -> None:
    out = torch.randn(3, 6, 16, device=device)
    lse = torch.randn(3, 6, device=device)
    with pytest.raises(ValueError, match="H=6 must be divisible by DCP world size 4"):
        a2a_pack(out, lse, 4)
    with pytest.raises(ValueError, match=r"disagree on \[B, H\]"):
        a2a_pack(out, lse[:2], 2)
    with pytest.raises(ValueError, match=r"expected cp_attn_out \[B, H, D\]"):
        a2a_pack(out[0], lse, 2)
    with pytest.raises(ValueError, match="not supported"):
        a2a_pack(out.double(), lse, 2)
    with pytest.raises(TypeError, match="floating"):
        a2a_pack(out, lse.int(), 2)
    with pytest.raises(ValueError, match="provided together"):
        a2a_pack(out, lse, 2, seq_lens=torch.tensor([1], device=device))
    with pytest.raises(ValueError, match=r"expected recv \[N, B, H_r, 6\]"):
        a2a_unpack_combine(torch.randn(2, 3, 6, device=device).half(), head_dim=4)
    # A record width padded to 16 bytes is rejected, with the numbers.
    with pytest.raises(ValueError, match=r"\[N, B, H_r, 130\] .*head_dim=128.*\(2, 3, 1, 136\)"):
        a2a_unpack_combine(torch.randn(2, 3, 1, 136, device=device).bfloat16(), head_dim=128)
    with pytest.raises(ValueError, match=r"\[N, B, H_r, 17\]"):
        a2a_unpack_combine(torch.randn(2, 3, 1, 20, device=device), head_dim=16)
    with pytest.raises(ValueError, match="contiguous"):
        a2a_unpack_combine(torch.randn(2, 6, 1, 6, device=device).half()[:, ::2], head_dim=4)
    with pytest.raises(TypeError, match="head_dim must be an int"):
        a2a_unpack_combine(torch.randn(2, 3, 1, 6, device=device).half(), head_dim=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expected buf \[N, B, H_r, 6\]"):
        a2a_buffer_views(torch.randn(2, 3, 1, 8, device=device).half(), 4)
    with pytest.raises(ValueError, match="Cannot pack"):
        a2a_unpack_combine(torch.randn(2, 3, 4, 5, device=device).double(), head_dim=3)
    # A non-floating buffer: TypeError, as for every op (it was ValueError "Cannot pack").
    for dtype in (torch.int16, torch.int32, torch.bool):
        with pytest.raises(TypeError, match="recv must be a floating tensor"):
            a2a_unpack_combine(torch.zeros(2, 3, 1, 6, device=device, dtype=dtype), head_dim=4)
        with pytest.raises(TypeError, match="buf must be a floating tensor"):
            a2a_buffer_views(torch.zeros(2, 3, 1, 6, device=device, dtype=dtype), 4)
    # These raised ZeroDivisionError, RuntimeError (negative dimension) or a late TypeError.
    for size, error in ((0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(error, match=re.escape("cp_world_size must be a")):
            a2a_pack(out, lse, size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"recv must hold N >= 1 blocks"):
        a2a_unpack_combine(torch.randn(0, 2, 2, 9, device=device), head_dim=8)


@pytest.mark.parametrize(("b", "h"), [(1, 2), (3, 2), (2, 2), (1, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_receive_half_starts_16_byte_aligned(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, b: int, h: int, dtype: torch.dtype
) -> None:
    """N*B*H_r records of D + P lanes need not end on 16 bytes (bf16 D=512, N=2, B=1, H_r=1:
    2056 bytes): the staging buffer leaves a gap so that the unpack reads an aligned recv."""
    seen: list[int] = []
    real = a2a_mod._unpack_combine

    def spy(recv: torch.Tensor, *args: Any) -> Any:
        seen.append(recv.data_ptr() % 16)
        return real(recv, *args)

    monkeypatch.setattr(a2a_mod, "_unpack_combine", spy)
    world = SimulatedWorld(2, device)
    d = 512 if dtype == torch.bfloat16 else 2
    outs, lses = _partials(2, b, h, d, 5, dtype, torch.float32)
    outs, lses = outs.to(device), lses.to(device)
    got = world.run(
        lambda g: dcp_a2a_lse_reduce(
            outs[g.rank_in_group], lses[g.rank_in_group], g, return_lse=True
        )
    )
    assert seen == [0, 0]
    ref_out, ref_lse = lse_combine_ref(outs, lses)
    for r, (out, lse) in enumerate(got):
        heads = slice(r * h // 2, (r + 1) * h // 2)
        assert_close_to_ref(out, ref_out[:, heads], dtype=dtype)
        assert_close_to_ref(lse, ref_lse[:, heads], dtype=torch.float32)
