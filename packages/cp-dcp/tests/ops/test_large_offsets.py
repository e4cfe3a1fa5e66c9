"""Tensors past 2**31 elements: the combine and mask kernels where int32 offsets would wrap
(GPU only).

Each test builds fresh random inputs whose last rows (or, for the LSEs of a later source, all
rows) sit past element offset 2**31, poisons the outputs, runs the op once and compares every
row with a float64 reference computed in chunks on the device (or bit for bit where the op
copies). The int32 index paths are also forced by a lowered bound in ``test_a2a_kernels.py``;
here the real sizes run. The direct (symmetric-memory) kernels' offsets past 2**31 are checked
in Triton's interpreter instead (``tests/direct/test_direct_gather.py``: such a slot would
take several GB per rank), as is the lean ``correct_attn_out`` kernel's LSE offset
(``test_correct_attn_out.py``). Needs 9-19 GB of free device memory per test; skips otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch

from cpattn_common.alloc import get_output_poison
from cpattn_dcp import (
    a2a_buffer_views,
    a2a_pack,
    a2a_record_width,
    correct_attn_out,
    mask_dcp_empty_shards_,
)
from cpattn_dcp.ops.a2a_combine import a2a_unpack_combine
from cpattn_dcp.ops.correct_attn_out import _contig_plan
from cpattn_testing.cases import random_lses
from cpattn_testing.pytest_plugin import require_device_memory
from cpattn_testing.reference import correct_attn_out_ref, lse_combine_ref
from cpattn_testing.tolerances import ChunkedAgreement, assert_close_by_row_chunks

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

_INT32_SPAN = 2**31
_CHUNK_ROWS = 1 << 13  # float64 temporaries of a chunk stay within about 3 GB


def _rows_past(elements_per_row: int, extra: int = 64) -> int:
    """Smallest batch whose last ``extra`` rows start past element offset 2**31."""
    return _INT32_SPAN // elements_per_row + extra


def test_correct_attn_out_contiguous(device: torch.device) -> None:
    """The lean (contiguous) kernel rescales every row of a 2**31+ element output."""
    n, h, d, rank = 2, 8, 512, 1
    b = _rows_past(h * d)
    require_device_memory(device, 2 * b * h * d * 2 + 4 * 2**30)
    gen = torch.Generator(device).manual_seed(101)
    out = torch.randn(b, h, d, generator=gen, device=device, dtype=torch.bfloat16)
    lses = random_lses((n, b, h), gen)
    orig = out.clone()
    res, lse = correct_attn_out(out, lses, rank)
    assert res.data_ptr() == out.data_ptr()
    assert_close_by_row_chunks(
        [out, lse],
        lambda s, e: correct_attn_out_ref(orig[s:e], lses[:, s:e], rank),
        [ChunkedAgreement(torch.bfloat16, name="out"), ChunkedAgreement(torch.float32, name="lse")],
        chunk_rows=_CHUNK_ROWS,
    )


def _fill_random_lses(lses: torch.Tensor, gen: torch.Generator, chunk: int = 1 << 28) -> None:
    """Fill contiguous ``lses`` with ``random_lses`` values, ``chunk`` elements at a time: its
    float32 temporaries for the whole tensor would take several times the tensor's size."""
    flat = lses.view(-1)
    for s in range(0, flat.numel(), chunk):
        e = min(flat.numel(), s + chunk)
        flat[s:e] = random_lses((e - s,), gen, dtype=lses.dtype)


