"""A2A block layout: the pack paths (unit-stride 16-byte-aligned rows, unaligned rows,
strided head dim, odd D, blocks that are not 16-byte multiples) and the unpack paths
(unrolled N <= 8, tiled N > 8) against an independent reference, bit-exact.

Buffers are ``[N, B, H_r, D + P]``: destination n's block is its ``B * H_r`` payload rows
``[B, H_r, D]``, then their fp32 LSE bits ``[B, H_r, P]`` (built here with plain torch ops,
every lane compared). A shape where a wrong vector width faults with "misaligned address"
(H=64, D=128, N=2, B=4096, bf16) runs at its exact size on the GPU (``@pytest.mark.gpu``).
"""

from __future__ import annotations

import math

import pytest
import torch

from cpattn_dcp.ops.a2a_combine import (
    a2a_buffer_views,
    a2a_pack,
    a2a_pack_dim,
    a2a_record_width,
    a2a_unpack_combine,
)
from cpattn_testing.reference import lse_combine_ref, mask_empty_shards_ref
from cpattn_testing.tolerances import assert_close_to_ref

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _expected_send(
    out: torch.Tensor,
    lse: torch.Tensor,
    n: int,
    seq_lens: torch.Tensor | None = None,
    qsl: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N, B, H_r, D + P]`` built with plain torch ops on the CPU (the block format)."""
    out, lse = out.cpu(), lse.cpu().float()
    if seq_lens is not None and qsl is not None:
        lse = mask_empty_shards_ref(lse, seq_lens.cpu(), qsl.cpu())
    b, h, d = out.shape
    return _blocks(
        out.reshape(b, n, h // n, d).transpose(0, 1),
        lse.reshape(b, n, h // n).transpose(0, 1),
    )


def _blocks(payload: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Block buffer ``[N, B, H_r, D + P]`` of ``payload [N, B, H_r, D]`` (the buffer dtype)
    and the fp32 bits of ``lse [N, B, H_r]``."""
    n, b, hr, d = payload.shape
    lanes = lse.float().contiguous().view(payload.dtype).reshape(n, -1)
    flat = torch.cat([payload.reshape(n, -1), lanes], dim=1)
    return flat.view(n, b, hr, d + a2a_pack_dim(payload.dtype))


def _assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, d: int) -> None:
    """Every lane bit-identical."""
    assert actual.shape == expected.shape
    assert actual.shape[-1] == a2a_record_width(d, expected.dtype)
    bits = _BITS[expected.dtype]
    a = actual.cpu().contiguous().view(bits)
    e = expected.contiguous().view(bits)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} lanes differ, first at {bad[:4].tolist()}"


def _inputs(
    b: int, h: int, d: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(b, h, d, generator=gen).to(dtype)
    lse = torch.randn(b, h, generator=gen) * 4.0
    lse[0, 0] = math.nan
    lse[-1, -1] = math.inf
    return out.to(device), lse.to(device)


# (B, H, D, N, dtype, layout): "contig" (16-byte-aligned unit-stride rows), "strided"
# (padded heads and head dim: row strides not multiples of 16 bytes), "odd" (odd head stride),
# "shifted" (pointer one element past a 16-byte boundary), "dstride" (head dim stride 2:
# the strided fallback).
_CASES = [
    (6, 8, 16, 2, torch.bfloat16, "contig"),  # 24 rows x 18 lanes: 16-byte blocks
    (3, 4, 16, 2, torch.bfloat16, "contig"),  # 6 x 18 lanes = 216 bytes: 8-byte-aligned blocks
    (5, 16, 32, 2, torch.bfloat16, "strided"),
    (3, 8, 16, 4, torch.float16, "contig"),
    (4, 6, 12, 2, torch.bfloat16, "contig"),  # D not a multiple of 8
    (4, 4, 10, 4, torch.float32, "contig"),
    (3, 4, 9, 2, torch.float32, "strided"),
    (3, 2, 7, 2, torch.bfloat16, "contig"),  # rows * D odd: LSE as two 16-bit lanes
    (3, 4, 16, 2, torch.float16, "odd"),
    (3, 4, 24, 2, torch.bfloat16, "shifted"),
    (3, 4, 8, 2, torch.float32, "dstride"),
    (2, 4, 14, 4, torch.float16, "dstride"),
]


@pytest.mark.parametrize(("b", "h", "d", "n", "dtype", "layout"), _CASES)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_pack_layouts_bit_exact(
    device: torch.device,
    b: int,
    h: int,
    d: int,
    n: int,
    dtype: torch.dtype,
    layout: str,
    masked: bool,
) -> None:
    out, lse = _inputs(b, h, d, dtype, device, seed=b * h * d + n)
    if layout == "strided":
        big = torch.zeros(b, h + 2, d + 2, dtype=dtype, device=device)
        big[:, 1 : 1 + h, :d] = out
        out = big[:, 1 : 1 + h, :d]
    elif layout == "odd":
        big = torch.zeros(b, h, d + 1, dtype=dtype, device=device)
        big[..., :d] = out
        out = big[..., :d]
    elif layout == "shifted":
        flat = torch.zeros(out.numel() + 1, dtype=dtype, device=device)
        flat[1:] = out.reshape(-1)
        out = flat[1:].view(b, h, d)
    elif layout == "dstride":
        big = torch.zeros(b, h, 2 * d, dtype=dtype, device=device)
        big[..., ::2] = out
        out = big[..., ::2]
    seq_lens = qsl = None
    if masked:
        seq_lens = torch.tensor([3, 0, 1][: max(1, b - 2)], dtype=torch.int32, device=device)
        r = seq_lens.shape[0]
        qsl = torch.arange(r + 1, dtype=torch.int32, device=device)  # rows >= r: padding
    send = a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl)
    _assert_bits_equal(send, _expected_send(out, lse, n, seq_lens, qsl), d)