def test_correct_attn_out_contiguous_lse_offsets(device: torch.device) -> None:
    """The lean kernel's row-vector weights (N <= 8) read every LSE of source 2 past element
    offset 2**31 (N = 3, 2*B*H > 2**31; ``2 * B*H`` was an int32 product and wrapped).

    D = 1 and bf16 LSEs keep it to about 12 GiB: the output and its copy 2 GiB each, the
    LSEs 6 GiB, the global LSE 2 GiB.
    """
    n, h, d, rank = 3, 8, 1, 2
    b = _rows_past(2 * h)  # B*H = 2**30 + 512
    assert (n - 1) * b * h > _INT32_SPAN
    assert _contig_plan(b, h, d, n, 2, True)[1].constexprs["LSE_ROWS"]
    require_device_memory(device, 2 * b * h * (2 * d + n + 1) + 3 * 2**30)
    gen = torch.Generator(device).manual_seed(106)
    out = torch.randn(b, h, d, generator=gen, device=device, dtype=torch.bfloat16)
    lses = torch.empty((n, b, h), device=device, dtype=torch.bfloat16)
    _fill_random_lses(lses, gen)
    orig = out.clone()
    res, lse = correct_attn_out(out, lses, rank)
    assert res.data_ptr() == out.data_ptr()
    assert_close_by_row_chunks(
        [out, lse],
        lambda s, e: correct_attn_out_ref(orig[s:e], lses[:, s:e], rank),
        [
            ChunkedAgreement(torch.bfloat16, name="out"),
            ChunkedAgreement(torch.bfloat16, name="lse"),
        ],
        chunk_rows=1 << 20,  # 8 Mi rows of 3 float64 LSEs per chunk: about 200 MB a temporary
    )


def test_correct_attn_out_strided(device: torch.device) -> None:
    """The general kernel (a head slice of a wider tensor, permuted LSEs) rescales every row
    and leaves the rest of the backing tensor bit-identical."""
    n, h, d, rank = 4, 8, 512, 2
    b = _rows_past((h + 1) * d)
    require_device_memory(device, 2 * b * (h + 1) * d * 2 + 4 * 2**30)
    gen = torch.Generator(device).manual_seed(102)
    backing = torch.randn(b, h + 1, d, generator=gen, device=device, dtype=torch.bfloat16)
    out = backing[:, 1:]
    lses = random_lses((b, h, n), gen).permute(2, 0, 1)  # [N, B, H], not contiguous
    orig = backing.clone()
    correct_attn_out(out, lses, rank)
    assert torch.equal(backing[:, 0], orig[:, 0])
    assert_close_by_row_chunks(
        [out],
        lambda s, e: correct_attn_out_ref(orig[s:e, 1:], lses[:, s:e], rank)[:1],
        [ChunkedAgreement(torch.bfloat16, name="out")],
        chunk_rows=_CHUNK_ROWS,
    )


def _ragged_requests(
    b: int, num_reqs: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seq_lens [R], query_start_loc [R + 1])`` over the first ``b - 100`` rows (the last
    100 are padding), about a quarter of the requests with an empty local shard."""
    cuts = torch.randperm(b - 101, generator=gen, device=device)[: num_reqs - 1] + 1
    qsl = torch.cat(
        [
            torch.zeros(1, device=device, dtype=torch.int64),
            cuts.sort().values,
            torch.full((1,), b - 100, device=device, dtype=torch.int64),
        ]
    ).to(torch.int32)
    seq_lens = torch.randint(1, 1000, (num_reqs,), generator=gen, device=device)
    seq_lens[torch.rand(num_reqs, generator=gen, device=device) < 0.25] = 0
    seq_lens[-1] = 0  # the rows right below the padding are masked too
    return seq_lens.to(torch.int32), qsl


def _empty_rows(b: int, seq_lens: torch.Tensor, qsl: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the rows the empty-shard mask sets to -inf (vectorised reference)."""
    rows = torch.arange(b, device=qsl.device)
    req = torch.searchsorted(qsl[1:].to(torch.int64), rows, right=True)
    padding = rows >= qsl[-1]
    empty = seq_lens[req.clamp(max=seq_lens.numel() - 1)] == 0
    return padding | empty


def test_a2a_pack_with_mask(device: torch.device) -> None:
    """The pack kernel copies every payload lane bit for bit and stores the masked LSE bits
    into a 2**31+ element send buffer (block format)."""
    n, h, d = 2, 8, 512
    rec = a2a_record_width(d, torch.bfloat16)
    b = _rows_past(h * d)
    require_device_memory(device, 2 * b * h * rec * 2 + 2 * 2**30)
    gen = torch.Generator(device).manual_seed(103)
    out = torch.randn(b, h, d, generator=gen, device=device, dtype=torch.bfloat16)
    lse = random_lses((b, h), gen)
    seq_lens, qsl = _ragged_requests(b, 997, gen, device)
    send = torch.full((n, b, h // n, rec), float("nan"), device=device, dtype=torch.bfloat16)
    a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl, send=send)
    empty = _empty_rows(b, seq_lens, qsl)
    want_lse = torch.where(empty[:, None], -math.inf, lse)
    hr = h // n
    payloads, lanes = a2a_buffer_views(send, d)
    for s in range(0, b, _CHUNK_ROWS):
        e = min(b, s + _CHUNK_ROWS)
        for r in range(n):
            payload = out[s:e, r * hr : (r + 1) * hr]
            assert torch.equal(payloads[r, s:e].view(torch.int16), payload.view(torch.int16)), (
                f"payload rows {s}..{e} of rank {r}"
            )
            got_lse = lanes[r, s:e].contiguous().view(torch.float32)[..., 0]
            assert torch.equal(
                got_lse.view(torch.int32),
                want_lse[s:e, r * hr : (r + 1) * hr].contiguous().view(torch.int32),
            ), f"LSE lanes rows {s}..{e} of rank {r}"


def test_a2a_unpack_combine(device: torch.device) -> None:
    """The unpack-combine kernel reads payloads and LSEs past element offset 2**31."""
    n, hr, d = 4, 2, 512
    rec = a2a_record_width(d, torch.bfloat16)
    b = _rows_past(n * hr * rec)
    require_device_memory(device, b * n * hr * rec * 2 + 4 * 2**30)
    gen = torch.Generator(device).manual_seed(104)
    recv = torch.full((n, b, hr, rec), float("nan"), device=device, dtype=torch.bfloat16)
    payloads, lanes = a2a_buffer_views(recv, d)
    payloads.copy_(torch.randn(n, b, hr, d, generator=gen, device=device, dtype=torch.bfloat16))
    lses = random_lses((n, b, hr), gen)
    lanes.copy_(lses.view(torch.bfloat16).view(n, b, hr, 2))
    out, lse = a2a_unpack_combine(recv, head_dim=d, return_lse=True)
    assert lse is not None
    assert_close_by_row_chunks(
        [out, lse],
        lambda s, e: lse_combine_ref(payloads[:, s:e], lses[:, s:e]),
        [ChunkedAgreement(torch.bfloat16, name="out"), ChunkedAgreement(torch.float32, name="lse")],
        chunk_rows=_CHUNK_ROWS,
    )


def test_mask_empty_shards(device: torch.device) -> None:
    """The in-place mask reaches LSE rows past element offset 2**31: masked rows are -inf,
    every other value is untouched."""
    h = 128
    b = _rows_past(h)
    require_device_memory(device, 2 * b * h * 4 + 2**30)
    gen = torch.Generator(device).manual_seed(105)
    lse = torch.randn(b, h, generator=gen, device=device)
    seq_lens, qsl = _ragged_requests(b, 1009, gen, device)
    orig = lse.clone()
    mask_dcp_empty_shards_(lse, seq_lens, qsl)
    empty = _empty_rows(b, seq_lens, qsl)
    assert bool(empty[-1])
    assert bool(empty[-101])
    assert bool((lse[empty] == -math.inf).all())
    assert torch.equal(lse[~empty], orig[~empty])


def test_poison_is_on() -> None:
    """These tests rely on fresh outputs being poisoned (NaN), so a row left unwritten fails."""
    assert get_output_poison() is not None