@pytest.mark.parametrize(
    ("n", "dtype", "d"),
    [
        (2, torch.bfloat16, 16),
        (8, torch.float16, 8),
        (10, torch.bfloat16, 16),
        (3, torch.float32, 5),
    ],
    ids=["n2", "n8-unrolled", "n10-tiled", "n3-fp32-d5"],
)
def test_unpack_paths(device: torch.device, n: int, dtype: torch.dtype, d: int) -> None:
    b, hr = 3, 2
    gen = torch.Generator().manual_seed(n * 7 + d)
    outs = torch.randn(n, b, hr, d, generator=gen, dtype=torch.float64)
    lses = torch.randn(n, b, hr, generator=gen, dtype=torch.float64) * 3.0
    lses[0, 0, 0] = -math.inf
    lses[:, 1, 1] = -math.inf  # an all-empty row: out 0, lse -inf
    lses[n - 1, 2, 0] = math.nan
    outs[torch.isinf(lses) | torch.isnan(lses)] = math.nan
    # Receive buffer: block n = source n's payloads, then their fp32 LSE bits.
    recv = _blocks(outs.to(dtype), lses).to(device)
    if n == 2:
        # A receive buffer that starts 2 bytes past a 4-byte boundary: the LSE halves must be
        # read as two 16-bit lanes there.
        flat = torch.empty(recv.numel() + 1, dtype=dtype, device=device)
        shifted = flat[1:].view(recv.shape)
        shifted.copy_(recv)
        out_s, lse_s = a2a_unpack_combine(shifted, head_dim=d, return_lse=True)
        out_a, lse_a = a2a_unpack_combine(recv, head_dim=d, return_lse=True)
        assert torch.equal(out_s, out_a)
        assert lse_s is not None
        assert lse_a is not None
        assert torch.equal(lse_s, lse_a)
    out, lse = a2a_unpack_combine(recv, head_dim=d, return_lse=True)
    ref_out, ref_lse = lse_combine_ref(outs.to(dtype).double(), lses.float().double())
    assert lse is not None
    assert_close_to_ref(out, ref_out, dtype=dtype, name="out")
    assert_close_to_ref(lse, ref_lse, dtype=torch.float32, name="lse")
    assert torch.equal(out[1, 1].cpu().float(), torch.zeros(d))


@pytest.mark.gpu
def test_pack_h64_d128_n2_b4096_exact_shape(device: torch.device) -> None:
    """A shape whose 260-byte rows would fault with "misaligned address" under 16-byte
    stores: the block format's alignment hints keep every access valid."""
    b, h, d, n = 4096, 64, 128, 2
    out, lse = _inputs(b, h, d, torch.bfloat16, device, seed=7)
    seq_lens = torch.randint(0, 3, (b,), dtype=torch.int32, device=device)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=device)
    for sl, q in ((None, None), (seq_lens, qsl)):
        send = a2a_pack(out, lse, n, seq_lens=sl, query_start_loc=q)
        torch.cuda.synchronize()
        _assert_bits_equal(send, _expected_send(out, lse, n, sl, q), d)
    # Unpack at the same shape (blocks from two "ranks" = the two halves of this send).
    recv = send.contiguous()
    res, res_lse = a2a_unpack_combine(recv, head_dim=d, return_lse=True)
    torch.cuda.synchronize()
    payload, lanes = a2a_buffer_views(recv, d)
    parts = payload.double().cpu()
    words = lanes.contiguous().view(torch.float32).squeeze(-1).double().cpu()
    ref_out, ref_lse = lse_combine_ref(parts, words)
    assert res_lse is not None
    assert_close_to_ref(res, ref_out, dtype=torch.bfloat16, name="out")
    assert_close_to_ref(res_lse, ref_lse, dtype=torch.float32, name="lse")
